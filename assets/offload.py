"""The filtered offload tier in Dagster: a per-ledger partitioned asset, its sensor, its checks,
and retention (`deleted_ledgers`: its own job and a daily schedule, never part of `txnlake run`).

`offloaded_entries` and `offload_manifest` are one multi-asset partitioned by ledger
(`LEDGER_PARTITIONS`). A run over one ledger or a backfill over a ledger range (one run, its
`context.partition_keys`) offloads the eligible ones among them; a ledger that is not eligible
yet (OPEN, or beyond its topic's stable position) is reported under `waiting` (metadata and
log), left alone, and not recorded as materialized, so a later backfill of missing partitions
picks it up. A run whose ledgers all wait fails, saying why each waits and what to do.
Re-running a partition is harmless: an offloaded ledger is not copied again (it is recorded
as materialized again).
"""

import json
import time
from datetime import timedelta

from dagster import (
    Definitions,
    AssetCheckResult,
    Config,
    DefaultScheduleStatus,
    AssetCheckSeverity,
    AssetExecutionContext,
    AssetKey,
    AssetMaterialization,
    AssetObservation,
    AssetSelection,
    AssetSpec,
    BackfillPolicy,
    DagsterRunStatus,
    DefaultSensorStatus,
    MaterializeResult,
    MetadataValue,
    RunRequest,
    RunsFilter,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    asset,
    asset_check,
    define_asset_job,
    multi_asset,
    schedule,
    sensor,
)
from pydantic import Field
from pyspark.sql import functions as F

from assets.metadata import PARTITION_ROW_COUNT, table_metadata
from assets.partitions import (
    LEDGER_PARTITIONS,
    check_partitions_exist,
    ledger_keys,
    legacy_partitions_message,
    partition_spans,
    range_tags,
    requested_partition_keys,
    retry_after_s,
)
from resources.spark import SparkResource
from resources.warehouse import WarehouseResource
from txn_engine.log.spark_columns import position_lt
from txn_engine.tier.offload import (EMPTY_CHECKSUM, OffloadWaitingError, content_checksum, eligible_not_offloaded, offload_ledgers,
                                     tier_uncommitted)
from txn_engine.core.positions import ledger_of_partition, ledger_partition_key
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.tier.retention import DEFAULT_MAX_AGE, RetentionPolicy, apply_retention
from txn_engine.core.schema import (
    DELETED_LEDGERS,
    LEDGERS,
    LEDGER_ENTRIES,
    OFFLOAD_MANIFEST,
    OFFLOAD_MANIFEST_SCHEMA,
    OFFLOADED_ENTRIES,
    OFFLOADED_ENTRIES_SCHEMA,
    STABLE_POSITIONS,
)

GROUP = "offload"


