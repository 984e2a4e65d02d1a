"""Transaction-buffer snapshots as assets: `txn_snapshot_segments` with the per-topic
`txn_snapshot_state`, and `recovered_buffer_state` with its check against the full replay.

A sensor (new entries in `ledger_entries`) and a schedule (the interval) run `snapshot_job`; the
job itself decides per topic whether a snapshot is due (txn_engine.snapshots.jobs.snapshot_states),
as a broker does, so a run with nothing due only refreshes the state and the recovery.
"""


import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlparse

from dagster import (
    Definitions,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    AssetSelection,
    AssetSpec,
    Config,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    MaterializeResult,
    MetadataValue,
    RunRequest,
    SensorEvaluationContext,
    SkipReason,
    asset,
    asset_check,
    define_asset_job,
    multi_asset,
    schedule,
    sensor,
)
import pyarrow.compute as pc
from pydantic import Field

from assets.metadata import markdown_preview, table_metadata
from resources.spark import SparkResource
from resources.warehouse import WarehouseResource
from txn_engine.storage.delta_io import DeltaTables, aggregate
from txn_engine.core.schema import (
    ABORTED_TXNS,
    DELETED_LEDGERS,
    LEDGER_ENTRIES,
    RECOVERED_BUFFER_STATE,
    RECOVERED_BUFFER_STATE_SCHEMA,
    SNAPSHOT_STATES,
    STABLE_POSITIONS,
    STABLE_POSITIONS_SCHEMA,
    TXN_SNAPSHOT_SEGMENTS,
    TXN_SNAPSHOT_STATE,
    TXN_SNAPSHOT_STATE_SCHEMA,
)
from txn_engine.snapshots.jobs import (
    SNAPSHOT_LOCK_TIMEOUT_S,
    TriggerConfig,
    compact_segments,
    current_snapshot_states,
    full_replay_states,
    recovery_mismatches,
    snapshot_lock,
    snapshots_in_driver,
    write_snapshots,
)
from txn_engine.snapshots.recovery import recover_to_warehouse, stale_recovery
from txn_engine.snapshots.triggers import due_inputs, due_reasons
from txn_engine.snapshots.format import DEFAULT_MAX_ABORTS_PER_SEGMENT, DEFAULT_MAX_SEGMENT_BYTES, SnapshotConfig
from txn_engine.storage.warehouse import Warehouse

GROUP = "snapshots"


class SnapshotRunConfig(Config):
    """Segment bounds, triggers and maintenance of one snapshot run."""

    force: bool = Field(default=False, description="Snapshot every topic with transactional data, due or not.")
    max_aborts_per_segment: int = Field(default=DEFAULT_MAX_ABORTS_PER_SEGMENT, description="Aborts per segment at most.")
    max_segment_bytes: int = Field(default=DEFAULT_MAX_SEGMENT_BYTES, description="Estimated bytes per segment at most (5 MiB: BookKeeper's entry limit).")
    max_changes: int = Field(default=1000, description="Snapshot after this many max-read-position changes + aborts.")
    interval_seconds: float = Field(default=300.0, description="Snapshot at least this often while anything changed.")
    compact: bool = Field(default=True, description="Compact the segments table (then OPTIMIZE, VACUUM) after writing.")
    vacuum_retention_hours: float = Field(default=168.0, description="VACUUM retention; Delta refuses less than 168 h by default.")
    lock_timeout_s: float = Field(default=SNAPSHOT_LOCK_TIMEOUT_S, description="How long to wait for another snapshot run "
                                  "on this warehouse to finish (one at a time) before failing.")


@multi_asset(
    specs=[
        AssetSpec(TXN_SNAPSHOT_SEGMENTS, group_name=GROUP, deps=[ABORTED_TXNS, STABLE_POSITIONS, LEDGER_ENTRIES],
                  description="Multi-part transaction-buffer snapshots (PIP-178 keys topic-1..N, topic-end) with a "
                  "snapshot index; read with key compaction (docs/snapshots.md)."),
        AssetSpec(TXN_SNAPSHOT_STATE, group_name=GROUP, deps=[TXN_SNAPSHOT_SEGMENTS],
                  description="Per topic: NO_SNAPSHOT / INITIALIZING / READY, the live snapshot, changes since, due."),
    ],
)
def txn_snapshot_segments(context: AssetExecutionContext, config: SnapshotRunConfig, spark: SparkResource,
                          warehouse: WarehouseResource):
    wh = warehouse.open(spark.session())
    segment_config = SnapshotConfig(config.max_aborts_per_segment, config.max_segment_bytes)
    with snapshot_lock(wh, config.lock_timeout_s):  # from choosing what is due to the state written
        yield from _take_snapshots(context, config, wh, segment_config)


