"""The transaction buffer on Spark (`txn_engine.buffer_jobs`) against the pure-Python reference.

Hand-written histories (the seed's worked example, positions across ledgers, each violation,
non-transactional entries, the two readers) each live in a topic of their own, so one Spark
computation answers all of them; the differential test does the same with random histories.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, Iterable

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from txn_engine.buffer_jobs import (
    aborted_txns,
    buffer_violations,
    committed_entries,
    committed_from_facts,
    compute_buffer_tables,
    stable_positions,
    txn_markers,
    violations_by_topic,
)
from txn_engine.errors import TxnlakeError
from txn_engine.log_types import LogEntry, TxnId, Violation
from txn_engine.positions import Position
from txn_engine.schema import (
    ABORTED_TXNS_SCHEMA,
    COMMITTED_ENTRIES_SCHEMA,
    LEDGER_ENTRIES_SCHEMA,
    LEDGER_ENTRY_COLUMNS,
    STABLE_POSITIONS_SCHEMA,
    TXN_MARKERS_SCHEMA,
)
from txn_engine.transaction_buffer import replay

T1, T2, T3 = TxnId(0, 1), TxnId(0, 2), TxnId(0, 3)
EPOCH = datetime(2026, 1, 1)
VIOLATIONS = tuple(v.value for v in Violation)


def e(ledger: int, entry: int, kind: str = "DATA", txn: TxnId | None = None, producer: int | None = None,
      seq: int | None = None, topic: str = "t") -> LogEntry:
    """One entry; DATA gets a payload unique to its position in the topic, so mixed-up rows show."""
    most, least = (None, None) if txn is None else txn
    data = kind == "DATA"
    return LogEntry(topic, ledger, entry, kind, most, least, producer, None if producer is None else 0, seq,
                    EPOCH + timedelta(seconds=entry), f"k{entry}" if data else None,
                    f"payload {ledger}:{entry}".encode() if data else None)


def in_topic(topic: str, entries: Iterable[LogEntry], prefix: bool = False) -> list[LogEntry]:
    """The entries moved to `topic` (or to `topic` + their own topic, with prefix=True)."""
    return [replace(x, topic=topic + x.topic if prefix else topic) for x in entries]


def frame(spark, entries: Iterable[LogEntry]) -> DataFrame:
    """The entries as a ledger_entries DataFrame, checkpointed in the JVM: the jobs scan their input
    several times, and a scan of a plain createDataFrame re-runs Python to unpickle the rows."""
    rows = [tuple(getattr(x, c) for c in LEDGER_ENTRY_COLUMNS) for x in entries]
    return spark.createDataFrame(rows, LEDGER_ENTRIES_SCHEMA).localCheckpoint()


def plain(row) -> tuple:
    return tuple(bytes(v) if isinstance(v, bytearray) else v for v in row)


def rows_by_topic(frame_: DataFrame) -> dict[str, list[tuple]]:
    out: dict[str, list[tuple]] = {}
    for row in frame_.collect():
        out.setdefault(row["topic"], []).append(plain(row))
    return {topic: sorted(rows) for topic, rows in out.items()}


# -- what the reference says, in the tables' row shapes -------------------------------------------

def expected_tables(entries: Iterable[LogEntry], deleted: Iterable[int] = ()) -> dict[str, dict[str, Any]]:
    """Per table, per topic: the reference's rows (sorted), and its violation counts.

    `deleted`: ledgers retention then deleted (of every topic): the abort set trimmed, their
    markers and entries gone from the tables, every other decision as it was.
    """
    tables: dict[str, dict[str, Any]] = {name: {} for name in
                                         ("txn_markers", "aborted_txns", "stable_positions", "committed_entries",
                                          "violations")}
    gone = set(deleted)
    for topic, buffer in replay(entries).items():
        buffer.trim_ledgers(gone)
        markers = [(topic, *m.txn, m.outcome, *m.position) for m in buffer.markers.values() if m.position.ledger_id not in gone]
        aborts = [(topic, *txn, *position) for txn, position in buffer.aborts.items()]
        stable = [(topic, *buffer.max_read_position, *buffer.last_position, buffer.ongoing_txn_count)]
        committed = [tuple(getattr(c.entry, col) for col in LEDGER_ENTRY_COLUMNS) + (*c.visible, c.local_seq,
                                                                                     c.in_stable_prefix)
                     for c in buffer.committed_entries() if c.entry.ledger_id not in gone]
        for name, rows in (("txn_markers", markers), ("aborted_txns", aborts), ("stable_positions", stable),
                           ("committed_entries", committed)):
            if rows:
                tables[name][topic] = sorted(rows)
        tables["violations"][topic] = tuple(buffer.violations[v] for v in VIOLATIONS)
    return tables


def actual_tables(markers: DataFrame, aborted: DataFrame, stable: DataFrame, committed: DataFrame,
                  violations: DataFrame) -> dict[str, dict[str, Any]]:
    return {
        "txn_markers": rows_by_topic(markers),
        "aborted_txns": rows_by_topic(aborted),
        "stable_positions": rows_by_topic(stable),
        "committed_entries": rows_by_topic(committed),
        "violations": {row["topic"]: tuple(row[v] for v in VIOLATIONS) for row in violations.collect()},
    }


# -- hand-written histories, one topic each, computed together ------------------------------------

SEED_EXAMPLE = [e(1, 0, txn=T1), e(1, 1, txn=T2), e(1, 2, txn=T1), e(1, 3, "COMMIT", T1),
                e(1, 4, txn=T2), e(1, 5, txn=T3), e(1, 6, "COMMIT", T2), e(1, 7, "COMMIT", T3)]
HANGING = [e(1, 0), e(1, 1, txn=T1), e(1, 2, txn=T2), e(1, 3), e(1, 4, txn=T2), e(1, 5, "COMMIT", T2)]
BIG = 2**40

SCENARIOS: dict[str, list[LogEntry]] = {
    **{f"seed-{n}": SEED_EXAMPLE[:n] for n in range(1, len(SEED_EXAMPLE) + 1)},
    # positions across ledgers; ledger 3 never appears, so ledger 2 is "previous non-empty"
    "previous-ledger": [e(1, 0), e(2, 0), e(2, 1), e(4, 0, txn=T1), e(4, 1)],
    "first-ledger": [e(5, 0, txn=T1), e(5, 1)],
    "mid-ledger": [e(5, 0), e(5, 1, txn=T1)],
    "entry-gap": [e(1, 0), e(1, 5, txn=T1)],
    "earliest-not-latest": [e(1, 0, txn=T1), e(2, 0, txn=T2), e(2, 1, "ABORT", T1)],
    "none-ongoing": [e(1, 0, txn=T1), e(2, 0, txn=T2), e(2, 1, "ABORT", T1), e(3, 0, "COMMIT", T2)],
    # the previous ledger's last entry is any entry: here a duplicate then a marker without data
    "previous-ledger-ends-dropped": [e(3, 0, producer=1, seq=0), e(3, 1, producer=1, seq=0),
                                     e(3, 2, "ABORT", T3), e(7, 0, txn=T1), e(7, 1, "COMMIT", T2)],
    # the txn starts at its first *kept* entry: (1, 1) repeats (1, 0)'s sequence
    "first-kept-entry": [e(1, 0, producer=1, seq=0), e(1, 1, txn=T1, producer=1, seq=0), e(1, 2, txn=T1)],
    "large-ids": [e(BIG, 0), e(BIG, 1, "COMMIT", TxnId(-5, 2**63 - 1)), e(BIG + 3, 0, txn=TxnId(2**62, -1)),
                  e(BIG + 3, 1, txn=TxnId(-5, 2**63 - 1))],
    # one violation at a time
    "duplicate": [e(1, 0, producer=7, seq=0), e(1, 1, txn=T1, producer=7, seq=0), e(1, 2, producer=7, seq=0),
                  e(1, 3, producer=7, seq=1)],
    "no-sequence-no-duplicate": [e(1, 0, producer=7), e(1, 1, producer=7), e(1, 2, seq=3), e(1, 3, seq=3)],
    "duplicate-of-aborted": [e(1, 0, txn=T1, producer=1, seq=5), e(1, 1, "ABORT", T1), e(1, 2, producer=1, seq=5)],
    "data-after-marker": [e(1, 0, txn=T1), e(1, 1, "COMMIT", T1), e(1, 2, txn=T1), e(1, 3, txn=T2),
                          e(1, 4, "ABORT", T2), e(1, 5, txn=T2)],
    "duplicate-marker": [e(1, 0, txn=T1), e(1, 1, "COMMIT", T1), e(1, 2, "ABORT", T1), e(1, 3, "COMMIT", T1)],
    "marker-without-data": [e(1, 0, "ABORT", T1), e(1, 1, "COMMIT", T2)],
    # the same producer and sequence on another topic is not a duplicate
    "sequence-topic-a": [e(1, 0, producer=9, seq=1)],
    "sequence-topic-b": [e(1, 0, producer=9, seq=1), e(2, 0, txn=T1, producer=9, seq=2)],
    # non-transactional entries around an open transaction
    "non-transactional": [e(1, 0), e(1, 1, txn=T1), e(1, 2, producer=3, seq=0), e(2, 0)],
    # blocks of 64 entries and buckets of 64 sequence ids (the Spark jobs keep a bit per id): T1's
    # first kept entry is bit 63 alone in its block, its entries span three blocks, its late data
    # lies in the marker's block, the next block and the next ledger; T2 spans two ledgers
    "block-edges": [e(1, 0), e(1, 63, txn=T1), e(1, 64, txn=T1), e(1, 127, txn=T2), e(1, 128, txn=T1, producer=1, seq=63),
                    e(1, 129, txn=T1, producer=1, seq=63), e(1, 190, "COMMIT", T1), e(1, 191, txn=T1), e(1, 192, txn=T1),
                    e(2, 0, txn=T1), e(2, 64, txn=T2), e(2, 127, "COMMIT", T2)],
    "kept-bit-62-retry-at-63": [e(1, 62, txn=T2, producer=2, seq=0), e(1, 63, txn=T2, producer=2, seq=0),
                                e(1, 200, "COMMIT", T2)],
    "ongoing-from-bit-63": [e(1, 0), e(1, 63, txn=T3), e(1, 64, txn=T3)],
    # a sequence id sent three times next to ids sent twice, at bucket edges (63, 64, 127)
    "sequence-thrice": [e(1, 0, producer=1, seq=64), e(1, 1, producer=1, seq=64), e(1, 2, producer=1, seq=64),
                        e(1, 3, producer=1, seq=63), e(1, 4, producer=1, seq=127), e(1, 5, txn=T1, producer=1, seq=127),
                        e(1, 6, producer=1, seq=65), e(2, 0, producer=1, seq=63), e(2, 1, "COMMIT", T1)],
    # the readers
    "hanging": HANGING,
    "hanging-then-committed": HANGING + [e(1, 6, "COMMIT", T1)],
    "open-transaction": [e(1, 0, txn=T1), e(1, 1, txn=T1)],
    "closed-transaction": [e(1, 0, txn=T1), e(1, 1, txn=T1), e(1, 2, txn=T1), e(1, 3, "COMMIT", T1)],
}


@pytest.fixture(scope="module")
def scenario_entries() -> list[LogEntry]:
    return [x for topic, entries in SCENARIOS.items() for x in in_topic(topic, entries)]


@pytest.fixture(scope="module")
def scenarios(spark, scenario_entries):
    """All four tables of all scenarios in one computation, collected; the tables stay cached for SQL."""
    entries = frame(spark, reversed(scenario_entries))  # input order must not matter
    tables = compute_buffer_tables(entries)
    committed = tables.committed_entries.cache()
    actual = actual_tables(tables.txn_markers, tables.aborted_txns, tables.stable_positions, committed,
                           tables.violations_by_topic)
    yield tables, committed, actual
    committed.unpersist()
    tables.unpersist()


def stable_of(actual, topic: str) -> tuple[Position, Position, int]:
    (_, max_l, max_e, last_l, last_e, ongoing), = actual["stable_positions"][topic]
    return Position(max_l, max_e), Position(last_l, last_e), ongoing


def test_every_scenario_equals_the_reference(scenarios, scenario_entries):
    _, _, actual = scenarios
    expected = expected_tables(scenario_entries)
    for table in expected:
        assert actual[table] == expected[table], table


def test_seed_worked_example_over_prefixes(scenarios):
    _, _, actual = scenarios
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
    _, _, actual = scenarios
    assert stable_of(actual, topic) == (Position(*max_read), Position(*last), ongoing)


@pytest.mark.parametrize("topic, violations", [
    ("duplicate", Counter(duplicate=2)),
    ("no-sequence-no-duplicate", Counter()),
    ("duplicate-of-aborted", Counter(duplicate=1)),
    ("data-after-marker", Counter(data_after_marker=2)),
    ("duplicate-marker", Counter(duplicate_marker=2)),
    ("marker-without-data", Counter(marker_without_data=2)),
    ("sequence-topic-a", Counter()),
    ("sequence-topic-b", Counter()),
])
def test_each_violation(scenarios, topic, violations):
    _, _, actual = scenarios
    assert actual["violations"][topic] == tuple(violations[v] for v in VIOLATIONS)


def test_violation_rules_shape_the_tables(scenarios):
    _, _, actual = scenarios
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


def test_violation_totals(scenarios, scenario_entries):
    tables, _, _ = scenarios
    expected = Counter()
    for buffer in replay(scenario_entries).values():
        expected.update(buffer.violations)
    assert tables.violations == {v: expected[v] for v in VIOLATIONS}


def test_standalone_functions_equal_the_reference(spark):
    # The shared computation is checked everywhere else; each public function on its own here.
    history = [x for topic in ("seed-8", "duplicate", "data-after-marker", "duplicate-marker",
                               "marker-without-data", "previous-ledger-ends-dropped")
               for x in in_topic(topic, SCENARIOS[topic])]
    entries = frame(spark, history)
    stable = stable_positions(entries)
    actual = actual_tables(txn_markers(entries), aborted_txns(entries), stable, committed_entries(entries, stable),
                           violations_by_topic(entries))
    expected = expected_tables(history)
    assert actual == expected
    totals = Counter()
    for counts in expected["violations"].values():
        totals.update(dict(zip(VIOLATIONS, counts)))
    assert buffer_violations(entries) == {v: totals[v] for v in VIOLATIONS}


def planned_joins(spark, frame_: DataFrame) -> list[str]:
    """The joins Spark plans for `frame_` when it broadcasts nothing unasked, as it does not for big sides."""
    spark.conf.set("spark.sql.autoBroadcastJoinThreshold", "-1")
    try:
        plan = frame_._jdf.queryExecution().sparkPlan()
    finally:
        spark.conf.unset("spark.sql.autoBroadcastJoinThreshold")

    def joins(node) -> list[str]:  # the plan's own nodes: cached frames are leaves here
        children = node.children()
        below = [j for i in range(children.size()) for j in joins(children.apply(i))]
        return ([node.nodeName()] if "Join" in node.nodeName() else []) + below
    return joins(plan)


def test_committed_entries_past_the_broadcast_bound_are_joined_by_shuffle(spark, scenarios, scenario_entries):
    # A history whose blocks would not fit a broadcast: each full row goes to its block by shuffle.
    # Forced here with a bound of 0; the rows are the reference's, as with the broadcast.
    tables, _, _ = scenarios
    shuffled = committed_from_facts(tables.facts, tables.stable_positions, broadcast_max_bytes=0)
    # Broadcast: only the stable positions (a row per topic). Below the bound the blocks are too.
    assert planned_joins(spark, shuffled) == ["BroadcastHashJoin", "SortMergeJoin", "SortMergeJoin", "SortMergeJoin"]
    assert rows_by_topic(shuffled) == expected_tables(scenario_entries)["committed_entries"]


def test_non_transactional_entries_are_visible_at_their_own_position(scenarios):
    _, _, actual = scenarios
    rows = actual["committed_entries"]["non-transactional"]
    # (ledger, entry, visible ledger, visible entry, local_seq, in_stable_prefix); (1, 1) is T1's, open.
    assert [(r[1], r[2], r[-4], r[-3], r[-2], r[-1]) for r in rows] == [
        (1, 0, 1, 0, 0, True), (1, 2, 1, 2, 0, False), (2, 0, 2, 0, 0, False)]
    assert rows[0][LEDGER_ENTRY_COLUMNS.index("payload")] == b"payload 1:0"


def ledger_order(spark, committed: DataFrame, topic: str) -> list[tuple[int, int]]:
    """The Pulsar/Kafka reader, in the brief's SQL."""
    query = "SELECT ledger_id, entry_id FROM {topic} WHERE in_stable_prefix ORDER BY ledger_id, entry_id"
    return [tuple(r) for r in spark.sql(query, topic=committed.where(F.col("topic") == topic)).collect()]


