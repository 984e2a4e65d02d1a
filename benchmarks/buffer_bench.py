"""Benchmark: the transaction buffer's four tables over N generated entries (default 10 million).

Measured side by side in one run, on the same `ledger_entries` Delta table:
- plain copy: Spark reads ledger_entries and rewrites it once (the floor);
- full: compute and write txn_markers, stable_positions, aborted_txns, committed_entries;
- DuckDB: the same logic (benchmarks/buffer_duckdb.py) over the table's Parquet files.
Prints seconds, rows/s, peak memory and the ratios.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import tempfile
from pathlib import Path

from benchmarks.measure import jvm_peak_rss_mib, python_peak_rss_mib, timed


def run(entries: int, workdir: Path, seed: int = 11) -> dict:
    from resources.spark import get_spark, spark_startup_seconds
    from txn_engine.buffer_jobs import compute_buffer_tables
    from txn_engine.generate import generate_ledger_file
    from txn_engine.ingest import ingest_files
    from txn_engine.schema import ABORTED_TXNS, COMMITTED_ENTRIES, LEDGER_ENTRIES, STABLE_POSITIONS, TXN_MARKERS
    from txn_engine.settings import WarehouseSettings
    from txn_engine.warehouse import Warehouse

    print(f"== transaction buffer benchmark: {entries:,} entries, workdir {workdir}")
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

    with timed("full: four buffer tables (Spark)") as t_full:
        tables = compute_buffer_tables(wh.read(LEDGER_ENTRIES))
        for table, frame in [(TXN_MARKERS, tables.txn_markers), (STABLE_POSITIONS, tables.stable_positions),
                             (ABORTED_TXNS, tables.aborted_txns), (COMMITTED_ENTRIES, tables.committed_entries)]:
            wh.overwrite(table, frame)
        tables.unpersist()
    jvm_peak = jvm_peak_rss_mib(spark)
    counts = {t: wh.read(t).count() for t in (TXN_MARKERS, STABLE_POSITIONS, ABORTED_TXNS, COMMITTED_ENTRIES)}

    duck = None
    try:
        import duckdb

        from benchmarks.buffer_duckdb import compute_and_write

        files = sorted(glob.glob(str(Path(wh.path(LEDGER_ENTRIES)) / "*.parquet")))
        out = workdir / "duckdb"
        out.mkdir(exist_ok=True)
        con = duckdb.connect()
        con.execute("SET threads = 2")
        with timed("full: four buffer tables (DuckDB, same logic)") as t_duck:
            duck_counts = compute_and_write(con, files, str(out))
        duck = t_duck.seconds
        mapped = {TXN_MARKERS: duck_counts["first_markers"], STABLE_POSITIONS: duck_counts["stable_positions"],
                  ABORTED_TXNS: duck_counts["aborted_txns"], COMMITTED_ENTRIES: duck_counts["committed_entries"]}
        if mapped != counts:
            print(f"  !! DuckDB row counts differ from Spark's: {mapped} vs {counts}")
    except ImportError:
        print("  (duckdb not installed: pip install '.[dev]')")

    result = {
        "entries": rows,
        "ingest_s": t_ingest.seconds,
        "plain_copy_s": t_copy.seconds,
        "full_s": t_full.seconds,
        "full_rows_per_s": rows / t_full.seconds,
        "full_vs_copy": t_full.seconds / t_copy.seconds,
        "duckdb_s": duck,
        "full_vs_duckdb": (t_full.seconds / duck) if duck else None,
        "jvm_peak_rss_mib": jvm_peak,
        "python_peak_rss_mib": python_peak_rss_mib(),
        "table_rows": counts,
    }
    print("-- results")
    for key, value in result.items():
        print(f"  {key:<22} {value:,.2f}" if isinstance(value, float) else f"  {key:<22} {value}")
    return result


def run_benchmark(workdir: Path) -> dict:
    return run(int(os.environ.get("BENCH_ENTRIES", "10000000")), workdir)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, default=10_000_000)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="txnlake-bench-", dir=os.environ.get("TXNLAKE_BENCH_DIR")))
    try:
        run(args.entries, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
