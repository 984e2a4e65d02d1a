"""The rules of the snapshot index (docs/snapshots.md, Bad rows), once, over Arrow.

Which keys are a topic's (`topic-end`, `topic-N`), why a row of `txn_snapshot_segments` cannot be
used, and which rows make a topic's live snapshot (`live_snapshot_index`). The driver's recovery
(`snapshots.recovery`) calls them on the table it reads; the Spark jobs (`snapshots.jobs`) run the
row rules as Arrow UDFs and the index over the rows' narrow columns collected (a row per segment
row, no aborts). Spark's Python workers import this module, so the UDFs' functions are at top level
and its imports stay light (no Spark).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from txn_engine.core.positions import Position
from txn_engine.snapshots.format import END_SUFFIX

BAD_REASON = "bad_reason"  # the column the Spark jobs append: null for a usable row
# The columns the rules read; Spark packs them in one struct for `bad_row_reasons_of`.
RULE_COLUMNS = ("snapshot_key", "topic", "max_read_ledger_id", "max_read_entry_id", "aborts", "snapshot_id",
                "segment_index", "segment_count", "abort_count", "tombstone")

# `<topic>-<N>`, N from 1 with at most nine digits (an int). A number holds no '-', so the key's
# last '-' ends the topic; `(?s)` lets a topic hold a newline, and `$` is the end of the key.
_PART_KEY = r"(?s)^(?P<topic>.*)-(?P<number>[1-9][0-9]{0,8})$"


def as_array(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """`values` as one array (a table's column is chunked)."""
    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values


def _strings(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One string array (a table's column comes in chunks, and may be large or view strings)."""
    values = as_array(values)
    return values if values.type == pa.string() else values.cast(pa.string())


def end_keys(topic: pa.Array, key: pa.Array) -> pa.Array:
    """Per row, whether `key` is `<topic>-end` (null when either is, as SQL's `=`)."""
    topic, key = _strings(topic), _strings(key)
    return pc.equal(key, pc.binary_join_element_wise(topic, f"-{END_SUFFIX}", ""))


def part_numbers(topic: pa.Array, key: pa.Array) -> pa.Array:
    """Per row, the number of a `<topic>-<N>` key; null for `<topic>-end` and for keys of no topic."""
    topic, key = _strings(topic), _strings(key)
    key_topic, number = pc.extract_regex(key, _PART_KEY).flatten()  # null where the key does not parse
    mine = pc.fill_null(pc.equal(key_topic, topic), False)
    return pc.if_else(mine, pc.cast(number, pa.int32()), pa.scalar(None, pa.int32()))


def unreadable_aborts(aborts: pa.ListArray) -> pa.Array:
    """Per row, whether its abort array holds a null abort or an abort with a null field."""
    values = aborts.flatten()
    bad_value = values.is_null()
    for child in values.flatten():
        bad_value = pc.or_(bad_value, child.is_null())
    bad_rows = pc.filter(pc.list_parent_indices(aborts), bad_value).cast(pa.int64())
    return pc.is_in(pa.array(np.arange(len(aborts), dtype=np.int64)), value_set=bad_rows)


def _text(*parts: str | pa.Array) -> pa.Array:
    """Literals and columns joined per row (null where a column is)."""
    return pc.binary_join_element_wise(*[p if isinstance(p, str) else p.cast(pa.string()) for p in parts], "")


def bad_row_reasons(segments: pa.Table | pa.RecordBatch) -> pa.Array:
    """Why each segment row cannot be used (null when it can): checked before recovery trusts it.
    The first rule a row breaks names it; a tombstone needs only a key of its topic."""
    def column(name: str) -> pa.Array:
        return as_array(segments.column(name))

    topic, key = _strings(column("topic")), _strings(column("snapshot_key"))
    aborts, segment_index = column("aborts"), column("segment_index")
    end, part = end_keys(topic, key), part_numbers(topic, key)
    live = pc.invert(pc.fill_null(column("tombstone"), False))
    no_index = aborts.is_null()
    for name in ("snapshot_id", "segment_index", "segment_count", "abort_count"):
        no_index = pc.or_(no_index, column(name).is_null())
    rules = {  # in order: (condition, reason)
        "no_key": (pc.or_(topic.is_null(), key.is_null()), pa.scalar("a segment row without topic or key")),
        "not_a_key": (pc.and_(pc.invert(end), part.is_null()),
                      _text("segment key '", key, "' is not a key of topic '", topic,
                            "' (wrong topic or unreadable key)")),
        "no_index": (pc.and_(live, no_index),
                     _text("segment '", key, "' lacks its snapshot index columns or aborts (unreadable)")),
        "no_position": (pc.and_(pc.and_(live, end), pc.or_(column("max_read_ledger_id").is_null(),
                                                          column("max_read_entry_id").is_null())),
                        _text("segment '", key, "' has no max read position (unreadable)")),
        "bad_abort": (pc.and_(live, unreadable_aborts(aborts)), _text("segment '", key, "' holds an unreadable abort")),
        "wrong_part": (pc.and_(pc.and_(live, pc.invert(end)), pc.not_equal(segment_index, part)),
                       _text("segment '", key, "' says it is part ", segment_index)),
    }
    conditions = pc.make_struct(*[pc.fill_null(c, False) for c, _ in rules.values()], field_names=list(rules))
    return pc.case_when(conditions, *[reason for _, reason in rules.values()])


def bad_row_reasons_of(rows: pa.Array) -> pa.Array:
    """`bad_row_reasons` of rows packed in one struct of `RULE_COLUMNS`, as Spark's Arrow UDF gets them."""
    return bad_row_reasons(pa.RecordBatch.from_struct_array(rows))


# What `live_snapshot_index` reads of each segment row: the index columns, why the row cannot be
# used (`BAD_REASON`, from `bad_row_reasons`) and how many aborts it holds (`ABORT_SIZE`).
INDEX_COLUMNS = ("topic", "snapshot_key", "write_seq", "tombstone", "snapshot_id", "segment_index", "segment_count",
                 "abort_count", "max_read_ledger_id", "max_read_entry_id")
ABORT_SIZE = "abort_size"


def indexed_rows(segments: pa.Table, extra: tuple[str, ...] = ()) -> pa.Table:
    """What `live_snapshot_index` reads of stored segment rows (and `extra` columns): `INDEX_COLUMNS`,
    `BAD_REASON` and `ABORT_SIZE`, without the aborts."""
    return segments.select([*INDEX_COLUMNS, *extra]).append_column(BAD_REASON, bad_row_reasons(segments)).append_column(
        ABORT_SIZE, pc.list_value_length(segments.column("aborts")))


@dataclass(frozen=True)
class IndexedSnapshot:
    """One topic of the snapshot index: its live snapshot (rows: parts in order, then the end), or why none."""

    topic: str
    snapshot_id: int | None = None
    max_read: Position | None = None
    rows: tuple[int, ...] = ()
    fallback_reason: str | None = None
    segment_count: int | None = None
    abort_count: int | None = None


def live_ends(rows: pa.Table | pa.RecordBatch) -> dict[str, int]:
    """Per topic, the row number in `rows` of its latest `topic-end` (by `write_seq`) when that is
    not a tombstone: which snapshot is live. Over the rows it is given: compaction gives all rows,
    the index those that pass the checks. A null `write_seq` loses to any other (as Spark orders it
    descending); between equal ones, the later row."""
    topic = _strings(rows.column("topic"))
    at = np.flatnonzero(pc.fill_null(end_keys(topic, rows.column("snapshot_key")), False).to_numpy(zero_copy_only=False))
    ends = pa.table({"topic": topic.take(at), "write_seq": as_array(rows.column("write_seq")).take(at)})
    order = pc.sort_indices(ends, sort_keys=[("topic", "ascending"), ("write_seq", "ascending", "at_start")]).to_numpy()
    latest: dict[str, int] = {}
    for t, i in zip(ends.column("topic").take(order).to_pylist(), at[order].tolist()):
        latest[t] = i  # ascending: the last seen is the latest
    tombstone = pc.fill_null(as_array(rows.column("tombstone")), False).to_pylist()
    return {t: i for t, i in latest.items() if not tombstone[i]}


def live_snapshot_index(segments: pa.Table) -> dict[str, IndexedSnapshot]:
    """Per topic with segment rows, its live snapshot or why it cannot be used; `rows` are row
    numbers of `segments` (`INDEX_COLUMNS`, `BAD_REASON`, `ABORT_SIZE`).

    A topic with a bad row falls back (the first reason by text); else its live snapshot is named
    by its latest `topic-end` unless that is a tombstone, and is made of the latest row of each of
    its part numbers written for that snapshot id; it must have them all and hold `abort_count` aborts.
    """
    meta = segments.select(list(INDEX_COLUMNS)).to_pylist()
    reasons = as_array(segments.column(BAD_REASON)).to_pylist()
    sizes = pc.fill_null(as_array(segments.column(ABORT_SIZE)), 0).to_pylist()
    is_end = end_keys(segments.column("topic"), segments.column("snapshot_key")).to_pylist()

    bad: dict[str, str] = {}
    for row, why in zip(meta, reasons):
        if row["topic"] is not None and why is not None:
            bad[row["topic"]] = min(bad.get(row["topic"], why), why)
    good = np.flatnonzero(pc.is_null(as_array(segments.column(BAD_REASON))).to_numpy(zero_copy_only=False))
    live = {t: int(good[i]) for t, i in live_ends(segments.take(good)).items()}
    parts: dict[str, dict[int, int]] = {}  # topic -> segment_index -> latest row of the live snapshot
    for i, (row, why) in enumerate(zip(meta, reasons)):
        end = live.get(row["topic"])
        if why is not None or end is None or row["tombstone"] or is_end[i]:
            continue
        e = meta[end]
        if row["snapshot_id"] == e["snapshot_id"] and row["segment_index"] < e["segment_count"]:
            mine = parts.setdefault(row["topic"], {})
            j = mine.get(row["segment_index"])
            if j is None or row["write_seq"] > meta[j]["write_seq"]:
                mine[row["segment_index"]] = i

    index = {}
    for topic in sorted({r["topic"] for r in meta if r["topic"] is not None}):
        end = live.get(topic)
        if topic in bad:
            index[topic] = IndexedSnapshot(topic, fallback_reason=bad[topic])
            continue
        if end is None:
            index[topic] = IndexedSnapshot(topic, fallback_reason=f"no live '{topic}-end' segment (no completed snapshot)")
            continue
        e = meta[end]
        mine = parts.get(topic, {})
        rows = (*(mine[k] for k in sorted(mine)), end)
        held = sum(sizes[i] for i in rows)
        reason = None
        if len(mine) != e["segment_count"] - 1:
            reason = (f"snapshot {e['snapshot_id']} lacks {e['segment_count'] - 1 - len(mine)} of its "
                      f"{e['segment_count']} segments")
        elif held != e["abort_count"]:
            reason = f"snapshot {e['snapshot_id']} holds {held} aborts, its index says {e['abort_count']}"
        index[topic] = IndexedSnapshot(topic, fallback_reason=reason) if reason is not None else IndexedSnapshot(
            topic, e["snapshot_id"], Position(e["max_read_ledger_id"], e["max_read_entry_id"]), rows,
            segment_count=e["segment_count"], abort_count=e["abort_count"])
    return index
