"""The one Definitions object: every asset, check, job, schedule and sensor, and the resources.

Executor: in-process. Every step of a run shares the run's one SparkSession (one JVM per run),
instead of the multiprocess executor's JVM per step, which costs several seconds each and
multiplies memory. A run launched from the UI gets its own process (the default run launcher),
so runs stay isolated from the webserver and from each other; concurrent runs writing one table
are serialized by the per-table writer locks.
"""

from __future__ import annotations

from dagster import AssetSelection, Definitions, define_asset_job, in_process_executor

from assets.ledger import ingest_ledger_entries, ledgers
from assets.offload import OFFLOAD_CHECKS, OFFLOAD_SELECTION, offload_eligible_ledgers, offload_job, offload_tier
from assets.sql_models import sql_model_assets
from assets.transaction_buffer import BUFFER_CHECKS, transaction_buffer_tables
from resources.spark import SparkResource
from resources.warehouse import WarehouseResource
from txn_engine.schema import LEDGER_ENTRIES, QUARANTINE_ENTRIES

ALL_ASSETS = [ingest_ledger_entries, ledgers, transaction_buffer_tables, *sql_model_assets(), offload_tier]
ALL_CHECKS = [*BUFFER_CHECKS, *OFFLOAD_CHECKS]

# Everything derived from what the warehouse already holds; ingest adds data and is not in it.
DERIVED_SELECTION = AssetSelection.all() - AssetSelection.assets(LEDGER_ENTRIES, QUARANTINE_ENTRIES)
# The offload tier is partitioned by ledger and runs per ledger (offload job, sensor); what reads it
# (tier_sizes) follows an offload, not every `txnlake run`.
DERIVED_SELECTION = DERIVED_SELECTION - OFFLOAD_SELECTION.downstream()

derive_all_job = define_asset_job(
    "derive_all",
    selection=DERIVED_SELECTION,
    description="Recompute every derived table from the current ledger_entries (what `txnlake run` does).",
)
ingest_job = define_asset_job(
    "ingest",
    selection=AssetSelection.assets(LEDGER_ENTRIES, QUARANTINE_ENTRIES),
    description="Ingest raw ledger files: set ops.ingest_ledger_entries.config.paths.",
)

RESOURCES = {"spark": SparkResource(), "warehouse": WarehouseResource()}

defs = Definitions(
    assets=ALL_ASSETS,
    asset_checks=ALL_CHECKS,
    jobs=[derive_all_job, ingest_job, offload_job],
    sensors=[offload_eligible_ledgers],
    resources=RESOURCES,
    executor=in_process_executor,
)
