"""The transaction-buffer assets and their checks, materialized in-process on Delta tables."""

from __future__ import annotations

from dagster import AssetKey, materialize

from pipelines.definitions import ALL_ASSETS, ALL_CHECKS, DERIVED_SELECTION
from tests.rows import entry, write_jsonl
from txn_engine.ingest import ingest_files
from txn_engine.schema import COMMITTED_ENTRIES, STABLE_POSITIONS

T1, T2, T3 = (0, 1), (0, 2), (0, 3)
# The offload seed's worked example (stable positions -1,-1,-1,0,0,0,4,7 over its prefixes),
# plus a second topic with an abort, a duplicate marker and a retried duplicate.
HISTORY = [
    entry("seed", 10, 0, txn=T1), entry("seed", 10, 1, txn=T2), entry("seed", 10, 2, txn=T1),
    entry("seed", 10, 3, "COMMIT", txn=T1), entry("seed", 10, 4, txn=T2), entry("seed", 10, 5, txn=T3),
    entry("seed", 10, 6, "COMMIT", txn=T2), entry("seed", 10, 7, "COMMIT", txn=T3),
    entry("other", 11, 0, txn=(1, 1), producer=5, seq=0), entry("other", 11, 1, txn=(1, 1), producer=5, seq=0),
    entry("other", 11, 2, "ABORT", txn=(1, 1)), entry("other", 11, 3, "ABORT", txn=(1, 1)),
    entry("other", 12, 0, producer=6, seq=0), entry("other", 12, 1, txn=(1, 2)),
]


def check_results(result):
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def test_buffer_tables_and_checks(warehouse, dagster_resources, tmp_path):
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "h.jsonl", HISTORY))])
    result = materialize([*ALL_ASSETS, *ALL_CHECKS], selection=DERIVED_SELECTION, resources=dagster_resources)
    assert result.success
    stable = {r.topic: tuple(r)[1:] for r in warehouse.read(STABLE_POSITIONS).collect()}
    assert stable == {"seed": (10, 7, 10, 7, 0), "other": (12, 0, 12, 1, 1)}
    committed = warehouse.read(COMMITTED_ENTRIES)
    ledger_order = [(r.topic, r.ledger_id, r.entry_id) for r in
                    committed.where("in_stable_prefix").orderBy("topic", "ledger_id", "entry_id").collect()]
    assert ledger_order == [("other", 12, 0)] + [("seed", 10, e) for e in (0, 1, 2, 4, 5)]
    [mat] = [e.event_specific_data.materialization for e in result.get_asset_materialization_events()
             if e.event_specific_data.materialization.asset_key == AssetKey(STABLE_POSITIONS)]
    assert mat.metadata["violations"].value == {"duplicate": 1, "duplicate_marker": 1, "data_after_marker": 0,
                                                "marker_without_data": 0}
    checks = check_results(result)
    assert set(checks) == {"stable_position_never_moves_backwards", "committed_entries_are_committed_once",
                           "markers_have_matching_outcomes"}
    assert all(c.passed for c in checks.values()), {k: c.metadata for k, c in checks.items()}


def test_stable_position_check_catches_a_step_backwards(warehouse, dagster_resources, tmp_path, spark):
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "h.jsonl", HISTORY))])
    # A previous version claiming a later stable position than the data supports.
    spark.createDataFrame([("seed", 99, 0, 99, 0, 0)], "topic string, max_read_ledger_id long, "
                          "max_read_entry_id long, last_ledger_id long, last_entry_id long, ongoing_txn_count long") \
        .write.format("delta").save(warehouse.path(STABLE_POSITIONS))
    result = materialize([*ALL_ASSETS, *ALL_CHECKS], selection=DERIVED_SELECTION, resources=dagster_resources)
    checks = check_results(result)
    assert not checks["stable_position_never_moves_backwards"].passed
    assert "seed" in str(checks["stable_position_never_moves_backwards"].metadata["topics_moved_back"].value)
