"""The offload tier in Dagster: ledger partitions, the sensor, a range backfill, checks, metadata, tier_sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import uuid

from dagster import (AssetKey, AssetsDefinition, AssetSelection, DagsterInstance, DagsterRun, DagsterRunStatus, SensorResult, SkipReason,
                     build_sensor_context, materialize)
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from assets.offload import OFFLOAD_CHECKS, offload_eligible_ledgers, offload_tier
from assets.partitions import LEDGER_PARTITIONS, retry_after_s
from pipelines.definitions import ALL_ASSETS
from tests.offload_history import COMMIT_D, HISTORY, derive_buffer_tables
from tests.rows import write_jsonl
from txn_engine.log.ingest import ingest_files
from txn_engine.tier.offload import OffloadWaitingError, eligible_not_offloaded
from txn_engine.core.positions import ledger_partition_key
from txn_engine.core.schema import LEDGER_ENTRIES_SCHEMA, OFFLOAD_MANIFEST, OFFLOADED_ENTRIES

TOPIC_OF = {e["ledger_id"]: e["topic"] for e in HISTORY}  # ledger ids are unique across the history's topics


def key(ledger: int) -> str:
    """The partition key of the history's ledger `ledger` (`t/1`)."""
    return ledger_partition_key(TOPIC_OF[ledger], ledger)


TIER_SIZES = [a for a in ALL_ASSETS if isinstance(a, AssetsDefinition) and AssetKey("tier_sizes") in a.keys]


def offload_run(resources, instance, **kwargs):
    return materialize([offload_tier, *OFFLOAD_CHECKS], resources=resources, instance=instance, **kwargs)


def metadata(result, table, partition: str | None = None):
    # A range run reports one materialization per partition it offloaded (or found offloaded), each
    # with the run's and the table's metadata and its own (its manifest row).
    mat = [e.event_specific_data.materialization for e in result.get_asset_materialization_events()
           if e.event_specific_data.materialization.asset_key == AssetKey(table)
           and partition in (None, e.event_specific_data.materialization.partition)][0]
    return {k: getattr(v, "value", v) for k, v in mat.metadata.items()}


def checks(result):
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def tier(warehouse):
    return sorted((r.topic, r.ledger_id, r.entry_id) for r in warehouse.read(OFFLOADED_ENTRIES).collect())


# The sensor evaluated in a fresh process: the partition ranges it asks for, and whether a JVM started.
SENSOR_IN_FRESH_PROCESS = """
import json, sys
from dagster import DagsterInstance, build_sensor_context
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG
from pyspark import SparkContext
from assets.offload import offload_eligible_ledgers
from resources.spark import SparkResource
from resources.warehouse import WarehouseResource
resources = {"spark": SparkResource(conf={"spark.driver.memory": "1g"}), "warehouse": WarehouseResource(root=sys.argv[1])}
result = offload_eligible_ledgers(build_sensor_context(instance=DagsterInstance.ephemeral(), resources=resources))
print(json.dumps({"spans": [[r.tags[ASSET_PARTITION_RANGE_START_TAG], r.tags[ASSET_PARTITION_RANGE_END_TAG]]
                            for r in getattr(result, "run_requests", [])],
                  "jvm": SparkContext._gateway is not None or SparkContext._active_spark_context is not None}))
"""


