"""The snapshot assets, their check, the sensor and the schedule, materialized in-process on Delta."""

from __future__ import annotations

from datetime import timedelta, timezone

from dagster import AssetCheckSeverity, AssetKey, AssetSelection, DagsterInstance, RunRequest, SkipReason, build_schedule_context, \
    build_sensor_context, materialize

from pyspark.sql import functions as F

from assets.snapshots import snapshot_schedule, snapshot_trigger_sensor
from assets.partitions import LEDGER_PARTITIONS, range_tags
from pipelines.definitions import ALL_ASSETS, ALL_CHECKS, defs
from resources.warehouse import WarehouseResource
from tests.dagster_runs import sensor_tick
from tests.buffer_histories import frame
from tests.test_snapshot_jobs import aborted_history, as_truth, truth
from tests.threads import held_elsewhere
from txn_engine.core.log_types import LogEntry
from txn_engine.core.schema import (
    ABORTED_TXNS,
    COMMITTED_ENTRIES,
    LEDGER_ENTRIES,
    LEDGERS,
    RECOVERED_BUFFER_STATE,
    STABLE_POSITIONS,
    TXN_MARKERS,
    TXN_SNAPSHOT_SEGMENTS,
    TXN_SNAPSHOT_STATE,
)
from txn_engine.snapshots.jobs import TriggerConfig, read_segments, snapshot_lock, snapshot_states

BUFFER_AND_SNAPSHOTS = AssetSelection.assets(TXN_MARKERS, STABLE_POSITIONS, ABORTED_TXNS, COMMITTED_ENTRIES) | \
    AssetSelection.groups("snapshots")


def buffer_and_snapshots(resources, instance, **segments):
    """The catalog, the closed ledgers added as partitions, then the buffer over them and the snapshots in one run."""
    catalog = materialize([*ALL_ASSETS, *ALL_CHECKS], selection=AssetSelection.assets(LEDGERS), resources=resources,
                          instance=instance)
    assert catalog.success
    sensor_tick(instance, resources)
    keys = instance.get_dynamic_partitions(LEDGER_PARTITIONS.name)
    return materialize([*ALL_ASSETS, *ALL_CHECKS], selection=BUFFER_AND_SNAPSHOTS, resources=resources,
                       instance=instance, tags=range_tags(keys[0], keys[-1]), run_config=run_config(**segments))


def run_config(**segments):
    return {"ops": {"txn_snapshot_segments": {"config": {"max_aborts_per_segment": 2, **segments}}}}


def metadata_of(result, table: str) -> dict:
    [mat] = [e.event_specific_data.materialization for e in result.get_asset_materialization_events()
             if e.event_specific_data.materialization.asset_key == AssetKey(table)]
    return {k: v.value for k, v in mat.metadata.items()}


