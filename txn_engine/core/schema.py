"""The table contract of the brief: table names and Spark schemas, defined once.

Downstream SQL depends on these column names and meanings; add columns, never rename them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DecimalType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

# Table names: one folder per table under the warehouse root.
LEDGER_ENTRIES = "ledger_entries"
QUARANTINE_ENTRIES = "quarantine_entries"
LEDGERS = "ledgers"
LEDGER_STATES_LOG = "ledger_states"
TXN_MARKERS = "txn_markers"
STABLE_POSITIONS = "stable_positions"
ABORTED_TXNS = "aborted_txns"
COMMITTED_ENTRIES = "committed_entries"
TXN_SNAPSHOT_SEGMENTS = "txn_snapshot_segments"
RECOVERED_BUFFER_STATE = "recovered_buffer_state"
OFFLOADED_ENTRIES = "offloaded_entries"
OFFLOAD_MANIFEST = "offload_manifest"
TXN_LOG = "txn_log"
CONSUMER_OFFSETS = "consumer_offsets"

ENTRY_TYPES = ("DATA", "COMMIT", "ABORT")
MARKER_TYPES = ("COMMIT", "ABORT")
LEDGER_STATES = ("OPEN", "CLOSED", "OFFLOADED", "DELETED")

# A record header: a name (text) and a value (bytes, or null).
HEADER_STRUCT = StructType([StructField("key", StringType(), True), StructField("value", BinaryType(), True)])

LEDGER_ENTRIES_SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("ledger_id", LongType(), False),
        StructField("entry_id", LongType(), False),
        StructField("entry_type", StringType(), False),
        StructField("txn_most_bits", LongType(), True),
        StructField("txn_least_bits", LongType(), True),
        StructField("producer_id", LongType(), True),
        StructField("producer_epoch", IntegerType(), True),
        StructField("sequence_id", LongType(), True),
        StructField("publish_time", TimestampType(), True),
        StructField("key", StringType(), True),
        StructField("payload", BinaryType(), True),
        # Added for logs whose keys are bytes (Kafka): a key that is not valid UTF-8, as bytes (a key
        # that is lives in `key`; so the key's bytes are coalesce(key_bytes, encode(key, 'UTF-8'))),
        # the record's headers in order (null: none), and what publish_time is (CREATE_TIME or
        # LOG_APPEND_TIME; null: not said).
        StructField("key_bytes", BinaryType(), True),
        StructField("headers", ArrayType(HEADER_STRUCT, True), True),
        StructField("timestamp_type", StringType(), True),
    ]
)
LEDGER_ENTRY_COLUMNS = tuple(f.name for f in LEDGER_ENTRIES_SCHEMA.fields)
# The columns added after the first contract: a warehouse written before them is migrated by
# `txnlake migrate` (`storage.migrate`), and refused until it is.
LOSSLESS_COLUMNS = ("key_bytes", "headers", "timestamp_type")
TIMESTAMP_TYPES = ("CREATE_TIME", "LOG_APPEND_TIME")
POSITION_COLUMNS = ("topic", "ledger_id", "entry_id")

QUARANTINE_ENTRIES_SCHEMA = StructType(
    [
        StructField("source_file", StringType(), False),
        StructField("line", LongType(), False),
        StructField("rule", StringType(), False),
        StructField("reason", StringType(), False),
        StructField("raw", StringType(), True),
        StructField("topic", StringType(), True),
        StructField("ledger_id", LongType(), True),
        StructField("entry_id", LongType(), True),
        StructField("ingest_id", StringType(), False),
        StructField("quarantined_at", TimestampType(), False),
    ]
)

LEDGERS_SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("ledger_id", LongType(), False),
        StructField("state", StringType(), False),
        StructField("first_entry_id", LongType(), False),
        StructField("last_entry_id", LongType(), False),
        StructField("entry_count", LongType(), False),
        StructField("size_bytes", LongType(), False),
        StructField("first_publish_time", TimestampType(), True),
        StructField("last_publish_time", TimestampType(), True),
        StructField("updated_at", TimestampType(), False),
    ]
)

# Recorded ledger state transitions (append-only; the latest `recorded_at` per ledger wins).
# Whoever knows better than "the last ledger is OPEN" writes here: the engine when it rolls a
# ledger over (CLOSED), the offloader (OFFLOADED), retention (DELETED). `ledgers` applies them.
LEDGER_STATES_SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("ledger_id", LongType(), False),
        StructField("state", StringType(), False),
        StructField("reason", StringType(), True),
        StructField("recorded_at", TimestampType(), False),
    ]
)

TXN_MARKERS_SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("txn_most_bits", LongType(), False),
        StructField("txn_least_bits", LongType(), False),
        StructField("outcome", StringType(), False),
        StructField("ledger_id", LongType(), False),
        StructField("entry_id", LongType(), False),
    ]
)

STABLE_POSITIONS_SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("max_read_ledger_id", LongType(), False),
        StructField("max_read_entry_id", LongType(), False),
        StructField("last_ledger_id", LongType(), False),
        StructField("last_entry_id", LongType(), False),
        StructField("ongoing_txn_count", LongType(), False),
    ]
)

ABORTED_TXNS_SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("txn_most_bits", LongType(), False),
        StructField("txn_least_bits", LongType(), False),
        StructField("abort_ledger_id", LongType(), False),
        StructField("abort_entry_id", LongType(), False),
    ]
)

COMMITTED_ENTRIES_SCHEMA = StructType(
    list(LEDGER_ENTRIES_SCHEMA.fields)
    + [
        StructField("visible_ledger_id", LongType(), False),
        StructField("visible_entry_id", LongType(), False),
        StructField("local_seq", LongType(), False),
        StructField("in_stable_prefix", BooleanType(), False),
    ]
)

# The transaction coordinator's log (append-only state transitions; the latest `log_seq` of a
# transactional id wins). EMPTY records a producer id / epoch handed out with no transaction open.
TXN_STATES = ("EMPTY", "ONGOING", "PREPARE_COMMIT", "PREPARE_ABORT", "COMPLETE_COMMIT", "COMPLETE_ABORT")
TXN_LOG_SCHEMA = StructType(
    [
        StructField("log_seq", LongType(), False),
        StructField("txn_group", IntegerType(), False),
        StructField("transactional_id", StringType(), True),  # null for idempotent producers
        StructField("producer_id", LongType(), False),
        StructField("producer_epoch", IntegerType(), False),
        StructField("txn_most_bits", LongType(), True),
        StructField("txn_least_bits", LongType(), True),
        StructField("state", StringType(), False),
        StructField("topics", ArrayType(StringType(), False), False),
        StructField("timeout_ms", LongType(), False),
        StructField("txn_started_at", TimestampType(), True),
        StructField("recorded_at", TimestampType(), False),
        StructField("actor", StringType(), False),  # producer, coordinator, recovery, operator:<who>
        StructField("reason", StringType(), True),
        # Offsets sent inside the transaction: kept with PREPARE_COMMIT so recovery can land them.
        StructField(
            "offsets",
            ArrayType(
                StructType(
                    [
                        StructField("group_id", StringType(), False),
                        StructField("topic", StringType(), False),
                        StructField("ledger_id", LongType(), False),
                        StructField("entry_id", LongType(), False),
                    ]
                ),
                False,
            ),
            True,
        ),
    ]
)

# Consumer-group offsets committed inside transactions: appended with the COMPLETE_COMMIT only.
CONSUMER_OFFSETS_SCHEMA = StructType(
    [
        StructField("group_id", StringType(), False),
        StructField("topic", StringType(), False),
        StructField("ledger_id", LongType(), False),
        StructField("entry_id", LongType(), False),
        StructField("txn_most_bits", LongType(), True),
        StructField("txn_least_bits", LongType(), True),
        StructField("log_seq", LongType(), False),  # the txn_log record that committed them; latest wins
        StructField("committed_at", TimestampType(), False),
    ]
)

# -- transaction-buffer snapshots (docs/snapshots.md) -------------------------------------------
TXN_SNAPSHOT_STATE = "txn_snapshot_state"
SNAPSHOT_STATES = ("NO_SNAPSHOT", "INITIALIZING", "READY")

# One aborted transaction inside a snapshot: the transaction and its abort marker's position.
ABORT_STRUCT = StructType(
    [
        StructField("txn_most_bits", LongType(), True),
        StructField("txn_least_bits", LongType(), True),
        StructField("ledger_id", LongType(), True),
        StructField("entry_id", LongType(), True),
    ]
)

# The brief's columns, then the snapshot index (added columns): which snapshot a row belongs to,
# its place in it, the snapshot's size (on every row; recovery checks it on topic-end), tombstones.
TXN_SNAPSHOT_SEGMENTS_SCHEMA = StructType(
    [
        StructField("snapshot_key", StringType(), False),
        StructField("topic", StringType(), False),
        StructField("max_read_ledger_id", LongType(), False),
        StructField("max_read_entry_id", LongType(), False),
        StructField("aborts", ArrayType(ABORT_STRUCT, True), True),
        StructField("write_seq", LongType(), False),
        StructField("snapshot_id", LongType(), True),
        StructField("segment_index", IntegerType(), True),
        StructField("segment_count", IntegerType(), True),
        StructField("abort_count", LongType(), True),
        StructField("tombstone", BooleanType(), True),
        StructField("written_at", TimestampType(), True),
    ]
)

RECOVERED_BUFFER_STATE_SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("max_read_ledger_id", LongType(), False),
        StructField("max_read_entry_id", LongType(), False),
        StructField("aborts", ArrayType(ABORT_STRUCT, True), True),
        StructField("snapshot_id", LongType(), True),
        StructField("source", StringType(), False),  # SNAPSHOT or FULL_REPLAY
        StructField("fallback_reason", StringType(), True),  # why FULL_REPLAY, when it is
        StructField("replayed_entries", LongType(), False),
    ]
)

# Per topic: where its snapshots stand and whether one is due (the triggers).
TXN_SNAPSHOT_STATE_SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("state", StringType(), False),  # NO_SNAPSHOT | INITIALIZING | READY
        StructField("snapshot_id", LongType(), True),
        StructField("segment_count", IntegerType(), True),
        StructField("abort_count", LongType(), True),
        StructField("max_read_ledger_id", LongType(), True),
        StructField("max_read_entry_id", LongType(), True),
        StructField("changes_since_snapshot", LongType(), False),
        StructField("last_snapshot_at", TimestampType(), True),
        StructField("due", BooleanType(), False),
        StructField("due_reason", StringType(), True),
        StructField("updated_at", TimestampType(), False),
    ]
)

# The transaction buffer's incremental state (internal, not part of the contract): per-ledger
# facts that the contract tables are folded from, so a run reads only the ledgers it recomputes.
BUFFER_LEDGER_TXNS = "buffer_ledger_txns"
BUFFER_SEQUENCE_RANGES = "buffer_sequence_ranges"
BUFFER_DUPLICATES = "buffer_duplicates"
BUFFER_PENDING_ENTRIES = "buffer_pending_entries"

# Per (topic, ledger, transaction; null for non-transactional entries), from that ledger alone
# once its duplicates are known.
BUFFER_LEDGER_TXNS_SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("ledger_id", LongType(), False),
        StructField("txn_most_bits", LongType(), True),
        StructField("txn_least_bits", LongType(), True),
        StructField("entry_count", LongType(), False),
        StructField("last_entry_id", LongType(), False),
        StructField("marker_count", LongType(), False),
        StructField("marker_entry_id", LongType(), True),
        StructField("marker_is_commit", BooleanType(), True),
        StructField("data_entry_id", LongType(), True),
        # Retried sends among the entries (`buffer_duplicates` of this ledger and transaction): with
        # entry_count and marker_count it gives the data a ledger holds per transaction, which the
        # offload's manifest counts by reason without re-reading the log.
        StructField("duplicate_count", LongType(), False),
    ]
)

# The exact set of (producer_id, producer_epoch, sequence_id) keys of DATA entries per (topic,
# ledger), as runs of consecutive sequence ids: what de-duplication of later ledgers checks against.
BUFFER_SEQUENCE_RANGES_SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("producer_id", LongType(), False),
        StructField("producer_epoch", IntegerType(), True),
        StructField("ledger_id", LongType(), False),
        StructField("first_sequence_id", LongType(), False),
        StructField("last_sequence_id", LongType(), False),
    ]
)

BUFFER_DUPLICATES_SCHEMA = StructType([StructField(c, LongType() if c != "topic" else StringType(), False)
                                       for c in POSITION_COLUMNS])

# -- the filtered offload tier (issue 6) ---------------------------------------------------------

# The last known catalog row of each ledger retention deleted (its entries are gone, its row stays).
DELETED_LEDGERS = "deleted_ledgers"

# The tier holds ledger_entries rows as they were, only fewer of them.
OFFLOADED_ENTRIES_SCHEMA = LEDGER_ENTRIES_SCHEMA

OFFLOAD_MANIFEST_SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("ledger_id", LongType(), False),
        StructField("first_entry_id", LongType(), False),
        StructField("last_entry_id", LongType(), False),
        StructField("entries_before", LongType(), False),
        StructField("entries_kept", LongType(), False),
        StructField("dropped_markers", LongType(), False),
        StructField("dropped_aborted", LongType(), False),
        StructField("dropped_duplicates", LongType(), False),  # retried sends (same producer_id, sequence_id)
        StructField("dropped_other", LongType(), False),  # late data after its transaction's COMMIT marker
        StructField("bytes_before", LongType(), False),
        StructField("bytes_after", LongType(), False),
        StructField("max_read_ledger_id", LongType(), False),
        StructField("max_read_entry_id", LongType(), False),
        StructField("checksum", StringType(), False),
        StructField("tier_location", StringType(), False),
        StructField("offloaded_at", TimestampType(), False),
    ]
)

# The tables whose rows are ledger_entries rows (plus columns of their own): those that gain the
# columns ledger_entries gains (`LOSSLESS_COLUMNS`), by `txnlake migrate` in a warehouse made before.
ENTRY_TABLES = (LEDGER_ENTRIES, COMMITTED_ENTRIES, BUFFER_PENDING_ENTRIES, OFFLOADED_ENTRIES)

DELETED_LEDGERS_SCHEMA = StructType(
    [f for f in LEDGERS_SCHEMA.fields if f.name not in ("state", "updated_at")]
    + [StructField("deleted_at", TimestampType(), False)]
)

# -- the warehouse as an analyst meets it (docs/tables.md) ----------------------------------------
#
# Every table's place, one-line summary and described columns, once: table locations
# (`WarehouseSettings.table_path`), the Delta column comments and the readable `txn_id` the storage
# layer writes (`storage.warehouse.stored_frame`, `storage.delta_io.stored_arrow`), the Dagster
# column schemas (`assets.metadata`) and docs/tables.md all come from here.

INTERNAL_FOLDER = "_internal"  # under the warehouse root: state no analyst query should depend on
TXN_ID = "txn_id"
TXN_HALVES = ("txn_most_bits", "txn_least_bits")
READ_COMMITTED_ENTRIES = "read_committed_entries"
# A transaction's readable id: "most:least" ("0:1515"), null for a non-transactional row. The same
# rule in Spark (`storage.warehouse.txn_id_column`), Arrow (`storage.delta_io.txn_id_array`) and SQL.
TXN_ID_SQL = "CONCAT(CAST(txn_most_bits AS STRING), ':', CAST(txn_least_bits AS STRING))"


class Place:
    """Where a table lives: the analyst's tables at the root, internal state apart, the tier's data
    at the tier's root (which may be another store)."""

    PUBLIC = "public"  # <warehouse>/<table>
    INTERNAL = "internal"  # <warehouse>/_internal/<table>
    TIER = "tier"  # <offload tier root>/<table>


