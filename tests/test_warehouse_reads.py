"""`Warehouse.read`: a small table as the Parquet files of its Delta log, a table the files alone do
not describe through Delta's reader, and the same rows either way."""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from txn_engine.core.errors import TableMissingError
from txn_engine.storage.warehouse import PARQUET_READ_MAX_FILES


def _scan(frame) -> str:
    """How Spark scans the frame: its physical plan."""
    return frame._jdf.queryExecution().executedPlan().toString()


def _rows(frame) -> list[tuple]:
    return sorted(tuple(r) for r in frame.collect())


def _by_delta(spark, location: str, version: int | None = None):
    reader = spark.read.format("delta")
    if version is not None:
        reader = reader.option("versionAsOf", version)
    return reader.load(location)


def _batch(start: int, n: int) -> pa.Table:
    return pa.table({"topic": pa.array([f"t-{i % 3}" for i in range(start, start + n)], pa.string()),
                     "ledger_id": pa.array(range(start, start + n), pa.int64()),
                     "payload": pa.array([None if i % 5 == 0 else bytes([i % 256]) * 3 for i in range(start, start + n)],
                                         pa.binary())})


def test_a_small_table_is_its_parquet_files_at_any_version(spark, warehouse):
    location = str(warehouse.settings.warehouse) + "/small"
    write_deltalake(location, _batch(0, 10))
    write_deltalake(location, _batch(10, 10), mode="append")
    write_deltalake(location, _batch(0, 4), mode="overwrite", predicate="ledger_id < 5")  # a file replaced

    latest = warehouse.read("small", location)
    assert "InMemoryFileIndex" in _scan(latest) and "Delta" not in _scan(latest)
    assert _rows(latest) == _rows(_by_delta(spark, location))
    assert sorted(r.ledger_id for r in latest.collect()) == [0, 1, 2, 3, *range(5, 20)]
    assert latest.schema == _by_delta(spark, location).schema

    first = warehouse.read("small", location, version=0)
    assert _rows(first) == _rows(_by_delta(spark, location, 0)) and first.count() == 10


def test_deletion_vectors_partitions_and_many_files_go_through_delta(spark, warehouse):
    root = str(warehouse.settings.warehouse)
    # Deletion vectors: the file still holds the deleted rows; only Delta's reader hides them.
    with_dv = root + "/with_dv"
    spark.createDataFrame(_batch(0, 20).to_pandas()).write.format("delta").option(
        "delta.enableDeletionVectors", "true").save(with_dv)
    spark.sql(f"DELETE FROM delta.`{with_dv}` WHERE ledger_id < 5")
    read = warehouse.read("with_dv", with_dv)
    assert "Delta" in _scan(read)
    assert sorted(r.ledger_id for r in read.collect()) == list(range(5, 20))

    # Partition values live in the log (and the folder names), not in the files.
    partitioned = root + "/partitioned"
    write_deltalake(partitioned, _batch(0, 12), partition_by=["topic"])
    read = warehouse.read("partitioned", partitioned)
    assert "Delta" in _scan(read)
    assert _rows(read) == _rows(_by_delta(spark, partitioned))

    many = root + "/many"
    for i in range(PARQUET_READ_MAX_FILES + 1):
        write_deltalake(many, _batch(i, 1), mode="append")
    read = warehouse.read("many", many)
    assert "Delta" in _scan(read) and read.count() == PARQUET_READ_MAX_FILES + 1


def test_an_empty_table_and_a_missing_one(spark, warehouse):
    location = str(warehouse.settings.warehouse) + "/empty"
    write_deltalake(location, _batch(0, 0))
    empty = warehouse.read("empty", location)
    assert empty.count() == 0 and [f.name for f in empty.schema.fields] == ["topic", "ledger_id", "payload"]
    with pytest.raises(TableMissingError, match="does not exist yet"):
        warehouse.read("nothing", str(warehouse.settings.warehouse) + "/nothing")
