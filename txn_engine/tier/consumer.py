"""A read-committed consumer of one topic, in ledger order, through the transaction buffer's rules.

It reads what the reference `TopicTransactionBuffer` fed the topic's whole log would let a
read-committed reader see, across the ledgers retention deleted, as a Pulsar consumer does: the
topic's transaction buffer resumes from what it recorded and replays the ledgers still stored,
and the ledgers gone from them are read from tiered storage. Without Spark (delta-rs / pyarrow):

- the ledgers still in `ledger_entries` are fed to the reference buffer (the one definition of
  what is committed, aborted, undecided or a duplicate) instead of restating those rules;
- that buffer first resumes (`TopicTransactionBuffer.restored`) from the facts of the ledgers
  retention deleted, which the buffer's state keeps (`buffer_ledger_txns`: each transaction's
  first marker and first kept entry, folded by `kernel.txns_from_ledger_txns`;
  `buffer_sequence_ranges`: the sequence ids seen) and their last entries (`deleted_ledgers`). So a
  retried send whose first copy was deleted stays a duplicate, data after a marker in a deleted
  ledger stays late, and a transaction still open there holds the stable position back;
- a deleted ledger's entries come from the offload tier (`offloaded_entries` of the ledgers with
  a manifest row, `offloaded_ledgers`): everything there was decided when it was offloaded.

What it cannot know (a deleted ledger's facts the buffer's state does not hold) it refuses
(`ConsumerStateError`) rather than return wrong data; a ledger deleted without being offloaded is
not read, its entries gone (docs/engine.md, "The consumer").
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from txn_engine.buffer import kernel
from txn_engine.buffer.refresh import state_ledger_counts
from txn_engine.storage.arrow_frames import arrow_schema
from txn_engine.storage.delta_io import DeltaTables, scan
from txn_engine.core.errors import TxnlakeError
from txn_engine.log.ledgers import ledger_ranges
from txn_engine.core.log_types import LogEntry, TxnId, TxnMarker
from txn_engine.tier.offload import offloaded_ledgers
from txn_engine.core.positions import EARLIEST, Position, checked_position
from txn_engine.core.schema import (
    BUFFER_LEDGER_TXNS,
    BUFFER_LEDGER_TXNS_SCHEMA,
    BUFFER_SEQUENCE_RANGES,
    BUFFER_SEQUENCE_RANGES_SCHEMA,
    DELETED_LEDGERS,
    DELETED_LEDGERS_SCHEMA,
    LEDGER_ENTRIES,
    LEDGER_ENTRIES_SCHEMA,
    OFFLOADED_ENTRIES,
    OFFLOADED_ENTRIES_SCHEMA,
)
from txn_engine.reference.transaction_buffer import TopicTransactionBuffer


class ConsumerStateError(TxnlakeError):
    """The consumer cannot know what a read-committed reader of the topic sees (module doc)."""


@dataclass(frozen=True)
class TopicLog:
    """A topic as the consumer reads it: the buffer that decided its stored ledgers (resumed after
    the deleted ones), and the tier's entries of the deleted, offloaded ledgers (ledger order)."""

    buffer: TopicTransactionBuffer
    cold: list[LogEntry]

    def read_committed(self, from_position: Position, max_entries: int | None = None) -> list[LogEntry]:
        # Deleted ledgers precede every stored one (retention deletes a prefix): cold, then hot.
        entries = [e for e in self.cold if e.position >= from_position] + self.buffer.read_committed(from_position, max_entries)
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
    rows = _topic_rows(tables, LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA, topic, ledger_ids)
    return rows.sort_by([("ledger_id", "ascending"), ("entry_id", "ascending")])


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
    buffer = TopicTransactionBuffer(topic)
    if gone and hot.num_rows:
        ids = sorted(gone)
        buffer = resumed_buffer(topic, gone, hot, _topic_rows(tables, BUFFER_LEDGER_TXNS, BUFFER_LEDGER_TXNS_SCHEMA, topic, ids),
                                _topic_rows(tables, BUFFER_SEQUENCE_RANGES, BUFFER_SEQUENCE_RANGES_SCHEMA, topic, ids))
    for row in hot.to_pylist():
        buffer.append(LogEntry.from_row(row))
    tiered = sorted(ledger for _, ledger in offloaded_ledgers(tables.warehouse, topic) if ledger in gone)
    cold = _topic_rows(tables, OFFLOADED_ENTRIES, OFFLOADED_ENTRIES_SCHEMA, topic, tiered)
    cold = cold.sort_by([("ledger_id", "ascending"), ("entry_id", "ascending")])
    return TopicLog(buffer, [LogEntry.from_row(r) for r in cold.to_pylist()])


