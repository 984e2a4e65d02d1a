"""The pure-Python transaction buffer reference: worked example, each rule, and properties on random histories.

No Spark and no fixtures: these run in well under a second and need nothing from conftest.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from txn_engine.core.log_types import BufferState, LogEntry, TxnId, TxnState
from txn_engine.core.positions import EARLIEST, Position, position_before
from txn_engine.reference.transaction_buffer import (
    TopicTransactionBuffer,
    commit_order,
    ledger_order,
    replay,
    stable_position_trace,
)

TOPIC = "orders-partition-0"
T1, T2, T3 = TxnId(0, 1), TxnId(0, 2), TxnId(0, 3)


def e(ledger: int, entry: int, kind: str = "DATA", txn: TxnId | None = None, producer: int | None = None,
      seq: int | None = None, topic: str = TOPIC) -> LogEntry:
    most, least = (None, None) if txn is None else txn
    return LogEntry(topic, ledger, entry, kind, most, least, producer, None if producer is None else 0, seq,
                    None, None, b"x" if kind == "DATA" else None)


def fed(*entries: LogEntry) -> TopicTransactionBuffer:
    buffer = TopicTransactionBuffer(entries[0].topic if entries else TOPIC)
    for entry in entries:
        buffer.append(entry)
    return buffer


def positions(entries) -> list[Position]:
    return [getattr(x, "entry", x).position for x in entries]


# -- the seed's worked example and positions -----------------------------------------------------

SEED_EXAMPLE = [e(1, 0, txn=T1), e(1, 1, txn=T2), e(1, 2, txn=T1), e(1, 3, "COMMIT", T1),
                e(1, 4, txn=T2), e(1, 5, txn=T3), e(1, 6, "COMMIT", T2), e(1, 7, "COMMIT", T3)]


def test_seed_worked_example():
    trace = stable_position_trace(SEED_EXAMPLE)
    assert [p.entry_id for p in trace] == [-1, -1, -1, 0, 0, 0, 4, 7]
    buffer = fed(*SEED_EXAMPLE)
    assert buffer.ongoing_txn_count == 0 and not buffer.violations
    assert positions(buffer.commit_order()) == [Position(1, i) for i in (0, 2, 1, 4, 5)]
    assert [(c.visible.entry_id, c.local_seq) for c in buffer.commit_order()] == [
        (3, 0), (3, 1), (6, 0), (6, 1), (7, 0)]


def test_empty_buffer_reads_nothing():
    buffer = TopicTransactionBuffer(TOPIC)
    assert buffer.max_read_position == EARLIEST and buffer.last_position is None
    assert buffer.snapshot() == BufferState(TOPIC, EARLIEST, (), ())


def test_stable_position_before_first_entry_of_a_later_ledger_is_previous_ledgers_last():
    # Ledger 3 is empty on this topic (never seen), so the previous non-empty ledger is 2.
    buffer = fed(e(1, 0), e(2, 0), e(2, 1), e(4, 0, txn=T1), e(4, 1))
    assert buffer.max_read_position == Position(2, 1)
    assert buffer.ongoing == {T1: Position(4, 0)}


def test_stable_position_before_first_entry_of_first_ledger():
    assert fed(e(5, 0, txn=T1), e(5, 1)).max_read_position == Position(5, -1)
    assert fed(e(5, 0), e(5, 1, txn=T1)).max_read_position == Position(5, 0)


def test_stable_position_follows_earliest_ongoing_not_latest():
    buffer = fed(e(1, 0, txn=T1), e(2, 0, txn=T2), e(2, 1, "ABORT", T1))
    assert buffer.max_read_position == Position(1, 0)  # before T2's (2, 0): ledger 1's last
    buffer.append(e(2, 2, "COMMIT", T2))
    assert buffer.max_read_position == Position(2, 2) == buffer.last_position


# -- the rules, one violation at a time --------------------------------------------------------

def test_duplicate_sequence_is_dropped_even_inside_a_transaction():
    buffer = fed(e(1, 0, producer=7, seq=0), e(1, 1, txn=T1, producer=7, seq=0), e(1, 2, producer=7, seq=0),
                 e(1, 3, producer=7, seq=1))
    assert buffer.violations == Counter(duplicate=2)
    assert buffer.ongoing == {}  # the duplicate did not start T1
    assert positions(buffer.ledger_order()) == [Position(1, 0), Position(1, 3)]
    # Null producer or sequence never counts as a duplicate.
    assert not fed(e(1, 0, producer=7), e(1, 1, producer=7), e(1, 2, seq=3), e(1, 3, seq=3)).violations


def test_duplicate_of_an_aborted_entry_is_still_a_duplicate():
    buffer = fed(e(1, 0, txn=T1, producer=1, seq=5), e(1, 1, "ABORT", T1), e(1, 2, producer=1, seq=5))
    assert buffer.violations == Counter(duplicate=1) and buffer.committed_entries() == []


def test_data_after_marker_is_dropped():
    buffer = fed(e(1, 0, txn=T1), e(1, 1, "COMMIT", T1), e(1, 2, txn=T1), e(1, 3, txn=T2), e(1, 4, "ABORT", T2),
                 e(1, 5, txn=T2))
    assert buffer.violations == Counter(data_after_marker=2)
    assert buffer.ongoing == {} and buffer.max_read_position == Position(1, 5)
    assert positions(buffer.ledger_order()) == [Position(1, 0)]


def test_duplicate_marker_first_wins():
    buffer = fed(e(1, 0, txn=T1), e(1, 1, "COMMIT", T1), e(1, 2, "ABORT", T1), e(1, 3, "COMMIT", T1))
    assert buffer.violations == Counter(duplicate_marker=2)
    assert buffer.aborts == {} and buffer.txn_state(T1) is TxnState.COMMITTED
    assert [(m.outcome, m.position) for m in buffer.markers.values()] == [("COMMIT", Position(1, 1))]
    assert positions(buffer.ledger_order()) == [Position(1, 0)]


def test_marker_without_data_is_recorded():
    buffer = fed(e(1, 0, "ABORT", T1), e(1, 1, "COMMIT", T2))
    assert buffer.violations == Counter(marker_without_data=2)
    assert buffer.aborts == {T1: Position(1, 0)} and set(buffer.markers) == {T1, T2}
    assert buffer.committed_entries() == [] and buffer.max_read_position == Position(1, 1)


def test_bad_input_is_rejected_with_a_clear_error():
    buffer = fed(e(1, 5))
    with pytest.raises(ValueError, match="topic 'other'"):
        buffer.append(e(1, 6, topic="other"))
    with pytest.raises(ValueError, match="not after the last one"):
        buffer.append(e(1, 5))
    with pytest.raises(ValueError, match="not after the last one"):
        buffer.append(e(0, 9))
    with pytest.raises(ValueError, match="no transaction id"):
        buffer.append(e(1, 6, "COMMIT"))
    with pytest.raises(ValueError, match="entry_type"):
        e(1, 7, "BEGIN")
    with pytest.raises(ValueError, match="both be set"):
        LogEntry(TOPIC, 1, 7, "DATA", txn_most_bits=1)
    assert buffer.last_position == Position(1, 5)  # rejected entries changed nothing


def test_txn_id_prints_and_parses():
    assert str(TxnId(3, -4)) == "3:-4" and TxnId.parse("3:-4") == TxnId(3, -4)
    with pytest.raises(ValueError, match="MOST_BITS:LEAST_BITS"):
        TxnId.parse("3")


# -- aborts ------------------------------------------------------------------------------------

def test_aborts_in_marker_order_and_trim():
    buffer = fed(e(1, 0, txn=T3), e(1, 1, txn=T1), e(1, 2, "ABORT", T1), e(2, 0, txn=T2), e(2, 1, "ABORT", T3),
                 e(3, 0, "ABORT", T2))
    assert list(buffer.aborts.items()) == [(T1, Position(1, 2)), (T3, Position(2, 1)), (T2, Position(3, 0))]
    assert buffer.trim_ledgers([1, 3]) == {T1: Position(1, 2), T2: Position(3, 0)}
    assert buffer.aborts == {T3: Position(2, 1)}
    assert buffer.snapshot().aborts == ((T3, Position(2, 1)),)
    # Trimming forgets the abort, not the marker: late data of T1 is still dropped.
    buffer.append(e(4, 0, txn=T1))
    assert buffer.violations["data_after_marker"] == 1 and buffer.ongoing == {}


# -- readers -----------------------------------------------------------------------------------

def test_hanging_transaction_stalls_ledger_order_but_not_commit_order():
    buffer = fed(e(1, 0), e(1, 1, txn=T1), e(1, 2, txn=T2), e(1, 3), e(1, 4, txn=T2), e(1, 5, "COMMIT", T2))
    assert buffer.max_read_position == Position(1, 0)
    assert positions(buffer.ledger_order()) == [Position(1, 0)]
    assert positions(buffer.commit_order()) == [Position(1, 0), Position(1, 3), Position(1, 2), Position(1, 4)]
    assert buffer.snapshot().ongoing == ((T1, Position(1, 1)),)
    buffer.append(e(1, 6, "COMMIT", T1))
    assert positions(buffer.ledger_order()) == [Position(1, i) for i in range(5)]
    assert buffer.read_committed(Position(1, 2)) == [buffer.ledger_order()[i].entry for i in (2, 3, 4)]


def test_commit_order_never_exposes_part_of_a_transaction():
    buffer = fed(e(1, 0, txn=T1), e(1, 1, txn=T1))
    assert buffer.commit_order() == []
    buffer.append(e(1, 2, txn=T1))
    buffer.append(e(1, 3, "COMMIT", T1))
    assert [c.local_seq for c in buffer.commit_order()] == [0, 1, 2]


def test_read_committed_from_a_position():
    buffer = fed(e(1, 0), e(1, 1, txn=T1), e(1, 2), e(1, 3, "ABORT", T1), e(2, 0), e(2, 1))
    assert positions(buffer.read_committed(Position(1, 1))) == [Position(1, 2), Position(2, 0), Position(2, 1)]
    assert positions(buffer.read_committed(Position(1, 1), max_entries=2)) == [Position(1, 2), Position(2, 0)]
    assert positions(buffer.read_committed(EARLIEST, max_entries=0)) == []
    assert buffer.read_committed(Position(2, 2)) == []


def test_replay_splits_topics_and_sorts():
    entries = [e(2, 0, topic="b"), e(1, 1, "COMMIT", T1, topic="a"), e(1, 0, txn=T1, topic="a"), e(1, 0, topic="b")]
    buffers = replay(entries)
    assert sorted(buffers) == ["a", "b"]
    assert buffers["a"].max_read_position == Position(1, 1) and buffers["b"].last_position == Position(2, 0)
    with pytest.raises(ValueError, match="not after"):
        replay([e(1, 0), e(1, 0)])


# -- properties on random histories -------------------------------------------------------------

TXNS = [None, T1, T2, T3, TxnId(1, 0)]


@st.composite
def histories(draw) -> list[LogEntry]:
    """One topic's entries over a few ledgers (some ledger ids skipped), with every kind of anomaly."""
    steps = draw(st.lists(st.tuples(
        st.sampled_from(["DATA"] * 4 + ["COMMIT", "ABORT"]),
        st.sampled_from(TXNS),
        st.sampled_from([None, 1, 2]),  # producer
        st.integers(0, 4),  # sequence
        st.integers(0, 5),  # 0 starts a new ledger
    ), max_size=40))
    ledger, entry, out = draw(st.integers(0, 3)), 0, []
    for kind, txn, producer, seq, roll in steps:
        if kind != "DATA" and txn is None:
            txn = T1  # ingest rejects markers without a transaction id
        if roll == 0 and out:
            ledger, entry = ledger + draw(st.integers(1, 2)), 0
        out.append(e(ledger, entry, kind, txn, producer, None if producer is None else seq))
        entry += 1
    return out


