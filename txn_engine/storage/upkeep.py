"""Upkeep of the Delta tables the engine appends to: bounded history, file count and disk.

Each group commit adds a Delta version and a data file to each table it writes, and delta-rs
pays for both on every later append (it lists `_delta_log` with a stat per entry; its snapshot
holds every active file): with Delta's default 30-day history a busy engine's appends slow down
without bound (docs/benchmarks.md, "Engine upkeep"). So the engine keeps both bounded, as a log
broker its segments: a short history (`log_retention`), size-tiered compaction every
`compact_every` commits (delta-rs OPTIMIZE, rows and their order kept), and after each compaction
a VACUUM of files replaced longer ago than `file_retention`; a table's own settings win. The rules
and their reasons: docs/engine.md, "Upkeep of its tables".

Upkeep runs in the committer between rounds, under the table's writer lock. It is maintenance: a
failure is logged and retried at the next due point, never stops the engine or loses an
acknowledged write (each step is one atomic Delta commit).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Sequence

from txn_engine.storage.delta_io import DeltaTables

log = logging.getLogger(__name__)

LOG_RETENTION_PROPERTY = "delta.logRetentionDuration"
FILE_RETENTION_PROPERTY = "delta.deletedFileRetentionDuration"
# A file of fewer bytes is always merged: Parquet's per-file overhead (footer, schema: a few KB)
# makes the bytes per row of tiny files no guide to how many rows a file holds.
MIN_TARGET_BYTES = 1024 * 1024
BEFORE_COMPACTION = "before_compaction"  # crash point: a table is due and about to be compacted
BEFORE_VACUUM = "before_vacuum"  # crash point: a compacted table is about to be vacuumed


@dataclass(frozen=True)
class UpkeepPolicy:
    """How the engine keeps its tables cheap to append to (module docstring)."""

    log_retention: timedelta = timedelta(minutes=5)
    file_retention: timedelta = timedelta(hours=1)  # how long a replaced file stays on disk
    compact_every: int = 100  # a table's commits between two compactions; 0 turns compaction off
    small_file_rows: int = 100_000
    fanout: int = 10
    max_file_rows: int = 1_000_000  # no bigger: a compaction stalls the committer (benchmarks.md, "Engine upkeep")
    max_file_bytes: int = 128 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("log_retention", "file_retention"):
            if getattr(self, name) < timedelta(seconds=1):
                raise ValueError(f"{name} must be at least one second, got {getattr(self, name)}")
        if self.compact_every < 0 or self.small_file_rows < 1 or self.fanout < 2 or self.max_file_bytes < 1:
            raise ValueError(
                f"compaction settings out of range: compact_every={self.compact_every} (>= 0), "
                f"small_file_rows={self.small_file_rows} (>= 1), fanout={self.fanout} (>= 2), "
                f"max_file_bytes={self.max_file_bytes} (>= 1)"
            )
        if self.max_file_rows < self.small_file_rows:
            raise ValueError(f"max_file_rows ({self.max_file_rows}) is below small_file_rows ({self.small_file_rows})")

    def retention_properties(self) -> dict[str, str]:
        """The Delta table properties that bound history and replaced files, in Delta's interval syntax."""
        return {
            LOG_RETENTION_PROPERTY: f"interval {int(self.log_retention.total_seconds())} seconds",
            FILE_RETENTION_PROPERTY: f"interval {int(self.file_retention.total_seconds())} seconds",
        }

    def target_rows(self, compaction: int) -> int:
        """The file size, in rows, of a table's `compaction`-th compaction (1-based): the small
        size, times `fanout` for each power of `fanout` that divides `compaction`."""
        rows = self.small_file_rows
        while compaction % self.fanout == 0 and rows * self.fanout <= self.max_file_rows:
            compaction //= self.fanout
            rows *= self.fanout
        return rows


@dataclass(frozen=True)
class Compaction:
    """One compaction, as reported by the benchmark and the tests."""

    table: str
    target_rows: int
    files_removed: int
    files_added: int
    seconds: float


@dataclass(frozen=True)
class Vacuum:
    """One VACUUM of a table's replaced files, as reported by the benchmark and the tests."""

    table: str
    files_deleted: int
    seconds: float


def vacuum_table(tables: DeltaTables, table: str) -> Vacuum:
    """VACUUM `table` with its own `delta.deletedFileRetentionDuration` (`DeltaTables.vacuum`), timed."""
    started = time.perf_counter()
    deleted = tables.vacuum(table)
    return Vacuum(table, len(deleted), time.perf_counter() - started)