def resumed_buffer(topic: str, gone: dict[int, dict], hot: pa.Table, ledger_txns: pa.Table,
                   ranges: pa.Table) -> TopicTransactionBuffer:
    """The reference buffer of `topic` after its deleted ledgers (`gone`: ledger id -> deleted_ledgers
    row, with `entry_count` and `last_entry_id`), ready to be fed `hot` (the stored entries, in
    ledger_entries columns), from the facts the buffer's state keeps of the deleted ledgers: their
    `buffer_ledger_txns` and `buffer_sequence_ranges` rows. Pure."""
    first_stored = pc.min(hot["ledger_id"]).as_py()
    if max(gone) > first_stored:
        raise ConsumerStateError(
            f"topic {topic!r}: ledger {max(gone)} is recorded deleted (deleted_ledgers) but ledger {first_stored} before "
            "it is still stored; retention deletes the oldest ledgers first, so the log was changed by something else. "
            "The consumer cannot read the topic in ledger order; restore the deleted ledger's entries or its deleted_ledgers row."
        )
    ids = sorted(gone)
    held = state_ledger_counts(ledger_txns)
    missing = [ledger for ledger in ids if held.get((topic, ledger)) != (gone[ledger]["entry_count"], gone[ledger]["last_entry_id"])]
    if missing:
        raise ConsumerStateError(
            f"topic {topic!r}: retention deleted ledger(s) {', '.join(map(str, missing))}, and the transaction buffer's state "
            "(buffer_ledger_txns) does not hold their facts as they were (the buffer had not run over them when they were "
            "deleted, or its state was rebuilt since). Only their deleted entries told which later entries are retried sends "
            "or data after their transaction's marker, so the consumer refuses to guess. Nothing was read. To avoid this, "
            "run the transaction buffer (`txnlake run`) before `txnlake retention`."
        )
    txns = kernel.txns_from_ledger_txns(ledger_txns).to_pylist()
    met = {(e["txn_most_bits"], e["txn_least_bits"]) for e in hot.select(["txn_most_bits", "txn_least_bits"]).to_pylist()}
    # Only the closed transactions the stored entries meet matter (as snapshot recovery restores
    # only the aborts its tail meets); every open one holds the stable position back.
    closed = [TxnMarker(TxnId(t["txn_most_bits"], t["txn_least_bits"]), t["outcome"], Position(t["marker_ledger_id"], t["marker_entry_id"]))
              for t in txns if t["marker_count"] > 0 and (t["txn_most_bits"], t["txn_least_bits"]) in met]
    ongoing = {TxnId(t["txn_most_bits"], t["txn_least_bits"]): Position(t["first_data_ledger_id"], t["first_data_entry_id"])
               for t in txns if t["marker_count"] == 0}
    # The sequence ids seen in the deleted ledgers, of the stored entries that repeat one: the rule
    # the buffer's incremental runs apply to earlier ledgers' runs.
    sequences: set[tuple[int, int | None, int]] = set()
    if ranges.num_rows:
        narrow = hot.select(["topic", "ledger_id", "entry_id", "entry_type", "producer_id", "producer_epoch", "sequence_id"])
        repeated = kernel.duplicates_of_earlier_ledgers(narrow, ranges)
        again = narrow.join(repeated, ["topic", "ledger_id", "entry_id"], join_type="left semi")
        sequences = set(zip(*(again[c].to_pylist() for c in kernel.SEQUENCE_KEY[1:])))
    lasts = [Position(ledger, gone[ledger]["last_entry_id"]) for ledger in ids]
    return TopicTransactionBuffer.restored(topic, (), lasts[-1], closed=closed, ongoing=ongoing, sequences=sequences,
                                          ledger_lasts=lasts)


