-- Per topic, the oldest ongoing transaction: data on the topic and no marker yet. It is what
-- holds the topic's stable position back (Kafka's and Pulsar's "hanging transaction").
WITH txn_data AS (
    SELECT
        topic,
        txn_most_bits,
        txn_least_bits,
        MIN(STRUCT(ledger_id, entry_id)) AS first_position,
        MIN(publish_time) AS first_publish_time,
        COUNT(*) AS data_entries
    FROM ledger_entries
    WHERE entry_type = 'DATA' AND txn_most_bits IS NOT NULL
    GROUP BY topic, txn_most_bits, txn_least_bits
),
ongoing AS (
    SELECT d.*
    FROM txn_data AS d
    LEFT ANTI JOIN txn_markers AS m
      ON m.topic = d.topic AND m.txn_most_bits = d.txn_most_bits AND m.txn_least_bits = d.txn_least_bits
),
ranked AS (
    SELECT
        o.*,
        ROW_NUMBER() OVER (PARTITION BY topic ORDER BY first_position) AS age_rank,
        COUNT(*) OVER (PARTITION BY topic) AS ongoing_txns
    FROM ongoing AS o
)
SELECT
    topic,
    CONCAT(CAST(txn_most_bits AS STRING), ':', CAST(txn_least_bits AS STRING)) AS txn_id,
    first_position.ledger_id AS first_ledger_id,
    first_position.entry_id AS first_entry_id,
    first_publish_time,
    data_entries,
    ongoing_txns
FROM ranked
WHERE age_rank = 1
ORDER BY first_publish_time, topic
