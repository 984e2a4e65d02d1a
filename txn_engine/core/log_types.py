"""The shared types of the log: entries, transaction ids, markers, states and violations.

Used by production code and by the reference buffer (`transaction_buffer`) alike, so production
modules need not import the test oracle for its types.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Mapping, NamedTuple

from txn_engine.core.positions import Position


class EntryType(StrEnum):
    """The `entry_type` column. A StrEnum, so it compares equal to the plain strings in rows."""

    DATA = "DATA"
    COMMIT = "COMMIT"
    ABORT = "ABORT"


class TxnState(StrEnum):
    """Where a transaction stands on one topic."""

    ONGOING = "ONGOING"  # has kept data on the topic and no marker yet
    COMMITTED = "COMMITTED"  # its first marker on the topic is a COMMIT
    ABORTED = "ABORTED"  # its first marker on the topic is an ABORT


class Violation(StrEnum):
    """Anomalies the buffer tolerates (as a broker would) but counts, so tests and checks can see them."""

    DUPLICATE = "duplicate"  # a DATA entry repeating an earlier (producer_id, sequence_id)
    DATA_AFTER_MARKER = "data_after_marker"  # data of a transaction already closed on the topic
    DUPLICATE_MARKER = "duplicate_marker"  # a second marker for the same transaction
    MARKER_WITHOUT_DATA = "marker_without_data"  # a marker for a transaction with no data here


class TxnId(NamedTuple):
    """A transaction id, Pulsar's TxnID: two 64-bit halves."""

    most_bits: int
    least_bits: int

    def __str__(self) -> str:
        return f"{self.most_bits}:{self.least_bits}"

    @classmethod
    def parse(cls, text: str) -> "TxnId":
        """Parse `MOST:LEAST` (as printed) into a TxnId, with a clear error for anything else."""
        try:
            most, least = text.split(":")
            return cls(int(most), int(least))
        except ValueError:
            raise ValueError(
                f"not a transaction id: {text!r}; write it as MOST_BITS:LEAST_BITS, for example 1:42"
            ) from None


@dataclass(frozen=True)
class LogEntry:
    """One row of `ledger_entries`, same fields and meanings."""

    topic: str
    ledger_id: int
    entry_id: int
    entry_type: str
    txn_most_bits: int | None = None
    txn_least_bits: int | None = None
    producer_id: int | None = None
    producer_epoch: int | None = None
    sequence_id: int | None = None
    publish_time: datetime | None = None
    key: str | None = None
    payload: bytes | None = None
    key_bytes: bytes | None = None
    headers: tuple | list | None = None  # of {"key": str, "value": bytes | None}
    timestamp_type: str | None = None

    def __post_init__(self) -> None:
        # The same rules ingest applies, so the oracle never accepts a row the warehouse would not.
        if self.entry_type not in tuple(EntryType):
            raise ValueError(f"entry_type must be one of DATA, COMMIT, ABORT, got {self.entry_type!r}")
        if (self.txn_most_bits is None) != (self.txn_least_bits is None):
            raise ValueError("txn_most_bits and txn_least_bits must both be set or both be null")
        if self.ledger_id < 0 or self.entry_id < 0:
            raise ValueError(f"ledger_id and entry_id must not be negative, got {self.ledger_id}:{self.entry_id}")

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "LogEntry":
        """Build from a mapping with the ledger_entries columns (a dict, or a Spark Row's asDict())."""
        return cls(**{name: row.get(name) for name in cls.__dataclass_fields__})

    @property
    def position(self) -> Position:
        return Position(self.ledger_id, self.entry_id)

    @property
    def txn_id(self) -> TxnId | None:
        if self.txn_most_bits is None or self.txn_least_bits is None:
            return None
        return TxnId(self.txn_most_bits, self.txn_least_bits)

    @property
    def is_marker(self) -> bool:
        return self.entry_type != EntryType.DATA


class TxnMarker(NamedTuple):
    """The first marker of a transaction on a topic: a row of `txn_markers`."""

    txn: TxnId
    outcome: str  # COMMIT or ABORT
    position: Position


@dataclass(frozen=True)
class BufferState:
    """An immutable summary of a buffer, to compare with snapshots and recovered states."""

    topic: str
    max_read_position: Position
    aborts: tuple[tuple[TxnId, Position], ...]  # in abort-marker order
    ongoing: tuple[tuple[TxnId, Position], ...]  # (txn, first position), by first position
