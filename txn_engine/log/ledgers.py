"""The ledger catalog (`ledgers`), derived from `ledger_entries`."""

from __future__ import annotations

from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import DeltaTable

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from txn_engine.core.errors import TxnlakeError
from txn_engine.core.positions import ledger_partition_key
from txn_engine.log.spark_columns import built_per_session
from txn_engine.core.schema import (
    DELETED_LEDGERS,
    DELETED_LEDGERS_SCHEMA,
    LEDGER_ENTRIES,
    LEDGER_STATES,
    LEDGER_STATES_LOG,
    LEDGER_STATES_SCHEMA,
    LEDGERS,
    LEDGERS_SCHEMA,
)
from txn_engine.storage.arrow_frames import local_frame
from txn_engine.storage.delta_io import DeltaTables, aggregate_batches, version_key
from txn_engine.storage.warehouse import Warehouse


@built_per_session
def entry_size_bytes() -> F.Column:
    """Bytes an entry occupies, as txnlake counts them: payload plus key, text or bytes (markers have neither)."""
    return (F.coalesce(F.octet_length("payload"), F.lit(0)) + F.coalesce(F.octet_length("key"), F.lit(0))
            + F.coalesce(F.octet_length("key_bytes"), F.lit(0)))


def derive_ledger_catalog(
    entries: DataFrame, known_states: pa.Table | None = None, deleted: pa.Table | None = None
) -> DataFrame:
    """`derived_catalog_table` as a Spark frame of the catalog's types. Pure."""
    catalog = derived_catalog_table(entries, known_states, deleted)
    return local_frame(entries.sparkSession, catalog, StructType([f for f in LEDGERS_SCHEMA.fields if f.name in catalog.column_names]))


def derived_catalog_table(
    entries: DataFrame, known_states: pa.Table | None = None, deleted: pa.Table | None = None
) -> pa.Table:
    """One row per (topic, ledger_id) with entry range, count, bytes and state, as Arrow. Pure.

    Without other information the last ledger of a topic is OPEN (still being written) and the
    others CLOSED. `known_states` (topic, ledger_id, state), when given, overrides that: later
    stages record OFFLOADED and DELETED there. `deleted` (`deleted_ledgers` rows) keeps listing
    ledgers whose entries retention removed, with their last known range and counts. Both are
    Arrow, as the driver reads them. Spark aggregates the entries per ledger in one job; the rows
    (a row per ledger) are collected and decided in the driver (`catalog_table`).
    """
    return catalog_table(_per_ledger(entries).toArrow(), known_states, deleted)


def catalog_table(per_ledger: pa.Table, known_states: pa.Table | None = None, deleted: pa.Table | None = None) -> pa.Table:
    """The catalog's rows of per-ledger rows (topic, ledger_id and any of the catalog's columns): each
    with its state (`catalog_states`) and the time it was derived, in the catalog's column order. Pure."""
    gone = None if deleted is None else deleted.select(per_ledger.column_names)
    rows = catalog_states(per_ledger, known_states, gone).drop_columns([FROM_DELETED])
    now = pa.array([datetime.now(timezone.utc)] * rows.num_rows, pa.timestamp("us", tz="UTC"))
    rows = rows.append_column("updated_at", now)
    return rows.select([f.name for f in LEDGERS_SCHEMA.fields if f.name in rows.column_names])


FROM_DELETED = "from_deleted"  # `catalog_states`: the row is a `deleted_ledgers` row, the ledger has no entries left
_KEYS = [("topic", pa.string()), ("ledger_id", pa.int64())]


def _keyed(table: pa.Table, *columns: tuple[str, pa.DataType]) -> pa.Table:
    """The key columns (and `columns`) of `table`, in the catalog's types, for Arrow joins."""
    fields = [*_KEYS, *columns]
    return pa.table([table[n].cast(t) for n, t in fields], schema=pa.schema(fields))


def latest_recorded_states(log: pa.Table) -> pa.Table:
    """The latest recorded state of each ledger in `ledger_states` rows: (topic, ledger_id, state).

    The latest `recorded_at` wins; between equal times, the later row of the log. A row without
    `recorded_at` (the column is NOT NULL: only a foreign writer leaves one) cannot be shown to be
    newer than any timed transition, so it loses to all of them, as an older one would."""
    if not log.num_rows:
        return _keyed(log, ("state", pa.string()))
    # Stable: ties keep log order.
    ordered = log.take(pc.sort_indices(log, sort_keys=[("recorded_at", "ascending", "at_start")]))
    # Ordered aggregation (no threads): "last" is the latest row of each ledger.
    latest = ordered.group_by(["topic", "ledger_id"], use_threads=False).aggregate([("state", "last")])
    return _keyed(latest.rename_columns({"state_last": "state"}), ("state", pa.string()))


