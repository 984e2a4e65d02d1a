"""Producers: the transactional session (Kafka's TransactionManager), idempotent and plain sends.

Sequence numbers are per (producer id, topic) and keep counting across epochs, because readers
drop duplicates by (topic, producer_id, sequence_id) (see `committed_entries`): a sequence is
never reused. The ProducerStateManager decides, under the producer id's lock, whether a send
is the next one (written), a retry of one already sent in the same transaction (acknowledged with
its original position, written once), one already used by another transaction (refused: readers
would drop it as a duplicate of that transaction's entry, aborted or not) or leaves a gap
(refused, nothing written).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from concurrent.futures import Future
from datetime import timedelta
from dataclasses import dataclass
from typing import Callable, Mapping

import pyarrow.compute as pc

from txn_engine.producers.coordinator import ProducerIdentity, TransactionCoordinator
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.producers.ledger_writer import LedgerWriter, PendingEntries, WriteRequest
from txn_engine.core.log_types import EntryType, TxnId
from txn_engine.core.positions import Position, checked_position
from txn_engine.core.schema import LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA
from txn_engine.core.errors import InvalidTxnStateError, OutOfOrderSequenceError, TransactionAbortedError


RECENT_SENDS_KEPT = 256  # per (producer, topic): retries of older sends are looked up in Delta


MAX_BATCH_ENTRIES = 10_000  # a producer's batch is queued when this full, at the latest


class SendFuture:
    """The acknowledgement of one send: `result()` is its position once durable in Delta.

    Waiting on it first queues its producer's batch if that is still held back."""

    __slots__ = ("_batch", "_index", "sequence", "_flush", "txn")

    def __init__(self, batch: Future, index: int = 0, sequence: int | None = None, flush=None,
                 txn: TxnId | None = None):
        self._batch = batch
        self._index = index
        self.sequence = sequence
        self._flush = flush
        self.txn = txn  # the transaction the send belongs to: only a resend in it is a retry

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
    one transaction (or none), producer and epoch: the producer queues or drops it before it ends
    one, and a batch of another transaction or epoch is never added to (its entries would be
    written under that transaction's id)."""

    def __init__(self) -> None:
        self.request: WriteRequest | None = None
        self._owner: tuple[TxnId | None, int, int] | None = None  # (txn, producer id, epoch) of `request`

    def add(self, txn: TxnId | None, producer_id: int, epoch: int, topic: str, sequence: int,
            key: str | None, payload: bytes) -> tuple[Future, int]:
        request = self.request
        if request is not None:
            owner = self._owner
            if (owner[0] is not txn and owner[0] != txn) or owner[1] != producer_id or owner[2] != epoch:
                # Unreachable through the producers (they queue or drop a batch before its transaction
                # ends); kept so a stale batch can never carry sends into another transaction.
                self.drop(InvalidTxnStateError(
                    f"this send of transaction {owner[0]} (producer {owner[1]}, epoch {owner[2]}) was still "
                    "held back when its producer moved on; it was dropped and nothing of it was written. "
                    "Send it again in the current transaction."
                ))
                request = None
        if request is None:
            entries = PendingEntries(EntryType.DATA.value, None if txn is None else txn.most_bits,
                                     None if txn is None else txn.least_bits, producer_id, epoch)
            request = self.request = WriteRequest(entries=entries)
            self._owner = (txn, producer_id, epoch)
        return request.future, request.entries.add(topic, sequence, key, payload)

    def take(self) -> WriteRequest | None:
        request, self.request = self.request, None
        return request

    def drop(self, error: BaseException) -> None:
        """Fail the sends held back: nothing of them is written."""
        request = self.take()
        if request is not None:
            request.fail(error)


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

    def check(self, producer_id: int, topic: str, sequence: int, txn: TxnId | None = None) -> SendFuture | None:
        """None when `sequence` is the next one; the original acknowledgement for a retry (a resend in
        the original's transaction `txn`, None for non-transactional sends); raises on a gap or when
        the sequence was used by another transaction."""
        return self.check_state(self.of(producer_id, topic), sequence, txn)

    def check_state(self, state: TopicSequences, sequence: int, txn: TxnId | None = None) -> SendFuture | None:
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
        original = state.recent_send(sequence)
        if original is None:
            original = self._stored_position(producer_id, topic, sequence)
        if original.txn != txn:
            self._refuse_reuse(state, sequence, original, txn)
        return original

    def _refuse_reuse(self, state: TopicSequences, sequence: int, original: SendFuture, txn: TxnId | None):
        """A resend outside the original's transaction: readers keep the first entry of a sequence
        whatever its transaction, so written again it would be dropped as a duplicate, and answered
        with the original's position it would be lost whenever that transaction does not commit."""
        theirs = "a non-transactional send" if original.txn is None else f"a send of transaction {original.txn}"
        ours = "of this non-transactional send" if txn is None else f"of the current transaction {txn}"
        if original.done() and original.exception() is not None:
            fate = "never written"
        elif original.txn is None:
            fate = "written"
        else:
            outcome = self._outcome(original.txn, state.topic) if original.done() else None
            fate = {EntryType.COMMIT.value: "committed", EntryType.ABORT.value: "aborted"}.get(outcome, "not decided yet")
        raise OutOfOrderSequenceError(
            f"sequence {sequence} of producer {state.producer_id} on topic {state.topic!r} was already given to "
            f"{theirs} ({fate}), not {ours}. A sequence number is never reused (readers keep its first entry), "
            "so nothing was written. If that transaction committed, its message is already readable: do not "
            "send it again. Otherwise send it in the current transaction under a new sequence number (the "
            f"next expected is {state.last + 1}, or omit `sequence`)."
        )

    def _outcome(self, txn: TxnId, topic: str) -> str | None:
        """COMMIT or ABORT: the marker of `txn` on `topic`, None if it has none yet (an error path only)."""
        entries = self.tables.read(
            LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA, ["topic", "entry_type", "txn_most_bits", "txn_least_bits"]
        )
        mask = pc.and_(
            pc.and_(pc.equal(entries["txn_most_bits"], txn.most_bits), pc.equal(entries["txn_least_bits"], txn.least_bits)),
            pc.and_(pc.equal(entries["topic"], topic), pc.not_equal(entries["entry_type"], EntryType.DATA.value)),
        )
        markers = entries.filter(mask)["entry_type"].to_pylist()
        return markers[0] if markers else None

    def _stored_position(self, producer_id: int, topic: str, sequence: int) -> SendFuture:
        entries = self.tables.read(
            LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA,
            ["topic", "ledger_id", "entry_id", "producer_id", "sequence_id", "txn_most_bits", "txn_least_bits"],
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
        most, least = hit["txn_most_bits"][0].as_py(), hit["txn_least_bits"][0].as_py()
        return SendFuture(future, 0, sequence, txn=None if most is None else TxnId(most, least))


def _payload(value: bytes | str) -> bytes:
    if type(value) is bytes:
        return value
    if isinstance(value, str):
        try:
            return value.encode()
        except UnicodeEncodeError as exc:
            raise ValueError(f"a str message value must encode as UTF-8 ({exc}); pass bytes instead. "
                             "Nothing was written") from None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"a message value is bytes or str, got {type(value).__name__}; encode it first")


def _check_utf8(text: str, what: str) -> None:
    # Delta stores strings as UTF-8: a str that has none (a lone surrogate, as surrogateescape
    # decoding yields) would fail in the committer and stop the engine for every producer.
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} {text!r} cannot be stored: it is not valid UTF-8 ({exc.reason} at "
                         f"index {exc.start}); decode it without 'surrogateescape'. Nothing was written") from None


