"""What a snapshot run writes and keeps, once, over Arrow (docs/snapshots.md).

The segments of a topic's abort set (`cut_segments`), the order that numbers a commit's rows
(`write_seqs`), the tombstones of stale numbered keys (`stale_parts`), what compaction keeps
(`compaction_keeps`) and the per-topic state with its trigger verdict (`snapshot_state_table`).
The driver's writer calls them on tables read by delta-rs; the Spark writer (`snapshots.jobs`) on
the segment rows' narrow columns, collected, or per topic in a Python worker (`cut_segments`).
Spark's Python workers import this module: no Spark here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Callable, Mapping, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from txn_engine.core.schema import TXN_SNAPSHOT_SEGMENTS_SCHEMA, TXN_SNAPSHOT_STATE_SCHEMA
from txn_engine.snapshots.format import END_SUFFIX, SnapshotConfig
from txn_engine.snapshots.index import BAD_REASON, as_array, end_keys, live_ends, live_snapshot_index, part_numbers
from txn_engine.snapshots.triggers import TriggerConfig, due_reasons
from txn_engine.storage.arrow_frames import arrow_schema

SEGMENTS_SCHEMA = arrow_schema(TXN_SNAPSHOT_SEGMENTS_SCHEMA)
# A segment row before its commit numbers and stamps it.
UNNUMBERED_SCHEMA = pa.schema([f for f in SEGMENTS_SCHEMA if f.name not in ("write_seq", "written_at")])
STATE_SCHEMA = arrow_schema(TXN_SNAPSHOT_STATE_SCHEMA)
ABORTED_COLUMNS = ("topic", "txn_most_bits", "txn_least_bits", "abort_ledger_id", "abort_entry_id")
# Per topic, what the log says since its snapshot (`snapshot_state_table`'s `facts`).
FACT_COLUMNS = ("topic", "txn_entries", "changes_since_snapshot")


class Planned(NamedTuple):
    """One topic's snapshot to write: its id and the max read position its end carries."""

    snapshot_id: int
    max_read_ledger_id: int | None
    max_read_entry_id: int | None


