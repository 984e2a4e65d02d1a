-- Per topic, the oldest ongoing transaction: data on the topic and no marker yet. It is what
-- holds the topic's stable position back (Kafka's and Pulsar's "hanging transaction").
-- A retried send (a DATA entry repeating an earlier one's topic, producer_id, producer_epoch and
-- sequence_id) is dropped and starts nothing, so only each send's first copy counts.
WITH sent AS (
    SELECT
        topic, txn_most_bits, txn_least_bits, ledger_id, entry_id, publish_time, producer_id, sequence_id,
        ROW_NUMBER() OVER (PARTITION BY topic, producer_id, producer_epoch, sequence_id ORDER BY ledger_id, entry_id) AS copy
    FROM ledger_entries
    WHERE entry_type = 'DATA'
),
txn_data AS (
    SELECT
        topic, txn_most_bits, txn_least_bits, ledger_id, entry_id, publish_time,
        ROW_NUMBER() OVER (PARTITION BY topic, txn_most_bits, txn_least_bits ORDER BY ledger_id, entry_id) AS nth,
        MIN(publish_time) OVER (PARTITION BY topic, txn_most_bits, txn_least_bits) AS first_publish_time,
        COUNT(*) OVER (PARTITION BY topic, txn_most_bits, txn_least_bits) AS data_entries
    FROM sent
    WHERE txn_most_bits IS NOT NULL AND (copy = 1 OR producer_id IS NULL OR sequence_id IS NULL)
),
-- `stable_positions` says which topics have transactions ongoing and how many; every ongoing
-- transaction's first entry lies after the stable position. That also leaves out a transaction
-- decided in a ledger retention has since deleted (its later data is late, not ongoing).
ongoing AS (
    SELECT d.*, s.ongoing_txn_count AS ongoing_txns
    FROM txn_data AS d
    JOIN stable_positions AS s
      ON s.topic = d.topic
     AND s.ongoing_txn_count > 0
     AND (d.ledger_id > s.max_read_ledger_id
          OR (d.ledger_id = s.max_read_ledger_id AND d.entry_id > s.max_read_entry_id))
    WHERE d.nth = 1
      AND NOT EXISTS (
        SELECT 1 FROM txn_markers AS m
        WHERE m.topic = d.topic AND m.txn_most_bits = d.txn_most_bits AND m.txn_least_bits = d.txn_least_bits
      )
),
ranked AS (
    SELECT
        o.*,
        ROW_NUMBER() OVER (PARTITION BY topic ORDER BY ledger_id, entry_id) AS age_rank
    FROM ongoing AS o
)
SELECT
    topic,
    txn_most_bits,
    txn_least_bits,
    CONCAT(CAST(txn_most_bits AS STRING), ':', CAST(txn_least_bits AS STRING)) AS txn_id,
    ledger_id AS first_ledger_id,
    entry_id AS first_entry_id,
    first_publish_time,
    data_entries,
    ongoing_txns
FROM ranked
WHERE age_rank = 1
ORDER BY first_publish_time, topic
