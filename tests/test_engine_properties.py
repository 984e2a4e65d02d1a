"""Property test: random histories of producers, fencing, crashes and restarts through the engine.

Invariants (the issue's): nothing of an aborted or open transaction is read as committed;
committed transactions are all-or-nothing across topics; no entry is read twice; a fenced
producer never writes.
"""

from __future__ import annotations

import shutil
import tempfile
from datetime import datetime, timedelta, timezone

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from txn_engine.producers.engine import Engine
from txn_engine.producers.ledger_writer import AFTER_ENTRIES_CHUNK, AFTER_PREPARE, BEFORE_COMPLETE
from txn_engine.core.schema import LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA
from txn_engine.core.settings import WarehouseSettings
from txn_engine.core.errors import EngineStoppedError, InjectedCrash, ProducerFencedError, TransactionAbortedError
from txn_engine.storage.warehouse import Warehouse

TOPICS = ("t0", "t1", "t2")
PRODUCERS = 2
TIMEOUT_S = 30

send = st.tuples(st.just("send"), st.integers(0, PRODUCERS - 1), st.integers(0, len(TOPICS) - 1))
crash_commit = st.tuples(
    st.just("crash_commit"),
    st.integers(0, PRODUCERS - 1),
    st.sampled_from([AFTER_PREPARE, AFTER_ENTRIES_CHUNK, BEFORE_COMPLETE]),
    st.integers(1, 2),
)
ops = st.lists(
    st.one_of(
        send,
        send,
        send,
        send,
        crash_commit,
        crash_commit,
        st.tuples(st.just("commit"), st.integers(0, PRODUCERS - 1)),
        st.tuples(st.just("abort"), st.integers(0, PRODUCERS - 1)),
        st.tuples(st.just("reinit"), st.integers(0, PRODUCERS - 1)),
        st.tuples(st.just("zombie_send"), st.integers(0, PRODUCERS - 1)),
        st.tuples(st.just("plain"), st.integers(0, len(TOPICS) - 1)),
        st.tuples(st.just("retry"), st.integers(0, PRODUCERS - 1)),
        st.tuples(st.just("tick"), st.sampled_from([5, 40])),
        crash_commit,
    ),
    max_size=24,
)


class Hook:
    def __init__(self):
        self.target = None

    def __call__(self, point):
        if self.target and self.target[0] == point:
            self.target[1] -= 1
            if self.target[1] == 0:
                self.target = None
                raise InjectedCrash(f"injected at {point}")


