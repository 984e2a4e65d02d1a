"""Producers: the transactional session (Kafka's TransactionManager), idempotent and plain sends.

Sequence numbers are per (producer id, topic) and keep counting across epochs, because readers
drop duplicates by (topic, producer_id, sequence_id) (see `committed_entries`): a sequence is
never reused. The ProducerStateManager decides, under the producer id's lock, whether a send
is the next one (written), one already written (acknowledged with its original position, written
once) or leaves a gap (refused, nothing written).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future
from datetime import timedelta
from typing import TYPE_CHECKING, Mapping

import pyarrow.compute as pc

from txn_engine.coordinator import ProducerIdentity
from txn_engine.delta_io import DeltaTables
from txn_engine.ledger_writer import PendingEntries, WriteRequest
from txn_engine.positions import Position
from txn_engine.schema import LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA
from txn_engine.transaction_buffer import EntryType, TxnId
from txn_engine.txn_errors import InvalidTxnStateError, OutOfOrderSequenceError, TransactionAbortedError

if TYPE_CHECKING:
    from txn_engine.engine import Engine

RECENT_SENDS_KEPT = 256  # per (producer, topic): retries of older sends are looked up in Delta


MAX_BATCH_ENTRIES = 10_000  # a producer's batch is queued when this full, at the latest


class SendFuture:
    """The acknowledgement of one send: `result()` is its position once durable in Delta.

    Waiting on it first queues its producer's batch if that is still held back."""

    __slots__ = ("_batch", "_index", "sequence", "_flush")

    def __init__(self, batch: Future, index: int = 0, sequence: int | None = None, flush=None):
        self._batch = batch
        self._index = index
        self.sequence = sequence
        self._flush = flush

    def result(self, timeout: float | None = None) -> Position:
        if self._flush is not None and not self._batch.done():
            self._flush()
        return self._batch.result(timeout)[self._index]

    def done(self) -> bool:
        return self._batch.done()

    def exception(self, timeout: float | None = None):
        if self._flush is not None and not self._batch.done():
            self._flush()
        return self._batch.exception(timeout)


class SendAccumulator:
    """A producer's sends not yet queued (Kafka's RecordAccumulator): one write request per batch,
    so a transaction's messages cost one request and one future, not one each. A batch belongs to
    one transaction (or none), producer and epoch: the producer queues it before it ends one."""

    def __init__(self) -> None:
        self.request: WriteRequest | None = None

    def add(self, txn: TxnId | None, producer_id: int, epoch: int, topic: str, sequence: int,
            key: str | None, payload: bytes) -> tuple[Future, int]:
        request = self.request
        if request is None:
            entries = PendingEntries(EntryType.DATA.value, None if txn is None else txn.most_bits,
                                     None if txn is None else txn.least_bits, producer_id, epoch)
            request = self.request = WriteRequest(entries=entries)
        return request.future, request.entries.add(topic, sequence, key, payload)

    def take(self) -> WriteRequest | None:
        request, self.request = self.request, None
        return request


class TopicSequences:
    """One (producer id, topic)'s sequences: the last one written and the acknowledgements of the
    last RECENT_SENDS_KEPT sends, in a ring indexed by sequence (sequences are written without
    gaps, so the ring holds exactly the sends after `last - RECENT_SENDS_KEPT`; an acknowledgement
    from before a restart is not there and is looked up in Delta). Shared by the instances of a
    transactional id; read and changed under its producer lock."""

    __slots__ = ("producer_id", "topic", "last", "recent")

    def __init__(self, producer_id: int, topic: str, last: int = -1):
        self.producer_id = producer_id
        self.topic = topic
        self.last = last
        # Made on the first send: the pairs loaded at start (every producer ever stored) cost no ring.
        self.recent: list[SendFuture | None] | None = None

    def record(self, sequence: int, future: SendFuture) -> None:
        self.last = sequence
        recent = self.recent
        if recent is None:
            recent = self.recent = [None] * RECENT_SENDS_KEPT
        recent[sequence % RECENT_SENDS_KEPT] = future

    def recent_send(self, sequence: int) -> SendFuture | None:
        if self.recent is None or sequence <= self.last - RECENT_SENDS_KEPT:
            return None
        future = self.recent[sequence % RECENT_SENDS_KEPT]
        return future if future is not None and future.sequence == sequence else None


