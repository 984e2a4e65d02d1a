"""Transaction-buffer snapshots: write segments, compact them, keep the per-topic state, recover.

The same design as the reference `txn_engine.reference.snapshots` (the oracle; docs/snapshots.md).
Each rule is stated once over Arrow (`snapshots.segments`, `snapshots.index`, `snapshots.replay`);
this module runs a snapshot run's work in the driver on delta-rs for a log that fits the driver,
else on Spark (`snapshots_in_driver`, the `compute` setting):
- `write_snapshots` writes the parts, then every `topic-end`, then tombstones for stale numbered
  keys, each step its own Delta commit under the table's writer lock (write_seq allocated under
  it: unique and increasing); `compact_segments` applies the compaction rule in one commit;
- `snapshot_states` / `current_snapshot_states`: per-topic state and the triggers' verdict;
- `recover_buffer_states`: recovery on Spark, the fallback of the driver's (`snapshots.recovery`)
  for a large tail, and what the tests hold it equal to.
"""

from __future__ import annotations

import functools
import secrets
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.functions import arrow_udf
from pyspark.sql import types as T
from pyspark.sql.types import StringType

from txn_engine.buffer import kernel
from txn_engine.buffer.kernel import NARROW_COLUMNS, require_ledger_entries
from txn_engine.log.spark_columns import conform, has_txn, is_marker
from txn_engine.storage.arrow_frames import arrow_schema, local_frame
from txn_engine.storage.delta_io import DeltaTables, aggregate_batches
from txn_engine.log.ledgers import recorded_deleted_ledgers
from txn_engine.core.positions import Position
from txn_engine.storage.locks import writer_lock
from txn_engine.core.schema import (
    ABORT_STRUCT,
    ABORTED_TXNS,
    ABORTED_TXNS_SCHEMA,
    LEDGER_ENTRIES,
    LEDGER_ENTRY_COLUMNS,
    RECOVERED_BUFFER_STATE,
    RECOVERED_BUFFER_STATE_SCHEMA,
    STABLE_POSITIONS,
    STABLE_POSITIONS_SCHEMA,
    TXN_SNAPSHOT_SEGMENTS,
    TXN_SNAPSHOT_SEGMENTS_SCHEMA,
    TXN_SNAPSHOT_STATE_SCHEMA,
)
from txn_engine.snapshots.index import (ABORT_SIZE, BAD_REASON, INDEX_COLUMNS, RULE_COLUMNS, bad_row_reasons_of,
                                        indexed_rows, live_snapshot_index)
from txn_engine.snapshots.segments import (ABORTED_COLUMNS, SEGMENTS_SCHEMA, UNNUMBERED_SCHEMA, Planned, compaction_keeps,
                                           cut_segments, snapshot_state_table, stale_parts, write_seqs)
from txn_engine.snapshots.triggers import TriggerConfig
from txn_engine.snapshots.replay import (SNAPSHOT_ENTRY, SNAPSHOT_LEDGER, after_snapshot, anchor_position,
                                         full_replay_rows, replayed_rows)
from txn_engine.snapshots.format import SnapshotConfig, Source
from txn_engine.storage.warehouse import Warehouse, elements_as, retry_delta_conflicts, stored_frame

# The writer's steps, in order; `after_commit` hooks receive them (tests inject crashes there).
PARTS, ENDS, TOMBSTONES = "parts", "ends", "tombstones"


# -- keys ---------------------------------------------------------------------------------------

# The bad-row rules run as an Arrow UDF: the function the driver's recovery calls
# (`snapshots.index`). Not mapInArrow: PySpark builds it on pandas_udf, which needs pandas.
_bad_row_reason = arrow_udf(bad_row_reasons_of, StringType())


def checked_segments(segments: DataFrame) -> DataFrame:
    """`segments` with `bad_reason`: why a row cannot be used (null when it can), checked before
    recovery trusts it, and `_row`, the row's identity for the index. Checkpointed: the index reads
    the rows several times, and each read would run the rules in a Python worker again."""
    return (segments.withColumn(BAD_REASON, _bad_row_reason(F.struct(*RULE_COLUMNS)))
            .withColumn(_ROW, F.monotonically_increasing_id()).localCheckpoint())


_ROW = "_row"


def _abort_size():
    """`index.ABORT_SIZE` on Spark: the aborts a row holds, null when its array is."""
    return F.when(F.col("aborts").isNull(), F.lit(None)).otherwise(F.size("aborts")).alias(ABORT_SIZE)


# -- where snapshot work runs -------------------------------------------------------------------

