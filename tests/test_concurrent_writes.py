"""Two processes writing one Delta table at once must not lose a commit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from txn_engine.storage.locks import TableLockTimeout, table_lock

BATCHES = 6


@pytest.mark.slow
def test_two_processes_racing_on_one_table_lose_nothing(spark, tmp_path):
    root = tmp_path / "wh"
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.race_writer", str(root), "race", name, str(BATCHES), str(tmp_path / f"{name}.ready"), str(go)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for name in ("a", "b")
    ]
    deadline = time.monotonic() + 180
    while not all((tmp_path / f"{n}.ready").exists() for n in ("a", "b")):
        assert time.monotonic() < deadline, "writers did not start"
        assert all(p.poll() is None for p in procs), [p.stdout.read().decode()[-2000:] for p in procs]
        time.sleep(0.1)
    go.touch()
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out.decode()[-3000:]
        # A fresh process's JVM starts quietly (resources/log4j2.properties): no INFO banner, no native-library warning.
        assert b"default log4j profile" not in out and b"NativeCodeLoader" not in out, out.decode()[-3000:]

    table = spark.read.format("delta").load(str(root / "race"))
    counts = {(r.writer, r.batch): r["count"] for r in table.groupBy("writer", "batch").count().collect()}
    assert counts == {(w, b): 10 for w in ("a", "b") for b in range(BATCHES)}
    log = sorted((root / "race" / "_delta_log").glob("*.json"))
    assert [int(p.stem) for p in log] == list(range(2 * BATCHES))
    operations = [json.loads(line) for p in log for line in p.read_text().splitlines()]
    assert sum(1 for op in operations if "commitInfo" in op) == 2 * BATCHES


def test_lock_excludes_a_second_holder_and_times_out_clearly(tmp_path):
    lock = tmp_path / "t.lock"
    with table_lock(lock):
        with pytest.raises(TableLockTimeout, match="another txnlake process is writing this table"):
            with table_lock(lock, timeout_s=0.2):
                pass
    with table_lock(lock, timeout_s=0.2):  # released after the block
        pass
