-- Per topic: what a read-committed reader sees now (read_committed_entries), and how far the stable
-- position (max read position) lags behind the last position, in entries and bytes a read-committed
-- reader cannot see yet, and how many transactions hold it.
WITH readable AS (
    SELECT topic, COUNT(*) AS readable_entries
    FROM read_committed_entries
    GROUP BY topic
)
SELECT
    s.topic,
    s.last_ledger_id,
    s.last_entry_id,
    s.max_read_ledger_id,
    s.max_read_entry_id,
    s.ongoing_txn_count,
    COALESCE(MAX(r.readable_entries), 0) AS readable_entries,
    COUNT(e.entry_id) AS entries_behind,
    COALESCE(SUM(COALESCE(OCTET_LENGTH(e.payload), 0) + COALESCE(CAST(BIT_LENGTH(e.key) / 8 AS BIGINT), 0)), 0) AS bytes_behind
FROM stable_positions AS s
LEFT JOIN readable AS r
  ON r.topic = s.topic
LEFT JOIN ledger_entries AS e
  ON e.topic = s.topic
 AND (e.ledger_id > s.max_read_ledger_id
      OR (e.ledger_id = s.max_read_ledger_id AND e.entry_id > s.max_read_entry_id))
GROUP BY s.topic, s.last_ledger_id, s.last_entry_id, s.max_read_ledger_id, s.max_read_entry_id, s.ongoing_txn_count
ORDER BY entries_behind DESC, s.topic
