"""Retention: policies, deletion from the hot tables, the abort-set trim, crash recovery."""

from __future__ import annotations

import os
import time
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.offload_history import COMMIT_D, HISTORY, G, derive_buffer_tables, oracle_read
from tests.rows import entry, write_jsonl
from tests.test_offload_property import STEP, build_history
from txn_engine.buffer import kernel
from txn_engine.buffer.refresh import ledger_inventory, refresh_buffer
from txn_engine.buffer.spark_runner import compute_buffer_tables
from txn_engine.tier.consumer import Consumer, ConsumerStateError, TopicDecisions, resumed_decisions
from txn_engine.storage.arrow_frames import arrow_schema
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.producers.engine import Engine
from txn_engine.producers.ledger_writer import RolloverPolicy
from txn_engine.log.ingest import ingest_files
from txn_engine.log.ledgers import current_catalog_table, current_ledger_catalog, record_ledger_states, write_ledger_catalog
from txn_engine.tier.offload import (TierUncommitted, eligibility, eligible_not_offloaded, offload_ledgers, offloaded_ledgers,
                                     tier_uncommitted)
from txn_engine.tier.reader import TopicReader
from pipelines.cli import main
from txn_engine.core.log_types import LogEntry
from txn_engine.tier.retention import (
    AFTER_STATE,
    RetentionPolicy,
    RetentionPolicyError,
    apply_retention,
    ledgers_to_delete,
    parse_bytes,
    parse_duration,
)
from txn_engine.core.positions import EARLIEST, Position
from txn_engine.core.schema import (
    ABORTED_TXNS,
    BUFFER_LEDGER_TXNS,
    BUFFER_LEDGER_TXNS_SCHEMA,
    COMMITTED_ENTRIES,
    DELETED_LEDGERS,
    LEDGERS,
    LEDGERS_SCHEMA,
    LEDGER_ENTRIES,
    LEDGER_ENTRIES_SCHEMA,
    LEDGER_ENTRY_COLUMNS,
    QUARANTINE_ENTRIES,
    RECOVERED_BUFFER_STATE,
    STABLE_POSITIONS,
    TXN_MARKERS,
)
from txn_engine.snapshots.jobs import full_replay_states, recovery_mismatches, write_snapshots
from txn_engine.snapshots.recovery import recover_to_warehouse
from txn_engine.reference.transaction_buffer import TopicTransactionBuffer, replay

# Ledger 4 (hot, OPEN) gets an aborted transaction G and a retried send of t/2:1.
EXTRA = [entry("t", 4, 2, txn=G, payload=b"g-data"), entry("t", 4, 3, "ABORT", txn=G),
         entry("t", 4, 4, producer=1, seq=0, payload=b"t-2-1")]
FULL = HISTORY + COMMIT_D + EXTRA


def ledger_keys(frame, column="ledger_id"):
    return sorted({(r.topic, r[column]) for r in frame.collect()})


def aborts(frame):
    return sorted((r.topic, r.txn_most_bits, r.txn_least_bits, r.abort_ledger_id, r.abort_entry_id) for r in frame.collect())


def read_positions(warehouse, topic):
    return [(e.ledger_id, e.entry_id) for e in TopicReader(warehouse).read(topic).entries]


def offload_full(warehouse, folder):
    ingest_files(warehouse, [str(write_jsonl(folder / "h.jsonl", FULL))])
    refresh_buffer(warehouse, ledger_inventory(warehouse), full=True)  # what `txnlake run` does: retention needs its state
    assert sorted(offload_ledgers(warehouse).offloaded) == [("t", 1), ("t", 2), ("t", 3), ("u", 5)]


@pytest.fixture
def offloaded(prepared):
    return prepared("retention-offloaded", offload_full)


def quarantined(wh):
    return sorted((r.topic, r.ledger_id, r.entry_id, r.rule, r.reason) for r in wh.read(QUARANTINE_ENTRIES).collect())


