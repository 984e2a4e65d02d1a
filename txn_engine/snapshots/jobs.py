"""Transaction-buffer snapshots on Spark: write segments, compact them, recover from them.

The same design as the reference `txn_engine.reference.snapshots` (the oracle; docs/snapshots.md):
- `snapshot_segments` cuts each topic's abort set into segments; `write_snapshots` writes the
  parts, then every `topic-end`, then tombstones for stale numbered keys, each step its own Delta
  commit under the table's writer lock (write_seq allocated under it: unique and increasing);
- `compacted_segments` is the compaction rule, `compact_segments` applies it in one commit;
- `recover_buffer_states`: the live snapshot by its index, its aborts minus those of DELETED
  ledgers, plus a replay of the tail; topics without a usable snapshot are replayed in full. Each
  topic's replay is `snapshots.replay.replay_topic` in a Python worker, the function the driver's
  recovery (`snapshots.recovery`) calls: the asset recovers in the driver, this plan is its
  fallback for a large tail, and what the tests hold it equal to;
- `snapshot_states`: per-topic state (NO_SNAPSHOT / INITIALIZING / READY) and the triggers'
  verdict (`snapshots.triggers`).
"""

from __future__ import annotations

import secrets
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Iterator, Sequence

import pyarrow as pa
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.functions import arrow_udf
from pyspark.sql import types as T
from pyspark.sql.types import BooleanType, IntegerType, StringType

from txn_engine.buffer.kernel import NARROW_COLUMNS, require_ledger_entries
from txn_engine.log.spark_columns import conform, has_txn, is_marker
from txn_engine.storage.arrow_frames import local_frame
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.log.ledgers import recorded_deleted_ledgers
from txn_engine.core.positions import Position
from txn_engine.storage.locks import writer_lock
from txn_engine.core.schema import (
    ABORT_STRUCT,
    ABORTED_TXNS,
    LEDGER_ENTRIES,
    LEDGER_ENTRY_COLUMNS,
    RECOVERED_BUFFER_STATE,
    RECOVERED_BUFFER_STATE_SCHEMA,
    STABLE_POSITIONS,
    TXN_SNAPSHOT_SEGMENTS,
    TXN_SNAPSHOT_SEGMENTS_SCHEMA,
    TXN_SNAPSHOT_STATE_SCHEMA,
)
from txn_engine.snapshots.index import (ABORT_SIZE, BAD_REASON, INDEX_COLUMNS, RULE_COLUMNS, bad_row_reasons_of,
                                        end_keys, live_snapshot_index, part_numbers)
from txn_engine.snapshots.index import live_ends as live_ends_of
from txn_engine.snapshots.triggers import TriggerConfig, due_reasons
from txn_engine.snapshots.replay import after_snapshot, anchor_position, full_replay_rows, replayed_rows
from txn_engine.snapshots.format import ABORT_BYTES, END_SUFFIX, SnapshotConfig, Source, segment_bytes
from txn_engine.storage.warehouse import Warehouse, elements_as, retry_delta_conflicts, stored_frame

# The writer's steps, in order; `after_commit` hooks receive them (tests inject crashes there).
PARTS, ENDS, TOMBSTONES = "parts", "ends", "tombstones"


def _empty_aborts() -> Column:
    return F.array().cast(f"array<{ABORT_STRUCT.simpleString()}>")


# -- keys ---------------------------------------------------------------------------------------

# The part number and the bad-row rules run as Arrow UDFs: the functions the driver's recovery
# calls (`snapshots.index`). Not mapInArrow: PySpark builds it on pandas_udf, which needs pandas.
_part_number = arrow_udf(part_numbers, IntegerType())
_bad_row_reason = arrow_udf(bad_row_reasons_of, StringType())


_end_key = arrow_udf(end_keys, BooleanType())


def is_end_key() -> Column:
    """Whether the row's key is its topic's `topic-end` (`index.end_keys`)."""
    return _end_key(F.col("topic"), F.col("snapshot_key"))


