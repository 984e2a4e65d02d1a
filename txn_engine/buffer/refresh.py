"""The transaction buffer, incrementally: recompute only some ledgers, keep the tables equal to a full run.

`refresh_buffer` writes the four contract tables from per-ledger facts it keeps in four state
tables (`buffer_ledger_txns`, `buffer_sequence_ranges`, `buffer_duplicates`,
`buffer_pending_entries`), so a run over newly closed ledgers reads their entries, not the history.
Its scope: the ledgers asked for, plus every ledger the catalog lists otherwise than the state;
ledgers retention deleted keep their facts. The kernel decides in the driver or on Spark
(`compute`), a run replaces its scope's rows by ledger, and `buffer_ledger_txns` is written last,
as the record of what is done, so the next run completes a crashed one. The state, the scope and
the write order: docs/transaction-buffer.md, "Incremental: partitions by ledger".

One run at a time: `refresh_buffer` holds the warehouse's buffer lock (`buffer_lock`) from
reading the state to its last write; a second run waits for it (and then plans on what the first
wrote). A crashed run's lock goes with its process (a flock), or expires (a lease in an S3 store).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator, Mapping, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset
from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, Row
from pyspark.sql import functions as F

from txn_engine.buffer import kernel, spark_runner
from txn_engine.buffer.kernel import NARROW_TABLES, TABLE_SCHEMAS, VIOLATIONS, require_ledger_entries
from txn_engine.storage.arrow_frames import arrow_schema, local_frame
from txn_engine.core.positions import at_or_before_sql
from txn_engine.storage.delta_io import (
    aggregate_batches,
    DeltaTables,
    fits_driver,
    ledger_predicate,
    overwrite_small,
    sql_string,
    TopicRows,
)
from txn_engine.log.ledgers import derived_catalog_table, recorded_states_table
from txn_engine.storage.locks import writer_lock
from txn_engine.core.schema import (
    ABORTED_TXNS,
    BUFFER_DUPLICATES,
    BUFFER_LEDGER_TXNS,
    BUFFER_LEDGER_TXNS_SCHEMA,
    BUFFER_PENDING_ENTRIES,
    BUFFER_SEQUENCE_RANGES,
    BUFFER_SEQUENCE_RANGES_SCHEMA,
    COMMITTED_ENTRIES,
    DELETED_LEDGERS,
    DELETED_LEDGERS_SCHEMA,
    LEDGER_ENTRIES,
    LEDGER_ENTRIES_SCHEMA,
    LEDGERS,
    LEDGERS_SCHEMA,
    STABLE_POSITIONS,
    STABLE_POSITIONS_SCHEMA,
    TXN_MARKERS,
)
from txn_engine.storage.warehouse import Warehouse

STATE_TABLES = (BUFFER_PENDING_ENTRIES, BUFFER_DUPLICATES, BUFFER_SEQUENCE_RANGES, BUFFER_LEDGER_TXNS)
LEDGER_COUNT_COLUMNS = ["topic", "ledger_id", "entry_count", "last_entry_id"]
# Commit metadata of a run's `buffer_ledger_txns` commit (its last): per contract table, the version
# the run's own writes left. Read at those versions, the tables describe exactly the log this state
# describes, whatever was written since (`DeltaTables.last_commit`; the offload reads them so).
RECORDED_TABLES = (TXN_MARKERS, COMMITTED_ENTRIES, STABLE_POSITIONS)
# The column that attributes a row to the ledger whose recomputation rewrites it.
LEDGER_COLUMN = {
    TXN_MARKERS: "ledger_id",
    ABORTED_TXNS: "abort_ledger_id",
    COMMITTED_ENTRIES: "visible_ledger_id",
    BUFFER_PENDING_ENTRIES: "ledger_id",
    BUFFER_DUPLICATES: "ledger_id",
    BUFFER_SEQUENCE_RANGES: "ledger_id",
    BUFFER_LEDGER_TXNS: "ledger_id",
}


@dataclass
class BufferRefresh:
    """What one `refresh_buffer` run did."""

    full: bool
    ledgers: list[int]  # ledgers whose facts were (re)computed; every ledger when full
    # "spark": the tables of entry rows by Spark's Delta writer (the narrow ones that fit through
    # the driver all the same), or "driver": every table collected as Arrow and committed by delta-rs.
    written_by: str = "spark"
    computed_by: str = "spark"  # where the kernel ran: "spark", or "driver" (`refresh_buffer`'s `compute`)
    # Ledgers retention deleted whose facts the state keeps (their transactions stay decided, their
    # sequence ids seen): every one so far, not only this run's.
    retained_ledgers: int = 0
    violations: dict[str, int] = field(default_factory=dict)  # in the recomputed ledgers
    rows_written: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        if self.full:
            return f"full recompute of {len(self.ledgers)} ledgers"
        text = f"recomputed {len(self.ledgers)} ledgers"
        if self.retained_ledgers:
            text += f"; the facts of {self.retained_ledgers} deleted ledgers kept"
        return text


# -- the run -----------------------------------------------------------------------------------

# Also in that commit: the JSON list of the ledgers the run rewrote (its scope and the deleted
# ledgers), or ALL_LEDGERS for a full run; the asset checks read just those rows (`buffer.checks`).
RUN_LEDGERS_KEY = "txnlake.buffer.ledgers"
ALL_LEDGERS = "all"

# One buffer run at a time per warehouse: a run reads the state, decides, and writes eight tables
# one by one; the per-table writer locks keep each commit whole but not the run. Two runs
# interleaved (A paused after a write while B ran to the end, then A finished) left
# stable_positions moved backwards and a committed row missing, both runs reported a success.
BUFFER_LOCK = "transaction_buffer"  # a lock file of its own beside the tables' (`WarehouseSettings.lock_path`)
# Long enough to wait out another run, a full recompute of a big log on Spark included.
BUFFER_LOCK_TIMEOUT_S = 3600.0


@contextmanager
def buffer_lock(wh: Warehouse, timeout_s: float = BUFFER_LOCK_TIMEOUT_S) -> Iterator[None]:
    """Exclusive right to run the transaction buffer on this warehouse, across processes and threads.

    Held by `refresh_buffer` for its whole run; nothing it calls takes it again (the lock is not
    reentrant: it would wait for itself).
    """
    with writer_lock(wh.settings, BUFFER_LOCK, timeout_s,
                    guarded="the transaction buffer of this warehouse (a buffer run: a Dagster run of its "
                            "assets, `txnlake run`)"):
        yield


def recorded_version_key(table: str) -> str:
    """The commit-metadata key under which a buffer run records `table`'s version (`RECORDED_TABLES`)."""
    return f"txnlake.buffer.{table}_version"


