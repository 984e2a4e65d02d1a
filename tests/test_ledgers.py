"""The ledger catalog derived from ledger_entries."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyspark.sql import Row

from tests.rows import entry
from txn_engine.log.ledgers import derive_ledger_catalog
from txn_engine.core.schema import LEDGER_ENTRIES_SCHEMA, LEDGER_ENTRY_COLUMNS


def entries_df(spark, rows):
    import base64
    import datetime as dt

    def typed(r):
        return Row(**{**{c: None for c in LEDGER_ENTRY_COLUMNS}, **r,
                      "publish_time": dt.datetime(2026, 1, 1, 0, 0, r["entry_id"]),
                      "payload": None if r["payload"] is None else base64.b64decode(r["payload"])})

    return spark.createDataFrame([typed(r) for r in rows], LEDGER_ENTRIES_SCHEMA)


def test_catalog_counts_bytes_and_states(spark):
    rows = [entry("a", 1, i, payload=b"12345", key="kk") for i in range(3)]
    rows += [entry("a", 1, 3, "COMMIT", txn=(0, 1))]
    rows += [entry("a", 7, i, payload=b"1") for i in range(2)]
    rows += [entry("b", 4, 0, payload=b"xyz")]
    catalog = {(r.topic, r.ledger_id): r for r in derive_ledger_catalog(entries_df(spark, rows)).collect()}
    assert set(catalog) == {("a", 1), ("a", 7), ("b", 4)}
    first = catalog[("a", 1)]
    assert (first.state, first.first_entry_id, first.last_entry_id, first.entry_count, first.size_bytes) == (
        "CLOSED", 0, 3, 4, 3 * (5 + 2),
    )
    assert first.last_publish_time.second == 3
    assert catalog[("a", 7)].state == "OPEN"  # the last ledger of a topic is still being written
    assert catalog[("b", 4)].state == "OPEN" and catalog[("b", 4)].size_bytes == 3


def test_known_states_override_the_derived_ones(spark):
    rows = [entry("a", 1, 0), entry("a", 2, 0), entry("a", 3, 0)]
    known = pa.table({"topic": ["a", "a"], "ledger_id": [1, 3], "state": ["OFFLOADED", "CLOSED"]})
    states = {r.ledger_id: r.state for r in derive_ledger_catalog(entries_df(spark, rows), known).collect()}
    assert states == {1: "OFFLOADED", 2: "CLOSED", 3: "CLOSED"}


def test_recorded_states_latest_wins_and_reach_the_catalog(warehouse, spark):
    from txn_engine.log.ledgers import record_ledger_states, recorded_ledger_states, recorded_states_table

    rows = [entry("a", 1, 0), entry("a", 2, 0)]
    assert recorded_ledger_states(warehouse).count() == 0  # no table yet: no recorded state
    record_ledger_states(warehouse, [("a", 2, "CLOSED", "rolled over")])
    record_ledger_states(warehouse, [("a", 1, "CLOSED", None)])
    record_ledger_states(warehouse, [("a", 1, "OFFLOADED", "offloaded to cold tier")])
    recorded = {(r.topic, r.ledger_id): r.state for r in recorded_ledger_states(warehouse).collect()}
    assert recorded == {("a", 1): "OFFLOADED", ("a", 2): "CLOSED"}
    catalog = derive_ledger_catalog(entries_df(spark, rows), recorded_states_table(warehouse))
    assert {r.ledger_id: r.state for r in catalog.collect()} == {1: "OFFLOADED", 2: "CLOSED"}


def test_recording_an_unknown_state_is_refused_and_writes_nothing(warehouse):
    import pytest

    from txn_engine.log.ledgers import record_ledger_states
    from txn_engine.core.schema import LEDGER_STATES_LOG

    with pytest.raises(ValueError, match="unknown state 'GONE'; use one of OPEN, CLOSED, OFFLOADED, DELETED"):
        record_ledger_states(warehouse, [("a", 1, "CLOSED", None), ("a", 2, "GONE", None)])
    assert not warehouse.exists(LEDGER_STATES_LOG)


def test_ledger_ranges_match_the_spark_catalog_at_each_version(warehouse, spark):
    from txn_engine.log.ledgers import ledger_ranges, ledger_ranges_catalog, record_ledger_states
    from txn_engine.core.schema import LEDGER_ENTRIES

    first = [entry("a", 1, i) for i in range(3)] + [entry("b", 4, 0)]
    # Ledger a/1 goes on in the second commit: its range spans files (and Arrow batches).
    second = [entry("a", 1, i) for i in range(3, 6)] + [entry("a", 2, 0, "COMMIT", txn=(0, 1)), entry("b", 4, 1)]
    warehouse.append(LEDGER_ENTRIES, entries_df(spark, first))  # as every writer does: with txn_id
    warehouse.append(LEDGER_ENTRIES, entries_df(spark, second))
    record_ledger_states(warehouse, [("a", 1, "OFFLOADED", None)])

    def spark_ranges(rows):
        return {(r.topic, r.ledger_id): (r.first_entry_id, r.last_entry_id, r.entry_count)
                for r in derive_ledger_catalog(entries_df(spark, rows)).collect()}

    for version, rows in ((0, first), (1, first + second), (None, first + second)):
        ranges = ledger_ranges(warehouse, version).to_pylist()
        assert {(r["topic"], r["ledger_id"]): (r["first_entry_id"], r["last_entry_id"], r["entry_count"])
                for r in ranges} == spark_ranges(rows)
    assert spark_ranges(first + second)[("a", 1)] == (0, 5, 6)
    catalog = {(r["topic"], r["ledger_id"]): r["state"] for r in ledger_ranges_catalog(warehouse).to_pylist()}
    assert catalog == {("a", 1): "OFFLOADED", ("a", 2): "OPEN", ("b", 4): "OPEN"}
    assert {(r["topic"], r["ledger_id"]): r["state"] for r in ledger_ranges_catalog(warehouse, 0).to_pylist()} == {
        ("a", 1): "OFFLOADED", ("b", 4): "OPEN"}


def test_ledger_ranges_and_the_offload_without_a_log_say_what_to_do(warehouse):
    import pytest

    from txn_engine.core.errors import TableMissingError
    from txn_engine.log.ledgers import ledger_ranges
    from txn_engine.tier.offload import offload_ledgers

    for call in (lambda: ledger_ranges(warehouse), lambda: ledger_ranges(warehouse, 0), lambda: offload_ledgers(warehouse)):
        with pytest.raises(TableMissingError, match="table ledger_entries does not exist yet .*`txnlake ingest FILE`"):
            call()


# Longer than the 32 characters of a string Spark's Delta statistics keep.
LONG_TOPIC = "persistent://public/default/orders-partition-0"


@pytest.mark.parametrize("layout", ["a ledger a file", "ledgers mixed in files"])
def test_ledger_ranges_from_statistics_equal_a_full_scan(warehouse, spark, layout):
    from deltalake import DeltaTable

    from tests.buffer_histories import frame
    from txn_engine.storage.delta_io import DeltaTables, aggregate
    from txn_engine.log.ledgers import RANGES_SCHEMA, ledger_ranges, single_ledger_files
    from txn_engine.core.log_types import LogEntry
    from txn_engine.core.schema import LEDGER_ENTRIES

    def ledger(topic, ledger_id, entry_ids):
        return [LogEntry(topic, ledger_id, k, "DATA") for k in entry_ids]

    # a/1 goes on in a later file; b/7 starts at entry 2 (ranges, not counts from 0).
    files = [ledger("a", 1, range(5)), ledger("a", 2, range(3)), ledger("b", 7, range(2, 6)), ledger(LONG_TOPIC, 3, range(4)),
             ledger("a", 1, range(5, 8))]
    if layout == "ledgers mixed in files":
        files = [[e for f in files[:3] for e in f], files[3], files[4] + ledger("b", 8, range(2))]
    for rows in files:
        warehouse.append(LEDGER_ENTRIES, frame(spark, rows).coalesce(1))

    def full_scan(version):
        rows = DeltaTables(warehouse).dataset(LEDGER_ENTRIES, version).to_table(columns=["topic", "ledger_id", "entry_id"])
        folded = aggregate(rows, ["topic", "ledger_id"], [("entry_id", "min", "first_entry_id"),
                                                          ("entry_id", "max", "last_entry_id"), ("entry_id", "count", "entry_count")])
        return folded.cast(RANGES_SCHEMA).sort_by([("topic", "ascending"), ("ledger_id", "ascending")])

    for version in (*range(len(files)), None):
        assert ledger_ranges(warehouse, version) == full_scan(version), version
    stated, unstated = single_ledger_files(DeltaTable(warehouse.path(LEDGER_ENTRIES)))
    if layout == "a ledger a file":
        # Every file but the long topic's (its statistics are cut short) counted without reading it.
        assert sorted(stated["ledger_id"].to_pylist()) == [1, 1, 2, 7]
        assert unstated.count_rows() == 4
    else:
        # Two files mix ledgers, the third is the long topic's: all read.
        assert stated.num_rows == 0 and unstated.count_rows() == sum(map(len, files))
    assert ledger_ranges(warehouse).to_pylist()[0] == {"topic": "a", "ledger_id": 1, "first_entry_id": 0,
                                                      "last_entry_id": 7, "entry_count": 8}


def test_latest_recorded_state_a_null_time_loses_to_any_timed_one():
    import datetime as dt

    import pyarrow as pa

    from txn_engine.log.ledgers import deleted_by_topic, latest_recorded_states

    t = lambda s: dt.datetime(2026, 1, 1, 0, 0, s, tzinfo=dt.timezone.utc)  # noqa: E731
    log = pa.table({
        "topic": ["a", "a", "a", "a", "b", "b", "c", "c"],
        "ledger_id": [1, 1, 2, 2, 1, 1, 1, 1],
        "state": ["DELETED", "CLOSED", "CLOSED", "OFFLOADED", "CLOSED", "DELETED", "CLOSED", "DELETED"],
        # a/1: the untimed DELETED comes first in the log and still loses; a/2: a tie keeps log order;
        # b/1: the untimed row comes last and loses too; c/1: untimed only, the later row of the log.
        "recorded_at": [None, t(1), t(5), t(5), t(2), None, None, None],
    }, schema=pa.schema([("topic", pa.string()), ("ledger_id", pa.int64()), ("state", pa.string()),
                         ("recorded_at", pa.timestamp("us", "UTC"))]))
    latest = latest_recorded_states(log)
    assert {(r["topic"], r["ledger_id"]): r["state"] for r in latest.to_pylist()} == {
        ("a", 1): "CLOSED", ("a", 2): "OFFLOADED", ("b", 1): "CLOSED", ("c", 1): "DELETED"}
    assert deleted_by_topic(latest) == {"c": {1}}
    assert latest_recorded_states(log.slice(0, 0)).num_rows == 0


def test_catalog_states_open_closed_deleted_then_recorded():
    import pyarrow as pa

    from txn_engine.log.ledgers import FROM_DELETED, catalog_states

    ledgers = pa.table({"topic": ["a", "a", "a", "b"], "ledger_id": [1, 2, 3, 9], "last_entry_id": [4, 5, 6, 7]})
    deleted = pa.table({"topic": ["a", "b"], "ledger_id": [0, 9], "last_entry_id": [3, 8]})
    recorded = pa.table({"topic": ["a", "a", "z"], "ledger_id": [1, 3, 1], "state": ["OFFLOADED", "CLOSED", "CLOSED"]})
    rows = catalog_states(ledgers, recorded, deleted).to_pylist()
    assert [(r["topic"], r["ledger_id"], r["last_entry_id"], r["state"], r[FROM_DELETED]) for r in rows] == [
        ("a", 0, 3, "DELETED", True),  # deleted, no entries left
        ("a", 1, 4, "OFFLOADED", False),  # recorded overrides the derived CLOSED
        ("a", 2, 5, "CLOSED", False),
        ("a", 3, 6, "CLOSED", False),  # the topic's last, recorded CLOSED by the engine's rollover
        ("b", 9, 7, "OPEN", False),  # in deleted_ledgers but still has entries: its entries describe it
    ]  # z/1: recorded only, no entries and not deleted: not a ledger of the catalog
