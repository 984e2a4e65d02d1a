"""The filtered offload tier: `offloaded_entries` and `offload_manifest` (the offload seed).

A CLOSED ledger whose last entry is at or below its topic's stable position holds only decided
entries, so it can move to the cold tier. Only what a read-committed reader may ever see goes
there: DATA entries that are non-transactional or committed (before their COMMIT marker, each
(producer_id, sequence_id) once), at their original positions. Markers, aborted data, retried
duplicates and late data stay behind, counted by reason in the manifest.

Everything is decided with the buffer's own rules, from one consistent view of the log:
- when the transaction buffer's persisted state (`buffer_ledger_txns`, `buffer_duplicates`, see
  `buffer_incremental`) describes exactly the pinned `ledger_entries` (every ledger's entry
  count and last entry agree, as the buffer's own planner checks), the facts are folded from
  that state: a few narrow tables instead of the whole log (Pulsar's offloader likewise asks
  the topic's transaction buffer, it does not re-read the topic);
- otherwise (no state yet, a ledger the buffer has not processed, a ledger retention removed)
  they are classified from the pinned `ledger_entries` itself (`buffer_jobs.classify_entries`).
Never from the contract tables, which may be half rewritten. Both ways give the same facts
(tested): the state is by definition the per-ledger step of `classify_entries`.

How the work is laid out, and why (writing Parquet costs several times what reading it does):
- one version of `ledger_entries` is read throughout, so the facts, the eligibility, the copy
  and the manifest describe the same rows;
- the facts are narrow (no payload), and so is the catalog that eligibility is decided from;
- the kept rows: when the facts come from the buffer's state and the run that wrote it recorded
  the `committed_entries` version it left (`COMMITTED_ENTRIES_AT`), they are that version's rows
  of the offloaded ledgers. It holds the read-committed rows of exactly the log the state
  describes, and an eligible ledger holds decided entries only, so its rows there are its kept
  rows: a filtered copy with no join. The manifest then takes the kept side (count, bytes,
  checksum) from the tier rows written, read back, and the dropped side from the state's
  per-(ledger, transaction) counts (`drops_from_state`); the kept count must lie within the
  bounds the state gives, else the run stops before the manifest (`OffloadStateError`);
- otherwise the offloaded ledgers' rows are classified against the duplicates and the decided
  transactions, both broadcast (no full row is shuffled), and the kept ones written; the
  manifest is one aggregate over the same classification, recomputed rather than cached
  (re-reading the rows costs less than spilling them).

Per ledger the write is three steps, and the manifest row is the commit point:
1. the kept rows replace the ledger's rows in `offloaded_entries` (Delta replaceWhere: one commit);
2. the ledger's manifest row replaces any earlier one in `offload_manifest`;
3. `ledger_states` records OFFLOADED.
A crash after 1 leaves tier rows without a manifest row ("orphans"): every offload run first
finishes them when the ledger is still eligible (steps 1-3 again: same rows) and otherwise
rolls them back (deletes them). Finding them needs the ledgers of the whole tier, a scan that
grows with it; so the manifest commit of step 2 records the tier version up to which every tier
row has its manifest row (`TIER_CLEAN_AT`), and a run that finds the tier still at that version
knows there are no orphans without reading it. Any other tier commit (a crash after 1, a
rollback, another writer) changes the version, and the next run scans. A crash after 2 leaves a manifest row whose ledger is not yet
recorded OFFLOADED: the next run records it. Readers trust the manifest only, so they never
see a half-written ledger. A ledger that already has its manifest row is not copied again, so
re-runs and backfills leave the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Iterable

from pyspark.sql import Column, DataFrame, Row
from pyspark.sql import functions as F

from txn_engine.buffer_incremental import (
    COMMITTED_ENTRIES_AT,
    LEDGER_COUNT_COLUMNS,
    inventory_of,
    plan_scope,
    state_is_current,
    state_ledger_counts,
)
from txn_engine.buffer_jobs import (
    NARROW_COLUMNS,
    TXN_KEY,
    BufferFacts,
    classify_entries,
    has_txn,
    is_data,
    position_le,
    position_lt,
    stable_from_facts,
    txns_from_ledger_txns,
)
from txn_engine.delta_io import DeltaTables, delete_ledgers, ledger_predicate
from txn_engine.ledgers import entry_size_bytes, ledger_ranges_catalog, record_ledger_states
from txn_engine.positions import Position
from txn_engine.schema import (
    BUFFER_DUPLICATES,
    BUFFER_LEDGER_TXNS,
    COMMITTED_ENTRIES,
    LEDGER_ENTRIES,
    LEDGERS,
    LEDGERS_SCHEMA,
    LEDGER_ENTRY_COLUMNS,
    OFFLOAD_MANIFEST,
    OFFLOAD_MANIFEST_SCHEMA,
    OFFLOADED_ENTRIES,
    POSITION_COLUMNS,
    STABLE_POSITIONS,
)
from txn_engine.errors import TxnlakeError
from txn_engine.step_clock import StepClock
from txn_engine.warehouse import Warehouse

# Where an offload run took the buffer's facts from (OffloadResult.facts_from).
FROM_BUFFER_STATE, FROM_LEDGER_ENTRIES = "buffer_state", "ledger_entries"

# Why an entry stays behind (or KEPT). The manifest has one count column per reason.
KEPT, MARKER, ABORTED, DUPLICATE, OTHER = "KEPT", "MARKER", "ABORTED", "DUPLICATE", "OTHER"
DROP_COLUMNS = {MARKER: "dropped_markers", ABORTED: "dropped_aborted", DUPLICATE: "dropped_duplicates", OTHER: "dropped_other"}

# The steps of an offload run whose seconds OffloadResult.step_seconds reports, in order: the pinned
# catalog; the buffer's facts and the stable positions; eligibility, look-ups and recovery; the
# kept rows' write; the manifest (its counting pass and commit); the ledgers' states.
OFFLOAD_STEPS = ("catalog", "facts", "plan", "write", "manifest", "states")

# Commit metadata of a manifest commit: the `offloaded_entries` version at which every tier row's
# ledger has a manifest row (no orphans), when the run that committed it could tell.
TIER_CLEAN_AT = "txnlake.offload.tier_clean_at_version"

# Crash-injection points of `offload_ledgers`, in order (tests pass a hook that raises).
AFTER_ENTRIES, AFTER_MANIFEST = "after_entries", "after_manifest"

LedgerKey = tuple[str, int]  # (topic, ledger_id)


class OffloadStateError(TxnlakeError):
    """The buffer's tables disagree about a ledger being offloaded; its manifest row was not written."""

