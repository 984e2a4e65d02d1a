"""The transaction coordinator: transaction state, durable in the `txn_log` table.

Kafka's TransactionCoordinator + TransactionStateManager, DistributedLog's transaction groups:
a transactional id maps to one group (`txn_most_bits`), which numbers its transactions
(`txn_least_bits`). Every state transition is a txn_log row; the latest `log_seq` wins. The
commit protocol (Kafka's two phases): PREPARE_* durable, then a marker on every touched topic,
then COMPLETE_*. Recovery finishes every transaction found prepared, writing only the markers
that are missing, so each topic gets its marker exactly once.
"""

from __future__ import annotations

import threading
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Callable

import pyarrow.compute as pc

from txn_engine.storage.delta_io import DeltaTables
from txn_engine.producers.ledger_writer import LedgerWriter, PendingEntries, WriteRequest
from txn_engine.core.log_types import EntryType, TxnId
from txn_engine.core.schema import (
    CONSUMER_OFFSETS,
    CONSUMER_OFFSETS_SCHEMA,
    LEDGER_ENTRIES,
    LEDGER_ENTRIES_SCHEMA,
    TXN_LOG,
    TXN_LOG_SCHEMA,
)
from txn_engine.core.errors import (
    InvalidTxnStateError, ProducerFencedError, TransactionAbortedError, UnknownTransactionError,
)


class TxnStatus(StrEnum):
    """States of txn_log. EMPTY: a producer id/epoch handed out, no transaction open."""

    EMPTY = "EMPTY"
    ONGOING = "ONGOING"
    PREPARE_COMMIT = "PREPARE_COMMIT"
    PREPARE_ABORT = "PREPARE_ABORT"
    COMPLETE_COMMIT = "COMPLETE_COMMIT"
    COMPLETE_ABORT = "COMPLETE_ABORT"

    @property
    def is_prepared(self) -> bool:
        return self in (TxnStatus.PREPARE_COMMIT, TxnStatus.PREPARE_ABORT)

    @property
    def is_complete(self) -> bool:
        return self in (TxnStatus.COMPLETE_COMMIT, TxnStatus.COMPLETE_ABORT)


PREPARE = {EntryType.COMMIT: TxnStatus.PREPARE_COMMIT, EntryType.ABORT: TxnStatus.PREPARE_ABORT}
COMPLETE = {EntryType.COMMIT: TxnStatus.COMPLETE_COMMIT, EntryType.ABORT: TxnStatus.COMPLETE_ABORT}
MARKER_OF = {TxnStatus.PREPARE_COMMIT: EntryType.COMMIT, TxnStatus.PREPARE_ABORT: EntryType.ABORT}


@dataclass
class Transaction:
    """What the coordinator knows of one transaction (the latest txn_log row of it)."""

    txn: TxnId
    transactional_id: str | None
    producer_id: int
    producer_epoch: int
    timeout_ms: int
    started_at: datetime | None
    state: TxnStatus
    topics: list[str] = field(default_factory=list)
    offsets: list[dict[str, Any]] = field(default_factory=list)
    actor: str = "producer"
    reason: str | None = None
    updated_at: datetime | None = None

    def expired(self, now: datetime) -> bool:
        return (
            self.state == TxnStatus.ONGOING
            and self.started_at is not None
            and now - self.started_at > timedelta(milliseconds=self.timeout_ms)
        )


@dataclass
class ProducerIdentity:
    """A transactional id's producer id, current epoch, group and open transaction."""

    transactional_id: str
    producer_id: int
    epoch: int
    group: int
    timeout_ms: int
    txn: TxnId | None = None


def txn_group_of(transactional_id: str, groups: int) -> int:
    """The transaction group a transactional id belongs to: stable across processes and runs."""
    return zlib.crc32(transactional_id.encode()) % groups


