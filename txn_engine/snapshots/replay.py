"""Recovery's replay of one topic, once, over Arrow: what is replayed after a snapshot and what it gives.

The driver's recovery (`snapshots.recovery`) calls `replay_topic` per topic; the Spark path
(`snapshots.jobs.replayed_states`) runs the same function per topic in a Python worker, the tail
and the snapshot cogrouped by topic. A topic without a usable snapshot is the same call with no
aborts and no anchor over all its entries: the full replay. The buffer's rules are the kernel's
(`buffer.kernel.full_scope_tables`); this module states only how a snapshot's state is carried in.
"""

from __future__ import annotations

from typing import Callable, Container

import pyarrow as pa
import pyarrow.compute as pc

from txn_engine.buffer import kernel
from txn_engine.buffer.kernel import NARROW_COLUMNS
from txn_engine.core.log_types import EntryType
from txn_engine.core.positions import Position
from txn_engine.core.schema import ABORT_STRUCT, ABORTED_TXNS, LEDGER_ENTRIES_SCHEMA, STABLE_POSITIONS
from txn_engine.log.spark_columns import position_lt
from txn_engine.storage.arrow_frames import arrow_schema, arrow_type

ABORTS_TYPE = arrow_type(ABORT_STRUCT)
NARROW_SCHEMA = pa.schema([arrow_schema(LEDGER_ENTRIES_SCHEMA).field(c).with_nullable(True) for c in NARROW_COLUMNS])
# Per topic replayed: its buffer after the replay (as `recovered_buffer_state` holds it) and how many
# entries of the log were replayed (the anchor is not one).
REPLAYED_SCHEMA = pa.schema([("topic", pa.string()), ("max_read_ledger_id", pa.int64()), ("max_read_entry_id", pa.int64()),
                             ("aborts", pa.list_(ABORTS_TYPE)), ("replayed_entries", pa.int64())])
# The snapshot side of a topic on Spark: its trimmed aborts and its anchor (null when none).
SNAPSHOT_COLUMNS = ("_kept", "_anchor_ledger_id", "_anchor_entry_id")

# Beside each entry, its topic's snapshot max read position: the columns `after_snapshot` compares.
SNAPSHOT_LEDGER, SNAPSHOT_ENTRY = "_sl", "_se"


def after_snapshot(col):
    """The tail recovery replays: an entry after its topic's snapshot max read position (in the
    `SNAPSHOT_LEDGER`, `SNAPSHOT_ENTRY` columns beside it). `col` names a column: `pc.field` in the
    driver (a pyarrow filter), `F.col` on Spark; operators only, so it is one rule either way (as
    `tier.reader.read_limit`)."""
    return position_lt(col(SNAPSHOT_LEDGER), col(SNAPSHOT_ENTRY), col("ledger_id"), col("entry_id"))


def anchor_position(max_read: Position, deleted: Container[int],
                    last_before: Callable[[int], Position | None]) -> Position | None:
    """The last remaining position at or before a snapshot's max read position: the log's end so far
    and the previous non-empty ledger of the position-before rule. The max read position itself
    unless its ledger was deleted since; then `last_before(ledger)`, the last entry of the topic's
    last remaining ledger before it. None when the snapshot saw no entry."""
    if max_read.entry_id < 0:
        return None
    if max_read.ledger_id not in deleted:
        return max_read
    return last_before(max_read.ledger_id)


def replay_input(topic: str, kept: pa.StructArray, anchor: Position | None, tail: pa.Table) -> pa.Table:
    """What the kernel replays after a snapshot (`NARROW_COLUMNS`): the tail (`tail`: the entries
    after the max read position), with every entry of a transaction in the snapshot's trimmed abort
    set (`kept`) made plain (no transaction, no sequence: it is closed, so a later marker is a
    duplicate and later data late, both only moving the log's end, exactly as the full replay treats
    them), and one plain entry at the anchor (`anchor_position`)."""
    rows = tail.select(list(NARROW_COLUMNS)).cast(NARROW_SCHEMA)
    if len(kept):
        closed = pa.table({"txn_most_bits": kept.field("txn_most_bits"), "txn_least_bits": kept.field("txn_least_bits"),
                           "_closed": pa.array([True] * len(kept), pa.bool_())}).group_by(
            ["txn_most_bits", "txn_least_bits"], use_threads=False).aggregate([("_closed", "min")])
        rows = rows.join(closed, ["txn_most_bits", "txn_least_bits"], join_type="left outer")
        plain = pc.fill_null(rows["_closed_min"], False)
        for name in ("txn_most_bits", "txn_least_bits", "producer_id", "producer_epoch", "sequence_id"):
            rows = rows.set_column(rows.schema.get_field_index(name), name,
                                   pc.if_else(plain, pa.nulls(rows.num_rows, rows.schema.field(name).type), rows[name]))
        rows = rows.set_column(rows.schema.get_field_index("entry_type"), "entry_type",
                               pc.if_else(plain, pa.scalar(EntryType.DATA.value), rows["entry_type"]))
        rows = rows.select(list(NARROW_COLUMNS)).cast(NARROW_SCHEMA)
    if anchor is not None:
        at = {c: None for c in NARROW_COLUMNS} | {"topic": topic, "ledger_id": anchor.ledger_id,
                                                  "entry_id": anchor.entry_id, "entry_type": EntryType.DATA.value}
        rows = pa.concat_tables([rows, pa.Table.from_pylist([at], schema=NARROW_SCHEMA)])
    return rows


