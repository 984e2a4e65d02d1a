"""txnlake on a real Spark standalone cluster (a master and two workers on loopback) against a
warehouse on S3 (an S3-compatible server on loopback, tests/s3_server.py): the CLI end to end in
local mode on a local warehouse and on the cluster on the S3 one, its input file on the store too,
over one generated log, with the same tables and reads. One cluster run covers both deployments'
differences from local mode at once (the suite has time for one): executors on other JVMs, the
store's settings reaching Spark and delta-rs, commits by conditional PUTs, leases for locks.

Executors get Delta's jars and the project's code as a user's cluster would (`resources.spark`:
`spark.jars`, and a zip of the packages by `spark.submit.pyFiles`); nothing is installed for them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.s3_server import S3Server, s3_server
from tests.spark_standalone import StandaloneCluster, standalone_cluster

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
COMMAND_TIMEOUT = 900

# Settings of the calling shell that would steer a run elsewhere than this test says.
CLEARED_ENV = ("TXNLAKE_WAREHOUSE", "TXNLAKE_COLD_TIER", "TXNLAKE_LOCK_DIR", "TXNLAKE_SPARK_MASTER",
               "TXNLAKE_SPARK_CONF", "TXNLAKE_COMPUTE", "TXNLAKE_SHIP_CODE", "PYSPARK_PYTHON", "SPARK_LOCAL_IP",
               "SPARK_CONF_DIR", "PYTHONPATH", "TXNLAKE_S3_ENDPOINT", "TXNLAKE_S3_REGION", "TXNLAKE_S3_ACCESS_KEY_ID",
               "TXNLAKE_S3_SECRET_ACCESS_KEY", "TXNLAKE_S3_SESSION_TOKEN", "TXNLAKE_S3_PATH_STYLE")

# Columns that legitimately differ between two runs over the same log; every other column of every
# table must be equal row for row.
RUN_SPECIFIC_COLUMNS = {
    "updated_at": "wall-clock time the catalog row / snapshot state was refreshed",
    "recorded_at": "wall-clock time a ledger state (OFFLOADED) was recorded",
    "offloaded_at": "wall-clock time of the offload",
    "tier_location": "absolute path of the tier table, under each warehouse's own root",
    "snapshot_id": "random per snapshot (secrets.randbits), so recovery never mixes two snapshots' parts",
    "written_at": "wall-clock time a snapshot segment was written",
    "last_snapshot_at": "wall-clock time of the topic's last snapshot",
    "deleted_at": "wall-clock time retention deleted the ledger",
}


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory) -> StandaloneCluster:
    with standalone_cluster(tmp_path_factory.mktemp("spark-cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def s3_store(tmp_path_factory) -> S3Server:
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


def cli_env(settings: dict[str, str]) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in CLEARED_ENV}, **settings}


def txnlake(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`txnlake ARGS` in a fresh process of this checkout (`python -m pipelines.cli`, as the
    `txnlake` script runs `pipelines.cli:main`); fails the test with its output if it fails."""
    done = subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=COMMAND_TIMEOUT)
    assert done.returncode == 0, failure(args, env, done)
    return done


def failure(args: list[str], env: dict[str, str], done: subprocess.CompletedProcess) -> str:
    return (f"`txnlake {' '.join(args)}` exited {done.returncode} (TXNLAKE_SPARK_MASTER="
            f"{env.get('TXNLAKE_SPARK_MASTER', '-')}):\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-8000:]}")


# One process runs the commands in turn (`pipelines.cli.main`, as the `txnlake` script does): one
# JVM and one cluster application for the whole pipeline; each command's output after a marker line.
# Then, in the same application, where the executors' Python workers (the buffer kernel's, a user's
# UDF) found the project's packages and with which interpreter.
SESSION = """
import importlib.util, json, sys
from pipelines.cli import main
from resources.spark import get_spark
for args in json.loads(sys.argv[1]):
    print("\\n@@ txnlake " + " ".join(args), flush=True)
    code = main(args)
    sys.stdout.flush()
    if code:
        sys.exit(code)

def where(_):
    import sys, txn_engine.core.positions
    yield {"executable": sys.executable, "txn_engine": txn_engine.core.positions.__file__,
           **{p: importlib.util.find_spec(p).origin for p in ("assets", "resources", "pipelines")}}

spark = get_spark()
seen = spark.sparkContext.parallelize(range(4), 4).mapPartitions(where).collect()
print("\\n@@ probe\\n" + json.dumps({"driver_host": spark.conf.get("spark.driver.host"), "seen": seen}), flush=True)
"""