def ledger_ids_predicate(column: str, ledger_ids: Iterable[int]) -> str:
    ids = sorted(set(int(i) for i in ledger_ids))
    return f"{column} IN ({', '.join(map(str, ids))})" if ids else "false"


def ledger_inventory(wh: Warehouse) -> pa.Table:
    """(topic, ledger_id, entry_count, last_entry_id, size_bytes) of every ledger, from the `ledgers` catalog.

    The catalog is what the sensor and `txnlake run` refresh before the buffer runs: a row per
    ledger, read by delta-rs (no Spark job). Without one it is derived here, on Spark. DELETED
    ledgers are gone: retention deletes their rows.
    """
    columns = ["topic", "ledger_id", "state", "entry_count", "last_entry_id", "size_bytes"]
    catalog = read_catalog(wh, columns) if wh.exists(LEDGERS) else \
        derived_catalog_table(wh.read(LEDGER_ENTRIES), recorded_states_table(wh)).select(columns)
    return listed_ledgers(catalog).drop_columns(["state"])


def read_catalog(wh: Warehouse, columns: list[str]) -> pa.Table:
    """The `ledgers` catalog's `columns` (with `topic`, `ledger_id`, `state`) by delta-rs, a ledger
    in `deleted_ledgers` marked DELETED even when the catalog was written before retention deleted
    it (retention run from Dagster, no `txnlake run` since): taken for a stored ledger, its gone
    rows would look changed, and a buffer run would "recompute" it from nothing, dropping the facts
    the state keeps of it (a retried send's first copy, a marker before late data)."""
    catalog = DeltaTables(wh).read(LEDGERS, LEDGERS_SCHEMA, columns)
    deleted = DeltaTables(wh).read(DELETED_LEDGERS, DELETED_LEDGERS_SCHEMA, ["topic", "ledger_id"])
    if not deleted.num_rows:
        return catalog
    gone = pc.is_in(pc.binary_join_element_wise(catalog["topic"], pc.cast(catalog["ledger_id"], pa.string()), "/"),
                    value_set=pc.binary_join_element_wise(deleted["topic"], pc.cast(deleted["ledger_id"], pa.string()), "/"))
    state = pc.if_else(gone, pa.scalar("DELETED"), catalog["state"])
    return catalog.set_column(catalog.schema.get_field_index("state"), "state", state)