class ProducerStateManager:
    """The last sequence of every (producer id, topic), rebuilt from ledger_entries at start."""

    def __init__(self, tables: DeltaTables):
        self.tables = tables
        self._topic_sequences: dict[tuple[int, str], TopicSequences] = {}
        stored = tables.read(LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA, ["producer_id", "topic", "sequence_id"])
        stored = stored.filter(pc.is_valid(stored["sequence_id"]))
        if stored.num_rows:
            last = stored.group_by(["producer_id", "topic"]).aggregate([("sequence_id", "max")])
            for pid, topic, seq in zip(*(last[c].to_pylist() for c in ("producer_id", "topic", "sequence_id_max"))):
                self._topic_sequences[(pid, topic)] = TopicSequences(pid, topic, seq)

    def of(self, producer_id: int, topic: str) -> TopicSequences:
        """The sequences of (producer_id, topic), created empty for a new pair (one dict operation:
        two producer ids never race for one key, and setdefault is atomic)."""
        state = self._topic_sequences.get((producer_id, topic))
        if state is None:
            state = self._topic_sequences.setdefault((producer_id, topic), TopicSequences(producer_id, topic))
        return state

    def next_sequence(self, producer_id: int, topic: str) -> int:
        return self.of(producer_id, topic).last + 1

    def check(self, producer_id: int, topic: str, sequence: int) -> SendFuture | None:
        """None when `sequence` is the next one; the original acknowledgement for a retry; raises on a gap."""
        return self.check_state(self.of(producer_id, topic), sequence)

    def check_state(self, state: TopicSequences, sequence: int) -> SendFuture | None:
        expected = state.last + 1
        if sequence == expected:
            return None
        producer_id, topic = state.producer_id, state.topic
        if sequence > expected:
            raise OutOfOrderSequenceError(
                f"sequence {sequence} of producer {producer_id} on topic {topic!r} is out of order: the next "
                f"expected is {expected}, so {sequence - expected} send(s) before it are missing. Nothing was "
                "written. Resend the missing sequence numbers first, in order (or omit `sequence` and let "
                "the producer number its sends)."
            )
        if sequence < 0:
            raise OutOfOrderSequenceError(f"sequence numbers start at 0, got {sequence}; nothing was written")
        recent = state.recent_send(sequence)
        if recent is not None:
            return recent
        return self._stored_position(producer_id, topic, sequence)

    def _stored_position(self, producer_id: int, topic: str, sequence: int) -> SendFuture:
        entries = self.tables.read(
            LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA, ["topic", "ledger_id", "entry_id", "producer_id", "sequence_id"]
        )
        mask = pc.and_(
            pc.and_(pc.equal(entries["producer_id"], producer_id), pc.equal(entries["sequence_id"], sequence)),
            pc.equal(entries["topic"], topic),
        )
        hit = entries.filter(mask).sort_by([("ledger_id", "ascending"), ("entry_id", "ascending")])
        if hit.num_rows == 0:
            raise OutOfOrderSequenceError(
                f"sequence {sequence} of producer {producer_id} on topic {topic!r} is below the next expected "
                f"({self.next_sequence(producer_id, topic)}) but was never written; nothing was written. "
                "Continue with the next expected sequence."
            )
        future: Future = Future()
        future.set_result([Position(hit["ledger_id"][0].as_py(), hit["entry_id"][0].as_py())])
        return SendFuture(future, 0, sequence)


def _payload(value: bytes | str) -> bytes:
    if type(value) is bytes:
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"a message value is bytes or str, got {type(value).__name__}; encode it first")


def _check_key(key: str | None) -> None:
    if key is not None and not isinstance(key, str):
        raise TypeError(f"a message key is a str or None, got {type(key).__name__}; nothing was written")


def _check_topic(topic: str) -> None:
    if not isinstance(topic, str) or not topic.strip():
        raise ValueError(f"topic must be a non-empty string like 'orders-partition-0', got {topic!r}")


class SequencedSends(ABC):
    """What both producers share: the de-duplicating send path into the producer's batch. Each
    producer keeps its topics' TopicSequences at hand, so a send costs no lookup by (producer, topic)
    and its topic is validated once."""

    engine: "Engine"
    _batch: SendAccumulator
    _topic_sequences: dict[str, TopicSequences]

    def _sequences(self, producer_id: int, topic: str) -> TopicSequences:
        state = self._topic_sequences.get(topic) if type(topic) is str else None
        if state is None or state.producer_id != producer_id:
            _check_topic(topic)
            state = self._topic_sequences[topic] = self.engine.sequences.of(producer_id, topic)
        return state

    def _send(self, producer_id: int, epoch: int, topic: str, payload: bytes, key: str | None,
              sequence: int | None, txn: TxnId | None) -> SendFuture:
        """Call under the producer id's lock."""
        state = self._sequences(producer_id, topic)
        if sequence is None:
            seq = state.last + 1
        else:
            seq = int(sequence)
            original = self.engine.sequences.check_state(state, seq)
            if original is not None:
                return original  # a retry: acknowledged with its original position
        batch = self._batch
        future, index = batch.add(txn, producer_id, epoch, topic, seq, key, payload)
        send = SendFuture(future, index, seq, self.flush)
        state.record(seq, send)
        if index >= MAX_BATCH_ENTRIES - 1:  # the batch is full
            self.flush()
        return send

    @abstractmethod
    def flush(self) -> None:
        """Queue the sends held back in this producer's batch."""


