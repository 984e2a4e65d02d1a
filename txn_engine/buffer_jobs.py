"""The transaction buffer on Spark: `txn_markers`, `aborted_txns`, `stable_positions`, `committed_entries`.

Each public function takes the `ledger_entries` DataFrame and returns exactly the columns of the
brief's table. The results equal what `txn_engine.transaction_buffer` (the oracle) holds after
being fed every topic's whole history in ledger order: the same de-duplication, the same
first-marker-wins rule, the same dropped late data, the same stable position and violation counts.

The rules, stated over the whole history at once (per topic):
- a DATA entry with a producer_id and a sequence_id repeating an earlier DATA entry's pair is a
  duplicate and is dropped, whatever its transaction (the first position is kept);
- the first marker of a transaction decides it; later markers are `duplicate_marker`;
- kept data of a transaction after its first marker is `data_after_marker` and dropped;
- a first marker with no kept data of its transaction before it is `marker_without_data` (still
  a marker, and an ABORT one still enters the abort set);
- a transaction with kept data and no marker is ongoing; the stable position is the position
  before the earliest ongoing transaction's first kept entry (`positions.position_before`, whose
  "previous ledger" is the topic's previous non-empty ledger, counting every entry), or the
  topic's last position when none is ongoing.

How the work is laid out, and why (the payload is ~200 bytes a row, the other columns ~70):
- `classify_entries` computes the facts once, from narrow columns only: the positions of the
  duplicates, per block of 64 entries of a ledger and transaction the kept DATA as bits, the
  last entry of each ledger, and per (topic, transaction) its first marker and first kept
  entry. Every table is built from these facts.
- Duplicates: sequence ids are counted per bucket of 64 ids of a producer, with a bit per id
  (`duplicate_entries`): a few hundred thousand groups instead of one per entry, and only the
  entries of the repeated ids are then ranked by position. The duplicates are taken off the
  blocks afterwards (their bits): the 10M-row aggregate reads no duplicate flag.
- First positions are two long columns, never a struct: a hash aggregate cannot hold a struct
  buffer (Spark falls back to a sort aggregate), so the lexicographic minimum is taken in two
  hash aggregates, per (topic, ledger, txn) with min(entry_id), then per (topic, txn) with
  min(ledger_id) and min_by(entry, ledger_id) (each ledger occurs once per txn there).
- `committed_entries` shuffles no row: the blocks a reader sees (about one row per transaction
  and ledger, with the count of the transaction's kept entries before each) are broadcast, and
  each full row finds there whether it is kept and visible, and its `local_seq` (the count
  before its block plus the bits before its own). Late data is counted from the same bits.
  Numbering full rows in a window, as before, shuffled and sorted ~4M payloads: a third of the
  full run. Past `BROADCAST_MAX_BYTES` of blocks (a history of about 20M entries) each row is
  shuffled once to its block instead: a broadcast grows with the history and is held whole.
- `compute_buffer_tables` caches the narrow facts and the stable positions, so writing the four
  tables reads the full rows only for `committed_entries`.

Assumes what ingest guarantees: one entry per (topic, ledger_id, entry_id), markers carry a
transaction id (a marker without one is ignored here; the oracle rejects it), non-negative ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, reduce

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from txn_engine.buffer_arrow import require_ledger_entries
from txn_engine.delta_io import fits_driver
from txn_engine.errors import TxnlakeError
from txn_engine.log_types import EntryType, Violation
from txn_engine.schema import (
    ABORTED_TXNS_SCHEMA,
    COMMITTED_ENTRIES_SCHEMA,
    LEDGER_ENTRY_COLUMNS,
    POSITION_COLUMNS,
    STABLE_POSITIONS_SCHEMA,
    TXN_MARKERS_SCHEMA,
)

TXN_KEY = ("topic", "txn_most_bits", "txn_least_bits")
LEDGER_TXN_KEY = ("topic", "ledger_id", "txn_most_bits", "txn_least_bits")
BLOCK_KEY = (*LEDGER_TXN_KEY, "block")
# A duplicate's position and its own transaction: what `ledger_txn_blocks` takes off its block.
DUPLICATE_COLUMNS = (*POSITION_COLUMNS, "txn_most_bits", "txn_least_bits")
SEQUENCE_KEY = ("topic", "producer_id", "sequence_id")
VIOLATIONS = tuple(v.value for v in Violation)  # duplicate, data_after_marker, duplicate_marker, marker_without_data
# Only these columns feed the facts; the rest (payload above all) is read for committed_entries only.
NARROW_COLUMNS = ("topic", "ledger_id", "entry_id", "entry_type", "txn_most_bits", "txn_least_bits",
                  "producer_id", "sequence_id")


# -- column helpers -----------------------------------------------------------------------------

def is_data() -> Column:
    return F.col("entry_type") == EntryType.DATA.value


def has_txn() -> Column:
    """Transactional: both halves of the id set (ingest never stores only one)."""
    return F.col("txn_most_bits").isNotNull() & F.col("txn_least_bits").isNotNull()


def is_marker() -> Column:
    return (F.col("entry_type") != EntryType.DATA.value) & has_txn()


def has_sequence() -> Column:
    """Only DATA with both producer_id and sequence_id takes part in de-duplication."""
    return F.col("producer_id").isNotNull() & F.col("sequence_id").isNotNull()


def position_lt(ledger: Column, entry: Column, other_ledger: Column, other_entry: Column) -> Column:
    """(ledger, entry) < (other_ledger, other_entry) in log order, on two long columns."""
    return (ledger < other_ledger) | ((ledger == other_ledger) & (entry < other_entry))


def position_le(ledger: Column, entry: Column, other_ledger: Column, other_entry: Column) -> Column:
    """(ledger, entry) <= (other_ledger, other_entry) in log order, on two long columns."""
    return (ledger < other_ledger) | ((ledger == other_ledger) & (entry <= other_entry))


# Entry ids (and sequence ids) in blocks of 64: one long holds a bit for each id of a block.
BLOCK_SHIFT = 6
BLOCK_SIZE = 1 << BLOCK_SHIFT
_MIN_LONG = -(1 << 63)


def block_of(id_: Column) -> Column:
    return F.shiftright(id_, BLOCK_SHIFT)


def _offset_in_block(id_: Column) -> Column:
    return id_.bitwiseAND(BLOCK_SIZE - 1).cast("int")


def entry_bit(id_: Column) -> Column:
    """The id's bit in its block's long."""
    return F.call_function("shiftleft", F.lit(1).cast("long"), _offset_in_block(id_))


def bits_before(id_: Column) -> Column:
    """The bits of the ids of its block below `id_`. (Shifts only: ANSI arithmetic would overflow at bit 63.)"""
    return F.bitwise_not(F.call_function("shiftleft", F.lit(-1).cast("long"), _offset_in_block(id_)))


def bits_after(id_: Column) -> Column:
    """The bits of the ids of its block above `id_`."""
    return F.call_function("shiftleft", F.lit(-1).cast("long"), _offset_in_block(id_)).bitwiseAND(F.bitwise_not(entry_bit(id_)))


def lowest_entry(block: Column, bits: Column) -> Column:
    """The least id whose bit is set in `bits` (not 0) of `block`: the count of trailing zeros, by
    bit_count(~x & (x - 1)); x - 1 overflows only for bit 63 alone, taken apart."""
    trailing = F.when(bits == F.lit(_MIN_LONG), F.lit(BLOCK_SIZE - 1)).otherwise(
        F.bit_count(F.bitwise_not(bits).bitwiseAND(bits - 1)))
    return block * BLOCK_SIZE + trailing


# A broadcast is held whole by the driver and by every executor, and one that grows with the history
# (Spark refuses a broadcast past 8 GB; executors run out first) is made only while its rows, at
# what one costs in the hash relation, fit this bound (`fits_driver`); past it the join shuffles.
# The blocks `read_committed` broadcasts to the full rows: at 10M entries 1.45M visible blocks made
# a 384 MiB hash relation (~280 bytes a block); past the bound each row goes to its block once.
# The offload's decided transactions take the same bound (`offload.decided_txns`).
BROADCAST_MAX_BYTES = 1 << 30
BLOCK_BROADCAST_BYTES = 280


def blocks_fit_broadcast(blocks: DataFrame, max_bytes: int = BROADCAST_MAX_BYTES) -> bool:
    """Whether `read_committed` may broadcast `blocks` (`ledger_txn_blocks`; cached ones count cheaply):
    every block with kept data counted, a bound of what both broadcasts hold."""
    return fits_driver(blocks.filter(F.col("kept_bits") != 0), max_bytes, BLOCK_BROADCAST_BYTES)


def conform(frame: DataFrame, schema: StructType) -> DataFrame:
    """Exactly the schema's columns, in its order and types."""
    return frame.select(*[F.col(f.name).cast(f.dataType).alias(f.name) for f in schema.fields])


