"""The transaction-buffer kernel: every rule of the buffer, once, over Arrow tables of narrow columns.

`scope_tables` decides a scope (some ledgers of some topics, with the state of the others) from
the narrow columns of its entries (`NARROW_COLUMNS`, never a payload) and returns every narrow
table a run writes plus its decisions on rows (`VISIBLE`, `PENDING`); the caller selects the
wide rows from them. Every fact is a topic's own, so callers may run it a topic at a time: in the
driver a thread per topic, on Spark a group per topic (`spark_runner`). The pure-Python
reference (`transaction_buffer`) is the test oracle of this module, not a part of it.

Row identity: `_row` is a row's index in the scope's narrow table (then the pending rows read
from the state), carried through the steps, so the caller can pick full rows by mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from txn_engine.storage.arrow_frames import arrow_schema
from txn_engine.core.errors import TxnlakeError
from txn_engine.core.log_types import EntryType, Violation
from txn_engine.core.positions import Position, position_before
from txn_engine.core.schema import (
    ABORTED_TXNS,
    ABORTED_TXNS_SCHEMA,
    BUFFER_DUPLICATES,
    BUFFER_LEDGER_TXNS,
    BUFFER_PENDING_ENTRIES,
    BUFFER_SEQUENCE_RANGES,
    COMMITTED_ENTRIES,
    STABLE_POSITIONS,
    TXN_MARKERS,
    BUFFER_DUPLICATES_SCHEMA,
    BUFFER_LEDGER_TXNS_SCHEMA,
    BUFFER_SEQUENCE_RANGES_SCHEMA,
    COMMITTED_ENTRIES_SCHEMA,
    LEDGER_ENTRIES_SCHEMA,
    LEDGER_ENTRY_COLUMNS,
    POSITION_COLUMNS,
    STABLE_POSITIONS_SCHEMA,
    TXN_MARKERS_SCHEMA,
)

TXN_KEY = ["topic", "txn_most_bits", "txn_least_bits"]
# A null epoch is one value (a key with nulls is grouped, never joined, so nulls compare equal).
SEQUENCE_KEY = ["topic", "producer_id", "producer_epoch", "sequence_id"]
PRODUCER_KEY = ["topic", "producer_id", "producer_epoch"]
POSITIONS = list(POSITION_COLUMNS)
VIOLATIONS = tuple(v.value for v in Violation)
# The only columns the rules read; the rest (payload above all) is selected by the caller.
NARROW_COLUMNS = ("topic", "ledger_id", "entry_id", "entry_type", "txn_most_bits", "txn_least_bits",
                  "producer_id", "producer_epoch", "sequence_id")
# Every table a buffer run writes, and the ones of them without entry rows (a row per
# transaction and ledger at most, per topic, producer and ledger, or per topic).
TABLE_SCHEMAS = {
    TXN_MARKERS: TXN_MARKERS_SCHEMA,
    ABORTED_TXNS: ABORTED_TXNS_SCHEMA,
    COMMITTED_ENTRIES: COMMITTED_ENTRIES_SCHEMA,
    STABLE_POSITIONS: STABLE_POSITIONS_SCHEMA,
    BUFFER_PENDING_ENTRIES: LEDGER_ENTRIES_SCHEMA,
    BUFFER_DUPLICATES: BUFFER_DUPLICATES_SCHEMA,
    BUFFER_SEQUENCE_RANGES: BUFFER_SEQUENCE_RANGES_SCHEMA,
    BUFFER_LEDGER_TXNS: BUFFER_LEDGER_TXNS_SCHEMA,
}
NARROW_TABLES = (TXN_MARKERS, ABORTED_TXNS, STABLE_POSITIONS, BUFFER_DUPLICATES, BUFFER_SEQUENCE_RANGES, BUFFER_LEDGER_TXNS)
# The kernel's decisions on rows, beside the tables it writes whole.
VISIBLE = "visible"  # per committed row: `_row`, its position and VISIBLE_COLUMNS
PENDING = "pending"  # per row of the scope to keep in `buffer_pending_entries`: `_row` and its position
VISIBLE_COLUMNS = ("visible_ledger_id", "visible_entry_id", "local_seq", "in_stable_prefix")
_NULL_LONG = pa.scalar(None, pa.int64())


# -- column helpers ------------------------------------------------------------------------------

def is_data(table: pa.Table) -> pa.ChunkedArray:
    return pc.equal(table["entry_type"], EntryType.DATA.value)


def has_txn(table: pa.Table) -> pa.ChunkedArray:
    return pc.and_(pc.is_valid(table["txn_most_bits"]), pc.is_valid(table["txn_least_bits"]))


def is_marker(table: pa.Table) -> pa.ChunkedArray:
    return pc.and_(pc.invert(is_data(table)), has_txn(table))


def has_sequence(table: pa.Table) -> pa.ChunkedArray:
    return pc.and_(pc.is_valid(table["producer_id"]), pc.is_valid(table["sequence_id"]))


def position_lt(ledger, entry, other_ledger, other_entry) -> pa.ChunkedArray:
    return pc.or_(pc.less(ledger, other_ledger), pc.and_(pc.equal(ledger, other_ledger), pc.less(entry, other_entry)))


def position_le(ledger, entry, other_ledger, other_entry) -> pa.ChunkedArray:
    return pc.or_(pc.less(ledger, other_ledger),
                  pc.and_(pc.equal(ledger, other_ledger), pc.less_equal(entry, other_entry)))


def require_ledger_entries(entries) -> None:
    """Refuse a table (Arrow or Spark) without the ledger_entries columns, before any work."""
    names = entries.column_names if isinstance(entries, pa.Table) else entries.columns
    missing = [c for c in LEDGER_ENTRY_COLUMNS if c not in names]
    if missing:
        raise TxnlakeError(
            f"the transaction buffer needs the ledger_entries columns; missing: {', '.join(missing)}. "
            "Pass the ledger_entries table (txn_engine.core.schema.LEDGER_ENTRIES_SCHEMA), e.g. warehouse.read('ledger_entries')."
        )


def conform(table: pa.Table, schema) -> pa.Table:
    """Exactly the schema's columns, in its order and Arrow types (`schema.py` stays the one definition)."""
    target = arrow_schema(schema)
    return pa.Table.from_arrays([table[f.name].cast(f.type) for f in target], schema=target)