@multi_asset(
    specs=[
        # skippable: a run records only the partitions it offloaded or found offloaded (below).
        AssetSpec(OFFLOADED_ENTRIES, group_name=GROUP, deps=[LEDGER_ENTRIES], skippable=True,
                  description="The filtered offload tier (cold tier location): only DATA entries that are "
                  "non-transactional or committed, of offloaded ledgers, at their original positions."),
        AssetSpec(OFFLOAD_MANIFEST, group_name=GROUP, deps=[LEDGER_ENTRIES], skippable=True,
                  description="One row per offloaded ledger: entries kept and dropped by reason, bytes before and "
                  "after, the stable position at offload time, a content checksum, the tier location."),
    ],
    partitions_def=LEDGER_PARTITIONS,
    backfill_policy=BackfillPolicy.single_run(),
)
def offload_tier(context: AssetExecutionContext, spark: SparkResource, warehouse: WarehouseResource):
    wh = warehouse.open(spark.session())
    # A run of one key the instance does not hold reaches this step: say why it is no partition.
    check_partitions_exist(wh, context.instance, requested_partition_keys(context.run.tags))
    ledgers = [ledger_of_partition(k) for k in context.partition_keys]
    result = offload_ledgers(wh, ledgers)
    savings = result.savings()
    waiting = {ledger_partition_key(t, l): reason for (t, l), reason in sorted(result.waiting.items())}
    # The partitions the tier now holds: offloaded by this run, or before.
    done = set(ledger_keys([*result.offloaded, *result.already_offloaded])) & set(context.partition_keys)
    named = done | set(waiting)
    waiting.update({k: "not in the `ledgers` catalog" for k in context.partition_keys if k not in named})
    not_done = [k for k in context.partition_keys if k not in done]
    if waiting:
        context.log.warning(f"not eligible yet, left in the hot tier and not recorded as materialized: {waiting}")
    context.log.info(f"offloaded {result.offloaded}: {savings}")
    if not_done and not done:
        # Asked for waiting ledgers only (e.g. one partition from the UI): a success would record
        # them as materialized, and "backfill missing partitions" would skip them afterwards.
        raise OffloadWaitingError(waiting)
    extra = {
        "ledgers_requested": len(ledgers),
        "facts_from": result.facts_from,
        "kept_from": result.kept_from,  # the buffer's committed_entries, or the log classified
        "step_seconds": MetadataValue.json({step: round(s, 2) for step, s in result.step_seconds.items()}),
        # Whether the orphan check had to read the tier's ledgers (see txn_engine.tier.offload).
        "tier_scanned": result.tier_scanned,
        "ledgers_offloaded": MetadataValue.json([ledger_partition_key(t, l) for t, l in result.offloaded]),
        "ledgers_already_offloaded": len(result.already_offloaded),
        "ledgers_waiting": MetadataValue.json(waiting),
        "recovered": MetadataValue.json({
            "finished": [ledger_partition_key(t, l) for t, l in result.finished_orphans],
            "rolled_back": [ledger_partition_key(t, l) for t, l in result.rolled_back_orphans],
            "states_recorded": [ledger_partition_key(t, l) for t, l in result.states_recorded],
        }),
        # The run's totals; each partition's own figures are its manifest row (below).
        **{f"run_{k}": v for k, v in savings.items()},
    }
    manifest = _manifest_rows(wh, done)
    offloaded_now = set(ledger_keys(result.offloaded))
    for table in (OFFLOADED_ENTRIES, OFFLOAD_MANIFEST):
        metadata = table_metadata(wh, table, **extra)
        del metadata["rows"]  # `dagster/row_count`: the table's; each partition's rows in its own metadata
        own = {key: _partition_facts(table, manifest.get(key), key in offloaded_now) for key in done}
        if not not_done:
            for key in context.partition_keys:
                context.add_asset_metadata(own[key], asset_key=table, partition_key=key)
            yield MaterializeResult(asset_key=table, metadata=metadata)
        else:
            # An output materializes every partition of the run, so a range with waiting ledgers
            # records the others one by one and skips the outputs (skippable specs). The checks,
            # which follow the outputs, are then skipped too: they run in the next run that holds
            # no waiting ledger.
            for key in context.partition_keys:
                if key in done:
                    yield AssetMaterialization(asset_key=table, partition=key, metadata={**metadata, **own[key]})


def _manifest_rows(wh, keys: set[str]) -> dict[str, dict]:
    """The `offload_manifest` rows (a row per offloaded ledger) of these partitions."""
    rows = DeltaTables(wh).read(OFFLOAD_MANIFEST, OFFLOAD_MANIFEST_SCHEMA).to_pylist()
    return {k: r for r in rows if (k := ledger_partition_key(r["topic"], r["ledger_id"])) in keys}


def _partition_facts(table: str, row: dict | None, offloaded_now: bool) -> dict:
    """A ledger partition's own metadata: its manifest row (its rows in the tier, what was dropped, why)."""
    facts: dict = {"offloaded_by_this_run": offloaded_now}
    if row is None:  # a partition the tier held, whose manifest row is gone: not txnlake's doing; say 0
        facts[PARTITION_ROW_COUNT] = MetadataValue.int(0)
        return facts
    facts[PARTITION_ROW_COUNT] = MetadataValue.int(row["entries_kept"] if table == OFFLOADED_ENTRIES else 1)
    facts.update({k: v if isinstance(v, (int, str)) else str(v) for k, v in row.items() if v is not None})
    return facts


