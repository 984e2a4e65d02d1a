"""Reading a topic through the hot ledgers and the offload tier, across the gaps filtering leaves."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark.sql import functions as F

from assets.offload import tier_holds_only_committed_data
from pipelines.cli import main
from tests.offload_history import COMMIT_D, HISTORY, derive_buffer_tables, oracle_read
from tests.rows import write_jsonl
from txn_engine.core.errors import TableMissingError, TxnlakeError
from txn_engine.log.ingest import ingest_files
from txn_engine.log.ledgers import write_ledger_catalog
from txn_engine.tier.offload import offload_ledgers
from txn_engine.core.positions import EARLIEST, Position
from txn_engine.storage.arrow_frames import arrow_schema
from txn_engine.tier.reader import SENT_COLUMNS, TopicReader, read_limit, repeated_in_tier, repeated_in_tier_on_spark, views_behind_log


REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(params=["driver", "spark"])
def read_budget(request) -> dict:
    """TopicReader's keyword for each read path: in the process (delta-rs, Arrow), or on Spark."""
    return {} if request.param == "driver" else {"driver_max_bytes": 0}


def positions(batch):
    return [(e.ledger_id, e.entry_id, e.tier) for e in batch.entries]


def offload_history(warehouse, tmp_path):
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "h.jsonl", HISTORY))])
    write_ledger_catalog(warehouse)  # the catalog, then the buffer, as `txnlake run`
    derive_buffer_tables(warehouse)
    offload_ledgers(warehouse)  # ledgers t/1 and u/5 go cold
    return warehouse


@pytest.fixture
def offloaded(prepared):
    return prepared("reader-offloaded", offload_history)


def test_read_across_the_hot_cold_boundary_equals_the_reference(offloaded, read_budget):
    reader = TopicReader(offloaded, **read_budget)
    assert reader.fits_driver("t", EARLIEST, reader.published("t")) == (not read_budget)  # the path asked for
    got = positions(reader.read("t"))
    assert got == [(1, 0, "cold"), (1, 1, "cold"), (2, 0, "hot"), (2, 1, "hot")]
    assert [(l, e) for l, e, _ in got] == oracle_read(HISTORY, "t")
    assert positions(reader.read("u")) == [(5, 0, "cold"), (5, 1, "cold")] and oracle_read(HISTORY, "u") == [(5, 0), (5, 1)]
    assert positions(reader.read("t", Position(1, 1), 2)) == [(1, 1, "cold"), (2, 0, "hot")]


@pytest.mark.parametrize("start", [Position(1, 2), Position(1, 3), Position(1, 4), Position(1, 99)])
def test_a_filtered_start_position_skips_to_the_next_kept_entry(offloaded, start, read_budget):
    # 1:2 is aborted data, 1:3 and 1:4 markers, 1:99 past the ledger's end: all start at 2:0.
    batch = TopicReader(offloaded, **read_budget).read("t", start, 1)
    assert positions(batch) == [(2, 0, "hot")]
    assert batch.next_position == Position(2, 1)


def test_reading_batch_by_batch_never_loops(offloaded, read_budget):
    reader, seen, at = TopicReader(offloaded, **read_budget), [], EARLIEST
    for _ in range(10):
        batch = reader.read("t", at, 1)
        if not batch.entries:
            break
        seen += positions(batch)
        at = batch.next_position
    else:
        pytest.fail(f"reader did not reach the end: {seen}")
    assert seen == positions(reader.read("t"))


# Both read paths at each step (READ_BUDGETS): the steps between the reads are the same for both.
READ_BUDGETS = ({}, {"driver_max_bytes": 0})


