"""Reading a topic through the hot ledgers and the offload tier, across the gaps filtering leaves."""

from __future__ import annotations

import pytest

from pipelines.cli import main
from tests.offload_history import COMMIT_D, HISTORY, derive_buffer_tables, oracle_read
from tests.rows import write_jsonl
from txn_engine.errors import TableMissingError, TxnlakeError
from txn_engine.ingest import ingest_files
from txn_engine.offload import offload_ledgers
from txn_engine.positions import EARLIEST, Position
from txn_engine.reader import TopicReader


def positions(batch):
    return [(e.ledger_id, e.entry_id, e.tier) for e in batch.entries]


def offload_history(warehouse, tmp_path):
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "h.jsonl", HISTORY))])
    derive_buffer_tables(warehouse)
    offload_ledgers(warehouse)  # ledgers t/1 and u/5 go cold
    return warehouse


@pytest.fixture
def offloaded(prepared):
    return prepared("reader-offloaded", offload_history)


def test_read_across_the_hot_cold_boundary_equals_the_reference(offloaded):
    reader = TopicReader(offloaded)
    got = positions(reader.read("t"))
    assert got == [(1, 0, "cold"), (1, 1, "cold"), (2, 0, "hot"), (2, 1, "hot")]
    assert [(l, e) for l, e, _ in got] == oracle_read(HISTORY, "t")
    assert positions(reader.read("u")) == [(5, 0, "cold"), (5, 1, "cold")] and oracle_read(HISTORY, "u") == [(5, 0), (5, 1)]
    assert positions(reader.read("t", Position(1, 1), 2)) == [(1, 1, "cold"), (2, 0, "hot")]


@pytest.mark.parametrize("start", [Position(1, 2), Position(1, 3), Position(1, 4), Position(1, 99)])
def test_a_filtered_start_position_skips_to_the_next_kept_entry(offloaded, start):
    # 1:2 is aborted data, 1:3 and 1:4 markers, 1:99 past the ledger's end: all start at 2:0.
    batch = TopicReader(offloaded).read("t", start, 1)
    assert positions(batch) == [(2, 0, "hot")]
    assert batch.next_position == Position(2, 1)


def test_reading_batch_by_batch_never_loops(offloaded):
    reader, seen, at = TopicReader(offloaded), [], EARLIEST
    for _ in range(10):
        batch = reader.read("t", at, 1)
        if not batch.entries:
            break
        seen += positions(batch)
        at = batch.next_position
    else:
        pytest.fail(f"reader did not reach the end: {seen}")
    assert seen == positions(reader.read("t"))


def test_offloaded_data_is_not_limited_by_the_max_read_position(offloaded, tmp_path):
    # committed_entries is left as computed before D committed (stable 2:3); the offload decides
    # from ledger_entries, so t/2 and t/3 go cold and are readable past that stale stable position.
    ingest_files(offloaded, [str(write_jsonl(tmp_path / "d.jsonl", COMMIT_D))])
    assert sorted(offload_ledgers(offloaded).offloaded) == [("t", 2), ("t", 3)]
    got = positions(TopicReader(offloaded).read("t", Position(2, 0)))
    assert got == [(2, 0, "cold"), (2, 1, "cold"), (2, 4, "cold"), (3, 0, "cold"), (3, 1, "cold")]
    assert [(l, e) for l, e, _ in positions(TopicReader(offloaded).read("t"))] == oracle_read(HISTORY + COMMIT_D, "t")[:-1]


def test_reader_errors(warehouse):
    with pytest.raises(TableMissingError, match="materialize the transaction buffer"):
        TopicReader(warehouse).read("t")
    with pytest.raises(TxnlakeError, match="must not be negative"):
        TopicReader(warehouse).read("t", EARLIEST, -1)


def test_txnlake_read_and_offload(warehouse_root, warehouse, tmp_path, capsys):
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "h.jsonl", HISTORY))])
    derive_buffer_tables(warehouse)
    assert main(["offload"]) == 0
    out = capsys.readouterr().out
    assert "offloaded t/1" in out and "waiting   t/2: last entry is beyond the stable position" in out
    assert "\ntook " in out and "(catalog " in out and "manifest " in out
    assert main(["read", "t", "--from", "1:2", "--max", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("2:0\thot\ttxn=1:3") and out[1].startswith("2:1\thot") and "continue with --from 2:2" in out[2]
    assert main(["read", "t", "--from", "one"]) == 2
    assert "write it as LEDGER_ID:ENTRY_ID" in capsys.readouterr().err
