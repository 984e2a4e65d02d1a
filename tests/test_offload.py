"""The filtered offload: eligibility, the filtered copy, the manifest, idempotence, crash recovery."""

from __future__ import annotations

import time

import pytest

from tests.offload_history import COMMIT_D, HISTORY, oracle_read
from tests.rows import entry, write_jsonl
from tests.buffer_histories import planned_joins
from deltalake import DeltaTable
from pyspark.sql import functions as F

from txn_engine.log.ingest import ingest_files
from txn_engine.log.ledgers import current_catalog_table, current_ledger_catalog, entry_size_bytes
from txn_engine.buffer.kernel import TXN_KEY
from txn_engine.buffer.refresh import ledger_inventory, recorded_version_key, refresh_buffer
from txn_engine.buffer.spark_runner import committed_rows, compute_buffer_tables, decide_full
from txn_engine.storage.upkeep import FILE_RETENTION_PROPERTY
from txn_engine.tier.offload import (
    AFTER_ENTRIES,
    AFTER_MANIFEST,
    FROM_BUFFER_STATE,
    FROM_LEDGER_ENTRIES,
    OFFLOAD_STEPS,
    TIER_CLEAN_AT,
    OffloadStateError,
    _recorded_tables,
    _state_version,
    EMPTY_CHECKSUM,
    checksum_of,
    content_checksum,
    offload_ledgers,
)
from txn_engine.storage.delta_io import DeltaTables, delete_ledgers, ledger_predicate
from txn_engine.core.schema import (
    BUFFER_LEDGER_TXNS,
    COMMITTED_ENTRIES,
    LEDGER_ENTRIES,
    LEDGER_ENTRY_COLUMNS,
    LEDGER_STATES_LOG,
    OFFLOAD_MANIFEST,
    OFFLOADED_ENTRIES,
    STABLE_POSITIONS,
    TXN_MARKERS,
)


class Crash(Exception):
    pass


def crash_at(step):
    def hook(at):
        if at == step:
            raise Crash(at)
    return hook


def ingest(warehouse, tmp_path, rows, name="h.jsonl"):
    ingest_files(warehouse, [str(write_jsonl(tmp_path / name, rows))])


@pytest.fixture
def history(prepared):
    """A warehouse holding HISTORY, ingested."""
    return prepared("offload-history", lambda wh, folder: ingest(wh, folder, HISTORY))


def tier_positions(warehouse):
    return sorted((r.topic, r.ledger_id, r.entry_id) for r in warehouse.read(OFFLOADED_ENTRIES).collect())


def manifest_rows(warehouse):
    return {(r.topic, r.ledger_id): r.asDict() for r in warehouse.read(OFFLOAD_MANIFEST).collect()}


def states(warehouse):
    return {(r.topic, r.ledger_id): r.state for r in current_ledger_catalog(warehouse).collect()}


EXPECTED_TIER = [("t", 1, 0), ("t", 1, 1), ("u", 5, 0), ("u", 5, 1)]


def test_eligibility_filtered_copy_and_manifest(history, tmp_path):
    # The decided transactions past the broadcast bound, joined by shuffle, select the same rows:
    # test_the_kernels_decisions_past_the_broadcast_bound_are_joined_by_shuffle.
    warehouse = history
    started = time.perf_counter()
    result = offload_ledgers(warehouse)
    wall = time.perf_counter() - started
    # Where the time went: every step, in order, and together no more than the call took.
    assert list(result.step_seconds) == list(OFFLOAD_STEPS)
    assert all(s > 0 for s in result.step_seconds.values()) and sum(result.step_seconds.values()) <= wall
    assert result.time_spent().startswith(f"{sum(result.step_seconds.values()):.1f} s (catalog ")
    # Ledger 5 ends exactly at its topic's stable position (5:1); ledgers 2 and 3 wait for D.
    assert sorted(result.offloaded) == [("t", 1), ("u", 5)]
    assert set(result.waiting) == {("t", 2), ("t", 3), ("t", 4), ("u", 6), ("u", 7), ("v", 8)}
    assert "beyond the stable position" in result.waiting[("t", 2)]
    assert result.waiting[("v", 8)] == "ledger is OPEN"
    assert tier_positions(warehouse) == EXPECTED_TIER
    payloads = {(r.ledger_id, r.entry_id): bytes(r.payload) for r in warehouse.read(OFFLOADED_ENTRIES).collect()}
    assert payloads[(5, 1)] == b"e-data"  # committed by a marker in a later (hot) ledger
    assert warehouse.path(OFFLOADED_ENTRIES).startswith(str(warehouse.settings.cold_table_path("")).rstrip("/"))

    manifest = manifest_rows(warehouse)
    t1 = manifest[("t", 1)]
    assert (t1["entries_before"], t1["entries_kept"], t1["dropped_markers"], t1["dropped_aborted"],
            t1["dropped_duplicates"], t1["dropped_other"]) == (5, 2, 2, 1, 0, 0)
    assert (t1["bytes_before"], t1["bytes_after"]) == (len(b"t-1-0a-datab-aborted"), len(b"t-1-0a-data"))
    assert (t1["max_read_ledger_id"], t1["max_read_entry_id"]) == (2, 3)
    assert (manifest[("u", 5)]["max_read_ledger_id"], manifest[("u", 5)]["max_read_entry_id"]) == (5, 1)
    assert t1["tier_location"] == warehouse.path(OFFLOADED_ENTRIES)
    assert t1["checksum"] != manifest[("u", 5)]["checksum"]
    got = states(warehouse)
    assert got[("t", 1)] == got[("u", 5)] == "OFFLOADED"
    assert got[("t", 2)] == "CLOSED" and got[("t", 4)] == "OPEN" and got[("v", 8)] == "OPEN"
    # The hot log is untouched by an offload.
    assert warehouse.read(LEDGER_ENTRIES).count() == len(HISTORY)


