"""The reference snapshot writer, compaction and recovery (txn_engine.reference.snapshots): PIP-178's
scenarios, the leak of PIP-178 as written, crashes, racing writers, bad rows, random histories."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings

from tests.snapshot_histories import full_replay, op_lists, replay_topic, simulate
from txn_engine.core.log_types import BufferState, LogEntry, TxnId
from txn_engine.core.positions import EARLIEST, Position
from txn_engine.reference.snapshots import Crash, SnapshotLog, live_snapshot, recover, recover_pip178_as_written, split_snapshot
from txn_engine.snapshots.format import SnapshotConfig, SnapshotError, Source, segment_bytes

T = "orders-partition-0"


def aborted_history(n: int, ledger_size: int = 4, topic: str = T, start_txn: int = 0) -> list[LogEntry]:
    """`n` transactions, each one DATA entry then its ABORT, `ledger_size` entries per ledger."""
    entries = []
    for i in range(n):
        for kind in ("DATA", "ABORT"):
            k = len(entries)
            entries.append(LogEntry(topic, 100 + k // ledger_size, k % ledger_size, kind, 7, start_txn + i))
    return entries


def state_of(entries: list[LogEntry], topic: str = T) -> BufferState:
    return replay_topic(topic, entries).snapshot()


def assert_recovers(log: SnapshotLog, entries: list[LogEntry], deleted=(), source=Source.SNAPSHOT, topic: str = T):
    recovered = recover(topic, log.rows, entries, deleted)
    buffer = replay_topic(topic, entries)
    assert (recovered.max_read_position, recovered.aborts) == (buffer.max_read_position, tuple(buffer.aborts.items()))
    assert recovered.source == source, recovered.fallback_reason
    return recovered


# -- the writer ---------------------------------------------------------------------------------

def test_small_abort_set_is_topic_end_alone():
    [end] = split_snapshot(state_of(aborted_history(3)), 1, SnapshotConfig(max_aborts_per_segment=5))
    assert (end.snapshot_key, end.segment_count, len(end.aborts)) == (f"{T}-end", 1, 3)
    assert end.max_read_position == Position(101, 1)


def test_large_abort_set_is_cut_into_parts_and_end_carries_the_max_read_position():
    state = state_of(aborted_history(7))
    segments = split_snapshot(state, 9, SnapshotConfig(max_aborts_per_segment=3))
    assert [s.snapshot_key for s in segments] == [f"{T}-1", f"{T}-2", f"{T}-end"]
    assert [len(s.aborts) for s in segments] == [3, 3, 1]
    assert [s.max_read_position for s in segments] == [EARLIEST, EARLIEST, state.max_read_position]
    assert tuple(a for s in segments for a in s.aborts) == state.aborts  # abort-marker order kept
    assert {(s.snapshot_id, s.segment_count, s.abort_count) for s in segments} == {(9, 3, 7)}


def test_byte_bound_limits_segments_too():
    state = state_of(aborted_history(10))
    config = SnapshotConfig(max_aborts_per_segment=1000, max_segment_bytes=segment_bytes(T, 4))
    segments = split_snapshot(state, 1, config)
    assert [len(s.aborts) for s in segments] == [4, 4, 2]
    assert all(segment_bytes(T, len(s.aborts)) <= config.max_segment_bytes for s in segments)


def test_bad_configuration_is_refused_with_what_to_do():
    with pytest.raises(SnapshotError, match="at least 1"):
        SnapshotConfig(max_aborts_per_segment=0)
    with pytest.raises(SnapshotError, match="cannot hold one abort"):
        SnapshotConfig(max_segment_bytes=10)


# -- PIP-178's scenarios ------------------------------------------------------------------------

def test_normal_flow_recovers_from_snapshot_and_replays_the_rest():
    entries = aborted_history(7)
    log = SnapshotLog()
    log.write_snapshot(state_of(entries[:8]), 1, SnapshotConfig(max_aborts_per_segment=2))
    recovered = assert_recovers(log, entries)
    assert recovered.snapshot_id == 1


def test_crash_after_some_segments_of_a_new_snapshot_keeps_the_old_one():
    entries = aborted_history(12)
    config = SnapshotConfig(max_aborts_per_segment=2)
    for crash_at in range(1, 6):
        log = SnapshotLog()
        log.write_snapshot(state_of(entries[:16]), 1, config)  # 8 aborts: keys 1..3 + end

        def crash(segment, n=[0]):
            n[0] += 1
            if n[0] == crash_at:
                raise Crash()
        with pytest.raises(Crash):
            log.write_snapshot(state_of(entries), 2, config, after_write=crash)  # 12 aborts: 1..5 + end
        recovered = assert_recovers(log, entries)
        assert recovered.snapshot_id == 1  # the new one never reached topic-end
        log.compact()
        assert assert_recovers(log, entries).snapshot_id == 1  # compaction kept the live snapshot


def test_crash_after_trimming_recovers_the_trimmed_set():
    """PIP-178's third case: ledgers deleted (aborts trimmed at the oldest end), then a new
    snapshot is written only in part."""
    entries = aborted_history(12)
    config = SnapshotConfig(max_aborts_per_segment=2)
    log = SnapshotLog()
    log.write_snapshot(state_of(entries), 1, config)
    remaining = [e for e in entries if e.ledger_id > 101]  # ledgers 100, 101 deleted: 4 aborts trimmed

    def crash(segment):
        if segment.segment_index == 2:
            raise Crash()
    with pytest.raises(Crash):
        log.write_snapshot(state_of(remaining), 2, config, after_write=crash)
    recovered = assert_recovers(log, remaining, deleted={100, 101})
    assert recovered.snapshot_id == 1
    assert all(pos.ledger_id > 101 for _, pos in recovered.aborts)


def test_marker_whose_data_lies_before_the_replay_start():
    x, e = TxnId(1, 1), TxnId(1, 2)
    entries = [LogEntry(T, 5, 0, "DATA", *x), LogEntry(T, 5, 1, "DATA", *e), LogEntry(T, 5, 2, "ABORT", *x),
               LogEntry(T, 5, 3, "ABORT", *x),  # a duplicate marker, after the snapshot
               LogEntry(T, 5, 4, "DATA", *x),  # late data of an aborted transaction
               LogEntry(T, 5, 5, "COMMIT", *e)]
    log = SnapshotLog()
    log.write_snapshot(state_of(entries[:3]), 1, SnapshotConfig())  # max read position 5:0, X aborted at 5:2
    assert log.rows[-1].max_read_position == Position(5, 0)
    assert_recovers(log, entries)
    log2 = SnapshotLog()
    log2.write_snapshot(state_of(entries[:2]), 1, SnapshotConfig())  # X ongoing: its ABORT comes in the replay
    assert_recovers(log2, entries)


def test_first_ongoing_at_the_start_of_a_ledger_after_the_previous_ledger_was_deleted():
    a, b = TxnId(2, 1), TxnId(2, 2)
    entries = [LogEntry(T, 1, 0, "DATA", *a), LogEntry(T, 1, 1, "ABORT", *a),
               LogEntry(T, 2, 0, "DATA"), LogEntry(T, 3, 0, "DATA", *b)]
    log = SnapshotLog()
    log.write_snapshot(state_of(entries), 1, SnapshotConfig())  # max read position 2:0
    remaining = [e for e in entries if e.ledger_id != 2]
    assert_recovers(log, remaining, deleted={2})  # position before 3:0 is now 1:1
    remaining = [e for e in entries if e.ledger_id == 3]
    assert_recovers(log, remaining, deleted={1, 2})  # and now 3:-1


# -- beyond PIP-178: the leak and the snapshot index ---------------------------------------------

def test_pip178_as_written_leaks_trimmed_aborts_and_the_index_does_not():
    entries = aborted_history(12)
    config = SnapshotConfig(max_aborts_per_segment=2)
    log = SnapshotLog()
    log.write_snapshot(state_of(entries), 1, config)  # 12 aborts: keys 1..5 + end
    remaining = [e for e in entries if e.ledger_id > 103]  # 8 of 12 aborts trimmed
    log.write_snapshot(state_of(remaining), 2, config)  # 4 aborts: keys 1 + end, 2..5 stale
    stale = [r for r in log.latest_per_key().values() if not r.tombstone and r.snapshot_id == 1]
    assert stale == []  # every stale key's latest row is a tombstone
    legacy = [r for r in log.rows if not r.tombstone]  # PIP-178: no index, no tombstones
    legacy_latest = {r.snapshot_key: r for r in legacy}
    _, leaked = recover_pip178_as_written(T, legacy_latest.values())
    truth = tuple(replay_topic(T, remaining).aborts.items())
    assert len(leaked) > len(truth) and set(truth) < set(leaked)  # trimmed aborts come back
    log.compact()
    assert {r.snapshot_key for r in log.rows} == {f"{T}-1", f"{T}-end"}  # stale keys removed
    # The index alone is exact, even without knowing which ledgers were deleted.
    assert live_snapshot(T, log.rows).aborts == truth
    assert_recovers(log, remaining, deleted=set(range(100, 104)))


def test_racing_writers_leave_one_complete_snapshot():
    entries = aborted_history(12)
    config = SnapshotConfig(max_aborts_per_segment=2)
    older, newer = split_snapshot(state_of(entries[:10]), 1, config), split_snapshot(state_of(entries), 2, config)
    for interleaving in ("older_end_last", "newer_end_last"):
        log = SnapshotLog()
        a, b = (newer, older) if interleaving == "older_end_last" else (older, newer)
        for pair in zip(a[:-1], b[:-1]):
            for segment in pair:
                log.append(segment)
        for rest in (a[len(b) - 1:-1], b[len(a) - 1:-1], [a[-1]], [b[-1]]):
            for segment in rest:
                log.append(segment)
        assert_recovers(log, entries)
        log.compact()
        assert_recovers(log, entries)


@pytest.mark.parametrize("damage, reason", [
    (lambda rows: [r for r in rows if not r.is_end], "no 'orders-partition-0-end'"),
    (lambda rows: [r for r in rows if r.segment_index != 2], "lacks segment"),
    (lambda rows: [replace(r, snapshot_key="other-topic-end") if r.is_end else r for r in rows], "not a key of topic"),
    (lambda rows: [replace(r, abort_count=r.abort_count + 1) if r.is_end else r for r in rows], "its index says"),
])
def test_bad_segment_rows_fall_back_to_full_replay(damage, reason):
    entries = aborted_history(7)
    log = SnapshotLog()
    log.write_snapshot(state_of(entries[:10]), 1, SnapshotConfig(max_aborts_per_segment=2))
    log.rows = damage(log.rows)
    recovered = assert_recovers(log, entries, source=Source.FULL_REPLAY)
    assert reason in recovered.fallback_reason


# -- random histories ---------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(op_lists)
def test_random_histories_recover_to_the_full_replay(ops):
    history = simulate(T, ops, first_ledger=10, txn_base=3)
    recovered = recover(T, history.log.rows, history.entries, history.deleted)
    assert (recovered.max_read_position, recovered.aborts) == full_replay(history)
    if recovered.source == Source.FULL_REPLAY:
        # Only when no snapshot was ever completed.
        assert not any(r.is_end and not r.tombstone for r in history.log.rows), recovered.fallback_reason
