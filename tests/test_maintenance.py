"""The table_maintenance job: real Delta tables, a real in-process Dagster run, real VACUUMs."""

from __future__ import annotations

import os
import time

import pyarrow as pa
import pytest
from dagster import DagsterInstance, DefaultScheduleStatus
from deltalake import DeltaTable, write_deltalake

from pipelines.definitions import ASSET_TABLES, MAINTAINED_TABLES, defs, maintenance_job
from resources.warehouse import WarehouseResource
from txn_engine.buffer.refresh import STATE_TABLES
from txn_engine.producers.engine import ENGINE_TABLES
from txn_engine.core.errors import TableMissingError
from txn_engine.core.settings import WarehouseSettings
from txn_engine.core.schema import BUFFER_DUPLICATES, COMMITTED_ENTRIES, OFFLOADED_ENTRIES, STABLE_POSITIONS, TXN_MARKERS
from txn_engine.storage.upkeep import FILE_RETENTION_PROPERTY


def _rewrite(path: str, times: int, properties: dict | None = None) -> None:
    """A table overwritten `times` times, as the buffer rewrites its small tables every run."""
    for i in range(times):
        write_deltalake(path, pa.table({"run": [i]}), mode="overwrite", configuration=properties if i == 0 else None)


def _on_disk(path: str) -> set[str]:
    return {f for f in os.listdir(path) if f.endswith(".parquet") and not f.startswith(".")}


def _referenced(path: str) -> set[str]:
    return {os.path.basename(uri) for uri in DeltaTable(path).file_uris()}


def test_table_maintenance_vacuums_each_table_with_its_own_retention(warehouse_root):
    short = {FILE_RETENTION_PROPERTY: "interval 1 seconds"}
    settings = WarehouseSettings(warehouse=str(warehouse_root))
    paths = {t: settings.table_path(t) for t in (STABLE_POSITIONS, BUFFER_DUPLICATES, TXN_MARKERS)}
    _rewrite(paths[STABLE_POSITIONS], 4, short)  # an asset's table
    _rewrite(paths[BUFFER_DUPLICATES], 3, short)  # a buffer state table: not an asset, maintained too
    _rewrite(paths[TXN_MARKERS], 3)  # Delta's default retention: 7 days
    time.sleep(1.5)
    assert len(_on_disk(paths[STABLE_POSITIONS])) == 4 and len(_referenced(paths[STABLE_POSITIONS])) == 1

    instance = DagsterInstance.ephemeral()
    result = maintenance_job.execute_in_process(resources={"warehouse": WarehouseResource(root=str(warehouse_root))},
                                                instance=instance)
    assert result.success
    for table, last_run in ((STABLE_POSITIONS, 3), (BUFFER_DUPLICATES, 2)):
        assert _on_disk(paths[table]) == _referenced(paths[table]), table
        assert DeltaTable(paths[table]).to_pyarrow_table().column("run").to_pylist() == [last_run]  # the current version intact
    assert len(_on_disk(paths[TXN_MARKERS])) == 3  # replaced just now by Delta's clock: kept for a week

    observations = [e.event_specific_data.asset_observation for e in result.get_asset_observation_events()]
    observed = {o.asset_key.path[-1]: o.metadata for o in observations}
    assert observed[STABLE_POSITIONS]["files_vacuumed"].value == 3
    assert observed[STABLE_POSITIONS]["file_retention"].value == "interval 1 seconds"
    assert observed[TXN_MARKERS]["files_vacuumed"].value == 0
    assert observed[TXN_MARKERS]["file_retention"].value == "Delta's default (7 days)"
    assert BUFFER_DUPLICATES not in observed  # not an asset: logged, not observed


def test_table_maintenance_is_scheduled_and_covers_every_table():
    schedule = defs.resolve_schedule_def("table_maintenance_schedule")
    assert schedule.job_name == "table_maintenance" and schedule.default_status == DefaultScheduleStatus.RUNNING
    # One list of the tables (schema.py): every asset's table, the buffer's state and the engine's.
    assert set(MAINTAINED_TABLES) == ASSET_TABLES | set(STATE_TABLES) | set(ENGINE_TABLES)
    assert {COMMITTED_ENTRIES, OFFLOADED_ENTRIES} <= set(MAINTAINED_TABLES)


def test_table_maintenance_fails_on_a_warehouse_holding_none_of_the_tables(tmp_path):
    # A mistyped root used to "succeed", vacuuming nothing, every night.
    typo = tmp_path / "no" / "such" / "warehouse"
    with pytest.raises(TableMissingError, match=f"the warehouse root {typo} does not exist: nothing to VACUUM.*root"):
        maintenance_job.execute_in_process(resources={"warehouse": WarehouseResource(root=str(typo))},
                                           instance=DagsterInstance.ephemeral())
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TableMissingError, match=f"the warehouse root {empty} .* holds none of the {len(MAINTAINED_TABLES)} tables"):
        maintenance_job.execute_in_process(resources={"warehouse": WarehouseResource(root=str(empty))},
                                           instance=DagsterInstance.ephemeral())
    assert not typo.exists()  # nothing made under the wrong root
