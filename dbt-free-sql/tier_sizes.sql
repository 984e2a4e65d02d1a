-- Per topic: entries and bytes in the hot tier (ledger_entries) and in the filtered offload tier, and what filtering saved.
WITH hot AS (
    SELECT
        topic,
        COUNT(*) AS hot_entries,
        SUM(COALESCE(OCTET_LENGTH(payload), 0) + COALESCE(CAST(BIT_LENGTH(key) / 8 AS BIGINT), 0)) AS hot_bytes
    FROM ledger_entries
    GROUP BY topic
),
cold AS (
    SELECT
        topic,
        COUNT(*) AS offloaded_ledgers,
        SUM(entries_kept) AS cold_entries,
        SUM(bytes_after) AS cold_bytes,
        SUM(entries_before - entries_kept) AS entries_dropped_by_filtering,
        SUM(bytes_before - bytes_after) AS bytes_saved_by_filtering
    FROM offload_manifest
    GROUP BY topic
)
SELECT
    COALESCE(h.topic, c.topic) AS topic,
    COALESCE(h.hot_entries, 0) AS hot_entries,
    COALESCE(h.hot_bytes, 0) AS hot_bytes,
    COALESCE(c.offloaded_ledgers, 0) AS offloaded_ledgers,
    COALESCE(c.cold_entries, 0) AS cold_entries,
    COALESCE(c.cold_bytes, 0) AS cold_bytes,
    COALESCE(c.entries_dropped_by_filtering, 0) AS entries_dropped_by_filtering,
    COALESCE(c.bytes_saved_by_filtering, 0) AS bytes_saved_by_filtering
FROM hot AS h
FULL OUTER JOIN cold AS c
  ON h.topic = c.topic
ORDER BY topic
