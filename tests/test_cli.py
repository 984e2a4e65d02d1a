"""`txnlake` end to end, in-process: generate, ingest, run, sql, offload, read, and its errors."""

from __future__ import annotations

import ast
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipelines.cli import DAGSTER_YAML, PAYLOAD_CHARS, _instance, entry_line, main, payload_text
from txn_engine.core.schema import TABLES

REPO = Path(__file__).resolve().parent.parent


def test_generate_ingest_run_sql_offload_read(warehouse, warehouse_root, tmp_path, capsys, monkeypatch):
    from dagster import AssetKey, DagsterInstance

    from pipelines.definitions import RESOURCES
    from resources.warehouse import WarehouseResource
    from txn_engine.core.positions import ledger_partition_key
    from txn_engine.core.schema import LEDGER_ENTRIES, LEDGERS, OFFLOADED_ENTRIES

    # The warehouse is configured on the resource; the environment names another one. Every
    # command (runs, sql, read, txn, offload) must use the resource's (the sensors take it as a
    # parameter: tests/test_snapshot_assets.py).
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setenv("TXNLAKE_WAREHOUSE", str(elsewhere))
    monkeypatch.setitem(RESOURCES, "warehouse", WarehouseResource(root=str(warehouse_root)))

    data = tmp_path / "demo.jsonl"
    assert main(["generate", "--entries", "3000", "--seed", "3", str(data)]) == 0
    assert data.is_file()
    assert main(["ingest", str(data)]) == 0
    out = capsys.readouterr().out
    assert "rows read" in out and "0 quarantined" in out and str(warehouse_root / "ledger_entries") in out
    assert main(["ingest", str(data)]) == 0  # idempotent
    assert "0 appended, 3000 already present" in capsys.readouterr().out

    assert main(["run"]) == 0
    out = capsys.readouterr().out
    assert "ledgers" in out and "ledger_sizes" in out and "ledger_entries " not in out  # run adds no data
    assert main(["sql", str(REPO / "dbt-free-sql" / "ledger_sizes.sql"), "--limit", "3"]) == 0
    out = capsys.readouterr().out
    assert "reads ledger_entries, ledgers" in out and "pct_of_topic_entries" in out
    # Printed as Spark's show prints it: a header and three rows of the same width, and how many were shown.
    grid = [line for line in out.splitlines() if line.startswith("|")]
    assert len(grid) == 4 and len({len(line) for line in grid}) == 1 and "only showing top 3 rows" in out, out
    assert grid[0].replace(" ", "").split("|")[1:-1] == TABLES["ledger_sizes"].schema.fieldNames()
    assert main(["txn", "list", "--state", "complete_abort"]) == 0  # any case
    out = capsys.readouterr().out
    assert "COMPLETE_ABORT" in out and "COMPLETE_COMMIT" not in out and "\n0 transaction(s)" not in out

    # Offload through Dagster: an unknown ledger is an error; a named one is its partition's run.
    def states():
        return {(r.topic, r.ledger_id): r.state for r in warehouse.read(LEDGERS).collect()}

    instance = DagsterInstance.get()  # the CLI's (DAGSTER_HOME)
    tier_sizes_runs = len(instance.fetch_materializations(AssetKey("tier_sizes"), limit=1000).records)
    assert main(["offload", "999999"]) == 2
    assert "ledger(s) 999999 not in the `ledgers` catalog" in capsys.readouterr().err
    topic, first = min((k for k, s in states().items() if s == "CLOSED"), key=lambda k: k[1])
    assert main(["offload", f"{topic}/{first}"]) == 0  # the partition key, as the UI shows it
    out = capsys.readouterr().out
    assert f"  offloaded {topic}/{first}\n" in out and "offloaded 1 ledger(s)" in out
    assert "check tier_matches_manifest: passed" in out and "FAILED" not in out
    assert all(f"  {t} " in out for t in ("offloaded_entries", "offload_manifest", "ledgers", "ledger_sizes", "tier_sizes"))
    assert states()[(topic, first)] == "OFFLOADED"  # the catalog is refreshed, and the model over it
    assert {r.state for r in warehouse.read("ledger_sizes").where(f"ledger_id = {first}").collect()} == {"OFFLOADED"}
    offloads = instance.fetch_materializations(AssetKey(OFFLOADED_ENTRIES), limit=1000).records
    assert ledger_partition_key(topic, first) in {r.asset_materialization.partition for r in offloads}

    assert len(instance.fetch_materializations(AssetKey("tier_sizes"), limit=1000).records) == tier_sizes_runs + 1
    # The catalog's refresh after the offload is a named job's run, as every CLI run is.
    [refresh] = instance.fetch_materializations(AssetKey("tier_sizes"), limit=1).records
    assert instance.get_run_by_id(refresh.run_id).job_name == "catalog_after_offload"

    # Reading: one line per entry, whatever the payload; an unknown topic is an error naming the known ones.
    assert main(["read", topic, "--max", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[0].startswith(f"{first}:") and "\tcold\t" in lines[0] and lines[2].startswith("-- 2 entries")
    assert main(["read", "no-such-topic"]) == 2
    err = capsys.readouterr().err
    assert "unknown topic 'no-such-topic'" in err and topic in err

    # Offloading it again has nothing to do: it says so, and records nothing.
    runs = len(instance.get_run_records())
    assert main(["offload", str(first)]) == 0
    assert f"already offloaded: {topic}/{first} (OFFLOADED)\nnothing to do" in capsys.readouterr().out
    assert len(instance.get_run_records()) == runs

    # A check that fails (a marker copied into the tier) makes `offload` exit 1.
    marker = warehouse.read(LEDGER_ENTRIES).where(f"ledger_id = {first} AND entry_type != 'DATA'").limit(1)
    warehouse.append(OFFLOADED_ENTRIES, marker)
    assert main(["offload"]) == 1
    out = capsys.readouterr().out
    assert "check tier_holds_only_committed_data: FAILED" in out
    assert not elsewhere.exists()


def test_errors_exit_non_zero_and_write_nothing(spark, warehouse_root, tmp_path, capsys):  # some commands start Spark first
    assert main(["ingest", str(tmp_path / "nope.jsonl")]) == 2
    err = capsys.readouterr().err
    # One line saying what is wrong, and where the run's log is; no Dagster stack traces.
    assert "error: input file" in err and "does not exist; nothing was ingested" in err
    assert "Stack Trace" not in err and "Traceback" not in err and len(err.splitlines()) == 1
    odd = tmp_path / "data.xml"
    odd.write_text("<x/>")
    assert main(["ingest", str(odd)]) == 2
    assert "unknown format" in capsys.readouterr().err
    assert not (warehouse_root / "ledger_entries").exists()
    # JSON objects, none of them a valid entry: everything quarantined, and the command says so and fails.
    from tests.rows import entry, write_jsonl

    bogus = write_jsonl(tmp_path / "bogus.jsonl", [{**entry("t", 1, i), "entry_type": "BOGUS"} for i in range(3)])
    assert main(["ingest", "--quiet", str(bogus)]) == 1
    out, err = capsys.readouterr()
    assert "3 quarantined" in out and "warning: no valid row in the input (3 read, 3 quarantined)" in err
    assert main(["sql", str(tmp_path / "missing.sql")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["txn", "list", "--state", "BOGUS"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "invalid choice: 'BOGUS'" in err and "COMPLETE_ABORT" in err


def test_payloads_print_on_one_line():
    assert payload_text(None) == "" and payload_text(b"order 17: ok") == "order 17: ok"
    assert payload_text("żółw".encode()) == "żółw"
    assert payload_text(b"two\nlines") == r"b'two\nlines'" and payload_text(b"a\tb") == r"b'a\tb'"
    assert payload_text(b"\xff\x00") == r"b'\xff\x00'"
    # A key is escaped too: one entry, one line.
    forged = SimpleNamespace(ledger_id=1, entry_id=0, tier="hot", txn_most_bits=None, txn_least_bits=None,
                             key="k\n2:0\thot", payload=b"p", key_bytes=None, headers=None)
    assert entry_line(forged) == "1:0\thot\ttxn=-\tkey=b'k\\n2:0\\thot'\tp"
    # A key of bytes that are not UTF-8, and headers (a null value as -).
    kafka = SimpleNamespace(**{**vars(forged), "key": None, "key_bytes": b"\xff", "headers": [
        {"key": "h", "value": b""}, {"key": "n", "value": None}]})
    assert entry_line(kafka) == "1:0\thot\ttxn=-\tkey=b'\\xff'\theaders=h=,n=-\tp"
    assert payload_text(b"x" * 100) == "x" * PAYLOAD_CHARS + "..."
    cut = payload_text(bytes(range(200, 256)))  # escapes cut whole, not in half
    assert cut.startswith(r"b'\xc8\xc9") and cut.endswith("'...") and len(cut) <= PAYLOAD_CHARS + 3
    assert bytes(range(200, 256)).startswith(ast.literal_eval(cut[:-3]))


def test_every_command_says_what_it_does_and_what_its_arguments_are():
    import argparse

    from pipelines.cli import build_parser

    def commands(parser, path):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for sub in subs:
            for name, child in sub.choices.items():
                yield from commands(child, f"{path} {name}")
        if not subs:
            yield path, parser

    found = dict(commands(build_parser(), "txnlake"))
    assert {"txnlake run", "txnlake read", "txnlake txn abort"} <= set(found)
    for path, parser in found.items():
        assert parser.description, f"`{path} --help` has no description"
        for action in parser._actions:
            assert action.help, f"`{path} --help`: {action.dest} has no help line"


def test_read_start_positions():
    from pipelines.cli import _attach_positions
    from txn_engine.core.positions import EARLIEST, Position, start_position

    assert _attach_positions(["read", "t", "--from", "-1:-1", "--max", "2"]) == ["read", "t", "--from=-1:-1", "--max", "2"]
    assert _attach_positions(["read", "t", "--from", "3:0", "--max", "-1"]) == ["read", "t", "--from", "3:0", "--max", "-1"]
    assert start_position("earliest") == start_position(" Earliest") == start_position("-1:-1") == EARLIEST
    assert start_position("3:-1") == Position(3, -1) and start_position("3:0") == Position(3, 0)
    for bad, why in [("x", "not a position"), ("3:", "not a position"), ("-5:0", "out of range"), ("3:-2", "out of range")]:
        with pytest.raises(ValueError, match=why):
            start_position(bad)


def test_without_dagster_home_the_cli_keeps_its_runs_in_dot_dagster_home(tmp_path, monkeypatch):
    from assets.partitions import LEDGER_PARTITIONS
    from txn_engine.core.positions import ledger_partition_key

    monkeypatch.delenv("DAGSTER_HOME")
    monkeypatch.chdir(tmp_path)
    instance = _instance()
    home = tmp_path / ".dagster_home"
    assert not instance.is_ephemeral and Path(instance.root_directory) == home
    assert (home / "dagster.yaml").read_text() == DAGSTER_YAML
    assert DAGSTER_YAML.replace("\n", "\\n") in (REPO / "Makefile").read_text()  # what `make` writes there
    instance.add_dynamic_partitions(LEDGER_PARTITIONS.name, [ledger_partition_key("t", 7)])
    assert _instance().get_dynamic_partitions(LEDGER_PARTITIONS.name) == ["t/7"]  # the next command's


def test_a_log_whose_ledgers_are_all_open_gets_its_buffer_tables(warehouse, tmp_path, capsys, monkeypatch):
    """A log's first ledgers are OPEN: `txnlake run` makes them the partitions, so every topic has a
    stable position at once instead of waiting for a ledger to close."""
    from tests.rows import entry, write_jsonl
    from txn_engine.storage.delta_io import DeltaTables
    from txn_engine.core.schema import STABLE_POSITIONS, STABLE_POSITIONS_SCHEMA

    (tmp_path / "dagster_home").mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster_home"))  # no ledger partitions of other tests
    rows = [entry("a", 1, 0), entry("a", 1, 1, txn=(0, 1)), entry("a", 1, 2), entry("b", 2, 0)]
    assert main(["ingest", str(write_jsonl(tmp_path / "open.jsonl", rows))]) == 0
    assert main(["run"]) == 0
    assert "the 2 OPEN ledger(s) added as ledger partitions" in capsys.readouterr().err  # a stage line
    stable = DeltaTables(warehouse).read(STABLE_POSITIONS, STABLE_POSITIONS_SCHEMA).to_pylist()
    assert sorted((r["topic"], r["max_read_ledger_id"], r["max_read_entry_id"], r["ongoing_txn_count"]) for r in stable) == [
        ("a", 1, 0, 1), ("b", 2, 0, 0)]

    # Ledger 1 closes with its transaction still ongoing: `offload 1` runs its partition, which
    # waits; the run fails rather than record it materialized, and the CLI says why it waits.
    from dagster import AssetKey, DagsterInstance
    from txn_engine.core.schema import OFFLOADED_ENTRIES
    assert main(["ingest", str(write_jsonl(tmp_path / "more.jsonl", [entry("a", 3, 0)]))]) == 0
    capsys.readouterr()
    assert main(["offload", "1"]) == 0
    out = capsys.readouterr().out
    assert "  waiting   a/1: last entry is beyond the stable position" in out and "no ledger to offload" in out
    assert not DagsterInstance.get().get_materialized_partitions(AssetKey(OFFLOADED_ENTRIES))


def test_quickstart_is_make_run_in_one_process(warehouse, warehouse_root, tmp_path, capsys):
    """`make run`: every step a named run tagged with its own command line, in this one process;
    the second time over the same warehouse it migrates and finds nothing new to derive."""
    from dagster import DagsterInstance

    from pipelines.runs import COMMAND_TAG
    from txn_engine.core.schema import COMMITTED_ENTRIES, LEDGER_ENTRIES, OFFLOADED_ENTRIES

    demo = tmp_path / "data" / "demo.jsonl"
    spark_conf = os.environ.get("TXNLAKE_SPARK_CONF")
    assert main(["quickstart", "--entries", "1500", "--file", str(demo), "--quiet"]) == 0
    assert os.environ.get("TXNLAKE_SPARK_CONF") == spark_conf  # the demo's settings end with it
    out, err = capsys.readouterr()
    assert "started" not in err and "starting Spark" not in err, err  # --quiet reaches every step
    steps = [line.removeprefix("== txnlake ") for line in out.splitlines() if line.startswith("== txnlake ")]
    assert [s.split()[0] for s in steps] == ["generate", "ingest", "demo", "run", "snapshot", "offload"], steps
    assert "quickstart done in " in out and "6 steps, one process" in out
    runs = DagsterInstance.get().get_run_records()  # this worker's instance: other tests' runs too
    commands = {(r.dagster_run.job_name, r.dagster_run.tags.get(COMMAND_TAG)) for r in runs}
    assert {("ingest", f"txnlake ingest {demo} --quiet"), ("demo", "txnlake demo --quiet"), ("derive_all", "txnlake run --quiet"),
            ("take_snapshots", "txnlake snapshot --quiet"), ("offload", "txnlake offload --quiet")} <= commands
    assert warehouse.read(LEDGER_ENTRIES).count() > 1500 and warehouse.read(COMMITTED_ENTRIES).count()
    assert warehouse.read(OFFLOADED_ENTRIES).count()

    assert main(["quickstart", "--file", str(demo), "--quiet"]) == 0
    out = capsys.readouterr().out
    steps = [line.removeprefix("== txnlake ").split()[0] for line in out.splitlines() if line.startswith("== txnlake ")]
    assert steps == ["migrate", "run", "snapshot", "offload"] and "nothing to do" in out, out


def test_the_demo_session_interprets_expressions_unless_the_user_says_otherwise(monkeypatch):
    from pipelines.cli import _interpret_expressions
    from resources.spark import SMALL_LOG_SPARK_CONF
    from txn_engine.core.settings import conf_from_environment

    monkeypatch.setenv("TXNLAKE_SPARK_CONF", "spark.sql.codegen.wholeStage=true,spark.driver.memory=2g")
    _interpret_expressions("spark.sql.codegen.wholeStage=true,spark.driver.memory=2g")
    conf = conf_from_environment()
    assert conf["spark.sql.codegen.wholeStage"] == "true" and conf["spark.driver.memory"] == "2g"
    assert conf["spark.sql.codegen.factoryMode"] == SMALL_LOG_SPARK_CONF["spark.sql.codegen.factoryMode"]
    monkeypatch.delenv("TXNLAKE_SPARK_CONF")
    _interpret_expressions(None)
    assert conf_from_environment() == SMALL_LOG_SPARK_CONF