# -- the shared facts ---------------------------------------------------------------------------

@dataclass(frozen=True)
class BufferFacts:
    """What every buffer table is built from; all narrow, all lazily defined.

    - `duplicates`: (topic, ledger_id, entry_id) of DATA entries that repeat an earlier
      (producer_id, sequence_id) of their topic: the `duplicate` violations, dropped everywhere.
    - `ledgers`: (topic, ledger_id, last_entry_id) over every entry, dropped ones included (the
      log's end, and the "previous non-empty ledger" of the position-before rule).
    - `txns`: per (topic, txn_most_bits, txn_least_bits) with kept data or a marker: `outcome`,
      `marker_ledger_id`, `marker_entry_id` of the first marker (null when none), `marker_count`,
      and `first_data_ledger_id`, `first_data_entry_id` of its first kept DATA entry (null when none).
    - `blocks`: `ledger_txn_blocks`, the per-block step `by_ledger_txn` rolls up: which entries
      are kept DATA, a bit each (None when the facts were folded from stored state).
    """

    entries: DataFrame
    duplicates: DataFrame
    by_ledger_txn: DataFrame  # per (topic, ledger_id, txn); the step both `ledgers` and `txns` come from
    ledgers: DataFrame
    txns: DataFrame
    blocks: DataFrame | None = None

    def cached_frames(self) -> list[DataFrame]:
        """The frames `classify_entries(persist=True)` caches (unpersisting the others is harmless)."""
        return [f for f in (self.duplicates, self.blocks, self.by_ledger_txn, self.txns) if f is not None]


