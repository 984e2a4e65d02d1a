"""A read-committed consumer of one topic, in ledger order, decided by the transaction buffer's kernel.

It reads what the buffer's rules let a reader of the topic's whole log see, across the ledgers
retention deleted, as a Pulsar consumer does, without Spark (delta-rs / pyarrow): the stored
ledgers are the scope of `kernel.scope_tables` (narrow columns; the full rows it decides visible
are picked by mask), the facts the buffer's state keeps of the deleted ledgers
(`buffer_ledger_txns`, `buffer_sequence_ranges`, their last entries in `deleted_ledgers`) are the
state it reads, and the deleted ledgers' entries come from the offload tier. What it cannot know
(a deleted ledger's facts the state does not hold) it refuses (`ConsumerStateError`) rather than
return wrong data; a ledger deleted without being offloaded is not read, its entries gone. A kept
`Consumer` decides only the ledgers that grew (docs/engine.md, "The consumer").
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Mapping

import pyarrow as pa
import pyarrow.compute as pc

from txn_engine.buffer import kernel
from txn_engine.buffer.refresh import state_ledger_counts
from txn_engine.storage.arrow_frames import arrow_schema
from txn_engine.storage.delta_io import DeltaTables, scan
from txn_engine.core.errors import TxnlakeError
from txn_engine.log.ledgers import ledger_ranges
from txn_engine.core.log_types import LogEntry
from txn_engine.tier.offload import offloaded_ledgers
from txn_engine.core.positions import EARLIEST, Position, checked_position
from txn_engine.core.schema import (
    BUFFER_LEDGER_TXNS,
    BUFFER_LEDGER_TXNS_SCHEMA,
    BUFFER_PENDING_ENTRIES,
    BUFFER_SEQUENCE_RANGES,
    BUFFER_SEQUENCE_RANGES_SCHEMA,
    COMMITTED_ENTRIES,
    COMMITTED_ENTRIES_SCHEMA,
    DELETED_LEDGERS,
    DELETED_LEDGERS_SCHEMA,
    LEDGER_ENTRIES,
    LEDGER_ENTRIES_SCHEMA,
    OFFLOADED_ENTRIES,
    OFFLOADED_ENTRIES_SCHEMA,
    STABLE_POSITIONS,
)

# The state tables the kernel reads of the ledgers before a feed (`refresh.STATE_TABLES` less the
# duplicates, which only say which stored rows to leave out when rows are read back).
_STATE = {table: kernel.TABLE_SCHEMAS[table] for table in (BUFFER_LEDGER_TXNS, BUFFER_SEQUENCE_RANGES, BUFFER_PENDING_ENTRIES)}


class ConsumerStateError(TxnlakeError):
    """The consumer cannot know what a read-committed reader of the topic sees (module doc)."""


def _entries(rows: pa.Table) -> list[LogEntry]:
    # Column by column, in LogEntry's field order: no dict per row (docs/benchmarks.md, the consumer).
    fields = list(LogEntry.__dataclass_fields__)
    return [LogEntry(*values) for values in zip(*(rows[f].to_pylist() for f in fields))]


def _positions(rows: pa.Table) -> pa.Table:
    return rows.sort_by([("ledger_id", "ascending"), ("entry_id", "ascending")])


class TopicDecisions:
    """The kernel's decisions on one topic's stored ledgers, kept between reads. Pure (Arrow in, entries out).

    `feed` gives it whole ledgers in ledger order: new ones, or the last one fed again with what
    it gained. Each feed is one kernel run over just those ledgers, with the facts of the ledgers
    before (the deleted ones it resumed from, then its own earlier runs) as the state in memory,
    as `refresh_buffer` runs on the stored state. The rows a ledger-order reader sees are the
    visible rows at or before the stable position, and those are final: the stable position only
    moves forward as entries are appended, and every transaction with data at or before it is
    decided. So they become entries once, and only the rows past it stay rows (visible, or kept
    for a later commit).
    """

    def __init__(self, topic: str, deleted_lasts: Mapping[int, int] | None = None,
                 ledger_txns: pa.Table | None = None, ranges: pa.Table | None = None):
        """`deleted_lasts`: the last entry id of each (non-empty) ledger retention deleted before the
        stored ones; `ledger_txns`, `ranges`: their `buffer_ledger_txns` and `buffer_sequence_ranges` rows."""
        self.topic = topic
        given = {BUFFER_LEDGER_TXNS: ledger_txns, BUFFER_SEQUENCE_RANGES: ranges}
        self._state = {table: arrow_schema(schema).empty_table() if given.get(table) is None
                       else kernel.conform(given[table], schema) for table, schema in _STATE.items()}
        self._lasts: dict[int, int] = dict(deleted_lasts or {})  # ledger -> last entry, deleted ones too
        self._retained = [(topic, ledger) for ledger in self._lasts]
        self.fed: dict[int, int] = {}  # entries fed, per stored ledger
        self.last_position: Position | None = None  # of the last entry fed
        self.max_read_position: Position = EARLIEST
        self._read: list[LogEntry] = []  # visible at or before the stable position, in ledger order
        self._visible_after = arrow_schema(COMMITTED_ENTRIES_SCHEMA).empty_table()  # visible past it

    def only_appends(self, rows: pa.Table) -> bool:
        """Whether `rows` (every row of some ledgers) add only entries after the last one fed."""
        if self.last_position is None or not rows.num_rows:
            return True
        last = self.last_position
        if pc.min(rows["ledger_id"]).as_py() < last.ledger_id:
            return False
        not_after = pc.sum(kernel.position_le(rows["ledger_id"], rows["entry_id"], last.ledger_id, last.entry_id)).as_py()
        return (not_after or 0) == (self.fed[last.ledger_id] if pc.any(pc.equal(rows["ledger_id"], last.ledger_id)).as_py()
                                    else 0)

    def feed(self, rows: pa.Table) -> None:
        """Decide `rows`: every row (ledger_entries columns) of the ledgers they name (`only_appends`)."""
        if not rows.num_rows:
            return
        if not self.only_appends(rows):
            raise ValueError(f"rows fed to the decisions of {self.topic!r} are not whole ledgers after {self.last_position}")
        rows = _positions(kernel.conform(rows, LEDGER_ENTRIES_SCHEMA))
        scope = set(pc.unique(rows["ledger_id"]).to_pylist())
        lasts = rows.group_by("ledger_id", use_threads=False).aggregate([("entry_id", "max"), ("entry_id", "count")])
        self._lasts.update(zip(lasts["ledger_id"].to_pylist(), lasts["entry_id_max"].to_pylist()))
        kept = ~pc.field("ledger_id").isin(pa.array(sorted(scope), pa.int64()))
        old_stable = {} if self.last_position is None else {self.topic: self.max_read_position.ledger_id}
        decided = kernel.scope_tables(rows, scope, lambda table, wanted: self._state[table].filter(kept & wanted), old_stable,
                                      [(self.topic, ledger, last) for ledger, last in self._lasts.items()],
                                      retained=self._retained)
        tables = kernel.wide_tables(decided, rows)
        stable = tables[STABLE_POSITIONS].to_pylist()[0]
        before, self.max_read_position = self.max_read_position, Position(stable["max_read_ledger_id"],
                                                                           stable["max_read_entry_id"])
        for table in _STATE:
            self._state[table] = pa.concat_tables([self._state[table].filter(kept), tables[table]])
        # A row at or before the stable position is final: a kept one is read already or never.
        pending = self._state[BUFFER_PENDING_ENTRIES]
        self._state[BUFFER_PENDING_ENTRIES] = pending.filter(self._past(pending, self.max_read_position))
        # Visible rows decided before outside the scope, and the scope's not read already.
        earlier = self._visible_after.filter(pc.invert(pc.is_in(self._visible_after["visible_ledger_id"],
                                                                pa.array(sorted(scope), pa.int64()))))
        committed = tables[COMMITTED_ENTRIES]
        visible = _positions(pa.concat_tables([earlier, committed.filter(self._past(committed, before))]))
        past = self._past(visible, self.max_read_position)
        self._read.extend(_entries(visible.filter(pc.invert(past))))
        self._visible_after = visible.filter(past)
        self.fed.update(zip(lasts["ledger_id"].to_pylist(), lasts["entry_id_count"].to_pylist()))
        last = lasts.filter(pc.equal(lasts["ledger_id"], max(scope)))
        self.last_position = Position(max(scope), last["entry_id_max"][0].as_py())

    @staticmethod
    def _past(rows: pa.Table, position: Position) -> pa.ChunkedArray:
        return pc.invert(kernel.position_le(rows["ledger_id"], rows["entry_id"], position.ledger_id, position.entry_id))

    def read_committed(self, from_position: Position, max_entries: int | None = None) -> list[LogEntry]:
        """What a ledger-order read-committed reader gets from `from_position` (inclusive) of the stored ledgers."""
        start = bisect_left(self._read, from_position, key=lambda e: e.position)
        return self._read[start:] if max_entries is None else self._read[start:start + max_entries]


def resumed_decisions(topic: str, gone: Mapping[int, Mapping], first_stored: int, ledger_txns: pa.Table,
                      ranges: pa.Table) -> TopicDecisions:
    """The decisions of `topic` ready to be fed its stored ledgers (the first is `first_stored`),
    on top of the ledgers retention deleted (`gone`: ledger id -> deleted_ledgers row, with
    `entry_count` and `last_entry_id`) as the buffer's state keeps them: their `buffer_ledger_txns`
    and `buffer_sequence_ranges` rows. Refuses what it cannot know (module doc). Pure."""
    if max(gone) > first_stored:
        raise ConsumerStateError(
            f"topic {topic!r}: ledger {max(gone)} is recorded deleted (deleted_ledgers) but ledger {first_stored} before "
            "it is still stored; retention deletes the oldest ledgers first, so the log was changed by something else. "
            "The consumer cannot read the topic in ledger order; restore the deleted ledger's entries or its deleted_ledgers row."
        )
    held = state_ledger_counts(ledger_txns)
    missing = [ledger for ledger in sorted(gone)
               if held.get((topic, ledger)) != (gone[ledger]["entry_count"], gone[ledger]["last_entry_id"])]
    if missing:
        raise ConsumerStateError(
            f"topic {topic!r}: retention deleted ledger(s) {', '.join(map(str, missing))}, and the transaction buffer's state "
            "(buffer_ledger_txns) does not hold their facts as they were (the buffer had not run over them when they were "
            "deleted, or its state was rebuilt since). Only their deleted entries told which later entries are retried sends "
            "or data after their transaction's marker, so the consumer refuses to guess. Nothing was read. To avoid this, "
            "run the transaction buffer (`txnlake run`) before `txnlake retention`."
        )
    return TopicDecisions(topic, {ledger: row["last_entry_id"] for ledger, row in gone.items()}, ledger_txns, ranges)


@dataclass(frozen=True)
class TopicLog:
    """A topic as the consumer reads it: the decisions on its stored ledgers (resumed after the
    deleted ones), and the tier's entries of the deleted, offloaded ledgers (ledger order)."""

    decisions: TopicDecisions
    cold: list[LogEntry]

    def read_committed(self, from_position: Position, max_entries: int | None = None) -> list[LogEntry]:
        # Deleted ledgers precede every stored one (retention deletes a prefix): cold, then hot.
        cold = self.cold[bisect_left(self.cold, from_position, key=lambda e: e.position):]
        entries = cold + self.decisions.read_committed(from_position, max_entries)
        return entries if max_entries is None else entries[:max_entries]


