"""The dbt-free SQL runner: dependency detection from the SQL, running a model on Delta tables."""

from __future__ import annotations

import pytest

from tests.rows import entry, write_jsonl
from txn_engine.core.errors import InputFileError, TableMissingError
from txn_engine.core.schema import TABLES
from txn_engine.log.ingest import ingest_files
from txn_engine.sql.models import discover_models, known_tables, load_model, referenced_tables, run_model, run_model_in_driver


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


def _model(tmp_path, name: str, sql: str):
    path = tmp_path / f"{name}.sql"
    path.write_text(sql)
    return load_model(path)


def test_unknown_table_is_told_apart_from_one_not_written_yet(warehouse, tmp_path):
    # A typo names no txnlake table: "materialize it first" would send the user looking for an asset.
    typo = _model(tmp_path, "typo", "SELECT * FROM ledger_entrys LIMIT 3")
    with pytest.raises(InputFileError, match="reads table ledger_entrys, which is not a txnlake table") as err:
        run_model(warehouse, typo)
    assert str(tmp_path / "typo.sql") in str(err.value)
    assert "ledger_entries, " in str(err.value) and "txn_markers" in str(err.value)  # the names to choose from
    # Known: the contract's tables and the SQL models' own.
    assert {"ledger_entries", "txn_markers", "consumer_offsets", "ledger_sizes"} <= set(known_tables())
    with pytest.raises(TableMissingError, match=r"ledger_sizes, which does not exist yet .* write it first \(`txnlake run`\)"):
        run_model(warehouse, _model(tmp_path, "sizes", "SELECT * FROM ledger_sizes"))
    # The command that writes it, for a table `txnlake run` does not write.
    with pytest.raises(TableMissingError, match=r"write it first \(`txnlake snapshot`\)"):
        run_model(warehouse, _model(tmp_path, "segments", "SELECT * FROM txn_snapshot_segments"))
    # Nothing offloaded or deleted yet: those tables read as empty, not as an error.
    assert run_model(warehouse, _model(tmp_path, "cold", "SELECT COUNT(*) AS n FROM offload_manifest")).collect()[0].n == 0


def test_run_model_over_delta_tables(warehouse, tmp_path):
    model = _model(tmp_path, "per_topic", "-- entries per topic\nSELECT topic, COUNT(*) AS n FROM ledger_entries GROUP BY topic ORDER BY topic")
    with pytest.raises(TableMissingError, match="reads table ledger_entries, which does not exist yet"):
        run_model(warehouse, model)
    rows = [entry("a", 1, 0), entry("a", 1, 1), entry("b", 2, 0)]
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "in.jsonl", rows))])
    assert [tuple(r) for r in run_model(warehouse, model).collect()] == [("a", 2), ("b", 1)]

    # Spark's analysis errors: the model, Spark's first line (not its plan), and what to do.
    col = _model(tmp_path, "col", "SELECT topic, nonexistent_col FROM ledger_entries")
    with pytest.raises(InputFileError, match=r"SQL model col \(.*col\.sql\) does not run: \[UNRESOLVED_COLUMN") as err:
        run_model(warehouse, col)
    message = str(err.value)
    assert "nonexistent_col" in message and f"Fix the SQL in {tmp_path / 'col.sql'}" in message
    assert "\n" not in message
    # sqlglot accepts a trailing comma that Spark's parser refuses: the same clear error.
    trailing = _model(tmp_path, "trailing", "SELECT topic, FROM ledger_entries")
    with pytest.raises(InputFileError, match=r"trailing \(.*\) does not run: \[TRAILING_COMMA_IN_SELECT\]"):
        run_model(warehouse, trailing)


def _offloaded_history(warehouse, folder):
    from tests.offload_history import HISTORY, derive_buffer_tables
    from txn_engine.log.ledgers import write_ledger_catalog
    from txn_engine.tier.offload import offload_ledgers

    # Keys of several UTF-8 widths, so byte counts differ from character counts.
    keyed = [entry("w", 9, i, key=k, payload=b"p" * i) for i, k in enumerate(["a", "é", "日本", "🙂", None])]
    ingest_files(warehouse, [str(write_jsonl(folder / "h.jsonl", HISTORY + keyed))])
    write_ledger_catalog(warehouse)
    derive_buffer_tables(warehouse)
    offload_ledgers(warehouse)