def listed_ledgers(catalog: pa.Table) -> pa.Table:
    """The rows of a `ledgers` catalog (as Arrow) of the ledgers `ledger_entries` holds: not
    DELETED, with entries."""
    return catalog.filter(pc.and_(pc.not_equal(catalog["state"], "DELETED"), pc.greater(catalog["entry_count"], 0)))


def ledgers_behind(now: LedgerCounts, known: LedgerCounts) -> LedgerCounts:
    """The ledgers of `now` (the catalog's counts) whose counts the state (`known`) does not hold:
    never computed, or computed while shorter. What a run must recompute, whatever was asked."""
    return {key: counts for key, counts in now.items() if known.get(key) != counts}


def inventory_rows(inventory: DataFrame | pa.Table) -> list[Row]:
    """The rows of an inventory, from Arrow (`ledger_inventory`) or a DataFrame."""
    if isinstance(inventory, pa.Table):
        return [Row(**r) for r in inventory.to_pylist()]
    return inventory.collect()


def _has_state(wh: Warehouse) -> bool:
    """Every table exists, and the state tables have every column this code writes (a state
    written before a column was added is rebuilt by a full run, as a first run builds it)."""
    return all(wh.exists(t) for t in (*STATE_TABLES, TXN_MARKERS, ABORTED_TXNS, COMMITTED_ENTRIES, STABLE_POSITIONS)) and (
        state_is_current(wh)
    )


def state_is_current(wh: Warehouse) -> bool:
    """Whether `buffer_ledger_txns` and `buffer_sequence_ranges` exist with every column of their schemas."""
    tables = DeltaTables(wh)
    for table, schema in ((BUFFER_LEDGER_TXNS, BUFFER_LEDGER_TXNS_SCHEMA), (BUFFER_SEQUENCE_RANGES, BUFFER_SEQUENCE_RANGES_SCHEMA)):
        columns = tables.columns(table)
        if columns is None or not set(schema.fieldNames()) <= set(columns):
            return False
    return True


class ScopePlan(NamedTuple):
    ledgers: set[int]  # to recompute
    # (topic, ledger_id, last_entry_id) of the ledgers the state holds and the catalog no longer
    # lists (retention deleted them): their facts stay, as a broker's do (module doc).
    retained: list[tuple[str, int, int]]
    size_bytes: int  # of the entries of `ledgers`, per the catalog (0 when the inventory has no size_bytes)
    log_bytes: int  # of every ledger's entries, per the catalog (0 when the inventory has no size_bytes)
    last_entries: list[tuple[str, int, int]]  # (topic, ledger_id, last_entry_id) of every ledger of the catalog

    @property
    def shadowed(self) -> list[tuple[str, int]]:
        """Retained (topic, ledger) pairs whose ledger id another topic's recomputed ledger shares:
        a run replaces rows by ledger id, and must spare theirs."""
        return sorted((topic, ledger) for topic, ledger, _ in self.retained if ledger in self.ledgers)


LedgerCounts = dict[tuple[str, int], tuple[int, int]]  # (topic, ledger_id) -> (entry_count, last_entry_id)


def state_ledger_counts(ledger_txns: DataFrame | pa.Table | pyarrow.dataset.Dataset) -> LedgerCounts:
    """What `buffer_ledger_txns` says each ledger holds, folded to one row per ledger.

    From Arrow (a table, or a dataset delta-rs opened, read batch by batch: no Spark job) or from a
    DataFrame (a version the caller pinned). Bounded: the driver holds a row per ledger and one
    batch, never the table's row per transaction (`aggregate_batches`).
    """
    if isinstance(ledger_txns, DataFrame):
        folded = ledger_txns.groupBy("topic", "ledger_id").agg(
            F.sum("entry_count").alias("entry_count"), F.max("last_entry_id").alias("last_entry_id")
        )
        return {(r.topic, r.ledger_id): (r.entry_count, r.last_entry_id) for r in folded.collect()}
    batches = (ledger_txns.to_batches() if isinstance(ledger_txns, pa.Table)
               else ledger_txns.to_batches(columns=LEDGER_COUNT_COLUMNS))
    folded = aggregate_batches(batches, ["topic", "ledger_id"],
                               [("entry_count", "sum", "entry_count"), ("last_entry_id", "max", "last_entry_id")])
    if folded is None:
        return {}
    columns = [folded.column(c).to_pylist() for c in LEDGER_COUNT_COLUMNS]
    return {(t, ledger): (n, last) for t, ledger, n, last in zip(*columns)}


