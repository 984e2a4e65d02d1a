"""Retention: delete old ledgers from the hot tables, by default only once they are offloaded.

A policy (age, size, keep-N-ledgers) picks, per topic, a prefix of the oldest ledgers, stopping
at the first one it keeps or that may not go (OPEN, not offloaded, not yet held by the buffer's
state), so a topic's hot log stays a suffix and its abort set and stable position stay
meaningful. A ledger goes in this order, each step idempotent: its catalog row to
`deleted_ledgers`, DELETED recorded in `ledger_states` (the intent), its rows out of the derived
tables (the abort set trimmed), its rows out of `ledger_entries` last; then the four tables are
VACUUMed. The tier keeps its rows and the buffer's state the ledger's facts, so nothing else the
buffer decided changes (a broker's transaction buffer too only trims its abort set).
Details and reasons: docs/offload.md, "Retention".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Callable, Iterable

from txn_engine.buffer.refresh import buffer_lock, ledgers_behind, stored_ledger_counts
from txn_engine.core.errors import TxnlakeError
from txn_engine.log.ledgers import current_catalog_table, record_ledger_states
from txn_engine.storage.delta_io import DRIVER_WRITE_MAX_BYTES, DeltaTables, delete_ledgers, ledger_predicate
from txn_engine.tier.offload import LedgerKey, offloaded_ledgers
from txn_engine.storage.upkeep import vacuum_table
from txn_engine.core.schema import (
    ABORTED_TXNS,
    COMMITTED_ENTRIES,
    DELETED_LEDGERS,
    DELETED_LEDGERS_SCHEMA,
    LEDGER_ENTRIES,
    TXN_MARKERS,
)
from txn_engine.storage.warehouse import Warehouse
from txn_engine.core import units

# Crash-injection points of `apply_retention`, in order.
AFTER_CATALOG, AFTER_STATE, AFTER_DERIVED = "after_catalog", "after_state", "after_derived"


class RetentionPolicyError(TxnlakeError, ValueError):
    """A retention policy that cannot be applied."""


@dataclass(frozen=True)
class RetentionPolicy:
    """Which ledgers to delete, per topic. A ledger goes when any set limit says so."""

    max_age: timedelta | None = None  # its last entry was published longer ago than this
    max_bytes: int | None = None  # the topic's hot ledgers hold more bytes than this (oldest go first)
    keep_ledgers: int | None = None  # the topic has more than this many ledgers (oldest go first)
    require_offloaded: bool = True  # only ledgers the tier already holds
    # Only ledgers the transaction buffer's state holds at the catalog's counts: their facts (late
    # data, retried sends, transactions still open) outlive their rows only there (module doc).
    require_buffered: bool = True

    def __post_init__(self) -> None:
        if self.max_age is None and self.max_bytes is None and self.keep_ledgers is None:
            raise RetentionPolicyError("a retention policy needs a limit: set max_age, max_bytes or keep_ledgers")
        for name in ("max_bytes", "keep_ledgers"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise RetentionPolicyError(f"{name} must not be negative, got {value}")
        if self.max_age is not None and self.max_age < timedelta(0):
            raise RetentionPolicyError(f"max_age must not be negative, got {self.max_age}")


def ledgers_to_delete(catalog: Iterable[dict], policy: RetentionPolicy, now: datetime, offloaded: set[LedgerKey],
                      buffered: set[LedgerKey] | None = None) -> list[LedgerKey]:
    """The ledgers `policy` deletes, from catalog rows (`ledgers` columns). Pure.

    `buffered`: the ledgers the buffer's state holds (`buffered_ledgers`); None: all of them."""
    by_topic: dict[str, list[dict]] = {}
    for row in catalog:
        if row["state"] != "DELETED":
            by_topic.setdefault(row["topic"], []).append(row)
    chosen: list[LedgerKey] = []
    for topic, rows in sorted(by_topic.items()):
        rows.sort(key=lambda r: r["ledger_id"])
        hot_bytes = sum(r["size_bytes"] for r in rows)
        for n, row in enumerate(rows):
            key = (topic, row["ledger_id"])
            too_many = policy.keep_ledgers is not None and len(rows) - n > policy.keep_ledgers
            too_big = policy.max_bytes is not None and hot_bytes > policy.max_bytes
            last = row["last_publish_time"]
            too_old = policy.max_age is not None and last is not None and _utc(last) < now - policy.max_age
            may_go = row["state"] != "OPEN" and (not policy.require_offloaded or key in offloaded) and (
                not policy.require_buffered or buffered is None or key in buffered)
            if not (too_many or too_big or too_old) or not may_go:
                break  # keep a suffix: never delete past a ledger that stays
            chosen.append(key)
            hot_bytes -= row["size_bytes"]
    return chosen


def _utc(moment: datetime) -> datetime:
    # Catalog rows from Arrow are UTC; a naive time (as PySpark collects them) is read as local.
    return moment.astimezone(timezone.utc)


# The policy's parsers (`--max-age`, `--max-bytes`) live in the kernel: the CLI checks them before importing this.
parse_duration, parse_bytes = units.parse_duration, units.parse_bytes

# Kafka's default `retention.ms` (7 days): the policy when an operator names no limit.
DEFAULT_MAX_AGE = timedelta(hours=168)

