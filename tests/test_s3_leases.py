"""Locks of a warehouse on S3: leases in the store itself, exclusive across processes that share no
local folder, taken over once a killed holder's lease expires. A real S3-compatible server on
loopback (tests/s3_server.py); no Spark."""

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
def store(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


def host_env(store, tmp_path: Path, name: str, prefix: str, **extra: str) -> dict[str, str]:
    """The environment of a process standing for another host: a HOME of its own, so no local
    folder (lock or cache) is shared with the others; only the store is."""
    home = tmp_path / name
    home.mkdir(exist_ok=True)
    return {**os.environ, **store.env(prefix), "HOME": str(home), "PYTHONPATH": str(REPO), **extra}


def settings_of(store, prefix: str, **extra) -> WarehouseSettings:
    env = store.env(prefix)
    return WarehouseSettings(warehouse=env["TXNLAKE_WAREHOUSE"], s3_endpoint=store.endpoint,
                             s3_access_key_id=env["TXNLAKE_S3_ACCESS_KEY_ID"],
                             s3_secret_access_key=env["TXNLAKE_S3_SECRET_ACCESS_KEY"],
                             s3_region=env["TXNLAKE_S3_REGION"], s3_path_style=True, **extra)


def test_an_s3_warehouse_keeps_its_locks_in_the_store(store):
    settings = settings_of(store, "placed")
    assert settings.locks_in_store()
    assert settings.lock_path("ledgers") == f"s3://{store.bucket}/placed/_locks/ledgers.lock"
    with writer_lock(settings, "ledgers"):
        assert f"placed/_locks/ledgers.lock" in store.keys("placed/_locks/")
        with pytest.raises(TableLockTimeout, match=r"s3://.*ledgers\.lock; another txnlake process \(pid \d+ on "):
            with writer_lock(settings, "ledgers", timeout_s=0.3):
                pass
    with writer_lock(settings, "ledgers", timeout_s=0.3):  # released: free at once, not after its expiry
        pass


@pytest.mark.slow
def test_two_hosts_incrementing_under_one_lease_lose_no_update(store, tmp_path):
    times = 25
    procs = [subprocess.Popen([sys.executable, "-m", "tests.lease_holder", "count", "counter", str(times)],
                              env=host_env(store, tmp_path, name, "count"), cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for name in ("host-a", "host-b")]
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out.decode()[-3000:]
    from tests.lease_holder import read_counter

    assert read_counter(settings_of(store, "count")) == 2 * times


@pytest.mark.slow
def test_a_killed_holder_blocks_others_for_one_lease_at_most(store, tmp_path):
    lease_s = 3.0
    ready = tmp_path / "ready"
    env = host_env(store, tmp_path, "host-a", "killed", TXNLAKE_LOCK_LEASE_SECONDS=str(lease_s))
    holder = subprocess.Popen([sys.executable, "-m", "tests.lease_holder", "hold", "engine", str(ready)], env=env,
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert holder.poll() is None and time.monotonic() < deadline, holder.stdout.read().decode()[-3000:]
            time.sleep(0.05)
        warehouse = Warehouse(lambda: None, settings_of(store, "killed", lock_lease_seconds=lease_s))
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


def test_a_local_warehouse_keeps_flock_in_its_folder(tmp_path):
    settings = WarehouseSettings(warehouse=str(tmp_path / "wh"))
    assert not settings.locks_in_store()
    with writer_lock(settings, "ledgers"):
        assert (tmp_path / "wh" / "_locks" / "ledgers.lock").is_file()
