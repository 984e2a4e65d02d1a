"""Histories of the transaction buffer for the tests, and what the pure-Python reference says of them.

Hand-written scenarios (the seed's worked example, positions across ledgers, each violation,
non-transactional entries, the two readers) each live in a topic of their own; `history` draws
random ones (hypothesis). `expected_tables` is the oracle's rows in the tables' shapes.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, Iterable

import pyarrow as pa
from hypothesis import strategies as st
from pyspark.sql import DataFrame

from txn_engine.core.log_types import LogEntry, TxnId, Violation
from txn_engine.core.schema import (
    LEDGER_ENTRIES_SCHEMA,
    LEDGER_ENTRY_COLUMNS,
)
from txn_engine.reference.transaction_buffer import replay
from txn_engine.storage.delta_io import DeltaTables

T1, T2, T3 = TxnId(0, 1), TxnId(0, 2), TxnId(0, 3)
EPOCH = datetime(2026, 1, 1)
VIOLATIONS = tuple(v.value for v in Violation)


def e(ledger: int, entry: int, kind: str = "DATA", txn: TxnId | None = None, producer: int | None = None,
      seq: int | None = None, topic: str = "t", epoch: int | None = 0) -> LogEntry:
    """One entry; DATA gets a payload unique to its position in the topic, so mixed-up rows show."""
    most, least = (None, None) if txn is None else txn
    data = kind == "DATA"
    return LogEntry(topic, ledger, entry, kind, most, least, producer, None if producer is None else epoch, seq,
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


def stored_rows_by_topic(wh, table: str) -> dict[str, list[tuple]]:
    """`rows_by_topic` of `table` as stored, in the contract's columns (without the readable
    `txn_id`), read by delta-rs: the values Spark's collect gives (times naive UTC), no Spark job."""
    data = DeltaTables(wh).dataset(table).to_table()
    data = data.drop_columns([c for c in ("txn_id",) if c in data.column_names])
    naive = pa.schema([f.with_type(pa.timestamp(f.type.unit)) if pa.types.is_timestamp(f.type) else f for f in data.schema])
    out: dict[str, list[tuple]] = {}
    for row in data.cast(naive).to_pylist():
        out.setdefault(row["topic"], []).append(tuple(_as_collected(v) for v in row.values()))
    return {topic: sorted(rows) for topic, rows in out.items()}


def _as_collected(value: Any) -> Any:
    """A value as `plain` leaves a Spark-collected one: structs as tuples (Rows are), lists of them."""
    if isinstance(value, dict):
        return tuple(_as_collected(v) for v in value.values())
    if isinstance(value, list):
        return [_as_collected(v) for v in value]
    return value


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
    # a bumped epoch restarts the sequence: the same id again is new; a null epoch is one value
    "epoch-restart": [e(1, 0, producer=4, seq=0), e(1, 1, producer=4, seq=1), e(1, 2, producer=4, seq=0, epoch=1),
                      e(2, 0, producer=4, seq=1, epoch=1), e(2, 1, producer=4, seq=1, epoch=1),
                      e(2, 2, producer=4, seq=0, epoch=None), e(2, 3, producer=4, seq=0, epoch=None)],
    # the same producer and sequence on another topic is not a duplicate
    "sequence-topic-a": [e(1, 0, producer=9, seq=1)],
    "sequence-topic-b": [e(1, 0, producer=9, seq=1), e(2, 0, txn=T1, producer=9, seq=2)],
    # non-transactional entries around an open transaction
    "non-transactional": [e(1, 0), e(1, 1, txn=T1), e(1, 2, producer=3, seq=0), e(2, 0)],
    # blocks of 64 entries and buckets of 64 sequence ids (an earlier Spark design kept a bit per id): T1's
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


# -- random histories ------------------------------------------------------------------------

TXNS = [None, T1, T2, T3, TxnId(1, 0), TxnId(-1, 2**63 - 1)]


@st.composite
def topic_history(draw, topic: str) -> list[LogEntry]:
    """One topic over a few ledgers (ids skipped, rare entry gaps), with every kind of anomaly."""
    steps = draw(st.lists(st.tuples(
        st.sampled_from(["DATA"] * 4 + ["COMMIT", "ABORT"]),
        st.sampled_from(TXNS),
        st.sampled_from([None, 1, 2]),  # producer, shared by topics
        st.sampled_from([0, 1, 2, 3, 4, 63, 64, 127]),  # sequence ids, some at the edges of buckets of 64
        st.sampled_from([0] * 4 + [1, None]),  # producer epoch: bumped now and then, or not known
        st.integers(0, 5),  # 0 starts a new ledger
        st.sampled_from([1] * 8 + [2, 62]),  # entry step: a rare gap, a jump across a block of 64 entries
    ), min_size=3, max_size=25))
    ledger, entry, out = draw(st.sampled_from([0, 1, 3, BIG])), 0, []
    for kind, txn, producer, seq, epoch, roll, step in steps:
        if kind != "DATA" and txn is None:
            txn = T1  # ingest rejects markers without a transaction id
        if roll == 0 and out:
            ledger, entry = ledger + draw(st.integers(1, 2)), 0
        out.append(e(ledger, entry, kind, txn, producer, None if producer is None else seq, topic=topic, epoch=epoch))
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


