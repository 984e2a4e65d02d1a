"""Benchmark: transaction-buffer snapshots, N aborted transactions over 4 topics (default 1 million).

Measured side by side in one run, on the same `ledger_entries` Delta table (each aborted
transaction is a DATA entry and its ABORT marker; 10 000 entries a ledger, ledger ids unique
across topics; files of 100 000 entries, each a range of ledgers, as ingest appends leave them):
- snapshot write: segments of every topic's abort set, from `aborted_txns` + `stable_positions`;
- after the snapshot, 1% more aborted transactions are appended (the replay's work);
- recovery from the snapshot (`recovered_buffer_state`) against a full replay of ledger_entries
  (the buffer jobs' abort set and stable position), both computed and written as Delta tables;
- the number of segments, peak memory, and that recovery equals the full replay.
Target: recovery at least 10x faster than the full replay at 1 million aborts.
`BENCH_ABORTS` sets N (develop at 100 000); BENCH_ENTRIES does not apply (the size is in aborts).
"""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.measure import jvm_peak_rss_mib, python_peak_rss_mib, timed

TOPICS = 4
LEDGER_SIZE = 10_000
TAIL_FRACTION = 0.01
ENTRIES_PER_FILE = 100_000


def log_frame(spark, first_txn: int, count: int):
    """`count` aborted transactions from `first_txn`, round-robin over the topics, as ledger_entries rows."""
    from pyspark.sql import functions as F

    from txn_engine.core.schema import LEDGER_ENTRIES_SCHEMA

    txns = spark.range(first_txn, first_txn + count).select(F.col("id").alias("txn"))
    per_topic = F.floor(F.col("txn") / TOPICS)  # the transaction's rank on its topic
    rows = txns.select(
        F.format_string("bench-topic-%d", F.col("txn") % TOPICS).alias("topic"),
        F.col("txn"),
        F.explode(F.array(F.lit(0), F.lit(1))).alias("k"),
        (per_topic * 2).alias("_n"),
    ).withColumn("_n", F.col("_n") + F.col("k"))
    rows = rows.select(
        "topic",
        # BookKeeper-style ids: unique across topics, increasing with creation time (the topics'
        # ledgers are created in turn).
        (F.floor(F.col("_n") / LEDGER_SIZE) * TOPICS + F.col("txn") % TOPICS + 1).cast("long").alias("ledger_id"),
        (F.col("_n") % LEDGER_SIZE).cast("long").alias("entry_id"),
        F.when(F.col("k") == 0, F.lit("DATA")).otherwise(F.lit("ABORT")).alias("entry_type"),
        F.lit(1).cast("long").alias("txn_most_bits"),
        F.col("txn").cast("long").alias("txn_least_bits"),
        F.lit(None).cast("long").alias("producer_id"),
        F.lit(None).cast("int").alias("producer_epoch"),
        F.lit(None).cast("long").alias("sequence_id"),
        F.current_timestamp().alias("publish_time"),
        F.lit(None).cast("string").alias("key"),
        F.when(F.col("k") == 0, F.expr("unhex(repeat('ab', 100))")).alias("payload"),
    )
    # The columns a Pulsar-like log leaves null (key_bytes, headers, timestamp_type).
    return rows.select(*[(F.col(f.name) if f.name in rows.columns else F.lit(None)).cast(f.dataType).alias(f.name)
                         for f in LEDGER_ENTRIES_SCHEMA.fields])


