"""`txn_engine.buffer.kernel` on cases the random histories rarely reach (no Spark needed).

The Arrow twins are held equal to Spark and to the reference by the differential tests of
`tests/test_buffer_incremental.py`; these pin the parts whose exactness rests on a trick.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from txn_engine.buffer import kernel
from txn_engine.storage.arrow_frames import arrow_schema
from txn_engine.core.schema import BUFFER_SEQUENCE_RANGES_SCHEMA


def narrow(rows: list[dict]) -> pa.Table:
    defaults = {"topic": "t", "entry_type": "DATA", "txn_most_bits": None, "txn_least_bits": None,
                "producer_id": None, "producer_epoch": 0, "sequence_id": None}
    table = pa.Table.from_pylist([{**defaults, **r} for r in rows], schema=pa.schema([
        ("topic", pa.string()), ("ledger_id", pa.int64()), ("entry_id", pa.int64()), ("entry_type", pa.string()),
        ("txn_most_bits", pa.int64()), ("txn_least_bits", pa.int64()), ("producer_id", pa.int64()),
        ("producer_epoch", pa.int32()), ("sequence_id", pa.int64())]))
    return kernel.with_row_index(table)


def positions(table: pa.Table) -> list[tuple]:
    return sorted((r["topic"], r["ledger_id"], r["entry_id"]) for r in table.to_pylist())


def test_an_earlier_ledgers_sequence_run_is_found_even_when_runs_overlap_and_later_ledgers_do_not_count():
    # Producer 7's runs: [0, 10] in ledger 1, [3, 4] in ledger 2 (overlapping: a state that should
    # not happen, still answered exactly), [20, 30] in ledger 9 (after the entries: not earlier).
    ranges = pa.Table.from_pylist([
        {"topic": "t", "producer_id": 7, "producer_epoch": 0, "ledger_id": 1, "first_sequence_id": 0, "last_sequence_id": 10},
        {"topic": "t", "producer_id": 7, "producer_epoch": 0, "ledger_id": 2, "first_sequence_id": 3, "last_sequence_id": 4},
        {"topic": "t", "producer_id": 7, "producer_epoch": 0, "ledger_id": 9, "first_sequence_id": 20, "last_sequence_id": 30},
        {"topic": "u", "producer_id": 7, "producer_epoch": 0, "ledger_id": 1, "first_sequence_id": 40, "last_sequence_id": 40},
    ], schema=arrow_schema(BUFFER_SEQUENCE_RANGES_SCHEMA))
    entries = narrow([
        {"ledger_id": 5, "entry_id": 0, "producer_id": 7, "sequence_id": 5},  # inside [0, 10] behind [3, 4]: held
        {"ledger_id": 5, "entry_id": 1, "producer_id": 7, "sequence_id": 11},  # in no run
        {"ledger_id": 5, "entry_id": 2, "producer_id": 7, "sequence_id": 25},  # only in ledger 9's run: not earlier
        {"ledger_id": 5, "entry_id": 3, "producer_id": 8, "sequence_id": 5},  # another producer
        {"ledger_id": 5, "entry_id": 4, "producer_id": 7, "sequence_id": 40},  # topic u's pair, not t's
        {"ledger_id": 10, "entry_id": 0, "producer_id": 7, "sequence_id": 25},  # ledger 9 is earlier for ledger 10
        {"ledger_id": 10, "entry_id": 1, "producer_id": 7, "sequence_id": 0},
        {"ledger_id": 10, "entry_id": 2, "entry_type": "COMMIT", "txn_most_bits": 1, "txn_least_bits": 1,
         "producer_id": 7, "sequence_id": 1},  # a marker takes no part in de-duplication
    ])
    found = kernel.duplicates_of_earlier_ledgers(entries, ranges)
    assert positions(found) == [("t", 5, 0), ("t", 10, 0), ("t", 10, 1)]


def test_a_ledgers_first_marker_decides_its_kind_and_duplicates_do_not_count_as_kept_data():
    entries = narrow([
        {"ledger_id": 1, "entry_id": 0, "txn_most_bits": 1, "txn_least_bits": 2, "producer_id": 1, "sequence_id": 0},
        {"ledger_id": 1, "entry_id": 1, "txn_most_bits": 1, "txn_least_bits": 2, "producer_id": 1, "sequence_id": 1},
        {"ledger_id": 1, "entry_id": 2, "entry_type": "ABORT", "txn_most_bits": 1, "txn_least_bits": 2},
        {"ledger_id": 1, "entry_id": 3, "entry_type": "COMMIT", "txn_most_bits": 1, "txn_least_bits": 2},
        {"ledger_id": 1, "entry_id": 4},
    ])
    duplicate = np.array([True, False, False, False, False])
    rows = {(r["txn_least_bits"]): r for r in kernel.by_ledger_txn(entries, duplicate).to_pylist()}
    assert rows[2] == {"topic": "t", "ledger_id": 1, "txn_most_bits": 1, "txn_least_bits": 2, "entry_count": 4,
                       "last_entry_id": 3, "marker_count": 2, "marker_entry_id": 2, "marker_is_commit": False,
                       "data_entry_id": 1, "duplicate_count": 1}
    assert rows[None]["entry_count"] == 1 and rows[None]["marker_is_commit"] is None