# Up to this many decided transactions are broadcast to the offloaded rows (~100 bytes each in
# the hash table: ~1.1 million at 10 million entries); beyond it Spark joins by shuffle.
BROADCAST_TXNS_MAX = 5_000_000


# -- pure DataFrame logic -----------------------------------------------------------------------

def ledger_eligibility(catalog: DataFrame, stable: DataFrame) -> DataFrame:
    """Per catalog ledger: `eligible` and, when not, `waiting_reason`. Pure.

    Eligible: CLOSED, and its last entry at or below its topic's stable position
    (`max_read_ledger_id`, `max_read_entry_id`). OPEN is never eligible; OFFLOADED and DELETED
    ledgers are done.
    """
    at = stable.select("topic", "max_read_ledger_id", "max_read_entry_id")
    below = position_le(F.col("ledger_id"), F.col("last_entry_id"), F.col("max_read_ledger_id"), F.col("max_read_entry_id"))
    reason = (
        F.when(F.col("state") != "CLOSED", F.concat(F.lit("ledger is "), F.col("state")))
        .when(F.col("max_read_ledger_id").isNull(), F.lit("topic has no stable position yet"))
        .when(~below, F.lit("last entry is beyond the stable position (a transaction is still ongoing)"))
    )
    return (
        catalog.join(at, "topic", "left")
        .withColumn("waiting_reason", reason)
        .withColumn("eligible", F.col("waiting_reason").isNull())
    )