@dataclass
class Session:
    """The commands of `start_session`, running in a process of their own."""

    commands: list[list[str]]
    env: dict[str, str]
    process: subprocess.Popen

    def outputs(self) -> dict[str, str]:
        """Once it ends: the outputs by command name (and the probe's); a failure of the test, with
        its output, if a command failed."""
        try:
            stdout, stderr = self.process.communicate(timeout=COMMAND_TIMEOUT)
        finally:
            self.stop()  # when it timed out
        done = subprocess.CompletedProcess(self.process.args, self.process.returncode, stdout, stderr)
        assert done.returncode == 0, failure([c[0] for c in self.commands], self.env, done)
        commands_out, probe = done.stdout.split("\n@@ probe\n")
        outputs = commands_out.split("\n@@ txnlake ")[1:]
        assert len(outputs) == len(self.commands), done.stdout[-4000:]
        return {**{command[0]: output.split("\n", 1)[1] for command, output in zip(self.commands, outputs)},  # after its marker
                "probe": probe}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


def start_session(commands: list[list[str]], env: dict[str, str]) -> Session:
    """The commands started, all in one fresh process (`SESSION`)."""
    return Session(commands, env, subprocess.Popen([sys.executable, "-c", SESSION, json.dumps(commands)], cwd=REPO, env=env,
                                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))


def end_to_end(folder: Path, log: str, topic: str, extra_env: dict[str, str]) -> tuple[list[list[str]], dict[str, str]]:
    """ingest, run, snapshot, offload, retention (all but each topic's newest ledger), read, into the
    warehouse `extra_env` names (default: one of its own under `folder`): the commands and their
    environment, with a Dagster home of its own (as the CLI prepares one: tests/test_cli.py)."""
    from pipelines.cli import DAGSTER_YAML

    home = folder / "dagster_home"
    home.mkdir(parents=True)
    (home / "dagster.yaml").write_text(DAGSTER_YAML)
    env = cli_env({"TXNLAKE_WAREHOUSE": str(folder / "warehouse"), "DAGSTER_HOME": str(home), **extra_env})
    return [["ingest", log], ["run"], ["snapshot"], ["offload"], ["retention", "--keep-ledgers", "1"],
            ["read", topic, "--max", "50"]], env


def read_output(out: dict[str, str]) -> tuple[str, str | None]:
    """Of an `end_to_end` session's outputs, once checked that it offloaded and deleted ledgers: the
    read's output, and the fresh process's probe of its executors (`SESSION`)."""
    assert "FAILED" not in out["offload"] and "offloaded 0 ledger(s)" not in out["offload"], out["offload"]
    assert "nothing to do" not in out["retention"] and "deleted 0 ledger(s)" not in out["retention"], out["retention"]
    return out["read"], out.get("probe")


def in_this_process(monkeypatch, capsys):
    """A session's commands (`start_session`) run at once in the test's own process and SparkSession
    (local mode, already warm): `pipelines.cli.main` per command, in the session's environment."""
    from pipelines.cli import main

    def session(commands: list[list[str]], env: dict[str, str]) -> dict[str, str]:
        for name in CLEARED_ENV:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            if os.environ.get(name) != value:
                monkeypatch.setenv(name, value)
        capsys.readouterr()
        outputs = {}
        for args in commands:
            code = main(args)
            out, err = capsys.readouterr()
            assert code == 0, f"`txnlake {' '.join(args)}` exited {code}:\n{out[-4000:]}\n{err[-4000:]}"
            outputs[args[0]] = out
        return outputs

    return session


def computed_by(folder: Path) -> set[str]:
    """Where the transaction-buffer runs of `folder`'s Dagster home computed, by their materializations' metadata."""
    from dagster import AssetKey, DagsterInstance

    with DagsterInstance.from_config(str(folder / "dagster_home")) as instance:
        events = instance.fetch_materializations(AssetKey("stable_positions"), limit=100).records
        return {e.asset_materialization.metadata["computed_by"].value for e in events
                if "computed_by" in e.asset_materialization.metadata}


def delta_tables(root: Path) -> dict[str, str]:
    return {str(log.parent.relative_to(root)): str(log.parent) for log in sorted(root.rglob("_delta_log"))}


def s3_delta_tables(store: S3Server, prefix: str) -> dict[str, str]:
    logs = {key.split("/_delta_log/")[0] for key in store.keys(f"{prefix}/") if "/_delta_log/" in key}
    return {name.removeprefix(f"{prefix}/"): f"s3://{store.bucket}/{name}" for name in sorted(logs)}


def comparable_rows(path: str, skipped_seen: set[str], store: S3Server) -> tuple[object, list[dict]]:
    """The table's schema without run-specific columns, and its rows sorted by every non-binary
    column (nested ones by their repr), binary ones breaking ties."""
    import pyarrow as pa
    from deltalake import DeltaTable

    table = DeltaTable(path, storage_options=store.settings().storage_options(path)).to_pyarrow_table()
    skipped = [c for c in table.column_names if c in RUN_SPECIFIC_COLUMNS]
    skipped_seen.update(skipped)
    table = table.drop_columns(skipped)
    binary = [f.name for f in table.schema if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)]
    keys = [c for c in table.column_names if c not in binary] + binary
    rows = table.to_pylist()
    rows.sort(key=lambda r: [_sortable(r[c]) for c in keys])
    return table.schema, rows


