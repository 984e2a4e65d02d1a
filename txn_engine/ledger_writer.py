"""The ledger writer: positions, ledger rollover and group commit into Delta.

One committer thread drains everything producers and the coordinator queued since its last
round and writes it in a fixed order of Delta commits, each holding that table's writer lock:

1. `txn_log`: records that must be durable before any entry of this round (ONGOING with a new
   topic, PREPARE_COMMIT / PREPARE_ABORT);
2. `ledger_entries`: data and markers, in queue order, each given the next position of its
   topic (in chunks of at most `max_rows_per_commit`);
3. `consumer_offsets` of committing transactions, then `txn_log` COMPLETE_* records.

So PREPARE is durable before any marker and COMPLETE after every marker, and a round costs a few
Delta commits whatever the number of producers: throughput does not collapse to one commit per
message. A failed write stops the engine (every waiting caller gets the error); restarting it
runs recovery from what is durable.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Callable

import pyarrow as pa

from txn_engine.delta_io import DeltaTables, arrow_schema
from txn_engine.positions import Position
from txn_engine.schema import (
    CONSUMER_OFFSETS,
    CONSUMER_OFFSETS_SCHEMA,
    LEDGER_ENTRIES,
    LEDGER_ENTRIES_SCHEMA,
    LEDGER_STATES_LOG,
    LEDGER_STATES_SCHEMA,
    TXN_LOG,
    TXN_LOG_SCHEMA,
)
from txn_engine.txn_errors import EngineStoppedError

log = logging.getLogger(__name__)

# Named points between the steps of a round, where tests inject crashes.
AFTER_PREPARE = "after_prepare"  # txn_log (PREPARE) durable, no entry of the round written yet
AFTER_ENTRIES_CHUNK = "after_entries_chunk"  # one ledger_entries commit of the round durable
BEFORE_COMPLETE = "before_complete"  # every entry durable, COMPLETE not yet written

_ENTRY_SCHEMA = arrow_schema(LEDGER_ENTRIES_SCHEMA)


@dataclass(frozen=True)
class RolloverPolicy:
    """When a topic's open ledger is closed and a new one opened (whichever comes first)."""

    max_entries: int = 50_000
    max_bytes: int = 64 * 1024 * 1024
    max_age: timedelta = timedelta(hours=1)

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.max_bytes < 1 or self.max_age <= timedelta(0):
            raise ValueError(
                f"rollover limits must be positive, got max_entries={self.max_entries}, "
                f"max_bytes={self.max_bytes}, max_age={self.max_age}"
            )


@dataclass
class PendingEntry:
    """An entry waiting for its position: a row of ledger_entries without ledger_id/entry_id.

    (Not a `LogEntry`: that one is a stored row and requires its position.)"""

    topic: str
    entry_type: str
    txn_most_bits: int | None = None
    txn_least_bits: int | None = None
    producer_id: int | None = None
    producer_epoch: int | None = None
    sequence_id: int | None = None
    key: str | None = None
    payload: bytes | None = None

    @property
    def size_bytes(self) -> int:  # as txn_engine.ledgers.entry_size_bytes counts them
        return len(self.payload or b"") + len((self.key or "").encode())


@dataclass(eq=False)
class WriteRequest:
    """One caller's share of a round; `future` resolves to the positions of `entries`."""

    before: list[dict[str, Any]] = field(default_factory=list)  # txn_log rows, durable before entries
    entries: list[PendingEntry] = field(default_factory=list)
    offsets: list[dict[str, Any]] = field(default_factory=list)  # consumer_offsets rows
    after: list[dict[str, Any]] = field(default_factory=list)  # txn_log rows, durable after entries
    on_durable: Callable[[list[Position]], None] | None = None  # runs in the committer, before the future
    depends_on: list[Future] = field(default_factory=list)  # written in a round after these are durable
    future: Future = field(default_factory=Future)

    def ready(self) -> bool:
        return all(f.done() for f in self.depends_on)