def commit_order(spark, committed: DataFrame, topic: str) -> list[tuple[int, int, int]]:
    """The DistributedLog reader, in the brief's SQL."""
    query = "SELECT ledger_id, entry_id, local_seq FROM {topic} ORDER BY visible_ledger_id, visible_entry_id, local_seq"
    return [tuple(r) for r in spark.sql(query, topic=committed.where(F.col("topic") == topic)).collect()]


def test_hanging_transaction_stalls_ledger_order_but_not_commit_order(spark, scenarios):
    _, committed, _ = scenarios
    assert ledger_order(spark, committed, "hanging") == [(1, 0)]
    assert commit_order(spark, committed, "hanging") == [(1, 0, 0), (1, 3, 0), (1, 2, 0), (1, 4, 1)]
    assert ledger_order(spark, committed, "hanging-then-committed") == [(1, i) for i in range(5)]
    assert commit_order(spark, committed, "hanging-then-committed") == [
        (1, 0, 0), (1, 3, 0), (1, 2, 0), (1, 4, 1), (1, 1, 0)]


def test_commit_order_never_shows_part_of_a_transaction(spark, scenarios):
    _, committed, _ = scenarios
    assert commit_order(spark, committed, "open-transaction") == []
    assert commit_order(spark, committed, "closed-transaction") == [(1, 0, 0), (1, 1, 1), (1, 2, 2)]