def test_keep_n_ledgers_deletes_offloaded_ledgers_and_trims_the_abort_set(offloaded, tmp_path):
    wh = offloaded
    assert aborts(wh.read(ABORTED_TXNS)) == [("t", 1, 2, 1, 4), ("t", *G, 4, 3)]
    # Late entries into ledgers that take none: t/2 is OFFLOADED (appended now, the entry would be in
    # no tier once retention deletes the ledger), u/6 recorded CLOSED as the engine does on rollover
    # (immutable, as in BookKeeper). An entry already stored in an offloaded ledger is just present.
    record_ledger_states(wh, [("u", 6, "CLOSED", "rollover: test")])
    entries_before = wh.read(LEDGER_ENTRIES).count()
    late = ingest_files(wh, [str(write_jsonl(tmp_path / "late.jsonl", [
        entry("t", 2, 5, payload=b"late"), entry("u", 6, 2, payload=b"late"), entry("t", 3, 1, payload=b"t-3-1"),
        entry("u", 4, 0, payload=b"early")]))])  # a ledger new to u, before its offloaded u/5
    assert (late.rows_written, late.rows_already_present, late.quarantine_by_rule) == (
        0, 1, {"ledger_offloaded": 1, "ledger_closed": 1, "ledger_before_tier": 1})
    assert wh.read(LEDGER_ENTRIES).count() == entries_before
    assert quarantined(wh) == [
        ("t", 2, 5, "ledger_offloaded", "ledger t/2 is OFFLOADED (recorded in ledger_states): the offload tier holds its "
         "copy and retention deletes its hot rows, so entry 5 appended now would exist nowhere after retention; write the "
         "entry to a new ledger of the topic (a higher ledger_id) and ingest it again"),
        ("u", 4, 0, "ledger_before_tier", "ledger u/4 comes before ledger u/5, which is already offloaded: the topic's "
         "later ledgers were decided (duplicates, late data, stable position) and offloaded or deleted without it, so "
         "entry 0 cannot be put in front of them now; ingest a topic's ledgers before offloading later ones, or write "
         "the entry to a new ledger after u/5 and ingest it again"),
        ("u", 6, 2, "ledger_closed", "ledger u/6 was closed by the transaction engine (recorded CLOSED in ledger_states) "
         "and a closed ledger is immutable, as in BookKeeper: entry 2 cannot be added; write the entry to a new ledger of "
         "the topic (a higher ledger_id) and ingest it again"),
    ]
    before = {t: read_positions(wh, t) for t in ("t", "u")}
    assert before["t"] == oracle_read(FULL, "t")
    catalog_before = {(r.topic, r.ledger_id): r.asDict() for r in current_ledger_catalog(wh).collect()}

    result = apply_retention(wh, RetentionPolicy(keep_ledgers=1))
    # u/6 is not offloaded, so u keeps it and everything after it.
    assert result.deleted == [("t", 1), ("t", 2), ("t", 3), ("u", 5)] and result.finished == []
    assert ledger_keys(wh.read(LEDGER_ENTRIES)) == [("t", 4), ("u", 6), ("u", 7), ("v", 8)]
    assert ledger_keys(wh.read(COMMITTED_ENTRIES)) == [("t", 4), ("u", 7), ("v", 8)]
    assert all(l not in (1, 2, 3, 5) for _, l in ledger_keys(wh.read(TXN_MARKERS)))
    trimmed = aborts(wh.read(ABORTED_TXNS))
    assert trimmed == [("t", *G, 4, 3)]  # B's marker was in the deleted ledger 1

    # The catalog still lists the deleted ledgers, with their last known range and counts.
    catalog = {(r.topic, r.ledger_id): r for r in current_ledger_catalog(wh).collect()}
    assert (catalog[("t", 1)].state, catalog[("t", 1)].first_entry_id, catalog[("t", 1)].last_entry_id,
            catalog[("t", 1)].entry_count) == ("DELETED", 0, 4, 5)
    assert catalog[("u", 6)].state == "CLOSED" and catalog[("t", 4)].state == "OPEN"
    # The offload sensor's decision (the ledgers' ranges by delta-rs) with deleted ledgers equals the
    # one from the whole catalog as Spark derives it.
    whole = eligibility(current_catalog_table(wh), wh.read(STABLE_POSITIONS).toArrow())
    assert eligible_not_offloaded(wh) == sorted(
        set(zip(*(whole.filter(whole["eligible"])[c].to_pylist() for c in ("topic", "ledger_id")))) - offloaded_ledgers(wh))
    # The tier check's kernel decides the tier's transactions with the deleted ledgers' facts from the state.
    assert tier_uncommitted(wh) == TierUncommitted(markers=0, entries_of_aborted_txns=0, entries_of_ongoing_txns=0)
    # deleted_ledgers keeps each one's last catalog row as it was, timestamps included (they go
    # through the driver: Spark hands them over as naive local times).
    for row in wh.read(DELETED_LEDGERS).collect():
        kept = {k: v for k, v in row.asDict().items() if k != "deleted_at"}
        assert kept == {k: catalog_before[(row.topic, row.ledger_id)][k] for k in kept}
        assert row.deleted_at is not None

    # A full recompute over what is left gives the same trimmed abort set, as does the oracle.
    remaining = compute_buffer_tables(wh.read(LEDGER_ENTRIES))
    assert aborts(remaining.aborted_txns) == trimmed
    remaining.unpersist()
    oracle = replay(LogEntry.from_row({**r, "payload": None, "publish_time": None}) for r in FULL)["t"]
    oracle.trim_ledgers([1, 2, 3])
    assert [("t", *txn, *pos) for txn, pos in oracle.aborts.items()] == trimmed

    # Readers see the same log: deleted ledgers from the tier, the rest hot, also after a recompute
    # without the buffer's state (a stateless replay of what is left, where the retried send t/4:4
    # of the deleted t/2:1 is no longer a duplicate in the hot view: the reader's tier guard drops it).
    assert {t: read_positions(wh, t) for t in ("t", "u")} == before
    derive_buffer_tables(wh)
    assert (4, 4) in [(r.ledger_id, r.entry_id) for r in wh.read(COMMITTED_ENTRIES).where("topic = 't'").collect()]
    assert {t: read_positions(wh, t) for t in ("t", "u")} == before

    # Applying the policy again deletes nothing more.
    again = apply_retention(wh, RetentionPolicy(keep_ledgers=1))
    assert again.deleted == [] and again.finished == []

    # Ingesting the whole history again brings no deleted ledger back: their 14 rows are counted
    # apart, the rest is present; a new entry past a deleted ledger's range is quarantined. A re-run
    # adds no duplicate to the quarantine.
    # So is a ledger new to the topic before its deleted ones: the late older ledger of a file that
    # arrived after retention (was: appended, and its data committed by a deleted marker never shown).
    again_file = str(write_jsonl(tmp_path / "again.jsonl", FULL + [entry("t", 1, 5), entry("t", 0, 0)]))
    for _ in range(2):
        summary = ingest_files(wh, [again_file])
        assert (summary.rows_written, summary.rows_in_deleted_ledgers, summary.rows_already_present,
                summary.quarantine_by_rule) == (0, 14, len(FULL) - 14, {"ledger_deleted": 1, "ledger_before_tier": 1})
        assert ledger_keys(wh.read(LEDGER_ENTRIES)) == [("t", 4), ("u", 6), ("u", 7), ("v", 8)]
        assert quarantined(wh)[0][:4] == ("t", 0, 0, "ledger_before_tier")
        assert "ledger t/0 comes before ledger t/3, which is already deleted by retention" in quarantined(wh)[0][4]
        assert quarantined(wh)[1] == (
            "t", 1, 5, "ledger_deleted", "ledger t/1 was deleted by retention (DELETED in ledger_states/deleted_ledgers) "
            "and takes no new entries; entry 5 is outside the range it held (0..4); write the entry to a new ledger of "
            "the topic (a higher ledger_id) and ingest it again")
        assert len(quarantined(wh)) == 5

    # The buffer's state kept the deleted ledgers' facts: the engine's consumer reads as the whole log.
    assert [(e.ledger_id, e.entry_id) for e in Consumer(DeltaTables(wh), "t").read()] == oracle_read(FULL, "t")


