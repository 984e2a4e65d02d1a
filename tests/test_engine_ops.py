"""The engine in Dagster and the operators' tools, end to end on real tables and real runs."""

from __future__ import annotations

from datetime import datetime, timezone

import pyarrow.compute as pc
import pytest
from dagster import DagsterInstance, RunRequest, build_sensor_context

from assets.engine import abort_expired_job, demo_job, txn_timeout_sensor
from pipelines.cli import main
from tests.rows import entry, write_jsonl
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.producers.engine import Engine
from txn_engine.log.ingest import ingest_files
from txn_engine.core.log_types import TxnId
from txn_engine.core.schema import LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA, TXN_LOG, TXN_LOG_SCHEMA
from txn_engine.producers.admin import TxnAdmin


def test_demo_workload_job_reports_ledger_entries(dagster_resources, warehouse):
    config = {"producers": 3, "transactions_per_producer": 6, "timeout_ratio": 0.2, "abort_ratio": 0.2, "seed": 1}
    result = demo_job.execute_in_process(resources=dagster_resources, run_config={"ops": {"demo_workload": {"config": config}}})
    assert result.success
    # The engine wrote ledger_entries: the run reports it materialized, with its rows and the outcome.
    [mat] = [e.event_specific_data.materialization for e in result.get_asset_materialization_events()]
    assert mat.asset_key.path == [LEDGER_ENTRIES]
    outcome = result.output_for_node("demo_workload")
    assert mat.metadata["demo_outcome"].value == outcome
    assert outcome["fenced_sends_refused"] == 1
    assert outcome["committed"] > 0 and outcome["aborted"] > 0
    assert outcome["timed_out"] == outcome["late_commits_refused"] > 0
    infos = TxnAdmin(DeltaTables(warehouse)).transactions().values()
    states = [i.state for i in infos]
    assert states.count("COMPLETE_COMMIT") == outcome["committed"]
    assert "ONGOING" not in states  # everything the workload opened was decided
    assert mat.metadata["rows"].value == warehouse.read(LEDGER_ENTRIES).count()
    assert mat.metadata["written_by"].value == "demo_workload"


def test_timeout_sensor_launches_the_abort(warehouse, dagster_resources):
    resources = {"warehouse": dagster_resources["warehouse"]}
    long_ago = datetime(2020, 1, 1, tzinfo=timezone.utc)
    # Its clock stands still, so its own timeout timer never finds the transaction expired; the
    # sensor, on the real clock, does.
    with Engine(warehouse, clock=lambda: long_ago) as engine:
        p = engine.producer("sleepy", transaction_timeout=0.05)
        p.init_transactions()
        txn = p.begin()
        p.send("t", b"x").result()
        request = txn_timeout_sensor(build_sensor_context(resources=resources))
        assert isinstance(request, RunRequest) and str(txn) in request.tags["txnlake/expired"]
        # While an engine runs it aborts its expired transactions itself: the job, refused the
        # warehouse, says so and succeeds instead of failing.
        instance = DagsterInstance.ephemeral()
        result = abort_expired_job.execute_in_process(resources=dagster_resources, instance=instance)
        assert result.success and result.output_for_node("abort_expired_op") == []
        messages = [e.user_message for e in instance.all_logs(result.run_id)]
        assert any("an engine is running on this warehouse and aborts its expired transactions itself" in m
                   for m in messages)
    # Still expired, the same transactions: the next tick must launch a run again. Dagster launches a
    # run key once only, so the request has none.
    request = txn_timeout_sensor(build_sensor_context(resources=resources))
    assert isinstance(request, RunRequest) and request.run_key is None
    result = abort_expired_job.execute_in_process(resources=dagster_resources)
    assert result.success and result.output_for_node("abort_expired_op") == [str(txn)]
    assert TxnAdmin(DeltaTables(warehouse)).describe(txn).state == "COMPLETE_ABORT"
    assert txn_timeout_sensor(build_sensor_context(resources=resources)).skip_message


