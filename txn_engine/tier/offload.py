"""The filtered offload tier: `offloaded_entries` and `offload_manifest` (the offload seed).

A CLOSED ledger whose last entry is at or below its topic's stable position holds only decided
entries, so it can move to the cold tier; only what a read-committed reader may ever see goes
there, at its original positions, and markers, aborted data, retried duplicates and late data stay
behind, counted by reason in the manifest. Nothing here restates a buffer rule: every decision is
the buffer kernel's over one pinned version of `ledger_entries`, read from the tables the buffer
recorded for exactly that log when there are some (as Pulsar's offloader asks the topic's
transaction buffer), else made by running the kernel over the pinned log. Per ledger: the tier
rows, then the manifest row (the commit point), then the OFFLOADED state; every run first repairs
what a crash left. docs/offload.md has the rules, the layout and the crash cases;
docs/benchmarks.md, "Offload", the measurements behind them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Iterable

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from txn_engine.buffer.refresh import (
    RECORDED_TABLES,
    listed_ledgers,
    plan_scope,
    recorded_version_key,
    state_is_current,
    state_ledger_counts,
)
from txn_engine.buffer import kernel
from txn_engine.buffer.kernel import TXN_KEY, ledger_drops, ledger_filter
from txn_engine.log.spark_columns import BROADCAST_MAX_BYTES, has_txn, is_data
from txn_engine.buffer.spark_runner import SparkDecisions, committed_rows, decide_full
from txn_engine.storage.arrow_frames import local_frame
from txn_engine.storage.delta_io import DeltaTables, delete_ledgers, ledger_predicate
from txn_engine.core.errors import TxnlakeError
from txn_engine.log.ledgers import entry_size_bytes, ledger_ranges_catalog, record_ledger_states
from txn_engine.core.log_types import EntryType
from txn_engine.core.positions import Position
from txn_engine.core.schema import (
    BUFFER_DUPLICATES,
    BUFFER_LEDGER_TXNS,
    BUFFER_LEDGER_TXNS_SCHEMA,
    COMMITTED_ENTRIES,
    LEDGER_ENTRIES,
    LEDGERS,
    LEDGERS_SCHEMA,
    LEDGER_ENTRY_COLUMNS,
    OFFLOAD_MANIFEST,
    OFFLOAD_MANIFEST_SCHEMA,
    OFFLOADED_ENTRIES,
    OFFLOADED_ENTRIES_SCHEMA,
    STABLE_POSITIONS,
    STABLE_POSITIONS_SCHEMA,
    TXN_MARKERS,
)
from txn_engine.core.step_clock import StepClock
from txn_engine.storage.warehouse import Warehouse

# Where an offload run took the buffer's facts from (OffloadResult.facts_from).
FROM_BUFFER_STATE, FROM_LEDGER_ENTRIES = "buffer_state", "ledger_entries"

# The manifest's count of each reason an entry stays behind (`kernel.ledger_drops`; late data is the rest).
DROP_COLUMNS = ("dropped_markers", "dropped_aborted", "dropped_duplicates", "dropped_other")

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


# What to do about a ledger that waits, by the start of its reason (`ledger_eligibility`).
WAITING_ADVICE = {
    "ledger is OPEN": "it can be offloaded once it closes (its topic rolls over to a new ledger)",
    "topic has no stable position": "materialize the transaction buffer first (`txnlake run`)",
    "last entry is beyond": "it can be offloaded once its transactions end (commit, abort or timeout) "
                            "and the transaction buffer has run again (`txnlake run`)",
    "ledger is DELETED": "retention deleted it from the hot tables before it was offloaded: nothing is left to offload",
    "not in the": "ingest its entries and refresh the catalog (`txnlake run`), or drop the partition",
}


class OffloadWaitingError(TxnlakeError):
    """None of the ledgers a run asked for can be offloaded now (and none is offloaded already)."""

    def __init__(self, waiting: dict[str, str]):
        self.waiting = waiting  # "topic/ledger_id" (or the partition key when unknown) -> reason
        why = "; ".join(f"{name}: {reason}, so {next((a for p, a in WAITING_ADVICE.items() if reason.startswith(p)), 'retry later')}"
                        for name, reason in sorted(waiting.items()))
        super().__init__(f"nothing was offloaded, no requested ledger is eligible: {why}. The partition(s) stay "
                         "not materialized; the offload sensor requests them once they are eligible.")


# -- pure logic ---------------------------------------------------------------------------------

ELIGIBILITY_COLUMNS = ("topic", "ledger_id", "state", "last_entry_id")


def eligibility(catalog: pa.Table, stable: pa.Table) -> pa.Table:
    """Per catalog ledger (at least `ELIGIBILITY_COLUMNS`): `eligible` and, when not,
    `waiting_reason`, beside its topic's stable position (`stable`: `stable_positions` rows). Pure.

    Eligible: CLOSED, and its last entry at or below its topic's stable position
    (`max_read_ledger_id`, `max_read_entry_id`). OPEN is never eligible; OFFLOADED and DELETED
    ledgers are done.
    """
    at = pa.table({"topic": stable["topic"].cast(pa.string()), "max_read_ledger_id": stable["max_read_ledger_id"].cast(pa.int64()),
                   "max_read_entry_id": stable["max_read_entry_id"].cast(pa.int64())})
    joined = catalog.set_column(catalog.schema.get_field_index("topic"), "topic", catalog["topic"].cast(pa.string())).join(
        at, "topic", join_type="left outer")
    state = joined["state"].cast(pa.string())
    below = kernel.position_le(joined["ledger_id"], joined["last_entry_id"], joined["max_read_ledger_id"],
                               joined["max_read_entry_id"])
    conditions = pc.make_struct(pc.fill_null(pc.not_equal(state, "CLOSED"), True), pc.is_null(joined["max_read_ledger_id"]),
                                pc.invert(pc.fill_null(below, False)), field_names=["not_closed", "no_stable", "beyond"])
    reason = pc.case_when(conditions, pc.binary_join_element_wise("ledger is ", state, ""),
                          pa.scalar("topic has no stable position yet"),
                          pa.scalar("last entry is beyond the stable position (a transaction is still ongoing)"))
    return joined.append_column("waiting_reason", reason).append_column("eligible", pc.is_null(reason))


def ledger_eligibility(catalog: DataFrame, stable: DataFrame) -> DataFrame:
    """`eligibility` of Spark frames (a row per ledger and per topic, collected), as a frame."""
    return catalog.sparkSession.createDataFrame(eligibility(catalog.toArrow(), stable.toArrow()))


def row_hash() -> Column:
    """A 64-bit hash of a row's ledger_entries columns; `checksum_of` sums them."""
    return F.xxhash64(*LEDGER_ENTRY_COLUMNS)


