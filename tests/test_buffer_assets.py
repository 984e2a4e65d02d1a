"""The transaction-buffer assets and their checks, materialized in-process on Delta tables."""

from __future__ import annotations

from delta.tables import DeltaTable
from dagster import AssetKey, AssetPartitionStatus, AssetSelection, DagsterInstance, PartitionKeyRange, SensorResult, materialize

from assets.partitions import LEDGER_PARTITIONS, range_tags, retry_after_s
from assets.transaction_buffer.sensors import REQUEST_TAG
from pipelines.definitions import ALL_ASSETS, ALL_CHECKS
from resources.warehouse import WarehouseResource
from tests.dagster_runs import backdate_sensor_requests, derive_all, sensor_tick
from tests.rows import entry, write_jsonl
from txn_engine.buffer.spark_runner import compute_buffer_tables
from txn_engine.log.ingest import ingest_files
from txn_engine.core.positions import ledger_partition_key
from txn_engine.core.schema import (
    ABORTED_TXNS,
    COMMITTED_ENTRIES,
    LEDGER_ENTRIES,
    LEDGERS,
    STABLE_POSITIONS,
    TXN_MARKERS,
)

T1, T2, T3 = (0, 1), (0, 2), (0, 3)
# The offload seed's worked example (stable positions -1,-1,-1,0,0,0,4,7 over its prefixes),
# plus a second topic with an abort, a duplicate marker and a retried duplicate.
HISTORY = [
    entry("seed", 10, 0, txn=T1), entry("seed", 10, 1, txn=T2), entry("seed", 10, 2, txn=T1),
    entry("seed", 10, 3, "COMMIT", txn=T1), entry("seed", 10, 4, txn=T2), entry("seed", 10, 5, txn=T3),
    entry("seed", 10, 6, "COMMIT", txn=T2), entry("seed", 10, 7, "COMMIT", txn=T3),
    entry("other", 11, 0, txn=(1, 1), producer=5, seq=0), entry("other", 11, 1, txn=(1, 1), producer=5, seq=0),
    entry("other", 11, 2, "ABORT", txn=(1, 1)), entry("other", 11, 3, "ABORT", txn=(1, 1)),
    entry("other", 12, 0, producer=6, seq=0), entry("other", 12, 1, txn=(1, 2)),
]


# The topic of each ledger id these tests use (ids are unique across their topics).
TOPIC_OF = {10: "seed", 15: "seed", 18: "seed", 11: "other", 12: "other", 14: "other", 16: "other", 17: "other"}


def key(ledger: int) -> str:
    return ledger_partition_key(TOPIC_OF[ledger], ledger)


BUFFER = AssetSelection.assets(TXN_MARKERS, STABLE_POSITIONS, ABORTED_TXNS, COMMITTED_ENTRIES)


def check_results(result):
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def metadata(result, key: str) -> dict:
    [mat, *_] = [e.event_specific_data.materialization for e in result.get_asset_materialization_events()
                 if e.event_specific_data.materialization.asset_key == AssetKey(key)]
    return {k: getattr(v, "value", v) for k, v in mat.metadata.items()}


def table_rows(warehouse) -> dict:
    # The contract's columns, as a recompute's frames have them (the stored txn_id joins the halves).
    return {t: sorted(map(tuple, warehouse.read(t).drop("txn_id").collect())) for t in (
        TXN_MARKERS, ABORTED_TXNS, STABLE_POSITIONS, COMMITTED_ENTRIES)}


def test_buffer_tables_and_checks(warehouse, dagster_resources, tmp_path):
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "h.jsonl", HISTORY))])
    _, result = derive_all(dagster_resources)
    assert result.success
    stable = {r.topic: tuple(r)[1:] for r in warehouse.read(STABLE_POSITIONS).collect()}
    assert stable == {"seed": (10, 7, 10, 7, 0), "other": (12, 0, 12, 1, 1)}
    committed = warehouse.read(COMMITTED_ENTRIES)
    ledger_order = [(r.topic, r.ledger_id, r.entry_id) for r in
                    committed.where("in_stable_prefix").orderBy("topic", "ledger_id", "entry_id").collect()]
    assert ledger_order == [("other", 12, 0)] + [("seed", 10, e) for e in (0, 1, 2, 4, 5)]
    assert metadata(result, STABLE_POSITIONS)["violations"] == {"duplicate": 1, "duplicate_marker": 1, "data_after_marker": 0,
                                                "marker_without_data": 0}
    for table in (TXN_MARKERS, STABLE_POSITIONS, ABORTED_TXNS, COMMITTED_ENTRIES):  # read from the Delta log by delta-rs
        meta, history = metadata(result, table), DeltaTable.forPath(warehouse.spark, warehouse.path(table)).history(1)
        assert (meta["dagster/row_count"], meta["delta_version"]) == (warehouse.read(table).count(), history.first()["version"])
    checks = check_results(result)
    assert set(checks) == {"stable_position_never_moves_backwards", "committed_entries_are_committed_once",
                           "markers_have_matching_outcomes", "aborted_txns_match_kafka_index"}
    assert all(c.passed for c in checks.values()), {k: c.metadata for k, c in checks.items()}
    # No Kafka import recorded in this instance: nothing to compare, said so.
    assert checks["aborted_txns_match_kafka_index"].metadata["kafka_partitions"].value == []