OFFLOAD_SELECTION = AssetSelection.assets(OFFLOADED_ENTRIES, OFFLOAD_MANIFEST)
OFFLOAD_KEYS = {AssetKey(OFFLOADED_ENTRIES), AssetKey(OFFLOAD_MANIFEST)}

offload_job = define_asset_job(
    "offload",
    selection=OFFLOAD_SELECTION,
    description="Offload ledgers (partitions) to the filtered tier; a range backfill is one run.",
)


# Runs of the offload job that are still to finish: while one is, the sensor requests nothing.
UNFINISHED = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
              DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]


def offload_run_request(keys: list[str], order: list[str], cursor: dict) -> tuple[RunRequest, dict]:
    """The run over the first contiguous span (in partition `order`) of the eligible `keys`, and
    the cursor after it.

    One run at a time: each is a JVM (an 8g driver) and a writer of the same Delta tables, so
    runs side by side would compete for the cores and conflict on the commits. A span, not the
    range covering every eligible key: a range holding a waiting ledger records only the others
    and skips the checks (see `offload_tier`); the next span is asked for on a later tick.
    The run key holds an attempt count: Dagster launches a run key once, so when the same span is
    still to offload after its run finished (it failed), the next attempt needs a new key.
    """
    first, last = partition_spans(order, set(keys), contiguous=True)[0]
    attempt = cursor["attempt"] + 1 if cursor.get("span") == [first, last] else 1
    request = RunRequest(run_key=f"offload-{first}-{last}-attempt-{attempt}", tags=range_tags(first, last))
    return request, {"span": [first, last], "attempt": attempt}


@sensor(job=offload_job, minimum_interval_seconds=60, default_status=DefaultSensorStatus.STOPPED,
        description="Offloads ledgers that became eligible (CLOSED and at or below their topic's stable position): "
                    "one run at a time, over a span of them; a failed run is retried on a later tick.")
def offload_eligible_ledgers(context: SensorEvaluationContext, spark: SparkResource, warehouse: WarehouseResource):
    # Read by delta-rs (`eligible_not_offloaded`): a tick starts no JVM in the sensor's process.
    wh = warehouse.open(spark.session)
    legacy = legacy_partitions_message(context.instance)
    if legacy:
        return SkipReason(legacy)
    if not wh.exists(STABLE_POSITIONS):
        return SkipReason(f"no {STABLE_POSITIONS} yet: materialize the transaction buffer first")
    # Any unfinished run writing the tier: the offload job's, a UI backfill's (an asset job of its own)
    # or `txnlake offload`'s.
    running = [r for r in context.instance.get_run_records(RunsFilter(statuses=UNFINISHED), limit=200)
               if r.dagster_run.job_name == offload_job.name or OFFLOAD_KEYS & set(r.dagster_run.asset_selection or ())]
    if running:
        return SkipReason(f"offload run {running[0].dagster_run.run_id} is still to finish")
    keys = ledger_keys(eligible_not_offloaded(wh))
    if not keys:
        return SkipReason("no ledger is newly eligible for offload")
    known = context.instance.get_dynamic_partitions(LEDGER_PARTITIONS.name)
    new = [k for k in keys if k not in set(known)]
    last = json.loads(context.cursor) if context.cursor else {}
    request, cursor = offload_run_request(keys, [*known, *new], last)
    if cursor["attempt"] > 1:  # the same span again: its run failed; ask after a backoff, as the buffer sensor does
        wait = last.get("at", 0) + retry_after_s(cursor["attempt"] - 2) - time.time()
        if wait > 0:
            return SkipReason(f"the offload run of {cursor['span'][0]}..{cursor['span'][1]} failed; asking again in {wait:.0f} s")
    context.update_cursor(json.dumps({**cursor, "at": time.time()}))
    return SensorResult(
        run_requests=[request],
        dynamic_partitions_requests=[LEDGER_PARTITIONS.build_add_request(new)] if new else [],
    )


# -- retention ---------------------------------------------------------------------------------