class Kind:
    TABLE = "table"  # written by txnlake's code
    SQL_MODEL = "sql model"  # dbt-free-sql/<name>.sql, materialized as a Delta table
    VIEW = "view"  # dbt-free-sql/<name>.sql, a query over tables, not stored (`txnlake sql` and the models read it)


# Columns that mean the same in every table that has them.
COMMON_DESCRIPTIONS = {
    "topic": "The topic: one partition of a log (e.g. orders-partition-0).",
    "ledger_id": "The ledger: a run of entries of one topic; with entry_id, a position.",
    "entry_id": "The entry's id inside its ledger (dense from 0 unless the log was compacted).",
    "entry_type": "DATA, or a marker closing a transaction on this topic: COMMIT or ABORT.",
    "txn_most_bits": "The transaction id's high half (Pulsar's mostSigBits; in generated logs the coordinator); "
                     "null for non-transactional entries.",
    "txn_least_bits": "The transaction id's low half (Pulsar's leastSigBits; the coordinator's sequence); "
                      "null for non-transactional entries.",
    TXN_ID: "The transaction id readable, txn_most_bits:txn_least_bits (e.g. 0:1515); null for non-transactional rows.",
    "producer_id": "The producer that wrote the entry (null: not an idempotent producer).",
    "producer_epoch": "The producer's epoch: bumped when a producer restarts, fencing its zombie (null: none).",
    "sequence_id": "The producer's sequence number on this topic: a retried send repeats it (null: none).",
    "publish_time": "When the entry was published (UTC).",
    "key": "The record's key as text (null: none, or bytes that are not UTF-8: see key_bytes).",
    "payload": "The record's value, as bytes.",
    "key_bytes": "The record's key when it is not valid UTF-8, as bytes (a UTF-8 key is in key).",
    "headers": "The record's headers in order, each a key and a value of bytes (null: none).",
    "timestamp_type": "What publish_time is: CREATE_TIME or LOG_APPEND_TIME (null: not said).",
    "max_read_ledger_id": "The stable position's (max read position's) ledger: a read-committed reader reads up to it.",
    "max_read_entry_id": "The stable position's entry id (-1: before the ledger's first entry).",
    "first_entry_id": "The ledger's first entry id.",
    "last_entry_id": "The ledger's last entry id.",
    "entry_count": "How many entries the ledger holds.",
    "size_bytes": "The ledger's entry bytes: payloads plus keys.",
    "first_publish_time": "The earliest publish_time in the ledger.",
    "last_publish_time": "The latest publish_time in the ledger.",
    "aborts": "The aborted transactions, each with its id (two halves and txn_id) and its abort marker's position, "
              "in abort-marker order.",
    "snapshot_id": "The snapshot: its number, counting up per topic.",
    "log_seq": "The transaction log record's sequence number (the latest per transactional id wins).",
    "group_id": "The consumer group.",
}

