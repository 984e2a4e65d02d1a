"""The transaction-buffer kernel (`txn_engine.buffer.kernel`) against the pure-Python reference.

No JVM: the kernel runs in this process, a topic at a time as both of its runners call it, so
the random histories get many examples. `test_the_kernel_on_spark_equals_the_reference` runs the
same scenarios through the Spark runner (`spark_runner`): the wiring, not the rules.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.buffer_histories import (
    BIG,
    SCENARIOS,
    VIOLATIONS,
    brief,
    e,
    expected_tables,
    frame,
    history,
    in_topic,
    planned_joins,
    rows_by_topic,
)
from txn_engine.buffer import kernel
from txn_engine.buffer.spark_runner import BufferTables, decide_full, ledger_chunks, wide_tables
from txn_engine.storage.arrow_frames import arrow_schema
from txn_engine.core.errors import TxnlakeError
from txn_engine.core.log_types import LogEntry
from txn_engine.core.positions import Position
from txn_engine.core.schema import (
    ABORTED_TXNS,
    ABORTED_TXNS_SCHEMA,
    BUFFER_PENDING_ENTRIES,
    COMMITTED_ENTRIES,
    COMMITTED_ENTRIES_SCHEMA,
    LEDGER_ENTRIES_SCHEMA,
    LEDGER_ENTRY_COLUMNS,
    STABLE_POSITIONS,
    STABLE_POSITIONS_SCHEMA,
    TXN_MARKERS,
    TXN_MARKERS_SCHEMA,
)

CONTRACT = {TXN_MARKERS: TXN_MARKERS_SCHEMA, ABORTED_TXNS: ABORTED_TXNS_SCHEMA, STABLE_POSITIONS: STABLE_POSITIONS_SCHEMA,
            COMMITTED_ENTRIES: COMMITTED_ENTRIES_SCHEMA}


def arrow_entries(entries: list[LogEntry]) -> pa.Table:
    return pa.Table.from_pylist([{c: getattr(x, c) for c in LEDGER_ENTRY_COLUMNS} for x in entries],
                                schema=arrow_schema(LEDGER_ENTRIES_SCHEMA))


def naive(value):
    """Timestamps as the reference holds them: naive UTC."""
    return value.replace(tzinfo=None) if isinstance(value, datetime) else value


def kernel_tables(entries: list[LogEntry]) -> tuple[dict[str, dict], dict[str, pa.Table]]:
    """The four tables and violations per topic, in `expected_tables`' shape, by the kernel run a
    topic at a time (as both runners run it); and the tables as Arrow, all topics together."""
    table = arrow_entries(entries)
    out: dict[str, dict] = {name: {} for name in (*CONTRACT, "violations")}
    arrow: dict[str, list[pa.Table]] = {name: [] for name in CONTRACT}
    # In reverse: the kernel must not depend on the order it is given the entries in.
    table = table.take(pa.array(range(table.num_rows - 1, -1, -1))) if table.num_rows else table
    for topic in sorted(set(table["topic"].to_pylist())):
        rows = table.filter(pc.equal(table["topic"], topic))
        decided = kernel.full_scope_tables(rows)
        tables = kernel.wide_tables(decided, rows)
        for name in CONTRACT:
            arrow[name].append(tables[name])
            found = sorted(tuple(naive(v) for v in r.values()) for r in tables[name].to_pylist())
            if found:
                out[name][topic] = found
        out["violations"][topic] = tuple(decided.violations[v] for v in VIOLATIONS)
    return out, {name: pa.concat_tables(parts) if parts else arrow_schema(CONTRACT[name]).empty_table()
                 for name, parts in arrow.items()}


@pytest.fixture(scope="module")
def scenario_entries() -> list[LogEntry]:
    return [x for topic, entries in SCENARIOS.items() for x in in_topic(topic, entries)]


@pytest.fixture(scope="module")
def scenarios(scenario_entries):
    return kernel_tables(scenario_entries)


def stable_of(actual, topic: str) -> tuple[Position, Position, int]:
    (_, max_l, max_e, last_l, last_e, ongoing), = actual["stable_positions"][topic]
    return Position(max_l, max_e), Position(last_l, last_e), ongoing


def test_every_scenario_equals_the_reference(scenarios, scenario_entries):
    actual, _ = scenarios
    expected = expected_tables(scenario_entries)
    for table in expected:
        assert actual[table] == expected[table], table


def test_seed_worked_example_over_prefixes(scenarios):
    actual, _ = scenarios
    trace = [stable_of(actual, f"seed-{n}")[0] for n in range(1, 9)]
    assert [p.entry_id for p in trace] == [-1, -1, -1, 0, 0, 0, 4, 7]
    assert {p.ledger_id for p in trace} == {1}
    committed = actual["committed_entries"]["seed-8"]
    assert sorted((r[-4], r[-3], r[-2], r[2]) for r in committed) == [
        (1, 3, 0, 0), (1, 3, 1, 2), (1, 6, 0, 1), (1, 6, 1, 4), (1, 7, 0, 5)]
    assert actual["violations"]["seed-8"] == (0, 0, 0, 0)


@pytest.mark.parametrize("topic, max_read, last, ongoing", [
    ("previous-ledger", (2, 1), (4, 1), 1),
    ("first-ledger", (5, -1), (5, 1), 1),
    ("mid-ledger", (5, 0), (5, 1), 1),
    ("entry-gap", (1, 4), (1, 5), 1),
    ("earliest-not-latest", (1, 0), (2, 1), 1),
    ("none-ongoing", (3, 0), (3, 0), 0),
    ("previous-ledger-ends-dropped", (3, 2), (7, 1), 1),
    ("first-kept-entry", (1, 1), (1, 2), 1),
    ("large-ids", (BIG, 1), (BIG + 3, 1), 1),
])
def test_stable_positions_across_ledgers(scenarios, topic, max_read, last, ongoing):
    actual, _ = scenarios
    assert stable_of(actual, topic) == (Position(*max_read), Position(*last), ongoing)


@pytest.mark.parametrize("topic, violations", [
    ("duplicate", Counter(duplicate=2)),
    ("no-sequence-no-duplicate", Counter()),
    ("duplicate-of-aborted", Counter(duplicate=1)),
    ("data-after-marker", Counter(data_after_marker=2)),
    ("duplicate-marker", Counter(duplicate_marker=2)),
    ("marker-without-data", Counter(marker_without_data=2)),
    ("epoch-restart", Counter(duplicate=2)),
    ("sequence-topic-a", Counter()),
    ("sequence-topic-b", Counter()),
])
def test_each_violation(scenarios, topic, violations):
    actual, _ = scenarios
    assert actual["violations"][topic] == tuple(violations[v] for v in VIOLATIONS)


def test_violation_rules_shape_the_tables(scenarios):
    actual, _ = scenarios
    positions = lambda topic: [(r[1], r[2]) for r in actual["committed_entries"].get(topic, [])]  # noqa: E731
    # A duplicate never starts a transaction and is never visible.
    assert positions("duplicate") == [(1, 0), (1, 3)]
    assert stable_of(actual, "duplicate")[2] == 0
    # Late data is dropped; the first marker wins; a marker without data still aborts.
    assert positions("data-after-marker") == [(1, 0)]
    assert actual["txn_markers"]["duplicate-marker"] == [("duplicate-marker", 0, 1, "COMMIT", 1, 1)]
    assert "duplicate-marker" not in actual["aborted_txns"]
    assert actual["aborted_txns"]["marker-without-data"] == [("marker-without-data", 0, 1, 1, 0)]
    assert positions("marker-without-data") == []


def test_non_transactional_entries_are_visible_at_their_own_position(scenarios):
    actual, _ = scenarios
    rows = actual["committed_entries"]["non-transactional"]
    # (ledger, entry, visible ledger, visible entry, local_seq, in_stable_prefix); (1, 1) is T1's, open.
    assert [(r[1], r[2], r[-4], r[-3], r[-2], r[-1]) for r in rows] == [
        (1, 0, 1, 0, 0, True), (1, 2, 1, 2, 0, False), (2, 0, 2, 0, 0, False)]
    assert rows[0][LEDGER_ENTRY_COLUMNS.index("payload")] == b"payload 1:0"


def ledger_order(committed: pa.Table, topic: str) -> list[tuple[int, int]]:
    """The Pulsar/Kafka reader: `WHERE in_stable_prefix ORDER BY ledger_id, entry_id`."""
    rows = committed.filter(pc.and_(pc.equal(committed["topic"], topic), committed["in_stable_prefix"]))
    return sorted((r["ledger_id"], r["entry_id"]) for r in rows.to_pylist())


def commit_order(committed: pa.Table, topic: str) -> list[tuple[int, int, int]]:
    """The DistributedLog reader: `ORDER BY visible_ledger_id, visible_entry_id, local_seq`."""
    rows = sorted(committed.filter(pc.equal(committed["topic"], topic)).to_pylist(),
                  key=lambda r: (r["visible_ledger_id"], r["visible_entry_id"], r["local_seq"]))
    return [(r["ledger_id"], r["entry_id"], r["local_seq"]) for r in rows]


def test_hanging_transaction_stalls_ledger_order_but_not_commit_order(scenarios):
    _, tables = scenarios
    committed = tables[COMMITTED_ENTRIES]
    assert ledger_order(committed, "hanging") == [(1, 0)]
    assert commit_order(committed, "hanging") == [(1, 0, 0), (1, 3, 0), (1, 2, 0), (1, 4, 1)]
    assert ledger_order(committed, "hanging-then-committed") == [(1, i) for i in range(5)]
    assert commit_order(committed, "hanging-then-committed") == [(1, 0, 0), (1, 3, 0), (1, 2, 0), (1, 4, 1), (1, 1, 0)]


def test_commit_order_never_shows_part_of_a_transaction(scenarios):
    _, tables = scenarios
    assert commit_order(tables[COMMITTED_ENTRIES], "open-transaction") == []
    assert commit_order(tables[COMMITTED_ENTRIES], "closed-transaction") == [(1, 0, 0), (1, 1, 1), (1, 2, 2)]


def test_tables_have_the_contract_schemas(scenarios):
    _, tables = scenarios
    for name, schema in CONTRACT.items():
        assert tables[name].schema == arrow_schema(schema), name


def test_empty_log():
    actual, tables = kernel_tables([])
    assert all(t.num_rows == 0 for t in tables.values()) and actual["violations"] == {}
    decided = kernel.full_scope_tables(arrow_entries([]))
    assert decided.violations == dict.fromkeys(VIOLATIONS, 0)


def test_missing_columns_are_named():
    with pytest.raises(TxnlakeError, match="missing: .*payload"):
        kernel.require_ledger_entries(arrow_entries([e(1, 0)]).drop_columns(["payload"]))


# No shrinking needed to read a failure: the message names the history, as short tuples.
@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                   HealthCheck.data_too_large])
@given(history())
def test_random_histories_equal_the_reference(entries):
    actual, _ = kernel_tables(entries)
    expected = expected_tables(entries)
    for table in expected:
        assert actual[table] == expected[table], f"table {table}: {brief(entries)}"


def decoded_segments(segments: pa.Table) -> list[tuple]:
    """The rows a segment table encodes (`kernel.visible_segments`), decoded independently."""
    rows = []
    for seg in segments.to_pylist():
        for offset, code in enumerate(seg["codes"]):
            if code < 0:
                continue
            ledger, entry = seg["ledger_id"], seg["first_entry_id"] + offset
            target = seg["targets"][(code >> kernel.CODE_TARGET_SHIFT) & kernel.CODE_TARGET_MASK] if not code & 1 else None
            visible = (ledger, entry) if code & 1 else (target["ledger_id"], target["entry_id"])
            assert not code & 2, "bit 1 is unused"
            rows.append((ledger, entry, *visible, code >> kernel.CODE_SEQ_SHIFT))
    return sorted(rows)


def visible_rows(visible: pa.Table) -> list[tuple]:
    columns = ["ledger_id", "entry_id", "visible_ledger_id", "visible_entry_id", "local_seq"]
    return sorted(zip(*(visible[c].to_pylist() for c in columns)))


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                   HealthCheck.data_too_large])
@given(history())
def test_visible_segments_encode_every_visible_decision(entries):
    table = arrow_entries(entries)
    for topic in sorted(set(table["topic"].to_pylist())):
        visible = kernel.full_scope_tables(table.filter(pc.equal(table["topic"], topic))).tables[kernel.VISIBLE]
        segments = kernel.visible_segments(visible)
        assert decoded_segments(segments) == visible_rows(visible), brief(entries)
        assert segments.schema == kernel.SEGMENT_SCHEMA


def test_visible_segments_split_at_gaps_and_keep_foreign_targets():
    visible = pa.table({
        "topic": ["t"] * 5, "ledger_id": [1, 1, 1, 2, 2], "entry_id": [0, 1, 5000, 0, 3],
        "_row": [0, 1, 2, 3, 4],
        "visible_ledger_id": [1, 2, 1, 2, 2], "visible_entry_id": [0, 3, 5000, 3, 3],
        "local_seq": [0, 0, 0, 1, 0], "in_stable_prefix": [True, False, True, False, False],
    })
    segments = kernel.visible_segments(visible)
    assert [(s["ledger_id"], s["first_entry_id"], s["last_entry_id"]) for s in segments.to_pylist()] == [
        (1, 0, 1), (1, 5000, 5000), (2, 0, 3)]  # a gap of more than SEGMENT_GAP entry ids starts a segment
    assert decoded_segments(segments) == visible_rows(visible)
    assert segments["codes"].to_pylist()[2][1:3] == [-1, -1]  # entry ids with no visible row


def unordered(table: pa.Table, columns: list[str] | None = None) -> list[tuple]:
    return sorted((tuple(r.values()) for r in table.select(columns or table.column_names).to_pylist()), key=repr)


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                   HealthCheck.data_too_large])
@given(history(), st.integers(1, 6), st.integers(1, 4))
def test_topics_folded_in_chunks_of_ledgers_equal_one_scope(entries, chunk_entries, batch_rows):
    """`ledger_chunks` cuts sorted batches into whole ledgers of one topic, and `fold_scopes` over
    them decides what one scope over the topic does; `in_stable_prefix` is stamped per chunk, so
    it may only be late (the runner stamps it against the last stable position)."""
    table = arrow_entries(entries).select(list(kernel.NARROW_COLUMNS))
    ordered = table.sort_by([("topic", "ascending"), ("ledger_id", "ascending"), ("entry_id", "ascending")])
    chunks = list(ledger_chunks(ordered.to_batches(max_chunksize=batch_rows), chunk_entries))
    assert pa.concat_tables(chunks).equals(ordered) if chunks else not entries
    ledgers = [(c["topic"][0].as_py(), ledger) for c in chunks for ledger in pc.unique(c["ledger_id"]).to_pylist()]
    assert len(ledgers) == len(set(ledgers)), "a ledger split over chunks"
    for topic in sorted(set(table["topic"].to_pylist())):
        mine = [c for c in chunks if c["topic"][0].as_py() == topic]
        assert all(pc.all(pc.equal(c["topic"], topic)).as_py() for c in mine)
        whole = kernel.full_scope_tables(pa.concat_tables(mine))
        folded = list(kernel.fold_scopes(mine))
        for name in kernel.NARROW_TABLES:
            found = folded[-1].tables[name] if name == STABLE_POSITIONS else pa.concat_tables([f.tables[name] for f in folded])
            assert unordered(found) == unordered(whole.tables[name]), f"{name}: {brief(entries)}"
        assert {v: sum(f.violations[v] for f in folded) for v in kernel.VIOLATIONS} == whole.violations
        decided = ["ledger_id", "entry_id", "visible_ledger_id", "visible_entry_id", "local_seq"]
        visible = pa.concat_tables([f.tables[kernel.VISIBLE] for f in folded])
        assert unordered(visible, decided) == unordered(whole.tables[kernel.VISIBLE], decided), brief(entries)
        late = set(unordered(visible.filter(visible["in_stable_prefix"]), decided[:2]))
        assert late <= set(unordered(whole.tables[kernel.VISIBLE].filter(whole.tables[kernel.VISIBLE]["in_stable_prefix"]),
                                     decided[:2]))
        pending = pa.concat_tables([f.tables[kernel.PENDING] for f in folded])
        assert unordered(pending, decided[:2]) == unordered(whole.tables[kernel.PENDING], decided[:2])


def test_the_kernel_on_spark_equals_the_reference(spark, scenario_entries):
    """The Spark runner: topics spread over partitions, each folded a ledger at a time (the
    smallest chunks), the decisions joined with the full rows, the totals summed, the rows kept
    pending as the driver keeps them."""
    entries = frame(spark, reversed(scenario_entries))
    tables = BufferTables(decide_full(entries, chunk_entries=1), entries)
    try:
        expected = expected_tables(scenario_entries)
        for name, found in ((TXN_MARKERS, tables.txn_markers), (ABORTED_TXNS, tables.aborted_txns),
                            (STABLE_POSITIONS, tables.stable_positions), (COMMITTED_ENTRIES, tables.committed_entries)):
            assert rows_by_topic(found) == expected[name], name
        totals = Counter()
        for counts in expected["violations"].values():
            totals.update(dict(zip(VIOLATIONS, counts)))
        assert tables.violations == {v: totals[v] for v in VIOLATIONS}

        # The rows kept pending, picked from the full rows as the driver picks them: the decisions
        # broadcast while they fit (else Spark plans by the size of the whole persisted frame and
        # shuffles every full row of their ledgers), joined by shuffle past the bound.
        below = wide_tables(tables.decided, entries)[BUFFER_PENDING_ENTRIES]
        past = wide_tables(tables.decided, entries, broadcast_max_bytes=0)[BUFFER_PENDING_ENTRIES]
        assert planned_joins(spark, below)[0] == "BroadcastHashJoin"
        assert planned_joins(spark, past)[0] == "SortMergeJoin"
        rows = arrow_entries(scenario_entries)
        in_driver = kernel.wide_tables(kernel.full_scope_tables(rows), rows)[BUFFER_PENDING_ENTRIES]
        expected = sorted(tuple(r.values()) for r in in_driver.select(["topic", "ledger_id", "entry_id"]).to_pylist())
        assert expected  # the scenarios leave transactions ongoing
        for found in (below, past):
            assert sorted(tuple(r) for r in found.select("topic", "ledger_id", "entry_id").collect()) == expected
    finally:
        tables.unpersist()
