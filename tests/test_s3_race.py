"""Two hosts writing one S3 warehouse at once lose no commit: separate processes that share nothing
but the store (no lock folder, each its own HOME), appending to and rewriting the same tables
through Spark and delta-rs alike, with txnlake's leases and without any lock."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.s3_server import REPO, s3_server
from tests.s3_race_writer import ROWS
from txn_engine.storage.warehouse import Warehouse

pytestmark = pytest.mark.slow

HOSTS = ("host-a", "host-b")
ROUNDS = 2
# Commits a host makes per round: Spark append, delta-rs append, (Spark rewrite,) delta-rs rewrite.
COMMITS_PER_ROUND = {"race": 3, "race_raw": 4}


def test_two_hosts_racing_on_s3_lose_no_commit(tmp_path):
    with s3_server(tmp_path / "s3") as store:
        go = tmp_path / "go"
        procs = {}
        for host in HOSTS:
            home = tmp_path / host
            home.mkdir()
            env = {**os.environ, **store.env(), "HOME": str(home), "PYTHONPATH": str(REPO),
                   # The jars are read-only inputs, cached once per machine by `make setup`.
                   "TXNLAKE_JAR_CACHE": os.environ.get("TXNLAKE_JAR_CACHE", str(os.path.expanduser("~/.cache/txnlake/jars")))}
            procs[host] = subprocess.Popen(
                [sys.executable, "-m", "tests.s3_race_writer", host, str(ROUNDS), str(tmp_path / f"{host}.ready"), str(go)],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while not all((tmp_path / f"{h}.ready").exists() for h in HOSTS):
            assert time.monotonic() < deadline, "writers did not start"
            assert all(p.poll() is None for p in procs.values()), {h: p.stdout.read().decode()[-3000:] for h, p in procs.items()}
            time.sleep(0.1)
        go.touch()
        for host, p in procs.items():
            out, _ = p.communicate(timeout=600)
            assert p.returncode == 0, f"{host}:\n{out.decode()[-6000:]}"

        wh = Warehouse(lambda: None, store.settings())
        for table, commits in COMMITS_PER_ROUND.items():
            # Rows of round r were rewritten in each round from r on: every append and every rewrite is there.
            rewrites = commits - 2
            expected = sorted((h, via, r, i, rewrites * (ROUNDS - r)) for h in HOSTS for via in ("spark", "delta-rs")
                              for r in range(ROUNDS) for i in range(ROWS))
            handle = wh.delta_rs_table(wh.path(table))
            rows = sorted(tuple(r.values()) for r in handle.to_pyarrow_table().to_pylist())
            assert rows == expected, f"{table}: {len(rows)} rows, {len(expected)} expected"
            history = handle.history()
            # One version per commit, none written twice or lost: 0..N-1 for N operations.
            assert sorted(c["version"] for c in history) == list(range(len(HOSTS) * ROUNDS * commits)), table
        locks = store.keys("warehouse/_locks/")
        assert "warehouse/_locks/race.lock" in locks, locks
