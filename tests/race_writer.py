"""A writer process for the concurrency test: appends batches to one Delta table via Warehouse.

Usage: python -m tests.race_writer WAREHOUSE TABLE WRITER_ID BATCHES READY_FILE GO_FILE
It signals READY_FILE once its SparkSession is up, waits for GO_FILE, then appends as fast as
it can, so both writers' commits overlap.
"""

import sys
import time
from pathlib import Path

from resources.spark import get_spark
from txn_engine.core.settings import WarehouseSettings
from txn_engine.storage.warehouse import Warehouse


def main() -> None:
    root, table, writer_id, batches, ready, go = sys.argv[1:7]
    spark = get_spark(conf={"spark.driver.memory": "1g", "spark.sql.shuffle.partitions": "1"})
    warehouse = Warehouse(spark, WarehouseSettings(warehouse=root))
    frames = [
        spark.createDataFrame([(writer_id, b, i) for i in range(10)], "writer string, batch int, i int")
        for b in range(int(batches))
    ]
    Path(ready).touch()
    while not Path(go).exists():
        time.sleep(0.01)
    for frame in frames:
        warehouse.append(table, frame)


if __name__ == "__main__":
    main()
