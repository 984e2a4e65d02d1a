"""Ledger partitions as ledgers close: the sensor that adds their keys and asks for the buffer run.

A ledger becomes a partition of the transaction-buffer assets when the `ledgers` catalog says it
is closed (CLOSED or OFFLOADED: recorded in `ledger_states`, or no longer its topic's last
ledger). The sensor adds the keys of the newly closed ledgers and requests ONE run over their
range; that run also picks up the OPEN ledgers' new entries (see `txn_engine.buffer_incremental`).

A closed ledger that is a partition already (`txnlake run` adds a log's first ledgers while they
are all OPEN) but that the buffer state describes with other counts than the catalog (it grew
before it closed) gets a run over its own key too. The cursor holds the counts each such ledger
had when its run was requested, so a tick during that run does not request it again.
"""

from __future__ import annotations

import hashlib
import json

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
from txn_engine.buffer_incremental import LEDGER_COUNT_COLUMNS, closed_ledger_ids, state_is_current, state_ledger_counts
from txn_engine.delta_io import DeltaTables
from txn_engine.positions import ledger_partition_key
from txn_engine.schema import BUFFER_LEDGER_TXNS, BUFFER_LEDGER_TXNS_SCHEMA, LEDGERS, LEDGERS_SCHEMA
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


def closed_ledgers_behind_the_state(wh: Warehouse) -> dict[str, list[int]]:
    """Closed ledgers of the catalog whose (entry_count, last_entry_id) the buffer state does not
    hold (not computed yet, or computed while they were OPEN and shorter), keyed "topic/ledger_id"."""
    if not wh.exists(LEDGERS):
        return {}
    tables = DeltaTables(wh)
    catalog = tables.read(LEDGERS, LEDGERS_SCHEMA, LEDGER_COUNT_COLUMNS + ["state"]).to_pylist()
    state = state_ledger_counts(tables.read(BUFFER_LEDGER_TXNS, BUFFER_LEDGER_TXNS_SCHEMA, LEDGER_COUNT_COLUMNS)) if (
        state_is_current(wh)) else {}
    return {f"{r['topic']}/{r['ledger_id']}": [r["entry_count"], r["last_entry_id"]] for r in catalog
            if r["state"] in ("CLOSED", "OFFLOADED") and r["entry_count"] > 0
            and state.get((r["topic"], r["ledger_id"])) != (r["entry_count"], r["last_entry_id"])}


def changed_partition_keys(behind: dict[str, list[int]], requested: dict[str, list[int]], known: list[str]) -> list[str]:
    """Keys, in partition order, of the partitions among `behind` whose run was not requested at
    these very counts (`requested`: the sensor's cursor)."""
    changed = {ledger_partition_key(int(name.rsplit("/", 1)[1])) for name, counts in behind.items()
               if requested.get(name) != counts}
    return [k for k in known if k in changed]


@sensor(job=transaction_buffer_job, minimum_interval_seconds=60,
        description="Adds the partition keys of newly closed ledgers and runs the transaction buffer over them "
                    "(and over a ledger that was a partition while OPEN, once it has closed).")
def ledgers_closed_sensor(context: SensorEvaluationContext, spark: SparkResource, warehouse: WarehouseResource):
    # The catalog and the state are read by delta-rs: a tick starts no JVM in the sensor's process.
    wh = warehouse.open(spark.session)
    new = new_closed_ledger_keys(wh, context.instance)
    behind = closed_ledgers_behind_the_state(wh)
    requested = json.loads(context.cursor) if context.cursor else {}
    changed = changed_partition_keys(behind, requested, context.instance.get_dynamic_partitions(LEDGER_PARTITIONS.name))
    # Every ledger behind the state is now requested (or is being computed): the cursor says at which counts.
    context.update_cursor(json.dumps(behind, sort_keys=True))
    if not new and not changed:
        return SkipReason("no newly closed ledger in the `ledgers` catalog")
    runs = []
    if new:
        runs.append(RunRequest(run_key=f"ledgers-{new[0]}-{new[-1]}", tags=range_tags(new[0], new[-1])))
    if changed:
        # These keys were added together (a log's first ledgers), so their range holds only them.
        counts = json.dumps({name: behind[name] for name in sorted(behind)
                             if ledger_partition_key(int(name.rsplit("/", 1)[1])) in changed})
        digest = hashlib.sha1(counts.encode()).hexdigest()[:12]
        runs.append(RunRequest(run_key=f"grown-{changed[0]}-{changed[-1]}-{digest}", tags=range_tags(changed[0], changed[-1])))
    return SensorResult(run_requests=runs, dynamic_partitions_requests=[LEDGER_PARTITIONS.build_add_request(new)] if new else [])
