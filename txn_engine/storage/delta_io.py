"""The engine's Delta I/O through delta-rs (`deltalake`): Arrow appends in milliseconds.

An Arrow append through delta-rs, not a Spark DataFrame made from Python rows, is what makes
group commit pay (docs/benchmarks.md, "Driver writes"). Both write the same Delta protocol, so
Spark reads what the engine appends and the reverse; every append holds the table's txnlake writer
lock (`Warehouse.writer`).

Appends use handles of their own, never reloaded (a commit that finds its version taken reads the
newer commits and retries: appends do not conflict), but replaced from the checkpoint each time a
commit crosses one, as a handle moved only by its own commits slows down; delta-rs's expired-log
cleanup runs only with the checkpoints, as Spark's Delta does (docs/benchmarks.md, "Engine:
threads, garbage collection, delta-rs handles"). Reads use other handles, refreshed on every read.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from typing import Any, Iterable, Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset
from deltalake import CommitProperties, DeltaTable, write_deltalake
from deltalake.transaction import PostCommitHookProperties
from deltalake.exceptions import CommitFailedError, TableNotFoundError
from pyspark.sql import DataFrame
from pyspark.sql import types as T

from txn_engine.core.schema import TXN_HALVES, TXN_ID, stored_schema, struct_elements
from txn_engine.storage.arrow_frames import arrow_schema
from txn_engine.storage.warehouse import Warehouse, delta_rs_schema, require_current_columns, retry_delta_conflicts

# A write of at most this many bytes goes through the driver (collected as Arrow, committed by
# delta-rs): a Spark Delta write or DELETE costs several Spark jobs however small the table.
# Measured in entry bytes, the catalog's `size_bytes`, never in Parquet file bytes.
DRIVER_WRITE_MAX_BYTES = 256 * 1024 * 1024


# What a row of a narrow table (ids, positions, counts, a topic name; no payload) is taken to
# cost as Arrow in the driver, to bound such a table by DRIVER_WRITE_MAX_BYTES.
NARROW_ROW_BYTES = 128


def fits_driver(frame: DataFrame, max_bytes: int = DRIVER_WRITE_MAX_BYTES, row_bytes: int = NARROW_ROW_BYTES) -> bool:
    """Whether `frame` (rows of at most `row_bytes`) is small enough to collect in the driver: one
    Spark job, a count (cheap on a cached frame, as the buffer's facts are), unless a bound below
    one row answers without it."""
    return max_bytes >= row_bytes and frame.count() * row_bytes <= max_bytes


def overwrite_small(warehouse: Warehouse, table: str, frame: DataFrame, predicate: str | None = None,
                    commit_metadata: dict[str, str] | None = None, schema: T.StructType | None = None) -> int:
    """Write a result small enough for the driver (a row per ledger or topic, a small run's tables)
    as `DeltaTables.overwrite` does: collected as Arrow in one Spark job, committed by delta-rs, in
    `schema` when given (its NOT NULL columns kept), else the frame's."""
    return DeltaTables(warehouse).overwrite(table, frame.toArrow(), schema or frame.schema, predicate, commit_metadata)


def ledger_predicate(ledgers: Iterable[tuple[str, int]], ledger_column: str = "ledger_id", delta_rs: bool = False) -> str:
    """A predicate matching exactly these (topic, ledger) pairs (for replaceWhere/DELETE): Spark SQL,
    or with `delta_rs` delta-rs's (DataFusion) SQL, which quotes strings differently."""
    by_topic: dict[str, list[int]] = {}
    for topic, ledger_id in sorted(set(ledgers)):
        by_topic.setdefault(topic, []).append(int(ledger_id))
    if not by_topic:
        return "false"
    parts = [f"(topic = {sql_string(t, delta_rs)} AND {ledger_column} IN ({', '.join(map(str, ids))}))"
             for t, ids in by_topic.items()]
    return " OR ".join(parts)


def delete_ledgers(wh: Warehouse, table: str, ledgers: Iterable[tuple[str, int]], ledger_column: str = "ledger_id",
                   through_driver: bool = False) -> None:
    """Delete the rows of these (topic, ledger) pairs from `table` in one commit (no-op on a missing table).

    `through_driver`: by delta-rs (no Spark job; Spark's DELETE runs several even on a small table),
    which rewrites the files it touches in this process: for tables the caller knows are small.
    """
    ledgers = sorted(set(ledgers))
    if not ledgers:
        return
    if through_driver:
        DeltaTables(wh).delete(table, ledger_predicate(ledgers, ledger_column, delta_rs=True))
    else:
        wh.delete(table, ledger_predicate(ledgers, ledger_column))


def sql_string(text: str, delta_rs: bool = False) -> str:
    """A string literal: Spark SQL escapes with a backslash; delta-rs (DataFusion) doubles a quote
    and reads a backslash as itself."""
    if delta_rs:
        return "'" + text.replace("'", "''") + "'"
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def scan(dataset: pyarrow.dataset.Dataset, pushed: pc.Expression | None = None, columns: Sequence[str] | None = None,
         on_rows: pc.Expression | None = None, on_rows_columns: Sequence[str] = ()) -> pa.Table:
    """`columns` of the rows of `dataset` matching `pushed` and `on_rows`.

    `pushed` goes to the files (statistics, row groups); `on_rows` is applied to the rows read and
    names its columns in `on_rows_columns`. A condition on a string column must go in `on_rows`:
    the files delta-rs 1.6 rewrites (DELETE, UPDATE, OPTIMIZE) store strings as `string_view`
    (delta-rs #4579), and pyarrow 26 fails any pushed-down string condition on such a file
    ("no kernel matching input types (string, string_view)").
    """
    read = None if columns is None else list(dict.fromkeys([*columns, *on_rows_columns]))
    rows = dataset.to_table(filter=pushed, columns=read)
    if on_rows is not None:
        rows = rows.filter(on_rows)
    return rows if columns is None else rows.select(list(columns))


def aggregate(table: pa.Table | pa.RecordBatch, keys: Sequence[str], aggregations: Sequence[tuple[str, str, str]]) -> pa.Table:
    """`table` grouped by `keys`, with a column `name` per (column, op, name) of `aggregations`
    (pyarrow's hash `op` of `column`); no aggregation: the distinct keys."""
    table = pa.Table.from_batches([table]) if isinstance(table, pa.RecordBatch) else table
    grouped = table.group_by(list(keys), use_threads=False).aggregate([(column, op) for column, op, _ in aggregations])
    return grouped.select([*keys, *(f"{column}_{op}" for column, op, _ in aggregations)]).rename_columns(
        [*keys, *(name for _, _, name in aggregations)])


# How an aggregate's partial results combine: a count of counts is their sum.
_FOLD_OP = {"sum": "sum", "min": "min", "max": "max", "count": "sum"}
# Partial results folded together once they come to this many rows (or to the groups folded so far).
FOLD_ROWS = 1 << 16


def aggregate_batches(batches: Iterable[pa.RecordBatch | pa.Table], keys: Sequence[str],
                      aggregations: Sequence[tuple[str, str, str]], partials: Iterable[pa.Table] = ()) -> pa.Table | None:
    """`aggregate` over all `batches` as if they were one table, reading them one at a time; None
    when there is no row. `partials`: results already aggregated (columns `keys` and the names)
    to fold in.

    Bounded: it holds the groups (a row per key) and the partial results of the batches since its
    last fold, which it folds once they outgrow the groups, never the rows.
    """
    folds = [(name, _FOLD_OP[op], name) for _, op, name in aggregations]
    folded: pa.Table | None = None
    pending: list[pa.Table] = []
    pending_rows = 0

    def fold() -> pa.Table:
        # "default": a partial from file statistics may say nullable where the batches' column is not.
        return aggregate(pa.concat_tables(([folded] if folded is not None else []) + pending, promote_options="default"),
                         keys, folds)

    for part in _partials(batches, keys, aggregations, partials):
        pending.append(part)
        pending_rows += part.num_rows
        if pending_rows >= max(FOLD_ROWS, 0 if folded is None else folded.num_rows):
            folded, pending, pending_rows = fold(), [], 0
    return fold() if pending else folded


def _partials(batches, keys, aggregations, partials) -> Iterator[pa.Table]:
    yield from (p for p in partials if p.num_rows)
    yield from (aggregate(b, keys, aggregations) for b in batches if b.num_rows)


DEFAULT_CHECKPOINT_INTERVAL = 100  # the Delta protocol's default `delta.checkpointInterval`


# Commits that change no row of a table (delta-rs's VACUUM writes two, Delta's OPTIMIZE rewrites files).
MAINTENANCE_OPERATIONS = ("VACUUM START", "VACUUM END", "OPTIMIZE")


def version_key(table: str) -> str:
    """The commit metadata key of `table`'s version in `DeltaTables.versions`."""
    return f"{table}_version"


def txn_id_array(most: pa.Array | pa.ChunkedArray, least: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """`schema.TXN_ID_SQL` over Arrow: "most:least", null when either half is."""
    return pc.binary_join_element_wise(pc.cast(most, pa.string()), pc.cast(least, pa.string()), ":")


def _elements_have_halves(kind: pa.DataType) -> bool:
    return (pa.types.is_list(kind) and pa.types.is_struct(kind.value_type)
            and all(kind.value_type.get_field_index(h) >= 0 for h in TXN_HALVES))


def _elements_with_txn_id(column: pa.Array | pa.ChunkedArray, stored: pa.StructType) -> pa.Array:
    """A list column's struct elements as `stored` has them, each `txn_id` from its halves."""
    lists = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    values = lists.values  # `offsets` index into it, whatever slice `lists` is
    fields = [txn_id_array(*(values.field(h) for h in TXN_HALVES)) if f.name == TXN_ID else values.field(f.name)
              for f in stored]
    elements = pa.StructArray.from_arrays(fields, fields=list(stored), mask=values.is_null())
    return pa.ListArray.from_arrays(lists.offsets, elements, type=pa.list_(stored), mask=lists.is_null())


def stored_arrow(table: str, data: pa.Table) -> pa.Table:
    """`data` as `table` stores it, as `warehouse.stored_frame` does for Spark: the table's column
    order, each column described (field metadata `comment`), `txn_id` from the two halves (in a
    list's struct elements too)."""
    stored = stored_schema(table)
    if stored is None:
        return data
    present = set(data.column_names)
    with_halves = set(TXN_HALVES) <= present
    target = arrow_schema(stored)
    fields, columns = [], []
    for field in stored.fields:
        elements = struct_elements(field)
        if field.name == TXN_ID and with_halves:
            column = txn_id_array(*(data[h] for h in TXN_HALVES))
            kind, nullable = column.type, True
        elif field.name in present and elements and TXN_ID in elements.fieldNames() \
                and _elements_have_halves(data.schema.field(field.name).type):
            column = _elements_with_txn_id(data[field.name], target.field(field.name).type.value_type)
            kind, nullable = column.type, data.schema.field(field.name).nullable
        elif field.name in present:
            column = data[field.name]
            kind, nullable = column.type, data.schema.field(field.name).nullable
        else:
            continue
        fields.append(pa.field(field.name, kind, nullable, metadata=field.metadata))
        columns.append(column)
    named = set(stored.fieldNames())
    for name in data.column_names:
        if name not in named:
            fields.append(data.schema.field(name))
            columns.append(data[name])
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


class TopicRows:
    """A dataset's rows topic by topic (`rows(topic)`, safe to call from several threads), each
    Parquet row group decoded once. A row group of one topic is read by that topic's call; one that
    may hold several (where a file written in position order crosses from one topic to the next, or
    a small log's single row group) is read by the first call that needs it and kept until each
    topic its statistics admit has taken its rows. A filtered scan per topic decodes such a row
    group once for every topic in it."""

    def __init__(self, source: pyarrow.dataset.Dataset, topics: Iterable[str]):
        self.schema = source.schema
        names = list(topics)
        self._groups: list[tuple[pyarrow.dataset.ParquetFileFragment, str | None, str | None]] = []
        self._shared: dict[int, _SharedRowGroup] = {}
        for fragment in source.get_fragments():
            for group in fragment.split_by_row_group():
                bounds = group.row_groups[0].statistics.get("topic") or {}
                low, high = bounds.get("min"), bounds.get("max")
                if low is None or low != high:
                    self._shared[len(self._groups)] = _SharedRowGroup(sum(_may_hold(low, high, t) for t in names))
                self._groups.append((group, low, high))

    def rows(self, topic: str) -> pa.Table:
        """The topic's rows, in the dataset's order."""
        mine = pc.field("topic") == topic
        parts = [self._shared[i].take(group, topic, self.schema) if i in self._shared
                 else group.to_table(schema=self.schema, filter=mine)
                 for i, (group, low, high) in enumerate(self._groups) if _may_hold(low, high, topic)]
        return pa.concat_tables(parts) if parts else self.schema.empty_table()


def _may_hold(low: str | None, high: str | None, topic: str) -> bool:
    """Whether a row group whose topic statistics are `low`..`high` (None: unknown) may hold `topic`;
    Python orders strings as Parquet orders their UTF-8 bytes."""
    return (low is None or low <= topic) and (high is None or topic <= high)


class _SharedRowGroup:
    """A row group that may hold several topics: read once, kept until `users` topics took theirs."""

    def __init__(self, users: int):
        self.users = users
        self.lock = threading.Lock()
        self.table: pa.Table | None = None

    def take(self, group: pyarrow.dataset.ParquetFileFragment, topic: str, schema: pa.Schema) -> pa.Table:
        with self.lock:  # the others wait for the one read rather than decoding it again
            table = self.table if self.table is not None else group.to_table(schema=schema)
            self.users -= 1
            self.table = table if self.users > 0 else None
        return table.filter(pc.equal(table["topic"], topic))


class DeltaTables:
    """Arrow reads and appends of the warehouse's Delta tables, without Spark."""

    def __init__(self, warehouse: Warehouse):
        self.warehouse = warehouse
        self._handles: dict[str, DeltaTable] = {}  # reads: refreshed before each use
        self._writers: dict[str, DeltaTable] = {}  # appends: moved forward by their own commits
        self._read_lock = threading.Lock()  # a handle is not safe to refresh from two threads at once
        # Per table: [commits, seconds, rows] of the appends (lock wait included), for the benchmark.
        self.append_stats: dict[str, list] = defaultdict(lambda: [0, 0.0, 0])
        self._held = threading.local()  # per thread: the tables whose writer lock `writing` holds

    @contextmanager
    def writing(self, table: str) -> Iterator[None]:
        """Hold `table`'s writer lock from a read to the writes that depend on it; the writes made
        through this instance meanwhile do not take it again (it is not reentrant)."""
        held = self._held.__dict__.setdefault("tables", set())
        with self.warehouse.writer(table):
            held.add(table)
            try:
                yield
            finally:
                held.discard(table)

    def _lock(self, table: str):
        return nullcontext() if table in self._held.__dict__.get("tables", ()) else self.warehouse.writer(table)

    def exists(self, table: str) -> bool:
        return self._handle(table) is not None

    def _handle(self, table: str) -> DeltaTable | None:
        with self._read_lock:
            handle = self._handles.get(table)
            if handle is None:
                handle = self._open(table)
                if handle is not None:
                    self._handles[table] = handle
            else:
                handle.update_incremental()
            if handle is not None:
                require_current_columns(table, delta_rs_schema(handle), self.warehouse.path(table))
            return handle

    def _open(self, table: str) -> DeltaTable | None:
        try:
            return self.warehouse.delta_rs_table(self.warehouse.path(table))
        except TableNotFoundError:
            return None

    def last_commit(self, table: str) -> dict[str, Any] | None:
        """The commit info of the table's latest version (its `version` included), or None when
        the table does not exist. The commit's metadata are keys of it, whichever writer committed:
        delta-rs puts them there (`overwrite(commit_metadata=...)`), Spark's `Warehouse.overwrite`
        as a JSON object in `userMetadata`."""
        return self._commit_info(table, limit=1)

    def last_rows_commit(self, table: str) -> dict[str, Any] | None:
        """As `last_commit`, for the latest commit that changed the table's rows: the VACUUMs and
        OPTIMIZEs of table maintenance that came after it (at most a few) are skipped. None when
        the table does not exist or only such commits are among its latest ten."""
        return self._commit_info(table, limit=10, skipped=MAINTENANCE_OPERATIONS)

    def _commit_info(self, table: str, limit: int, skipped: tuple[str, ...] = ()) -> dict[str, Any] | None:
        handle = self._handle(table)
        if handle is None:
            return None
        latest = [c for c in handle.history(limit=limit) if c.get("operation") not in skipped][:1]
        if not latest:
            return None
        info = dict(latest[0])
        try:
            spark_metadata = json.loads(info.get("userMetadata") or "{}")
        except ValueError:
            spark_metadata = {}  # another tool's free text
        if isinstance(spark_metadata, dict):
            info.update({k: v for k, v in spark_metadata.items() if k not in info})
        return info

    def versions(self, tables: Sequence[str]) -> dict[str, str]:
        """Commit metadata naming each table's current version (-1: not there yet), under
        `version_key(table)`: what a result derived from those tables records, so that
        `rows_changed_after` can tell later whether they moved on."""
        return {version_key(t): str(-1 if (v := self.version(t)) is None else v) for t in tables}

    def last_change(self, table: str) -> dict[str, Any] | None:
        """`last_rows_commit`, or the very last commit when only maintenance commits are among the
        latest (the last that changed rows is then unknown); None when the table does not exist."""
        return self.last_rows_commit(table) or self.last_commit(table)

    def rows_changed_after(self, table: str, version: int) -> dict[str, Any] | None:
        """The table's `last_change` when it is after `version`; else None. Maintenance (VACUUM,
        OPTIMIZE) changes no rows and moves nothing on."""
        changed = self.last_change(table)
        return changed if changed is not None and changed["version"] > version else None

    def schema(self, table: str) -> T.StructType | None:
        """The table's schema from its Delta log (no data read), as Spark types (the log's JSON is
        Spark's), or None when it does not exist."""
        handle = self._handle(table)
        return None if handle is None else T.StructType.fromJson(json.loads(handle.schema().to_json()))

    def version(self, table: str) -> int | None:
        """The table's latest version, or None when it does not exist (the log only, no data read)."""
        handle = self._handle(table)
        return None if handle is None else handle.version()

    def columns(self, table: str) -> list[str] | None:
        """The column names of the table's latest version, or None when it does not exist."""
        handle = self._handle(table)
        return None if handle is None else [f.name for f in handle.schema().fields]

    def dataset(self, table: str, version: int | None = None) -> pyarrow.dataset.Dataset:
        """The table (at `version`, else the latest) as a pyarrow dataset, to scan in batches;
        `Warehouse.missing`'s error when the table does not exist."""
        return self.snapshot(table, version).to_pyarrow_dataset()

    def snapshot(self, table: str, version: int | None = None) -> DeltaTable:
        """The table's delta-rs handle at `version` (else the latest), not to be written through;
        `Warehouse.missing`'s error when the table does not exist."""
        handle = self._handle(table)
        if handle is None:
            raise self.warehouse.missing(table)
        if version is not None and version != handle.version():
            handle = self.warehouse.delta_rs_table(self.warehouse.path(table), version)  # the cached handle stays at the latest
        return handle

    def read(self, table: str, schema: T.StructType, columns: Sequence[str] | None = None,
             version: int | None = None) -> pa.Table:
        """The table as Arrow (only `columns`) at `version` (else the latest), or an empty table of
        `schema` when it does not exist."""
        handle = self._handle(table) if version is None else self.snapshot(table, version)
        target = arrow_schema(schema)
        if columns is not None:
            target = pa.schema([target.field(c) for c in columns])
        if handle is None:
            return target.empty_table()
        data = pa.table(handle.to_pyarrow_dataset().to_table(columns=list(target.names)))
        return data.cast(target) if data.schema != target else data

    def column_max(self, table: str, column: str) -> int | None:
        """The largest value of a numeric column from the Delta file statistics (no data read)."""
        handle = self._handle(table)
        if handle is None:
            return None
        actions = pa.table(handle.get_add_actions(flatten=True))
        name = f"max.{column}"
        if actions.num_rows == 0 or name not in actions.column_names:
            return None
        if actions.column(name).null_count:
            # A file without statistics: read the column itself to stay exact.
            values = self.read_column(table, column)
            return None if len(values) == 0 else pc.max(values).as_py()
        return pc.max(actions.column(name)).as_py()

    def row_count(self, table: str) -> int:
        """The table's rows (0 when missing): the sum of its files' `numRecords` statistics, no data
        read; a file written without statistics makes it count the rows of one column instead."""
        handle = self._handle(table)
        if handle is None:
            return 0
        records = pa.table(handle.get_add_actions(flatten=True)).column("num_records")
        if records.null_count:
            return handle.to_pyarrow_dataset().count_rows()
        return int(pc.sum(records).as_py() or 0)

    def delete(self, table: str, predicate: str) -> None:
        """Delete the rows matching `predicate` (delta-rs SQL) in one Delta commit; no-op on a missing table."""
        with self._lock(table):
            if not self.exists(table):
                return
            retry_delta_conflicts(lambda: self._open(table).delete(predicate))  # a fresh handle per attempt
            self._writers.pop(table, None)  # an append handle would first have to read this commit

    def update(self, table: str, updates: dict[str, str], predicate: str) -> int:
        """Set columns (delta-rs SQL expressions) of the rows matching `predicate` in one Delta
        commit (none when no row matches); returns the rows updated."""
        with self._lock(table):
            metrics = retry_delta_conflicts(lambda: self._open(table).update(updates=updates, predicate=predicate))
            self._writers.pop(table, None)  # an append handle would first have to read this commit
        return int(metrics.get("num_updated_rows", 0))

    def properties(self, table: str) -> dict[str, str]:
        """The table's Delta properties (`delta.*` configuration); {} when it does not exist."""
        handle = self._handle(table)
        return {} if handle is None else dict(handle.metadata().configuration)

    def set_properties(self, table: str, properties: dict[str, str]) -> None:
        """Set Delta table properties in one metadata commit."""
        with self._lock(table):
            retry_delta_conflicts(lambda: self._open(table).alter.set_table_properties(properties))
            self._writers.pop(table, None)  # an append handle would first have to read this commit

    def file_count(self, table: str) -> int:
        """The table's active data files (0 when it does not exist)."""
        handle = self._handle(table)
        return 0 if handle is None else len(handle.file_uris())

    def stored_bytes(self, table: str) -> int:
        """The size of the table's active data files, from its log (0 when it does not exist)."""
        handle = self._handle(table)
        if handle is None:
            return 0
        return pc.sum(pa.table(handle.get_add_actions(flatten=True)).column("size_bytes")).as_py() or 0

    def bytes_per_row(self, table: str) -> float:
        """The table's stored bytes per row, from its files' sizes and `numRecords` (0 when empty)."""
        handle = self._handle(table)
        if handle is None:
            return 0.0
        actions = pa.table(handle.get_add_actions(flatten=True))
        rows = pc.sum(actions.column("num_records")).as_py() or 0
        return (pc.sum(actions.column("size_bytes")).as_py() or 0) / rows if rows else 0.0

    def compact(self, table: str, target_size: int) -> dict[str, Any]:
        """Merge the table's files smaller than `target_size` bytes into files of about that size,
        in one Delta commit that changes no row (delta-rs OPTIMIZE: dataChange=false, insertion
        order kept); returns delta-rs's metrics (`numFilesRemoved`, `numFilesAdded`, ...)."""
        with self._lock(table):
            metrics = retry_delta_conflicts(
                lambda: self._open(table).optimize.compact(target_size=target_size, max_concurrent_tasks=1)
            )
            self._writers.pop(table, None)  # an append handle would first have to read this commit
        return metrics

    def vacuum(self, table: str, retention_hours: float | None = None) -> list[str]:
        """Delete the files of `table` that no version references and that were removed (or, never
        committed, written) longer ago than its `delta.deletedFileRetentionDuration` (Delta's
        default: a week), or than `retention_hours` (rounded up to whole hours) when given: delta-rs
        VACUUM in full mode, which also finds files whose tombstones a checkpoint has dropped. As
        Delta's own VACUUM, it refuses a retention shorter than the table's. Returns the deleted
        files' paths."""
        hours = None if retention_hours is None else math.ceil(retention_hours)
        with self._lock(table):
            deleted = retry_delta_conflicts(lambda: self._open(table).vacuum(retention_hours=hours, dry_run=False, full=True))
            self._writers.pop(table, None)  # an append handle would first have to read its commits
        return deleted

    def read_column(self, table: str, column: str) -> pa.ChunkedArray:
        handle = self._handle(table)
        return handle.to_pyarrow_dataset().to_table(columns=[column]).column(column)

    def append(self, table: str, schema: T.StructType, rows: Iterable[dict[str, Any]] | pa.Table) -> int:
        """Append rows (dicts with the schema's columns, or an Arrow table) in one Delta commit."""
        data = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(list(rows), schema=arrow_schema(schema))
        if data.num_rows == 0:
            return 0
        data = stored_arrow(table, data)
        started = time.perf_counter()
        with self._lock(table):
            retry_delta_conflicts(lambda: self._write(table, data))
        stats = self.append_stats[table]
        stats[0] += 1
        stats[1] += time.perf_counter() - started
        stats[2] += data.num_rows
        return data.num_rows

    def overwrite(self, table: str, data: pa.Table | list[dict[str, Any]], schema: T.StructType,
                  predicate: str | None = None, commit_metadata: dict[str, str] | None = None) -> int:
        """Replace the table (or only its rows matching `predicate`, delta-rs SQL) with `data` (an
        Arrow table, or dicts with the schema's columns) in one Delta commit, whose commit info
        carries `commit_metadata` (see `last_commit`).

        The driver's way to write a small result: one commit, where Spark's Delta writer runs several
        Spark jobs even for a table of ten rows (docs/benchmarks.md, "Driver writes").
        """
        target = arrow_schema(schema)
        if not isinstance(data, pa.Table):
            data = pa.Table.from_pylist(data, schema=target)
        data = data.select(schema.fieldNames())
        if data.schema != target:
            data = data.cast(target)
        data = stored_arrow(table, data)
        path = self.warehouse.path(table)
        options = self.warehouse.storage_options(path)
        properties = CommitProperties(custom_metadata=commit_metadata) if commit_metadata else None
        with self._lock(table):
            if predicate is None or not self.exists(table):
                retry_delta_conflicts(lambda: write_deltalake(path, data, mode="overwrite", schema_mode="overwrite",
                                                              commit_properties=properties, storage_options=options))
            else:
                retry_delta_conflicts(lambda: write_deltalake(path, data, mode="overwrite", predicate=predicate,
                                                              commit_properties=properties, storage_options=options))
            self._writers.pop(table, None)  # an append handle would first have to read this commit
        return data.num_rows

    def _write(self, table: str, data: pa.Table) -> None:
        handle = self._writers.get(table) or self._open(table)
        try:
            if handle is None:  # the first append creates the table
                path = self.warehouse.path(table)
                write_deltalake(path, data, mode="append", storage_options=self.warehouse.storage_options(path))
                return
            before = handle.version()
            interval = int(handle.metadata().configuration.get("delta.checkpointInterval") or DEFAULT_CHECKPOINT_INTERVAL)
            checkpoint = (before + 1) % interval == 0
            hooks = PostCommitHookProperties(create_checkpoint=True, cleanup_expired_logs=None if checkpoint else False)
            write_deltalake(handle, data, mode="append", post_commithook_properties=hooks)
        except CommitFailedError:
            self._writers.pop(table, None)  # re-read the log, then let the retry happen
            raise
        if handle.version() // interval > before // interval:
            self._writers.pop(table, None)  # a checkpoint was written: start from it next time
        else:
            self._writers[table] = handle