def classify_for_offload(entries: DataFrame, txns: DataFrame, duplicates: DataFrame) -> DataFrame:
    """`entries` with a `disposition` column: KEPT or the reason it is dropped. Pure.

    `txns` and `duplicates` are the buffer's facts (`BufferFacts.txns`, `.duplicates`) of the
    whole topic history, so the rules are exactly those of `committed_entries`.
    """
    decided = txns.select(*TXN_KEY, "outcome", F.col("marker_ledger_id").alias("_ml"), F.col("marker_entry_id").alias("_me"))
    flagged = entries.join(F.broadcast(duplicates.withColumn("_dup", F.lit(True))), list(POSITION_COLUMNS), "left")
    joined = flagged.join(decided, list(TXN_KEY), "left")
    before_marker = position_lt(F.col("ledger_id"), F.col("entry_id"), F.col("_ml"), F.col("_me"))
    disposition = (
        F.when(~is_data(), F.lit(MARKER))
        .when(F.col("_dup").isNotNull(), F.lit(DUPLICATE))
        .when(~has_txn(), F.lit(KEPT))
        .when((F.col("outcome") == "COMMIT") & before_marker, F.lit(KEPT))
        .when(F.col("outcome") == "ABORT", F.lit(ABORTED))
        .otherwise(F.lit(OTHER))
    )
    return joined.withColumn("disposition", disposition).drop("_dup", "outcome", "_ml", "_me")


def row_hash() -> Column:
    """A 64-bit hash of a row's ledger_entries columns; `checksum_of` sums them."""
    return F.xxhash64(*LEDGER_ENTRY_COLUMNS)


def checksum_of(hashes: Column) -> Column:
    """The order-independent checksum of the rows whose `row_hash()` values these are (nulls skipped):
    their exact sum, as a decimal string.

    Summed as two longs, the signed high and the unsigned low 32 bits of each hash (exact up to
    2^31 rows a group), then combined once per group: the same value as summing the hashes as
    decimal(38,0), whose per-row BigDecimal arithmetic cost 1-2 s of the manifest pass at 10M rows.
    """
    high = F.coalesce(F.sum(F.shiftright(hashes, 32)), F.lit(0)).cast("decimal(38,0)")
    low = F.coalesce(F.sum(hashes.bitwiseAND(F.lit(0xFFFFFFFF))), F.lit(0)).cast("decimal(38,0)")
    return (high * F.lit(1 << 32).cast("decimal(38,0)") + low).cast("decimal(38,0)").cast("string")


def content_checksum() -> Column:
    """An order-independent checksum of rows with the ledger_entries columns (an aggregate)."""
    return checksum_of(row_hash())


def manifest_counts(classified: DataFrame) -> DataFrame:
    """Per (topic, ledger_id): range, counts (kept and dropped by reason), bytes and the kept rows' checksum. Pure.

    `classified` is `classify_for_offload` output with `_bytes` (`entry_size_bytes()`) and
    `_hash` (`row_hash()`) columns, so no payload is read here.
    """
    kept = F.col("disposition") == KEPT
    return classified.groupBy("topic", "ledger_id").agg(
        F.min("entry_id").alias("first_entry_id"),
        F.max("entry_id").alias("last_entry_id"),
        F.count("*").alias("entries_before"),
        F.count(F.when(kept, 1)).alias("entries_kept"),
        *[F.count(F.when(F.col("disposition") == d, 1)).alias(c) for d, c in DROP_COLUMNS.items()],
        F.sum("_bytes").cast("long").alias("bytes_before"),
        F.coalesce(F.sum(F.when(kept, F.col("_bytes"))), F.lit(0)).cast("long").alias("bytes_after"),
        checksum_of(F.when(kept, F.col("_hash"))).alias("checksum"),
    )


def kept_rows_summary(tier: DataFrame) -> DataFrame:
    """Per (topic, ledger_id) of tier rows: `entries_kept`, `bytes_after` and their `checksum`
    (`content_checksum`, as `manifest_counts` computes them over the classified rows). Pure."""
    return tier.groupBy("topic", "ledger_id").agg(
        F.count("*").alias("entries_kept"),
        F.sum(entry_size_bytes()).cast("long").alias("bytes_after"),
        content_checksum().alias("checksum"),
    )


