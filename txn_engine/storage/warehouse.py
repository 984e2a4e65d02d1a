"""Reading and writing the warehouse's Delta tables, with one writer per table at a time."""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

from delta.exceptions import (
    ConcurrentAppendException,
    ConcurrentDeleteDeleteException,
    ConcurrentDeleteReadException,
    ConcurrentTransactionException,
    ConcurrentWriteException,
    MetadataChangedException,
    ProtocolChangedException,
)
import deltalake
from delta.tables import DeltaTable
from deltalake.exceptions import CommitFailedError, TableNotFoundError
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from txn_engine.core.errors import TableMissingError, TxnlakeError, WarehouseMigrationError
from txn_engine.storage.arrow_frames import local_frame
from txn_engine.storage.locks import writer_lock
from txn_engine.core.schema import ADDED_COLUMNS, TXN_HALVES, TXN_ID, column_paths, stored_schema, struct_elements, txn_id_owed
from txn_engine.core.settings import WarehouseSettings

log = logging.getLogger(__name__)

# Delta's conflict exceptions share no Python base class, so they are named one by one. They
# still happen under our lock when a writer that does not take it (another cluster, a
# notebook) commits to the same table.
DELTA_CONFLICTS = (
    ConcurrentAppendException,
    ConcurrentDeleteReadException,
    ConcurrentDeleteDeleteException,
    ConcurrentTransactionException,
    ConcurrentWriteException,
    MetadataChangedException,
    ProtocolChangedException,
    CommitFailedError,  # delta-rs (the engine's write path): another writer won the version
)

T = TypeVar("T")


