"""A warehouse on S3 without Spark: its locks are leases in the store itself, exclusive across
processes that share no local folder and taken over once a killed holder's lease expires; the
Dagster resource's store settings reach delta-rs (a sensor reads the store). A real S3-compatible
server on loopback (tests/s3_server.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.s3_server import REPO, s3_server
from txn_engine.core.errors import EngineLockedError
from txn_engine.core.settings import WarehouseSettings
from txn_engine.producers.engine import EngineLock
from txn_engine.storage.locks import TableLockTimeout, writer_lock
from txn_engine.storage.warehouse import Warehouse


@pytest.fixture(scope="module")
def s3_store(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


def host_env(s3_store, tmp_path: Path, name: str, prefix: str, **extra: str) -> dict[str, str]:
    """The environment of a process standing for another host: a HOME of its own, so no local
    folder (lock or cache) is shared with the others; only the store is."""
    home = tmp_path / name
    home.mkdir(exist_ok=True)
    return {**os.environ, **s3_store.env(prefix), "HOME": str(home), "PYTHONPATH": str(REPO), **extra}


def test_an_s3_warehouse_keeps_its_locks_in_the_store(s3_store):
    settings = s3_store.settings("placed")
    assert settings.locks_in_store()
    assert settings.lock_path("ledgers") == f"s3://{s3_store.bucket}/placed/_internal/locks/ledgers.lock"
    with writer_lock(settings, "ledgers"):
        assert "placed/_internal/locks/ledgers.lock" in s3_store.keys("placed/_internal/locks/")
        with pytest.raises(TableLockTimeout, match=r"s3://.*ledgers\.lock; another txnlake process \(pid \d+ on "):
            with writer_lock(settings, "ledgers", timeout_s=0.3):
                pass
    with writer_lock(settings, "ledgers", timeout_s=0.3):  # released: free at once, not after its expiry
        pass


@pytest.mark.slow
def test_two_hosts_incrementing_under_one_lease_lose_no_update(s3_store, tmp_path):
    times = 25
    procs = [subprocess.Popen([sys.executable, "-m", "tests.lease_holder", "count", "counter", str(times)],
                              env=host_env(s3_store, tmp_path, name, "count"), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for name in ("host-a", "host-b")]
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out.decode()[-3000:]
    from tests.lease_holder import read_counter

    assert read_counter(s3_store.settings("count")) == 2 * times


@pytest.mark.slow
def test_a_killed_holder_blocks_others_for_one_lease_at_most(s3_store, tmp_path):
    lease_s = 3.0
    ready = tmp_path / "ready"
    env = host_env(s3_store, tmp_path, "host-a", "killed", TXNLAKE_LOCK_LEASE_SECONDS=str(lease_s))
    holder = subprocess.Popen([sys.executable, "-m", "tests.lease_holder", "hold", "engine", str(ready)], env=env,
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert holder.poll() is None and time.monotonic() < deadline, holder.stdout.read().decode()[-3000:]
            time.sleep(0.05)
        warehouse = Warehouse(lambda: None, s3_store.settings("killed", lock_lease_seconds=lease_s))
        # Renewed while its holder lives: refused however long we wait past one lease.
        time.sleep(lease_s * 1.5)
        with pytest.raises(EngineLockedError, match=r"another transaction engine is running on this warehouse \(pid "):
            EngineLock(warehouse)
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
        killed_at = time.monotonic()
        while True:
            try:
                lock = EngineLock(warehouse)
                break
            except EngineLockedError:
                assert time.monotonic() - killed_at < lease_s + 2, "the dead holder's lease never expired"
                time.sleep(0.1)
        taken_after = time.monotonic() - killed_at
        lock.release()
        assert taken_after <= lease_s + 2
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()


@pytest.mark.slow
def test_a_holder_stalled_past_its_lease_learns_it_lost_it(s3_store, tmp_path):
    lease_s = 2.0
    ready = tmp_path / "ready"
    env = host_env(s3_store, tmp_path, "host-a", "stalled", TXNLAKE_LOCK_LEASE_SECONDS=str(lease_s))
    holder = subprocess.Popen([sys.executable, "-m", "tests.lease_holder", "hold", "ledgers", str(ready), "4"], env=env,
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert holder.poll() is None and time.monotonic() < deadline, holder.stdout.read().decode()[-3000:]
        time.sleep(0.05)
    holder.send_signal(signal.SIGSTOP)  # a stall: a long pause, a partition
    try:
        with writer_lock(s3_store.settings("stalled", lock_lease_seconds=lease_s), "ledgers", timeout_s=lease_s + 5):
            holder.send_signal(signal.SIGCONT)
            out, _ = holder.communicate(timeout=60)
    finally:
        holder.send_signal(signal.SIGCONT)
    assert holder.returncode == 1
    assert "LeaseLostError: the lease s3://" in out.decode() and "expired while held" in out.decode(), out.decode()[-3000:]


def test_the_snapshot_sensor_reads_an_s3_warehouse_by_the_resource_s_settings(s3_store, monkeypatch):
    import pyarrow as pa
    from dagster import DagsterInstance, RunRequest, SkipReason, build_sensor_context
    from deltalake import write_deltalake

    from assets.snapshots import snapshot_trigger_sensor
    from resources.warehouse import WarehouseResource

    for key in s3_store.env():  # nothing from the environment: the resource alone names the store
        monkeypatch.delenv(key, raising=False)
    settings = s3_store.settings("sensed")
    resources = {"warehouse": WarehouseResource(
        root=settings.warehouse, s3_endpoint=s3_store.endpoint, s3_region=settings.s3_region, s3_path_style=True,
        s3_access_key_id=settings.s3_access_key_id, s3_secret_access_key=settings.s3_secret_access_key)}
    with DagsterInstance.ephemeral() as instance:
        def tick(cursor=None):
            context = build_sensor_context(instance=instance, resources=resources, cursor=cursor)
            return context, snapshot_trigger_sensor(context)

        assert isinstance(tick()[1], SkipReason)
        path = settings.table_path("ledger_entries")
        for _ in range(2):
            write_deltalake(path, pa.table({"topic": ["t"]}), mode="append", storage_options=settings.storage_options(path))
        context, request = tick()
        assert isinstance(request, RunRequest) and request.run_key == "ledger_entries-v1"
        assert isinstance(tick(context.cursor)[1], SkipReason)


def test_a_local_warehouse_keeps_flock_in_its_folder(tmp_path):
    settings = WarehouseSettings(warehouse=str(tmp_path / "wh"))
    assert not settings.locks_in_store()
    with writer_lock(settings, "ledgers"):
        assert (tmp_path / "wh" / "_internal" / "locks" / "ledgers.lock").is_file()


def test_an_older_s3_warehouse_is_refused_then_moved_by_copy(s3_store):
    """On S3 a table moves by a copy in one commit, then the old copy goes: no rename there. Here
    without Spark: the tables moved need no column the contract added."""
    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    from txn_engine.core.errors import WarehouseMigrationError
    from txn_engine.core.schema import LEDGER_STATES_LOG, OFFLOAD_MANIFEST, TABLES
    from txn_engine.storage.migrate import migrate_warehouse, require_current_layout

    settings = s3_store.settings("older")
    states = pa.table({"topic": ["t"], "ledger_id": [1], "state": ["OFFLOADED"], "reason": ["offload"],
                       "recorded_at": pa.array([0], pa.timestamp("us", tz="UTC"))})
    manifest_columns = TABLES[OFFLOAD_MANIFEST].schema.fieldNames()
    manifest = {c: [0] for c in manifest_columns}
    manifest.update(topic=["t"], ledger_id=[1], checksum=["-1"], tier_location=["s3://x/cold/offloaded_entries"],
                    offloaded_at=pa.array([0], pa.timestamp("us", tz="UTC")))
    former = {t: settings.former_table_path(t) for t in (LEDGER_STATES_LOG, OFFLOAD_MANIFEST)}
    assert former[OFFLOAD_MANIFEST].endswith("/older/cold/offload_manifest")
    write_deltalake(former[LEDGER_STATES_LOG], states, storage_options=settings.storage_options(former[LEDGER_STATES_LOG]))
    write_deltalake(former[OFFLOAD_MANIFEST], pa.table(manifest), storage_options=settings.storage_options(former[OFFLOAD_MANIFEST]))
    with pytest.raises(WarehouseMigrationError, match="txnlake migrate"):
        require_current_layout(settings)

    done = migrate_warehouse(Warehouse(None, settings), report=lambda line: None)
    assert set(done) >= {LEDGER_STATES_LOG, OFFLOAD_MANIFEST}
    require_current_layout(settings)
    assert not s3_store.keys("older/ledger_states/") and not s3_store.keys("older/cold/offload_manifest/")
    opts = settings.storage_options(settings.table_path(OFFLOAD_MANIFEST))
    moved = DeltaTable(settings.table_path(LEDGER_STATES_LOG), storage_options=opts)
    assert settings.table_path(LEDGER_STATES_LOG).endswith("/older/_internal/ledger_states")
    assert moved.to_pyarrow_table().to_pylist() == states.to_pylist()
    assert all(f.metadata.get("comment") for f in moved.schema().fields)
    [row] = DeltaTable(settings.table_path(OFFLOAD_MANIFEST), storage_options=opts).to_pyarrow_table().to_pylist()
    assert row["checksum"] == "ffffffffffffffff"  # -1 modulo 2^64
    assert migrate_warehouse(Warehouse(None, settings), report=lambda line: None) == {}


def test_a_shipped_model_runs_in_the_driver_over_an_s3_warehouse(s3_store):
    """DuckDB reads the store's Delta tables through delta-rs's datasets, with the store's settings:
    the driver's way for a shipped model on small tables (`sql.models.runs_in_driver`), no JVM."""
    from txn_engine.core.schema import TXN_MARKERS, TXN_MARKERS_SCHEMA
    from txn_engine.sql.models import discover_models, run_model_in_driver, runs_in_driver
    from txn_engine.storage.delta_io import DeltaTables

    warehouse = Warehouse(lambda: None, s3_store.settings("modelled"))
    assert warehouse.path(TXN_MARKERS).startswith(f"s3://{s3_store.bucket}/modelled/")
    markers = [{"topic": "t", "txn_most_bits": 0, "txn_least_bits": i, "outcome": "ABORT" if i % 3 == 0 else "COMMIT",
                "ledger_id": 1 + i // 6, "entry_id": i} for i in range(12)]
    DeltaTables(warehouse).append(TXN_MARKERS, TXN_MARKERS_SCHEMA, markers)
    model = next(m for m in discover_models() if m.name == "abort_rates")
    assert runs_in_driver(warehouse, model)
    rates = {r["ledger_id"]: (r["decided_txns"], r["aborted_txns"], r["abort_rate"])
             for r in run_model_in_driver(warehouse, model).to_pylist()}
    assert rates == {1: (6, 2, round(2 / 6, 4)), 2: (6, 2, round(2 / 6, 4))}  # the model rounds to 4 places
