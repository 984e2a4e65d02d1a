"""The snapshot index's row rules in Arrow (`txn_engine.snapshots.index`), without Spark.

The Spark jobs run the same functions as Arrow UDFs; tests/test_snapshot_jobs.py holds the two
recovery paths equal on damaged tables.
"""

from __future__ import annotations

import pyarrow as pa
from hypothesis import given
from hypothesis import strategies as st

from txn_engine.storage.arrow_frames import arrow_schema
from txn_engine.core.schema import TXN_SNAPSHOT_SEGMENTS_SCHEMA
from txn_engine.snapshots.index import bad_row_reasons, end_keys, part_numbers
from txn_engine.reference.snapshots import key_suffix

SCHEMA = arrow_schema(TXN_SNAPSHOT_SEGMENTS_SCHEMA)
ABORT = {"txn_most_bits": 1, "txn_least_bits": 2, "ledger_id": 3, "entry_id": 4}


def row(key: str, topic: str = "t", **columns) -> dict:
    end = key == f"{topic}-end"
    return {"snapshot_key": key, "topic": topic, "max_read_ledger_id": 5 if end else -1,
            "max_read_entry_id": 6 if end else -1, "aborts": [ABORT], "write_seq": 1, "snapshot_id": 9,
            "segment_index": 2 if end else 1, "segment_count": 2, "abort_count": 2, "tombstone": False,
            "written_at": None, **columns}


def test_each_rule_names_the_row_it_refuses():
    cases = [
        (row("t-end"), None),
        (row("t-1"), None),
        (row("t-1-1", topic="t-1"), None),
        (row("u-1"), "segment key 'u-1' is not a key of topic 't' (wrong topic or unreadable key)"),
        (row("t-01"), "segment key 't-01' is not a key of topic 't' (wrong topic or unreadable key)"),
        (row("t-1\n"), "segment key 't-1\n' is not a key of topic 't' (wrong topic or unreadable key)"),
        (row("t-1234567890"), "segment key 't-1234567890' is not a key of topic 't' (wrong topic or unreadable key)"),
        (row("u-1", tombstone=True), "segment key 'u-1' is not a key of topic 't' (wrong topic or unreadable key)"),
        (row("t-3", tombstone=True, snapshot_id=None, aborts=[None]), None),
        (row("t-1", snapshot_id=None), "segment 't-1' lacks its snapshot index columns or aborts (unreadable)"),
        (row("t-1", aborts=None), "segment 't-1' lacks its snapshot index columns or aborts (unreadable)"),
        (row("t-end", max_read_entry_id=None), "segment 't-end' has no max read position (unreadable)"),
        (row("t-1", aborts=[ABORT, None]), "segment 't-1' holds an unreadable abort"),
        (row("t-1", aborts=[{**ABORT, "entry_id": None}]), "segment 't-1' holds an unreadable abort"),
        (row("t-1", segment_index=3), "segment 't-1' says it is part 3"),
    ]
    table = pa.Table.from_pylist([r for r, _ in cases], schema=SCHEMA)
    assert bad_row_reasons(table).to_pylist() == [reason for _, reason in cases]
    # Spark hands the rules record batches of any size: the same answers batch by batch.
    batches = table.to_batches(max_chunksize=4)
    assert sum((bad_row_reasons(b).to_pylist() for b in batches), []) == [reason for _, reason in cases]


@given(st.text("t-1end0", max_size=5), st.text("t-1end0\n", max_size=9))
def test_keys_agree_with_the_reference(topic, key):
    part = part_numbers(pa.array([topic]), pa.array([key])).to_pylist()[0]
    end = end_keys(pa.array([topic]), pa.array([key])).to_pylist()[0]
    suffix = key_suffix(topic, key)
    assert end == (suffix == "end")
    assert part == (int(suffix) if suffix not in (None, "end") else None)