class RetentionConfig(Config):
    """A retention policy: a ledger goes when any set limit says so (Kafka's retention.ms / .bytes)."""

    max_age_hours: float | None = Field(default=DEFAULT_MAX_AGE.total_seconds() / 3600,
                                        description="Delete ledgers whose last entry is older (default 168 h, as Kafka).")
    max_bytes: int | None = Field(default=None, description="Per topic, delete the oldest ledgers while the hot ones hold more.")
    keep_ledgers: int | None = Field(default=None, description="Per topic, keep at most this many (newest) ledgers.")
    require_offloaded: bool = Field(default=True, description="Only delete ledgers the offload tier already holds.")
    require_buffered: bool = Field(default=True, description="Only delete ledgers the transaction buffer's state holds "
                                   "(their facts outlive their rows only there); set false only knowing what is lost.")
    dry_run: bool = Field(default=False, description="Report what would be deleted; write nothing.")

    def policy(self) -> RetentionPolicy:
        age = None if self.max_age_hours is None else timedelta(hours=self.max_age_hours)
        return RetentionPolicy(max_age=age, max_bytes=self.max_bytes, keep_ledgers=self.keep_ledgers,
                               require_offloaded=self.require_offloaded, require_buffered=self.require_buffered)


@asset(name=DELETED_LEDGERS, group_name=GROUP, deps=[OFFLOAD_MANIFEST, LEDGER_ENTRIES], output_required=False,
       description="Retention: ledgers deleted from the hot tables (by default only offloaded ones), with their "
       "last known catalog row; their aborts are trimmed from the abort set, readers read them from the tier. "
       "A dry run, or a run with nothing to delete, records an observation, not a materialization: nothing changed.")
def ledger_retention(context: AssetExecutionContext, config: RetentionConfig, spark: SparkResource,
                     warehouse: WarehouseResource):
    wh = warehouse.open(spark.session())
    result = apply_retention(wh, config.policy(), dry_run=config.dry_run)
    verb = "would delete" if config.dry_run else "deleted"
    context.log.info(f"retention {verb} {result.deleted} ({result.freed_entries} entries, {result.freed_bytes} bytes); "
                     f"finished interrupted deletions {result.finished}"
                     + (f"; kept until the transaction buffer has run over them (`txnlake run`): {result.waiting_for_buffer}"
                        if result.waiting_for_buffer else ""))
    outcome = {
        "policy": MetadataValue.json({k: v for k, v in config.model_dump().items() if k != "dry_run"}),
        "dry_run": config.dry_run,
        "ledgers_deleted": MetadataValue.json([f"{t}/{l}" for t, l in result.deleted]),
        "ledgers_finished": MetadataValue.json([f"{t}/{l}" for t, l in result.finished]),
        "entries_freed": result.freed_entries,
        "bytes_freed": result.freed_bytes,
        "files_reclaimed": MetadataValue.int(result.files_reclaimed),  # from disk, past the tables' file retention
        # Kept until the buffer has run over them (`txnlake run`), with the ledgers after them.
        "ledgers_waiting_for_buffer": MetadataValue.json([f"{t}/{l}" for t, l in result.waiting_for_buffer]),
    }
    # A dry run, or a run that deleted nothing, changed no table: an observation, not a materialization.
    if config.dry_run or not (result.deleted or result.finished):
        context.log_event(AssetObservation(asset_key=DELETED_LEDGERS, metadata=outcome))
        return
    yield MaterializeResult(metadata=table_metadata(wh, DELETED_LEDGERS, **outcome))


# What an offload changes besides the tier: the catalog's states (OFFLOADED) and the models over
# it and the tier. A named job, so the CLI's follow-up run is listed and re-executable as one.
OFFLOAD_REFRESH_JOB = "catalog_after_offload"
catalog_after_offload_job = define_asset_job(
    OFFLOAD_REFRESH_JOB,
    selection=AssetSelection.assets(LEDGERS, "ledger_sizes", "tier_sizes"),
    description="Refresh the `ledgers` catalog, ledger_sizes and tier_sizes after an offload (`txnlake offload` runs it).",
)


