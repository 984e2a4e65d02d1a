"""`txnlake snapshot` in-process: its output and exit code, and its errors (nothing written)."""

from __future__ import annotations

from pipelines.cli import main
from tests.buffer_histories import frame
from tests.test_snapshot_jobs import aborted_history, as_truth, truth
from txn_engine.buffer.spark_runner import compute_buffer_tables
from txn_engine.core.schema import (
    ABORTED_TXNS,
    LEDGER_ENTRIES,
    RECOVERED_BUFFER_STATE,
    STABLE_POSITIONS,
    TXN_SNAPSHOT_SEGMENTS,
    TXN_SNAPSHOT_STATE,
)


def test_snapshot_command_errors_then_snapshots(warehouse, warehouse_root, capsys):
    # Nothing ingested yet: a clear error, exit 2, no table written.
    assert main(["snapshot"]) == 2
    err = capsys.readouterr().err
    assert "table ledger_entries does not exist yet" in err and "txnlake ingest" in err
    assert not (warehouse_root / TXN_SNAPSHOT_SEGMENTS).exists()

    entries = aborted_history("busy", 5)
    log = frame(warehouse.spark, entries)
    warehouse.overwrite(LEDGER_ENTRIES, log)
    tables = compute_buffer_tables(log)
    warehouse.overwrite(STABLE_POSITIONS, tables.stable_positions)
    warehouse.overwrite(ABORTED_TXNS, tables.aborted_txns)
    tables.unpersist()
    # A segment bound that cannot hold an abort: refused before anything is written.
    assert main(["snapshot", "--max-aborts-per-segment", "0"]) == 2
    assert "error: max_aborts_per_segment must be at least 1, got 0" in capsys.readouterr().err
    assert not (warehouse_root / TXN_SNAPSHOT_SEGMENTS).exists()

    assert main(["snapshot", "--max-aborts-per-segment", "2"]) == 0
    out = capsys.readouterr().out
    for table in (TXN_SNAPSHOT_SEGMENTS, RECOVERED_BUFFER_STATE):
        assert table in out and str(warehouse_root / table) in out
    assert warehouse.path(TXN_SNAPSHOT_STATE) == str(warehouse_root / "_internal" / TXN_SNAPSHOT_STATE)  # internal state
    assert "check recovered_state_equals_full_replay: passed" in out
    # 5 aborts, 2 a segment: busy-1, busy-2, busy-end; the state READY; recovery from it.
    keys = sorted(r.snapshot_key for r in warehouse.read(TXN_SNAPSHOT_SEGMENTS).collect())
    assert keys == ["busy-1", "busy-2", "busy-end"]
    assert warehouse.read(TXN_SNAPSHOT_STATE).first().state == "READY"
    [recovered] = [r.asDict(recursive=True) for r in warehouse.read(RECOVERED_BUFFER_STATE).collect()]
    assert recovered["source"] == "SNAPSHOT" and as_truth(recovered) == truth(entries, "busy")
