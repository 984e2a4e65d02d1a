"""Dagster: the Definitions load, every asset materializes in-process with useful metadata."""

from __future__ import annotations

import warnings

from dagster import AssetKey, BetaWarning, Definitions

from assets.offload import retention_job
from pipelines.definitions import DERIVED_SELECTION, defs, ignore_dagsters_own_owners_warning
from tests.dagster_runs import derive_all
from tests.rows import entry, write_jsonl
from deltalake import DeltaTable

from txn_engine.core.schema import LEDGER_ENTRIES, LEDGERS, QUARANTINE_ENTRIES, TABLES, stored_schema


def metadata_of(result, key: str) -> dict:
    [mat] = [e.event_specific_data.materialization for e in result.get_asset_materialization_events()
             if e.event_specific_data.materialization.asset_key == AssetKey(key)]
    return {k: getattr(v, "value", v) for k, v in mat.metadata.items()}


def test_definitions_load_with_every_asset_and_sql_deps():
    # Resolving the definitions warns about nothing we chose: Dagster's own `owners` BetaWarning is
    # filtered when they are imported (pytest resets the filters around each test: here again);
    # any other beta or deprecation warning shows here.
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", category=Warning)
        ignore_dagsters_own_owners_warning()
        Definitions.merge(defs).get_repository_def()
    assert not [str(w.message) for w in caught if issubclass(w.category, (BetaWarning, DeprecationWarning))]
    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert {LEDGER_ENTRIES, QUARANTINE_ENTRIES, LEDGERS, "ledger_sizes"} <= keys
    assert graph.get(AssetKey("ledger_sizes")).parent_keys == {AssetKey(LEDGER_ENTRIES), AssetKey(LEDGERS)}
    assert graph.get(AssetKey(LEDGERS)).parent_keys == {AssetKey(LEDGER_ENTRIES)}
    assert defs.resolve_job_def("derive_all") is not None
    assert defs.resolve_job_def("transaction_buffer").partitions_def.name == "topic_ledgers"
    assert defs.resolve_sensor_def("ledgers_closed_sensor") is not None
    # Retention has its own job and (stopped) daily schedule; `txnlake run` never deletes ledgers.
    assert defs.resolve_schedule_def("retention_schedule").job_name == "retention"
    assert retention_job.selection.resolve(graph) == {AssetKey("deleted_ledgers")}
    assert AssetKey("deleted_ledgers") not in DERIVED_SELECTION.resolve(graph)
    # The UI's kind tags: what holds each table and what computes it.
    assert graph.get(AssetKey("committed_entries")).kinds == {"spark", "delta"}
    assert graph.get(AssetKey("ledger_sizes")).kinds == {"sql", "spark", "delta"}
    assert graph.get(AssetKey(LEDGER_ENTRIES)).kinds == {"spark", "python", "delta"}
    # The raw log is written by jobs (ingest, the engine's demo), not by "Materialize all": it is
    # an external asset, and the demo workload no asset at all.
    assert not graph.get(AssetKey(LEDGER_ENTRIES)).is_executable
    assert not graph.has(AssetKey("demo_workload"))
    assert {defs.resolve_job_def(name).name for name in ("ingest", "demo")} == {"ingest", "demo"}


def test_ingest_then_derive_every_asset_in_process(dagster_resources, warehouse_root, tmp_path):
    rows = [entry("orders-0", 1, i, payload=b"abcd") for i in range(5)] + [entry("orders-0", 2, 0)]
    rows.append({**entry("orders-0", 2, 1), "entry_type": "NOPE"})
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    ingest = defs.resolve_job_def("ingest").execute_in_process(
        run_config={"ops": {"ingest_ledger_entries": {"config": {"paths": [str(path)]}}}},
        resources=dagster_resources,
    )
    assert ingest.success
    meta = metadata_of(ingest, LEDGER_ENTRIES)
    assert (meta["rows"], meta["rows_written"], meta["rows_quarantined"]) == (6, 6, 1)
    assert meta["table_location"] == str(warehouse_root / LEDGER_ENTRIES)
    # Dagster's own keys, which the UI shows: the row count and the columns, from the Delta log.
    assert meta["dagster/row_count"] == 6
    columns = {c.name: (c.type, c.constraints.nullable) for c in meta["dagster/column_schema"].columns}
    assert list(columns) == stored_schema(LEDGER_ENTRIES).fieldNames()  # the contract's, txn_id beside its halves
    assert (columns["ledger_id"][0], columns["producer_epoch"][0], columns["publish_time"][0], columns["payload"][0]) == (
        "bigint", "int", "timestamp", "binary")
    assert columns["txn_most_bits"][1] is True  # null for non-transactional entries
    assert metadata_of(ingest, QUARANTINE_ENTRIES)["rows"] == 1

    catalog, derived = derive_all(dagster_resources)
    assert derived.success
    materialized = {e.event_specific_data.materialization.asset_key.to_user_string()
                    for e in [*catalog.get_asset_materialization_events(), *derived.get_asset_materialization_events()]}
    assert {LEDGERS, "ledger_sizes", "stable_positions"} <= materialized and LEDGER_ENTRIES not in materialized
    assert metadata_of(catalog, LEDGERS)["ledgers_by_state"] == {"CLOSED": 1, "OPEN": 1}
    sizes = metadata_of(derived, "ledger_sizes")
    assert sizes["rows"] == sizes["dagster/row_count"] == 2 and "| orders-0 | 1 | CLOSED | 5 |" in sizes["preview"]
    assert (warehouse_root / "ledger_sizes" / "_delta_log").is_dir()
    # Every column described, in the UI (each materialization's column schema) and in the Delta table
    # (its column comment), from the one source (schema.TABLES); the asset definitions carry it too.
    events = [*ingest.get_asset_materialization_events(), *catalog.get_asset_materialization_events(),
              *derived.get_asset_materialization_events()]
    graph = defs.resolve_asset_graph()
    for event in events:
        materialization = event.event_specific_data.materialization
        table = materialization.asset_key.to_user_string()
        schema_meta = materialization.metadata["dagster/column_schema"].value
        spec = TABLES[table]
        assert [(c.name, c.description) for c in schema_meta.columns] == [
            (f.name, f.metadata["comment"]) for f in spec.schema.fields], table
        assert all(c.description for c in schema_meta.columns), table
        stored = DeltaTable(str(warehouse_root / table)).schema().fields
        assert [(f.name, f.metadata.get("comment")) for f in stored] == [
            (f.name, f.metadata["comment"]) for f in spec.schema.fields], table
        declared = graph.get(materialization.asset_key).metadata["dagster/column_schema"]
        assert [c.description for c in declared.columns] == [c.description for c in schema_meta.columns], table
    assert {LEDGER_ENTRIES, QUARANTINE_ENTRIES, LEDGERS, "txn_markers", "committed_entries", "topic_read_lag"} <= {
        e.event_specific_data.materialization.asset_key.to_user_string() for e in events}


def test_ingest_without_paths_fails_with_instructions(dagster_resources):
    result = defs.resolve_job_def("ingest").execute_in_process(resources=dagster_resources, raise_on_error=False)
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "set config `paths`" in str(failure.event_specific_data.error)