def in_position_order(aborts: pa.StructArray) -> pa.StructArray:
    """An abort set in abort-marker order (oldest first), as the brief keeps it (sorted only when needed)."""
    n = len(aborts)
    if n < 2:
        return aborts
    lid, eid = aborts.field("ledger_id"), aborts.field("entry_id")
    a_l, b_l, a_e, b_e = lid.slice(0, n - 1), lid.slice(1), eid.slice(0, n - 1), eid.slice(1)
    if pc.all(kernel.position_lt(a_l, a_e, b_l, b_e)).as_py():
        return aborts
    keys = [(c, "ascending") for c in ("ledger_id", "entry_id", "txn_most_bits", "txn_least_bits")]
    return aborts.take(pc.sort_indices(pa.RecordBatch.from_struct_array(aborts), sort_keys=keys))


def replay_topic(topic: str, kept: pa.StructArray, anchor: Position | None,
                 tail: pa.Table) -> tuple[Position, pa.StructArray] | None:
    """The buffer of `topic` from its trimmed snapshot aborts (`kept`), its anchor and the entries
    after it (`tail`), decided by the buffer kernel: its max read position, and `kept` followed by
    the new aborts in abort-marker order. With no aborts, no anchor and every entry of the topic:
    the full replay. None when there is neither anchor nor entry."""
    replayed = replay_input(topic, kept, anchor, tail)
    if not replayed.num_rows:
        return None
    decided = kernel.full_scope_tables(replayed)
    (stable,) = decided.tables[STABLE_POSITIONS].to_pylist()
    new = decided.tables[ABORTED_TXNS]
    added = pa.StructArray.from_arrays([new["txn_most_bits"].combine_chunks(), new["txn_least_bits"].combine_chunks(),
                                        new["abort_ledger_id"].combine_chunks(), new["abort_entry_id"].combine_chunks()],
                                       fields=list(ABORTS_TYPE))
    aborts = pa.concat_arrays([kept.cast(ABORTS_TYPE), added]) if len(added) else kept.cast(ABORTS_TYPE)
    return Position(stable["max_read_ledger_id"], stable["max_read_entry_id"]), in_position_order(aborts)


def no_aborts() -> pa.StructArray:
    return pa.array([], ABORTS_TYPE)


def replayed_rows(key: tuple[pa.Scalar, ...], tail: pa.Table, snapshot: pa.Table | None) -> pa.Table:
    """`replay_topic` as Spark's cogrouped Arrow function: one topic's tail (`NARROW_COLUMNS`) and its
    snapshot side (at most one row of `SNAPSHOT_COLUMNS`; none for a full replay), to a
    `REPLAYED_SCHEMA` row (none when `replay_topic` gives none)."""
    topic = key[0].as_py()
    kept, anchor = no_aborts(), None
    if snapshot is not None and snapshot.num_rows:
        side = snapshot.select(list(SNAPSHOT_COLUMNS)).slice(0, 1).combine_chunks()
        kept_list = side.column(0).chunk(0)
        if kept_list.null_count == 0:
            kept = kept_list.flatten().cast(ABORTS_TYPE)
        ledger, entry = side.column(1)[0].as_py(), side.column(2)[0].as_py()
        anchor = None if ledger is None else Position(ledger, entry)
    state = replay_topic(topic, kept, anchor, tail)
    if state is None:
        return REPLAYED_SCHEMA.empty_table()
    (max_read, aborts) = state
    return pa.table([pa.array([topic]), pa.array([max_read.ledger_id], pa.int64()), pa.array([max_read.entry_id], pa.int64()),
                     pa.ListArray.from_arrays(pa.array([0, len(aborts)], pa.int32()), aborts, type=pa.list_(ABORTS_TYPE)),
                     pa.array([tail.num_rows], pa.int64())], schema=REPLAYED_SCHEMA)


def full_replay_rows(key: tuple[pa.Scalar, ...], tail: pa.Table) -> pa.Table:
    """`replayed_rows` of a topic without a snapshot: all its entries (Spark's grouped Arrow function)."""
    return replayed_rows(key, tail, None)