def test_stable_position_check_catches_a_step_backwards(warehouse, dagster_resources, tmp_path, spark):
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "h.jsonl", HISTORY))])
    # A previous version claiming a later stable position than the data supports.
    spark.createDataFrame([("seed", 99, 0, 99, 0, 0)], "topic string, max_read_ledger_id long, "
                          "max_read_entry_id long, last_ledger_id long, last_entry_id long, ongoing_txn_count long") \
        .write.format("delta").save(warehouse.path(STABLE_POSITIONS))
    # One partition of three, on a warehouse without buffer state: a full run, which rewrites every
    # ledger's rows; Dagster records the other two partitions as materialized by it too.
    instance = DagsterInstance.ephemeral()
    keys = [key(i) for i in (10, 11, 12)]
    instance.add_dynamic_partitions(LEDGER_PARTITIONS.name, keys)
    result = materialize([*ALL_ASSETS, *ALL_CHECKS], selection=BUFFER, resources=dagster_resources, instance=instance,
                         partition_key=keys[1])
    assert metadata(result, STABLE_POSITIONS)["mode"] == "full"
    for table in (TXN_MARKERS, STABLE_POSITIONS, ABORTED_TXNS, COMMITTED_ENTRIES):
        assert instance.get_materialized_partitions(AssetKey(table)) == set(keys)
    beyond = {m.partition: {k: v.value for k, v in m.metadata.items()} for m in (
        e.event_specific_data.materialization for e in result.get_asset_materialization_events())
        if m.asset_key == AssetKey(STABLE_POSITIONS) and m.partition != keys[1]}
    # Each with its own figures: its topic's row of stable_positions.
    reason = {"recomputed_by_run_range": keys[1], "reason": "full run: every ledger recomputed",
              "dagster/partition_row_count": 1}
    assert beyond == {
        keys[0]: {**reason, "topic": "seed", "ledger_id": 10, "stable_position": "10:7", "last_position": "10:7",
                  "ongoing_txns": 0},
        keys[2]: {**reason, "topic": "other", "ledger_id": 12, "stable_position": "12:0", "last_position": "12:1",
                  "ongoing_txns": 1}}
    checks = check_results(result)
    assert not checks["stable_position_never_moves_backwards"].passed
    assert "seed" in str(checks["stable_position_never_moves_backwards"].metadata["topics_moved_back"].value)


