"""Ledger partitions as ledgers close: the sensor that adds their keys and asks for the buffer run.

A ledger becomes a partition of the transaction-buffer assets when the `ledgers` catalog says it
is closed. The sensor adds the keys of newly closed ledgers and requests ONE run over their range
(which also picks up the OPEN ledgers' new entries). It asks again, after a backoff (1, 2, 4 ...
minutes, at most an hour), for a closed ledger the buffer state does not describe at the catalog's
counts or whose partition's last run failed; its cursor and the runs' tag (`REQUEST_TAG`) tell a
request queued or running from one that failed. It decides from the catalog, so first it keeps
that fresh: a stale catalog (`txn_engine.log.ledgers.stale_catalog`) gets a run of
`ledgers_catalog` and nothing else, one at a time, with the same backoff. The cases:
docs/transaction-buffer.md, "Incremental: partitions by ledger".
"""

from __future__ import annotations

import json
import time
from typing import NamedTuple

import pyarrow.compute as pc

from dagster import (
    AssetKey,
    AssetPartitionStatus,
    AssetSelection,
    DagsterInstance,
    DagsterRunStatus,
    RunRequest,
    RunsFilter,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    define_asset_job,
    sensor,
)

from assets.ledger import ledgers_catalog_job
from assets.partitions import LEDGER_PARTITIONS, ledger_keys, legacy_partitions_message, partition_spans, range_tags, retry_after_s
from assets.transaction_buffer.tables import DESCRIPTIONS
from resources.spark import SparkResource
from resources.warehouse import WarehouseResource
from txn_engine.buffer.refresh import (
    LEDGER_COUNT_COLUMNS,
    closed_ledger_counts,
    closed_ledgers,
    ledgers_behind,
    listed_ledgers,
    read_catalog,
    stored_ledger_counts,
)
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.log.ledgers import stale_catalog
from txn_engine.core.positions import ledger_partition_key
from txn_engine.core.schema import LEDGER_ENTRIES, LEDGERS
from txn_engine.storage.warehouse import Warehouse

BUFFER_SELECTION = AssetSelection.assets(*DESCRIPTIONS)
CATALOG_TAG = "txnlake/catalog_for"  # on the catalog runs the sensor requests: what they were asked for
REQUEST_TAG = "txnlake/buffer_request"  # on the runs the sensor requests: which request, which attempt
FINISHED = {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}

transaction_buffer_job = define_asset_job(
    "transaction_buffer",
    selection=BUFFER_SELECTION,  # partitioned by ledger, as its assets are
    description="Recompute the transaction buffer tables for a ledger range (and the ledgers that changed).",
)


class ClosedLedgers(NamedTuple):
    new_keys: list[str]  # partition keys of closed ledgers that are not partitions yet, by topic and ledger
    # partition key ("topic/ledger_id") -> [entry_count, last_entry_id] of the closed ledgers that need a buffer run:
    # new ones, those the state does not hold at the catalog's counts, and partitions whose last run
    # failed (or never ran): their tables may be right, but Dagster's partition status is not.
    to_run: dict[str, list[int]]


def closed_ledgers_of(wh: Warehouse, instance: DagsterInstance) -> ClosedLedgers:
    """The `ledgers` catalog's closed ledgers, read once: which are new partitions, and which need a run."""
    if not wh.exists(LEDGERS):
        return ClosedLedgers([], {})
    catalog = read_catalog(wh, LEDGER_COUNT_COLUMNS + ["state"])
    partitions = set(instance.get_dynamic_partitions(LEDGER_PARTITIONS.name))
    rows = closed_ledgers(catalog)
    closed_keys = ledger_keys(zip(rows["topic"].to_pylist(), rows["ledger_id"].to_pylist()))
    new = [k for k in closed_keys if k not in partitions]
    closed = closed_ledger_counts(catalog)
    state = stored_ledger_counts(wh)
    unrecorded = set(new) | unmaterialized_partitions(instance, [k for k in closed_keys if k in partitions])
    to_run = {**ledgers_behind(closed, state),
              **{key: counts for key, counts in closed.items() if ledger_partition_key(*key) in unrecorded}}
    return ClosedLedgers(new, {ledger_partition_key(*key): list(counts) for key, counts in sorted(to_run.items())})