def snapshots_in_driver(warehouse: Warehouse, compute: str | None = None) -> bool:
    """Whether a snapshot run (its states, writes and compaction) runs in the driver on delta-rs:
    `compute` (default: the warehouse's `compute` setting) says so, or it is auto and the log fits
    the full-run bound (the state reads the log's narrow columns; the abort sets are smaller)."""
    compute = (compute or warehouse.settings.compute).lower()
    if compute != "auto":
        return compute == "driver"
    return DeltaTables(warehouse).stored_bytes(LEDGER_ENTRIES) <= warehouse.settings.driver_full_run_max_bytes


# -- writing ------------------------------------------------------------------------------------

SNAPSHOT_LOCK = "txn_snapshot_writer"  # a lock file of its own beside the tables' (`WarehouseSettings.lock_path`)
SNAPSHOT_LOCK_TIMEOUT_S = 1800.0


_snapshot_locks_held = threading.local()  # the lock paths this thread holds (`snapshot_lock` is reentrant)


@contextmanager
def snapshot_lock(wh: Warehouse, timeout_s: float = SNAPSHOT_LOCK_TIMEOUT_S) -> Iterator[None]:
    """One snapshot writer at a time per warehouse, across processes and threads (the sensor's and
    the schedule's runs, `txnlake snapshot`, API callers), as one broker owns a Pulsar topic's
    snapshots: the segments table's own lock covers one commit, and a compaction between another
    writer's parts and its end drops those parts (the end then names a snapshot without them).

    `write_snapshots` and `compact_segments` take it; a snapshot run holds it from choosing what is
    due to the state written, across both. Reentrant in the thread that holds it (the lock is not:
    it would wait for itself); another thread of the process waits like another process."""
    path = wh.settings.lock_path(SNAPSHOT_LOCK)
    held: set = _snapshot_locks_held.__dict__.setdefault("paths", set())
    if path in held:
        yield
        return
    with writer_lock(wh.settings, SNAPSHOT_LOCK, timeout_s,
                    guarded="the transaction-buffer snapshots of this warehouse (a snapshot run: `txnlake snapshot`, "
                            "the take_snapshots job, or a caller of write_snapshots / compact_segments)"):
        held.add(path)
        try:
            yield
        finally:
            held.discard(path)


UNNUMBERED_STRUCT = T.StructType([f for f in TXN_SNAPSHOT_SEGMENTS_SCHEMA.fields if f.name in UNNUMBERED_SCHEMA.names])


def _cut_groups(plan: dict[str, Planned], config: SnapshotConfig) -> Callable[[pa.Table], pa.Table]:
    """`cut_segments` of the topic of one Spark group (typed: PySpark picks the Arrow UDF by its hints)."""
    def cut(aborted: pa.Table) -> pa.Table:
        return cut_segments(aborted, plan, config, topics=pc.unique(aborted["topic"]).to_pylist())
    return cut


def snapshot_segments(aborted: DataFrame, plan: dict[str, Planned], config: SnapshotConfig) -> DataFrame:
    """On Spark, the segments (no write_seq yet) of a snapshot of each planned topic that has aborts
    in `aborted` (the `aborted_txns` columns): `segments.cut_segments` per topic in a Python worker."""
    topics = sorted(plan)
    return (aborted.where(F.col("topic").isin(topics)).select(*ABORTED_COLUMNS).groupBy("topic")
            .applyInArrow(_cut_groups(plan, config), UNNUMBERED_STRUCT))


@dataclass
class SnapshotWriteSummary:
    topics: list[str]
    snapshot_ids: dict[str, int]
    segments: int  # rows written as parts and ends
    tombstones: int
    commits: int
    segments_per_topic: dict[str, int] = field(default_factory=dict)
    computed_by: str = "driver"  # or "spark" (`snapshots_in_driver`)


def write_snapshots(
    warehouse: Warehouse,
    topics: Sequence[str],
    config: SnapshotConfig | None = None,
    aborted: DataFrame | None = None,
    stable: DataFrame | None = None,
    parts_per_commit: int | None = None,
    after_commit: Callable[[str, int], None] | None = None,
    snapshot_ids: dict[str, int] | None = None,
    compute: str | None = None,
) -> SnapshotWriteSummary:
    """Take a snapshot of each of `topics`, from `aborted_txns` and `stable_positions` by default,
    in the driver or on Spark (`snapshots_in_driver`).

    Write order: the parts (in commits of `parts_per_commit` part numbers, all in one by default),
    then every `topic-end` in one commit, then the tombstones. `after_commit(step, rows)` runs after
    each commit. A crash anywhere leaves the previous snapshot recoverable (docs/snapshots.md).
    Holds the warehouse's `snapshot_lock` throughout, so no compaction runs between its parts and
    its end, and another writer of this warehouse's snapshots waits for it.
    """
    config = config or SnapshotConfig()
    topics = sorted(set(topics))
    if parts_per_commit is not None and parts_per_commit < 1:
        raise ValueError(f"parts_per_commit must be at least 1, got {parts_per_commit}")
    if not topics:
        return SnapshotWriteSummary([], {}, 0, 0, 0)
    with snapshot_lock(warehouse):  # no compaction between this snapshot's parts and its end
        return _write_snapshots(warehouse, topics, config, aborted, stable, parts_per_commit, after_commit, snapshot_ids,
                                snapshots_in_driver(warehouse, compute))