_ENTRY_POSITION = {"entry_id": "The entry's id inside its ledger."}
_LEDGER_ROW = {"ledger_id": "The ledger (per topic: ledger ids are unique only within a topic)."}
_COMMITTED = {
    "visible_ledger_id": "Where a commit-order reader sees the entry: its COMMIT marker's ledger (its own for "
                         "non-transactional entries).",
    "visible_entry_id": "Where a commit-order reader sees the entry: its COMMIT marker's entry id (its own for "
                        "non-transactional entries).",
    "local_seq": "The entry's order inside its transaction on this topic (0 for non-transactional entries); commit "
                 "order is visible_ledger_id, visible_entry_id, local_seq.",
}

# Per table: the columns whose meaning there is its own (the others: COMMON_DESCRIPTIONS).
TABLE_DESCRIPTIONS: dict[str, dict[str, str]] = {
    QUARANTINE_ENTRIES: {
        "source_file": "The input file the row came from.",
        "line": "The row's line in that file (1-based; a Parquet file's row index + 1).",
        "rule": "The rule it broke (malformed_line, type, txn_id_pair, position_conflict, ledger_closed, ...).",
        "reason": "What was wrong with it, in words.",
        "raw": "The row as it was read (its text, or its values as JSON).",
        "topic": "The row's topic, when it could be read.",
        "ledger_id": "The row's ledger, when it could be read.",
        "entry_id": "The row's entry id, when it could be read.",
        "ingest_id": "The ingest that refused it.",
        "quarantined_at": "When it was refused (UTC).",
    },
    LEDGERS: {
        "state": "OPEN (written), CLOSED (rolled over), OFFLOADED (copied to the tier) or DELETED (by retention).",
        "updated_at": "When this catalog row was computed (UTC).",
    },
    LEDGER_STATES_LOG: {
        "state": "The state recorded: CLOSED (by the engine's rollover), OFFLOADED or DELETED.",
        "reason": "Why it was recorded.",
        "recorded_at": "When (UTC); the latest per ledger wins.",
    },
    TXN_MARKERS: {
        "outcome": "COMMIT or ABORT: the transaction's first marker on this topic.",
        "ledger_id": "The marker's ledger.",
        "entry_id": "The marker's entry id.",
    },
    STABLE_POSITIONS: {
        "last_ledger_id": "The topic's last position's ledger.",
        "last_entry_id": "The topic's last position's entry id.",
        "ongoing_txn_count": "Transactions with data on the topic and no marker yet.",
    },
    ABORTED_TXNS: {
        "abort_ledger_id": "The abort marker's ledger.",
        "abort_entry_id": "The abort marker's entry id.",
    },
    COMMITTED_ENTRIES: {
        **_COMMITTED,
        "in_stable_prefix": "True when the entry's own position is at or below the stable position: a read-committed "
                            "reader in ledger order sees it now (read_committed_entries holds exactly these).",
    },
    READ_COMMITTED_ENTRIES: dict(_COMMITTED),
    TXN_LOG: {
        "txn_group": "The coordinator's transaction group (partition of the transaction log).",
        "transactional_id": "The producer's transactional id (null for idempotent producers).",
        "producer_epoch": "The producer's epoch.",
        "state": "EMPTY, ONGOING, PREPARE_COMMIT, PREPARE_ABORT, COMPLETE_COMMIT or COMPLETE_ABORT.",
        "topics": "The topics the transaction wrote to.",
        "timeout_ms": "The transaction's timeout.",
        "txn_started_at": "When the transaction began (UTC).",
        "recorded_at": "When this state was recorded (UTC).",
        "actor": "Who recorded it: producer, coordinator, recovery or operator:<who>.",
        "reason": "Why, for aborts and operator actions.",
        "offsets": "Consumer offsets sent inside the transaction, committed with it.",
    },
    CONSUMER_OFFSETS: {
        "topic": "The topic consumed.",
        "ledger_id": "The committed position's ledger.",
        "entry_id": "The committed position's entry id.",
        "log_seq": "The txn_log record that committed it; the latest per group and topic wins.",
        "committed_at": "When (UTC).",
    },
    TXN_SNAPSHOT_SEGMENTS: {
        "snapshot_key": "The segment's key: topic-1 ... topic-N, and topic-end.",
        "max_read_ledger_id": "The stable position's ledger when the snapshot was taken (on topic-end).",
        "max_read_entry_id": "The stable position's entry id when the snapshot was taken (on topic-end).",
        "aborts": "This segment's aborted transactions, each with its id (two halves and txn_id) and its abort "
                  "marker's position.",
        "write_seq": "The write's sequence: per key the latest wins (key compaction).",
        "snapshot_id": "The snapshot this segment belongs to.",
        "segment_index": "The segment's place in its snapshot.",
        "segment_count": "How many segments the snapshot has.",
        "abort_count": "How many aborted transactions the snapshot holds.",
        "tombstone": "True when the row deletes its key (compaction).",
        "written_at": "When the segment was written (UTC).",
    },
    RECOVERED_BUFFER_STATE: {
        "max_read_ledger_id": "The recovered stable position's ledger.",
        "max_read_entry_id": "The recovered stable position's entry id.",
        "snapshot_id": "The snapshot recovery started from (null: a full replay).",
        "source": "SNAPSHOT (a snapshot plus the replay after it) or FULL_REPLAY.",
        "fallback_reason": "Why recovery replayed the whole log, when it did.",
        "replayed_entries": "Entries replayed after the snapshot.",
    },
    TXN_SNAPSHOT_STATE: {
        "state": "NO_SNAPSHOT, INITIALIZING or READY.",
        "snapshot_id": "The topic's last snapshot.",
        "segment_count": "Its segments.",
        "abort_count": "Its aborted transactions.",
        "max_read_ledger_id": "The stable position's ledger it recorded.",
        "max_read_entry_id": "The stable position's entry id it recorded.",
        "changes_since_snapshot": "Aborts and stable-position moves since it was taken.",
        "last_snapshot_at": "When it was taken (UTC).",
        "due": "True when a new snapshot is due.",
        "due_reason": "Which trigger made it due.",
        "updated_at": "When this row was computed (UTC).",
    },
    BUFFER_LEDGER_TXNS: {
        **_LEDGER_ROW,
        "entry_count": "The transaction's entries in this ledger (markers included).",
        "last_entry_id": "The transaction's last entry in this ledger.",
        "marker_count": "Its markers in this ledger.",
        "marker_entry_id": "Its first marker's entry id in this ledger.",
        "marker_is_commit": "Whether that marker is a COMMIT.",
        "data_entry_id": "Its first DATA entry's id in this ledger.",
        "duplicate_count": "Its retried sends in this ledger.",
    },
    BUFFER_SEQUENCE_RANGES: {
        **_LEDGER_ROW,
        "first_sequence_id": "A run of consecutive sequence ids of the producer in this ledger: its first.",
        "last_sequence_id": "The run's last sequence id.",
    },
    BUFFER_DUPLICATES: {**_ENTRY_POSITION},
    OFFLOAD_MANIFEST: {
        "first_entry_id": "The ledger's first entry id.",
        "last_entry_id": "The ledger's last entry id.",
        "entries_before": "The ledger's entries in the hot tier.",
        "entries_kept": "The entries the tier holds: committed or non-transactional DATA.",
        "dropped_markers": "COMMIT and ABORT markers left out.",
        "dropped_aborted": "Entries of aborted transactions left out.",
        "dropped_duplicates": "Retried sends (same producer, epoch and sequence) left out.",
        "dropped_other": "Late data after its transaction's COMMIT marker left out.",
        "bytes_before": "The ledger's entry bytes in the hot tier.",
        "bytes_after": "The entry bytes the tier holds.",
        "max_read_ledger_id": "The stable position's ledger when the ledger was offloaded.",
        "max_read_entry_id": "The stable position's entry id when the ledger was offloaded.",
        "checksum": "The kept rows' order-independent checksum: 16 hex digits (the sum of their 64-bit xxhash "
                    "values modulo 2^64).",
        "tier_location": "Where the tier's table is (offloaded_entries).",
        "offloaded_at": "When the ledger was offloaded (UTC).",
    },
    DELETED_LEDGERS: {"deleted_at": "When retention deleted the ledger (UTC)."},
    "abort_rates": {
        "ledger_id": "The ledger holding the transactions' first markers.",
        "decided_txns": "Transactions decided in the ledger (by their first marker).",
        "aborted_txns": "Of those, the aborted.",
        "committed_txns": "Of those, the committed.",
        "abort_rate": "aborted_txns / decided_txns, rounded to 4 places.",
    },
    "ledger_sizes": {
        "state": "The ledger's state (as in ledgers).",
        "entries": "Entries in the ledger.",
        "data_entries": "Of those, DATA.",
        "marker_entries": "Of those, COMMIT and ABORT markers.",
        "bytes": "Entry bytes: payloads plus keys (UTF-8 bytes).",
        "pct_of_topic_entries": "The ledger's share of its topic's entries, in percent.",
    },
    "oldest_ongoing_txn": {
        "first_ledger_id": "The transaction's first entry's ledger.",
        "first_entry_id": "The transaction's first entry's id.",
        "first_publish_time": "When its first entry was published (UTC).",
        "data_entries": "Its DATA entries so far (retried sends once).",
        "ongoing_txns": "Transactions ongoing on the topic.",
    },
    "tier_sizes": {
        "hot_entries": "Entries in the hot tier (ledger_entries).",
        "hot_bytes": "Their bytes: payloads plus keys.",
        "offloaded_ledgers": "Ledgers offloaded to the tier.",
        "cold_entries": "Entries the tier holds.",
        "cold_bytes": "Their bytes.",
        "entries_dropped_by_filtering": "Entries the filtered offload left out (markers, aborted, duplicates).",
        "bytes_saved_by_filtering": "Their bytes.",
    },
    "topic_read_lag": {
        "last_ledger_id": "The topic's last position's ledger.",
        "last_entry_id": "The topic's last position's entry id.",
        "ongoing_txn_count": "Transactions holding the stable position back.",
        "readable_entries": "Entries a read-committed reader sees now (rows of read_committed_entries).",
        "entries_behind": "Entries past the stable position: a read-committed reader cannot see them yet.",
        "bytes_behind": "Their bytes: payloads plus keys.",
    },
}


