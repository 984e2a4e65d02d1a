"""The ledger writer: positions, ledger rollover and group commit into Delta.

One committer thread drains everything producers and the coordinator queued since its last
round and writes it in a fixed order of Delta commits, each under that table's writer lock:
`txn_log` (ONGOING with a new topic, PREPARE_*, and the previous round's COMPLETE_*, whose markers
and offsets were durable at the end of that round; at once when nothing else is queued), then
`ledger_entries` (data and markers, each given its topic's next position, in chunks of at most
`max_rows_per_commit`), then `consumer_offsets` of committing transactions. So PREPARE is durable
before any marker and COMPLETE after every marker, and a round costs two Delta commits whatever
the number of producers. A failed write stops the engine (every waiting caller gets
EngineStoppedError, the failure as its cause); restarting it runs recovery from what is durable
(docs/engine.md, "Commit protocol").
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from txn_engine.storage.arrow_frames import arrow_schema
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.core.positions import Position
from txn_engine.core.schema import (
    CONSUMER_OFFSETS,
    CONSUMER_OFFSETS_SCHEMA,
    LEDGER_ENTRIES,
    LEDGER_ENTRIES_SCHEMA,
    LEDGER_STATES_LOG,
    LEDGER_STATES_SCHEMA,
    TXN_LOG,
    TXN_LOG_SCHEMA,
)
from txn_engine.storage.upkeep import TableUpkeep
from txn_engine.core.errors import EngineStoppedError

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


class PendingEntries:
    """Entries waiting for their positions, column by column: rows of ledger_entries without
    ledger_id/entry_id. One batch shares its entry type, transaction, producer and epoch (a
    producer's batch belongs to one transaction; markers to one outcome of one transaction).

    Columns rather than an object per entry: the committer turns a round's batches into Arrow
    arrays with a few C calls (building rows entry by entry was a fifth of the committer)."""

    __slots__ = ("entry_type", "txn_most_bits", "txn_least_bits", "producer_id", "producer_epoch",
                 "topics", "sequences", "keys", "payloads")

    def __init__(self, entry_type: str, txn_most_bits: int | None = None, txn_least_bits: int | None = None,
                 producer_id: int | None = None, producer_epoch: int | None = None):
        self.entry_type = entry_type
        self.txn_most_bits = txn_most_bits
        self.txn_least_bits = txn_least_bits
        self.producer_id = producer_id
        self.producer_epoch = producer_epoch
        self.topics: list[str] = []
        self.sequences: list[int | None] = []
        self.keys: list[str | None] = []
        self.payloads: list[bytes | None] = []

    def add(self, topic: str, sequence: int | None = None, key: str | None = None, payload: bytes | None = None) -> int:
        """Append one entry; returns its index in the batch (and in the batch's positions)."""
        self.topics.append(topic)
        self.sequences.append(sequence)
        self.keys.append(key)
        self.payloads.append(payload)
        return len(self.topics) - 1

    def __len__(self) -> int:
        return len(self.topics)


class Positions(Sequence):
    """The positions a round assigned to one request's entries, in entry order (a view of the
    round's position arrays: a Position object is made only for the entries someone asks about)."""

    __slots__ = ("_ledger_ids", "_entry_ids", "_start", "_len")

    def __init__(self, ledger_ids: np.ndarray, entry_ids: np.ndarray, start: int, length: int):
        self._ledger_ids, self._entry_ids, self._start, self._len = ledger_ids, entry_ids, start, length

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._len))]
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"position index {index} out of range ({self._len} entries)")
        at = self._start + index
        return Position(int(self._ledger_ids[at]), int(self._entry_ids[at]))

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))


NO_POSITIONS = Positions(np.empty(0, np.int64), np.empty(0, np.int64), 0, 0)


