"""Reading a topic across the hot ledgers and the offload tier, in ledger order (the offload seed).

Offloaded ledgers (those with an `offload_manifest` row) are read from `offloaded_entries`; the
others from `committed_entries`, in ledger order. To the reader the two are one log with gaps
where filtering removed markers, aborted data and duplicates.

- A start position that filtering removed is not looked up entry by entry (the seed's ReadHandle
  walked back to the index before a missing entry and looped): the read is a range predicate,
  `position >= from`, so it starts at the next kept entry, whichever tier holds it.
- Both tiers are limited by one position: the topic's published stable position
  (`stable_positions`, read before the entries). The offloader decides from `ledger_entries`,
  which may be newer than the buffer's tables (an ingest since the last `txnlake run`): a ledger
  it offloaded may then lie past what the hot view can show before it, and reading it would show
  half of a transaction and skip the hot entries before it for good. Limited the same way, an
  offload never changes what a reader sees; the tier's ledgers show once the buffer catches up.
  (In Pulsar the broker's max read position is always current, so offloaded data, always below
  it, needs no limit: the seed's "not subject to MaxReadPosition".) Read first, the stable
  position is never newer than the `committed_entries` read after it (a buffer run writes
  `stable_positions` after the rows), and every entry at or below it is decided there, so
  `position <= stable` is `in_stable_prefix` of those rows.
- Hot rows of an offloaded ledger (before retention deletes them) are never read twice: the
  manifest decides which tier a ledger is read from.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow.compute as pc
from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F

from txn_engine.buffer_jobs import has_sequence, position_le, position_lt
from txn_engine.delta_io import DeltaTables
from txn_engine.errors import TableMissingError, TxnlakeError
from txn_engine.ledgers import ledger_ranges
from txn_engine.offload import offloaded_ledgers
from txn_engine.positions import EARLIEST, Position
from txn_engine.schema import (
    COMMITTED_ENTRIES,
    LEDGER_ENTRIES,
    LEDGER_ENTRY_COLUMNS,
    OFFLOADED_ENTRIES,
    OFFLOADED_ENTRIES_SCHEMA,
    STABLE_POSITIONS,
    STABLE_POSITIONS_SCHEMA,
)
from txn_engine.warehouse import Warehouse

HOT, COLD = "hot", "cold"


def views_behind_log(warehouse: Warehouse) -> dict[str, Position]:
    """Each topic whose last position in `ledger_entries` lies past its `stable_positions` view's
    last position (entries ingested since the last `txnlake run`, which no read shows and no
    offload considers until then), with that last position. Delta-rs and Arrow, no Spark job."""
    if not warehouse.exists(LEDGER_ENTRIES):
        return {}
    last: dict[str, Position] = {}
    for r in ledger_ranges(warehouse).to_pylist():
        last[r["topic"]] = max(last.get(r["topic"], Position(r["ledger_id"], r["last_entry_id"])),
                               Position(r["ledger_id"], r["last_entry_id"]))
    views = ({r["topic"]: Position(r["last_ledger_id"], r["last_entry_id"])
              for r in DeltaTables(warehouse).read(STABLE_POSITIONS, STABLE_POSITIONS_SCHEMA).to_pylist()}
             if warehouse.exists(STABLE_POSITIONS) else {})
    return {t: p for t, p in last.items() if t not in views or p > views[t]}


@dataclass(frozen=True)
class ReadBatch:
    """Entries read in ledger order and where to continue: `next_position` is after the last one."""

    entries: list[Row]

    @property
    def next_position(self) -> Position | None:
        if not self.entries:
            return None
        last = self.entries[-1]
        return Position(last.ledger_id, last.entry_id + 1)


class TopicReader:
    """A read-committed, ledger-order reader of one warehouse, hot and cold tiers together."""

    def __init__(self, warehouse: Warehouse):
        self.warehouse = warehouse

    def published(self, topic: str) -> dict | None:
        """The topic's `stable_positions` row (max read and last position of the buffer's view), or
        None when the view holds no such topic. A row per topic, by delta-rs (no Spark job)."""
        wh = self.warehouse
        for table in (STABLE_POSITIONS, COMMITTED_ENTRIES):
            if not wh.exists(table):
                raise TableMissingError(
                    f"table {table} does not exist yet at {wh.path(table)}; "
                    "materialize the transaction buffer first (`txnlake run`)."
                )
        rows = DeltaTables(wh).read(STABLE_POSITIONS, STABLE_POSITIONS_SCHEMA).to_pylist()
        return next((r for r in rows if r["topic"] == topic), None)

    def behind_log(self, topic: str) -> Position | None:
        """The topic's last position in `ledger_entries` when the buffer's view does not reach it
        yet (`views_behind_log`); None when the view is up to date."""
        self.published(topic)  # the buffer's tables must exist: the same error as a read's
        return views_behind_log(self.warehouse).get(topic)

    def frame(self, topic: str, from_position: Position = EARLIEST) -> DataFrame:
        """The topic's readable entries at or after `from_position`, with a `tier` column (unordered)."""
        wh = self.warehouse
        view = self.published(topic)  # before the entries: see the module doc
        # Column expressions need a running session; a CLI's warehouse starts it on first use.
        wh.spark  # noqa: B018
        cold_ids = sorted(ledger for _, ledger in offloaded_ledgers(wh, topic))
        at_or_after = ~position_lt(F.col("ledger_id"), F.col("entry_id"), F.lit(from_position.ledger_id), F.lit(from_position.entry_id))
        stable = F.lit(False) if view is None else position_le(
            F.col("ledger_id"), F.col("entry_id"), F.lit(view["max_read_ledger_id"]), F.lit(view["max_read_entry_id"]))
        # The one read limit, whichever tier holds the entry.
        mine = (F.col("topic") == topic) & at_or_after & stable
        cold = (
            wh.read_or_empty(OFFLOADED_ENTRIES, OFFLOADED_ENTRIES_SCHEMA)
            .where(mine & F.col("ledger_id").isin(cold_ids))
            .select(*LEDGER_ENTRY_COLUMNS, F.lit(COLD).alias("tier"))
        )
        hot = (
            wh.read(COMMITTED_ENTRIES)
            .where(mine & ~F.col("ledger_id").isin(cold_ids))
            .select(*LEDGER_ENTRY_COLUMNS, F.lit(HOT).alias("tier"))
        )
        # Once retention deleted a ledger, a recomputed hot view no longer knows that a retried
        # send repeats an entry now only in the tier; the tier's copy is the first, keep it.
        sent_cold = (
            wh.read_or_empty(OFFLOADED_ENTRIES, OFFLOADED_ENTRIES_SCHEMA)
            .where((F.col("topic") == topic) & F.col("ledger_id").isin(cold_ids) & has_sequence())
            .select("producer_id", "sequence_id")
        )
        hot = hot.join(sent_cold, ["producer_id", "sequence_id"], "left_anti")
        return cold.unionByName(hot)

    def read(self, topic: str, from_position: Position = EARLIEST, max_entries: int | None = None) -> ReadBatch:
        """Up to `max_entries` entries of `topic` from `from_position` (inclusive), in ledger order."""
        if max_entries is not None and max_entries < 0:
            raise TxnlakeError(f"max_entries must not be negative, got {max_entries}; pass a count, or none for all")
        ordered = self.frame(topic, from_position).orderBy("ledger_id", "entry_id")
        if max_entries is not None:
            ordered = ordered.limit(max_entries)
        return ReadBatch(ordered.collect())
