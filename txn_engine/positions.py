"""Positions in a topic: `(ledger_id, entry_id)`, ordered lexicographically (Pulsar's PositionImpl)."""

from __future__ import annotations

from typing import NamedTuple, Sequence


class Position(NamedTuple):
    """A position in one topic. Tuple order is the log order."""

    ledger_id: int
    entry_id: int

    def __str__(self) -> str:
        return f"{self.ledger_id}:{self.entry_id}"

    @classmethod
    def parse(cls, text: str) -> "Position":
        """Parse `L:E` (as printed) into a Position, with a clear error for anything else."""
        try:
            ledger, entry = text.split(":")
            return cls(int(ledger), int(entry))
        except ValueError:
            raise ValueError(
                f"not a position: {text!r}; write it as LEDGER_ID:ENTRY_ID, for example 12:0"
            ) from None


# The position before anything: what a topic with no readable entry reports.
EARLIEST = Position(-1, -1)


def position_before(position: Position, previous_ledger_last: Position | None) -> Position:
    """The position just before `position`, as Pulsar's managed ledger defines it.

    `(L, e-1)` when `e > 0`; before `(L, 0)` it is the last entry of the topic's previous
    non-empty ledger (`previous_ledger_last`), or `(L, -1)` when there is none.
    """
    if position.entry_id > 0:
        return Position(position.ledger_id, position.entry_id - 1)
    if previous_ledger_last is not None:
        return previous_ledger_last
    return Position(position.ledger_id, -1)


def previous_ledger_last_entries(ledger_last_entries: Sequence[Position]) -> dict[int, Position | None]:
    """For each non-empty ledger of a topic, the last position of the previous non-empty ledger."""
    ordered = sorted(ledger_last_entries)
    result: dict[int, Position | None] = {}
    previous: Position | None = None
    for last in ordered:
        result[last.ledger_id] = previous
        previous = last
    return result


# Dagster partitions are ledgers. Ledger ids are BookKeeper's: unique across topics and
# increasing in creation time, so a zero-padded id sorts as the ledgers were created and a
# partition range is a ledger range. (Should two topics share an id, the partition covers both.)
LEDGER_KEY_DIGITS = 19  # BIGINT's widest positive value


def ledger_partition_key(ledger_id: int) -> str:
    """The Dagster partition key of a ledger: its id, zero-padded so keys sort like ids."""
    if ledger_id < 0:
        raise ValueError(f"ledger ids are not negative, got {ledger_id}")
    return f"{ledger_id:0{LEDGER_KEY_DIGITS}d}"


def ledger_id_of_partition(key: str) -> int:
    """The ledger id a partition key names, with a clear error for anything else."""
    if not key.isdigit():
        raise ValueError(f"not a ledger partition key: {key!r}; keys are zero-padded ledger ids like {ledger_partition_key(12)}")
    return int(key)