def drops_from_state(ledger_txns: DataFrame, txns: DataFrame) -> DataFrame:
    """Per (topic, ledger_id), the manifest's counts by reason from the buffer's state instead of
    the ledger's rows: `entries_before`, `dropped_markers`, `dropped_duplicates`, `dropped_aborted`,
    and the bounds `kept_at_least` <= KEPT <= `kept_at_most`. Pure.

    `ledger_txns` are the per-(topic, ledger, transaction) rows of the buffer's state
    (`buffer_jobs.by_ledger_txn`), `txns` the transactions folded from them. They are
    `classify_for_offload`'s rules summed per group: a group's data not retried is
    entry_count - marker_count - duplicate_count, and it is all ABORTED (an aborted transaction),
    all KEPT (no transaction, or a COMMIT whose first marker is in a later ledger, or in this one
    after every entry of the group) or all OTHER (a COMMIT in an earlier ledger). Only a group that
    holds entries after its COMMIT in the same ledger (late data, or a second marker) splits, which
    the bounds leave open: the caller takes KEPT from the tier rows and checks it lies within them.
    """
    t = txns.select(*TXN_KEY, "outcome", F.col("marker_ledger_id").alias("_ml"), F.col("marker_entry_id").alias("_me"))
    groups = ledger_txns.join(t, list(TXN_KEY), "left")
    data = F.col("entry_count") - F.col("marker_count") - F.col("duplicate_count")
    commit = F.col("outcome") == "COMMIT"
    marker_here = commit & (F.col("_ml") == F.col("ledger_id"))
    all_kept = ~has_txn() | (commit & (F.col("_ml") > F.col("ledger_id"))) | (marker_here & (F.col("last_entry_id") <= F.col("_me")))
    split = marker_here & (F.col("last_entry_id") > F.col("_me"))

    def total(column: Column) -> Column:
        return F.coalesce(F.sum(column), F.lit(0)).cast("long")

    return groups.groupBy("topic", "ledger_id").agg(
        total(F.col("entry_count")).alias("entries_before"),
        total(F.col("marker_count")).alias("dropped_markers"),
        total(F.col("duplicate_count")).alias("dropped_duplicates"),
        total(F.when(F.col("outcome") == "ABORT", data)).alias("dropped_aborted"),
        total(F.when(all_kept, data)).alias("kept_at_least"),
        total(F.when(all_kept | split, data)).alias("kept_at_most"),
    )


def _in_ledgers(frame: DataFrame, ledgers: Iterable[LedgerKey]) -> DataFrame:
    return frame.where(ledger_predicate(ledgers))


# -- the offload --------------------------------------------------------------------------------

@dataclass
class OffloadResult:
    """What one offload run did. `manifest` holds the manifest rows written in this run."""

    manifest: list[dict] = field(default_factory=list)
    already_offloaded: list[LedgerKey] = field(default_factory=list)
    waiting: dict[LedgerKey, str] = field(default_factory=dict)
    finished_orphans: list[LedgerKey] = field(default_factory=list)
    rolled_back_orphans: list[LedgerKey] = field(default_factory=list)
    states_recorded: list[LedgerKey] = field(default_factory=list)
    facts_from: str = FROM_LEDGER_ENTRIES
    # Where the kept rows were copied from: COMMITTED_ENTRIES (the buffer's, at the version its state
    # records; the manifest then counts from that state and the rows written) or FROM_LEDGER_ENTRIES
    # (each row of the offloaded ledgers classified).
    kept_from: str = FROM_LEDGER_ENTRIES
    # Whether the orphan check read the tier's ledgers (False: no tier yet, or the tier is still at
    # the version the last manifest commit recorded as clean).
    tier_scanned: bool = False
    # Where the run's time went, in seconds per step (OFFLOAD_STEPS, those the run reached).
    step_seconds: dict[str, float] = field(default_factory=dict)

    def time_spent(self) -> str:
        """The step seconds on one line, e.g. "catalog 2.3 s, facts 1.9 s, ...", total first."""
        steps = ", ".join(f"{step} {seconds:.1f} s" for step, seconds in self.step_seconds.items())
        return f"{sum(self.step_seconds.values()):.1f} s ({steps})"

    @property
    def offloaded(self) -> list[LedgerKey]:
        return [(r["topic"], r["ledger_id"]) for r in self.manifest]

    def savings(self) -> dict[str, int]:
        """Totals over this run's manifest rows: entries and bytes before and after, dropped by reason."""
        keys = ["entries_before", "entries_kept", *DROP_COLUMNS.values(), "bytes_before", "bytes_after"]
        totals = {k: sum(int(r[k]) for r in self.manifest) for k in keys}
        totals["bytes_saved"] = totals["bytes_before"] - totals["bytes_after"]
        totals["entries_dropped"] = totals["entries_before"] - totals["entries_kept"]
        return totals