def test_the_engines_consumer_reads_deleted_ledgers_as_the_reference_fed_the_whole_log(warehouse, tmp_path):
    """After `txnlake run`, offload and retention, the consumer reads the deleted ledgers from the tier and
    decides the stored ones with the facts the buffer's state kept (was: it replayed only the stored
    ledgers, so it lost the deleted entries, read a retried send as new and late data as an open
    transaction that hid every later entry)."""
    A, B = (1, 1), (1, 2)
    ingested = [  # t: a retried send and A's late data in ledger 2, whose originals / marker are in ledger 1
        entry("t", 1, 0, producer=9, seq=0, payload=b"orig-9-0"), entry("t", 1, 1, txn=A, payload=b"A-data"),
        entry("t", 1, 2, "COMMIT", txn=A),
        entry("t", 2, 0, producer=9, seq=0, payload=b"DUP-9-0"), entry("t", 2, 1, txn=A, payload=b"A-LATE"),
        entry("t", 2, 2, txn=B, payload=b"B-data"), entry("t", 2, 3, "ABORT", txn=B),
        entry("t", 3, 0, payload=b"plain-3-0"), entry("t", 4, 0, payload=b"plain-4-0")]
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "h.jsonl", ingested))])
    with Engine(warehouse, rollover=RolloverPolicy(max_entries=2)) as engine:  # a: a transaction across ledgers
        p = engine.producer("app")
        p.init_transactions()
        p.begin()
        for i in range(3):
            p.send("a", f"T-{i}".encode()).result()
        p.commit()
        for i in range(4):
            engine.send("a", f"plain-{i}".encode()).result()
        before = [(e.position, e.payload) for e in engine.consumer("a").read()]
    assert len(before) == 7
    a_ledgers = sorted({p.ledger_id for p, _ in before})
    refresh_buffer(warehouse, ledger_inventory(warehouse), full=True)
    offload_ledgers(warehouse, [1, *a_ledgers[:-1]])
    assert apply_retention(warehouse, RetentionPolicy(keep_ledgers=1)).deleted == [("a", l) for l in a_ledgers[:-1]] + [("t", 1)]

    tables = DeltaTables(warehouse)
    with Engine(warehouse) as engine:
        assert [(e.position, e.payload) for e in engine.consumer("a").read()] == before
    read = Consumer(tables, "t").read()
    assert [(e.ledger_id, e.entry_id) for e in read] == oracle_read(ingested, "t") == [(1, 0), (1, 1), (3, 0), (4, 0)]
    assert [e.payload for e in read] == [b"orig-9-0", b"A-data", b"plain-3-0", b"plain-4-0"]
    # From a position, and a page at a time, across the tier and the stored ledgers.
    consumer = Consumer(tables, "t", "1:1")
    assert [[str(e.position) for e in consumer.poll(2)] for _ in range(3)] == [["1:1", "3:0"], ["4:0"], []]