retention_job = define_asset_job(
    "retention",
    selection=AssetSelection.assets(DELETED_LEDGERS),
    description="Apply the retention policy (ops.deleted_ledgers.config) to the hot tables.",
)


@schedule(job=retention_job, cron_schedule="0 3 * * *", default_status=DefaultScheduleStatus.STOPPED,
          description="Daily at 03:00: the default policy (ledgers older than 168 h, offloaded ones only).")
def retention_schedule(_context):
    return RunRequest()


# -- checks ------------------------------------------------------------------------------------

def _tier_and_manifest(wh):
    return (wh.read_or_empty(OFFLOADED_ENTRIES, OFFLOADED_ENTRIES_SCHEMA),
            wh.read_or_empty(OFFLOAD_MANIFEST, OFFLOAD_MANIFEST_SCHEMA))


@asset_check(asset=OFFLOADED_ENTRIES,
             description="The tier holds no marker and no entry of an aborted or ongoing transaction.")
def tier_holds_only_committed_data(spark: SparkResource, warehouse: WarehouseResource) -> AssetCheckResult:
    found = tier_uncommitted(warehouse.open(spark.session()))
    return AssetCheckResult(
        passed=found.passed,
        metadata={"markers": found.markers, "entries_of_aborted_txns": found.entries_of_aborted_txns,
                  "entries_of_ongoing_txns": found.entries_of_ongoing_txns},
    )


@asset_check(asset=OFFLOADED_ENTRIES,
             description="Nothing in the tier lies beyond its topic's stable position at offload time.")
def tier_within_stable_position_at_offload(spark: SparkResource, warehouse: WarehouseResource) -> AssetCheckResult:
    wh = warehouse.open(spark.session())
    tier, manifest = _tier_and_manifest(wh)
    at = manifest.select("topic", "ledger_id", "max_read_ledger_id", "max_read_entry_id")
    joined = tier.join(at, ["topic", "ledger_id"], "left")
    beyond = joined.where(position_lt(F.col("max_read_ledger_id"), F.col("max_read_entry_id"), F.col("ledger_id"), F.col("entry_id"))).count()
    # Rows without a manifest row are an interrupted offload; readers ignore them, the next run repairs them.
    orphans = joined.where(F.col("max_read_ledger_id").isNull()).count()
    return AssetCheckResult(
        passed=beyond == 0 and orphans == 0,
        severity=AssetCheckSeverity.ERROR if beyond else AssetCheckSeverity.WARN,
        metadata={"entries_beyond_stable_position": beyond, "entries_without_manifest_row": orphans},
    )


@asset_check(asset=OFFLOAD_MANIFEST,
             description="Per offloaded ledger the tier holds exactly the entries the manifest counts, with its checksum.")
def tier_matches_manifest(spark: SparkResource, warehouse: WarehouseResource) -> AssetCheckResult:
    wh = warehouse.open(spark.session())
    tier, manifest = _tier_and_manifest(wh)
    actual = tier.groupBy("topic", "ledger_id").agg(F.count("*").alias("_n"), content_checksum().alias("_sum"))
    wrong = (
        manifest.join(actual, ["topic", "ledger_id"], "left")
        .where((F.coalesce("_n", F.lit(0)) != F.col("entries_kept")) | (F.coalesce("_sum", F.lit(EMPTY_CHECKSUM)) != F.col("checksum")))
        .select("topic", "ledger_id")
        .collect()
    )
    return AssetCheckResult(
        passed=not wrong,
        metadata={"ledgers_checked": manifest.count(),
                  "ledgers_not_matching": MetadataValue.json([f"{r.topic}/{r.ledger_id}" for r in wrong[:20]])},
    )


OFFLOAD_CHECKS = [tier_holds_only_committed_data, tier_within_stable_position_at_offload, tier_matches_manifest]


defs = Definitions(assets=[offload_tier, ledger_retention], asset_checks=OFFLOAD_CHECKS, jobs=[offload_job, catalog_after_offload_job, retention_job],
                   sensors=[offload_eligible_ledgers], schedules=[retention_schedule])