def catalog_states(ledgers: pa.Table, recorded: pa.Table | None = None, deleted: pa.Table | None = None) -> pa.Table:
    """The catalog's state of each ledger: (topic, ledger_id, state, `FROM_DELETED`). Pure.

    `ledgers`: the ledgers with entries (topic, ledger_id); a topic's last is OPEN (still being
    written), the others CLOSED. `deleted` (topic, ledger_id: `deleted_ledgers`): one with no
    entries left is DELETED whatever the log says (one that still has entries, retention stopped
    half-way, is described by them). `recorded` (`latest_recorded_states`) then overrides the state
    of any ledger listed. Any further column of `ledgers` and `deleted` (the same in both) is kept."""
    extra = [(f.name, f.type) for f in ledgers.schema if f.name not in ("topic", "ledger_id")]
    live = _keyed(ledgers, *extra)
    newest = live.group_by("topic").aggregate([("ledger_id", "max")])
    live = live.join(newest, "topic")
    derived = pc.if_else(pc.equal(live["ledger_id"], live["ledger_id_max"]), "OPEN", "CLOSED")
    rows = live.drop_columns(["ledger_id_max"]).append_column("state", derived.cast(pa.string()))
    rows = rows.append_column(FROM_DELETED, pa.array([False] * rows.num_rows, pa.bool_()))
    if deleted is not None and deleted.num_rows:
        gone = _keyed(deleted, *extra).join(_keyed(ledgers), ["topic", "ledger_id"], join_type="left anti")
        gone = gone.append_column("state", pa.array(["DELETED"] * gone.num_rows, pa.string()))
        rows = pa.concat_tables([rows, gone.append_column(FROM_DELETED, pa.array([True] * gone.num_rows, pa.bool_()))])
    if recorded is not None and recorded.num_rows:
        known = _keyed(recorded, ("state", pa.string())).rename_columns(["topic", "ledger_id", "_recorded"])
        rows = rows.join(known, ["topic", "ledger_id"], join_type="left outer")
        rows = rows.set_column(rows.schema.get_field_index("state"), "state", pc.coalesce(rows["_recorded"], rows["state"]))
        rows = rows.drop_columns(["_recorded"])
    return rows.select(["topic", "ledger_id", *(n for n, _ in extra), "state", FROM_DELETED]).sort_by(
        [("topic", "ascending"), ("ledger_id", "ascending")])


def _per_ledger(entries: DataFrame) -> DataFrame:
    return entries.groupBy("topic", "ledger_id").agg(
        F.min("entry_id").alias("first_entry_id"),
        F.max("entry_id").alias("last_entry_id"),
        F.count("*").alias("entry_count"),
        F.sum(entry_size_bytes()).cast("long").alias("size_bytes"),
        F.min("publish_time").alias("first_publish_time"),
        F.max("publish_time").alias("last_publish_time"),
    )


def record_ledger_states(warehouse: Warehouse, transitions: list[tuple[str, int, str, str | None]]) -> None:
    """Append `(topic, ledger_id, state, reason)` transitions to `ledger_states`, in one commit."""
    for topic, ledger_id, state, _ in transitions:
        if state not in LEDGER_STATES:
            raise ValueError(f"ledger {topic}/{ledger_id}: unknown state {state!r}; use one of {', '.join(LEDGER_STATES)}")
    if not transitions:
        return
    now = datetime.now(timezone.utc)
    rows = [{"topic": t, "ledger_id": int(l), "state": s, "reason": r, "recorded_at": now} for t, l, s, r in transitions]
    DeltaTables(warehouse).append(LEDGER_STATES_LOG, LEDGER_STATES_SCHEMA, rows)  # as the engine does: no Spark job


def recorded_states_table(warehouse: Warehouse) -> pa.Table:
    """`latest_recorded_states` of the warehouse's `ledger_states`, as Arrow.

    The log is small (a row per transition), so it is read by delta-rs and folded with Arrow, not
    scanned by Spark: every catalog reads it, often in a fresh JVM (docs/benchmarks.md, "Driver reads").
    """
    return latest_recorded_states(DeltaTables(warehouse).read(
        LEDGER_STATES_LOG, LEDGER_STATES_SCHEMA, ["topic", "ledger_id", "state", "recorded_at"]))


