"""`txnlake` commands are runs of the code location's named jobs: the instance lists them under their
jobs with the command line that started them, the UI (its GraphQL, on the workspace's code location)
re-executes them, and so does `execute_job`. A command with nothing to do says so and records
nothing; one waiting for a lock says so; an interrupt marks its run cancelled."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

from pipelines.cli import DAGSTER_YAML, main
from pipelines.runs import COMMAND_TAG, LOCATION_NAME
from tests.rows import entry, write_jsonl
from tests.threads import held_elsewhere

REPO = Path(__file__).resolve().parent.parent
# The UI's re-execution is queued (no daemon here launches it): what the test checks is that the UI
# accepts it, for the named job, with the parent's selection and tags.
QUEUED = "run_coordinator:\n  module: dagster._core.run_coordinator\n  class: QueuedRunCoordinator\n"
# Topic "t": ledger 1 (closed) holds a committed and an aborted transaction; ledger 2 is OPEN, with
# a transaction still open (2:1) and one committed after it: a marker past the stable position, a
# change the snapshot interval (not the command) makes due.
HISTORY = [entry("t", 1, 0, txn=(0, 1)), entry("t", 1, 1, txn=(0, 2)), entry("t", 1, 2, "COMMIT", txn=(0, 1)),
           entry("t", 1, 3, "ABORT", txn=(0, 2)), entry("t", 2, 0, producer=5, seq=0), entry("t", 2, 1, txn=(0, 3)),
           entry("t", 2, 2, txn=(0, 4)), entry("t", 2, 3, "COMMIT", txn=(0, 4))]
REPOSITORY_TAG = ".dagster/repository"  # what the UI's job pages filter runs by

RUNS_QUERY = """query($job: String!, $repository: String!) {
  runsOrError(filter: {pipelineName: $job, tags: [{key: ".dagster/repository", value: $repository}]}) {
    ... on Runs { results { runId jobName status tags { key value } } }
  }
}"""
REEXECUTE = """mutation($parent: String!) {
  launchPipelineReexecution(reexecutionParams: {parentRunId: $parent, strategy: ALL_STEPS}) {
    __typename
    ... on LaunchRunSuccess { run { runId jobName parentRunId status tags { key value } } }
    ... on PythonError { message }
  }
}"""


def runs_by_job(instance) -> dict[str, list]:
    by_job: dict[str, list] = {}
    for record in reversed(instance.get_run_records()):  # oldest first
        by_job.setdefault(record.dagster_run.job_name, []).append(record.dagster_run)
    return by_job


def test_cli_runs_are_named_reexecutable_runs(warehouse, warehouse_root, tmp_path, capsys, monkeypatch):
    from dagster import DagsterInstance, DagsterRunStatus, ReexecutionOptions, RunsFilter, execute_job
    from dagster._utils.hosted_user_process import recon_job_from_origin
    from dagster_graphql.test.utils import define_out_of_process_context, execute_dagster_graphql

    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(DAGSTER_YAML + QUEUED)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    data = write_jsonl(tmp_path / "t.jsonl", HISTORY)
    assert main(["ingest", str(data)]) == 0
    assert main(["run"]) == 0
    out, err = capsys.readouterr()
    assert "stable_positions" in out and "of job derive_all: started" in err, (out, err)  # stage lines: stderr
    instance = DagsterInstance.get()
    runs = runs_by_job(instance)
    assert set(runs) == {"ingest", "ledgers_catalog", "derive_all"}, runs
    [ingest], [catalog], [derive] = runs["ingest"], runs["ledgers_catalog"], runs["derive_all"]
    assert ingest.tags[COMMAND_TAG] == f"txnlake ingest {data}" and derive.tags[COMMAND_TAG] == "txnlake run"
    for run in (ingest, catalog, derive):
        assert run.status == DagsterRunStatus.SUCCESS and run.remote_job_origin.location_name == LOCATION_NAME
    # Stored with the code location's label, which the UI's job pages filter by.
    labelled = instance.get_run_records(RunsFilter(tags={REPOSITORY_TAG: f"__repository__@{LOCATION_NAME}"}))
    assert {r.dagster_run.run_id for r in labelled} == {ingest.run_id, catalog.run_id, derive.run_id}
    # derive_all over the ledger partitions as a range (one run), the catalog aside (its own run).
    assert derive.tags["dagster/asset_partition_range_start"] and derive.tags["dagster/asset_partition_range_end"]
    assert "ledgers" not in {k.to_user_string() for k in derive.asset_selection}

    # Again with no new data: nothing to do, said at once, nothing recorded.
    started = time.perf_counter()
    assert main(["run"]) == 0
    assert capsys.readouterr().out.startswith("nothing to do: ")
    assert time.perf_counter() - started < 15 and runs_by_job(instance) == runs

    # The UI lists the runs on the job's page and re-executes them.
    with define_out_of_process_context(str(REPO / "workspace.yaml"), None, instance) as context:
        listed = execute_dagster_graphql(context, RUNS_QUERY, {"job": "derive_all", "repository": f"__repository__@{LOCATION_NAME}"})
        assert [r["runId"] for r in listed.data["runsOrError"]["results"]] == [derive.run_id]
        launched = execute_dagster_graphql(context, REEXECUTE, {"parent": derive.run_id}).data["launchPipelineReexecution"]
        assert launched["__typename"] == "LaunchRunSuccess", launched
        again = launched["run"]
        assert again["jobName"] == "derive_all" and again["parentRunId"] == derive.run_id and again["status"] == "QUEUED"
        assert {t["key"]: t["value"] for t in again["tags"]}[COMMAND_TAG] == "txnlake run"
    queued = instance.get_run_by_id(again["runId"])
    assert queued.asset_selection == derive.asset_selection
    instance.report_run_canceled(queued)  # no daemon will launch it
    # And a re-execution runs, as the run worker would: the catalog run again, in this process.
    with execute_job(recon_job_from_origin(catalog.job_code_origin), instance,
                     reexecution_options=ReexecutionOptions(parent_run_id=catalog.run_id)) as result:
        assert result.success and result.dagster_run.parent_run_id == catalog.run_id
        assert result.dagster_run.job_name == "ledgers_catalog"

    # Snapshots: the first run takes them; the second has nothing to do.
    assert main(["snapshot"]) == 0
    assert "check recovered_state_equals_full_replay: passed" in capsys.readouterr().out
    assert [r.tags[COMMAND_TAG] for r in runs_by_job(instance)["take_snapshots"]] == ["txnlake snapshot"]
    before = runs_by_job(instance)
    assert main(["snapshot"]) == 0
    assert capsys.readouterr().out.startswith("nothing to do: no topic is due")
    assert runs_by_job(instance) == before
    # The commit past the open transaction is a change: once the interval has passed, "t" is due.
    from assets.snapshots import snapshots_pending

    assert snapshots_pending(warehouse, now=time.time() + 3600) == ["1 topic(s) due for a snapshot: t"]


def test_a_run_waiting_for_the_buffer_says_so_and_an_interrupt_cancels_it(warehouse, warehouse_root, tmp_path, capsys,
                                                                           monkeypatch):
    from dagster import DagsterInstance, DagsterRunStatus

    from txn_engine.buffer.refresh import buffer_lock

    home = tmp_path / "dagster_home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    assert main(["ingest", str(write_jsonl(tmp_path / "t.jsonl", HISTORY))]) == 0
    capsys.readouterr()
    waiting = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record):
            if "waiting for the lock" in record.getMessage():
                waiting.set()

    def interrupt():  # SIGTERM (as Ctrl-C) once the command says it waits
        if waiting.wait(300):
            os.kill(os.getpid(), signal.SIGTERM)

    seen = Seen()
    logging.getLogger("txnlake").addHandler(seen)
    try:
        with held_elsewhere(lambda: buffer_lock(warehouse)):  # another buffer run
            threading.Thread(target=interrupt, daemon=True).start()
            assert main(["run"]) == 130
    finally:
        logging.getLogger("txnlake").removeHandler(seen)
    err = capsys.readouterr().err
    assert "waiting for the lock of the transaction buffer of this warehouse" in err and "held by process" in err
    [line] = [line for line in err.splitlines() if line.startswith("interrupted")]
    assert "of job derive_all is marked canceled" in line and "Traceback" not in err
    [derive] = [r.dagster_run for r in DagsterInstance.get().get_run_records() if r.dagster_run.job_name == "derive_all"]
    assert derive.status == DagsterRunStatus.CANCELED
    # The lock free, the next run does the work the cancelled one did not.
    assert main(["run", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert "stable_positions" in out and "nothing to do" not in out and err == ""
