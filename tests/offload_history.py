"""A small history for the offload tests: every eligibility edge case on real ledgers.

Topic `t`:
- ledger 1 (decided): plain, data of A, data of B, COMMIT A, ABORT B  -> eligible;
- ledger 2: data of C, plain (producer 1, seq 0), COMMIT C, a retried duplicate of it, data of D
  (D is ongoing and spans ledgers 2 and 3)                            -> waits (beyond stable 2:3);
- ledger 3: data of D, plain                                         -> waits;
- ledger 4: plain                                                    -> OPEN (the last ledger).
Topic `u`:
- ledger 5: plain, data of E                     -> ends exactly at the stable position 5:1;
- ledger 6: data of F (ongoing), COMMIT E        -> waits;
- ledger 7: plain                                -> OPEN.
Topic `v`: ledger 8 with one plain entry: decided but OPEN, never offloaded.
`COMMIT_D` later commits D in ledger 4, making ledgers 2 and 3 eligible.
"""

from tests.rows import entry

A, B, C, D, E, F, G = (1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (1, 5)

HISTORY = [
    entry("t", 1, 0, payload=b"t-1-0"), entry("t", 1, 1, txn=A, payload=b"a-data"), entry("t", 1, 2, txn=B, payload=b"b-aborted"),
    entry("t", 1, 3, "COMMIT", txn=A), entry("t", 1, 4, "ABORT", txn=B),
    entry("t", 2, 0, txn=C, payload=b"c-data"), entry("t", 2, 1, producer=1, seq=0, payload=b"t-2-1"),
    entry("t", 2, 2, "COMMIT", txn=C), entry("t", 2, 3, producer=1, seq=0, payload=b"t-2-1"),
    entry("t", 2, 4, txn=D, payload=b"d-first"),
    entry("t", 3, 0, txn=D, payload=b"d-second"), entry("t", 3, 1, payload=b"t-3-1"),
    entry("t", 4, 0, payload=b"t-4-0"),
    entry("u", 5, 0, payload=b"u-5-0"), entry("u", 5, 1, txn=E, payload=b"e-data"),
    entry("u", 6, 0, txn=F, payload=b"f-data"), entry("u", 6, 1, "COMMIT", txn=E),
    entry("u", 7, 0, payload=b"u-7-0"),
    entry("v", 8, 0, payload=b"v-8-0"),
]

COMMIT_D = [entry("t", 4, 1, "COMMIT", txn=D)]


def derive_buffer_tables(warehouse) -> None:
    """Write the four transaction-buffer tables from the current ledger_entries (what `txnlake run` does)."""
    from txn_engine.buffer.spark_runner import compute_buffer_tables
    from txn_engine.core.schema import ABORTED_TXNS, COMMITTED_ENTRIES, LEDGER_ENTRIES, STABLE_POSITIONS, TXN_MARKERS

    tables = compute_buffer_tables(warehouse.read(LEDGER_ENTRIES))
    try:
        for name, frame in [(TXN_MARKERS, tables.txn_markers), (STABLE_POSITIONS, tables.stable_positions),
                            (ABORTED_TXNS, tables.aborted_txns), (COMMITTED_ENTRIES, tables.committed_entries)]:
            warehouse.overwrite(name, frame)
    finally:
        tables.unpersist()


def oracle_read(rows, topic):
    """The reference read-committed output of `topic` from the beginning: (ledger_id, entry_id) in order."""
    from txn_engine.core.log_types import LogEntry
    from txn_engine.core.positions import EARLIEST
    from txn_engine.reference.transaction_buffer import replay

    entries = [LogEntry.from_row({**r, "payload": None, "publish_time": None}) for r in rows]
    buffers = replay(entries)
    return [(e.ledger_id, e.entry_id) for e in buffers[topic].read_committed(EARLIEST)] if topic in buffers else []