def recorded_ledger_states(warehouse: Warehouse) -> DataFrame:
    """The latest recorded state of each ledger that has one: (topic, ledger_id, state), as a frame."""
    return local_frame(warehouse.spark, recorded_states_table(warehouse), "topic string, ledger_id long, state string")


def deleted_by_topic(recorded: pa.Table) -> dict[str, set[int]]:
    """Per topic, the ledgers whose latest recorded state (`latest_recorded_states`) is DELETED."""
    gone = recorded.filter(pc.equal(recorded["state"], "DELETED"))
    deleted: dict[str, set[int]] = {}
    for topic, ledger in zip(gone["topic"].to_pylist(), gone["ledger_id"].to_pylist()):
        deleted.setdefault(topic, set()).add(ledger)
    return deleted


def recorded_deleted_ledgers(warehouse: Warehouse) -> DataFrame:
    """(topic, ledger_id) recorded DELETED in ledger_states: their aborts are trimmed from every abort set."""
    return recorded_ledger_states(warehouse).where(F.col("state") == "DELETED").select("topic", "ledger_id")


def deleted_ledgers_table(warehouse: Warehouse) -> pa.Table:
    """The `deleted_ledgers` table: the last known catalog rows of the ledgers retention deleted
    (empty when none was). Small (a row per deleted ledger): read by delta-rs, as the states are."""
    return DeltaTables(warehouse).read(DELETED_LEDGERS, DELETED_LEDGERS_SCHEMA)


def deleted_ledger_rows(warehouse: Warehouse) -> DataFrame:
    """`deleted_ledgers_table` as a frame."""
    return local_frame(warehouse.spark, deleted_ledgers_table(warehouse), DELETED_LEDGERS_SCHEMA)


RANGES_SCHEMA = pa.schema([("topic", pa.string()), ("ledger_id", pa.int64()), ("first_entry_id", pa.int64()),
                           ("last_entry_id", pa.int64()), ("entry_count", pa.int64())])
_RANGES = [("entry_id", "min", "first_entry_id"), ("entry_id", "max", "last_entry_id"), ("entry_id", "count", "entry_count")]


def ledger_ranges(warehouse: Warehouse, version: int | None = None) -> pa.Table:
    """(topic, ledger_id, first_entry_id, last_entry_id, entry_count) of every ledger `ledger_entries`
    holds at `version` (the latest when None), as Arrow, in (topic, ledger_id) order.

    No Spark job and no payload read: a file of one ledger gives its part of the ledger's range
    from its Delta statistics (`single_ledger_files`); the other files are read by delta-rs batch by
    batch (three narrow columns) and folded with Arrow. Bounded: the driver holds a row per file
    and per ledger and one batch. Far cheaper than Spark's narrow scan of the same columns, above all
    in a fresh JVM, as each Dagster run is (docs/benchmarks.md, "Driver reads").
    """
    stated, unstated = single_ledger_files(DeltaTables(warehouse).snapshot(LEDGER_ENTRIES, version))
    folded = aggregate_batches(unstated.to_batches(columns=["topic", "ledger_id", "entry_id"]), ["topic", "ledger_id"],
                               _RANGES, partials=[stated])
    if folded is None:
        return RANGES_SCHEMA.empty_table()
    return folded.cast(RANGES_SCHEMA).sort_by([("topic", "ascending"), ("ledger_id", "ascending")])


def single_ledger_files(log: DeltaTable) -> tuple[pa.Table, ds.Dataset]:
    """The ranges (`RANGES_SCHEMA`, a row per file) of the log's files whose rows all belong to one
    (topic, ledger), from their Delta statistics, and the dataset of the other files.

    Exact: such a file's min and max topic and ledger are equal and no row lacks them or its entry
    id, so its min and max entry id and its row count are its rows' (ingest stores a position once:
    the counts of a ledger's files add up). A file without statistics is read, and so is one of a
    topic longer than its statistics keep (Spark's: 32 characters, the max with a character
    appended, so min and max differ).
    """
    dataset = log.to_pyarrow_dataset()
    actions = pa.table(log.get_add_actions(flatten=True))
    needed = ["num_records", *(f"{s}.{c}" for s in ("min", "max", "null_count") for c in ("topic", "ledger_id", "entry_id"))]
    if not actions.num_rows or not set(needed) <= set(actions.column_names):
        return RANGES_SCHEMA.empty_table(), dataset
    one = pc.and_(pc.equal(actions["min.topic"], actions["max.topic"]), pc.equal(actions["min.ledger_id"], actions["max.ledger_id"]))
    for condition in (pc.is_valid(actions["min.entry_id"]), pc.is_valid(actions["max.entry_id"]),
                      pc.greater(actions["num_records"], 0),
                      *(pc.equal(actions[f"null_count.{c}"], 0) for c in ("topic", "ledger_id", "entry_id"))):
        one = pc.and_(one, condition)
    fragments = list(dataset.get_fragments())
    # Matched by the dataset's own paths: a file it names otherwise is read, not counted twice.
    one = pc.and_(pc.fill_null(one, False), pc.is_in(actions["path"], pa.array([f.path for f in fragments], pa.string())))
    files = actions.filter(one)
    stated = pa.table([files[c] for c in ("min.topic", "min.ledger_id", "min.entry_id", "max.entry_id", "num_records")],
                      names=RANGES_SCHEMA.names).cast(RANGES_SCHEMA)
    paths = set(files["path"].to_pylist())
    rest = ds.FileSystemDataset([f for f in fragments if f.path not in paths], dataset.schema, dataset.format, dataset.filesystem)
    return stated, rest


