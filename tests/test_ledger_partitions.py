"""Ledger partitions a person can read: keys `<topic>/<ledger_id>` (two topics share ledger ids, as
every Kafka partition's first segment is ledger 0), a range backfill launched from the UI's GraphQL by
those keys, each partition's own metadata, one event per partition a run recomputed, a clear message
for a key that is not a partition (an OPEN ledger), and `txnlake migrate` for the keys of older
releases. All on a real instance, real Delta tables and Spark."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from dagster import AssetKey, AssetMaterialization, DagsterInstance, DagsterRunStatus, materialize

from pipelines.cli import DAGSTER_YAML, main
from pipelines.runs import LOCATION_NAME
from tests.rows import entry, write_jsonl
from txn_engine.core.schema import ABORTED_TXNS, COMMITTED_ENTRIES, STABLE_POSITIONS, TXN_MARKERS

REPO = Path(__file__).resolve().parent.parent
BUFFER_TABLES = (TXN_MARKERS, STABLE_POSITIONS, ABORTED_TXNS, COMMITTED_ENTRIES)
# Runs launched through the GraphQL API (and a backfill's) execute at once, in this process: the
# launcher Dagster's own tests use in place of a run worker.
IN_PROCESS = ("run_coordinator:\n  module: dagster._core.run_coordinator\n  class: DefaultRunCoordinator\n"
              "run_launcher:\n  module: dagster._core.launcher.sync_in_memory_run_launcher\n  class: SyncInMemoryRunLauncher\n")

# Two topics with the same ledger ids 0, 1, 2 (2 OPEN): a commit whose data spans ledgers, an abort,
# plain entries.
HISTORY = [
    entry("orders-0", 0, 0, txn=(0, 1)), entry("orders-0", 0, 1, producer=1, seq=0), entry("orders-0", 0, 2, "COMMIT", txn=(0, 1)),
    entry("orders-0", 1, 0, txn=(0, 2)), entry("orders-0", 1, 1, "ABORT", txn=(0, 2)), entry("orders-0", 1, 2, producer=1, seq=1),
    entry("orders-0", 2, 0, producer=1, seq=2),
    entry("payments-0", 0, 0, txn=(1, 1)), entry("payments-0", 0, 1, producer=2, seq=0),
    entry("payments-0", 1, 0, txn=(1, 1)), entry("payments-0", 1, 1, "COMMIT", txn=(1, 1)),
    entry("payments-0", 2, 0, producer=2, seq=1),
]
LATER = [entry("orders-0", 3, 0, producer=1, seq=3)]  # closes orders-0/2

BACKFILL = """mutation($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PartitionKeysNotFoundError { message }
    ... on PythonError { message }
  }
}"""
LAUNCH = """mutation($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId status } }
    ... on PythonError { message }
  }
}"""


def events(instance, run_id: str) -> list[AssetMaterialization]:
    return [e.asset_materialization for e in instance.all_logs(run_id) if e.is_dagster_event
            and e.dagster_event.event_type_value == "ASSET_MATERIALIZATION"]


def per_partition(materializations, table: str) -> dict[str, dict]:
    return {m.partition: {k: getattr(v, "value", v) for k, v in m.metadata.items()}
            for m in materializations if m.asset_key == AssetKey(table)}


def failure_text(instance, run_id: str) -> str:
    text = ""
    for record in instance.all_logs(run_id):
        if record.is_dagster_event and record.dagster_event.event_type_value == "STEP_FAILURE":
            error = record.dagster_event.event_specific_data.error
            while error is not None:
                text += f"{error.cls_name}: {error.message}\n"
                error = error.cause
    return text


def test_readable_keys_backfill_metadata_and_open_ledgers(warehouse, warehouse_root, tmp_path, capsys, monkeypatch):
    from dagster._daemon.backfill import execute_backfill_iteration
    from dagster_graphql.test.utils import define_out_of_process_context, execute_dagster_graphql

    from assets.partitions import LEDGER_PARTITIONS

    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(DAGSTER_YAML + IN_PROCESS)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    assert main(["ingest", str(write_jsonl(tmp_path / "a.jsonl", HISTORY))]) == 0
    assert main(["run"]) == 0
    instance = DagsterInstance.get()
    # Keys read as topic and ledger; ledger 0 of both topics are two partitions; OPEN ledgers none.
    keys = instance.get_dynamic_partitions(LEDGER_PARTITIONS.name)
    assert keys == ["orders-0/0", "orders-0/1", "payments-0/0", "payments-0/1"]

    # The first run (a full one) recorded every partition once per table, each with its own rows.
    [derive] = [r for r in instance.get_runs() if r.job_name == "derive_all"]
    first = events(instance, derive.run_id)
    counted = Counter((m.asset_key.to_user_string(), m.partition) for m in first if m.partition)
    assert set(counted.values()) == {1} and set(counted) == {(t, k) for t in BUFFER_TABLES for k in keys}
    rows = Counter((r.topic, r.visible_ledger_id) for r in warehouse.read(COMMITTED_ENTRIES).collect())
    committed = per_partition(first, COMMITTED_ENTRIES)
    for key in keys:
        topic, ledger = key.rsplit("/", 1)
        assert committed[key]["dagster/partition_row_count"] == rows[(topic, int(ledger))], key
        assert (committed[key]["topic"], committed[key]["ledger_id"]) == (topic, int(ledger))
        assert committed[key]["dagster/row_count"] == sum(rows.values())  # the table's, as Dagster defines it
    stable = per_partition(first, STABLE_POSITIONS)
    assert {k: (m["dagster/partition_row_count"], m["stable_position"], m["last_position"], m["ongoing_txns"])
            for k, m in stable.items()} == {
        "orders-0/0": (1, "2:0", "2:0", 0), "orders-0/1": (1, "2:0", "2:0", 0),
        "payments-0/0": (1, "2:0", "2:0", 0), "payments-0/1": (1, "2:0", "2:0", 0)}
    aborted = per_partition(first, ABORTED_TXNS)
    assert {k: m["dagster/partition_row_count"] for k, m in aborted.items()} == {
        "orders-0/0": 0, "orders-0/1": 1, "payments-0/0": 0, "payments-0/1": 0}
    assert per_partition(first, TXN_MARKERS)["payments-0/1"]["dagster/partition_row_count"] == 1

    # orders-0/2 closes: the next run records that partition alone (payments-0/2 is OPEN, no partition).
    assert main(["ingest", str(write_jsonl(tmp_path / "b.jsonl", LATER))]) == 0
    before = {r.run_id for r in instance.get_runs()}
    assert main(["run"]) == 0
    capsys.readouterr()
    assert instance.get_dynamic_partitions(LEDGER_PARTITIONS.name)[-1] == "orders-0/2"
    [second] = [r for r in instance.get_runs() if r.job_name == "derive_all" and r.run_id not in before]
    assert {(m.asset_key.to_user_string(), m.partition) for m in events(instance, second.run_id) if m.partition} == {
        (t, "orders-0/2") for t in BUFFER_TABLES}

    selector = {"repositoryLocationName": LOCATION_NAME, "repositoryName": "__repository__"}
    with define_out_of_process_context(str(REPO / "workspace.yaml"), None, instance) as context:
        # A backfill of orders-0's ledgers, by their keys: Dagster makes one run per contiguous span
        # in partition order (payments-0's keys lie between), so no run crosses into payments-0.
        wanted = ["orders-0/0", "orders-0/1", "orders-0/2"]
        launched = execute_dagster_graphql(context, BACKFILL, {"params": {
            "assetSelection": [{"path": [t]} for t in BUFFER_TABLES], "partitionNames": wanted}}).data
        assert launched["launchPartitionBackfill"]["__typename"] == "LaunchBackfillSuccess", launched
        backfill_id = launched["launchPartitionBackfill"]["backfillId"]
        before = {r.run_id for r in instance.get_runs()}
        for _ in range(4):  # the daemon's iterations: submit the runs (executed at once), then finish
            list(execute_backfill_iteration(context.process_context, logging.getLogger("backfill")))
        runs = [r for r in instance.get_runs() if r.run_id not in before]
        assert sorted((r.tags["dagster/asset_partition_range_start"], r.tags["dagster/asset_partition_range_end"])
                      for r in runs) == [("orders-0/0", "orders-0/1"), ("orders-0/2", "orders-0/2")]
        assert all(r.status == DagsterRunStatus.SUCCESS and r.tags["dagster/backfill"] == backfill_id for r in runs), [
            (r.status, r.tags, failure_text(instance, r.run_id)) for r in runs]
        recorded_by = {}
        for run in runs:
            recorded = Counter((m.asset_key.to_user_string(), m.partition) for m in events(instance, run.run_id))
            assert set(recorded.values()) == {1} and {t for t, _ in recorded} == set(BUFFER_TABLES)  # once each
            committed = per_partition(events(instance, run.run_id), COMMITTED_ENTRIES)
            recorded_by[run.tags["dagster/asset_partition_range_start"]] = sorted(committed)
            # A run replaces rows by ledger id: payments-0's ledger of the same id was recomputed too,
            # and is recorded so, with its own rows and the reason (no recomputed ledger goes unrecorded).
            for key, meta in committed.items():
                assert meta["topic"] == key.split("/")[0]
                assert ("another topic's ledger of the same id" in meta.get("reason", "")) == key.startswith("payments-0/")
        assert recorded_by == {"orders-0/0": ["orders-0/0", "orders-0/1", "payments-0/0", "payments-0/1"],
                               "orders-0/2": ["orders-0/2"]}  # payments-0/2 is OPEN: no partition
        assert instance.get_materialized_partitions(AssetKey(COMMITTED_ENTRIES)) >= set(wanted)

        # An OPEN ledger is no partition: the UI's backfill refuses it before any code of ours runs
        # (Dagster's own error, naming the key) ...
        refused = execute_dagster_graphql(context, BACKFILL, {"params": {
            "assetSelection": [{"path": [t]} for t in BUFFER_TABLES], "partitionNames": ["orders-0/3"]}}).data
        assert refused["launchPartitionBackfill"]["__typename"] == "PartitionKeysNotFoundError"
        # ... and a run launched for it says why, and when it can be materialized.
        ran = execute_dagster_graphql(context, LAUNCH, {"params": {
            "selector": {**selector, "jobName": "transaction_buffer"}, "mode": "default",
            "executionMetadata": {"tags": [{"key": "dagster/partition", "value": "orders-0/3"}]}}}).data["launchRun"]
        assert ran["__typename"] == "LaunchRunSuccess", ran
    run_id = ran["run"]["runId"]
    assert instance.get_run_by_id(run_id).status == DagsterRunStatus.FAILURE
    text = failure_text(instance, run_id)
    assert "NotALedgerPartitionError: ledger orders-0/3 is still OPEN" in text, text
    assert "when orders-0's next ledger starts" in text and "ledgers_closed_sensor" in text
    assert not events(instance, run_id)


def test_unknown_keys_say_why(warehouse, dagster_resources, tmp_path):
    from assets.partitions import LEDGER_PARTITIONS, NotALedgerPartitionError, check_partitions_exist
    from pipelines.definitions import ALL_ASSETS, ALL_CHECKS
    from tests.dagster_runs import derive_all
    from txn_engine.log.ingest import ingest_files

    ingest_files(warehouse, [str(write_jsonl(tmp_path / "a.jsonl", HISTORY))])
    instance = DagsterInstance.ephemeral()
    derive_all(dagster_resources, instance)
    for key, said in [("orders-0/9", "no ledger orders-0/9 in the `ledgers` catalog (orders-0 has ledgers 0..2)"),
                      ("refunds-0/0", "no topic 'refunds-0' in the catalog"),
                      ("0000000000000000001", "run `txnlake migrate`"),
                      ("payments-0/2", "ledger payments-0/2 is still OPEN")]:
        try:
            check_partitions_exist(warehouse, instance, [key])
            raise AssertionError(key)
        except NotALedgerPartitionError as exc:
            assert said in str(exc) and "\n" not in str(exc), exc
    # A closed ledger the sensor has not added yet.
    instance.delete_dynamic_partition(LEDGER_PARTITIONS.name, "payments-0/1")
    run = materialize([*ALL_ASSETS, *ALL_CHECKS], selection=list(map(AssetKey, BUFFER_TABLES)), instance=instance,
                      resources=dagster_resources, tags={"dagster/partition": "payments-0/1"}, raise_on_error=False)
    assert not run.success and not run.get_asset_materialization_events()
    [failure] = [e for e in run.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "ledger payments-0/1 is CLOSED but not a partition yet" in failure.event_specific_data.error.cause.message


def test_migrate_renames_ledger_id_keys_with_their_status(warehouse, warehouse_root, tmp_path, capsys, monkeypatch):
    from assets.partitions import LEDGER_PARTITIONS, LEGACY_PARTITIONS
    from txn_engine.log.ingest import ingest_files
    from txn_engine.log.ledgers import write_ledger_catalog
    from txn_engine.core.schema import LEDGERS

    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(DAGSTER_YAML)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "a.jsonl", HISTORY))])
    write_ledger_catalog(warehouse)
    # What an older release left: keys 0 and 1 (ledger ids alone), materialized; orders-0/0 offloaded.
    instance = DagsterInstance.get()
    old = ["0000000000000000000", "0000000000000000001"]
    instance.add_dynamic_partitions(LEGACY_PARTITIONS, old)
    for table in (*BUFFER_TABLES, "offloaded_entries"):
        for key in old:
            instance.report_runless_asset_event(AssetMaterialization(asset_key=table, partition=key))
    warehouse.spark.sql(f"UPDATE delta.`{warehouse.path(LEDGERS)}` SET state = 'OFFLOADED' "
                        "WHERE topic = 'orders-0' AND ledger_id = 0")
    # Until migrated, the commands that use partitions refuse, naming the command.
    assert main(["run"]) == 2
    assert "run `txnlake migrate` once" in capsys.readouterr().err
    assert main(["migrate"]) == 0
    out = capsys.readouterr().out
    assert "ledger partition 0000000000000000000 -> orders-0/0, payments-0/0" in out and "2 ledger partition(s) renamed" in out
    assert instance.get_dynamic_partitions(LEGACY_PARTITIONS) == []
    assert instance.get_dynamic_partitions(LEDGER_PARTITIONS.name) == ["orders-0/0", "orders-0/1", "payments-0/0",
                                                                        "payments-0/1"]
    for table in BUFFER_TABLES:  # a buffer run computed every topic's ledger of an id
        assert instance.get_materialized_partitions(AssetKey(table)) >= {"orders-0/0", "orders-0/1", "payments-0/0",
                                                                           "payments-0/1"}
    tier = instance.get_materialized_partitions(AssetKey("offloaded_entries"))
    assert "orders-0/0" in tier and not {"orders-0/1", "payments-0/0", "payments-0/1"} & tier  # only what the tier holds
    assert main(["migrate"]) == 0
    assert "Dagster instance already current" in capsys.readouterr().out