class TransactionCoordinator:
    """Transaction state in memory, every transition queued to txn_log through the ledger writer."""

    def __init__(self, tables: DeltaTables, writer: LedgerWriter, clock: Callable[[], datetime], groups: int = 1):
        if groups < 1:
            raise ValueError(f"txn_groups must be at least 1, got {groups}")
        self.tables = tables
        self.writer = writer
        self.clock = clock
        self.groups = groups
        self.lock = threading.RLock()
        self._producer_locks: dict[int, threading.RLock] = {}
        self.producers: dict[str, ProducerIdentity] = {}
        self.txns: dict[TxnId, Transaction] = {}
        self._log_seq = 0
        self._next_producer_id = 1
        self._next_txn_seq: dict[int, int] = {}
        # The shortest transaction timeout of the producers initialized in this engine, and the event
        # the engine's timeout timer waits on: set when that timeout gets shorter (or the engine closes).
        self.shortest_timeout_ms: int | None = None
        self.expiry_wakeup = threading.Event()
        self._load()

    # -- loading and recovery ----------------------------------------------------------------

    def _load(self) -> None:
        log = self.tables.read(TXN_LOG, TXN_LOG_SCHEMA).sort_by("log_seq")
        max_pid = 0
        for row in log.to_pylist():
            self._log_seq = max(self._log_seq, row["log_seq"])
            max_pid = max(max_pid, row["producer_id"])
            group = row["txn_group"]
            tid = row["transactional_id"]
            identity = self.producers.get(tid) if tid is not None else None
            # A transaction's rows carry that transaction's epoch (the one its markers carry), also
            # when written after a newer instance's init_transactions (recovery finishing a prepared
            # transaction, the timeout abort of an older instance's transaction): such a row says
            # nothing of the producer's current epoch. Its epoch is the highest seen, so epochs only
            # grow and none is handed out twice; the rows keep meaning "this transaction, this epoch".
            if tid is not None and (
                identity is None or identity.producer_id != row["producer_id"] or row["producer_epoch"] > identity.epoch
            ):
                identity = self.producers[tid] = ProducerIdentity(
                    tid, row["producer_id"], row["producer_epoch"], group, row["timeout_ms"]
                )
            current = identity is not None and row["producer_epoch"] == identity.epoch
            if row["txn_most_bits"] is None:
                continue
            txn = TxnId(row["txn_most_bits"], row["txn_least_bits"])
            self._next_txn_seq[group] = max(self._next_txn_seq.get(group, 0), txn.least_bits + 1)
            state = TxnStatus(row["state"])
            if state.is_complete:
                self.txns.pop(txn, None)  # finished: no producer of this engine can refer to it (see `_end`)
            else:
                self.txns[txn] = Transaction(
                    txn, row["transactional_id"], row["producer_id"], row["producer_epoch"], row["timeout_ms"],
                    row["txn_started_at"], state, list(row["topics"]), list(row["offsets"] or []),
                    row["actor"], row["reason"], row["recorded_at"],
                )
            if current and state == TxnStatus.ONGOING:
                identity.txn = txn
            elif current and identity.txn == txn:
                identity.txn = None  # not if another of its transactions began meanwhile (commit_async)
        # Ids above everything stored, ingested ledgers included, so none can collide.
        stored_pid = self.tables.column_max(LEDGER_ENTRIES, "producer_id") or 0
        self._next_producer_id = max(max_pid, stored_pid) + 1
        self._stored_least_bits = self.tables.column_max(LEDGER_ENTRIES, "txn_least_bits") or 0

    def recover(self) -> list[TxnId]:
        """Finish every prepared transaction: write its missing markers (and offsets), then COMPLETE."""
        finished = []
        with self.lock:
            prepared = [t for t in self.txns.values() if t.state.is_prepared]
        for t in prepared:
            marker = MARKER_OF[t.state]
            have = self.topics_with_marker(t.txn)
            request = WriteRequest(
                entries=self._markers(t, [topic for topic in t.topics if topic not in have], marker),
                offsets=[] if marker == EntryType.ABORT or self._offsets_landed(t.txn) else self._offset_rows(t),
                after=[self._row(t, COMPLETE[marker], "recovery", f"finished after restart ({t.state})")],
            )
            self.writer.write_now(request)
            t.state = COMPLETE[marker]
            finished.append(t.txn)
        return finished

    def topics_with_marker(self, txn: TxnId) -> set[str]:
        entries = self.tables.read(LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA, ["topic", "entry_type", "txn_most_bits", "txn_least_bits"])
        mask = pc.and_(
            pc.and_(pc.equal(entries["txn_most_bits"], txn.most_bits), pc.equal(entries["txn_least_bits"], txn.least_bits)),
            pc.not_equal(entries["entry_type"], EntryType.DATA.value),
        )
        return set(entries.filter(mask)["topic"].to_pylist())

    def _offsets_landed(self, txn: TxnId) -> bool:
        offsets = self.tables.read(CONSUMER_OFFSETS, CONSUMER_OFFSETS_SCHEMA, ["txn_most_bits", "txn_least_bits"])
        mask = pc.and_(pc.equal(offsets["txn_most_bits"], txn.most_bits), pc.equal(offsets["txn_least_bits"], txn.least_bits))
        return offsets.filter(mask).num_rows > 0

    # -- producers ---------------------------------------------------------------------------

    def producer_lock(self, producer_id: int) -> threading.RLock:
        """The lock of one producer id's sends and batch, shared by the instances of a transactional id
        (they share sequence numbers). A send takes only this one: with one lock for every producer,
        8 producer threads queued on it for each message. Whatever changes transaction state takes
        `lock` too, always after this one, and checks again there (`flush`), so a send accepted just
        before its producer was fenced or its transaction aborted is never written."""
        with self.lock:
            return self._producer_locks.setdefault(producer_id, threading.RLock())

    def new_producer_id(self) -> int:
        with self.lock:
            pid = self._next_producer_id
            self._next_producer_id += 1
            return pid

    def init_producer(self, transactional_id: str, timeout_ms: int) -> ProducerIdentity:
        """Kafka's InitProducerId: same producer id, epoch + 1; the previous instance's open txn is aborted."""
        if not transactional_id:
            raise ValueError("transactional_id must be a non-empty string, e.g. 'orders-enricher-1'")
        with self.lock:
            identity = self.producers.get(transactional_id)
            pending = None
            if identity is not None and identity.txn is not None:
                open_txn = self.txns.get(identity.txn)
                if open_txn is not None and open_txn.state == TxnStatus.ONGOING:
                    pending = self._end(open_txn, EntryType.ABORT, "coordinator",
                                        f"fenced: a new instance of {transactional_id!r} called init_transactions")
        if pending is not None:
            pending.result()
        with self.lock:
            identity = self.producers.get(transactional_id)
            if identity is None:
                identity = ProducerIdentity(
                    transactional_id, self.new_producer_id(), -1,
                    txn_group_of(transactional_id, self.groups), timeout_ms,
                )
            identity = ProducerIdentity(identity.transactional_id, identity.producer_id, identity.epoch + 1,
                                        identity.group, timeout_ms)
            self.producers[transactional_id] = identity
            if self.shortest_timeout_ms is None or timeout_ms < self.shortest_timeout_ms:
                self.shortest_timeout_ms = timeout_ms
                self.expiry_wakeup.set()
            row = self._identity_row(identity, "producer", "init_transactions")
            future = self.writer.submit(WriteRequest(after=[row]))
        future.result()
        return identity

    def register_idempotent_producer(self) -> int:
        """A fresh producer id for an idempotent (non-transactional) producer, recorded so it is never reused."""
        with self.lock:
            pid = self.new_producer_id()
            row = self._log_row(None, 0, pid, 0, None, TxnStatus.EMPTY, [], 0, None, "producer", "idempotent producer")
            future = self.writer.submit(WriteRequest(after=[row]))
        future.result()
        return pid

    def check_epoch(self, transactional_id: str, epoch: int) -> ProducerIdentity:
        identity = self.producers[transactional_id]
        if identity.epoch != epoch:
            raise ProducerFencedError(
                f"producer {transactional_id!r} epoch {epoch} was fenced by a newer instance (epoch "
                f"{identity.epoch}); its open transaction was aborted. Close this instance: the newer "
                "one owns the transactional id."
            )
        return identity

    # -- transactions --------------------------------------------------------------------------

    def next_txn_id(self, identity: ProducerIdentity) -> TxnId:
        with self.lock:
            seq = max(self._next_txn_seq.get(identity.group, 0), self._stored_least_bits + 1)
            self._next_txn_seq[identity.group] = seq + 1
            return TxnId(identity.group, seq)

    def add_topics(self, identity: ProducerIdentity, txn: TxnId, topics) -> list[dict[str, Any]]:
        """Make `topics` part of `txn` (Kafka's AddPartitionsToTxn): the ONGOING row to write before
        their data, or none when they already were. Call under `lock`; checks the state first."""
        t = self.ensure_txn(identity, txn)
        self.require_ongoing(t)
        new = [topic for topic in topics if topic not in t.topics]
        if not new:
            return []
        t.topics.extend(new)
        return [self._row(t, TxnStatus.ONGOING, "producer", None)]

    def ensure_txn(self, identity: ProducerIdentity, txn: TxnId) -> Transaction:
        """The coordinator's record of `txn`, created (ONGOING, its timeout starting) on first use."""
        t = self.txns.get(txn)
        if t is None:
            t = Transaction(txn, identity.transactional_id, identity.producer_id, identity.epoch,
                            identity.timeout_ms, self.clock(), TxnStatus.ONGOING)
            self.txns[txn] = t
            identity.txn = txn
        return t

    def require_ongoing(self, t: Transaction) -> None:
        if t.state == TxnStatus.ONGOING:
            return
        if t.state in (TxnStatus.PREPARE_ABORT, TxnStatus.COMPLETE_ABORT):
            raise TransactionAbortedError(
                f"transaction {t.txn} was aborted by {t.actor} ({t.reason or 'no reason given'}); nothing of "
                "it will be read. Call abort() to clear it, then begin() a new transaction and send its "
                "messages again under new sequence numbers (omit `sequence`): a sequence number already "
                "used in the aborted transaction is never reused."
            )
        raise InvalidTxnStateError(f"transaction {t.txn} is {t.state}, not open; begin() a new transaction")

    def add_offsets(self, txn: TxnId, offsets: list[dict[str, Any]]) -> None:
        with self.lock:
            t = self.txns[txn]
            self.require_ongoing(t)
            t.offsets.extend(offsets)

    def end_txn(self, txn: TxnId, outcome: EntryType, actor: str, reason: str | None = None, depends_on=()):
        """Commit or abort an ongoing transaction; returns the future of its COMPLETE record.
        `depends_on`: the transaction's sends not yet durable (it is prepared after them)."""
        with self.lock:
            t = self.txns.get(txn)
            if t is None:
                raise UnknownTransactionError(f"no transaction {txn} in txn_log; list them with `txnlake txn list`")
            self.require_ongoing(t)
            if outcome == EntryType.COMMIT and t.expired(self.clock()):
                # Past its timeout it is the coordinator's to abort, whether or not the engine's
                # timeout timer has come by yet: a late commit never lands (Kafka refuses it too).
                self._abort_timed_out(t)
                self.require_ongoing(t)  # raises TransactionAbortedError, naming the timeout
            return self._end(t, outcome, actor, reason, depends_on)

    def _end(self, t: Transaction, outcome: EntryType, actor: str, reason: str | None, depends_on=()):
        prepare = PREPARE[outcome]
        t.state = prepare
        t.actor, t.reason = actor, reason
        identity = self.producers.get(t.transactional_id) if t.transactional_id is not None else None
        if identity is not None and identity.txn == t.txn:
            identity.txn = None  # its producer's open transaction (see ensure_txn); one lookup, not a scan

        def completed(_positions) -> None:
            t.state = COMPLETE[outcome]
            if actor == "producer":
                # Its producer has already let go of it (its next call is begin()): like Kafka's
                # coordinator, keep state per producer, not per finished transaction, so memory and
                # the garbage collector's work stay flat however many transactions pass (txn_log
                # keeps the record). Ended by anyone else, it stays: its producer still has to hear
                # why. A single dict operation: safe from the committer thread without the lock.
                self.txns.pop(t.txn, None)

        commit = outcome == EntryType.COMMIT
        request = WriteRequest(
            before=[self._row(t, prepare, actor, reason, with_offsets=commit)],
            entries=self._markers(t, t.topics, outcome),
            offsets=self._offset_rows(t) if commit else [],
            after=[self._row(t, COMPLETE[outcome], actor, reason)],
            on_durable=completed,
            depends_on=list(depends_on),
        )
        return self.writer.submit(request)

    def abort_expired(self, now: datetime | None = None) -> list[TxnId]:
        """Abort every transaction open past its timeout (the engine's timeout timer calls it)."""
        now = now or self.clock()
        futures = []
        with self.lock:
            for t in list(self.txns.values()):
                if t.expired(now):
                    futures.append((t.txn, self._abort_timed_out(t)))
        for _, future in futures:
            future.result()
        return [txn for txn, _ in futures]

    def _abort_timed_out(self, t: Transaction) -> Future:
        reason = f"timed out: open since {t.started_at:%Y-%m-%d %H:%M:%S} UTC, timeout {t.timeout_ms} ms"
        return self._end(t, EntryType.ABORT, "coordinator", reason)

    def expiry_check_interval(self, most: float) -> float:
        """Seconds until the timeout timer should look again: `most`, or less when a producer of this
        engine has a shorter timeout, so a transaction is aborted within about twice its timeout."""
        shortest = self.shortest_timeout_ms
        return most if shortest is None else min(most, shortest / 1000)

    def abort_from_ledgers(self, txn: TxnId, topics: list[str], producer_id: int | None, actor: str, reason: str):
        """An operator's abort of a transaction txn_log does not know: ABORT markers on `topics`."""
        with self.lock:
            t = Transaction(txn, None, producer_id if producer_id is not None else -1, -1, 0, None,
                            TxnStatus.ONGOING, list(topics), actor=actor, reason=reason)
            self.txns[txn] = t
            return self._end(t, EntryType.ABORT, actor, reason)

    # -- rows ------------------------------------------------------------------------------------

    def _markers(self, t: Transaction, topics, outcome: EntryType) -> PendingEntries:
        """The `outcome` marker of `t` on each of `topics`."""
        epoch = t.producer_epoch if t.producer_epoch >= 0 else None
        pid = t.producer_id if t.producer_id >= 0 else None
        markers = PendingEntries(outcome.value, t.txn.most_bits, t.txn.least_bits, pid, epoch)
        for topic in topics:
            markers.add(topic)
        return markers

    def _offset_rows(self, t: Transaction) -> list[dict[str, Any]]:
        if not t.offsets:
            return []
        now = self.clock()
        with self.lock:
            self._log_seq += 1
            seq = self._log_seq
        return [
            {**o, "txn_most_bits": t.txn.most_bits, "txn_least_bits": t.txn.least_bits, "log_seq": seq, "committed_at": now}
            for o in t.offsets
        ]

    def _row(self, t: Transaction, state: TxnStatus, actor: str, reason: str | None, with_offsets: bool = False):
        group = t.txn.most_bits
        return self._log_row(t.transactional_id, group, t.producer_id, max(t.producer_epoch, 0), t.txn, state,
                             t.topics, t.timeout_ms, t.started_at, actor, reason,
                             t.offsets if with_offsets else None)

    def _identity_row(self, identity: ProducerIdentity, actor: str, reason: str | None):
        return self._log_row(identity.transactional_id, identity.group, identity.producer_id, identity.epoch, None,
                             TxnStatus.EMPTY, [], identity.timeout_ms, None, actor, reason)

    def _log_row(self, tid, group, pid, epoch, txn, state, topics, timeout_ms, started_at, actor, reason, offsets=None):
        with self.lock:
            self._log_seq += 1
            seq = self._log_seq
        now = self.clock()
        return {
            "log_seq": seq, "txn_group": group, "transactional_id": tid, "producer_id": pid,
            "producer_epoch": epoch, "txn_most_bits": None if txn is None else txn.most_bits,
            "txn_least_bits": None if txn is None else txn.least_bits, "state": state.value,
            "topics": list(topics), "timeout_ms": timeout_ms, "txn_started_at": started_at,
            "recorded_at": now, "actor": actor, "reason": reason, "offsets": offsets,
        }