class TableUpkeep:
    """Applies an UpkeepPolicy to the tables an engine appends to."""

    def __init__(self, tables: DeltaTables, policy: UpkeepPolicy, names: Sequence[str],
                 crash_hook: Callable[[str], None] | None = None):
        self.tables = tables
        self.policy = policy
        self.names = tuple(names)
        self.crash_hook = crash_hook or (lambda point: None)
        self._compacted_at: dict[str, int] = {}  # a table's append count at its last compaction
        self._compactions: Counter[str] = Counter()
        self._retention_set: set[str] = set()
        self._vacuum_due: set[str] = set()  # compacted since their last VACUUM
        self.compactions: list[Compaction] = []
        self.vacuums: list[Vacuum] = []
        self.failures = 0

    def start(self) -> None:
        """At engine start, before any write: set the retentions on every existing table that
        has none; compact a table holding more than `compact_every` files (a backlog from an
        engine without upkeep, or one stopped between compactions); VACUUM what earlier runs
        left. A backlog's first compaction rewrites all its small files once; done here it delays
        the start, not acknowledgements. A failure is logged, as in `run_due`: the engine starts."""
        for table in self.names:
            if self.tables.exists(table):
                self._attempt(table, "at start; retried later", lambda: self._start_upkeep(table))

    def _start_upkeep(self, table: str) -> None:
        self._bound_history(table)
        if self.policy.compact_every and self.tables.file_count(table) > self.policy.compact_every:
            self.compact(table)
        self._due_vacuum(table)

    def _attempt(self, table: str, retry: str, step: Callable[[], object]) -> bool:
        """Run one upkeep step; a failure is logged and counted, never raised (module docstring)."""
        try:
            step()
            return True
        except Exception as exc:  # noqa: BLE001 - maintenance: see the module docstring
            self.failures += 1
            log.warning("upkeep of %s failed (the engine goes on; %s): %s", table, retry, exc)
            return False

    def _bound_history(self, table: str) -> None:
        if table in self._retention_set or not self.tables.exists(table):
            return
        own = self.tables.properties(table)
        missing = {k: v for k, v in self.policy.retention_properties().items() if k not in own}
        if missing:
            self.tables.set_properties(table, missing)
            log.info("%s: Delta retention set: %s", table, missing)
        self._retention_set.add(table)

    def run_due(self) -> None:
        """Bound the history of a table the engine created, and compact the first table written
        `compact_every` times since its last compaction (or its last failed upkeep); a second
        due table waits for the next round, so the committer stalls for one compaction at most.
        A gap without a compaction VACUUMs one table compacted since its last VACUUM."""
        every = self.policy.compact_every
        for table in self.names:
            commits = self.tables.append_stats[table][0] if table in self.tables.append_stats else 0
            since = commits - self._compacted_at.get(table, 0)
            due = bool(every) and since >= every
            if not commits or (table in self._retention_set and not due):
                continue
            if table not in self._retention_set and not due and table in self._compacted_at:
                continue  # its history setting failed: retried when compaction is due
            self._compacted_at.setdefault(table, 0)
            if due:
                self._compacted_at[table] = commits
            if not self._attempt(table, f"retried in {every} commits", lambda: self._due_upkeep(table, due)):
                self._compacted_at[table] = commits
            if due:
                return  # one compaction between two rounds: tables written together fall due together
        table = next((t for t in self.names if t in self._vacuum_due), None)
        if table is not None:
            self._vacuum_due.discard(table)
            self._attempt(table, "its VACUUM retried after its next compaction", lambda: self._due_vacuum(table))

    def _due_upkeep(self, table: str, compact: bool) -> None:
        self._bound_history(table)
        if compact:
            self.crash_hook(BEFORE_COMPACTION)
            self.compact(table)

    def _due_vacuum(self, table: str) -> None:
        self.crash_hook(BEFORE_VACUUM)
        self.vacuum(table)

    def vacuum(self, table: str) -> Vacuum:
        """Delete `table`'s files that no version references and that were removed (or written,
        for a file never committed) longer ago than its file retention (module docstring)."""
        done = vacuum_table(self.tables, table)
        self.vacuums.append(done)
        return done

    def compact(self, table: str) -> Compaction:
        """One size-tiered compaction of `table` (module docstring)."""
        self._compactions[table] += 1
        rows = self.policy.target_rows(self._compactions[table])
        started = time.perf_counter()
        bytes_per_row = self.tables.bytes_per_row(table)
        target_bytes = min(self.policy.max_file_bytes, max(MIN_TARGET_BYTES, int(rows * bytes_per_row)))
        metrics = self.tables.compact(table, target_bytes)
        done = Compaction(table, rows, int(metrics.get("numFilesRemoved", 0)), int(metrics.get("numFilesAdded", 0)),
                          time.perf_counter() - started)
        self.compactions.append(done)
        self._vacuum_due.add(table)
        return done