def _check_key(key: str | None) -> None:
    if key is not None:
        if not isinstance(key, str):
            raise TypeError(f"a message key is a str or None, got {type(key).__name__}; nothing was written")
        _check_utf8(key, "message key")


def _check_topic(topic: str) -> None:
    if not isinstance(topic, str) or not topic.strip():
        raise ValueError(f"topic must be a non-empty string like 'orders-partition-0', got {topic!r}")
    _check_utf8(topic, "topic")


@dataclass(frozen=True)
class ProducerServices:
    """What a producer writes through: its engine's coordinator, ledger writer and producer states."""

    coordinator: TransactionCoordinator
    writer: LedgerWriter
    sequences: ProducerStateManager


class SequencedSends(ABC):
    """What both producers share: the de-duplicating send path into the producer's batch. Each
    producer keeps its topics' TopicSequences at hand, so a send costs no lookup by (producer, topic)
    and its topic is validated once."""

    services: ProducerServices
    _batch: SendAccumulator
    _topic_sequences: dict[str, TopicSequences]

    def _sequences(self, producer_id: int, topic: str) -> TopicSequences:
        state = self._topic_sequences.get(topic) if type(topic) is str else None
        if state is None or state.producer_id != producer_id:
            _check_topic(topic)
            state = self._topic_sequences[topic] = self.services.sequences.of(producer_id, topic)
        return state

    def _send(self, producer_id: int, epoch: int, topic: str, payload: bytes, key: str | None,
              sequence: int | None, txn: TxnId | None) -> SendFuture:
        """Call under the producer id's lock."""
        state = self._sequences(producer_id, topic)
        if sequence is None:
            seq = state.last + 1
        else:
            seq = int(sequence)
            original = self.services.sequences.check_state(state, seq, txn)
            if original is not None:
                return original  # a retry in the same transaction: acknowledged with its original position
        batch = self._batch
        future, index = batch.add(txn, producer_id, epoch, topic, seq, key, payload)
        send = SendFuture(future, index, seq, self.flush, txn)
        state.record(seq, send)
        if index >= MAX_BATCH_ENTRIES - 1:  # the batch is full
            self.flush()
        return send

    @abstractmethod
    def flush(self) -> None:
        """Queue the sends held back in this producer's batch."""