def checksum_of(hashes: Column) -> Column:
    """The order-independent checksum of the rows whose `row_hash()` values these are (nulls skipped):
    their sum modulo 2^64, as 16 lower-case hex digits (`EMPTY_CHECKSUM` for none).

    Summed as two longs, the signed high and the unsigned low 32 bits of each hash (exact up to
    2^31 rows a group), then combined once per group: the same value as summing the hashes as
    decimal(38,0), whose per-row BigDecimal arithmetic slowed the manifest pass (docs/benchmarks.md,
    "Offload").
    """
    high = F.coalesce(F.sum(F.shiftright(hashes, 32)), F.lit(0)).cast("decimal(38,0)")
    low = F.coalesce(F.sum(hashes.bitwiseAND(F.lit(0xFFFFFFFF))), F.lit(0)).cast("decimal(38,0)")
    total = (high * F.lit(1 << 32).cast("decimal(38,0)") + low).cast("decimal(38,0)")
    return checksum_hex(total)


# The checksum of no rows.
EMPTY_CHECKSUM = "0" * 16


def checksum_hex(total: Column) -> Column:
    """An exact sum of 64-bit hashes (a decimal) as the manifest's checksum: modulo 2^64, 16 hex digits."""
    wrapped = F.pmod(total, F.lit(str(1 << 64)).cast("decimal(38,0)")).cast("decimal(20,0)").cast("string")
    return F.lpad(F.lower(F.conv(wrapped, 10, 16)), 16, "0")


def content_checksum() -> Column:
    """An order-independent checksum of rows with the ledger_entries columns (an aggregate)."""
    return checksum_of(row_hash())