def _max_read_positions(warehouse: Warehouse, stable: DataFrame | None, topics: list[str]) -> dict[str, tuple]:
    """Per topic of `topics` with a stable position, its max read position (a row per topic)."""
    columns = ["topic", "max_read_ledger_id", "max_read_entry_id"]
    if stable is None:
        rows = DeltaTables(warehouse).read(STABLE_POSITIONS, STABLE_POSITIONS_SCHEMA, columns).to_pylist()
    else:
        rows = [r.asDict() for r in stable.where(F.col("topic").isin(topics)).select(*columns).collect()]
    wanted = set(topics)
    return {r["topic"]: (r["max_read_ledger_id"], r["max_read_entry_id"]) for r in rows if r["topic"] in wanted}


def _write_snapshots(warehouse: Warehouse, topics: list[str], config: SnapshotConfig, aborted: DataFrame | None,
                     stable: DataFrame | None, parts_per_commit: int | None,
                     after_commit: Callable[[str, int], None] | None,
                     snapshot_ids: dict[str, int] | None, in_driver: bool) -> SnapshotWriteSummary:
    positions = _max_read_positions(warehouse, stable, topics)
    if set(topics) - set(positions):
        raise ValueError(
            f"no stable position for topic(s) {sorted(set(topics) - set(positions))[:5]}; materialize stable_positions "
            "(the transaction_buffer assets) after ingesting their entries, then snapshot again"
        )
    for topic in topics:
        config.segment_capacity(topic)  # a topic whose segment cannot hold one abort fails here, before any write
    tables = DeltaTables(warehouse)
    tables.exists(TXN_SNAPSHOT_SEGMENTS)  # refuses an older txnlake's log (`txnlake migrate`), before any write
    ids = dict(snapshot_ids or {})
    for topic in topics:
        ids.setdefault(topic, secrets.randbits(62) + 1)  # unique per snapshot; order comes from write_seq
    plan = {t: Planned(ids[t], *positions[t]) for t in topics}
    segments: pa.Table | DataFrame
    if in_driver:
        if aborted is None:
            rows = tables.read(ABORTED_TXNS, ABORTED_TXNS_SCHEMA, list(ABORTED_COLUMNS))
        else:
            rows = aborted.where(F.col("topic").isin(topics)).select(*ABORTED_COLUMNS).toArrow()
        segments = cut_segments(rows, plan, config)
        counts = dict(zip(segments["topic"].to_pylist(), segments["segment_count"].to_pylist()))
    else:
        cut = snapshot_segments(aborted if aborted is not None else warehouse.read(ABORTED_TXNS), plan, config)
        counts = {r.topic: r.segment_count for r in cut.select("topic", "segment_count").distinct().collect()}
        alone = [t for t in topics if t not in counts]  # no aborts: `topic-end` alone, cut in the driver
        if alone:
            ends = cut_segments(_ABORTED_ARROW.empty_table(), plan, config, alone)
            cut = cut.unionByName(local_frame(warehouse.spark, ends, UNNUMBERED_STRUCT))
            counts.update({t: 1 for t in alone})
        segments = cut.withColumn(_ROW, F.monotonically_increasing_id()).localCheckpoint()
    commits = 0
    written = 0

    def commit(step: str, rows: pa.Table | DataFrame) -> None:
        nonlocal commits, written
        n = _append_with_write_seq(warehouse, rows)
        commits += 1
        written += n if step != TOMBSTONES else 0
        if after_commit:
            after_commit(step, n)

    highest = max(counts.values()) - 1
    step = parts_per_commit or max(highest, 1)
    for first in range(1, highest + 1, step):
        commit(PARTS, _segments_where(segments, first, min(first + step - 1, highest)))
    commit(ENDS, _segments_where(segments, None, None))
    tombstones = _write_tombstones(warehouse, ids, counts)
    commits += 1 if tombstones else 0
    if after_commit and tombstones:
        after_commit(TOMBSTONES, tombstones)
    return SnapshotWriteSummary(topics, {t: ids[t] for t in topics}, written, tombstones, commits, counts,
                                "driver" if in_driver else "spark")


