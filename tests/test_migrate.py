"""`txnlake migrate`: a warehouse written before the lossless columns is refused with a message
naming the command, which adds them without changing a stored row."""

from __future__ import annotations

import os

import pytest
from pyspark.sql import functions as F

from tests.rows import entry, write_jsonl
from txn_engine.core.errors import WarehouseMigrationError
from txn_engine.core.schema import LEDGER_ENTRIES, LEDGER_ENTRY_COLUMNS, LOSSLESS_COLUMNS, stored_schema
from txn_engine.log.ingest import ingest_files
from txn_engine.storage.delta_io import DeltaTables


def test_an_old_warehouse_is_refused_then_migrated(warehouse, tmp_path, capsys):
    from pipelines.cli import main

    ingest_files(warehouse, [str(write_jsonl(tmp_path / "a.jsonl", [entry("t", 1, 0, key="k"), entry("t", 1, 1)]))])
    stored = sorted(tuple(r) for r in warehouse.read(LEDGER_ENTRIES).select(*LEDGER_ENTRY_COLUMNS).collect())
    # What an older txnlake wrote: the table without the columns added since.
    old = [c for c in LEDGER_ENTRY_COLUMNS if c not in LOSSLESS_COLUMNS]
    frame = warehouse.read(LEDGER_ENTRIES).select(*old).localCheckpoint()
    frame.write.format("delta").mode("overwrite").option("overwriteSchema", "true").save(warehouse.path(LEDGER_ENTRIES))
    with pytest.raises(WarehouseMigrationError, match=r"ledger_entries at .* has no column\(s\) key_bytes, headers, "
                       r"timestamp_type, txn_id.*Run `txnlake migrate` once"):
        warehouse.read(LEDGER_ENTRIES)
    with pytest.raises(WarehouseMigrationError, match="txnlake migrate"):
        DeltaTables(warehouse).read(LEDGER_ENTRIES, frame.schema)
    assert main(["migrate"]) == 0
    assert "ledger_entries: added key_bytes, headers, timestamp_type" in capsys.readouterr().out
    migrated = warehouse.read(LEDGER_ENTRIES)
    assert migrated.columns == stored_schema(LEDGER_ENTRIES).fieldNames()
    assert sorted(tuple(r) for r in migrated.select(*LEDGER_ENTRY_COLUMNS).collect()) == stored
    assert main(["migrate"]) == 0
    assert "already current" in capsys.readouterr().out


def _current_warehouse(warehouse, folder):
    """A warehouse as `make run` leaves it, small: ledgers ingested, the buffer run (its internal
    state too), ledgers offloaded (manifest, tier, recorded states), a SQL model with a txn_id."""
    from tests.offload_history import COMMIT_D, HISTORY
    from txn_engine.buffer.refresh import ledger_inventory, refresh_buffer
    from txn_engine.log.ledgers import write_ledger_catalog
    from txn_engine.sql.models import load_model, run_model, sql_dir
    from txn_engine.storage.delta_io import overwrite_small
    from txn_engine.tier.offload import offload_ledgers

    ingest_files(warehouse, [str(write_jsonl(folder / "h.jsonl", HISTORY + COMMIT_D + [entry("z", 9, 0, txn=(3, 7))]))])
    write_ledger_catalog(warehouse)
    refresh_buffer(warehouse, ledger_inventory(warehouse), full=True)
    offload_ledgers(warehouse)
    overwrite_small(warehouse, "oldest_ongoing_txn", run_model(warehouse, load_model(sql_dir() / "oldest_ongoing_txn.sql")))


def _rows(warehouse, table):
    from deltalake import DeltaTable

    data = DeltaTable(warehouse.path(table)).to_pyarrow_table()
    columns = sorted(data.column_names)
    return sorted(repr(tuple(r[c] for c in columns)) for r in data.to_pylist())