@dataclass
class RetentionResult:
    deleted: list[LedgerKey] = field(default_factory=list)  # newly chosen by the policy
    finished: list[LedgerKey] = field(default_factory=list)  # recorded DELETED earlier, entries still there
    # The chosen ledgers' catalog rows before deletion (entries, bytes): what the run frees.
    freed_entries: int = 0
    freed_bytes: int = 0
    dry_run: bool = False
    files_reclaimed: int = 0  # files VACUUM deleted from disk (removed by earlier deletes, past their retention)
    # Ledgers the policy would delete but the buffer's state does not hold yet (kept, with those after them).
    waiting_for_buffer: list[LedgerKey] = field(default_factory=list)


def buffered_ledgers(wh: Warehouse, catalog: Iterable[dict]) -> set[LedgerKey]:
    """The catalog's ledgers the transaction buffer's state holds at their counts (delta-rs reads)."""
    rows = list(catalog)
    now = {(r["topic"], r["ledger_id"]): (int(r["entry_count"]), int(r["last_entry_id"])) for r in rows
           if r["entry_count"] is not None and r["last_entry_id"] is not None}
    return set(now) - set(ledgers_behind(now, stored_ledger_counts(wh)))


def apply_retention(
    warehouse: Warehouse,
    policy: RetentionPolicy,
    now: datetime | None = None,
    crash_hook: Callable[[str], None] | None = None,
    dry_run: bool = False,
    driver_write_max_bytes: int = DRIVER_WRITE_MAX_BYTES,
) -> RetentionResult:
    """Delete what `policy` chooses (and finish interrupted deletions). See the module doc for the steps.

    With `dry_run` nothing is written: the result says what a real run would delete and free. When
    the log's entries (the catalog's `size_bytes`) come to at most `driver_write_max_bytes`, the
    deletes go through delta-rs (`delta_io.delete_ledgers`), else through Spark's DELETE.
    """
    wh = warehouse
    now = now or datetime.now(timezone.utc)
    log = wh.read(LEDGER_ENTRIES)  # a clear error when there is no log yet
    catalog = current_catalog_table(wh, log).to_pylist()
    present = {(r.topic, r.ledger_id) for r in log.select("topic", "ledger_id").distinct().collect()}
    unfinished = sorted((r["topic"], r["ledger_id"]) for r in catalog if r["state"] == "DELETED" and (r["topic"], r["ledger_id"]) in present)
    offloaded = offloaded_ledgers(wh)
    chosen = ledgers_to_delete(catalog, policy, now, offloaded, buffered_ledgers(wh, catalog))
    waiting = sorted(set(ledgers_to_delete(catalog, policy, now, offloaded)) - set(chosen))
    chosen_set = set(chosen)
    chosen_rows = [r for r in catalog if (r["topic"], r["ledger_id"]) in chosen_set]  # their last known catalog rows
    result = RetentionResult(deleted=chosen, finished=unfinished, dry_run=dry_run, waiting_for_buffer=waiting,
                             freed_entries=sum(int(r["entry_count"]) for r in chosen_rows),
                             freed_bytes=sum(int(r["size_bytes"]) for r in chosen_rows))
    if dry_run:
        return result
    if chosen or unfinished:
        hook = crash_hook or (lambda step: None)
        if chosen:
            # A row per deleted ledger, committed by delta-rs, its timestamps in UTC.
            last_known = [
                {**{f.name: _utc(r[f.name]) if isinstance(r[f.name], datetime) else r[f.name] for f in DELETED_LEDGERS_SCHEMA.fields
                    if f.name != "deleted_at"}, "deleted_at": _utc(now)}
                for r in chosen_rows
            ]
            DeltaTables(wh).overwrite(DELETED_LEDGERS, last_known, DELETED_LEDGERS_SCHEMA,
                                      predicate=ledger_predicate(chosen, delta_rs=True))
            hook(AFTER_CATALOG)
            record_ledger_states(wh, [(t, l, "DELETED", "retention") for t, l in chosen])
            hook(AFTER_STATE)
        targets = sorted(chosen_set | set(unfinished))
        # Every table deleted from holds at most the log's entries: its bytes decide who deletes.
        small = sum(int(r["size_bytes"]) for r in catalog if (r["topic"], r["ledger_id"]) in present) <= driver_write_max_bytes
        delete_ledger_rows(wh, targets, small, hook)
    result.files_reclaimed = _reclaim_disk(wh)
    return result


def delete_ledger_rows(wh: Warehouse, ledgers: list[tuple[str, int]], through_driver: bool,
                       hook: Callable[[str], None] = lambda point: None) -> None:
    """Steps 3 and 4 of the module doc: the ledgers' rows leave the derived hot tables, then `ledger_entries`.

    Under the buffer's lock: a buffer run between reading the log and writing its tables would
    otherwise write a deleted ledger's rows back."""
    with buffer_lock(wh):
        delete_ledgers(wh, COMMITTED_ENTRIES, ledgers, through_driver=through_driver)
        delete_ledgers(wh, TXN_MARKERS, ledgers, through_driver=through_driver)
        delete_ledgers(wh, ABORTED_TXNS, ledgers, "abort_ledger_id", through_driver=through_driver)
        hook(AFTER_DERIVED)
        delete_ledgers(wh, LEDGER_ENTRIES, ledgers, through_driver=through_driver)


def _reclaim_disk(wh: Warehouse) -> int:
    """VACUUM the tables retention deletes from (module docstring); returns the files deleted."""
    tables = DeltaTables(wh)
    hot = (COMMITTED_ENTRIES, TXN_MARKERS, ABORTED_TXNS, LEDGER_ENTRIES)
    return sum(vacuum_table(tables, t).files_deleted for t in hot if tables.exists(t))
