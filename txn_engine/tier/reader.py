"""Reading a topic across the hot ledgers and the offload tier, in ledger order (the offload seed).

Offloaded ledgers (those with an `offload_manifest` row) are read from `offloaded_entries`, the
others from `committed_entries`: to the reader one log with gaps where filtering removed markers,
aborted data and duplicates. A read is a range predicate, `position >= from`, so a start that
filtering removed begins at the next kept entry, with no entry-by-entry lookup that could loop
(the seed's ReadHandle). Both tiers are limited by the topic's published stable position, read
first, so an offload ahead of the buffer's tables never shows half a transaction. Small reads
(`driver_max_bytes` of entries by the catalog's `size_bytes`) run in this process by delta-rs and
Arrow, with no JVM; bigger ones on Spark. Each rule is one function both ways run (`read_limit`,
`repeated_in_tier`), tested equal. The reasons: docs/offload.md, "Reading through gaps".
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql.types import BinaryType, TimestampType

from txn_engine.log.spark_columns import position_le, position_lt
from txn_engine.buffer import kernel
from txn_engine.storage.arrow_frames import arrow_schema
from txn_engine.storage.delta_io import DRIVER_WRITE_MAX_BYTES, DeltaTables, scan
from txn_engine.core.errors import TableMissingError, TxnlakeError
from txn_engine.log.ledgers import ledger_ranges
from txn_engine.tier.offload import offloaded_ledgers
from txn_engine.core.positions import EARLIEST, Position
from txn_engine.core.schema import (
    COMMITTED_ENTRIES,
    LEDGER_ENTRIES,
    LEDGER_ENTRIES_SCHEMA,
    LEDGER_ENTRY_COLUMNS,
    LEDGERS,
    LEDGERS_SCHEMA,
    OFFLOADED_ENTRIES,
    OFFLOADED_ENTRIES_SCHEMA,
    STABLE_POSITIONS,
    STABLE_POSITIONS_SCHEMA,
)
from txn_engine.storage.warehouse import Warehouse

HOT, COLD = "hot", "cold"


# A retried send's key, as the buffer de-duplicates by it (`kernel.SEQUENCE_KEY`, within a topic).
SENT_KEY = kernel.SEQUENCE_KEY[1:]
SENT_COLUMNS = [*kernel.SEQUENCE_KEY, "ledger_id", "entry_id"]
REPEATED_SCHEMA = "topic string, ledger_id long, entry_id long"
_SENT_TYPES = {f.name: f.type for f in arrow_schema(LEDGER_ENTRIES_SCHEMA) if f.name in SENT_COLUMNS}


def read_limit(col, from_position: Position, stable: Position):
    """The one read limit of both tiers and both ways of reading (module doc): at or after
    `from_position`, at or below the published stable position. `col` names a column: `pc.field`
    in the driver (a pyarrow filter), `F.col` on Spark; the expression uses only operators both
    define, so it is this one rule either way."""
    ledger, entry = col("ledger_id"), col("entry_id")
    return (~position_lt(ledger, entry, from_position.ledger_id, from_position.entry_id)
            & position_le(ledger, entry, stable.ledger_id, stable.entry_id))


def repeated_in_tier(hot: pa.Table, tier: pa.Table) -> pa.Table:
    """Positions (topic, ledger_id, entry_id) of the `hot` rows whose sent key a `tier` row of the
    same topic holds (`SENT_KEY`; a null epoch is one value; a row without producer or sequence
    has none). Once retention deleted a ledger, a recomputed hot view no longer knows that a
    retried send repeats an entry now only in the tier: the tier's copy is the first, keep it.

    Arrow only, so one function serves both ways of reading: the driver calls it, Spark runs it a
    topic at a time on the key columns (`SENT_COLUMNS`) of the two frames, cogrouped."""
    def keys(rows: pa.Table, in_tier: bool) -> pa.Table:
        rows = rows.filter(kernel.has_sequence(rows))
        table = pa.table({c: rows[c].cast(t) for c, t in _SENT_TYPES.items()})
        return table.append_column("_hot", pa.array([not in_tier] * table.num_rows, pa.bool_()))

    # Within a key, the tier's rows sort first: a group holds a tier row iff its first row is one.
    ordered = kernel.grouped(pa.concat_tables([keys(tier, True), keys(hot, False)]), kernel.SEQUENCE_KEY, ["_hot"])
    starts = kernel.group_starts(ordered, kernel.SEQUENCE_KEY)
    hot_rows = ordered["_hot"].to_numpy(zero_copy_only=False).astype(bool)
    group_in_tier = ~hot_rows[starts]
    return ordered.filter(pa.array(hot_rows & group_in_tier[starts.cumsum() - 1])).select(kernel.POSITIONS)


def repeated_in_tier_on_spark(hot: DataFrame, tier: DataFrame) -> DataFrame:
    """`repeated_in_tier` on Spark: the key columns of each topic's rows of both frames, cogrouped,
    in a Python worker; the full rows stay in the JVM."""
    return hot.select(*SENT_COLUMNS).groupBy("topic").cogroup(tier.select(*SENT_COLUMNS).groupBy("topic")).applyInArrow(
        repeated_in_tier, REPEATED_SCHEMA)


def _stable(view: dict) -> Position:
    return Position(view["max_read_ledger_id"], view["max_read_entry_id"])


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
    """A read-committed, ledger-order reader of one warehouse, hot and cold tiers together.

    `driver_max_bytes`: the most entry bytes a read takes in this process, without Spark (module
    doc); 0 reads on Spark always."""

    def __init__(self, warehouse: Warehouse, driver_max_bytes: int = DRIVER_WRITE_MAX_BYTES):
        self.warehouse = warehouse
        self.driver_max_bytes = driver_max_bytes

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
        return self._frame(topic, from_position, self.published(topic))  # the view before the entries: module doc

    def _frame(self, topic: str, from_position: Position, view: dict | None) -> DataFrame:
        wh = self.warehouse
        # Column expressions need a running session; a CLI's warehouse starts it on first use.
        wh.spark  # noqa: B018
        cold_ids = sorted(ledger for _, ledger in offloaded_ledgers(wh, topic))
        # The one read limit, whichever tier holds the entry.
        mine = (F.col("topic") == topic) & (F.lit(False) if view is None else read_limit(F.col, from_position, _stable(view)))
        tier = wh.read_or_empty(OFFLOADED_ENTRIES, OFFLOADED_ENTRIES_SCHEMA).where(
            (F.col("topic") == topic) & F.col("ledger_id").isin(cold_ids))
        cold = tier.where(mine).select(*LEDGER_ENTRY_COLUMNS, F.lit(COLD).alias("tier"))
        hot = (
            wh.read(COMMITTED_ENTRIES)
            .where(mine & ~F.col("ledger_id").isin(cold_ids))
            .select(*LEDGER_ENTRY_COLUMNS, F.lit(HOT).alias("tier"))
        )
        if cold_ids:
            hot = hot.join(repeated_in_tier_on_spark(hot, tier), list(kernel.POSITIONS), "left_anti")
        return cold.unionByName(hot)

    def read(self, topic: str, from_position: Position = EARLIEST, max_entries: int | None = None) -> ReadBatch:
        """Up to `max_entries` entries of `topic` from `from_position` (inclusive), in ledger order."""
        if max_entries is not None and max_entries < 0:
            raise TxnlakeError(f"max_entries must not be negative, got {max_entries}; pass a count, or none for all")
        view = self.published(topic)
        if self.fits_driver(topic, from_position, view):
            return ReadBatch(self.read_in_driver(topic, from_position, max_entries, view))
        ordered = self._frame(topic, from_position, view).orderBy("ledger_id", "entry_id")
        if max_entries is not None:
            ordered = ordered.limit(max_entries)
        return ReadBatch(ordered.collect())

    def fits_driver(self, topic: str, from_position: Position, view: dict | None) -> bool:
        """Whether the ledgers the read can reach hold at most `driver_max_bytes` of entries, by the
        `ledgers` catalog (False without one: the size is then unknown)."""
        if view is None:
            return True  # nothing is readable: no rows to read
        if self.driver_max_bytes <= 0 or not self.warehouse.exists(LEDGERS):
            return False
        catalog = DeltaTables(self.warehouse).read(LEDGERS, LEDGERS_SCHEMA, ["topic", "ledger_id", "size_bytes"])
        reached = pc.and_(pc.equal(catalog["topic"], topic),
                          pc.and_(pc.greater_equal(catalog["ledger_id"], from_position.ledger_id),
                                  pc.less_equal(catalog["ledger_id"], view["max_read_ledger_id"])))
        return (pc.sum(catalog.filter(reached)["size_bytes"]).as_py() or 0) <= self.driver_max_bytes

    def read_in_driver(self, topic: str, from_position: Position, max_entries: int | None,
                       view: dict | None) -> list[Row]:
        """`read`'s entries by delta-rs and Arrow, the rules of `frame` (module doc), as Rows like
        Spark's (a timestamp in this process's local time, without zone; a payload as bytearray)."""
        if view is None:
            return []
        wh, tables = self.warehouse, DeltaTables(self.warehouse)
        stable = _stable(view)
        cold_ids = pa.array(sorted(ledger for _, ledger in offloaded_ledgers(wh, topic)), pa.int64())
        # Files are skipped by their ledger statistics; the topic is matched on the rows read (`scan`).
        reached = (pc.field("ledger_id") >= from_position.ledger_id) & (pc.field("ledger_id") <= stable.ledger_id)
        limit = read_limit(pc.field, from_position, stable)
        mine = pc.field("topic") == topic
        cold = pa.table({})
        hot = scan(tables.dataset(COMMITTED_ENTRIES), reached & limit, LEDGER_ENTRY_COLUMNS, mine, ["topic"])
        if len(cold_ids) and wh.exists(OFFLOADED_ENTRIES):
            tier = tables.dataset(OFFLOADED_ENTRIES)
            cold = scan(tier, reached & limit & kernel.ledger_filter(cold_ids), LEDGER_ENTRY_COLUMNS, mine, ["topic"])
            cold = cold.append_column("tier", pa.array([COLD] * cold.num_rows, pa.string()))
            hot = hot.filter(pc.invert(pc.is_in(hot["ledger_id"], cold_ids)))
            sent = scan(tier, kernel.ledger_filter(cold_ids), SENT_COLUMNS, mine, ["topic"])
            at = kernel.with_row_index(hot.select(["ledger_id", "entry_id"]))  # joined narrow: the full rows by mask
            repeated = at.join(repeated_in_tier(hot, sent).select(["ledger_id", "entry_id"]), ["ledger_id", "entry_id"],
                               join_type="left semi")
            hot = hot.filter(pa.array(~kernel.rows_mask(hot.num_rows, repeated["_row"])))
        hot = hot.append_column("tier", pa.array([HOT] * hot.num_rows, pa.string()))

        def first(rows: pa.Table) -> list[dict]:  # each tier's first max_entries, ordered in Arrow
            if not rows.num_rows:
                return []
            ordered = rows.sort_by([("ledger_id", "ascending"), ("entry_id", "ascending")])
            return (ordered if max_entries is None else ordered.slice(0, max_entries)).to_pylist()
        rows = sorted(first(cold) + first(hot), key=lambda r: (r["ledger_id"], r["entry_id"]))
        return [_spark_like_row(r) for r in rows[:max_entries]]


_BINARY = {f.name for f in LEDGER_ENTRIES_SCHEMA.fields if isinstance(f.dataType, BinaryType)}
_TIMESTAMPS = {f.name for f in LEDGER_ENTRIES_SCHEMA.fields if isinstance(f.dataType, TimestampType)}
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _spark_like_row(values: dict) -> Row:
    """A row read by Arrow as Spark's `collect` returns it: the ledger_entries columns and the
    tier; binary as bytearray, a timestamp in this process's local time without zone."""
    out = {}
    for c in (*LEDGER_ENTRY_COLUMNS, "tier"):
        v = values[c]
        if v is not None and c in _BINARY:
            v = bytearray(v)
        elif v is not None and c in _TIMESTAMPS:
            v = TimestampType().fromInternal((v - _EPOCH) // timedelta(microseconds=1))
        out[c] = v
    return Row(**out)
