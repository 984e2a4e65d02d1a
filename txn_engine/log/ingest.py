"""Ingest raw ledger entries (JSONL, CSV, Parquet) into `ledger_entries`, validating every row.

Valid rows are appended; each invalid row goes to `quarantine_entries` with the rule it broke,
a readable reason, its source file and line. Ingest is idempotent by position: a row identical
to the stored one at its position is skipped, a different row at a stored position is
quarantined, never overwritten. New rows of a ledger recorded CLOSED, OFFLOADED or DELETED are
not appended (see `classify`). File-level problems (missing, unknown format, unreadable,
missing or unknown columns) are found before anything is written.

Each file is typed by its own format's rules, so a row is stored the same whatever other files
share the ingest: JSONL and CSV values are text (integers, ISO-8601 or epoch-millisecond times,
base64 payloads); a Parquet column keeps its type, and a string column follows the text rules.
An integer publish_time is epoch milliseconds (Pulsar's publishTime) in every format, and a
publish_time outside [2000-01-01, 2262-04-11) UTC is quarantined (see PUBLISH_TIME_RANGE).
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import uuid
from dataclasses import dataclass, field
from functools import reduce
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, Observation, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    ByteType,
    DateType,
    FractionalType,
    IntegerType,
    LongType,
    NullType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
    VariantType,
)
from pyspark.errors import PySparkException
from pyspark.sql.utils import AnalysisException
from py4j.protocol import Py4JJavaError

from txn_engine.core.errors import InputFileError
from txn_engine.log.input_files import (
    _format_of,
    check_input_files,
    format_or_error,
    missing_input,
    no_input_in_folder,
    check_columns,
    unknown_columns_error,
)
from txn_engine.log.ledgers import immutable_ledgers, ledger_ranges
from txn_engine.log.spark_columns import built_per_session
from txn_engine.core.schema import (
    ENTRY_TYPES,
    TIMESTAMP_TYPES,
    LEDGER_ENTRIES,
    LEDGER_ENTRIES_SCHEMA,
    LEDGER_ENTRY_COLUMNS,
    MARKER_TYPES,
    POSITION_COLUMNS,
    QUARANTINE_ENTRIES,
    QUARANTINE_ENTRIES_SCHEMA,
)
from txn_engine.core.settings import WarehouseSettings
from txn_engine.storage.arrow_frames import local_frame
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.storage.s3 import arrow_filesystem
from txn_engine.storage.warehouse import Warehouse, retry_delta_conflicts, stored_frame

# Rows per file ingest writes (about 18 MB of generated entries).
ROWS_PER_FILE = 1_000_000
_ID_COLUMNS = ("ledger_id", "entry_id", "txn_most_bits", "txn_least_bits", "producer_id", "sequence_id")

# Stored publish times, UTC, [start, end). The end is where timestamp[ns] ends (2262-04-11), which
# pandas, delta-rs and the CLI's Arrow reads need; the start is before any message log existed, and
# catches the usual unit mistake: epoch seconds read as milliseconds land in January 1970 (and
# microseconds far past the end).
PUBLISH_TIME_RANGE = (dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc), dt.datetime(2262, 4, 11, tzinfo=dt.timezone.utc))
_RANGE_MS = tuple(int(t.timestamp()) * 1000 for t in PUBLISH_TIME_RANGE)
# Beyond this many milliseconds Spark's timestamp (microseconds in a long) overflows.
_MAX_SPARK_MS = 9_000_000_000_000_000
_INTEGRAL = (ByteType, ShortType, IntegerType, LongType)
# Standard base64, padded: Spark's own decoder skips characters outside the alphabet, so
# "plain text payload" would decode to bytes nobody wrote.
_BASE64 = "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"

# What happened to each input row. IN_DELETED_LEDGER: a position a ledger held before retention
# deleted it (re-ingesting an old file); skipped, since storing it again would resurrect the ledger.
NEW, PRESENT, REPEATED, QUARANTINED = "NEW", "PRESENT", "REPEATED_IN_INPUT", "QUARANTINED"
IN_DELETED_LEDGER = "IN_DELETED_LEDGER"
# String columns of ledger_entries: in JSONL their value must be a JSON string (or null).
_STRING_COLUMNS = tuple(f.name for f in LEDGER_ENTRIES_SCHEMA.fields if isinstance(f.dataType, StringType))
# Gap warnings list this many ledgers at most (the count is always complete).
GAPS_LISTED = 10


@dataclass
class IngestSummary:
    ingest_id: str
    files: list[str]
    rows_read: int = 0
    rows_written: int = 0
    rows_already_present: int = 0
    rows_repeated_in_input: int = 0
    rows_quarantined: int = 0
    rows_in_deleted_ledgers: int = 0
    quarantine_by_rule: dict[str, int] = field(default_factory=dict)
    # Per topic, rows by status (NEW, PRESENT, ...): what an import reports per partition.
    rows_by_topic: dict[str, dict[str, int]] = field(default_factory=dict)
    # Ledgers this ingest appended to whose entry ids are not dense (a warning, not an error):
    # dicts of topic, ledger_id, first_entry_id, last_entry_id, entry_count, missing.
    entry_id_gaps: list[dict] = field(default_factory=list)
    table_location: str = ""
    quarantine_location: str = ""

    def lines(self) -> list[str]:
        out = [
            f"ingest {self.ingest_id}: {len(self.files)} file(s), {self.rows_read} rows read",
            f"  {self.rows_written} appended to ledger_entries ({self.table_location})",
            f"  {self.rows_already_present} already present (skipped), "
            f"{self.rows_repeated_in_input} repeated in the input (skipped)",
        ]
        if self.rows_in_deleted_ledgers:
            out.append(f"  {self.rows_in_deleted_ledgers} of ledgers retention deleted (skipped, not stored again)")
        out.append(f"  {self.rows_quarantined} quarantined to quarantine_entries ({self.quarantine_location})")
        out += [f"    {n} x {rule}" for rule, n in sorted(self.quarantine_by_rule.items())]
        return out + gap_warnings(self.entry_id_gaps)


def gap_warnings(gaps: list[dict]) -> list[str]:
    """The warning lines for `IngestSummary.entry_id_gaps` (also printed by `txnlake ingest`)."""
    if not gaps:
        return []
    out = [
        f"  warning: entry ids not dense in {len(gaps)} ledger(s) written to (BookKeeper numbers a ledger's "
        "entries 0, 1, 2, ...: a gap means entries missing from the input, or a compacted export). "
        "Ingest the missing entries if they exist:"
    ]
    out += [
        f"    {g['topic']}/{g['ledger_id']}: {g['missing']} id(s) missing in {g['first_entry_id']}..{g['last_entry_id']} "
        f"({g['entry_count']} entries)"
        for g in gaps[:GAPS_LISTED]
    ]
    if len(gaps) > GAPS_LISTED:
        out.append(f"    ... and {len(gaps) - GAPS_LISTED} more ledger(s)")
    return out


@dataclass(frozen=True)
class SourceFile:
    path: str
    format: str


def resolve_sources(spark: SparkSession, paths: Sequence[str]) -> list[SourceFile]:
    """Check every path before anything is read: exists, known format, readable."""
    check_input_files(paths, spark.sparkContext.master)
    sources: list[SourceFile] = []
    jvm = spark.sparkContext._jvm
    hadoop_conf = spark.sparkContext._jsc.hadoopConfiguration()
    for raw in paths:
        hpath = jvm.org.apache.hadoop.fs.Path(raw)
        fs = hpath.getFileSystem(hadoop_conf)
        if not fs.exists(hpath):
            raise missing_input(raw)
        qualified = str(fs.makeQualified(hpath).toString())
        if fs.getFileStatus(hpath).isDirectory():
            children = [str(st.getPath().toString()) for st in fs.listStatus(hpath) if st.isFile()]
            found = [c for c in sorted(children) if _format_of(c)] or no_input_in_folder(raw)
            sources += [SourceFile(c, _format_of(c)) for c in found]
            continue
        fmt = format_or_error(raw)
        try:
            fs.open(hpath).close()
        except Exception as exc:  # Py4J wraps the Java IOException
            raise InputFileError(f"cannot read {raw}: {_first_line(exc)}; nothing was ingested") from None
        sources.append(SourceFile(qualified, fmt))
    return sources


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    # Java errors carry their useful cause deep in the trace: prefer a "Caused by" line.
    for line in text.splitlines():
        if line.startswith("Caused by:"):
            return line.removeprefix("Caused by:").strip()[:300]
    return text.splitlines()[0][:300] if text else type(exc).__name__


def read_raw(spark: SparkSession, source: SourceFile, settings: WarehouseSettings | None = None) -> DataFrame:
    """One source file as rows of `source_file, line, raw, <ledger_entries columns>`.

    Text formats keep every column a string (validated later) and number lines from 1 (the CSV
    header is line 1); Parquet keeps its types and numbers rows from 1.
    """
    try:
        if source.format == "parquet":
            return _read_parquet(spark, source, settings or WarehouseSettings())
        lines = _numbered_lines(spark, source.path)
        if source.format == "jsonl":
            return _parse_jsonl(lines, source.path)
        return _parse_csv(spark, lines, source.path)
    except (AnalysisException, Py4JJavaError, PySparkException) as exc:
        hint = ""
        if "TIMESTAMP(NANOS" in str(exc):
            hint = ("; write publish_time as timestamp[us] or as int64 epoch milliseconds (pyarrow: "
                    "pq.write_table(t, path, coerce_timestamps='us', allow_truncated_timestamps=True); "
                    "pandas: df.to_parquet(path, coerce_timestamps='us', allow_truncated_timestamps=True))")
        raise InputFileError(
            f"cannot read {source.path} as {source.format}: {_first_line(exc)}{hint}; nothing was ingested"
        ) from None


def _numbered_lines(spark: SparkSession, path: str) -> DataFrame:
    # Spark has no row index for text files, but every row knows the file block it came from,
    # and rows of one block keep file order: line = lines of earlier blocks + index in block.
    text = (
        spark.read.text(path)
        .select("value", F.col("_metadata.file_block_start").alias("block"))
        .withColumn("mid", F.monotonically_increasing_id())
    )
    blocks = text.groupBy("block").agg(F.count("*").alias("n"), F.min("mid").alias("first_mid"))
    blocks = blocks.withColumn(
        "before", F.coalesce(F.sum("n").over(Window.orderBy("block").rowsBetween(Window.unboundedPreceding, -1)), F.lit(0))
    )
    return (
        text.join(F.broadcast(blocks), "block")
        .select(
            F.lit(path).alias("source_file"),
            (F.col("before") + F.col("mid") - F.col("first_mid") + 1).alias("line"),
            F.col("value").alias("raw"),
        )
    )


# JSONL values are read as their JSON text, except the string columns: those are read as VARIANT
# (one parse still) so a number, object or array given for a string is told apart from a string.
_JSONL_SCHEMA = StructType(
    [StructField(c, VariantType() if c in _STRING_COLUMNS else StringType(), True) for c in LEDGER_ENTRY_COLUMNS]
    + [StructField("_corrupt_record", StringType(), True)]
)
_UNKNOWN_COLUMNS = ArrayType(StringType())


def _parse_jsonl(lines: DataFrame, path: str) -> DataFrame:
    not_blank, parsed, columns = _jsonl_columns()
    return lines.filter(not_blank).withColumn("j", parsed).select(*columns)


@built_per_session
def _jsonl_columns() -> tuple[Column, Column, tuple[Column | str, ...]]:
    """`_parse_jsonl`'s filter of blank lines, its parse of a line (as `j`), and the columns it selects."""
    parsed = F.from_json("raw", _JSONL_SCHEMA, {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": "_corrupt_record"})
    malformed = F.col("j._corrupt_record").isNotNull() | ~F.ltrim("raw").startswith("{")
    columns, value_errors = [], []
    for c in LEDGER_ENTRY_COLUMNS:
        if c not in _STRING_COLUMNS:
            columns.append(F.col(f"j.{c}").alias(c))
            continue
        kind = F.expr(f"schema_of_variant(j.{c})")  # STRING, VOID (JSON null), BIGINT, OBJECT<...>, ...
        text = F.expr(f"try_variant_get(j.{c}, '$', 'string')")
        columns.append(F.when(kind == "STRING", text).alias(c))
        value_errors.append(F.when(kind.isNotNull() & ~kind.isin("STRING", "VOID"), F.concat(
            F.lit(f"type:{c} must be a JSON string, got "), F.substring(text, 1, 60), F.lit(" ("),
            F.lower(F.split_part(kind, F.lit("<"), F.lit(1))),
            F.lit("); write it as a JSON string (in double quotes) and ingest the row again"),
        )))
    return F.trim("raw") != "", parsed, (
        "source_file",
        "line",
        "raw",
        F.when(malformed, F.lit("malformed_line:not a JSON object on one line")).alias("_parse_error"),
        F.filter(F.array(*value_errors), lambda e: e.isNotNull()).alias("_value_errors"),
        # Keys of the line that are no column: the whole file is refused (ingest_files), not the row.
        F.array_except(F.json_object_keys("raw"), F.array(*[F.lit(c) for c in LEDGER_ENTRY_COLUMNS])).alias("_unknown_columns"),
        *columns,
    )


def _parse_csv(spark: SparkSession, lines: DataFrame, path: str) -> DataFrame:
    first = lines.filter("line = 1").select("raw").first()
    if first is None:
        raise InputFileError(f"{path} is empty: a CSV file needs a header row; nothing was ingested")
    header = [h.strip() for h in next(csv.reader([first["raw"]]))]
    check_columns(path, header, header=True)
    schema = StructType([StructField(f"c{i}", StringType(), True) for i in range(len(header))])
    body = lines.filter((F.col("line") > 1) & (F.trim("raw") != ""))
    parsed = body.withColumn("j", F.from_csv("raw", schema.simpleString(), {"mode": "PERMISSIVE"}))
    width = F.size(F.split("raw", ",(?=(?:[^\"]*\"[^\"]*\")*[^\"]*$)"))
    def field(c: str) -> Column:
        if c not in header:
            return F.lit(None).cast("string").alias(c)
        value = F.col(f"j.c{header.index(c)}")
        return F.when(value != "", value).alias(c)  # CSV has no null: an empty field is one

    return parsed.select(
        "source_file",
        "line",
        "raw",
        F.when(
            width != len(header),
            F.concat(
                F.lit(f"malformed_line:expected {len(header)} fields as in the header, found "),
                width.cast("string"),
            ),
        ).alias("_parse_error"),
        F.lit(None).cast(_UNKNOWN_COLUMNS).alias("_value_errors"),
        F.lit(None).cast(_UNKNOWN_COLUMNS).alias("_unknown_columns"),
        *[field(c) for c in LEDGER_ENTRY_COLUMNS],
    )


# Spark reads no Parquet TIMESTAMP(NANOS) (pandas' and pyarrow's default) but as raw INT64 under
# this setting; ingest turns those columns back into timestamps (`_read_parquet`).
_NANOS_AS_LONG = "spark.sql.legacy.parquet.nanosAsLong"


def _nanosecond_columns(path: str, settings: WarehouseSettings) -> list[str]:
    """Columns of a Parquet file stored as TIMESTAMP(NANOS), from its footer (pyarrow: no Spark job).
    Empty when pyarrow cannot open the path (a file system it does not know): Spark then names the
    problem itself, and `read_raw` says how to write the file."""
    try:
        fs, inner = arrow_filesystem(settings, path)  # on an S3 store: its settings, as Spark has them
        schema = pq.read_schema(inner, filesystem=fs)
    except Exception:  # noqa: BLE001 - only a shortcut; Spark's read reports real problems
        return []
    return [f.name for f in schema if pa.types.is_timestamp(f.type) and f.type.unit == "ns"]


def _read_parquet(spark: SparkSession, source: SourceFile, settings: WarehouseSettings) -> DataFrame:
    nanos = _nanosecond_columns(source.path, settings)
    if nanos:
        # Session-wide, and left set: it changes only how Spark reads nanosecond columns, which it
        # cannot read otherwise; unsetting it could break a concurrent ingest of such a file.
        spark.conf.set(_NANOS_AS_LONG, "true")
    df = spark.read.parquet(source.path)
    check_columns(source.path, df.columns)

    def column(c: str) -> Column:
        if c not in df.columns:
            return F.lit(None).alias(c)
        if c in nanos:  # nanoseconds as INT64: to a timestamp (Spark's are microseconds)
            return F.expr(f"timestamp_micros(`{c}` div 1000)").alias(c)
        return F.col(c)

    columns = [column(c) for c in LEDGER_ENTRY_COLUMNS]
    return df.select(
        F.lit(source.path).alias("source_file"),
        (F.col("_metadata.row_index") + 1).alias("line"),
        F.lit(None).cast("string").alias("raw"),
        F.lit(None).cast("string").alias("_parse_error"),
        F.lit(None).cast(_UNKNOWN_COLUMNS).alias("_value_errors"),
        F.lit(None).cast(_UNKNOWN_COLUMNS).alias("_unknown_columns"),
        *columns,
    )


def validate(raw: DataFrame) -> DataFrame:
    """Typed ledger_entries columns plus `rule`/`reason` (null for a valid row). Pure.

    `raw` is one file's rows (`read_raw`): its column types say which format's rules apply.
    """
    return raw.select(*_validated_columns(raw.schema.json()))


@built_per_session
def _validated_columns(raw_schema: str) -> tuple[Column | str, ...]:
    """`validate`'s columns over a `read_raw` frame of this schema (as JSON)."""
    schema = StructType.fromJson(json.loads(raw_schema))
    typed: dict[str, Column] = {}
    errors: list[Column] = [F.col("_parse_error")]
    for target in LEDGER_ENTRIES_SCHEMA.fields:
        value, error = _typed(schema, target.name, target.dataType)
        typed[target.name] = value
        errors.append(error)

    def rule(code: str, condition: Column, message: Column | str) -> Column:
        msg = F.lit(message) if isinstance(message, str) else message
        return F.when(condition, F.concat(F.lit(code + ":"), msg))

    t = typed
    errors += [
        rule(
            "missing",
            # A topic of the wrong JSON type has its own reason (in _value_errors).
            (t["topic"].isNull() & ~F.coalesce(F.exists("_value_errors", lambda e: e.startswith("type:topic ")), F.lit(False)))
            | (F.trim(t["topic"]) == ""),
            "topic is missing or empty",
        ),
        rule(
            "topic_whitespace",
            t["topic"].rlike(r"^\s|\s$") & (F.trim(t["topic"]) != ""),
            F.concat(
                F.lit("topic '"), t["topic"], F.lit("' starts or ends with whitespace; topic names are compared "
                "exactly, so it would be a topic of its own beside '"),
                F.regexp_replace(t["topic"], r"^\s+|\s+$", ""),
                F.lit("'. Remove the whitespace and ingest the row again"),
            ),
        ),
        rule("missing", t["ledger_id"].isNull() & F.col("ledger_id").isNull(), "ledger_id is missing"),
        rule("missing", t["entry_id"].isNull() & F.col("entry_id").isNull(), "entry_id is missing"),
        rule(
            "entry_type",
            ~F.coalesce(t["entry_type"].isin(*ENTRY_TYPES), F.lit(False)),
            F.concat(
                F.lit("entry_type must be one of DATA, COMMIT, ABORT, got "),
                F.coalesce(F.concat(F.lit("'"), t["entry_type"], F.lit("'")), F.lit("nothing")),
            ),
        ),
        rule(
            "txn_id_pair",
            F.col("txn_most_bits").isNull() != F.col("txn_least_bits").isNull(),
            "txn_most_bits and txn_least_bits must both be set or both be null",
        ),
        rule(
            "marker_without_txn",
            t["entry_type"].isin(*MARKER_TYPES)
            & (F.col("txn_most_bits").isNull() | F.col("txn_least_bits").isNull()),
            "a COMMIT or ABORT marker must carry a transaction id (txn_most_bits, txn_least_bits)",
        ),
    ]
    errors += [
        rule(
            "timestamp_type",
            ~t["timestamp_type"].isin(*TIMESTAMP_TYPES),
            F.concat(F.lit(f"timestamp_type must be one of {', '.join(TIMESTAMP_TYPES)} or null, got '"),
                     t["timestamp_type"], F.lit("'")),
        ),
        rule(
            "key_twice",
            t["key"].isNotNull() & t["key_bytes"].isNotNull(),
            "a key is either text (key) or bytes that are not UTF-8 (key_bytes), not both; drop one and ingest "
            "the row again",
        ),
    ]
    # One way to store a key: bytes that are UTF-8 are text (`key`), so a row reads the same
    # whichever column its source used, and `key_bytes` holds only what text cannot.
    given_bytes = t["key_bytes"]
    is_text = F.is_valid_utf8(given_bytes.cast("string"))
    t["key"] = F.coalesce(t["key"], F.when(is_text, given_bytes.cast("string")))
    t["key_bytes"] = F.when(~is_text, given_bytes)
    for name in _ID_COLUMNS + ("producer_epoch",):
        errors.append(rule("negative_id", t[name] < 0, F.concat(F.lit(f"{name} must not be negative, got "), t[name].cast("string"))))
    # A line that did not parse gets that one reason, not the cascade of missing fields.
    problems = F.when(F.col("_parse_error").isNotNull(), F.array(F.col("_parse_error"))).otherwise(
        F.concat(F.coalesce("_value_errors", F.array().cast(_UNKNOWN_COLUMNS)), F.filter(F.array(*errors), lambda e: e.isNotNull()))
    )
    first = problems[0]
    # Higher-order functions run interpreted, row by row: only a row with a problem builds the list.
    has_problem = (F.col("_parse_error").isNotNull() | F.coalesce(*errors[1:]).isNotNull()
                   | (F.coalesce(F.size("_value_errors"), F.lit(0)) > 0))
    return (
        "source_file",
        "line",
        "raw",
        "_unknown_columns",
        # Cast: every file's validated rows have the same schema, so they union as they are.
        *[t[f.name].cast(f.dataType).alias(f.name) for f in LEDGER_ENTRIES_SCHEMA.fields],
        F.when(has_problem, F.split_part(first, F.lit(":"), F.lit(1))).alias("rule"),
        F.when(
            has_problem,
            F.array_join(F.transform(problems, lambda e: F.regexp_replace(e, "^[a-z_]+:", "")), "; "),
        ).alias("reason"),
    )


def _typed(raw_schema: StructType, name: str, target) -> tuple[Column, Column]:
    """(typed value, error message or null) for one column, from a string or an already typed source."""
    col = F.col(name)
    source_type = raw_schema[name].dataType
    if isinstance(target, TimestampType):
        return _publish_time(name, source_type)
    if isinstance(source_type, type(target)) and not isinstance(target, StringType):
        return col, F.lit(None).cast("string")
    if isinstance(target, StringType):
        if isinstance(source_type, (StringType, NullType)):
            return col.cast("string"), F.lit(None).cast("string")
        if isinstance(source_type, BinaryType):  # Parquet binary: kept only as valid UTF-8 text
            valid = F.expr(f"is_valid_utf8(cast(`{name}` as string))")
            return F.when(valid, col.cast("string")), F.when(col.isNotNull() & ~valid, F.lit(
                f"type:{name} must be UTF-8 text, but this Parquet binary value is not valid UTF-8; write "
                f"{name} as a UTF-8 string (binary data belongs in payload) and ingest the row again"))
        return F.lit(None).cast("string"), F.when(
            col.isNotNull(), F.lit(f"type:{name} has type {source_type.simpleString()}, expected string"))
    if not isinstance(source_type, StringType):
        value = F.expr(f"try_cast(`{name}` as {target.simpleString()})")
        bad = col.isNotNull() & value.isNull()
        if isinstance(source_type, FractionalType) and isinstance(target, _INTEGRAL):
            bad = bad | (value != col)  # 1.5 is no id (try_cast would truncate it to 1)
        return value, F.when(bad, F.lit(f"type:{name} has type {source_type.simpleString()}, expected {target.simpleString()}"))
    if isinstance(target, ArrayType):  # headers: JSON text of [{"key": text, "value": base64 or null}, ...]
        items = F.from_json(col, "array<struct<key:string,value:string>>")
        bad_item = F.exists(items, lambda h: h["key"].isNull() | (h["value"].isNotNull() & ~h["value"].rlike(_BASE64)))
        value = F.when(~bad_item, F.transform(items, lambda h: F.struct(h["key"].alias("key"), F.unbase64(h["value"]).alias("value"))))
        message = F.concat(F.lit(f"type:{name} is not a JSON array of {{\"key\": text, \"value\": base64 or null}}: '"),
                           F.substring(col, 1, 60), F.lit("'; write the headers so and ingest the row again"))
        return value, F.when(col.isNotNull() & value.isNull(), message)
    if isinstance(target, (LongType, IntegerType)):
        value = F.expr(f"try_cast(trim(`{name}`) as {target.simpleString()})")
        what = "an integer" if isinstance(target, LongType) else "a 32-bit integer"
    elif isinstance(target, BinaryType):
        value = F.when(col.rlike(_BASE64), F.unbase64(col))
        what = "base64"
    else:
        raise TypeError(f"no parser for {target}")
    bad = col.isNotNull() & value.isNull()
    message = F.concat(F.lit(f"type:{name} is not {what}: '"), F.substring(col, 1, 60), F.lit("'"))
    if isinstance(target, BinaryType):
        message = F.concat(message, F.lit(
            f"; a {name} in JSONL or CSV (or a Parquet string column) must be base64: only A-Z a-z 0-9 + /, "
            f"padded with = to a multiple of 4 characters. Encode the {name} bytes as base64 (or write a "
            "Parquet binary column) and ingest the row again"
        ))
    return value, F.when(bad, message)


def _publish_time(name: str, source_type) -> tuple[Column, Column]:
    """publish_time by its file's type: a text holds ISO-8601 or epoch milliseconds, a Parquet
    integer is epoch milliseconds, a Parquet timestamp (or date) is kept as it is (one without a
    time zone is UTC, the session's). Out of PUBLISH_TIME_RANGE is its own rule."""
    col = F.col(name)
    millis = parsed = None
    if isinstance(source_type, StringType):
        text = F.trim(col)
        millis = F.when(text.rlike("^-?[0-9]{1,18}$"), F.expr(f"try_cast(trim(`{name}`) as bigint)"))
        parsed = F.when(millis.isNull(), F.expr(f"try_cast(trim(`{name}`) as timestamp)"))
        what = f"type:{name} is not an ISO-8601 timestamp or integer epoch milliseconds: '"
    elif isinstance(source_type, _INTEGRAL):
        millis = col.cast("bigint")
    elif isinstance(source_type, (TimestampType, TimestampNTZType, DateType, NullType)):
        parsed = col.cast("timestamp")
    else:
        message = f"type:{name} has type {source_type.simpleString()}, expected a timestamp or integer epoch milliseconds"
        return F.lit(None).cast("timestamp"), F.when(col.isNotNull(), F.lit(message))
    if millis is not None:
        # Guarded: Spark fails the whole job on a timestamp it cannot hold.
        from_millis = F.timestamp_millis(F.when(F.abs(millis) <= _MAX_SPARK_MS, millis))
        value = from_millis if parsed is None else F.coalesce(parsed, from_millis)
    else:
        value = parsed
    start, end = _RANGE_MS
    ms = F.coalesce(millis, F.unix_millis(value)) if millis is not None else F.unix_millis(value)
    out_of_range = (ms < start) | (ms >= end)
    read_as = F.lit("")
    if millis is not None:  # show what an integer meant
        meant = F.when(millis.isNotNull(), F.concat(F.lit(" (read as "), value.cast("string"), F.lit(" UTC)")))
        read_as = F.coalesce(meant, F.lit(""))
    range_message = F.concat(
        F.lit(f"publish_time_range:{name} must be in [{PUBLISH_TIME_RANGE[0]:%Y-%m-%d}, "
              f"{PUBLISH_TIME_RANGE[1]:%Y-%m-%d}) UTC, got "),
        col.cast("string"),
        read_as,
        F.lit("; an integer publish_time is epoch milliseconds (seconds or microseconds fall outside). "
              "Correct the value (epoch milliseconds or an ISO-8601 time) and ingest the row again"),
    )
    error = F.when(out_of_range, range_message)
    if isinstance(source_type, StringType):
        type_message = F.concat(F.lit(what), F.substring(col, 1, 60), F.lit("'"))
        error = F.when(col.isNotNull() & ms.isNull(), type_message).otherwise(error)
    # An out-of-range time is never stored; its quarantine reason carries the value as given.
    return F.when(~F.coalesce(out_of_range, F.lit(False)), value), error


def classify(validated: DataFrame, existing: DataFrame, immutable: DataFrame | None = None,
             suspect: Sequence[tuple[str, int]] | None = None) -> DataFrame:
    """Add `status` (NEW, PRESENT, REPEATED_IN_INPUT, IN_DELETED_LEDGER, QUARANTINED) and
    position-conflict reasons.

    The first row of the input at a position (by file, line) is the candidate; an identical
    later row is a harmless repeat, a different one is quarantined. A candidate identical to
    the stored entry is PRESENT; a different one is quarantined, never overwriting. A new
    candidate in a ledger of `immutable` (`ledgers.immutable_ledgers`) is not appended: inside a
    deleted ledger's former range it is IN_DELETED_LEDGER (an old file ingested again), else
    quarantined (`ledger_closed`, `ledger_offloaded`, `ledger_deleted`); nor is one in any other
    ledger before its topic's last offloaded or deleted ledger (`ledger_before_tier`). Pure.

    `suspect` (topic, ledger_id), when given, holds every ledger of the input that has stored
    rows or a position repeated in the input (`suspect_ledgers`): only their rows are compared
    by position, since every other row is its position's only candidate and nothing is stored
    there. Column `_compared` says which rows were.
    """
    invalid_rule = F.col("rule").isNotNull()  # by `validate`
    if suspect is None:
        joined = _by_position(validated.filter(~invalid_rule), existing)
    else:
        ledgers = local_frame(validated.sparkSession, [(t, l, True) for t, l in suspect], "topic string, ledger_id bigint, _suspect boolean")
        marked = validated.join(F.broadcast(ledgers), ["topic", "ledger_id"], "left")
        compared = _by_position(marked.where(F.col("_suspect").isNotNull() & ~invalid_rule).drop("_suspect"),
                                existing.join(F.broadcast(ledgers), ["topic", "ledger_id"], "left_semi"))
        # The others skip the window and the join, the two shuffles of full rows; the invalid rows
        # go with them, so that nothing compared means one pass over `validated`, without a union.
        columns, added = validated.columns, compared.schema
        alone = marked.where(F.col("_suspect").isNull() | invalid_rule).select(
            *columns, *[F.lit(None).cast(f.dataType).alias(f.name) for f in added.fields
                        if f.name not in columns and f.name != "_compared"], F.lit(False).alias("_compared"))
        joined = alone if not suspect else compared.unionByName(alone)
    if immutable is None:
        joined = joined.select("*", *[F.lit(None).cast(t).alias(c) for c, t in (
            ("_sealed", "string"), ("_deleted_first", "bigint"), ("_deleted_last", "bigint"),
            ("_tier_ledger", "bigint"), ("_tier_state", "string"))])
    else:
        joined = joined.join(F.broadcast(immutable.select(
            "topic", "ledger_id", F.col("state").alias("_sealed"),
            F.col("deleted_first_entry_id").alias("_deleted_first"), F.col("deleted_last_entry_id").alias("_deleted_last"),
        )), ["topic", "ledger_id"], "left")
        # Each topic's last ledger offloaded or deleted: what lies before it was decided without
        # any ledger that arrives now (see `before_tier` below).
        last_in_tier = (immutable.where(F.col("state").isin("OFFLOADED", "DELETED"))
                        .groupBy("topic").agg(F.max(F.struct("ledger_id", "state")).alias("_t"))
                        .select("topic", F.col("_t.ledger_id").alias("_tier_ledger"), F.col("_t.state").alias("_tier_state")))
        joined = joined.join(F.broadcast(last_in_tier), ["topic"], "left")
    checked = joined.select(*_classified_columns())
    if suspect is not None:
        return checked
    invalid = validated.filter(invalid_rule).select(
        "source_file", "line", "raw", "_unknown_columns", *LEDGER_ENTRY_COLUMNS,
        F.lit(QUARANTINED).alias("status"), "rule", "reason", F.lit(False).alias("_compared"),
    )
    return checked.unionByName(invalid)


@built_per_session
def _classified_columns() -> tuple[Column | str, ...]:
    """`classify`'s columns over the rows joined with what decides them (`_by_position`, the sealed ledgers)."""
    invalid_rule = F.col("rule").isNotNull()  # by `validate`
    position = F.concat_ws(" ", F.col("topic"), F.concat_ws(":", F.col("ledger_id"), F.col("entry_id")))
    by_position = (
        F.when(F.col("_input_status").isNotNull(), F.col("_input_status"))
        .when(F.col("_stored").isNull(), F.lit(NEW))
        .when(_same_entry(F.col("_stored")), F.lit(PRESENT))
        .otherwise(F.lit(QUARANTINED))
    )
    new_in_sealed = (by_position == NEW) & F.col("_sealed").isNotNull()
    # A new entry in a ledger before the topic's last offloaded or deleted one: the later ledgers'
    # duplicates, late data and stable position were decided, copied to the tier or deleted
    # without it, and stay so (in BookKeeper a topic's ledgers are created in id order, so this is
    # a late or misnumbered file).
    before_tier = (by_position == NEW) & F.col("_sealed").isNull() & (F.col("ledger_id") < F.col("_tier_ledger"))
    status = (
        F.when(new_in_sealed & (F.col("_sealed") == "DELETED")
               & F.col("entry_id").between(F.col("_deleted_first"), F.col("_deleted_last")), F.lit(IN_DELETED_LEDGER))
        .when(new_in_sealed | before_tier, F.lit(QUARANTINED))
        .otherwise(by_position)
    )
    rule = F.when(
        F.col("_input_status") == QUARANTINED, F.lit("position_repeated_in_input")
    ).when(by_position == QUARANTINED, F.lit("position_conflict")).when(
        before_tier, F.lit("ledger_before_tier")).when(
        status == QUARANTINED, F.concat(F.lit("ledger_"), F.lower("_sealed")))
    ledger = F.concat_ws("/", F.col("topic"), F.col("ledger_id"))
    then = F.lit("; write the entry to a new ledger of the topic (a higher ledger_id) and ingest it again")
    tier_ledger = F.concat_ws("/", F.col("topic"), F.col("_tier_ledger"))
    before_tier_reason = F.concat(
        F.lit("ledger "), ledger, F.lit(" comes before ledger "), tier_ledger, F.lit(", which is already "),
        F.when(F.col("_tier_state") == "DELETED", F.lit("deleted by retention")).otherwise(F.lit("offloaded")),
        F.lit(": the topic's later ledgers were decided (duplicates, late data, stable position) and offloaded or deleted "
              "without it, so entry "), F.col("entry_id").cast("string"),
        F.lit(" cannot be put in front of them now; ingest a topic's ledgers before offloading later ones, or write "
              "the entry to a new ledger after "), tier_ledger, F.lit(" and ingest it again"))
    sealed_reason = (
        F.when(F.col("_sealed") == "OFFLOADED", F.concat(
            F.lit("ledger "), ledger, F.lit(" is OFFLOADED (recorded in ledger_states): the offload tier holds its copy "
                                            "and retention deletes its hot rows, so entry "),
            F.col("entry_id").cast("string"), F.lit(" appended now would exist nowhere after retention"), then))
        .when(F.col("_sealed") == "CLOSED", F.concat(
            F.lit("ledger "), ledger, F.lit(" was closed by the transaction engine (recorded CLOSED in ledger_states) and a "
                                            "closed ledger is immutable, as in BookKeeper: entry "),
            F.col("entry_id").cast("string"), F.lit(" cannot be added"), then))
        .otherwise(F.concat(
            F.lit("ledger "), ledger, F.lit(" was deleted by retention (DELETED in ledger_states/deleted_ledgers) and takes "
                                            "no new entries; entry "),
            F.col("entry_id").cast("string"), F.lit(" is outside the range it held"),
            F.coalesce(F.concat(F.lit(" ("), F.col("_deleted_first").cast("string"), F.lit(".."),
                                F.col("_deleted_last").cast("string"), F.lit(")")), F.lit("")),
            then))
    )
    reason = F.when(
        F.col("_input_status") == QUARANTINED,
        F.concat(
            F.lit("position "), position,
            F.lit(" appears earlier in the input with different content, at "),
            F.col("_first.source_file"), F.lit(":"), F.col("_first.line").cast("string"),
        ),
    ).when(
        by_position == QUARANTINED,
        F.concat(
            F.lit("position "), position,
            F.lit(" already holds a different entry in ledger_entries; stored entries are never overwritten"),
        ),
    ).when(before_tier, before_tier_reason).when(status == QUARANTINED, sealed_reason)
    return (
        "source_file", "line", "raw", "_unknown_columns", *LEDGER_ENTRY_COLUMNS,
        F.when(invalid_rule, F.lit(QUARANTINED)).otherwise(status).alias("status"),
        F.when(invalid_rule, F.col("rule")).otherwise(rule).alias("rule"),
        F.when(invalid_rule, F.col("reason")).otherwise(reason).alias("reason"), "_compared",
    )


def _by_position(valid: DataFrame, existing: DataFrame) -> DataFrame:
    """`valid` with `_input_status` (by the other input rows at its position) and `_stored` (the
    stored entry there): a window and a join over the full rows."""
    rank, first, input_status, stored_entry, compared = _position_columns()
    in_input = valid.withColumn("_rank", rank).withColumn("_first", first).select("*", input_status)
    stored = existing.select(*POSITION_COLUMNS, stored_entry)
    return in_input.join(stored, list(POSITION_COLUMNS), "left").withColumn("_compared", compared)


@built_per_session
def _position_columns() -> tuple[Column, ...]:
    """`_by_position`'s rank and first row of a position in the input, the input status that follows
    from them, the stored entry as one column, and `_compared`."""
    order = Window.partitionBy(*POSITION_COLUMNS).orderBy("source_file", "line")
    input_status = (F.when(F.col("_rank") == 1, F.lit(None)).when(_same_entry(F.col("_first")), F.lit(REPEATED))
                    .otherwise(F.lit(QUARANTINED)).alias("_input_status"))
    return (F.row_number().over(order), F.first(F.struct("source_file", "line", *LEDGER_ENTRY_COLUMNS)).over(order),
            input_status, F.struct(*LEDGER_ENTRY_COLUMNS).alias("_stored"), F.lit(True))


def suspect_ledgers(warehouse: Warehouse, validated: DataFrame,
                    input_ledgers: dict[tuple[str, int], bool] | None = None) -> list[tuple[str, int]]:
    """The ledgers of `validated` that `classify` must compare by position: those with stored
    rows (`ledger_ranges`, no Spark job) or a position repeated in the input. `input_ledgers`,
    when the caller knows them without reading the rows: {(topic, ledger_id): whether a position
    may repeat in it}; else one job over the positions alone (invalid rows are counted too, which
    only compares more), a row per ledger to the driver."""
    stored = ({(r["topic"], r["ledger_id"]) for r in ledger_ranges(warehouse).to_pylist()}
              if warehouse.exists(LEDGER_ENTRIES) else set())
    if input_ledgers is None:
        per_ledger = (validated.where(F.col("entry_id").isNotNull()).groupBy(*POSITION_COLUMNS).count()
                      .groupBy("topic", "ledger_id").agg(F.max("count").alias("most")).collect())
        input_ledgers = {(r["topic"], r["ledger_id"]): r["most"] > 1 for r in per_ledger}
    return sorted(ledger for ledger, repeats in input_ledgers.items() if repeats or ledger in stored)


def _same_entry(other: Column) -> Column:
    same = F.lit(True)
    for c in LEDGER_ENTRY_COLUMNS:
        same = same & F.col(c).eqNullSafe(other[c])
    return same


def ingest_files(warehouse: Warehouse, paths: Sequence[str]) -> IngestSummary:
    """Validate and append raw ledger files; see the module docstring for the rules."""
    spark = warehouse.spark
    sources = resolve_sources(spark, paths)
    # Validated file by file: a union of raw files would coerce one file's columns to another's
    # types (JSONL's base64 text becoming Parquet's binary, undecoded).
    validated = reduce(DataFrame.unionByName, [validate(read_raw(spark, s, warehouse.settings)) for s in sources])
    validated = validated.persist(StorageLevel.MEMORY_AND_DISK)  # parsed once, read by each step of the append
    try:
        return append_validated(warehouse, validated, [s.path for s in sources])
    finally:
        validated.unpersist()


def append_validated(warehouse: Warehouse, validated: DataFrame, files: list[str],
                     in_position_order: bool = False, input_ledgers: dict[tuple[str, int], bool] | None = None,
                     count_while_writing: bool = False) -> IngestSummary:
    """Classify `validate`d rows against what is stored, quarantine the bad ones and append the
    new ones (the rules of `classify`): idempotent, and a crash between the two writes is
    repaired by running it again. Every importer of raw entries appends through here.

    `validated` is read by several jobs (the positions, the counts, each write): pass a persisted
    frame when computing it costs. `in_position_order`: each of its partitions holds whole
    ledgers in position order (a Kafka segment per task), so the rows not compared by position
    are written as they come, without the range repartition and sort. `input_ledgers`: see
    `suspect_ledgers`. `count_while_writing` (rows that cannot carry unknown columns): when no
    ledger is compared by position, the counts are observed while the new rows are written, so
    `validated` is computed once (again only to quarantine rows, after the append)."""
    summary = IngestSummary(
        ingest_id=uuid.uuid4().hex[:12],
        files=files,
        table_location=warehouse.path(LEDGER_ENTRIES),
        quarantine_location=warehouse.path(QUARANTINE_ENTRIES),
    )
    # Hold the entries table's lock from reading what is stored until the append commits, so a
    # concurrent ingest cannot slip a row in between the check and the write.
    with warehouse.writer(LEDGER_ENTRIES):
        existing = warehouse.read_or_empty(LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA)
        suspect = suspect_ledgers(warehouse, validated, input_ledgers)
        classified = classify(validated, existing, immutable_ledgers(warehouse), suspect)
        if suspect:  # keep the shuffled comparison for the counts and both writes
            classified = classified.persist(StorageLevel.MEMORY_AND_DISK)
        try:
            is_new = F.col("status") == NEW
            if count_while_writing and in_position_order and not suspect:
                warehouse.spark._jvm.io.txnlake.spark.Tally.register(warehouse.spark._jsparkSession)
                observation = Observation(f"ingest-{summary.ingest_id}")
                observed = classified.observe(observation, F.call_function(TALLY, F.concat_ws(
                    _TALLY_SEP, *[F.coalesce(c.cast("string"), F.lit(_TALLY_NULL)) for c in _tally_keys(is_new)])).alias("tally"))
                _append_new(warehouse, observed, in_position_order, None, compared=bool(suspect))
                appended_to = _summarize(summary, _observed_tally(observation.get["tally"]))
                # After the append: a crash before this write is repaired by running it again, which
                # finds the same rows to quarantine (no rule of theirs depends on the append).
                _write_quarantine_if_any(warehouse, classified, summary)
            else:
                # One job: the counts, the ledgers appended to (for the gap check) and unknown columns.
                has_unknown = F.size("_unknown_columns") > 0
                tally = classified.groupBy(*_tally_keys(is_new)).agg(
                    F.count("*").alias("n"),
                    F.collect_set(F.when(has_unknown, F.struct("source_file", "_unknown_columns"))).alias("unknown"),
                    F.min(F.when(has_unknown, F.struct("source_file", "line"))).alias("first_unknown"),
                ).collect()
                unknown = sorted({(u["source_file"], c) for r in tally for u in r["unknown"] for c in u["_unknown_columns"]})
                if unknown:
                    first = min(r["first_unknown"] for r in tally if r["first_unknown"] is not None)
                    raise unknown_columns_error(
                        first["source_file"], [c for f, c in unknown if f == first["source_file"]],
                        f" (first on line {first['line']})",
                    )
                appended_to = _summarize(summary, [(r["status"], r["rule"], r["t"], r["l"], r["n"]) for r in tally])
                # Quarantine first: if we stop between the two commits, a re-run redoes both and
                # each is idempotent.
                _write_quarantine_if_any(warehouse, classified, summary)
                if summary.rows_written or not warehouse.exists(LEDGER_ENTRIES):
                    _append_new(warehouse, classified, in_position_order, summary.rows_written, compared=bool(suspect))
            if appended_to:
                summary.entry_id_gaps = entry_id_gaps(warehouse, appended_to)
        finally:
            classified.unpersist()
    return summary


TALLY = "txnlake_tally"  # io.txnlake.spark.Tally (resources/java), registered in the session where used
_TALLY_SEP, _TALLY_NULL = "\u0001", "\u0002"


def _tally_keys(is_new: Column) -> list[Column]:
    """What the counts are by: status, rule, topic, and the ledger of a new row (for the gap check)."""
    return [F.col("status"), F.col("rule"), F.col("topic").alias("t"), F.when(is_new, F.col("ledger_id")).alias("l")]


def _observed_tally(lines: str) -> list[tuple]:
    out = []
    for line in lines.splitlines():
        key, _, n = line.rpartition("\t")
        status, rule, topic, ledger = (None if v == _TALLY_NULL else v for v in key.split(_TALLY_SEP))
        out.append((status, rule, topic, None if ledger is None else int(ledger), int(n)))
    return out


def _summarize(summary: IngestSummary, tally: list[tuple]) -> set[tuple[str, int]]:
    """The summary's counts from (status, rule, topic, new row's ledger, rows) tuples; the ledgers appended to."""
    appended_to = set()
    counts: dict[str, int] = {}
    by_rule: dict[str, int] = {}
    for status, rule, topic, ledger, n in tally:
        counts[status] = counts.get(status, 0) + n
        if status == QUARANTINED:
            by_rule[rule] = by_rule.get(rule, 0) + n
        if topic is not None:
            by_status = summary.rows_by_topic.setdefault(topic, {})
            by_status[status] = by_status.get(status, 0) + n
        if status == NEW:
            appended_to.add((topic, ledger))
    summary.rows_read = sum(counts.values())
    summary.rows_written = counts.get(NEW, 0)
    summary.rows_already_present = counts.get(PRESENT, 0)
    summary.rows_repeated_in_input = counts.get(REPEATED, 0)
    summary.rows_in_deleted_ledgers = counts.get(IN_DELETED_LEDGER, 0)
    summary.rows_quarantined = counts.get(QUARANTINED, 0)
    summary.quarantine_by_rule = by_rule
    return appended_to


def _write_quarantine_if_any(warehouse: Warehouse, classified: DataFrame, summary: IngestSummary) -> None:
    if summary.rows_quarantined:
        _write_quarantine(warehouse, classified, summary.ingest_id)
    elif not warehouse.exists(QUARANTINE_ENTRIES):
        # The table the summary names exists from the first ingest on, empty or not.
        DeltaTables(warehouse).overwrite(QUARANTINE_ENTRIES, [], QUARANTINE_ENTRIES_SCHEMA)


def _append_new(warehouse: Warehouse, classified: DataFrame, in_position_order: bool, rows: int | None,
                *, compared: bool) -> None:
    """Append the NEW rows of `classified` (`rows` of them, None when not known yet). `compared`:
    whether `classify` compared any row by position (it does when a ledger is suspect)."""
    # Files of contiguous positions, sorted: a ledger's entries sit together, so aggregates by
    # ledger and transaction combine before they shuffle, and readers skip files by their
    # ledger_id statistics (docs/benchmarks.md, "Buffer").
    new = classified.filter(F.col("status") == NEW)
    columns = [F.col(f.name).cast(f.dataType) for f in LEDGER_ENTRIES_SCHEMA.fields]
    in_order = new.where(~F.col("_compared")).select(*columns) if in_position_order else None
    if in_order is not None and not compared:
        # Written as they come: a ranged branch, even one of no rows, computes the input again.
        new_rows = in_order
    else:
        ranged = new.where(F.col("_compared")) if in_position_order else new
        new_rows = ranged.select(*columns).repartitionByRange(
            max(1, -(-(rows or 0) // ROWS_PER_FILE)), *POSITION_COLUMNS).sortWithinPartitions(*POSITION_COLUMNS)
        if in_order is not None:
            new_rows = new_rows.unionByName(in_order)
    retry_delta_conflicts(
        lambda: stored_frame(LEDGER_ENTRIES, new_rows).write.format("delta").mode("append").save(warehouse.path(LEDGER_ENTRIES))
    )


def entry_id_gaps(warehouse: Warehouse, ledgers: set[tuple[str, int]]) -> list[dict]:
    """Of `ledgers`, those whose stored entry ids are not dense (fewer entries than their range
    spans), by `ledger_ranges`: delta-rs, no Spark job."""
    gaps = [
        {**r, "missing": r["last_entry_id"] - r["first_entry_id"] + 1 - r["entry_count"]}
        for r in ledger_ranges(warehouse).to_pylist()
        if (r["topic"], r["ledger_id"]) in ledgers and r["last_entry_id"] - r["first_entry_id"] + 1 != r["entry_count"]
    ]
    return sorted(gaps, key=lambda g: (g["topic"], g["ledger_id"]))


def _write_quarantine(warehouse: Warehouse, classified: DataFrame, ingest_id: str) -> None:
    rows = classified.filter(F.col("status") == QUARANTINED).select(
        "source_file",
        "line",
        "rule",
        "reason",
        F.coalesce(F.col("raw"), F.to_json(F.struct(*LEDGER_ENTRY_COLUMNS))).alias("raw"),
        "topic",
        "ledger_id",
        "entry_id",
        F.lit(ingest_id).alias("ingest_id"),
        F.current_timestamp().alias("quarantined_at"),
    ).select(*[F.col(f.name).cast(f.dataType) for f in QUARANTINE_ENTRIES_SCHEMA.fields])
    path = warehouse.path(QUARANTINE_ENTRIES)
    with warehouse.writer(QUARANTINE_ENTRIES):
        # Idempotent: the same row of the same file quarantined for the same rule is kept once.
        # (An anti-join and an append under the table's lock: cheaper than a Delta MERGE.)
        stored = warehouse.read_or_empty(QUARANTINE_ENTRIES, QUARANTINE_ENTRIES_SCHEMA, path)
        key = ["source_file", "line", "rule"]
        fresh = rows.dropDuplicates(key).join(stored.select(*key, F.col("raw").alias("_raw")), key, "left")
        fresh = fresh.filter(F.col("_raw").isNull() | ~F.col("_raw").eqNullSafe(F.col("raw"))).drop("_raw")
        retry_delta_conflicts(lambda: stored_frame(QUARANTINE_ENTRIES, fresh).write.format("delta").mode("append").save(path))
