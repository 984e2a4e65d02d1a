"""Recovery in the driver, as a broker recovers in-process: no Spark job on the usual path.

Recovery's work is small (a snapshot index of a few rows, one abort array per topic, the entries
after the snapshots), but on Spark it is ~10 jobs whose fixed cost exceeds a full replay
(docs/snapshots.md, "Recovery in the driver"). This path reads the segments, `ledger_states` and
the tail of `ledger_entries` with delta-rs (file statistics skip older ledgers), replays the tail
with `snapshots.replay.replay_topic` (what the Spark path runs per topic), keeps the abort set as
Arrow, and writes `recovered_buffer_state` in one delta-rs commit. Its result is the Spark path's
(`snapshots.jobs.recover_buffer_states`, the same row rules of `snapshots.index`), tested equal
row for row and to the full replay. Spark still does what is large: topics without a usable
snapshot, and a tail beyond `DriverLimits`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import DeltaTable
from pyspark.sql import functions as F

from txn_engine.buffer.kernel import NARROW_COLUMNS, ledger_filter
from txn_engine.storage.arrow_frames import arrow_schema
from txn_engine.storage.delta_io import DeltaTables, scan, version_key
from txn_engine.log.ledgers import deleted_by_topic, recorded_states_table, stale_catalog
from txn_engine.core.positions import Position
from txn_engine.core.schema import (
    LEDGER_ENTRIES,
    LEDGER_ENTRIES_SCHEMA,
    LEDGERS,
    LEDGERS_SCHEMA,
    RECOVERED_BUFFER_STATE,
    RECOVERED_BUFFER_STATE_SCHEMA,
    TXN_SNAPSHOT_SEGMENTS,
    TXN_SNAPSHOT_SEGMENTS_SCHEMA,
)
from txn_engine.snapshots.jobs import full_replay_states, recover_from_warehouse
from txn_engine.snapshots.index import IndexedSnapshot, indexed_rows, live_snapshot_index
from txn_engine.snapshots.format import Source
from txn_engine.snapshots.replay import ABORTS_TYPE, SNAPSHOT_ENTRY, SNAPSHOT_LEDGER, after_snapshot, anchor_position, replay_topic
from txn_engine.storage.warehouse import Warehouse

RECOVERED_SCHEMA = arrow_schema(RECOVERED_BUFFER_STATE_SCHEMA)


@dataclass(frozen=True)
class DriverLimits:
    """How much tail the driver replays; beyond, the whole recovery runs on Spark. The triggers
    keep a tail short (1000 changes by default), so these bound only a stale or missing snapshot."""

    max_scanned_entries: int = 2_000_000  # rows of the files left after skipping (read as Arrow)
    max_replayed_entries: int = 200_000  # entries after the snapshots (fed one by one in Python)


@dataclass
class RecoverySummary:
    path: str  # "driver" or "spark" (the tail exceeded DriverLimits)
    topics: int = 0
    replayed_entries: int = 0
    full_replay_topics: list[str] = field(default_factory=list)  # replayed in full on Spark
    seconds: dict[str, float] = field(default_factory=dict)  # per step


# -- the snapshot index over Arrow rows (`snapshots.index.live_snapshot_index`) -------------------

def snapshot_index(segments: pa.Table) -> tuple[dict[str, IndexedSnapshot], pa.ListArray]:
    """Per topic with segment rows, its live snapshot or why it cannot be used; and the aborts column."""
    aborts = segments.column("aborts").combine_chunks() if segments.num_rows else pa.array([], pa.list_(ABORTS_TYPE))
    return live_snapshot_index(indexed_rows(segments)), aborts


def snapshot_aborts(aborts: pa.ListArray, rows: tuple[int, ...], deleted: set[int]) -> pa.StructArray:
    """A snapshot's abort set (its rows' arrays in order), minus the aborts of DELETED ledgers."""
    kept = pa.concat_arrays([aborts[i].values.cast(ABORTS_TYPE) for i in rows]) if rows else pa.array([], ABORTS_TYPE)
    if deleted and len(kept):
        kept = kept.filter(pc.invert(pc.is_in(kept.field("ledger_id"), pa.array(sorted(deleted), pa.int64()))))
    return kept


# -- reading, planning and writing --------------------------------------------------------------

@contextmanager
def _step(seconds: dict[str, float], name: str) -> Iterator[None]:
    started = time.perf_counter()
    yield
    seconds[name] = round(time.perf_counter() - started, 3)


def _log_topics(warehouse: Warehouse, log: DeltaTable) -> set[str]:
    """Every topic of the log. From the `ledgers` catalog when it is fresh (`stale_catalog`): a row
    per ledger, and a ledger not DELETED there has entries; a topic with DELETED ledgers only is
    looked up in the files of those ledgers (retention may have stopped before their entries went).
    Else from the log's `topic` column, read batch by batch (dictionary-encoded): the driver holds
    the set of topics and one batch, never the column."""
    if warehouse.exists(LEDGERS) and stale_catalog(warehouse) is None:
        catalog = DeltaTables(warehouse).read(LEDGERS, LEDGERS_SCHEMA, ["topic", "ledger_id", "state"])
        deleted = pc.equal(catalog["state"], "DELETED")
        topics = set(pc.unique(catalog.filter(pc.invert(deleted))["topic"]).to_pylist())
        gone = catalog.filter(pc.and_(deleted, pc.invert(pc.is_in(catalog["topic"], pa.array(sorted(topics), pa.string())))))
        if gone.num_rows:
            left = scan(log.to_pyarrow_dataset(), ledger_filter(gone["ledger_id"]), ["topic"],
                        on_rows=ds.field("topic").isin(pc.unique(gone["topic"])))
            topics.update(pc.unique(left["topic"]).to_pylist())
        return topics
    dataset = log.to_pyarrow_dataset(parquet_read_options=ds.ParquetReadOptions(dictionary_columns={"topic"}))
    topics: set[str] = set()
    for batch in dataset.to_batches(columns=["topic"]):
        chunk = batch.column(0)
        if isinstance(chunk, pa.DictionaryArray):
            topics.update(chunk.dictionary.take(pc.unique(chunk.indices)).to_pylist())
        else:
            topics.update(pc.unique(chunk).to_pylist())
    topics.discard(None)
    return topics


def files_from_ledger(log: DeltaTable, lowest: int) -> ds.Dataset:
    """The log's files that may hold ledgers >= `lowest` (by their Delta min/max statistics)."""
    return log.to_pyarrow_dataset(file_pruning_predicate=f"ledger_id >= {lowest}")


