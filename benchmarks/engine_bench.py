"""Transaction engine throughput: 8 producers, transactions of 10 messages over 2 topics,
100-byte payloads, every acknowledgement durable in Delta (delta-rs appends, group-committed).

Three modes, side by side in one run on one warehouse:
- `txn blocking`: Kafka's commitTransaction (flush the sends, commit, wait, then the next one);
- `txn pipelined`: commit_async, up to BENCH_ENGINE_IN_FLIGHT (256) transactions in flight per producer
  (a window wide enough that Little's law does not bind: 2,048 transactions / ~0.18 s is ~110,000
  msg/s, so the figure is the engine's, not the window's; 32 bound it at ~20,000);
- `non-transactional`: the same producers sending idempotently, no transactions.
Commit latency is from the commit call to COMPLETE durable. Targets: >= 50,000 messages/s and
p99 commit latency <= 2 s. Scale: BENCH_ENTRIES messages per mode (default 400,000).

Where the time goes: for each mode, the Delta commits per table (count, ms each, rows each) and
the share of the mode's wall time the committer spent in them, and the load average (the machine
is shared: figures are only comparable at similar load).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path

from txn_engine.engine import Engine
from txn_engine.settings import WarehouseSettings
from txn_engine.warehouse import Warehouse

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
    best = results["txn_pipelined"]
    print(f"  targets: >= 50,000 msg/s -> {'met' if best['messages_per_s'] >= 50_000 else 'NOT met'}; "
          f"p99 commit <= 2 s -> {'met' if best['commit_p99_s'] <= 2 else 'NOT met'} (pipelined)", flush=True)
    return results