def test_a_kept_consumer_feeds_only_what_was_appended_and_builds_again_when_the_log_changed_otherwise(warehouse, tmp_path):
    """A consumer kept between calls (as a Pulsar consumer reads on from its cursor) decides only the
    ledgers that grew since the last call (new ones, the OPEN one it fed last); rows before the last
    entry it fed (files ingested out of order) or retention make it decide the whole log again. Each
    read equals a new consumer's and the reference's."""
    tables, kept = DeltaTables(warehouse), Consumer(DeltaTables(warehouse), "t")
    log = sorted(HISTORY + COMMIT_D, key=lambda r: (r["topic"], r["ledger_id"], r["entry_id"]))
    late = entry("t", 2, 5, producer=1, seq=1, payload=b"t-2-5")  # ledger 2 after ledger 4 was ingested
    ingested: list[dict] = []

    def ingest(name, rows):
        ingested.extend(rows)
        ingest_files(warehouse, [str(write_jsonl(tmp_path / name, rows))])

    def read_as_expected(rebuilds):
        read = [(e.ledger_id, e.entry_id, e.payload) for e in kept.read(EARLIEST)]
        assert read == [(e.ledger_id, e.entry_id, e.payload) for e in Consumer(tables, "t").read()]
        assert [p[:2] for p in read] == oracle_read(sorted(ingested, key=lambda r: (r["ledger_id"], r["entry_id"])), "t")
        assert kept.rebuilds == rebuilds
        return read

    ingest("a.jsonl", [r for r in log if r["ledger_id"] <= 2])
    assert [p[:2] for p in read_as_expected(1)] == [(1, 0), (1, 1), (2, 0), (2, 1)]  # D holds 2:4 back
    assert [str(e.position) for e in kept.poll(3)] == ["1:0", "1:1", "2:0"]
    ingest("b.jsonl", [r for r in log if r["ledger_id"] in (3, 5)])  # appended: fed, not built again
    read_as_expected(1)
    ingest("c.jsonl", [r for r in log if r["ledger_id"] >= 4 and r["ledger_id"] != 5])  # COMMIT D: 2:4 and 3:0 become readable
    assert [p[:2] for p in read_as_expected(1)][-4:] == [(2, 4), (3, 0), (3, 1), (4, 0)]
    assert [str(e.position) for e in kept.poll()] == ["2:1", "2:4", "3:0", "3:1", "4:0"]
    ingest("open.jsonl", [entry("t", 4, 2, payload=b"t-4-2")])  # appended to the OPEN ledger: decided again, not the log
    read_as_expected(1)
    assert [str(e.position) for e in kept.poll()] == ["4:2"]
    ingest("d.jsonl", [late])  # before the last entry fed: built again
    assert (2, 5, b"t-2-5") in read_as_expected(2)
    assert [str(e.position) for e in kept.poll()] == []  # the cursor is past 2:5, as a Pulsar cursor would be
    refresh_buffer(warehouse, ledger_inventory(warehouse), full=True)
    offload_ledgers(warehouse, [1, 2])
    assert ("t", 1) in apply_retention(warehouse, RetentionPolicy(keep_ledgers=1)).deleted
    read_as_expected(3)  # retention since: built again, the deleted ledgers read from the tier
    read_as_expected(3)  # nothing changed: the kept buffer