def test_the_kernels_decisions_past_the_broadcast_bound_are_joined_by_shuffle(history, spark):
    # Deciding from the log, the offload picks the rows the kernel decides visible (`committed_rows`):
    # its decisions are broadcast to the rows below the bound, joined by shuffle past it.
    entries = history.read(LEDGER_ENTRIES).select(*LEDGER_ENTRY_COLUMNS)
    decided = decide_full(entries)
    try:
        below = committed_rows(decided, entries)
        past = committed_rows(decided, entries, broadcast_max_bytes=0)
        # The run's stable positions (a row per topic) always broadcast, then the decisions.
        assert planned_joins(spark, below) == ["BroadcastHashJoin", "BroadcastHashJoin"]
        assert planned_joins(spark, past) == ["BroadcastHashJoin", "SortMergeJoin"]
        by_shuffle = rows_of(past)
        assert by_shuffle == rows_of(below)
        for topic in ("t", "u", "v"):
            readable = sorted((r.ledger_id, r.entry_id) for r in past.where((F.col("topic") == topic) & F.col("in_stable_prefix")).collect())
            assert readable == oracle_read(HISTORY, topic)
    finally:
        decided.unpersist()


def test_checksum_is_the_sum_of_the_row_hashes_in_hex(spark):
    # Summed as two 32-bit halves: the extremes of a signed 64-bit hash, carries across the
    # halves, and a group of only nulls (no kept row: all zeros); shown modulo 2^64 in hex.
    hashes = {"extremes": [-(2**63), 2**63 - 1, -1, 0, 1, 2**32 - 1, -(2**32)],
              "carries": [2**32 - 1] * 5 + [-(2**31) * 2**32] * 3,
              "none": [None, None]}
    frame = spark.createDataFrame([(g, h) for g, values in hashes.items() for h in values], "g string, h long")
    got = {r.g: r.checksum for r in frame.groupBy("g").agg(checksum_of(F.col("h")).alias("checksum")).collect()}
    assert got == {g: f"{sum(h for h in values if h is not None) % 2**64:016x}" for g, values in hashes.items()}
    assert got["none"] == EMPTY_CHECKSUM


def test_manifest_counts_bytes_and_checksum_match_the_tier_rows_as_read_back(history, tmp_path):
    warehouse = history
    # The manifest is counted from the rows as they were written, not read back: check it
    # against the tier's rows, and the "before" figures against the hot ledger's.
    ingest(warehouse, tmp_path, COMMIT_D, "more.jsonl")
    offload_ledgers(warehouse)
    tier = {
        (r.topic, r.ledger_id): (r.n, r.bytes, r.checksum)
        for r in warehouse.read(OFFLOADED_ENTRIES).groupBy("topic", "ledger_id")
        .agg(F.count("*").alias("n"), F.sum(entry_size_bytes()).alias("bytes"), content_checksum().alias("checksum")).collect()
    }
    hot = {
        (r.topic, r.ledger_id): (r.n, r.bytes, r.first, r.last)
        for r in warehouse.read(LEDGER_ENTRIES).groupBy("topic", "ledger_id")
        .agg(F.count("*").alias("n"), F.sum(entry_size_bytes()).alias("bytes"), F.min("entry_id").alias("first"),
             F.max("entry_id").alias("last")).collect()
    }
    manifest = manifest_rows(warehouse)
    assert sorted(manifest) == [("t", 1), ("t", 2), ("t", 3), ("u", 5)]
    for key, m in manifest.items():
        assert (m["entries_kept"], m["bytes_after"], m["checksum"]) == tier[key]
        assert (m["entries_before"], m["bytes_before"], m["first_entry_id"], m["last_entry_id"]) == hot[key]
        assert m["entries_before"] == m["entries_kept"] + m["dropped_markers"] + m["dropped_aborted"] + \
            m["dropped_duplicates"] + m["dropped_other"]