def _tail(log: DeltaTable, usable: dict[str, IndexedSnapshot], limits: DriverLimits) -> pa.Table | None:
    """The entries after each usable snapshot's max read position (narrow columns, sorted by
    topic and position), or None when they exceed `limits`. Ledger ids increase with creation time
    (BookKeeper), so they all lie in ledgers >= the lowest max read ledger: the file statistics
    skip every older file (as `snapshots.jobs.entries_after_snapshots` does on Spark)."""
    columns = list(NARROW_COLUMNS)
    lowest = min(s.max_read.ledger_id for s in usable.values())
    dataset = files_from_ledger(log, lowest)
    if dataset.count_rows() > limits.max_scanned_entries:
        return None
    topics = sorted(usable)
    rows = scan(dataset, ds.field("ledger_id") >= lowest, columns, on_rows=ds.field("topic").isin(topics))
    at = pc.index_in(rows.column("topic"), pa.array(topics))
    rows = rows.append_column(SNAPSHOT_LEDGER, pc.take(pa.array([usable[t].max_read.ledger_id for t in topics], pa.int64()), at))
    rows = rows.append_column(SNAPSHOT_ENTRY, pc.take(pa.array([usable[t].max_read.entry_id for t in topics], pa.int64()), at))
    rows = rows.filter(after_snapshot(pc.field)).drop_columns([SNAPSHOT_LEDGER, SNAPSHOT_ENTRY])
    if rows.num_rows > limits.max_replayed_entries:
        return None
    return rows.take(pc.sort_indices(rows, sort_keys=[("topic", "ascending"), ("ledger_id", "ascending"),
                                                      ("entry_id", "ascending")]))


def _anchor(log: DeltaTable, topic: str, snap: IndexedSnapshot, deleted: set[int]) -> Position | None:
    """`replay.anchor_position` of `snap`, an older ledger's last entry looked up in the log's files."""
    def last_before(ledger: int) -> Position | None:
        older = scan(log.to_pyarrow_dataset(file_pruning_predicate=f"ledger_id < {ledger}"),
                     ds.field("ledger_id") < ledger, ["ledger_id", "entry_id"],
                     on_rows=ds.field("topic") == topic, on_rows_columns=["topic"])
        if not older.num_rows:
            return None
        last = pc.max(older.column("ledger_id")).as_py()
        return Position(last, pc.max(older.filter(pc.equal(older.column("ledger_id"), last)).column("entry_id")).as_py())

    return anchor_position(snap.max_read, deleted, last_before)


def _spark_full_replays(warehouse: Warehouse, topics: list[str]) -> list[dict]:
    """The full replay on Spark of `topics` (no usable snapshot), with their entry counts."""
    replayed = full_replay_states(warehouse.read(LEDGER_ENTRIES).where(F.col("topic").isin(topics))).toArrow()
    aborts = replayed.column("aborts").combine_chunks()
    return [{**r, "aborts": aborts[i].values.cast(ABORTS_TYPE)}
            for i, r in enumerate(replayed.drop_columns(["aborts"]).to_pylist())]


