"""Positions in a topic: `(ledger_id, entry_id)`, ordered lexicographically (Pulsar's PositionImpl)."""

from __future__ import annotations

import operator
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


def at_or_before_sql(ledger: str, entry: str, other_ledger: str, other_entry: str) -> str:
    """SQL (Spark's and delta-rs's) for "position (ledger, entry) is at or before (other_ledger,
    other_entry)", over column names or literals: the one text of the rule outside Arrow."""
    return f"({ledger} < {other_ledger} OR ({ledger} = {other_ledger} AND {entry} <= {other_entry}))"


# The position before anything: what a topic with no readable entry reports.
EARLIEST = Position(-1, -1)

INT64_MAX = 2**63 - 1  # ledger_id and entry_id are BIGINT


def checked_position(value: object, what: str = "position") -> Position:
    """`value` as the position of an entry: a Position, a (ledger_id, entry_id) pair or `L:E` as
    printed; both ids integers in 0 .. 2**63-1 (BIGINT). Anything else gets a clear error, before
    it can reach a table (a value out of BIGINT's range would fail the engine's whole write)."""
    if isinstance(value, str):
        try:
            value = Position.parse(value)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
    if isinstance(value, (tuple, list)) and len(value) == 2 and not any(isinstance(i, bool) for i in value):
        try:
            ids = [operator.index(i) for i in value]  # ints, numpy's too; not floats
        except TypeError:
            pass
        else:
            if all(0 <= i <= INT64_MAX for i in ids):
                return Position(*ids)
            raise ValueError(f"{what} {ids[0]}:{ids[1]} is out of range: ledger and entry ids are between 0 "
                             f"and {INT64_MAX}")
    raise ValueError(f"{what} must be a Position, a (ledger_id, entry_id) pair of integers or a string "
                     f"LEDGER_ID:ENTRY_ID like 12:40, got {value!r}")


def start_position(value: str, what: str = "start position") -> Position:
    """Where a read starts, as a user types it: `earliest` or -1:-1 (EARLIEST: the beginning), an
    entry's `L:E`, or `L:-1`, the position before (L, 0) (the brief's words), which the read's
    `position >= start` starts at (L, 0). Anything else gets the `checked_position` style of error."""
    if value.strip().lower() == "earliest":
        return EARLIEST
    try:
        position = Position.parse(value)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}, or earliest for the beginning") from None
    if position == EARLIEST:
        return position
    if position.entry_id == -1 and 0 <= position.ledger_id <= INT64_MAX:
        return position
    if not all(0 <= i <= INT64_MAX for i in position):
        raise ValueError(f"{what} {position} is out of range: write it as LEDGER_ID:ENTRY_ID with ids between 0 and "
                         f"{INT64_MAX} (an entry id of -1 starts at the ledger's first entry), or earliest (-1:-1) "
                         "for the beginning")
    return position


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


# Dagster partitions are ledgers, keyed "<topic>/<ledger_id>" (`orders-partition-0/42`): a ledger id
# is unique only within its topic (every Kafka partition's first segment is ledger 0), and a person
# reads the key in the UI. The id is last and has no "/", so a topic may hold one (Pulsar's
# `persistent://tenant/ns/t`). Sorted, keys are ordered by `ledger_of_partition`, not as strings.
LEDGER_KEY_SEPARATOR = "/"
# What Dagster refuses in a dynamic partition key, or breaks its UI's partition selection text.
_KEY_FORBIDDEN = ("...", ",", "[", "]", "\a", "\b", "\f", "\n", "\r", "\t", "\v", "\0")


def ledger_partition_key(topic: str, ledger_id: int) -> str:
    """The Dagster partition key of a topic's ledger: `<topic>/<ledger_id>`."""
    if ledger_id < 0:
        raise ValueError(f"ledger ids are not negative, got {ledger_id}")
    bad = [s for s in _KEY_FORBIDDEN if s in topic]
    if not topic or bad:
        raise ValueError(f"topic {topic!r} cannot name a Dagster partition (it holds {bad or 'nothing'}); "
                         "rename the topic in the input (Dagster refuses '...', ',', '[', ']' and control characters)")
    return f"{topic}{LEDGER_KEY_SEPARATOR}{ledger_id}"


def ledger_of_partition(key: str) -> tuple[str, int]:
    """(topic, ledger_id) of a ledger partition key, with a clear error for anything else."""
    topic, _, ledger = key.rpartition(LEDGER_KEY_SEPARATOR)
    if key.isdigit():
        raise ValueError(f"{key!r} is a ledger partition key of an older release (a ledger id without its topic); "
                         "run `txnlake migrate`, which renames them to <topic>/<ledger_id>")
    if not topic or not ledger.isdigit():
        raise ValueError(f"not a ledger partition key: {key!r}; keys are <topic>/<ledger_id>, like orders-partition-0/42")
    return topic, int(ledger)