def part_number() -> Column:
    """The number of a `topic-i` key, null for `topic-end` and for keys of no topic."""
    return _part_number(F.col("topic"), F.col("snapshot_key"))


def checked_segments(segments: DataFrame) -> DataFrame:
    """`segments` with `bad_reason`: why a row cannot be used (null when it can), checked before
    recovery trusts it, and `_row`, the row's identity for the index. Checkpointed: the index reads
    the rows several times, and each read would run the rules in a Python worker again."""
    return (segments.withColumn(BAD_REASON, _bad_row_reason(F.struct(*RULE_COLUMNS)))
            .withColumn(_ROW, F.monotonically_increasing_id()).localCheckpoint())


_ROW = "_row"


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


def snapshot_segments(aborted: DataFrame, stable: DataFrame, snapshot_ids: DataFrame, config: SnapshotConfig) -> DataFrame:
    """The segments (no write_seq yet) of a snapshot of each topic in `snapshot_ids` (topic, snapshot_id).

    `aborted` has the `aborted_txns` columns and `stable` the `stable_positions` ones: together the
    state a broker's buffer holds. A topic in `snapshot_ids` with no aborts gets `topic-end` alone.
    """
    ids = F.broadcast(snapshot_ids.select("topic", F.col("snapshot_id").cast("long")))
    # `SnapshotConfig.segment_capacity` on Spark, in longs (a segment size of a TiB overflows an int
    # before the bound by aborts applies); write_snapshots has refused topics where it is below 1.
    capacity = F.least(
        F.lit(config.max_aborts_per_segment).cast("long"),
        F.floor((F.lit(config.max_segment_bytes).cast("long") - F.lit(segment_bytes("", 0)) - 2 * F.octet_length("topic"))
                / ABORT_BYTES).cast("long"),
    )
    in_order = Window.partitionBy("topic").orderBy("abort_ledger_id", "abort_entry_id")
    numbered = (
        aborted.join(ids, "topic")
        .withColumn("_n", F.row_number().over(in_order) - 1)
        .withColumn("_capacity", capacity)
        .withColumn("segment_index", (F.floor(F.col("_n") / F.col("_capacity")) + 1).cast("int"))
    )
    parts = numbered.groupBy("topic", "snapshot_id", "segment_index").agg(
        # (n, abort) sorted by n: the abort-marker order inside the segment.
        F.array_sort(F.collect_list(F.struct(
            F.col("_n"), F.struct(F.col("txn_most_bits"), F.col("txn_least_bits"),
                                  F.col("abort_ledger_id").alias("ledger_id"), F.col("abort_entry_id").alias("entry_id"))
            .alias("a")))).alias("_sorted")
    ).select("topic", "snapshot_id", "segment_index", F.transform("_sorted", lambda s: s["a"]).alias("aborts"))
    totals = numbered.groupBy("topic").agg(F.count("*").alias("abort_count"), F.max("_capacity").alias("_capacity"))
    per_topic = (
        ids.join(totals, "topic", "left")
        .join(stable.select("topic", "max_read_ledger_id", "max_read_entry_id"), "topic", "left")
        .select("topic", "snapshot_id", F.coalesce("abort_count", F.lit(0)).alias("abort_count"),
                F.greatest(F.lit(1), F.ceil(F.coalesce("abort_count", F.lit(0)) / F.col("_capacity"))).cast("int")
                .alias("segment_count"),
                "max_read_ledger_id", "max_read_entry_id")
    )
    # Every topic has its end, aborts or not: the right outer join brings the empty ones.
    segments = parts.join(per_topic, ["topic", "snapshot_id"], "right").withColumn(
        "segment_index", F.coalesce("segment_index", "segment_count")
    )
    is_end = F.col("segment_index") == F.col("segment_count")
    return segments.select(
        F.when(is_end, F.concat("topic", F.lit(f"-{END_SUFFIX}")))
        .otherwise(F.concat("topic", F.lit("-"), F.col("segment_index").cast("string"))).alias("snapshot_key"),
        "topic",
        F.when(is_end, F.col("max_read_ledger_id")).otherwise(F.lit(-1)).alias("max_read_ledger_id"),
        F.when(is_end, F.col("max_read_entry_id")).otherwise(F.lit(-1)).alias("max_read_entry_id"),
        F.coalesce("aborts", _empty_aborts()).alias("aborts"),
        F.lit(None).cast("long").alias("write_seq"),
        "snapshot_id", "segment_index", "segment_count", "abort_count",
        F.lit(False).alias("tombstone"),
    )


