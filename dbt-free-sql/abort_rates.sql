-- Abort rate per topic and ledger: of the transactions decided in a ledger (by the position of
-- their first marker on the topic), the share that aborted.
SELECT
    topic,
    ledger_id,
    COUNT(*) AS decided_txns,
    SUM(CASE WHEN outcome = 'ABORT' THEN 1 ELSE 0 END) AS aborted_txns,
    SUM(CASE WHEN outcome = 'COMMIT' THEN 1 ELSE 0 END) AS committed_txns,
    ROUND(SUM(CASE WHEN outcome = 'ABORT' THEN 1 ELSE 0 END) / COUNT(*), 4) AS abort_rate
FROM txn_markers
GROUP BY topic, ledger_id
ORDER BY topic, ledger_id