def ledger_ranges_catalog(warehouse: Warehouse, version: int | None = None) -> pa.Table:
    """The catalog's (topic, ledger_id, first_entry_id, last_entry_id, entry_count, state, updated_at)
    as of `ledger_entries` at `version`, from `ledger_ranges`, as Arrow: for callers that need no
    bytes or times (offload eligibility), at a fraction of `current_ledger_catalog`'s cost, no Spark job."""
    return catalog_table(ledger_ranges(warehouse, version), recorded_states_table(warehouse), deleted_ledgers_table(warehouse))


def current_ledger_catalog(warehouse: Warehouse, entries: DataFrame | None = None) -> DataFrame:
    """`current_catalog_table` as a Spark frame of the catalog's types."""
    log = warehouse.read(LEDGER_ENTRIES) if entries is None else entries
    return derive_ledger_catalog(log, recorded_states_table(warehouse), deleted_ledgers_table(warehouse))


def current_catalog_table(warehouse: Warehouse, entries: DataFrame | None = None) -> pa.Table:
    """The catalog as of now, as Arrow: ledger_entries (or `entries`, e.g. one pinned version of
    it), the recorded states and the deleted ledgers."""
    log = warehouse.read(LEDGER_ENTRIES) if entries is None else entries
    return derived_catalog_table(log, recorded_states_table(warehouse), deleted_ledgers_table(warehouse))


def write_ledger_catalog(warehouse: Warehouse, entries: DataFrame | None = None,
                         commit_metadata: dict[str, str] | None = None) -> pa.Table:
    """Replace the `ledgers` table with `current_catalog_table` (of `entries` when given) in one
    delta-rs commit carrying `commit_metadata` (the sources' versions: `catalog_source_versions`,
    taken before); returns the rows written."""
    catalog = current_catalog_table(warehouse, entries)
    DeltaTables(warehouse).overwrite(LEDGERS, catalog, LEDGERS_SCHEMA, commit_metadata=commit_metadata)
    return catalog


def immutable_ledgers(warehouse: Warehouse) -> DataFrame:
    """Ledgers that take no new entries, for ingest: (topic, ledger_id, state, deleted_first_entry_id,
    deleted_last_entry_id). State is the recorded CLOSED (the engine's rollover: a closed BookKeeper
    ledger is immutable), OFFLOADED (the tier holds a copy that new entries would never reach) or
    DELETED (also any ledger in `deleted_ledgers`, whose range the two last columns give). A ledger
    CLOSED only by derivation (not its topic's last) is not listed: files may arrive out of order."""
    states = recorded_ledger_states(warehouse).where(F.col("state").isin("CLOSED", "OFFLOADED", "DELETED"))
    deleted = deleted_ledger_rows(warehouse).select(
        "topic", "ledger_id",
        F.col("first_entry_id").alias("deleted_first_entry_id"), F.col("last_entry_id").alias("deleted_last_entry_id"),
    )
    both = states.join(deleted, ["topic", "ledger_id"], "full")
    # In deleted_ledgers but not (yet) recorded DELETED: retention stopped half-way and finishes it.
    return both.withColumn(
        "state", F.when(F.col("deleted_first_entry_id").isNotNull(), F.lit("DELETED")).otherwise(F.col("state"))
    )


# What the `ledgers` catalog is derived from (`current_ledger_catalog`): the log, the recorded
# states (the engine's rollover, retention's DELETED) and retention's deleted_ledgers.
CATALOG_SOURCES = (LEDGER_ENTRIES, LEDGER_STATES_LOG, DELETED_LEDGERS)


