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


def test_topic_rows_decode_a_row_group_once_and_equal_a_filtered_scan(tmp_path):
    """`TopicRows` over row groups of one topic, of several (where the sorted rows pass from one
    topic to the next, and an unsorted file), and one whose bounds admit a topic it lacks."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow.compute as pc
    from deltalake import DeltaTable, WriterProperties

    from txn_engine.storage.delta_io import TopicRows

    def rows(topics: list[str], first: int) -> pa.Table:
        return pa.table({"topic": pa.array(topics, pa.string()),
                         "entry_id": pa.array(range(first, first + len(topics)), pa.int64()),
                         "payload": pa.array([bytes([i]) * 5 for i in range(len(topics))], pa.binary())})

    location = str(tmp_path / "entries")
    four = WriterProperties(max_row_group_size=4)
    # Row groups [a a a a] [a a b b] [b b b b] [c c], then [b d b d] [b d].
    write_deltalake(location, rows(["a"] * 6 + ["b"] * 6 + ["c"] * 2, 0), writer_properties=four)
    write_deltalake(location, rows(["b", "d"] * 3, 100), mode="append", writer_properties=four)
    source = DeltaTable(location).to_pyarrow_dataset()
    topics = ["a", "b", "c", "d"]
    reads = TopicRows(source, topics)
    assert len(reads._shared) == 3  # [a a b b], [b d b d] (which admits c too), [b d]

    with ThreadPoolExecutor(4) as pool:
        got = dict(zip(topics, pool.map(reads.rows, topics)))
    for topic in topics:
        assert got[topic].equals(source.to_table(filter=pc.field("topic") == topic)), topic
    assert [got[t].num_rows for t in topics] == [6, 9, 2, 3]
    assert all(shared.table is None and shared.users == 0 for shared in reads._shared.values())  # none kept
    assert reads.rows("e").num_rows == 0
