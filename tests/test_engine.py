"""The transaction engine on real Delta tables: fencing, sequences, atomic commit, crashes, timeouts."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import pyarrow.compute as pc
import pytest

from txn_engine.producers.engine import GC_FIRST_GENERATION_THRESHOLD, Engine
from txn_engine.producers.ledger_writer import AFTER_ENTRIES_CHUNK, AFTER_PREPARE, RolloverPolicy
from txn_engine.core.log_types import TxnId
from txn_engine.core.positions import Position
from txn_engine.producers.producer import RECENT_SENDS_KEPT, SendAccumulator
from txn_engine.core.schema import (
    CONSUMER_OFFSETS,
    CONSUMER_OFFSETS_SCHEMA,
    LEDGER_ENTRIES,
    LEDGER_ENTRIES_SCHEMA,
    LEDGER_STATES_LOG,
    LEDGER_STATES_SCHEMA,
    TXN_LOG,
    TXN_LOG_SCHEMA,
)
from txn_engine.core.settings import WarehouseSettings
from txn_engine.producers.admin import operator_abort
from txn_engine.core.errors import (
    EngineLockedError,
    EngineStoppedError,
    InjectedCrash,
    InvalidTxnStateError,
    OutOfOrderSequenceError,
    ProducerFencedError,
    TransactionAbortedError,
)
from txn_engine.storage.warehouse import Warehouse


class Clock:
    def __init__(self):
        self.now = datetime(2026, 1, 1, tzinfo=timezone.utc)

    def __call__(self) -> datetime:
        return self.now


class CrashAt:
    """A crash hook: raises InjectedCrash the `nth` time `point` is reached after arm()."""

    def __init__(self, point: str, nth: int = 1):
        self.point, self.nth, self.armed, self.seen = point, nth, False, 0

    def arm(self) -> None:
        self.armed = True

    def __call__(self, point: str) -> None:
        if self.armed and point == self.point:
            self.seen += 1
            if self.seen == self.nth:
                self.armed = False
                raise InjectedCrash(f"injected crash at {point}")


def entries(engine: Engine):
    return engine.tables.read(LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA)


def markers_of(engine: Engine, txn) -> list[tuple[str, str]]:
    e = entries(engine)
    mask = pc.and_(pc.equal(e["txn_least_bits"], txn.least_bits), pc.not_equal(e["entry_type"], "DATA"))
    rows = e.filter(mask).to_pylist()
    return sorted((r["topic"], r["entry_type"]) for r in rows if r["txn_most_bits"] == txn.most_bits)


def payloads(engine: Engine, topic: str) -> list[bytes]:
    return [e.payload for e in engine.consumer(topic).read()]


@pytest.fixture
def engine(warehouse):
    with Engine(warehouse) as e:
        yield e


def test_errors_say_what_happened_and_what_to_do(engine, warehouse):
    p = engine.producer("app")
    with pytest.raises(InvalidTxnStateError, match="call init_transactions\\(\\) first"):
        p.begin()
    p.init_transactions()
    with pytest.raises(InvalidTxnStateError, match="no open transaction; call begin\\(\\) first"):
        p.send("t", b"x")
    p.begin()
    with pytest.raises(InvalidTxnStateError, match="already has transaction .* open; commit\\(\\) or abort\\(\\) it"):
        p.begin()
    with pytest.raises(ValueError, match="topic must be a non-empty string"):
        p.send("", b"x")
    with pytest.raises(TypeError, match="bytes or str"):
        p.send("t", 42)
    with pytest.raises(TypeError, match="a message key is a str or None, got int; nothing was written"):
        p.send("t", b"x", key=7)
    with pytest.raises(TypeError, match="a message key is a str or None"):
        engine.send("t", b"x", key=b"k")
    # A str with no UTF-8 form (surrogateescape decoding makes them) is refused at the call: in the
    # committer it stopped the engine and failed every other producer's writes.
    lone = b"user-\xff".decode("utf-8", "surrogateescape")
    with pytest.raises(ValueError, match="message key 'user-\\\\udcff' cannot be stored: it is not valid UTF-8"):
        engine.send("t", b"x", key=lone)
    with pytest.raises(ValueError, match="topic 'user-\\\\udcff' cannot be stored"):
        p.send(lone, b"x")
    with pytest.raises(ValueError, match="message key .* cannot be stored"):
        engine.idempotent_producer().send("t", b"x", key=lone)
    with pytest.raises(ValueError, match="must encode as UTF-8"):
        p.send("t", lone)
    assert engine.send("t", b"fine").result() is not None and engine.writer.stopped is None
    with pytest.raises(ValueError, match="transaction_timeout must be positive"):
        engine.producer("x", transaction_timeout=0)
    with pytest.raises(EngineLockedError, match="another transaction engine is running on this warehouse .*pid"):
        Engine(warehouse)


def test_begin_send_commit_and_abort(engine):
    p = engine.producer("app")
    assert p.init_transactions() == (p.producer_id, 0)
    txn = p.begin()
    a = p.send("orders", b"a1")
    b = p.send("payments", b"b1")
    assert p.commit() == txn
    p.begin()
    p.send("orders", b"dropped")
    p.abort()
    assert payloads(engine, "orders") == [b"a1"]
    assert payloads(engine, "payments") == [b"b1"]
    assert a.result().entry_id == 0 and b.result().entry_id == 0
    assert a.result().ledger_id != b.result().ledger_id  # ledger ids are unique across topics
    states = engine.tables.read(TXN_LOG, TXN_LOG_SCHEMA).sort_by("log_seq")
    mine = states.filter(pc.equal(states["txn_least_bits"], txn.least_bits))["state"].to_pylist()
    assert mine == ["ONGOING", "PREPARE_COMMIT", "COMPLETE_COMMIT"]  # one ONGOING: both topics in one batch


def test_fencing_two_instances_interleaved(engine):
    old = engine.producer("etl")
    pid, epoch = old.init_transactions()
    old.begin()
    old.send("orders", b"zombie-1")
    old.send("payments", b"zombie-2").result()
    old_txn = old.txn
    new = engine.producer("etl")
    assert new.init_transactions() == (pid, epoch + 1)
    # The zombie's open transaction was aborted on both topics it touched.
    assert markers_of(engine, old_txn) == [("orders", "ABORT"), ("payments", "ABORT")]
    written = entries(engine).num_rows
    for call in (lambda: old.send("orders", b"late"), old.commit, old.abort, old.begin):
        with pytest.raises(ProducerFencedError, match="fenced by a newer instance .*Close this instance"):
            call()
    assert entries(engine).num_rows == written  # a fenced producer never writes
    new.begin()
    new.send("orders", b"fresh")
    new.commit()
    assert payloads(engine, "orders") == [b"fresh"]
    assert payloads(engine, "payments") == []


def test_duplicate_and_out_of_order_sends(engine, warehouse):
    ip = engine.idempotent_producer()
    first = ip.send("t", b"m0", sequence=0).result()
    ip.send("t", b"m1", sequence=1).result()
    assert ip.send("t", b"m0", sequence=0).result() == first  # a retry: original position
    written = entries(engine).num_rows
    with pytest.raises(OutOfOrderSequenceError, match="next expected is 2, so 3 send\\(s\\) before it are missing"):
        ip.send("t", b"m5", sequence=5)
    assert entries(engine).num_rows == written
    p = engine.producer("tx")
    p.init_transactions()
    p.begin()
    s0 = p.send("t", b"t0")
    assert s0.sequence == 0
    assert p.send("t", b"t0", sequence=0).result() == s0.result()
    with pytest.raises(OutOfOrderSequenceError):
        p.send("t", b"t9", sequence=9)
    p.commit()
    engine.send("t", b"plain").result()  # non-transactional sends interleave with the others
    assert payloads(engine, "t") == [b"m0", b"m1", b"t0", b"plain"]
    pid = ip.producer_id
    engine.close()
    with Engine(warehouse) as again:  # after a restart retries are still recognized (looked up in Delta)
        retried = again.sequences.check(pid, "t", 0)
        assert retried.result() == first
        assert again.sequences.next_sequence(pid, "t") == 2


def test_retries_of_recent_and_of_older_sends_are_acknowledged_once(engine):
    """The last RECENT_SENDS_KEPT sends of a (producer, topic) are answered from memory, older ones
    from Delta: either way with the original position and nothing written again."""
    ip = engine.idempotent_producer()
    sends = [ip.send("t", f"m{i}".encode()) for i in range(RECENT_SENDS_KEPT + 5)]
    positions = [s.result() for s in sends]
    written = entries(engine).num_rows
    last = len(sends) - 1
    for sequence in (0, 4, 5, last - RECENT_SENDS_KEPT + 1, last):
        assert ip.send("t", b"again", sequence=sequence).result() == positions[sequence]
    assert ip.send("t", b"next", sequence=last + 1).result() != positions[last]
    assert entries(engine).num_rows == written + 1


def test_a_sequence_of_another_transaction_is_refused_not_acknowledged(engine, warehouse):
    """Readers keep the first entry of a (topic, producer, sequence) whatever its transaction: a
    resend of an aborted transaction's sequence in a new one was acknowledged at the aborted
    position, so the message was lost. Refused now, nothing written; only a retry in the same
    transaction is acknowledged."""
    p = engine.producer("app")
    p.init_transactions()
    p.begin()
    p.send("t", b"order-1", sequence=0).result()
    p.send("t", b"order-2", sequence=1)  # held back: abort() drops it, never written
    p.abort()
    p.begin()
    written = entries(engine).num_rows
    for sequence, fate in ((0, "aborted"), (1, "never written")):
        with pytest.raises(OutOfOrderSequenceError, match=f"sequence {sequence} .* was already given to a send of "
                           f"transaction .* \\({fate}\\), not of the current transaction .*nothing was written.*"
                           "under a new sequence number \\(the next expected is 2"):
            p.send("t", b"again", sequence=sequence)
    assert entries(engine).num_rows == written
    resent = p.send("t", b"order-1")
    assert p.send("t", b"order-1", sequence=resent.sequence).result() == resent.result()  # same txn: a retry
    p.commit()
    p.begin()
    p.send("t", b"open at close", sequence=3).result()  # ongoing when the engine goes; re-init aborts it
    engine.close()
    with Engine(warehouse) as again:  # the originals are looked up in Delta now
        q = again.producer("app")
        q.init_transactions()
        q.begin()
        for sequence in (0, 3):
            with pytest.raises(OutOfOrderSequenceError, match=f"sequence {sequence} .*\\(aborted\\)"):
                q.send("t", b"again", sequence=sequence)
        with pytest.raises(OutOfOrderSequenceError, match="sequence 2 .*\\(committed\\).*do not send it again"):
            q.send("t", b"order-1", sequence=2)
        q.send("t", b"order-2")
        q.commit()
        assert payloads(again, "t") == [b"order-1", b"order-2"]


def test_init_transactions_again_drops_the_sends_held_back(engine):
    p = engine.producer("app")
    p.init_transactions()
    old = p.begin()
    held = p.send("t", b"old")  # held back in the producer's batch
    p.init_transactions()
    assert isinstance(held.exception(), TransactionAbortedError)
    with pytest.raises(TransactionAbortedError, match="init_transactions\\(\\) was called again .*nothing of the "
                       "send was written"):
        held.result()
    new = p.begin()
    p.send("t", b"new")
    p.commit()
    assert payloads(engine, "t") == [b"new"]
    stored = entries(engine).to_pylist()
    assert {(r["txn_least_bits"], r["producer_epoch"]) for r in stored} == {(new.least_bits, 1)}
    assert old.least_bits != new.least_bits


def test_a_batch_is_never_reused_by_another_transaction_or_epoch():
    batch = SendAccumulator()
    first, _ = batch.add(TxnId(0, 1), 7, 0, "t", 0, None, b"a")
    assert batch.add(TxnId(0, 1), 7, 0, "t", 1, None, b"b") == (first, 1)  # same transaction: one batch
    second, index = batch.add(TxnId(0, 2), 7, 0, "t", 2, None, b"c")
    assert second is not first and index == 0
    with pytest.raises(InvalidTxnStateError, match="transaction 0:1 .* was still held back .* nothing of it was written"):
        first.result(timeout=0)
    third, index = batch.add(TxnId(0, 2), 7, 1, "t", 3, None, b"d")  # a new epoch: a new batch too
    assert third is not second and index == 0 and second.exception(timeout=0) is not None


@pytest.mark.parametrize("ending, ended", [("commit", "committed"), ("abort", "aborted")])
def test_no_send_is_accepted_while_a_transaction_ends(warehouse, ending, ended):
    """A send from a second thread while commit() (abort()) waits for the transaction's sends was
    acknowledged, then written after the COMMIT marker: never readable. It is refused now."""
    late: list = []

    def send_while_ending(point: str) -> None:  # in the committer, while commit()/abort() waits on it
        if point == AFTER_ENTRIES_CHUNK and p.txn is not None and not late:
            deadline = time.monotonic() + 5
            while getattr(p, "_ending", None) is None and time.monotonic() < deadline:
                time.sleep(0.001)  # abort(): its sends were queued before it was called
            try:
                late.append(p.send("t", b"late"))
            except InvalidTxnStateError as exc:
                late.append(exc)

    with Engine(warehouse, crash_hook=send_while_ending) as engine:
        p = engine.producer("app")
        p.init_transactions()
        txn = p.begin()
        p.send("t", b"x-1")
        if ending == "commit":
            p.commit()
        else:
            p.flush()
            p.abort()
        [refused] = late
        assert isinstance(refused, InvalidTxnStateError), refused
        assert f"transaction {txn} of producer 'app' is being {ended}" in str(refused)
        p.begin()
        p.send("t", b"y-1")
        p.commit()
        assert payloads(engine, "t") == ([b"x-1", b"y-1"] if ending == "commit" else [b"y-1"])
        stored = entries(engine).sort_by([("ledger_id", "ascending"), ("entry_id", "ascending")]).to_pylist()
        assert b"late" not in [r["payload"] for r in stored]
        assert [r["entry_type"] for r in stored if r["txn_least_bits"] == txn.least_bits][-1] == ending.upper()


def test_crash_after_prepare_then_recovery_writes_each_marker_once(warehouse):
    crash = CrashAt(AFTER_PREPARE)
    engine = Engine(warehouse, crash_hook=crash)
    p = engine.producer("app")
    p.init_transactions()
    txn = p.begin()
    p.send("a", b"1")
    p.send("b", b"2").result()  # the data is durable; the crash hits the commit
    p.send_offsets("group", {"in": Position(7, 3)})
    crash.arm()
    with pytest.raises(EngineStoppedError, match="if it was aborted, begin\\(\\) a new transaction and send its "
                       "messages under new sequence numbers") as stopped:
        p.commit()  # the caller of the failed round hears that the engine stopped, the failure chained
    assert isinstance(stopped.value.__cause__, InjectedCrash)
    with pytest.raises(EngineStoppedError, match="Start a new engine"):
        engine.send("a", b"after crash")
    engine.close()
    assert markers_of(engine, txn) == []  # PREPARE durable, no marker yet
    with Engine(warehouse) as recovered:
        assert recovered.recovered == [txn]
        assert markers_of(recovered, txn) == [("a", "COMMIT"), ("b", "COMMIT")]
        assert payloads(recovered, "a") == [b"1"] and payloads(recovered, "b") == [b"2"]
        offsets = recovered.tables.read(CONSUMER_OFFSETS, CONSUMER_OFFSETS_SCHEMA).to_pylist()
        assert [(o["group_id"], o["topic"], o["ledger_id"], o["entry_id"]) for o in offsets] == [("group", "in", 7, 3)]
        assert recovered.coordinator.txns[txn].state == "COMPLETE_COMMIT"
    with Engine(warehouse) as third:  # nothing left to recover: no second marker
        assert third.recovered == []
        assert markers_of(third, txn) == [("a", "COMMIT"), ("b", "COMMIT")]


def test_crash_between_markers_of_a_multi_topic_transaction(warehouse):
    crash = CrashAt(AFTER_ENTRIES_CHUNK)
    engine = Engine(warehouse, crash_hook=crash, max_rows_per_commit=1)  # one Delta commit per entry
    p = engine.producer("app")
    p.init_transactions()
    txn = p.begin()
    sent = [p.send(topic, topic.encode()) for topic in ("a", "b", "c")]
    [s.result() for s in sent]
    crash.arm()
    with pytest.raises(EngineStoppedError) as stopped:
        p.commit()
    assert isinstance(stopped.value.__cause__, InjectedCrash)
    engine.close()
    assert markers_of(engine, txn) == [("a", "COMMIT")]  # one marker durable, two missing
    with Engine(warehouse) as recovered:
        assert recovered.recovered == [txn]
        assert markers_of(recovered, txn) == [("a", "COMMIT"), ("b", "COMMIT"), ("c", "COMMIT")]
        assert [payloads(recovered, t) for t in "abc"] == [[b"a"], [b"b"], [b"c"]]


def test_timeout_abort_and_the_late_commit(warehouse):
    clock = Clock()
    with Engine(warehouse, clock=clock) as engine:
        p = engine.producer("slow", transaction_timeout=10)
        p.init_transactions()
        txn = p.begin()
        p.send("t", b"late").result()
        clock.now += timedelta(seconds=5)
        assert engine.abort_expired() == []
        clock.now += timedelta(seconds=6)
        assert engine.abort_expired() == [txn]
        assert markers_of(engine, txn) == [("t", "ABORT")]
        with pytest.raises(TransactionAbortedError, match="aborted by coordinator \\(timed out.*Call abort\\(\\)"):
            p.commit()
        with pytest.raises(TransactionAbortedError):
            p.send("t", b"more")
        assert txn in engine.coordinator.txns  # kept until its producer has heard why
        p.abort()  # clears the aborted transaction
        assert txn not in engine.coordinator.txns
        p.begin()
        p.send("t", b"next")
        p.commit()
        assert payloads(engine, "t") == [b"next"]
        # A commit past the timeout is refused even before anything aborted it (the engine's timer
        # waits 10 s of real time here): the coordinator aborts it then and there.
        late = p.begin()
        p.send("t", b"too late").result()
        clock.now += timedelta(seconds=11)
        with pytest.raises(TransactionAbortedError, match="aborted by coordinator \\(timed out"):
            p.commit()
        p.abort()
        assert engine.abort_expired() == []
        engine.send("u", b"after").result()  # queued after the abort: its round wrote the markers too
        assert markers_of(engine, late) == [("t", "ABORT")]
        assert payloads(engine, "t") == [b"next"]


def test_the_running_engine_aborts_expired_transactions_itself(warehouse_root):
    # Nothing calls abort_expired() here: the engine's own timer does, as often as the shortest
    # timeout of its producers when that is below its interval (Kafka's coordinator: 10 s).
    with Engine(Warehouse(None, WarehouseSettings(warehouse=str(warehouse_root))), abort_expired_interval=30) as engine:
        p = engine.producer("sleepy", transaction_timeout=0.05)
        p.init_transactions()
        txn = p.begin()
        p.send("t", b"x").result()
        deadline = time.monotonic() + 5
        while txn not in engine.coordinator.txns or engine.coordinator.txns[txn].state != "COMPLETE_ABORT":
            assert time.monotonic() < deadline, "the running engine did not abort its expired transaction"
            time.sleep(0.02)
        assert engine.coordinator.txns[txn].actor == "coordinator"
        assert markers_of(engine, txn) == [("t", "ABORT")]
        with pytest.raises(TransactionAbortedError, match="timed out"):
            p.send("t", b"y")
    with pytest.raises(ValueError, match="abort_expired_interval must be positive"):
        Engine(Warehouse(None, WarehouseSettings(warehouse=str(warehouse_root))), abort_expired_interval=0)


def test_epochs_only_grow_across_recovery(warehouse_root):
    """A transaction prepared, then a newer instance's init_transactions durable, then a crash: recovery
    writes the transaction's COMPLETE row (with its own, older epoch) last; the next engine must still
    hand out an epoch above every one already given."""
    wh = Warehouse(None, WarehouseSettings(warehouse=str(warehouse_root)))
    held, release, crash = threading.Event(), threading.Event(), CrashAt(AFTER_PREPARE)

    def hook(point):
        if point == AFTER_ENTRIES_CHUNK and not release.is_set():
            held.set()  # hold the committer after the data round, so the next round takes both below
            release.wait(5)
        crash(point)

    engine = Engine(wh, crash_hook=hook)
    p = engine.producer("app")
    assert p.init_transactions()[1] == 0
    txn = p.begin()
    p.send("t", b"x")
    p.flush()
    assert held.wait(5)
    p.commit_async()  # PREPARE_COMMIT, queued behind the held data round
    crash.arm()
    second: list = []

    def init_second():
        try:
            second.append(engine.producer("app").init_transactions())
        except Exception as exc:  # the crash below stops the engine before the answer
            second.append(exc)

    thread = threading.Thread(target=init_second)
    thread.start()
    deadline = time.monotonic() + 5
    while engine.coordinator.producers["app"].epoch != 1:  # its record is queued once epoch 1 is set
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with engine.coordinator.lock:
        pass  # ... under this lock, which it holds until it has queued the record
    release.set()  # one round: PREPARE_COMMIT and epoch 1 durable, then the crash
    thread.join(5)
    # A crashed round tells its callers the engine stopped, the crash as its cause.
    assert isinstance(second[0], EngineStoppedError) and isinstance(second[0].__cause__, InjectedCrash)
    engine.close()
    with Engine(wh) as recovered:
        assert recovered.recovered == [txn]
    with Engine(wh) as engine:
        log = engine.tables.read(TXN_LOG, TXN_LOG_SCHEMA).sort_by("log_seq").to_pylist()
        assert [(r["state"], r["producer_epoch"]) for r in log[-2:]] == [("EMPTY", 1), ("COMPLETE_COMMIT", 0)]
        assert engine.producer("app").init_transactions()[1] == 2
        assert payloads(engine, "t") == [b"x"]


def test_finished_transactions_leave_no_state_behind(warehouse, tmp_path):
    # Kafka's coordinator keeps state per transactional id, not per finished transaction: memory
    # (and the garbage collector's work) must not grow with every transaction that passes.
    import gc
    import sys

    before = (gc.get_threshold(), sys.getswitchinterval())
    with Engine(warehouse) as engine:
        assert gc.get_threshold()[0] == GC_FIRST_GENERATION_THRESHOLD and sys.getswitchinterval() <= 0.001
        other = Engine(Warehouse(None, WarehouseSettings(warehouse=str(tmp_path / "other"))))
        other.close()
        other.close()  # twice: harmless
        assert gc.get_threshold()[0] == GC_FIRST_GENERATION_THRESHOLD  # still tuned while this engine runs
        p = engine.producer("busy")
        p.init_transactions()
        futures = []
        for i in range(30):
            p.begin()
            p.send("t", b"%d" % i)
            futures.append(p.commit_async())
        p.begin()
        p.send("t", b"dropped").result()  # queued and written: the transaction is in txn_log
        aborted = p.abort()
        for future in futures:
            future.result()
        assert engine.coordinator.txns == {}
        with pytest.raises(InvalidTxnStateError, match="COMPLETE_ABORT .*it is decided; nothing to abort"):
            operator_abort(engine, aborted, "ops", "cleanup")
        ongoing = p.begin()
        p.send("t", b"open").result()
    assert (gc.get_threshold(), sys.getswitchinterval()) == before  # restored at close
    with Engine(warehouse) as restarted:  # only what is still open is loaded again
        assert set(restarted.coordinator.txns) == {ongoing}
        assert len(payloads(restarted, "t")) == 30


def test_offsets_land_only_with_a_commit(engine):
    p = engine.producer("ctp")
    p.init_transactions()
    p.begin()
    p.send("out", b"x")
    p.send_offsets("g1", {"in": Position(3, 10)})
    p.abort()
    assert engine.tables.read(CONSUMER_OFFSETS, CONSUMER_OFFSETS_SCHEMA).num_rows == 0
    p.begin()
    p.send("out", b"y")
    p.send_offsets("g1", {"in": (3, 11)})
    p.commit()
    p.begin()
    # Refused at the call, nothing added: an id out of BIGINT's range stopped the engine at commit.
    for bad, message in [
        (7, "must be a Position, a \\(ledger_id, entry_id\\) pair of integers or a string LEDGER_ID:ENTRY_ID"),
        ((3, 1.5), "pair of integers"), ((True, 1), "pair of integers"), ("3-12", "not a position: '3-12'"),
        ((-5, 9), "-5:9 is out of range"), ((2**63, 0), f"{2**63}:0 is out of range"), ("3:-1", "3:-1 is out of range"),
    ]:
        with pytest.raises(ValueError, match=f"the offset of topic 'in'.*{message}"):
            p.send_offsets("g1", {"in": bad})
    p.send_offsets("g1", {"in": "3:12", "in2": [4, 0]})  # offsets alone make a transaction too; "L:E" as printed
    p.commit()
    rows = engine.tables.read(CONSUMER_OFFSETS, CONSUMER_OFFSETS_SCHEMA).sort_by([("log_seq", "ascending"), ("topic", "ascending")]).to_pylist()
    assert [(r["group_id"], r["topic"], r["ledger_id"], r["entry_id"]) for r in rows] == [
        ("g1", "in", 3, 11),
        ("g1", "in", 3, 12),
        ("g1", "in2", 4, 0),
    ]
    assert engine.writer.stopped is None


def test_consumer_positions_are_checked_as_offsets_are(engine):
    at = engine.send("t", b"x").result()
    engine.send("t", b"y").result()
    # "L:E" as printed and pairs of integers, from the start or per read (was: "3:0" a TypeError,
    # (1, 'x'), (1.5, 0) and (-5, 0) accepted).
    assert [e.payload for e in engine.consumer("t", f"{at.ledger_id}:1").read()] == [b"y"]
    assert [e.payload for e in engine.consumer("t").read((at.ledger_id, 1))] == [b"y"]
    for bad, message in [("30", "not a position: '30'"), ((1, "x"), "pair of integers"), ((1.5, 0), "pair of integers"),
                         ((-5, 0), "-5:0 is out of range")]:
        with pytest.raises(ValueError, match=f"start.*{message}"):
            engine.consumer("t", bad)
        with pytest.raises(ValueError, match=f"from_position.*{message}"):
            engine.consumer("t").read(bad)


def test_second_engine_is_refused_until_the_first_closes(warehouse):
    first = Engine(warehouse)
    with pytest.raises(EngineLockedError, match="One engine writes a warehouse at a time"):
        Engine(warehouse)
    first.close()
    with Engine(warehouse) as second:
        assert second.send("t", b"x").result() is not None


def test_pipelined_commits_keep_many_transactions_in_flight(engine):
    p = engine.producer("fast")
    p.init_transactions()
    futures = []
    for i in range(5):
        p.begin()
        p.send("a", f"a{i}")
        p.send("b", f"b{i}")
        futures.append(p.commit_async())  # the next begin() does not wait for it
    p.begin()
    p.send("a", b"aborted")
    p.abort()
    for future in futures:
        future.result()
    assert payloads(engine, "a") == [f"a{i}".encode() for i in range(5)]
    assert payloads(engine, "b") == [f"b{i}".encode() for i in range(5)]
    # Each transaction was prepared only after its data was durable: its PREPARE row comes in a
    # later group-commit round than its data, i.e. every marker is after the data it closes.
    stored = entries(engine).to_pylist()
    for topic in "ab":
        kinds = [(r["txn_least_bits"], r["entry_type"]) for r in sorted(
            (r for r in stored if r["topic"] == topic), key=lambda r: (r["ledger_id"], r["entry_id"]))]
        for txn, kind in kinds:
            if kind == "COMMIT":
                assert (txn, "DATA") in kinds[: kinds.index((txn, kind))]


def test_an_engine_in_another_process_is_refused_until_it_dies(warehouse, warehouse_root):
    import os
    import signal
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from txn_engine.producers.engine import Engine\n"
         "from txn_engine.core.settings import WarehouseSettings\n"
         "from txn_engine.storage.warehouse import Warehouse\n"
         f"engine = Engine(Warehouse(None, WarehouseSettings(warehouse={str(warehouse_root)!r})))\n"
         "print('ready', flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True, cwd=os.getcwd(),
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(EngineLockedError, match=f"pid {child.pid} on"):
            Engine(warehouse)
    finally:
        child.send_signal(signal.SIGKILL)  # a crash: the OS releases the lock
        child.wait()
    with Engine(warehouse) as engine:
        assert engine.send("t", b"x").result() is not None


def test_rollover_by_bytes_and_by_age(warehouse):
    clock = Clock()
    policy = RolloverPolicy(max_entries=1000, max_bytes=10, max_age=timedelta(minutes=5))
    with Engine(warehouse, rollover=policy, clock=clock) as engine:
        by_bytes = [engine.send("t", b"123456").result() for _ in range(3)]  # 6 + 6 bytes reach 10
        assert [p.entry_id for p in by_bytes] == [0, 1, 0]
        clock.now += timedelta(minutes=6)
        aged = engine.send("t", b"1").result()
        assert aged.entry_id == 0 and aged.ledger_id > by_bytes[2].ledger_id
        with pytest.raises(ValueError, match="rollover limits must be positive"):
            RolloverPolicy(max_entries=0)
    states = engine.tables.read(LEDGER_STATES_LOG, LEDGER_STATES_SCHEMA)
    reasons = sorted(states["reason"].to_pylist())
    assert len(reasons) == 2 and reasons[0].startswith("rollover: 12 bytes") and "open for" in reasons[1]
