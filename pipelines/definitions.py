"""The one Definitions object: the domains' Definitions merged, plus the jobs over all of them,
the resources and the executor.

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

from assets import engine, ledger, offload, snapshots, sql_models, transaction_buffer
from assets.metadata import COLUMN_SCHEMA, column_schema
from assets.offload import OFFLOAD_SELECTION
from pipelines.maintenance import table_maintenance
from resources.engine import EngineResource
from resources.spark import SparkResource
from resources.warehouse import WarehouseResource
from txn_engine.core.schema import LEDGER_ENTRIES, QUARANTINE_ENTRIES
from txn_engine.sql.models import known_tables, views



def _with_kinds(spec: AssetSpec) -> AssetSpec:
    """The UI's kind tags: every asset is a Delta table, computed by Spark or by a SQL model on Spark
    (ledger_entries is also appended by the engine, in Python); and its columns, described
    (`schema.TABLES`), before any materialization reports them."""
    columns = column_schema(spec.key.path[-1])
    if columns is not None:
        spec = spec.merge_attributes(metadata={COLUMN_SCHEMA: columns})
    if spec.key == AssetKey(LEDGER_ENTRIES):
        return spec.merge_attributes(kinds={"spark", "python", "delta"})
    if spec.group_name == sql_models.GROUP:
        return spec.merge_attributes(kinds={"sql", "spark"} if spec.key.path[-1] in views() else {"sql", "spark", "delta"})
    return spec.merge_attributes(kinds={"spark", "delta"})


def _domain_parts() -> tuple[list, ...]:
    """Each domain owns its assets, checks, jobs, partitions, sensors and schedules: theirs merged.
    In a function: Dagster refuses a module with two Definitions objects at its top level."""
    merged = Definitions.merge(ledger.defs, transaction_buffer.defs, sql_models.defs, snapshots.defs, offload.defs, engine.defs)
    return tuple(list(getattr(merged, kind) or ()) for kind in ("assets", "asset_checks", "jobs", "sensors", "schedules"))


_DOMAIN_ASSETS, ALL_CHECKS, DOMAIN_JOBS, DOMAIN_SENSORS, DOMAIN_SCHEDULES = _domain_parts()
ALL_ASSETS = map_asset_specs(_with_kinds, _DOMAIN_ASSETS)

# Everything derived from what the warehouse already holds; ingest and the demo workload add data
# (jobs of their own: `ingest`, `demo`) and are not assets.
# Snapshots have their own loop (take_snapshots: sensor + schedule), as a broker's timer does.
# The offload tier is partitioned by ledger and runs per ledger (offload job, sensor); what reads it
# (tier_sizes) follows an offload, not every `txnlake run`; so does retention (deleted_ledgers).
DERIVED_SELECTION = (
    AssetSelection.all()
    - AssetSelection.assets(LEDGER_ENTRIES, QUARANTINE_ENTRIES, *views())  # written by ops; views store nothing
    - AssetSelection.groups(snapshots.GROUP)
    - OFFLOAD_SELECTION.downstream()
)

derive_all_job = define_asset_job(
    "derive_all",
    selection=DERIVED_SELECTION,
    description="Recompute every derived table from the current ledger_entries (what `txnlake run` does).",
)


def derive_all_pending(wh, instance) -> list[str]:
    """Why `derive_all` has work to do, empty when every table it writes is current: the catalog is
    fresh, the buffer state holds every ledger at the catalog's counts (and Dagster every closed
    ledger's partition), and each other table exists, materialized after what it reads."""
    from assets.transaction_buffer.sensors import closed_ledgers_of, open_ledgers_behind
    from txn_engine.log.ledgers import stale_catalog

    stale = stale_catalog(wh)
    if stale is not None:
        return [stale]
    closed = closed_ledgers_of(wh, instance)
    behind = [*closed.to_run, *open_ledgers_behind(wh)]
    reasons = [f"{len(behind)} ledger(s) the transaction buffer has not computed at their current length: "
               + ", ".join(behind[:5]) + (", ..." if len(behind) > 5 else "")] if behind else []
    graph = defs.resolve_asset_graph()
    selected = DERIVED_SELECTION.resolve(graph)
    latest = {key: instance.get_latest_materialization_event(key) for key in selected}
    for key in sorted(selected):
        if not wh.exists(key.path[-1]):
            reasons.append(f"table {key.path[-1]} does not exist")
        elif latest[key] is None:
            reasons.append(f"{key.to_user_string()} was never materialized in this Dagster instance")
        else:
            newer = [p.to_user_string() for p in graph.get(key).parent_keys
                     if p in selected and latest[p] is not None and latest[p].timestamp > latest[key].timestamp]
            if newer:
                reasons.append(f"{key.to_user_string()} is older than {', '.join(newer)}")
    return reasons


# Every asset is the Delta table of its name (but the views, which store nothing).
ASSET_TABLES = {key.path[-1] for asset in ALL_ASSETS for key in (asset.keys if isinstance(asset, AssetsDefinition) else [asset.key])} - set(views())
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
    jobs=[derive_all_job, *DOMAIN_JOBS, maintenance_job],
    sensors=DOMAIN_SENSORS,
    schedules=[*DOMAIN_SCHEDULES, maintenance_schedule],
    resources=RESOURCES,
    executor=in_process_executor,
)