def classify_entries(entries: DataFrame, persist: bool = False) -> BufferFacts:
    """The facts of the transaction buffer, from the narrow columns of `ledger_entries`.

    `persist=True` caches the duplicates, the blocks, the per-(topic, ledger, txn) step and `txns`
    (all narrow: about one row per transaction and ledger), for callers that build several tables.
    """
    require_ledger_entries(entries)
    narrow = entries.select(*NARROW_COLUMNS)
    duplicates = duplicate_entries(narrow)
    if persist:
        duplicates = duplicates.cache()
    blocks = ledger_txn_blocks(narrow, duplicates)
    if persist:
        blocks = blocks.cache()
    ledger_txns = ledger_txns_from_blocks(blocks)
    if persist:
        ledger_txns = ledger_txns.cache()
    txns = txns_from_ledger_txns(ledger_txns)
    if persist:
        txns = txns.cache()
    ledgers = ledger_txns.groupBy("topic", "ledger_id").agg(F.max("last_entry_id").alias("last_entry_id"))
    return BufferFacts(entries, duplicates.select(*POSITION_COLUMNS), ledger_txns, ledgers, txns, blocks)


def duplicate_positions(narrow: DataFrame) -> DataFrame:
    """(topic, ledger_id, entry_id) of the DATA entries repeating an earlier (producer_id, sequence_id) of their topic."""
    return duplicate_entries(narrow).select(*POSITION_COLUMNS)


def duplicate_entries(narrow: DataFrame) -> DataFrame:
    """`duplicate_positions` with each duplicate's own transaction (`DUPLICATE_COLUMNS`), which `ledger_txn_blocks` takes.

    Nearly every (topic, producer_id, sequence_id) is unique, and counting 10M keys was the
    costliest aggregate of the facts. So the keys are counted per bucket of 64 consecutive
    sequence ids of a producer (a few hundred thousand groups: a cheap aggregate), with a bit per
    id: OR (ids seen) and XOR (ids seen an odd number of times). A bucket with more entries than
    ids seen holds a repeat; when its extra entries are exactly as many as its ids seen an even
    number of times, those are the ids seen twice (any id seen 3 or more times breaks the
    equality), else every id of the bucket is a candidate. Only the candidates' entries are
    ranked by position: exact whatever the ids look like.
    """
    sequenced = narrow.filter(is_data() & has_sequence())
    bit = entry_bit(F.col("sequence_id"))
    buckets = sequenced.groupBy("topic", "producer_id", block_of(F.col("sequence_id")).alias("_bucket")).agg(
        F.count("*").alias("_n"), F.bit_or(bit).alias("_seen"), F.bit_xor(bit).alias("_odd")
    )
    seen = F.bit_count("_seen")
    twice = F.col("_seen").bitwiseAND(F.bitwise_not(F.col("_odd")))
    repeated = buckets.filter(F.col("_n") > seen).select(
        "topic", "producer_id", "_bucket",
        F.when(F.col("_n") - seen == F.bit_count(twice), twice).otherwise(F.col("_seen")).alias("_bits"),
    )
    keys = repeated.select(
        "topic", "producer_id", "_bucket",
        F.explode(F.filter(F.sequence(F.lit(0), F.lit(BLOCK_SIZE - 1)),
                           lambda i: F.call_function("shiftrightunsigned", F.col("_bits"), i).bitwiseAND(1) == 1)).alias("_i"),
    ).select("topic", "producer_id", (F.col("_bucket") * BLOCK_SIZE + F.col("_i")).alias("sequence_id"))
    candidates = sequenced.join(F.broadcast(keys), list(SEQUENCE_KEY), "left_semi")
    in_log_order = Window.partitionBy(*SEQUENCE_KEY).orderBy("ledger_id", "entry_id")
    return (
        candidates.withColumn("_nth", F.row_number().over(in_log_order))
        .filter(F.col("_nth") > 1)  # the first position is kept
        .select(*DUPLICATE_COLUMNS)
    )


