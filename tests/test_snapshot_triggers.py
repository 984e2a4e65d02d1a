"""When a snapshot is due (`snapshots.triggers`): the one rule `snapshot_states` runs on Spark and
the snapshot run's pre-check runs on the state it wrote, later."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pyarrow as pa

from txn_engine.snapshots.triggers import TriggerConfig, due_inputs, due_reasons

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
TS = pa.timestamp("us", "UTC")


def test_each_trigger_names_its_reason_in_order():
    rows = pa.table({
        "has_snapshot": [False, False, True, True, True, True, True, False],
        "unfinished": [False, True, True, False, False, False, False, False],
        "first_due": [True, False, False, False, False, False, False, False],
        "changes_since_snapshot": [0, 0, 5, 3, 2, 2, 0, 7],
        "last_snapshot_at": pa.array([None, None, NOW, NOW, NOW - timedelta(seconds=60.5), NOW - timedelta(seconds=59),
                                      NOW - timedelta(hours=1), None], TS),
    })
    reasons = due_reasons(rows, TriggerConfig(max_changes=3, interval_seconds=60), NOW).to_pylist()
    assert reasons == [
        "first snapshot: the topic has transactional data",
        "an unfinished snapshot (parts without their end, its writer stopped): written again",
        "an unfinished snapshot (parts without their end, its writer stopped): written again",
        "3 changes since the last snapshot (threshold 3)",
        "2 changes and 61 s since the last snapshot (interval 60 s)",  # rounded half up, as Spark's %.0f
        None,  # changes, but the interval has not passed
        None,  # the interval passed, but nothing changed
        None,  # changes without a snapshot nor transactional data: nothing to snapshot
    ]


def test_the_written_state_decides_again_later():
    # As `txn_snapshot_state` holds them: a due NO_SNAPSHOT topic, one that was not (no
    # transactional data), a READY one below the threshold, an INITIALIZING one.
    states = pa.table({
        "topic": ["new", "idle", "ready", "cut"],
        "state": ["NO_SNAPSHOT", "NO_SNAPSHOT", "READY", "INITIALIZING"],
        "due": [True, False, False, True],
        "snapshot_id": pa.array([None, None, 4, 2], pa.int64()),
        "changes_since_snapshot": pa.array([3, 0, 1, 0], pa.int64()),
        "last_snapshot_at": pa.array([None, None, NOW, NOW], TS),
    })
    triggers = TriggerConfig(max_changes=10, interval_seconds=300)
    at = lambda seconds: due_reasons(due_inputs(states), triggers, NOW + timedelta(seconds=seconds)).is_valid().to_pylist()  # noqa: E731
    assert at(0) == [True, False, False, True]
    assert at(300) == [True, False, True, True]  # the interval trigger, now that it passed