_ABORTED_ARROW = pa.schema([arrow_schema(ABORTED_TXNS_SCHEMA).field(c) for c in ABORTED_COLUMNS])


def _segments_where(segments: pa.Table | DataFrame, first: int | None, last: int | None) -> pa.Table | DataFrame:
    """The parts numbered `first`..`last`, or with no bounds the ends (`segment_index` == `segment_count`)."""
    if isinstance(segments, DataFrame):
        if first is None:
            return segments.where(F.col("segment_index") == F.col("segment_count"))
        return segments.where((F.col("segment_index") < F.col("segment_count"))
                              & F.col("segment_index").between(first, last))
    index, count = segments["segment_index"], segments["segment_count"]
    if first is None:
        return segments.filter(pc.equal(index, count))
    return segments.filter(pc.and_(pc.less(index, count),
                                   pc.and_(pc.greater_equal(index, first), pc.less_equal(index, last))))


def _append_with_write_seq(warehouse: Warehouse, rows: pa.Table | DataFrame) -> int:
    """Append segment rows (a Spark frame with `_row` on the Spark path) with `write_seq` after every
    stored one (`segments.write_seqs`), read and committed under the table's writer lock."""
    table = TXN_SNAPSHOT_SEGMENTS
    tables = DeltaTables(warehouse)
    keys = rows.select(*_KEY_COLUMNS).toArrow() if isinstance(rows, DataFrame) else rows
    if not keys.num_rows:
        return 0
    with tables.writing(table):
        seqs = write_seqs(keys, tables.column_max(table, "write_seq") or 0)
        if isinstance(rows, DataFrame):
            numbered = rows.join(F.broadcast(local_frame(warehouse.spark, pa.table({_ROW: keys[_ROW], "write_seq": seqs}),
                                                         f"{_ROW} long, write_seq long")), _ROW).drop(_ROW)
            stamped = conform(numbered.withColumn("written_at", F.current_timestamp()), TXN_SNAPSHOT_SEGMENTS_SCHEMA)
            warehouse.create_missing(table, TXN_SNAPSHOT_SEGMENTS_SCHEMA)
            retry_delta_conflicts(lambda: stored_frame(table, stamped).write.format("delta").mode("append").save(warehouse.path(table)))
        else:
            now = pa.array([datetime.now(timezone.utc)] * keys.num_rows, SEGMENTS_SCHEMA.field("written_at").type)
            tables.append(table, TXN_SNAPSHOT_SEGMENTS_SCHEMA, pa.table(
                [seqs if f.name == "write_seq" else now if f.name == "written_at" else rows[f.name] for f in SEGMENTS_SCHEMA],
                schema=SEGMENTS_SCHEMA))
    return keys.num_rows


_KEY_COLUMNS = (_ROW, "topic", "segment_index", "snapshot_key")


def _write_tombstones(warehouse: Warehouse, ids: dict[str, int], counts: dict[str, int]) -> int:
    """Tombstone every numbered key of the snapshotted topics beyond their new segment count
    whose latest row is not already a tombstone (`segments.stale_parts`): tiny rows, written by delta-rs."""
    stored = DeltaTables(warehouse).read(TXN_SNAPSHOT_SEGMENTS, TXN_SNAPSHOT_SEGMENTS_SCHEMA,
                                         ["snapshot_key", "topic", "write_seq", "tombstone"])
    return _append_with_write_seq(warehouse, stale_parts(stored, {t: (ids[t], counts[t]) for t in counts}))


# -- compaction ---------------------------------------------------------------------------------

COMPACTION_COLUMNS = ("topic", "snapshot_key", "write_seq", "tombstone", "snapshot_id")


def compacted_segments(segments: DataFrame) -> DataFrame:
    """On Spark, the rows compaction keeps (`segments.compaction_keeps`, over the rows' narrow
    columns collected: a row per segment row, no aborts)."""
    rows = segments.withColumn(_ROW, F.monotonically_increasing_id()).localCheckpoint()
    meta = rows.select(_ROW, *COMPACTION_COLUMNS).toArrow()
    kept = local_frame(segments.sparkSession, meta.filter(compaction_keeps(meta)).select([_ROW]), f"{_ROW} long")
    return rows.join(F.broadcast(kept), _ROW).drop(_ROW)


