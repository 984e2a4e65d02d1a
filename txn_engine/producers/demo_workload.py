"""A demo workload through the engine: concurrent producers with commits, aborts, timeouts,
retried sends, non-transactional sends and a zombie producer, so the warehouse holds a log
that really went through the engine."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass

from txn_engine.producers.engine import Engine
from txn_engine.core.errors import ProducerFencedError, TransactionAbortedError


@dataclass(frozen=True)
class WorkloadMix:
    producers: int = 4
    transactions_per_producer: int = 20
    messages_per_transaction: int = 5
    topics: int = 3
    abort_ratio: float = 0.15
    timeout_ratio: float = 0.05  # left open until the coordinator aborts them
    retry_ratio: float = 0.1  # sends retried with the same sequence
    plain_sends_per_producer: int = 5
    timeout_s: float = 1.0  # of the transactions left open (the others have the default, 60 s)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.producers < 1 or self.transactions_per_producer < 0 or self.messages_per_transaction < 1 or self.topics < 1:
            raise ValueError("producers, messages_per_transaction and topics must be >= 1, transactions >= 0")
        if not 0 <= self.abort_ratio + self.timeout_ratio <= 1 or not 0 <= self.retry_ratio <= 1:
            raise ValueError("abort_ratio + timeout_ratio and retry_ratio must be between 0 and 1")


def run_demo_workload(engine: Engine, mix: WorkloadMix = WorkloadMix(), topic_prefix: str = "demo") -> dict[str, int]:
    """Run the workload; returns what happened, counted."""
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    topics = [f"{topic_prefix}-partition-{i}" for i in range(mix.topics)]
    slow: list = []  # (producer) whose transaction is left to time out

    def worker(index: int) -> None:
        rng = random.Random(mix.seed * 1000 + index)
        regular = engine.producer(f"{topic_prefix}-producer-{index}")
        regular.init_transactions()
        plain = engine.idempotent_producer()
        local: Counter[str] = Counter()
        for t in range(mix.transactions_per_producer):
            roll = rng.random()
            left_open = mix.abort_ratio <= roll < mix.abort_ratio + mix.timeout_ratio
            producer = regular
            if left_open:
                # A producer of its own with the short timeout: the running engine aborts what is open
                # past its timeout and refuses a late commit, so a regular transaction slowed by a
                # busy machine must not be anywhere near it.
                producer = engine.producer(f"{topic_prefix}-producer-{index}-times-out-{t}", mix.timeout_s)
                producer.init_transactions()
            producer.begin()
            sends = []
            for m in range(mix.messages_per_transaction):
                topic = rng.choice(topics)
                sent = producer.send(topic, f"p{index}-t{t}-m{m}".encode(), key=f"k{m}")
                if rng.random() < mix.retry_ratio:
                    retried = producer.send(topic, f"p{index}-t{t}-m{m}".encode(), key=f"k{m}", sequence=sent.sequence)
                    sends.append((sent, retried))
                    local["retried_sends"] += 1
            for sent, retried in sends:
                assert sent.result() == retried.result()  # acknowledged once, at its original position
            if roll < mix.abort_ratio:
                producer.abort()
                local["aborted"] += 1
            elif left_open:
                producer.flush()  # its sends are written; only the commit never comes
                with lock:
                    slow.append(producer)
            else:
                producer.commit()
                local["committed"] += 1
            if t < mix.plain_sends_per_producer:
                plain.send(rng.choice(topics), f"plain-p{index}-{t}".encode()).result()
                local["plain_sends"] += 1
        with lock:
            counts.update(local)

    threads = [threading.Thread(target=worker, args=(i,), name=f"demo-producer-{i}") for i in range(mix.producers)]
    for thread in threads:
        thread.start()
    _zombie(engine, topics[0], topic_prefix, counts)
    for thread in threads:
        thread.join()
    if slow:
        time.sleep(mix.timeout_s + 0.1)
        engine.abort_expired()  # those the engine's own timer has not come by yet
        aborted_by_coordinator = [engine.coordinator.txns.get(p.txn) for p in slow]
        counts["timed_out"] += sum(1 for t in aborted_by_coordinator if t is not None and t.actor == "coordinator")
        for producer in slow:
            try:
                producer.commit()
            except TransactionAbortedError:
                counts["late_commits_refused"] += 1
    return dict(counts)


def _zombie(engine: Engine, topic: str, prefix: str, counts: Counter) -> None:
    """Two instances of one transactional id: the older is fenced and its open transaction aborted."""
    zombie = engine.producer(f"{prefix}-zombie")
    zombie.init_transactions()
    zombie.begin()
    zombie.send(topic, b"zombie-before-fence").result()
    successor = engine.producer(f"{prefix}-zombie")
    successor.init_transactions()
    try:
        zombie.send(topic, b"zombie-after-fence")
    except ProducerFencedError:
        counts["fenced_sends_refused"] += 1
    successor.begin()
    successor.send(topic, b"successor").result()
    successor.commit()
    counts["committed"] += 1