def group_starts(table: pa.Table, keys: Iterable[str]) -> np.ndarray:
    """On a table sorted by `keys`: True where a row begins a new group (nulls equal each other)."""
    n = table.num_rows
    starts = np.zeros(n, dtype=bool)
    if n == 0:
        return starts
    starts[0] = True
    for key in keys:
        column = table[key].combine_chunks()
        after, before = column.slice(1), column.slice(0, n - 1)
        same = pc.or_(pc.fill_null(pc.equal(after, before), False), pc.and_(pc.is_null(after), pc.is_null(before)))
        starts[1:] |= ~same.to_numpy(zero_copy_only=False)
    return starts


def rank_in_group(starts: np.ndarray) -> np.ndarray:
    """0, 1, 2, ... within each group of a sorted table (`group_starts`)."""
    index = np.arange(len(starts))
    return index - np.maximum.accumulate(np.where(starts, index, 0))


def grouped(table: pa.Table, groups: list[str], then: list[str] = ()) -> pa.Table:
    """`table` with the rows of each `groups` group adjacent, ascending by `then` within a group.

    The groups' own order is not lexical: a string key is sorted by a dictionary code of it, which
    halves the sort (docs/benchmarks.md, "Buffer").
    """
    keys = table.select(list(groups) + list(then))
    for i, name in enumerate(groups):
        if pa.types.is_string(keys.schema.field(name).type) or pa.types.is_large_string(keys.schema.field(name).type):
            # Encoded whole: a chunked array's chunks would each get a dictionary of their own.
            keys = keys.set_column(i, name, pc.dictionary_encode(keys[name].combine_chunks()).indices)
    return table.take(pc.sort_indices(keys, [(c, "ascending") for c in keys.column_names]))


def first_per_group(table: pa.Table, keys: list[str], order: list[str]) -> pa.Table:
    """The first row of each `keys` group by `order` (ascending): min_by, exactly, on any columns."""
    ordered = grouped(table, keys, order)
    return ordered.filter(pa.array(group_starts(ordered, keys)))