@dataclass
class SnapshotWriteSummary:
    topics: list[str]
    snapshot_ids: dict[str, int]
    segments: int  # rows written as parts and ends
    tombstones: int
    commits: int
    segments_per_topic: dict[str, int] = field(default_factory=dict)


def write_snapshots(
    warehouse: Warehouse,
    topics: Sequence[str],
    config: SnapshotConfig | None = None,
    aborted: DataFrame | None = None,
    stable: DataFrame | None = None,
    parts_per_commit: int | None = None,
    after_commit: Callable[[str, int], None] | None = None,
    snapshot_ids: dict[str, int] | None = None,
) -> SnapshotWriteSummary:
    """Take a snapshot of each of `topics`, from `aborted_txns` and `stable_positions` by default.

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
        return _write_snapshots(warehouse, topics, config, aborted, stable, parts_per_commit, after_commit, snapshot_ids)


def _write_snapshots(warehouse: Warehouse, topics: list[str], config: SnapshotConfig, aborted: DataFrame | None,
                     stable: DataFrame | None, parts_per_commit: int | None,
                     after_commit: Callable[[str, int], None] | None,
                     snapshot_ids: dict[str, int] | None) -> SnapshotWriteSummary:
    spark = warehouse.spark
    aborted = aborted if aborted is not None else warehouse.read(ABORTED_TXNS)
    stable = stable if stable is not None else warehouse.read(STABLE_POSITIONS)
    known = {r.topic for r in stable.select("topic").where(F.col("topic").isin(topics)).collect()}
    if set(topics) - known:
        raise ValueError(
            f"no stable position for topic(s) {sorted(set(topics) - known)[:5]}; materialize stable_positions "
            "(the transaction_buffer assets) after ingesting their entries, then snapshot again"
        )
    for topic in topics:
        config.segment_capacity(topic)  # a topic whose segment cannot hold one abort fails here, before any write
    if warehouse.exists(TXN_SNAPSHOT_SEGMENTS):
        warehouse.read(TXN_SNAPSHOT_SEGMENTS)  # an older txnlake's log is refused (`txnlake migrate`), before any write
    ids = dict(snapshot_ids or {})
    for topic in topics:
        ids.setdefault(topic, secrets.randbits(62) + 1)  # unique per snapshot; order comes from write_seq
    id_frame = local_frame(spark, sorted(ids.items()), "topic string, snapshot_id long").where(F.col("topic").isin(topics))
    segments = snapshot_segments(aborted, stable, id_frame, config).localCheckpoint()
    counts = {r.topic: r.segment_count for r in segments.select("topic", "segment_count").distinct().collect()}
    commits = 0
    written = 0

    def commit(step: str, rows: DataFrame) -> None:
        nonlocal commits, written
        n = _append_with_write_seq(warehouse, rows)
        commits += 1
        written += n if step != TOMBSTONES else 0
        if after_commit:
            after_commit(step, n)

    parts = segments.where(F.col("segment_index") < F.col("segment_count"))
    highest = max(counts.values()) - 1
    step = parts_per_commit or max(highest, 1)
    for first in range(1, highest + 1, step):
        commit(PARTS, parts.where(F.col("segment_index").between(first, first + step - 1)))
    commit(ENDS, segments.where(F.col("segment_index") == F.col("segment_count")))
    tombstones = _write_tombstones(warehouse, ids, counts)
    commits += 1 if tombstones else 0
    if after_commit and tombstones:
        after_commit(TOMBSTONES, tombstones)
    return SnapshotWriteSummary(topics, {t: ids[t] for t in topics}, written, tombstones, commits, counts)


def _append_with_write_seq(warehouse: Warehouse, rows: DataFrame) -> int:
    """Append segment rows with write_seq after every existing one, read and committed under the lock."""
    table = TXN_SNAPSHOT_SEGMENTS
    n = rows.count()
    if not n:
        return 0
    with warehouse.writer(table):
        base = _max_write_seq(warehouse)
        in_write_order = Window.orderBy("topic", "segment_index", "snapshot_key")  # few rows: one partition is fine
        numbered = rows.withColumn("write_seq", F.row_number().over(in_write_order) + F.lit(base))
        stamped = conform(numbered.withColumn("written_at", F.current_timestamp()), TXN_SNAPSHOT_SEGMENTS_SCHEMA)
        retry_delta_conflicts(lambda: stored_frame(table, stamped).write.format("delta").mode("append").save(warehouse.path(table)))
    return n


def _max_write_seq(warehouse: Warehouse) -> int:
    table = warehouse.read_or_empty(TXN_SNAPSHOT_SEGMENTS, TXN_SNAPSHOT_SEGMENTS_SCHEMA)
    return int(table.agg(F.max("write_seq")).first()[0] or 0)


def _write_tombstones(warehouse: Warehouse, ids: dict[str, int], counts: dict[str, int]) -> int:
    """Tombstone every numbered key of the snapshotted topics beyond their new segment count
    whose latest row is not already a tombstone (stale parts of older, longer snapshots)."""
    spark = warehouse.spark
    new = local_frame(spark, [(t, ids[t], counts[t]) for t in counts], "topic string, _id long, _count int")
    latest = latest_per_key(warehouse.read(TXN_SNAPSHOT_SEGMENTS))
    stale = (
        latest.join(F.broadcast(new), "topic")
        .withColumn("_part", part_number())
        .where(~F.coalesce("tombstone", F.lit(False)) & F.col("_part").isNotNull() & (F.col("_part") >= F.col("_count")))
        .select(
            "snapshot_key", "topic", F.lit(-1).cast("long").alias("max_read_ledger_id"),
            F.lit(-1).cast("long").alias("max_read_entry_id"),
            _empty_aborts().alias("aborts"),
            F.col("_id").alias("snapshot_id"), F.col("_part").alias("segment_index"),
            F.lit(0).alias("segment_count"), F.lit(0).cast("long").alias("abort_count"), F.lit(True).alias("tombstone"),
        )
    )
    return _append_with_write_seq(warehouse, stale.localCheckpoint())


# -- compaction ---------------------------------------------------------------------------------

def latest_per_key(segments: DataFrame) -> DataFrame:
    """Key-compaction semantics: the row with the latest write_seq of each snapshot_key."""
    newest = Window.partitionBy("snapshot_key").orderBy(F.col("write_seq").desc())
    return segments.withColumn("_r", F.row_number().over(newest)).where("_r = 1").drop("_r")


def live_ends(segments: DataFrame, columns: Sequence[str]) -> DataFrame:
    """`index.live_ends` of `segments` (the rows it applies to): per topic, `columns` of its live
    `topic-end`. Collects the end rows' narrow columns (a row per `topic-end` row, no aborts)."""
    needed = list(dict.fromkeys(["topic", "snapshot_key", "write_seq", "tombstone", *columns]))
    ends = segments.where(is_end_key()).select(*needed).toArrow()
    picked = ends.take(pa.array(sorted(live_ends_of(ends).values()), pa.int64()))
    return local_frame(segments.sparkSession, picked, T.StructType([segments.schema[c] for c in ["topic", *columns]]))