def stored_ledger_counts(wh: Warehouse) -> LedgerCounts:
    """`state_ledger_counts` of the state as stored, read by delta-rs batch by batch (no Spark job,
    a row per ledger held); empty without a current state (`state_is_current`): then the state
    holds no ledger."""
    if not state_is_current(wh):
        return {}
    return state_ledger_counts(DeltaTables(wh).dataset(BUFFER_LEDGER_TXNS))


def plan_scope(inventory: DataFrame | pa.Table, known: LedgerCounts, requested: Iterable[int]) -> ScopePlan:
    """The ledgers to recompute and the retained (deleted) ones, from the catalog and the state.

    `inventory`: (topic, ledger_id, entry_count, last_entry_id, size_bytes) of every ledger
    `ledger_entries` holds, collected once (a row per ledger); `known`: what the state says
    (`state_ledger_counts`).
    """
    rows = inventory_rows(inventory)
    now = {(r.topic, r.ledger_id): (r.entry_count, r.last_entry_id) for r in rows}
    changed = {ledger for _, ledger in ledgers_behind(now, known)}
    retained = sorted((topic, ledger, last) for (topic, ledger), (_, last) in known.items() if (topic, ledger) not in now)
    wanted = set(int(i) for i in requested) & {ledger for _, ledger in now}
    scope = wanted | changed
    # The offloader plans without it (it reads no payload).
    sized = "size_bytes" in (inventory.column_names if isinstance(inventory, pa.Table) else inventory.columns)
    return ScopePlan(scope, retained, sum(r.size_bytes for r in rows if r.ledger_id in scope) if sized else 0,
                     sum(r.size_bytes for r in rows) if sized else 0, [(r.topic, r.ledger_id, r.last_entry_id) for r in rows])


def refresh_buffer(
    wh: Warehouse,
    inventory: DataFrame | pa.Table | None = None,
    ledgers: Iterable[int] = (),
    full: bool = False,
    after_write: Callable[[str], None] | None = None,
    compute: str | None = None,
    driver_write_max_bytes: int | None = None,
    driver_full_run_max_bytes: int | None = None,
    lock_timeout_s: float = BUFFER_LOCK_TIMEOUT_S,
) -> BufferRefresh:
    """Recompute the ledgers asked for (and whatever `plan_scope` adds), write every table; see the module doc.

    `inventory` is the ledger catalog: (topic, ledger_id, entry_count, last_entry_id, size_bytes)
    per ledger that `ledger_entries` holds (`ledger_inventory`: the `ledgers` table without its
    DELETED rows, as Arrow; or a DataFrame). None: `ledger_inventory`, read once the run holds the
    buffer lock, so a run that waited for another plans on the catalog as it is then. The whole
    run holds the buffer lock (`buffer_lock`), from reading the state to its last write.

    Where the kernel runs: `compute` (default: the warehouse's setting, `TXNLAKE_COMPUTE`) is
    `driver`, `spark`, or `auto`: in the driver an incremental run over at most
    `driver_write_max_bytes` of entries and a full run of a log of at most
    `driver_full_run_max_bytes` (per the catalog's `size_bytes`; a catalog without them never),
    else on Spark. The bounds default to the warehouse's settings too.
    """
    settings = wh.settings
    compute = (compute or settings.compute).lower()
    scope_max = settings.driver_scope_max_bytes if driver_write_max_bytes is None else driver_write_max_bytes
    full_max = settings.driver_full_run_max_bytes if driver_full_run_max_bytes is None else driver_full_run_max_bytes
    route = _Route(compute, scope_max, full_max)
    with buffer_lock(wh, lock_timeout_s):
        return _refresh_buffer(wh, ledger_inventory(wh) if inventory is None else inventory, ledgers, full, after_write, route)


class _Route(NamedTuple):
    """Where a run computes (`refresh_buffer`'s `compute` and bounds); writes follow `scope_max`."""

    compute: str
    scope_max: int
    full_max: int

    def scope_in_driver(self, size_bytes: int) -> bool:
        return self.compute == "driver" or (self.compute == "auto" and size_bytes <= self.scope_max)

    def full_run_in_driver(self, log_bytes: int) -> bool:
        return self.compute == "driver" or (self.compute == "auto" and 0 < log_bytes <= self.full_max)


