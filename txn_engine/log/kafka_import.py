"""`txnlake import-kafka`: Kafka segments into `ledger_entries` through ingest's validated,
idempotent, crash-safe append (`ingest.validate`, `ingest.append_validated`).

Segments are parsed on Spark in the JVM with Kafka's own record classes, a segment per task
(`io.txnlake.kafka.SegmentReader`, `resources/java`), once, as the append writes them. The
transactions open where a segment starts are known before: a scan of the earlier segments'
batch headers (`SegmentReader.scan`) and the stored rows before the import, chained in the
driver (`kafka_log.open_before`). A batch that cannot be read is quarantined with its segment and
byte position (rule `corrupt_batch`). `verify_against_index` compares `aborted_txns` with the
segments' `.txnindex`. See docs/kafka-import.md.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from py4j.java_gateway import JavaClass
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from txn_engine.core.errors import InputFileError, KafkaJarsMissingError
from txn_engine.core.schema import ABORTED_TXNS, LEDGER_ENTRIES, LEDGER_ENTRY_COLUMNS
from txn_engine.log import kafka_log
from txn_engine.log.ingest import IngestSummary, append_validated, validate
from txn_engine.log.input_files import check_readable_by_executors
from txn_engine.log.ledgers import ledger_ranges
from txn_engine.storage.arrow_frames import local_frame
from txn_engine.storage.warehouse import Warehouse

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


def _reader(spark: SparkSession):
    """`io.txnlake.kafka.SegmentReader`; KafkaJarsMissingError when the session started without its jar."""
    reader = spark.sparkContext._jvm.io.txnlake.kafka.SegmentReader
    if not isinstance(reader, JavaClass):  # py4j names a class it cannot load as a package
        raise KafkaJarsMissingError(
            "the Kafka segment reader (kafka-clients and txnlake's reader jar) is not on this Spark session's class "
            "path: run `make setup` (it fetches and builds them into the jar cache), then run the import in a new process")
    return reader


def _spec(segment: Segment, open_before: dict[int, int] | None = None) -> str:
    """A segment as `SegmentReader` takes it: path, topic, base offset, the transactions open before it."""
    txns = ",".join(f"{pid}:{first}" for pid, first in sorted((open_before or {}).items()))
    return f"{segment.path}\t{segment.topic}\t{segment.base_offset}\t{txns}"


def scan_segments(spark: SparkSession, segments: Sequence[Segment]) -> dict[str, tuple[dict[int, tuple[int, bool]], set[int]]]:
    """{path: (the transactions open at its end: {producer: (provisional first offset, carried)},
    the producers with a transaction open where it starts)}, from batch headers (a Spark job)."""
    if not segments:
        return {}
    out = {}
    for line in _reader(spark).scan(spark._jsparkSession, [_spec(s) for s in segments]):
        path, ends, carried = str(line).split("\t")
        out[path] = ({int(pid): (int(first), carry == "1") for pid, first, carry in
                      (e.split(":") for e in ends.split(",") if e)},
                     {int(pid) for pid in carried.split(",") if pid})
    return out


def transactions_open_before(warehouse: Warehouse, segments: Sequence[Segment]) -> dict[str, dict[int, int]]:
    """{segment path: {producer id: first offset}}: the transactions open where each segment
    starts, from the stored rows before the import and the earlier segments' batch headers (the
    last segment of a partition is not scanned: nothing comes after it)."""
    by_topic: dict[str, list[Segment]] = {}
    for s in segments:
        by_topic.setdefault(s.topic, []).append(s)
    firsts = {topic: min(s.base_offset for s in group) for topic, group in by_topic.items()}
    initial = _stored_open_txns(warehouse, firsts)
    scanned = scan_segments(warehouse.spark, [s for group in by_topic.values() for s in sorted(group, key=lambda s: s.base_offset)[:-1]])
    out = {}
    for topic, group in by_topic.items():
        group = sorted(group, key=lambda s: s.base_offset)
        chain = [(s.base_offset, *scanned[s.path]) for s in group[:-1]] + [(group[-1].base_offset, {}, set())]
        before = kafka_log.open_before(chain, initial.get(topic))
        out.update((s.path, before[s.base_offset]) for s in group)
    return out


def parse_segments(spark: SparkSession, segments: Sequence[Segment], open_before: dict[str, dict[int, int]] | None = None,
                   done=None) -> DataFrame:
    """Every record of the segments as a row of `SegmentReader.SCHEMA`, a segment per task, each
    carried transaction given its first offset from `open_before` ({path: {producer: first
    offset}}); each segment's "path\trecords" added to `done` (a JVM CollectionAccumulator) as it is read."""
    specs = [_spec(s, (open_before or {}).get(s.path)) for s in segments]
    return DataFrame(_reader(spark).parse(spark._jsparkSession, specs, done), spark)