SEGMENTS_FILE_BYTES = 256 * 1024 * 1024  # OPTIMIZE's target file size (Spark's default 1 GiB; segments are small)


@dataclass
class CompactionSummary:
    rows_before: int
    rows_after: int
    vacuumed: bool


def compact_segments(
    warehouse: Warehouse,
    vacuum_retention_hours: float = 168.0,
    optimize: bool = True,
    before_commit: Callable[[], None] | None = None,
    compute: str | None = None,
) -> CompactionSummary:
    """Rewrite `txn_snapshot_segments` with the rows `segments.compaction_keeps` in one commit, in
    the driver or on Spark (`snapshots_in_driver`), then OPTIMIZE and VACUUM it. The default
    retention (7 days, Delta's own) keeps every file a reader of an older version may still open;
    lower it only where no reader runs that long (VACUUM refuses less than the table's
    `delta.deletedFileRetentionDuration`, a week unless set).

    OPTIMIZE and VACUUM run in delta-rs (`DeltaTables`): Spark's ran a listing job, then a job per
    step, on a table of a few rows (docs/benchmarks.md, "Driver reads")."""
    table = TXN_SNAPSHOT_SEGMENTS
    tables = DeltaTables(warehouse)
    in_driver = snapshots_in_driver(warehouse, compute)
    with snapshot_lock(warehouse), tables.writing(table):  # never between a writer's parts and its end
        if in_driver:
            current = tables.read(table, TXN_SNAPSHOT_SEGMENTS_SCHEMA)
            kept_rows = current.filter(compaction_keeps(current))
            before, after = current.num_rows, kept_rows.num_rows
        else:
            current = warehouse.read(table).localCheckpoint()
            before = current.count()
            kept = compacted_segments(current).localCheckpoint()
            after = kept.count()
        if before_commit:
            before_commit()
        if after != before:
            if in_driver:
                tables.overwrite(table, kept_rows, TXN_SNAPSHOT_SEGMENTS_SCHEMA)
            else:
                retry_delta_conflicts(
                    lambda: stored_frame(table, kept).write.format("delta").mode("overwrite").save(warehouse.path(table)))
    if optimize:  # no row changes (dataChange=false): a concurrent snapshot write keeps its rows
        tables.compact(table, SEGMENTS_FILE_BYTES)
    if vacuum_retention_hours is not None:
        tables.vacuum(table, vacuum_retention_hours)
    return CompactionSummary(before, after, vacuum_retention_hours is not None)


# -- recovery -----------------------------------------------------------------------------------

def live_snapshots(segments: DataFrame) -> DataFrame:
    """Per topic with segment rows: its live snapshot by the index, or why it cannot be used.

    Columns: topic, snapshot_id, max_read_ledger_id, max_read_entry_id, segment_count,
    abort_count, aborts (the whole abort set, in order; null when unusable), fallback_reason.
    """
    return _live_snapshots(checked_segments(segments))


def _live_snapshots(checked: DataFrame) -> DataFrame:
    """`live_snapshots` of `checked_segments`: `index.live_snapshot_index` over the rows' index
    columns, collected (a row per segment row, no aborts); then each live snapshot's aborts, its
    rows' arrays in order, joined in Spark."""
    spark = checked.sparkSession
    meta = checked.select(*INDEX_COLUMNS, BAD_REASON, _abort_size(), _ROW).toArrow()
    index = live_snapshot_index(meta)
    row_ids = meta.column(_ROW).to_pylist()
    plan = local_frame(spark, [
        (s.topic, s.snapshot_id, s.max_read and s.max_read.ledger_id, s.max_read and s.max_read.entry_id, s.segment_count,
         s.abort_count, s.fallback_reason) for s in index.values()],
        "topic string, snapshot_id long, max_read_ledger_id long, max_read_entry_id long, segment_count int, "
        "abort_count long, fallback_reason string")
    picks = local_frame(spark, [(s.topic, n, row_ids[i]) for s in index.values() for n, i in enumerate(s.rows)],
                        f"topic string, _n int, {_ROW} long")
    aborts = (
        checked.select(_ROW, "aborts").join(F.broadcast(picks), _ROW)
        .groupBy("topic").agg(F.array_sort(F.collect_list(F.struct("_n", "aborts"))).alias("_ordered"))
        .select("topic", F.flatten(F.transform("_ordered", lambda p: p["aborts"])).alias("aborts"))
    )
    return plan.join(aborts, "topic", "left").select(
        "topic", "snapshot_id", "max_read_ledger_id", "max_read_entry_id", "segment_count", "abort_count", "aborts",
        "fallback_reason")