def test_snapshot_assets_state_and_check(warehouse, dagster_resources):
    entries = aborted_history("busy", 5) + [LogEntry("plain", 900, 0, "DATA"), LogEntry("plain", 900, 1, "DATA")]
    warehouse.overwrite(LEDGER_ENTRIES, frame(warehouse.spark, entries))
    instance = DagsterInstance.ephemeral()
    result = buffer_and_snapshots(dagster_resources, instance, compact=False)
    assert result.success
    # The first snapshot as soon as a topic has transactional data; none for a topic without.
    states = {r.topic: r for r in warehouse.read(TXN_SNAPSHOT_STATE).collect()}
    assert set(states) == {"busy"}
    assert (states["busy"].state, states["busy"].segment_count, states["busy"].abort_count, states["busy"].due) == \
        ("READY", 3, 5, False)
    assert metadata_of(result, TXN_SNAPSHOT_STATE)["topics_by_state"] == {"NO_SNAPSHOT": 0, "INITIALIZING": 0, "READY": 1}
    assert metadata_of(result, TXN_SNAPSHOT_SEGMENTS)["segments_per_topic"] == {"busy": 3}
    recovered = {r.topic: r.asDict(recursive=True) for r in warehouse.read(RECOVERED_BUFFER_STATE).collect()}
    assert recovered["busy"]["source"] == "SNAPSHOT" and recovered["plain"]["source"] == "FULL_REPLAY"
    for topic in ("busy", "plain"):
        assert as_truth(recovered[topic]) == truth(entries, topic)
    checks = {c.check_name: c for c in result.get_asset_check_evaluations()}
    assert checks["recovered_state_equals_full_replay"].passed

    # More aborts: the triggers (changes since the snapshot, the interval), then a new snapshot.
    more = entries + [LogEntry("busy", 110, i, kind, 8, i // 2) for i, kind in enumerate(["DATA", "ABORT"] * 2)]
    warehouse.overwrite(LEDGER_ENTRIES, frame(warehouse.spark, more))
    # The check alone now: the stored recovery is of the log before, which it says (a warning
    # naming both versions and what to run), rather than calling the recovery wrong.
    check_only = materialize([*ALL_ASSETS, *ALL_CHECKS], instance=instance, resources=dagster_resources,
                             selection=AssetSelection.checks_for_assets(RECOVERED_BUFFER_STATE))
    [stale] = check_only.get_asset_check_evaluations()
    log_version = warehouse.version(LEDGER_ENTRIES)
    assert (stale.passed, stale.severity, stale.metadata["ledger_entries_version"].value) == \
        (False, AssetCheckSeverity.WARN, log_version)
    assert stale.metadata["recovered_from_ledger_entries_version"].value < log_version
    assert "materialize take_snapshots" in stale.description
    segments = read_segments(warehouse).localCheckpoint()
    taken = states["busy"].last_snapshot_at.replace(tzinfo=timezone.utc)

    def busy(triggers, now):
        return snapshot_states(warehouse.read(LEDGER_ENTRIES), segments, triggers, now).where("topic = 'busy'").first()
    below = busy(TriggerConfig(max_changes=3), taken)
    assert (below.changes_since_snapshot, below.due) == (2, False)
    assert busy(TriggerConfig(max_changes=2), taken).due
    assert busy(TriggerConfig(max_changes=3, interval_seconds=60), taken + timedelta(seconds=61)).due
    result = buffer_and_snapshots(dagster_resources, instance, max_changes=2, compact=True)
    assert metadata_of(result, TXN_SNAPSHOT_SEGMENTS)["topics_snapshotted"] == 1
    state = warehouse.read(TXN_SNAPSHOT_STATE).where("topic = 'busy'").first()
    assert (state.state, state.abort_count, state.changes_since_snapshot) == ("READY", 7, 0)
    assert all(c.passed for c in result.get_asset_check_evaluations())
    # Compaction dropped the first snapshot's rows: only the live snapshot's keys are left.
    assert sorted(r.snapshot_key for r in read_segments(warehouse).collect()) == ["busy-1", "busy-2", "busy-3", "busy-end"]

    # One snapshot run at a time: while another holds the warehouse's snapshot lock, a run waits
    # (here 0.5 s) and fails saying why, writing nothing (a compaction beside another writer's
    # unfinished snapshot would drop its parts).
    keys = sorted(r.snapshot_key for r in read_segments(warehouse).collect())
    # Held by another thread: the lock is reentrant in its own, and an in-process run executes there.
    with held_elsewhere(lambda: snapshot_lock(warehouse)):
        blocked = materialize([*ALL_ASSETS, *ALL_CHECKS], selection=AssetSelection.groups("snapshots"),
                              resources=dagster_resources, raise_on_error=False,
                              run_config={"ops": {"txn_snapshot_segments": {"config": {"force": True, "lock_timeout_s": 0.5}}}})
    assert not blocked.success
    [failure] = [e for e in blocked.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "another txnlake process is writing the transaction-buffer snapshots" in str(failure.event_specific_data.error)
    assert sorted(r.snapshot_key for r in read_segments(warehouse).collect()) == keys

    # The check fails when the recovered table disagrees with the full replay.
    wrong = warehouse.read(RECOVERED_BUFFER_STATE).withColumn("max_read_entry_id", F.lit(-5).cast("long"))
    warehouse.overwrite(RECOVERED_BUFFER_STATE, wrong.localCheckpoint())
    result = materialize([*ALL_ASSETS, *ALL_CHECKS], selection=AssetSelection.checks_for_assets(RECOVERED_BUFFER_STATE),
                         resources=dagster_resources)
    [check] = result.get_asset_check_evaluations()
    assert not check.passed
    assert set(check.metadata["mismatched_topics"].value) == {"busy", "plain"}


def test_sensor_fires_on_new_ledger_entries_and_schedule_runs_the_job(warehouse, warehouse_root, tmp_path, monkeypatch):
    assert defs.resolve_sensor_def("snapshot_trigger_sensor").job_name == "take_snapshots"
    assert defs.resolve_schedule_def("snapshot_schedule").job_name == "take_snapshots"
    # The sensor watches its warehouse resource's root, not the environment's (which names another).
    monkeypatch.setenv("TXNLAKE_WAREHOUSE", str(tmp_path / "elsewhere"))
    resources = {"warehouse": WarehouseResource(root=str(warehouse_root))}

    def tick(cursor=None):
        context = build_sensor_context(instance=instance, resources=resources, cursor=cursor)
        return context, snapshot_trigger_sensor(context)

    with DagsterInstance.ephemeral() as instance:
        assert isinstance(tick()[1], SkipReason)
        warehouse.overwrite(LEDGER_ENTRIES, frame(warehouse.spark, aborted_history("t", 1)))
        context, request = tick()
        assert isinstance(request, RunRequest) and request.run_key == "ledger_entries-v0"
        assert isinstance(tick(context.cursor)[1], SkipReason)
        warehouse.append(LEDGER_ENTRIES, frame(warehouse.spark, [LogEntry("t", 200, 0, "DATA")]))
        assert tick(context.cursor)[1].run_key == "ledger_entries-v1"
    assert isinstance(snapshot_schedule(build_schedule_context()), RunRequest)
