"""`txnlake` end to end, in-process: generate, ingest, run, sql, and its errors."""

from __future__ import annotations

from pathlib import Path

from pipelines.cli import main

REPO = Path(__file__).resolve().parent.parent


def test_generate_ingest_run_sql(warehouse_root, tmp_path, capsys):
    data = tmp_path / "demo.jsonl"
    assert main(["generate", "--entries", "3000", "--seed", "3", str(data)]) == 0
    assert data.is_file()
    assert main(["ingest", str(data)]) == 0
    out = capsys.readouterr().out
    assert "rows read" in out and "0 quarantined" in out and str(warehouse_root / "ledger_entries") in out
    assert main(["ingest", str(data)]) == 0  # idempotent
    assert "0 appended, 3000 already present" in capsys.readouterr().out

    assert main(["run"]) == 0
    out = capsys.readouterr().out
    assert "ledgers" in out and "ledger_sizes" in out and "ledger_entries " not in out  # run adds no data
    assert main(["sql", str(REPO / "dbt-free-sql" / "ledger_sizes.sql"), "--limit", "3"]) == 0
    out = capsys.readouterr().out
    assert "reads ledger_entries, ledgers" in out and "pct_of_topic_entries" in out


def test_errors_exit_non_zero_and_write_nothing(warehouse_root, tmp_path, capsys):
    assert main(["ingest", str(tmp_path / "nope.jsonl")]) == 2
    assert "does not exist; nothing was ingested" in capsys.readouterr().err
    odd = tmp_path / "data.xml"
    odd.write_text("<x/>")
    assert main(["ingest", str(odd)]) == 2
    assert "unknown format" in capsys.readouterr().err
    assert not (warehouse_root / "ledger_entries").exists()
    assert main(["sql", str(tmp_path / "missing.sql")]) == 2
    assert "does not exist" in capsys.readouterr().err
