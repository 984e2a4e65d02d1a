"""Per-table writer locks across processes.

Delta on a local filesystem does not make two processes' commits mutually exclusive (both can
write version N and one commit is lost), so every txnlake writer of a table holds that table's
lock from reading the snapshot it decides on until its commit is durable. `flock` conflicts between
separate open file descriptions, so it also serializes threads of one process.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from txn_engine.core.errors import TxnlakeError

# The operator's console (`txnlake` commands print this logger): a writer waiting says so.
progress = logging.getLogger("txnlake.locks")
WAIT_REPORT_S = 10.0  # a wait is announced at once, then again this often


class TableLockTimeout(TxnlakeError):
    """Another writer held the table's lock for too long."""


@contextmanager
def table_lock(path: Path, timeout_s: float = 600.0, guarded: str = "this table") -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) for the duration of the block.

    `guarded` names what the lock guards, for the timeout's message. Not reentrant: taking a lock
    this process (this very thread included) already holds waits for the timeout.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        started = time.monotonic()
        deadline = started + timeout_s
        reported = None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if reported is None or now - reported >= WAIT_REPORT_S:
                    reported = now
                    what = f"table {path.stem}" if guarded == "this table" else guarded
                    progress.info(f"waiting for the lock of {what} ({path}, {_holder(path)}), "
                                  f"{now - started:.0f}s so far")
                if time.monotonic() > deadline:
                    raise TableLockTimeout(
                        f"waited {timeout_s:.0f}s for the writer lock {path}; another txnlake "
                        f"process is writing {guarded}. Let it finish, or stop it and retry."
                    ) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _holder(path: Path) -> str:
    """Who holds the lock, as the holder wrote it (its pid), for the wait's message."""
    try:
        pid = path.read_text().strip()
    except OSError:
        pid = ""
    return f"held by process {pid}" if pid.isdigit() else "held by another writer"