def _refresh_buffer(wh: Warehouse, inventory: DataFrame | pa.Table, ledgers: Iterable[int], full: bool, after_write,
                    route: _Route) -> BufferRefresh:
    has_state = _has_state(wh)
    full = full or not has_state
    tables = DeltaTables(wh)
    known = stored_ledger_counts(wh) if has_state else {}
    plan = plan_scope(inventory, known, () if full else ledgers)
    if not full:
        return _refresh_incrementally(wh, tables, plan, after_write, route)
    # A full run's scope is every ledger the catalog lists, its size the whole log's.
    plan = plan._replace(ledgers={ledger for _, ledger, _ in plan.last_entries}, size_bytes=plan.log_bytes)
    if not plan.retained:
        if route.full_run_in_driver(plan.log_bytes):
            return _refresh_full_in_driver(wh, tables, plan, after_write)
        entries_all = wh.read(LEDGER_ENTRIES)
        require_ledger_entries(entries_all)
        return _refresh_on_spark(wh, entries_all, None, None, plan, after_write, route.scope_max)
    # Retention deleted ledgers whose facts only the state holds now: every listed ledger is
    # recomputed on top of them, which is the full recompute of the log as it was.
    return replace(_refresh_incrementally(wh, tables, plan, after_write, route), full=True)


def _refresh_incrementally(wh: Warehouse, tables: DeltaTables, plan: ScopePlan, after_write, route: _Route) -> BufferRefresh:
    if not plan.ledgers:
        return BufferRefresh(full=False, ledgers=[], retained_ledgers=len(plan.retained))
    # Small (a row per topic): read by delta-rs, without the Spark jobs of a Delta scan.
    old_stable = [Row(**r) for r in tables.read(STABLE_POSITIONS, STABLE_POSITIONS_SCHEMA).to_pylist()]
    if route.scope_in_driver(plan.size_bytes):
        return _refresh_in_driver(wh, tables, old_stable, plan, after_write, plan.log_bytes <= route.scope_max)
    entries_all = wh.read(LEDGER_ENTRIES)
    require_ledger_entries(entries_all)
    # Small (the scope's entries) and read by every table: scanned from Delta once.
    entries = entries_all.filter(F.col("ledger_id").isin(sorted(plan.ledgers))).cache()
    kept_state = {t: wh.read(t).filter(_kept_state_rows(plan)) for t in STATE_TABLES}
    try:
        return _refresh_on_spark(wh, entries, kept_state, old_stable, plan, after_write, route.scope_max)
    finally:
        entries.unpersist()


def _kept_state_rows(plan: ScopePlan) -> Column:
    """The state rows a Spark run keeps: those outside its ledgers, and the retained ones sharing an id with them."""
    outside = ~F.col("ledger_id").isin(sorted(plan.ledgers))
    if not plan.shadowed:
        return outside
    return outside | F.expr(ledger_predicate(plan.shadowed))


def _replaced_rows(plan: ScopePlan, column: str, delta_rs: bool) -> str:
    """The predicate of the rows a run replaces in a table: those of its ledgers (by `column`),
    but the retained ones sharing an id with them. Plain SQL for Spark or, with `delta_rs`, delta-rs."""
    where = ledger_ids_predicate(column, plan.ledgers)
    if not plan.shadowed:
        return where
    return f"({where}) AND NOT ({ledger_predicate(plan.shadowed, column, delta_rs)})"


