"""The table contract of the brief: table names and Spark schemas, defined once.

Downstream SQL depends on these column names and meanings; add columns, never rename them.
"""

from __future__ import annotations

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
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

# Tables that live in the cold tier (WarehouseSettings.cold_table_path), not under the warehouse root.
COLD_TABLES = (OFFLOADED_ENTRIES, OFFLOAD_MANIFEST)
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