def _take_snapshots(context: AssetExecutionContext, config: SnapshotRunConfig, wh: Warehouse,
                    segment_config: SnapshotConfig):
    triggers = TriggerConfig(config.max_changes, config.interval_seconds)
    compute = "driver" if snapshots_in_driver(wh) else "spark"  # one way for the whole run
    before = current_snapshot_states(wh, triggers, compute=compute).to_pylist()
    wanted = {r["topic"] for r in before if r["due"] or config.force}
    # Snapshots are taken of the buffer tables' state; a topic they do not know yet waits.
    tables = DeltaTables(wh)  # the small tables (a row per topic) read in the driver, no Spark job
    known = set(tables.read(STABLE_POSITIONS, STABLE_POSITIONS_SCHEMA, ["topic"])["topic"].to_pylist())
    skipped = sorted(wanted - known)
    if skipped:
        context.log.warning(f"no stable position yet for {skipped[:10]}: materialize the transaction_buffer assets")
    due = sorted(wanted & known)
    for row in before:
        if row["topic"] in due:
            context.log.info(f"snapshot {row['topic']}: {row['due_reason'] or 'forced'}")
    summary = write_snapshots(wh, due, segment_config, compute=compute)
    compaction = compact_segments(wh, config.vacuum_retention_hours, compute=compute) \
        if config.compact and wh.exists(TXN_SNAPSHOT_SEGMENTS) else None
    tables.overwrite(TXN_SNAPSHOT_STATE, current_snapshot_states(wh, triggers, compute=compute), TXN_SNAPSHOT_STATE_SCHEMA)
    stored = tables.read(TXN_SNAPSHOT_STATE, TXN_SNAPSHOT_STATE_SCHEMA)
    by_state = {s: 0 for s in SNAPSHOT_STATES}
    by_state.update(Counter(stored["state"].to_pylist()))
    segments_rows = tables.row_count(TXN_SNAPSHOT_SEGMENTS)
    yield MaterializeResult(asset_key=TXN_SNAPSHOT_SEGMENTS, metadata=table_metadata(
        wh, TXN_SNAPSHOT_SEGMENTS, segments_rows,
        topics_snapshotted=len(summary.topics),
        segments_written=summary.segments,
        tombstones_written=summary.tombstones,
        segments_per_topic=MetadataValue.json(summary.segments_per_topic),
        rows_before_compaction=compaction.rows_before if compaction else segments_rows,
        computed_by=compute,
    ))
    yield MaterializeResult(asset_key=TXN_SNAPSHOT_STATE, metadata=table_metadata(
        wh, TXN_SNAPSHOT_STATE, sum(by_state.values()),
        topics_by_state=MetadataValue.json(by_state),
        topics_skipped=MetadataValue.json(skipped),
        states=MetadataValue.md(markdown_preview(
            stored.select(["topic", "state", "snapshot_id", "segment_count", "abort_count", "changes_since_snapshot",
                           "due"]).sort_by("topic"), limit=50)),
    ))


@asset(name=RECOVERED_BUFFER_STATE, group_name=GROUP, deps=[TXN_SNAPSHOT_SEGMENTS, LEDGER_ENTRIES],
       description="Per topic, the transaction buffer rebuilt from its snapshot plus the replay after its max read "
       "position (source SNAPSHOT), or by a full replay when it has no usable snapshot (source FULL_REPLAY).")
def recovered_buffer_state(spark: SparkResource, warehouse: WarehouseResource) -> MaterializeResult:
    wh = warehouse.open(spark.session())
    recovery = recover_to_warehouse(wh)  # in the driver, as a broker recovers (docs/snapshots.md)
    stored = DeltaTables(wh).read(RECOVERED_BUFFER_STATE, RECOVERED_BUFFER_STATE_SCHEMA,
                                  ["topic", "source", "fallback_reason", "replayed_entries"])  # a row per topic
    by_source = {r["source"]: {"topics": r["topics"], "replayed_entries": r["replayed"] or 0} for r in aggregate(
        stored, ["source"], [("topic", "count", "topics"), ("replayed_entries", "sum", "replayed")]).to_pylist()}
    reasons = [f"{r['topic']}: {r['fallback_reason']}" for r in stored.to_pylist() if r["source"] == "FULL_REPLAY"][:20]
    return MaterializeResult(metadata=table_metadata(
        wh, RECOVERED_BUFFER_STATE,
        by_source=MetadataValue.json(by_source), full_replay_reasons=MetadataValue.json(reasons),
        recovery_path=recovery.path, recovery_seconds=MetadataValue.json(recovery.seconds),
    ))


@asset_check(asset=RECOVERED_BUFFER_STATE,
             description="The recovered state equals a full replay of ledger_entries: abort set and max read position.")
def recovered_state_equals_full_replay(spark: SparkResource, warehouse: WarehouseResource) -> AssetCheckResult:
    wh = warehouse.open(spark.session())
    stale = stale_recovery(DeltaTables(wh))
    if stale:  # not wrong, out of date: a warning that says what to run
        return AssetCheckResult(
            passed=False, severity=AssetCheckSeverity.WARN,
            description=f"recovered_buffer_state was recovered from ledger_entries version "
            f"{stale['recovered_from_ledger_entries_version']}; the log is at version {stale['ledger_entries_version']} "
            "since (rows ingested or deleted), so a replay of it is no test of that recovery: materialize "
            "take_snapshots (or run `txnlake snapshot`) to recover again, then this check compares.",
            metadata={k: MetadataValue.int(v) for k, v in stale.items()})
    mismatched = recovery_mismatches(wh.read(RECOVERED_BUFFER_STATE), full_replay_states(wh.read(LEDGER_ENTRIES)))
    topics = [r.topic for r in mismatched.limit(20).collect()]
    return AssetCheckResult(passed=not topics, metadata={"mismatched_topics": MetadataValue.json(topics)})