def _described(table: str, fields) -> StructType:
    """`fields` with each column's description as Delta's column comment (field metadata `comment`)."""
    own = TABLE_DESCRIPTIONS.get(table, {})
    out = []
    for f in fields:
        text = own.get(f.name) or COMMON_DESCRIPTIONS.get(f.name)
        out.append(StructField(f.name, f.dataType, f.nullable, {**f.metadata, "comment": text} if text else f.metadata))
    return StructType(out)


def _with_txn_id(fields) -> list[StructField]:
    """The fields, with `txn_id` right after the two halves wherever a row or an array's elements
    (a snapshot's aborts) have both."""
    fields = [StructField(f.name, ArrayType(StructType(_with_txn_id(struct_elements(f).fields)), f.dataType.containsNull),
                          f.nullable, f.metadata) if struct_elements(f) else f for f in fields]
    names = [f.name for f in fields]
    if not set(TXN_HALVES) <= set(names) or TXN_ID in names:
        return fields
    at = names.index(TXN_HALVES[1]) + 1
    return [*fields[:at], StructField(TXN_ID, StringType(), True), *fields[at:]]


def struct_elements(field: StructField) -> StructType | None:
    """The struct of an array-of-structs column's elements; None for any other column."""
    kind = field.dataType
    return kind.elementType if isinstance(kind, ArrayType) and isinstance(kind.elementType, StructType) else None


