"""Recovery reads only what follows the snapshots: the replay's literal ledger bound reaches the
Delta scan and skips the files of older ledgers, with the recovered state still equal to the full
replay (ledger ids BookKeeper-style: unique across topics, increasing in creation time)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from deltalake import DeltaTable
from pyspark.sql import functions as F

from tests.buffer_histories import frame
from tests.test_snapshot_jobs import assert_all_recover, snapshot
from txn_engine.log.ledgers import record_ledger_states
from txn_engine.core.log_types import LogEntry
from txn_engine.core.schema import LEDGER_ENTRIES
from txn_engine.snapshots.jobs import entries_after_snapshots, entries_without_snapshot
from txn_engine.snapshots.recovery import files_from_ledger
from txn_engine.storage import warehouse as warehouse_module

LEDGER_SIZE = 4


def interleaved_log(topics: list[str], txns: int, first_ledger: int) -> list[list[LogEntry]]:
    """Per topic `txns` aborted transactions (DATA then ABORT), `LEDGER_SIZE` entries a ledger; the
    topics' ledgers are created in turn, so ids are unique and increase with creation time.
    Returned as batches of one ledger per topic, in creation order (as ingest would append them)."""
    n_ledgers = 2 * txns // LEDGER_SIZE
    batches = []
    for rank in range(n_ledgers):
        batch = []
        for t, topic in enumerate(topics):
            ledger = first_ledger + rank * len(topics) + t
            for k in range(LEDGER_SIZE):
                n = rank * LEDGER_SIZE + k
                batch.append(LogEntry(topic, ledger, k, "DATA" if n % 2 == 0 else "ABORT", 7, n // 2))
        batches.append(batch)
    return batches


def test_recovery_reads_only_the_files_after_the_snapshots(warehouse, spark, monkeypatch):
    # A real log has more files than `Warehouse.read` reads as plain Parquet: Delta's reader, with
    # its data skipping, reads this one too.
    monkeypatch.setattr(warehouse_module, "PARQUET_READ_MAX_FILES", 0)
    old = [LogEntry("never", 90, k, "DATA" if k % 2 == 0 else "ABORT", 7, k // 2) for k in range(4)]
    batches = interleaved_log(["a", "b"], txns=12, first_ledger=100)  # 6 batches: ledgers 100..111
    # One Delta file per ingest batch, as appends of a growing log leave them.
    warehouse.overwrite(LEDGER_ENTRIES, frame(spark, old).coalesce(1))
    for batch in batches:
        warehouse.append(LEDGER_ENTRIES, frame(spark, batch).coalesce(1))
    everything = old + [e for b in batches for e in b]
    # Snapshots as of the first four batches (a's max read position in ledger 106, b's in 107).
    snapshot(warehouse, old + [e for b in batches[:4] for e in b], ["a", "b"])
    # a's oldest ledgers deleted since: trimmed from the snapshot's abort set.
    record_ledger_states(warehouse, [("a", 100, "DELETED", "retention"), ("a", 102, "DELETED", "retention")])
    remaining = [e for e in everything if not (e.topic == "a" and e.ledger_id in (100, 102))]
    warehouse.overwrite(LEDGER_ENTRIES, frame(spark, remaining).where("false"),
                        replace_where="topic = 'a' AND ledger_id IN (100, 102)")

    recovered = assert_all_recover(warehouse, remaining, expect_source={"a": "SNAPSHOT", "b": "SNAPSHOT",
                                                                         "never": "FULL_REPLAY"})
    # The replay covers exactly the entries after each max read position.
    assert recovered["a"]["replayed_entries"] == sum(1 for e in remaining if e.topic == "a" and e.ledger_id > 106)
    assert recovered["b"]["replayed_entries"] == sum(1 for e in remaining if e.topic == "b" and e.ledger_id > 107)
    assert recovered["never"]["replayed_entries"] == len(old)

    # The scans as planned, after Delta's data skipping: the replay after the snapshots opens only
    # the files of ledgers >= 106 (a's max read ledger, the lowest), the full replay of "never"
    # only its own file.
    entries = warehouse.read(LEDGER_ENTRIES)
    by_file = entries.groupBy(F.input_file_name().alias("f")).agg(
        F.max("ledger_id").alias("hi"), F.collect_set("topic").alias("topics")).collect()
    assert len(by_file) == 7
    snap = spark.createDataFrame([("a", 106, 3), ("b", 107, 3)], "topic string, _sl long, _se long")
    after = entries_after_snapshots(entries, snap, 106)
    plan = after._jdf.queryExecution().executedPlan().toString()
    assert "ledger_id#" in plan and ">= 106" in plan, plan
    assert set(after.inputFiles()) == {r.f for r in by_file if r.hi >= 106}
    assert set(entries_without_snapshot(entries, ["a", "b"]).inputFiles()) == {
        r.f for r in by_file if "never" in r.topics}
    assert after.count() == sum(recovered[t]["replayed_entries"] for t in ("a", "b"))
    # The driver path (the asset's) prunes the same files through delta-rs.
    pruned = files_from_ledger(DeltaTable(warehouse.path(LEDGER_ENTRIES)), 106)
    assert {Path(f.path).name for f in pruned.get_fragments()} == {
        Path(urlparse(r.f).path).name for r in by_file if r.hi >= 106}


def test_the_log_topics_come_from_a_fresh_catalog_else_from_the_log_batch_by_batch(warehouse, spark):
    from txn_engine.storage.delta_io import DeltaTables
    from txn_engine.log.ledgers import catalog_source_versions, write_ledger_catalog
    from txn_engine.core.schema import DELETED_LEDGERS, DELETED_LEDGERS_SCHEMA, LEDGERS
    from txn_engine.snapshots.recovery import _log_topics

    class Unread:
        def to_pyarrow_dataset(self, **_):
            raise AssertionError("the log's topic column was read")

    def log():
        return DeltaTable(warehouse.path(LEDGER_ENTRIES))

    def materialize_catalog():
        sources = catalog_source_versions(warehouse)
        write_ledger_catalog(warehouse, commit_metadata=sources)

    entries = [LogEntry(t, ledger, k, "DATA") for t, ledger in (("a", 1), ("a", 2), ("b", 3), ("c", 4)) for k in range(2)]
    warehouse.overwrite(LEDGER_ENTRIES, frame(spark, entries))
    assert _log_topics(warehouse, log()) == {"a", "b", "c"}  # no catalog
    materialize_catalog()
    assert _log_topics(warehouse, Unread()) == {"a", "b", "c"}
    # c's only ledger recorded DELETED: the catalog is stale, so the log tells; once the catalog is
    # fresh again, c (DELETED ledgers only) is looked up in its ledger's files, where it still is.
    record_ledger_states(warehouse, [("c", 4, "DELETED", "retention")])
    assert _log_topics(warehouse, log()) == {"a", "b", "c"}
    materialize_catalog()
    assert _log_topics(warehouse, log()) == {"a", "b", "c"}
    # Then its entries go (deleted_ledgers keeps its row, so the catalog still lists it DELETED).
    gone = [{**r, "deleted_at": r["updated_at"]} for r in DeltaTables(warehouse).dataset(LEDGERS).to_table().to_pylist()
            if r["topic"] == "c"]
    DeltaTables(warehouse).append(DELETED_LEDGERS, DELETED_LEDGERS_SCHEMA, gone)
    warehouse.delete(LEDGER_ENTRIES, "topic = 'c'")
    assert _log_topics(warehouse, log()) == {"a", "b"}
    materialize_catalog()
    assert ("c", "DELETED") in {(r["topic"], r["state"]) for r in DeltaTables(warehouse).dataset(LEDGERS).to_table().to_pylist()}
    assert _log_topics(warehouse, log()) == {"a", "b"}