def offload_ledgers(
    warehouse: Warehouse,
    ledger_ids: Iterable[int] | None = None,
    crash_hook: Callable[[str], None] | None = None,
) -> OffloadResult:
    """Offload the eligible ledgers among `ledger_ids` (all ledgers when None), recovering first.

    `crash_hook(step)` is called after each write step (AFTER_ENTRIES, AFTER_MANIFEST); tests
    make it raise to simulate a crash there.
    """
    wh = warehouse
    lap = StepClock()
    wanted = None if ledger_ids is None else {int(i) for i in ledger_ids}
    # One version of the log for the whole run: every job of it reads the same rows.
    log_version = wh.version(LEDGER_ENTRIES)
    if log_version is None:
        raise wh.missing(LEDGER_ENTRIES)
    entries = _pinned(wh, LEDGER_ENTRIES, log_version)
    # The catalog of the same version, with only what eligibility and the state check need: the
    # ledgers' ranges (`ledger_ranges`: delta-rs and Arrow, no Spark scan) and their states.
    # Collected once (a row per ledger) and used as a small local frame by both steps below.
    catalog_rows = ledger_ranges_catalog(wh, log_version).select(
        "topic", "ledger_id", "state", "entry_count", "first_entry_id", "last_entry_id"
    ).collect()
    catalog_now = wh.spark.createDataFrame(
        catalog_rows, "topic string, ledger_id long, state string, entry_count long, first_entry_id long, last_entry_id long"
    )
    lap("catalog")
    facts, facts_from, committed = _buffer_facts(wh, entries, catalog_now)
    stable = stable_from_facts(facts).cache()
    try:
        stable_at = {r["topic"]: Position(r["max_read_ledger_id"], r["max_read_entry_id"]) for r in stable.collect()}
        lap("facts")
        catalog = ledger_eligibility(catalog_now, stable).select("topic", "ledger_id", "state", "eligible", "waiting_reason").collect()
        result = OffloadResult(facts_from=facts_from, kept_from=FROM_LEDGER_ENTRIES if committed is None else COMMITTED_ENTRIES,
                               step_seconds=lap.seconds)  # later laps land there too
        manifest_commit = DeltaTables(wh).last_commit(OFFLOAD_MANIFEST)
        in_manifest = _ledgers_of(wh, OFFLOAD_MANIFEST, manifest_commit and manifest_commit["version"])
        tier_version = wh.version(OFFLOADED_ENTRIES)
        clean_at = (manifest_commit or {}).get(TIER_CLEAN_AT)
        result.tier_scanned = tier_version is not None and str(tier_version) != clean_at
        orphans = (_ledgers_of(wh, OFFLOADED_ENTRIES, tier_version) if result.tier_scanned else set()) - in_manifest
        eligible = {(r["topic"], r["ledger_id"]) for r in catalog if r["eligible"]}

        targets: set[LedgerKey] = set()
        for row in catalog:
            key = (row["topic"], row["ledger_id"])
            if key in in_manifest:
                if row["state"] not in ("OFFLOADED", "DELETED"):
                    result.states_recorded.append(key)  # crashed after the manifest: finish
                if wanted is None or key[1] in wanted:
                    result.already_offloaded.append(key)
            elif key in orphans and key in eligible:
                targets.add(key)
                result.finished_orphans.append(key)
            elif wanted is None or key[1] in wanted:
                if key in eligible:
                    targets.add(key)
                else:
                    result.waiting[key] = row["waiting_reason"]
        result.rolled_back_orphans = sorted(orphans - targets)
        if result.rolled_back_orphans:
            delete_ledgers(wh, OFFLOADED_ENTRIES, result.rolled_back_orphans)
        if result.states_recorded:
            record_ledger_states(wh, [(t, l, "OFFLOADED", "offload finished after a crash") for t, l in result.states_recorded])
        lap("plan")
        if targets:
            # The tier version with no orphans once this run's manifest commit lands, if this run's
            # write is the only tier commit after the one checked (-1: there was no tier).
            clean_before = None if result.rolled_back_orphans else (-1 if tier_version is None else tier_version)
            ranges = {(r["topic"], r["ledger_id"]): r for r in catalog_rows}
            copy = _Copy(wh, entries, facts, committed, sorted(targets), ranges)
            result.manifest = _copy_ledgers(copy, stable_at, crash_hook, lap, clean_before)
        return result
    finally:
        for frame in [*facts.cached_frames(), stable]:
            frame.unpersist()