def column_paths(schema: StructType) -> list[str]:
    """Every column's name, and `column.field` for each field of an array's struct elements."""
    paths = []
    for f in schema.fields:
        paths.append(f.name)
        if struct_elements(f):
            paths += [f"{f.name}.{inner}" for inner in struct_elements(f).fieldNames()]
    return paths


def txn_id_owed(path: str, paths: Iterable[str]) -> bool:
    """Whether a table with these column paths owes `path`: a `txn_id` only beside its two halves."""
    parent, _, leaf = path.rpartition(".")
    prefix = f"{parent}." if parent else ""
    return leaf != TXN_ID or {prefix + half for half in TXN_HALVES} <= set(paths)


@dataclass(frozen=True)
class TableSpec:
    name: str
    place: str  # Place
    summary: str  # one line: what it is
    schema: StructType  # the stored columns, in order, each described (metadata "comment")
    kind: str = Kind.TABLE
    written_by: str = "`txnlake run`"

    def description(self, column: str) -> str | None:
        for f in self.schema.fields:
            if f.name == column:
                return f.metadata.get("comment")
        return None


def _spec(name: str, place: str, summary: str, fields, kind: str = Kind.TABLE, written_by: str = "`txnlake run`") -> TableSpec:
    fields = list(fields)
    if place != Place.INTERNAL:  # public rows carry the readable transaction id next to its halves
        fields = _with_txn_id(fields)
    return TableSpec(name, place, summary, _described(name, fields), kind, written_by)