def _make_old(warehouse, spark):
    """Rewrite a current warehouse into the layout an older txnlake wrote: every table under the root
    (the manifest under the tier), no txn_id, the manifest's checksum as an exact signed decimal,
    oldest_ongoing_txn with the string id only, no column comments, locks in `_locks`."""
    import shutil

    from deltalake import DeltaTable

    from txn_engine.core.schema import OFFLOAD_MANIFEST, TABLES

    settings = warehouse.settings
    for table in TABLES:
        location = warehouse.path(table)
        if not warehouse.exists(table, location):
            continue
        frame = spark.read.format("delta").load(location)
        plain = frame.select(*[F.col(f"`{c}`").alias(c, metadata={}) for c in frame.columns
                               if c != "txn_id" or table == "oldest_ongoing_txn"])
        if table == "oldest_ongoing_txn":
            plain = plain.drop("txn_most_bits", "txn_least_bits")
        if table == OFFLOAD_MANIFEST:  # the hex's signed value: a sum that fits 64 bits, as the old form wrote it
            signed = F.conv(F.col("checksum"), 16, 10).cast("decimal(20,0)")
            half, whole = (F.lit(str(n)).cast("decimal(20,0)") for n in (2**63, 2**64))
            plain = plain.withColumn("checksum", F.when(signed >= half, signed - whole).otherwise(signed)
                                     .cast("decimal(20,0)").cast("string"))
        plain = plain.localCheckpoint()
        plain.write.format("delta").mode("overwrite").option("overwriteSchema", "true").save(location)
        assert all("comment" not in f.metadata for f in DeltaTable(location).schema().fields), table
        former = settings.former_table_path(table)
        if former is not None:
            shutil.move(location, former)
    os.makedirs(settings.former_lock_root(), exist_ok=True)
    shutil.rmtree(settings.lock_root(), ignore_errors=True)


def test_an_old_layout_is_refused_then_moved_keeping_every_row_through_crashes(warehouse, tmp_path, capsys, monkeypatch):
    from deltalake import DeltaTable

    from pipelines.cli import main
    from txn_engine.core.schema import INTERNAL_FOLDER, OFFLOAD_MANIFEST, TABLES, TXN_ID
    from txn_engine.storage import migrate
    from txn_engine.storage.migrate import migrate_warehouse, require_current_layout
    from txn_engine.storage.warehouse import Warehouse

    _current_warehouse(warehouse, tmp_path)
    settings = warehouse.settings
    present = [t for t in TABLES if warehouse.exists(t)]
    moved = [t for t in present if settings.former_table_path(t)]
    assert {"buffer_ledger_txns", "ledger_states", OFFLOAD_MANIFEST, "offloaded_entries", "oldest_ongoing_txn"} <= set(present)
    assert OFFLOAD_MANIFEST in moved and "buffer_ledger_txns" in moved and "ledger_entries" not in moved
    before = {t: _rows(warehouse, t) for t in present}
    checksums = sorted(r["checksum"] for r in DeltaTable(warehouse.path(OFFLOAD_MANIFEST)).to_pyarrow_table().to_pylist())
    assert all(len(c) == 16 and int(c, 16) >= 0 for c in checksums)

    _make_old(warehouse, warehouse.spark)
    assert set(os.listdir(settings.warehouse)) >= {"buffer_ledger_txns", "ledger_states", "_locks"}
    # Refused before anything runs, in one line naming the command.
    with pytest.raises(WarehouseMigrationError, match=r"layout of an older txnlake .* run `txnlake migrate` once"):
        require_current_layout(settings)
    assert main(["sql", "dbt-free-sql/abort_rates.sql"]) == 2
    refused = capsys.readouterr().err.strip()
    assert "\n" not in refused and "txnlake migrate" in refused

    # A crash after the manifest's copy committed, before its old copy is deleted.
    real_remove = migrate._remove

    def crash_once(*args):
        monkeypatch.setattr(migrate, "_remove", real_remove)
        raise RuntimeError("injected crash")

    monkeypatch.setattr(migrate, "_remove", crash_once)
    with pytest.raises(RuntimeError, match="injected crash"):
        migrate_warehouse(warehouse, report=lambda line: None)
    assert warehouse.exists(OFFLOAD_MANIFEST) and DeltaTable(settings.former_table_path(OFFLOAD_MANIFEST)).version() >= 0
    # A crash in the middle of the columns: the first overwrite that adds txn_id fails.
    real_overwrite = Warehouse.overwrite

    def crash_on_overwrite(self, table, *args, **kwargs):
        monkeypatch.setattr(Warehouse, "overwrite", real_overwrite)
        raise RuntimeError("injected crash")

    monkeypatch.setattr(Warehouse, "overwrite", crash_on_overwrite)
    with pytest.raises(RuntimeError, match="injected crash"):
        migrate_warehouse(warehouse, report=lambda line: None)
    # The rerun finishes.
    assert main(["migrate"]) == 0
    assert "warehouse migrated" in capsys.readouterr().out
    require_current_layout(settings)

    for table in present:
        former = settings.former_table_path(table)
        assert former is None or not os.path.exists(former), table
        assert _rows(warehouse, table) == before[table], table  # every row, every value
        stored = DeltaTable(warehouse.path(table))
        fields = stored.schema().fields
        assert all(f.metadata.get("comment") == TABLES[table].description(f.name) for f in fields), table
        if TXN_ID in TABLES[table].schema.fieldNames():
            data = stored.to_pyarrow_table().to_pylist()
            assert [f.name for f in fields] == TABLES[table].schema.fieldNames(), table
            assert all(r[TXN_ID] == (None if r["txn_most_bits"] is None else f"{r['txn_most_bits']}:{r['txn_least_bits']}")
                       for r in data), table
    assert settings.table_path("buffer_ledger_txns").endswith(f"{INTERNAL_FOLDER}/buffer_ledger_txns")
    assert sorted(r["checksum"] for r in DeltaTable(warehouse.path(OFFLOAD_MANIFEST)).to_pyarrow_table().to_pylist()) == checksums
    assert not os.path.exists(settings.former_lock_root())
    assert main(["migrate"]) == 0
    assert "already current" in capsys.readouterr().out