def kept_rows_summary(tier: DataFrame) -> DataFrame:
    """Per (topic, ledger_id) of tier rows: `entries_kept`, `bytes_after` and their `checksum`
    (`content_checksum`, as `manifest_counts` computes them over the classified rows). Pure."""
    return tier.groupBy("topic", "ledger_id").agg(
        F.count("*").alias("entries_kept"),
        F.sum(entry_size_bytes()).cast("long").alias("bytes_after"),
        content_checksum().alias("checksum"),
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
    # records) or FROM_LEDGER_ENTRIES (the rows the kernel, run over the pinned log, decides visible).
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
        keys = ["entries_before", "entries_kept", *DROP_COLUMNS, "bytes_before", "bytes_after"]
        totals = {k: sum(int(r[k]) for r in self.manifest) for k in keys}
        totals["bytes_saved"] = totals["bytes_before"] - totals["bytes_after"]
        totals["entries_dropped"] = totals["entries_before"] - totals["entries_kept"]
        return totals


def offload_ledgers(
    warehouse: Warehouse,
    ledger_ids: Iterable[int | LedgerKey] | None = None,
    crash_hook: Callable[[str], None] | None = None,
    broadcast_max_bytes: int = BROADCAST_MAX_BYTES,
) -> OffloadResult:
    """Offload the eligible ledgers among `ledger_ids` (all ledgers when None), recovering first.
    An id names that ledger of every topic; a (topic, ledger_id) pair one topic's (a partition's).

    `crash_hook(step)` is called after each write step (AFTER_ENTRIES, AFTER_MANIFEST); tests
    make it raise to simulate a crash there. `broadcast_max_bytes` bounds the kernel's decisions
    broadcast to the offloaded rows when it decides from the log (`spark_runner.committed_rows`).
    """
    wh = warehouse
    lap = StepClock()
    wanted = None if ledger_ids is None else {i if isinstance(i, tuple) else int(i) for i in ledger_ids}
    # One version of the log for the whole run: every job of it reads the same rows.
    log_version = wh.version(LEDGER_ENTRIES)
    if log_version is None:
        raise wh.missing(LEDGER_ENTRIES)
    entries = _pinned(wh, LEDGER_ENTRIES, log_version)
    # The catalog of the same version, with only what eligibility and the state check need: the
    # ledgers' ranges (`ledger_ranges`: delta-rs and Arrow, no Spark scan) and their states.
    # As Arrow (a row per ledger), for eligibility and the state check.
    catalog_table = ledger_ranges_catalog(wh, log_version).select(
        ["topic", "ledger_id", "state", "entry_count", "first_entry_id", "last_entry_id"])
    catalog_rows = catalog_table.to_pylist()
    lap("catalog")
    state_version = _state_version(wh, catalog_table)
    recorded = None if state_version is None else _recorded_tables(wh, state_version)
    # Without the recorded tables of a state that describes this log, the kernel decides the log.
    decided = LogDecisions(entries, decide_full(entries, topics={r["topic"] for r in catalog_rows}), broadcast_max_bytes) \
        if recorded is None else None
    source = recorded or decided
    stable = local_frame(wh.spark, recorded.stable_rows, STABLE_POSITIONS_SCHEMA) if recorded is not None \
        else decided.decided.table(STABLE_POSITIONS)
    try:
        stable_rows = stable.toArrow()  # a row per topic
        stable_at = {r["topic"]: Position(r["max_read_ledger_id"], r["max_read_entry_id"]) for r in stable_rows.to_pylist()}
        lap("facts")
        catalog = eligibility(catalog_table, stable_rows).to_pylist()
        result = OffloadResult(facts_from=FROM_LEDGER_ENTRIES if recorded is None else FROM_BUFFER_STATE,
                               kept_from=FROM_LEDGER_ENTRIES if recorded is None else COMMITTED_ENTRIES,
                               step_seconds=lap.seconds)  # later laps land there too
        manifest_commit = DeltaTables(wh).last_commit(OFFLOAD_MANIFEST)
        in_manifest = offloaded_ledgers(wh, version=manifest_commit["version"]) if manifest_commit else set()
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
                if wanted is None or key in wanted or key[1] in wanted:
                    result.already_offloaded.append(key)
            elif key in orphans and key in eligible:
                targets.add(key)
                result.finished_orphans.append(key)
            elif wanted is None or key in wanted or key[1] in wanted:
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
            copy = _Copy(wh, entries, sorted(targets), ranges, source)
            result.manifest = _copy_ledgers(copy, stable_at, crash_hook, lap, clean_before)
        return result
    finally:
        if decided is not None:
            decided.decided.unpersist()


def _state_version(wh: Warehouse, catalog: pa.Table) -> int | None:
    """The version of the buffer's state (`buffer_ledger_txns`) when it describes exactly the
    pinned log (`catalog` is its ledger catalog): every ledger's entry count and last entry agree,
    the test the buffer's own planner applies. None otherwise (no state, a state written by an
    older release, a ledger the buffer has not processed). The facts of ledgers retention
    deleted stay in the state (`refresh`), so a deletion alone does not make it stale."""
    if not (state_is_current(wh) and wh.exists(BUFFER_DUPLICATES)):
        return None
    state_version = wh.version(BUFFER_LEDGER_TXNS)
    # The check folds four narrow columns read by delta-rs batch by batch (no Spark job, which costs
    # most in a fresh JVM: docs/benchmarks.md, "Driver reads"; a row per ledger held, not per transaction).
    counts = state_ledger_counts(DeltaTables(wh).dataset(BUFFER_LEDGER_TXNS, state_version))
    plan = plan_scope(listed_ledgers(catalog), counts, ())
    return None if plan.ledgers else state_version


@dataclass
class RecordedBufferTables:
    """The buffer's tables as the run that wrote its state at `state_version` left them (the versions
    it recorded in that commit, `RECORDED_TABLES`): one description of exactly the pinned log,
    whatever was written since, read without refolding anything."""

    wh: Warehouse
    state_version: int  # of buffer_ledger_txns
    versions: dict[str, int]  # of each of RECORDED_TABLES
    committed: DataFrame  # committed_entries at its recorded version
    stable_rows: list[dict]  # stable_positions at its recorded version, a row per topic

    def kept_rows(self, ledgers: list[LedgerKey]) -> DataFrame:
        return _in_ledgers(self.committed, ledgers).select(*LEDGER_ENTRY_COLUMNS)

    def state_of(self, ledgers: list[LedgerKey]) -> tuple[pa.Table, pa.Table]:
        """The state's rows of these ledgers and their transactions' first markers, by delta-rs
        (narrow; a row per ledger and transaction of the ledgers of one run: what the driver holds,
        the markers read for those transactions only, not the whole `txn_markers`)."""
        tables = DeltaTables(self.wh)
        ids = pa.array(sorted({ledger for _, ledger in ledgers}), pa.int64())
        state = tables.dataset(BUFFER_LEDGER_TXNS, self.state_version).to_table(
            columns=["topic", "ledger_id", *TXN_KEY[1:], "entry_count", "last_entry_id", "marker_count", "duplicate_count"],
            filter=ledger_filter(ids),
        )
        wanted = pa.table({"topic": [t for t, _ in ledgers], "ledger_id": pa.array([l for _, l in ledgers], pa.int64())})
        state = state.join(wanted, keys=["topic", "ledger_id"], join_type="left semi")  # ledger ids repeat across topics
        txns = state.filter(pc.is_valid(state["txn_least_bits"])).select(TXN_KEY)
        markers = tables.dataset(TXN_MARKERS, self.versions[TXN_MARKERS]).to_table(
            columns=[*TXN_KEY, "outcome", "ledger_id", "entry_id"],
            filter=pc.field("txn_least_bits").isin(pc.unique(txns["txn_least_bits"])),
        )
        # The topic (a string: not pushed down, `delta_io.scan`) and the whole id, on the rows read.
        return state, markers.join(txns, keys=list(TXN_KEY), join_type="left semi")


def _recorded_tables(wh: Warehouse, state_version: int) -> RecordedBufferTables | None:
    """The tables the state at `state_version` recorded, or None when its commit recorded none
    (a release before this, or a later commit than the state read)."""
    commit = DeltaTables(wh).last_rows_commit(BUFFER_LEDGER_TXNS) or {}
    versions = {t: commit.get(recorded_version_key(t)) for t in RECORDED_TABLES}
    # The commit read must be the state's (later commits than it only VACUUMed or OPTIMIZEd).
    if None in versions.values() or commit.get("version") is None or commit["version"] > state_version:
        return None
    at = {t: int(v) for t, v in versions.items()}
    return RecordedBufferTables(
        wh, state_version, at,
        committed=_pinned(wh, COMMITTED_ENTRIES, at[COMMITTED_ENTRIES]),
        # A row per topic, by delta-rs: no Spark job.
        stable_rows=DeltaTables(wh).dataset(STABLE_POSITIONS, at[STABLE_POSITIONS]).to_table().to_pylist(),
    )


def _ledgers_of(wh: Warehouse, table: str, version: int | None) -> set[LedgerKey]:
    """The (topic, ledger_id) pairs `table` holds at `version` (none when the table does not exist)."""
    if version is None:
        return set()
    return {(r["topic"], r["ledger_id"]) for r in _pinned(wh, table, version).select("topic", "ledger_id").distinct().collect()}


def _pinned(wh: Warehouse, table: str, version: int) -> DataFrame:
    """`table` at `version` (a later commit does not change what this run reads)."""
    return wh.read(table, version=version)


def _as_of_now(wh: Warehouse, table: str) -> DataFrame:
    """`table` pinned to its current version."""
    return _pinned(wh, table, wh.version(table))


@dataclass
class LogDecisions:
    """The kernel's decisions over the pinned log (`spark_runner.decide_full`), when no recorded
    buffer tables describe it: the kept rows are the rows it decides visible, the drops its
    per-(ledger, transaction) facts. `unpersist` the decisions when done."""

    entries: DataFrame  # the pinned ledger_entries
    decided: SparkDecisions
    broadcast_max_bytes: int  # offload_ledgers' bound (`committed_rows`)

    def kept_rows(self, ledgers: list[LedgerKey]) -> DataFrame:
        rows = _in_ledgers(self.entries, ledgers).select(*LEDGER_ENTRY_COLUMNS)
        return committed_rows(self.decided, rows, self.broadcast_max_bytes).select(*LEDGER_ENTRY_COLUMNS)

    def state_of(self, ledgers: list[LedgerKey]) -> tuple[pa.Table, pa.Table]:
        """As `RecordedBufferTables.state_of`, from the decisions (a row per ledger and transaction of
        these ledgers, and their transactions' first markers)."""
        state = _in_ledgers(self.decided.table(BUFFER_LEDGER_TXNS), ledgers)
        markers = self.decided.table(TXN_MARKERS).join(state.where(F.col("txn_least_bits").isNotNull()).select(*TXN_KEY),
                                                       list(TXN_KEY), "left_semi")
        return state.toArrow(), markers.toArrow()


@dataclass
class _Copy:
    """What one run copies: the pinned log, the ledgers and their ranges, and what decided them
    (the recorded buffer tables, or the kernel over the log)."""

    wh: Warehouse
    entries: DataFrame  # the pinned ledger_entries
    targets: list[LedgerKey]
    ranges: dict[LedgerKey, dict]  # the pinned catalog's rows
    source: RecordedBufferTables | LogDecisions

    def kept_rows(self) -> DataFrame:
        # Eligible ledgers hold decided entries only: the rows the buffer decides visible are the kept rows.
        return self.source.kept_rows(self.targets)

    def counts(self, tier_version: int) -> dict[LedgerKey, dict]:
        """Per ledger: the manifest's range, counts by reason, bytes and checksum: the kept side from
        the rows written (read back from the tier version this run made), the dropped side from the
        buffer's per-(ledger, transaction) facts (`kernel.ledger_drops`)."""
        tier = _in_ledgers(_pinned(self.wh, OFFLOADED_ENTRIES, tier_version), self.targets)
        kept = {(r["topic"], r["ledger_id"]): r.asDict() for r in kept_rows_summary(tier).collect()}
        dropped = ledger_drops(*self.source.state_of(self.targets))
        drops = {(r["topic"], r["ledger_id"]): r for r in dropped.to_pylist()}
        none_dropped = dict.fromkeys(dropped.column_names, 0)  # a ledger without state rows: refused below
        sizes = _entry_bytes(self.wh, self.entries, self.ranges, self.targets)
        counts = {}
        for key in self.targets:
            range_ = self.ranges[key]
            drop = drops.get(key, none_dropped)
            kept_row = kept.get(key) or {"entries_kept": 0, "bytes_after": 0, "checksum": EMPTY_CHECKSUM}
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


def _entry_bytes(wh: Warehouse, entries: DataFrame, ranges: dict[LedgerKey, dict], targets: list[LedgerKey]) -> dict[LedgerKey, int]:
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


@dataclass(frozen=True)
class TierUncommitted:
    """What the tier holds that a read-committed reader must never see (`tier_uncommitted`)."""

    markers: int
    entries_of_aborted_txns: int
    entries_of_ongoing_txns: int

    @property
    def passed(self) -> bool:
        return not (self.markers or self.entries_of_aborted_txns or self.entries_of_ongoing_txns)


ONGOING = "ONGOING"  # `txn_decisions`' outcome of a transaction without a marker on its topic
TXN_DECISIONS_DDL = "topic string, txn_most_bits long, txn_least_bits long, outcome string"


def txn_decisions(ledger_txns: pa.Table) -> pa.Table:
    """Per (topic, txn) of one topic's `buffer_ledger_txns` rows: the kernel's outcome
    (`kernel.txns_from_ledger_txns`: its first marker's), ONGOING without one. Spark's grouped
    Arrow function."""
    txns = kernel.txns_from_ledger_txns(kernel.conform(ledger_txns, BUFFER_LEDGER_TXNS_SCHEMA))
    return pa.table({"topic": txns["topic"], "txn_most_bits": txns["txn_most_bits"], "txn_least_bits": txns["txn_least_bits"],
                     "outcome": pc.fill_null(txns["outcome"], ONGOING)})


def tier_uncommitted(wh: Warehouse) -> TierUncommitted:
    """The tier's markers, and its DATA of transactions the buffer kernel decides aborted or ongoing.

    The kernel's facts per (ledger, transaction), folded per topic by `txn_decisions`: the buffer's
    state (`buffer_ledger_txns`) when it describes the log as it is now (`_state_version`), which
    keeps the facts of the ledgers retention deleted; else the kernel run over the tier's topics'
    log (`decide_full`: the offload may have decided from entries newer than the buffer's tables),
    with the state's facts of the ledgers no longer in the log."""
    tier = wh.read_or_empty(OFFLOADED_ENTRIES, OFFLOADED_ENTRIES_SCHEMA)
    markers = tier.where(~is_data()).count()
    txn_rows = tier.where(has_txn() & is_data()).select(*TXN_KEY)
    topics = sorted(r.topic for r in tier.select("topic").distinct().collect())  # a row per topic
    if not topics:
        return TierUncommitted(markers, 0, 0)
    state_version = _state_version(wh, ledger_ranges_catalog(wh))
    decided = None if state_version is not None else decide_full(
        wh.read(LEDGER_ENTRIES).where(F.col("topic").isin(topics)), topics=topics)
    try:
        if decided is None:
            facts = _pinned(wh, BUFFER_LEDGER_TXNS, state_version).where(F.col("topic").isin(topics))
        else:
            facts = decided.table(BUFFER_LEDGER_TXNS)
            if wh.exists(BUFFER_LEDGER_TXNS):
                gone = (wh.read(BUFFER_LEDGER_TXNS).where(F.col("topic").isin(topics)).select(*facts.columns)
                        .join(facts.select("topic", "ledger_id").distinct(), ["topic", "ledger_id"], "left_anti"))
                facts = facts.unionByName(gone)
        txns = facts.select(*BUFFER_LEDGER_TXNS_SCHEMA.fieldNames()).groupBy("topic").applyInArrow(
            txn_decisions, TXN_DECISIONS_DDL)
        counts = {r.outcome: r["count"] for r in txn_rows.join(txns, list(TXN_KEY)).groupBy("outcome").count().collect()}
    finally:
        if decided is not None:
            decided.unpersist()
    return TierUncommitted(markers, counts.get(EntryType.ABORT.value, 0), counts.get(ONGOING, 0))


def offloaded_ledgers(warehouse: Warehouse, topic: str | None = None, version: int | None = None) -> set[LedgerKey]:
    """The ledgers the tier holds: those with a manifest row (the offload's commit point), at the
    manifest's `version` (else its latest). A row per ledger, read by delta-rs: no Spark job, so
    the engine's consumer reads the tier without a JVM."""
    manifest = DeltaTables(warehouse).read(OFFLOAD_MANIFEST, OFFLOAD_MANIFEST_SCHEMA, ["topic", "ledger_id"],
                                           version).to_pylist()
    return {(r["topic"], r["ledger_id"]) for r in manifest if topic is None or r["topic"] == topic}


def eligible_not_offloaded(wh: Warehouse) -> list[LedgerKey]:
    """Ledgers to offload next, cheaply: eligible by the stored `stable_positions`, not yet in the manifest.

    The stored stable positions may be older than `ledger_entries`; a stable position only moves
    forward, so they only make this list shorter, never wrong. `offload_ledgers` decides again
    from `ledger_entries`. Read by delta-rs and decided in Arrow (`ledger_ranges_catalog`,
    `eligibility`), a row per ledger: a sensor tick then starts no JVM in the code server, which
    would take much of the sensor's timeout and stay resident (docs/benchmarks.md, "Driver reads")."""
    stable = DeltaTables(wh).read(STABLE_POSITIONS, STABLE_POSITIONS_SCHEMA, ["topic", "max_read_ledger_id", "max_read_entry_id"])
    decided = eligibility(ledger_ranges_catalog(wh), stable)
    eligible = set(zip(*(decided.filter(decided["eligible"])[c].to_pylist() for c in ("topic", "ledger_id"))))
    return sorted(eligible - offloaded_ledgers(wh))