_DDL_TYPES = {"STRING": StringType(), "BIGINT": LongType(), "INT": IntegerType(), "DOUBLE": DoubleType(),
              "TIMESTAMP": TimestampType(), "BOOLEAN": BooleanType()}


def _model_schema(ddl: str) -> list[StructField]:
    """A SQL model's result columns from "name TYPE, ..." (the types its SQL gives on Spark; no JVM here)."""
    return [StructField(name, _DDL_TYPES.get(kind) or DecimalType(*map(int, kind[8:-1].split(","))), True)
            for name, kind in (column.split() for column in ddl.split(", "))]


_READ_COMMITTED_FIELDS = [f for f in COMMITTED_ENTRIES_SCHEMA.fields if f.name != "in_stable_prefix"]
_ENGINE = "the transaction engine (`txnlake demo`, or producers through it)"

TABLES: dict[str, TableSpec] = {s.name: s for s in [
    _spec(LEDGER_ENTRIES, Place.PUBLIC, "Every entry of every ledger: data and markers, as the log holds them.",
          LEDGER_ENTRIES_SCHEMA.fields, written_by="`txnlake ingest`, `txnlake import-kafka` or the transaction engine"),
    _spec(QUARANTINE_ENTRIES, Place.PUBLIC, "Input rows ingest refused, with the rule, the reason, the file and the line.",
          QUARANTINE_ENTRIES_SCHEMA.fields, written_by="`txnlake ingest`"),
    _spec(LEDGERS, Place.PUBLIC, "The ledger catalog: per topic and ledger its range, entries, bytes, times and state.",
          LEDGERS_SCHEMA.fields),
    _spec(TXN_MARKERS, Place.PUBLIC, "Per topic and transaction, its first marker: outcome and position.",
          TXN_MARKERS_SCHEMA.fields),
    _spec(STABLE_POSITIONS, Place.PUBLIC, "Per topic, the stable (max read) position, the last position and the "
          "ongoing transactions.", STABLE_POSITIONS_SCHEMA.fields),
    _spec(ABORTED_TXNS, Place.PUBLIC, "The abort set: aborted transactions with their abort marker's position.",
          ABORTED_TXNS_SCHEMA.fields),
    _spec(COMMITTED_ENTRIES, Place.PUBLIC, "Everything a read-committed reader may ever see that is decided now: "
          "visible DATA, each once, with where (ledger order, commit order) it is seen.", COMMITTED_ENTRIES_SCHEMA.fields),
    _spec(READ_COMMITTED_ENTRIES, Place.PUBLIC, "What a read-committed reader sees now, in ledger order: the committed "
          "entries at or below the stable position (committed_entries WHERE in_stable_prefix).", _READ_COMMITTED_FIELDS,
          kind=Kind.VIEW),
    _spec(TXN_SNAPSHOT_SEGMENTS, Place.PUBLIC, "The transaction-buffer snapshot log: multi-part snapshots of the abort "
          "set, read with key compaction (latest write_seq per key).", TXN_SNAPSHOT_SEGMENTS_SCHEMA.fields,
          written_by="`txnlake snapshot`"),
    _spec(RECOVERED_BUFFER_STATE, Place.PUBLIC, "Per topic, the transaction buffer rebuilt from its snapshot and the "
          "replay after it (equal to a full replay).", RECOVERED_BUFFER_STATE_SCHEMA.fields, written_by="`txnlake snapshot`"),
    _spec(OFFLOADED_ENTRIES, Place.TIER, "The filtered offload tier: DATA entries that are committed or "
          "non-transactional, of offloaded ledgers, at their original positions.", OFFLOADED_ENTRIES_SCHEMA.fields,
          written_by="`txnlake offload`"),
    _spec(OFFLOAD_MANIFEST, Place.PUBLIC, "One row per offloaded ledger: what was kept and dropped, the stable position "
          "then, a checksum and where the tier is.", OFFLOAD_MANIFEST_SCHEMA.fields, written_by="`txnlake offload`"),
    _spec(DELETED_LEDGERS, Place.PUBLIC, "Ledgers retention deleted, with their last catalog row.",
          DELETED_LEDGERS_SCHEMA.fields, written_by="`txnlake retention`"),
    _spec("abort_rates", Place.PUBLIC, "Per topic and ledger, the share of the transactions decided there that aborted.",
          _model_schema("topic STRING, ledger_id BIGINT, decided_txns BIGINT, aborted_txns BIGINT, committed_txns BIGINT, "
                        "abort_rate DOUBLE"), kind=Kind.SQL_MODEL),
    _spec("ledger_sizes", Place.PUBLIC, "Per topic and ledger: entries, markers, bytes, state and share of the topic.",
          _model_schema("topic STRING, ledger_id BIGINT, state STRING, entries BIGINT, data_entries BIGINT, "
                        "marker_entries BIGINT, bytes BIGINT, pct_of_topic_entries DECIMAL(27,2)"), kind=Kind.SQL_MODEL),
    _spec("oldest_ongoing_txn", Place.PUBLIC, "Per topic with transactions ongoing, the oldest: what holds its stable "
          "position back.", _model_schema(
              "topic STRING, txn_most_bits BIGINT, txn_least_bits BIGINT, txn_id STRING, first_ledger_id BIGINT, "
              "first_entry_id BIGINT, first_publish_time TIMESTAMP, data_entries BIGINT, ongoing_txns BIGINT"),
          kind=Kind.SQL_MODEL),
    _spec("tier_sizes", Place.PUBLIC, "Per topic: entries and bytes in the hot tier and in the offload tier, and what "
          "filtering saved.", _model_schema(
              "topic STRING, hot_entries BIGINT, hot_bytes BIGINT, offloaded_ledgers BIGINT, cold_entries BIGINT, "
              "cold_bytes BIGINT, entries_dropped_by_filtering BIGINT, bytes_saved_by_filtering BIGINT"),
          kind=Kind.SQL_MODEL, written_by="`txnlake offload`"),
    _spec("topic_read_lag", Place.PUBLIC, "Per topic: what a read-committed reader sees now and how far the stable "
          "position lags behind the last position.", _model_schema(
              "topic STRING, last_ledger_id BIGINT, last_entry_id BIGINT, max_read_ledger_id BIGINT, "
              "max_read_entry_id BIGINT, ongoing_txn_count BIGINT, readable_entries BIGINT, entries_behind BIGINT, "
              "bytes_behind BIGINT"), kind=Kind.SQL_MODEL),
    _spec(LEDGER_STATES_LOG, Place.INTERNAL, "Recorded ledger state changes (CLOSED by the engine, OFFLOADED, DELETED) "
          "that the catalog applies.", LEDGER_STATES_SCHEMA.fields, written_by="the engine, `txnlake offload` or `txnlake retention`"),
    _spec(TXN_LOG, Place.INTERNAL, "The transaction coordinator's log: every state change of every transaction.",
          TXN_LOG_SCHEMA.fields, written_by=_ENGINE),
    _spec(CONSUMER_OFFSETS, Place.INTERNAL, "Consumer-group offsets committed inside transactions.",
          CONSUMER_OFFSETS_SCHEMA.fields, written_by=_ENGINE),
    _spec(TXN_SNAPSHOT_STATE, Place.INTERNAL, "Per topic, where its snapshots stand and whether one is due.",
          TXN_SNAPSHOT_STATE_SCHEMA.fields, written_by="`txnlake snapshot`"),
    _spec(BUFFER_LEDGER_TXNS, Place.INTERNAL, "The transaction buffer's incremental state: per ledger and transaction, "
          "its entries and markers.", BUFFER_LEDGER_TXNS_SCHEMA.fields),
    _spec(BUFFER_SEQUENCE_RANGES, Place.INTERNAL, "The transaction buffer's incremental state: per ledger, the "
          "producers' sequence ids, for de-duplication.", BUFFER_SEQUENCE_RANGES_SCHEMA.fields),
    _spec(BUFFER_DUPLICATES, Place.INTERNAL, "The transaction buffer's incremental state: the positions of retried sends.",
          BUFFER_DUPLICATES_SCHEMA.fields),
    _spec(BUFFER_PENDING_ENTRIES, Place.INTERNAL, "The transaction buffer's incremental state: entries of undecided "
          "transactions.", LEDGER_ENTRIES_SCHEMA.fields),
]}

