"""Findings of the Dagster UI audit: the sensor keeps the `ledgers` catalog fresh, the buffer pool has
its limit from the start, and a buffer run without a ledger partition says what to do."""

from __future__ import annotations

import uuid

from dagster import AssetSelection, DagsterInstance, DagsterRun, DagsterRunStatus, RunRequest, SensorResult, SkipReason
from dagster import build_sensor_context, materialize

from assets.transaction_buffer.tables import POOL
from assets.ledger import ledgers_catalog_job
from assets.partitions import LEDGER_PARTITIONS, retry_after_s
from assets.transaction_buffer.sensors import ledgers_closed_sensor, transaction_buffer_job
from pipelines.definitions import ALL_ASSETS, ALL_CHECKS
from tests.rows import entry, write_jsonl
from txn_engine.log.ingest import ingest_files
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.log.ledgers import catalog_source_versions, write_ledger_catalog, stale_catalog
from txn_engine.core.positions import ledger_partition_key
from txn_engine.core.schema import ABORTED_TXNS, COMMITTED_ENTRIES, LEDGER_ENTRIES, LEDGERS, STABLE_POSITIONS, TXN_MARKERS

ASSETS = [*ALL_ASSETS, *ALL_CHECKS]
BUFFER = AssetSelection.assets(TXN_MARKERS, STABLE_POSITIONS, ABORTED_TXNS, COMMITTED_ENTRIES)
# "seed" has one ledger (10, OPEN: its topic's last); "other" closes 11, 12 stays OPEN.
HISTORY = [entry("seed", 10, 0, txn=(0, 1)), entry("seed", 10, 1, "COMMIT", txn=(0, 1)),
           entry("other", 11, 0, txn=(1, 1)), entry("other", 11, 1, "COMMIT", txn=(1, 1)),
           entry("other", 12, 0, producer=6, seq=0)]


def tick(instance, resources):
    """One evaluation of ledgers_closed_sensor, its partition requests applied as the daemon would."""
    result = ledgers_closed_sensor(build_sensor_context(instance=instance, resources=resources))
    if isinstance(result, SensorResult):
        for request in result.dynamic_partitions_requests:
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return result


def catalog_run_request(result) -> RunRequest:
    requests = [result] if isinstance(result, RunRequest) else list(getattr(result, "run_requests", None) or [])
    assert [r.job_name for r in requests] == [ledgers_catalog_job.name], result
    return requests[0]


def refresh_catalog(instance, resources):
    assert materialize(ASSETS, selection=AssetSelection.assets(LEDGERS), resources=resources, instance=instance).success


def test_sensor_materializes_a_stale_catalog_before_deciding(warehouse, dagster_resources, tmp_path):
    instance = DagsterInstance.ephemeral()
    skipped = tick(instance, dagster_resources)
    assert isinstance(skipped, SkipReason) and "ingest" in skipped.skip_message  # an empty warehouse
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "a.jsonl", HISTORY))])
    # ledger_entries, no catalog yet: only a catalog run is asked for; no partition is added.
    assert "does not exist" in stale_catalog(warehouse)
    request = catalog_run_request(tick(instance, dagster_resources))
    assert instance.get_dynamic_partitions(LEDGER_PARTITIONS.name) == []

    # While a run that materializes the catalog is running (or queued), no second one.
    queued = instance.add_run(DagsterRun(job_name=ledgers_catalog_job.name, run_id=str(uuid.uuid4()),
                                         status=DagsterRunStatus.STARTED, tags=request.tags))
    skipped = tick(instance, dagster_resources)
    assert isinstance(skipped, SkipReason) and queued.run_id in skipped.skip_message
    # It failed: asked again only after the backoff.
    instance.report_run_failed(queued)
    skipped = tick(instance, dagster_resources)
    assert isinstance(skipped, SkipReason) and "backoff" in skipped.skip_message
    assert retry_after_s(0) == 60.0

    # The catalog run: the next tick does what it did before, from a fresh catalog.
    refresh_catalog(instance, dagster_resources)
    assert stale_catalog(warehouse) is None
    # The catalog's commit names the versions of its sources it was derived from.
    assert int(DeltaTables(warehouse).last_commit(LEDGERS)[f"{LEDGER_ENTRIES}_version"]) == warehouse.version(LEDGER_ENTRIES)
    result = tick(instance, dagster_resources)
    assert isinstance(result, SensorResult)
    assert [r.job_name for r in result.run_requests] == [transaction_buffer_job.name]
    assert instance.get_dynamic_partitions(LEDGER_PARTITIONS.name) == [ledger_partition_key("other", 11)]
    run = materialize(ASSETS, selection=BUFFER, resources=dagster_resources, instance=instance,
                      tags=result.run_requests[0].tags)
    assert run.success
    assert isinstance(tick(instance, dagster_resources), SkipReason)  # fresh, nothing to do

    # An ingest closes ledger 12: the catalog is stale again; the refresh, then its partition.
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "b.jsonl", [entry("other", 13, 0, producer=6, seq=1)]))])
    assert LEDGER_ENTRIES in stale_catalog(warehouse)
    catalog_run_request(tick(instance, dagster_resources))
    refresh_catalog(instance, dagster_resources)
    result = tick(instance, dagster_resources)
    assert isinstance(result, SensorResult) and [r.job_name for r in result.run_requests] == [transaction_buffer_job.name]
    assert instance.get_dynamic_partitions(LEDGER_PARTITIONS.name) == ["other/11", "other/12"]

    # Rows deleted from ledger_entries (what retention does) leave it stale too.
    warehouse.delete(LEDGER_ENTRIES, "ledger_id = 11")
    assert LEDGER_ENTRIES in stale_catalog(warehouse)
    catalog_run_request(tick(instance, dagster_resources))


