"""Benchmark: the transaction buffer's four tables over N generated entries (default 10 million).

Measured side by side in one run, on the same `ledger_entries` Delta table:
- plain copy: Spark reads ledger_entries and rewrites it (the floor), before and after the full
  run; the ratios are taken against the faster of the two;
- full: the four tables and the incremental state computed and written as `refresh_buffer` runs
  it (a log within `DRIVER_FULL_RUN_MAX_BYTES`: in the driver, a topic per core), reported whole
  and split; then the same full run on Spark (as a bigger log runs), and at the end again, warm;
- DuckDB: the same logic (benchmarks/buffer_duckdb.py) over the table's Parquet files, first and
  warm, in a process of its own; then the driver's full run again, warm;
- incremental: one new ledger of BENCH_NEW_LEDGER_ENTRIES appended, then `refresh_buffer` for it
  in the driver, against the full run; then the same step on Spark.
Prints seconds, rows/s, peak memory and the ratios (targets: full <= 2x plain copy, incremental
<= 5% of full). Figures: docs/benchmarks.md, "buffer".

`BENCH_BUFFER_ONE_TOPIC=1`: the memory bound instead. N entries in one topic, generated and
ingested in a process of its own, then the Spark full run in another with 2 GiB for the JVM
(`spark.driver.memory`, local mode) and 2 GiB for each Python worker
(`spark.executor.pyspark.memory`, an address-space limit PySpark sets on the worker); prints the
time and the peak resident memory of the JVM and of the Python workers.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.measure import ChildPeaks, jvm_peak_rss_mib, python_peak_rss_mib, timed
from txn_engine.core.step_clock import StepClock


def new_ledger(spark, raw: Path, entries: int, topic: str, ledger_id: int):
    """`entries` generated entries moved into one new ledger of `topic`, in their generated order."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from txn_engine.core.schema import LEDGER_ENTRIES_SCHEMA

    order = Window.orderBy("topic", "ledger_id", "entry_id")
    frame = spark.read.parquet(str(raw)).withColumn("_n", F.row_number().over(order) - 1)
    return frame.select(*[
        F.lit(topic).alias(f.name) if f.name == "topic" else F.lit(ledger_id).cast("long").alias(f.name) if f.name == "ledger_id"
        else F.col("_n").cast("long").alias(f.name) if f.name == "entry_id" else F.col(f.name) if f.name in frame.columns
        else F.lit(None).cast(f.dataType).alias(f.name)  # what a generated log leaves out (key_bytes, headers, ...)
        for f in LEDGER_ENTRIES_SCHEMA.fields
    ])


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (the machine is shared: figures go with them)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class WriteClock(StepClock):
    """`after_write` hook of `refresh_buffer`: prints the seconds each table's write took (where the time goes)."""

    def __call__(self, table: str) -> None:
        super().__call__(table)
        print(f"    {table:<46} {self.seconds[table]:8.2f} s", flush=True)


