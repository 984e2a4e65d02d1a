"""The incremental transaction buffer (`txn_engine.buffer.refresh`) on real Delta tables.

Histories arrive in chunks (ledgers close, the OPEN ledger grows), each chunk is appended to
`ledger_entries` and refreshed incrementally; the tables must equal both the reference and a
full recompute, also after retention deletes a ledger and after a crash between writes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.buffer_histories import (
    VIOLATIONS,
    T1,
    T2,
    T3,
    brief,
    e,
    expected_tables,
    frame,
    history,
    in_topic,
    planned_joins,
    stored_rows_by_topic,
)
from txn_engine.buffer.refresh import STATE_TABLES, buffer_lock, ledger_inventory, refresh_buffer
from txn_engine.buffer.spark_runner import state_reads
from txn_engine.storage.delta_io import NARROW_ROW_BYTES, DeltaTables, fits_driver
from txn_engine.log.ledgers import derive_ledger_catalog
from txn_engine.storage.locks import TableLockTimeout
from txn_engine.core.log_types import LogEntry
from txn_engine.tier.retention import delete_ledger_rows
from txn_engine.sql.models import discover_models, run_model
from txn_engine.core.schema import (
    ABORTED_TXNS,
    BUFFER_LEDGER_TXNS,
    BUFFER_PENDING_ENTRIES,
    BUFFER_SEQUENCE_RANGES,
    COMMITTED_ENTRIES,
    LEDGER_ENTRIES,
    LEDGER_ENTRY_COLUMNS,
    STABLE_POSITIONS,
    TXN_MARKERS,
    stored_schema,
)
from txn_engine.core.settings import WarehouseSettings
from txn_engine.storage.warehouse import Warehouse

TABLES = (TXN_MARKERS, ABORTED_TXNS, STABLE_POSITIONS, COMMITTED_ENTRIES)


def append(wh, spark, entries: list[LogEntry]) -> None:
    if entries:
        wh.append(LEDGER_ENTRIES, frame(spark, entries))


def inventory(wh):
    """The catalog as `ledgers` would hold it now (without materializing the asset)."""
    return derive_ledger_catalog(wh.read(LEDGER_ENTRIES)).select("topic", "ledger_id", "state", "entry_count", "last_entry_id", "size_bytes")


def refresh(wh, **kwargs):
    """`refresh_buffer` on the catalog as it is now; a bound given as None is the default."""
    return refresh_buffer(wh, inventory(wh), **{k: v for k, v in kwargs.items() if v is not None})


def snapshot(wh) -> dict[str, list[tuple]]:
    return {t: sorted(row for rows in stored_rows_by_topic(wh, t).values() for row in rows) for t in TABLES}


def stored_rows(wh) -> dict[str, list[tuple]]:
    """The four tables and the state, every row as delta-rs reads it: no Spark job per table, for
    the snapshots that are only compared with each other."""
    tables = DeltaTables(wh)
    return {t: sorted((tuple(r.values()) for r in tables.dataset(t).to_table().to_pylist()), key=repr)  # repr: nulls sort
            for t in TABLES + STATE_TABLES}


def reference_rows(entries: list[LogEntry], deleted: list[int] = ()) -> dict:
    expected = expected_tables(entries, deleted)
    return {k: v for k, v in expected.items() if k != "violations"}


def actual_rows(wh) -> dict:
    """The tables in the contract's columns, as the reference gives their rows (the readable txn_id,
    the halves joined, is held to them in tests/test_migrate.py and tests/test_dagster.py)."""
    return {t: stored_rows_by_topic(wh, t) for t in TABLES}


def in_log_order(entries: list[LogEntry]) -> list[LogEntry]:
    return sorted(entries, key=lambda x: (x.ledger_id, x.entry_id, x.topic))


def delete_ledgers(wh, ledger_ids: list[int]) -> None:
    """What retention does to the hot tables: the rows of these ledgers (of every topic) go."""
    ids = set(ledger_ids)
    pairs = sorted({(r.topic, r.ledger_id) for r in wh.read(LEDGER_ENTRIES).select("topic", "ledger_id").distinct().collect()
                    if r.ledger_id in ids})
    delete_ledger_rows(wh, pairs, through_driver=True)


# Each example is a batch of histories (own topics), fed in 2 chunks, recomputed in full, then a
# deletion: every step one computation for all of them. The cost is per step, not per
# history: one example of 12-16 histories checks as many as two of 6-8, in half the steps.
@settings(max_examples=1, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(st.lists(history(), min_size=12, max_size=16), st.data())
def test_incremental_chunks_then_deletion_equal_the_reference(production_spark, tmp_path_factory, histories, data):
    spark = production_spark
    warehouse = Warehouse(spark, WarehouseSettings(warehouse=str(tmp_path_factory.mktemp("wh"))))
    entries = in_log_order([x for i, h in enumerate(histories) for x in in_topic(f"h{i}-", h, prefix=True)])
    cut = data.draw(st.integers(1, len(entries) - 1))
    chunks = [entries[:cut], entries[cut:]]
    for n, chunk in enumerate(chunks):
        append(warehouse, spark, chunk)
        # The second run also asks for a ledger that did not change (a backfill of it).
        asked = data.draw(st.lists(st.sampled_from(sorted({x.ledger_id for x in chunks[0]})), max_size=2)) if n else []
        # In the driver (a log this small); the same scopes on Spark below, whose state must equal
        # these runs' exactly (a first run on Spark, from no state: the named scenarios further down).
        result = refresh(warehouse, ledgers=asked)
        assert (result.full, result.computed_by) == (n == 0, "driver")
        assert actual_rows(warehouse) == reference_rows(entries[:cut] if n == 0 else entries), \
            f"after chunk {n}: {[brief(h) for h in histories]}"
    in_arrow = stored_rows(warehouse)
    # The same scope again on Spark (the path of scopes too big for the driver): the same rows and counts.
    on_spark = refresh(warehouse, ledgers=result.ledgers, driver_write_max_bytes=0)
    assert (on_spark.computed_by, on_spark.ledgers, on_spark.violations) == ("spark", result.ledgers, result.violations)
    assert actual_rows(warehouse) == reference_rows(entries), f"on Spark: {[brief(h) for h in histories]}"
    incremental = stored_rows(warehouse)
    assert incremental == in_arrow  # the state too: the next run reads it
    # A full recompute gives identical tables (and state), and its violations are the reference's
    # totals: in Arrow, a topic per thread (a log this small), and on Spark.
    expected = expected_tables(entries)["violations"]
    for bound, computed_by in ((None, "driver"), (0, "spark")):
        result = refresh(warehouse, full=True, driver_full_run_max_bytes=bound)
        assert (result.full, result.computed_by) == (True, computed_by)
        assert stored_rows(warehouse) == incremental, f"full, computed by {computed_by}: {[brief(h) for h in histories]}"
        assert result.violations == {v: sum(c[i] for c in expected.values()) for i, v in enumerate(VIOLATIONS)}

    # Retention deletes the first ledger of some topics: nothing else changes, as in the reference
    # fed the whole log and then trimmed; a full recompute works on the facts the state kept (in
    # Arrow here: the same on Spark is in test_a_deleted_ledger_changes_no_decision_of_the_ledgers_left).
    first = {}
    for x in entries:
        first.setdefault(x.topic, x.ledger_id)
    gone = sorted(set(data.draw(st.lists(st.sampled_from(sorted(set(first.values()))), min_size=1, max_size=3))))
    delete_ledgers(warehouse, gone)
    expected = reference_rows(entries, gone)
    result = refresh(warehouse)
    assert result.ledgers == [] and result.retained_ledgers == len({(x.topic, x.ledger_id) for x in entries if x.ledger_id in gone})
    assert actual_rows(warehouse) == expected, f"after deleting {gone}: {[brief(h) for h in histories]}"
    result = refresh(warehouse, full=True)
    assert (result.full, result.computed_by) == (True, "driver")
    assert actual_rows(warehouse) == expected, f"full, after deleting {gone}: {[brief(h) for h in histories]}"


# -- named scenarios ---------------------------------------------------------------------------

def assert_sql_models_agree(wh, tables: dict, left: list[LogEntry]) -> None:
    """The analysts' models over the buffer's tables (`dbt-free-sql/`) against those tables and the
    entries `left` in `ledger_entries`: lag, abort rates, the oldest ongoing transaction."""
    models = {m.name: m for m in discover_models()}
    stable = {topic: row for topic, (row,) in tables[STABLE_POSITIONS].items()}
    lag = {r.topic: (r.entries_behind, r.ongoing_txn_count) for r in run_model(wh, models["topic_read_lag"]).collect()}
    assert lag == {t: (sum(1 for x in left if x.topic == t and (x.ledger_id, x.entry_id) > row[1:3]), row[5])
                   for t, row in stable.items()}
    rates = {(r.topic, r.ledger_id): (r.aborted_txns, r.committed_txns) for r in run_model(wh, models["abort_rates"]).collect()}
    outcomes: dict = {}
    for rows in tables[TXN_MARKERS].values():
        for topic, _, _, outcome, ledger, _ in rows:
            aborted, committed = outcomes.get((topic, ledger), (0, 0))
            outcomes[(topic, ledger)] = (aborted + (outcome == "ABORT"), committed + (outcome == "COMMIT"))
    assert rates == outcomes
    oldest = {r.topic: (r.txn_id, r.first_ledger_id, r.first_entry_id, r.data_entries, r.ongoing_txns)
              for r in run_model(wh, models["oldest_ongoing_txn"]).collect()}
    # The oldest ongoing transaction's first kept entry is the one right after the stable position.
    expected = {}
    for t, row in stable.items():
        if row[5]:
            first = min((x for x in left if x.topic == t and (x.ledger_id, x.entry_id) > row[1:3]),
                        key=lambda x: (x.ledger_id, x.entry_id))
            sent = {(x.producer_id, x.sequence_id) for x in left if x.topic == t and x.txn_least_bits == first.txn_least_bits
                    and x.entry_type == "DATA"}
            expected[t] = (f"{first.txn_most_bits}:{first.txn_least_bits}", first.ledger_id, first.entry_id, len(sent), row[5])
    assert oldest == expected


def test_a_deleted_ledger_changes_no_decision_of_the_ledgers_left(spark, warehouse):
    """Retention deletes ledgers; what the buffer decided about the rest stays, as in a broker.

    Before, the topic was recomputed from what was left: late data of a transaction whose marker
    was deleted reopened it and stalled the stable position for ever, and a retry whose first copy
    (aborted) was deleted became readable.
    """
    first = [
        # a: T1's late data in ledger 11 stays late once ledger 10 (its COMMIT) is gone.
        e(10, 0, txn=T1, topic="a"), e(10, 1, "COMMIT", T1, topic="a"), e(11, 0, txn=T1, topic="a"), e(11, 1, topic="a"),
        # r: the first copy of producer 1's sequence 5 was aborted; its retry stays a duplicate.
        e(20, 0, txn=T1, producer=1, seq=5, topic="r"), e(20, 1, "ABORT", T1, topic="r"), e(21, 0, topic="r"),
        e(21, 1, producer=1, seq=5, topic="r"),
        # p: T1 spans the deleted ledger 30 and ledger 31, and commits after the deletion: its entry
        # in 31 is read with local_seq 1, its deleted one not at all.
        e(30, 0, txn=T1, topic="p"), e(30, 1, topic="p"), e(31, 0, txn=T1, topic="p"),
        # s and b share ledger id 1; only s's goes. b's stays as it was, through a backfill of ledger 1.
        e(1, 0, txn=T3, topic="s"), e(1, 1, "COMMIT", T3, topic="s"), e(2, 0, txn=T3, topic="s"), e(2, 1, topic="s"),
        e(1, 0, txn=T2, topic="b"), e(1, 1, "COMMIT", T2, topic="b"), e(1, 2, "ABORT", T3, topic="b"), e(2, 0, topic="b"),
    ]
    later = [e(12, 0, txn=T2, topic="a"), e(12, 1, "COMMIT", T2, topic="a"), e(32, 0, "COMMIT", T1, topic="p"),
             e(22, 0, producer=1, seq=6, topic="r"),
             # a: T3 stays ongoing, with a retry among its entries; r: T2's only data is a retry, so T2 never starts.
             e(12, 2, txn=T3, producer=2, seq=0, topic="a"), e(12, 3, txn=T3, producer=2, seq=0, topic="a"),
             e(12, 4, txn=T3, producer=2, seq=1, topic="a"), e(22, 1, txn=T2, producer=1, seq=6, topic="r")]
    deleted = {"a": [10], "r": [20], "p": [30], "s": [1]}

    def expected(entries):
        by_topic = {}
        for x in entries:
            by_topic.setdefault(x.topic, []).append(x)
        merged: dict = {}
        for topic, rows in by_topic.items():
            for table, per_topic in reference_rows(rows, deleted.get(topic, [])).items():
                merged.setdefault(table, {}).update(per_topic)
        return merged

    append(warehouse, spark, first)
    refresh(warehouse)
    delete_ledger_rows(warehouse, [(t, ledger) for t, ids in deleted.items() for ledger in ids], through_driver=True)
    nothing = refresh(warehouse)
    assert (nothing.ledgers, nothing.retained_ledgers) == ([], 4)
    assert actual_rows(warehouse) == expected(first)
    stable_before = actual_rows(warehouse)[STABLE_POSITIONS]

    append(warehouse, spark, later)
    incremental = refresh(warehouse, ledgers=[1])  # with a backfill of ledger 1 (b's; s's is retained)
    assert (incremental.computed_by, incremental.ledgers) == ("driver", [1, 12, 22, 32])
    tables = actual_rows(warehouse)
    assert tables == expected(first + later)
    visible = len(LEDGER_ENTRY_COLUMNS)  # committed_entries: then visible_ledger_id, visible_entry_id, local_seq
    assert [r[visible:visible + 3] for r in tables[COMMITTED_ENTRIES]["p"] if r[1:3] == (31, 0)] == [(32, 0, 1)]
    assert not [r for r in tables[COMMITTED_ENTRIES]["p"] if r[1] == 30]
    assert tables[STABLE_POSITIONS]["a"][0][1:3] == (12, 1)  # T1's late data holds nothing back; T3 does
    for topic, ((_, ledger, entry, *_),) in stable_before.items():
        assert tables[STABLE_POSITIONS][topic][0][1:3] >= (ledger, entry), f"{topic}'s stable position moved back"
    assert_sql_models_agree(warehouse, tables, [x for x in first + later if x.ledger_id not in deleted.get(x.topic, [])])

    full = refresh(warehouse, full=True, driver_write_max_bytes=0)  # on Spark, on top of the retained facts
    assert (full.full, full.computed_by) == (True, "spark")
    assert actual_rows(warehouse) == tables



# Small incremental runs are computed in the driver and written by delta-rs; big ones on Spark:
# both ways, same tables. On Spark the rows of older ledgers a commit makes visible come from the
# pending state.
@pytest.mark.parametrize("driver_write_max_bytes, written_by, computed_by", [(1 << 20, "driver", "driver"),
                                                                               (0, "spark", "spark")])
def test_newly_closed_ledger_reads_only_its_entries_and_equals_a_full_recompute(spark, warehouse, driver_write_max_bytes,
                                                                                written_by, computed_by):
    bounds = {"driver_write_max_bytes": driver_write_max_bytes, "driver_full_run_max_bytes": driver_write_max_bytes}

    # A transaction spanning ledgers 1 -> 3 (its data in 1 reaches committed_entries from the
    # pending state), a retried send in ledger 3 repeating ledger 1's sequence, a hanging
    # transaction released by ledger 3: the stable position moves and old rows become readable.
    first = [e(1, 0, txn=T1, producer=1, seq=0, topic="a"), e(1, 1, txn=T2, topic="a"), e(1, 2, producer=1, seq=1, topic="a"),
             e(2, 0, topic="b"), e(2, 1, txn=T3, topic="b")]
    later = [e(3, 0, txn=T1, producer=1, seq=0, topic="a"), e(3, 1, txn=T1, topic="a"), e(3, 2, "COMMIT", T1, topic="a"),
             e(3, 3, "ABORT", T2, topic="a"), e(4, 0, topic="b")]
    append(warehouse, spark, first)
    first_run = refresh(warehouse, **bounds)
    assert (first_run.full, first_run.written_by) == (True, written_by)
    before = {r.topic: (r.max_read_ledger_id, r.max_read_entry_id) for r in warehouse.read(STABLE_POSITIONS).collect()}
    assert before == {"a": (1, -1), "b": (2, 0)}
    append(warehouse, spark, later)
    result = refresh(warehouse, **bounds)
    # Ledgers 1 and 2 unchanged: not reread.
    assert (result.full, result.ledgers, result.written_by, result.computed_by) == (False, [3, 4], written_by, computed_by)
    assert result.violations["duplicate"] == 1
    incremental = snapshot(warehouse)
    assert incremental == {k: sorted(v) for k, v in snapshot_of_reference(first + later).items()}
    assert refresh(warehouse, full=True, **bounds).full
    assert snapshot(warehouse) == incremental
    committed = warehouse.read(COMMITTED_ENTRIES).filter("topic = 'a'").orderBy("visible_ledger_id", "visible_entry_id", "local_seq")
    assert [(r.ledger_id, r.entry_id, r.local_seq, r.in_stable_prefix) for r in committed.collect()] == [
        (1, 2, 0, True), (1, 0, 0, True), (3, 1, 1, True)]
    # Either way every table keeps its schema's NOT NULL columns (Spark computes its frames' as nullable).
    for table in (*TABLES, *STATE_TABLES):
        columns = lambda schema: [(f.name, f.dataType, f.nullable) for f in schema.fields]  # noqa: E731
        assert columns(DeltaTables(warehouse).schema(table)) == columns(stored_schema(table)), table


def test_the_state_a_spark_run_reads_is_filtered_where_it_lies_while_its_keys_fit_a_broadcast(spark, warehouse):
    # A Spark incremental run reads the state rows of its scope's producers and transactions. While
    # their keys fit a broadcast they are broadcast as they are, and the state tables are filtered
    # where they are read; with no bound known Spark plans shuffles (AQE may broadcast later, but the
    # state tables were shuffled by then). The same rows either way.
    first = [e(1, 0, txn=T1, producer=1, seq=0, topic="a"), e(1, 1, txn=T2, topic="a"), e(1, 2, producer=1, seq=1, topic="a"),
             e(2, 0, txn=T3, producer=2, seq=0, topic="b"), e(2, 1, producer=3, seq=0, topic="b")]
    later = [e(3, 0, txn=T1, producer=1, seq=2, topic="a"), e(3, 1, "COMMIT", T1, topic="a"), e(4, 0, producer=2, seq=1, topic="b")]
    append(warehouse, spark, first)
    refresh(warehouse)
    append(warehouse, spark, later)
    entries = warehouse.read(LEDGER_ENTRIES).where("ledger_id IN (3, 4)")
    state = {t: warehouse.read(t) for t in STATE_TABLES}
    stable = {r.topic: r.max_read_ledger_id for r in warehouse.read(STABLE_POSITIONS).collect()}
    broadcast = state_reads(state, entries, stable, key_rows=len(first) + len(later))
    shuffled = state_reads(state, entries, stable, key_rows=None)
    past_bound = state_reads(state, entries, stable, key_rows=len(first) + len(later), broadcast_max_bytes=NARROW_ROW_BYTES)
    for table in (BUFFER_SEQUENCE_RANGES, BUFFER_LEDGER_TXNS, BUFFER_PENDING_ENTRIES):
        semi_joins = lambda reads: [j for j in planned_joins(spark, reads[table]) if j != "BroadcastNestedLoopJoin"][:1]  # noqa: E731
        assert semi_joins(broadcast) == ["BroadcastHashJoin"], table
        assert semi_joins(shuffled) == semi_joins(past_bound) == ["SortMergeJoin"], table
        rows = [sorted(map(tuple, reads[table].collect())) for reads in (broadcast, shuffled, past_bound)]
        assert rows[0] == rows[1] == rows[2], table
    # What the scope needs: producer 1's and 2's ranges (not 3's), T1 (touched) and T2, T3 (ongoing).
    assert sorted({(r.topic, r.producer_id) for r in broadcast[BUFFER_SEQUENCE_RANGES].collect()}) == [("a", 1), ("b", 2)]
    assert sorted({(r.topic, r.txn_least_bits) for r in broadcast[BUFFER_LEDGER_TXNS].collect()}) == sorted(
        {("a", T1.least_bits), ("a", T2.least_bits), ("b", T3.least_bits)})


def test_a_log_too_big_for_the_driver_writes_its_narrow_tables_through_it(spark, warehouse):
    # Entries by Spark, the narrow tables (a row per transaction, per topic...) by delta-rs when
    # they fit; the rows are the reference's, and the next (incremental) run reads that state.
    first = [e(1, 0, txn=T1, producer=1, seq=0, topic="a"), e(1, 1, txn=T2, topic="a"), e(1, 2, producer=1, seq=0, topic="a"),
             e(1, 3, "COMMIT", T1, topic="a"), e(2, 0, txn=T3, topic="b"), e(2, 1, "ABORT", T3, topic="b"), e(2, 2, topic="b"),
             # A gap in producer 2's sequence ids: its ranges are read from the entries again (and cached, being counted).
             e(2, 3, producer=2, seq=0, topic="b"), e(2, 4, producer=2, seq=2, topic="b")]
    later = [e(3, 0, txn=T2, producer=1, seq=1, topic="a"), e(3, 1, "COMMIT", T2, topic="a"),
             e(4, 0, producer=2, seq=2, topic="b"), e(4, 1, producer=2, seq=1, topic="b")]  # a repeat, then the gap filled
    # Payloads of 1 KB: a log of a few KB, its narrow tables a few rows.
    first = [replace(x, payload=bytes(1024) + x.payload) if x.payload else x for x in first]
    append(warehouse, spark, first)
    log_bytes = sum(r.size_bytes for r in inventory(warehouse).collect())
    # Below the log's size, above any of its narrow tables (a few rows of NARROW_ROW_BYTES).
    assert log_bytes - 1 >= len(first) * NARROW_ROW_BYTES
    result = refresh(warehouse, full=True, driver_write_max_bytes=log_bytes - 1, driver_full_run_max_bytes=0)
    assert (result.full, result.written_by) == (True, "spark")
    # Spark's Delta writer names itself "Apache-Spark/...", delta-rs "delta-rs:...". No table is
    # empty here (an empty one fits the driver whatever the bound): T2's entry is pending.
    tables = DeltaTables(warehouse)
    engines = {t: tables.last_commit(t)["engineInfo"].split(":")[0].split("/")[0] for t in (*TABLES, *STATE_TABLES)}
    assert engines == {t: "Apache-Spark" if t in (COMMITTED_ENTRIES, BUFFER_PENDING_ENTRIES) else "delta-rs" for t in engines}
    assert snapshot(warehouse) == {k: sorted(v) for k, v in snapshot_of_reference(first).items()}
    append(warehouse, spark, later)
    assert refresh(warehouse).ledgers == [3, 4]
    assert snapshot(warehouse) == {k: sorted(v) for k, v in snapshot_of_reference(first + later).items()}


def test_fits_driver_bounds_rows_by_their_bytes(spark):
    three = spark.range(3)
    assert fits_driver(three, 3 * NARROW_ROW_BYTES) and not fits_driver(three, 3 * NARROW_ROW_BYTES - 1)
    # A bound below one row: nothing is counted (the Spark path of the tests runs with a bound of 0).
    assert not fits_driver(three.limit(0), NARROW_ROW_BYTES - 1) and fits_driver(three.limit(0), NARROW_ROW_BYTES)


def test_a_local_frame_reaches_spark_as_arrow_without_python_workers(spark):
    from txn_engine.storage.arrow_frames import local_frame
    from txn_engine.core.schema import STABLE_POSITIONS_SCHEMA

    schema = "topic string, _id long, _count int"
    rows = [("a", 1, 2), ("b", None, 3)]
    frame_ = local_frame(spark, rows, schema)
    # A scan of rows the plan holds; a list's frame scans a Python RDD (its executors unpickle it).
    assert frame_._jdf.queryExecution().executedPlan().toString().startswith("LocalTableScan")
    assert "LocalTableScan" not in spark.createDataFrame(rows, schema)._jdf.queryExecution().executedPlan().toString()
    assert frame_.collect() == spark.createDataFrame(rows, schema).collect()
    stable = [{"topic": "t", "max_read_ledger_id": 1, "max_read_entry_id": 0, "last_ledger_id": 1, "last_entry_id": 0,
               "ongoing_txn_count": 0}]
    assert local_frame(spark, stable, STABLE_POSITIONS_SCHEMA).schema == STABLE_POSITIONS_SCHEMA
    assert local_frame(spark, [], STABLE_POSITIONS_SCHEMA).count() == 0


def snapshot_of_reference(entries: list[LogEntry]) -> dict[str, list[tuple]]:
    ref = reference_rows(entries)
    return {TXN_MARKERS: [r for rows in ref["txn_markers"].values() for r in rows],
            ABORTED_TXNS: [r for rows in ref["aborted_txns"].values() for r in rows],
            STABLE_POSITIONS: [r for rows in ref["stable_positions"].values() for r in rows],
            COMMITTED_ENTRIES: [r for rows in ref["committed_entries"].values() for r in rows]}


class Crash(Exception):
    pass


FIRST = [e(1, 0, txn=T1), e(1, 1), e(1, 2, txn=T2, producer=4, seq=0)]
LATER = [e(2, 0, "COMMIT", T1), e(2, 1, txn=T2, producer=4, seq=0), e(2, 2, "COMMIT", T2), e(2, 3)]


def refreshed_then_later(spark):
    """A warehouse whose buffer holds FIRST, with LATER appended since (`prepared`'s builder)."""

    def build(wh, _folder):
        append(wh, spark, FIRST)
        refresh(wh)
        append(wh, spark, LATER)

    return build


# Incremental runs, and full ones (in Arrow, a topic per thread: the tables of every topic written at once).
@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("crash_after", [COMMITTED_ENTRIES, "buffer_sequence_ranges"])
def test_a_run_stopped_between_writes_is_completed_by_the_next(spark, prepared, crash_after, full):
    warehouse = prepared("buffer-refreshed-then-later", refreshed_then_later(spark))

    def crash(table: str) -> None:
        if table == crash_after:
            raise Crash(table)

    with pytest.raises(Crash):
        refresh(warehouse, after_write=crash, full=full)
    result = refresh(warehouse, lock_timeout_s=0.5)  # the crashed run let go of the buffer lock
    assert result.ledgers == [2]
    assert snapshot(warehouse) == {k: sorted(v) for k, v in snapshot_of_reference(FIRST + LATER).items()}


def test_a_second_run_waits_for_the_first_and_both_end_as_a_full_recompute(spark, prepared):
    """Run A pauses after its first write; new data arrives and run B starts. Without a lock over
    the whole run B ran to the end in between, then A wrote a stable position from before B's data
    (moved backwards, a committed row missing) and both succeeded. Threads of one process exclude
    each other as processes do (a flock per open file)."""
    warehouse = prepared("buffer-refreshed-then-later", refreshed_then_later(spark))
    more = [e(3, 0, txn=T3), e(3, 1, "COMMIT", T3), e(3, 2)]  # the stable position moves to (3, 2)
    paused, resume, runs = threading.Event(), threading.Event(), {}

    def pause_once(table: str) -> None:
        if not paused.is_set():
            paused.set()
            assert resume.wait(120)

    def run(name: str, **kwargs) -> None:
        try:
            runs[name] = refresh(warehouse, **kwargs)
        except BaseException as error:  # noqa: BLE001 - reported by the assertions below
            runs[name] = error

    a = threading.Thread(target=run, args=("a",), kwargs={"after_write": pause_once})
    a.start()
    try:
        assert paused.wait(120), runs
        append(warehouse, spark, more)
        # While A holds it, a run with a short timeout is refused, saying what holds it.
        with pytest.raises(TableLockTimeout, match="the transaction buffer of this warehouse"):
            with buffer_lock(warehouse, timeout_s=0.3):
                pass
        b = threading.Thread(target=run, args=("b",))
        b.start()
        b.join(0.5)
        assert b.is_alive() and "b" not in runs  # waiting for A
    finally:
        resume.set()
        a.join(120)
    b.join(120)
    assert [runs["a"].ledgers, runs["b"].ledgers] == [[2], [3]], runs
    assert snapshot(warehouse) == {k: sorted(v) for k, v in snapshot_of_reference(FIRST + LATER + more).items()}


def test_retention_waits_for_a_buffer_run(spark, prepared):
    """Retention deletes under the buffer's lock: a run between its reading the log and its writes
    would otherwise write the deleted ledger's rows back."""
    warehouse = prepared("buffer-refreshed-then-later", refreshed_then_later(spark))
    ledgers_of = lambda table: {r.ledger_id for r in warehouse.read(table).select("ledger_id").distinct().collect()}  # noqa: E731
    deleted_at: list[float] = []  # when the derived tables' deletes were done (the retention hook)
    with buffer_lock(warehouse):  # as a buffer run holds it
        deleting = threading.Thread(target=delete_ledger_rows, args=(warehouse, [("t", 1)], True),
                                    kwargs={"hook": lambda point: deleted_at.append(time.monotonic())})
        deleting.start()
        deleting.join(1.0)
        assert deleting.is_alive()  # waiting for the run
        released_at = time.monotonic()
    deleting.join(60)
    assert deleted_at and deleted_at[0] > released_at  # nothing deleted while the run held the lock
    assert 1 not in ledgers_of(LEDGER_ENTRIES) and 1 not in ledgers_of(COMMITTED_ENTRIES)


def test_inventory_comes_from_the_catalog_without_deleted_ledgers(spark, warehouse):
    from txn_engine.log.ledgers import record_ledger_states
    from txn_engine.core.schema import LEDGERS

    append(warehouse, spark, [e(1, 0), e(1, 1), e(2, 0)])
    record_ledger_states(warehouse, [("t", 1, "DELETED", "retention")])
    assert sorted(tuple(r.values())[:4] for r in ledger_inventory(warehouse).to_pylist()) == [("t", 2, 1, 0)]
    warehouse.overwrite(LEDGERS, derive_ledger_catalog(warehouse.read(LEDGER_ENTRIES)))
    assert sorted(tuple(r.values())[:4] for r in ledger_inventory(warehouse).to_pylist()) == [("t", 1, 2, 1), ("t", 2, 1, 0)]
    assert warehouse.exists(LEDGER_ENTRIES) and not warehouse.exists(BUFFER_LEDGER_TXNS)


def test_a_stable_move_flips_rows_only_where_a_row_not_rewritten_can_lie():
    from txn_engine.buffer.refresh import flip_may_match

    ledgers = {1: 9, 3: 4, 5: 2}  # ledger -> last entry, per the catalog
    # The topic had nothing ongoing (stable at its end); a new ledger 5 moves it: only ledger 5 lies between.
    assert not flip_may_match((3, 4), (5, 1), ledgers, rewritten={5})
    # Ledger 3 lies between and the run does not rewrite it.
    assert flip_may_match((3, 2), (5, 1), ledgers, rewritten={5})
    # A backfill of ledger 3: its rows may be visible in ledger 5, which stays.
    assert flip_may_match((3, 2), (3, 4), ledgers, rewritten={3})
    assert not flip_may_match((3, 2), (3, 4), ledgers, rewritten={3, 5})
    # Backwards, and from no stored position (a new topic) alike.
    assert flip_may_match((5, 1), (1, 3), ledgers, rewritten={5})
    assert not flip_may_match(None, (5, 2), ledgers, rewritten={1, 3, 5})


def test_closed_ledgers_behind_the_state_follow_the_catalog_rules():
    # The sensor's rule, on a catalog as delta-rs reads it: closed (CLOSED, OFFLOADED) ledgers that
    # `ledger_entries` holds (entries, not DELETED) and the state does not hold at their counts.
    import pyarrow as pa

    from txn_engine.buffer.refresh import closed_ledger_counts, closed_ledger_ids, ledgers_behind

    catalog = pa.table({
        "topic": ["a", "a", "a", "b", "b", "b", "c"],
        "ledger_id": [1, 2, 3, 4, 5, 6, 7],
        "entry_count": [10, 5, 0, 3, 8, 2, 4],
        "last_entry_id": [9, 4, -1, 2, 7, 1, 3],
        "state": ["CLOSED", "OFFLOADED", "CLOSED", "DELETED", "CLOSED", "OPEN", "CLOSED"],
    })
    state = {("a", 1): (10, 9), ("a", 2): (4, 3), ("b", 5): (8, 7), ("c", 7): (3, 2), ("b", 6): (1, 0)}
    assert closed_ledger_ids(catalog) == [1, 2, 3, 5, 7]
    # 1 and 5 held at their counts; 2 and 7 grew after they were computed; 3 is empty, 4 deleted,
    # 6 still OPEN (a buffer run picks it up by itself).
    closed = closed_ledger_counts(catalog)
    assert closed == {("a", 1): (10, 9), ("a", 2): (5, 4), ("b", 5): (8, 7), ("c", 7): (4, 3)}
    assert ledgers_behind(closed, state) == {("a", 2): (5, 4), ("c", 7): (4, 3)}
    assert ledgers_behind(closed, {}) == closed


def test_stored_ledger_counts_fold_the_state_batch_by_batch(warehouse, monkeypatch):
    # A row per (ledger, transaction) in several files; folded a batch at a time with partial
    # results folded again every row (FOLD_ROWS 1), it still gives each ledger's sum and max.
    from txn_engine.storage import delta_io
    from txn_engine.buffer.refresh import stored_ledger_counts
    from txn_engine.core.schema import BUFFER_LEDGER_TXNS_SCHEMA, BUFFER_SEQUENCE_RANGES, BUFFER_SEQUENCE_RANGES_SCHEMA

    def row(topic, ledger, txn, count, last):
        return {"topic": topic, "ledger_id": ledger, "txn_most_bits": None if txn is None else 0, "txn_least_bits": txn,
                "entry_count": count, "last_entry_id": last, "marker_count": 0, "duplicate_count": 0}

    tables = DeltaTables(warehouse)
    assert stored_ledger_counts(warehouse) == {}  # no state
    tables.overwrite(BUFFER_SEQUENCE_RANGES, [], BUFFER_SEQUENCE_RANGES_SCHEMA)  # with it, the state is current
    tables.append(BUFFER_LEDGER_TXNS, BUFFER_LEDGER_TXNS_SCHEMA,
                  [row("a", 1, None, 3, 2), row("a", 1, 7, 2, 4), row("b", 1, 7, 1, 0)])
    tables.append(BUFFER_LEDGER_TXNS, BUFFER_LEDGER_TXNS_SCHEMA, [row("a", 1, 8, 1, 3), row("a", 2, None, 5, 4)])
    monkeypatch.setattr(delta_io, "FOLD_ROWS", 1)
    assert stored_ledger_counts(warehouse) == {("a", 1): (6, 4), ("b", 1): (1, 0), ("a", 2): (5, 4)}