@dataclass
class OpenLedger:
    ledger_id: int
    opened_at: datetime
    next_entry_id: int = 0
    size_bytes: int = 0


class LedgerWriter:
    """Assigns positions and group-commits queued writes; see the module docstring."""

    def __init__(
        self,
        tables: DeltaTables,
        clock: Callable[[], datetime],
        rollover: RolloverPolicy,
        max_rows_per_commit: int = 100_000,
        crash_hook: Callable[[str], None] | None = None,
    ):
        self.tables = tables
        self.clock = clock
        self.rollover = rollover
        self.max_rows_per_commit = max_rows_per_commit
        self.crash_hook = crash_hook or (lambda point: None)
        self._open: dict[str, OpenLedger] = {}
        self._last_ledger_id = tables.column_max(LEDGER_ENTRIES, "ledger_id") or 0
        self._queue: deque[WriteRequest] = deque()
        self._cond = threading.Condition()
        self._stopped: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self.rounds = 0

    # -- callers ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="txnlake-committer", daemon=True)
        self._thread.start()

    def check_running(self) -> None:
        if self._stopped is not None or self._closing:
            raise EngineStoppedError(
                f"the engine stopped ({self._stopped or 'closed'}); nothing was written. Start a new engine "
                "on this warehouse (it recovers every prepared transaction) and a new producer on it."
            )

    def submit(self, request: WriteRequest) -> Future:
        with self._cond:
            self.check_running()
            self._queue.append(request)
            self._cond.notify()
        return request.future

    def write_now(self, request: WriteRequest) -> list[Position]:
        """Write one request synchronously in the caller's thread (recovery, before the committer runs)."""
        self._write_round([request])
        return request.future.result()

    def stop(self) -> None:
        """Refuse new writes, write the queued ones, then end the committer."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def stopped(self) -> BaseException | None:
        return self._stopped

    # -- the committer -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing and self._stopped is None:
                    self._cond.wait()
                if self._stopped is not None or not self._queue:
                    failed = list(self._queue)  # a failure stops at once; a close drains first
                    self._queue.clear()
                    break
                # A commit queued right after its sends waits one round: its data must be durable
                # before its PREPARE (its dependencies are always earlier in the queue, so this
                # round makes them durable).
                batch, waiting = [], deque()
                for request in self._queue:
                    (batch if request.ready() else waiting).append(request)
                self._queue = waiting
            try:
                self._write_round(batch)
            except BaseException as exc:  # noqa: BLE001 - any failure stops the engine, see docstring
                log.error("engine write failed, stopping: %s", exc)
                with self._cond:
                    self._stopped = exc
                    failed = batch + list(self._queue)
                    self._queue.clear()
                break
        error = EngineStoppedError(
            f"the engine stopped before this write was acknowledged ({self._stopped!r}); it may or may "
            "not be durable. Start a new engine on the warehouse (it recovers prepared transactions) "
            "and retry with the same sequence numbers: duplicates are acknowledged, not rewritten."
        )
        for request in failed:
            if not request.future.done():
                request.future.set_exception(error)

    def _write_round(self, batch: list[WriteRequest]) -> None:
        try:
            self.tables.append(TXN_LOG, TXN_LOG_SCHEMA, [r for req in batch for r in req.before])
            if any(req.before for req in batch):
                self.crash_hook(AFTER_PREPARE)
            positions, closed = self._write_entries(batch)
            self.crash_hook(BEFORE_COMPLETE)
            self.tables.append(CONSUMER_OFFSETS, CONSUMER_OFFSETS_SCHEMA, [r for req in batch for r in req.offsets])
            self.tables.append(TXN_LOG, TXN_LOG_SCHEMA, [r for req in batch for r in req.after])
        except BaseException as exc:
            with self._cond:
                self._stopped = exc  # before anyone hears of the failure: no write is accepted after it
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(exc)
            raise
        self.rounds += 1
        for request, assigned in zip(batch, positions):
            if request.on_durable is not None:
                request.on_durable(assigned)
            request.future.set_result(assigned)
        if closed:
            # Through delta-rs like the rest of the engine's writes (no Spark needed, milliseconds),
            # into the ledger_states log that txn_engine.ledgers.record_ledger_states also appends to.
            # Best effort: the catalog derives CLOSED for every ledger but a topic's last one anyway.
            now = self.clock()
            rows = [{"topic": t, "ledger_id": l, "state": s, "reason": r, "recorded_at": now} for t, l, s, r in closed]
            try:
                self.tables.append(LEDGER_STATES_LOG, LEDGER_STATES_SCHEMA, rows)
            except Exception as exc:  # noqa: BLE001
                log.warning("could not record closed ledgers %s: %s", closed, exc)

    def _write_entries(self, batch: list[WriteRequest]) -> tuple[list[list[Position]], list]:
        now = self.clock()
        columns: dict[str, list] = {name: [] for name in _ENTRY_SCHEMA.names}
        positions: list[list[Position]] = []
        closed: list[tuple[str, int, str, str]] = []
        for request in batch:
            assigned = []
            for entry in request.entries:
                position = self._next_position(entry, now, closed)
                assigned.append(position)
                for name, value in (
                    ("topic", entry.topic),
                    ("ledger_id", position.ledger_id),
                    ("entry_id", position.entry_id),
                    ("entry_type", entry.entry_type),
                    ("txn_most_bits", entry.txn_most_bits),
                    ("txn_least_bits", entry.txn_least_bits),
                    ("producer_id", entry.producer_id),
                    ("producer_epoch", entry.producer_epoch),
                    ("sequence_id", entry.sequence_id),
                    ("publish_time", now),
                    ("key", entry.key),
                    ("payload", entry.payload),
                ):
                    columns[name].append(value)
            positions.append(assigned)
        table = pa.Table.from_pydict(columns, schema=_ENTRY_SCHEMA)
        for start in range(0, table.num_rows, self.max_rows_per_commit):
            self.tables.append(LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA, table.slice(start, self.max_rows_per_commit))
            self.crash_hook(AFTER_ENTRIES_CHUNK)
        return positions, closed

    def _next_position(self, entry: PendingEntry, now: datetime, closed: list) -> Position:
        ledger = self._open.get(entry.topic)
        if ledger is not None:
            reason = self._rollover_reason(ledger, now)
            if reason:
                closed.append((entry.topic, ledger.ledger_id, "CLOSED", f"rollover: {reason}"))
                ledger = None
        if ledger is None:
            ledger = OpenLedger(self._allocate_ledger_id(), now)
            self._open[entry.topic] = ledger
        position = Position(ledger.ledger_id, ledger.next_entry_id)
        ledger.next_entry_id += 1
        ledger.size_bytes += entry.size_bytes
        return position

    def _rollover_reason(self, ledger: OpenLedger, now: datetime) -> str | None:
        policy = self.rollover
        if ledger.next_entry_id >= policy.max_entries:
            return f"{ledger.next_entry_id} entries (max {policy.max_entries})"
        if ledger.size_bytes >= policy.max_bytes:
            return f"{ledger.size_bytes} bytes (max {policy.max_bytes})"
        if now - ledger.opened_at >= policy.max_age:
            return f"open for {now - ledger.opened_at} (max {policy.max_age})"
        return None

    def _allocate_ledger_id(self) -> int:
        # BookKeeper-style ids, unique across topics: above every ledger already stored,
        # ingested ones included (read from Delta's file statistics, no data scan).
        stored = self.tables.column_max(LEDGER_ENTRIES, "ledger_id") or 0
        self._last_ledger_id = max(self._last_ledger_id, stored) + 1
        return self._last_ledger_id

    def open_ledgers(self) -> dict[str, Position]:
        """Each topic's open ledger and next entry id (for tests and the CLI)."""
        return {t: Position(l.ledger_id, l.next_entry_id) for t, l in self._open.items()}
