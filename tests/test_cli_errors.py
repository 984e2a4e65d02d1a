"""`txnlake`'s errors before the JVM: bad arguments, bad input files and a damaged table log are told
in one line, before Spark starts or a Dagster run is recorded (no `spark` fixture: the fast tier)."""

from __future__ import annotations

import json
import os
import time

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from pipelines.cli import main
from tests.rows import entry, write_jsonl


@pytest.fixture
def no_spark(monkeypatch):
    """Starting a SparkSession fails the test (as the fast tier does), and no Dagster run may be recorded."""
    from dagster import DagsterInstance
    from pyspark.sql import SparkSession

    def refuse(*args, **kwargs):
        raise AssertionError("Spark was started")

    monkeypatch.setattr(SparkSession.Builder, "getOrCreate", refuse)
    instance = DagsterInstance.get()
    runs = len(instance.get_run_records())
    yield
    assert len(instance.get_run_records()) == runs, "a Dagster run was recorded"


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def timed(argv) -> tuple[int, float]:
    started = time.perf_counter()
    code = main(argv)
    return code, time.perf_counter() - started


def test_bad_input_files_fail_at_once(no_spark, warehouse_root, tmp_path, capsys):
    random_parquet = tmp_path / "noise.parquet"
    random_parquet.write_bytes(os.urandom(4096))
    random_jsonl = tmp_path / "noise.jsonl"
    random_jsonl.write_bytes(os.urandom(4096))
    prose = tmp_path / "prose.jsonl"
    prose.write_text("not json\nnor this\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases = {
        tmp_path / "missing.jsonl": "does not exist",
        empty: "is empty",
        random_parquet: "is not a Parquet file",
        random_jsonl: "is not UTF-8 text",
        prose: "is not JSONL",
    }
    for path, message in cases.items():
        code, seconds = timed(["ingest", str(path)])
        line = one_error_line(capsys)
        assert code == 2 and line.startswith("error: ") and message in line and str(path) in line, line
        assert "nothing was ingested" in line and seconds < 1.0, (line, seconds)
    assert not (warehouse_root / "ledger_entries").exists()


def test_bad_arguments_are_usage_errors(no_spark, warehouse_root, capsys):
    for argv, message in [
        (["read", "t", "--max", "-5"], "argument --max: must be 0 or more, got -5"),
        (["retention", "--max-age", "banana"], "argument --max-age: cannot read 'banana' as an age"),
        (["retention", "--max-bytes", "lots"], "argument --max-bytes: cannot read 'lots' as a size"),
        (["retention", "--keep-ledgers", "-1"], "argument --keep-ledgers: must be 0 or more"),
    ]:
        started = time.perf_counter()
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and time.perf_counter() - started < 1.0, err


def test_unknown_topic_is_told_without_spark(no_spark, warehouse_root, capsys):
    assert main(["read", "no-such-topic"]) == 2
    assert "unknown topic 'no-such-topic'; the warehouse has no topic yet" in one_error_line(capsys)


def test_a_damaged_head_commit_names_table_file_and_fix(no_spark, warehouse_root, tmp_path, capsys):
    table = warehouse_root / "ledger_entries"
    rows = pa.table({"topic": ["t"], "ledger_id": [1], "entry_id": [0]})
    write_deltalake(str(table), rows)
    write_deltalake(str(table), rows, mode="append")
    head = table / "_delta_log" / "00000000000000000001.json"
    whole = head.read_bytes()
    head.write_bytes(whole[: len(whole) // 2])  # a crash of the storage, mid-write

    good = write_jsonl(tmp_path / "good.jsonl", [entry("t", 1, 1)])
    assert main(["ingest", str(good)]) == 2
    line = one_error_line(capsys)
    assert "table ledger_entries: its last commit 00000000000000000001.json is cut short" in line
    assert "move that file" in line and "reads as of version 0" in line and "txnlake doctor" in line

    assert main(["doctor"]) == 1
    out, err = capsys.readouterr()
    assert "DAMAGED  ledger_entries" in out and "1 damaged" in out and "00000000000000000001.json" in err
    head.rename(tmp_path / head.name)  # what the message says to do
    assert main(["doctor"]) == 0
    assert "every head commit is whole" in capsys.readouterr().out


def test_a_commit_that_disagrees_with_its_checksum_is_damaged(tmp_path):
    from txn_engine.storage.logs import head_commit_problem

    commit = tmp_path / "00000000000000000003.json"
    text = json.dumps({"commitInfo": {"operation": "WRITE"}}) + "\n"
    commit.write_text(text)
    assert head_commit_problem(commit) is None
    # Hadoop's checksum of other bytes: a commit cut at a line boundary still shows.
    import struct
    import zlib

    crc = b"crc\x00" + struct.pack(">I", 512) + struct.pack(">I", zlib.crc32((text + text).encode()))
    (tmp_path / ".00000000000000000003.json.crc").write_bytes(crc)
    assert "does not match its checksum" in head_commit_problem(commit)


def test_a_local_input_with_executors_on_other_hosts_is_refused(no_spark, warehouse_root, tmp_path, capsys, monkeypatch):
    """Executors of a remote master cannot read a path of this host: refused at once, with the two
    ways out; a `file:` URI (a mount every worker shares) and a local master pass the check."""
    good = write_jsonl(tmp_path / "good.jsonl", [entry("t", 1, 1)])
    monkeypatch.setenv("TXNLAKE_SPARK_MASTER", "spark://10.1.2.3:7077")
    code, seconds = timed(["ingest", str(good)])
    line = one_error_line(capsys)
    assert code == 2 and seconds < 1.0, (line, seconds)
    assert f"input {good} is a path on this host, but the executors of spark://10.1.2.3:7077 run on other hosts" in line
    assert "s3://" in line and f"file://{good}" in line

    from txn_engine.log.input_files import check_input_files

    check_input_files([f"file://{good}"], "spark://10.1.2.3:7077")
    for master in ("local[2]", "spark://127.0.0.1:7077", None):
        check_input_files([str(good)], master)
    monkeypatch.setenv("TXNLAKE_SPARK_MASTER", "spark://10.1.2.3:7077")
    code, _ = timed(["import-kafka", str(tmp_path)])
    assert code == 2 and "is a path on this host, but the executors of spark://10.1.2.3:7077" in one_error_line(capsys)
