"""The transaction buffer's four tables in DuckDB: benchmark-only, to compare Spark against.

The same rules as `txn_engine.reference.transaction_buffer` (and the Spark jobs): de-duplicate DATA by
(topic, producer_id, sequence_id) keeping the first position; the first marker of a transaction
on a topic wins; data after that marker is dropped; the stable position is the position before
the earliest ongoing transaction's first entry (or the last position); committed entries carry
their commit marker's position and their order inside the transaction.
"""

from __future__ import annotations

import json
import os
import sys
import time

from benchmarks.measure import peak_rss_mib

BUFFER_SQL = """
CREATE OR REPLACE TEMP VIEW entries AS SELECT * FROM read_parquet({files});

CREATE OR REPLACE TEMP TABLE kept_data AS
SELECT * EXCLUDE (dup_rank) FROM (
    SELECT *, CASE WHEN producer_id IS NULL OR sequence_id IS NULL THEN 1
               ELSE row_number() OVER (PARTITION BY topic, producer_id, sequence_id ORDER BY ledger_id, entry_id) END AS dup_rank
    FROM entries WHERE entry_type = 'DATA'
) WHERE dup_rank = 1;

CREATE OR REPLACE TEMP TABLE first_markers AS
SELECT topic, txn_most_bits, txn_least_bits, entry_type AS outcome, ledger_id, entry_id FROM (
    SELECT *, row_number() OVER (PARTITION BY topic, txn_most_bits, txn_least_bits ORDER BY ledger_id, entry_id) AS rk
    FROM entries WHERE entry_type IN ('COMMIT', 'ABORT')
) WHERE rk = 1;

CREATE OR REPLACE TEMP TABLE txn_data AS
SELECT d.*, m.outcome, m.ledger_id AS m_ledger, m.entry_id AS m_entry
FROM kept_data d LEFT JOIN first_markers m USING (topic, txn_most_bits, txn_least_bits)
WHERE d.txn_most_bits IS NOT NULL
  AND (m.ledger_id IS NULL OR d.ledger_id < m.ledger_id OR (d.ledger_id = m.ledger_id AND d.entry_id < m.entry_id));

CREATE OR REPLACE TEMP TABLE ledger_last AS
SELECT topic, ledger_id, max(entry_id) AS last_entry FROM entries GROUP BY topic, ledger_id;

CREATE OR REPLACE TEMP TABLE earliest_ongoing AS
SELECT topic, arg_min(ledger_id, (ledger_id, entry_id)) AS l, arg_min(entry_id, (ledger_id, entry_id)) AS e,
       count(DISTINCT (txn_most_bits, txn_least_bits)) AS ongoing
FROM txn_data WHERE outcome IS NULL GROUP BY topic;

CREATE OR REPLACE TEMP TABLE stable_positions AS
WITH last_pos AS (
    SELECT topic, arg_max(ledger_id, ledger_id) AS last_ledger_id, arg_max(last_entry, ledger_id) AS last_entry_id
    FROM ledger_last GROUP BY topic
), before_first AS (
    SELECT o.topic, o.l, o.e, o.ongoing,
           (SELECT arg_max(p.ledger_id, p.ledger_id) FROM ledger_last p WHERE p.topic = o.topic AND p.ledger_id < o.l) AS prev_l,
           (SELECT arg_max(p.last_entry, p.ledger_id) FROM ledger_last p WHERE p.topic = o.topic AND p.ledger_id < o.l) AS prev_e
    FROM earliest_ongoing o
)
SELECT t.topic,
       CASE WHEN b.topic IS NULL THEN t.last_ledger_id WHEN b.e > 0 THEN b.l ELSE coalesce(b.prev_l, b.l) END AS max_read_ledger_id,
       CASE WHEN b.topic IS NULL THEN t.last_entry_id WHEN b.e > 0 THEN b.e - 1 ELSE coalesce(b.prev_e, -1) END AS max_read_entry_id,
       t.last_ledger_id, t.last_entry_id, coalesce(b.ongoing, 0) AS ongoing_txn_count
FROM last_pos t LEFT JOIN before_first b USING (topic);

CREATE OR REPLACE TEMP TABLE aborted_txns AS
SELECT topic, txn_most_bits, txn_least_bits, ledger_id AS abort_ledger_id, entry_id AS abort_entry_id
FROM first_markers WHERE outcome = 'ABORT';

CREATE OR REPLACE TEMP TABLE committed_entries AS
WITH visible AS (
    SELECT * EXCLUDE (outcome, m_ledger, m_entry), m_ledger AS visible_ledger_id, m_entry AS visible_entry_id,
           row_number() OVER (PARTITION BY topic, txn_most_bits, txn_least_bits ORDER BY ledger_id, entry_id) - 1 AS local_seq
    FROM txn_data WHERE outcome = 'COMMIT'
    UNION ALL
    SELECT *, ledger_id AS visible_ledger_id, entry_id AS visible_entry_id, 0 AS local_seq
    FROM kept_data WHERE txn_most_bits IS NULL
)
SELECT v.*, (v.ledger_id < s.max_read_ledger_id OR (v.ledger_id = s.max_read_ledger_id AND v.entry_id <= s.max_read_entry_id)) AS in_stable_prefix
FROM visible v JOIN stable_positions s USING (topic);
"""

TABLES = ("first_markers", "stable_positions", "aborted_txns", "committed_entries")


def compute_and_write(con, parquet_files: list[str], out_dir: str) -> dict[str, int]:
    """Run the buffer logic over Parquet files and write the four tables as Parquet; row counts."""
    files = "[" + ", ".join(f"'{f}'" for f in parquet_files) + "]"
    con.execute(BUFFER_SQL.format(files=files))
    counts = {}
    for table in TABLES:
        con.execute(f"COPY {table} TO '{out_dir}/{table}.parquet' (FORMAT parquet)")
        counts[table] = con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    return counts


def runs(parquet_files: list[str], out_dir: str, rounds: int = 2) -> dict:
    """`compute_and_write` `rounds` times, each on a connection of its own with 2 threads (the first
    pays the process's first touches of memory): {"seconds": [...], "counts": {...}, "peak_rss_mib": ...}."""
    import duckdb  # optional (the dev extra): buffer_bench checks for it before starting this process

    seconds, counts = [], {}
    for _ in range(rounds):
        con = duckdb.connect()
        con.execute("SET threads = 2")
        started = time.perf_counter()
        counts = compute_and_write(con, parquet_files, out_dir)
        seconds.append(time.perf_counter() - started)
        con.close()
    # VmHWM, not ru_maxrss: a child's ru_maxrss starts from its parent's at the fork.
    return {"seconds": seconds, "counts": counts, "peak_rss_mib": peak_rss_mib(os.getpid())}


if __name__ == "__main__":
    # In a process of its own (`buffer_bench`): DuckDB's memory never sits beside the steps measured after it.
    print(json.dumps(runs(json.loads(sys.argv[1]), sys.argv[2])))