def _refresh_on_spark(wh, entries, kept_state, old_stable, plan: ScopePlan, after_write,
                      driver_write_max_bytes: int) -> BufferRefresh:
    """The run on Spark (`spark_runner`): a full run (`kept_state` None), or an incremental one."""
    full = kept_state is None
    pending_rows = None
    if full:
        decided = spark_runner.decide_full(entries, topics={t for t, _, _ in plan.last_entries})
    else:
        stable_at = {r.topic: r.max_read_ledger_id for r in old_stable}
        # The keys come from the scope's entries (at most last_entry_id + 1 a ledger) and the stored transactions.
        key_rows = (sum(last + 1 for _, ledger, last in plan.last_entries if ledger in plan.ledgers)
                    + DeltaTables(wh).row_count(BUFFER_LEDGER_TXNS))
        reads = spark_runner.state_reads(kept_state, entries, stable_at, key_rows)
        pending_rows = reads[BUFFER_PENDING_ENTRIES]
        listed = plan.last_entries + plan.retained
        decided = spark_runner.decide_scope(entries, reads, {t for t, _, _ in listed}, plan.ledgers, stable_at, listed,
                                            plan.shadowed, [(t, ledger) for t, ledger, _ in plan.retained])
    try:
        # The narrow decisions in one collect when they fit: delta-rs commits them without Spark's per-write jobs.
        small = spark_runner.collect_narrow(decided, driver_write_max_bytes)
        written = spark_runner.wide_tables(decided, entries, pending_rows, small)
        driver = plan.size_bytes <= driver_write_max_bytes

        def by_driver(table: str, frame: DataFrame) -> bool:
            # Every table when the scope is small; else the narrow ones (a row per transaction and
            # ledger at most) when they fit.
            return driver or (table in NARROW_TABLES and fits_driver(frame, driver_write_max_bytes))

        stable = written[STABLE_POSITIONS]
        new_stable = (lambda: [Row(**r) for r in stable.to_pylist()]) if small else stable.collect
        # The in_stable_prefix flip rewrites files of the history: by the driver only when the whole log fits.
        _write(wh, written, new_stable, old_stable, plan, after_write, by_driver, plan.log_bytes <= driver_write_max_bytes)
        if not full:
            ledgers = sorted(plan.ledgers)
        elif small:
            ledgers = sorted(set(written[BUFFER_LEDGER_TXNS]["ledger_id"].to_pylist()))
        else:
            ledgers = sorted(r.ledger_id for r in written[BUFFER_LEDGER_TXNS].select("ledger_id").distinct().collect())
        return BufferRefresh(full=full, ledgers=ledgers, written_by="driver" if driver else "spark",
                             retained_ledgers=len(plan.retained),
                             violations=spark_runner.violations_of(small) if small else decided.violations())
    finally:
        decided.unpersist()


def _refresh_in_driver(wh: Warehouse, tables: DeltaTables, old_stable: list[Row], plan: ScopePlan, after_write,
                       flip_by_driver: bool) -> BufferRefresh:
    """An incremental run small enough for the driver: read by delta-rs, computed in Arrow
    (`kernel`), written by delta-rs; the same rows as `_refresh_on_spark`."""
    kept = ~pc.field("ledger_id").isin(pa.array(sorted(plan.ledgers), pa.int64()))
    for topic, ledger in plan.shadowed:  # retained rows sharing an id with the scope's (`_kept_state_rows`)
        kept = kept | ((pc.field("topic") == topic) & (pc.field("ledger_id") == ledger))
    entries = tables.dataset(LEDGER_ENTRIES).to_table(filter=kernel.ledger_filter(pa.array(sorted(plan.ledgers), pa.int64())))
    require_ledger_entries(entries)
    decided = kernel.scope_tables(entries, plan.ledgers,
                                        lambda table, rows: tables.dataset(table).to_table(filter=kept & rows),
                                        {r.topic: r.max_read_ledger_id for r in old_stable}, plan.last_entries + plan.retained,
                                        plan.shadowed, [(t, ledger) for t, ledger, _ in plan.retained])
    computed = kernel.wide_tables(decided, entries)
    new_stable = lambda: [Row(**r) for r in computed[STABLE_POSITIONS].to_pylist()]  # noqa: E731
    _write(wh, computed, new_stable, old_stable, plan, after_write, lambda table, frame: True, flip_by_driver)
    return BufferRefresh(full=False, ledgers=sorted(plan.ledgers), written_by="driver", computed_by="driver",
                         retained_ledgers=len(plan.retained), violations=decided.violations)


def _refresh_full_in_driver(wh: Warehouse, tables: DeltaTables, plan: ScopePlan, after_write) -> BufferRefresh:
    """A full run small enough for the driver: each topic read by delta-rs and computed in Arrow
    (`kernel.scope_tables` over all its ledgers, with no state), a thread per core, then
    every table written by delta-rs; the same rows as `_refresh_on_spark`.

    Per topic because every fact of the buffer is a topic's own (its keys all start with the
    topic: transactions, sequence ids, positions), as a broker keeps a transaction buffer per
    topic. Arrow's kernels release the GIL, so the threads use both cores. As on Spark, the
    entries, not the catalog, say which topics and ledgers there are (the catalog only routes
    the run here).
    """
    source = tables.dataset(LEDGER_ENTRIES)
    require_ledger_entries(source.schema.empty_table())
    topics = pc.unique(source.to_table(columns=["topic"])["topic"]).to_pylist()
    # Biggest first (by the catalog's ledger count), so the last topic to finish is a small one.
    ledger_count = Counter(topic for topic, _, _ in plan.last_entries)

    def tables_of(entries: pa.Table) -> tuple[dict[str, pa.Table], dict[str, int]]:
        decided = kernel.full_scope_tables(entries)
        return kernel.wide_tables(decided, entries), decided.violations

    reads = TopicRows(source, topics)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="buffer-topic") as pool:
        parts = list(pool.map(lambda topic: tables_of(reads.rows(topic)), sorted(topics, key=lambda t: (-ledger_count[t], t))))
    if not parts:  # an empty log: the tables of no entries
        parts = [tables_of(arrow_schema(LEDGER_ENTRIES_SCHEMA).empty_table())]
    computed = {table: pa.concat_tables([tables[table] for tables, _ in parts]) for table in parts[0][0]}
    violations = {v: sum(counts.get(v, 0) for _, counts in parts) for v in VIOLATIONS}
    _write(wh, computed, lambda: [], None, plan, after_write, lambda table, frame: True, True)
    return BufferRefresh(full=True, ledgers=sorted(set(computed[BUFFER_LEDGER_TXNS]["ledger_id"].to_pylist())),
                         written_by="driver", computed_by="driver", violations=violations)


