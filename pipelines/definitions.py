"""The one Definitions object: every asset, check, job, schedule and sensor, and the resources.

Executor: in-process. Every step of a run shares the run's one SparkSession (one JVM per run),
instead of the multiprocess executor's JVM per step, which costs several seconds each and
multiplies memory. A run launched from the UI gets its own process (the default run launcher),
so runs stay isolated from the webserver and from each other. The per-table writer locks keep
each commit of concurrent runs whole, not a run that writes several tables: a transaction-buffer
run (eight tables from one read of its state) holds the warehouse's buffer lock from start to
end, and its assets share the Dagster pool `transaction_buffer` (one run at a time under the
instance config `txnlake` writes), so the daemon queues a second one.
"""

from __future__ import annotations

import warnings

from dagster import (
    AssetKey,
    AssetsDefinition,
    AssetSelection,
    AssetSpec,
    BetaWarning,
    Definitions,
    define_asset_job,
    in_process_executor,
    map_asset_specs,
)

from assets.engine import abort_expired_job, demo_job, txn_timeout_sensor
from assets.ledger import LEDGER_SPECS, ingest_job, ledgers
from assets.offload import (
    OFFLOAD_CHECKS,
    OFFLOAD_SELECTION,
    ledger_retention,
    offload_eligible_ledgers,
    offload_job,
    offload_tier,
    retention_job,
    retention_schedule,
)
from assets.snapshots import GROUP as SNAPSHOT_GROUP
from assets.snapshots import SNAPSHOT_ASSETS, SNAPSHOT_CHECKS, SNAPSHOT_JOBS, SNAPSHOT_SCHEDULES, SNAPSHOT_SENSORS
from assets.sql_models import GROUP as SQL_MODELS_GROUP
from assets.sql_models import sql_model_assets
from assets.transaction_buffer import BUFFER_CHECKS, transaction_buffer_tables
from pipelines.buffer_sensors import ledgers_catalog_job, ledgers_closed_sensor, transaction_buffer_job
from pipelines.maintenance import table_maintenance
from resources.engine import EngineResource
from resources.spark import SparkResource
from resources.warehouse import WarehouseResource
from txn_engine.core.schema import LEDGER_ENTRIES, QUARANTINE_ENTRIES
from txn_engine.sql.models import known_tables



def _with_kinds(spec: AssetSpec) -> AssetSpec:
    """The UI's kind tags: every asset is a Delta table, computed by Spark or by a SQL model on Spark
    (ledger_entries is also appended by the engine, in Python)."""
    if spec.key == AssetKey(LEDGER_ENTRIES):
        return spec.merge_attributes(kinds={"spark", "python", "delta"})
    if spec.group_name == SQL_MODELS_GROUP:
        return spec.merge_attributes(kinds={"sql", "spark", "delta"})
    return spec.merge_attributes(kinds={"spark", "delta"})


ALL_ASSETS = map_asset_specs(_with_kinds, [
    *LEDGER_SPECS,
    ledgers,
    transaction_buffer_tables,
    *sql_model_assets(),
    *SNAPSHOT_ASSETS,
    offload_tier,
    ledger_retention,
])
ALL_CHECKS = [*BUFFER_CHECKS, *SNAPSHOT_CHECKS, *OFFLOAD_CHECKS]

# Everything derived from what the warehouse already holds; ingest and the demo workload add data
# (jobs of their own: `ingest`, `demo`) and are not assets.
# Snapshots have their own loop (take_snapshots: sensor + schedule), as a broker's timer does.
# The offload tier is partitioned by ledger and runs per ledger (offload job, sensor); what reads it
# (tier_sizes) follows an offload, not every `txnlake run`; so does retention (deleted_ledgers).
DERIVED_SELECTION = (
    AssetSelection.all()
    - AssetSelection.assets(LEDGER_ENTRIES, QUARANTINE_ENTRIES)
    - AssetSelection.groups(SNAPSHOT_GROUP)
    - OFFLOAD_SELECTION.downstream()
)

derive_all_job = define_asset_job(
    "derive_all",
    selection=DERIVED_SELECTION,
    description="Recompute every derived table from the current ledger_entries (what `txnlake run` does).",
)
# Every asset is the Delta table of its name.
ASSET_TABLES = {key.path[-1] for asset in ALL_ASSETS for key in (asset.keys if isinstance(asset, AssetsDefinition) else [asset.key])}
# Every table txnlake writes: the assets', the buffer's state tables and the engine's (one list: schema.py).
MAINTAINED_TABLES = list(known_tables())
maintenance_job, maintenance_schedule = table_maintenance(MAINTAINED_TABLES, ASSET_TABLES)

RESOURCES = {"spark": SparkResource(), "warehouse": WarehouseResource(), "engine": EngineResource()}


def ignore_dagsters_own_owners_warning() -> None:
    """Dagster 1.13 passes the beta `owners` parameter itself when it binds the resources to the
    sensors' jobs (`SensorDefinition.with_attributes`), whether a sensor has owners or not (ours
    have none): a BetaWarning on every code load and every run, about nothing we chose."""
    warnings.filterwarnings("ignore", message="Parameter `owners` of initializer `SensorDefinition.__init__`",
                            category=BetaWarning)


ignore_dagsters_own_owners_warning()

defs = Definitions(
    assets=ALL_ASSETS,
    asset_checks=ALL_CHECKS,
    jobs=[derive_all_job, ingest_job, transaction_buffer_job, ledgers_catalog_job, demo_job, abort_expired_job, *SNAPSHOT_JOBS, offload_job, retention_job,
          maintenance_job],
    sensors=[ledgers_closed_sensor, txn_timeout_sensor, *SNAPSHOT_SENSORS, offload_eligible_ledgers],
    schedules=[*SNAPSHOT_SCHEDULES, retention_schedule, maintenance_schedule],
    resources=RESOURCES,
    executor=in_process_executor,
)