# The contract's columns an older txnlake did not write, per table: `txnlake migrate` adds them, and
# such a table is refused until it has (`storage.warehouse.require_current_columns`).
ADDED_COLUMNS: dict[str, tuple[str, ...]] = {
    name: tuple(c for c in ((LOSSLESS_COLUMNS if name in ENTRY_TABLES else ())
                            + (tuple(p for p in column_paths(spec.schema) if p.rpartition(".")[2] == TXN_ID)
                               if spec.kind == Kind.TABLE else ())
                            + (TXN_HALVES if name == "oldest_ongoing_txn" else ())))
    for name, spec in TABLES.items()
}


def table_spec(table: str) -> TableSpec | None:
    """The table's spec; None for a table txnlake does not name (a user's own SQL model, say)."""
    return TABLES.get(table)


def table_place(table: str) -> str:
    spec = TABLES.get(table)
    return Place.PUBLIC if spec is None else spec.place


def stored_schema(table: str) -> StructType | None:
    """The columns `table` stores, in order, described; None for a table txnlake does not name."""
    spec = TABLES.get(table)
    return None if spec is None else spec.schema


_WHERE = {Place.PUBLIC: "`<warehouse>/{name}`", Place.INTERNAL: f"`<warehouse>/{INTERNAL_FOLDER}/{{name}}`",
          Place.TIER: "`<offload tier>/{name}`"}