def ledger_txn_blocks(narrow: DataFrame, duplicates: DataFrame | None = None) -> DataFrame:
    """Per (topic, ledger_id, txn, block of 64 entry ids): `by_ledger_txn`'s columns and the block's kept DATA as bits.

    `kept_count` and `kept_bits` (bit `entry_id % 64` set for each kept DATA entry: not a
    duplicate; non-transactional ones included) are what numbers a transaction's entries
    (`read_committed`) and counts its late data without shuffling or rescanning rows. The
    aggregate reads no duplicate flag: the few `duplicates` (positions with their own transaction,
    `DUPLICATE_COLUMNS`) are taken off the blocks afterwards, their bits are distinct entries'.
    Non-transactional entries fall in the (topic, ledger_id, null, null, block) groups. Without
    `duplicates` every DATA entry is kept (rows already de-duplicated).
    """
    bit = entry_bit(F.col("entry_id"))
    marker_entry = F.when(is_marker(), F.col("entry_id"))
    block = block_of(F.col("entry_id")).alias("block")
    blocks = narrow.groupBy(*LEDGER_TXN_KEY, block).agg(
        F.count("*").alias("entry_count"),
        F.max("entry_id").alias("last_entry_id"),
        F.count(marker_entry).alias("marker_count"),
        F.min(marker_entry).alias("marker_entry_id"),
        # A boolean, not the entry_type string: keeps the aggregate a hash aggregate.
        F.min_by(F.col("entry_type") == EntryType.COMMIT.value, marker_entry).alias("marker_is_commit"),
        F.count(F.when(is_data(), 1)).alias("_data_count"),
        F.bit_or(F.when(is_data(), bit)).alias("_data_bits"),
    )
    if duplicates is None:
        blocks = blocks.withColumns({"duplicate_count": F.lit(0).cast("long"), "_dup_bits": F.lit(0).cast("long")})
    else:
        dropped = duplicates.groupBy(*LEDGER_TXN_KEY, block).agg(
            F.count("*").alias("duplicate_count"), F.bit_or(bit).alias("_dup_bits")
        )
        keys = [f"_d_{c}" for c in BLOCK_KEY]
        dropped = dropped.toDF(*keys, "duplicate_count", "_dup_bits")
        same_block = reduce(lambda a, b: a & b, [F.col(c).eqNullSafe(F.col(k)) for c, k in zip(BLOCK_KEY, keys)])
        blocks = blocks.join(F.broadcast(dropped), same_block, "left")
    kept_bits = F.coalesce(F.col("_data_bits"), F.lit(0).cast("long")).bitwiseAND(
        F.bitwise_not(F.coalesce(F.col("_dup_bits"), F.lit(0).cast("long"))))
    return (
        blocks
        .withColumn("duplicate_count", F.coalesce(F.col("duplicate_count"), F.lit(0).cast("long")))
        .withColumn("kept_bits", kept_bits)
        .select(
            *BLOCK_KEY, "entry_count", "last_entry_id", "marker_count", "marker_entry_id", "marker_is_commit",
            F.when(has_txn() & (F.col("kept_bits") != 0), lowest_entry(F.col("block"), F.col("kept_bits"))).alias("data_entry_id"),
            "duplicate_count",
            (F.col("_data_count") - F.col("duplicate_count")).alias("kept_count"),
            "kept_bits",
        )
    )


def ledger_txns_from_blocks(blocks: DataFrame) -> DataFrame:
    """`by_ledger_txn` from `ledger_txn_blocks`: each (topic, ledger, txn)'s blocks rolled up."""
    return blocks.groupBy(*LEDGER_TXN_KEY).agg(
        F.sum("entry_count").alias("entry_count"),
        F.max("last_entry_id").alias("last_entry_id"),
        F.sum("marker_count").alias("marker_count"),
        F.min("marker_entry_id").alias("marker_entry_id"),
        F.min_by("marker_is_commit", "marker_entry_id").alias("marker_is_commit"),
        F.min("data_entry_id").alias("data_entry_id"),
        F.sum("duplicate_count").alias("duplicate_count"),
    )