@settings(max_examples=100, deadline=None, database=None)
@given(steps=st.lists(STEP, min_size=1, max_size=25), deleted=st.integers(0, 6), cut=st.integers(0, 7))
def test_the_consumers_decisions_resumed_after_deleted_ledgers_and_fed_by_pieces_are_the_whole_logs(steps, deleted, cut):
    """The consumer's kernel decisions, resumed from the state's facts of the first ledgers (as the
    buffer's own run writes them: `kernel`) and fed the rest a ledger at a time, a ledger's first
    entries before the whole of it (as a kept consumer feeds an OPEN ledger that grew), read and
    hold the stable position after every feed as the reference fed every ledger up to there:
    transactions still open in the deleted ledgers included, which an offloaded ledger never holds
    (so the tests through the tier never see them)."""
    entries = build_history("h", steps, 100)
    ledgers = sorted({e.ledger_id for e in entries})
    gone_ids = pa.array(ledgers[:min(deleted, len(ledgers) - 1)], pa.int64())
    log = pa.Table.from_pylist([{c: getattr(e, c) for c in LEDGER_ENTRY_COLUMNS} for e in entries],
                               schema=arrow_schema(LEDGER_ENTRIES_SCHEMA))
    in_gone = pc.is_in(log["ledger_id"], gone_ids)
    hot = log.filter(pc.invert(in_gone))
    first_hot = pc.min(hot["ledger_id"]).as_py()
    decisions = TopicDecisions("h")
    if len(gone_ids):
        narrow = kernel.with_row_index(log.filter(in_gone))
        duplicate = kernel.is_duplicate(narrow, kernel.duplicate_positions(narrow))
        gone = {ledger: {"entry_count": sum(e.ledger_id == ledger for e in entries),
                         "last_entry_id": max(e.entry_id for e in entries if e.ledger_id == ledger)}
                for ledger in gone_ids.to_pylist()}
        decisions = resumed_decisions("h", gone, first_hot, kernel.by_ledger_txn(narrow, duplicate),
                                      kernel.sequence_ranges(narrow, duplicate))
    whole = TopicTransactionBuffer("h")
    for e in entries:
        if e.ledger_id < first_hot:
            whole.append(e)
    hot_entries, done = [e for e in entries if e.ledger_id >= first_hot], 0
    for ledger in ledgers[len(gone_ids):]:
        rows = hot.filter(pc.equal(hot["ledger_id"], ledger))
        for piece in sorted({min(cut, rows.num_rows - 1) or rows.num_rows, rows.num_rows}):
            assert decisions.only_appends(rows.slice(0, piece))
            decisions.feed(rows.slice(0, piece))
            while done < len(hot_entries) and hot_entries[done].position <= (ledger, rows["entry_id"][piece - 1].as_py()):
                whole.append(hot_entries[done])
                done += 1
            assert decisions.read_committed(EARLIEST) == [e for e in whole.read_committed(EARLIEST) if e.ledger_id >= first_hot]
            assert decisions.max_read_position == whole.max_read_position
            assert decisions.read_committed(Position(ledger, 1), 2) == [
                e for e in whole.read_committed(Position(ledger, 1)) if e.ledger_id >= first_hot][:2]
    if hot.num_rows > 1:  # a row at or before the last one fed: a kept consumer decides the whole log again
        assert not decisions.only_appends(hot.slice(0, 1))


def data_files_on_disk(wh, table):
    root = wh.path(table)
    return {os.path.join(folder, f) for folder, dirs, files in os.walk(root) if "_delta_log" not in folder
            for f in files if f.endswith(".parquet") and not f.startswith(".")}


def data_files_referenced(wh, table):
    return {os.path.normpath(uri.removeprefix("file://")) for uri in DeltaTable(wh.path(table)).file_uris()}


