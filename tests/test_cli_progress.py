"""What a `txnlake` command prints while it works: stage lines, a heartbeat while a stage is quiet,
a writer's wait for a lock, and nothing of that under `--quiet` (no Spark: the fast tier)."""

from __future__ import annotations

import io
import logging
import time

import pytest

from pipelines.progress import Console
from tests.threads import held_elsewhere
from txn_engine.storage.locks import TableLockTimeout, table_lock


def test_a_quiet_stage_gets_a_heartbeat_and_quiet_prints_nothing():
    out = io.StringIO()
    with Console(stream=out, heartbeat_s=0.2) as console:
        console.begin("counting ledgers")
        time.sleep(0.7)
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("] counting ledgers ...")
    assert any(line.endswith("] counting ledgers: working (in Python)") or "counting ledgers: working (Spark:" in line
               for line in lines[1:]), lines
    silent = io.StringIO()
    with Console(quiet=True, stream=silent, heartbeat_s=0.2) as console:
        console.begin("counting ledgers")
        logging.getLogger("txnlake.locks").info("waiting for something")
        time.sleep(0.5)
    assert silent.getvalue() == ""


def test_a_writer_waiting_for_a_lock_says_for_what_and_whom(tmp_path):
    lock = tmp_path / "_locks" / "ledger_entries.lock"
    out = io.StringIO()
    with held_elsewhere(lambda: table_lock(lock)), Console(stream=out, heartbeat_s=60):
        with pytest.raises(TableLockTimeout, match="another txnlake process is writing"):
            with table_lock(lock, timeout_s=0.5):
                pass
    [line] = out.getvalue().splitlines()
    assert f"waiting for the lock of table ledger_entries ({lock}, held by process " in line
