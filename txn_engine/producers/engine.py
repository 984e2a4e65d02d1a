"""The transaction engine: producers write through it into the ledgers; one engine per warehouse.

Several engines on one warehouse would each hand out producer ids, epochs, transaction ids and
ledger positions from their own memory, so fencing and exactly-once markers would break. The
rule: one engine per warehouse, enforced by an exclusive lock (`<lock dir>/engine.lock`, beside
the table writer locks: an flock, or a lease in the store for an S3 warehouse, `storage.locks`)
held for the engine's lifetime. A second engine, in
this process or another, is refused with an error naming the holder. Ingest and the Spark jobs
are not engines: they keep writing their tables under the per-table locks.

While an engine runs, threads switch every 1 ms (default 5: acknowledgements wait for a committer
that waits for the GIL after each commit) and the youngest generation is collected every 100,000
allocations (default 700: it would rescan what the engine keeps every few messages); set by the
process's first engine, restored by its last (docs/benchmarks.md, "Engine: threads, ...").
Its timer aborts transactions open past their timeout, as Kafka's does (docs/engine.md, "Timeouts").
"""

from __future__ import annotations

import fcntl
import gc
import logging
import os
import socket
import sys
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable

from txn_engine.tier.consumer import Consumer
from txn_engine.producers.coordinator import TransactionCoordinator
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.producers.ledger_writer import LedgerWriter, PendingEntries, RolloverPolicy, WriteRequest
from txn_engine.core.log_types import EntryType, TxnId
from txn_engine.core.positions import EARLIEST, Position
from txn_engine.producers.producer import (
    IdempotentProducer, ProducerServices, ProducerStateManager, SendFuture, TransactionalProducer, _check_key, _check_topic, _payload,
)
from txn_engine.core.schema import CONSUMER_OFFSETS, LEDGER_ENTRIES, LEDGER_STATES_LOG, TXN_LOG
from txn_engine.storage.upkeep import TableUpkeep, UpkeepPolicy
from txn_engine.core.errors import EngineLockedError, EngineStoppedError
from txn_engine.storage.locks import Lease
from txn_engine.storage.warehouse import Warehouse

ENGINE_LOCK = "engine"
GIL_SWITCH_INTERVAL_S = 0.001  # see the module docstring
GC_FIRST_GENERATION_THRESHOLD = 100_000  # see the module docstring (Python's default: 700)
ENGINE_TABLES = (TXN_LOG, LEDGER_ENTRIES, CONSUMER_OFFSETS, LEDGER_STATES_LOG)  # what the engine appends to
ABORT_EXPIRED_INTERVAL_S = 10.0  # see the module docstring (Kafka's default)
MIN_EXPIRY_CHECK_S = 0.01  # the timer never looks more often, however short a timeout

log = logging.getLogger(__name__)


class InterpreterTuning:
    """The interpreter settings an engine runs with (module docstring), process-wide: set when the
    first engine of the process starts, restored when the last one closes."""

    _lock = threading.Lock()
    _engines = 0
    _saved: tuple[float, tuple[int, ...]] | None = None

    @classmethod
    def engine_started(cls) -> None:
        with cls._lock:
            if cls._engines == 0:
                cls._saved = (sys.getswitchinterval(), gc.get_threshold())
                interval, thresholds = cls._saved
                sys.setswitchinterval(min(interval, GIL_SWITCH_INTERVAL_S))
                gc.set_threshold(max(thresholds[0], GC_FIRST_GENERATION_THRESHOLD), *thresholds[1:])
            cls._engines += 1

    @classmethod
    def engine_closed(cls) -> None:
        with cls._lock:
            cls._engines -= 1
            if cls._engines == 0 and cls._saved is not None:
                interval, thresholds = cls._saved
                sys.setswitchinterval(interval)
                gc.set_threshold(*thresholds)


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