def by_ledger_txn(narrow: DataFrame, duplicates: DataFrame) -> DataFrame:
    """Per (topic, ledger_id, txn): entry count, last entry, marker count, first marker, first kept data entry and duplicate count.

    Non-transactional entries fall in the (topic, ledger_id, null, null) group: they only count
    for the ledger's size and last entry. Only the `duplicates` (`DUPLICATE_COLUMNS`) make a row
    depend on other ledgers, which is what lets the incremental path persist these rows per ledger.
    """
    return ledger_txns_from_blocks(ledger_txn_blocks(narrow, duplicates))


def txns_from_ledger_txns(by_ledger_txn: DataFrame) -> DataFrame:
    # Each ledger occurs once per txn here, so min_by(entry, ledger) is the lexicographic minimum.
    marker_ledger = F.when(F.col("marker_entry_id").isNotNull(), F.col("ledger_id"))
    data_ledger = F.when(F.col("data_entry_id").isNotNull(), F.col("ledger_id"))
    per_txn = by_ledger_txn.filter(has_txn()).groupBy(*TXN_KEY).agg(
        F.sum("marker_count").alias("marker_count"),
        F.min(marker_ledger).alias("marker_ledger_id"),
        F.min_by("marker_entry_id", marker_ledger).alias("marker_entry_id"),
        F.min_by("marker_is_commit", marker_ledger).alias("_is_commit"),
        F.min(data_ledger).alias("first_data_ledger_id"),
        F.min_by("data_entry_id", data_ledger).alias("first_data_entry_id"),
    )
    outcome = F.when(F.col("_is_commit"), F.lit(EntryType.COMMIT.value)).when(
        ~F.col("_is_commit"), F.lit(EntryType.ABORT.value)
    )
    return (
        # A transaction whose every entry was a duplicate never existed for the buffer.
        per_txn.filter((F.col("marker_count") > 0) | F.col("first_data_ledger_id").isNotNull())
        .withColumn("outcome", outcome)
        .drop("_is_commit")
    )


# -- the tables from the facts ------------------------------------------------------------------

def markers_from_facts(facts: BufferFacts) -> DataFrame:
    first = facts.txns.filter(F.col("marker_count") > 0).select(
        *TXN_KEY, "outcome", F.col("marker_ledger_id").alias("ledger_id"), F.col("marker_entry_id").alias("entry_id")
    )
    return conform(first, TXN_MARKERS_SCHEMA)


def aborted_from_facts(facts: BufferFacts) -> DataFrame:
    aborted = facts.txns.filter(F.col("outcome") == EntryType.ABORT.value).select(
        *TXN_KEY,
        F.col("marker_ledger_id").alias("abort_ledger_id"),
        F.col("marker_entry_id").alias("abort_entry_id"),
    )
    return conform(aborted, ABORTED_TXNS_SCHEMA)


def stable_from_facts(facts: BufferFacts) -> DataFrame:
    """One row per topic with entries: the max read position, the last position, the ongoing count."""
    ongoing = facts.txns.filter(F.col("marker_count") == 0)  # every row left has kept data
    # The earliest first entry per topic, again in two hash aggregates on long columns.
    per_ledger = ongoing.groupBy("topic", F.col("first_data_ledger_id").alias("_l")).agg(
        F.min("first_data_entry_id").alias("_e"), F.count("*").alias("_n")
    )
    earliest = per_ledger.groupBy("topic").agg(
        F.min("_l").alias("_first_ledger"), F.min_by("_e", "_l").alias("_first_entry"), F.sum("_n").alias("_ongoing")
    )
    earlier_ledger = F.when(F.col("ledger_id") < F.col("_first_ledger"), F.col("ledger_id"))
    per_topic = (
        facts.ledgers.join(F.broadcast(earliest), "topic", "left")
        .groupBy("topic", "_first_ledger", "_first_entry", "_ongoing")
        .agg(
            F.max("ledger_id").alias("last_ledger_id"),
            F.max_by("last_entry_id", "ledger_id").alias("last_entry_id"),
            # The previous non-empty ledger of the earliest ongoing entry, for position_before.
            F.max(earlier_ledger).alias("_prev_ledger"),
            F.max_by("last_entry_id", earlier_ledger).alias("_prev_entry"),
        )
    )
    none_ongoing = F.col("_first_ledger").isNull()
    first_of_ledger = F.col("_first_entry") == 0
    max_read_ledger = (
        F.when(none_ongoing, F.col("last_ledger_id"))
        .when(~first_of_ledger, F.col("_first_ledger"))
        .otherwise(F.coalesce("_prev_ledger", "_first_ledger"))
    )
    max_read_entry = (
        F.when(none_ongoing, F.col("last_entry_id"))
        .when(~first_of_ledger, F.col("_first_entry") - 1)
        .otherwise(F.coalesce(F.col("_prev_entry"), F.lit(-1)))
    )
    stable = per_topic.select(
        "topic",
        max_read_ledger.alias("max_read_ledger_id"),
        max_read_entry.alias("max_read_entry_id"),
        "last_ledger_id",
        "last_entry_id",
        F.coalesce(F.col("_ongoing"), F.lit(0)).alias("ongoing_txn_count"),
    )
    return conform(stable, STABLE_POSITIONS_SCHEMA)


