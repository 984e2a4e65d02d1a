"""The dbt-free SQL runner: dependency detection from the SQL, running a model on Delta tables."""

from __future__ import annotations

import pytest

from tests.rows import entry, write_jsonl
from txn_engine.errors import InputFileError, TableMissingError
from txn_engine.ingest import ingest_files
from txn_engine.sql_models import discover_models, load_model, referenced_tables, run_model


@pytest.mark.parametrize(
    "sql,tables",
    [
        ("SELECT * FROM ledger_entries", ("ledger_entries",)),
        ("SELECT * FROM ledgers l JOIN ledger_entries e ON l.topic = e.topic", ("ledger_entries", "ledgers")),
        ("WITH recent AS (SELECT * FROM ledgers WHERE state = 'OPEN') SELECT * FROM recent", ("ledgers",)),
        ("SELECT * FROM (SELECT topic FROM txn_markers) t WHERE topic IN (SELECT topic FROM aborted_txns)",
         ("aborted_txns", "txn_markers")),
        ("SELECT 1 AS one", ()),
    ],
)
def test_referenced_tables_come_from_the_sql(sql, tables):
    assert referenced_tables(sql) == tables


def test_unparseable_sql_is_a_clear_error(tmp_path):
    path = tmp_path / "broken.sql"
    path.write_text("SELECT FROM WHERE (")
    with pytest.raises(InputFileError, match="cannot parse the SQL"):
        load_model(path)


def test_shipped_models_read_known_tables():
    models = {m.name: m for m in discover_models()}
    assert models["ledger_sizes"].reads == ("ledger_entries", "ledgers")
    assert "Entries and bytes per topic and ledger" in models["ledger_sizes"].description


def test_run_model_over_delta_tables(warehouse, tmp_path):
    model_path = tmp_path / "per_topic.sql"
    model_path.write_text("-- entries per topic\nSELECT topic, COUNT(*) AS n FROM ledger_entries GROUP BY topic ORDER BY topic")
    model = load_model(model_path)
    with pytest.raises(TableMissingError, match="reads table ledger_entries, which does not exist yet"):
        run_model(warehouse, model)
    rows = [entry("a", 1, 0), entry("a", 1, 1), entry("b", 2, 0)]
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "in.jsonl", rows))])
    assert [tuple(r) for r in run_model(warehouse, model).collect()] == [("a", 2), ("b", 1)]
