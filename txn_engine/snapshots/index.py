"""The row rules of the snapshot index (docs/snapshots.md, Bad rows), once, over Arrow.

Which keys are a topic's (`topic-end`, `topic-N`) and why a row of `txn_snapshot_segments`
cannot be used. The driver's recovery (`snapshots.recovery`) calls them on the table it reads; the
Spark jobs (`snapshots.jobs`) run the same functions as Arrow UDFs. Spark's Python workers import
this module, so the UDFs' functions are at top level and its imports stay light (no Spark).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from txn_engine.snapshots.format import END_SUFFIX

BAD_REASON = "bad_reason"  # the column the Spark jobs append: null for a usable row
# The columns the rules read; Spark packs them in one struct for `bad_row_reasons_of`.
RULE_COLUMNS = ("snapshot_key", "topic", "max_read_ledger_id", "max_read_entry_id", "aborts", "snapshot_id",
                "segment_index", "segment_count", "abort_count", "tombstone")

# `<topic>-<N>`, N from 1 with at most nine digits (an int). A number holds no '-', so the key's
# last '-' ends the topic; `(?s)` lets a topic hold a newline, and `$` is the end of the key.
_PART_KEY = r"(?s)^(?P<topic>.*)-(?P<number>[1-9][0-9]{0,8})$"


def _array(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values


def _strings(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """One string array (a table's column comes in chunks, and may be large or view strings)."""
    values = _array(values)
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
        return _array(segments.column(name))

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
