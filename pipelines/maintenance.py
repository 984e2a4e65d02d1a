"""Table maintenance: VACUUM the warehouse's Delta tables, each with its own file retention.

Buffer runs, retention, snapshots and the offload rewrite or delete rows, and a Delta rewrite only
takes the old files out of the current version, so without a VACUUM the disk grows with every run.
This job VACUUMs every table of the Definitions (and the engine's: harmless) with delta-rs,
deleting the files removed longer ago than the table's `delta.deletedFileRetentionDuration`
(Delta's default: 7 days), and records an observation per asset. A warehouse holding none of the
tables fails the run (a mistyped root would otherwise "succeed" every night); one holding only
some of them is normal.

(No `from __future__ import annotations`: Dagster resolves the nested op's annotations at definition.)
"""

from typing import Sequence

from dagster import (
    AssetKey,
    AssetObservation,
    DefaultScheduleStatus,
    JobDefinition,
    OpExecutionContext,
    ScheduleDefinition,
    in_process_executor,
    job,
    op,
)

from resources.warehouse import WarehouseResource
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.core.errors import TableMissingError
from txn_engine.core.settings import WarehouseSettings
from txn_engine.storage.upkeep import FILE_RETENTION_PROPERTY, vacuum_table
from txn_engine.storage.warehouse import Warehouse

DELTA_DEFAULT_FILE_RETENTION = "Delta's default (7 days)"


def table_maintenance(tables: Sequence[str], asset_tables: set[str]) -> tuple[JobDefinition, ScheduleDefinition]:
    """The `table_maintenance` job over `tables` (an observation for those in `asset_tables`), and
    its daily schedule (running by default: it deletes only files no version references)."""

    @op(name="vacuum_tables", description="VACUUM every table, each with its own file retention (delta-rs).")
    def vacuum_tables(context: OpExecutionContext, warehouse: WarehouseResource) -> None:
        settings = warehouse.settings()
        delta = DeltaTables(Warehouse(None, settings))  # delta-rs only: no JVM for this job
        present = [table for table in tables if delta.exists(table)]
        if not present:
            raise no_tables_error(settings, len(tables))
        total = 0
        for table in present:
            done = vacuum_table(delta, table)
            retention = delta.properties(table).get(FILE_RETENTION_PROPERTY, DELTA_DEFAULT_FILE_RETENTION)
            total += done.files_deleted
            context.log.info(f"{table}: VACUUM deleted {done.files_deleted} file(s) in {done.seconds:.2f} s (retention {retention})")
            if table in asset_tables:
                context.log_event(AssetObservation(asset_key=AssetKey(table), metadata={
                    "files_vacuumed": done.files_deleted, "vacuum_seconds": round(done.seconds, 3), "file_retention": retention,
                }))
        context.log.info(f"table maintenance: {total} file(s) deleted from disk")

    @job(name="table_maintenance", executor_def=in_process_executor,
         description="VACUUM the warehouse's Delta tables: the files rewrites and deletes replaced, once older "
         "than each table's delta.deletedFileRetentionDuration (Delta's default 7 days).")
    def maintenance_job() -> None:
        vacuum_tables()

    schedule = ScheduleDefinition(
        name="table_maintenance_schedule", job=maintenance_job, cron_schedule="30 4 * * *",
        default_status=DefaultScheduleStatus.RUNNING,
        description="Daily at 04:30 (after retention at 03:00): VACUUM every table.",
    )
    return maintenance_job, schedule


def no_tables_error(settings: WarehouseSettings, maintained: int) -> TableMissingError:
    """The error for a warehouse holding none of the maintained tables: most likely a mistyped root."""
    root = settings.root
    if settings.root_missing():
        where = f"the warehouse root {root} does not exist"
    else:
        where = (f"the warehouse root {root} (offload tier {settings.cold_root()}) holds none of the {maintained} "
                 "tables table maintenance VACUUMs")
    return TableMissingError(
        f"{where}: nothing to VACUUM. Check that the "
        "warehouse resource's root (resources.warehouse.config.root, default TXNLAKE_WAREHOUSE) is the one the "
        "other jobs write; on a new warehouse, ingest ledgers first (`txnlake ingest FILE`)."
    )