def test_ledgers_become_eligible_when_the_ongoing_transaction_commits(history, tmp_path):
    warehouse = history
    offload_ledgers(warehouse)
    ingest(warehouse, tmp_path, COMMIT_D, "more.jsonl")
    result = offload_ledgers(warehouse)
    assert sorted(result.offloaded) == [("t", 2), ("t", 3)]
    t2 = manifest_rows(warehouse)[("t", 2)]
    assert (t2["entries_kept"], t2["dropped_markers"], t2["dropped_duplicates"]) == (3, 1, 1)
    assert ("t", 2, 3) not in tier_positions(warehouse)  # the retried duplicate stays behind


def rows_of(frame):
    return sorted(tuple(r) for r in frame.collect())


# Topic `w`, the protocol violations the manifest counts apart (the transaction buffer issue's):
# ledger 20: data of G, COMMIT G, late data of G (after its COMMIT, in the marker's ledger), a second
# marker of G (the first wins), data of H, a retried send inside H, ABORT H; ledger 21: late data of G
# again (its COMMIT is in an earlier ledger), a plain entry; ledger 22: plain (the OPEN last ledger).
G_, H_ = (7, 1), (7, 2)
VIOLATIONS = [
    entry("w", 20, 0, txn=G_, producer=3, seq=0, payload=b"g-data"), entry("w", 20, 1, "COMMIT", txn=G_),
    entry("w", 20, 2, txn=G_, producer=3, seq=1, payload=b"g-late"), entry("w", 20, 3, "ABORT", txn=G_),
    entry("w", 20, 4, txn=H_, producer=4, seq=0, payload=b"h-data"),
    entry("w", 20, 5, txn=H_, producer=4, seq=0, payload=b"h-data"), entry("w", 20, 6, "ABORT", txn=H_),
    entry("w", 21, 0, txn=G_, producer=3, seq=2, payload=b"g-later"), entry("w", 21, 1, payload=b"w-21-1"),
    entry("w", 22, 0, payload=b"w-22-0"),
]