def parsed_accumulator(spark: SparkSession):
    """A JVM accumulator of "path\trecords" lines, one per segment read (a task run again repeats its line)."""
    sc = spark.sparkContext._jsc.sc()
    acc = spark.sparkContext._jvm.org.apache.spark.util.CollectionAccumulator()
    sc.register(acc, "txnlake import-kafka segments parsed")
    return acc


def _parsed_lines(acc) -> list[tuple[str, int]]:
    return [(path, int(records)) for path, _, records in (str(line).rpartition("\t") for line in list(acc.value()))]


def _parsed_so_far(acc) -> dict[str, int]:
    return dict(_parsed_lines(acc))


@contextmanager
def partition_progress(segments: Sequence[Segment], done, progress: Callable[[str], None],
                       started: float, poll_s: float = 0.5) -> Iterator[None]:
    """While the body runs (the jobs that parse), a line per partition as its last segment is
    parsed (`done`: `parsed_accumulator`): its segments, records and the seconds since `started`;
    the rest when the body ends."""
    wanted: dict[str, set[str]] = {}
    for s in segments:
        wanted.setdefault(s.topic, set()).add(s.path)
    reported: set[str] = set()

    def report() -> None:
        parsed = _parsed_so_far(done)
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


def as_raw_rows(parsed: DataFrame) -> DataFrame:
    """The parsed rows in the shape `ingest.validate` reads: `line` is the record's offset (a
    batch that cannot be read: its byte position), a corrupt batch a parse error of its own rule.
    The key's bytes go as `key_bytes` alone: validation keeps those that are UTF-8 as `key`."""
    error = F.col("error").isNotNull()
    return parsed.withColumn("key", F.lit(None).cast("string")).select(
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
    # How many times each segment was parsed: once, unless Spark ran a task again.
    segment_reads: Counter[str] = field(default_factory=Counter)

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
    _reader(spark)
    topics = sorted({s.topic for s in segments})
    progress(f"import-kafka: {len(segments)} segment(s) of {len(topics)} partition(s): {', '.join(topics[:10])}"
             + (" ..." if len(topics) > 10 else ""))
    open_before = transactions_open_before(warehouse, segments)
    done = parsed_accumulator(spark)
    rows = parse_segments(spark, segments, open_before, done)
    with partition_progress(segments, done, progress, started):
        # A task parses a whole segment in offset order: ledgers in position order, written as they come.
        # A position repeats only in a ledger read from two files: a segment's offsets strictly
        # increase (`SegmentReader` quarantines a batch where they do not), so no job looks for them.
        files_per_ledger = Counter((s.topic, s.base_offset) for s in segments)
        summary = append_validated(warehouse, validate(as_raw_rows(rows)), [s.path for s in segments], in_position_order=True,
                                   input_ledgers={ledger: n > 1 for ledger, n in files_per_ledger.items()},
                                   count_while_writing=True)
    result = KafkaImportSummary(segments, summary, Counter(path for path, _ in _parsed_lines(done)))
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