def topic_buffer(tables: DeltaTables, topic: str) -> TopicTransactionBuffer:
    """The transaction buffer of `topic` that decided its stored entries (`topic_log`'s): fed every
    entry of ledger_entries, after resuming from the facts of the ledgers retention deleted."""
    return topic_log(tables, topic).buffer


def _position(value: object, what: str) -> Position:
    """A position to read from: EARLIEST, or a position `checked_position` accepts."""
    return EARLIEST if value == EARLIEST else checked_position(value, what)


class Consumer:
    """Reads the committed entries of a topic from a position: each once, never past the stable
    position. Refuses with `ConsumerStateError` what it cannot know after retention (module doc).

    Like a Pulsar consumer reading on from its cursor, it keeps the topic's buffer between calls and
    feeds it only the entries appended since (`ledger_entries`' new version, read by the ledgers
    that grew): a call costs in proportion to what is new, plus a fold of the log's narrow columns
    to see what grew. It builds the buffer again from the whole stored log when the log changed in
    any other way: rows in a ledger before the last entry fed (files ingested out of order), a
    ledger fed that is no longer stored, or a ledger recorded deleted since (retention)."""

    def __init__(self, tables: DeltaTables, topic: str, start: Position | tuple[int, int] | str = EARLIEST):
        if not isinstance(topic, str) or not topic.strip():
            raise ValueError(f"topic must be a non-empty string, got {topic!r}")
        self.tables = tables
        self.topic = topic
        self.position = _position(start, "start")  # the next read starts here (inclusive)
        self._log: TopicLog | None = None
        self._fed: dict[int, int] = {}  # entries fed to the buffer, per stored ledger
        self._versions: tuple[int | None, int | None] = (None, None)  # ledger_entries', deleted_ledgers'
        self.rebuilds = 0  # times the buffer was built from the whole stored log

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
            # Rows appended between the count and the read are fed too; the next call then finds
            # them at or before the last entry fed and builds again: never wrong, at worst slower.
            self._log, self._fed = topic_log(self.tables, self.topic, counts), dict(counts)
            self.rebuilds += 1
        self._versions = versions
        return self._log

    def _feed_appended(self, counts: dict[int, int], versions: tuple[int | None, int | None]) -> bool:
        """Feed the buffer the entries appended after the last one fed, when that is all that changed
        (see the class doc); False when the buffer must be built again."""
        log, last = self._log, None if self._log is None else self._log.buffer.last_position
        if log is None or last is None or versions[1] != self._versions[1]:
            return False  # first call, nothing stored yet (or all of it deleted), or a retention since
        if any(counts.get(ledger) is None or counts[ledger] < fed for ledger, fed in self._fed.items()):
            return False  # a ledger fed is gone or smaller
        grown = sorted(ledger for ledger, n in counts.items() if n != self._fed.get(ledger))
        if any(ledger < last.ledger_id for ledger in grown):
            return False  # rows arrived in a ledger before the last one fed
        rows = _stored_entries(self.tables, self.topic, grown)
        after = pc.or_(pc.greater(rows["ledger_id"], last.ledger_id),
                       pc.and_(pc.equal(rows["ledger_id"], last.ledger_id), pc.greater(rows["entry_id"], last.entry_id)))
        if pc.sum(pc.invert(after)).as_py():
            return False  # rows at or before the last entry fed, in its ledger
        for row in rows.to_pylist():
            log.buffer.append(LogEntry.from_row(row))
            self._fed[row["ledger_id"]] = self._fed.get(row["ledger_id"], 0) + 1
        return True