def recover_buffer_states(entries: DataFrame, segments: DataFrame, deleted: DataFrame) -> DataFrame:
    """`recovered_buffer_state` for every topic with entries (see the module doc).

    `entries`: ledger_entries; `segments`: txn_snapshot_segments; `deleted`: (topic, ledger_id)
    of DELETED ledgers. Collects the (tiny) per-topic snapshot index to plan the replay.
    """
    require_ledger_entries(entries)
    index = live_snapshots(segments).localCheckpoint()
    deleted = deleted.select("topic", "ledger_id").distinct()
    deleted_by_topic = deleted.groupBy("topic").agg(F.collect_set("ledger_id").alias("_deleted"))
    not_deleted = lambda a: ~F.coalesce(F.array_contains(F.col("_deleted"), a["ledger_id"]), F.lit(False))  # noqa: E731
    snap = (
        index.where(F.col("fallback_reason").isNull())
        .join(F.broadcast(deleted_by_topic), "topic", "left")
        .select("topic", "snapshot_id", F.col("max_read_ledger_id").alias("_sl"),
                F.col("max_read_entry_id").alias("_se"), F.filter("aborts", not_deleted).alias("_kept"))
    )
    snap = snap.localCheckpoint()
    reasons = index.select("topic", F.col("fallback_reason").alias("_reason"))
    joined = (
        replayed_states(entries, snap, deleted)
        .join(snap.select("topic", "snapshot_id"), "topic", "left")
        .join(reasons, "topic", "left")
    )
    result = joined.select(
        "topic", "max_read_ledger_id", "max_read_entry_id", "aborts", "snapshot_id",
        F.when(F.col("snapshot_id").isNotNull(), F.lit(Source.SNAPSHOT.value))
        .otherwise(F.lit(Source.FULL_REPLAY.value)).alias("source"),
        F.when(F.col("snapshot_id").isNull(), F.coalesce("_reason", F.lit("no snapshot yet"))).alias("fallback_reason"),
        "replayed_entries",
    )
    return conform(result, RECOVERED_BUFFER_STATE_SCHEMA)


REPLAYED_DDL = (f"topic string, max_read_ledger_id long, max_read_entry_id long, aborts array<{ABORT_STRUCT.simpleString()}>, "
                "replayed_entries long")  # `replay.REPLAYED_SCHEMA`


def replayed_states(entries: DataFrame, snap: DataFrame, deleted: DataFrame) -> DataFrame:
    """Per topic with entries, `replay.replay_topic` run in a Python worker: after its snapshot
    (`snap`: topic, _sl, _se (its max read position), _kept (its trimmed aborts)) the entries after
    the max read position, cogrouped with the aborts and the anchor; without one all its entries,
    alone (the full replay). Columns: `replay.REPLAYED_SCHEMA`."""
    bounds = snap.select("topic", "_sl", "_se").collect()  # one row per snapshot topic
    anchors = _anchors(entries, bounds, deleted)
    tails = entries_without_snapshot(entries, [r.topic for r in bounds]).unionByName(
        entries_after_snapshots(entries, snap.select("topic", "_sl", "_se"), min((r._sl for r in bounds), default=None))
        .select(*LEDGER_ENTRY_COLUMNS))
    side = snap.select("topic", "_kept").join(
        F.broadcast(local_frame(entries.sparkSession, [(t, a and a.ledger_id, a and a.entry_id) for t, a in anchors.items()],
                                "topic string, _anchor_ledger_id long, _anchor_entry_id long")), "topic", "left")
    # Narrow: the replay needs no payload, so ledger_entries' narrow columns alone are shuffled.
    return tails.select(*NARROW_COLUMNS).groupBy("topic").cogroup(side.groupBy("topic")).applyInArrow(
        replayed_rows, REPLAYED_DDL)


def entries_after_snapshots(entries: DataFrame, snap: DataFrame, lowest_ledger: int | None) -> DataFrame:
    """The entries after each snapshot topic's max read position (`snap`: topic, _sl, _se, ...).

    Ledger ids are unique across topics and increase with creation time (BookKeeper), so every
    entry to replay lies in a ledger >= `lowest_ledger`, the smallest max read ledger among the
    snapshots: that literal bound reaches the Delta scan, whose file statistics skip the files of
    older ledgers. The broadcast join then applies each topic's own position.
    """
    if lowest_ledger is None:  # no snapshot topic: nothing to read
        return entries.where(F.lit(False)).join(snap, "topic")
    return (
        entries.where(F.col("ledger_id") >= F.lit(lowest_ledger))
        .join(F.broadcast(snap), "topic")
        .where(after_snapshot(F.col))
    )