def declarative_view(entries: list[LogEntry]):
    """The same rules stated over the whole history at once, as the SQL jobs state them."""
    first_of_sequence: dict[tuple[int, int], Position] = {}
    first_marker: dict[TxnId, LogEntry] = {}
    for x in entries:
        if x.is_marker:
            first_marker.setdefault(x.txn_id, x)
        elif x.producer_id is not None and x.sequence_id is not None:
            first_of_sequence.setdefault((x.producer_id, x.sequence_id), x.position)
    unique = [x for x in entries if not x.is_marker
              and first_of_sequence.get((x.producer_id, x.sequence_id), x.position) == x.position]
    kept = [x for x in unique
            if x.txn_id is None or x.txn_id not in first_marker or first_marker[x.txn_id].position > x.position]
    violations = Counter(
        duplicate=sum(not x.is_marker for x in entries) - len(unique),
        data_after_marker=len(unique) - len(kept),
        duplicate_marker=sum(x.is_marker for x in entries) - len(first_marker),
        marker_without_data=len(set(first_marker) - {x.txn_id for x in kept}),
    )
    committed, seqs, ongoing = set(), Counter(), {}
    for x in kept:
        marker = first_marker.get(x.txn_id)
        if x.txn_id is None:
            committed.add((x.position, x.position, 0))
        elif marker is None:
            ongoing.setdefault(x.txn_id, x.position)
        elif marker.entry_type == "COMMIT":
            committed.add((x.position, marker.position, seqs[x.txn_id]))
            seqs[x.txn_id] += 1
    return committed, ongoing, +violations  # unary + drops the zero counts


