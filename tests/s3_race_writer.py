"""A writer process for the S3 race test (tests/test_s3_race.py), standing for one host.

Usage: python -m tests.s3_race_writer HOST ROUNDS READY_FILE GO_FILE
The warehouse and the store come from the environment (TXNLAKE_WAREHOUSE=s3://..., TXNLAKE_S3_*).
Once its SparkSession is up it touches READY_FILE and waits for GO_FILE. Then, on two tables, its
main thread appends a batch through Spark and rewrites its Spark rows (`rev` + 1) ROUNDS times,
while a second thread does the same through delta-rs until the main thread is done: delta-rs
commits land between Spark's read and its commit, on this host and the other. `race` is written
the txnlake way (`Warehouse`, `DeltaTables`: under the tables' leases), `race_raw` with Spark's and
delta-rs's own calls and no lock, so only Delta's commit protocol on the store keeps it whole
(partitioned by writer, so that a rewrite conflicts with no one's appends but at the commit itself).
Prints a JSON line: how many batches each way wrote.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import write_deltalake
from pyspark.sql import types as T

from resources.spark import get_spark
from txn_engine.storage.delta_io import DeltaTables, arrow_schema
from txn_engine.storage.warehouse import Warehouse, retry_delta_conflicts

SCHEMA = T.StructType([T.StructField("host", T.StringType()), T.StructField("via", T.StringType()),
                       T.StructField("batch", T.IntegerType()), T.StructField("i", T.IntegerType()),
                       T.StructField("rev", T.IntegerType())])
ROWS = 5
PARTITIONS = ["host", "via"]
MIN_DELTA_RS_BATCHES = 4
PAUSE = 1.0


def batch(host: str, via: str, number: int) -> pa.Table:
    return pa.Table.from_pylist([{"host": host, "via": via, "batch": number, "i": i, "rev": 0} for i in range(ROWS)],
                                arrow_schema(SCHEMA))


def bumped(rows: pa.Table) -> pa.Table:
    return rows.set_column(4, "rev", pc.add(rows["rev"], 1))


def main() -> None:
    host, rounds, ready, go = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    spark = get_spark(conf={"spark.driver.memory": "1g", "spark.sql.shuffle.partitions": "1",
                            "spark.databricks.delta.snapshotPartitions": "1"})
    wh = Warehouse(spark)
    tables = DeltaTables(wh)
    raw = wh.path("race_raw")
    options = wh.storage_options(raw)

    def own(via: str) -> tuple[str, list[tuple]]:
        # Only this thread writes these rows, so reading them before the commit decides nothing stale.
        return f"host = '{host}' AND via = '{via}'", [("host", "=", host), ("via", "=", via)]

    def delta_rs_writer(done: threading.Event, written: list[int]) -> None:
        predicate, filters = own("delta-rs")
        while not done.is_set() or written[0] < MIN_DELTA_RS_BATCHES:
            rows = batch(host, "delta-rs", written[0])
            tables.append("race", SCHEMA, rows)
            mine = tables.read("race", SCHEMA).filter((pc.field("host") == host) & (pc.field("via") == "delta-rs"))
            tables.overwrite("race", bumped(mine), SCHEMA, predicate=predicate)
            retry_delta_conflicts(lambda: write_deltalake(raw, rows, mode="append", partition_by=PARTITIONS,
                                                          storage_options=options))
            retry_delta_conflicts(lambda: write_deltalake(
                raw, bumped(wh.delta_rs_table(raw).to_pyarrow_table(filters=filters)), mode="overwrite",
                partition_by=PARTITIONS, predicate=predicate, storage_options=options))
            written[0] += 1
            # Paced: Spark's commits, slowed on the way to the store, still meet delta-rs commits
            # from both hosts, without retrying behind an unbroken stream of them.
            done.wait(PAUSE)

    Path(ready).touch()
    while not Path(go).exists():
        time.sleep(0.01)
    done, written = threading.Event(), [0]
    other = threading.Thread(target=delta_rs_writer, args=(done, written))
    other.start()
    try:
        predicate, filters = own("spark")
        for r in range(rounds):
            frame = spark.createDataFrame(batch(host, "spark", r).to_pylist(), SCHEMA)
            wh.append("race", frame)
            mine = tables.read("race", SCHEMA).filter((pc.field("host") == host) & (pc.field("via") == "spark"))
            wh.overwrite("race", spark.createDataFrame(bumped(mine).to_pylist(), SCHEMA), replace_where=predicate)
            retry_delta_conflicts(lambda: frame.write.format("delta").mode("append").partitionBy(*PARTITIONS).save(raw))
            retry_delta_conflicts(lambda: spark.createDataFrame(
                bumped(wh.delta_rs_table(raw).to_pyarrow_table(filters=filters)).to_pylist(), SCHEMA)
                .write.format("delta").mode("overwrite").partitionBy(*PARTITIONS).option("replaceWhere", predicate).save(raw))
    finally:
        done.set()
        other.join()
    print(json.dumps({"host": host, "spark": rounds, "delta-rs": written[0]}), flush=True)


if __name__ == "__main__":
    main()