_HEADINGS = {Place.PUBLIC: "The analyst's tables", Place.TIER: "The offload tier",
             Place.INTERNAL: "Internal state (not part of the contract)"}


def table_reference() -> str:
    """docs/tables.md: every table, where it lives, what it is, its columns and their descriptions
    (`tests/test_table_reference.py` holds the file to it)."""
    out = [
        "# Tables",
        "",
        "Generated from `txn_engine/core/schema.py` (`TABLES`), the one source of the tables' places, columns and",
        "descriptions, which are also each Delta column's comment and each Dagster asset's column schema. Regenerate",
        "with `TXNLAKE_UPDATE_TABLES_DOC=1 pytest tests/test_table_reference.py`.",
        "",
        "The analyst's tables are at the warehouse root (`TXNLAKE_WAREHOUSE`, default `./warehouse`), one folder each;",
        "the offload tier's entries at the tier's root (`TXNLAKE_COLD_TIER`, default `<warehouse>/cold`); internal",
        f"state, which no query should depend on, under `<warehouse>/{INTERNAL_FOLDER}/` (the writer locks too, in",
        f"`{INTERNAL_FOLDER}/locks/`). A transaction is named by its two halves, `txn_most_bits` and `txn_least_bits`",
        f"(the contract), and readably by `{TXN_ID}` (`most:least`, e.g. `0:1515`) in every public table that has",
        "them. A warehouse written by an older txnlake is refused with a message naming `txnlake migrate`, which",
        "brings it here.",
        "",
    ]
    for place in (Place.PUBLIC, Place.TIER, Place.INTERNAL):
        out += [f"## {_HEADINGS[place]}", ""]
        for spec in TABLES.values():
            if spec.place != place:
                continue
            kind = "" if spec.kind == Kind.TABLE else f" ({spec.kind}: `dbt-free-sql/{spec.name}.sql`)"
            where = "" if spec.kind == Kind.VIEW else f" At {_WHERE[place].format(name=spec.name)}; written by {spec.written_by}."
            out += [f"### `{spec.name}`{kind}", "", f"{spec.summary}{where}", "",
                    "| column | type | description |", "| --- | --- | --- |"]
            out += [f"| `{f.name}` | {f.dataType.simpleString()} | {f.metadata.get('comment', '')} |" for f in spec.schema.fields]
            out.append("")
    return "\n".join(out)