def sensor_in_fresh_process(root) -> dict:
    done = subprocess.run([sys.executable, "-c", SENSOR_IN_FRESH_PROCESS, str(root)], cwd=Path(__file__).parents[1],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sensor_backfill_checks_and_savings(warehouse, dagster_resources, tmp_path):
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "h.jsonl", HISTORY + COMMIT_D))])
    derive_buffer_tables(warehouse)
    instance = DagsterInstance.ephemeral()

    def tick(cursor=None):
        context = build_sensor_context(instance=instance, resources=dagster_resources, cursor=cursor)
        return offload_eligible_ledgers(context), context.cursor

    def span(request):
        return request.tags[ASSET_PARTITION_RANGE_START_TAG], request.tags[ASSET_PARTITION_RANGE_END_TAG]

    # The sensor asks for ONE run over the newly eligible ledgers, adding their partitions: on an
    # instance without partitions they are contiguous.
    result, cursor = tick()
    assert isinstance(result, SensorResult)
    wanted = [key(1), key(2), key(3), key(5)]
    assert wanted == [key(l) for _, l in eligible_not_offloaded(warehouse)]
    [request] = result.run_requests
    assert span(request) == (key(1), key(5)) and request.run_key == f"offload-{key(1)}-{key(5)}-attempt-1"
    assert list(result.dynamic_partitions_requests[0].partition_keys) == wanted
    instance.add_dynamic_partitions(LEDGER_PARTITIONS.name, [key(i) for i in range(1, 8)])  # in ledger order
    # While an offload run is to finish, nothing more is asked for (one JVM, one writer at a time).
    pending = instance.add_run(DagsterRun(job_name="offload", run_id=str(uuid.uuid4()), status=DagsterRunStatus.STARTED))
    skipped, cursor = tick(cursor)
    assert isinstance(skipped, SkipReason) and pending.run_id in skipped.skip_message
    instance.report_run_failed(pending)
    # ... also a UI backfill's run of the tier (an asset job of its own).
    backfill = instance.add_run(DagsterRun(job_name="__ASSET_JOB", run_id=str(uuid.uuid4()), status=DagsterRunStatus.STARTED,
                                           asset_selection=frozenset({AssetKey(OFFLOADED_ENTRIES)})))
    skipped, cursor = tick(cursor)
    assert isinstance(skipped, SkipReason) and backfill.run_id in skipped.skip_message
    instance.report_run_failed(backfill)
    # The OPEN ledger 4 is a partition now: the first span without it; the second is for a later tick.
    result, cursor = tick(cursor)
    [request] = result.run_requests
    assert span(request) == (key(1), key(3)) and request.run_key.endswith("-attempt-1")
    # That run failed (no run is to finish, the span is still eligible): after a backoff, a new run
    # key, so Dagster retries.
    waiting, _ = tick(cursor)
    assert isinstance(waiting, SkipReason) and "asking again" in waiting.skip_message
    cursor = json.dumps({**json.loads(cursor), "at": json.loads(cursor)["at"] - retry_after_s(0)})
    [retry] = tick(cursor)[0].run_requests
    assert span(retry) == (key(1), key(3)) and retry.run_key == f"offload-{key(1)}-{key(3)}-attempt-2"

    # Asked for the OPEN ledger alone (one partition from the UI): the run fails, saying why, and
    # records nothing.
    alone = offload_run(dagster_resources, instance, partition_key=key(4), raise_on_error=False)
    assert not alone.success and not alone.get_asset_materialization_events()
    [failure] = [e for e in alone.all_events if e.event_type_value == "STEP_FAILURE"]
    error = failure.event_specific_data.error.cause  # the asset's own, under Dagster's step error
    assert error.cls_name == OffloadWaitingError.__name__
    assert "t/4: ledger is OPEN, so it can be offloaded once it closes" in error.message

    # A backfill over the ledger range 1..4 is one run; the OPEN ledger 4 waits, and is not
    # recorded as materialized (a backfill of missing partitions will ask for it again).
    tags = {ASSET_PARTITION_RANGE_START_TAG: key(1), ASSET_PARTITION_RANGE_END_TAG: key(4)}
    run = offload_run(dagster_resources, instance, tags=tags)
    assert run.success
    for table in (OFFLOADED_ENTRIES, OFFLOAD_MANIFEST):
        partitions = {e.partition for e in run.get_asset_materialization_events() if e.asset_key == AssetKey(table)}
        assert partitions == {key(1), key(2), key(3)} == instance.get_materialized_partitions(AssetKey(table))
    assert not run.get_asset_check_evaluations()  # they follow the outputs, skipped in such a run
    meta = metadata(run, OFFLOADED_ENTRIES)
    assert meta["ledgers_requested"] == 4 and meta["ledgers_offloaded"] == ["t/1", "t/2", "t/3"]
    assert meta["ledgers_waiting"] == {"t/4": "ledger is OPEN"}
    assert list(meta["step_seconds"]) == ["catalog", "facts", "plan", "write", "manifest", "states"]
    assert meta["tier_scanned"] is False  # the first run: no tier yet
    assert (meta["facts_from"], meta["kept_from"]) == ("ledger_entries", "ledger_entries")  # no buffer state here
    # Savings: t/1 drops 2 markers + 1 aborted, t/2 a marker + a duplicate; 8 of 12 bytes... kept as counted.
    assert (meta["run_entries_before"], meta["run_entries_kept"], meta["run_entries_dropped"]) == (12, 7, 5)
    assert (meta["run_dropped_markers"], meta["run_dropped_aborted"], meta["run_dropped_duplicates"]) == (3, 1, 1)
    assert meta["run_bytes_saved"] == meta["run_bytes_before"] - meta["run_bytes_after"] == len(b"b-aborted") + len(b"t-2-1")
    assert meta["dagster/row_count"] == meta["run_entries_kept"] == 7  # the table's rows
    # Each partition's own figures: its manifest row, its rows in the tier.
    own = {k: metadata(run, OFFLOADED_ENTRIES, k) for k in (key(1), key(2), key(3))}
    assert {k: (m["topic"], m["ledger_id"], m["entries_before"], m["entries_kept"], m["dagster/partition_row_count"],
                m["offloaded_by_this_run"]) for k, m in own.items()} == {
        key(1): ("t", 1, 5, 2, 2, True), key(2): ("t", 2, 5, 3, 3, True), key(3): ("t", 3, 2, 2, 2, True)}
    assert own[key(1)]["dropped_markers"] == 2 and own[key(1)]["dropped_aborted"] == 1
    assert {metadata(run, OFFLOAD_MANIFEST, k)["dagster/partition_row_count"] for k in own} == {1}

    # With a manifest and recorded OFFLOADED states, a fresh process's sensor (as in the code server)
    # decides as `eligible_not_offloaded` does here, and starts no JVM.
    fresh = sensor_in_fresh_process(warehouse.settings.warehouse)
    assert eligible_not_offloaded(warehouse) == [("u", 5)]
    assert fresh == {"spans": [[key(5), key(5)]], "jvm": False}

    # A run whose every partition is offloaded: the outputs, and the checks after them.
    single = offload_run(dagster_resources, instance, partition_key=key(5))
    assert metadata(single, OFFLOAD_MANIFEST)["ledgers_offloaded"] == ["u/5"]
    assert all(c.passed for c in checks(single).values()), {k: c.metadata for k, c in checks(single).items()}
    assert set(checks(single)) == {"tier_holds_only_committed_data", "tier_within_stable_position_at_offload",
                                   "tier_matches_manifest"}
    assert metadata(single, OFFLOADED_ENTRIES)["tier_scanned"] is False  # unchanged since the last manifest commit
    before = tier(warehouse)
    again = offload_run(dagster_resources, instance, tags=tags)  # the backfill once more: same rows
    assert metadata(again, OFFLOADED_ENTRIES)["ledgers_already_offloaded"] == 3 and tier(warehouse) == before
    assert metadata(again, OFFLOADED_ENTRIES, key(2))["offloaded_by_this_run"] is False
    assert key(4) not in instance.get_materialized_partitions(AssetKey(OFFLOADED_ENTRIES))
    assert warehouse.read(OFFLOAD_MANIFEST).count() == 4
    assert isinstance(offload_eligible_ledgers(build_sensor_context(instance=instance, resources=dagster_resources)), SkipReason)

    # The SQL model: hot and cold per topic, and what filtering saved.
    sized = materialize([*TIER_SIZES], resources=dagster_resources, instance=instance)
    assert sized.success
    rows = {r.topic: r.asDict() for r in warehouse.read("tier_sizes").collect()}
    assert (rows["t"]["hot_entries"], rows["t"]["cold_entries"], rows["t"]["offloaded_ledgers"]) == (14, 7, 3)
    assert rows["t"]["bytes_saved_by_filtering"] == meta["run_bytes_saved"]
    assert (rows["v"]["cold_entries"], rows["v"]["hot_entries"]) == (0, 1)