class EngineLock:
    """The warehouse's exclusive engine lock: an flock (released when the holder exits, even
    killed), or a lease in the store (expiring a lease after a killed holder's last renewal)."""

    def __init__(self, warehouse: Warehouse):
        settings = warehouse.settings
        self._lease: Lease | None = None
        self._fd = -1
        if settings.locks_in_store():
            self._lease = Lease(settings, settings.lock_path(ENGINE_LOCK))
            holder = self._lease.try_acquire()
            if holder is not None:
                raise EngineLockedError(
                    f"another transaction engine is running on this warehouse ({holder}; lease "
                    f"{self._lease.uri}, renewed every {self._lease.ttl_s / 3:.0f}s while it runs). One engine writes a "
                    "warehouse at a time: send through that engine, or stop it and retry.")
            return
        self.path = Path(settings.lock_path(ENGINE_LOCK))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self.path.read_text().strip() or "unknown"
            os.close(self._fd)
            raise EngineLockedError(
                f"another transaction engine is running on this warehouse ({holder}; lock {self.path}). "
                "One engine writes a warehouse at a time: send through that engine, or stop it and retry."
            ) from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"pid {os.getpid()} on {socket.gethostname()} since {utc_now():%Y-%m-%d %H:%M:%S} UTC".encode())

    def release(self) -> None:
        if self._lease is not None:
            lease, self._lease = self._lease, None
            lease.release()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class TimeoutTimer:
    """The thread that aborts the engine's expired transactions (module docstring)."""

    def __init__(self, coordinator: TransactionCoordinator, writer: LedgerWriter, interval_s: float):
        self.coordinator = coordinator
        self.writer = writer
        self.interval_s = interval_s
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="txnlake-timeouts", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self.coordinator.expiry_wakeup.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        coordinator = self.coordinator
        while not self._stopping:
            wait = max(MIN_EXPIRY_CHECK_S, coordinator.expiry_check_interval(self.interval_s))
            if coordinator.expiry_wakeup.wait(wait):
                coordinator.expiry_wakeup.clear()
                continue  # closing, or a producer with a shorter timeout: wait again from now
            if self.writer.stopped is not None:
                return  # a failed write stopped the engine; the next one recovers and aborts
            try:
                aborted = coordinator.abort_expired()
            except EngineStoppedError:
                return
            except Exception:  # noqa: BLE001 - the next round tries again; the engine keeps serving
                log.exception("aborting expired transactions failed")
                continue
            if aborted:
                log.info("aborted %d transaction(s) open past their timeout: %s",
                         len(aborted), ", ".join(map(str, aborted)))


class Engine:
    """The facade: coordinator, ledger writer, producer states, consumers. Use as a context manager."""

    def __init__(
        self,
        warehouse: Warehouse,
        *,
        txn_groups: int = 1,
        rollover: RolloverPolicy | None = None,
        clock: Callable[[], datetime] = utc_now,
        crash_hook: Callable[[str], None] | None = None,
        max_rows_per_commit: int = 100_000,
        upkeep: UpkeepPolicy | None = None,
        abort_expired_interval: timedelta | float = ABORT_EXPIRED_INTERVAL_S,
    ):
        interval = abort_expired_interval
        interval_s = interval.total_seconds() if isinstance(interval, timedelta) else float(interval)
        if not interval_s > 0:
            raise ValueError(f"abort_expired_interval must be positive (seconds), got {abort_expired_interval!r}")
        self.warehouse = warehouse
        self.clock = clock
        self._lock = EngineLock(warehouse)
        try:
            self.tables = DeltaTables(warehouse)
            self.upkeep = TableUpkeep(self.tables, upkeep or UpkeepPolicy(), ENGINE_TABLES, crash_hook)
            self.upkeep.start()
            self.writer = LedgerWriter(
                self.tables, clock, rollover or RolloverPolicy(), max_rows_per_commit, crash_hook, self.upkeep
            )
            self.coordinator = TransactionCoordinator(self.tables, self.writer, clock, txn_groups)
            self.sequences = ProducerStateManager(self.tables)
            self.services = ProducerServices(self.coordinator, self.writer, self.sequences)
            self.recovered: list[TxnId] = self.coordinator.recover()
            self.writer.start()
            self.timeouts = TimeoutTimer(self.coordinator, self.writer, interval_s)
            self.timeouts.start()
        except BaseException:
            self._lock.release()
            raise
        self._closed = False
        InterpreterTuning.engine_started()

    # -- producers ---------------------------------------------------------------------------

    def producer(self, transactional_id: str, transaction_timeout: timedelta | float = 60.0) -> TransactionalProducer:
        """A transactional producer; call its init_transactions() before anything else."""
        return TransactionalProducer(self.services, transactional_id, transaction_timeout)

    def idempotent_producer(self) -> IdempotentProducer:
        """A non-transactional producer with sequence numbers (a fresh producer id)."""
        return IdempotentProducer(self.services, self.coordinator.register_idempotent_producer())

    def send(self, topic: str, value: bytes | str, key: str | None = None) -> SendFuture:
        """A plain non-transactional, non-idempotent send."""
        _check_topic(topic)
        _check_key(key)
        entries = PendingEntries(EntryType.DATA.value)
        entries.add(topic, key=key, payload=_payload(value))
        return SendFuture(self.writer.submit(WriteRequest(entries=entries)))

    # -- coordinator -------------------------------------------------------------------------

    def abort_expired(self, now: datetime | None = None) -> list[TxnId]:
        """Abort every transaction open past its timeout now; returns their ids (the engine's timer
        calls it too, see the module docstring)."""
        return self.coordinator.abort_expired(now)

    # -- reading -----------------------------------------------------------------------------

    def consumer(self, topic: str, start: Position = EARLIEST) -> Consumer:
        return Consumer(self.tables, topic, start)

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting writes, finish the queued ones, release the warehouse."""
        if self._closed:
            return
        self._closed = True
        self.timeouts.stop()  # first: an abort it is making still gets written
        self.writer.stop()
        self._lock.release()
        InterpreterTuning.engine_closed()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