def _write(wh, tables: Mapping[str, DataFrame | pa.Table | Callable[[], DataFrame]], new_stable: Callable[[], list], old_stable, plan: ScopePlan,
           after_write, by_driver: Callable[[str, DataFrame], bool], flip_by_driver: bool) -> None:
    """Write one run's tables (Spark frames or Arrow tables) in the crash-safe order of the module doc;
    a Spark frame for which `by_driver(table, frame)` holds is collected and committed by delta-rs."""
    full = old_stable is None

    def write(table: str, whole: bool = full, commit_metadata: dict[str, str] | None = None) -> None:
        frame = tables[table]
        if callable(frame):  # built when its turn comes (it runs a Spark job to decide its plan)
            frame = frame()
        where = lambda delta_rs: None if whole else _replaced_rows(plan, LEDGER_COLUMN[table], delta_rs)  # noqa: E731
        if isinstance(frame, pa.Table):
            DeltaTables(wh).overwrite(table, frame, TABLE_SCHEMAS[table], where(True), commit_metadata)
        elif by_driver(table, frame):
            overwrite_small(wh, table, frame, predicate=where(True), commit_metadata=commit_metadata, schema=TABLE_SCHEMAS[table])
        else:
            wh.overwrite(table, frame, replace_where=where(False), commit_metadata=commit_metadata, schema=TABLE_SCHEMAS[table])
        if after_write:
            after_write(table)

    # Contract tables first; the small ones before committed_entries (see BufferTables).
    write(TXN_MARKERS)
    write(ABORTED_TXNS)
    write(COMMITTED_ENTRIES)
    if not full:
        _move_stable_prefix(wh, old_stable, new_stable(), plan.ledgers, flip_by_driver, plan.last_entries)
        if after_write:
            after_write("in_stable_prefix")
    # After the rows it marks: the stable positions stored are what `in_stable_prefix` of the
    # older rows agrees with, so a run stopped before this line moves them next time.
    write(STABLE_POSITIONS, whole=True)
    recorded = {recorded_version_key(t): str(wh.version(t)) for t in RECORDED_TABLES}
    recorded[RUN_LEDGERS_KEY] = ALL_LEDGERS if full else json.dumps(sorted(plan.ledgers))
    # State last, buffer_ledger_txns the very last: it records what is done.
    write(BUFFER_PENDING_ENTRIES)
    write(BUFFER_DUPLICATES)
    write(BUFFER_SEQUENCE_RANGES)
    # With the versions of the contract tables this run left (the offload decides and copies from them).
    write(BUFFER_LEDGER_TXNS, commit_metadata=recorded)