def _sortable(value) -> tuple:
    if value is None:
        return (True, 0)  # nulls last; never compared with a value
    return (False, repr(value) if isinstance(value, (list, dict)) else value)


def test_the_cli_on_a_standalone_cluster_and_s3_matches_local_mode(spark_cluster, s3_store, spark, tmp_path, monkeypatch,
                                                                   capsys):
    log = tmp_path / "log.jsonl"
    txnlake(["generate", "--entries", "3000", "--seed", "11", str(log)], cli_env({"DAGSTER_HOME": str(tmp_path)}))
    topic = min(json.loads(line)["topic"] for line in log.read_text().splitlines())
    # The cluster's input on the store as well: executors on other hosts could not read a local path.
    s3_store.client().upload_file(str(log), s3_store.bucket, "inputs/log.jsonl")

    def apps() -> dict[str, dict]:
        return {a["id"]: a for a in spark_cluster.state()["completedapps"]}

    before = apps()
    # The cluster's commands in a process of their own, started first: they mostly wait (on
    # executors, the store), so local mode runs meanwhile, in this process's warm session.
    # TXNLAKE_COMPUTE=spark: every buffer run on Spark (the kernel in the executors' Python
    # workers), not in the driver, which this small log would otherwise take.
    cluster = start_session(*end_to_end(tmp_path / "cluster", f"s3://{s3_store.bucket}/inputs/log.jsonl", topic, {
        "TXNLAKE_SPARK_MASTER": spark_cluster.url, "TXNLAKE_COMPUTE": "spark", **s3_store.env("warehouse")}))
    try:
        local_read, _ = read_output(in_this_process(monkeypatch, capsys)(*end_to_end(tmp_path / "local", str(log), topic, {})))
    except BaseException:
        cluster.stop()
        raise
    cluster_read, cluster_probe = read_output(cluster.outputs())
    assert computed_by(tmp_path / "local") == {"driver"} and computed_by(tmp_path / "cluster") == {"spark"}

    # Executors' Python workers imported this checkout's packages from the zip the driver shipped,
    # not whatever their site-packages holds, with the driver's interpreter.
    probe = json.loads(cluster_probe.strip())
    assert probe["driver_host"] == "127.0.0.1"
    assert len(probe["seen"]) == 4
    for seen in probe["seen"]:
        assert seen.pop("executable") == sys.executable
        for package, origin in seen.items():
            # SparkFiles' copy in the executor's work dir, e.g. ./txnlake-code-<hash>.zip/txn_engine/core/positions.py
            assert "txnlake-code-" in origin and ".zip/" in origin, (package, origin)

    # The cluster ran the work, and only the commands' application (local mode never touched it):
    # it had executors on both workers, each small enough for a 2 GiB worker.
    ran = [a for key, a in apps().items() if key not in before]
    assert len(ran) == 1 and {a["name"] for a in ran} == {"txnlake"}, ran
    assert all(a["memoryperexecutor"] <= 2048 for a in ran), ran
    for work_dir in spark_cluster.worker_dirs:
        assert {p.name for p in work_dir.glob("app-*")} & {a["id"] for a in ran}, f"no executor of the run in {work_dir}"

    local_tables, cluster_tables = delta_tables(tmp_path / "local" / "warehouse"), s3_delta_tables(s3_store, "warehouse")
    assert set(cluster_tables) == set(local_tables)
    assert {"committed_entries", "stable_positions", "cold/offloaded_entries", "recovered_buffer_state"} <= set(local_tables)
    skipped_seen: set[str] = set()
    for name, path in local_tables.items():
        local_schema, local_rows = comparable_rows(path, skipped_seen, s3_store)
        cluster_schema, cluster_rows = comparable_rows(cluster_tables[name], skipped_seen, s3_store)
        # Names, types and nullability: the buffer's Spark path keeps the schema's NOT NULL as the driver's does.
        assert [(f.name, f.type, f.nullable) for f in cluster_schema] == [(f.name, f.type, f.nullable) for f in local_schema], \
            f"{name}: schemas differ"
        assert len(cluster_rows) == len(local_rows), f"{name}: {len(cluster_rows)} rows on the cluster, {len(local_rows)} locally"
        for i, (cluster_row, local_row) in enumerate(zip(cluster_rows, local_rows)):
            assert cluster_row == local_row, f"{name}: row {i} (sorted) differs"
    assert skipped_seen == set(RUN_SPECIFIC_COLUMNS), "a skipped column no table has: drop it from the list"

    assert cluster_read == local_read
    assert cluster_read.splitlines()[-1].startswith("-- 50 entries"), cluster_read[-500:]
    # Every lock of the cluster's run was a lease in the store, none a file on this host.
    leases = {key.rsplit("/", 1)[1] for key in s3_store.keys("warehouse/_internal/locks/")}
    assert {"ledger_entries.lock", "transaction_buffer.lock", "txn_snapshot_writer.lock"} <= leases, leases