def test_sensor_adds_closed_ledgers_and_incremental_runs_equal_a_full_recompute(warehouse, dagster_resources, tmp_path):
    instance = DagsterInstance.ephemeral()
    assets = [*ALL_ASSETS, *ALL_CHECKS]
    buffer = BUFFER

    def tick_and_run(rows, name, then_tick=False):
        ingest_files(warehouse, [str(write_jsonl(tmp_path / name, rows))])
        assert materialize(assets, selection=AssetSelection.assets(LEDGERS), resources=dagster_resources,
                           instance=instance).success
        tick = sensor_tick(instance, dagster_resources)
        [request] = tick.run_requests
        if then_tick:  # a tick before the run has written asks for nothing more
            assert not isinstance(sensor_tick(instance, dagster_resources), SensorResult)
        run = materialize(assets, selection=buffer, resources=dagster_resources, instance=instance, tags=request.tags)
        assert run.success and all(c.passed for c in run.get_asset_check_evaluations())
        return request, run

    # Ledger 10 of "seed" stays OPEN (its topic's last) and grows; "other" closes 11, then 12.
    request, run = tick_and_run(HISTORY, "a.jsonl")
    assert instance.get_dynamic_partitions(LEDGER_PARTITIONS.name) == [key(11)]
    assert metadata(run, STABLE_POSITIONS)["mode"] == "full"  # the only partition: everything
    later = [entry("seed", 10, 8, txn=(0, 4)), entry("seed", 10, 9, producer=8, seq=1),
             entry("other", 14, 0, "COMMIT", txn=(1, 2)), entry("other", 14, 1, txn=(1, 1))]
    request, run = tick_and_run(later, "b.jsonl")
    assert request.partition_key_range == PartitionKeyRange(key(12), key(12))
    assert instance.get_dynamic_partitions(LEDGER_PARTITIONS.name) == [key(i) for i in (11, 12)]
    meta = metadata(run, STABLE_POSITIONS)
    # Ledger 12 (closed now), the OPEN ledger 10 that grew and the new OPEN ledger 14; 11 is not reread.
    assert (meta["mode"], meta["ledgers_recomputed"]) == ("incremental", 3)
    assert meta["violations"]["data_after_marker"] == 1  # (14, 1): txn (1, 1) was aborted in ledger 11
    incremental = table_rows(warehouse)
    assert_equal_to_a_full_recompute(warehouse)
    stable = {r.topic: (r.max_read_ledger_id, r.max_read_entry_id) for r in warehouse.read(STABLE_POSITIONS).collect()}
    assert stable == {"seed": (10, 7), "other": (14, 1)}

    # A backfill over one ledger (one run, a partition range) recomputes exactly that ledger.
    backfill = materialize(assets, selection=buffer, resources=dagster_resources, instance=instance,
                           tags=range_tags(key(11), key(11)))
    meta = metadata(backfill, STABLE_POSITIONS)
    assert (meta["mode"], meta["ledgers_recomputed"]) == ("incremental", 1)
    assert table_rows(warehouse) == incremental
    assert not isinstance(sensor_tick(instance, dagster_resources), SensorResult)  # nothing newly closed

    # A ledger that became a partition while OPEN (`txnlake run` adds a log's first ledgers so when
    # all are OPEN) gets a run once it has closed: its key is known, but the state describes it shorter.
    open_keys = [key(i) for i in (10, 14)]
    instance.add_dynamic_partitions(LEDGER_PARTITIONS.name, open_keys)
    assert materialize(assets, selection=buffer, resources=dagster_resources, instance=instance,
                       tags=range_tags(*open_keys)).success
    assert not isinstance(sensor_tick(instance, dagster_resources), SensorResult)  # both still OPEN
    grown = [entry("seed", 10, 10, txn=(0, 9)), entry("seed", 10, 11, "COMMIT", txn=(0, 9)), entry("seed", 15, 0),
             entry("other", 14, 2, producer=6, seq=1), entry("other", 16, 0, producer=6, seq=2)]
    request, run = tick_and_run(grown, "c.jsonl", then_tick=True)
    assert request.partition_key_range == PartitionKeyRange(*open_keys)
    assert request.run_key.startswith("behind-")
    meta = metadata(run, STABLE_POSITIONS)
    assert (meta["mode"], meta["ledgers_recomputed"]) == ("incremental", 4)  # 10 and 14 closed, 15 and 16 OPEN
    assert_equal_to_a_full_recompute(warehouse)
    assert not isinstance(sensor_tick(instance, dagster_resources), SensorResult)

    # The run the sensor asks for fails (here: a warehouse root that is a file): the sensor asks
    # again once its backoff has passed, not before, and that run catches up. Ledger 16 closed one
    # entry longer than the state holds it; 15 closed as the state holds it (its tables are right,
    # but its partition's run failed: it is asked again too, so Dagster's status ends right).
    closing = [entry("other", 16, 1, producer=6, seq=3), entry("other", 17, 0, producer=6, seq=4), entry("seed", 18, 0)]
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "d.jsonl", closing))])
    assert materialize(assets, selection=AssetSelection.assets(LEDGERS), resources=dagster_resources, instance=instance).success
    [request] = sensor_tick(instance, dagster_resources).run_requests
    assert request.partition_key_range == PartitionKeyRange(key(16), key(15))  # added by topic: "other" first
    not_a_folder = tmp_path / "not-a-folder"
    not_a_folder.write_text("")
    failed = materialize(assets, selection=buffer, instance=instance, tags=request.tags, raise_on_error=False,
                         resources={**dagster_resources, "warehouse": WarehouseResource(root=str(not_a_folder))})
    assert not failed.success
    assert not isinstance(sensor_tick(instance, dagster_resources), SensorResult)  # within the backoff
    backdate_sensor_requests(instance, retry_after_s(0))
    [retry] = sensor_tick(instance, dagster_resources).run_requests
    assert retry.run_key.startswith("behind-") and retry.tags[REQUEST_TAG] != request.tags[REQUEST_TAG]
    assert retry.partition_key_range == PartitionKeyRange(key(16), key(15))  # added by topic: "other" first
    assert materialize(assets, selection=buffer, resources=dagster_resources, instance=instance, tags=retry.tags).success
    assert_equal_to_a_full_recompute(warehouse)
    assert not isinstance(sensor_tick(instance, dagster_resources), SensorResult)
    status = instance.get_status_by_partition(AssetKey(COMMITTED_ENTRIES), instance.get_dynamic_partitions(
        LEDGER_PARTITIONS.name), LEDGER_PARTITIONS)
    assert set(status.values()) == {AssetPartitionStatus.MATERIALIZED}, status


def assert_equal_to_a_full_recompute(warehouse) -> None:
    """The buffer's four tables equal a full recompute of `ledger_entries` on Spark."""
    tables = table_rows(warehouse)
    full = compute_buffer_tables(warehouse.read(LEDGER_ENTRIES))
    try:
        assert tables == {t: sorted(map(tuple, f.drop("txn_id").collect())) for t, f in [
            (TXN_MARKERS, full.txn_markers), (ABORTED_TXNS, full.aborted_txns), (STABLE_POSITIONS, full.stable_positions),
            (COMMITTED_ENTRIES, full.committed_entries)]}
    finally:
        full.unpersist()
