-- Entries and bytes per topic and ledger, with the ledger's state and its share of the topic.
SELECT
    e.topic,
    e.ledger_id,
    l.state,
    COUNT(*) AS entries,
    SUM(CASE WHEN e.entry_type = 'DATA' THEN 1 ELSE 0 END) AS data_entries,
    SUM(CASE WHEN e.entry_type <> 'DATA' THEN 1 ELSE 0 END) AS marker_entries,
    SUM(COALESCE(OCTET_LENGTH(e.payload), 0) + COALESCE(CAST(BIT_LENGTH(e.key) / 8 AS BIGINT), 0)) AS bytes,
    ROUND(100.0 * COUNT(*) / SUM(COUNT(*)) OVER (PARTITION BY e.topic), 2) AS pct_of_topic_entries
FROM ledger_entries AS e
JOIN ledgers AS l
  ON l.topic = e.topic AND l.ledger_id = e.ledger_id
GROUP BY e.topic, e.ledger_id, l.state
ORDER BY e.topic, e.ledger_id