def catalog_source_versions(warehouse: Warehouse) -> dict[str, str]:
    """The versions of the catalog's sources, for the catalog's commit: taken before the catalog
    reads them, so a write racing its run makes it stale, never fresh."""
    return DeltaTables(warehouse).versions(CATALOG_SOURCES)


def stale_catalog(warehouse: Warehouse) -> str | None:
    """Why the `ledgers` catalog must be materialized again before what reads it is right, or None
    when it is fresh (or when there is no ledger_entries to catalog).

    Stale: the catalog is missing while ledger_entries exists, or one of its sources changed rows
    (an ingest, the engine's appends or state transitions, a retention run's deletes) in a version
    after the one the catalog was derived from (`catalog_source_versions`, in its commit). Table
    maintenance (VACUUM, OPTIMIZE) changes no rows and does not count. A catalog written before it
    recorded versions is compared by commit times instead, which an ingest racing its run fools.
    Read by delta-rs (commit infos only): the `txnlake` commands and `ledgers_closed_sensor` (no JVM
    in a sensor) decide with it.
    """
    if not warehouse.exists(LEDGER_ENTRIES):
        return None
    tables = DeltaTables(warehouse)
    catalog = tables.last_commit(LEDGERS)
    if catalog is None:
        return "the `ledgers` catalog does not exist yet, while ledger_entries does"
    for source in CATALOG_SOURCES:
        derived_from = catalog.get(version_key(source))
        if derived_from is not None:
            changed = tables.rows_changed_after(source, int(derived_from))
        else:
            changed = tables.last_change(source)
            changed = changed if changed is not None and changed["timestamp"] > catalog["timestamp"] else None
        if changed is not None:
            seen = "" if derived_from is None else f", derived from its version {derived_from}"
            return (f"{source} changed (version {changed.get('version')}, {changed.get('operation')}) after the "
                    f"`ledgers` catalog was last materialized (version {catalog.get('version')}{seen})")
    return None


def known_topics(warehouse: Warehouse) -> set[str]:
    """Topics of the `ledgers` catalog (deleted ledgers included) and of ledger_entries, by delta-rs:
    the catalog is only as new as the last `txnlake run`."""
    topics = set(DeltaTables(warehouse).read(LEDGERS, LEDGERS_SCHEMA, ["topic"])["topic"].to_pylist())
    if warehouse.exists(LEDGER_ENTRIES):
        topics |= set(ledger_ranges(warehouse)["topic"].to_pylist())
    return topics


def open_ledgers(warehouse: Warehouse) -> list[tuple[str, int]]:
    """(topic, ledger_id) of the catalog's OPEN ledgers, in order (none when there is no catalog)."""
    if not warehouse.exists(LEDGERS):
        return []
    catalog = DeltaTables(warehouse).read(LEDGERS, LEDGERS_SCHEMA, ["topic", "ledger_id", "state"])
    rows = catalog.filter(pc.equal(catalog["state"], "OPEN"))
    return sorted(set(zip(rows["topic"].to_pylist(), rows["ledger_id"].to_pylist())))


def catalog_rows(warehouse: Warehouse, ledgers: list[int | tuple[str, int]]) -> list[dict]:
    """The catalog's (topic, ledger_id, state) of `ledgers`, by topic and id: an id names that ledger of
    every topic (ids repeat across topics), a (topic, ledger_id) pair one; an error naming those it
    does not hold."""
    rows = DeltaTables(warehouse).read(LEDGERS, LEDGERS_SCHEMA, ["topic", "ledger_id", "state"]).to_pylist()
    named = [r for r in rows if r["ledger_id"] in ledgers or (r["topic"], r["ledger_id"]) in ledgers]
    found = {r["ledger_id"] for r in named} | {(r["topic"], r["ledger_id"]) for r in named}
    unknown = [ledger for ledger in ledgers if ledger not in found]
    if unknown:
        ids = [r["ledger_id"] for r in rows]
        span = f"ledgers {min(ids)}..{max(ids)}" if ids else "no ledger"
        names = ", ".join(ledger_partition_key(*u) if isinstance(u, tuple) else str(u) for u in unknown)
        raise TxnlakeError(
            f"ledger(s) {names} not in the `ledgers` catalog ({len(rows)} ledger(s): {span}); "
            "nothing was offloaded. `txnlake sql dbt-free-sql/ledger_sizes.sql` lists them.")
    return sorted(named, key=lambda r: (r["topic"], r["ledger_id"]))
