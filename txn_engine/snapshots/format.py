"""The snapshot log's format, shared by the writers, the readers and the reference (`snapshots`).

Keys (`topic-1 ... topic-N`, `topic-end`), how a segment's size is counted, the segment bounds
(`SnapshotConfig`) and where a recovered state comes from (`Source`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from txn_engine.core.errors import TxnlakeError

END_SUFFIX = "end"
# What a segment costs in the snapshot topic, as txnlake counts it: four longs per abort, and a
# fixed envelope (key, topic, positions, ids, counts) plus the topic name twice (key and topic).
ABORT_BYTES = 32
SEGMENT_ENVELOPE_BYTES = 128
DEFAULT_MAX_SEGMENT_BYTES = 5 * 1024 * 1024  # BookKeeper's default entry size limit (nettyMaxFrameSizeBytes)
DEFAULT_MAX_ABORTS_PER_SEGMENT = 100_000


class Source(StrEnum):
    """Where a recovered state comes from (the `source` column of recovered_buffer_state)."""

    SNAPSHOT = "SNAPSHOT"
    FULL_REPLAY = "FULL_REPLAY"


class SnapshotError(TxnlakeError, ValueError):
    """A snapshot configuration or segment that cannot be used; the message says what to do
    (a TxnlakeError, so the CLI prints it without a traceback and exits 2)."""


@dataclass(frozen=True)
class SnapshotConfig:
    """The bounds of one segment. Both apply: a segment holds at most this many aborts and its
    estimated size stays at or under `max_segment_bytes`."""

    max_aborts_per_segment: int = DEFAULT_MAX_ABORTS_PER_SEGMENT
    max_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES

    def __post_init__(self) -> None:
        if self.max_aborts_per_segment < 1:
            raise SnapshotError(f"max_aborts_per_segment must be at least 1, got {self.max_aborts_per_segment}")
        if self.max_segment_bytes < SEGMENT_ENVELOPE_BYTES + ABORT_BYTES:
            raise SnapshotError(
                f"max_segment_bytes {self.max_segment_bytes} cannot hold one abort; use at least "
                f"{SEGMENT_ENVELOPE_BYTES + ABORT_BYTES} (the default is {DEFAULT_MAX_SEGMENT_BYTES}, 5 MiB)"
            )

    def segment_capacity(self, topic: str) -> int:
        """How many aborts one segment of `topic` may hold under both bounds."""
        room = self.max_segment_bytes - segment_bytes(topic, 0)
        by_bytes = room // ABORT_BYTES
        if by_bytes < 1:
            raise SnapshotError(
                f"topic name {topic[:60]!r}... is too long for max_segment_bytes {self.max_segment_bytes}; "
                "raise max_segment_bytes"
            )
        return min(self.max_aborts_per_segment, by_bytes)


def segment_bytes(topic: str, aborts: int) -> int:
    """Estimated bytes of a segment of `topic` holding `aborts` aborts."""
    return SEGMENT_ENVELOPE_BYTES + 2 * len(topic.encode()) + ABORT_BYTES * aborts