class World:
    """The engine under test plus what the API told the callers."""

    def __init__(self, root: str):
        self.clock_now = datetime(2026, 1, 1, tzinfo=timezone.utc)
        self.warehouse = Warehouse(None, WarehouseSettings(warehouse=root))  # the engine needs no Spark here
        self.hook = Hook()
        self.txns: dict = {}  # txn -> {"state": ..., "payloads": {topic: [...]}}
        self.plain: set[bytes] = set()
        self.zombies: list = []
        self.counter = 0
        self.start()

    def start(self):
        self.engine = Engine(self.warehouse, clock=lambda: self.clock_now, crash_hook=self.hook, max_rows_per_commit=1)
        self.producers = [self.new_producer(i) for i in range(PRODUCERS)]

    def new_producer(self, i):
        p = self.engine.producer(f"p{i}", transaction_timeout=TIMEOUT_S)
        p.init_transactions()
        self.on_fenced_abort()
        return p

    def on_fenced_abort(self):
        # init_transactions aborts the previous instance's open transaction.
        for txn, t in self.txns.items():
            if t["state"] == "open" and self.engine.coordinator.txns.get(txn) is not None:
                if self.engine.coordinator.txns[txn].state.startswith(("PREPARE_ABORT", "COMPLETE_ABORT")):
                    t["state"] = "aborted"

    def restart(self):
        self.engine.close()
        for t in self.txns.values():
            if t["state"] == "open":
                t["state"] = "open_dead"  # its producer died with the engine; re-init aborts it
        self.zombies.extend(self.producers)
        self.start()
        if self.engine.recovered:
            event("recovered a prepared transaction")
        for txn in self.engine.recovered:
            assert self.txns[txn]["state"] == "in_doubt"
        for t in self.txns.values():
            if t["state"] == "open_dead":
                t["state"] = "aborted"

    def payload(self, tag: str) -> bytes:
        self.counter += 1
        return f"{tag}-{self.counter}".encode()

    def apply(self, op):
        kind = op[0]
        if kind == "send":
            p, topic = self.producers[op[1]], TOPICS[op[2]]
            if p.txn is None:
                txn = p.begin()
                self.txns[txn] = {"state": "open", "payloads": {}}
            t = self.txns[p.txn]
            value = self.payload("txn")
            try:
                p.send(topic, value).result()
            except TransactionAbortedError:
                return
            t["payloads"].setdefault(topic, []).append(value)
        elif kind in ("commit", "abort", "crash_commit"):
            p = self.producers[op[1]]
            if kind == "crash_commit" and p.txn is None:
                for topic in range(len(TOPICS)):  # a multi-topic transaction to crash in
                    self.apply(("send", op[1], topic))
            if p.txn is None:
                return
            txn = p.txn
            if kind == "crash_commit":
                self.hook.target = [op[2], op[3]]
            try:
                (p.abort if kind == "abort" else p.commit)()
                self.txns[txn]["state"] = "aborted" if kind == "abort" else "committed"
            except TransactionAbortedError:
                self.txns[txn]["state"] = "aborted"
                p.abort()
            except Exception as exc:  # the injected crash, or the engine it stopped
                self.hook.target = None
                if self.engine.writer.stopped is None:
                    raise AssertionError(f"unexpected {exc!r}") from exc
                self.txns[txn]["state"] = "in_doubt"
                event(f"crash {op[2]}")
                self.restart()
            self.hook.target = None
        elif kind == "reinit":
            old = self.producers[op[1]]
            self.zombies.append(old)
            self.producers[op[1]] = self.new_producer(op[1])
            if old.txn is not None and self.txns[old.txn]["state"] == "open":
                self.txns[old.txn]["state"] = "aborted"
        elif kind == "zombie_send":
            for zombie in self.zombies[-1:]:
                try:
                    zombie.send(TOPICS[0], b"zombie")
                except ProducerFencedError:
                    pass
                except EngineStoppedError:
                    assert zombie.services is not self.engine.services  # a producer of an engine that crashed
                except Exception as exc:
                    raise AssertionError(f"a fenced producer got {exc!r}, not ProducerFencedError") from exc
                else:
                    raise AssertionError("a fenced producer's send was accepted")
        elif kind == "plain":
            value = self.payload("plain")
            self.engine.send(TOPICS[op[1]], value).result()
            self.plain.add(value)
        elif kind == "retry":
            ip = self.engine.idempotent_producer()
            value = self.payload("plain")
            first = ip.send(TOPICS[0], value).result()
            assert ip.send(TOPICS[0], value, sequence=0).result() == first
            self.plain.add(value)
        elif kind == "tick":
            self.clock_now += timedelta(seconds=op[1])
            for txn in self.engine.abort_expired():
                self.txns[txn]["state"] = "aborted"

    def finish(self):
        # Decide everything: time out whatever is still open, then read every topic.
        self.clock_now += timedelta(seconds=TIMEOUT_S * 10)
        for txn in self.engine.abort_expired():
            assert self.txns[txn]["state"] in ("open",), (txn, self.txns[txn])
            self.txns[txn]["state"] = "aborted"
        read = {topic: self.engine.consumer(topic).read() for topic in TOPICS}
        stored = self.engine.tables.read(LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA)
        self.engine.close()
        return read, stored


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(history=ops)
def test_random_histories_keep_the_transaction_invariants(history):
    root = tempfile.mkdtemp(prefix="txnlake-engine-prop-")
    try:
        world = World(root)
        for op in history:
            world.apply(op)
        read, stored = world.finish()
        payloads_read = [e.payload for entries in read.values() for e in entries]
        assert len(payloads_read) == len(set(payloads_read)), "an entry was read twice"
        positions = [(t, e.position) for t, entries in read.items() for e in entries]
        assert len(positions) == len(set(positions))
        seen = set(payloads_read)
        assert b"zombie" not in set(stored["payload"].to_pylist()), "a fenced producer wrote"
        assert world.plain <= seen, "an acknowledged non-transactional send is missing"
        for txn, t in world.txns.items():
            sent = {v for values in t["payloads"].values() for v in values}
            got = sent & seen
            if t["state"] == "committed":
                assert got == sent, f"committed {txn} lost entries"
            elif t["state"] == "in_doubt":
                assert got in (set(), sent), f"{txn} committed on some topics only"
            else:
                assert not got, f"{t['state']} {txn} was read as committed"
        assert seen <= world.plain | {v for t in world.txns.values() for vs in t["payloads"].values() for v in vs}
    finally:
        shutil.rmtree(root, ignore_errors=True)