@dataclass(eq=False)
class WriteRequest:
    """One caller's share of a round; `future` resolves to the positions of `entries`."""

    before: list[dict[str, Any]] = field(default_factory=list)  # txn_log rows, durable before entries
    entries: PendingEntries | None = None
    offsets: list[dict[str, Any]] = field(default_factory=list)  # consumer_offsets rows
    after: list[dict[str, Any]] = field(default_factory=list)  # txn_log rows, durable after entries
    on_durable: Callable[[Positions], None] | None = None  # runs in the committer, before the future
    depends_on: list["WriteRequest"] = field(default_factory=list)  # written in a round after these are settled
    future: Future = field(default_factory=Future)
    # Set by the committer when `future` gets its result or exception: read without the future's
    # lock by `ready`, which runs for every queued request each round under the queue's lock.
    settled: bool = False

    def ready(self) -> bool:
        for request in self.depends_on:
            if not request.settled:
                return False
        self.depends_on = []  # once ready, never checked again
        return True

    def resolve(self, positions: "Positions") -> None:
        if self.on_durable is not None:
            self.on_durable(positions)
        self.settled = True
        self.future.set_result(positions)

    def fail(self, error: BaseException) -> None:
        self.settled = True
        if not self.future.done():
            self.future.set_exception(error)


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
        upkeep: TableUpkeep | None = None,
    ):
        self.tables = tables
        self.upkeep = upkeep
        self.clock = clock
        self.rollover = rollover
        self.max_rows_per_commit = max_rows_per_commit
        self.crash_hook = crash_hook or (lambda point: None)
        self._open: dict[str, OpenLedger] = {}
        self._last_ledger_id = tables.column_max(LEDGER_ENTRIES, "ledger_id") or 0
        self._queue: deque[WriteRequest] = deque()
        # Requests whose entries and offsets are durable and whose txn_log `after` rows go in the
        # next round's first commit, with the positions they were given.
        self._carried: list[tuple[WriteRequest, Positions]] = []
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

    def write_now(self, request: WriteRequest) -> Positions:
        """Write one request synchronously in the caller's thread (recovery, before the committer runs)."""
        self._write_round([request])
        while self._carried:
            self._write_round([])
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
                while not self._queue and not self._carried and not self._closing and self._stopped is None:
                    self._cond.wait()
                if self._stopped is not None or not (self._queue or self._carried):
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
                if self.upkeep is not None:
                    self.upkeep.run_due()  # between rounds: it holds a table's writer lock like a round
            except BaseException as exc:  # noqa: BLE001 - any failure stops the engine, see docstring
                log.error("engine write failed, stopping: %s", exc)
                with self._cond:
                    self._stopped = exc
                    failed = batch + list(self._queue)
                    self._queue.clear()
                break
        error = self._stopped_error()
        for request in failed:
            request.fail(error)

    def _stopped_error(self) -> EngineStoppedError:
        """What every caller whose write was not acknowledged gets once the engine stopped."""
        error = EngineStoppedError(
            f"the engine stopped before this write was acknowledged ({self._stopped!r}); it may or may "
            "not be durable. Start a new engine on the warehouse: it finishes every prepared transaction (a "
            "prepared commit commits) and leaves the others open until their producer's init_transactions() "
            "or their timeout aborts them. Then look the transaction up (`txnlake txn describe ID`): if it "
            "committed, its sends are readable, send nothing again; if it was aborted, begin() a new "
            "transaction and send its messages under new sequence numbers (omit `sequence`), since a "
            "sequence number already written is never reused. A non-transactional send retried with "
            "its sequence number is acknowledged once."
        )
        error.__cause__ = self._stopped
        return error

    def _write_round(self, batch: list[WriteRequest]) -> None:
        carried, self._carried = self._carried, []
        # Nothing in ledger_entries or consumer_offsets: all its txn_log rows go in the first commit.
        early = [r for r in batch if not (r.entries or r.offsets)]
        later = [r for r in batch if r.entries or r.offsets]
        try:
            rows = [row for request, _ in carried for row in request.after]
            for request in batch:
                rows.extend(request.before)
            for request in early:
                rows.extend(request.after)
            self.tables.append(TXN_LOG, TXN_LOG_SCHEMA, rows)
            if any(request.before for request in batch):
                self.crash_hook(AFTER_PREPARE)
            for request, assigned in carried:
                request.resolve(assigned)
            for request in early:
                request.resolve(NO_POSITIONS)
            positions, closed = self._write_entries(later)
            if later:
                self.crash_hook(BEFORE_COMPLETE)
            self.tables.append(CONSUMER_OFFSETS, CONSUMER_OFFSETS_SCHEMA, [r for req in later for r in req.offsets])
        except BaseException as exc:
            with self._cond:
                self._stopped = exc  # before anyone hears of the failure: no write is accepted after it
            error = self._stopped_error()
            for request in [request for request, _ in carried] + batch:
                request.fail(error)
            raise
        self.rounds += 1
        for request, assigned in zip(later, positions):
            if request.after:
                self._carried.append((request, assigned))  # COMPLETE: first thing of the next round
            else:
                request.resolve(assigned)
        if closed:
            # Through delta-rs like the rest of the engine's writes (no Spark needed, milliseconds),
            # into the ledger_states log that txn_engine.log.ledgers.record_ledger_states also appends to.
            # Best effort: the catalog derives CLOSED for every ledger but a topic's last one anyway.
            now = self.clock()
            rows = [{"topic": t, "ledger_id": l, "state": s, "reason": r, "recorded_at": now} for t, l, s, r in closed]
            try:
                self.tables.append(LEDGER_STATES_LOG, LEDGER_STATES_SCHEMA, rows)
            except Exception as exc:  # noqa: BLE001
                log.warning("could not record closed ledgers %s: %s", closed, exc)

    def _write_entries(self, requests: list[WriteRequest]) -> tuple[list[Positions], list]:
        """Give every entry of `requests` its position and append them, in queue order."""
        counts = [0 if r.entries is None else len(r.entries.topics) for r in requests]
        total = sum(counts)
        if total == 0:
            return [NO_POSITIONS] * len(requests), []
        now = self.clock()
        batches = [r.entries for r, n in zip(requests, counts) if n]
        topics, sequences, keys, payloads = [], [], [], []
        for b in batches:
            topics += b.topics
            sequences += b.sequences
            keys += b.keys
            payloads += b.payloads
        # What a batch shares (type, transaction, producer, epoch): one value per batch, repeated
        # to its entries by one `take` (lists of 4,000 repeated Python values were a fifth of this).
        each_entry = pa.array(np.repeat(np.arange(len(batches)), [n for n in counts if n]))

        def shared(values: list, type_: pa.DataType) -> pa.Array:
            return pa.array(values, type_).take(each_entry)

        topic_array = pa.array(topics, pa.string())
        key_array = pa.array(keys, pa.string())
        payload_array = pa.array(payloads, pa.binary())
        ledger_ids, entry_ids, closed = self._assign_positions(topic_array, key_array, payload_array, now)
        table = pa.Table.from_arrays(
            [
                topic_array, pa.array(ledger_ids), pa.array(entry_ids),
                shared([b.entry_type for b in batches], pa.string()),
                shared([b.txn_most_bits for b in batches], pa.int64()),
                shared([b.txn_least_bits for b in batches], pa.int64()),
                shared([b.producer_id for b in batches], pa.int64()),
                shared([b.producer_epoch for b in batches], pa.int32()),
                pa.array(sequences, pa.int64()),
                pa.repeat(pa.scalar(now, _ENTRY_SCHEMA.field("publish_time").type), total), key_array, payload_array,
                # The engine's keys are text and its entries have no headers: key_bytes, headers, timestamp_type.
                *[pa.nulls(total, f.type) for f in _ENTRY_SCHEMA][_ENTRY_SCHEMA.get_field_index("key_bytes"):],
            ],
            schema=_ENTRY_SCHEMA,
        )
        for start in range(0, total, self.max_rows_per_commit):
            self.tables.append(LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA, table.slice(start, self.max_rows_per_commit))
            self.crash_hook(AFTER_ENTRIES_CHUNK)
        positions, offset = [], 0
        for n in counts:
            positions.append(Positions(ledger_ids, entry_ids, offset, n) if n else NO_POSITIONS)
            offset += n
        return positions, closed

    def _assign_positions(self, topics: pa.Array, keys: pa.Array, payloads: pa.Array, now: datetime):
        """Each entry's (ledger_id, entry_id): the next of its topic, in queue order, topic by topic
        (a topic's entries are numbered with one numpy range per ledger they land in)."""
        ledger_ids = np.empty(len(topics), np.int64)
        entry_ids = np.empty(len(topics), np.int64)
        encoded = topics.dictionary_encode()
        codes = encoded.indices.to_numpy(zero_copy_only=False)
        sizes = pc.binary_length(payloads).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        if keys.null_count < len(keys):
            sizes = sizes + pc.binary_length(keys).fill_null(0).to_numpy(zero_copy_only=False)
        closed: list[tuple[str, int, str, str]] = []
        for code, topic in enumerate(encoded.dictionary.to_pylist()):
            where = np.flatnonzero(codes == code)
            topic_sizes = sizes[where]
            done = 0
            while done < len(where):
                ledger = self._ledger_for(topic, now, closed)
                take = self._entries_fitting(ledger, topic_sizes[done:])
                chunk = where[done:done + take]
                ledger_ids[chunk] = ledger.ledger_id
                entry_ids[chunk] = np.arange(ledger.next_entry_id, ledger.next_entry_id + take)
                ledger.next_entry_id += take
                ledger.size_bytes += int(topic_sizes[done:done + take].sum())
                done += take
        return ledger_ids, entry_ids, closed

    def _ledger_for(self, topic: str, now: datetime, closed: list) -> OpenLedger:
        """The topic's open ledger for its next entry: rolled over (and recorded in `closed`) when
        a limit is reached, opened when there is none."""
        ledger = self._open.get(topic)
        if ledger is not None:
            reason = self._rollover_reason(ledger, now)
            if reason:
                closed.append((topic, ledger.ledger_id, "CLOSED", f"rollover: {reason}"))
                ledger = None
        if ledger is None:
            ledger = OpenLedger(self._allocate_ledger_id(), now)
            self._open[topic] = ledger
        return ledger

    def _entries_fitting(self, ledger: OpenLedger, sizes: np.ndarray) -> int:
        """How many of the next entries (their `sizes`) `ledger` takes before a rollover check fires:
        the same checks as entry by entry. The first fits (`_ledger_for` just checked it); entry
        j > 0 fits while the entry count and the bytes before it are below the limits. The age
        check cannot fire within a round: `now` is the round's."""
        room = min(self.rollover.max_entries - ledger.next_entry_id, len(sizes))
        bytes_before = ledger.size_bytes + np.cumsum(sizes[: room - 1])
        return 1 + int(np.searchsorted(bytes_before, self.rollover.max_bytes, side="left"))

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