def rows_mask(num_rows: int, rows: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A mask of `num_rows` rows, True at these row numbers (`_row`)."""
    mask = np.zeros(num_rows, dtype=bool)
    mask[rows.to_numpy()] = True
    return mask


def with_row_index(entries: pa.Table) -> pa.Table:
    return entries.append_column("_row", pa.array(np.arange(entries.num_rows, dtype=np.int64)))


# -- the facts ----------------------------------------------------------------------------------

def sequenced(narrow: pa.Table, columns: list[str] | None = None) -> pa.Table:
    """DATA entries with both producer_id and sequence_id: the ones de-duplication looks at; only
    their `columns` when given (a filter copies every column it keeps)."""
    mask = pc.and_(is_data(narrow), has_sequence(narrow))
    return (narrow if columns is None else narrow.select(columns)).filter(mask)


def by_sequence(narrow: pa.Table) -> pa.Table:
    """The sequenced DATA rows of `narrow` (which has `_row`): key, position and `_row`, each key's
    rows together in position order. De-duplication and the sequence ranges both read them."""
    return grouped(sequenced(narrow, SEQUENCE_KEY + ["ledger_id", "entry_id", "_row"]), SEQUENCE_KEY, ["ledger_id", "entry_id"])


def duplicate_positions(narrow: pa.Table, ordered: pa.Table | None = None) -> pa.Table:
    """Positions of DATA entries repeating an earlier (topic, producer_id, producer_epoch,
    sequence_id) of `narrow` (with `_row`; `ordered`: its `by_sequence`, when at hand)."""
    ordered = by_sequence(narrow) if ordered is None else ordered
    return ordered.filter(pa.array(~group_starts(ordered, SEQUENCE_KEY))).select(POSITIONS)


def duplicates_of_earlier_ledgers(narrow: pa.Table, earlier_ranges: pa.Table) -> pa.Table:
    """Positions of DATA entries whose key a run of an earlier ledger of the topic holds.

    Per scope ledger L and (topic, producer, epoch): the runs of ledgers before L sorted by their first
    sequence id, with the running maximum of their last; an id is held when the last run
    starting at or before it reaches it (exact even if runs overlapped).
    """
    if not earlier_ranges.num_rows:  # a first or full run: no earlier ledger to repeat
        return _empty(POSITIONS, narrow)
    entries = sequenced(narrow, SEQUENCE_KEY + ["ledger_id", "entry_id"])
    hits = []
    for ledger in pc.unique(entries["ledger_id"]).to_pylist():
        ranges = earlier_ranges.filter(pc.less(earlier_ranges["ledger_id"], ledger))
        if ranges.num_rows == 0:
            continue
        here = entries.filter(pc.equal(entries["ledger_id"], ledger))
        ranges = ranges.sort_by([(c, "ascending") for c in PRODUCER_KEY] + [("first_sequence_id", "ascending")])
        here = here.sort_by([(c, "ascending") for c in PRODUCER_KEY])
        range_groups = _groups(ranges, PRODUCER_KEY)
        firsts = ranges["first_sequence_id"].to_numpy()
        lasts = ranges["last_sequence_id"].to_numpy()
        sequence_ids = here["sequence_id"].to_numpy()
        held = np.zeros(here.num_rows, dtype=bool)
        for key, (lo, hi) in _groups(here, PRODUCER_KEY).items():
            bounds = range_groups.get(key)
            if bounds is None:
                continue
            start, end = bounds
            reach = np.maximum.accumulate(lasts[start:end])
            ids = sequence_ids[lo:hi]
            at = np.searchsorted(firsts[start:end], ids, side="right") - 1
            held[lo:hi] = (at >= 0) & (reach[np.maximum(at, 0)] >= ids)
        hits.append(here.filter(pa.array(held)).select(POSITIONS))
    return pa.concat_tables(hits, promote_options="default") if hits else _empty(POSITIONS, narrow)


def _groups(ordered: pa.Table, keys: list[str]) -> dict[tuple, tuple[int, int]]:
    """(key values) -> (first row, end row) of each group of a table sorted by `keys`."""
    starts = np.flatnonzero(group_starts(ordered, keys))
    ends = np.append(starts[1:], ordered.num_rows)
    values = [ordered[k].take(pa.array(starts)).to_pylist() for k in keys] if len(starts) else [[] for _ in keys]
    return {key: (int(s), int(e)) for key, s, e in zip(zip(*values), starts, ends)}


def _empty(columns: list[str], like: pa.Table) -> pa.Table:
    return pa.schema([like.schema.field(c) for c in columns]).empty_table()


def distinct_positions(*tables: pa.Table) -> pa.Table:
    both = pa.concat_tables([t.select(POSITIONS) for t in tables], promote_options="default")
    return both.group_by(POSITIONS, use_threads=False).aggregate([])


def is_duplicate(narrow: pa.Table, duplicates: pa.Table) -> np.ndarray:
    """Per row of `narrow` (which has `_row`): whether its position is one of `duplicates`."""
    if not duplicates.num_rows:
        return np.zeros(narrow.num_rows, dtype=bool)
    hit = narrow.select(POSITIONS + ["_row"]).join(duplicates.select(POSITIONS), POSITIONS, join_type="left semi")
    return rows_mask(narrow.num_rows, hit["_row"])


def by_ledger_txn(narrow: pa.Table, duplicate: np.ndarray) -> pa.Table:
    """Per (topic, ledger_id, txn): entry count, last entry, markers, first kept DATA, duplicates
    (`BUFFER_LEDGER_TXNS_SCHEMA`): the per-ledger facts every other fact is a fold of.

    `duplicate` flags the rows of `narrow` (by `_row`) that are duplicates. The first marker's
    kind is taken with its entry id in one min: entry_id * 2 + (0 for COMMIT, 1 for ABORT), exact
    for entry ids below 2**62.
    """
    dup = pa.array(duplicate[narrow["_row"].to_numpy()])
    marker = is_marker(narrow)
    entry = narrow["entry_id"]
    kind = pc.if_else(pc.equal(narrow["entry_type"], EntryType.COMMIT.value), 0, 1)
    columns = {
        "topic": narrow["topic"], "ledger_id": narrow["ledger_id"],
        "txn_most_bits": narrow["txn_most_bits"], "txn_least_bits": narrow["txn_least_bits"],
        "entry_id": entry,
        "_marker": pc.if_else(marker, entry, _NULL_LONG),
        "_marker_kind": pc.if_else(marker, pc.add(pc.multiply(entry, 2), kind), _NULL_LONG),
        "_kept_data": pc.if_else(pc.and_(pc.and_(is_data(narrow), has_txn(narrow)), pc.invert(dup)), entry, _NULL_LONG),
        "_dup": pc.if_else(dup, 1, _NULL_LONG),
    }
    grouped = pa.table(columns).group_by(["topic", "ledger_id", "txn_most_bits", "txn_least_bits"], use_threads=False).aggregate([
        ("entry_id", "count"), ("entry_id", "max"), ("_marker", "count"), ("_marker", "min"),
        ("_marker_kind", "min"), ("_kept_data", "min"), ("_dup", "count"),
    ])
    first_kind = grouped["_marker_kind_min"]
    return conform(pa.table({
        "topic": grouped["topic"], "ledger_id": grouped["ledger_id"],
        "txn_most_bits": grouped["txn_most_bits"], "txn_least_bits": grouped["txn_least_bits"],
        "entry_count": grouped["entry_id_count"], "last_entry_id": grouped["entry_id_max"],
        "marker_count": grouped["_marker_count"], "marker_entry_id": grouped["_marker_min"],
        "marker_is_commit": pc.equal(pc.bit_wise_and(first_kind, 1), 0),
        "data_entry_id": grouped["_kept_data_min"], "duplicate_count": grouped["_dup_count"],
    }), BUFFER_LEDGER_TXNS_SCHEMA)


def txns_from_ledger_txns(ledger_txns: pa.Table) -> pa.Table:
    """Per (topic, txn): marker_count, the first marker (ledger, entry, outcome) and the first kept
    data entry."""
    rows = ledger_txns.filter(has_txn(ledger_txns))
    counts = rows.group_by(TXN_KEY, use_threads=False).aggregate([("marker_count", "sum")]).rename_columns(
        TXN_KEY + ["marker_count"])
    markers = first_per_group(rows.filter(pc.is_valid(rows["marker_entry_id"])), TXN_KEY, ["ledger_id"]).select(
        TXN_KEY + ["ledger_id", "marker_entry_id", "marker_is_commit"]).rename_columns(
        TXN_KEY + ["marker_ledger_id", "marker_entry_id", "_is_commit"])
    data = first_per_group(rows.filter(pc.is_valid(rows["data_entry_id"])), TXN_KEY, ["ledger_id"]).select(
        TXN_KEY + ["ledger_id", "data_entry_id"]).rename_columns(TXN_KEY + ["first_data_ledger_id", "first_data_entry_id"])
    txns = counts.join(markers, TXN_KEY, join_type="left outer").join(data, TXN_KEY, join_type="left outer")
    # A transaction whose every entry was a duplicate never existed for the buffer.
    txns = txns.filter(pc.or_(pc.greater(txns["marker_count"], 0), pc.is_valid(txns["first_data_ledger_id"])))
    outcome = pc.if_else(txns["_is_commit"], EntryType.COMMIT.value, EntryType.ABORT.value)
    return txns.drop_columns(["_is_commit"]).append_column("outcome", outcome)


def txns_of(narrow: pa.Table) -> pa.Table:
    """`txns_from_ledger_txns` of whole histories (`narrow`: every entry of their topics), retried
    duplicates dropped first: where each transaction stands on each topic."""
    narrow = with_row_index(narrow.select(list(NARROW_COLUMNS)))
    return txns_from_ledger_txns(by_ledger_txn(narrow, is_duplicate(narrow, duplicate_positions(narrow))))


def stable_positions(txns: pa.Table, ledgers: Iterable[tuple[str, int, int]]) -> pa.Table:
    """Per topic of `ledgers` ((topic, ledger_id, last_entry_id) of every ledger): the max read
    position, the last position and the ongoing count."""
    ongoing = txns.filter(pc.equal(txns["marker_count"], 0))  # every row left has kept data
    first: dict[str, tuple[Position, int]] = {}
    for topic, ledger, entry in zip(*(ongoing[c].to_pylist() for c in ("topic", "first_data_ledger_id", "first_data_entry_id"))):
        at, count = first.get(topic, (None, 0))
        here = Position(ledger, entry)
        first[topic] = (here if at is None or here < at else at, count + 1)
    last_entries: dict[str, dict[int, int]] = {}
    for topic, ledger, last in ledgers:
        last_entries.setdefault(topic, {})[ledger] = last
    rows = []
    for topic, by_ledger in sorted(last_entries.items()):
        last_ledger = max(by_ledger)
        end = Position(last_ledger, by_ledger[last_ledger])
        at, count = first.get(topic, (None, 0))
        if at is None:
            stable = end
        else:
            earlier = [ledger for ledger in by_ledger if ledger < at.ledger_id]
            stable = position_before(at, Position(max(earlier), by_ledger[max(earlier)]) if earlier else None)
        rows.append({"topic": topic, "max_read_ledger_id": stable.ledger_id, "max_read_entry_id": stable.entry_id,
                     "last_ledger_id": end.ledger_id, "last_entry_id": end.entry_id, "ongoing_txn_count": count})
    return pa.Table.from_pylist(rows, schema=arrow_schema(STABLE_POSITIONS_SCHEMA))


def markers_from_txns(txns: pa.Table) -> pa.Table:
    first = txns.filter(pc.greater(txns["marker_count"], 0))
    return conform(first.rename_columns([{"marker_ledger_id": "ledger_id", "marker_entry_id": "entry_id"}.get(c, c)
                                         for c in first.column_names]), TXN_MARKERS_SCHEMA)


def aborted_from_txns(txns: pa.Table) -> pa.Table:
    aborted = txns.filter(pc.equal(txns["outcome"], EntryType.ABORT.value))
    return conform(aborted.rename_columns([{"marker_ledger_id": "abort_ledger_id", "marker_entry_id": "abort_entry_id"}
                                           .get(c, c) for c in aborted.column_names]), ABORTED_TXNS_SCHEMA)


def committed_txns(txns: pa.Table) -> pa.Table:
    """(topic, txn, visible_ledger_id, visible_entry_id) of the committed transactions."""
    committed = txns.filter(pc.equal(txns["outcome"], EntryType.COMMIT.value))
    return committed.select(TXN_KEY + ["marker_ledger_id", "marker_entry_id"]).rename_columns(
        TXN_KEY + ["visible_ledger_id", "visible_entry_id"])


def read_committed(data: pa.Table, committed: pa.Table, stable: pa.Table) -> pa.Table:
    """The `VISIBLE` decisions: which kept DATA rows of `data` (narrow, with `_row`) a read-committed
    reader sees, where (`visible_ledger_id`, `visible_entry_id`), in what order (`local_seq`) and
    whether at or below the stable position (`in_stable_prefix`), in no set order: each reader
    orders them as it needs (`select_rows` by `_row`, `visible_segments` by position).

    Transactional rows of a transaction missing from `committed` are left out.
    """
    txn = has_txn(data)
    plain = data.select(POSITIONS + ["_row"]).filter(pc.invert(txn))
    plain = plain.append_column("visible_ledger_id", plain["ledger_id"]).append_column(
        "visible_entry_id", plain["entry_id"]).append_column("local_seq", pa.array(np.zeros(plain.num_rows, dtype=np.int64)))
    # Numbered over all the transaction's kept data, then cut at the marker.
    ordered = grouped(data.select(TXN_KEY + ["ledger_id", "entry_id", "_row"]).filter(txn), TXN_KEY, ["ledger_id", "entry_id"])
    ordered = ordered.append_column("local_seq", pa.array(rank_in_group(group_starts(ordered, TXN_KEY)).astype(np.int64)))
    numbered = ordered.join(committed, TXN_KEY, join_type="inner")
    numbered = numbered.filter(position_lt(numbered["ledger_id"], numbered["entry_id"],
                                           numbered["visible_ledger_id"], numbered["visible_entry_id"]))
    visible = pa.concat_tables([plain.select(_VISIBLE_COLUMNS), numbered.select(_VISIBLE_COLUMNS)], promote_options="default")
    stable_at = stable.select(["topic", "max_read_ledger_id", "max_read_entry_id"])
    visible = visible.join(stable_at, "topic", join_type="inner")
    in_prefix = position_le(visible["ledger_id"], visible["entry_id"], visible["max_read_ledger_id"], visible["max_read_entry_id"])
    return visible.select(_VISIBLE_COLUMNS).append_column("in_stable_prefix", in_prefix)


_VISIBLE_COLUMNS = POSITIONS + ["_row", "visible_ledger_id", "visible_entry_id", "local_seq"]


# `VISIBLE` as segments of a ledger's entry ids, for a join by (topic, ledger) and a lookup by entry
# id (the Spark runner's committed rows): a row's code is -1 when it is not visible, else
# local_seq << 32 | target << 2 | at_own_position, where `target` indexes the segment's `targets`
# (the visible positions that are not the rows' own). Bit 1 is unused: the Spark runner stamps
# `in_stable_prefix` against the run's last stable position (`fold_scopes`), not a chunk's.
SEGMENT_GAP = 1024  # entry ids further apart than this start a new segment
CODE_SEQ_SHIFT, CODE_TARGET_SHIFT = 32, 2
CODE_TARGET_MASK = (1 << 30) - 1
SEGMENT_SCHEMA = pa.schema([("ledger_id", pa.int64()), ("first_entry_id", pa.int64()), ("last_entry_id", pa.int64()),
                            ("codes", pa.list_(pa.int64())),
                            ("targets", pa.list_(pa.struct([("ledger_id", pa.int64()), ("entry_id", pa.int64())])))])


def visible_segments(visible: pa.Table) -> pa.Table:
    """One topic's `VISIBLE` decisions as `SEGMENT_SCHEMA` rows (see above): a few rows per ledger,
    eight bytes per entry id they span."""
    # Only the columns read are sorted: VISIBLE comes in no set order, and a take of its topic strings costs.
    v = visible.select(["ledger_id", "entry_id", "visible_ledger_id", "visible_entry_id", "local_seq"]).sort_by(
        [("ledger_id", "ascending"), ("entry_id", "ascending")])
    if not v.num_rows:
        return SEGMENT_SCHEMA.empty_table()
    ledger, entry = v["ledger_id"].to_numpy(), v["entry_id"].to_numpy()
    target_ledger, target_entry = v["visible_ledger_id"].to_numpy(), v["visible_entry_id"].to_numpy()
    seq = v["local_seq"].to_numpy()
    if seq.max() > np.iinfo(np.int32).max:
        raise ValueError(f"a transaction has more than {np.iinfo(np.int32).max} entries on one topic; "
                         "visible_segments cannot encode its order")
    own = (target_ledger == ledger) & (target_entry == entry)
    starts = np.flatnonzero(np.r_[True, (ledger[1:] != ledger[:-1]) | (entry[1:] - entry[:-1] > SEGMENT_GAP)])
    ends = np.append(starts[1:], len(ledger))
    codes, code_offsets, targets_l, targets_e, target_offsets = [], [0], [], [], [0]
    for s, e in zip(starts, ends):
        foreign = ~own[s:e]
        pairs = np.stack([target_ledger[s:e][foreign], target_entry[s:e][foreign]], axis=1)
        unique, index = np.unique(pairs, axis=0, return_inverse=True) if len(pairs) else (np.empty((0, 2), np.int64), [])
        if len(unique) > CODE_TARGET_MASK:
            raise ValueError("a ledger segment has more visible positions than visible_segments can encode")
        target = np.zeros(e - s, dtype=np.int64)
        target[foreign] = np.asarray(index).reshape(-1)
        span = np.full(entry[e - 1] - entry[s] + 1, -1, dtype=np.int64)
        span[entry[s:e] - entry[s]] = (seq[s:e] << CODE_SEQ_SHIFT) | (target << CODE_TARGET_SHIFT) | own[s:e].astype(np.int64)
        codes.append(span)
        code_offsets.append(code_offsets[-1] + len(span))
        targets_l.append(unique[:, 0])
        targets_e.append(unique[:, 1])
        target_offsets.append(target_offsets[-1] + len(unique))
    target_struct = pa.StructArray.from_arrays([pa.array(np.concatenate(targets_l), pa.int64()),
                                                pa.array(np.concatenate(targets_e), pa.int64())], ["ledger_id", "entry_id"])
    return pa.table([
        pa.array(ledger[starts], pa.int64()), pa.array(entry[starts], pa.int64()), pa.array(entry[ends - 1], pa.int64()),
        pa.ListArray.from_arrays(pa.array(code_offsets, pa.int32()), pa.array(np.concatenate(codes), pa.int64())),
        pa.ListArray.from_arrays(pa.array(target_offsets, pa.int32()), target_struct),
    ], schema=SEGMENT_SCHEMA)


def select_rows(rows: pa.Table, decided: pa.Table, schema) -> pa.Table:
    """The full `rows` that `decided` (decisions by `_row`, in any order) names, with the decisions'
    own columns beyond the position appended, in `schema`: a filter by mask, as a `take` of
    payloads is several times slower (docs/benchmarks.md, "Buffer"). A row is decided once."""
    row = decided["_row"].to_numpy()
    mask = rows_mask(rows.num_rows, decided["_row"])
    picked = rows.filter(pa.array(mask)) if len(row) < rows.num_rows else rows
    own = [name for name in decided.column_names if name not in POSITIONS and name != "_row" and name not in picked.column_names]
    if own:
        # Each decision to the place of its row among the picked ones: a scatter, not a sort.
        order = np.empty(len(row), dtype=np.int64)
        order[(np.cumsum(mask) - 1)[row]] = np.arange(len(row))
        placed = decided.select(own).take(order)
        for name in own:
            picked = picked.append_column(name, placed[name])
    return conform(picked, schema)



def without_ledgers(rows: pa.Table, ledgers: Iterable[tuple[str, int]], column: str = "ledger_id") -> pa.Table:
    """`rows` but those of these (topic, ledger) pairs, the ledger in `column`."""
    pairs = sorted(set(ledgers))
    if not pairs:
        return rows
    gone = pa.table({"topic": pa.array([t for t, _ in pairs], rows.schema.field("topic").type),
                     column: pa.array([ledger for _, ledger in pairs], pa.int64())})
    return rows.join(gone, ["topic", column], join_type="left anti").select(rows.column_names)


def kept_txn_data(narrow: pa.Table, duplicate: np.ndarray) -> pa.Table:
    """The transactional DATA rows of `narrow` that are not duplicates (`duplicate` is by `_row`)."""
    return narrow.filter(pc.and_(pc.and_(is_data(narrow), has_txn(narrow)), pa.array(~duplicate[narrow["_row"].to_numpy()])))


def ledger_filter(ledger_ids: pa.Array | pa.ChunkedArray) -> pc.Expression:
    """A scan filter for rows of these ledgers; the bounds let the scan skip row groups by their
    statistics, where `isin` alone reads them all."""
    if len(ledger_ids) == 0:
        return pc.scalar(False)
    return ((pc.field("ledger_id") >= pc.min(ledger_ids).as_py()) & (pc.field("ledger_id") <= pc.max(ledger_ids).as_py())
            & pc.field("ledger_id").isin(pc.unique(ledger_ids)))


def pending_entries(narrow: pa.Table, duplicate: np.ndarray, ledger_txns: pa.Table) -> pa.Table:
    """The `PENDING` decisions: kept transactional DATA rows (`_row` and position) whose transaction
    has no marker in their own ledger, ordered by `_row`."""
    unmarked = ledger_txns.filter(pc.and_(pc.and_(has_txn(ledger_txns), pc.equal(ledger_txns["marker_count"], 0)),
                                          pc.is_valid(ledger_txns["data_entry_id"])))
    keys = ["topic", "ledger_id", "txn_most_bits", "txn_least_bits"]
    rows = kept_txn_data(narrow, duplicate).select(keys + ["entry_id", "_row"]).join(unmarked.select(keys), keys,
                                                                                      join_type="left semi")
    return rows.take(pc.sort_indices(rows["_row"])).select(["_row"] + POSITIONS)


def sequence_ranges(narrow: pa.Table, duplicate: np.ndarray, ordered: pa.Table | None = None) -> pa.Table:
    """Per (topic, producer_id, producer_epoch, ledger_id): the runs of consecutive sequence ids of
    its kept DATA (`narrow` with `_row`; `ordered`: its `by_sequence`, when at hand).

    Without its duplicates a key is at one position only, so in key order a run is a block of one
    producer's consecutive ids in one ledger: no second sort, no group-by.
    """
    ordered = by_sequence(narrow) if ordered is None else ordered
    kept = ordered.filter(pa.array(~duplicate[ordered["_row"].to_numpy()]))
    starts = group_starts(kept, PRODUCER_KEY + ["ledger_id"])
    ids = kept["sequence_id"].to_numpy()
    starts[1:] |= ids[1:] != ids[:-1] + 1
    first = np.flatnonzero(starts)
    last = np.append(first[1:], len(ids))[:len(first)] - 1
    runs = kept.select(PRODUCER_KEY + ["ledger_id"]).take(pa.array(first, pa.int64()))
    return conform(runs.append_column("first_sequence_id", pa.array(ids[first], pa.int64()))
                   .append_column("last_sequence_id", pa.array(ids[last], pa.int64())), BUFFER_SEQUENCE_RANGES_SCHEMA)


def txns_to_refold(unmarked: pa.Table, scope_ledger_txns: pa.Table, stable_at: Mapping[str, int]) -> pa.Table:
    """(topic, txn) of the transactions the run folds again; `refresh.txns_to_refold`'s keys.

    `unmarked`: at least the kept `buffer_ledger_txns` rows with kept data and no marker at or
    after their topic's stored stable ledger (`stable_at`: topic -> ledger), and every such row of
    a topic without one; more rows are filtered out here.
    """
    touched = scope_ledger_txns.filter(has_txn(scope_ledger_txns)).select(TXN_KEY)
    unmarked = unmarked.filter(pc.and_(pc.and_(has_txn(unmarked), pc.equal(unmarked["marker_count"], 0)),
                                       pc.is_valid(unmarked["data_entry_id"])))
    if stable_at:
        since = pa.table({"topic": list(stable_at), "_sl": list(stable_at.values())}, schema=pa.schema(
            [("topic", pa.string()), ("_sl", pa.int64())]))
        unmarked = unmarked.join(since, "topic", join_type="left outer")
        unmarked = unmarked.filter(pc.or_(pc.is_null(unmarked["_sl"]), pc.greater_equal(unmarked["ledger_id"], unmarked["_sl"])))
    return pa.concat_tables([touched, unmarked.select(TXN_KEY)], promote_options="default").group_by(
        TXN_KEY, use_threads=False).aggregate([])


def scoped_violation_totals(narrow: pa.Table, duplicate: np.ndarray, duplicates: pa.Table, txns: pa.Table,
                            scope_ledger_txns: pa.Table) -> dict[str, int]:
    """The count of each violation whose entry lies in the scope; `refresh.scoped_violation_totals`."""
    facts = txns.select(TXN_KEY + ["marker_ledger_id", "marker_entry_id", "first_data_ledger_id", "first_data_entry_id"])
    markers = scope_ledger_txns.filter(pc.and_(has_txn(scope_ledger_txns), pc.greater(scope_ledger_txns["marker_count"], 0)))
    markers = markers.select(TXN_KEY + ["ledger_id", "marker_count"]).join(facts, TXN_KEY, join_type="inner")
    first_here = pc.fill_null(pc.equal(markers["marker_ledger_id"], markers["ledger_id"]), False)
    data_before = pc.fill_null(pc.and_(pc.is_valid(markers["first_data_ledger_id"]), position_lt(
        markers["first_data_ledger_id"], markers["first_data_entry_id"], markers["marker_ledger_id"], markers["marker_entry_id"])),
        False)
    late = kept_txn_data(narrow, duplicate).select(TXN_KEY + ["ledger_id", "entry_id"]).join(
        facts.filter(pc.is_valid(facts["marker_ledger_id"])), TXN_KEY, join_type="inner")
    late = late.filter(position_lt(late["marker_ledger_id"], late["marker_entry_id"], late["ledger_id"], late["entry_id"]))
    return {
        Violation.DUPLICATE.value: duplicates.num_rows,
        Violation.DATA_AFTER_MARKER.value: late.num_rows,
        Violation.DUPLICATE_MARKER.value: int(pc.sum(markers["marker_count"]).as_py() or 0) - int(pc.sum(first_here.cast(pa.int64())).as_py() or 0),
        Violation.MARKER_WITHOUT_DATA.value: int(pc.sum(pc.and_(first_here, pc.invert(data_before)).cast(pa.int64())).as_py() or 0),
    }


def ledger_drops(ledger_txns: pa.Table, first_markers: pa.Table) -> pa.Table:
    """Per (topic, ledger_id), what a read-committed reader never sees of it, by reason:
    `entries_before`, `dropped_markers`, `dropped_duplicates`, `dropped_aborted`, and the bounds
    `kept_at_least` <= visible <= `kept_at_most` (the offload manifest's counts; late data is the rest).

    `ledger_txns`: `buffer_ledger_txns` rows (`by_ledger_txn`) of those ledgers; `first_markers`:
    `txn_markers` rows of their transactions. A group's data not retried is entry_count -
    marker_count - duplicate_count: all aborted (an aborted transaction), all visible (no
    transaction, or a COMMIT in a later ledger, or in this one after every entry of the group) or
    all late (a COMMIT in an earlier ledger); only a group holding entries after its COMMIT in
    the same ledger splits, which the bounds leave open.
    """
    markers = first_markers.select([*TXN_KEY, "outcome", "ledger_id", "entry_id"]).rename_columns(
        [*TXN_KEY, "_outcome", "_ml", "_me"])
    g = ledger_txns.join(markers, keys=list(TXN_KEY), join_type="left outer")  # null keys (no transaction) match nothing

    def when(condition: pa.ChunkedArray, values: pa.ChunkedArray) -> pa.ChunkedArray:
        return pc.if_else(pc.fill_null(condition, False), values, 0)

    data = pc.subtract(pc.subtract(g["entry_count"], g["marker_count"]), g["duplicate_count"])
    commit = pc.equal(g["_outcome"], EntryType.COMMIT.value)
    marker_here = pc.and_kleene(commit, pc.equal(g["_ml"], g["ledger_id"]))
    after_all = pc.less_equal(g["last_entry_id"], g["_me"])
    all_kept = pc.or_kleene(pc.or_kleene(pc.invert(has_txn(g)), pc.and_kleene(commit, pc.greater(g["_ml"], g["ledger_id"]))),
                            pc.and_kleene(marker_here, after_all))
    split = pc.and_kleene(marker_here, pc.invert(after_all))
    parts = pa.table({
        "topic": g["topic"], "ledger_id": g["ledger_id"],
        "entries_before": g["entry_count"], "dropped_markers": g["marker_count"], "dropped_duplicates": g["duplicate_count"],
        "dropped_aborted": when(pc.equal(g["_outcome"], EntryType.ABORT.value), data),
        "kept_at_least": when(all_kept, data),
        "kept_at_most": when(pc.or_kleene(all_kept, split), data),
    })
    sums = [c for c in parts.column_names if c not in ("topic", "ledger_id")]
    totals = parts.group_by(["topic", "ledger_id"], use_threads=False).aggregate([(c, "sum") for c in sums])
    return totals.select(["topic", "ledger_id", *(f"{c}_sum" for c in sums)]).rename_columns(["topic", "ledger_id", *sums])


# -- one scope ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ScopeTables:
    """What the kernel decided for one scope: every narrow table a run writes, by name (its scope's
    rows; `stable_positions` whole), the row decisions `VISIBLE` and `PENDING` (whose `_row` counts
    the scope's entries, then `pending_read`), and the counts of the violations in the scope."""

    tables: dict[str, pa.Table]
    violations: dict[str, int]
    pending_read: pa.Table  # the `buffer_pending_entries` rows `read_state` returned, as it returned them


StateReader = Callable[[str, pc.Expression], pa.Table]


def scope_tables(narrow: pa.Table, scope: set[int], read_state: StateReader, old_stable: Mapping[str, int],
                 ledgers: Iterable[tuple[str, int, int]], spared: Iterable[tuple[str, int]] = (),
                 retained: Iterable[tuple[str, int]] = ()) -> ScopeTables:
    """The run over a scope: `narrow` holds at least `NARROW_COLUMNS` of every entry of the scope's ledgers.

    `read_state(table, filter)`: the rows of a state table that match `filter` (a pyarrow
    expression), without those of the ledgers the run replaces; for `buffer_pending_entries` at
    least `NARROW_COLUMNS`. Only the rows a run can use are asked for, so memory follows the
    scope, not the history: the sequence ranges of the scope's producers, the `buffer_ledger_txns`
    rows of the transactions the scope touches or that may be ongoing (`txns_to_refold` decides
    exactly among them), the pending rows of those transactions. `old_stable`: topic -> stored
    stable ledger; `ledgers`: (topic, ledger_id, last_entry_id) of every ledger of the catalog and
    every retained (deleted) one; `retained`: those (topic, ledger) pairs, whose pending rows number
    later rows (`local_seq`) but are not read; `spared`: the retained pairs whose id is in `scope`,
    whose rows the run does not write.
    """
    narrow = with_row_index(narrow.select(list(NARROW_COLUMNS)))
    ordered = by_sequence(narrow)
    earlier_ranges = read_state(BUFFER_SEQUENCE_RANGES, pc.field("topic").isin(pc.unique(ordered["topic"]))
                                & pc.field("producer_id").isin(pc.unique(ordered["producer_id"])))
    duplicates = distinct_positions(duplicate_positions(narrow, ordered), duplicates_of_earlier_ledgers(narrow, earlier_ranges))
    duplicate = is_duplicate(narrow, duplicates)
    scope_ledger_txns = by_ledger_txn(narrow, duplicate)
    # Which transactions to refold, then every state row of theirs (a decided one's marker row is
    # neither unmarked nor in the scope): two filtered reads, exact after the joins.
    maybe_ongoing = ((pc.field("marker_count") == 0) & pc.field("data_entry_id").is_valid()
                     & ((pc.field("ledger_id") >= min(old_stable.values(), default=0))
                        | ~pc.field("topic").isin(pa.array(list(old_stable), pa.string()))))
    refold = txns_to_refold(read_state(BUFFER_LEDGER_TXNS, maybe_ongoing), scope_ledger_txns, old_stable)
    refolded = read_state(BUFFER_LEDGER_TXNS, pc.field("txn_least_bits").isin(pc.unique(refold["txn_least_bits"])))
    folded = pa.concat_tables([scope_ledger_txns, conform(refolded.join(refold, TXN_KEY, join_type="left semi"),
                                                          BUFFER_LEDGER_TXNS_SCHEMA)])
    txns = txns_from_ledger_txns(folded)
    # Only transactions with a marker in the scope can commit there: all are in `refold`.
    pending_read = read_state(BUFFER_PENDING_ENTRIES, pc.field("txn_least_bits").isin(pc.unique(refold["txn_least_bits"])))
    pending = pending_read.select(list(NARROW_COLUMNS)).append_column(
        "_row", pa.array(np.arange(narrow.num_rows, narrow.num_rows + pending_read.num_rows, dtype=np.int64)))
    stable = stable_positions(txns, ledgers)

    def in_scope(table: pa.Table, column: str) -> pa.Table:
        return without_ledgers(table.filter(pc.is_in(table[column], pa.array(sorted(scope), pa.int64()))), spared, column)

    committed = in_scope(committed_txns(txns), "visible_ledger_id")
    kept_data = narrow.filter(pc.and_(is_data(narrow), pa.array(~duplicate)))
    # Rows of older ledgers that a commit in the scope makes visible.
    pending_committed = pending.join(committed.select(TXN_KEY), TXN_KEY, join_type="left semi")
    data = pa.concat_tables([kept_data, pending_committed.select(kept_data.column_names)], promote_options="default")
    return ScopeTables(
        tables={
            TXN_MARKERS: in_scope(markers_from_txns(txns), "ledger_id"),
            ABORTED_TXNS: in_scope(aborted_from_txns(txns), "abort_ledger_id"),
            VISIBLE: without_ledgers(read_committed(data, committed, stable), retained),
            STABLE_POSITIONS: stable,
            PENDING: pending_entries(narrow, duplicate, scope_ledger_txns),
            BUFFER_DUPLICATES: conform(duplicates, BUFFER_DUPLICATES_SCHEMA),
            BUFFER_SEQUENCE_RANGES: sequence_ranges(narrow, duplicate, ordered),
            BUFFER_LEDGER_TXNS: scope_ledger_txns,
        },
        violations=scoped_violation_totals(narrow, duplicate, duplicates, txns, scope_ledger_txns),
        pending_read=pending_read,
    )




def no_state(table: str, rows: pc.Expression) -> pa.Table:
    """A `StateReader` of an empty state: a first or full run."""
    return arrow_schema(TABLE_SCHEMAS[table]).empty_table()


def full_scope_tables(narrow: pa.Table) -> ScopeTables:
    """`scope_tables` over whole topics with no state: every ledger of `narrow` in the scope, each
    ledger's last entry its own (the entries, not a catalog, say which ledgers there are)."""
    last = narrow.group_by(["topic", "ledger_id"], use_threads=False).aggregate([("entry_id", "max")])
    ledgers = list(zip(last["topic"].to_pylist(), last["ledger_id"].to_pylist(), last["entry_id_max"].to_pylist()))
    return scope_tables(narrow, {ledger for _, ledger, _ in ledgers}, no_state, {}, ledgers)


def fold_scopes(chunks: Iterable[pa.Table]) -> Iterator[ScopeTables]:
    """`scope_tables` over one topic's entries given as consecutive chunks of whole ledgers (in
    ledger order), each chunk a scope run on the state the earlier ones left, as incremental runs
    over appended ledgers are: memory follows one chunk and the state, not the topic.

    Together the results hold what `full_scope_tables` gives for the whole topic, but for two
    facts that only the last chunk knows: the stable position (the last result's) and so
    `in_stable_prefix` of `VISIBLE` rows, stamped against each chunk's own stable position (which
    only moves forward as ledgers are appended); the caller stamps them against the last one.
    A `PENDING` or `VISIBLE` `_row` counts within its own chunk, then its `pending_read`.
    """
    state: dict[str, pa.Table] = {name: arrow_schema(TABLE_SCHEMAS[name]).empty_table()
                                  for name in (BUFFER_SEQUENCE_RANGES, BUFFER_LEDGER_TXNS)}
    state[BUFFER_PENDING_ENTRIES] = arrow_schema(LEDGER_ENTRIES_SCHEMA).empty_table().select(list(NARROW_COLUMNS))
    ledgers: list[tuple[str, int, int]] = []
    old_stable: dict[str, int] = {}
    for chunk in chunks:
        narrow = chunk.select(list(NARROW_COLUMNS))
        last = narrow.group_by(["topic", "ledger_id"], use_threads=False).aggregate([("entry_id", "max")])
        here = list(zip(last["topic"].to_pylist(), last["ledger_id"].to_pylist(), last["entry_id_max"].to_pylist()))
        ledgers.extend(here)
        decided = scope_tables(narrow, {ledger for _, ledger, _ in here}, lambda table, rows: state[table].filter(rows),
                               old_stable, ledgers)
        pending = narrow.take(decided.tables[PENDING]["_row"])
        for name, rows in ((BUFFER_SEQUENCE_RANGES, decided.tables[BUFFER_SEQUENCE_RANGES]),
                           (BUFFER_LEDGER_TXNS, decided.tables[BUFFER_LEDGER_TXNS]), (BUFFER_PENDING_ENTRIES, pending)):
            state[name] = pa.concat_tables([state[name], rows.cast(state[name].schema)])
        stable = decided.tables[STABLE_POSITIONS]
        old_stable = dict(zip(stable["topic"].to_pylist(), stable["max_read_ledger_id"].to_pylist()))
        yield decided


def wide_tables(decided: ScopeTables, entries: pa.Table) -> dict[str, pa.Table]:
    """Every table of a run decided in the driver: the narrow ones as decided, `committed_entries`
    and `buffer_pending_entries` selected from the full rows (`entries`: the scope's, in the order
    the kernel was given them; then the pending rows it read)."""
    tables = {name: table for name, table in decided.tables.items() if name not in (VISIBLE, PENDING)}
    rows = pa.concat_tables([conform(entries, LEDGER_ENTRIES_SCHEMA), conform(decided.pending_read, LEDGER_ENTRIES_SCHEMA)])
    tables[COMMITTED_ENTRIES] = select_rows(rows, decided.tables[VISIBLE], COMMITTED_ENTRIES_SCHEMA)
    tables[BUFFER_PENDING_ENTRIES] = select_rows(conform(entries, LEDGER_ENTRIES_SCHEMA), decided.tables[PENDING],
                                                 LEDGER_ENTRIES_SCHEMA)
    return tables