def run(entries: int, workdir: Path, seed: int = 11, new_entries: int = 50_000) -> dict:
    from pyspark.sql import functions as F

    from resources.spark import get_spark, spark_startup_seconds
    from txn_engine.buffer.refresh import STATE_TABLES, ledger_inventory, refresh_buffer
    from txn_engine.log.ledgers import write_ledger_catalog
    from txn_engine.log.generate import generate_ledger_file
    from txn_engine.log.ingest import ingest_files
    from txn_engine.core.schema import ABORTED_TXNS, COMMITTED_ENTRIES, LEDGER_ENTRIES, STABLE_POSITIONS, TXN_MARKERS
    from txn_engine.core.settings import WarehouseSettings
    from txn_engine.storage.warehouse import Warehouse

    print(f"== transaction buffer benchmark: {entries:,} entries, workdir {workdir}, load average {load_average()}")
    raw = workdir / "raw.parquet"
    with timed(f"generate {entries:,} entries (parquet)"):
        generate_ledger_file(raw, entries=entries, seed=seed)
    spark = get_spark()
    print(f"  spark session start                              {spark_startup_seconds():8.2f} s")
    wh = Warehouse(spark, WarehouseSettings(warehouse=str(workdir / "wh")))
    with timed("ingest (validate + append to ledger_entries)") as t_ingest:
        ingest_files(wh, [str(raw)])
    source = wh.read(LEDGER_ENTRIES)
    rows = source.count()

    with timed("plain copy (read + rewrite ledger_entries)") as t_copy:
        wh.overwrite("plain_copy", wh.read(LEDGER_ENTRIES))

    with timed("ledgers catalog (the `ledgers` asset, not timed below)"):
        write_ledger_catalog(wh)
    with timed("full: four buffer tables + state (as the product runs it: Arrow in the driver when the log fits)") as t_full:
        full_steps = WriteClock()
        full = refresh_buffer(wh, ledger_inventory(wh), full=True, after_write=full_steps)
    print(f"  full run: computed by {full.computed_by}, written by {full.written_by}")
    python_peak_full = python_peak_rss_mib()
    counted = lambda: {t: wh.read(t).count() for t in (TXN_MARKERS, STABLE_POSITIONS, ABORTED_TXNS, COMMITTED_ENTRIES)}  # noqa: E731
    counts_first = counted()
    # Side by side: the same full run on Spark, as a log too big for the driver runs.
    with timed("full again, on Spark (computed and written by Spark)") as t_full_spark:
        full_spark_steps = WriteClock()
        full_spark = refresh_buffer(wh, ledger_inventory(wh), full=True, after_write=full_spark_steps,
                                    driver_full_run_max_bytes=0)
    print(f"  full run again: computed by {full_spark.computed_by}, written by {full_spark.written_by}")
    jvm_peak = jvm_peak_rss_mib(spark)
    # The copy again, after the full run: the faster of the two is the floor the ratio is taken against.
    with timed("plain copy again (after the full run)") as t_copy_again:
        wh.overwrite("plain_copy", wh.read(LEDGER_ENTRIES))
    copy_s = min(t_copy.seconds, t_copy_again.seconds)
    # Where the full run's time goes: the four tables of the brief (their writes, and the facts the
    # first one computes), the incremental state, and the rest (the violation counts).
    contract = (TXN_MARKERS, ABORTED_TXNS, COMMITTED_ENTRIES, STABLE_POSITIONS)
    four = sum(full_steps.seconds.get(t, 0.0) for t in contract)
    state = sum(full_steps.seconds.get(t, 0.0) for t in STATE_TABLES)
    four_spark = sum(full_spark_steps.seconds.get(t, 0.0) for t in contract)
    counts = counted()
    if counts != counts_first:
        print(f"  !! the full run on Spark wrote other row counts than the first: {counts} vs {counts_first}")

    duck = full_warm = duck_warm = duck_peak = None
    if importlib.util.find_spec("duckdb") is None:
        print("  (duckdb not installed: pip install '.[dev]')")
    else:
        files = sorted(glob.glob(str(Path(wh.path(LEDGER_ENTRIES)) / "*.parquet")))
        out = workdir / "duckdb"
        out.mkdir(exist_ok=True)
        # A first run and a warm one, in a process of its own: its temp tables hold the log's rows,
        # and no step measured here runs beside them.
        with timed("full: four buffer tables (DuckDB, same logic), then again warm, in a process of its own"):
            done = subprocess.run([sys.executable, "-m", "benchmarks.buffer_duckdb", json.dumps(files), str(out)],
                                  check=True, capture_output=True, text=True)
        duckdb_runs = json.loads(done.stdout.strip().splitlines()[-1])
        (duck, duck_warm), duck_counts, duck_peak = duckdb_runs["seconds"], duckdb_runs["counts"], duckdb_runs["peak_rss_mib"]
        print(f"  DuckDB: {duck:.2f} s, warm {duck_warm:.2f} s, peak RSS {duck_peak:,.0f} MiB")
        mapped = {TXN_MARKERS: duck_counts["first_markers"], STABLE_POSITIONS: duck_counts["stable_positions"],
                  ABORTED_TXNS: duck_counts["aborted_txns"], COMMITTED_ENTRIES: duck_counts["committed_entries"]}
        if mapped != counts:
            print(f"  !! DuckDB row counts differ from Spark's: {mapped} vs {counts}")
        # The driver again, warm: its first run is the process's first large Arrow work and pays
        # first touches of memory, as DuckDB's first does in its process.
        with timed("full again, in the driver (warm)") as t_full_warm:
            refresh_buffer(wh, ledger_inventory(wh), full=True)
        full_warm = t_full_warm.seconds

    python_peak_before_incremental = python_peak_rss_mib()

    # One new ledger on top: generated apart, appended, the catalog refreshed, then the step.
    new_raw = workdir / "new.parquet"
    generate_ledger_file(new_raw, entries=new_entries, seed=seed + 1, topics=1)
    last = wh.read(LEDGER_ENTRIES).agg(F.max("ledger_id"), F.min("topic")).first()
    new_id = last[0] + 1
    with timed(f"append one new ledger of {new_entries:,} entries"):
        wh.append(LEDGER_ENTRIES, new_ledger(spark, new_raw, new_entries, last[1], new_id))
    with timed("ledgers catalog again (not in the step)"):
        write_ledger_catalog(wh)
    with timed("incremental: the new ledger (Arrow in the driver, written by delta-rs)") as t_inc:
        inc_steps = WriteClock()
        step = refresh_buffer(wh, ledger_inventory(wh), ledgers=[new_id], after_write=inc_steps)
    print(f"  incremental step: {step.summary()}, computed by {step.computed_by}, written by {step.written_by}")
    # The same step again (the ledger asked for is recomputed) computed on Spark, its tables written
    # as the Spark full run's are (by size): the counterpart of that run.
    with timed("incremental again, computed on Spark (written by size, as the Spark full run)") as t_inc_on_spark:
        inc_on_spark_steps = WriteClock()
        on_spark = refresh_buffer(wh, ledger_inventory(wh), ledgers=[new_id], after_write=inc_on_spark_steps,
                                  compute="spark")
    print(f"  incremental step again: {on_spark.summary()}, computed by {on_spark.computed_by}, written by {on_spark.written_by}")
    # And as a scope too big for the driver runs: computed on Spark, every table written by Spark's Delta writer.
    with timed("incremental again, on Spark (computed and written by Spark)") as t_inc_spark:
        inc_spark_steps = WriteClock()
        again = refresh_buffer(wh, ledger_inventory(wh), ledgers=[new_id], after_write=inc_spark_steps,
                               driver_write_max_bytes=0)
    print(f"  incremental step again: {again.summary()}, computed by {again.computed_by}, written by {again.written_by}")

    # The Spark full run again, warm as the copies are (the first paid its Python workers' start,
    # their imports and the JIT of its plans, as a `txnlake run` process does once); last, so the
    # steps above run as they did without it.
    with timed("full again, on Spark (warm)") as t_full_spark_warm:
        refresh_buffer(wh, ledger_inventory(wh), full=True, driver_full_run_max_bytes=0)

    result = {
        "entries": rows,
        "ingest_s": t_ingest.seconds,
        "plain_copy_s": t_copy.seconds,
        "plain_copy_again_s": t_copy_again.seconds,
        "full_s": t_full.seconds,
        "full_rows_per_s": rows / t_full.seconds,
        "full_vs_copy": t_full.seconds / copy_s,
        "full_computed_by": full.computed_by,
        "four_tables_s": four,
        "four_tables_vs_copy": four / copy_s,
        "state_s": state,
        "rest_s": t_full.seconds - four - state,
        "full_on_spark_s": t_full_spark.seconds,
        "full_on_spark_vs_copy": t_full_spark.seconds / copy_s,
        "four_tables_on_spark_vs_copy": four_spark / copy_s,
        "full_on_spark_warm_s": t_full_spark_warm.seconds,
        "full_on_spark_warm_vs_copy": t_full_spark_warm.seconds / copy_s,
        "full_vs_full_on_spark": t_full.seconds / t_full_spark.seconds,
        "duckdb_s": duck,
        "full_vs_duckdb": (t_full.seconds / duck) if duck else None,
        "full_warm_s": full_warm,
        "duckdb_warm_s": duck_warm,
        "full_vs_duckdb_warm": (full_warm / duck_warm) if duck_warm else None,
        "incremental_entries": new_entries,
        "incremental_s": t_inc.seconds,
        "incremental_vs_full": t_inc.seconds / t_full.seconds,
        "incremental_computed_by": step.computed_by,
        "incremental_computed_on_spark_s": t_inc_on_spark.seconds,
        "incremental_computed_on_spark_vs_full_on_spark": t_inc_on_spark.seconds / t_full_spark.seconds,
        "incremental_computed_on_spark_vs_warm_full_on_spark": t_inc_on_spark.seconds / t_full_spark_warm.seconds,
        "incremental_on_spark_s": t_inc_spark.seconds,
        "incremental_on_spark_vs_full_on_spark": t_inc_spark.seconds / t_full_spark.seconds,
        "incremental_arrow_vs_spark": t_inc.seconds / t_inc_spark.seconds,
        "incremental_ledgers": len(step.ledgers),
        "full_steps_s": {k: round(v, 2) for k, v in full_steps.seconds.items()},
        "full_on_spark_steps_s": {k: round(v, 2) for k, v in full_spark_steps.seconds.items()},
        "incremental_steps_s": {k: round(v, 2) for k, v in inc_steps.seconds.items()},
        "incremental_computed_on_spark_steps_s": {k: round(v, 2) for k, v in inc_on_spark_steps.seconds.items()},
        "incremental_on_spark_steps_s": {k: round(v, 2) for k, v in inc_spark_steps.seconds.items()},
        "jvm_peak_rss_mib": jvm_peak,
        "python_peak_rss_mib_after_full": python_peak_full,
        "python_peak_rss_mib_before_incremental": python_peak_before_incremental,
        "duckdb_peak_rss_mib": duck_peak,
        "python_peak_rss_mib": python_peak_rss_mib(),
        "table_rows": counts,
        "load_average_at_end": load_average(),
    }
    print("-- results")
    for key, value in result.items():
        print(f"  {key:<22} {value:,.2f}" if isinstance(value, float) else f"  {key:<22} {value}")
    return result