class IdempotentProducer(SequencedSends):
    """Non-transactional sends with sequence numbers: a retried send is written once."""

    def __init__(self, engine: "Engine", producer_id: int, epoch: int = 0):
        self.engine = engine
        self.producer_id = producer_id
        self.epoch = epoch
        self._batch = SendAccumulator()
        self._topic_sequences = {}
        self._lock = engine.coordinator.producer_lock(producer_id)

    def send(self, topic: str, value: bytes | str, key: str | None = None, sequence: int | None = None) -> SendFuture:
        """Write a DATA entry; `sequence` (default: the next one) makes a retry safe."""
        payload = _payload(value)
        _check_key(key)
        with self._lock:
            self.engine.writer.check_running()
            return self._send(self.producer_id, self.epoch, topic, payload, key, sequence, None)

    def flush(self) -> None:
        """Queue the sends held back in this producer's batch (waiting on a send does it too)."""
        with self._lock:
            request = self._batch.take()
            if request is not None:
                self.engine.writer.submit(request)


class TransactionalProducer(SequencedSends):
    """A transactional producer session: init_transactions, begin, send, send_offsets, commit, abort."""

    def __init__(self, engine: "Engine", transactional_id: str, transaction_timeout: timedelta | float = 60.0):
        if not isinstance(transactional_id, str) or not transactional_id.strip():
            raise ValueError(f"transactional_id must be a non-empty string, got {transactional_id!r}")
        timeout = transaction_timeout if isinstance(transaction_timeout, timedelta) else timedelta(seconds=transaction_timeout)
        if timeout <= timedelta(0):
            raise ValueError(f"transaction_timeout must be positive, got {transaction_timeout!r}")
        self.engine = engine
        self.transactional_id = transactional_id
        self.timeout_ms = int(timeout / timedelta(milliseconds=1))
        self.producer_id: int | None = None
        self.epoch: int | None = None
        self.txn: TxnId | None = None
        self._sends: list[WriteRequest] = []  # queued batches of the open transaction
        self._batch = SendAccumulator()
        self._topic_sequences = {}
        self._lock = threading.RLock()  # its producer id's lock once initialized (see `producer_lock`)

    def init_transactions(self) -> tuple[int, int]:
        """Register this instance: same producer id as before, epoch + 1; fences older instances."""
        identity = self.engine.coordinator.init_producer(self.transactional_id, self.timeout_ms)
        self.producer_id, self.epoch, self.txn = identity.producer_id, identity.epoch, None
        self._lock = self.engine.coordinator.producer_lock(identity.producer_id)
        return identity.producer_id, identity.epoch

    def _identity(self) -> ProducerIdentity:
        self.engine.writer.check_running()
        if self.epoch is None:
            raise InvalidTxnStateError(
                f"producer {self.transactional_id!r} is not initialized; call init_transactions() first"
            )
        return self.engine.coordinator.check_epoch(self.transactional_id, self.epoch)

    def _open_txn(self) -> TxnId:
        if self.txn is None:
            raise InvalidTxnStateError(
                f"producer {self.transactional_id!r} has no open transaction; call begin() first"
            )
        return self.txn

    def begin(self) -> TxnId:
        """Open a transaction; its id is (transaction group, the group's next sequence)."""
        with self._lock, self.engine.coordinator.lock:
            identity = self._identity()
            if self.txn is not None:
                raise InvalidTxnStateError(
                    f"producer {self.transactional_id!r} already has transaction {self.txn} open; "
                    "commit() or abort() it before begin()"
                )
            self.txn = self.engine.coordinator.next_txn_id(identity)
            self._sends = []
            return self.txn

    def send(self, topic: str, value: bytes | str, key: str | None = None, sequence: int | None = None) -> SendFuture:
        """Write a DATA entry in the open transaction; `result()` of the answer is its position."""
        payload = _payload(value)
        _check_key(key)
        coordinator = self.engine.coordinator
        with self._lock:  # not the coordinator's: `flush` checks again under it, in queue order
            identity = self._identity()
            txn = self._open_txn()
            t = coordinator.txns.get(txn)
            if t is not None:
                coordinator.require_ongoing(t)
            return self._send(identity.producer_id, identity.epoch, topic, payload, key, sequence, txn)

    def flush(self) -> None:
        """Queue the sends held back in this producer's batch (waiting on a send does it too).

        The checks happen here, in queue order: a producer fenced or a transaction aborted since
        the sends were accepted gets its sends failed, and nothing of them is written."""
        coordinator = self.engine.coordinator
        with self._lock, coordinator.lock:
            request = self._batch.take()
            if request is None:
                return
            try:
                identity = self._identity()
                txn = self._open_txn()
                topics = dict.fromkeys(request.entries.topics)
                request.before = coordinator.add_topics(identity, txn, topics)  # durable before the data
                self.engine.writer.submit(request)
            except BaseException as exc:
                request.fail(exc)
                raise
            self._sends.append(request)

    def send_offsets(self, group: str, offsets: Mapping[str, Position | tuple[int, int]]) -> None:
        """Consumer-group offsets that land in consumer_offsets if and only if this transaction commits."""
        if not isinstance(group, str) or not group.strip():
            raise ValueError(f"consumer group must be a non-empty string, got {group!r}")
        rows = []
        for topic, position in offsets.items():
            _check_topic(topic)
            ledger_id, entry_id = Position(*position)
            rows.append({"group_id": group, "topic": topic, "ledger_id": int(ledger_id), "entry_id": int(entry_id)})
        coordinator = self.engine.coordinator
        with self._lock, coordinator.lock:
            identity = self._identity()
            txn = self._open_txn()
            coordinator.ensure_txn(identity, txn)  # offsets alone still make a transaction
            coordinator.add_offsets(txn, rows)

    def _wait_sends(self) -> BaseException | None:
        errors = [request.future.exception() for request in self._sends]
        return next((e for e in errors if e is not None), None)

    def commit(self) -> TxnId:
        """Make every send of the transaction readable, on all its topics, or (on error) none."""
        coordinator = self.engine.coordinator
        with self._lock, coordinator.lock:
            self._identity()
            txn = self._open_txn()
            self.flush()
        failed = self._wait_sends()
        if failed is not None:
            raise InvalidTxnStateError(
                f"a send of transaction {txn} failed ({failed}); the transaction cannot commit. Call abort(), "
                "then begin() again and resend."
            ) from failed
        with self._lock, coordinator.lock:
            self._identity()  # fenced while flushing?
            t = coordinator.txns.get(txn)
            future = None
            if t is not None:
                future = coordinator.end_txn(txn, EntryType.COMMIT, "producer")
        if future is not None:
            future.result()
        self.txn, self._sends = None, []
        return txn

    def commit_async(self) -> Future:
        """Pipelined commit: queue the commit and return at once; the future resolves when it is
        complete (or raises). The producer may begin() its next transaction meanwhile, so one
        producer keeps many transactions in flight. A crash before the future resolves leaves the
        transaction in doubt: recovery commits it on every topic if it was prepared, else on none."""
        coordinator = self.engine.coordinator
        with self._lock, coordinator.lock:
            self._identity()
            txn = self._open_txn()
            self.flush()
            if txn in coordinator.txns:
                future = coordinator.end_txn(
                    txn, EntryType.COMMIT, "producer", depends_on=[r for r in self._sends if not r.settled]
                )
            else:
                future = Future()
                future.set_result([])
            self.txn, self._sends = None, []
        return future

    def abort(self) -> TxnId | None:
        """Abort the open transaction: ABORT markers on its topics; nothing of it is ever read."""
        coordinator = self.engine.coordinator
        with self._lock, coordinator.lock:
            self._identity()
            txn = self._open_txn()
            dropped = self._batch.take()
            if dropped is not None:  # never queued: nothing of it is written
                dropped.fail(
                    TransactionAbortedError(f"transaction {txn} was aborted before this send was written")
                )
        self._wait_sends()
        with self._lock, coordinator.lock:
            self._identity()
            t = coordinator.txns.get(txn)
            future = None
            if t is not None:
                try:
                    coordinator.require_ongoing(t)
                    future = coordinator.end_txn(txn, EntryType.ABORT, "producer")
                except TransactionAbortedError:
                    # Aborted by the coordinator or an operator: nothing left to do, and now that its
                    # producer knows, the coordinator can forget it (see TransactionCoordinator._end).
                    coordinator.txns.pop(txn, None)
        if future is not None:
            future.result()
        self.txn, self._sends = None, []
        return txn