def test_tables_have_the_contract_schemas(scenarios):
    tables, _, _ = scenarios
    simple = lambda schema: [(f.name, f.dataType) for f in schema.fields]  # noqa: E731
    assert simple(tables.txn_markers.schema) == simple(TXN_MARKERS_SCHEMA)
    assert simple(tables.aborted_txns.schema) == simple(ABORTED_TXNS_SCHEMA)
    assert simple(tables.stable_positions.schema) == simple(STABLE_POSITIONS_SCHEMA)
    assert simple(tables.committed_entries.schema) == simple(COMMITTED_ENTRIES_SCHEMA)


def test_empty_log(spark):
    tables = compute_buffer_tables(frame(spark, []))
    try:
        for table in (tables.txn_markers, tables.stable_positions, tables.aborted_txns, tables.committed_entries):
            assert table.count() == 0
        assert tables.violations == dict.fromkeys(VIOLATIONS, 0)
    finally:
        tables.unpersist()


def test_missing_columns_are_named(spark):
    with pytest.raises(TxnlakeError, match="missing: .*payload"):
        stable_positions(frame(spark, [e(1, 0)]).drop("payload"))


# -- differential: random histories against the reference -----------------------------------------

TXNS = [None, T1, T2, T3, TxnId(1, 0), TxnId(-1, 2**63 - 1)]


