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
from txn_engine.core.schema import TXN_HALVES, BUFFER_LEDGER_TXNS, BUFFER_SEQUENCE_RANGES, COMMITTED_ENTRIES, LEDGER_ENTRIES, STABLE_POSITIONS, TXN_MARKERS
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


COMMITTED_COLUMNS = POSITIONS + ["entry_type", *TXN_HALVES, "producer_id", "producer_epoch", "sequence_id"]
COUNTS = ("entries_of_uncommitted_txns", "duplicate_positions", "duplicate_sequences", "markers")


def committed_once_counts(rows: pa.Table, commits: pa.Table, positions: pa.Table | None = None,
                          sequences: pa.Table | None = None) -> CommittedOnce:
    """The rule, over `committed_entries` rows (`COMMITTED_COLUMNS`) and the COMMIT markers of their
    transactions (`TXN_KEY`): rows of transactions without one, markers, and the positions and
    sequences of `rows` that occur twice in `positions` / `sequences` (every row sharing a key with
    them, epoch as `_null_epoch_as_value`; `rows`' own by default)."""
    txn_rows = rows.filter(pc.is_valid(rows["txn_least_bits"]))
    sequenced = _null_epoch_as_value(rows.filter(has_sequence(rows)))
    positions = rows.select(POSITIONS) if positions is None else positions
    sequences = sequenced.select(SEQUENCE_KEY) if sequences is None else sequences
    return CommittedOnce(
        entries_of_uncommitted_txns=txn_rows.select(TXN_KEY).join(commits.select(TXN_KEY), TXN_KEY,
                                                                  join_type="left anti").num_rows,
        duplicate_positions=_repeated(positions, POSITIONS).join(rows.select(POSITIONS), POSITIONS, join_type="left semi").num_rows,
        duplicate_sequences=_repeated(sequences, SEQUENCE_KEY).join(sequenced.select(SEQUENCE_KEY), SEQUENCE_KEY,
                                                                join_type="left semi").num_rows,
        markers=rows.filter(pc.not_equal(rows["entry_type"], EntryType.DATA.value)).num_rows,
    )


def topic_committed_once(rows: pa.Table, commits: pa.Table) -> pa.Table:
    """`committed_once_counts` of one topic's rows, as Spark's cogrouped Arrow function."""
    counts = committed_once_counts(rows, commits)
    return pa.table({name: pa.array([getattr(counts, name)], pa.int64()) for name in COUNTS})


def committed_once(wh: Warehouse) -> CommittedOnce:
    ledgers = last_run_ledgers(wh)
    tables = DeltaTables(wh)
    if ledgers is None and not _whole_in_driver(wh, tables, COMMITTED_ENTRIES, TXN_MARKERS):
        return _committed_once_on_spark(wh)
    committed = tables.dataset(COMMITTED_ENTRIES)
    rows = committed.to_table(filter=None if ledgers is None else _isin("visible_ledger_id", pa.array(ledgers, pa.int64())),
                              columns=COMMITTED_COLUMNS)
    txn_rows = rows.filter(pc.is_valid(rows["txn_least_bits"]))
    commits = scan(tables.dataset(TXN_MARKERS), _isin("txn_least_bits", txn_rows["txn_least_bits"]), TXN_KEY,
                   on_rows=pc.field("outcome") == EntryType.COMMIT.value, on_rows_columns=["outcome"])
    if ledgers is None:
        result = committed_once_counts(rows, commits)
    else:
        # The keys that span ledgers: every row of the table that shares one with the run's rows.
        positions = committed.to_table(filter=_isin("ledger_id", rows["ledger_id"]), columns=POSITIONS)
        sequenced = _null_epoch_as_value(rows.filter(has_sequence(rows)))
        sequences = _null_epoch_as_value(committed.to_table(
            filter=ledger_filter(_ledgers_sharing_sequences(tables, sequenced)) & _isin("producer_id", sequenced["producer_id"])
            & pc.field("sequence_id").is_valid(), columns=SEQUENCE_KEY))
        result = committed_once_counts(rows, commits, positions, sequences)
    result.checked = _scope_text(ledgers)
    return result


def _committed_once_on_spark(wh: Warehouse) -> CommittedOnce:
    """The whole tables' `committed_once_counts`, a topic per Arrow call (every key holds the topic)."""
    committed = wh.read(COMMITTED_ENTRIES).select(*COMMITTED_COLUMNS)
    commits = wh.read(TXN_MARKERS).where(F.col("outcome") == EntryType.COMMIT.value).select(*TXN_KEY)
    counts = committed.groupBy("topic").cogroup(commits.groupBy("topic")).applyInArrow(
        topic_committed_once, ", ".join(f"{name} long" for name in COUNTS))
    totals = counts.agg(*[F.coalesce(F.sum(name), F.lit(0)).alias(name) for name in COUNTS]).first()
    return CommittedOnce(**{name: int(totals[name]) for name in COUNTS})


