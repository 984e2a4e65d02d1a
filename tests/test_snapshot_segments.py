"""A snapshot run's Arrow rules (`txn_engine.snapshots.segments`) against the reference, with no
JVM and many random histories: the cut, the tombstones and what compaction keeps. The Spark and
driver runners of the same rules are tested in tests/test_snapshot_jobs.py."""

from __future__ import annotations

from dataclasses import replace

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.snapshot_histories import op_lists, replay_topic, simulate
from txn_engine.reference.snapshots import Crash, SnapshotLog, SnapshotSegment, compacted_rows, split_snapshot
from txn_engine.snapshots.format import SnapshotConfig
from txn_engine.snapshots.segments import ABORTED_COLUMNS, Planned, compaction_keeps, cut_segments, stale_parts


def index_table(rows: list[SnapshotSegment]) -> pa.Table:
    """The narrow columns the rules read of stored segment rows."""
    return pa.table({"topic": pa.array([r.topic for r in rows], pa.string()),
                     "snapshot_key": pa.array([r.snapshot_key for r in rows], pa.string()),
                     "write_seq": pa.array([r.write_seq for r in rows], pa.int64()),
                     "tombstone": pa.array([r.tombstone for r in rows], pa.bool_()),
                     "snapshot_id": pa.array([r.snapshot_id for r in rows], pa.int64())})


def crash_after(rows: int):
    def hook(_segment: SnapshotSegment) -> None:
        hook.written += 1
        if hook.written == rows:
            raise Crash("writer stopped")
    hook.written = 0
    return hook


@settings(max_examples=150, deadline=None, database=None)
@given(st.lists(st.tuples(op_lists, st.integers(0, 3)), min_size=1, max_size=4))
def test_compaction_keeps_the_references_rows(histories):
    rows, offset = [], 0
    for i, (ops, stop) in enumerate(histories):  # several topics in one table, write_seq global
        history = simulate(f"h{i}", ops, first_ledger=1000 * (i + 1), txn_base=i)
        if stop:  # a last snapshot cut short: its parts overwrite keys of the live one
            state = replay_topic(history.topic, history.entries).snapshot()
            try:
                history.log.write_snapshot(state, 10_000 + i, SnapshotConfig(max_aborts_per_segment=1), crash_after(stop))
            except Crash:
                pass
        rows += [replace(r, write_seq=r.write_seq + offset) for r in history.log.rows]
        offset += history.log.last_write_seq
    kept = compaction_keeps(index_table(rows)).to_pylist()
    assert {r.write_seq for r, keep in zip(rows, kept) if keep} == {r.write_seq for r in compacted_rows(rows)}


@settings(max_examples=150, deadline=None, database=None)
@given(op_lists, st.integers(1, 4), st.randoms(use_true_random=False))
def test_cut_and_tombstones_are_the_references(ops, per_segment, rnd):
    history = simulate("t", ops, first_ledger=100, txn_base=0)
    state = replay_topic("t", history.entries).snapshot()
    config = SnapshotConfig(max_aborts_per_segment=per_segment)
    aborts = list(state.aborts)
    rnd.shuffle(aborts)  # the cut orders them itself
    aborted = pa.table([pa.array(["t"] * len(aborts), pa.string()),
                        *(pa.array(values, pa.int64()) for values in (
                            [t.most_bits for t, _ in aborts], [t.least_bits for t, _ in aborts],
                            [p.ledger_id for _, p in aborts], [p.entry_id for _, p in aborts]))],
                       names=list(ABORTED_COLUMNS))
    plan = {"t": Planned(7, state.max_read_position.ledger_id, state.max_read_position.entry_id)}
    cut = cut_segments(aborted, plan, config).to_pylist()
    expected = split_snapshot(state, 7, config)
    assert [(r["snapshot_key"], r["max_read_ledger_id"], r["max_read_entry_id"],
             [(a["txn_most_bits"], a["txn_least_bits"], a["ledger_id"], a["entry_id"]) for a in r["aborts"]],
             r["snapshot_id"], r["segment_index"], r["segment_count"], r["abort_count"], r["tombstone"]) for r in cut] == \
        [(s.snapshot_key, s.max_read_position.ledger_id, s.max_read_position.entry_id,
          [(t.most_bits, t.least_bits, p.ledger_id, p.entry_id) for t, p in s.aborts],
          7, s.segment_index, s.segment_count, s.abort_count, False) for s in expected]
    # The tombstones of this snapshot written after the history's rows, as the reference log writes them.
    log = SnapshotLog(rows=list(history.log.rows), last_write_seq=history.log.last_write_seq)
    stale = stale_parts(index_table(log.rows), {"t": (7, len(expected))}).to_pylist()
    written = log.write_snapshot(state, 7, config)
    assert sorted((r["snapshot_key"], r["snapshot_id"], r["tombstone"]) for r in stale) == \
        sorted((r.snapshot_key, r.snapshot_id, r.tombstone) for r in written if r.tombstone)
