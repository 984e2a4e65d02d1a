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
  duplicates, the last entry of each ledger, and per (topic, transaction) its first marker and
  first kept entry. Every table is built from these facts.
- Duplicates: count a 64-bit hash of (topic, producer_id, sequence_id), then broadcast the
  (usually tiny) set of repeated hashes back to find, by the exact key, which positions repeat.
  The duplicate positions are then broadcast wherever rows must be dropped: no full row is
  shuffled for it. (A log where most entries are retried sends would make this set large.)
- First positions are two long columns, never a struct: a hash aggregate cannot hold a struct
  buffer (Spark falls back to a sort aggregate), so the lexicographic minimum is taken in two
  hash aggregates, per (topic, ledger, txn) with min(entry_id), then per (topic, txn) with
  min(ledger_id) and min_by(entry, ledger_id) (each ledger occurs once per txn there).
- `committed_entries` shuffles and sorts full rows once, and only transactional DATA rows: they
  are partitioned by transaction to number them (`local_seq`), and the join with the committed
  transactions reuses that order. Non-transactional rows are not
  shuffled; stable positions (one row per topic) are broadcast.
- `compute_buffer_tables` caches the narrow facts and the stable positions, so writing the four
  tables reads the full rows only for `committed_entries`.

Assumes what ingest guarantees: one entry per (topic, ledger_id, entry_id), markers carry a
transaction id (a marker without one is ignored here; the oracle rejects it), non-negative ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import pyarrow as pa
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from txn_engine.errors import TxnlakeError
from txn_engine.schema import (
    ABORTED_TXNS_SCHEMA,
    COMMITTED_ENTRIES_SCHEMA,
    LEDGER_ENTRY_COLUMNS,
    POSITION_COLUMNS,
    STABLE_POSITIONS_SCHEMA,
    TXN_MARKERS_SCHEMA,
)
from txn_engine.transaction_buffer import EntryType, Violation

TXN_KEY = ("topic", "txn_most_bits", "txn_least_bits")
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


def conform(frame: DataFrame, schema: StructType) -> DataFrame:
    """Exactly the schema's columns, in its order and types."""
    return frame.select(*[F.col(f.name).cast(f.dataType).alias(f.name) for f in schema.fields])


