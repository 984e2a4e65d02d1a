"""Snapshots on Spark (txn_engine.snapshots.jobs) on real Delta tables, against the reference and
the full replay: the writer, PIP-178's scenarios, the leak fix, crashes, racing writers, bad rows,
and random histories (many topics per Spark job)."""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import datetime, timezone

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pyspark.sql import functions as F

from tests.snapshot_histories import op_lists, replay_topic, simulate
from tests.buffer_histories import frame
from txn_engine.buffer.spark_runner import compute_buffer_tables
from txn_engine.log.ledgers import record_ledger_states
from txn_engine.storage.locks import TableLockTimeout
from txn_engine.storage.warehouse import stored_frame
from txn_engine.core.log_types import LogEntry, TxnId
from txn_engine.core.positions import Position
from txn_engine.core.schema import (
    LEDGER_ENTRIES,
    LEDGER_STATES_LOG,
    LEDGER_STATES_SCHEMA,
    RECOVERED_BUFFER_STATE,
    TXN_SNAPSHOT_SEGMENTS,
    TXN_SNAPSHOT_SEGMENTS_SCHEMA,
)
from txn_engine.snapshots.jobs import ENDS, PARTS, TriggerConfig, compact_segments, compacted_segments, current_snapshot_states, read_segments, recover_from_warehouse, snapshot_lock, snapshot_states, write_snapshots
from txn_engine.snapshots.recovery import DriverLimits, recover_to_warehouse
from txn_engine.reference.snapshots import Crash, SnapshotSegment, compacted_rows, recover, split_snapshot
from txn_engine.snapshots.format import ABORT_BYTES, SEGMENT_ENVELOPE_BYTES, SnapshotConfig, SnapshotError, Source

SMALL = SnapshotConfig(max_aborts_per_segment=2)


