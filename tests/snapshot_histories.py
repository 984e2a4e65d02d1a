"""Random topic histories with snapshots, crashes, retention deletions and compactions.

`simulate` plays a list of drawn operations on one topic against the reference snapshot log and
returns what the warehouse would hold at the end: the remaining entries, the segment rows, the
deleted ledgers. Used by the reference tests and, batched many topics at a time, by the Spark ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st

from txn_engine.core.log_types import LogEntry, TxnId
from txn_engine.core.positions import Position
from txn_engine.reference.snapshots import Crash, SnapshotLog, SnapshotSegment
from txn_engine.snapshots.format import SnapshotConfig
from txn_engine.reference.transaction_buffer import TopicTransactionBuffer

OPS = ("data", "data", "txn_data", "txn_data", "txn_data", "commit", "abort", "abort", "roll",
       "snapshot", "snapshot", "delete", "delete", "compact")


@dataclass
class History:
    topic: str
    entries: list[LogEntry] = field(default_factory=list)  # what ledger_entries holds now
    log: SnapshotLog = field(default_factory=SnapshotLog)
    deleted: set[int] = field(default_factory=set)
    crashes: int = 0


def replay_topic(topic: str, entries: list[LogEntry]) -> TopicTransactionBuffer:
    buffer = TopicTransactionBuffer(topic)
    for entry in sorted(entries, key=lambda e: e.position):
        buffer.append(entry)
    return buffer


def simulate(topic: str, ops: list[tuple[str, int]], first_ledger: int, txn_base: int) -> History:
    """Play `ops` ((name, random int) pairs) on `topic`, with ledger ids from `first_ledger`."""
    history = History(topic)
    ledger, next_entry, next_txn = first_ledger, 0, 0
    ongoing: list[TxnId] = []
    snapshots = 0

    def add(kind: str, txn: TxnId | None = None) -> None:
        nonlocal next_entry
        most, least = (None, None) if txn is None else txn
        history.entries.append(LogEntry(topic, ledger, next_entry, kind, most, least))
        next_entry += 1

    for op, n in ops:
        if op == "data":
            add("DATA")
        elif op == "txn_data":
            if ongoing and n % 3:
                add("DATA", ongoing[n % len(ongoing)])
            else:
                txn = TxnId(txn_base, next_txn)
                next_txn += 1
                ongoing.append(txn)
                add("DATA", txn)
        elif op in ("commit", "abort"):
            if ongoing and n % 5:
                txn = ongoing.pop(n % len(ongoing))
            else:  # a marker with no data on the topic (its data went to other topics)
                txn = TxnId(txn_base, next_txn)
                next_txn += 1
            add(op.upper(), txn)
        elif op == "roll":
            if next_entry:
                ledger, next_entry = ledger + 1 + n % 2, 0
        elif op == "snapshot":
            state = replay_topic(topic, history.entries).snapshot()
            config = SnapshotConfig(max_aborts_per_segment=1 + n % 3)
            crash_after = (n // 3) % 5  # 0: no crash, else crash after that many rows
            snapshots += 1
            try:
                history.log.write_snapshot(state, snapshot_id=txn_base * 1000 + snapshots, config=config,
                                           after_write=_crash_after(crash_after))
            except Crash:
                history.crashes += 1
        elif op == "delete":
            # Retention: the oldest remaining ledger, if it is not the one being written and lies
            # wholly at or before the stable position (so no ongoing transaction loses data).
            ledgers = sorted({e.ledger_id for e in history.entries})
            if len(ledgers) > 1 and ledgers[0] != ledger:
                stable = replay_topic(topic, history.entries).max_read_position
                oldest = ledgers[0]
                if max(e.position for e in history.entries if e.ledger_id == oldest) <= stable:
                    history.entries = [e for e in history.entries if e.ledger_id != oldest]
                    history.deleted.add(oldest)
        elif op == "compact":
            try:
                history.log.compact(before_commit=_raise if n % 4 == 0 else None)
            except Crash:
                history.crashes += 1
    return history


def _crash_after(rows: int):
    if not rows:
        return None
    written = 0

    def hook(_segment: SnapshotSegment) -> None:
        nonlocal written
        written += 1
        if written == rows:
            raise Crash(f"crash after {rows} segment rows")
    return hook


def _raise() -> None:
    raise Crash("crash during compaction")


op_lists = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 1000)), min_size=10, max_size=80)


def full_replay(history: History) -> tuple[Position, tuple]:
    buffer = replay_topic(history.topic, history.entries)
    return buffer.max_read_position, tuple(buffer.aborts.items())