def test_facts_come_from_the_buffer_state_when_it_matches_the_log(warehouse, tmp_path):
    ingest(warehouse, tmp_path, HISTORY + COMMIT_D + VIOLATIONS)
    refresh_buffer(warehouse, ledger_inventory(warehouse), full=True)
    entries = warehouse.read(LEDGER_ENTRIES)
    catalog = current_catalog_table(warehouse, entries)
    state_version = _state_version(warehouse, catalog)
    assert state_version == warehouse.version(BUFFER_LEDGER_TXNS)  # the state describes this log
    # The buffer recorded the versions its run left of the tables the offload reads: they are the
    # tables of this log (the kept rows come from committed_entries, eligibility from stable_positions).
    recorded = _recorded_tables(warehouse, state_version)
    assert rows_of(recorded.committed) == rows_of(warehouse.read(COMMITTED_ENTRIES))
    assert recorded.versions == {t: warehouse.version(t) for t in (TXN_MARKERS, COMMITTED_ENTRIES, STABLE_POSITIONS)}
    from_log = compute_buffer_tables(entries)
    assert sorted(tuple(r.values()) for r in recorded.stable_rows) == rows_of(from_log.stable_positions)
    from_log.unpersist()
    # The state's rows of the ledgers asked for, and the markers of their transactions only.
    state, markers = recorded.state_of([("w", 20)])
    assert set(state["ledger_id"].to_pylist()) == {20} and set(state["topic"].to_pylist()) == {"w"}
    txns = {k for k in zip(*(state[c].to_pylist() for c in TXN_KEY)) if k[2] is not None}
    columns = [*TXN_KEY, "outcome", "ledger_id", "entry_id"]
    every_marker = rows_of(warehouse.read(TXN_MARKERS).select(*columns))
    assert sorted(zip(*(markers[c].to_pylist() for c in columns))) == [r for r in every_marker if r[:3] in txns]
    assert 0 < markers.num_rows < len(every_marker)

    by_state = offload_ledgers(warehouse)
    assert (by_state.facts_from, by_state.kept_from) == (FROM_BUFFER_STATE, COMMITTED_ENTRIES)
    assert sorted(by_state.offloaded) == [("t", 1), ("t", 2), ("t", 3), ("u", 5), ("w", 20), ("w", 21)]
    tier, manifest = rows_of(warehouse.read(OFFLOADED_ENTRIES)), manifest_rows(warehouse)
    # Counted by reason from the state: the late data split in ledger 20, whole in 21.
    w20, w21 = manifest[("w", 20)], manifest[("w", 21)]
    assert [w20[c] for c in ("entries_kept", "dropped_markers", "dropped_aborted", "dropped_duplicates", "dropped_other")] == [1, 3, 1, 1, 1]
    assert [w21[c] for c in ("entries_kept", "dropped_other")] == [1, 1]

    # The same offload deciding from the log (no buffer state): the same tier rows and manifest.
    for table in (OFFLOADED_ENTRIES, OFFLOAD_MANIFEST, LEDGER_STATES_LOG, BUFFER_LEDGER_TXNS):
        warehouse.delete(table, "true")
    by_log = offload_ledgers(warehouse)
    assert (by_log.facts_from, by_log.kept_from) == (FROM_LEDGER_ENTRIES, FROM_LEDGER_ENTRIES)
    assert sorted(by_log.offloaded) == sorted(by_state.offloaded)
    assert rows_of(warehouse.read(OFFLOADED_ENTRIES)) == tier
    drop_time = lambda rows: {k: {c: v for c, v in r.items() if c != "offloaded_at"} for k, r in rows.items()}  # noqa: E731
    assert drop_time(manifest_rows(warehouse)) == drop_time(manifest)

    # A ledger the buffer has not processed: the state no longer describes the log.
    refresh_buffer(warehouse, ledger_inventory(warehouse), full=True)
    ingest(warehouse, tmp_path, [entry("u", 9, 0, payload=b"late")], "more.jsonl")
    assert offload_ledgers(warehouse).facts_from == FROM_LEDGER_ENTRIES


def test_offload_twice_leaves_the_same_rows(history, tmp_path):
    warehouse = history
    first = offload_ledgers(warehouse)
    manifest = manifest_rows(warehouse)
    again = offload_ledgers(warehouse, ledger_ids=[1, 5])
    assert again.offloaded == [] and sorted(again.already_offloaded) == [("t", 1), ("u", 5)]
    assert list(again.step_seconds) == ["catalog", "facts", "plan"]  # nothing to copy: no write
    assert tier_positions(warehouse) == EXPECTED_TIER
    assert manifest_rows(warehouse) == manifest
    assert len(first.manifest) == 2


def test_only_the_requested_ledgers_are_offloaded(history, tmp_path):
    warehouse = history
    result = offload_ledgers(warehouse, ledger_ids=[5, 7])
    assert result.offloaded == [("u", 5)] and set(result.waiting) == {("u", 7)}
    assert tier_positions(warehouse) == [("u", 5, 0), ("u", 5, 1)]


def test_crash_between_entries_and_manifest_is_finished_or_rolled_back(history, tmp_path):
    warehouse = history
    with pytest.raises(Crash):
        offload_ledgers(warehouse, crash_hook=crash_at(AFTER_ENTRIES))
    assert tier_positions(warehouse) == EXPECTED_TIER  # the entries are there ...
    assert not warehouse.exists(OFFLOAD_MANIFEST)  # ... without their manifest rows
    assert states(warehouse)[("t", 1)] == "CLOSED"
    # Ledger 5 is gone from the hot log meanwhile, so its orphan rows can only be rolled back.
    warehouse.delete(LEDGER_ENTRIES, "ledger_id = 5")
    result = offload_ledgers(warehouse, ledger_ids=[])
    assert result.finished_orphans == [("t", 1)] and result.rolled_back_orphans == [("u", 5)]
    assert tier_positions(warehouse) == [("t", 1, 0), ("t", 1, 1)]
    assert set(manifest_rows(warehouse)) == {("t", 1)}
    assert states(warehouse)[("t", 1)] == "OFFLOADED"


