"""Transaction engine throughput: 8 producers, transactions of 10 messages over 2 topics,

Three modes, side by side in one run on one warehouse: `txn blocking` (Kafka's commitTransaction:
flush, commit, wait), `txn pipelined` (commit_async, up to BENCH_ENGINE_IN_FLIGHT transactions in
flight per producer: a window Little's law does not bind, so the figure is the engine's) and
`non-transactional` (the same producers, idempotent sends). Commit latency is from the commit call
to COMPLETE durable. Targets: >= 50,000 messages/s and p99 commit latency <= 2 s. BENCH_ENTRIES
messages per mode. Also printed: the Delta commits per table and the committer's share of the
wall time, the load average, the compactions of the engine's upkeep, and a soak
(BENCH_ENGINE_SOAK_COMMITS appends to one table with the engine's upkeep and with Delta's
defaults, under a history short enough to expire within it). Figures: docs/benchmarks.md, "engine".
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path

from datetime import datetime, timedelta, timezone

import numpy as np
import pyarrow as pa

from txn_engine.storage.arrow_frames import arrow_schema
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.producers.engine import Engine
from txn_engine.core.schema import LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA
from txn_engine.storage.upkeep import TableUpkeep, UpkeepPolicy
from txn_engine.core.settings import WarehouseSettings
from txn_engine.storage.warehouse import Warehouse

PRODUCERS = 8
MESSAGES_PER_TXN = 10
TOPICS = ("bench-partition-0", "bench-partition-1")
PAYLOAD = b"x" * 100


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _commit_stats(engine: Engine) -> dict[str, tuple[int, float, int]]:
    return {table: tuple(stats) for table, stats in engine.tables.append_stats.items()}


def _measured(engine: Engine, run) -> dict:
    """Run one mode; its figures plus the Delta commits it caused and the load average after it."""
    before, rounds = _commit_stats(engine), engine.writer.rounds
    result = run()
    after = _commit_stats(engine)
    result["group_commits"] = engine.writer.rounds - rounds
    result["delta_commits"] = {
        table: (c - before.get(table, (0, 0.0, 0))[0], s - before.get(table, (0, 0.0, 0))[1], r - before.get(table, (0, 0.0, 0))[2])
        for table, (c, s, r) in after.items()
        if c > before.get(table, (0, 0.0, 0))[0]
    }
    result["load_average"] = os.getloadavg()[0]
    return result


def _run_threads(target, count: int) -> float:
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def _transactional(engine: Engine, txns_per_producer: int, in_flight: int, tag: str) -> dict:
    latencies: list[float] = []
    lock = threading.Lock()

    def producer(index: int) -> None:
        p = engine.producer(f"bench-{tag}-{index}", transaction_timeout=600)
        p.init_transactions()
        local: list[float] = []
        pending: deque = deque()
        for _ in range(txns_per_producer):
            p.begin()
            for m in range(MESSAGES_PER_TXN):
                p.send(TOPICS[m % 2], PAYLOAD)
            started = time.perf_counter()
            if in_flight <= 1:
                p.commit()
                local.append(time.perf_counter() - started)
            else:
                future = p.commit_async()
                future.add_done_callback(lambda f, s=started: local.append(time.perf_counter() - s))
                pending.append(future)
                while len(pending) >= in_flight:
                    pending.popleft().result()
        for future in pending:
            future.result()
        with lock:
            latencies.extend(local)

    seconds = _run_threads(producer, PRODUCERS)
    txns = PRODUCERS * txns_per_producer
    return {
        "seconds": seconds,
        "messages_per_s": txns * MESSAGES_PER_TXN / seconds,
        "txns_per_s": txns / seconds,
        "commit_p50_s": _percentile(latencies, 0.50),
        "commit_p99_s": _percentile(latencies, 0.99),
        "commit_mean_s": sum(latencies) / max(1, len(latencies)),
    }


def _non_transactional(engine: Engine, messages_per_producer: int, in_flight: int) -> dict:
    def producer(index: int) -> None:
        p = engine.idempotent_producer()
        pending: deque = deque()
        for m in range(messages_per_producer):
            pending.append(p.send(TOPICS[m % 2], PAYLOAD))
            while len(pending) >= in_flight * MESSAGES_PER_TXN:
                pending.popleft().result()
        for future in pending:
            future.result()

    seconds = _run_threads(producer, PRODUCERS)
    return {"seconds": seconds, "messages_per_s": PRODUCERS * messages_per_producer / seconds}


def _round_rows(rows: int, first_entry: int) -> pa.Table:
    """A pipelined round's ledger_entries: DATA of 100-byte payloads over the benchmark's topics."""
    schema = arrow_schema(LEDGER_ENTRIES_SCHEMA)
    entry_ids = np.arange(first_entry, first_entry + rows, dtype=np.int64)
    columns = {
        "topic": pa.array([TOPICS[i % 2] for i in range(rows)]),
        "ledger_id": pa.array(np.full(rows, 1, np.int64)),
        "entry_id": pa.array(entry_ids),
        "entry_type": pa.array(["DATA"] * rows),
        "txn_most_bits": pa.array(np.zeros(rows, np.int64)),
        "txn_least_bits": pa.array(entry_ids // MESSAGES_PER_TXN),
        "producer_id": pa.array(np.full(rows, 7, np.int64)),
        "producer_epoch": pa.array(np.zeros(rows, np.int32)),
        "sequence_id": pa.array(entry_ids),
        "publish_time": pa.repeat(pa.scalar(datetime.now(timezone.utc), schema.field("publish_time").type), rows),
        "key": pa.nulls(rows, pa.string()),
        "payload": pa.array([PAYLOAD] * rows, pa.binary()),
    }
    columns.update({f.name: pa.nulls(rows, f.type) for f in schema if f.name not in columns})  # key_bytes, headers ...
    return pa.table(columns, schema=schema)


def _soak(workdir: Path, commits: int, upkeep: bool) -> dict:
    """`commits` appends of a round's rows to a fresh ledger_entries, with or without upkeep."""
    warehouse = Warehouse(None, WarehouseSettings(warehouse=str(workdir / f"soak-{'upkeep' if upkeep else 'none'}")))
    tables = DeltaTables(warehouse)
    # Ten seconds of history and of replaced files, so that a soak of a minute or two shows both bounded.
    policy = UpkeepPolicy(log_retention=timedelta(seconds=10), file_retention=timedelta(seconds=10))
    keeper = TableUpkeep(tables, policy, [LEDGER_ENTRIES]) if upkeep else None
    window = max(1, commits // 10)
    times: list[float] = []
    started = time.perf_counter()
    for i in range(commits):
        rows = _round_rows(3_000, 3_000 * i)
        t = time.perf_counter()
        tables.append(LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA, rows)
        times.append(time.perf_counter() - t)
        if keeper is not None:
            keeper.run_due()
    seconds = time.perf_counter() - started
    path = Path(warehouse.path(LEDGER_ENTRIES))
    from deltalake import DeltaTable

    return {
        "first_ms": 1000 * sorted(times[:window])[window // 2],
        "last_ms": 1000 * sorted(times[-window:])[window // 2],
        "window": window,
        "seconds": seconds,
        "log_files": len(list((path / "_delta_log").iterdir())),
        "data_files": len(DeltaTable(str(path)).file_uris()),
        "files_on_disk": sum(1 for f in path.iterdir() if f.suffix == ".parquet"),
        "mib_on_disk": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20,
        "vacuums": len(keeper.vacuums) if keeper else 0,
        "vacuum_s": sum(v.seconds for v in keeper.vacuums) if keeper else 0.0,
        "files_vacuumed": sum(v.files_deleted for v in keeper.vacuums) if keeper else 0,
        "compactions": len(keeper.compactions) if keeper else 0,
        "compaction_s": sum(c.seconds for c in keeper.compactions) if keeper else 0.0,
        "compaction_max_s": max((c.seconds for c in keeper.compactions), default=0.0) if keeper else 0.0,
    }


def run_benchmark(workdir: Path) -> dict:
    messages = int(os.environ.get("BENCH_ENTRIES", 400_000))
    in_flight = int(os.environ.get("BENCH_ENGINE_IN_FLIGHT", 256))
    txns_per_producer = max(1, messages // (PRODUCERS * MESSAGES_PER_TXN))
    blocking_txns = max(1, min(txns_per_producer, int(os.environ.get("BENCH_ENGINE_BLOCKING_TXNS", 200))))
    warehouse = Warehouse(None, WarehouseSettings(warehouse=str(workdir / "warehouse")))
    print(f"engine: {PRODUCERS} producers, {MESSAGES_PER_TXN}-message transactions over {len(TOPICS)} topics, "
          f"{len(PAYLOAD)}-byte payloads, durable in Delta", flush=True)
    results = {}
    with Engine(warehouse) as engine:
        results["txn_blocking"] = _measured(engine, lambda: _transactional(engine, blocking_txns, 1, "blocking"))
        results["txn_pipelined"] = _measured(engine, lambda: _transactional(engine, txns_per_producer, in_flight, "pipelined"))
        results["non_transactional"] = _measured(
            engine, lambda: _non_transactional(engine, txns_per_producer * MESSAGES_PER_TXN, in_flight)
        )
        upkeep = engine.upkeep.compactions
    print(f"  upkeep during the modes: {len(upkeep)} compactions, {sum(c.seconds for c in upkeep):.2f} s in all "
          f"({', '.join(f'{c.table} {c.files_removed}->{c.files_added} files {c.seconds:.2f} s' for c in upkeep[-4:])})",
          flush=True)
    for name, r in results.items():
        line = f"  {name:<18} {r['messages_per_s']:>10,.0f} msg/s"
        if "txns_per_s" in r:
            line += f"  {r['txns_per_s']:>8,.0f} txn/s  commit p50 {r['commit_p50_s']:.3f} s  p99 {r['commit_p99_s']:.3f} s"
        line += f"  ({r['group_commits']} group commits, {r['seconds']:.1f} s, load {r['load_average']:.1f})"
        print(line, flush=True)
        in_commits = sum(seconds for _, seconds, _ in r["delta_commits"].values())
        detail = ", ".join(
            f"{table} {count} x {1000 * seconds / count:.1f} ms ({rows / count:,.0f} rows)"
            for table, (count, seconds, rows) in r["delta_commits"].items()
        )
        print(f"      Delta commits: {detail}; {in_commits / r['seconds']:.0%} of the wall time", flush=True)
    window = PRODUCERS * in_flight
    mean = results["txn_pipelined"]["commit_mean_s"]
    print(f"  txn_pipelined window: {window} transactions in flight / mean commit latency {mean:.3f} s "
          f"= at most {window / mean * MESSAGES_PER_TXN:,.0f} msg/s (Little's law)", flush=True)
    base = results["non_transactional"]["messages_per_s"]
    for name in ("txn_blocking", "txn_pipelined"):
        print(f"  {name} / non_transactional: {results[name]['messages_per_s'] / base:.2f}x", flush=True)
    soak_commits = int(os.environ.get("BENCH_ENGINE_SOAK_COMMITS", 3_000))
    if soak_commits:
        soaks = {mode: _soak(workdir, soak_commits, mode == "upkeep") for mode in ("none", "upkeep")}
        for mode, r in soaks.items():
            print(f"  soak, {soak_commits:,} appends of 3,000 rows, {'engine upkeep' if mode == 'upkeep' else 'no upkeep (Delta defaults)'}: "
                  f"median append {r['first_ms']:.1f} ms (first {r['window']}) -> {r['last_ms']:.1f} ms (last {r['window']}); "
                  f"{r['seconds']:.1f} s; then {r['log_files']} files in _delta_log, {r['data_files']} data files "
                  f"({r['files_on_disk']} on disk, {r['mib_on_disk']:.0f} MiB); "
                  f"{r['compactions']} compactions, {r['compaction_s']:.1f} s (longest {r['compaction_max_s']:.2f} s); "
                  f"{r['vacuums']} VACUUMs, {r['vacuum_s']:.2f} s, {r['files_vacuumed']} files deleted", flush=True)
        print(f"  soak: last-window append, no upkeep / upkeep: {soaks['none']['last_ms'] / soaks['upkeep']['last_ms']:.2f}x",
              flush=True)
        results["soak"] = soaks
    best = results["txn_pipelined"]
    print(f"  targets: >= 50,000 msg/s -> {'met' if best['messages_per_s'] >= 50_000 else 'NOT met'}; "
          f"p99 commit <= 2 s -> {'met' if best['commit_p99_s'] <= 2 else 'NOT met'} (pipelined)", flush=True)
    return results