def recovered_table(rows: list[dict]) -> pa.Table:
    """`recovered_buffer_state` rows (aborts as StructArrays) as one Arrow table, sorted by topic."""
    rows = sorted(rows, key=lambda r: r["topic"])
    offsets = [0]
    for r in rows:
        offsets.append(offsets[-1] + len(r["aborts"]))
    values = pa.concat_arrays([r["aborts"] for r in rows]) if rows else pa.array([], ABORTS_TYPE)
    columns = {f.name: pa.array([r[f.name] for r in rows], f.type) for f in RECOVERED_SCHEMA if f.name != "aborts"}
    columns["aborts"] = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values,
                                                 type=RECOVERED_SCHEMA.field("aborts").type)
    return pa.table([columns[f.name] for f in RECOVERED_SCHEMA], schema=RECOVERED_SCHEMA)


def recover_to_warehouse(warehouse: Warehouse, limits: DriverLimits = DriverLimits()) -> RecoverySummary:
    """Rebuild `recovered_buffer_state` (see the module doc) and write it in one Delta commit."""
    if not warehouse.exists(LEDGER_ENTRIES):
        warehouse.read(LEDGER_ENTRIES)  # raises the warehouse's error: what to ingest or materialize
    seconds: dict[str, float] = {}
    tables = DeltaTables(warehouse)
    with _step(seconds, "index"):
        index, aborts = snapshot_index(tables.read(TXN_SNAPSHOT_SEGMENTS, TXN_SNAPSHOT_SEGMENTS_SCHEMA))
        deleted = deleted_by_topic(recorded_states_table(warehouse))
    usable = {t: s for t, s in index.items() if s.fallback_reason is None}
    log = warehouse.delta_rs_table(warehouse.path(LEDGER_ENTRIES))
    # The log's version this recovery starts from, in its commit: the check tells a recovery the
    # log has since moved past (an ingest, a retention) from a wrong one (`stale_recovery`).
    recovered_from = {version_key(LEDGER_ENTRIES): str(log.version())}
    with _step(seconds, "tail"):
        tail = _tail(log, usable, limits) if usable else None
    if usable and tail is None:
        with _step(seconds, "spark"):
            warehouse.overwrite(RECOVERED_BUFFER_STATE, recover_from_warehouse(warehouse), commit_metadata=recovered_from)
        return RecoverySummary("spark", seconds=seconds)
    rows = []
    with _step(seconds, "replay"):
        for topic, snap in usable.items():
            gone = deleted.get(topic, set())
            entries = tail.filter(pc.equal(tail["topic"], topic)) if tail is not None else \
                arrow_schema(LEDGER_ENTRIES_SCHEMA).empty_table().select(list(NARROW_COLUMNS))
            state = replay_topic(topic, snapshot_aborts(aborts, snap.rows, gone), _anchor(log, topic, snap, gone), entries)
            if state is not None:
                rows.append({"topic": topic, "max_read_ledger_id": state[0].ledger_id,
                             "max_read_entry_id": state[0].entry_id, "aborts": state[1],
                             "snapshot_id": snap.snapshot_id, "source": Source.SNAPSHOT.value,
                             "fallback_reason": None, "replayed_entries": entries.num_rows})
    with _step(seconds, "topics"):
        others = sorted(_log_topics(warehouse, log) - set(usable))
    if others:
        with _step(seconds, "spark_full_replay"):
            for r in _spark_full_replays(warehouse, others):
                reason = index[r["topic"]].fallback_reason if r["topic"] in index else "no snapshot yet"
                rows.append({**r, "snapshot_id": None, "source": Source.FULL_REPLAY.value, "fallback_reason": reason})
    with _step(seconds, "write"):
        tables.overwrite(RECOVERED_BUFFER_STATE, recovered_table(rows), RECOVERED_BUFFER_STATE_SCHEMA,
                         commit_metadata=recovered_from)
    return RecoverySummary("driver", len(rows), sum(r["replayed_entries"] for r in rows), others, seconds)


def stale_recovery(tables: DeltaTables) -> dict[str, int] | None:
    """When `ledger_entries` changed rows after the version `recovered_buffer_state` was recovered
    from (rows ingested or deleted since), the two versions; None when it did not (or the recovery
    predates this record). A full replay of today's log is then no test of it: recover again."""
    recorded = (tables.last_rows_commit(RECOVERED_BUFFER_STATE) or {}).get(version_key(LEDGER_ENTRIES))
    changed = None if recorded is None else tables.rows_changed_after(LEDGER_ENTRIES, int(recorded))
    if changed is None:
        return None
    return {"recovered_from_ledger_entries_version": int(recorded), "ledger_entries_version": changed["version"]}