def entries_without_snapshot(entries: DataFrame, snapshot_topics: Sequence[str]) -> DataFrame:
    """All entries of the topics that have no usable snapshot (they are replayed in full).

    Which topics those are is read from the `topic` column alone (a cheap scan); their entries are
    then read by a literal topic filter, so files of snapshot topics only can be skipped too.
    """
    known = set(snapshot_topics)
    others = sorted(r.topic for r in entries.select("topic").distinct().collect() if r.topic not in known)
    return entries.where(F.col("topic").isin(others) if others else F.lit(False)).select(*LEDGER_ENTRY_COLUMNS)


def _anchors(entries: DataFrame, bounds: list, deleted: DataFrame) -> dict[str, Position | None]:
    """`replay.anchor_position` of each snapshot topic (`bounds`: topic, _sl, _se). The max read
    position is an entry of the log; only when its ledger was deleted since is the log searched for
    the last entry before it (a narrow scan of those topics only)."""
    spark = entries.sparkSession
    at = local_frame(spark, [(r.topic, r._sl) for r in bounds], "topic string, ledger_id long")
    gone = {(r.topic, r.ledger_id) for r in deleted.join(F.broadcast(at), ["topic", "ledger_id"], "left_semi").collect()}
    last_before: dict[str, Position] = {}
    if gone:
        bound = local_frame(spark, sorted(gone), "topic string, _sl long")
        earlier = (
            entries.select("topic", "ledger_id", "entry_id").where(F.col("topic").isin(sorted({t for t, _ in gone})))
            .join(F.broadcast(bound), "topic").where(F.col("ledger_id") < F.col("_sl"))
            .groupBy("topic").agg(F.max("ledger_id").alias("ledger_id"))
        )
        last = (
            entries.select("topic", "ledger_id", "entry_id")
            .join(F.broadcast(earlier), ["topic", "ledger_id"])
            .groupBy("topic", "ledger_id").agg(F.max("entry_id").alias("entry_id"))
        )
        last_before = {r.topic: Position(r.ledger_id, r.entry_id) for r in last.collect()}
    return {r.topic: anchor_position(Position(r._sl, r._se), {ledger for t, ledger in gone if t == r.topic},
                                     lambda _ledger, topic=r.topic: last_before.get(topic))
            for r in bounds}


def full_replay_states(entries: DataFrame) -> DataFrame:
    """The truth recovery must equal: per topic, the max read position and the abort set of a
    replay of all of `ledger_entries` (`replay.replay_topic` with no snapshot), in the recovered
    table's shape, with `replayed_entries`."""
    return entries.select(*NARROW_COLUMNS).groupBy("topic").applyInArrow(full_replay_rows, REPLAYED_DDL)


def recovery_mismatches(recovered: DataFrame, full: DataFrame) -> DataFrame:
    """Topics whose recovered max read position or abort set differ from the full replay's; either
    side as stored or as computed (each abort's readable id is made the same way on both)."""
    recovered, full = (stored_frame(RECOVERED_BUFFER_STATE, side) for side in (recovered, full))
    r = recovered.select("topic", F.struct("max_read_ledger_id", "max_read_entry_id", "aborts").alias("_r"))
    f = full.select("topic", F.struct("max_read_ledger_id", "max_read_entry_id", "aborts").alias("_f"))
    return r.join(f, "topic", "full_outer").where(~F.col("_r").eqNullSafe(F.col("_f"))).select("topic")


# -- triggers and per-topic state ----------------------------------------------------------------

# What the state's counts read of the log.
_FACT_INPUT = ("topic", "ledger_id", "entry_id", "entry_type", "txn_most_bits", "txn_least_bits")


def _entry_facts_on_spark(entries: DataFrame, positions: dict[str, tuple[int, int]]) -> pa.Table:
    """`segments.FACT_COLUMNS` of every topic of the log, on Spark (a row per topic collected)."""
    usable = local_frame(entries.sparkSession, [(t, *p) for t, p in sorted(positions.items())],
                         f"topic string, {SNAPSHOT_LEDGER} long, {SNAPSHOT_ENTRY} long")
    narrow = entries.select(*_FACT_INPUT)
    return (narrow.join(F.broadcast(usable), "topic", "left").groupBy("topic").agg(
        F.count(F.when(has_txn(), 1)).alias("txn_entries"),
        F.count(F.when(is_marker() & (F.col(SNAPSHOT_LEDGER).isNull() | after_snapshot(F.col)), 1))
        .alias("changes_since_snapshot"),
    )).toArrow()