def compacted_segments(segments: DataFrame) -> DataFrame:
    """What compaction keeps: the latest row of each key unless it is a tombstone, and the newest
    row of each key of every live snapshot (the one its topic's latest `topic-end` names), which a
    newer, unfinished snapshot may have overwritten."""
    live = live_ends(segments, ["snapshot_id"]).select("topic", F.col("snapshot_id").alias("_live_id"))
    not_tombstone = ~F.coalesce(F.col("tombstone"), F.lit(False))
    newest = Window.partitionBy("snapshot_key").orderBy(F.col("write_seq").desc())
    newest_of_snapshot = Window.partitionBy("snapshot_key", "snapshot_id", "_tomb").orderBy(F.col("write_seq").desc())
    ranked = (
        segments.withColumn("_tomb", ~not_tombstone)
        .withColumn("_r", F.row_number().over(newest))
        .withColumn("_rs", F.row_number().over(newest_of_snapshot))
        .join(F.broadcast(live), "topic", "left")
    )
    keep = ((F.col("_r") == 1) & not_tombstone) | (
        not_tombstone & (F.col("_rs") == 1) & (F.col("snapshot_id") == F.col("_live_id"))
    )
    return ranked.where(keep).select(*segments.columns)


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
) -> CompactionSummary:
    """Rewrite `txn_snapshot_segments` with `compacted_segments` in one commit, then OPTIMIZE and
    VACUUM it. The default retention (7 days, Delta's own) keeps every file a reader of an older
    version may still open; lower it only where no reader runs that long (VACUUM refuses less than
    the table's `delta.deletedFileRetentionDuration`, a week unless set).

    OPTIMIZE and VACUUM run in delta-rs (`DeltaTables`): Spark's ran a listing job, then a job per
    step, on a table of a few rows, and printed its own line to the console (docs/benchmarks.md,
    "Driver reads")."""
    table = TXN_SNAPSHOT_SEGMENTS
    path = warehouse.path(table)
    with snapshot_lock(warehouse), warehouse.writer(table):  # never between a writer's parts and its end
        current = warehouse.read(table).localCheckpoint()
        before = current.count()
        kept = compacted_segments(current).localCheckpoint()
        after = kept.count()
        if before_commit:
            before_commit()
        if after != before:
            retry_delta_conflicts(lambda: stored_frame(table, kept).write.format("delta").mode("overwrite").save(path))
    tables = DeltaTables(warehouse)
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
    size = F.when(F.col("aborts").isNull(), F.lit(None)).otherwise(F.size("aborts")).alias(ABORT_SIZE)
    meta = checked.select(*INDEX_COLUMNS, BAD_REASON, size, _ROW).toArrow()
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