def test_driver_recovery_selects_topics_in_files_delta_rs_rewrote(offloaded):
    """Retention deletes a small log's rows by delta-rs, which rewrites their files with strings
    stored as string_view (delta-rs 1.6); the snapshot recovery in the driver still selects by
    topic (was: "no kernel matching input types (string, string_view)", and `txnlake snapshot`
    failing from then on). The committed-once check's read by outcome: test_buffer_checks."""
    wh = offloaded
    write_snapshots(wh, ["t", "u"])
    apply_retention(wh, RetentionPolicy(keep_ledgers=1))
    def string_view_files(table):
        return [u for u in DeltaTable(wh.path(table)).file_uris()
                if pq.read_schema(u.removeprefix("file://")).field("topic").type == pa.string_view()]
    assert string_view_files(LEDGER_ENTRIES)  # the case at hand
    assert recover_to_warehouse(wh).path == "driver"
    assert recovery_mismatches(wh.read(RECOVERED_BUFFER_STATE), full_replay_states(wh.read(LEDGER_ENTRIES))).count() == 0


def test_retention_frees_the_disk_of_deleted_ledgers_after_the_file_retention(offloaded):
    wh = offloaded
    tables = (COMMITTED_ENTRIES, TXN_MARKERS, ABORTED_TXNS, LEDGER_ENTRIES)
    for table in tables:
        DeltaTable(wh.path(table)).alter.set_table_properties({"delta.deletedFileRetentionDuration": "interval 2 seconds"})
    before = {t: read_positions(wh, t) for t in ("t", "u")}
    referenced = {table: data_files_referenced(wh, table) for table in tables}

    first = apply_retention(wh, RetentionPolicy(keep_ledgers=1))
    assert first.deleted == [("t", 1), ("t", 2), ("t", 3), ("u", 5)]
    # The files the deletes replaced are younger than the retention: still on disk for readers.
    replaced = {table: referenced[table] - data_files_referenced(wh, table) for table in tables}
    assert replaced[LEDGER_ENTRIES] and replaced[COMMITTED_ENTRIES], replaced
    assert all(replaced[table] <= data_files_on_disk(wh, table) for table in tables)

    time.sleep(2.5)
    second = apply_retention(wh, RetentionPolicy(keep_ledgers=1))  # deletes nothing more, frees the disk
    assert second.deleted == [] and second.files_reclaimed >= sum(len(files) for files in replaced.values())
    for table in tables:
        assert data_files_on_disk(wh, table) == data_files_referenced(wh, table), table
    assert {t: read_positions(wh, t) for t in ("t", "u")} == before


def test_by_default_only_offloaded_ledgers_the_buffer_holds_are_deleted(warehouse, tmp_path, capsys):
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "h.jsonl", HISTORY))])
    assert apply_retention(warehouse, RetentionPolicy(keep_ledgers=0)).deleted == []
    # Not offloaded, when asked; but not before the buffer has run over them (was: deleted, taking
    # along the facts only their rows held: a retried send of them then read as new, data after
    # their markers as an open transaction holding the stable position back for good).
    waiting = apply_retention(warehouse, RetentionPolicy(keep_ledgers=0, require_offloaded=False))
    closed = [("t", 1), ("t", 2), ("t", 3), ("u", 5), ("u", 6)]  # never an OPEN ledger: t/4, u/7 and v/8 stay
    assert (waiting.deleted, waiting.waiting_for_buffer) == ([], closed)
    # The same through the CLI: kept and said why; `--include-not-buffered` would delete them.
    assert main(["retention", "--keep-ledgers", "0", "--include-not-offloaded", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would delete 0 ledger(s)" in out and "kept t/1: the transaction buffer has not run over it yet" in out
    assert main(["retention", "--keep-ledgers", "0", "--include-not-offloaded", "--include-not-buffered", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would delete 5 ledger(s)" in out and "require_buffered=False" in out and "kept " not in out
    refresh_buffer(warehouse, ledger_inventory(warehouse), full=True)
    result = apply_retention(warehouse, RetentionPolicy(keep_ledgers=0, require_offloaded=False))
    assert (result.deleted, result.waiting_for_buffer) == (closed, [])
    assert ledger_keys(warehouse.read(LEDGER_ENTRIES)) == [("t", 4), ("u", 7), ("v", 8)]


def test_the_consumer_refuses_ledgers_deleted_before_the_buffer_held_them(warehouse, tmp_path):
    # Only when retention is told to delete them anyway: nothing recorded whether a later entry
    # repeats a send of theirs, so the engine's consumer refuses, it does not guess.
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "h.jsonl", HISTORY))])
    policy = RetentionPolicy(keep_ledgers=0, require_offloaded=False, require_buffered=False)
    assert apply_retention(warehouse, policy).deleted == [("t", 1), ("t", 2), ("t", 3), ("u", 5), ("u", 6)]
    with pytest.raises(ConsumerStateError, match=r"topic 't': retention deleted ledger\(s\) 1, 2, 3.*`txnlake run`"):
        Consumer(DeltaTables(warehouse), "t").read()


