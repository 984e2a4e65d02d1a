"""Writer locks across processes and hosts: an flock where the locks live in a local folder, a lease
where they live in an S3 store (the default for an S3 warehouse).

A writer of a table holds its lock from the snapshot it decides on to its durable commit; the
buffer, the snapshots and the engine have locks of their own. An flock goes with its process. A
lease is an object `<lock root>/<name>.lock` taken with a conditional PUT (If-None-Match),
renewed by its holder (If-Match), released by marking it expired, and taken over by a waiter once
expired: a crashed host blocks the others for one lease at most. Expiry is by wall clock (hosts
keep theirs in sync); a holder that stalled past its lease learns it at release (LeaseLostError),
its commits atomic all the same (docs/deployment.md).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from botocore.exceptions import ClientError

from txn_engine.core.errors import TxnlakeError
from txn_engine.core.settings import WarehouseSettings, split_s3_uri
from txn_engine.storage.s3 import not_found, precondition_failed, s3_client

log = logging.getLogger(__name__)

# The operator's console (`txnlake` commands print this logger): a writer waiting says so.
progress = logging.getLogger("txnlake.locks")
WAIT_REPORT_S = 10.0  # a wait is announced at once, then again this often


class _Wait:
    """A writer's wait for a lock or lease: announced at once, then every WAIT_REPORT_S."""

    def __init__(self, timeout_s: float):
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self._reported: float | None = None

    def report(self, what: Callable[[], str]) -> None:
        now = time.monotonic()
        if self._reported is None or now - self._reported >= WAIT_REPORT_S:
            self._reported = now
            progress.info(f"waiting for {what()}, {now - self.started:.0f}s so far")

    def expired(self) -> bool:
        return time.monotonic() > self.deadline


class TableLockTimeout(TxnlakeError):
    """Another writer held the table's lock for too long."""


class LeaseLostError(TxnlakeError):
    """A lease expired while held (the holder stalled past it) and another host took it over."""


def _timeout_error(timeout_s: float, where: str, guarded: str, holder: str | None = None) -> TableLockTimeout:
    by = f" ({holder})" if holder else ""
    return TableLockTimeout(
        f"waited {timeout_s:.0f}s for the writer lock {where}; another txnlake process{by} is writing "
        f"{guarded}. Let it finish, or stop it and retry.")


@contextmanager
def table_lock(path: Path, timeout_s: float = 600.0, guarded: str = "this table") -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if missing) for the duration of the block.

    `guarded` names what the lock guards, for the timeout's message. Not reentrant: taking a lock
    this process (this very thread included) already holds waits for the timeout.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        wait = _Wait(timeout_s)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                what = f"table {path.stem}" if guarded == "this table" else guarded
                wait.report(lambda: f"the lock of {what} ({path}, {_holder(path)})")
                if wait.expired():
                    raise _timeout_error(timeout_s, str(path), guarded) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # closing releases the flock


def holder_name() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


class Lease:
    """An exclusive lease on the object at `uri` (s3://bucket/key), `ttl_s` long, renewed by a
    thread of its own while held (module docstring)."""

    def __init__(self, settings: WarehouseSettings, uri: str, ttl_s: float | None = None):
        self.uri = uri
        self.bucket, self.key = split_s3_uri(uri)
        self.ttl_s = float(ttl_s if ttl_s is not None else settings.lock_lease_seconds)
        self.client = s3_client(settings)
        self.owner = f"{holder_name()} ({uuid.uuid4().hex[:8]})"
        self._etag: str | None = None
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _body(self, expires_at: float | None = None) -> bytes:
        expiry = time.time() + self.ttl_s if expires_at is None else expires_at
        return json.dumps({"owner": self.owner, "expires_at": expiry,
                           "written_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}).encode()

    def _put(self, **condition: str) -> bool:
        """A conditional PUT of a fresh lease; False when the condition failed."""
        try:
            self._etag = self.client.put_object(Bucket=self.bucket, Key=self.key, Body=self._body(),
                                                ContentType="application/json", **condition)["ETag"]
            return True
        except ClientError as exc:
            if precondition_failed(exc) or not_found(exc):
                return False
            raise

    def try_acquire(self) -> str | None:
        """Take the lease if it is free, released or expired: None; else who holds it."""
        if self._put(IfNoneMatch="*"):
            return self._held()
        try:
            current = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except ClientError as exc:
            if not_found(exc):
                return "a holder releasing it"  # deleted meanwhile: try again
            raise
        try:
            state = json.loads(current["Body"].read())
            expires_at, owner = float(state["expires_at"]), str(state["owner"])
        except (ValueError, KeyError, TypeError):
            expires_at, owner = 0.0, "an unreadable lease"  # not ours to respect: take it over
        if expires_at > time.time():
            return owner
        if self._put(IfMatch=current["ETag"]):
            if expires_at > 0:
                log.warning("took over the expired lease %s of %s", self.uri, owner)
            return self._held()
        return owner

    def _held(self) -> None:
        self._lost.clear()
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew, name=f"lease {self.key}", daemon=True)
        self._renewer.start()
        return None

    def acquire(self, timeout_s: float, guarded: str) -> None:
        wait = _Wait(timeout_s)
        pause = 0.05
        while (holder := self.try_acquire()) is not None:
            wait.report(lambda: f"the lease {self.uri} ({guarded}, held by {holder})")
            if wait.expired():
                raise _timeout_error(timeout_s, self.uri, guarded, holder)
            time.sleep(pause)
            pause = min(pause * 2, 0.5, self.ttl_s / 4)

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if not self._put(IfMatch=self._etag):
                    self._lost.set()
                    log.error("lost the lease %s: another host took it over after it expired", self.uri)
                    return
            except Exception as exc:  # noqa: BLE001 - the store unreachable for a while: keep trying
                log.warning("could not renew the lease %s: %s", self.uri, exc)

    def release(self) -> None:
        """Stop renewing and mark the lease expired (If-Match: only if still ours); LeaseLostError
        when another host took it over meanwhile."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        if not self._lost.is_set():
            try:
                self.client.put_object(Bucket=self.bucket, Key=self.key, Body=self._body(expires_at=0.0),
                                       IfMatch=self._etag)
                return
            except ClientError as exc:
                if not (precondition_failed(exc) or not_found(exc)):
                    raise
        raise LeaseLostError(
            f"the lease {self.uri} expired while held (this process stalled for over {self.ttl_s:.0f}s) and "
            "another host took it over; what this process wrote is committed, but another writer may have "
            "worked alongside it. Re-run the command: every txnlake write is idempotent.")


@contextmanager
def writer_lock(settings: WarehouseSettings, name: str, timeout_s: float = 600.0,
                guarded: str = "this table") -> Iterator[None]:
    """Hold the lock `name` of the warehouse: a lease in the store when the locks live there, else a
    flock in the lock folder. Not reentrant."""
    if not settings.locks_in_store():
        with table_lock(Path(settings.lock_path(name)), timeout_s, guarded):
            yield
        return
    lease = Lease(settings, settings.lock_path(name))
    lease.acquire(timeout_s, guarded)
    try:
        yield
    finally:
        lease.release()


def _holder(path: Path) -> str:
    """Who holds the lock, as the holder wrote it (its pid), for the wait's message."""
    try:
        pid = path.read_text().strip()
    except OSError:
        pid = ""
    return f"held by process {pid}" if pid.isdigit() else "held by another writer"
