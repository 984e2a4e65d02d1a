"""Kafka's on-disk log around its parser (`io.txnlake.kafka.SegmentReader`, in the JVM with
Kafka's own record classes): segment names, the format check made before anything is parsed,
the chain of transactions across segments, and the aborted-transaction index (`.txnindex`).
No Spark here.

A segment maps to a ledger: topic `<topic>-<partition>`, ledger = segment (its base offset),
entry_id = offset - base offset, control records as COMMIT/ABORT. A transaction's id is
(producer id, offset of its first record); a transaction open where a segment starts takes its
first offset from `open_before`, chained over the partition's segments in order. The mapping and
its limits: docs/kafka-import.md.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

SEGMENT_NAME = re.compile(r"^(\d{20})\.log$")
PARTITION_DIR = re.compile(r"^(.+)-(\d+)$")
TXN_INDEX_ENTRY = struct.Struct(">hqqqq")  # version, producerId, firstOffset, lastOffset, lastStableOffset


class SegmentFormatError(ValueError):
    """A segment txnlake cannot import at all (an older message format, not a segment)."""


@dataclass(frozen=True)
class SegmentName:
    topic: str  # `<topic>-<partition>`, the txnlake topic
    base_offset: int


def segment_name(path: str) -> SegmentName | None:
    """Topic and base offset from `.../<topic>-<partition>/<20 digits>.log`; None for other files."""
    parts = path.rstrip("/").split("/")
    match = SEGMENT_NAME.match(parts[-1])
    if not match or len(parts) < 2 or not PARTITION_DIR.match(parts[-2]):
        return None
    return SegmentName(parts[-2], int(match.group(1)))


def first_batch_magic(head: bytes) -> int | None:
    """The magic byte of a segment's first batch (from its first 17 bytes); None when empty."""
    if len(head) < 17:
        return None
    return head[16]


def check_format(path: str, head: bytes) -> None:
    magic = first_batch_magic(head)
    if magic is not None and magic != 2:
        raise SegmentFormatError(
            f"{path}: message format v{magic} (magic byte {magic}); txnlake imports record batch format v2 "
            "only (Kafka 0.11 and later). Rewrite the topic with a current broker (e.g. MirrorMaker or "
            "kafka-reassign-partitions after upgrading log.message.format) and import that"
        )


def open_before(
    segments: list[tuple[int, dict[int, tuple[int, bool]], set[int]]],
    initial: dict[int, int] | None = None,
) -> dict[int, dict[int, int]]:
    """One partition's transactions open where each segment starts: {base offset: {producer id:
    first offset}}.

    `segments` in offset order: (base offset, the transactions open at its end as
    `SegmentReader.scan` gives them: {producer: (provisional first offset, open where it
    starts)}, the producers whose transaction was open where it starts); `initial` the
    producers' transactions open before the first of them (their first offsets). A transaction
    open where a segment starts whose producer had nothing open keeps its provisional id there:
    for txnlake it starts in that segment.
    """
    state = dict(initial or {})
    out: dict[int, dict[int, int]] = {}
    for ledger_id, ends, carried in segments:
        out[ledger_id] = dict(state)
        for pid in carried | set(ends):
            before = state.pop(pid, None)
            end = ends.get(pid)
            if end is not None:
                least, carry = end
                state[pid] = before if carry and before is not None else least
    return out


@dataclass(frozen=True)
class AbortedTxn:
    producer_id: int
    first_offset: int
    last_offset: int  # the ABORT marker's offset
    last_stable_offset: int


def parse_txn_index(buf: bytes) -> list[AbortedTxn]:
    """A `.txnindex` file: one 34-byte entry per transaction aborted while that segment was active."""
    if len(buf) % TXN_INDEX_ENTRY.size:
        raise ValueError(f"a .txnindex holds {TXN_INDEX_ENTRY.size}-byte entries; this one has {len(buf)} bytes")
    entries = []
    for pos in range(0, len(buf), TXN_INDEX_ENTRY.size):
        _version, pid, first, last, lso = TXN_INDEX_ENTRY.unpack_from(buf, pos)
        entries.append(AbortedTxn(pid, first, last, lso))
    return entries