def committed_from_facts(facts: BufferFacts, stable: DataFrame, broadcast_max_bytes: int = BROADCAST_MAX_BYTES) -> DataFrame:
    """The read-committed view: kept DATA of no transaction or of a committed one, before its marker."""
    blocks = blocks_of(facts)
    return read_committed(facts.entries, blocks, committed_txns(facts.txns), stable,
                          broadcast=blocks_fit_broadcast(blocks, broadcast_max_bytes))


def blocks_of(facts: BufferFacts) -> DataFrame:
    if facts.blocks is None:
        raise TxnlakeError("these buffer facts were folded from stored state and have no blocks; "
                           "classify the entries (buffer_jobs.classify_entries) to read committed rows or count late data")
    return facts.blocks


def committed_txns(txns: DataFrame) -> DataFrame:
    """(topic, txn, visible_ledger_id, visible_entry_id): the committed transactions and their commit marker."""
    return txns.filter(F.col("outcome") == EntryType.COMMIT.value).select(
        *TXN_KEY, F.col("marker_ledger_id").alias("visible_ledger_id"), F.col("marker_entry_id").alias("visible_entry_id")
    )


def visible_blocks(blocks: DataFrame, committed: DataFrame) -> DataFrame:
    """The blocks (`ledger_txn_blocks`) of the transactions in `committed` that begin before the
    commit marker, with `visible_ledger_id`, `visible_entry_id` and `_offset`: the transaction's
    kept entries in its earlier blocks.

    A row's `local_seq` is `_offset` plus its block's kept entries before it. Blocks after the
    marker are left out, and those numbered are all before it, so late data changes no number.
    """
    earlier = Window.partitionBy(*TXN_KEY).orderBy("ledger_id", "block").rowsBetween(Window.unboundedPreceding, -1)
    return (
        blocks.filter(has_txn() & (F.col("kept_bits") != 0))
        .select(*BLOCK_KEY, "kept_count", "kept_bits")
        .join(committed, list(TXN_KEY))
        .filter(position_lt(F.col("ledger_id"), F.col("block") * BLOCK_SIZE, F.col("visible_ledger_id"), F.col("visible_entry_id")))
        .withColumn("_offset", F.coalesce(F.sum("kept_count").over(earlier), F.lit(0).cast("long")))
        .drop("kept_count")
    )


