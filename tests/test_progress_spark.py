"""The heartbeat's Spark progress on a real session: tasks done of total, and rows as tasks finish."""

from __future__ import annotations

import threading
import time

from pipelines.progress import spark_progress


def test_spark_progress_tells_tasks_and_rows(spark, tmp_path):
    spark.range(0, 400_000, numPartitions=8).selectExpr("id % 7 as k", "id").write.parquet(str(tmp_path / "rows"))
    # One task per file, each slowed so that the job is still running while we look.
    slow = spark.read.parquet(str(tmp_path / "rows")).repartition(8).mapInPandas(
        lambda frames: (time.sleep(0.5) or f for f in frames), "k long, id long")
    job = threading.Thread(target=slow.count)
    job.start()
    seen = []
    while job.is_alive():
        seen.append(spark_progress())
        time.sleep(0.1)
    job.join()
    running = [s for s in seen if s and "stage(s) running" in s]
    assert running, seen
    assert any("rows read" in s for s in running), running
    assert spark_progress() == "Spark: between jobs"