def aborted_history(topic: str, n: int, ledger_size: int = 4, first_ledger: int = 100) -> list[LogEntry]:
    """`n` transactions on `topic`, each a DATA entry then its ABORT, `ledger_size` entries a ledger."""
    entries = []
    for i in range(n):
        for kind in ("DATA", "ABORT"):
            k = len(entries)
            entries.append(LogEntry(topic, first_ledger + k // ledger_size, k % ledger_size, kind, 7, i))
    return entries


def snapshot(warehouse, entries: list[LogEntry], topics, config=SMALL, **kwargs):
    """Write a snapshot of `topics` as of `entries` (a prefix of the log)."""
    tables = compute_buffer_tables(frame(warehouse.spark, entries))
    try:
        return write_snapshots(warehouse, topics, config, aborted=tables.aborted_txns, stable=tables.stable_positions,
                               **kwargs)
    finally:
        tables.unpersist()


def store_log(warehouse, entries: list[LogEntry], deleted: dict[str, set[int]] | None = None) -> None:
    """Replace the log and its ledger_states: hypothesis reuses one warehouse across examples, and a
    DELETED record left by an earlier example would trim this one's abort sets."""
    warehouse.overwrite(LEDGER_ENTRIES, frame(warehouse.spark, entries))
    warehouse.overwrite(LEDGER_STATES_LOG, warehouse.spark.createDataFrame([], LEDGER_STATES_SCHEMA))
    transitions = [(t, lid, "DELETED", "retention") for t, ids in (deleted or {}).items() for lid in sorted(ids)]
    record_ledger_states(warehouse, transitions)


def recovered_by_topic(warehouse, limits: DriverLimits = DriverLimits(), path: str = "driver") -> dict[str, dict]:
    """Recovery as the asset runs it (written to recovered_buffer_state), row for row the Spark path's."""
    assert recover_to_warehouse(warehouse, limits).path == path
    written = {r.topic: r.asDict(recursive=True) for r in warehouse.read(RECOVERED_BUFFER_STATE).collect()}
    on_spark = {r.topic: r.asDict(recursive=True)
                for r in stored_frame(RECOVERED_BUFFER_STATE, recover_from_warehouse(warehouse)).collect()}
    differing = {t: (written.get(t), on_spark.get(t)) for t in set(written) | set(on_spark) if written.get(t) != on_spark.get(t)}
    assert not differing, differing
    return written


def truth(entries: list[LogEntry], topic: str) -> tuple[Position, list[tuple]]:
    buffer = replay_topic(topic, [e for e in entries if e.topic == topic])
    return buffer.max_read_position, [(t.most_bits, t.least_bits, p.ledger_id, p.entry_id) for t, p in buffer.aborts.items()]


def as_truth(row: dict) -> tuple[Position, list[tuple]]:
    return (Position(row["max_read_ledger_id"], row["max_read_entry_id"]),
            [(a["txn_most_bits"], a["txn_least_bits"], a["ledger_id"], a["entry_id"]) for a in row["aborts"]])


def stored_rows(warehouse) -> list[SnapshotSegment]:
    """The segments table as the reference's rows, to check what a writer left with the oracle."""
    return [SnapshotSegment(r.snapshot_key, r.topic, Position(r.max_read_ledger_id, r.max_read_entry_id),
                            tuple((TxnId(a.txn_most_bits, a.txn_least_bits), Position(a.ledger_id, a.entry_id))
                                  for a in r.aborts), r.snapshot_id, r.segment_index, r.segment_count, r.abort_count,
                            r.write_seq, bool(r.tombstone))
            for r in read_segments(warehouse).collect()]


def assert_reference_recovers(warehouse, entries, topic: str) -> None:
    recovered = recover(topic, stored_rows(warehouse), entries)
    assert recovered.source == Source.SNAPSHOT, recovered.fallback_reason
    assert (recovered.max_read_position, [(t.most_bits, t.least_bits, p.ledger_id, p.entry_id)
                                          for t, p in recovered.aborts]) == truth(entries, topic)


def assert_all_recover(warehouse, entries, expect_source: dict[str, str] | None = None, **how) -> dict[str, dict]:
    recovered = recovered_by_topic(warehouse, **how)
    topics = {e.topic for e in entries}
    assert set(recovered) == topics
    for topic in topics:
        assert as_truth(recovered[topic]) == truth(entries, topic), topic
        if expect_source and topic in expect_source:
            assert recovered[topic]["source"] == expect_source[topic], (topic, recovered[topic]["fallback_reason"])
    return recovered


# -- the writer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("compute", ["driver", "spark"])
def test_writer_cuts_segments_like_the_reference(warehouse, compute):
    """Both ways a snapshot run goes, the rules of `snapshots.segments` in the driver or on Spark:
    the cut, the write order, the tombstones and the compaction, each against the reference."""
    entries = aborted_history("big", 7) + aborted_history("small", 2, first_ledger=200) + \
        [LogEntry("none", 300, 0, "DATA", 1, 1), LogEntry("none", 300, 1, "COMMIT", 1, 1)]
    store_log(warehouse, entries)
    summary = snapshot(warehouse, entries, ["big", "small", "none"], SnapshotConfig(max_aborts_per_segment=3),
                       snapshot_ids={"big": 11, "small": 12, "none": 13}, compute=compute)
    assert (summary.segments_per_topic, summary.computed_by) == ({"big": 3, "small": 1, "none": 1}, compute)
    rows = {r.snapshot_key: r for r in read_segments(warehouse).collect()}
    assert set(rows) == {"big-1", "big-2", "big-end", "small-end", "none-end"}
    for topic, sid in (("big", 11), ("small", 12), ("none", 13)):
        expected = split_snapshot(replay_topic(topic, [e for e in entries if e.topic == topic]).snapshot(), sid,
                                  SnapshotConfig(max_aborts_per_segment=3))
        for seg in expected:
            row = rows[seg.snapshot_key]
            assert (row.max_read_ledger_id, row.max_read_entry_id) == tuple(seg.max_read_position)
            assert [(a.txn_most_bits, a.txn_least_bits, a.ledger_id, a.entry_id) for a in row.aborts] == \
                [(t.most_bits, t.least_bits, p.ledger_id, p.entry_id) for t, p in seg.aborts]
            assert (row.snapshot_id, row.segment_index, row.segment_count, row.abort_count, row.tombstone) == \
                (sid, seg.segment_index, seg.segment_count, seg.abort_count, False)
    # Parts are written before ends: every end has a higher write_seq than its parts.
    assert rows["big-end"].write_seq > max(rows["big-1"].write_seq, rows["big-2"].write_seq)
    # A shorter snapshot of big tombstones its stale part; compaction keeps the reference's rows.
    again = snapshot(warehouse, entries, ["big"], SnapshotConfig(max_aborts_per_segment=5), compute=compute)
    assert (again.segments_per_topic, again.tombstones) == ({"big": 2}, 1)
    written = stored_rows(warehouse)
    assert [(r.snapshot_key, r.tombstone) for r in written if r.write_seq == max(s.write_seq for s in written)] == \
        [("big-2", True)]
    compact_segments(warehouse, vacuum_retention_hours=None, optimize=False, compute=compute)
    assert sorted(r.write_seq for r in stored_rows(warehouse)) == sorted(r.write_seq for r in compacted_rows(written))
    assert_all_recover(warehouse, entries, expect_source={"big": "SNAPSHOT", "small": "SNAPSHOT", "none": "SNAPSHOT"})


def test_writer_refuses_a_topic_without_stable_position(warehouse):
    with pytest.raises(ValueError, match="materialize stable_positions"):
        snapshot(warehouse, aborted_history("a", 1), ["a", "nowhere"])
    assert not warehouse.exists(TXN_SNAPSHOT_SEGMENTS)
    # A bound the config accepts but under which this topic's segment cannot hold one abort: refused
    # before any write (was: an end segment holding 1 of its aborts, a good snapshot compacted away).
    too_small = SnapshotConfig(max_segment_bytes=SEGMENT_ENVELOPE_BYTES + ABORT_BYTES)
    with pytest.raises(SnapshotError, match=f"too long for max_segment_bytes {too_small.max_segment_bytes}"):
        snapshot(warehouse, aborted_history("a", 1), ["a"], too_small)
    assert not warehouse.exists(TXN_SNAPSHOT_SEGMENTS)
    # A bound past an int (1 TiB) is a bound like any other (was: Spark's CAST_OVERFLOW).
    snapshot(warehouse, aborted_history("a", 3), ["a"], SnapshotConfig(max_segment_bytes=2**40))
    [row] = read_segments(warehouse).collect()
    assert (row.snapshot_key, row.abort_count, len(row.aborts)) == ("a-end", 3, 3)


# -- PIP-178's scenarios, the leak fix and crashes, one topic each ------------------------------

def test_named_scenarios_recover_to_the_full_replay(warehouse):
    normal = aborted_history("normal", 9, first_ledger=100)
    crashed = aborted_history("crashed", 9, first_ledger=200)
    trimmed = aborted_history("trimmed", 9, first_ledger=300)
    leak = aborted_history("leak", 9, first_ledger=400)
    x, e = TxnId(1, 1), TxnId(1, 2)
    before_start = [LogEntry("before", 500, 0, "DATA", *x), LogEntry("before", 500, 1, "DATA", *e),
                    LogEntry("before", 500, 2, "ABORT", *x), LogEntry("before", 500, 3, "ABORT", *x),
                    LogEntry("before", 500, 4, "DATA", *x), LogEntry("before", 501, 0, "COMMIT", *e),
                    LogEntry("before", 502, 0, "DATA", 1, 3)]
    never = aborted_history("never", 3, first_ledger=600)
    everything = normal + crashed + trimmed + leak + before_start + never

    # First snapshots, mid-history, of every topic but "never".
    first = [e for e in everything if e.topic != "before" and e.ledger_id % 100 < 2] + before_start[:3]
    snapshot(warehouse, first, ["normal", "crashed", "trimmed", "leak", "before"])
    # crashed: a new, longer snapshot cut short after its second part.
    def crash_after_two_parts(step, rows, n=[0]):
        n[0] += step == PARTS
        if n[0] == 2:
            raise Crash("broker restart")
    with pytest.raises(Crash):
        snapshot(warehouse, crashed, ["crashed"], parts_per_commit=1, after_commit=crash_after_two_parts)
    # trimmed and leak: the oldest ledgers deleted; leak also takes a new, shorter snapshot.
    deleted = {"trimmed": {300, 301}, "leak": {400, 401, 402, 403}}
    remaining = [e for e in everything if e.ledger_id not in deleted.get(e.topic, ())]
    snapshot(warehouse, [e for e in remaining if e.topic == "leak"], ["leak"])
    store_log(warehouse, remaining, deleted)

    recovered = assert_all_recover(warehouse, remaining, expect_source={
        "normal": "SNAPSHOT", "crashed": "SNAPSHOT", "trimmed": "SNAPSHOT", "leak": "SNAPSHOT", "before": "SNAPSHOT",
        "never": "FULL_REPLAY"})
    assert recovered["never"]["fallback_reason"] == "no snapshot yet"
    assert recovered["normal"]["replayed_entries"] < len(normal)
    # The leak: the old, longer snapshot's stale keys are tombstoned, then compacted away.
    latest = {r.snapshot_key: r for r in read_segments(warehouse).orderBy("write_seq").collect()}
    assert all(latest[f"leak-{i}"].tombstone for i in (2, 3, 4) if f"leak-{i}" in latest)
    # The per-topic state in the driver and on Spark at one instant: one rule, either runner.
    now = datetime.now(timezone.utc)
    driver, on_spark = (current_snapshot_states(warehouse, TriggerConfig(), now, compute=c).to_pylist()
                        for c in ("driver", "spark"))
    assert driver == on_spark
    assert {r["topic"]: (r["state"], r["due"]) for r in driver} == {
        "normal": ("READY", False), "crashed": ("INITIALIZING", True), "trimmed": ("READY", False),
        "leak": ("READY", False), "before": ("READY", False), "never": ("NO_SNAPSHOT", True)}
    # Crash during compaction: nothing changes; then a real compaction.
    version = warehouse.version(TXN_SNAPSHOT_SEGMENTS)
    with pytest.raises(Crash):
        compact_segments(warehouse, before_commit=lambda: (_ for _ in ()).throw(Crash("killed")))
    assert warehouse.version(TXN_SNAPSHOT_SEGMENTS) == version
    summary = compact_segments(warehouse)
    assert summary.rows_after < summary.rows_before
    keys = {r.snapshot_key for r in read_segments(warehouse).collect()}
    assert not any(k.startswith("leak-") and k != "leak-end" and k != "leak-1" for k in keys), keys
    assert {"crashed-1", "crashed-2", "crashed-end"} <= keys
    # crashed-1 twice: the live snapshot's row survives beside the unfinished snapshot's newer one.
    assert read_segments(warehouse).where("snapshot_key = 'crashed-1'").count() == 2
    assert_all_recover(warehouse, remaining, expect_source={"crashed": "SNAPSHOT", "leak": "SNAPSHOT"})


def test_crash_after_each_commit_of_a_snapshot_write(warehouse):
    entries = aborted_history("t", 8)
    store_log(warehouse, entries)
    snapshot(warehouse, entries[:6], ["t"])  # 3 aborts: t-1 + t-end
    for crash_at in range(1, 6):  # 8 aborts: parts 1..3, end, then tombstones (none here)
        steps = []

        def crash(step, rows, n=[0]):
            n[0] += 1
            steps.append(step)
            if n[0] == crash_at:
                raise Crash(step)
        try:
            snapshot(warehouse, entries, ["t"], parts_per_commit=1, after_commit=crash)
        except Crash:
            pass
        assert_reference_recovers(warehouse, entries, "t")  # what the writer left, checked by the oracle
        if crash_at == 1:  # parts without their end: due again, though nothing changed enough to trigger one
            [state] = snapshot_states(warehouse.read(LEDGER_ENTRIES), read_segments(warehouse), TriggerConfig()).collect()
            assert (state.state, state.due, state.changes_since_snapshot) == ("INITIALIZING", True, 5)
            assert "unfinished snapshot" in state.due_reason
    assert steps == [PARTS, PARTS, PARTS, ENDS]  # the last round ran to the end
    assert_all_recover(warehouse, entries, expect_source={"t": "SNAPSHOT"})


def test_racing_writers_on_one_topic(warehouse):
    """Two writers of one topic's snapshots at once take turns (the snapshot lock): neither's
    commits fall between the other's parts and end, and the last end written is the live one."""
    entries = aborted_history("t", 10)
    store_log(warehouse, entries)
    errors = []

    def write(prefix):
        try:
            snapshot(warehouse, prefix, ["t"], SnapshotConfig(max_aborts_per_segment=1), parts_per_commit=1)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=write, args=(p,)) for p in (entries[:8], entries)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    rows = read_segments(warehouse).orderBy("write_seq").collect()
    seqs = [r.write_seq for r in rows]
    assert len(seqs) == len(set(seqs))  # write_seq is unique across the writers
    by_writer = [r.snapshot_id for r in rows]
    assert sum(1 for a, b in zip(by_writer, by_writer[1:]) if a != b) == 1, by_writer  # one after the other
    assert_reference_recovers(warehouse, entries, "t")
    compact_segments(warehouse, vacuum_retention_hours=None, optimize=False)  # the rule; maintenance is tested above
    assert_all_recover(warehouse, entries, expect_source={"t": "SNAPSHOT"})


def test_a_compaction_waits_for_an_unfinished_snapshot_of_another_writer(warehouse):
    """API callers of write_snapshots and compact_segments take the snapshot lock, as a snapshot
    run does: a second writer's snapshot and compaction, started while another writer stopped
    between its first part and its end, would drop that part (its end, written last, then names a
    snapshot without it, and the topic falls back to a full replay)."""
    entries = aborted_history("t", 8)  # 8 aborts: parts 1..3 and the end
    store_log(warehouse, entries)
    paused, resume = threading.Event(), threading.Event()
    done: dict[str, object] = {}

    def pause_after_first_part(step, rows):
        if step == PARTS and not paused.is_set():
            paused.set()
            assert resume.wait(120)

    def run(name, work):
        try:
            done[name] = work()
        except BaseException as error:  # noqa: BLE001 - reported by the assertions below
            done[name] = error

    first = threading.Thread(target=run, args=("first", lambda: snapshot(
        warehouse, entries, ["t"], parts_per_commit=1, after_commit=pause_after_first_part)))
    second = threading.Thread(target=run, args=("second", lambda: (
        snapshot(warehouse, entries[:12], ["t"]), compact_segments(warehouse, vacuum_retention_hours=None, optimize=False))))
    first.start()
    try:
        assert paused.wait(120), done
        with pytest.raises(TableLockTimeout, match="transaction-buffer snapshots of this warehouse"):
            with snapshot_lock(warehouse, timeout_s=0.3):
                pass
        second.start()
        second.join(1.0)
        assert second.is_alive() and "second" not in done  # waiting for the first writer's end
    finally:
        resume.set()
        first.join(120)
    second.join(120)
    assert not any(isinstance(v, BaseException) for v in done.values()), done
    # The second writer's snapshot, taken after the first, is live, whole, and compacted to itself.
    live = {r.snapshot_key: r.snapshot_id for r in read_segments(warehouse).collect()}
    assert sorted(live) == ["t-1", "t-2", "t-end"] and len(set(live.values())) == 1, live
    assert set(live.values()) == set(done["second"][0].snapshot_ids.values())
    assert_all_recover(warehouse, entries, expect_source={"t": "SNAPSHOT"})


def test_a_tail_beyond_the_driver_limits_recovers_on_spark(warehouse):
    entries = aborted_history("t", 8) + aborted_history("u", 2, first_ledger=200)
    store_log(warehouse, entries)
    snapshot(warehouse, entries[:6] + entries[16:], ["t", "u"])  # t: 5 aborts after its snapshot
    expected = {"t": "SNAPSHOT", "u": "SNAPSHOT"}
    for limits in (DriverLimits(max_replayed_entries=9), DriverLimits(max_scanned_entries=10)):
        recovered = assert_all_recover(warehouse, entries, expected, limits=limits, path="spark")
        assert recovered["t"]["replayed_entries"] == 10
    assert_all_recover(warehouse, entries, expected, limits=DriverLimits(max_replayed_entries=10,
                                                                          max_scanned_entries=20))


def test_bad_segment_rows_fall_back_to_full_replay(warehouse, spark):
    topics = ["unreadable", "wrong", "no_end", "fine"]
    entries = [e for i, t in enumerate(topics) for e in aborted_history(t, 5, first_ledger=100 * (i + 1))]
    store_log(warehouse, entries)
    snapshot(warehouse, entries, topics)
    table = read_segments(warehouse)
    damaged = (
        table.where(~((F.col("topic") == "no_end") & F.col("snapshot_key").endswith("-end")))
        .withColumn("aborts", F.when(F.col("snapshot_key") == "unreadable-1", F.lit(None)).otherwise(F.col("aborts")))
        .withColumn("snapshot_key", F.when(F.col("snapshot_key") == "wrong-1", F.lit("fine-1"))
                    .otherwise(F.col("snapshot_key")))
    )
    warehouse.overwrite(TXN_SNAPSHOT_SEGMENTS, damaged.localCheckpoint())
    recovered = assert_all_recover(warehouse, entries, expect_source={
        "unreadable": "FULL_REPLAY", "wrong": "FULL_REPLAY", "no_end": "FULL_REPLAY"})
    assert "unreadable" in recovered["unreadable"]["fallback_reason"]
    assert "not a key of topic 'wrong'" in recovered["wrong"]["fallback_reason"]
    assert "no live 'no_end-end'" in recovered["no_end"]["fallback_reason"]
    # "fine-1" now has a newer row of another topic under its key; fine recovers from its own rows.
    assert recovered["fine"]["source"] == "SNAPSHOT"


# -- random histories, many topics per Spark job -------------------------------------------------

def segment_rows(rows: list[SnapshotSegment]) -> list[tuple]:
    return [(r.snapshot_key, r.topic, r.max_read_position.ledger_id, r.max_read_position.entry_id,
             [(t.most_bits, t.least_bits, p.ledger_id, p.entry_id) for t, p in r.aborts], r.write_seq, r.snapshot_id,
             r.segment_index, r.segment_count, r.abort_count, r.tombstone, None) for r in rows]


# Each example is several Spark jobs: few examples, no shrinking (a failure shows its history as drawn).
@settings(max_examples=2, deadline=None, database=None, phases=(Phase.explicit, Phase.generate), suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(op_lists, min_size=6, max_size=10))
def test_random_histories_recover_on_spark(warehouse, production_spark, histories_ops):
    spark = production_spark
    histories = [simulate(f"h{i}", ops, first_ledger=1000 * (i + 1), txn_base=i) for i, ops in enumerate(histories_ops)]
    entries = [e for h in histories for e in h.entries]
    if not entries:
        return
    # One segments table for all: write_seq made global by offsetting each history's log.
    rows, offset = [], 0
    for h in histories:
        rows += [replace(r, write_seq=r.write_seq + offset) for r in h.log.rows]
        offset += h.log.last_write_seq
    warehouse.overwrite(TXN_SNAPSHOT_SEGMENTS, spark.createDataFrame(segment_rows(rows), TXN_SNAPSHOT_SEGMENTS_SCHEMA))
    store_log(warehouse, entries, {h.topic: h.deleted for h in histories})
    assert_all_recover(warehouse, entries)
    # Spark's compaction keeps exactly the reference's rows.
    kept = {r.write_seq for r in compacted_segments(read_segments(warehouse)).collect()}
    assert kept == {r.write_seq for r in compacted_rows(rows)}