def read_committed(rows: DataFrame, blocks: DataFrame, committed: DataFrame, stable: DataFrame,
                   broadcast: bool = True) -> DataFrame:
    """`committed_entries` from `ledger_entries` rows, their blocks (`ledger_txn_blocks`) and `committed_txns`.

    `rows` may hold any entries: a row is read when its block marks it kept DATA and it is
    non-transactional, or of a transaction in `committed` and before its marker. So a caller can
    pass more than it wants rows for (the incremental path passes only the transactions committed
    in the ledgers it recomputes). Every block of a committed transaction before its marker must
    be in `blocks` (they number its rows), and the rows of those wanted in `rows`.

    No row is shuffled: the blocks a reader sees (about one row per transaction and ledger) are
    broadcast, and each row finds its block, its bit and its number there. A shuffle of full rows
    by transaction, to number them in a window, was the costliest step of the full run. Two
    broadcasts, transactional and not, so that each row probes one with plain equality (a
    null-safe key of both kinds doubled the key columns every row builds).

    With `broadcast=False` (blocks too many to broadcast: `blocks_fit_broadcast`) the same rows
    come from joins by shuffle: the transactional rows with their transaction's blocks, the
    others with theirs, so that each row is shuffled once.
    """
    in_txn = visible_blocks(blocks, committed).select(
        *[F.col(c).alias(f"_t_{c}") for c in BLOCK_KEY], F.col("kept_bits").alias("_t_bits"),
        "visible_ledger_id", "visible_entry_id", "_offset")
    plain = blocks.filter(~has_txn() & (F.col("kept_bits") != 0)).select(
        *[F.col(c).alias(f"_p_{c}") for c in ("topic", "ledger_id", "block")], F.col("kept_bits").alias("_p_bits"))
    entry = F.col("entry_id")
    block = block_of(entry)
    txn_match = reduce(lambda a, b: a & b, [F.col(c) == F.col(f"_t_{c}") for c in LEDGER_TXN_KEY]) & (block == F.col("_t_block"))
    # Null for transactional rows: they skip this probe.
    plain_row = lambda column: F.when(~has_txn(), column)  # noqa: E731
    plain_match = ((plain_row(F.col("topic")) == F.col("_p_topic")) & (plain_row(F.col("ledger_id")) == F.col("_p_ledger_id"))
                   & (block == F.col("_p_block")))
    data = rows.filter(is_data())
    if broadcast:
        joined = data.join(F.broadcast(in_txn), txn_match, "left").join(F.broadcast(plain), plain_match, "left")
    else:
        # Inner joins: a row without its block is not read either way.
        joined = data.filter(has_txn()).join(in_txn, txn_match).unionByName(
            data.filter(~has_txn()).join(plain, plain_match), allowMissingColumns=True)
    bits = F.coalesce(F.col("_t_bits"), F.col("_p_bits"))
    kept = bits.bitwiseAND(entry_bit(entry)) != 0
    before_marker = ~has_txn() | position_lt(F.col("ledger_id"), entry, F.col("visible_ledger_id"), F.col("visible_entry_id"))
    local_seq = F.when(has_txn(), F.col("_offset") + F.bit_count(bits.bitwiseAND(bits_before(entry))))
    read = joined.filter(kept & before_marker).select(
        *LEDGER_ENTRY_COLUMNS,
        F.coalesce("visible_ledger_id", "ledger_id").alias("visible_ledger_id"),
        F.coalesce("visible_entry_id", "entry_id").alias("visible_entry_id"),
        F.coalesce(local_seq, F.lit(0)).cast("long").alias("local_seq"),
    )
    stable_at = stable.select("topic", F.col("max_read_ledger_id").alias("_sl"), F.col("max_read_entry_id").alias("_se"))
    in_prefix = position_le(F.col("ledger_id"), entry, F.col("_sl"), F.col("_se"))
    return conform(read.join(F.broadcast(stable_at), "topic").withColumn("in_stable_prefix", in_prefix), COMMITTED_ENTRIES_SCHEMA)


def late_data(blocks: DataFrame, txns: DataFrame) -> DataFrame:
    """Per block of `blocks` with kept DATA of a transaction with a first marker in `txns`: `topic`
    and `_late`, its kept entries after that marker (`data_after_marker`), from the block's bits."""
    markers = txns.filter(F.col("marker_count") > 0).select(
        *TXN_KEY, F.col("marker_ledger_id").alias("_ml"), F.col("marker_entry_id").alias("_me"))
    marked = blocks.filter(has_txn() & (F.col("kept_bits") != 0)).select(*BLOCK_KEY, "kept_count", "kept_bits").join(
        markers, list(TXN_KEY))
    marker_ledger, marker_entry = F.col("_ml"), F.col("_me")
    marker_block = block_of(marker_entry)
    late = (
        F.when((F.col("ledger_id") > marker_ledger) | ((F.col("ledger_id") == marker_ledger) & (F.col("block") > marker_block)),
               F.col("kept_count"))
        .when((F.col("ledger_id") == marker_ledger) & (F.col("block") == marker_block),
              F.bit_count(F.col("kept_bits").bitwiseAND(bits_after(marker_entry))).cast("long"))
        .otherwise(F.lit(0).cast("long"))
    )
    return marked.select("topic", late.alias("_late"))


def violations_from_facts(facts: BufferFacts) -> DataFrame:
    """Per topic (every topic with entries), the count of each violation, as the oracle counts them."""
    topics = facts.ledgers.select("topic").distinct()
    duplicates = facts.duplicates.groupBy("topic").agg(F.count("*").alias(Violation.DUPLICATE.value))
    has_marker = F.col("marker_count") > 0
    data_before_marker = F.col("first_data_ledger_id").isNotNull() & position_lt(
        F.col("first_data_ledger_id"), F.col("first_data_entry_id"), F.col("marker_ledger_id"), F.col("marker_entry_id")
    )
    per_txn = facts.txns.groupBy("topic").agg(
        F.sum(F.when(has_marker, F.col("marker_count") - 1).otherwise(0)).alias(Violation.DUPLICATE_MARKER.value),
        F.count(F.when(has_marker & ~data_before_marker, 1)).alias(Violation.MARKER_WITHOUT_DATA.value),
    )
    late = late_data(blocks_of(facts), facts.txns).groupBy("topic").agg(F.sum("_late").alias(Violation.DATA_AFTER_MARKER.value))
    joined = topics.join(duplicates, "topic", "left").join(per_txn, "topic", "left").join(late, "topic", "left")
    return joined.select("topic", *[F.coalesce(F.col(v), F.lit(0)).cast("long").alias(v) for v in VIOLATIONS])


