"""A read-committed consumer of one topic, in ledger order, through the transaction buffer's rules.

It feeds the topic's entries to the reference `TopicTransactionBuffer` (the one definition of
what is committed, aborted, undecided or a duplicate) instead of restating those rules.
"""

from __future__ import annotations

import pyarrow.compute as pc

from txn_engine.delta_io import DeltaTables
from txn_engine.positions import EARLIEST, Position
from txn_engine.schema import LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA
from txn_engine.transaction_buffer import LogEntry, TopicTransactionBuffer


def topic_buffer(tables: DeltaTables, topic: str) -> TopicTransactionBuffer:
    """The transaction buffer of `topic` after every entry stored in ledger_entries."""
    entries = tables.read(LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA)
    entries = entries.filter(pc.equal(entries["topic"], topic)).sort_by(
        [("ledger_id", "ascending"), ("entry_id", "ascending")]
    )
    buffer = TopicTransactionBuffer(topic)
    for row in entries.to_pylist():
        buffer.append(LogEntry.from_row(row))
    return buffer


class Consumer:
    """Reads the committed entries of a topic from a position: each once, never past the stable position."""

    def __init__(self, tables: DeltaTables, topic: str, start: Position = EARLIEST):
        if not isinstance(topic, str) or not topic.strip():
            raise ValueError(f"topic must be a non-empty string, got {topic!r}")
        self.tables = tables
        self.topic = topic
        self.position = Position(*start)  # the next read starts here (inclusive)

    def read(self, from_position: Position | None = None, max_entries: int | None = None) -> list[LogEntry]:
        """Committed DATA entries at or after `from_position`, in ledger order (stateless)."""
        start = self.position if from_position is None else Position(*from_position)
        return topic_buffer(self.tables, self.topic).read_committed(start, max_entries)

    def poll(self, max_entries: int | None = None) -> list[LogEntry]:
        """The next committed entries after those already returned; moves the consumer's position."""
        entries = self.read(self.position, max_entries)
        if entries:
            last = entries[-1].position
            self.position = Position(last.ledger_id, last.entry_id + 1)
        return entries