def test_buffer_runs_on_a_catalog_written_before_retention_keep_the_deleted_ledgers_facts(offloaded):
    """Retention run from Dagster leaves the `ledgers` catalog as it was (no `txnlake run` since): a
    buffer run, a backfill of the deleted ledgers' partitions or the sensor's, must not take their
    gone rows for a change (was: "recomputed" from nothing, dropping the facts the state keeps of
    them, and every later run took them for behind)."""
    wh = offloaded
    write_ledger_catalog(wh)  # the catalog before retention
    assert apply_retention(wh, RetentionPolicy(keep_ledgers=1)).deleted == [("t", 1), ("t", 2), ("t", 3), ("u", 5)]
    tables = DeltaTables(wh)

    def state():
        return (sorted(map(str, tables.read(BUFFER_LEDGER_TXNS, BUFFER_LEDGER_TXNS_SCHEMA).to_pylist())),
                {t: read_positions(wh, t) for t in ("t", "u")})

    before = state()
    assert {(r["topic"], r["ledger_id"]) for r in tables.read(LEDGERS, LEDGERS_SCHEMA).to_pylist()
            if r["state"] == "DELETED"} == set()  # stale indeed
    assert {(r["topic"], r["ledger_id"]) for r in ledger_inventory(wh).to_pylist()} == {("t", 4), ("u", 6), ("u", 7), ("v", 8)}
    assert refresh_buffer(wh, ledgers=[1, 2, 5]).ledgers == []  # the deleted partitions, backfilled from the UI
    refresh_buffer(wh, ledgers=[6])
    assert state() == before


def test_crash_after_recording_deleted_is_finished_by_the_next_run(offloaded):
    wh = offloaded

    def crash(step):
        if step == AFTER_STATE:
            raise RuntimeError("crash")

    with pytest.raises(RuntimeError):
        apply_retention(wh, RetentionPolicy(keep_ledgers=3), crash_hook=crash)
    assert ("t", 1) in ledger_keys(wh.read(LEDGER_ENTRIES))  # recorded DELETED, entries still there
    result = apply_retention(wh, RetentionPolicy(max_bytes=10**9))  # a policy that chooses nothing new
    assert result.deleted == [] and result.finished == [("t", 1)]
    assert ("t", 1) not in ledger_keys(wh.read(LEDGER_ENTRIES))
    assert aborts(wh.read(ABORTED_TXNS)) == [("t", *G, 4, 3)]


NOW = datetime(2026, 6, 1, tzinfo=timezone.utc)


def ledger(topic, ledger_id, state="CLOSED", size=10, age_days=0):
    return {"topic": topic, "ledger_id": ledger_id, "state": state, "size_bytes": size,
            "last_publish_time": NOW - timedelta(days=age_days)}


@pytest.mark.parametrize("policy,expected", [
    (RetentionPolicy(keep_ledgers=2), [("a", 1), ("a", 2)]),
    (RetentionPolicy(max_age=timedelta(days=5)), [("a", 1)]),
    (RetentionPolicy(max_bytes=25), [("a", 1), ("a", 2)]),  # 40 bytes hot: drop 10 + 10 to reach 20
    (RetentionPolicy(keep_ledgers=0), [("a", 1), ("a", 2)]),  # a/3 not offloaded: stops there
    (RetentionPolicy(keep_ledgers=0, require_offloaded=False), [("a", 1), ("a", 2), ("a", 3)]),  # never a/4 (OPEN)
])
def test_policies_choose_a_prefix_of_each_topic(policy, expected):
    catalog = [ledger("a", 1, "OFFLOADED", age_days=9), ledger("a", 2, "OFFLOADED", age_days=3),
               ledger("a", 3, age_days=2), ledger("a", 4, "OPEN"), ledger("b", 9, "DELETED"), ledger("b", 10, "OPEN")]
    assert ledgers_to_delete(catalog, policy, NOW, {("a", 1), ("a", 2)}) == expected


