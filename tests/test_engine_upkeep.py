"""The engine's table upkeep on real Delta tables: bounded history, size-tiered compaction, and
that neither changes a row any reader (the engine's consumer, Spark, time travel) sees."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from datetime import timedelta

import pytest
from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

from txn_engine.engine import Engine
from txn_engine.schema import LEDGER_ENTRIES, TXN_LOG
from txn_engine.table_upkeep import BEFORE_COMPACTION, LOG_RETENTION_PROPERTY, UpkeepPolicy
from txn_engine.txn_errors import InjectedCrash

SMALL = UpkeepPolicy(log_retention=timedelta(seconds=1), compact_every=10, small_file_rows=20, fanout=2, max_file_rows=80)


def _commit(engine: Engine, producer, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        producer.begin()
        producer.send("upkeep-a", f"a{i}".encode())
        producer.send("upkeep-b", f"b{i}".encode())
        producer.commit()


def _log_files(warehouse, table: str) -> int:
    return len(os.listdir(os.path.join(warehouse.path(table), "_delta_log")))


def test_upkeep_bounds_files_and_history_and_changes_no_row(warehouse, spark):
    with Engine(warehouse, upkeep=SMALL) as engine:
        producer = engine.producer("upkeep")
        producer.init_transactions()
        _commit(engine, producer, 60)
        early_version = DeltaTable(warehouse.path(LEDGER_ENTRIES)).version()
        time.sleep(1.5)  # the first commits leave the 1-second history
        _commit(engine, producer, 140, start=60)  # past a checkpoint (every 100 versions): expired logs go
        compactions = list(engine.upkeep.compactions)
        assert engine.upkeep.failures == 0
        read = {t: [e.payload for e in engine.consumer(t).read()] for t in ("upkeep-a", "upkeep-b")}

    assert read == {"upkeep-a": [f"a{i}".encode() for i in range(200)], "upkeep-b": [f"b{i}".encode() for i in range(200)]}
    # Tiers: the 2nd, 4th, ... compaction of a table aims at files twice as big, capped at 80 rows.
    targets = [c.target_rows for c in compactions if c.table == TXN_LOG]
    assert targets[:4] == [20, 40, 20, 80] and max(targets) == 80
    assert all(c.files_removed > c.files_added for c in compactions), [c for c in compactions if c.files_removed <= c.files_added]

    for table in (TXN_LOG, LEDGER_ENTRIES):
        handle = DeltaTable(warehouse.path(table))
        assert handle.metadata().configuration[LOG_RETENTION_PROPERTY] == "interval 1 seconds"
        versions = handle.version() + 1
        assert len(handle.file_uris()) < versions / 4, f"{table}: {len(handle.file_uris())} files for {versions} versions"
        assert _log_files(warehouse, table) < versions - 50, f"{table}: expired commit files were not deleted"
    # Spark reads what delta-rs compacted and cleaned: the same rows, each once.
    frame = spark.read.format("delta").load(warehouse.path(LEDGER_ENTRIES))
    assert frame.count() == frame.select("topic", "ledger_id", "entry_id").distinct().count() == 800  # 400 entries and a marker per topic per transaction
    # The same version, now older than the history: Delta no longer has it.
    with pytest.raises(TableNotFoundError):
        DeltaTable(warehouse.path(LEDGER_ENTRIES), version=early_version)


def test_a_version_within_the_history_reads_as_it_was_after_compactions(warehouse):
    with Engine(warehouse, upkeep=replace(SMALL, log_retention=timedelta(minutes=5))) as engine:
        producer = engine.producer("upkeep")
        producer.init_transactions()
        _commit(engine, producer, 5)
        early_version = DeltaTable(warehouse.path(LEDGER_ENTRIES)).version()
        early = DeltaTable(warehouse.path(LEDGER_ENTRIES)).to_pyarrow_table().sort_by([("topic", "ascending"), ("entry_id", "ascending")])
        _commit(engine, producer, 45, start=5)
        assert engine.upkeep.compactions
    # Compaction removed no file from disk: the old version's files are all still there.
    again = DeltaTable(warehouse.path(LEDGER_ENTRIES), version=early_version).to_pyarrow_table()
    assert again.sort_by([("topic", "ascending"), ("entry_id", "ascending")]).equals(early)


def test_a_backlog_of_small_files_is_compacted_at_start_before_any_write(warehouse):
    with Engine(warehouse, upkeep=replace(SMALL, compact_every=0)) as engine:  # an engine without compaction
        producer = engine.producer("upkeep")
        producer.init_transactions()
        _commit(engine, producer, 30)
    backlog = len(DeltaTable(warehouse.path(LEDGER_ENTRIES)).file_uris())
    assert backlog > SMALL.compact_every
    with Engine(warehouse, upkeep=SMALL) as engine:
        assert {c.table for c in engine.upkeep.compactions} >= {TXN_LOG, LEDGER_ENTRIES}
        assert len(DeltaTable(warehouse.path(LEDGER_ENTRIES)).file_uris()) < backlog / 4
        assert [e.payload for e in engine.consumer("upkeep-b").read()] == [f"b{i}".encode() for i in range(30)]


def test_an_operators_log_retention_is_kept(warehouse):
    with Engine(warehouse, upkeep=SMALL) as engine:
        producer = engine.producer("upkeep")
        producer.init_transactions()
        _commit(engine, producer, 1)
    DeltaTable(warehouse.path(TXN_LOG)).alter.set_table_properties({LOG_RETENTION_PROPERTY: "interval 7 days"})
    with Engine(warehouse, upkeep=SMALL) as engine:
        producer = engine.producer("upkeep")
        producer.init_transactions()
        _commit(engine, producer, 15)
    assert DeltaTable(warehouse.path(TXN_LOG)).metadata().configuration[LOG_RETENTION_PROPERTY] == "interval 7 days"
    assert DeltaTable(warehouse.path(LEDGER_ENTRIES)).metadata().configuration[LOG_RETENTION_PROPERTY] == "interval 1 seconds"


def test_a_failed_compaction_leaves_the_engine_running(warehouse):
    failures = []

    def crash_first_compaction(point: str) -> None:
        if point == BEFORE_COMPACTION and not failures:
            failures.append(point)
            raise InjectedCrash("injected crash before a compaction")

    with Engine(warehouse, upkeep=SMALL, crash_hook=crash_first_compaction) as engine:
        producer = engine.producer("upkeep")
        producer.init_transactions()
        _commit(engine, producer, 40)
        assert engine.upkeep.failures == 1 and engine.writer.stopped is None
        assert engine.upkeep.compactions, "upkeep did not compact again after the failure"
        assert [e.payload for e in engine.consumer("upkeep-a").read()] == [f"a{i}".encode() for i in range(40)]


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"log_retention": timedelta(0)}, "log_retention must be positive"),
        ({"fanout": 1}, "fanout=1 (>= 2)"),
        ({"small_file_rows": 100, "max_file_rows": 10}, "max_file_rows (10) is below small_file_rows (100)"),
    ],
)
def test_upkeep_policy_rejects_bad_settings(settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        UpkeepPolicy(**settings)


def test_target_rows_are_size_tiered():
    policy = UpkeepPolicy(small_file_rows=100, fanout=10, max_file_rows=10_000)
    assert [policy.target_rows(k) for k in (1, 9, 10, 20, 99, 100, 1000, 2000)] == [100, 100, 1000, 1000, 100, 10_000, 10_000, 10_000]