def test_no_read_past_the_published_stable_position_in_either_tier(offloaded, tmp_path, dagster_resources, capsys):
    # D commits in ledger 4 and ledger 3 (D's second entry, then plain) is offloaded, decided from
    # ledger_entries, before the buffer's tables catch up (published stable 2:3, D ongoing from 2:4).
    ingest_files(offloaded, [str(write_jsonl(tmp_path / "d.jsonl", COMMIT_D))])
    assert offload_ledgers(offloaded, [3]).offloaded == [("t", 3)]
    # The cold 3:0 would be half of D, and 2:4 skipped for good: both tiers stop at 2:3, as before
    # the offload, and `txnlake read` says the view is behind the log.
    assert main(["read", "t"]) == 0
    out, err = capsys.readouterr()
    assert [line.split("\t")[:2] for line in out.splitlines()] == [
        ["1:0", "cold"], ["1:1", "cold"], ["2:0", "hot"], ["2:1", "hot"], ["-- 4 entries; continue with --from 2:2"]]
    assert "behind the log (ledger_entries reaches 4:1)" in err and "run `txnlake run`" in err
    readers = [TopicReader(offloaded, **budget) for budget in READ_BUDGETS]
    for reader in readers:
        assert positions(reader.read("t")) == [(1, 0, "cold"), (1, 1, "cold"), (2, 0, "hot"), (2, 1, "hot")]
        assert reader.behind_log("u") is None
    # The tier is right, and its check says so although txn_markers does not know D's COMMIT yet.
    check = tier_holds_only_committed_data(**{k: dagster_resources[k] for k in ("spark", "warehouse")})
    assert check.passed, check.metadata
    derive_buffer_tables(offloaded)  # `txnlake run`
    for reader in readers:
        rest = positions(reader.read("t", Position(2, 2)))
        assert rest == [(2, 4, "hot"), (3, 0, "cold"), (3, 1, "cold"), (4, 0, "hot")]
        assert [(1, 0), (1, 1), (2, 0), (2, 1)] + [(l, e) for l, e, _ in rest] == oracle_read(HISTORY + COMMIT_D, "t")
        assert reader.behind_log("t") is None


def test_reader_errors(warehouse):
    with pytest.raises(TableMissingError, match="materialize the transaction buffer"):
        TopicReader(warehouse).read("t")
    with pytest.raises(TxnlakeError, match="must not be negative"):
        TopicReader(warehouse).read("t", EARLIEST, -1)


def test_txnlake_read_and_offload(warehouse_root, warehouse, tmp_path, capsys):
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "h.jsonl", HISTORY))])
    derive_buffer_tables(warehouse)
    assert main(["offload"]) == 0
    out, err = capsys.readouterr()
    assert "offloaded t/1" in out and "waiting   t/2: last entry is beyond the stable position" in out
    assert "behind the log" not in err
    assert "\ntook " in out and "(catalog " in out and "manifest " in out
    assert main(["read", "t", "--from", "1:2", "--max", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("2:0\thot\ttxn=1:3") and out[1].startswith("2:1\thot") and "continue with --from 2:2" in out[2]
    # The same read as a user runs it, in a fresh process (no Spark session until something starts
    # one): `txnlake read` reads in the process without starting a JVM; the same read on Spark
    # starts the session itself (it once failed there, building its columns before any session).
    script = "\n".join([
        "import sys",
        "from pyspark import SparkContext",
        "from pipelines.cli import _open_warehouse, entry_line, main",
        "from txn_engine.core.positions import Position",
        "from txn_engine.tier.reader import TopicReader",
        "assert main(['read', 't', '--from', '1:2', '--max', '2']) == 0",
        "assert main(['sql', 'dbt-free-sql/abort_rates.sql']) == 0",  # a shipped model on small tables: DuckDB
        "assert SparkContext._active_spark_context is None, 'the read or the SQL started a JVM'",
        "batch = TopicReader(_open_warehouse(), driver_max_bytes=0).read('t', Position(1, 2), 2)",
        "print('spark:', *[entry_line(e) for e in batch.entries], sep='\\n')",
    ])
    fresh = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO,
                           env={**os.environ, "TXNLAKE_WAREHOUSE": str(warehouse_root)})
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    in_driver, on_spark = fresh.stdout.split("spark:\n")
    read, sql = in_driver.split("-- abort_rates: reads txn_markers\n")
    assert read.splitlines() == out and on_spark.splitlines() == out[:2]
    assert sql.splitlines()[1].replace(" ", "") == "|topic|ledger_id|decided_txns|aborted_txns|committed_txns|abort_rate|"
    assert main(["read", "t", "--from", "one"]) == 2
    assert "write it as LEDGER_ID:ENTRY_ID" in capsys.readouterr().err
    # Positions as the help writes them: -1:-1 (the beginning) and L:-1 (before ledger L's first entry).
    assert main(["read", "t", "--from", "-1:-1", "--max", "1"]) == 0
    assert capsys.readouterr().out.startswith("1:0\tcold")
    assert main(["read", "t", "--from", "2:-1", "--max", "1"]) == 0
    assert capsys.readouterr().out.startswith("2:0\thot")
    for bad in ("-5:0", "3:-2", "-1:0"):
        assert main(["read", "t", "--from", bad]) == 2
        assert f"--from {bad} is out of range: write it as LEDGER_ID:ENTRY_ID" in capsys.readouterr().err
    # Ingested since the last `txnlake run`: offload decides by the buffer's view and says it is behind.
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "d.jsonl", COMMIT_D))])
    assert views_behind_log(warehouse) == {"t": Position(4, 1)}
    assert main(["offload"]) == 0
    out, err = capsys.readouterr()
    assert "nothing to do: no ledger is CLOSED" in out
    assert "view of 1 topic(s) is behind the log: t (log reaches 4:1)" in err and "run `txnlake run`" in err