def test_txnlake_instance_has_the_buffer_pool_limit_from_the_start(tmp_path, monkeypatch):
    from pipelines.cli import _instance

    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dh"))
    instance = _instance()  # a fresh home: dagster.yaml written, the pool's limit set
    storage = instance.event_log_storage
    assert POOL in storage.get_concurrency_keys()
    assert storage.get_concurrency_info(POOL).slot_count == 1
    assert {p.name: p.limit for p in storage.get_pool_limits()}[POOL] == 1
    # A limit set by hand (the UI, `dagster instance concurrency set`) is kept.
    storage.set_concurrency_slots(POOL, 2)
    assert _instance().event_log_storage.get_concurrency_info(POOL).slot_count == 2


def test_buffer_run_without_a_partition_says_what_to_do(warehouse, dagster_resources, tmp_path):
    instance = DagsterInstance.ephemeral()

    def failure_text() -> str:
        run = materialize(ASSETS, selection=BUFFER, resources=dagster_resources, instance=instance, raise_on_error=False)
        assert not run.success
        [failure] = [e for e in run.all_events if e.event_type_value == "STEP_FAILURE"]
        error = failure.event_specific_data.error
        text = ""
        while error is not None:
            text += f"{error.cls_name}: {error.message}\n"
            error = error.cause
        return text

    text = failure_text()
    assert "NoLedgerPartitionError" in text and "DagsterInvariantViolationError" not in text
    assert "no ledger partition yet" in text and "ledgers_closed_sensor" in text and "txnlake run" in text
    instance.add_dynamic_partitions(LEDGER_PARTITIONS.name, ["other/11", "other/12"])
    text = failure_text()
    assert "(2 known)" in text and "backfill a range" in text


def test_a_catalog_derived_before_a_racing_ingest_is_stale(warehouse, tmp_path):
    """A catalog run reads the log, an ingest commits, then the catalog commits: later than the
    ingest, without its rows. Commit times called that fresh; the versions it was derived from do not."""
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "a.jsonl", HISTORY))])
    sources = catalog_source_versions(warehouse)
    log_read = warehouse.read(LEDGER_ENTRIES, version=int(sources[f"{LEDGER_ENTRIES}_version"]))
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "b.jsonl", [entry("other", 13, 0, producer=6, seq=1)]))])
    write_ledger_catalog(warehouse, entries=log_read, commit_metadata=sources)
    tables = DeltaTables(warehouse)
    assert tables.last_commit(LEDGERS)["timestamp"] >= tables.last_commit(LEDGER_ENTRIES)["timestamp"]
    assert 13 not in {r.ledger_id for r in warehouse.read(LEDGERS).collect()}
    reason = stale_catalog(warehouse)
    assert reason and LEDGER_ENTRIES in reason and f"derived from its version {sources[f'{LEDGER_ENTRIES}_version']}" in reason
    write_ledger_catalog(warehouse, commit_metadata=catalog_source_versions(warehouse))
    assert stale_catalog(warehouse) is None
