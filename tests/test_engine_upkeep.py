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

from txn_engine.producers.engine import Engine
from txn_engine.core.schema import LEDGER_ENTRIES, TXN_LOG
from txn_engine.storage.upkeep import (
    BEFORE_COMPACTION,
    BEFORE_VACUUM,
    FILE_RETENTION_PROPERTY,
    LOG_RETENTION_PROPERTY,
    UpkeepPolicy,
)
from txn_engine.core.errors import InjectedCrash

SMALL = UpkeepPolicy(log_retention=timedelta(seconds=1), compact_every=10, small_file_rows=20, fanout=2, max_file_rows=80)


def _commit(engine: Engine, producer, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        producer.begin()
        producer.send("upkeep-a", f"a{i}".encode())
        producer.send("upkeep-b", f"b{i}".encode())
        producer.commit()


def _log_files(warehouse, table: str) -> int:
    return len(os.listdir(os.path.join(warehouse.path(table), "_delta_log")))


def _data_files_on_disk(warehouse, table: str) -> set[str]:
    return {f for f in os.listdir(warehouse.path(table)) if f.endswith(".parquet") and not f.startswith(".")}


def _data_files_referenced(warehouse, table: str) -> set[str]:
    return {os.path.basename(uri) for uri in DeltaTable(warehouse.path(table)).file_uris()}


def test_upkeep_bounds_files_and_history_and_changes_no_row(warehouse, spark):
    with Engine(warehouse, upkeep=SMALL) as engine:  # creates the tables
        producer = engine.producer("upkeep")
        producer.init_transactions()
        _commit(engine, producer, 1)
    # Expired commit files go at a checkpoint: one every 20 versions (an operator's setting the
    # engine follows) rather than Delta's 100, so that fewer commits pass several.
    for table in (TXN_LOG, LEDGER_ENTRIES):
        DeltaTable(warehouse.path(table)).alter.set_table_properties({"delta.checkpointInterval": "20"})
    with Engine(warehouse, upkeep=SMALL) as engine:
        producer = engine.producer("upkeep")
        producer.init_transactions()
        _commit(engine, producer, 39, start=1)
        early_version = DeltaTable(warehouse.path(LEDGER_ENTRIES)).version()
        time.sleep(1.5)  # the first commits leave the 1-second history
        _commit(engine, producer, 60, start=40)  # past checkpoints: expired logs go
        compactions = list(engine.upkeep.compactions)
        assert engine.upkeep.failures == 0
        read = {t: [e.payload for e in engine.consumer(t).read()] for t in ("upkeep-a", "upkeep-b")}

    assert read == {"upkeep-a": [f"a{i}".encode() for i in range(100)], "upkeep-b": [f"b{i}".encode() for i in range(100)]}
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
    assert frame.count() == frame.select("topic", "ledger_id", "entry_id").distinct().count() == 400  # 200 entries and a marker per topic per transaction
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
    txn_log = DeltaTable(warehouse.path(TXN_LOG)).metadata().configuration
    assert txn_log[LOG_RETENTION_PROPERTY] == "interval 7 days"
    assert txn_log[FILE_RETENTION_PROPERTY] == "interval 3600 seconds"  # the one it did not set: the engine's
    assert DeltaTable(warehouse.path(LEDGER_ENTRIES)).metadata().configuration[LOG_RETENTION_PROPERTY] == "interval 1 seconds"


def test_replaced_files_are_vacuumed_after_their_retention_and_no_row_changes(warehouse, spark):
    policy = replace(SMALL, log_retention=timedelta(minutes=5), file_retention=timedelta(seconds=1))
    with Engine(warehouse, upkeep=policy) as engine:
        producer = engine.producer("upkeep")
        producer.init_transactions()
        _commit(engine, producer, 30)
        written = _data_files_on_disk(warehouse, LEDGER_ENTRIES)
        time.sleep(1.5)  # the files replaced so far are now older than the retention
        _commit(engine, producer, 30, start=30)
        vacuums = list(engine.upkeep.vacuums)
        assert engine.upkeep.failures == 0
    assert {v.table for v in vacuums if v.files_deleted} >= {TXN_LOG, LEDGER_ENTRIES}, vacuums
    assert not written <= _data_files_on_disk(warehouse, LEDGER_ENTRIES), "no replaced file was deleted"
    for table in (TXN_LOG, LEDGER_ENTRIES):
        assert DeltaTable(warehouse.path(table)).metadata().configuration[FILE_RETENTION_PROPERTY] == "interval 1 seconds"
        assert _data_files_referenced(warehouse, table) <= _data_files_on_disk(warehouse, table)
    time.sleep(1.5)
    with Engine(warehouse, upkeep=policy) as engine:  # its start VACUUMs what the last run left
        for table in (TXN_LOG, LEDGER_ENTRIES):
            assert _data_files_on_disk(warehouse, table) == _data_files_referenced(warehouse, table), table
        read = [e.payload for e in engine.consumer("upkeep-a").read()]
    assert read == [f"a{i}".encode() for i in range(60)]
    frame = spark.read.format("delta").load(warehouse.path(LEDGER_ENTRIES))
    assert frame.count() == frame.select("topic", "ledger_id", "entry_id").distinct().count() == 240


@pytest.mark.parametrize("point", [BEFORE_COMPACTION, BEFORE_VACUUM])
def test_a_failed_upkeep_step_leaves_the_engine_running(warehouse, point):
    failures = []

    def crash_first(at: str) -> None:
        if at == point and not failures:
            failures.append(at)
            raise InjectedCrash(f"injected crash at {at}")

    with Engine(warehouse, upkeep=SMALL, crash_hook=crash_first) as engine:
        producer = engine.producer("upkeep")
        producer.init_transactions()
        _commit(engine, producer, 40)
        assert failures and engine.upkeep.failures == 1 and engine.writer.stopped is None
        done = engine.upkeep.compactions if point == BEFORE_COMPACTION else engine.upkeep.vacuums
        assert done, f"upkeep did not run again after the failure at {point}"
        assert [e.payload for e in engine.consumer("upkeep-a").read()] == [f"a{i}".encode() for i in range(40)]


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"log_retention": timedelta(0)}, "log_retention must be at least one second"),
        ({"file_retention": timedelta(milliseconds=10)}, "file_retention must be at least one second"),
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