def _topic_rows(tables: DeltaTables, table: str, schema, topic: str, ledger_ids: list[int]) -> pa.Table:
    """`table`'s rows of `topic` in `ledger_ids`, by delta-rs, in `schema` (empty when the table
    does not exist); the topic is matched on the rows read (`delta_io.scan`: files delta-rs
    rewrote store strings as string_view)."""
    if not tables.exists(table):
        return arrow_schema(schema).empty_table()
    pushed = kernel.ledger_filter(pa.array(ledger_ids, pa.int64()))
    return kernel.conform(scan(tables.dataset(table), pushed, on_rows=pc.field("topic") == topic), schema)


def topic_ledger_counts(tables: DeltaTables, topic: str) -> dict[int, int]:
    """Entries per ledger of `topic` in `ledger_entries` (empty when it does not exist): its narrow
    columns folded by `ledger_ranges`, no payload read."""
    if not tables.exists(LEDGER_ENTRIES):
        return {}
    ranges = ledger_ranges(tables.warehouse)
    ranges = ranges.filter(pc.equal(ranges["topic"], topic))
    return dict(zip(ranges["ledger_id"].to_pylist(), ranges["entry_count"].to_pylist()))


def _stored_entries(tables: DeltaTables, topic: str, ledger_ids: list[int]) -> pa.Table:
    """`topic`'s `ledger_entries` rows of `ledger_ids`, in ledger order; the files of other ledgers
    are skipped by their statistics (ingest writes position-ordered files)."""
    return _positions(_topic_rows(tables, LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA, topic, ledger_ids))