def require_ledger_entries(entries: DataFrame | pa.Table) -> None:
    names = entries.column_names if isinstance(entries, pa.Table) else entries.columns
    missing = [c for c in LEDGER_ENTRY_COLUMNS if c not in names]
    if missing:
        raise TxnlakeError(
            f"the transaction buffer jobs need the ledger_entries columns; missing: {', '.join(missing)}. "
            "Pass the ledger_entries table (txn_engine.schema.LEDGER_ENTRIES_SCHEMA), e.g. warehouse.read('ledger_entries')."
        )


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
    """

    entries: DataFrame
    duplicates: DataFrame
    by_ledger_txn: DataFrame  # per (topic, ledger_id, txn); the step both `ledgers` and `txns` come from
    ledgers: DataFrame
    txns: DataFrame

    def cached_frames(self) -> list[DataFrame]:
        """The frames `classify_entries(persist=True)` caches (unpersisting the others is harmless)."""
        return [self.duplicates, self.by_ledger_txn, self.txns]


def classify_entries(entries: DataFrame, persist: bool = False) -> BufferFacts:
    """The facts of the transaction buffer, from the narrow columns of `ledger_entries`.

    `persist=True` caches the duplicates, the per-(topic, ledger, txn) step and `txns` (all
    narrow: about one row per transaction and ledger), for callers that build several tables.
    """
    require_ledger_entries(entries)
    narrow = entries.select(*NARROW_COLUMNS)
    duplicates = duplicate_positions(narrow)
    if persist:
        duplicates = duplicates.cache()
    ledger_txns = by_ledger_txn(narrow, duplicates)
    if persist:
        ledger_txns = ledger_txns.cache()
    txns = txns_from_ledger_txns(ledger_txns)
    if persist:
        txns = txns.cache()
    ledgers = ledger_txns.groupBy("topic", "ledger_id").agg(F.max("last_entry_id").alias("last_entry_id"))
    return BufferFacts(entries, duplicates, ledger_txns, ledgers, txns)


def duplicate_positions(narrow: DataFrame) -> DataFrame:
    sequenced = narrow.filter(is_data() & has_sequence()).select(
        *SEQUENCE_KEY, "ledger_id", "entry_id", F.xxhash64(*SEQUENCE_KEY).alias("_key_hash")
    )
    # Count one long per entry, not (string, long, long): nearly every key is unique, so this
    # aggregate is as large as the log. Hash collisions only add candidates; the exact key
    # decides below. Repeated keys are rare (retried sends), so the candidates are few.
    repeated = sequenced.groupBy("_key_hash").count().filter(F.col("count") > 1).select("_key_hash")
    candidates = sequenced.join(F.broadcast(repeated), "_key_hash", "left_semi")
    in_log_order = Window.partitionBy(*SEQUENCE_KEY).orderBy("ledger_id", "entry_id")
    return (
        candidates.withColumn("_nth", F.row_number().over(in_log_order))
        .filter(F.col("_nth") > 1)  # the first position is kept
        .select(*POSITION_COLUMNS)
    )


def by_ledger_txn(narrow: DataFrame, duplicates: DataFrame) -> DataFrame:
    """Per (topic, ledger_id, txn): entry count, last entry, marker count, first marker, first kept data entry and duplicate count.

    Non-transactional entries fall in the (topic, ledger_id, null, null) group: they only count
    for the ledger's size and last entry. Only the `duplicates` make a row depend on other
    ledgers, which is what lets the incremental path persist these rows per ledger.
    """
    flagged = narrow.join(F.broadcast(duplicates.withColumn("_dup", F.lit(True))), list(POSITION_COLUMNS), "left")
    marker_entry = F.when(is_marker(), F.col("entry_id"))
    kept_data_entry = F.when(is_data() & has_txn() & F.col("_dup").isNull(), F.col("entry_id"))
    return flagged.groupBy("topic", "ledger_id", "txn_most_bits", "txn_least_bits").agg(
        F.count("*").alias("entry_count"),
        F.max("entry_id").alias("last_entry_id"),
        F.count(marker_entry).alias("marker_count"),
        F.min(marker_entry).alias("marker_entry_id"),
        # A boolean, not the entry_type string: keeps the aggregate a hash aggregate.
        F.min_by(F.col("entry_type") == EntryType.COMMIT.value, marker_entry).alias("marker_is_commit"),
        F.min(kept_data_entry).alias("data_entry_id"),
        F.count("_dup").alias("duplicate_count"),
    )


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


def committed_from_facts(facts: BufferFacts, stable: DataFrame) -> DataFrame:
    """The read-committed view: kept DATA of no transaction or of a committed one, before its marker."""
    data = facts.entries.filter(is_data()).join(F.broadcast(facts.duplicates), list(POSITION_COLUMNS), "left_anti")
    return read_committed(data, committed_txns(facts.txns), stable)


def committed_txns(txns: DataFrame) -> DataFrame:
    """(topic, txn, visible_ledger_id, visible_entry_id): the committed transactions and their commit marker."""
    return txns.filter(F.col("outcome") == EntryType.COMMIT.value).select(
        *TXN_KEY, F.col("marker_ledger_id").alias("visible_ledger_id"), F.col("marker_entry_id").alias("visible_entry_id")
    )


def read_committed(data: DataFrame, committed: DataFrame, stable: DataFrame) -> DataFrame:
    """`committed_entries` rows from kept DATA rows (duplicates already removed) and `committed_txns`.

    Transactional rows of a transaction missing from `committed` are left out, so a caller can
    pass more data than it wants rows for (the incremental path passes only the transactions
    committed in the ledgers it recomputes).
    """
    # Non-transactional rows stay where they are: visible at their own position, no shuffle.
    plain = data.filter(~has_txn()).select(
        *LEDGER_ENTRY_COLUMNS,
        F.col("ledger_id").alias("visible_ledger_id"),
        F.col("entry_id").alias("visible_entry_id"),
        F.lit(0).cast("long").alias("local_seq"),
    )
    # The one shuffle of full rows: by transaction, which the numbering and the join share.
    # Numbering first lets the join reuse the window's sort (its rows are already ordered by
    # transaction), so full rows are sorted once, not twice. Data after the marker is numbered
    # after every entry before it, so dropping it afterwards leaves local_seq unchanged.
    in_txn_order = Window.partitionBy(*TXN_KEY).orderBy("ledger_id", "entry_id")
    numbered = (
        data.filter(has_txn())
        .withColumn("local_seq", (F.row_number().over(in_txn_order) - 1).cast("long"))
        .join(committed, list(TXN_KEY))
        .filter(position_lt(F.col("ledger_id"), F.col("entry_id"), F.col("visible_ledger_id"), F.col("visible_entry_id")))
        .select(*LEDGER_ENTRY_COLUMNS, "visible_ledger_id", "visible_entry_id", "local_seq")
    )
    stable_at = stable.select("topic", F.col("max_read_ledger_id").alias("_sl"), F.col("max_read_entry_id").alias("_se"))
    visible = plain.unionByName(numbered).join(F.broadcast(stable_at), "topic")
    in_prefix = position_le(F.col("ledger_id"), F.col("entry_id"), F.col("_sl"), F.col("_se"))
    return conform(visible.withColumn("in_stable_prefix", in_prefix), COMMITTED_ENTRIES_SCHEMA)


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
    # Late data needs each entry against its marker: a narrow join, computed only when asked.
    kept_txn_data = (
        facts.entries.filter(is_data() & has_txn())
        .select(*TXN_KEY, "ledger_id", "entry_id")
        .join(F.broadcast(facts.duplicates), list(POSITION_COLUMNS), "left_anti")
    )
    markers = facts.txns.filter(has_marker).select(*TXN_KEY, "marker_ledger_id", "marker_entry_id")
    late = (
        kept_txn_data.join(markers, list(TXN_KEY))
        .filter(position_lt(F.col("marker_ledger_id"), F.col("marker_entry_id"), F.col("ledger_id"), F.col("entry_id")))
        .groupBy("topic")
        .agg(F.count("*").alias(Violation.DATA_AFTER_MARKER.value))
    )
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
    broadcasts the committed transactions when they are small). Call `unpersist()` when done.
    """

    txn_markers: DataFrame
    stable_positions: DataFrame
    aborted_txns: DataFrame
    committed_entries: DataFrame
    facts: BufferFacts = field(repr=False)

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


def compute_buffer_tables(entries: DataFrame) -> BufferTables:
    """All four tables from one classification (see `BufferTables` for what is cached)."""
    facts = classify_entries(entries, persist=True)
    stable = stable_from_facts(facts).cache()
    return BufferTables(
        txn_markers=markers_from_facts(facts),
        stable_positions=stable,
        aborted_txns=aborted_from_facts(facts),
        committed_entries=committed_from_facts(facts, stable),
        facts=facts,
    )