def test_the_read_rules_are_one_function_each_run_in_the_driver_or_on_spark(spark):
    """`read_limit` (a pyarrow filter or a Spark column, from one expression) and `repeated_in_tier`
    (Arrow, called by the driver, run by Spark a topic at a time) decide the same rows both ways on
    the same inputs: null epochs, rows without a key, two topics, positions around both limits."""
    rng = random.Random(7)
    maybe = lambda values: rng.choice([None, *values])  # noqa: E731

    def rows(ledgers, n):
        return [(rng.choice(["t", "u"]), maybe([1, 2]), maybe([0, 1]), maybe([0, 1, 2]), rng.choice(ledgers), i)
                for i in range(n)]

    hot, tier = rows([4, 5, 6], 300), rows([1, 2], 120)
    schema = "topic string, producer_id long, producer_epoch int, sequence_id long, ledger_id long, entry_id long"
    frames = [spark.createDataFrame(r, schema) for r in (hot, tier)]
    arrow = [pa.Table.from_pylist([dict(zip(SENT_COLUMNS, r)) for r in t], arrow_schema(spark.createDataFrame([], schema).schema))
             for t in (hot, tier)]

    def by_topic(table):
        return pa.concat_tables([repeated_in_tier(table.filter(pc.equal(table["topic"], t)),
                                                  arrow[1].filter(pc.equal(arrow[1]["topic"], t))) for t in ("t", "u")])

    in_driver = sorted(tuple(r.values()) for r in by_topic(arrow[0]).to_pylist())
    on_spark = sorted(tuple(r) for r in repeated_in_tier_on_spark(*frames).collect())
    assert in_driver == on_spark and 0 < len(in_driver) < len(hot)
    assert any(r[2] is None for r in hot if (r[0], r[4], r[5]) in {(t, l, e) for t, l, e in in_driver})  # a null epoch matched
    for start, stable in [(EARLIEST, Position(5, 100)), (Position(4, 50), Position(6, 200)), (Position(5, 0), Position(4, 10)),
                          (Position(5, 130), Position(5, 130))]:
        driver = sorted(arrow[0].filter(read_limit(pc.field, start, stable))["entry_id"].to_pylist())
        assert driver == sorted(r.entry_id for r in frames[0].where(read_limit(F.col, start, stable)).collect())
        assert driver == [r[5] for r in hot if start <= (r[4], r[5]) <= stable]