def violation_totals(per_topic: DataFrame) -> dict[str, int]:
    """Sum the per-topic counts: every violation name, zero included."""
    row = per_topic.agg(*[F.sum(v).alias(v) for v in VIOLATIONS]).collect()[0]
    return {v: int(row[v] or 0) for v in VIOLATIONS}


# -- public: one table each ---------------------------------------------------------------------

def txn_markers(entries: DataFrame) -> DataFrame:
    """`txn_markers`: the first marker of each (topic, transaction)."""
    return markers_from_facts(classify_entries(entries))


def aborted_txns(entries: DataFrame) -> DataFrame:
    """`aborted_txns`: the abort set, transactions whose first marker is an ABORT (with data or not)."""
    return aborted_from_facts(classify_entries(entries))


def stable_positions(entries: DataFrame) -> DataFrame:
    """`stable_positions`: per topic the max read position, the last position and the ongoing count."""
    return stable_from_facts(classify_entries(entries))


def committed_entries(entries: DataFrame, stable: DataFrame | None = None) -> DataFrame:
    """`committed_entries`: the read-committed view; `stable` reuses already computed stable positions."""
    facts = classify_entries(entries)
    return committed_from_facts(facts, stable if stable is not None else stable_from_facts(facts))


def violations_by_topic(entries: DataFrame) -> DataFrame:
    """Per topic: topic, duplicate, data_after_marker, duplicate_marker, marker_without_data (counts)."""
    return violations_from_facts(classify_entries(entries))


def buffer_violations(entries: DataFrame) -> dict[str, int]:
    """Every violation name with its count over all topics (zeros included, unlike the oracle's Counter)."""
    return violation_totals(violations_by_topic(entries))


# -- public: all four at once -------------------------------------------------------------------

@dataclass
class BufferTables:
    """The four tables of one history, sharing cached facts.

    Cached (lazily, on first use): the duplicate positions, the per-(topic, ledger, txn) step,
    `txns` and `stable_positions`; all narrow. Write the small tables before `committed_entries`,
    so the cache is filled and Spark plans the big job with the exact size of the facts (it then
    broadcasts the committed transactions when they are small). `committed_entries` is defined
    on first access: that counts the cached blocks (one Spark job), to choose between
    broadcasting them and a shuffle (`blocks_fit_broadcast`), and a caller that never reads it
    pays nothing. Call `unpersist()` when done.
    """

    txn_markers: DataFrame
    stable_positions: DataFrame
    aborted_txns: DataFrame
    facts: BufferFacts = field(repr=False)
    broadcast_max_bytes: int = BROADCAST_MAX_BYTES

    @cached_property
    def committed_entries(self) -> DataFrame:
        return committed_from_facts(self.facts, self.stable_positions, self.broadcast_max_bytes)

    @cached_property
    def violations_by_topic(self) -> DataFrame:
        return violations_from_facts(self.facts).cache()

    @cached_property
    def violations(self) -> dict[str, int]:
        """Totals of each violation; computed (one small Spark job) on first access."""
        return violation_totals(self.violations_by_topic)

    def unpersist(self) -> None:
        for frame in [*self.facts.cached_frames(), self.stable_positions]:
            frame.unpersist()
        if "violations_by_topic" in self.__dict__:
            self.violations_by_topic.unpersist()


def compute_buffer_tables(entries: DataFrame, broadcast_max_bytes: int = BROADCAST_MAX_BYTES) -> BufferTables:
    """All four tables from one classification (see `BufferTables` for what is cached;
    `broadcast_max_bytes`: see `blocks_fit_broadcast`)."""
    facts = classify_entries(entries, persist=True)
    stable = stable_from_facts(facts).cache()
    return BufferTables(
        txn_markers=markers_from_facts(facts),
        stable_positions=stable,
        aborted_txns=aborted_from_facts(facts),
        facts=facts,
        broadcast_max_bytes=broadcast_max_bytes,
    )
