"""Benchmark: offload N generated entries (default 10 million) to the filtered tier.

Measured side by side in one run, on the same `ledger_entries` Delta table and the same ledgers
(every eligible one, decided before timing):
- plain copy: Spark copies those ledgers whole to another Delta table (what today's offloaders do);
- offload: `offload_ledgers` (decide, filtered copy, manifest, states), after the `ledgers`
  catalog and the transaction buffer ran over the log (as in `make run`: both before the
  offload), so the offload decides from the buffer's persisted state and copies the kept rows
  from its `committed_entries` (`facts_from` and `kept_from` are printed).
Target: the offload takes at most 1.5x the plain copy. Prints seconds, the ratio, entries and
bytes saved by filtering, and peak memory.
"""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.measure import jvm_peak_rss_mib, python_peak_rss_mib, timed


def run(entries: int, workdir: Path, seed: int = 11) -> dict:
    from resources.spark import get_spark
    from txn_engine.log.generate import generate_ledger_file
    from txn_engine.log.ingest import ingest_files
    from txn_engine.log.ledgers import current_ledger_catalog, derive_ledger_catalog
    from txn_engine.tier.offload import ledger_eligibility, ledger_predicate, offload_ledgers
    from txn_engine.core.schema import LEDGER_ENTRIES, LEDGERS, STABLE_POSITIONS
    from txn_engine.core.settings import WarehouseSettings
    from txn_engine.storage.warehouse import Warehouse

    print(f"== offload benchmark: {entries:,} entries, workdir {workdir}")
    raw = workdir / "raw.parquet"
    with timed(f"generate {entries:,} entries (parquet)"):
        generate_ledger_file(raw, entries=entries, seed=seed)
    spark = get_spark()
    wh = Warehouse(spark, WarehouseSettings(warehouse=str(workdir / "wh"), cold_tier=str(workdir / "cold")))
    with timed("ingest (validate + append to ledger_entries)"):
        ingest_files(wh, [str(raw)])
    from txn_engine.buffer.refresh import ledger_inventory, refresh_buffer

    with timed("ledgers catalog and transaction buffer over the log (upstream of the offload, as in `txnlake run`; "
               "not part of either figure)"):
        wh.overwrite(LEDGERS, derive_ledger_catalog(wh.read(LEDGER_ENTRIES)))
        refresh_buffer(wh, ledger_inventory(wh), full=True)
    with timed("plan: the eligible ledgers (not part of either figure)"):
        # The stable positions the buffer just wrote over this very log.
        catalog = ledger_eligibility(current_ledger_catalog(wh), wh.read(STABLE_POSITIONS))
        eligible = [(r.topic, r.ledger_id) for r in catalog.where("eligible").select("topic", "ledger_id").collect()]
    ledgers_total = catalog.count()
    print(f"  {len(eligible)} of {ledgers_total} ledgers eligible")

    with timed("plain copy of the eligible ledgers (Spark, whole)") as t_copy:
        wh.overwrite("plain_copy", wh.read(LEDGER_ENTRIES).where(ledger_predicate(eligible)))
    with timed("offload: filtered copy + manifest + states") as t_offload:
        result = offload_ledgers(wh)
    jvm_peak = jvm_peak_rss_mib(spark)
    print(f"  offload steps: {result.time_spent()}")
    if sorted(result.offloaded) != sorted(eligible):
        print(f"  !! offloaded {len(result.offloaded)} ledgers, expected {len(eligible)}")
    savings = result.savings()
    out = {
        "entries": entries,
        "ledgers_offloaded": len(result.offloaded),
        "facts_from": result.facts_from,
        "kept_from": result.kept_from,
        "plain_copy_s": t_copy.seconds,
        "offload_s": t_offload.seconds,
        "offload_vs_copy": t_offload.seconds / t_copy.seconds,
        "offload_steps_s": {step: round(s, 2) for step, s in result.step_seconds.items()},
        "entries_before": savings["entries_before"],
        "entries_kept": savings["entries_kept"],
        "entries_dropped": savings["entries_dropped"],
        "bytes_before": savings["bytes_before"],
        "bytes_after": savings["bytes_after"],
        "bytes_saved": savings["bytes_saved"],
        "bytes_saved_pct": 100.0 * savings["bytes_saved"] / max(savings["bytes_before"], 1),
        "jvm_peak_rss_mib": jvm_peak,
        "python_peak_rss_mib": python_peak_rss_mib(),
    }
    print("-- results (target: offload_vs_copy <= 1.5)")
    for key, value in out.items():
        print(f"  {key:<22} {value:,.2f}" if isinstance(value, float) else f"  {key:<22} {value}")
    return out


def run_benchmark(workdir: Path) -> dict:
    return run(int(os.environ.get("BENCH_ENTRIES", "10000000")), workdir)