TXN_ID_HALVES = list(TXN_HALVES)
MARKER_KEYS = POSITIONS + ["outcome", *TXN_ID_HALVES]


def unmatched_markers(markers: pa.Table, entries: pa.Table) -> pa.Table:
    """The `txn_markers` rows no marker entry of `entries` (`ledger_entries`: positions,
    entry_type and the two halves) backs with the same transaction and outcome."""
    backing = entries.select(POSITIONS + ["entry_type", *TXN_ID_HALVES]).rename_columns(MARKER_KEYS)
    return markers.select(MARKER_KEYS).join(backing, MARKER_KEYS, join_type="left anti")


def split_outcomes(markers: pa.Table) -> pa.Table:
    """The transactions (two halves) whose `txn_markers` rows (any topics) hold more than one outcome."""
    outcomes = markers.group_by([*TXN_ID_HALVES, "outcome"], use_threads=False).aggregate([]).group_by(
        TXN_ID_HALVES, use_threads=False).aggregate([([], "count_all")])
    return outcomes.filter(pc.greater(outcomes["count_all"], 1)).select(TXN_ID_HALVES)


def topic_unmatched_markers(markers: pa.Table, entries: pa.Table) -> pa.Table:
    """`unmatched_markers` of one topic, counted: Spark's cogrouped Arrow function."""
    return pa.table({"unmatched": pa.array([unmatched_markers(markers, entries).num_rows], pa.int64())})


def _split_txn_ids(split: pa.Table) -> list[str]:
    split = split.sort_by([(c, "ascending") for c in TXN_ID_HALVES]).slice(0, 20)
    return [f"{m}:{l}" for m, l in zip(split["txn_most_bits"].to_pylist(), split["txn_least_bits"].to_pylist())]


def markers_match(wh: Warehouse) -> MarkersMatch:
    ledgers = last_run_ledgers(wh)
    tables = DeltaTables(wh)
    if ledgers is None and not _whole_in_driver(wh, tables, TXN_MARKERS, LEDGER_ENTRIES):
        return _markers_match_on_spark(wh)
    markers = tables.dataset(TXN_MARKERS).to_table(
        filter=None if ledgers is None else _isin("ledger_id", pa.array(ledgers, pa.int64())))
    entries = tables.dataset(LEDGER_ENTRIES).to_table(
        filter=ledger_filter(markers["ledger_id"]), columns=POSITIONS + ["entry_type", *TXN_ID_HALVES])
    theirs = markers if ledgers is None else tables.dataset(TXN_MARKERS).to_table(
        filter=_isin("txn_least_bits", markers["txn_least_bits"]), columns=[*TXN_ID_HALVES, "outcome"])
    split = split_outcomes(theirs).join(markers.select(TXN_ID_HALVES), TXN_ID_HALVES, join_type="left semi")
    return MarkersMatch(markers_without_entry=unmatched_markers(markers, entries).num_rows,
                        txns_with_split_outcome=_split_txn_ids(split), checked=_scope_text(ledgers))


def _markers_match_on_spark(wh: Warehouse) -> MarkersMatch:
    """The whole tables' `markers_match`: the markers a topic per Arrow call, cogrouped with the
    topic's marker entries; the outcomes of a transaction across topics a bucket of transactions
    per call (by a hash of the id: a transaction's rows in one bucket)."""
    markers = wh.read(TXN_MARKERS).select(*MARKER_KEYS)
    entries = wh.read(LEDGER_ENTRIES).where(F.col("entry_type") != EntryType.DATA.value).select(
        *POSITIONS, "entry_type", *TXN_ID_HALVES)
    unmatched = markers.groupBy("topic").cogroup(entries.groupBy("topic")).applyInArrow(
        topic_unmatched_markers, "unmatched long").agg(F.coalesce(F.sum("unmatched"), F.lit(0))).first()[0]
    buckets = int(wh.spark.conf.get("spark.sql.shuffle.partitions"))
    split = (markers.select(*TXN_ID_HALVES, "outcome")
             .withColumn("_bucket", F.pmod(F.hash(*TXN_ID_HALVES), F.lit(buckets))).groupBy("_bucket")
             .applyInArrow(split_outcomes, "txn_most_bits long, txn_least_bits long")
             .orderBy(*TXN_ID_HALVES).limit(20).toArrow())
    return MarkersMatch(markers_without_entry=int(unmatched), txns_with_split_outcome=_split_txn_ids(split))


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