SNAPSHOT_ASSETS = [txn_snapshot_segments, recovered_buffer_state]
SNAPSHOT_CHECKS = [recovered_state_equals_full_replay]

snapshot_job = define_asset_job(
    "take_snapshots",
    selection=AssetSelection.assets(TXN_SNAPSHOT_SEGMENTS, TXN_SNAPSHOT_STATE, RECOVERED_BUFFER_STATE),
    description="Snapshot the topics that are due, compact the segments, refresh the state and the recovery.",
)


def snapshots_pending(wh: Warehouse, triggers: TriggerConfig = TriggerConfig(), now: float | None = None) -> list[str]:
    """Why a `take_snapshots` run (not forced) has work, empty when it would change nothing: its
    tables exist, no topic is due now by `triggers` (the state's changes and last snapshot time) or
    unfinished, and nothing it reads changed after the state and recovery it wrote. Read by delta-rs."""
    now = time.time() if now is None else now

    tables = DeltaTables(wh)
    written = {t: tables.last_commit(t) for t in (TXN_SNAPSHOT_STATE, RECOVERED_BUFFER_STATE)}
    missing = [t for t, commit in written.items() if commit is None]
    if missing:
        return [f"table {', '.join(missing)} does not exist yet"]
    states = tables.read(TXN_SNAPSHOT_STATE, TXN_SNAPSHOT_STATE_SCHEMA,
                         ["topic", "state", "due", "snapshot_id", "changes_since_snapshot", "last_snapshot_at"])
    due = sorted(pc.filter(states["topic"], pc.is_valid(due_reasons(due_inputs(states), triggers,
                                                                   datetime.fromtimestamp(now, timezone.utc)))).to_pylist())
    reasons = [f"{len(due)} topic(s) due for a snapshot: {', '.join(due[:5])}"] if due else []
    # The segments are written (and compacted) by the run itself, before its recovery.
    since = {source: int(written[TXN_SNAPSHOT_STATE]["timestamp"]) for source in
             (LEDGER_ENTRIES, STABLE_POSITIONS, ABORTED_TXNS, DELETED_LEDGERS)}
    since[TXN_SNAPSHOT_SEGMENTS] = int(written[RECOVERED_BUFFER_STATE]["timestamp"])
    for source, after in since.items():
        change = tables.last_change(source)
        if change is not None and int(change["timestamp"]) > after:
            reasons.append(f"{source} changed (version {change.get('version')}) after the last snapshot run")
    return reasons


def delta_version_on_disk(table_path: str) -> int | None:
    """The latest commit of a local Delta table, from its log's file names (no Spark in the daemon)."""
    log = Path(urlparse(table_path).path if table_path.startswith("file:") else table_path) / "_delta_log"
    versions = [int(p.stem) for p in log.glob("*.json") if p.stem.isdigit()]
    return max(versions) if versions else None


@sensor(job=snapshot_job, minimum_interval_seconds=60, default_status=DefaultSensorStatus.STOPPED,
        description="Runs take_snapshots when ledger_entries has new commits (the job applies the triggers).")
def snapshot_trigger_sensor(context: SensorEvaluationContext, warehouse: WarehouseResource):
    # The warehouse resource the Definitions configure, as the runs get it: the sensor watches the warehouse
    # the runs write. Read from the log's file names, or on a store by delta-rs: a tick starts no JVM.
    settings = warehouse.settings()
    if settings.is_local():
        version = delta_version_on_disk(settings.table_path(LEDGER_ENTRIES))
    else:
        version = warehouse.open().version(LEDGER_ENTRIES)
    if version is None:
        return SkipReason("ledger_entries does not exist yet")
    if context.cursor == str(version):
        return SkipReason(f"ledger_entries still at version {version}")
    context.update_cursor(str(version))
    return RunRequest(run_key=f"ledger_entries-v{version}")


@schedule(job=snapshot_job, cron_schedule="*/5 * * * *", default_status=DefaultScheduleStatus.STOPPED,
          description="Every 5 minutes: the interval trigger (snapshots at least every interval_seconds).")
def snapshot_schedule(_context):
    return RunRequest()


SNAPSHOT_JOBS = [snapshot_job]
SNAPSHOT_SENSORS = [snapshot_trigger_sensor]
SNAPSHOT_SCHEDULES = [snapshot_schedule]


defs = Definitions(assets=SNAPSHOT_ASSETS, asset_checks=SNAPSHOT_CHECKS, jobs=SNAPSHOT_JOBS, sensors=SNAPSHOT_SENSORS,
                   schedules=SNAPSHOT_SCHEDULES)