def cut_segments(aborted: pa.Table, plan: Mapping[str, Planned], config: SnapshotConfig,
                 topics: list[str] | None = None) -> pa.Table:
    """The segments (`UNNUMBERED_SCHEMA`) of a snapshot of each of `topics` (default: the plan's).

    `aborted` has `ABORTED_COLUMNS` (other topics' rows are ignored). A topic's aborts in position
    order fill parts of `SnapshotConfig.segment_capacity` while more remain, the rest (possibly none)
    going to `topic-end`, which alone carries the max read position (PIP-178)."""
    topics = sorted(plan if topics is None else topics)
    rows = aborted.select(list(ABORTED_COLUMNS))
    rows = rows.filter(pc.is_in(as_array(rows["topic"]).cast(pa.string()), pa.array(topics, pa.string())))
    rows = rows.take(pc.sort_indices(rows, sort_keys=[("topic", "ascending"), ("abort_ledger_id", "ascending"),
                                                      ("abort_entry_id", "ascending")]))
    held = dict(zip(*(c.to_pylist() for c in pc.value_counts(as_array(rows["topic"]).cast(pa.string())).flatten())))
    values = pa.StructArray.from_arrays(
        [as_array(rows[c]) for c in ABORTED_COLUMNS[1:]],
        fields=list(SEGMENTS_SCHEMA.field("aborts").type.value_type))
    columns: dict[str, list] = {f.name: [] for f in UNNUMBERED_SCHEMA}
    offsets, start = [0], 0
    for topic in topics:
        n, planned = held.get(topic, 0), plan[topic]
        capacity = config.segment_capacity(topic)
        count = max(1, -(-n // capacity))
        for index in range(1, count + 1):
            end = index == count
            offsets.append(start + min(index * capacity, n))
            columns["snapshot_key"].append(f"{topic}-{END_SUFFIX}" if end else f"{topic}-{index}")
            columns["topic"].append(topic)
            columns["max_read_ledger_id"].append(planned.max_read_ledger_id if end else -1)
            columns["max_read_entry_id"].append(planned.max_read_entry_id if end else -1)
            columns["snapshot_id"].append(planned.snapshot_id)
            columns["segment_index"].append(index)
            columns["segment_count"].append(count)
            columns["abort_count"].append(n)
            columns["tombstone"].append(False)
        start += n
    aborts = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values, type=SEGMENTS_SCHEMA.field("aborts").type)
    return pa.table([aborts if f.name == "aborts" else pa.array(columns[f.name], f.type) for f in UNNUMBERED_SCHEMA],
                    schema=UNNUMBERED_SCHEMA)


def write_seqs(keys: pa.Table, base: int) -> pa.Array:
    """The `write_seq` of each row of one commit (`topic`, `segment_index`, `snapshot_key`): after
    every stored one (`base`, the largest), in topic, part and key order."""
    order = pc.sort_indices(keys, sort_keys=[("topic", "ascending", "at_start"), ("segment_index", "ascending", "at_start"),
                                             ("snapshot_key", "ascending", "at_start")]).to_numpy()
    seqs = np.empty(len(order), dtype=np.int64)
    seqs[order] = np.arange(base + 1, base + 1 + len(order), dtype=np.int64)
    return pa.array(seqs, pa.int64())


def _newest_first(rows: pa.Table, by: list[str]) -> np.ndarray:
    """Row numbers grouped by `by`, each group's rows by `write_seq` descending (nulls last, later
    rows first among equals): the first of a group is its newest row."""
    keyed = pa.table({**{f"_k{i}": as_array(rows[c]) for i, c in enumerate(by)},
                      "_seq": as_array(rows["write_seq"]), "_n": pa.array(np.arange(rows.num_rows), pa.int64())})
    return pc.sort_indices(keyed, sort_keys=[*((f"_k{i}", "ascending", "at_end") for i in range(len(by))),
                                             ("_seq", "descending", "at_end"), ("_n", "descending", "at_end")]).to_numpy()


def _firsts(rows: pa.Table, by: list[str]) -> np.ndarray:
    """Whether each row is its group's newest (`_newest_first`)."""
    order = _newest_first(rows, by)
    keys = list(zip(*(as_array(rows[c]).take(pa.array(order)).to_pylist() for c in by)))
    first = np.zeros(rows.num_rows, dtype=bool)
    first[order[[i for i in range(len(keys)) if i == 0 or keys[i] != keys[i - 1]]]] = True
    return first


def stale_parts(rows: pa.Table, new: Mapping[str, tuple[int, int]]) -> pa.Table:
    """Tombstones (`UNNUMBERED_SCHEMA`) for the numbered keys of the topics of `new` (topic:
    (snapshot_id, segment_count)) beyond their new count whose latest row (by `write_seq`) is not
    one already: the stale parts of an older, longer snapshot. `rows`: the stored segments'
    `snapshot_key`, `topic`, `write_seq`, `tombstone`."""
    latest = rows.filter(pa.array(_firsts(rows, ["snapshot_key"])))
    topic = as_array(latest["topic"]).cast(pa.string())
    part = part_numbers(topic, latest["snapshot_key"]).to_pylist()
    tomb = pc.fill_null(as_array(latest["tombstone"]), False).to_pylist()
    picked = [(k, t, new[t][0], p) for k, t, p, dead in zip(latest["snapshot_key"].to_pylist(), topic.to_pylist(), part, tomb)
              if t in new and not dead and p is not None and p >= new[t][1]]
    picked.sort(key=lambda r: (r[1], r[3]))
    n = len(picked)
    values = {"snapshot_key": [r[0] for r in picked], "topic": [r[1] for r in picked],
              "max_read_ledger_id": [-1] * n, "max_read_entry_id": [-1] * n, "aborts": [[] for _ in picked],
              "snapshot_id": [r[2] for r in picked], "segment_index": [r[3] for r in picked],
              "segment_count": [0] * n, "abort_count": [0] * n, "tombstone": [True] * n}
    return pa.table([pa.array(values[f.name], f.type) for f in UNNUMBERED_SCHEMA], schema=UNNUMBERED_SCHEMA)


def compaction_keeps(rows: pa.Table) -> pa.Array:
    """Per stored segment row (`topic`, `snapshot_key`, `write_seq`, `tombstone`, `snapshot_id`),
    whether compaction keeps it: the latest row of its key unless a tombstone, and the newest row
    of each key of every live snapshot (the one its topic's latest `topic-end` names), which a
    newer, unfinished snapshot may have overwritten."""
    tomb = pc.fill_null(as_array(rows["tombstone"]), False).to_numpy(zero_copy_only=False)
    ids = as_array(rows["snapshot_id"]).to_pylist()
    topics = as_array(rows["topic"]).to_pylist()
    live = {t: ids[i] for t, i in live_ends(rows).items()}
    latest = _firsts(rows, ["snapshot_key"])
    of_snapshot = _firsts(rows.append_column("_tomb", pa.array(tomb)), ["snapshot_key", "snapshot_id", "_tomb"])
    live_row = np.array([ids[i] is not None and live.get(topics[i]) == ids[i] for i in range(rows.num_rows)], dtype=bool)
    return pa.array(~tomb & (latest | (of_snapshot & live_row)))


def snapshot_state_table(meta: pa.Table, count_facts: Callable[[dict[str, tuple[int, int]]], pa.Table],
                         config: TriggerConfig, now: datetime) -> pa.Table:
    """`txn_snapshot_state` (`STATE_SCHEMA`): per topic with transactional entries or segment rows,
    its state and whether a snapshot is due at `now` (`triggers.due_reasons`).

    `meta`: the segment rows' index columns with `written_at`, `BAD_REASON` and `ABORT_SIZE`
    (`index.indexed_rows`); `count_facts(positions)`: `FACT_COLUMNS` per topic of the log, its
    changes counted after its usable snapshot's max read position in `positions` (all its markers
    without one), in the driver or on Spark.
    - NO_SNAPSHOT: no usable snapshot and no unfinished one; INITIALIZING: parts newer than the
      live `topic-end` exist (a snapshot being written, or cut short); READY: otherwise.
    - INITIALIZING is due: snapshot runs hold the snapshot lock from choosing what is due to
      their state's write, so parts without their end seen then were left by a writer that
      stopped. Written again, the topic is READY and the next compaction drops those parts.
    """
    index = live_snapshot_index(meta)
    facts = count_facts({t: (s.max_read.ledger_id, s.max_read.entry_id) for t, s in index.items()
                         if s.fallback_reason is None})
    good = np.flatnonzero(pc.is_null(as_array(meta[BAD_REASON])).to_numpy(zero_copy_only=False))
    ends = {t: int(good[i]) for t, i in live_ends(meta.take(good)).items()}
    seq, written = as_array(meta["write_seq"]).to_pylist(), as_array(meta["written_at"]).to_pylist()
    end_seq = {t: seq[i] for t, i in ends.items()}
    unfinished: dict[str, int] = {}
    is_end = end_keys(meta["topic"], meta["snapshot_key"]).to_pylist()
    tomb = pc.fill_null(as_array(meta["tombstone"]), False).to_pylist()
    for topic, end, dead, s in zip(as_array(meta["topic"]).to_pylist(), is_end, tomb, seq):
        if topic is not None and end is False and not dead and (
                end_seq.get(topic) is None or (s is not None and s > end_seq[topic])):
            unfinished[topic] = unfinished.get(topic, 0) + 1
    by_topic = {r["topic"]: r for r in facts.select(list(FACT_COLUMNS)).to_pylist()}
    topics = sorted({t for t, r in by_topic.items() if (r["txn_entries"] or 0) > 0} | set(index))
    rows = []
    for topic in topics:
        snap, fact = index.get(topic), by_topic.get(topic, {})
        has = snap is not None and snap.fallback_reason is None and snap.snapshot_id is not None
        rows.append({"topic": topic, "has_snapshot": has, "unfinished": unfinished.get(topic, 0) > 0,
                     "first_due": not has and (fact.get("txn_entries") or 0) > 0,
                     "changes_since_snapshot": fact.get("changes_since_snapshot") or 0,
                     "last_snapshot_at": written[ends[topic]] if topic in ends else None, "snap": snap})
    due = pa.table({"has_snapshot": pa.array([r["has_snapshot"] for r in rows], pa.bool_()),
                    "unfinished": pa.array([r["unfinished"] for r in rows], pa.bool_()),
                    "first_due": pa.array([r["first_due"] for r in rows], pa.bool_()),
                    "changes_since_snapshot": pa.array([r["changes_since_snapshot"] for r in rows], pa.int64()),
                    "last_snapshot_at": pa.array([r["last_snapshot_at"] for r in rows], STATE_SCHEMA.field("last_snapshot_at").type)})
    reasons = due_reasons(due, config, now).to_pylist()
    out = []
    for r, reason in zip(rows, reasons):
        snap, has = r["snap"], r["has_snapshot"]
        out.append({"topic": r["topic"],
                    "state": "INITIALIZING" if r["unfinished"] else "READY" if has else "NO_SNAPSHOT",
                    "snapshot_id": snap.snapshot_id if has else None,
                    "segment_count": snap.segment_count if has else None,
                    "abort_count": snap.abort_count if has else None,
                    "max_read_ledger_id": snap.max_read.ledger_id if has else None,
                    "max_read_entry_id": snap.max_read.entry_id if has else None,
                    "changes_since_snapshot": r["changes_since_snapshot"],
                    "last_snapshot_at": r["last_snapshot_at"] if has else None,
                    "due": reason is not None, "due_reason": reason, "updated_at": now})
    return pa.Table.from_pylist(out, schema=STATE_SCHEMA)

