"""Multi-part transaction-buffer snapshots (PIP-178) with a snapshot index, in pure Python.

This is the reference (the oracle) of `txn_engine.snapshots.jobs`, on plain lists: the same
segmentation (keys `topic-1 ... topic-(N-1)` and `topic-end`, which alone carries the max read
position), the same write order (the parts, then `topic-end` as the commit point, then tombstones
of the topic's other numbered keys), the same compaction rule (the latest row per key, and the
rows of the snapshot the latest `topic-end` names) and the same recovery (the latest `topic-end`
and the parts of its snapshot id, else a full replay; minus aborts of DELETED ledgers; then the
entries after the max read position). docs/snapshots.md explains the design.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Sequence

from txn_engine.core.log_types import BufferState, LogEntry, TxnId
from txn_engine.core.positions import EARLIEST, Position
from txn_engine.snapshots.format import END_SUFFIX, SnapshotConfig, Source
from txn_engine.reference.transaction_buffer import TopicTransactionBuffer

Abort = tuple[TxnId, Position]

def segment_key(topic: str, index: int, count: int) -> str:
    """`topic-i` for the parts, `topic-end` for the last segment (index == count)."""
    return f"{topic}-{END_SUFFIX}" if index == count else f"{topic}-{index}"


def end_key(topic: str) -> str:
    return f"{topic}-{END_SUFFIX}"


def key_suffix(topic: str, key: str) -> str | None:
    """`end` or the part number of a key of `topic`; None when the key is not one of its keys."""
    prefix = f"{topic}-"
    if not key.startswith(prefix):
        return None
    suffix = key[len(prefix):]
    return suffix if suffix == END_SUFFIX or re.fullmatch(r"[1-9][0-9]*", suffix) else None


def segment_count(aborts: int, capacity: int) -> int:
    """Segments a snapshot of `aborts` aborts needs: PIP-178 cuts full parts while more than
    `capacity` remain, and the rest (possibly empty) goes to `topic-end`."""
    return max(1, -(-aborts // capacity))


@dataclass(frozen=True)
class SnapshotSegment:
    """One row of `txn_snapshot_segments`."""

    snapshot_key: str
    topic: str
    max_read_position: Position
    aborts: tuple[Abort, ...]
    snapshot_id: int
    segment_index: int
    segment_count: int
    abort_count: int
    write_seq: int = -1  # assigned by the log when written
    tombstone: bool = False

    @property
    def is_end(self) -> bool:
        return self.snapshot_key == end_key(self.topic)


def split_snapshot(state: BufferState, snapshot_id: int, config: SnapshotConfig) -> list[SnapshotSegment]:
    """The segments of one snapshot of `state`, parts first and `topic-end` last."""
    capacity = config.segment_capacity(state.topic)
    aborts = tuple(state.aborts)
    count = segment_count(len(aborts), capacity)
    segments = []
    for index in range(1, count + 1):
        chunk = aborts[(index - 1) * capacity: index * capacity]
        last = index == count
        segments.append(SnapshotSegment(
            snapshot_key=segment_key(state.topic, index, count),
            topic=state.topic,
            max_read_position=state.max_read_position if last else EARLIEST,
            aborts=chunk,
            snapshot_id=snapshot_id,
            segment_index=index,
            segment_count=count,
            abort_count=len(aborts),
        ))
    return segments


class Crash(RuntimeError):
    """Raised by a test hook to stop a writer between two steps, as a broker restart would."""


# -- the snapshot log ---------------------------------------------------------------------------

@dataclass
class SnapshotLog:
    """The segments table of the reference: rows in write order, write_seq increasing."""

    rows: list[SnapshotSegment] = field(default_factory=list)
    last_write_seq: int = 0

    def append(self, segment: SnapshotSegment) -> SnapshotSegment:
        # After every row ever written, even those compaction dropped: a write_seq is never reused
        # (two rows of one key with one write_seq would make "the latest" a tie).
        self.last_write_seq = max(self.last_write_seq, *(r.write_seq for r in self.rows), 0) + 1
        written = replace(segment, write_seq=self.last_write_seq)
        self.rows.append(written)
        return written

    def latest_per_key(self) -> dict[str, SnapshotSegment]:
        """What a key-compacted reader sees: the latest write_seq per key (tombstones included)."""
        latest: dict[str, SnapshotSegment] = {}
        for row in self.rows:
            if row.snapshot_key not in latest or row.write_seq > latest[row.snapshot_key].write_seq:
                latest[row.snapshot_key] = row
        return latest

    def write_snapshot(self, state: BufferState, snapshot_id: int, config: SnapshotConfig,
                       after_write: Callable[[SnapshotSegment], None] | None = None) -> list[SnapshotSegment]:
        """Write parts, then topic-end, then tombstones for the topic's other numbered keys.

        `after_write` is called after each row is written (tests raise `Crash` there).
        """
        segments = split_snapshot(state, snapshot_id, config)
        written = []
        for segment in segments:
            written.append(self.append(segment))
            if after_write:
                after_write(written[-1])
        count = segments[-1].segment_count
        for key, row in sorted(self.latest_per_key().items()):
            suffix = key_suffix(state.topic, key) if row.topic == state.topic else None
            if suffix and suffix != END_SUFFIX and int(suffix) >= count and not row.tombstone:
                written.append(self.append(tombstone(row, snapshot_id)))
                if after_write:
                    after_write(written[-1])
        return written

    def compact(self, before_commit: Callable[[], None] | None = None) -> None:
        """Keep the latest row per key (not if it is a tombstone) and the live snapshots' rows."""
        kept = compacted_rows(self.rows)
        if before_commit:
            before_commit()  # a crash here leaves the log as it was: compaction is one commit
        self.rows = kept


