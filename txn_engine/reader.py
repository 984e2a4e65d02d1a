"""Reading a topic across the hot ledgers and the offload tier, in ledger order (the offload seed).

Offloaded ledgers (those with an `offload_manifest` row) are read from `offloaded_entries`; the
others from `committed_entries` in ledger order (`WHERE in_stable_prefix`). To the reader the
two are one log with gaps where filtering removed markers, aborted data and duplicates.

- A start position that filtering removed is not looked up entry by entry (the seed's ReadHandle
  walked back to the index before a missing entry and looped): the read is a range predicate,
  `position >= from`, so it starts at the next kept entry, whichever tier holds it.
- Offloaded data is not limited by the max read position: everything in the tier was decided
  when it was offloaded. Hot data is, through `in_stable_prefix`.
- Hot rows of an offloaded ledger (before retention deletes them) are never read twice: the
  manifest decides which tier a ledger is read from.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F

from txn_engine.buffer_jobs import has_sequence, position_lt
from txn_engine.errors import TableMissingError, TxnlakeError
from txn_engine.offload import offloaded_ledgers
from txn_engine.positions import EARLIEST, Position
from txn_engine.schema import COMMITTED_ENTRIES, LEDGER_ENTRY_COLUMNS, OFFLOADED_ENTRIES, OFFLOADED_ENTRIES_SCHEMA
from txn_engine.warehouse import Warehouse

HOT, COLD = "hot", "cold"


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

    def frame(self, topic: str, from_position: Position = EARLIEST) -> DataFrame:
        """The topic's readable entries at or after `from_position`, with a `tier` column (unordered)."""
        wh = self.warehouse
        if not wh.exists(COMMITTED_ENTRIES):
            raise TableMissingError(
                f"table {COMMITTED_ENTRIES} does not exist yet at {wh.path(COMMITTED_ENTRIES)}; "
                "materialize the transaction buffer first (`txnlake run`)."
            )
        cold_ids = sorted(ledger for _, ledger in offloaded_ledgers(wh, topic))
        at_or_after = ~position_lt(F.col("ledger_id"), F.col("entry_id"), F.lit(from_position.ledger_id), F.lit(from_position.entry_id))
        mine = (F.col("topic") == topic) & at_or_after
        cold = (
            wh.read_or_empty(OFFLOADED_ENTRIES, OFFLOADED_ENTRIES_SCHEMA)
            .where(mine & F.col("ledger_id").isin(cold_ids))
            .select(*LEDGER_ENTRY_COLUMNS, F.lit(COLD).alias("tier"))
        )
        hot = (
            wh.read(COMMITTED_ENTRIES)
            .where(mine & F.col("in_stable_prefix") & ~F.col("ledger_id").isin(cold_ids))
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
