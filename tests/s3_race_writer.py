"""A writer process for the S3 race test (tests/test_s3_race.py), standing for one host.

Usage: python -m tests.s3_race_writer HOST ROUNDS READY_FILE GO_FILE
The warehouse and the store come from the environment (TXNLAKE_WAREHOUSE=s3://..., TXNLAKE_S3_*).
Once its SparkSession is up it touches READY_FILE, waits for GO_FILE, then runs ROUNDS rounds on
two tables. `race` is written the txnlake way (`Warehouse`, `DeltaTables`: under the tables'
leases), each round a Spark append, a delta-rs append and a delta-rs rewrite of this host's rows
(`rev` + 1); `race_raw` with Spark's and delta-rs's own calls and no lock at all, as a writer
outside txnlake would, so only Delta's commit protocol on the store keeps it whole: each round a
Spark append, a delta-rs append, a Spark rewrite and a delta-rs rewrite.
"""

from __future__ import annotations

import sys
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
                       T.StructField("round", T.IntegerType()), T.StructField("i", T.IntegerType()),
                       T.StructField("rev", T.IntegerType())])
ROWS = 10


def batch(host: str, via: str, round_: int) -> list[dict]:
    return [{"host": host, "via": via, "round": round_, "i": i, "rev": 0} for i in range(ROWS)]


def main() -> None:
    host, rounds, ready, go = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    spark = get_spark(conf={"spark.driver.memory": "1g", "spark.sql.shuffle.partitions": "1",
                            "spark.databricks.delta.snapshotPartitions": "1"})
    wh = Warehouse(spark)
    tables = DeltaTables(wh)
    mine = f"host = '{host}'"
    raw = wh.path("race_raw")
    options = wh.storage_options(raw)
    Path(ready).touch()
    while not Path(go).exists():
        time.sleep(0.01)
    for r in range(rounds):
        # Through txnlake: each commit under the table's lease.
        wh.append("race", spark.createDataFrame(batch(host, "spark", r), SCHEMA))
        tables.append("race", SCHEMA, batch(host, "delta-rs", r))
        own = tables.read("race", SCHEMA).filter(pc.equal(pc.field("host"), host))
        tables.overwrite("race", own.set_column(4, "rev", pc.add(own["rev"], 1)), SCHEMA, predicate=mine)

        # Outside txnlake: no lock, Delta's conflicts retried as any writer must.
        retry_delta_conflicts(lambda: spark.createDataFrame(batch(host, "spark", r), SCHEMA)
                              .write.format("delta").mode("append").save(raw))
        retry_delta_conflicts(lambda: write_deltalake(raw, pa.Table.from_pylist(batch(host, "delta-rs", r), arrow_schema(SCHEMA)),
                                                      mode="append", storage_options=options))

        def rewritten() -> pa.Table:  # this host's rows, `rev` + 1 (only this host writes them)
            rows = wh.delta_rs_table(raw).to_pyarrow_table(filters=[("host", "=", host)])
            return rows.set_column(4, "rev", pc.add(rows["rev"], 1))

        def spark_rewrite():
            spark.createDataFrame(rewritten().to_pylist(), SCHEMA).write.format("delta").mode("overwrite") \
                .option("replaceWhere", mine).save(raw)

        def delta_rs_rewrite():
            write_deltalake(raw, rewritten(), mode="overwrite", predicate=mine, storage_options=options)

        retry_delta_conflicts(spark_rewrite, attempts=20)
        retry_delta_conflicts(delta_rs_rewrite, attempts=20)
    print(f"{host}: {rounds} rounds written", flush=True)


if __name__ == "__main__":
    main()