@st.composite
def topic_history(draw, topic: str) -> list[LogEntry]:
    """One topic over a few ledgers (ids skipped, rare entry gaps), with every kind of anomaly."""
    steps = draw(st.lists(st.tuples(
        st.sampled_from(["DATA"] * 4 + ["COMMIT", "ABORT"]),
        st.sampled_from(TXNS),
        st.sampled_from([None, 1, 2]),  # producer, shared by topics
        st.sampled_from([0, 1, 2, 3, 4, 63, 64, 127]),  # sequence; the Spark jobs bucket ids by 64
        st.integers(0, 5),  # 0 starts a new ledger
        st.sampled_from([1] * 8 + [2, 62]),  # entry step: a rare gap, a jump across a block of 64 entries
    ), min_size=3, max_size=25))
    ledger, entry, out = draw(st.sampled_from([0, 1, 3, BIG])), 0, []
    for kind, txn, producer, seq, roll, step in steps:
        if kind != "DATA" and txn is None:
            txn = T1  # ingest rejects markers without a transaction id
        if roll == 0 and out:
            ledger, entry = ledger + draw(st.integers(1, 2)), 0
        out.append(e(ledger, entry, kind, txn, producer, None if producer is None else seq, topic=topic))
        entry += step
    return out


@st.composite
def history(draw) -> list[LogEntry]:
    """A few topics sharing transaction ids and producers (multi-partition transactions)."""
    topics = draw(st.lists(st.sampled_from("abc"), min_size=1, max_size=3, unique=True))
    return [x for topic in topics for x in draw(topic_history(topic))]