@settings(max_examples=300, deadline=None)
@given(histories())
def test_invariants_on_random_histories(entries):
    buffer = TopicTransactionBuffer(TOPIC)
    previous = EARLIEST
    for x in entries:
        buffer.append(x)
        assert buffer.max_read_position >= previous, "the stable position must never move back"
        assert buffer.max_read_position <= buffer.last_position
        previous = buffer.max_read_position
    committed = buffer.committed_entries()
    in_order = commit_order(committed)

    expected_committed, expected_ongoing, expected_violations = declarative_view(entries)
    assert buffer.violations == expected_violations
    assert {(c.entry.position, c.visible, c.local_seq) for c in committed} == expected_committed
    assert buffer.ongoing == expected_ongoing
    if entries:
        first = min(expected_ongoing.values(), default=None)
        earlier = [x.position for x in entries if first is not None and x.ledger_id < first.ledger_id]
        expected_stable = entries[-1].position if first is None else position_before(first, max(earlier, default=None))
        assert buffer.max_read_position == expected_stable
    assert len({c.entry.position for c in committed}) == len(committed), "each kept entry once"
    for c in committed:
        assert c.visible >= c.entry.position
        state = None if c.entry.txn_id is None else buffer.txn_state(c.entry.txn_id)
        assert state in (None, TxnState.COMMITTED), "no aborted or ongoing entry is visible"
        assert c.in_stable_prefix == (c.entry.position <= buffer.max_read_position)
    # Commit order keeps each transaction's entries together, in their ledger order.
    txn_runs = [c.entry.txn_id for c in in_order if c.entry.txn_id is not None]
    for txn in set(txn_runs):
        at = [i for i, t in enumerate(txn_runs) if t == txn]
        assert at == list(range(at[0], at[0] + len(at)))
    assert positions([c for c in in_order if c.entry.txn_id == T1]) == sorted(
        positions([c for c in in_order if c.entry.txn_id == T1]))
    # The ledger-order reader sees the stable part of the same set, in ledger order.
    assert ledger_order(committed) == sorted(
        (c for c in committed if c.in_stable_prefix), key=lambda c: c.entry.position)
    assert buffer.read_committed(EARLIEST) == [c.entry for c in buffer.ledger_order()]
    assert all(p <= buffer.max_read_position for p in positions(buffer.ledger_order()))
    # Aborts are in marker order and all really aborted.
    assert list(buffer.aborts.values()) == sorted(buffer.aborts.values())
    assert all(buffer.txn_state(t) is TxnState.ABORTED for t in buffer.aborts)
    assert replay(entries).get(TOPIC, TopicTransactionBuffer(TOPIC)).snapshot() == buffer.snapshot()