def test_txn_tools_on_a_transaction_known_only_from_ingested_ledgers(warehouse, warehouse_root, tmp_path, capsys):
    old = "2026-01-01T00:00:00Z"
    rows = [
        entry("a", 10, 0, txn=(1, 7), producer=50, seq=0, publish_time=old),
        entry("b", 11, 0, txn=(1, 7), producer=50, seq=0, publish_time=old),
        entry("a", 10, 1, producer=51, seq=0, publish_time=old),
        entry("a", 10, 2, txn=(1, 8), producer=52, seq=0, publish_time=old),
        entry("a", 10, 3, "COMMIT", txn=(1, 8)),
    ]
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "in.jsonl", rows))])
    assert main(["txn", "list"]) == 0
    out = capsys.readouterr().out
    assert "1:7" in out and "ONGOING" in out and "ledgers" in out and "1:8" in out and "COMPLETE_COMMIT" in out
    assert main(["txn", "find-hanging", "--held-back", "60"]) == 0
    out = capsys.readouterr().out
    assert "holds a back at 10:0" in out and "4 entries behind it" in out and "holds b back at 11:0" in out
    assert "1:8" not in out
    assert main(["txn", "abort", "1:7", "--who", "alice", "--why", "stuck producer"]) == 0
    out = capsys.readouterr().out
    assert "topic a: ABORTED" in out and "topic b: ABORTED" in out and "by operator:alice: stuck producer" in out
    tables = DeltaTables(warehouse)
    stored = tables.read(LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA)
    markers = stored.filter(pc.equal(stored["entry_type"], "ABORT"))
    assert sorted(markers["topic"].to_pylist()) == ["a", "b"]
    assert main(["txn", "abort", "1:7", "--why", "again"]) == 2
    assert "nothing to abort" in capsys.readouterr().err
    assert main(["txn", "abort", "1:8", "--why", "oops"]) == 2
    assert "is committed (COMMIT markers on a); nothing to abort" in capsys.readouterr().err
    assert main(["txn", "describe", "5:5"]) == 2
    assert "neither in txn_log nor in any ledger" in capsys.readouterr().err
    assert main(["txn", "find-hanging", "--held-back", "60"]) == 0
    assert "0 hanging" in capsys.readouterr().out


def test_operator_abort_of_an_engine_transaction_is_recorded(warehouse, capsys):
    with Engine(warehouse) as engine:
        p = engine.producer("app")
        p.init_transactions()
        txn = p.begin()
        p.send("t", b"x").result()
    assert main(["txn", "describe", str(txn)]) == 0
    assert "ONGOING" in capsys.readouterr().out
    assert main(["txn", "abort", str(txn), "--who", "bob", "--why", "hung"]) == 0
    log = DeltaTables(warehouse).read(TXN_LOG, TXN_LOG_SCHEMA).sort_by("log_seq").to_pylist()
    last = [r for r in log if r["txn_least_bits"] == txn.least_bits][-1]
    assert (last["state"], last["actor"], last["reason"]) == ("COMPLETE_ABORT", "operator:bob", "hung")
    with Engine(warehouse) as engine:
        assert engine.consumer("t").read() == []
        assert TxnAdmin(engine.tables).describe(TxnId(txn.most_bits, txn.least_bits)).state == "COMPLETE_ABORT"


def test_txn_tools_refuse_negative_counts_and_durations(warehouse_root, capsys):
    # argparse's plain int/float took them: `--limit -1` printed all rows but the last ("first -1 shown").
    for argv, option, value in [(["txn", "list", "--limit", "-1"], "--limit", "-1"),
                                (["txn", "find-hanging", "--held-back", "-5"], "--held-back", "-5")]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert f"argument {option}: must be 0 or more, got {value}" in capsys.readouterr().err
    assert not warehouse_root.exists()  # refused before anything ran


def test_txn_tools_refuse_a_warehouse_root_that_does_not_exist(warehouse_root, capsys):
    # A mistyped root listed "0 transaction(s)" (exit 0), and an abort created it (its lock file).
    for argv in (["txn", "list"], ["txn", "find-hanging"], ["txn", "describe", "0:1"],
                 ["txn", "abort", "0:1", "--who", "ops", "--why", "test"]):
        assert main(argv) == 2
        assert f"the warehouse root {warehouse_root} does not exist" in capsys.readouterr().err
    assert not warehouse_root.exists()
