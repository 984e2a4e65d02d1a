"""What the transaction buffer's asset checks verify, over the rows the last buffer run wrote.

Three invariants (the assets in `assets/transaction_buffer/tables.py` report them):
- the stable position of a topic never moves backwards (`stable_moves_back`);
- `committed_entries` holds no entry of a transaction without a COMMIT marker, no position twice,
  no (topic, producer_id, producer_epoch, sequence_id) twice and no marker (`committed_once`);
- every `txn_markers` row matches a marker entry of `ledger_entries`, and a transaction has one
  outcome on all its topics (`markers_match`).

Which rows: after an incremental run (its ledgers recorded in its last state commit,
`RUN_LEDGERS_KEY`) the checks read by delta-rs its ledgers' rows and the rows sharing a key with
them, so a check costs in proportion to the run; after a full run, the whole tables, by delta-rs
too while they fit the driver (`WarehouseSettings.whole_tables_in_driver`), else on Spark
(docs/transaction-buffer.md, "Asset checks").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import functions as F

from txn_engine.buffer.kernel import POSITIONS, PRODUCER_KEY, SEQUENCE_KEY, TXN_KEY, has_sequence, ledger_filter, position_lt
from txn_engine.buffer.refresh import ALL_LEDGERS, RUN_LEDGERS_KEY
from txn_engine.storage.delta_io import DeltaTables, aggregate, scan
from txn_engine.core.log_types import EntryType
from txn_engine.core.schema import BUFFER_LEDGER_TXNS, BUFFER_SEQUENCE_RANGES, COMMITTED_ENTRIES, LEDGER_ENTRIES, STABLE_POSITIONS, TXN_MARKERS
from txn_engine.storage.warehouse import Warehouse



def last_run_ledgers(wh: Warehouse) -> list[int] | None:
    """The ledgers the last buffer run rewrote, or None when it was a full run (or is not recorded)."""
    commit = DeltaTables(wh).last_rows_commit(BUFFER_LEDGER_TXNS) or {}
    value = commit.get(RUN_LEDGERS_KEY)
    if value is None or value == ALL_LEDGERS:
        return None
    return [int(x) for x in json.loads(value)]


@dataclass
class CommittedOnce:
    entries_of_uncommitted_txns: int = 0
    duplicate_positions: int = 0
    duplicate_sequences: int = 0
    markers: int = 0
    checked: str = "whole table"

    @property
    def passed(self) -> bool:
        return not (self.entries_of_uncommitted_txns or self.duplicate_positions or self.duplicate_sequences or self.markers)


@dataclass
class MarkersMatch:
    markers_without_entry: int = 0
    txns_with_split_outcome: list[str] = field(default_factory=list)  # at most 20
    checked: str = "whole table"


@dataclass
class StableMoves:
    compared_versions: str
    moved_back: list[str] = field(default_factory=list)  # (topic, before ledger, before entry, now ledger, now entry)


def _scope_text(ledgers: list[int] | None) -> str:
    if ledgers is None:
        return "whole table"
    shown = ", ".join(map(str, ledgers[:20])) + (", ..." if len(ledgers) > 20 else "")
    return f"rows of the {len(ledgers)} ledger(s) the last run rewrote: {shown}"


def _isin(column: str, values: pa.Array | pa.ChunkedArray) -> pc.Expression:
    return pc.field(column).isin(pc.unique(values))


def _null_epoch_as_value(table: pa.Table) -> pa.Table:
    """`producer_epoch` with null as a value a join matches (an epoch is an int32; this is not one)."""
    epoch = pc.fill_null(table["producer_epoch"].cast(pa.int64()), -(1 << 40))
    return table.set_column(table.schema.get_field_index("producer_epoch"), "producer_epoch", epoch)


def _repeated(table: pa.Table, keys: list[str]) -> pa.Table:
    """The key values occurring more than once in `table`."""
    counts = table.group_by(keys, use_threads=False).aggregate([([], "count_all")])
    return counts.filter(pc.greater(counts["count_all"], 1)).select(keys)


def _ledgers_sharing_sequences(tables: DeltaTables, sequenced: pa.Table) -> pa.Array:
    """The ledgers whose committed rows can repeat a (topic, producer, epoch, sequence) of `sequenced`
    (the run's rows, epoch as `_null_epoch_as_value`): their own ledgers, and those whose runs in
    `buffer_sequence_ranges` overlap the run's sequence ids of the same producer and epoch. The
    state records each kept pair in the runs of the ledger that first held it, so the other copy of
    a repeated pair lies in one of those: the check reads them, not the producers' whole history."""
    spans = aggregate(sequenced, PRODUCER_KEY, [("sequence_id", "min", "_low"), ("sequence_id", "max", "_high")])
    own = sequenced["ledger_id"].combine_chunks()
    if not spans.num_rows:
        return own
    runs = tables.dataset(BUFFER_SEQUENCE_RANGES).to_table(
        filter=_isin("producer_id", spans["producer_id"]) & (pc.field("last_sequence_id") >= pc.min(spans["_low"]).as_py())
        & (pc.field("first_sequence_id") <= pc.max(spans["_high"]).as_py()),
        columns=[*PRODUCER_KEY, "ledger_id", "first_sequence_id", "last_sequence_id"])
    runs = _null_epoch_as_value(runs).join(spans, PRODUCER_KEY, join_type="inner")
    overlapping = runs.filter(pc.and_(pc.less_equal(runs["first_sequence_id"], runs["_high"]),
                                      pc.greater_equal(runs["last_sequence_id"], runs["_low"])))
    return pa.concat_arrays([own, overlapping["ledger_id"].combine_chunks()])


def _whole_in_driver(wh: Warehouse, tables: DeltaTables, *names: str) -> bool:
    return wh.settings.whole_tables_in_driver(sum(tables.stored_bytes(t) for t in names))


def committed_once(wh: Warehouse) -> CommittedOnce:
    ledgers = last_run_ledgers(wh)
    tables = DeltaTables(wh)
    if ledgers is None and not _whole_in_driver(wh, tables, COMMITTED_ENTRIES, TXN_MARKERS):
        return _committed_once_whole(wh)
    committed = tables.dataset(COMMITTED_ENTRIES)
    rows = committed.to_table(filter=None if ledgers is None else _isin("visible_ledger_id", pa.array(ledgers, pa.int64())),
                              columns=POSITIONS + ["entry_type", "txn_most_bits", "txn_least_bits", "producer_id",
                                                   "producer_epoch", "sequence_id"])
    txn_rows = rows.filter(pc.is_valid(rows["txn_least_bits"]))
    commits = scan(tables.dataset(TXN_MARKERS), _isin("txn_least_bits", txn_rows["txn_least_bits"]), TXN_KEY,
                   on_rows=pc.field("outcome") == EntryType.COMMIT.value, on_rows_columns=["outcome"])
    # The keys that span ledgers: every row of the table that shares one with the run's rows.
    positions = committed.to_table(filter=_isin("ledger_id", rows["ledger_id"]), columns=POSITIONS)
    sequenced = _null_epoch_as_value(rows.filter(has_sequence(rows)))
    sequences = _null_epoch_as_value(committed.to_table(
        filter=ledger_filter(_ledgers_sharing_sequences(tables, sequenced)) & _isin("producer_id", sequenced["producer_id"])
        & pc.field("sequence_id").is_valid(), columns=SEQUENCE_KEY))
    return CommittedOnce(
        entries_of_uncommitted_txns=txn_rows.select(TXN_KEY).join(commits, TXN_KEY, join_type="left anti").num_rows,
        duplicate_positions=_repeated(positions, POSITIONS).join(rows.select(POSITIONS), POSITIONS, join_type="left semi").num_rows,
        duplicate_sequences=_repeated(sequences, SEQUENCE_KEY).join(sequenced.select(SEQUENCE_KEY), SEQUENCE_KEY,
                                                                join_type="left semi").num_rows,
        markers=rows.filter(pc.not_equal(rows["entry_type"], EntryType.DATA.value)).num_rows,
        checked=_scope_text(ledgers),
    )


def _committed_once_whole(wh: Warehouse) -> CommittedOnce:
    committed = wh.read(COMMITTED_ENTRIES)
    commits = wh.read(TXN_MARKERS).where(F.col("outcome") == EntryType.COMMIT.value).select(*TXN_KEY)
    txn_rows = committed.where(F.col("txn_most_bits").isNotNull())
    sequenced = committed.where(F.col("producer_id").isNotNull() & F.col("sequence_id").isNotNull())
    return CommittedOnce(
        entries_of_uncommitted_txns=txn_rows.join(commits, TXN_KEY, "left_anti").count(),
        duplicate_positions=committed.groupBy(*POSITIONS).count().where("count > 1").count(),
        duplicate_sequences=sequenced.groupBy(*SEQUENCE_KEY).count().where("count > 1").count(),
        markers=committed.where(F.col("entry_type") != EntryType.DATA.value).count(),
    )


def markers_match(wh: Warehouse) -> MarkersMatch:
    ledgers = last_run_ledgers(wh)
    tables = DeltaTables(wh)
    if ledgers is None and not _whole_in_driver(wh, tables, TXN_MARKERS, LEDGER_ENTRIES):
        return _markers_match_whole(wh)
    markers = tables.dataset(TXN_MARKERS).to_table(
        filter=None if ledgers is None else _isin("ledger_id", pa.array(ledgers, pa.int64())))
    keys = POSITIONS + ["outcome", "txn_most_bits", "txn_least_bits"]
    entries = tables.dataset(LEDGER_ENTRIES).to_table(
        filter=ledger_filter(markers["ledger_id"]), columns=POSITIONS + ["entry_type", "txn_most_bits", "txn_least_bits"]
    ).rename_columns(keys)
    unmatched = markers.select(keys).join(entries, keys, join_type="left anti").num_rows
    theirs = tables.dataset(TXN_MARKERS).to_table(filter=_isin("txn_least_bits", markers["txn_least_bits"]),
                                                  columns=["txn_most_bits", "txn_least_bits", "outcome"])
    outcomes = theirs.group_by(["txn_most_bits", "txn_least_bits", "outcome"], use_threads=False).aggregate([]).group_by(
        ["txn_most_bits", "txn_least_bits"], use_threads=False).aggregate([([], "count_all")])
    split = outcomes.filter(pc.greater(outcomes["count_all"], 1)).join(
        markers.select(["txn_most_bits", "txn_least_bits"]), ["txn_most_bits", "txn_least_bits"], join_type="left semi")
    split = split.sort_by([("txn_most_bits", "ascending"), ("txn_least_bits", "ascending")]).slice(0, 20)
    return MarkersMatch(markers_without_entry=unmatched,
                        txns_with_split_outcome=[f"{m}:{l}" for m, l in zip(split["txn_most_bits"].to_pylist(),
                                                                             split["txn_least_bits"].to_pylist())],
                        checked=_scope_text(ledgers))


def _markers_match_whole(wh: Warehouse) -> MarkersMatch:
    markers = wh.read(TXN_MARKERS)
    entries = wh.read(LEDGER_ENTRIES).select(*POSITIONS, F.col("entry_type").alias("outcome"), "txn_most_bits", "txn_least_bits")
    unmatched = markers.join(entries, [*POSITIONS, "outcome", "txn_most_bits", "txn_least_bits"], "left_anti").count()
    split = (
        markers.groupBy("txn_most_bits", "txn_least_bits")
        .agg(F.countDistinct("outcome").alias("outcomes"))
        .where("outcomes > 1")
    )
    return MarkersMatch(markers_without_entry=unmatched,
                        txns_with_split_outcome=[f"{r.txn_most_bits}:{r.txn_least_bits}" for r in split.limit(20).collect()])


def stable_moves_back(wh: Warehouse) -> StableMoves | None:
    """The topics whose stable position is behind the previous version's (a row per topic: read by
    delta-rs); None when `stable_positions` has no previous version."""
    version = wh.version(STABLE_POSITIONS)
    if not version:
        return None
    tables = DeltaTables(wh)
    columns = ["topic", "max_read_ledger_id", "max_read_entry_id"]
    now = tables.dataset(STABLE_POSITIONS).to_table(columns=columns)
    before = tables.dataset(STABLE_POSITIONS, version - 1).to_table(columns=columns).rename_columns(
        ["topic", "_before_ledger_id", "_before_entry_id"])
    both = now.join(before, "topic", join_type="inner")
    back = both.filter(pc.fill_null(position_lt(both["max_read_ledger_id"], both["max_read_entry_id"],
                                                both["_before_ledger_id"], both["_before_entry_id"]), False))
    moved = zip(*(back[c].to_pylist() for c in ("topic", "_before_ledger_id", "_before_entry_id", "max_read_ledger_id",
                                                "max_read_entry_id")))
    return StableMoves(compared_versions=f"{version - 1} -> {version}", moved_back=[str(m) for m in sorted(moved)])
