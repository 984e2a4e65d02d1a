"""The buffer's asset checks (`txn_engine.buffer.checks`): whole tables after a full run, the last
run's rows (against the rest) after an incremental one, and each catches what it guards against."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from tests.test_buffer_incremental import T1, T2, T3, append, e, refresh
from txn_engine.buffer.checks import committed_once, last_run_ledgers, markers_match, stable_moves_back
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.core.schema import (
    COMMITTED_ENTRIES,
    COMMITTED_ENTRIES_SCHEMA,
    STABLE_POSITIONS,
    STABLE_POSITIONS_SCHEMA,
    TXN_MARKERS,
    TXN_MARKERS_SCHEMA,
)

FIRST = [e(1, 0, txn=T1, producer=1, seq=0), e(1, 1, txn=T2), e(1, 2, producer=1, seq=1), e(2, 0, topic="b"),
         e(2, 1, txn=T3, topic="b")]
LATER = [e(3, 0, txn=T1, producer=1, seq=2), e(3, 1, "COMMIT", T1), e(3, 2, "ABORT", T2), e(3, 3, producer=1, seq=3),
         e(4, 0, topic="b")]


def rows_of(wh, table: str, **equal) -> pa.Table:
    data = DeltaTables(wh).dataset(table).to_table()
    for column, value in equal.items():
        data = data.filter(pc.equal(data[column], value))
    return data


def with_values(row: pa.Table, **values) -> pa.Table:
    """A one-row table with some columns set (each keeps its field: type and nullability)."""
    for column, value in values.items():
        index = row.schema.get_field_index(column)
        row = row.set_column(index, row.schema.field(index), pa.array([value], row.schema.field(index).type))
    return row


def break_committed_entries(warehouse) -> None:
    """Corruption in ledger 3: an old row again (visible in ledger 3: its position and its sequence
    repeat a row of ledger 1), a row of the aborted T2, a marker."""
    old_row = rows_of(warehouse, COMMITTED_ENTRIES, ledger_id=1, entry_id=2)
    again = with_values(old_row, visible_ledger_id=3)
    aborted = with_values(again, txn_most_bits=T2[0], txn_least_bits=T2[1], entry_id=9, sequence_id=None)
    marker = with_values(aborted, entry_type="COMMIT", txn_least_bits=T1[1], entry_id=10)
    DeltaTables(warehouse).append(COMMITTED_ENTRIES, COMMITTED_ENTRIES_SCHEMA, pa.concat_tables([again, aborted, marker]))


def test_checks_read_the_whole_tables_after_a_full_run_and_the_runs_rows_after_an_incremental_one(spark, warehouse):
    append(warehouse, spark, FIRST)
    assert refresh(warehouse).full
    assert last_run_ledgers(warehouse) is None
    whole = committed_once(warehouse)
    assert (whole.passed, whole.checked) == (True, "whole table")
    assert markers_match(warehouse).markers_without_entry == 0
    assert stable_moves_back(warehouse) is None  # the first version: nothing to compare

    append(warehouse, spark, LATER)
    assert refresh(warehouse).ledgers == [3, 4]
    assert last_run_ledgers(warehouse) == [3, 4]
    scoped = committed_once(warehouse)
    assert scoped.passed and scoped.checked.startswith("rows of the 2 ledger(s) the last run rewrote: 3, 4")
    markers = markers_match(warehouse)
    assert (markers.markers_without_entry, markers.txns_with_split_outcome) == (0, [])
    assert "3, 4" in markers.checked
    assert stable_moves_back(warehouse).moved_back == []
    # The same after delta-rs rewrote the markers' files (an UPDATE, DELETE or OPTIMIZE by delta-rs
    # stores strings as string_view, where pyarrow cannot push a condition on `outcome` down).
    DeltaTables(warehouse).update(TXN_MARKERS, {"outcome": "outcome"}, "true")
    assert committed_once(warehouse) == scoped

    tables = DeltaTables(warehouse)
    break_committed_entries(warehouse)
    broken = committed_once(warehouse)
    assert not broken.passed
    assert (broken.duplicate_positions, broken.duplicate_sequences, broken.entries_of_uncommitted_txns, broken.markers) == \
        (1, 1, 1, 1)

    # A marker row in the run's ledgers that no entry of ledger_entries backs, and a second outcome for T1.
    fake = with_values(rows_of(warehouse, TXN_MARKERS, txn_least_bits=T1[1]), outcome="ABORT", topic="b", ledger_id=4)
    tables.append(TXN_MARKERS, TXN_MARKERS_SCHEMA, fake)
    assert markers_match(warehouse).markers_without_entry == 1
    assert markers_match(warehouse).txns_with_split_outcome == [f"{T1[0]}:{T1[1]}"]


def test_the_stable_position_check_compares_the_last_two_versions(spark, warehouse):
    append(warehouse, spark, FIRST)
    refresh(warehouse)
    stable = DeltaTables(warehouse).dataset(STABLE_POSITIONS).to_table()
    # A later version that moves topic t back to before its first entry.
    moved = stable.set_column(stable.schema.get_field_index("max_read_entry_id"), "max_read_entry_id",
                              pc.if_else(pc.equal(stable["topic"], "t"), -5, stable["max_read_entry_id"]))
    DeltaTables(warehouse).overwrite(STABLE_POSITIONS, moved, STABLE_POSITIONS_SCHEMA)
    moves = stable_moves_back(warehouse)
    assert len(moves.moved_back) == 1 and moves.moved_back[0].startswith("('t', 1,")


def test_the_sequence_check_reads_only_the_ledgers_whose_runs_overlap_the_runs_sequences(spark, warehouse):
    from txn_engine.buffer.checks import _ledgers_sharing_sequences, _null_epoch_as_value

    append(warehouse, spark, FIRST)
    refresh(warehouse)
    append(warehouse, spark, LATER)
    refresh(warehouse)
    # Producer 1 (epoch 0) holds sequences 0-1 in ledger 1 and 2-3 in ledger 3. The next run's 4-5
    # overlap neither, and its sequence 0 without an epoch is another key: only its own ledger is read.
    append(warehouse, spark, [e(5, 0, producer=1, seq=4), e(5, 1, producer=1, seq=5), e(5, 2, producer=1, seq=0, epoch=None),
                              e(5, 3, producer=2, seq=0)])
    assert refresh(warehouse).ledgers == [5]
    assert committed_once(warehouse).passed
    tables = DeltaTables(warehouse)

    def ledgers_read() -> list[int]:
        rows = _null_epoch_as_value(rows_of(warehouse, COMMITTED_ENTRIES, visible_ledger_id=5))
        return sorted(set(_ledgers_sharing_sequences(tables, rows.filter(pc.is_valid(rows["producer_id"]))).to_pylist()))

    assert ledgers_read() == [5]
    # A retried send the buffer failed to drop: sequence 2 of producer 1 again, in ledger 5. Its
    # first copy is in ledger 3, whose run holds sequence 2: read, and the repeat found.
    first_copy = rows_of(warehouse, COMMITTED_ENTRIES, ledger_id=3, entry_id=0)
    retried = with_values(first_copy, ledger_id=5, entry_id=9, visible_ledger_id=5, visible_entry_id=9,
                          txn_most_bits=None, txn_least_bits=None)
    tables.append(COMMITTED_ENTRIES, COMMITTED_ENTRIES_SCHEMA, retried)
    assert ledgers_read() == [3, 5]
    broken = committed_once(warehouse)
    assert (broken.duplicate_sequences, broken.duplicate_positions, broken.entries_of_uncommitted_txns) == (1, 0, 0)


def test_whole_table_checks_find_the_same_in_the_driver_and_on_spark(spark, warehouse):
    """After a full run the checks read the whole tables: by delta-rs while they fit the driver,
    on Spark when told (`TXNLAKE_COMPUTE=spark`) or beyond the bound; both count the same breakage."""
    from txn_engine.core.settings import WarehouseSettings
    from txn_engine.storage.warehouse import Warehouse

    append(warehouse, spark, FIRST + LATER)
    assert refresh(warehouse).full and last_run_ledgers(warehouse) is None
    tables = DeltaTables(warehouse)
    break_committed_entries(warehouse)
    fake = with_values(rows_of(warehouse, TXN_MARKERS, txn_least_bits=T1[1]), outcome="ABORT", topic="b", ledger_id=4)
    tables.append(TXN_MARKERS, TXN_MARKERS_SCHEMA, fake)

    root = warehouse.settings.warehouse
    on_spark = Warehouse(spark, WarehouseSettings(warehouse=root, compute="spark"))
    beyond_the_bound = Warehouse(spark, WarehouseSettings(warehouse=root, driver_full_run_max_bytes=1))
    counts = []
    for wh in (warehouse, on_spark, beyond_the_bound):
        once, markers = committed_once(wh), markers_match(wh)
        assert once.checked == markers.checked == "whole table"
        counts.append(((once.duplicate_positions, once.duplicate_sequences, once.entries_of_uncommitted_txns, once.markers),
                       (markers.markers_without_entry, markers.txns_with_split_outcome)))
    assert counts[0] == ((1, 1, 1, 1), (1, [f"{T1[0]}:{T1[1]}"])), counts[0]
    assert counts[1] == counts[2] == counts[0]