def topic_log(tables: DeltaTables, topic: str, counts: dict[int, int] | None = None) -> TopicLog:
    """`topic` as a read-committed reader sees it: see the module doc. Reads the stored entries first,
    so a ledger retention deletes meanwhile is read from them (its deleted_ledgers row, manifest row
    and state were written before its entries went). `counts`: `topic_ledger_counts`, when read already."""
    stored_ids = sorted(topic_ledger_counts(tables, topic) if counts is None else counts)
    hot = _stored_entries(tables, topic, stored_ids)
    stored = set(pc.unique(hot["ledger_id"]).to_pylist())
    deleted = tables.read(DELETED_LEDGERS, DELETED_LEDGERS_SCHEMA, ["topic", "ledger_id", "entry_count", "last_entry_id"])
    gone = {r["ledger_id"]: r for r in deleted.filter(pc.equal(deleted["topic"], topic)).to_pylist()
            if r["ledger_id"] not in stored and r["entry_count"] > 0}
    decisions = TopicDecisions(topic)
    if gone and hot.num_rows:
        ids = sorted(gone)
        decisions = resumed_decisions(topic, gone, pc.min(hot["ledger_id"]).as_py(),
                                      _topic_rows(tables, BUFFER_LEDGER_TXNS, BUFFER_LEDGER_TXNS_SCHEMA, topic, ids),
                                      _topic_rows(tables, BUFFER_SEQUENCE_RANGES, BUFFER_SEQUENCE_RANGES_SCHEMA, topic, ids))
    decisions.feed(hot)
    tiered = sorted(ledger for _, ledger in offloaded_ledgers(tables.warehouse, topic) if ledger in gone)
    cold = _topic_rows(tables, OFFLOADED_ENTRIES, OFFLOADED_ENTRIES_SCHEMA, topic, tiered)
    return TopicLog(decisions, _entries(_positions(cold)))