@pytest.mark.parametrize("kwargs,message", [
    ({}, "needs a limit"), ({"keep_ledgers": -1}, "keep_ledgers must not be negative"),
    ({"max_age": timedelta(days=-1)}, "max_age must not be negative"),
])
def test_bad_policies_are_clear_errors(kwargs, message):
    with pytest.raises(RetentionPolicyError, match=message):
        RetentionPolicy(**kwargs)


@pytest.mark.parametrize("text,seconds", [("90m", 5400), ("36h", 129600), ("7d", 604800), ("2w", 1209600), ("45", 45)])
def test_ages_parse(text, seconds):
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text,size", [("500", 500), ("10GB", 10**10), ("512MiB", 512 * 2**20), ("1.5kb", 1500)])
def test_sizes_parse(text, size):
    assert parse_bytes(text) == size


def retention_events():
    """deleted_ledgers' materialization count and observations (newest first) in the CLI's Dagster instance."""
    from dagster import AssetKey, DagsterInstance

    instance, key = DagsterInstance.get(), AssetKey(DELETED_LEDGERS)
    return len(instance.fetch_materializations(key, limit=1000).records), instance.fetch_observations(key, limit=1000).records


def test_txnlake_retention_dry_run_then_delete_then_catalog(offloaded, warehouse_root, capsys):
    wh = offloaded
    entries_before = wh.read(LEDGER_ENTRIES).count()

    # Bad limits: a usage error before anything starts, exit 2, nothing deleted.
    for argv, message in [(["--max-age", "a week"], "cannot read 'a week' as an age"),
                          (["--max-bytes", "10 parsecs"], "cannot read '10 parsecs' as a size"),
                          (["--keep-ledgers", "-2"], "--keep-ledgers: must be 0 or more")]:
        with pytest.raises(SystemExit) as exit_:
            main(["retention", *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert wh.read(LEDGER_ENTRIES).count() == entries_before

    # The default policy is 7 days (Kafka's): these ledgers were published on 2026-01-01. A dry run
    # is recorded as an observation of deleted_ledgers, not a materialization: nothing changed.
    events = retention_events()
    assert main(["retention", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "max_age_hours=168.0" in out and "would delete 4 ledger(s)" in out
    materialized, observed = retention_events()
    assert (materialized, len(observed)) == (events[0], len(events[1]) + 1)
    assert observed[0].asset_observation.metadata["ledgers_deleted"].value == ["t/1", "t/2", "t/3", "u/5"]
    assert main(["retention", "--max-age", "36500d"]) == 0  # nothing is that old: nothing new recorded
    assert "nothing to do: no ledger is due under this policy" in capsys.readouterr().out
    materialized, observed = retention_events()
    assert (materialized, len(observed)) == (events[0], len(events[1]) + 2)

    # A dry run says what would go and what it frees, and writes nothing.
    assert main(["retention", "--keep-ledgers", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "max_age_hours" not in out and "keep_ledgers=1" in out
    assert all(f"would delete {k}" in out for k in ("t/1", "t/2", "t/3", "u/5"))
    assert "would delete 4 ledger(s): 14 entries" in out
    assert wh.read(LEDGER_ENTRIES).count() == entries_before and not wh.exists(DELETED_LEDGERS)

    assert main(["retention", "--keep-ledgers", "1"]) == 0
    out = capsys.readouterr().out
    assert "deleted 4 ledger(s): 14 entries" in out and "deleted_ledgers" in out
    assert "VACUUM deleted 0 file(s) from disk" in out  # what the deletes replaced is kept 7 days (Delta's default)
    assert ledger_keys(wh.read(LEDGER_ENTRIES)) == [("t", 4), ("u", 6), ("u", 7), ("v", 8)]
    assert ledger_keys(wh.read(DELETED_LEDGERS)) == [("t", 1), ("t", 2), ("t", 3), ("u", 5)]
    # The `ledgers` table (refreshed by the command) shows them DELETED.
    states = {(r.topic, r.ledger_id): r.state for r in wh.read(LEDGERS).collect()}
    assert [k for k, s in sorted(states.items()) if s == "DELETED"] == [("t", 1), ("t", 2), ("t", 3), ("u", 5)]
    assert main(["retention", "--keep-ledgers", "1"]) == 0
    assert "nothing to do" in capsys.readouterr().out