def test_crash_between_manifest_and_state_is_finished(history, tmp_path):
    warehouse = history
    with pytest.raises(Crash):
        offload_ledgers(warehouse, crash_hook=crash_at(AFTER_MANIFEST))
    assert set(manifest_rows(warehouse)) == {("t", 1), ("u", 5)}
    assert states(warehouse)[("t", 1)] == "CLOSED"
    result = offload_ledgers(warehouse)
    assert sorted(result.states_recorded) == [("t", 1), ("u", 5)] and result.offloaded == []
    assert states(warehouse)[("t", 1)] == states(warehouse)[("u", 5)] == "OFFLOADED"
    assert tier_positions(warehouse) == EXPECTED_TIER


@pytest.mark.parametrize("through_driver", [True, False], ids=["delta-rs", "spark"])
def test_delete_ledgers_removes_exactly_its_pairs_whatever_the_topic_holds(warehouse, through_driver):
    # Spark SQL escapes with a backslash, delta-rs (DataFusion) doubles a quote: each predicate
    # must match exactly its pairs on its own engine, whatever the topic name holds.
    rows = [("it's", 1), ("it's", 2), ("back\\slash", 1), ("plain", 1), ("it", 1)]
    wanted = [("it's", 1), ("back\\slash", 1)]
    frame = warehouse.spark.createDataFrame(rows, "topic string, ledger_id long")
    assert sorted(tuple(r) for r in frame.where(ledger_predicate(wanted)).collect()) == sorted(wanted)
    warehouse.overwrite("pairs", frame)
    delete_ledgers(warehouse, "pairs", wanted, through_driver=through_driver)
    left = [tuple(r) for r in warehouse.read("pairs").collect()]
    assert sorted(left) == sorted(set(rows) - set(wanted))
    delete_ledgers(warehouse, "no_such_table", wanted, through_driver=through_driver)  # nothing there: a no-op


def test_the_orphan_check_reads_the_tier_only_when_it_changed_since_the_last_manifest_commit(history, tmp_path):
    warehouse = history
    assert offload_ledgers(warehouse, ledger_ids=[1]).tier_scanned is False  # no tier yet
    tier_version = warehouse.version(OFFLOADED_ENTRIES)
    assert DeltaTables(warehouse).last_commit(OFFLOAD_MANIFEST)[TIER_CLEAN_AT] == str(tier_version)
    again = offload_ledgers(warehouse, ledger_ids=[5])
    assert again.tier_scanned is False and again.offloaded == [("u", 5)]
    assert offload_ledgers(warehouse).tier_scanned is False  # nothing to do: the tier is unchanged
    # Another writer's tier commit: rows of a ledger with no manifest row (not eligible yet).
    stray = warehouse.read(LEDGER_ENTRIES).where("topic = 'u' AND ledger_id = 7")
    stray.write.format("delta").mode("append").save(warehouse.path(OFFLOADED_ENTRIES))
    found = offload_ledgers(warehouse)
    assert found.tier_scanned is True and found.rolled_back_orphans == [("u", 7)]
    assert tier_positions(warehouse) == EXPECTED_TIER
    # The rollback is a tier commit no manifest commit covers: the tier is read until the next one.
    assert offload_ledgers(warehouse).tier_scanned is True


def test_after_a_crash_between_entries_and_manifest_the_tier_is_read_and_then_clean_again(history, tmp_path):
    warehouse = history
    offload_ledgers(warehouse, ledger_ids=[1])
    with pytest.raises(Crash):
        offload_ledgers(warehouse, ledger_ids=[5], crash_hook=crash_at(AFTER_ENTRIES))
    # The manifest's last commit still says clean at the version before the crashed write.
    recovered = offload_ledgers(warehouse, ledger_ids=[])
    assert recovered.tier_scanned is True and recovered.finished_orphans == [("u", 5)]
    assert set(manifest_rows(warehouse)) == {("t", 1), ("u", 5)} and tier_positions(warehouse) == EXPECTED_TIER
    assert offload_ledgers(warehouse).tier_scanned is False