class IdempotentProducer(SequencedSends):
    """Non-transactional sends with sequence numbers: a retried send is written once."""

    def __init__(self, services: ProducerServices, producer_id: int, epoch: int = 0):
        self.services = services
        self.producer_id = producer_id
        self.epoch = epoch
        self._batch = SendAccumulator()
        self._topic_sequences = {}
        self._lock = services.coordinator.producer_lock(producer_id)

    def send(self, topic: str, value: bytes | str, key: str | None = None, sequence: int | None = None) -> SendFuture:
        """Write a DATA entry; `sequence` (default: the next one) makes a retry safe."""
        payload = _payload(value)
        _check_key(key)
        with self._lock:
            self.services.writer.check_running()
            return self._send(self.producer_id, self.epoch, topic, payload, key, sequence, None)

    def flush(self) -> None:
        """Queue the sends held back in this producer's batch (waiting on a send does it too)."""
        with self._lock:
            request = self._batch.take()
            if request is not None:
                self.services.writer.submit(request)


class TransactionalProducer(SequencedSends):
    """A transactional producer session: init_transactions, begin, send, send_offsets, commit, abort."""

    def __init__(self, services: ProducerServices, transactional_id: str, transaction_timeout: timedelta | float = 60.0):
        if not isinstance(transactional_id, str) or not transactional_id.strip():
            raise ValueError(f"transactional_id must be a non-empty string, got {transactional_id!r}")
        timeout = transaction_timeout if isinstance(transaction_timeout, timedelta) else timedelta(seconds=transaction_timeout)
        if timeout <= timedelta(0):
            raise ValueError(f"transaction_timeout must be positive, got {transaction_timeout!r}")
        self.services = services
        self.transactional_id = transactional_id
        self.timeout_ms = int(timeout / timedelta(milliseconds=1))
        self.producer_id: int | None = None
        self.epoch: int | None = None
        self.txn: TxnId | None = None
        self._sends: list[WriteRequest] = []  # queued batches of the open transaction
        # "committed" / "aborted" while commit() / abort() runs with the lock let go (waiting for the
        # sends): anything else on the transaction is refused meanwhile, as Kafka refuses sends during
        # a commit, so nothing acknowledged can be written after the transaction's marker.
        self._ending: str | None = None
        self._batch = SendAccumulator()
        self._topic_sequences = {}
        self._lock = threading.RLock()  # its producer id's lock once initialized (see `producer_lock`)

    def init_transactions(self) -> tuple[int, int]:
        """Register this instance: same producer id as before, epoch + 1; fences older instances.

        Called again on the same instance, it aborts the open transaction like a new instance
        would: the sends still held back fail (nothing of them is written)."""
        with self._lock:
            self._check_not_ending()
            txn, self.txn, self._sends = self.txn, None, []
            self._batch.drop(TransactionAbortedError(
                f"init_transactions() was called again while this send of transaction {txn} was held back in "
                "the producer: the transaction is aborted and nothing of the send was written. Send it again "
                "in a new transaction, under a new sequence number (or omit `sequence`)."
            ))
        identity = self.services.coordinator.init_producer(self.transactional_id, self.timeout_ms)
        self.producer_id, self.epoch, self.txn = identity.producer_id, identity.epoch, None
        self._lock = self.services.coordinator.producer_lock(identity.producer_id)
        return identity.producer_id, identity.epoch

    def _identity(self) -> ProducerIdentity:
        self.services.writer.check_running()
        if self.epoch is None:
            raise InvalidTxnStateError(
                f"producer {self.transactional_id!r} is not initialized; call init_transactions() first"
            )
        return self.services.coordinator.check_epoch(self.transactional_id, self.epoch)

    def _open_txn(self) -> TxnId:
        if self.txn is None:
            raise InvalidTxnStateError(
                f"producer {self.transactional_id!r} has no open transaction; call begin() first"
            )
        return self.txn

    def _check_not_ending(self) -> None:
        """Call under the lock."""
        if self._ending is not None:
            raise InvalidTxnStateError(
                f"transaction {self.txn} of producer {self.transactional_id!r} is being {self._ending} (by a "
                f"call in another thread); this call was refused and nothing was written. Wait until that "
                "call returns, then begin() the next transaction and make the call there."
            )

    def begin(self) -> TxnId:
        """Open a transaction; its id is (transaction group, the group's next sequence)."""
        with self._lock, self.services.coordinator.lock:
            identity = self._identity()
            self._check_not_ending()
            if self.txn is not None:
                raise InvalidTxnStateError(
                    f"producer {self.transactional_id!r} already has transaction {self.txn} open; "
                    "commit() or abort() it before begin()"
                )
            self.txn = self.services.coordinator.next_txn_id(identity)
            self._sends = []
            return self.txn

    def send(self, topic: str, value: bytes | str, key: str | None = None, sequence: int | None = None) -> SendFuture:
        """Write a DATA entry in the open transaction; `result()` of the answer is its position."""
        payload = _payload(value)
        _check_key(key)
        coordinator = self.services.coordinator
        with self._lock:  # not the coordinator's: `flush` checks again under it, in queue order
            identity = self._identity()
            txn = self._open_txn()
            if self._ending is not None:
                self._check_not_ending()
            t = coordinator.txns.get(txn)
            if t is not None:
                coordinator.require_ongoing(t)
            return self._send(identity.producer_id, identity.epoch, topic, payload, key, sequence, txn)

    def flush(self) -> None:
        """Queue the sends held back in this producer's batch (waiting on a send does it too).

        The checks happen here, in queue order: a producer fenced or a transaction aborted since
        the sends were accepted gets its sends failed, and nothing of them is written."""
        coordinator = self.services.coordinator
        with self._lock, coordinator.lock:
            request = self._batch.take()
            if request is None:
                return
            try:
                identity = self._identity()
                txn = self._open_txn()
                topics = dict.fromkeys(request.entries.topics)
                request.before = coordinator.add_topics(identity, txn, topics)  # durable before the data
                self.services.writer.submit(request)
            except BaseException as exc:
                request.fail(exc)
                raise
            self._sends.append(request)

    def send_offsets(self, group: str, offsets: Mapping[str, Position | tuple[int, int] | str]) -> None:
        """Consumer-group offsets that land in consumer_offsets if and only if this transaction commits.
        A position is a Position, a (ledger_id, entry_id) pair or `L:E` as printed."""
        if not isinstance(group, str) or not group.strip():
            raise ValueError(f"consumer group must be a non-empty string, got {group!r}")
        _check_utf8(group, "consumer group")
        if not isinstance(offsets, Mapping):
            raise TypeError(f"offsets are a mapping of topic to position, got {type(offsets).__name__}")
        rows = []
        for topic, position in offsets.items():
            _check_topic(topic)
            ledger_id, entry_id = checked_position(position, f"the offset of topic {topic!r}")
            rows.append({"group_id": group, "topic": topic, "ledger_id": ledger_id, "entry_id": entry_id})
        coordinator = self.services.coordinator
        with self._lock, coordinator.lock:
            identity = self._identity()
            txn = self._open_txn()
            self._check_not_ending()
            coordinator.ensure_txn(identity, txn)  # offsets alone still make a transaction
            coordinator.add_offsets(txn, rows)

    def _wait_sends(self) -> BaseException | None:
        errors = [request.future.exception() for request in self._sends]
        return next((e for e in errors if e is not None), None)

    def _end_marked(self, txn: TxnId, end: Callable[[], Future | None]) -> TxnId:
        """The part of commit()/abort() run with the lock let go, the transaction marked as ending:
        `end` (waits for the sends, queues the marker) and its marker's future. On success the
        producer has no open transaction; on error the mark is cleared and the transaction stays."""
        try:
            future = end()
            if future is not None:
                future.result()
        except BaseException:
            with self._lock:
                self._ending = None
            raise
        with self._lock:
            self.txn, self._sends, self._ending = None, [], None
        return txn

    def commit(self) -> TxnId:
        """Make every send of the transaction readable, on all its topics, or (on error) none."""
        coordinator = self.services.coordinator
        with self._lock, coordinator.lock:
            self._identity()
            txn = self._open_txn()
            self._check_not_ending()
            self.flush()
            self._ending = "committed"

        def end() -> Future | None:
            failed = self._wait_sends()
            if failed is not None:
                raise InvalidTxnStateError(
                    f"a send of transaction {txn} failed ({failed}); the transaction cannot commit. Call abort(), "
                    "then begin() again and send its messages under new sequence numbers (omit `sequence`)."
                ) from failed
            with self._lock, coordinator.lock:
                self._identity()  # fenced while flushing?
                if coordinator.txns.get(txn) is None:
                    return None
                return coordinator.end_txn(txn, EntryType.COMMIT, "producer")

        return self._end_marked(txn, end)

    def commit_async(self) -> Future:
        """Pipelined commit: queue the commit and return at once; the future resolves when it is
        complete (or raises). The producer may begin() its next transaction meanwhile, so one
        producer keeps many transactions in flight. A crash before the future resolves leaves the
        transaction in doubt: recovery commits it on every topic if it was prepared, else on none."""
        coordinator = self.services.coordinator
        with self._lock, coordinator.lock:
            self._identity()
            txn = self._open_txn()
            self._check_not_ending()
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
        coordinator = self.services.coordinator
        with self._lock, coordinator.lock:
            self._identity()
            txn = self._open_txn()
            self._check_not_ending()
            # Never queued: nothing of it is written.
            self._batch.drop(TransactionAbortedError(f"transaction {txn} was aborted before this send was written"))
            self._ending = "aborted"

        def end() -> Future | None:
            self._wait_sends()
            with self._lock, coordinator.lock:
                self._identity()
                t = coordinator.txns.get(txn)
                if t is None:
                    return None
                try:
                    coordinator.require_ongoing(t)
                    return coordinator.end_txn(txn, EntryType.ABORT, "producer")
                except TransactionAbortedError:
                    # Aborted by the coordinator or an operator: nothing left to do, and now that its
                    # producer knows, the coordinator can forget it (see TransactionCoordinator._end).
                    coordinator.txns.pop(txn, None)
                    return None

        return self._end_marked(txn, end)