class Warehouse:
    """The Delta tables under one warehouse root, read and written through one SparkSession."""

    def __init__(self, spark: SparkSession | Callable[[], SparkSession], settings: WarehouseSettings | None = None):
        self._spark = spark
        self.settings = settings or WarehouseSettings()
        self._storage_applied = False

    @property
    def spark(self) -> SparkSession:
        """The session; given a factory (`SparkResource.session`), started on first use, so work
        done by delta-rs alone (an incremental buffer run's checks) starts no JVM."""
        if callable(self._spark):
            self._spark = self._spark()
        if not self._storage_applied:
            self._storage_applied = True
            # The store's settings of this warehouse (they may come from the Dagster resource, not the
            # environment the session started from): Hadoop's configuration is read per file system
            # and shipped with each job, so setting it now reaches the executors too.
            if storage := self.settings.spark_storage_conf():
                hadoop = self._spark.sparkContext._jsc.hadoopConfiguration()
                for key, value in storage.items():
                    hadoop.set(key.removeprefix("spark.hadoop."), value)
        return self._spark

    def path(self, table: str) -> str:
        """Where `table` lives (`WarehouseSettings.table_path`: by the table's place)."""
        return self.settings.table_path(table)

    def storage_options(self, location: str) -> dict[str, str] | None:
        """delta-rs's `storage_options` for a table at `location` (the store's settings on S3)."""
        return self.settings.storage_options(location)

    def delta_rs_table(self, location: str, version: int | None = None) -> deltalake.DeltaTable:
        """The delta-rs handle of the table at `location` (at `version`, else the latest)."""
        return deltalake.DeltaTable(location, version=version, storage_options=self.storage_options(location))

    def exists(self, table: str, path: str | None = None) -> bool:
        # From the log through delta-rs: Spark's isDeltaTable loads Delta's JVM classes (4 s cold).
        location = path or self.path(table)
        return deltalake.DeltaTable.is_deltatable(location, storage_options=self.storage_options(location))

    def missing(self, table: str, path: str | None = None) -> TableMissingError:
        """The error for reading `table` before it exists: where it was looked for, and what makes it."""
        return TableMissingError(
            f"table {table} does not exist yet at {path or self.path(table)}. Ingest ledgers first "
            f"(`txnlake ingest FILE`) or materialize the asset {table}."
        )

    def read(self, table: str, path: str | None = None, version: int | None = None) -> DataFrame:
        """The table (at `version`, else the latest) as a DataFrame; `missing`'s error when it does not exist.

        A table of at most `PARQUET_READ_MAX_FILES` files that needs no reader feature of Delta
        (`parquet_files`) is read as those Parquet files, found by delta-rs in the table's log:
        Delta's own read of a table that changed since the session last saw it costs Spark jobs
        to rebuild its snapshot, several times the scan of a small table (docs/benchmarks.md,
        "Driver reads"). A larger table is read by Delta, which skips files by their statistics.
        """
        location = path or self.path(table)
        try:
            handle = self.delta_rs_table(location, version)
        except TableNotFoundError:
            raise self.missing(table, location) from None
        schema = delta_rs_schema(handle)
        require_current_columns(table, schema, location)
        files = parquet_files(handle)
        if files is None:
            reader = self.spark.read.format("delta")
            if version is not None:
                reader = reader.option("versionAsOf", version)
            return reader.load(location)
        if not files:
            return local_frame(self.spark, [], schema)
        return self.spark.read.schema(schema).parquet(*files)

    def read_or_empty(self, table: str, schema: StructType, path: str | None = None) -> DataFrame:
        try:
            return self.read(table, path)
        except TableMissingError:
            return local_frame(self.spark, [], schema)

    def version(self, table: str, path: str | None = None) -> int | None:
        location = path or self.path(table)
        if not self.exists(table, location):
            return None
        # From the log through delta-rs: Spark's history() costs a Spark job (~0.4 s) for one number.
        return self.delta_rs_table(location).version()

    @contextmanager
    def writer(self, table: str) -> Iterator[None]:
        """Exclusive right to write `table`, across processes: hold it from read to commit."""
        with writer_lock(self.settings, table):
            yield

    def append(self, table: str, df: DataFrame, path: str | None = None) -> None:
        location = path or self.path(table)
        with self.writer(table):
            stored = stored_frame(table, df)
            retry_delta_conflicts(lambda: stored.write.format("delta").mode("append").save(location))

    def overwrite(
        self,
        table: str,
        df: DataFrame,
        replace_where: str | None = None,
        path: str | None = None,
        commit_metadata: dict[str, str] | None = None,
        schema: StructType | None = None,
    ) -> None:
        """Replace the table (or only the rows matching `replace_where`) in one Delta commit, whose
        commit info carries `commit_metadata` (as Delta's `userMetadata`, a JSON object:
        `DeltaTables.last_commit` reads it back).

        `schema`: the table's own, whose NOT NULL columns stay NOT NULL (and are enforced by Delta)
        though Spark computes `df`'s as nullable: a missing table is created with it first, and a
        table with its columns is written without replacing its schema."""
        location = path or self.path(table)
        if schema is not None:  # as stored: described, with `txn_id` where the table has it
            schema = stored_schema(table) or schema
        with self.writer(table):
            writer = stored_frame(table, df).write.format("delta").mode("overwrite")
            if commit_metadata:
                writer = writer.option("userMetadata", json.dumps(commit_metadata, sort_keys=True))
            exists = self.exists(table, location)
            if schema is not None and not exists:
                self.create_missing(table, schema, location)
                exists = True
            if replace_where is not None and exists:
                writer = writer.option("replaceWhere", replace_where)
            elif schema is None or not _same_columns(delta_rs_schema(self.delta_rs_table(location)), schema):
                writer = writer.option("overwriteSchema", "true")
            retry_delta_conflicts(lambda: writer.save(location))

    def create_missing(self, table: str, schema: StructType, path: str | None = None) -> None:
        """Create `table` empty with `schema` as stored when it does not exist, so a Spark write keeps
        its NOT NULL columns (Spark computes most as nullable). The caller holds the writer lock."""
        location = path or self.path(table)
        if not self.exists(table, location):
            DeltaTable.createIfNotExists(self.spark).location(location).addColumns(stored_schema(table) or schema).execute()

    def delete(self, table: str, predicate: str, path: str | None = None) -> None:
        """Delete the rows matching `predicate` (Spark SQL) in one Delta commit; no-op on a missing table."""
        location = path or self.path(table)
        with self.writer(table):
            if self.exists(table, location):
                retry_delta_conflicts(lambda: DeltaTable.forPath(self.spark, location).delete(predicate))


# Spark lists more paths than `spark.sql.sources.parallelPartitionDiscovery.threshold` (32) with a
# Spark job of its own: past it, Delta's read (which takes the files' sizes from its log) is cheaper.
PARQUET_READ_MAX_FILES = 32
_GLOB_CHARACTERS = set("*?[]{}\\")