# The memory bound of the Spark path (issue 40): a JVM and its Python worker in 2 GiB each.
ONE_TOPIC_CONF = {"spark.driver.memory": "2g", "spark.executor.pyspark.memory": "2g"}


def one_topic_prepare(entries: int, workdir: Path, seed: int = 11) -> None:
    """`ledger_entries` and `ledgers` of `entries` generated entries in one topic (default Spark settings)."""
    from resources.spark import get_spark
    from txn_engine.core.settings import WarehouseSettings
    from txn_engine.log.generate import generate_ledger_file
    from txn_engine.log.ingest import ingest_files
    from txn_engine.log.ledgers import write_ledger_catalog
    from txn_engine.storage.warehouse import Warehouse

    raw = workdir / "raw.parquet"
    with timed(f"generate {entries:,} entries in one topic (parquet)"):
        generate_ledger_file(raw, entries=entries, seed=seed, topics=1)
    wh = Warehouse(get_spark(), WarehouseSettings(warehouse=str(workdir / "wh")))
    with timed("ingest (validate + append to ledger_entries)"):
        ingest_files(wh, [str(raw)])
    with timed("ledgers catalog"):
        write_ledger_catalog(wh)


def one_topic_full_run(workdir: Path) -> dict:
    """The Spark full run over the prepared warehouse, under `ONE_TOPIC_CONF`, with peak memory."""
    from resources.spark import get_spark
    from txn_engine.buffer.refresh import ledger_inventory, refresh_buffer
    from txn_engine.core.schema import COMMITTED_ENTRIES, LEDGER_ENTRIES
    from txn_engine.core.settings import WarehouseSettings
    from txn_engine.storage.warehouse import Warehouse

    spark = get_spark(conf=ONE_TOPIC_CONF)
    wh = Warehouse(spark, WarehouseSettings(warehouse=str(workdir / "wh")))
    pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
    with ChildPeaks(pid) as workers, timed("full run on Spark, one topic, 2g JVM + 2g Python worker") as t_full:
        steps = WriteClock()
        full = refresh_buffer(wh, ledger_inventory(wh), full=True, after_write=steps, compute="spark")
    result = {
        "entries": wh.read(LEDGER_ENTRIES).count(),
        "full_on_spark_s": round(t_full.seconds, 2),
        "computed_by": full.computed_by,
        "committed_entries": wh.read(COMMITTED_ENTRIES).count(),
        "jvm_peak_rss_mib": round(jvm_peak_rss_mib(spark), 1),
        "python_worker_peak_rss_mib": round(workers.peak_mib, 1),
        "python_workers": len(workers.peaks_kib),
        "python_worker_address_limit": sorted(set(workers.limits.values())),
        "driver_python_peak_rss_mib": round(python_peak_rss_mib(), 1),
        "conf": {k: spark.conf.get(k) for k in ONE_TOPIC_CONF},
        "load_average_at_end": load_average(),
    }
    print("ONE_TOPIC_RESULT " + json.dumps(result), flush=True)
    return result