def _move_stable_prefix(wh: Warehouse, old_rows, new_rows, rewritten: set[int], by_driver: bool,
                        ledgers: Iterable[tuple[str, int, int]]) -> None:
    """Set `in_stable_prefix` of the committed rows not rewritten where the topic's stable position moved.

    `by_driver`: a delta-rs UPDATE (no Spark job; it rewrites the files it touches in this process),
    for a log the caller knows is small; else Spark MERGEs. The same rows either way. A topic
    whose move can touch no such row (`flip_may_match`, from the catalog's `ledgers`) is left
    out, and with it, usually, the whole statement: finding no row costs a MERGE a scan of the table.
    """
    old = {r.topic: (r.max_read_ledger_id, r.max_read_entry_id) for r in old_rows}
    by_topic: dict[str, dict[int, int]] = {}
    for topic, ledger_id, last_entry_id in ledgers:
        by_topic.setdefault(topic, {})[ledger_id] = last_entry_id
    moved = [(r.topic, r.max_read_ledger_id, r.max_read_entry_id, old.get(r.topic)) for r in new_rows
             if old.get(r.topic) != (r.max_read_ledger_id, r.max_read_entry_id)
             and flip_may_match(old.get(r.topic), (r.max_read_ledger_id, r.max_read_entry_id), by_topic.get(r.topic, {}),
                                rewritten)]
    if not moved:
        return
    forward = any(prev is None or prev < (l, e) for _, l, e, prev in moved)
    backward = any(prev is not None and prev > (l, e) for _, l, e, prev in moved)
    if by_driver:
        tables = DeltaTables(wh)
        not_rewritten = f"NOT ({ledger_ids_predicate('visible_ledger_id', rewritten)})"

        def rows(flag: str, below: bool) -> str:
            return " OR ".join(
                f"(topic = {sql_string(t, delta_rs=True)} AND in_stable_prefix = {flag} AND "
                f"{'' if below else 'NOT '}{at_or_before_sql('ledger_id', 'entry_id', l, e)} AND {not_rewritten})"
                for t, l, e, _ in moved
            )
        if forward:
            tables.update(COMMITTED_ENTRIES, {"in_stable_prefix": "true"}, rows("false", below=True))
        if backward:
            tables.update(COMMITTED_ENTRIES, {"in_stable_prefix": "false"}, rows("true", below=False))
        return
    source = local_frame(wh.spark, [(t, l, e) for t, l, e, _ in moved], "topic string, _sl long, _se long")
    at_or_below = at_or_before_sql("t.ledger_id", "t.entry_id", "s._sl", "s._se")
    not_rewritten = f"NOT ({ledger_ids_predicate('t.visible_ledger_id', rewritten)})"
    with wh.writer(COMMITTED_ENTRIES):
        table = DeltaTable.forPath(wh.spark, wh.path(COMMITTED_ENTRIES))
        # `in_stable_prefix = false` lets Delta skip every file that holds only readable rows.
        if forward:
            table.alias("t").merge(
                source.alias("s"),
                f"t.topic = s.topic AND t.in_stable_prefix = false AND {at_or_below} AND {not_rewritten}",
            ).whenMatchedUpdate(set={"in_stable_prefix": "true"}).execute()
        if backward:
            table.alias("t").merge(
                source.alias("s"),
                f"t.topic = s.topic AND t.in_stable_prefix = true AND NOT {at_or_below} AND {not_rewritten}",
            ).whenMatchedUpdate(set={"in_stable_prefix": "false"}).execute()


def flip_may_match(old: tuple[int, int] | None, new: tuple[int, int], ledgers: Mapping[int, int], rewritten: set[int]) -> bool:
    """Whether moving a topic's stable position from `old` to `new` can change `in_stable_prefix` of a row not rewritten.

    Only rows between the two positions change. A row lies at or before its commit marker, so a
    row in ledger L that the run does not rewrite is visible in some ledger V >= L outside
    `rewritten`. `ledgers`: the topic's ledgers (ledger_id -> last_entry_id) per the catalog.
    """
    low, high = sorted([old or (-1, -1), new])
    between = [ledger for ledger, last in ledgers.items() if (ledger, last) > low and (ledger, 0) <= high]
    return bool(between) and any(ledger not in rewritten for ledger in ledgers if ledger >= min(between))


CLOSED_STATES = ("CLOSED", "OFFLOADED")


def closed_ledgers(catalog: pa.Table) -> pa.Table:
    """The rows of the `ledgers` catalog (as Arrow: the sensor reads it by delta-rs, without a JVM)
    of closed ledgers: CLOSED or OFFLOADED (the catalog already marks CLOSED every ledger that is
    not its topic's last, and applies recorded states)."""
    return catalog.filter(pc.is_in(catalog["state"], pa.array(CLOSED_STATES)))


def closed_ledger_ids(catalog: pa.Table) -> list[int]:
    """The ids of `closed_ledgers(catalog)`, in ledger order."""
    return sorted(pc.unique(closed_ledgers(catalog)["ledger_id"]).to_pylist())


def closed_ledger_counts(catalog: pa.Table) -> LedgerCounts:
    """(entry_count, last_entry_id) of the closed ledgers of the catalog that `ledger_entries` holds,
    per (topic, ledger_id): what the sensor compares with the state (`ledgers_behind`)."""
    rows = listed_ledgers(closed_ledgers(catalog)).select(LEDGER_COUNT_COLUMNS).to_pylist()
    return {(r["topic"], r["ledger_id"]): (r["entry_count"], r["last_entry_id"]) for r in rows}