def parquet_files(handle: deltalake.DeltaTable) -> list[str] | None:
    """The Parquet files of a delta-rs snapshot when they alone hold its rows, or None: a table
    whose protocol has reader features (deletion vectors, column mapping ...), that is partitioned
    (its partition values live in the log, not in the files), of more than `PARQUET_READ_MAX_FILES`
    files, or whose paths Spark would take for globs."""
    if handle.protocol().min_reader_version > 1 or handle.metadata().partition_columns:
        return None
    files = handle.file_uris()
    if len(files) > PARQUET_READ_MAX_FILES or any(_GLOB_CHARACTERS & set(f) for f in files):
        return None
    return files


def _same_columns(a: StructType, b: StructType) -> bool:
    """The same column names and types, in order, whatever their nullability."""
    return [(f.name, f.dataType) for f in a.fields] == [(f.name, f.dataType) for f in b.fields]


def require_current_columns(table: str, schema: StructType, location: str) -> None:
    """Refuse a table written before columns the contract added since (`schema.ADDED_COLUMNS`):
    reading or appending it would fail deep inside a job, or drop the new columns' values."""
    paths = column_paths(schema)
    missing = [c for c in ADDED_COLUMNS.get(table, ()) if txn_id_owed(c, paths) and c not in paths]
    if missing:
        raise WarehouseMigrationError(
            f"{table} at {location} has no column(s) {', '.join(missing)}: it was written by an older txnlake. "
            "Run `txnlake migrate` once: it adds them (empty for the lossless keys, headers and timestamp types; "
            "txn_id from the two halves) and changes no stored value."
        )


def delta_rs_schema(handle: deltalake.DeltaTable) -> StructType:
    """A delta-rs table's schema as Spark types (both write Delta's JSON form): no JVM."""
    return StructType.fromJson(json.loads(handle.schema().to_json()))


def txn_id_column(half: Callable[[str], Column] = F.col) -> Column:
    """`schema.TXN_ID_SQL` as a Spark column: "most:least", null when either half is (CONCAT's rule);
    `half` gives a half by name (a row's column by default, or an array element's field)."""
    return F.concat(half(TXN_HALVES[0]).cast("string"), F.lit(":"), half(TXN_HALVES[1]).cast("string"))


def elements_as(name: str, stored: StructType) -> Column:
    """An array column's struct elements as `stored` has them: its fields in its order, a `txn_id`
    it names computed from the element's halves."""
    return F.transform(F.col(f"`{name}`"), lambda e: F.struct(
        *[(txn_id_column(lambda h: e[h]) if f.name == TXN_ID else e[f.name]).alias(f.name) for f in stored.fields]))


def stored_frame(table: str, frame: DataFrame) -> DataFrame:
    """`frame` as `table` stores it (`schema.stored_schema`): its columns in the table's order, each
    with its description (Delta's column comment), and the readable `txn_id` computed from the two
    halves where the table has it (in an array's elements too). A column the frame lacks stays
    absent; one the table does not name is kept last. A projection: no Spark job."""
    stored = stored_schema(table)
    if stored is None:
        return frame
    present = set(frame.columns)
    paths = column_paths(frame.schema)
    with_halves = set(TXN_HALVES) <= present
    columns = []
    for field in stored.fields:
        elements = struct_elements(field)
        if field.name == TXN_ID and with_halves:
            columns.append(txn_id_column().alias(TXN_ID, metadata=field.metadata))
        elif field.name in present and elements and TXN_ID in elements.fieldNames() \
                and txn_id_owed(f"{field.name}.{TXN_ID}", paths):
            columns.append(elements_as(field.name, elements).alias(field.name, metadata=field.metadata))
        elif field.name in present:
            columns.append(F.col(f"`{field.name}`").alias(field.name, metadata=field.metadata))
    named = set(stored.fieldNames())
    columns += [F.col(f"`{c}`") for c in frame.columns if c not in named]
    return frame.select(*columns)


def retry_delta_conflicts(action: Callable[[], T], attempts: int = 5) -> T:
    """Run a Delta commit, retrying Delta's optimistic-concurrency conflicts with backoff."""
    for attempt in range(1, attempts + 1):
        try:
            return action()
        except DELTA_CONFLICTS as exc:
            if attempt == attempts:
                raise TxnlakeError(
                    f"gave up after {attempts} Delta commit conflicts ({type(exc).__name__}); "
                    "another writer keeps changing this table. Retry when it is done."
                ) from exc
            log.warning("Delta commit conflict (%s), retry %d", type(exc).__name__, attempt)
            time.sleep(0.2 * attempt)
    raise AssertionError("unreachable")