def buffer_range_to_run(wh: Warehouse, instance: DagsterInstance) -> tuple[str, str]:
    """The ledger partition range of a buffer run that brings the buffer up to the catalog: over the
    closed ledgers it has not computed (in partition order), else the last partition's (an OPEN
    ledger grew: every buffer run recomputes what changed, whatever its range). Needs a partition."""
    keys = instance.get_dynamic_partitions(LEDGER_PARTITIONS.name)
    todo = set(closed_ledgers_of(wh, instance).to_run) & set(keys)
    [span] = partition_spans(keys, todo or {keys[-1]}, contiguous=False)
    return span


def open_ledgers_behind(wh: Warehouse) -> list[str]:
    """"topic/ledger_id" of the OPEN ledgers whose catalog counts the buffer state does not hold (the
    closed ones are `closed_ledgers_of`'s): every buffer run recomputes them, whatever its range."""
    if not wh.exists(LEDGERS):
        return []
    catalog = read_catalog(wh, LEDGER_COUNT_COLUMNS + ["state"])
    rows = listed_ledgers(catalog.filter(pc.equal(catalog["state"], "OPEN"))).select(LEDGER_COUNT_COLUMNS).to_pylist()
    counts = {(r["topic"], r["ledger_id"]): (r["entry_count"], r["last_entry_id"]) for r in rows}
    return ledger_keys(ledgers_behind(counts, stored_ledger_counts(wh)))


def unmaterialized_partitions(instance: DagsterInstance, keys: list[str]) -> set[str]:
    """Of these ledger partitions, those some buffer asset has neither materialized nor is materializing."""
    if not keys:
        return set()
    done = {AssetPartitionStatus.MATERIALIZED, AssetPartitionStatus.IN_PROGRESS}
    missing: set[str] = set()
    for table in DESCRIPTIONS:
        status = instance.get_status_by_partition(AssetKey(table), keys, LEDGER_PARTITIONS) or {}
        missing |= {k for k in keys if status.get(k) not in done}
    return missing


def _requested_runs_state(instance: DagsterInstance, request: str) -> str:
    """"running", "succeeded" or "failed" (failed, canceled, or never launched) for the runs tagged `request`."""
    runs = instance.get_runs(filters=RunsFilter(tags={REQUEST_TAG: request}))
    if any(r.status not in FINISHED for r in runs):
        return "running"
    if runs and all(r.status == DagsterRunStatus.SUCCESS for r in runs):
        return "succeeded"
    return "failed"


def catalog_request(instance: DagsterInstance, wh: Warehouse, stale: str, now: float) -> RunRequest | SkipReason:
    """A run of `ledgers_catalog` for a stale catalog (`stale`: why), unless one is queued or running,
    or the last one asked for the same ledger_entries version failed less than its backoff ago."""
    # Its own runs, and any other that materializes the catalog (derive_all, a UI materialization).
    unfinished = [r.dagster_run for r in instance.get_run_records(
                      RunsFilter(statuses=[s for s in DagsterRunStatus if s not in FINISHED]), limit=200)
                  if r.dagster_run.job_name == ledgers_catalog_job.name
                  or AssetKey(LEDGERS) in (r.dagster_run.asset_selection or ())]
    if unfinished:
        return SkipReason(f"the `ledgers` catalog is stale ({stale}); run {unfinished[0].run_id}, which materializes "
                          "it, is queued or running")
    entries = DeltaTables(wh).last_commit(LEDGER_ENTRIES) or {}
    asked_for = str(entries.get("version"))
    earlier = instance.get_run_records(filters=RunsFilter(job_name=ledgers_catalog_job.name, tags={CATALOG_TAG: asked_for}))
    if earlier:  # latest first; all finished. A successful one that left the catalog stale counts as failed.
        last_end = earlier[0].end_time or earlier[0].update_timestamp.timestamp()
        if now < last_end + retry_after_s(len(earlier) - 1):
            return SkipReason(f"the `ledgers` catalog is stale ({stale}); its last run {earlier[0].dagster_run.run_id} "
                              f"ended {earlier[0].dagster_run.status.value}: asking again after a backoff")
    return RunRequest(job_name=ledgers_catalog_job.name, run_key=f"catalog-{asked_for}-{int(now * 1000)}",
                      tags={CATALOG_TAG: asked_for})