def brief(entries: list[LogEntry]) -> list[tuple]:
    """A history as short tuples, to paste into a failing test."""
    return [(x.topic, x.ledger_id, x.entry_id, x.entry_type, x.txn_id and tuple(x.txn_id), x.producer_id, x.sequence_id)
            for x in entries]


# Each example is a batch of ~9 histories checked by one Spark computation, so 5 examples cover
# ~45 histories. No shrinking: a shrink step costs a Spark computation; the failure message
# names the history and table instead, with the history itself.
@settings(max_examples=5, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(st.lists(history(), min_size=8, max_size=10))
def test_random_histories_equal_the_reference(production_codegen, histories):
    spark = production_codegen
    # Every history gets its own topics (h<i>-<topic>): one Spark computation checks them all.
    entries = [x for i, h in enumerate(histories) for x in in_topic(f"h{i}-", h, prefix=True)]
    tables = compute_buffer_tables(frame(spark, entries))
    try:
        actual = actual_tables(tables.txn_markers, tables.aborted_txns, tables.stable_positions,
                               tables.committed_entries, tables.violations_by_topic)
        expected = expected_tables(entries)
        for i in range(len(histories)):
            prefix = f"h{i}-"
            for table in expected:
                mine = {t: rows for t, rows in actual[table].items() if t.startswith(prefix)}
                oracle = {t: rows for t, rows in expected[table].items() if t.startswith(prefix)}
                assert mine == oracle, f"history {i}, table {table}: {brief(histories[i])}"
        totals = Counter()
        for counts in expected["violations"].values():
            totals.update(dict(zip(VIOLATIONS, counts)))
        assert tables.violations == {v: totals[v] for v in VIOLATIONS}
        # The path past the broadcast bound (rows joined with their blocks by shuffle) reads the same rows.
        shuffled = rows_by_topic(committed_from_facts(tables.facts, tables.stable_positions, broadcast_max_bytes=0))
        assert shuffled == expected["committed_entries"], [brief(h) for h in histories]
    finally:
        tables.unpersist()