def test_committed_entries_that_disagree_with_the_buffer_state_are_refused_and_nothing_is_recorded(warehouse, tmp_path):
    ingest(warehouse, tmp_path, HISTORY + COMMIT_D)
    refresh_buffer(warehouse, ledger_inventory(warehouse), full=True)
    # A buffer bug (or a hand edit) in the recorded committed_entries version: ledger 1's commit of A lost.
    warehouse.delete(COMMITTED_ENTRIES, "ledger_id = 1 AND txn_most_bits IS NOT NULL")
    recorded = {k: v for k, v in DeltaTables(warehouse).last_commit(BUFFER_LEDGER_TXNS).items() if k.startswith("txnlake.")}
    recorded[recorded_version_key(COMMITTED_ENTRIES)] = str(warehouse.version(COMMITTED_ENTRIES))
    warehouse.overwrite(BUFFER_LEDGER_TXNS, warehouse.read(BUFFER_LEDGER_TXNS).localCheckpoint(), commit_metadata=recorded)
    with pytest.raises(OffloadStateError, match=r"ledger 1 of topic 't': committed_entries holds 1 .* says 2-2 .*`txnlake run`"):
        offload_ledgers(warehouse)
    assert not warehouse.exists(OFFLOAD_MANIFEST)  # no manifest row: readers still read the hot tables
    assert set(states(warehouse).values()) <= {"OPEN", "CLOSED"}
    # What the message says to do: recompute the buffer, offload again. The tier's rows written
    # before the error have no manifest row; this run finds and rewrites them.
    refresh_buffer(warehouse, ledger_inventory(warehouse), full=True)
    result = offload_ledgers(warehouse)
    assert result.kept_from == COMMITTED_ENTRIES and result.tier_scanned
    assert sorted(result.finished_orphans) == sorted(result.offloaded) == [("t", 1), ("t", 2), ("t", 3), ("u", 5)]
    assert manifest_rows(warehouse)[("t", 1)]["entries_kept"] == 2
    assert ("t", 1, 1) in tier_positions(warehouse)


def test_a_buffer_state_written_by_older_code_is_rebuilt_and_meanwhile_the_log_decides(warehouse, tmp_path):
    ingest(warehouse, tmp_path, HISTORY + COMMIT_D)
    refresh_buffer(warehouse, ledger_inventory(warehouse), full=True)
    # The state as a release before `duplicate_count` wrote it, and without the committed_entries version.
    warehouse.overwrite(BUFFER_LEDGER_TXNS, warehouse.read(BUFFER_LEDGER_TXNS).drop("duplicate_count").localCheckpoint())
    assert offload_ledgers(warehouse, ledger_ids=[1]).facts_from == FROM_LEDGER_ENTRIES
    rebuilt = refresh_buffer(warehouse, ledger_inventory(warehouse))  # incremental asked: a full run instead
    assert rebuilt.full and "duplicate_count" in warehouse.read(BUFFER_LEDGER_TXNS).columns
    again = offload_ledgers(warehouse, ledger_ids=[2])
    assert (again.facts_from, again.kept_from) == (FROM_BUFFER_STATE, COMMITTED_ENTRIES)
    # A state with every column but no recorded versions: the kernel decides the log again.
    warehouse.overwrite(BUFFER_LEDGER_TXNS, warehouse.read(BUFFER_LEDGER_TXNS).localCheckpoint())
    last = offload_ledgers(warehouse)
    assert (last.facts_from, last.kept_from) == (FROM_LEDGER_ENTRIES, FROM_LEDGER_ENTRIES)
    assert sorted(again.offloaded + last.offloaded) == [("t", 2), ("t", 3), ("u", 5)]


def test_the_state_read_after_table_maintenance_still_names_its_committed_entries(warehouse, tmp_path):
    ingest(warehouse, tmp_path, HISTORY + COMMIT_D)
    refresh_buffer(warehouse, ledger_inventory(warehouse), full=True)
    # Files the state no longer references, old enough for VACUUM to delete (as table maintenance does).
    DeltaTable(warehouse.path(BUFFER_LEDGER_TXNS)).alter.set_table_properties({FILE_RETENTION_PROPERTY: "interval 0 seconds"})
    refresh_buffer(warehouse, ledger_inventory(warehouse), full=True)
    recorded = DeltaTables(warehouse).last_commit(BUFFER_LEDGER_TXNS)[recorded_version_key(COMMITTED_ENTRIES)]
    assert DeltaTables(warehouse).vacuum(BUFFER_LEDGER_TXNS)  # two commits, no row changed
    assert DeltaTables(warehouse).last_commit(BUFFER_LEDGER_TXNS)["operation"] == "VACUUM END"
    assert DeltaTables(warehouse).last_rows_commit(BUFFER_LEDGER_TXNS)[recorded_version_key(COMMITTED_ENTRIES)] == recorded
    assert offload_ledgers(warehouse).kept_from == COMMITTED_ENTRIES
