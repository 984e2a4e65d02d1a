"""Kafka's on-disk log read without a broker: segments of record batches (format v2, every
codec, CRC-32C checked) and the aborted-transaction index (`.txnindex`). No Spark here.

`parse_segment` maps a segment to `ledger_entries` rows: topic `<topic>-<partition>`, ledger =
segment (its base offset), entry_id = offset - base offset, control records as COMMIT/ABORT.
A transaction's id is (producer id, offset of its first record); rows of a transaction already
open where the segment starts are flagged `carry` and resolved by `resolve_carries` over the
partition's segments in order. The mapping and its limits: docs/kafka-import.md.
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass
from typing import Iterator

import cramjam
import crc32c
import pyarrow as pa

SEGMENT_NAME = re.compile(r"^(\d{20})\.log$")
PARTITION_DIR = re.compile(r"^(.+)-(\d+)$")

# baseOffset, batchLength, partitionLeaderEpoch, magic, crc, attributes, lastOffsetDelta,
# baseTimestamp, maxTimestamp, producerId, producerEpoch, baseSequence, recordCount.
BATCH_HEADER = struct.Struct(">qiibIhiqqqhii")
BATCH_OVERHEAD = 12  # baseOffset and batchLength precede what batchLength counts
CRC_START = 21  # the CRC covers attributes .. end of batch
CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
CONTROL_TYPES = {0: "ABORT", 1: "COMMIT"}
TXN_INDEX_ENTRY = struct.Struct(">hqqqq")  # version, producerId, firstOffset, lastOffset, lastStableOffset
NO_PRODUCER = -1

HEADER_TYPE = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
# What `parse_segment` yields: the ledger_entries columns, the Kafka-only ones, and the import's own.
PARSED_SCHEMA = pa.schema(
    [
        ("topic", pa.string()),
        ("ledger_id", pa.int64()),
        ("entry_id", pa.int64()),
        ("entry_type", pa.string()),
        ("txn_most_bits", pa.int64()),
        ("txn_least_bits", pa.int64()),
        ("producer_id", pa.int64()),
        ("producer_epoch", pa.int32()),
        ("sequence_id", pa.int64()),
        ("publish_time", pa.timestamp("us", tz="UTC")),
        ("key", pa.string()),
        ("payload", pa.binary()),
        ("key_bytes", pa.binary()),
        ("headers", HEADER_TYPE),
        ("timestamp_type", pa.string()),
        # Byte offset of the record's batch in its segment: where a problem is reported.
        ("batch_position", pa.int64()),
        # The row's transaction was open where the segment starts: its id comes from `resolve_carries`.
        ("carry", pa.bool_()),
        # A batch that cannot be read (CRC, codec, framing): one row, with the reason.
        ("error", pa.string()),
    ]
)


class SegmentFormatError(ValueError):
    """A segment txnlake cannot import at all (an older message format, not a segment)."""


class CorruptBatch(ValueError):
    """One batch that cannot be read; the rest of the segment can."""


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


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """A zigzag varint (Kafka's varint and varlong) at pos: (value, next position)."""
    b = buf[pos]
    if b < 0x80:  # the common one-byte case, without the loop
        return (b >> 1) ^ -(b & 1), pos + 1
    result, shift = b & 0x7F, 7
    while True:
        pos += 1
        b = buf[pos]
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return (result >> 1) ^ -(result & 1), pos + 1
        shift += 7


_XERIAL = b"\x82SNAPPY\x00"


def _snappy(data: bytes) -> bytes:
    # Java clients write snappy-java's framing (a 16-byte header, then length-prefixed raw
    # blocks); librdkafka writes one raw block. Both occur in one log.
    if data[:8] != _XERIAL:
        return bytes(cramjam.snappy.decompress_raw(data))
    out, pos = [], 16
    while pos < len(data):
        (n,) = struct.unpack_from(">i", data, pos)
        out.append(bytes(cramjam.snappy.decompress_raw(data[pos + 4 : pos + 4 + n])))
        pos += 4 + n
    return b"".join(out)


def decompress(codec: int, data: bytes) -> bytes:
    if codec == 0:
        return data
    if codec == 1:
        return zlib.decompress(data, 31)  # gzip framing
    if codec == 2:
        return _snappy(data)
    if codec == 3:
        return bytes(cramjam.lz4.decompress(data))  # the LZ4 frame format
    if codec == 4:
        return bytes(cramjam.zstd.decompress(data))
    raise CorruptBatch(f"unknown compression codec {codec}")


def batch_spans(buf: bytes) -> Iterator[tuple[int, int]]:
    """(start, end) of each batch; a span that does not fit the file raises CorruptBatch at its start."""
    pos, size = 0, len(buf)
    while pos < size:
        if pos + 17 > size:
            raise CorruptBatch(f"{size - pos} trailing bytes at byte {pos}, too few for a batch header")
        base_offset, length, _epoch, magic = struct.unpack_from(">qiib", buf, pos)
        if magic != 2:
            raise CorruptBatch(f"batch at byte {pos} has magic byte {magic}, not format v2")
        end = pos + BATCH_OVERHEAD + length
        if length < BATCH_HEADER.size - BATCH_OVERHEAD or end > size:
            raise CorruptBatch(f"batch at byte {pos} claims {length} bytes, the segment has {size - pos - BATCH_OVERHEAD}")
        yield pos, end
        pos = end


class _Columns:
    """Column lists of the rows being built, extended a batch at a time (a batch's constants
    repeated in one step); one Arrow table at the end."""

    def __init__(self) -> None:
        self.cols: dict[str, list] = {f.name: [] for f in PARSED_SCHEMA}

    def add(self, **row) -> None:
        for name, values in self.cols.items():
            values.append(row.get(name))

    def extend(self, count: int, constants: dict, varying: dict) -> None:
        for name, values in self.cols.items():
            if name in varying:
                values.extend(varying[name])
            else:
                values.extend([constants.get(name)] * count)

    def table(self) -> pa.Table:
        return pa.table(self.cols, schema=PARSED_SCHEMA)


def _utf8(raw: bytes | None) -> str | None:
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def parse_segment(topic: str, base_offset: int, buf: bytes) -> pa.Table:
    """Every record of one segment as a row of PARSED_SCHEMA, in offset order; a batch that
    cannot be read becomes one row with `error` set (and the segment's rest is read when its
    framing allows)."""
    out = _Columns()
    # Per producer, the provisional first offset of its transaction open at this point of the
    # segment, and whether that transaction was already open where the segment starts.
    open_txn: dict[int, tuple[int, bool]] = {}
    closed_here: set[int] = set()
    try:
        for start, end in batch_spans(buf):
            try:
                _parse_batch(topic, base_offset, buf, start, end, out, open_txn, closed_here)
            except (CorruptBatch, IndexError, struct.error, zlib.error, ValueError, UnicodeDecodeError) as exc:
                out.add(topic=topic, ledger_id=base_offset, batch_position=start, carry=False,
                        error=f"{type(exc).__name__}: {exc}" if not isinstance(exc, CorruptBatch) else str(exc))
    except CorruptBatch as exc:
        position = int(re.search(r"byte (\d+)", str(exc)).group(1))
        out.add(topic=topic, ledger_id=base_offset, batch_position=position, carry=False, error=str(exc))
    return out.table()


def _parse_batch(topic, ledger_id, buf, start, end, out, open_txn, closed_here) -> None:
    (base_offset, _length, _ple, _magic, crc, attributes, _last_delta, base_ts, max_ts,
     producer_id, epoch, base_seq, count) = BATCH_HEADER.unpack_from(buf, start)
    actual = crc32c.crc32c(memoryview(buf)[start + CRC_START : end])
    if actual != crc:
        raise CorruptBatch(f"batch at byte {start} fails its CRC-32C check (stored {crc:#010x}, computed {actual:#010x})")
    codec = attributes & 0x07
    log_append_time = bool(attributes & 0x08)
    transactional = bool(attributes & 0x10)
    control = bool(attributes & 0x20)
    body = decompress(codec, buf[start + BATCH_HEADER.size : end])
    has_producer = producer_id != NO_PRODUCER
    common = dict(
        topic=topic,
        ledger_id=ledger_id,
        producer_id=producer_id if has_producer else None,
        producer_epoch=epoch if has_producer and epoch >= 0 else None,
        timestamp_type="LOG_APPEND_TIME" if log_append_time else "CREATE_TIME",
        batch_position=start,
    )
    if transactional or control:
        if control:
            txn = open_txn.pop(producer_id, None)
            closed_before = producer_id in closed_here
            closed_here.add(producer_id)
            if txn is None:  # no data of it before the marker in this segment
                txn = (base_offset, not closed_before)
        else:
            txn = open_txn.get(producer_id)
            if txn is None:
                txn = (base_offset, producer_id not in closed_here)
                open_txn[producer_id] = txn
        common.update(txn_most_bits=producer_id, txn_least_bits=txn[0], carry=txn[1])
    else:
        common.update(carry=False)
    entry_ids, sequences, times, keys, key_bytes, values, header_lists, types = [], [], [], [], [], [], [], []
    pos = 0
    for _ in range(count):
        length, pos = _varint(body, pos)
        record_end = pos + length
        pos += 1  # record attributes: unused
        ts_delta, pos = _varint(body, pos)
        offset_delta, pos = _varint(body, pos)
        key_len, pos = _varint(body, pos)
        key = None if key_len < 0 else body[pos : pos + key_len]
        pos += max(key_len, 0)
        value_len, pos = _varint(body, pos)
        values.append(None if value_len < 0 else body[pos : pos + value_len])
        pos += max(value_len, 0)
        header_count, pos = _varint(body, pos)
        headers = None  # Kafka cannot tell no headers from an empty list: null
        if header_count:
            headers = []
            for _h in range(header_count):
                name_len, pos = _varint(body, pos)
                name = body[pos : pos + name_len].decode("utf-8")
                pos += name_len
                hv_len, pos = _varint(body, pos)
                headers.append({"key": name, "value": None if hv_len < 0 else body[pos : pos + hv_len]})
                pos += max(hv_len, 0)
        header_lists.append(headers)
        if pos != record_end:
            raise CorruptBatch(f"batch at byte {start}: record at offset {base_offset + offset_delta} is "
                               f"{length} bytes by its header, {length + pos - record_end} by its fields")
        offset = base_offset + offset_delta
        if control:
            if key is None or len(key) < 4:
                raise CorruptBatch(f"batch at byte {start}: control record at offset {offset} has no type")
            kind = struct.unpack_from(">h", key, 2)[0]
            if kind not in CONTROL_TYPES:
                raise CorruptBatch(f"batch at byte {start}: control record type {kind} at offset {offset} "
                                   "is neither ABORT (0) nor COMMIT (1)")
            types.append(CONTROL_TYPES[kind])
        entry_ids.append(offset - ledger_id)
        sequences.append(base_seq + offset_delta if base_seq >= 0 and not control else None)
        ts = max_ts if log_append_time else base_ts + ts_delta
        times.append(ts * 1000 if ts >= 0 else None)
        text_key = _utf8(key)
        keys.append(text_key)
        key_bytes.append(key if text_key is None else None)  # only what `key` cannot hold
    if pos != len(body):
        raise CorruptBatch(f"batch at byte {start} holds {len(body) - pos} bytes after its {count} records")
    varying = {"entry_id": entry_ids, "sequence_id": sequences, "publish_time": times, "key": keys,
               "key_bytes": key_bytes, "payload": values, "headers": header_lists}
    if control:
        varying["entry_type"] = types
    out.extend(count, {**common, "entry_type": "DATA"}, varying)


def open_at_end(table: pa.Table) -> dict[int, tuple[int, bool]]:
    """Per producer, the transaction still open at the segment's end: (provisional first offset, carry)."""
    last: dict[int, tuple[str, int, bool]] = {}
    rows = table.select(["entry_type", "txn_most_bits", "txn_least_bits", "carry"]).to_pylist()
    for r in rows:
        if r["txn_most_bits"] is not None:
            last[r["txn_most_bits"]] = (r["entry_type"], r["txn_least_bits"], r["carry"])
    return {pid: (least, carry) for pid, (kind, least, carry) in last.items() if kind == "DATA"}


def resolve_carries(
    segments: list[tuple[int, dict[int, tuple[int, bool]], set[int]]],
    initial: dict[int, int] | None = None,
) -> dict[tuple[int, int], int]:
    """One partition's carried transactions: {(ledger_id, producer_id): first offset}.

    `segments` in offset order: (base offset, the segment's `open_at_end`, the producers with
    carried rows in it); `initial` the producers' transactions open before the first of them
    (their first offsets). A carried row whose producer had nothing open keeps its provisional id:
    its transaction starts in that segment.
    """
    state = dict(initial or {})
    resolved: dict[tuple[int, int], int] = {}
    for ledger_id, ends, carried in segments:
        for pid in carried:
            if pid in state:
                resolved[(ledger_id, pid)] = state[pid]
        for pid in carried | set(ends):
            before = state.pop(pid, None)
            end = ends.get(pid)
            if end is not None:
                least, carry = end
                state[pid] = before if carry and before is not None else least
    return resolved


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
