"""Ledger partitions as ledgers close: the sensor that adds their keys and asks for the buffer run.

A ledger becomes a partition of the transaction-buffer assets when the `ledgers` catalog says it
is closed (CLOSED or OFFLOADED: recorded in `ledger_states`, or no longer its topic's last
ledger). The sensor adds the keys of the newly closed ledgers and requests ONE run over their
range; that run also picks up the OPEN ledgers' new entries (see `txn_engine.buffer_incremental`).
"""

from __future__ import annotations

from dagster import (
    AssetSelection,
    DagsterInstance,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    define_asset_job,
    sensor,
)
# Private, but dagster 1.13 has no public name for the range tags, nor a public RunRequest
# argument for a partition range (RunRequest.partition_key_range reads these very tags).
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from assets.transaction_buffer import DESCRIPTIONS
from pipelines.partitions import LEDGER_PARTITIONS
from resources.spark import SparkResource
from resources.warehouse import WarehouseResource
from txn_engine.buffer_incremental import closed_ledger_ids
from txn_engine.delta_io import DeltaTables
from txn_engine.positions import ledger_partition_key
from txn_engine.schema import LEDGERS, LEDGERS_SCHEMA
from txn_engine.warehouse import Warehouse

BUFFER_SELECTION = AssetSelection.assets(*DESCRIPTIONS)

transaction_buffer_job = define_asset_job(
    "transaction_buffer",
    selection=BUFFER_SELECTION,  # partitioned by ledger, as its assets are
    description="Recompute the transaction buffer tables for a ledger range (and the ledgers that changed).",
)


def range_tags(first_key: str, last_key: str) -> dict[str, str]:
    """Run tags that make one run cover a partition range."""
    return {ASSET_PARTITION_RANGE_START_TAG: first_key, ASSET_PARTITION_RANGE_END_TAG: last_key}


def new_closed_ledger_keys(wh: Warehouse, instance: DagsterInstance) -> list[str]:
    """Keys of closed ledgers of the catalog that are not partitions yet, in ledger order."""
    if not wh.exists(LEDGERS):
        return []
    known = set(instance.get_dynamic_partitions(LEDGER_PARTITIONS.name))
    catalog = DeltaTables(wh).read(LEDGERS, LEDGERS_SCHEMA, ["ledger_id", "state"])
    return [k for k in map(ledger_partition_key, closed_ledger_ids(catalog)) if k not in known]


@sensor(job=transaction_buffer_job, minimum_interval_seconds=60,
        description="Adds the partition keys of newly closed ledgers and runs the transaction buffer over them.")
def ledgers_closed_sensor(context: SensorEvaluationContext, spark: SparkResource, warehouse: WarehouseResource):
    # The catalog is read by delta-rs: a tick starts no JVM in the sensor's process.
    wh = warehouse.open(spark.session)
    new = new_closed_ledger_keys(wh, context.instance)
    if not new:
        return SkipReason("no newly closed ledger in the `ledgers` catalog")
    return SensorResult(
        run_requests=[RunRequest(run_key=f"ledgers-{new[0]}-{new[-1]}", tags=range_tags(new[0], new[-1]))],
        dynamic_partitions_requests=[LEDGER_PARTITIONS.build_add_request(new)],
    )