def _comparable(value):
    """A cell as both engines can agree on it: numbers as rounded floats, timestamps in UTC."""
    import datetime as dt
    import decimal

    if isinstance(value, (decimal.Decimal, float)):
        return round(float(value), 6)
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.timezone.utc).replace(tzinfo=None) if value.tzinfo else value
    if isinstance(value, dict):  # DuckDB's struct; Spark's is a Row, a tuple
        value = tuple(value.values())
    if isinstance(value, (list, tuple)):
        return tuple(_comparable(v) for v in value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    return value


def test_every_shipped_model_gives_the_same_rows_in_spark_and_duckdb(prepared, monkeypatch):
    """The models are portable SQL: DuckDB, reading the same Delta tables through delta-rs's Arrow
    datasets, returns what Spark does, row for row and in order."""
    monkeypatch.setenv("TZ", "UTC")
    warehouse = prepared("sql-models-offloaded", _offloaded_history)
    warehouse.spark.conf.set("spark.sql.session.timeZone", "UTC")
    compared = {}
    models = discover_models()
    views = {m.name: m for m in models if m.view}
    for model in models:
        result = run_model(warehouse, model)
        # Each model returns the columns its spec declares (names and Spark types): what docs/tables.md shows.
        assert [(f.name, f.dataType) for f in result.schema.fields] == [
            (f.name, f.dataType) for f in TABLES[model.name].schema.fields], model.name
        spark_rows = [tuple(_comparable(v) for v in row) for row in result.collect()]
        duck_rows = [tuple(_comparable(v) for v in row.values()) for row in run_model_in_driver(warehouse, model).to_pylist()]
        assert duck_rows == spark_rows, f"{model.name}: DuckDB and Spark differ"
        compared[model.name] = len(spark_rows)
        if model.name == "ledger_sizes":  # UTF-8 bytes of the keys (1 + 2 + 6 + 4) and payloads (0 + 1 + 2 + 3 + 4)
            assert [r[6] for r in spark_rows if r[:2] == ("w", 9)] == [13 + 10]
    assert set(compared) == {"abort_rates", "ledger_sizes", "oldest_ongoing_txn", "read_committed_entries", "tier_sizes",
                             "topic_read_lag"}
    assert all(compared.values()), compared  # every model returned rows
    # The view is what a read-committed reader sees now: committed_entries where in_stable_prefix.
    view = run_model(warehouse, views["read_committed_entries"])
    committed = warehouse.read("committed_entries")
    assert 0 < view.count() < committed.count()
    assert sorted(view.collect()) == sorted(committed.where("in_stable_prefix").drop("in_stable_prefix").collect())
    assert view.columns == [c for c in committed.columns if c != "in_stable_prefix"]


def test_the_model_assets_run_in_the_driver_on_small_tables_and_on_spark_when_told(prepared, dagster_resources, monkeypatch,
                                                                                    tmp_path):
    """`auto` runs the shipped models with DuckDB in the driver on tables this small, and a model
    of one's own on Spark; `TXNLAKE_COMPUTE=spark` runs every one on Spark. The tables are equal."""
    from dagster import AssetSelection, DagsterInstance, materialize

    from assets.sql_models import sql_model_assets
    from txn_engine.storage.delta_io import DeltaTables

    warehouse = prepared("sql-models-offloaded", _offloaded_history)
    shipped = [a for a in sql_model_assets() if hasattr(a, "op")]

    def materialized(compute):
        monkeypatch.setenv("TXNLAKE_COMPUTE", compute)
        result = materialize(shipped, selection=AssetSelection.all(), resources=dagster_resources,
                             instance=DagsterInstance.ephemeral())
        assert result.success
        events = [e.event_specific_data.materialization for e in result.get_asset_materialization_events()]
        by = {m.asset_key.path[-1]: m.metadata["computed_by"].value for m in events}
        tables = {name: (DeltaTables(warehouse).schema(name),
                         sorted(map(repr, DeltaTables(warehouse).read(name, TABLES[name].schema).to_pylist()))) for name in by}
        return by, tables

    on_driver, driver_tables = materialized("auto")
    assert set(on_driver.values()) == {"driver"} and set(on_driver) == {"abort_rates", "ledger_sizes", "oldest_ongoing_txn",
                                                                       "tier_sizes", "topic_read_lag"}
    on_spark, spark_tables = materialized("spark")
    assert set(on_spark.values()) == {"spark"}
    assert spark_tables == driver_tables and all(rows for _, rows in driver_tables.values())  # columns, nullability, rows

    from txn_engine.sql.models import runs_in_driver

    assert warehouse.settings.compute == "auto"
    assert runs_in_driver(warehouse, next(m for m in discover_models() if m.name == "abort_rates"))
    assert not runs_in_driver(warehouse, _model(tmp_path, "mine", "SELECT topic FROM ledgers"))  # undeclared: Spark's SQL