def tombstone(row: SnapshotSegment, snapshot_id: int) -> SnapshotSegment:
    """The tombstone of a stale key, written by snapshot `snapshot_id`."""
    return SnapshotSegment(row.snapshot_key, row.topic, EARLIEST, (), snapshot_id, row.segment_index, 0, 0,
                           tombstone=True)


def compacted_rows(rows: Sequence[SnapshotSegment]) -> list[SnapshotSegment]:
    latest: dict[str, SnapshotSegment] = {}
    for row in rows:
        if row.snapshot_key not in latest or row.write_seq > latest[row.snapshot_key].write_seq:
            latest[row.snapshot_key] = row
    live = {(row.topic, row.snapshot_id) for row in latest.values()
            if row.is_end and not row.tombstone}
    kept = []
    for row in rows:
        newest = latest[row.snapshot_key] is row
        if (newest and not row.tombstone) or (not row.tombstone and (row.topic, row.snapshot_id) in live
                                              and _is_newest_of_its_snapshot(row, rows)):
            kept.append(row)
    return sorted(kept, key=lambda r: r.write_seq)


def _is_newest_of_its_snapshot(row: SnapshotSegment, rows: Sequence[SnapshotSegment]) -> bool:
    return all(r.write_seq <= row.write_seq for r in rows
               if r.snapshot_key == row.snapshot_key and r.snapshot_id == row.snapshot_id and not r.tombstone)


# -- recovery -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class LiveSnapshot:
    """The snapshot a topic recovers from: its `topic-end` and its aborts, or why there is none."""

    topic: str
    snapshot_id: int | None
    max_read_position: Position | None
    aborts: tuple[Abort, ...]
    fallback_reason: str | None  # set: recover by full replay

    @property
    def usable(self) -> bool:
        return self.fallback_reason is None