def _entry_facts_in_driver(log: ds.Dataset, positions: dict[str, tuple[int, int]]) -> pa.Table:
    """`segments.FACT_COLUMNS` of every topic of the log, its narrow columns read by delta-rs batch
    by batch (the driver holds a row per topic and one batch)."""
    topics = pa.array(sorted(positions), pa.string())
    ledgers = pa.array([positions[t][0] for t in topics.to_pylist()], pa.int64())
    entries = pa.array([positions[t][1] for t in topics.to_pylist()], pa.int64())
    changed = pc.field("_marker") & (pc.field(SNAPSHOT_LEDGER).is_null() | after_snapshot(pc.field))

    def partial(batch: pa.RecordBatch) -> pa.Table:
        rows = pa.Table.from_batches([batch])
        topic = rows["topic"].cast(pa.string())
        at = pc.index_in(topic, topics)
        marked = pa.table({"topic": topic, "ledger_id": rows["ledger_id"], "entry_id": rows["entry_id"],
                           SNAPSHOT_LEDGER: pc.take(ledgers, at), SNAPSHOT_ENTRY: pc.take(entries, at),
                           "_txn": kernel.has_txn(rows), "_marker": kernel.is_marker(rows)})
        return ds.dataset(marked).to_table(columns={"topic": pc.field("topic"), "_txn": pc.field("_txn").cast(pa.int64()),
                                                    "_change": changed.cast(pa.int64())})

    facts = aggregate_batches((partial(b) for b in log.to_batches(columns=list(_FACT_INPUT))), ["topic"],
                              [("_txn", "sum", "txn_entries"), ("_change", "sum", "changes_since_snapshot")])
    return facts if facts is not None else pa.table({"topic": pa.array([], pa.string()), "txn_entries": pa.array([], pa.int64()),
                                                     "changes_since_snapshot": pa.array([], pa.int64())})


def _state_table_on_spark(entries: DataFrame, segments: DataFrame, config: TriggerConfig, now: datetime) -> pa.Table:
    meta = checked_segments(segments).select(*INDEX_COLUMNS, "written_at", BAD_REASON, _abort_size()).toArrow()
    return snapshot_state_table(meta, functools.partial(_entry_facts_on_spark, entries), config, now)


def snapshot_states(entries: DataFrame, segments: DataFrame, config: TriggerConfig,
                    now: datetime | None = None) -> DataFrame:
    """`txn_snapshot_state` on Spark (`segments.snapshot_state_table`): per topic with transactional
    data or snapshot rows, its state and whether a snapshot is due. The changes since a snapshot are
    the markers after its max read position: each COMMIT or ABORT is an abort or may move the max
    read position, the batch count of the broker's changeMaxReadPositionAndAddAbortTimes."""
    table = _state_table_on_spark(entries, segments, config, now or datetime.now(timezone.utc))
    return local_frame(entries.sparkSession, table, TXN_SNAPSHOT_STATE_SCHEMA)


def current_snapshot_states(warehouse: Warehouse, config: TriggerConfig, now: datetime | None = None,
                            compute: str | None = None) -> pa.Table:
    """`txn_snapshot_state` of the warehouse's log and segments, as Arrow, computed in the driver or
    on Spark (`snapshots_in_driver`)."""
    now = now or datetime.now(timezone.utc)
    if not snapshots_in_driver(warehouse, compute):
        return _state_table_on_spark(warehouse.read(LEDGER_ENTRIES), read_segments(warehouse), config, now)
    tables = DeltaTables(warehouse)
    log = tables.dataset(LEDGER_ENTRIES)  # the warehouse's error when there is no log: what to ingest
    meta = indexed_rows(tables.read(TXN_SNAPSHOT_SEGMENTS, TXN_SNAPSHOT_SEGMENTS_SCHEMA), ("written_at",))
    return snapshot_state_table(meta, functools.partial(_entry_facts_in_driver, log), config, now)


def read_segments(warehouse: Warehouse) -> DataFrame:
    """The snapshot log, each abort as the engine builds it (the stored readable `txn_id` left out)."""
    segments = warehouse.read_or_empty(TXN_SNAPSHOT_SEGMENTS, TXN_SNAPSHOT_SEGMENTS_SCHEMA)
    return segments.withColumn("aborts", elements_as("aborts", ABORT_STRUCT))


def recover_from_warehouse(warehouse: Warehouse) -> DataFrame:
    """`recover_buffer_states` over the warehouse's tables."""
    return recover_buffer_states(warehouse.read(LEDGER_ENTRIES), read_segments(warehouse), recorded_deleted_ledgers(warehouse))
