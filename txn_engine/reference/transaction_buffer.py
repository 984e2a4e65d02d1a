"""A pure-Python reference of one topic's transaction buffer (Pulsar's TopicTransactionBuffer).

This is the oracle the Spark jobs are tested against: it is fed the entries of one topic in
ledger order, one at a time, exactly as a broker would see them, and it answers the questions of
the brief: the stable position (max read position), the abort set, the markers, the ongoing
transactions and the read-committed view in ledger order and in commit order.

It is deliberately simple and slow: plain dicts and lists, no Spark, no I/O.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, NamedTuple

from txn_engine.core.log_types import BufferState, EntryType, LogEntry, TxnId, TxnMarker, TxnState, Violation
from txn_engine.core.positions import EARLIEST, Position, position_before


class CommittedEntry(NamedTuple):
    """A row of `committed_entries`: a DATA entry a read-committed reader may see."""

    entry: LogEntry
    visible: Position  # the commit marker's position, or the entry's own if non-transactional
    local_seq: int  # order inside its transaction on this topic, 0 for non-transactional entries
    in_stable_prefix: bool  # entry.position <= the max read position when decided


def ledger_order(committed: Iterable[CommittedEntry]) -> list[CommittedEntry]:
    """What a Pulsar/Kafka read-committed reader sees: the stable prefix, by own position."""
    return sorted((c for c in committed if c.in_stable_prefix), key=lambda c: c.entry.position)


def commit_order(committed: Iterable[CommittedEntry]) -> list[CommittedEntry]:
    """DistributedLog's commit order: everything decided, a transaction's entries together at its marker."""
    return sorted(committed, key=lambda c: (c.visible, c.local_seq))


class TopicTransactionBuffer:
    """The transaction buffer of one topic, fed its entries strictly in ledger order."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.last_position: Position | None = None
        self.violations: Counter[str] = Counter()
        self._ledger_last: dict[int, Position] = {}  # last entry seen of each (non-empty) ledger
        self._seen_sequences: set[tuple[int, int | None, int]] = set()  # (producer_id, producer_epoch, sequence_id) of DATA
        self._ongoing: dict[TxnId, Position] = {}  # txn -> first position, in append order
        self._pending: dict[TxnId, list[LogEntry]] = {}  # kept entries of ongoing txns
        self._markers: dict[TxnId, TxnMarker] = {}  # first marker of each txn, in append order
        self._aborts: dict[TxnId, Position] = {}  # in abort-marker order, which is append order
        self._visible: list[tuple[LogEntry, Position, int]] = []  # (entry, visible, local_seq)

    @classmethod
    def restored(cls, topic: str, aborts: Iterable[tuple[TxnId, Position]],
                 last_position: Position | None) -> "TopicTransactionBuffer":
        """A buffer resumed from a snapshot, ready to be fed the entries after `last_position`.

        `aborts` is the snapshot's abort set; those transactions count as closed, so a later
        marker of theirs is a duplicate and later data is late, exactly as in a full replay.
        `last_position` is the last remaining entry at or before the replay start: the log's end
        so far and the "previous non-empty ledger" of the position-before rule.
        """
        buffer = cls(topic)
        for txn, position in aborts:
            buffer._markers[txn] = TxnMarker(txn, EntryType.ABORT, position)
            buffer._aborts[txn] = position
        if last_position is not None:
            buffer.last_position = last_position
            buffer._ledger_last[last_position.ledger_id] = last_position
        return buffer

    # -- feeding ---------------------------------------------------------------------------

    def append(self, entry: LogEntry) -> None:
        """Apply one entry, the next of this topic in ledger order."""
        if entry.topic != self.topic:
            raise ValueError(f"entry of topic {entry.topic!r} fed to the buffer of topic {self.topic!r}")
        if self.last_position is not None and entry.position <= self.last_position:
            raise ValueError(
                f"entry {entry.position} of {self.topic!r} is not after the last one ({self.last_position}); "
                "feed each topic's entries sorted by (ledger_id, entry_id), each position once"
            )
        if entry.is_marker and entry.txn_id is None:
            raise ValueError(f"{entry.entry_type} marker at {entry.position} of {self.topic!r} has no transaction id")
        # Every entry moves the last position, dropped or not: it is the log's end, not the readable end.
        self.last_position = entry.position
        self._ledger_last[entry.ledger_id] = entry.position
        if entry.is_marker:
            self._apply_marker(entry)
        else:
            self._apply_data(entry)

    def _apply_data(self, entry: LogEntry) -> None:
        # De-duplication comes first: a retried send is dropped whatever its transaction. The epoch is
        # part of the key: a producer restarts its sequence at 0 when its epoch is bumped.
        if entry.producer_id is not None and entry.sequence_id is not None:
            sequence = (entry.producer_id, entry.producer_epoch, entry.sequence_id)
            if sequence in self._seen_sequences:
                self.violations[Violation.DUPLICATE] += 1
                return
            self._seen_sequences.add(sequence)
        txn = entry.txn_id
        if txn is None:
            self._visible.append((entry, entry.position, 0))
            return
        if txn in self._markers:
            # The transaction is closed here; late data must not reopen it.
            self.violations[Violation.DATA_AFTER_MARKER] += 1
            return
        if txn not in self._ongoing:
            self._ongoing[txn] = entry.position
            self._pending[txn] = []
        self._pending[txn].append(entry)

    def _apply_marker(self, entry: LogEntry) -> None:
        txn = entry.txn_id
        assert txn is not None  # checked in append
        if txn in self._markers:
            self.violations[Violation.DUPLICATE_MARKER] += 1  # the first marker wins
            return
        self._markers[txn] = TxnMarker(txn, entry.entry_type, entry.position)
        if txn not in self._ongoing:
            self.violations[Violation.MARKER_WITHOUT_DATA] += 1
        pending = self._pending.pop(txn, [])
        self._ongoing.pop(txn, None)
        if entry.entry_type == EntryType.COMMIT:
            self._visible.extend((e, entry.position, seq) for seq, e in enumerate(pending))
        else:
            self._aborts[txn] = entry.position

    def trim_ledgers(self, ledger_ids: Iterable[int]) -> dict[TxnId, Position]:
        """Forget the aborts whose marker lies in a deleted ledger; return the removed ones."""
        deleted = set(ledger_ids)
        removed = {txn: pos for txn, pos in self._aborts.items() if pos.ledger_id in deleted}
        for txn in removed:
            del self._aborts[txn]
        return removed

    # -- state -----------------------------------------------------------------------------

    @property
    def max_read_position(self) -> Position:
        """The stable position: nothing after it may be read by a ledger-order reader yet."""
        if self.last_position is None:
            return EARLIEST
        if not self._ongoing:
            return self.last_position
        first = min(self._ongoing.values())
        return position_before(first, self._previous_ledger_last(first.ledger_id))

    def _previous_ledger_last(self, ledger_id: int) -> Position | None:
        earlier = [lid for lid in self._ledger_last if lid < ledger_id]
        return self._ledger_last[max(earlier)] if earlier else None

    @property
    def ongoing(self) -> dict[TxnId, Position]:
        """Ongoing transactions and their first position on this topic (a copy)."""
        return dict(self._ongoing)

    @property
    def ongoing_txn_count(self) -> int:
        return len(self._ongoing)

    @property
    def aborts(self) -> dict[TxnId, Position]:
        """The abort set: txn -> abort marker position, oldest first (a copy)."""
        return dict(self._aborts)

    @property
    def markers(self) -> dict[TxnId, TxnMarker]:
        """The first marker of each transaction on this topic, in append order (a copy)."""
        return dict(self._markers)

    def txn_state(self, txn: TxnId) -> TxnState | None:
        """Where `txn` stands on this topic; None when the topic has never heard of it."""
        if txn in self._ongoing:
            return TxnState.ONGOING
        marker = self._markers.get(txn)
        if marker is None:
            return None
        return TxnState.COMMITTED if marker.outcome == EntryType.COMMIT else TxnState.ABORTED

    def snapshot(self) -> BufferState:
        return BufferState(
            topic=self.topic,
            max_read_position=self.max_read_position,
            aborts=tuple(self._aborts.items()),
            ongoing=tuple(sorted(self._ongoing.items(), key=lambda item: item[1])),
        )

    # -- reading ---------------------------------------------------------------------------

    def committed_entries(self) -> list[CommittedEntry]:
        """The read-committed view decided now, in the order entries became visible."""
        stable = self.max_read_position
        return [CommittedEntry(e, visible, seq, e.position <= stable) for e, visible, seq in self._visible]

    def ledger_order(self) -> list[CommittedEntry]:
        return ledger_order(self.committed_entries())

    def commit_order(self) -> list[CommittedEntry]:
        return commit_order(self.committed_entries())

    def read_committed(self, from_position: Position, max_entries: int | None = None) -> list[LogEntry]:
        """What a ledger-order read-committed consumer gets reading from `from_position` (inclusive)."""
        if max_entries is not None and max_entries < 0:
            raise ValueError(f"max_entries must not be negative, got {max_entries}")
        entries = [c.entry for c in self.ledger_order() if c.entry.position >= from_position]
        return entries if max_entries is None else entries[:max_entries]


def replay(entries: Iterable[LogEntry]) -> dict[str, TopicTransactionBuffer]:
    """Feed every topic's entries, sorted into ledger order, to a buffer per topic."""
    buffers: dict[str, TopicTransactionBuffer] = {}
    for entry in sorted(entries, key=lambda e: (e.topic, e.ledger_id, e.entry_id)):
        if entry.topic not in buffers:
            buffers[entry.topic] = TopicTransactionBuffer(entry.topic)
        buffers[entry.topic].append(entry)
    return buffers


def stable_position_trace(entries: Iterable[LogEntry]) -> list[Position]:
    """The max read position after each append of one topic's entries, fed in the given order."""
    buffer: TopicTransactionBuffer | None = None
    trace: list[Position] = []
    for entry in entries:
        if buffer is None:
            buffer = TopicTransactionBuffer(entry.topic)
        buffer.append(entry)
        trace.append(buffer.max_read_position)
    return trace
