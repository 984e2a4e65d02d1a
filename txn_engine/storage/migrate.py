"""`txnlake migrate`: bring a warehouse written by an older txnlake to the current table contract.

What changed since, and how each step is made so a crash anywhere loses nothing and a rerun
finishes (every step is found from what the warehouse holds, never from a record of progress):

- **Places** (docs/tables.md): internal state moved under `<warehouse>/_internal/`, the offload
  manifest from the tier's root to the warehouse root. A local table moves by one rename of its
  folder (atomic). Elsewhere (S3) it is copied in one Delta commit marked with where it came from,
  then the old copy is deleted, its log first; a rerun that finds both deletes the old copy only
  when the new one carries that mark, and refuses otherwise (something wrote the new place first).
  The offload manifest is always copied: its `checksum` becomes hex on the way, so the form of a
  checksum follows from where the row is.
- **Columns**: the lossless entry columns are added in Delta's log alone (empty for the rows
  stored); `txn_id` is added to the public tables that hold the two halves (and to the elements of
  a snapshot's `aborts`), and the halves to `oldest_ongoing_txn`, by one overwrite commit of the
  table (a crash leaves the old version whole).
- **Descriptions**: each column's comment, in metadata commits; the old default lock folder
  (`_locks`) is removed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import deltalake
import pyarrow as pa
import pyarrow.fs as pafs
from deltalake import CommitProperties, write_deltalake
from pyspark.sql import functions as F

from txn_engine.core.errors import WarehouseMigrationError
from txn_engine.core.schema import (
    ADDED_COLUMNS,
    ENTRY_TABLES,
    LEDGER_ENTRIES_SCHEMA,
    LEDGER_ENTRY_COLUMNS,
    LOSSLESS_COLUMNS,
    OFFLOAD_MANIFEST,
    TABLES,
    TXN_HALVES,
    TXN_ID,
    column_paths,
    stored_schema,
)
from txn_engine.core.settings import WarehouseSettings, is_local_uri
from txn_engine.storage.delta_io import stored_arrow
from txn_engine.storage.s3 import arrow_filesystem
from txn_engine.storage.warehouse import Warehouse, delta_rs_schema

log = logging.getLogger(__name__)

# The commit metadata key of a table copied to its new place: the place it was copied from.
MIGRATED_FROM = "txnlake.migrated_from"


def _is_table(settings: WarehouseSettings, location: str) -> bool:
    return deltalake.DeltaTable.is_deltatable(location, storage_options=settings.storage_options(location))


def moves_pending(settings: WarehouseSettings) -> list[tuple[str, str, str]]:
    """(table, former location, location) of each table an older txnlake left where it no longer lives."""
    pending = []
    for table in TABLES:
        former = settings.former_table_path(table)
        if former is not None and _is_table(settings, former):
            pending.append((table, former, settings.table_path(table)))
    return pending


def require_current_layout(settings: WarehouseSettings) -> None:
    """Refuse a warehouse with tables where an older txnlake kept them (one line, naming the command):
    a run would start new tables at the new places beside them."""
    pending = moves_pending(settings)
    if pending:
        table, former, _ = pending[0]
        more = f" and {len(pending) - 1} more" if len(pending) > 1 else ""
        raise WarehouseMigrationError(
            f"the warehouse {settings.warehouse} has the layout of an older txnlake ({table} at {former}{more}): "
            "run `txnlake migrate` once; it moves internal state under _internal/ and loses nothing")


def migrate_warehouse(warehouse: Warehouse, report: Callable[[str], None] = print) -> dict[str, list[str]]:
    """Every step the warehouse still needs; {table: what was done}. Idempotent and crash-safe."""
    done: dict[str, list[str]] = {}
    settings = warehouse.settings
    for table, former, location in moves_pending(settings):
        _move(warehouse, table, former, location)
        done.setdefault(table, []).append(f"moved from {former} to {location}")
        report(f"  {table}: moved to {location}")
    for table in TABLES:
        location = warehouse.path(table)
        if not _is_table(settings, location):
            continue
        for step in _add_columns(warehouse, table, location) + _describe(warehouse, table, location):
            done.setdefault(table, []).append(step)
            report(f"  {table}: {step}")
    former_locks = settings.former_lock_root()
    if former_locks is not None and _remove(settings, former_locks):
        done.setdefault("_locks", []).append("removed")
        report(f"  {former_locks}: removed (locks are under {settings.lock_root()})")
    return done


def _move(warehouse: Warehouse, table: str, former: str, location: str) -> None:
    settings = warehouse.settings
    if _is_table(settings, location):
        first = deltalake.DeltaTable(location, version=0, storage_options=settings.storage_options(location)).history(1)
        if not first or first[-1].get(MIGRATED_FROM) != former:
            raise WarehouseMigrationError(
                f"{table} exists both at {former} (an older txnlake's place) and at {location}, which this migration "
                f"did not write: keep the one you need (move the other away), then run `txnlake migrate` again")
        _remove(settings, former)  # the copy was committed before a crash: finish
        return
    transform = _TRANSFORMS.get(table)
    if transform is None and is_local_uri(former) and is_local_uri(location):
        target = Path(_local(location))
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():  # files of a copy that never committed
            _remove(settings, location)
        Path(_local(former)).rename(target)
        return
    source = deltalake.DeltaTable(former, storage_options=settings.storage_options(former)).to_pyarrow_dataset()
    # Streamed batch by batch, but for a transform's table (the manifest: a row per ledger).
    rows = transform(source.to_table()) if transform else pa.RecordBatchReader.from_batches(source.schema, source.to_batches())
    configuration = dict(deltalake.DeltaTable(former, storage_options=settings.storage_options(former)).metadata().configuration)
    with warehouse.writer(table):
        write_deltalake(location, rows, mode="overwrite", schema_mode="overwrite", configuration=configuration or None,
                        commit_properties=CommitProperties(custom_metadata={MIGRATED_FROM: former}),
                        storage_options=settings.storage_options(location))
    _remove(settings, former)


def checksum_to_hex(manifest: pa.Table) -> pa.Table:
    """An older manifest's checksum (the exact sum of the rows' hashes, in decimal) as the current
    one: modulo 2^64, 16 hex digits (`tier.offload.checksum_of`)."""
    hexed = pa.array([None if c is None else f"{int(c) % 2**64:016x}" for c in manifest["checksum"].to_pylist()],
                     pa.string())
    return stored_arrow(OFFLOAD_MANIFEST, manifest.set_column(manifest.schema.get_field_index("checksum"),
                                                             "checksum", hexed))


_TRANSFORMS: dict[str, Callable[[pa.Table], pa.Table]] = {OFFLOAD_MANIFEST: checksum_to_hex}


def _add_columns(warehouse: Warehouse, table: str, location: str) -> list[str]:
    steps = []
    present = column_paths(delta_rs_schema(warehouse.delta_rs_table(location)))
    if all(c in present for c in ADDED_COLUMNS.get(table, ())):
        return steps  # current: no Spark needed
    spark = warehouse.spark
    with warehouse.writer(table):
        lossless = [f for f in LEDGER_ENTRIES_SCHEMA.fields
                    if table in ENTRY_TABLES and f.name in LOSSLESS_COLUMNS and f.name not in present]
        # Each where the contract has it (after the column before it in ledger_entries), so a
        # migrated table reads and writes column for column like a new one.
        for field in lossless:
            before = LEDGER_ENTRY_COLUMNS[LEDGER_ENTRY_COLUMNS.index(field.name) - 1]
            spark.sql(f"ALTER TABLE delta.`{location}` ADD COLUMNS (`{field.name}` {field.dataType.simpleString()} "
                      f"AFTER `{before}`)")
        if lossless:
            steps.append(f"added {', '.join(f.name for f in lossless)}")
    rewritten = [c for c in ADDED_COLUMNS.get(table, ()) if c not in LOSSLESS_COLUMNS and c not in present]
    if rewritten:
        frame = spark.read.format("delta").load(location)
        if TXN_ID in frame.columns:  # oldest_ongoing_txn had the string only: its halves from it
            halves = F.split(F.col(TXN_ID), ":")
            frame = frame.withColumns({half: halves.getItem(i).cast("bigint") for i, half in enumerate(TXN_HALVES)})
        # One overwrite commit (`Warehouse.overwrite` adds txn_id and the descriptions): all or nothing.
        warehouse.overwrite(table, frame)
        steps.append(f"added {', '.join(rewritten)}")
    return steps


def _describe(warehouse: Warehouse, table: str, location: str) -> list[str]:
    """Set each column's description (Delta's column comment) where the table lacks it."""
    wanted = {f.name: f.metadata["comment"] for f in stored_schema(table).fields if "comment" in f.metadata}
    with warehouse.writer(table):
        handle = warehouse.delta_rs_table(location)
        stale = [(f.name, dict(f.metadata)) for f in handle.schema().fields
                 if f.name in wanted and f.metadata.get("comment") != wanted[f.name]]
        for name, metadata in stale:
            handle.alter.set_column_metadata(name, {**{k: str(v) for k, v in metadata.items()}, "comment": wanted[name]})
    return [f"described {len(stale)} column(s)"] if stale else []


def _remove(settings: WarehouseSettings, location: str) -> bool:
    """Delete a folder (or an S3 prefix): a table's log first, so a crash halfway leaves no table
    there, only files a rerun deletes. False when there was nothing."""
    fs, path = arrow_filesystem(settings, location)
    if fs.get_file_info(path).type == pafs.FileType.NotFound:
        return False
    log_dir = f"{path}/_delta_log"
    if fs.get_file_info(log_dir).type != pafs.FileType.NotFound:
        fs.delete_dir(log_dir)
    fs.delete_dir(path)
    return True


def _local(uri: str) -> str:
    return uri.removeprefix("file://").removeprefix("file:")