def snapshot_states(entries: DataFrame, segments: DataFrame, config: TriggerConfig,
                    now: datetime | None = None) -> DataFrame:
    """`txn_snapshot_state`: per topic with transactional data or snapshot rows, its state and whether
    a snapshot is due.

    - NO_SNAPSHOT: no usable snapshot and no unfinished one; INITIALIZING: parts newer than the
      live `topic-end` exist (a snapshot being written, or cut short); READY: otherwise.
    - changes since the snapshot: the markers after its max read position. Each COMMIT or ABORT
      is an abort or may move the max read position: the batch count of the broker's
      changeMaxReadPositionAndAddAbortTimes (every marker of a topic without a snapshot).
    - due: `triggers.due_reasons` (its reason in `due_reason`). INITIALIZING is due: snapshot runs
      hold the snapshot lock from here to their state's write, so parts without their end seen
      here were left by a writer that stopped (a crash). Written again, the topic is READY and the
      next compaction drops those parts.
    """
    now = now or datetime.now(timezone.utc)
    checked = checked_segments(segments)
    index = _live_snapshots(checked)
    ends = live_ends(checked.where(F.col(BAD_REASON).isNull()), ["write_seq", "written_at"]).select(
        "topic", F.col("write_seq").alias("_end_seq"), F.col("written_at").alias("last_snapshot_at"))
    newer_parts = (
        checked.where(~is_end_key() & ~F.coalesce("tombstone", F.lit(False)))
        .join(ends, "topic", "left")
        .where(F.col("_end_seq").isNull() | (F.col("write_seq") > F.col("_end_seq")))
        .groupBy("topic").agg(F.count("*").alias("_unfinished"))
    )
    narrow = entries.select("topic", "ledger_id", "entry_id", "entry_type", "txn_most_bits", "txn_least_bits")
    usable = index.where(F.col("fallback_reason").isNull()).select(
        "topic", F.col("max_read_ledger_id").alias("_sl"), F.col("max_read_entry_id").alias("_se"))
    per_topic = (
        narrow.join(F.broadcast(usable), "topic", "left")
        .groupBy("topic").agg(
            F.count(F.when(has_txn(), 1)).alias("_txn_entries"),
            F.count(F.when(is_marker() & (F.col("_sl").isNull() | after_snapshot(F.col)), 1)).alias("changes_since_snapshot"),
        )
    )
    topics = per_topic.where("_txn_entries > 0").select("topic").unionByName(index.select("topic")).distinct()
    joined = (
        topics.join(per_topic, "topic", "left").join(index, "topic", "left")
        .join(ends, "topic", "left").join(newer_parts, "topic", "left")
    )
    has_snapshot = F.col("fallback_reason").isNull() & F.col("snapshot_id").isNotNull()
    unfinished = F.coalesce("_unfinished", F.lit(0)) > 0
    state = F.when(unfinished, F.lit("INITIALIZING")).when(has_snapshot, F.lit("READY")).otherwise(F.lit("NO_SNAPSHOT"))
    changes = F.coalesce("changes_since_snapshot", F.lit(0))
    first_due = ~has_snapshot & (F.coalesce("_txn_entries", F.lit(0)) > 0)
    due_reason = arrow_udf(lambda rows: due_reasons(pa.RecordBatch.from_struct_array(rows), config, now), StringType())
    reason = due_reason(F.struct(has_snapshot.alias("has_snapshot"), unfinished.alias("unfinished"),
                                 first_due.alias("first_due"), changes.alias("changes_since_snapshot"),
                                 F.col("last_snapshot_at")))
    return conform(
        joined.select(
            "topic", state.alias("state"),
            F.when(has_snapshot, F.col("snapshot_id")).alias("snapshot_id"),
            F.when(has_snapshot, F.col("segment_count")).alias("segment_count"),
            F.when(has_snapshot, F.col("abort_count")).alias("abort_count"),
            F.when(has_snapshot, F.col("max_read_ledger_id")).alias("max_read_ledger_id"),
            F.when(has_snapshot, F.col("max_read_entry_id")).alias("max_read_entry_id"),
            changes.alias("changes_since_snapshot"),
            F.when(has_snapshot, F.col("last_snapshot_at")).alias("last_snapshot_at"),
            reason.isNotNull().alias("due"), reason.alias("due_reason"),
            F.lit(now).cast("timestamp").alias("updated_at"),
        ),
        TXN_SNAPSHOT_STATE_SCHEMA,
    )


def read_segments(warehouse: Warehouse) -> DataFrame:
    """The snapshot log, each abort as the engine builds it (the stored readable `txn_id` left out)."""
    segments = warehouse.read_or_empty(TXN_SNAPSHOT_SEGMENTS, TXN_SNAPSHOT_SEGMENTS_SCHEMA)
    return segments.withColumn("aborts", elements_as("aborts", ABORT_STRUCT))


def recover_from_warehouse(warehouse: Warehouse) -> DataFrame:
    """`recover_buffer_states` over the warehouse's tables."""
    return recover_buffer_states(warehouse.read(LEDGER_ENTRIES), read_segments(warehouse), recorded_deleted_ledgers(warehouse))