def test_snapshot_aborts_carry_a_readable_txn_id_and_older_logs_are_migrated(warehouse, capsys):
    """Each abort in `txn_snapshot_segments` and `recovered_buffer_state` has its `txn_id`, written by
    Spark and by Arrow; a log written without it is refused before any write, then migrated."""
    from deltalake import DeltaTable

    from pipelines.cli import main
    from tests.test_snapshot_jobs import aborted_history, assert_all_recover, snapshot, store_log
    from txn_engine.core.schema import ABORT_STRUCT, RECOVERED_BUFFER_STATE, TXN_SNAPSHOT_SEGMENTS, TXN_SNAPSHOT_SEGMENTS_SCHEMA
    from txn_engine.storage.warehouse import elements_as
    from txn_engine.snapshots.jobs import recover_from_warehouse
    from txn_engine.snapshots.format import SnapshotConfig

    entries = aborted_history("a", 3) + aborted_history("b", 2, first_ledger=200)
    store_log(warehouse, entries)
    snapshot(warehouse, entries, ["a", "b"])
    assert_all_recover(warehouse, entries)  # recovered_buffer_state written by the driver's Arrow path

    def aborts(table):
        return [a for r in DeltaTable(warehouse.path(table)).to_pyarrow_table().to_pylist() for a in r["aborts"] or []]

    def assert_readable(table):
        stored = aborts(table)
        assert len(stored) == 5, table
        assert all(list(a) == ["txn_most_bits", "txn_least_bits", "txn_id", "ledger_id", "entry_id"] for a in stored)
        assert all(a["txn_id"] == f"{a['txn_most_bits']}:{a['txn_least_bits']}" for a in stored), table
        return sorted(tuple(a.values()) for a in stored)

    segments = assert_readable(TXN_SNAPSHOT_SEGMENTS)
    recovered = assert_readable(RECOVERED_BUFFER_STATE)
    warehouse.overwrite(RECOVERED_BUFFER_STATE, recover_from_warehouse(warehouse))  # Spark's writer
    assert assert_readable(RECOVERED_BUFFER_STATE) == recovered

    # What an older txnlake wrote: each abort without its txn_id.
    for table in (TXN_SNAPSHOT_SEGMENTS, RECOVERED_BUFFER_STATE):
        frame = warehouse.spark.read.format("delta").load(warehouse.path(table))
        old = frame.withColumn("aborts", elements_as("aborts", ABORT_STRUCT)).localCheckpoint()
        old.write.format("delta").mode("overwrite").option("overwriteSchema", "true").save(warehouse.path(table))
    with pytest.raises(WarehouseMigrationError, match=r"txn_snapshot_segments at .* has no column\(s\) aborts.txn_id: "
                       r".*Run `txnlake migrate` once"):
        DeltaTables(warehouse).read(TXN_SNAPSHOT_SEGMENTS, TXN_SNAPSHOT_SEGMENTS_SCHEMA)
    version = DeltaTable(warehouse.path(TXN_SNAPSHOT_SEGMENTS)).version()
    with pytest.raises(WarehouseMigrationError, match="aborts.txn_id"):
        snapshot(warehouse, entries, ["a"], SnapshotConfig())
    assert DeltaTable(warehouse.path(TXN_SNAPSHOT_SEGMENTS)).version() == version  # refused before any write

    assert main(["migrate"]) == 0
    out = capsys.readouterr().out
    assert "txn_snapshot_segments: added aborts.txn_id" in out and "recovered_buffer_state: added aborts.txn_id" in out
    assert assert_readable(TXN_SNAPSHOT_SEGMENTS) == segments
    assert assert_readable(RECOVERED_BUFFER_STATE) == recovered
    assert_all_recover(warehouse, entries)