@sensor(jobs=[transaction_buffer_job, ledgers_catalog_job], minimum_interval_seconds=60,
        description="Materializes the `ledgers` catalog when it is stale (after an ingest, an offload or a retention "
                    "run); adds the partition keys of newly closed ledgers and runs the transaction buffer over them "
                    "(and over a ledger that was a partition while OPEN, once it has closed); retries a failed run.")
def ledgers_closed_sensor(context: SensorEvaluationContext, spark: SparkResource, warehouse: WarehouseResource):
    # The catalog and the state are read by delta-rs: a tick starts no JVM in the sensor's process.
    wh = warehouse.open(spark.session)
    instance = context.instance
    legacy = legacy_partitions_message(instance)
    if legacy:
        return SkipReason(legacy)
    if not wh.exists(LEDGER_ENTRIES):
        return SkipReason("no ledger_entries yet: ingest a ledger file first (`txnlake ingest FILE`, or the `ingest` job)")
    stale = stale_catalog(wh)
    if stale is not None:
        # Nothing is decided from a stale catalog: it would miss the new ledgers, and still list
        # the ledgers a retention run deleted. The cursor is kept for the tick after the refresh.
        return catalog_request(instance, wh, stale, time.time())
    new, to_run = closed_ledgers_of(wh, instance)
    # The cursor: per closed ledger that needs a run, the counts, request and attempt of its last run request.
    requested: dict[str, dict] = json.loads(context.cursor) if context.cursor else {}
    now = time.time()
    states: dict[str, str] = {}  # request tag -> state of its runs, looked up once
    due: dict[str, int] = {}  # name -> attempt of the request to make now
    waiting = []
    for name, counts in to_run.items():
        last = requested.get(name)
        if last is None or last["counts"] != counts:
            due[name] = 0
            continue
        state = states.setdefault(last["request"], _requested_runs_state(instance, last["request"]))
        if state == "failed":
            if now >= last["at"] + retry_after_s(last["attempt"]):
                due[name] = last["attempt"] + 1
            else:
                waiting.append(name)
        # "running": its run will write it; "succeeded": computed, but the catalog counts differ
        # (ledger_entries grew since the catalog was materialized): the next catalog refresh tells.
        # Either way nothing is asked again until the counts change or a run fails.
    request = f"{int(now * 1000)}"
    cursor = {name: requested[name] for name in to_run if name in requested and name not in due}
    cursor.update({name: {"counts": to_run[name], "request": request, "attempt": attempt, "at": now}
                   for name, attempt in due.items()})
    context.update_cursor(json.dumps(cursor, sort_keys=True) if cursor else None)
    new_set = set(new)
    known = set(due) - new_set
    known_keys = [k for k in instance.get_dynamic_partitions(LEDGER_PARTITIONS.name) if k in known]
    if not new and not known_keys:
        if waiting:
            return SkipReason(f"the buffer run for {len(waiting)} closed ledger(s) failed; asking again after a backoff")
        return SkipReason("no newly closed ledger in the `ledgers` catalog (fresh), and the buffer state holds "
                          "(or a requested run is computing) every closed one")
    tags = {REQUEST_TAG: request}
    runs = []
    if new:
        runs.append(RunRequest(job_name=transaction_buffer_job.name, run_key=f"ledgers-{new[0]}-{new[-1]}-{request}", tags={**tags, **range_tags(new[0], new[-1])}))
    if known_keys:
        # Partitions already: a log's first ledgers (added together while OPEN) or retried ones.
        runs.append(RunRequest(job_name=transaction_buffer_job.name, run_key=f"behind-{known_keys[0]}-{known_keys[-1]}-{request}",
                               tags={**tags, **range_tags(known_keys[0], known_keys[-1])}))
    return SensorResult(run_requests=runs, dynamic_partitions_requests=[LEDGER_PARTITIONS.build_add_request(new)] if new else [])