def live_snapshot(topic: str, rows: Iterable[SnapshotSegment]) -> LiveSnapshot:
    """Find the topic's snapshot by its index: the latest topic-end, then its own parts."""
    mine = [r for r in rows if r.topic == topic]
    bad = [r.snapshot_key for r in mine if key_suffix(topic, r.snapshot_key) is None]
    if bad:
        return _fallback(topic, f"segment key {bad[0]!r} is not a key of topic {topic!r} (wrong topic)")
    ends = [r for r in mine if r.is_end]
    if not ends:
        if mine:
            return _fallback(topic, f"no {end_key(topic)!r} segment (a snapshot was never completed)")
        return _fallback(topic, "no snapshot yet")
    end = max(ends, key=lambda r: r.write_seq)
    if end.tombstone:
        return _fallback(topic, f"{end_key(topic)!r} is a tombstone")
    parts: dict[int, SnapshotSegment] = {}
    for row in mine:
        if row.snapshot_id == end.snapshot_id and not row.is_end and not row.tombstone:
            if row.segment_index not in parts or row.write_seq > parts[row.segment_index].write_seq:
                parts[row.segment_index] = row
    missing = [i for i in range(1, end.segment_count) if i not in parts]
    if missing:
        return _fallback(topic, f"snapshot {end.snapshot_id} lacks segment {segment_key(topic, missing[0], end.segment_count)!r}")
    aborts = tuple(a for i in range(1, end.segment_count) for a in parts[i].aborts) + end.aborts
    if len(aborts) != end.abort_count:
        return _fallback(topic, f"snapshot {end.snapshot_id} holds {len(aborts)} aborts, its index says {end.abort_count}")
    return LiveSnapshot(topic, end.snapshot_id, end.max_read_position, aborts, None)


def _fallback(topic: str, reason: str) -> LiveSnapshot:
    return LiveSnapshot(topic, None, None, (), reason)


@dataclass(frozen=True)
class RecoveredState:
    """A row of `recovered_buffer_state`."""

    topic: str
    max_read_position: Position
    aborts: tuple[Abort, ...]
    snapshot_id: int | None
    source: Source
    fallback_reason: str | None = None


def recover(topic: str, rows: Iterable[SnapshotSegment], entries: Iterable[LogEntry],
            deleted_ledgers: Iterable[int] = ()) -> RecoveredState:
    """The buffer of `topic` from its snapshot plus the entries after its max read position.

    `entries` are what `ledger_entries` holds now for the topic (deleted ledgers' rows gone);
    `deleted_ledgers` are the ledgers recorded DELETED, whose aborts are trimmed.
    """
    ordered = sorted((e for e in entries if e.topic == topic), key=lambda e: e.position)
    snapshot = live_snapshot(topic, rows)
    if not snapshot.usable:
        buffer = TopicTransactionBuffer(topic)
        for entry in ordered:
            buffer.append(entry)
        return RecoveredState(topic, buffer.max_read_position, tuple(buffer.aborts.items()), None,
                              Source.FULL_REPLAY, snapshot.fallback_reason)
    deleted = set(deleted_ledgers)
    start = snapshot.max_read_position
    assert start is not None
    kept = [(txn, pos) for txn, pos in snapshot.aborts if pos.ledger_id not in deleted]
    before = [e for e in ordered if e.position <= start]
    buffer = TopicTransactionBuffer.restored(topic, kept, before[-1].position if before else None)
    for entry in ordered[len(before):]:
        buffer.append(entry)
    aborts = tuple(sorted(buffer.aborts.items(), key=lambda item: item[1]))
    return RecoveredState(topic, buffer.max_read_position, aborts, snapshot.snapshot_id, Source.SNAPSHOT)


def recover_pip178_as_written(topic: str, compacted: Iterable[SnapshotSegment]) -> tuple[Position, tuple[Abort, ...]]:
    """PIP-178's handleSnapshot over a key-compacted log: every segment's aborts, the max read
    position of topic-end. Kept to show the leak the snapshot index fixes (tests, docs)."""
    aborts: dict[TxnId, Position] = {}
    max_read = EARLIEST
    for row in sorted(compacted, key=lambda r: r.write_seq):
        if row.topic != topic or row.tombstone:
            continue
        if row.max_read_position > max_read:
            max_read = row.max_read_position
        aborts.update(row.aborts)
    return max_read, tuple(sorted(aborts.items(), key=lambda item: item[1]))
