"""`txnlake import-kafka`: Kafka segments into `ledger_entries` through ingest's validated,
idempotent, crash-safe append (`ingest.validate`, `ingest.append_validated`).

Segments are parsed on Spark, a file per task (`binaryFile` + `mapInArrow`, `kafka_log`); the
transactions carried across segments are resolved in the driver from a row per (segment,
producer) and the stored rows before the import. A batch that cannot be read is quarantined
with its segment and byte position (rule `corrupt_batch`). `verify_against_index` compares
`aborted_txns` with the segments' `.txnindex`. See docs/kafka-import.md.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import pyarrow as pa
from pyspark import Accumulator, AccumulatorParam, StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from txn_engine.core.errors import InputFileError
from txn_engine.core.schema import ABORTED_TXNS, LEDGER_ENTRIES, LEDGER_ENTRY_COLUMNS
from txn_engine.log import kafka_log
from txn_engine.log.ingest import IngestSummary, append_validated, validate
from txn_engine.log.input_files import check_readable_by_executors
from txn_engine.log.ledgers import ledger_ranges
from txn_engine.storage.arrow_frames import local_frame
from txn_engine.storage.warehouse import Warehouse

PARSED_DDL = (
    "topic string, ledger_id bigint, entry_id bigint, entry_type string, txn_most_bits bigint, "
    "txn_least_bits bigint, producer_id bigint, producer_epoch int, sequence_id bigint, publish_time timestamp, "
    "key string, payload binary, key_bytes binary, headers array<struct<key:string,value:binary>>, "
    "timestamp_type string, batch_position bigint, carry boolean, error string, source_file string"
)
CORRUPT_BATCH = "corrupt_batch"
# Kafka's own partitions (consumer offsets, transaction state, the metadata log) are no topic's data.
INTERNAL_PREFIX = "__"
# Folders the broker is deleting or moving (`<topic>-<partition>.<id>-delete`, `-future`) match no partition name.


@dataclass(frozen=True)
class Segment:
    path: str  # qualified URI
    topic: str
    base_offset: int


def resolve_segments(spark: SparkSession, paths: Sequence[str]) -> list[Segment]:
    """Every segment the paths name (a log directory, `<topic>-<partition>` folders, `.log` files),
    each checked to be a record-batch-v2 segment before anything is parsed."""
    if not paths:
        raise InputFileError("no input given; name a Kafka log directory, <topic>-<partition> folders or .log segment files")
    jvm = spark.sparkContext._jvm
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    found: dict[str, Segment] = {}
    check_readable_by_executors(paths, spark.sparkContext.master)
    for raw in paths:
        path = jvm.org.apache.hadoop.fs.Path(raw)
        fs = path.getFileSystem(conf)
        if not fs.exists(path):
            raise InputFileError(f"{raw} does not exist; nothing was imported")
        status = fs.getFileStatus(path)
        if not status.isDirectory():
            files = [status]
        elif kafka_log.PARTITION_DIR.match(path.getName()) and not path.getName().startswith(INTERNAL_PREFIX):
            files = list(fs.listStatus(path))
        else:
            files = [f for d in fs.listStatus(path) if d.isDirectory() and kafka_log.PARTITION_DIR.match(d.getPath().getName())
                     and not d.getPath().getName().startswith(INTERNAL_PREFIX) for f in fs.listStatus(d.getPath())]
        segments = []
        for f in files:
            uri = str(fs.makeQualified(f.getPath()).toString())
            name = kafka_log.segment_name(uri)
            if name is None:
                if not status.isDirectory():
                    raise InputFileError(f"{raw} is not a Kafka segment: a segment is a <20-digit base offset>.log file in a "
                                         "<topic>-<partition> folder; nothing was imported")
                continue
            head = _read_bytes(jvm, fs, f.getPath(), min(17, f.getLen()))
            try:
                kafka_log.check_format(uri, head)
            except kafka_log.SegmentFormatError as exc:
                raise InputFileError(f"{exc}; nothing was imported") from None
            segments.append(Segment(uri, name.topic, name.base_offset))
        if not segments:
            raise InputFileError(f"{raw} holds no Kafka segment (<topic>-<partition>/<base offset>.log); nothing was imported")
        found.update((s.path, s) for s in segments)
    return sorted(found.values(), key=lambda s: (s.topic, s.base_offset))


def _read_bytes(jvm, fs, path, size: int | None = None) -> bytes:
    """A file's first `size` bytes (all when None) through Hadoop's file system, closed after."""
    stream = fs.open(path)
    try:
        io = jvm.org.apache.commons.io.IOUtils
        return bytes(io.toByteArray(stream) if size is None else io.toByteArray(stream, size))
    finally:
        stream.close()


class _SegmentsParsed(AccumulatorParam):
    """{segment path: records}: what the parse tasks have done, as they finish (a task run again
    adds nothing)."""

    def zero(self, value: dict) -> dict:
        return {}

    def addInPlace(self, a: dict, b: dict) -> dict:
        a.update(b)
        return a


def parse_segments(spark: SparkSession, segments: Sequence[Segment], done: Accumulator | None = None) -> DataFrame:
    """The rows of `kafka_log.PARSED_SCHEMA` (plus `source_file`) of every segment, carries
    unresolved; each segment's path and record count added to `done` as it is parsed."""

    def parse_files(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        # mapInArrow over `binaryFile` rows (runs in Spark's Python workers).
        for batch in batches:
            contents = batch.column("content")
            for i, path in enumerate(batch.column("path").to_pylist()):
                name = kafka_log.segment_name(path)
                table = kafka_log.parse_segment(name.topic, name.base_offset, contents[i].as_py())
                table = table.append_column("source_file", pa.array([path] * table.num_rows, pa.string()))
                yield from table.to_batches()
                if done is not None:
                    done.add({path: table.num_rows})

    files = spark.read.format("binaryFile").load([s.path for s in segments])
    return files.mapInArrow(parse_files, PARSED_DDL)


@contextmanager
def partition_progress(segments: Sequence[Segment], done: Accumulator, progress: Callable[[str], None],
                       started: float, poll_s: float = 0.5) -> Iterator[None]:
    """While the body runs (the job that parses), a line per partition as its last segment is
    parsed: its segments, records and the seconds since `started`; the rest when the body ends."""
    wanted: dict[str, set[str]] = {}
    for s in segments:
        wanted.setdefault(s.topic, set()).add(s.path)
    reported: set[str] = set()

    def report() -> None:
        parsed = dict(done.value)
        for topic in sorted(wanted):
            if topic not in reported and wanted[topic] <= parsed.keys():
                reported.add(topic)
                records = sum(parsed[p] for p in wanted[topic])
                progress(f"  {topic}: parsed {len(wanted[topic])} segment(s), {records} records, "
                         f"{time.monotonic() - started:.1f}s")

    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(poll_s):
            report()

    watcher = threading.Thread(target=watch, name="txnlake-import-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
    report()


def _stored_open_txns(warehouse: Warehouse, firsts: dict[str, int]) -> dict[str, dict[int, int]]:
    """Per topic, the transactions open (data, no marker yet) in the stored ledgers before the
    import's first segment of that topic: {producer id: first offset}."""
    if not warehouse.exists(LEDGER_ENTRIES):
        return {}
    before = {r["topic"] for r in ledger_ranges(warehouse).to_pylist()
              if r["topic"] in firsts and r["ledger_id"] < firsts[r["topic"]]}
    if not before:
        return {}
    spark = warehouse.spark
    bounds = local_frame(spark, [(t, firsts[t]) for t in sorted(before)], "topic string, _first bigint")
    last = (warehouse.read(LEDGER_ENTRIES).join(F.broadcast(bounds), "topic")
            .where((F.col("ledger_id") < F.col("_first")) & F.col("txn_most_bits").isNotNull())
            .groupBy("topic", "txn_most_bits")
            .agg(F.max_by(F.struct("entry_type", "txn_least_bits"), F.struct("ledger_id", "entry_id")).alias("last"))
            .where(F.col("last.entry_type") == "DATA").collect())
    out: dict[str, dict[int, int]] = {}
    for r in last:
        out.setdefault(r["topic"], {})[r["txn_most_bits"]] = r["last"]["txn_least_bits"]
    return out


def resolve_transactions(warehouse: Warehouse, parsed: DataFrame, segments: Sequence[Segment]) -> DataFrame:
    """`parsed` with every carried row's `txn_least_bits` set to its transaction's first offset."""
    per_segment = (parsed.where(F.col("txn_most_bits").isNotNull())
                   .groupBy("topic", "ledger_id", "txn_most_bits")
                   .agg(F.max(F.col("carry").cast("int")).alias("carried"),
                        F.max_by(F.struct("entry_type", "txn_least_bits", "carry"), "entry_id").alias("last"))
                   .collect())
    by_topic: dict[str, dict[int, tuple[dict, set]]] = {}
    for r in per_segment:
        ends, carried = by_topic.setdefault(r["topic"], {}).setdefault(r["ledger_id"], ({}, set()))
        if r["carried"]:
            carried.add(r["txn_most_bits"])
        if r["last"]["entry_type"] == "DATA":
            ends[r["txn_most_bits"]] = (r["last"]["txn_least_bits"], r["last"]["carry"])
    firsts: dict[str, int] = {}
    for s in segments:
        firsts[s.topic] = min(firsts.get(s.topic, s.base_offset), s.base_offset)
    initial = _stored_open_txns(warehouse, firsts)
    mapping = []
    for topic, ledgers in by_topic.items():
        chain = [(ledger, ends, carried) for ledger, (ends, carried) in sorted(ledgers.items())]
        resolved = kafka_log.resolve_carries(chain, initial.get(topic))
        mapping += [(topic, ledger, pid, first) for (ledger, pid), first in resolved.items()]
    if not mapping:
        return parsed
    fix = local_frame(warehouse.spark, mapping, "topic string, ledger_id bigint, txn_most_bits bigint, _first bigint")
    joined = parsed.join(F.broadcast(fix), ["topic", "ledger_id", "txn_most_bits"], "left")
    least = F.when(F.col("carry") & F.col("_first").isNotNull(), F.col("_first")).otherwise(F.col("txn_least_bits"))
    return joined.withColumn("txn_least_bits", least).drop("_first")


def as_raw_rows(parsed: DataFrame) -> DataFrame:
    """The parsed rows in the shape `ingest.validate` reads: `line` is the record's offset (a
    batch that cannot be read: its byte position), a corrupt batch a parse error of its own rule."""
    error = F.col("error").isNotNull()
    return parsed.select(
        "source_file",
        F.when(error, F.col("batch_position")).otherwise(F.col("ledger_id") + F.col("entry_id")).alias("line"),
        F.when(error, F.concat(F.lit("segment bytes from "), F.col("batch_position").cast("string"))).alias("raw"),
        F.when(error, F.concat(F.lit(CORRUPT_BATCH + ":"), F.col("error"), F.lit(" in segment "), F.col("source_file"),
                               F.lit("; nothing of this batch was imported. Restore the segment from a replica or "
                                     "backup and import it again"))).alias("_parse_error"),
        F.lit(None).cast("array<string>").alias("_value_errors"),
        F.lit(None).cast("array<string>").alias("_unknown_columns"),
        *LEDGER_ENTRY_COLUMNS,
    )


@dataclass
class KafkaImportSummary:
    segments: list[Segment]
    ingest: IngestSummary

    def partition_lines(self) -> list[str]:
        counts: dict[str, int] = {}
        for s in self.segments:
            counts[s.topic] = counts.get(s.topic, 0) + 1
        out = []
        for topic in sorted(counts):
            by = self.ingest.rows_by_topic.get(topic, {})
            out.append(f"  {topic}: {counts[topic]} segment(s), {sum(by.values())} records, {by.get('NEW', 0)} appended, "
                       f"{by.get('PRESENT', 0)} already present, {by.get('QUARANTINED', 0)} quarantined")
        return out


def import_kafka(warehouse: Warehouse, paths: Sequence[str], progress: Callable[[str], None] = lambda line: None) -> KafkaImportSummary:
    """Import Kafka segments into `ledger_entries` (see the module docstring)."""
    started = time.monotonic()
    spark = warehouse.spark
    segments = resolve_segments(spark, paths)
    topics = sorted({s.topic for s in segments})
    progress(f"import-kafka: {len(segments)} segment(s) of {len(topics)} partition(s): {', '.join(topics[:10])}"
             + (" ..." if len(topics) > 10 else ""))
    done = spark.sparkContext.accumulator({}, _SegmentsParsed())
    # Parsed once: the transaction chain and the append both read it.
    parsed = parse_segments(spark, segments, done).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        with partition_progress(segments, done, progress, started):  # the chain's job parses
            rows = resolve_transactions(warehouse, parsed, segments)
        # A task parses whole segments in offset order: ledgers in position order, written as they come.
        summary = append_validated(warehouse, validate(as_raw_rows(rows)), [s.path for s in segments], in_position_order=True)
    finally:
        parsed.unpersist()
    result = KafkaImportSummary(segments, summary)
    for line in result.partition_lines():
        progress(line)
    return result


def index_entries(spark: SparkSession, segments: Sequence[Segment]) -> list[tuple[str, int, int, int]]:
    """(topic, producer id, first offset, last offset) of every `.txnindex` beside the segments."""
    jvm = spark.sparkContext._jvm
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    out = []
    for s in segments:
        path = jvm.org.apache.hadoop.fs.Path(s.path[: -len(".log")] + ".txnindex")
        fs = path.getFileSystem(conf)
        if not fs.exists(path):
            continue
        body = _read_bytes(jvm, fs, path)
        out += [(s.topic, e.producer_id, e.first_offset, e.last_offset) for e in kafka_log.parse_txn_index(body)]
    return out


@dataclass
class IndexComparison:
    """Aborted transactions as (topic, producer id, first offset, last offset), matched by
    (topic, producer id, last offset): the ABORT marker's position names one transaction."""

    only_in_index: list[tuple[str, int, int, int]]
    only_in_aborted_txns: list[tuple[str, int, int, int]]
    # Legitimate differences: an ABORT with no data before it is in our abort set, never in Kafka's
    # index; after the log cleaner removed an aborted transaction's data, the index still has its
    # first offset and our abort set the marker's (pairs: index entry, ours).
    marker_only: list[tuple[str, int, int, int]]
    cleaned: list[tuple[tuple[str, int, int, int], tuple[str, int, int, int]]]

    @property
    def equal(self) -> bool:
        return not self.only_in_index and not self.only_in_aborted_txns


def partition_folders(segment_paths: Sequence[str]) -> list[str]:
    """The `<topic>-<partition>` folders of segment files, once each."""
    return sorted({p.rstrip("/").rpartition("/")[0] for p in segment_paths})


def verify_against_index(warehouse: Warehouse, paths: Sequence[str], skip_missing: bool = False) -> IndexComparison:
    """`aborted_txns` of the imported partitions against the segments' `.txnindex` entries;
    `skip_missing` leaves out paths that no longer exist (a partition the broker deleted)."""
    spark = warehouse.spark
    if skip_missing:
        conf = spark.sparkContext._jsc.hadoopConfiguration()
        hadoop_path = spark.sparkContext._jvm.org.apache.hadoop.fs.Path
        paths = [p for p in paths if hadoop_path(p).getFileSystem(conf).exists(hadoop_path(p))]
        if not paths:
            return IndexComparison([], [], [], [])
    segments = resolve_segments(spark, paths)
    topics = sorted({s.topic for s in segments})
    if not warehouse.exists(ABORTED_TXNS):
        raise InputFileError("aborted_txns does not exist yet; run `txnlake run` after the import, then verify")
    index = {(t, pid, last): (t, pid, first, last) for t, pid, first, last in index_entries(spark, segments)}
    # The index holds the aborts of segments still on disk: compare from each partition's first one.
    firsts: dict[str, int] = {}
    for s in segments:
        firsts[s.topic] = min(firsts.get(s.topic, s.base_offset), s.base_offset)
    ours = {}
    for r in warehouse.read(ABORTED_TXNS).where(F.col("topic").isin(topics)).collect():
        last = r["abort_ledger_id"] + r["abort_entry_id"]
        if last >= firsts[r["topic"]]:
            ours[(r["topic"], r["txn_most_bits"], last)] = (r["topic"], r["txn_most_bits"], r["txn_least_bits"], last)
    marker_only = sorted(a for k, a in ours.items() if k not in index and a[2] == a[3])
    cleaned = sorted((index[k], a) for k, a in ours.items() if k in index and index[k] != a and a[2] == a[3])
    differ = sorted((index[k], a) for k, a in ours.items() if k in index and index[k] != a and a[2] != a[3])
    return IndexComparison(
        only_in_index=sorted([a for k, a in index.items() if k not in ours] + [i for i, _ in differ]),
        only_in_aborted_txns=sorted([a for k, a in ours.items() if k not in index and a[2] != a[3]] + [o for _, o in differ]),
        marker_only=marker_only,
        cleaned=cleaned,
    )