def _buffer_facts(wh: Warehouse, entries: DataFrame, catalog: DataFrame) -> tuple[BufferFacts, str, DataFrame | None]:
    """The buffer's facts of the pinned log (`catalog` is its ledger catalog): folded from the
    buffer's state when it describes exactly these ledgers, else classified from the log.
    Narrow frames, cached.

    Third: `committed_entries` at the version the run that wrote this state left it
    (`COMMITTED_ENTRIES_AT`), when the facts come from the state and that run recorded it: the
    read-committed rows of exactly this log, so an eligible ledger's rows there are its kept rows.
    """
    if state_is_current(wh) and wh.exists(BUFFER_DUPLICATES):
        # Read buffer_ledger_txns first: a buffer run writes it last, so a run in progress can only
        # have moved buffer_duplicates on, and a ledger whose counts are unchanged has the same
        # duplicates in either version.
        state_version = wh.version(BUFFER_LEDGER_TXNS)
        # The state check reads four narrow columns by delta-rs (no Spark job: 4-5 s in a fresh JVM).
        counts = DeltaTables(wh).dataset(BUFFER_LEDGER_TXNS, state_version).to_table(columns=LEDGER_COUNT_COLUMNS)
        plan = plan_scope(inventory_of(catalog), state_ledger_counts(counts), ())
        changed, deleted = plan.ledgers, plan.deleted
        if not changed and not deleted:
            ledger_txns = _pinned(wh, BUFFER_LEDGER_TXNS, state_version).cache()
            duplicates = _as_of_now(wh, BUFFER_DUPLICATES).cache()
            txns = txns_from_ledger_txns(ledger_txns).cache()
            ledgers = ledger_txns.groupBy("topic", "ledger_id").agg(F.max("last_entry_id").alias("last_entry_id"))
            facts = BufferFacts(entries, duplicates, ledger_txns, ledgers, txns)
            state_commit = DeltaTables(wh).last_rows_commit(BUFFER_LEDGER_TXNS) or {}
            committed_at = state_commit.get(COMMITTED_ENTRIES_AT)
            # The state read is the commit that recorded it (later commits only VACUUMed or OPTIMIZEd).
            if committed_at is None or state_commit.get("version") > state_version:
                return facts, FROM_BUFFER_STATE, None
            return facts, FROM_BUFFER_STATE, _pinned(wh, COMMITTED_ENTRIES, int(committed_at))
    return classify_entries(entries, persist=True), FROM_LEDGER_ENTRIES, None


def _ledgers_of(wh: Warehouse, table: str, version: int | None) -> set[LedgerKey]:
    """The (topic, ledger_id) pairs `table` holds at `version` (none when the table does not exist)."""
    if version is None:
        return set()
    return {(r["topic"], r["ledger_id"]) for r in _pinned(wh, table, version).select("topic", "ledger_id").distinct().collect()}


def _pinned(wh: Warehouse, table: str, version: int) -> DataFrame:
    """`table` at `version` (a later commit does not change what this run reads)."""
    return wh.spark.read.format("delta").option("versionAsOf", version).load(wh.path(table))


def _as_of_now(wh: Warehouse, table: str) -> DataFrame:
    """`table` pinned to its current version."""
    return _pinned(wh, table, wh.version(table))