def _position(value: object, what: str) -> Position:
    """A position to read from: EARLIEST, or a position `checked_position` accepts."""
    return EARLIEST if value == EARLIEST else checked_position(value, what)


class Consumer:
    """Reads the committed entries of a topic from a position: each once, never past the stable
    position. Refuses with `ConsumerStateError` what it cannot know after retention (module doc).

    Like a Pulsar consumer reading on from its cursor, it keeps the topic's decisions between calls
    and decides only the ledgers that grew since (`ledger_entries`' new version, read by those
    ledgers): new ledgers, and the last one fed when entries were appended to it (the kernel
    decides whole ledgers). A call costs in proportion to those ledgers, plus a fold of the log's
    narrow columns to see what grew. It decides the whole stored log again when the log changed in
    any other way: rows at or before the last entry fed (files ingested out of order), a ledger fed
    that is no longer stored, or a ledger recorded deleted since (retention)."""

    def __init__(self, tables: DeltaTables, topic: str, start: Position | tuple[int, int] | str = EARLIEST):
        if not isinstance(topic, str) or not topic.strip():
            raise ValueError(f"topic must be a non-empty string, got {topic!r}")
        self.tables = tables
        self.topic = topic
        self.position = _position(start, "start")  # the next read starts here (inclusive)
        self._log: TopicLog | None = None
        self._versions: tuple[int | None, int | None] = (None, None)  # ledger_entries', deleted_ledgers'
        self.rebuilds = 0  # times the whole stored log was decided

    def read(self, from_position: Position | tuple[int, int] | str | None = None,
             max_entries: int | None = None) -> list[LogEntry]:
        """Committed DATA entries at or after `from_position`, in ledger order (the position is not moved)."""
        start = self.position if from_position is None else _position(from_position, "from_position")
        if max_entries is not None and max_entries < 0:
            raise ValueError(f"max_entries must not be negative, got {max_entries}; pass a count, or None for all")
        return self._current_log().read_committed(start, max_entries)

    def poll(self, max_entries: int | None = None) -> list[LogEntry]:
        """The next committed entries after those already returned; moves the consumer's position."""
        entries = self.read(self.position, max_entries)
        if entries:
            last = entries[-1].position
            self.position = Position(last.ledger_id, last.entry_id + 1)
        return entries

    def _current_log(self) -> TopicLog:
        versions = (self.tables.version(LEDGER_ENTRIES), self.tables.version(DELETED_LEDGERS))  # before the reads
        if self._log is not None and versions == self._versions:
            return self._log
        counts = topic_ledger_counts(self.tables, self.topic)
        if not self._feed_appended(counts, versions):
            # Rows appended between the count and the read are decided too, and counted as fed.
            self._log = topic_log(self.tables, self.topic, counts)
            self.rebuilds += 1
        self._versions = versions
        return self._log

    def _feed_appended(self, counts: dict[int, int], versions: tuple[int | None, int | None]) -> bool:
        """Decide the ledgers that grew, when entries appended after the last one fed are all that
        changed (see the class doc); False when the whole stored log must be decided again."""
        decisions = None if self._log is None else self._log.decisions
        if decisions is None or decisions.last_position is None or versions[1] != self._versions[1]:
            return False  # first call, nothing stored yet (or all of it deleted), or a retention since
        if any(counts.get(ledger) is None or counts[ledger] < fed for ledger, fed in decisions.fed.items()):
            return False  # a ledger fed is gone or smaller
        grown = sorted(ledger for ledger, n in counts.items() if n != decisions.fed.get(ledger))
        if any(ledger < decisions.last_position.ledger_id for ledger in grown):
            return False  # rows arrived in a ledger before the last one fed
        rows = _stored_entries(self.tables, self.topic, grown)
        if not decisions.only_appends(rows):
            return False  # rows at or before the last entry fed, in its ledger
        decisions.feed(rows)
        return True