def test_checks_catch_a_tier_with_markers_aborted_data_and_rows_beyond_the_stable_position(
        warehouse, dagster_resources, tmp_path, spark):
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "h.jsonl", HISTORY))])
    derive_buffer_tables(warehouse)
    instance = DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(LEDGER_PARTITIONS.name, [key(1), key(5)])
    assert offload_run(dagster_resources, instance, partition_key=key(1)).success
    # Someone copies ledger t/1 unfiltered into the tier, and part of t/2 (beyond the stable position 2:3).
    raw = warehouse.read("ledger_entries").where("topic = 't' AND ledger_id = 1 AND entry_id >= 2 OR ledger_id = 2 AND entry_id = 4")
    warehouse.append(OFFLOADED_ENTRIES, raw.select(*[f.name for f in LEDGER_ENTRIES_SCHEMA.fields]))
    # Only the checks run: an offload run would first roll back the rows without a manifest row.
    run = offload_run(dagster_resources, instance, selection=AssetSelection.checks_for_assets(offload_tier),
                      raise_on_error=False)
    got = checks(run)
    only = got["tier_holds_only_committed_data"]
    assert not only.passed and only.metadata["markers"].value == 2 and only.metadata["entries_of_aborted_txns"].value == 1
    assert only.metadata["entries_of_ongoing_txns"].value == 1  # D's first entry, 2:4
    assert not got["tier_within_stable_position_at_offload"].passed
    assert got["tier_within_stable_position_at_offload"].metadata["entries_without_manifest_row"].value == 1
    assert not got["tier_matches_manifest"].passed
    assert got["tier_matches_manifest"].metadata["ledgers_not_matching"].value == ["t/1"]