def as_ingested(frame, entries: int):
    """The layout appends of a growing log leave: files of ~ENTRIES_PER_FILE entries, each a range
    of ledgers, sorted by position as ingest writes them (what lets recovery skip old files)."""
    from txn_engine.core.schema import POSITION_COLUMNS

    files = max(1, entries // ENTRIES_PER_FILE)
    return frame.repartitionByRange(files, "ledger_id", "entry_id").sortWithinPartitions(*POSITION_COLUMNS)


def run(aborts: int, workdir: Path) -> dict:
    from pyspark.sql import functions as F

    from resources.spark import get_spark
    from txn_engine.buffer.spark_runner import compute_buffer_tables
    from txn_engine.core.schema import ABORTED_TXNS, LEDGER_ENTRIES, RECOVERED_BUFFER_STATE, STABLE_POSITIONS
    from txn_engine.core.settings import WarehouseSettings
    from txn_engine.snapshots.jobs import (
        entries_after_snapshots,
        full_replay_states,
        TriggerConfig,
        current_snapshot_states,
        live_snapshots,
        read_segments,
        recover_from_warehouse,
        recovery_mismatches,
        write_snapshots,
    )
    from txn_engine.snapshots.recovery import recover_to_warehouse
    from txn_engine.storage.warehouse import Warehouse

    print(f"== snapshot benchmark: {aborts:,} aborted transactions over {TOPICS} topics, workdir {workdir}")
    spark = get_spark()
    wh = Warehouse(spark, WarehouseSettings(warehouse=str(workdir / "wh")))
    tail = max(1, int(aborts * TAIL_FRACTION))
    with timed(f"write ledger_entries ({2 * aborts:,} entries)"):
        wh.overwrite(LEDGER_ENTRIES, as_ingested(log_frame(spark, 0, aborts), 2 * aborts))
    with timed("buffer tables (aborted_txns, stable_positions)"):
        tables = compute_buffer_tables(wh.read(LEDGER_ENTRIES))
        wh.overwrite(STABLE_POSITIONS, tables.stable_positions)
        wh.overwrite(ABORTED_TXNS, tables.aborted_txns)
        tables.unpersist()
    topics = [r.topic for r in wh.read(STABLE_POSITIONS).select("topic").collect()]
    # The same snapshot written both ways a run can go (`snapshots_in_driver`), then the state.
    with timed("snapshot write (all topics), in the driver") as t_write:
        summary = write_snapshots(wh, topics, compute="driver")
    with timed("snapshot write (all topics), on Spark") as t_write_spark:
        write_snapshots(wh, topics, compute="spark")
    with timed("snapshot state, in the driver") as t_state:
        states = current_snapshot_states(wh, TriggerConfig(), compute="driver")
    with timed("snapshot state, on Spark") as t_state_spark:
        states_on_spark = current_snapshot_states(wh, TriggerConfig(), states["updated_at"][0].as_py(), compute="spark")
    segments = read_segments(wh).count()
    with timed(f"append {tail:,} more aborted transactions"):
        wh.append(LEDGER_ENTRIES, as_ingested(log_frame(spark, aborts, tail), 2 * tail))

    with timed("recovery: snapshot + replay (write recovered_buffer_state)") as t_recover:
        recovery = recover_to_warehouse(wh)
    with timed("full replay of ledger_entries (write full_replay)") as t_full:
        wh.overwrite("full_replay", full_replay_states(wh.read(LEDGER_ENTRIES)))
    # The same recovery planned as Spark jobs (what a tail beyond DriverLimits runs), for comparison.
    with timed("recovery on Spark (write recovered_on_spark)") as t_spark:
        wh.overwrite("recovered_on_spark", recover_from_warehouse(wh))
    jvm_peak = jvm_peak_rss_mib(spark)
    # The files the replay after the snapshots plans to read (after data skipping), of all.
    bounds = live_snapshots(read_segments(wh)).where(F.col("fallback_reason").isNull()).select(
        "topic", F.col("max_read_ledger_id").alias("_sl"), F.col("max_read_entry_id").alias("_se"))
    entries = wh.read(LEDGER_ENTRIES)
    lowest = bounds.agg(F.min("_sl")).first()[0]
    files_replayed = len(entries_after_snapshots(entries, bounds, lowest).inputFiles())
    mismatches = recovery_mismatches(wh.read(RECOVERED_BUFFER_STATE), wh.read("full_replay")).count()
    spark_mismatches = recovery_mismatches(wh.read("recovered_on_spark"), wh.read("full_replay")).count()
    sources = {r.source: r["count"] for r in wh.read(RECOVERED_BUFFER_STATE).groupBy("source").count().collect()}
    replayed = wh.read(RECOVERED_BUFFER_STATE).agg({"replayed_entries": "sum"}).first()[0]
    result = {
        "aborted_txns": aborts + tail,
        "entries": 2 * (aborts + tail),
        "snapshot_write_s": t_write.seconds,
        "snapshot_write_on_spark_s": t_write_spark.seconds,
        "snapshot_write_spark_vs_driver": t_write_spark.seconds / t_write.seconds,
        "snapshot_state_s": t_state.seconds,
        "snapshot_state_on_spark_s": t_state_spark.seconds,
        "states_equal": states.to_pylist() == states_on_spark.to_pylist(),
        "segments": segments,
        "segments_per_topic": summary.segments_per_topic,
        "recovery_s": t_recover.seconds,
        "recovery_path": recovery.path,
        "recovery_steps_s": recovery.seconds,
        "full_replay_s": t_full.seconds,
        "full_replay_vs_recovery": t_full.seconds / t_recover.seconds,
        "recovery_on_spark_s": t_spark.seconds,
        "full_replay_vs_spark_recovery": t_full.seconds / t_spark.seconds,
        "replayed_entries": replayed,
        "ledger_entries_files": len(entries.inputFiles()),
        "files_read_by_replay": files_replayed,
        "sources": sources,
        "recovery_equals_full_replay": mismatches == 0,
        "spark_recovery_equals_full_replay": spark_mismatches == 0,
        "jvm_peak_rss_mib": jvm_peak,
        "python_peak_rss_mib": python_peak_rss_mib(),
    }
    print("-- results")
    for key, value in result.items():
        print(f"  {key:<26} {value:,.2f}" if isinstance(value, float) else f"  {key:<26} {value}")
    if mismatches:
        print(f"  !! recovery differs from the full replay on {mismatches} topic(s)")
    return result


def run_benchmark(workdir: Path) -> dict:
    return run(int(os.environ.get("BENCH_ABORTS", "1000000")), workdir)