def one_topic(entries: int, workdir: Path) -> dict:
    """`BENCH_BUFFER_ONE_TOPIC=1` (module doc): each step in a process of its own, a JVM sized for it."""
    print(f"== transaction buffer, one topic of {entries:,} entries under 2 GiB: JVM and Python worker, workdir {workdir}")

    def step(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "benchmarks.buffer_bench", *args, "--workdir", str(workdir)],
                              stdout=subprocess.PIPE, text=True)
        print(done.stdout, end="", flush=True)
        if done.returncode:
            raise SystemExit(f"buffer_bench {args[0]} failed (exit {done.returncode})")
        return done.stdout

    step("one-topic-prepare", "--entries", str(entries))
    out = step("one-topic-full-run")
    return json.loads(next(line for line in out.splitlines() if line.startswith("ONE_TOPIC_RESULT "))[len("ONE_TOPIC_RESULT "):])


def run_benchmark(workdir: Path) -> dict:
    if os.environ.get("BENCH_BUFFER_ONE_TOPIC", "").strip() not in ("", "0"):
        return one_topic(int(os.environ.get("BENCH_ENTRIES", "10000000")), workdir)
    return run(int(os.environ.get("BENCH_ENTRIES", "10000000")), workdir,
               new_entries=int(os.environ.get("BENCH_NEW_LEDGER_ENTRIES", "50000")))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("step", nargs="?", choices=["one-topic-prepare", "one-topic-full-run"],
                        help="a step of BENCH_BUFFER_ONE_TOPIC, in the --workdir given")
    parser.add_argument("--entries", type=int, default=10_000_000)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args(argv)
    if args.step == "one-topic-prepare":
        return one_topic_prepare(args.entries, args.workdir)
    if args.step == "one-topic-full-run":
        one_topic_full_run(args.workdir)
        return
    workdir = Path(tempfile.mkdtemp(prefix="txnlake-bench-", dir=os.environ.get("TXNLAKE_BENCH_DIR")))
    try:
        run(args.entries, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