@dataclass
class _Copy:
    """What one run copies: the pinned log, its facts, the kept rows' source, the ledgers and their ranges."""

    wh: Warehouse
    entries: DataFrame  # the pinned ledger_entries
    facts: BufferFacts
    committed: DataFrame | None  # committed_entries at the state's version, or None: classify the log
    targets: list[LedgerKey]
    ranges: dict[LedgerKey, Row]  # the pinned catalog's rows

    def kept_rows(self) -> DataFrame:
        if self.committed is not None:
            # Eligible ledgers hold decided entries only: their committed_entries rows are the kept rows.
            return _in_ledgers(self.committed, self.targets).select(*LEDGER_ENTRY_COLUMNS)
        classified = classify_for_offload(_in_ledgers(self.entries, self.targets), self._decided(), self.facts.duplicates)
        return classified.where(F.col("disposition") == KEPT).select(*LEDGER_ENTRY_COLUMNS)

    def counts(self, tier_version: int) -> dict[LedgerKey, dict]:
        """Per ledger: the manifest's range, counts by reason, bytes and checksum."""
        if self.committed is None:
            # The same rows again (same log version, same classification): what was written, counted.
            # Size and hash first, then only narrow rows go through the joins (no payload carried).
            sized = _in_ledgers(self.entries, self.targets).select(
                *NARROW_COLUMNS, entry_size_bytes().alias("_bytes"), row_hash().alias("_hash")
            )
            narrow_classified = classify_for_offload(sized, self._decided(), self.facts.duplicates)
            return {(r["topic"], r["ledger_id"]): r.asDict() for r in manifest_counts(narrow_classified).collect()}
        # The kept side from the rows written (read back from the tier version this run made), the
        # dropped side from the buffer's state, whose groups this log's ledgers are.
        tier = _in_ledgers(_pinned(self.wh, OFFLOADED_ENTRIES, tier_version), self.targets)
        kept = {(r["topic"], r["ledger_id"]): r.asDict() for r in kept_rows_summary(tier).collect()}
        state = _in_ledgers(self.facts.by_ledger_txn, self.targets)
        drops = {(r["topic"], r["ledger_id"]): r.asDict() for r in drops_from_state(state, self.facts.txns).collect()}
        sizes = _entry_bytes(self.wh, self.entries, self.ranges, self.targets)
        counts = {}
        for key in self.targets:
            drop, range_ = drops[key], self.ranges[key]
            kept_row = kept.get(key) or {"entries_kept": 0, "bytes_after": 0, "checksum": "0"}
            entries_kept = kept_row["entries_kept"]
            if not drop["kept_at_least"] <= entries_kept <= drop["kept_at_most"] or drop["entries_before"] != range_["entry_count"]:
                raise OffloadStateError(
                    f"ledger {key[1]} of topic {key[0]!r}: committed_entries holds {entries_kept} of its entries, but the "
                    f"transaction buffer's state says {drop['kept_at_least']}-{drop['kept_at_most']} of its "
                    f"{drop['entries_before']} entries are readable (the log holds {range_['entry_count']}). Nothing was "
                    "recorded for it; recompute the transaction buffer over every ledger (`txnlake run`), then offload again."
                )
            counts[key] = {
                "topic": key[0], "ledger_id": key[1],
                "first_entry_id": range_["first_entry_id"], "last_entry_id": range_["last_entry_id"],
                "entries_before": drop["entries_before"], "entries_kept": entries_kept,
                "dropped_markers": drop["dropped_markers"], "dropped_aborted": drop["dropped_aborted"],
                "dropped_duplicates": drop["dropped_duplicates"],
                "dropped_other": drop["entries_before"] - entries_kept - drop["dropped_markers"] - drop["dropped_aborted"]
                - drop["dropped_duplicates"],
                "bytes_before": sizes[key], "bytes_after": kept_row["bytes_after"], "checksum": kept_row["checksum"],
            }
        return counts

    def _decided(self) -> DataFrame:
        decided = self.facts.txns.where(F.col("outcome").isNotNull())
        return F.broadcast(decided) if decided.count() <= BROADCAST_TXNS_MAX else decided  # `txns` is cached: a cheap count


