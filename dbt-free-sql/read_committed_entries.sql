-- materialized: view
-- What a read-committed reader sees now, in ledger order (Pulsar's and Kafka's delivery): the
-- committed entries at or below the stable position, that is committed_entries WHERE in_stable_prefix.
SELECT
    topic, ledger_id, entry_id, entry_type, txn_most_bits, txn_least_bits, txn_id, producer_id, producer_epoch,
    sequence_id, publish_time, key, payload, key_bytes, headers, timestamp_type,
    visible_ledger_id, visible_entry_id, local_seq
FROM committed_entries
WHERE in_stable_prefix
ORDER BY topic, ledger_id, entry_id
