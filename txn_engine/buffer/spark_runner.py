"""The transaction-buffer kernel on Spark: topics spread over partitions, fed narrow columns, wide rows joined after.

Every fact of the buffer is a topic's own (as a broker keeps a transaction buffer per topic), so
Spark only distributes topics. A full run hash-partitions the narrow columns by topic, sorts each
partition by position and streams it through `kernel.fold_scopes` (`mapInArrow`): a topic is
folded a chunk of ledgers at a time, so a Python worker holds one chunk and the topic's state,
never the whole topic. An incremental run cogroups each topic's scope with the state rows it
reads and runs `kernel.scope_tables` on the group. No payload reaches Python: the kernel returns
its narrow tables and its decisions on rows (`VISIBLE`, `PENDING`), and Spark joins those with
the full rows and writes.

All outputs of a group come back as one frame: a `kind` column naming the table, and one struct
column per table (null in the rows of the others), split again by `kind`.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, LongType, StringType, StructField, StructType

from txn_engine.buffer import kernel
from txn_engine.buffer.kernel import (
    NARROW_COLUMNS,
    NARROW_TABLES,
    PENDING,
    TABLE_SCHEMAS,
    TXN_KEY,
    VIOLATIONS,
    VISIBLE,
    ScopeTables,
    require_ledger_entries,
)
from txn_engine.storage.arrow_frames import arrow_schema, local_frame
from txn_engine.storage.delta_io import NARROW_ROW_BYTES
from txn_engine.core.positions import at_or_before_sql
from txn_engine.core.schema import (
    ABORTED_TXNS,
    BUFFER_LEDGER_TXNS,
    BUFFER_PENDING_ENTRIES,
    BUFFER_SEQUENCE_RANGES,
    COMMITTED_ENTRIES,
    COMMITTED_ENTRIES_SCHEMA,
    LEDGER_ENTRIES_SCHEMA,
    LEDGER_ENTRY_COLUMNS,
    POSITION_COLUMNS,
    STABLE_POSITIONS,
    TXN_MARKERS,
)
from txn_engine.log.spark_columns import BROADCAST_MAX_BYTES, conform

_POSITIONS = [StructField(c, StringType() if c == "topic" else LongType()) for c in POSITION_COLUMNS]
DECISION_SCHEMAS: dict[str, StructType] = {
    **{name: TABLE_SCHEMAS[name] for name in NARROW_TABLES},
    # The VISIBLE decisions as `kernel.visible_segments`: a few rows per ledger, not one per entry.
    VISIBLE: StructType([StructField("ledger_id", LongType()), StructField("first_entry_id", LongType()),
                         StructField("last_entry_id", LongType()), StructField("codes", ArrayType(LongType())),
                         StructField("targets", ArrayType(StructType([StructField("ledger_id", LongType()),
                                                                       StructField("entry_id", LongType())])))]),
    PENDING: StructType(_POSITIONS),
    "violations": StructType([StructField(v, LongType()) for v in VIOLATIONS]),
}
# What a topic's run reads of the state: the narrow columns of the pending rows, not their payloads.
STATE_SCHEMAS: dict[str, StructType] = {
    BUFFER_SEQUENCE_RANGES: TABLE_SCHEMAS[BUFFER_SEQUENCE_RANGES],
    BUFFER_LEDGER_TXNS: TABLE_SCHEMAS[BUFFER_LEDGER_TXNS],
    BUFFER_PENDING_ENTRIES: StructType([f for f in LEDGER_ENTRIES_SCHEMA.fields if f.name in NARROW_COLUMNS]),
}
_TOPIC_ONLY = "topic"  # a state row that only makes its topic a group: every catalog topic gets a stable position


def _nullable(schema: StructType) -> StructType:
    return StructType([StructField(f.name, f.dataType, True) for f in schema.fields])


def _union_schema(schemas: Mapping[str, StructType]) -> StructType:
    return StructType([StructField("topic", StringType()), StructField("kind", StringType()),
                       *[StructField(name, _nullable(schema)) for name, schema in schemas.items()]])


OUTPUT_SCHEMA = _union_schema(DECISION_SCHEMAS)


def _union_rows(frame: DataFrame, name: str, schemas: Mapping[str, StructType]) -> DataFrame:
    """The rows of `frame` (table `name`'s columns and `topic`) in the union shape of `schemas`."""
    return frame.select(F.col("topic"), F.lit(name).alias("kind"), *[
        (F.struct(*[F.col(f.name).cast(f.dataType).alias(f.name) for f in schema.fields]) if n == name
         else F.lit(None).cast(_nullable(schema))).alias(n) for n, schema in schemas.items()])


def _as_union(parts: Mapping[str, pa.Table], schema: StructType, topic: str) -> pa.Table:
    """One Arrow table in `schema`'s union shape from tables by name (each conformed to its struct)."""
    target = arrow_schema(schema)
    batches = []
    for name, rows in parts.items():
        n = rows.num_rows
        if not n:
            continue
        columns = []
        for field in target:
            if field.name == "topic":
                columns.append(pa.repeat(pa.scalar(topic, pa.string()), n))
            elif field.name == "kind":
                columns.append(pa.repeat(pa.scalar(name, pa.string()), n))
            elif field.name == name:
                columns.append(pa.StructArray.from_arrays(
                    [rows[f.name].combine_chunks().cast(f.type) for f in field.type], fields=list(field.type)))
            else:
                columns.append(pa.nulls(n, field.type))
        batches.append(pa.RecordBatch.from_arrays(columns, schema=target))
    return pa.Table.from_batches(batches, schema=target)


def _of_kind(union: pa.Table, name: str) -> pa.Table:
    """The rows of table `name` from a union table, as a plain table."""
    rows = union.filter(pc.equal(union["kind"], name))[name]
    return pa.Table.from_batches([pa.RecordBatch.from_struct_array(c) for c in rows.chunks],
                                 schema=pa.schema(list(rows.type))) if rows.num_chunks else pa.schema(list(rows.type)).empty_table()


def _decisions(decided: ScopeTables, topic: str, stable: bool = True) -> pa.Table:
    """The union rows of a scope's decisions; `stable`: with its stable position (a chunk that is
    not its topic's last has none to give: `kernel.fold_scopes`)."""
    parts = {name: table for name, table in decided.tables.items() if stable or name != STABLE_POSITIONS}
    parts[VISIBLE] = kernel.visible_segments(parts[VISIBLE])
    parts[PENDING] = parts[PENDING].drop_columns(["_row"])
    parts["violations"] = pa.Table.from_pylist([{v: int(decided.violations.get(v, 0)) for v in VIOLATIONS}])
    return _as_union(parts, OUTPUT_SCHEMA, topic)


@dataclass(frozen=True)
class _ScopeRun:
    """A topic's run of the kernel with a state: what the driver planned, shipped to the workers (small:
    a row per topic and per ledger of the catalog)."""

    scope: frozenset[int]
    old_stable: dict[str, int]
    ledgers: dict[str, list[tuple[str, int, int]]]
    spared: tuple[tuple[str, int], ...]
    retained: tuple[tuple[str, int], ...]

    def __call__(self, key: tuple[pa.Scalar, ...], narrow: pa.Table, state: pa.Table) -> pa.Table:
        topic = key[0].as_py()
        state_tables = {name: _of_kind(state, name) for name in STATE_SCHEMAS}
        narrow = narrow.select(list(NARROW_COLUMNS))
        if not narrow.num_rows:
            narrow = arrow_schema(STATE_SCHEMAS[BUFFER_PENDING_ENTRIES]).empty_table().select(list(NARROW_COLUMNS))
        decided = kernel.scope_tables(
            narrow, set(self.scope), lambda table, rows: state_tables[table].filter(rows), self.old_stable,
            self.ledgers.get(topic, []), self.spared, self.retained)
        return _decisions(decided, topic)


# Rows a Python worker folds at once (whole ledgers: a chunk ends at the first ledger past it):
# enough that each chunk's fixed costs vanish, few enough that a worker stays well within 2 GiB.
FOLD_CHUNK_ENTRIES = 1_000_000


def _topic_runs(batch: pa.RecordBatch) -> Iterator[pa.RecordBatch]:
    """The runs of one topic of a batch sorted by topic."""
    topics = batch.column("topic")
    n = batch.num_rows
    if n == 0:
        return
    changes = pc.indices_nonzero(pc.not_equal(topics.slice(1), topics.slice(0, n - 1))).to_numpy() + 1
    bounds = [0, *changes.tolist(), n]
    for start, end in zip(bounds, bounds[1:]):
        yield batch.slice(start, end - start)


def ledger_chunks(batches: Iterable[pa.RecordBatch], entries: int) -> Iterator[pa.Table]:
    """Batches sorted by (topic, ledger_id, entry_id) as tables of whole ledgers of one topic: each
    of at least `entries` rows (but a topic's last), ending at a ledger's end; each in one piece
    (the kernel's steps over a table of many small batches cost several times more)."""
    held: list[pa.RecordBatch] = []
    count = 0
    for batch in batches:
        for run in _topic_runs(batch):
            if held and held[0].column("topic")[0] != run.column("topic")[0]:
                yield pa.Table.from_batches(held).combine_chunks()
                held, count = [], 0
            held.append(run)
            count += run.num_rows
            if count < entries:
                continue
            table = pa.Table.from_batches(held)
            ledger = table["ledger_id"]
            cut = pc.index(ledger, ledger[-1]).as_py()  # the last ledger may go on in the next batch
            if cut > 0:
                yield table.slice(0, cut).combine_chunks()
                held, count = table.slice(cut).to_batches(), table.num_rows - cut
    if held:
        yield pa.Table.from_batches(held).combine_chunks()


@dataclass(frozen=True)
class _FullRun:
    """A partition's topics, each folded by the kernel in chunks of `chunk_entries` (`decide_full`), as union rows."""

    chunk_entries: int

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return _fold_partition(batches, self.chunk_entries)


def _fold_partition(batches: Iterator[pa.RecordBatch], chunk_entries: int) -> Iterator[pa.RecordBatch]:
    chunks = ledger_chunks(batches, chunk_entries)
    for topic, topic_chunks in itertools.groupby(chunks, key=lambda chunk: chunk["topic"][0].as_py()):
        decided = None
        for decided in kernel.fold_scopes(topic_chunks):
            yield from _decisions(decided, topic, stable=False).to_batches()
        yield from _as_union({STABLE_POSITIONS: decided.tables[STABLE_POSITIONS]}, OUTPUT_SCHEMA, topic).to_batches()


def decision_schema(name: str) -> StructType:
    """The columns of the kernel's table `name` as read from its output: the group's `topic` first
    when its own columns do not hold it."""
    schema = DECISION_SCHEMAS[name]
    return schema if "topic" in schema.fieldNames() else StructType([StructField("topic", StringType()), *schema.fields])


@dataclass
class SparkDecisions:
    """The kernel's outputs on Spark, persisted once and read per table."""

    frame: DataFrame

    def table(self, name: str) -> DataFrame:
        """Table `name`'s rows in `decision_schema(name)`."""
        own = set(DECISION_SCHEMAS[name].fieldNames())
        return self.frame.where(F.col("kind") == name).select(*[
            F.col(f"{name}.{f.name}" if f.name in own else f.name).cast(f.dataType).alias(f.name)
            for f in decision_schema(name).fields])

    def violations(self) -> dict[str, int]:
        row = self.table("violations").agg(*[F.coalesce(F.sum(v), F.lit(0)).alias(v) for v in VIOLATIONS]).first()
        return {v: int(row[v]) for v in VIOLATIONS}

    def unpersist(self) -> None:
        self.frame.unpersist()


def topic_partitions(spark, topics: Iterable[str]) -> int:
    """The fewest partitions (from one per topic up) in which, hash-partitioned by topic, no two of
    `topics` share one, so the kernel's topics run on as many cores as there are topics: by the
    shuffle's default partitions, topics land in one task together (and adaptive execution
    coalesces small ones). Past `SPREAD_MAX_PARTITIONS` a partitioning with the fewest topics in
    one partition is taken. Spark computes the topics' hashes (a local projection)."""
    names = sorted(set(topics))
    if len(names) < 2:
        return 1
    hashes = [r[0] for r in local_frame(spark, [(t,) for t in names], "topic string").select(F.hash("topic")).collect()]

    def most_in_one(n: int) -> int:  # Spark's partition: pmod(hash, n), as Python's % for n > 0
        return max(Counter(h % n for h in hashes).values())

    candidates = range(len(names), max(len(names), SPREAD_MAX_PARTITIONS) + 1)
    return next((n for n in candidates if most_in_one(n) == 1), None) or min(candidates, key=lambda n: (most_in_one(n), n))


def spread_topics(narrow: DataFrame, topics: Iterable[str] | None) -> DataFrame:
    """`narrow` hash-partitioned by topic: into `topic_partitions` of `topics` (the log's, from
    the catalog), or None: the shuffle's default partitions."""
    if topics is None:
        return narrow.repartition("topic")
    return narrow.repartition(topic_partitions(narrow.sparkSession, topics), "topic")


SPREAD_MAX_PARTITIONS = 64  # most of them empty: an empty task costs milliseconds


def decide_full(entries: DataFrame, persist: bool = True, topics: Iterable[str] | None = None,
                chunk_entries: int = FOLD_CHUNK_ENTRIES) -> SparkDecisions:
    """The kernel over every topic of `entries` (ledger_entries rows), with no state; `persist`:
    computed once for all the tables read (else each read of a table runs it again); `topics`: the
    log's (from the catalog), to give each a partition of its own (`spread_topics`);
    `chunk_entries`: the rows a worker folds at once (`ledger_chunks`)."""
    narrow = spread_topics(entries.select(*NARROW_COLUMNS), topics)
    # Each partition in position order, streamed to the kernel: a topic never has to fit a worker whole.
    decided = narrow.sortWithinPartitions("topic", "ledger_id", "entry_id").mapInArrow(
        _FullRun(chunk_entries), OUTPUT_SCHEMA)
    return SparkDecisions(decided.persist(StorageLevel.MEMORY_AND_DISK) if persist else decided)


@dataclass
class BufferTables:
    """The buffer's tables of a whole log by the kernel on Spark, computed once when first read;
    `unpersist()` when done. `entries`: the log's full rows, for `committed_entries`."""

    decided: SparkDecisions
    entries: DataFrame

    @property
    def txn_markers(self) -> DataFrame:
        return self.decided.table(TXN_MARKERS)

    @property
    def aborted_txns(self) -> DataFrame:
        return self.decided.table(ABORTED_TXNS)

    @property
    def stable_positions(self) -> DataFrame:
        return self.decided.table(STABLE_POSITIONS)

    @property
    def committed_entries(self) -> DataFrame:
        return committed_rows(self.decided, self.entries.select(*LEDGER_ENTRY_COLUMNS))

    @property
    def violations(self) -> dict[str, int]:
        return self.decided.violations()

    def unpersist(self) -> None:
        self.decided.unpersist()


def compute_buffer_tables(entries: DataFrame) -> BufferTables:
    """`BufferTables` of `entries` (ledger_entries rows)."""
    require_ledger_entries(entries)
    return BufferTables(decide_full(entries), entries)


def decide_scope(entries: DataFrame, state: Mapping[str, DataFrame], topics: Iterable[str], scope: Iterable[int],
                 old_stable: Mapping[str, int], ledgers: Iterable[tuple[str, int, int]], spared: Iterable[tuple[str, int]],
                 retained: Iterable[tuple[str, int]]) -> SparkDecisions:
    """The kernel over the scope's entries, each topic cogrouped with the state rows it may read.

    `state`: per state table (`STATE_SCHEMAS`), the kept rows a topic's run may ask for (a superset:
    the kernel filters them exactly); `topics`: every topic to decide (the catalog's), so each gets
    its stable position even without entries in the scope, and a partition of its own
    (`topic_partitions`, both sides partitioned alike: the cogroup shuffles nothing more).
    """
    by_topic: dict[str, list[tuple[str, int, int]]] = {}
    for topic, ledger, last in ledgers:
        by_topic.setdefault(topic, []).append((topic, ledger, last))
    run = _ScopeRun(frozenset(int(i) for i in scope), dict(old_stable), by_topic, tuple(spared), tuple(retained))

    rows = [_union_rows(state[name], name, STATE_SCHEMAS) for name in STATE_SCHEMAS]
    names = sorted(set(topics))
    spark = entries.sparkSession
    rows.append(_union_rows(local_frame(spark, [(t,) for t in names], "topic string"), _TOPIC_ONLY, STATE_SCHEMAS))
    state_rows = rows[0]
    for frame in rows[1:]:
        state_rows = state_rows.unionByName(frame)
    partitions = topic_partitions(spark, names)
    state_rows = state_rows.repartition(partitions, "topic")
    narrow = entries.select(*NARROW_COLUMNS).repartition(partitions, "topic")

    def decide(key: tuple[pa.Scalar, ...], narrow: pa.Table, state: pa.Table) -> pa.Table:
        return run(key, narrow, state)  # a plain function: PySpark counts its parameters

    decided = narrow.groupBy("topic").cogroup(state_rows.groupBy("topic")).applyInArrow(decide, OUTPUT_SCHEMA)
    return SparkDecisions(decided.persist(StorageLevel.MEMORY_AND_DISK))


def segment_bytes() -> Column:
    """What a row of the VISIBLE segments costs in a broadcast: its codes, its targets, its ids."""
    return F.size(f"{VISIBLE}.codes") * 8 + F.size(f"{VISIBLE}.targets") * 16 + NARROW_ROW_BYTES


def committed_rows(decided: SparkDecisions, rows: DataFrame, broadcast_max_bytes: int = BROADCAST_MAX_BYTES,
                   small: Mapping[str, pa.Table] | None = None) -> DataFrame:
    """`committed_entries`: the full `rows` the kernel decided visible, with its decisions, looked
    up in its segments (`kernel.visible_segments`) by (topic, ledger) and entry id; the segments
    broadcast while they fit `broadcast_max_bytes`, else joined by shuffle. `in_stable_prefix`
    against the run's final stable positions: a topic folded in chunks (`kernel.fold_scopes`)
    stamped its early rows against an earlier one, as `refresh._move_stable_prefix` restamps
    the rows a run does not rewrite. `small`: the decisions the driver holds (`collect_narrow`),
    from which the segments and stable positions are broadcast without a job over `decided`."""
    spark = rows.sparkSession
    if small is not None and VISIBLE in small:
        segments = F.broadcast(local_frame(spark, small[VISIBLE], decision_schema(VISIBLE)))
    else:
        segments = decided.table(VISIBLE)
        # Broadcast while the segments fit: the full rows then stream past them, never shuffled.
        size = decided.frame.where(F.col("kind") == VISIBLE).agg(F.sum(segment_bytes())).first()[0] or 0
        if size <= broadcast_max_bytes:
            segments = F.broadcast(segments)
    joined = rows.join(segments, ["topic", "ledger_id"]).where(F.col("entry_id").between(F.col("first_entry_id"), F.col("last_entry_id")))
    code = F.get(F.col("codes"), (F.col("entry_id") - F.col("first_entry_id")).cast("int"))
    joined = joined.withColumn("_code", code).where(F.col("_code") >= 0)
    code = F.col("_code")
    stable = (local_frame(spark, small[STABLE_POSITIONS], decision_schema(STABLE_POSITIONS)) if small is not None
              else decided.table(STABLE_POSITIONS)).select(
        "topic", F.col("max_read_ledger_id").alias("_sl"), F.col("max_read_entry_id").alias("_se"))
    joined = joined.join(F.broadcast(stable), "topic")  # a row per topic
    own = code.bitwiseAND(1) == 1
    target = F.get(F.col("targets"), F.shiftright(code, kernel.CODE_TARGET_SHIFT).bitwiseAND(kernel.CODE_TARGET_MASK).cast("int"))
    decided_rows = joined.select(
        *LEDGER_ENTRY_COLUMNS,
        F.when(own, F.col("ledger_id")).otherwise(target["ledger_id"]).alias("visible_ledger_id"),
        F.when(own, F.col("entry_id")).otherwise(target["entry_id"]).alias("visible_entry_id"),
        F.shiftright(code, kernel.CODE_SEQ_SHIFT).alias("local_seq"),
        F.expr(at_or_before_sql("ledger_id", "entry_id", "_sl", "_se")).alias("in_stable_prefix"),
    )
    return conform(decided_rows, COMMITTED_ENTRIES_SCHEMA)


# The decisions without entry rows (a row per transaction and ledger at most), the rows to keep
# pending, and the violation counts: what `collect_narrow` brings to the driver in one job.
SMALL_KINDS = (*NARROW_TABLES, PENDING, "violations")


def collect_narrow(decided: SparkDecisions, max_bytes: int) -> dict[str, pa.Table] | None:
    """`SMALL_KINDS` as Arrow tables (the narrow tables in their schemas), collected in one Spark
    job when together they fit `max_bytes` (`NARROW_ROW_BYTES` a row), else None: one count and one
    collect instead of a count and a collect per table. The VISIBLE segments come too when they
    fit as well (`segment_bytes`), for `committed_rows` to broadcast from the driver."""
    if max_bytes < NARROW_ROW_BYTES:
        return None
    is_small = F.col("kind").isin(list(SMALL_KINDS))
    sizes = decided.frame.agg(F.count(F.when(is_small, 1)).alias("rows"),
                              F.sum(F.when(F.col("kind") == VISIBLE, segment_bytes())).alias("segments")).first()
    small_bytes = sizes["rows"] * NARROW_ROW_BYTES
    if small_bytes > max_bytes:
        return None
    kinds = [*SMALL_KINDS, *([VISIBLE] if small_bytes + (sizes["segments"] or 0) <= max_bytes else [])]
    union = decided.frame.where(F.col("kind").isin(kinds)).select("topic", "kind", *kinds).toArrow()
    small = {name: _of_kind(union, name) for name in kinds}
    if VISIBLE in small:  # in `decision_schema(VISIBLE)`, as `SparkDecisions.table` gives them
        small[VISIBLE] = small[VISIBLE].add_column(0, "topic", union.filter(pc.equal(union["kind"], VISIBLE))["topic"])
    return {name: kernel.conform(table, TABLE_SCHEMAS[name]) if name in NARROW_TABLES else table
            for name, table in small.items()}


def violations_of(small: Mapping[str, pa.Table]) -> dict[str, int]:
    """The violation totals of collected decisions (`collect_narrow`)."""
    counts = small["violations"]
    return {v: int(pc.sum(counts[v]).as_py() or 0) for v in VIOLATIONS}


def wide_tables(decided: SparkDecisions, entries: DataFrame, pending_rows: DataFrame | None = None,
                small: Mapping[str, pa.Table] | None = None,
                broadcast_max_bytes: int = BROADCAST_MAX_BYTES) -> dict[str, DataFrame | pa.Table]:
    """Every table of the run: the kernel's narrow tables, and the full rows it decided on joined in.

    `entries`: the scope's full rows; `pending_rows`: the stored pending rows of older ledgers a
    commit in the scope can make visible (full rows; None for a run with no state); `small`: the
    narrow decisions when collected (`collect_narrow`), which are then returned as Arrow; the
    decisions not collected are broadcast while they fit `broadcast_max_bytes`, else joined by shuffle."""
    tables = {name: small[name] if small else decided.table(name) for name in NARROW_TABLES}
    rows = entries.select(*LEDGER_ENTRY_COLUMNS)
    if pending_rows is not None:
        rows = rows.unionByName(pending_rows.select(*LEDGER_ENTRY_COLUMNS))
    tables[COMMITTED_ENTRIES] = committed_rows(decided, rows, broadcast_max_bytes, small)
    # Only the ledgers that hold pending rows are read again.
    if small:
        pending = local_frame(entries.sparkSession, small[PENDING], decision_schema(PENDING))
        ledgers = sorted(set(small[PENDING]["ledger_id"].to_pylist()))
    else:
        pending = decided.table(PENDING)
        # The ledgers and the rows in one job; broadcast while they fit: else Spark plans by the size of
        # the whole persisted frame and shuffles every full row of those ledgers to meet a few.
        per_ledger = pending.groupBy("ledger_id").count().collect()
        ledgers = sorted(r.ledger_id for r in per_ledger)
        if sum(r["count"] for r in per_ledger) * NARROW_ROW_BYTES <= broadcast_max_bytes:
            pending = F.broadcast(pending)
    tables[BUFFER_PENDING_ENTRIES] = entries.where(F.col("ledger_id").isin(ledgers) if ledgers else F.lit(False)).select(
        *LEDGER_ENTRY_COLUMNS).join(pending, list(POSITION_COLUMNS), "left_semi")
    return tables


def state_reads(state: Mapping[str, DataFrame], entries: DataFrame, old_stable: Mapping[str, int],
                key_rows: int | None = None, broadcast_max_bytes: int = BROADCAST_MAX_BYTES) -> dict[str, DataFrame]:
    """The kept state rows the scope's topics may read (a superset of what `scope_tables` asks):
    the sequence ranges of the scope's producers; the `buffer_ledger_txns` and pending rows of
    the transactions the scope touches or that may still be ongoing (kept data, no marker, at or
    after the topic's stored stable ledger).

    `key_rows`: a bound on the rows those producers and transactions come from (the scope's
    entries and the stored `buffer_ledger_txns` rows), if known. Within `broadcast_max_bytes`
    they are broadcast as they are, and the state tables are filtered where they are read; else
    (or unknown) they are de-duplicated and the joins left to Spark, which shuffles the state
    tables to meet them."""
    broadcast = key_rows is not None and key_rows * NARROW_ROW_BYTES <= broadcast_max_bytes

    def keys_of(frame: DataFrame) -> DataFrame:
        return F.broadcast(frame) if broadcast else frame.distinct()

    producers = keys_of(entries.where(F.col("producer_id").isNotNull()).select("topic", "producer_id"))
    ranges = state[BUFFER_SEQUENCE_RANGES].join(producers, ["topic", "producer_id"], "left_semi")
    ledger_txns = state[BUFFER_LEDGER_TXNS]
    stable = local_frame(entries.sparkSession, list(old_stable.items()), "topic string, _sl long")
    maybe_ongoing = (
        ledger_txns.where((F.col("marker_count") == 0) & F.col("data_entry_id").isNotNull())
        .join(F.broadcast(stable), "topic", "left")
        .where(F.col("_sl").isNull() | (F.col("ledger_id") >= F.col("_sl")))
        .select(*TXN_KEY)
    )
    touched = entries.where(F.col("txn_least_bits").isNotNull()).select(*TXN_KEY)
    keys = keys_of(touched.unionByName(maybe_ongoing))
    return {
        BUFFER_SEQUENCE_RANGES: ranges,
        BUFFER_LEDGER_TXNS: ledger_txns.join(keys, list(TXN_KEY), "left_semi"),
        BUFFER_PENDING_ENTRIES: state[BUFFER_PENDING_ENTRIES].join(keys, list(TXN_KEY), "left_semi"),
    }