def _entry_bytes(wh: Warehouse, entries: DataFrame, ranges: dict[LedgerKey, Row], targets: list[LedgerKey]) -> dict[LedgerKey, int]:
    """`entry_size_bytes` summed per ledger: the `ledgers` catalog's `size_bytes` where its row
    has the pinned range and count (entries are only ever appended to a ledger, and retention
    removes whole ledgers, so the same range and count are the same entries), the others summed
    from the pinned log (one narrow Spark job)."""
    catalog = DeltaTables(wh).read(LEDGERS, LEDGERS_SCHEMA, ["topic", "ledger_id", "first_entry_id", "last_entry_id",
                                                             "entry_count", "size_bytes"]).to_pylist()
    same = {(r["topic"], r["ledger_id"]): r["size_bytes"] for r in catalog
            if (r["topic"], r["ledger_id"]) in ranges and all(
                r[c] == ranges[(r["topic"], r["ledger_id"])][c] for c in ("first_entry_id", "last_entry_id", "entry_count"))}
    sizes = {key: same[key] for key in targets if key in same}
    rest = [key for key in targets if key not in sizes]
    if rest:
        summed = _in_ledgers(entries, rest).groupBy("topic", "ledger_id").agg(F.sum(entry_size_bytes()).cast("long").alias("b"))
        sizes.update({(r["topic"], r["ledger_id"]): r["b"] or 0 for r in summed.collect()})
    return sizes


def _copy_ledgers(
    copy: _Copy,
    stable_at: dict[str, Position],
    crash_hook: Callable[[str], None] | None,
    lap: Callable[[str], None],
    clean_before: int | None,
) -> list[dict]:
    wh, targets = copy.wh, copy.targets
    predicate = ledger_predicate(targets)
    # Step 1: the tier rows of these ledgers, replaced in one commit.
    wh.overwrite(OFFLOADED_ENTRIES, copy.kept_rows(), replace_where=predicate)
    written_at = wh.version(OFFLOADED_ENTRIES)
    # Clean at the version this write made once its manifest rows land, unless another commit came between.
    clean = {TIER_CLEAN_AT: str(written_at)} if clean_before is not None and written_at == clean_before + 1 else None
    lap("write")
    if crash_hook:
        crash_hook(AFTER_ENTRIES)
    counts = copy.counts(written_at)
    location, now = wh.path(OFFLOADED_ENTRIES), datetime.now(timezone.utc)
    rows = []
    for key in targets:
        stable = stable_at[key[0]]
        rows.append({
            **counts[key],
            "max_read_ledger_id": stable.ledger_id, "max_read_entry_id": stable.entry_id,
            "tier_location": location, "offloaded_at": now,
        })
    # Step 2: the manifest rows: from now on readers read these ledgers from the tier. A row per
    # ledger, committed by delta-rs (Spark's replaceWhere would run 8 Spark jobs for them).
    DeltaTables(wh).overwrite(OFFLOAD_MANIFEST, rows, OFFLOAD_MANIFEST_SCHEMA, predicate=ledger_predicate(targets, delta_rs=True),
                              commit_metadata=clean)
    lap("manifest")
    if crash_hook:
        crash_hook(AFTER_MANIFEST)
    # Step 3: the catalog state.
    record_ledger_states(wh, [(t, l, "OFFLOADED", "offloaded to the filtered tier") for t, l in targets])
    lap("states")
    return rows


def offloaded_ledgers(warehouse: Warehouse, topic: str | None = None) -> set[LedgerKey]:
    """The ledgers the tier holds: those with a manifest row (the offload's commit point)."""
    manifest = warehouse.read_or_empty(OFFLOAD_MANIFEST, OFFLOAD_MANIFEST_SCHEMA)
    if topic is not None:
        manifest = manifest.where(F.col("topic") == topic)
    return {(r["topic"], r["ledger_id"]) for r in manifest.select("topic", "ledger_id").collect()}


def offload_candidates(warehouse: Warehouse) -> list[LedgerKey]:
    """Ledgers to offload next, cheaply: eligible by the stored `stable_positions`, not yet in the manifest.

    The stored stable positions may be older than `ledger_entries`; a stable position only moves
    forward, so they only make this list shorter, never wrong. `offload_ledgers` decides again
    from `ledger_entries`.
    """
    catalog = ledger_eligibility(ledger_ranges_catalog(warehouse), warehouse.read(STABLE_POSITIONS))
    eligible = {(r["topic"], r["ledger_id"]) for r in catalog.where("eligible").select("topic", "ledger_id").collect()}
    return sorted(eligible - offloaded_ledgers(warehouse))
