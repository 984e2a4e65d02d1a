"""`txnlake`: the command line. Each command is a thin shell over txn_engine or a Dagster run."""

from __future__ import annotations

import argparse
import atexit
import functools
import gc
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from pipelines.arguments import non_negative
from pipelines.progress import Console
from pipelines.txn_cli import add_txn_parser, run_txn_command
from txn_engine.core.errors import TxnlakeError

if TYPE_CHECKING:
    import pyarrow as pa


# What `make` writes to DAGSTER_HOME/dagster.yaml (the Makefile's rule): no telemetry; pools of
# one run at a time (the transaction buffer's, `assets.transaction_buffer.POOL`: the daemon queues
# a second buffer run rather than launch it to wait on the buffer lock). Per run, not per step: a
# step's slot is held in the instance and a killed process would leave it taken.
DAGSTER_YAML = ("telemetry:\n  enabled: false\n"
                "concurrency:\n  pools:\n    granularity: run\n    default_limit: 1\n")


def _instance():
    from dagster import DagsterInstance

    # One instance for every command, so that `make ui` shows their runs and the ledger partitions
    # they add persist: DAGSTER_HOME (`make` sets it), else ./.dagster_home, as `make` would.
    home = os.path.abspath(os.environ.get("DAGSTER_HOME") or ".dagster_home")
    os.makedirs(home, exist_ok=True)
    config = os.path.join(home, "dagster.yaml")
    if not os.path.exists(config):
        with open(config, "w") as f:
            f.write(DAGSTER_YAML)
    instance = DagsterInstance.from_config(home)
    ensure_pool_limits(instance)
    return instance


def ensure_pool_limits(instance) -> None:
    """Give txnlake's pools their limit row now (the instance's `default_limit`, 1 in DAGSTER_YAML),
    unless the pool has one already (set by Dagster, or by hand in the UI: kept as it is).

    Dagster 1.13 creates a pool's default limit lazily, in the same daemon pass that reads the limits
    from a list taken before: on a new DAGSTER_HOME the first queued runs of the pool all launch
    together. Cheap (one read of the instance's limit table) and idempotent; `make ui` calls it too.
    """
    from assets.transaction_buffer.tables import POOL

    storage = instance.event_log_storage
    if POOL not in storage.get_concurrency_keys():
        storage.initialize_concurrency_limit_to_default(POOL)


def prepare_instance() -> None:
    """`python -c 'import pipelines.cli as c; c.prepare_instance()'` (make ui): DAGSTER_HOME's
    dagster.yaml if missing, and the pools' limits."""
    _instance()


def _open_warehouse():
    """The warehouse of the configured resources (`pipelines.definitions.RESOURCES`), as every run
    sees it; Spark starts only when something needs it (delta-rs reads need none)."""
    from pipelines.definitions import RESOURCES

    return RESOURCES["warehouse"].open(RESOURCES["spark"].session)


def _stored_warehouse():
    """The configured warehouse as it is stored, an older layout too (`_open_warehouse` refuses
    those, naming `txnlake migrate`): for the commands that migrate it."""
    from pipelines.definitions import RESOURCES
    from txn_engine.storage.warehouse import Warehouse

    return Warehouse(RESOURCES["spark"].session, RESOURCES["warehouse"].settings())


def _run(job_name: str, instance=None, **kwargs):
    """Run the named job of the code location (`pipelines.runs.run_job`) in this process, tagged with
    this command line, its steps told on the console."""
    from pipelines.runs import command_tags, run_job

    return run_job(job_name, instance or _instance(), tags={**command_tags(_command.argv), **kwargs.pop("tags", {})},
                   loggers={"console": _command.console.dagster_logger()}, **kwargs)


class _Command:
    """This command's line (run tags) and console (stage lines), set by `main`."""

    argv: list[str] = []
    console = Console(quiet=True)


_command = _Command()


def _meta(event) -> dict:
    return {k: getattr(v, "value", v) for k, v in event.event_specific_data.materialization.metadata.items()}


def _print_materializations(*results) -> None:
    # A run over a partition range reports each asset once per partition, and several runs may
    # materialize one asset: print each table once, as last written (`dagster/row_count` is the
    # table's). The partitions a buffer run recomputed beside its range carry only their own figures.
    from assets.metadata import ROW_COUNT

    latest = {}
    for result in results:
        for event in result.get_asset_materialization_events():
            mat = event.event_specific_data.materialization
            meta = {k: getattr(v, "value", v) for k, v in mat.metadata.items()}
            if ROW_COUNT in meta:
                latest[mat.asset_key] = meta
    for key, meta in latest.items():
        print(f"  {key.to_user_string():<24} rows={meta[ROW_COUNT]}  {meta.get('table_location', '')}")


def cmd_ingest(args: argparse.Namespace) -> int:
    from txn_engine.log.ingest import gap_warnings

    result = _run("ingest", run_config={"ops": {"ingest_ledger_entries": {"config": {"paths": list(args.paths)}}}})
    meta = _meta(result.get_asset_materialization_events()[0])
    print(
        f"ingested {len(meta['files'])} file(s): {meta['rows_read']} rows read, "
        f"{meta['rows_written']} appended, {meta['rows_already_present']} already present, "
        f"{meta['rows_repeated_in_input']} repeated in input, {meta['rows_quarantined']} quarantined"
        + (f", {meta['rows_in_deleted_ledgers']} of ledgers retention deleted (skipped)" if meta["rows_in_deleted_ledgers"] else "")
    )
    for rule, n in sorted(meta["quarantine_by_rule"].items()):
        print(f"  quarantined {n} x {rule}")
    for line in gap_warnings(meta["entry_id_gaps"]):
        print(line)
    _print_materializations(result)
    valid = meta["rows_written"] + meta["rows_already_present"] + meta["rows_repeated_in_input"] + meta["rows_in_deleted_ledgers"]
    if valid == 0:
        print(f"warning: no valid row in the input ({meta['rows_read']} read, {meta['rows_quarantined']} quarantined): "
              "nothing was added; see quarantine_entries for each row's rule and reason", file=sys.stderr)
        return 1
    return 0


def _check_input_files(args: argparse.Namespace) -> None:
    from txn_engine.core.settings import conf_from_environment
    from txn_engine.log.input_files import check_input_files

    # In Python, before Spark, the warehouse and the run.
    check_input_files(args.paths, conf_from_environment().get("spark.master"))


def cmd_migrate(args: argparse.Namespace) -> int:
    from pipelines.partition_migration import migrate_ledger_partitions
    from txn_engine.storage.migrate import migrate_warehouse

    wh = _stored_warehouse()
    done = migrate_warehouse(wh)
    print("warehouse migrated" if done else "warehouse already current: nothing to migrate")
    partitions = migrate_ledger_partitions(_instance(), wh)
    if partitions.renamed or partitions.dropped:
        for old, new in sorted(partitions.renamed.items()):
            print(f"  ledger partition {old} -> {', '.join(new)}")
        if partitions.dropped:
            print(f"  dropped {len(partitions.dropped)} ledger partition(s) of no ledger in the catalog: "
                  f"{', '.join(partitions.dropped[:10])}{' ...' if len(partitions.dropped) > 10 else ''}")
        print(f"Dagster instance migrated: {len(partitions.renamed)} ledger partition(s) renamed to <topic>/<ledger_id>, "
              f"{partitions.statuses} materialized status(es) carried over")
    else:
        print("Dagster instance already current: no ledger partition keyed by ledger id alone")
    return 0


def cmd_quickstart(args: argparse.Namespace) -> int:
    """`make run`: into an empty warehouse a generated log and the engine's demo workload, then
    every derived table, the snapshots and the offload; one process (one JVM, one import of the
    code location), each step still its own named Dagster run, told as `txnlake STEP`."""
    from txn_engine.core.schema import LEDGER_ENTRIES

    quiet = ["--quiet"] if args.quiet else []
    if _stored_warehouse().exists(LEDGER_ENTRIES):
        steps = [["migrate"]]
    else:
        print(f"empty warehouse: generating {args.entries} demo entries into {args.file}", flush=True)
        Path(args.file).parent.mkdir(parents=True, exist_ok=True)
        steps = [["generate", "--force", "--entries", str(args.entries), "--seed", str(args.seed), args.file, *quiet],
                 ["ingest", args.file, *quiet], ["demo", *quiet]]
    steps += [["run", *quiet], ["snapshot", *quiet], ["offload", *quiet]]
    started = time.monotonic()
    _command.console.close()  # each step's command tells its own stages
    spark_conf = os.environ.get("TXNLAKE_SPARK_CONF")
    if steps[0][0] == "generate":
        _interpret_expressions(spark_conf)
    try:
        for step in steps:
            print(f"\n== txnlake {' '.join(step)}", flush=True)
            code = main(step)
            if code:
                print(f"quickstart stopped: `txnlake {' '.join(step)}` exited {code}", file=sys.stderr)
                return code
    finally:
        if spark_conf is None:
            os.environ.pop("TXNLAKE_SPARK_CONF", None)
        else:
            os.environ["TXNLAKE_SPARK_CONF"] = spark_conf
    print(f"\nquickstart done in {time.monotonic() - started:.0f}s: {len(steps)} steps, one process")
    return 0


def _interpret_expressions(spark_conf: str | None) -> None:
    """The demo's log is small: its session interprets expressions (`SMALL_LOG_SPARK_CONF`) unless
    the user's TXNLAKE_SPARK_CONF says otherwise."""
    from resources.spark import SMALL_LOG_SPARK_CONF
    from txn_engine.core.settings import conf_from_environment

    own = conf_from_environment()
    extra = [f"{k}={v}" for k, v in SMALL_LOG_SPARK_CONF.items() if k not in own]
    os.environ["TXNLAKE_SPARK_CONF"] = ",".join(filter(None, [spark_conf or "", *extra]))


def _check_paths_reach_executors(args: argparse.Namespace) -> None:
    from txn_engine.core.settings import conf_from_environment
    from txn_engine.log.input_files import check_readable_by_executors

    check_readable_by_executors(args.paths, conf_from_environment().get("spark.master"))


def cmd_import_kafka(args: argparse.Namespace) -> int:
    if args.verify:
        from txn_engine.log.kafka_import import verify_against_index

        comparison = verify_against_index(_open_warehouse(), args.paths)
        for name, rows in (("in the .txnindex, not in aborted_txns", comparison.only_in_index),
                           ("in aborted_txns, not in the .txnindex", comparison.only_in_aborted_txns)):
            for topic, producer, first, last in rows:
                print(f"  {name}: {topic} producer {producer} offsets {first}..{last}")
        if comparison.marker_only:
            print(f"  {len(comparison.marker_only)} ABORT marker(s) without data before them: in aborted_txns, never in "
                  "Kafka's index (expected)")
        if comparison.cleaned:
            print(f"  {len(comparison.cleaned)} aborted transaction(s) whose data the log cleaner removed: the index keeps "
                  "their first offset, aborted_txns the marker's (expected)")
        print("aborted_txns matches the .txnindex" if comparison.equal else "aborted_txns differs from the .txnindex")
        return 0 if comparison.equal else 1
    from txn_engine.log.ingest import gap_warnings

    result = _run("import_kafka", run_config={"ops": {"import_kafka_segments": {"config": {"paths": list(args.paths)}}}})
    meta = _meta(result.get_asset_materialization_events()[0])
    print(f"imported {len(meta['files'])} segment(s): {meta['rows_read']} records read, {meta['rows_written']} appended, "
          f"{meta['rows_already_present']} already present, {meta['rows_quarantined']} quarantined")
    for topic, by_status in sorted(meta["partitions"].items()):
        print(f"  {topic}: {sum(by_status.values())} records, {by_status.get('NEW', 0)} appended, "
              f"{by_status.get('PRESENT', 0)} already present, {by_status.get('QUARANTINED', 0)} quarantined")
    for rule, n in sorted(meta["quarantine_by_rule"].items()):
        print(f"  quarantined {n} x {rule}")
    for line in gap_warnings(meta["entry_id_gaps"]):
        print(line)
    _print_materializations(result)
    return 0


def _add_closed_ledger_partitions(instance, wh) -> None:
    """Add the `ledgers` catalog's newly closed ledgers as ledger partitions (what the
    ledgers_closed_sensor does), in ledger order."""
    from assets.transaction_buffer.sensors import closed_ledgers_of
    from assets.partitions import LEDGER_PARTITIONS, refuse_legacy_partitions

    refuse_legacy_partitions(instance)
    new = closed_ledgers_of(wh, instance).new_keys
    if new:
        instance.add_dynamic_partitions(LEDGER_PARTITIONS.name, new)
        _command.console.line(f"{len(new)} newly closed ledger(s) added as ledger partitions")


def _add_open_ledger_partitions(instance, wh) -> list[str]:
    """Add the catalog's OPEN ledgers as ledger partitions, in ledger order; return their keys."""
    from assets.partitions import LEDGER_PARTITIONS, ledger_keys
    from txn_engine.log.ledgers import open_ledgers

    keys = ledger_keys(open_ledgers(wh))
    if keys:
        instance.add_dynamic_partitions(LEDGER_PARTITIONS.name, keys)
        _command.console.line(f"no closed ledger yet: the {len(keys)} OPEN ledger(s) added as ledger partitions")
    return keys


def cmd_run(args: argparse.Namespace) -> int:
    from dagster import AssetKey

    from assets.partitions import LEDGER_PARTITIONS
    from assets.transaction_buffer.sensors import BUFFER_SELECTION, buffer_range_to_run
    from pipelines.definitions import DERIVED_SELECTION, defs, derive_all_pending
    from txn_engine.core.errors import TableMissingError
    from txn_engine.core.schema import LEDGER_ENTRIES, LEDGERS
    from txn_engine.log.ledgers import stale_catalog

    started = time.perf_counter()
    instance, wh = _instance(), _open_warehouse()  # one instance: the partitions added below are the run's
    if not wh.exists(LEDGER_ENTRIES):
        raise TableMissingError(f"table {LEDGER_ENTRIES} does not exist yet at {wh.path(LEDGER_ENTRIES)}: nothing to "
                                "derive from; ingest a ledger file first (`txnlake ingest FILE`)")
    pending = derive_all_pending(wh, instance)
    if not pending:
        print("nothing to do: the `ledgers` catalog is fresh, the transaction buffer holds every ledger at its "
              "current length and every derived table is newer than what it reads (nothing was recorded)")
        return 0
    _command.console.line("to do: " + "; ".join(pending[:3]) + ("; ..." if len(pending) > 3 else ""))
    runs = []
    if stale_catalog(wh) is not None:
        runs.append(_run("ledgers_catalog", instance))
    # The buffer is partitioned by closed ledger: add the newly closed ones, then run the range the
    # buffer needs (incremental; the first run's range is every partition: a full recompute).
    _add_closed_ledger_partitions(instance, wh)
    keys = instance.get_dynamic_partitions(LEDGER_PARTITIONS.name) or _add_open_ledger_partitions(instance, wh)
    graph = defs.resolve_asset_graph()
    rest = DERIVED_SELECTION.resolve(graph) - {AssetKey(LEDGERS)}
    if keys:
        runs.append(_run("derive_all", instance, asset_selection=rest, partition_range=buffer_range_to_run(wh, instance)))
    else:
        _command.console.line("no ledger yet: the transaction buffer tables (and the models reading them) wait for one")
        runs.append(_run("derive_all", instance, asset_selection=rest - BUFFER_SELECTION.downstream().resolve(graph)))
    print(f"done in {time.perf_counter() - started:.1f}s:")
    _print_materializations(*runs)
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    from txn_engine.sql.models import load_model, run_model, run_model_in_driver, runs_in_driver

    model = load_model(args.file)
    _command.console.begin(f"running {model.name}")
    print(f"-- {model.name}: reads {', '.join(model.reads) or 'no table'}")
    wh = _open_warehouse()
    if runs_in_driver(wh, model):  # a shipped model on small tables: DuckDB in this process, no JVM
        print(text_table(run_model_in_driver(wh, model), args.limit), end="")
    else:
        run_model(wh, model).show(args.limit, truncate=False)
    return 0


def text_table(table: pa.Table, limit: int) -> str:
    """The first `limit` rows as Spark's `show(truncate=False)` prints them: a bordered grid,
    NULL for a missing value, and how many rows were shown when there are more."""
    rows = [["NULL" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for v in r.values()]
            for r in table.slice(0, limit).to_pylist()]
    widths = [max([len(name), *(len(r[i]) for r in rows)]) for i, name in enumerate(table.column_names)]
    rule = "+" + "+".join("-" * w for w in widths) + "+"
    line = lambda cells: "|" + "|".join(c.ljust(w) for c, w in zip(cells, widths)) + "|"  # noqa: E731
    out = [rule, line(table.column_names), rule, *map(line, rows), rule]
    if table.num_rows > limit:
        out.append(f"only showing top {limit} row{'s' if limit != 1 else ''}")
    return "\n".join(out) + "\n\n"


def cmd_snapshot(args: argparse.Namespace) -> int:
    from dagster import AssetCheckSeverity

    from assets.snapshots import SnapshotRunConfig, snapshots_pending
    from txn_engine.snapshots.format import SnapshotConfig
    from txn_engine.snapshots.jobs import TriggerConfig

    config = {"force": args.force}
    if args.max_aborts_per_segment is not None:
        config["max_aborts_per_segment"] = args.max_aborts_per_segment
    if args.max_segment_bytes is not None:
        config["max_segment_bytes"] = args.max_segment_bytes
    bounds = SnapshotRunConfig(**config)
    SnapshotConfig(bounds.max_aborts_per_segment, bounds.max_segment_bytes)  # a bad bound fails here, before any run
    if not args.force:
        pending = snapshots_pending(_open_warehouse(), TriggerConfig(bounds.max_changes, bounds.interval_seconds))
        if not pending:
            print("nothing to do: no topic is due for a snapshot (by changes or interval since its last one) and "
                  "nothing the recovery reads changed since the last snapshot run (nothing was recorded; --force "
                  "snapshots anyway)")
            return 0
        _command.console.line("to do: " + "; ".join(pending[:3]))
    result = _run("take_snapshots", run_config={"ops": {"txn_snapshot_segments": {"config": config}}})
    _print_materializations(result)
    failed = False
    for check in result.get_asset_check_evaluations():
        # A warning (the recovery's log moved on during the run) says what it is; only errors fail.
        warning = not check.passed and check.severity == AssetCheckSeverity.WARN
        failed = failed or not (check.passed or warning)
        status = "passed" if check.passed else f"warning: {check.description}" if warning else "FAILED"
        print(f"  check {check.check_name}: {status}")
    return 1 if failed else 0


def cmd_generate(args: argparse.Namespace) -> int:
    from txn_engine.log.generate import generate_ledger_file

    started = time.perf_counter()
    summary = generate_ledger_file(args.out, entries=args.entries, seed=args.seed, topics=args.topics, overwrite=args.force)
    print(f"wrote {args.out} in {time.perf_counter() - started:.1f}s: {summary}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from assets.engine import DEMO_WORKLOAD

    config = {"producers": args.producers, "transactions_per_producer": args.transactions, "seed": args.seed}
    result = _run("demo", run_config={"ops": {DEMO_WORKLOAD: {"config": config}}})
    [event] = result.get_asset_materialization_events()
    print("demo workload through the engine:", _meta(event)["demo_outcome"])
    _print_materializations(result)
    return 0


def cmd_txn(args: argparse.Namespace) -> int:

    return run_txn_command(args)


PAYLOAD_CHARS = 60  # of each payload `txnlake read` prints


def payload_text(payload) -> str:
    """A payload on one line: as text when it is printable UTF-8 (no newline, no tab), else as
    a Python bytes literal (b'...'); at most PAYLOAD_CHARS characters of either, then '...'."""
    if payload is None:
        return ""
    raw = bytes(payload)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and text.isprintable():
        return text if len(text) <= PAYLOAD_CHARS else text[:PAYLOAD_CHARS] + "..."
    # Escaped: cut whole bytes, not an escape sequence in half.
    shown = raw[:PAYLOAD_CHARS]
    while len(repr(shown)) > PAYLOAD_CHARS:
        shown = shown[:-1]
    return repr(shown) + ("..." if len(shown) < len(raw) else "")


def entry_line(e) -> str:
    """One entry of `txnlake read` on one line: position, tier, transaction, key, payload (the key
    escaped as the payload is, so a newline or tab in it cannot start a line that looks like an entry)."""
    txn = "-" if e.txn_most_bits is None else f"{e.txn_most_bits}:{e.txn_least_bits}"
    # A key that is not UTF-8 is in key_bytes (shown as a bytes literal); headers only when there are.
    raw_key = e.key.encode("utf-8", "surrogateescape") if e.key is not None else e.key_bytes
    key = "" if raw_key is None else payload_text(raw_key)
    headers = "" if not e.headers else "\theaders=" + ",".join(
        f"{payload_text(h['key'].encode())}={'-' if h['value'] is None else payload_text(h['value'])}" for h in e.headers)
    return f"{e.ledger_id}:{e.entry_id}\t{e.tier}\ttxn={txn}\tkey={key}{headers}\t{payload_text(e.payload)}"


def cmd_read(args: argparse.Namespace) -> int:
    from txn_engine.core.positions import start_position
    from txn_engine.log.ledgers import known_topics
    from txn_engine.tier.reader import TopicReader

    try:
        start = start_position(args.from_position, "--from")
    except ValueError as exc:
        raise TxnlakeError(str(exc)) from None
    wh = _open_warehouse()
    # An unknown topic is told by delta-rs (the catalog, ledger_entries' statistics), before any read.
    known = known_topics(wh)
    if args.topic not in known:
        listed = ", ".join(sorted(known)[:20]) + (", ..." if len(known) > 20 else "")
        raise TxnlakeError(f"unknown topic {args.topic!r}; the warehouse has "
                           + (f"{len(known)} topic(s): {listed}" if known else "no topic yet (`txnlake ingest FILE`)"))
    reader = TopicReader(wh)
    _command.console.begin(f"reading {args.topic}")
    batch = reader.read(args.topic, start, args.max)
    for e in batch.entries:
        print(entry_line(e))
    nxt = batch.next_position
    print(f"-- {len(batch.entries)} entries" + (f"; continue with --from {nxt}" if nxt else ""))
    behind = reader.behind_log(args.topic)
    if behind is not None:
        print(f"note: the transaction buffer's view of {args.topic!r} is behind the log (ledger_entries reaches "
              f"{behind}): nothing past its last run is readable yet; run `txnlake run`", file=sys.stderr)
    return 0


def _refresh_stale_catalog(instance, wh) -> None:
    """Materialize `ledgers` when it is stale (`txn_engine.log.ledgers.stale_catalog`, the predicate
    `ledgers_closed_sensor` decides with too: missing, or older than what it is derived from, e.g. an
    ingest since the last `txnlake run`), and add its newly closed ledgers as partitions."""
    from txn_engine.log.ledgers import stale_catalog
    from txn_engine.core.schema import LEDGER_ENTRIES

    if not wh.exists(LEDGER_ENTRIES):
        raise wh.missing(LEDGER_ENTRIES)
    if stale_catalog(wh) is not None:
        _print_materializations(_run("ledgers_catalog", instance))
    _add_closed_ledger_partitions(instance, wh)


def cmd_offload(args: argparse.Namespace) -> int:
    from dagster import AssetSelection

    from assets.partitions import LEDGER_PARTITIONS, ledger_keys, partition_spans, refuse_legacy_partitions
    from pipelines.definitions import defs
    from assets.offload import OFFLOAD_REFRESH_JOB
    from txn_engine.core.errors import TableMissingError
    from txn_engine.log.ledgers import catalog_rows
    from txn_engine.tier.offload import OffloadResult, OffloadWaitingError, eligible_not_offloaded
    from txn_engine.core.positions import ledger_of_partition, ledger_partition_key
    from txn_engine.core.schema import LEDGERS, OFFLOAD_MANIFEST, OFFLOADED_ENTRIES, STABLE_POSITIONS

    started = time.perf_counter()
    instance, wh = _instance(), _open_warehouse()
    refuse_legacy_partitions(instance)
    _refresh_stale_catalog(instance, wh)
    waiting: dict[str, str] = {}
    if args.ledgers:
        keys, done = set(), []
        for row in catalog_rows(wh, args.ledgers):
            key = ledger_partition_key(row["topic"], row["ledger_id"])
            if row["state"] == "OPEN":  # not a partition (those are closed ledgers): nothing to run
                waiting[key] = "ledger is OPEN"
            elif row["state"] in ("OFFLOADED", "DELETED"):  # the tier holds it (or retention deleted it)
                done.append(f"{key} ({row['state']})")
            else:
                keys.add(key)
        if done:
            print(f"  already offloaded: {', '.join(done)}")
    else:
        if not wh.exists(STABLE_POSITIONS):
            raise TableMissingError(f"table {STABLE_POSITIONS} does not exist yet at {wh.path(STABLE_POSITIONS)}: which "
                                    "ledgers are eligible depends on it; materialize the transaction buffer first (`txnlake run`).")
        # As the offload sensor chooses: eligible by the stored stable positions, not offloaded yet.
        keys = set(ledger_keys(eligible_not_offloaded(wh)))
    if not keys:
        for key, reason in sorted(waiting.items()):
            print(f"  waiting   {key}: {reason}")
        why = ("every named ledger is offloaded already, or OPEN" if args.ledgers else
               "no ledger is CLOSED, at or below its topic's stable position and not offloaded yet")
        print(f"nothing to do: {why} (nothing was recorded)")
        _note_views_behind(wh)
        return 0
    known = set(instance.get_dynamic_partitions(LEDGER_PARTITIONS.name))
    missing = [k for k in ledger_keys(map(ledger_of_partition, keys)) if k not in known]
    if missing:
        instance.add_dynamic_partitions(LEDGER_PARTITIONS.name, missing)
    # One run per range of ledger partitions; without LEDGER_IDs one range over every eligible
    # ledger (those between that are not are reported waiting, and not recorded as materialized;
    # re-running one is harmless).
    spans = partition_spans(instance.get_dynamic_partitions(LEDGER_PARTITIONS.name), keys, contiguous=bool(args.ledgers))
    runs = []
    for first, last in spans:
        try:
            runs.append(_run("offload", instance, partition_key=first) if first == last
                        else _run("offload", instance, partition_range=(first, last)))
        except OffloadWaitingError as exc:  # every ledger of the range waits: its run failed, recording nothing
            waiting.update(exc.waiting)

    timing = OffloadResult()
    metas = []
    for run in runs:
        [meta] = [{k: getattr(v, "value", v) for k, v in e.event_specific_data.materialization.metadata.items()}
                  for e in run.get_asset_materialization_events()[:1]]  # every partition's has the run's metadata
        metas.append(meta)
        waiting.update(meta["ledgers_waiting"])
        for step, seconds in meta["step_seconds"].items():
            timing.step_seconds[step] = timing.step_seconds.get(step, 0.0) + seconds
    offloaded = [k for m in metas for k in m["ledgers_offloaded"]]
    for key in offloaded:
        print(f"  offloaded {key}")
    for key, reason in sorted(waiting.items()):
        print(f"  waiting   {key}: {reason}")
    recovered = {k: v for m in metas for v in ("finished", "rolled_back") for k in m["recovered"][v]}
    for key, how in sorted(recovered.items()):
        print(f"  recovered {key} ({how.replace('_', ' ')})")
    already = sum(m["ledgers_already_offloaded"] for m in metas)
    savings = {k: sum(m[f"run_{k}"] for m in metas) for k in timing.savings()}  # OffloadResult.savings() names the totals
    if metas:
        print(f"offloaded {len(offloaded)} ledger(s)" + (f" ({already} already were)" if already else "")
              + f", deciding from {metas[-1]['facts_from']}, copying from {metas[-1]['kept_from']}: {savings}")
        print(f"took {timing.time_spent()}")
    else:
        print("no ledger to offload" + ("" if args.ledgers else
              ": none is CLOSED, at or below its topic's stable position and not offloaded yet"))
    # The tier's checks follow the offload outputs: no run evaluated them when there was none, or
    # when each held a waiting ledger (its outputs skipped, see assets.offload.offload_tier).
    if not any(run.get_asset_check_evaluations() for run in runs) and wh.exists(OFFLOAD_MANIFEST):
        checks = AssetSelection.checks_for_assets(OFFLOADED_ENTRIES, OFFLOAD_MANIFEST).resolve_checks(defs.resolve_asset_graph())
        runs.append(_run("offload", instance, asset_selection=set(), asset_check_selection=checks))
    if offloaded or recovered or any(m["recovered"]["states_recorded"] for m in metas):
        # What the offload changed: the catalog's states (OFFLOADED), and the models over it and the tier.
        refreshed = [LEDGERS, "ledger_sizes", *(["tier_sizes"] if wh.exists(OFFLOAD_MANIFEST) else [])]
        runs.append(_run(OFFLOAD_REFRESH_JOB, instance, asset_selection=refreshed))
    _print_materializations(*runs)
    # A check evaluated in several runs: failed when any run failed it.
    checks: dict[str, bool] = {}
    for check in (c for run in runs for c in run.get_asset_check_evaluations()):
        checks[check.check_name] = checks.get(check.check_name, True) and check.passed
    for name, passed in checks.items():
        print(f"  check {name}: {'passed' if passed else 'FAILED'}")
    _note_views_behind(wh)
    print(f"done in {time.perf_counter() - started:.1f}s")
    return 0 if all(checks.values()) else 1


def _note_views_behind(wh) -> None:
    from txn_engine.tier.reader import views_behind_log

    behind = views_behind_log(wh)
    if behind:
        listed = ", ".join(f"{t} (log reaches {p})" for t, p in sorted(behind.items())[:5]) + (", ..." if len(behind) > 5 else "")
        print(f"note: the transaction buffer's view of {len(behind)} topic(s) is behind the log: {listed}; ledgers "
              "past its last run are not eligible until then; run `txnlake run`, then offload again", file=sys.stderr)


def cmd_retention(args: argparse.Namespace) -> int:
    from assets.offload import RetentionConfig
    from txn_engine.tier.retention import DEFAULT_MAX_AGE
    from txn_engine.core.schema import DELETED_LEDGERS

    named = args.max_age is not None or args.max_bytes is not None or args.keep_ledgers is not None
    age = args.max_age if args.max_age is not None else (None if named else DEFAULT_MAX_AGE)
    config = {
        "max_age_hours": None if age is None else age.total_seconds() / 3600,
        "max_bytes": args.max_bytes,
        "keep_ledgers": args.keep_ledgers,
        "require_offloaded": not args.include_not_offloaded,
        "require_buffered": not args.include_not_buffered,
        "dry_run": args.dry_run,
    }
    RetentionConfig(**config).policy()  # bad limits fail here, before any run
    print("retention policy: " + ", ".join(f"{k}={v}" for k, v in config.items() if v is not None), flush=True)
    instance = _instance()
    result = _run("retention", instance, run_config={"ops": {DELETED_LEDGERS: {"config": config}}})
    # A run that deleted something materializes deleted_ledgers; a dry run or one with nothing to
    # delete only observes it (nothing changed).
    materialized = result.get_asset_materialization_events()
    [event] = materialized or result.get_asset_observation_events()
    outcome = event.event_specific_data.materialization if materialized else event.event_specific_data.asset_observation
    meta = {k: getattr(v, "value", v) for k, v in outcome.metadata.items()}
    verb = "would delete" if args.dry_run else "deleted"
    for key in meta["ledgers_deleted"]:
        print(f"  {verb} {key}")
    for key in meta["ledgers_finished"]:
        print(f"  finished the interrupted deletion of {key}")
    for key in meta["ledgers_waiting_for_buffer"]:
        print(f"  kept {key}: the transaction buffer has not run over it yet (run `txnlake run`, then retention again)")
    if not (materialized or args.dry_run):
        print("nothing to do: no ledger is due under this policy (nothing was recorded)")
    else:
        print(f"{verb} {len(meta['ledgers_deleted'])} ledger(s): {meta['entries_freed']} entries, {meta['bytes_freed']} bytes")
    if materialized:
        print(f"VACUUM deleted {meta['files_reclaimed']} file(s) from disk: those earlier deletes replaced, past each "
              "table's delta.deletedFileRetentionDuration (Delta's default: 7 days)")
    _print_materializations(result)  # (none for a dry run)
    if meta["ledgers_deleted"] and not args.dry_run:
        _print_materializations(_run("ledgers_catalog", instance))  # the catalog shows DELETED
    return 0


def _parsed(name: str):
    """An argparse `type` from txn_engine.core.units' parser `name`: a bad value is a usage error
    at once, before anything starts."""

    def parse(text: str):
        from txn_engine.core import units

        try:
            return getattr(units, name)(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="txnlake",
        description="The batch side of a transactional message log: Spark over Delta Lake, run by Dagster.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("ingest", help="validate raw ledger files and append them to ledger_entries",
                       description="Validates raw ledger files (.jsonl, .csv, .parquet) and appends their entries to "
                       "ledger_entries; malformed rows go to quarantine_entries, entries already present are skipped.")
    p.add_argument("paths", nargs="+", metavar="PATH", help=".jsonl, .csv or .parquet files (or folders)")
    _add_quiet(p)
    p.set_defaults(func=cmd_ingest, precheck=_check_input_files)

    p = sub.add_parser("migrate", help="bring a warehouse an older txnlake wrote to the current layout and columns, "
                       "and the Dagster instance's ledger partitions to <topic>/<ledger_id>",
                       description="Moves internal state under <warehouse>/_internal/ and the offload manifest to the "
                       "warehouse root (its checksum in hex); adds the columns the table contract gained (key_bytes, "
                       "headers, timestamp_type empty for stored rows; txn_id from the two halves) and every column's "
                       "description (docs/tables.md). Then renames the Dagster instance's ledger partitions keyed by "
                       "ledger id alone (older releases) to <topic>/<ledger_id>, keeping their materialized status. "
                       "Crash-safe: a rerun finishes; running it again does nothing.")
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("import-kafka", help="import a Kafka log (segments) into ledger_entries",
                       description="Parses Kafka log segments (record batch format v2, every codec, CRC-32C checked) and "
                       "appends their records to ledger_entries as ingest does: a partition is a topic, a segment a "
                       "ledger (docs/kafka-import.md). With --verify, compares aborted_txns (after `txnlake run`) with "
                       "the segments' .txnindex and exits 1 on a difference.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="a Kafka log directory, <topic>-<partition> folders or .log files")
    p.add_argument("--verify", action="store_true", help="compare aborted_txns with the .txnindex instead of importing")
    _add_quiet(p)
    p.set_defaults(func=cmd_import_kafka, precheck=_check_paths_reach_executors)

    p = sub.add_parser("run", help="materialize every derived asset over what the warehouse holds",
                       description="Refreshes the ledgers catalog, then materializes the transaction buffer's tables and "
                       "the SQL models over every ledger the warehouse holds (snapshots, offload and retention have "
                       "their own commands). "
                       "Run it after an ingest: readers see nothing of the new entries before.")
    _add_quiet(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("sql", help="run one SQL model ad hoc and print its result",
                       description="Runs one SQL file over the warehouse's Delta tables (each table by its name) and "
                       "prints its rows.")
    p.add_argument("file", help="a .sql file, e.g. dbt-free-sql/ledger_sizes.sql")
    p.add_argument("--limit", type=non_negative(), default=50, help="rows to print (default 50)")
    p.set_defaults(func=cmd_sql)

    p = sub.add_parser("snapshot", help="take the due transaction-buffer snapshots, compact, recover and check",
                       description="Takes the due transaction-buffer snapshots (multi-part segments), compacts the "
                       "snapshot log, recovers the buffer state from it and checks it against a full replay.")
    p.add_argument("--force", action="store_true", help="snapshot every topic with transactional data")
    p.add_argument("--max-aborts-per-segment", type=int, help="aborts per segment at most (default 100000)")
    p.add_argument("--max-segment-bytes", type=int, help="bytes per segment at most (default 5 MiB)")
    _add_quiet(p)
    p.set_defaults(func=cmd_snapshot)

    p = sub.add_parser("generate", help="write a realistic raw ledger file (deterministic per seed)",
                       description="Writes a raw ledger file to ingest: topics, ledgers, transactions that commit, "
                       "abort or hang, retried sends. The same seed gives the same file.")
    p.add_argument("out", help="output file: .parquet, .jsonl or .csv")
    p.add_argument("--entries", type=int, default=10_000, help="number of entries (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--topics", type=int, default=4, help="number of topics (default 4)")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    _add_quiet(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="run the demo workload through the transaction engine",
                       description="Runs concurrent transactional producers through the transaction engine, which "
                       "writes their entries into the warehouse's ledgers.")
    p.add_argument("--producers", type=int, default=4, help="concurrent producers (default 4)")
    p.add_argument("--transactions", type=int, default=20, help="transactions per producer (default 20)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    _add_quiet(p)
    p.set_defaults(func=cmd_demo)


    p = sub.add_parser("quickstart", help="what `make run` runs: demo data into an empty warehouse, then run, "
                       "snapshot and offload, in one process",
                       description="Into an empty warehouse: generate a demo log, ingest it and run the engine's demo "
                       "workload; into one with data: migrate. Then run, snapshot and offload. Each step is the "
                       "command of that name (its own named Dagster run), all in one process.")
    p.add_argument("--entries", type=non_negative(), default=20_000, help="demo entries to generate (default 20000)")
    p.add_argument("--seed", type=int, default=7, help="random seed of the demo log (default 7)")
    p.add_argument("--file", default="data/demo-ledgers.jsonl", help="where the demo log goes (default data/demo-ledgers.jsonl)")
    _add_quiet(p)
    p.set_defaults(func=cmd_quickstart)

    add_txn_parser(sub, cmd_txn)
    p = sub.add_parser("read", help="read a topic from a position, hot ledgers and offload tier together",
                       description="Prints one line per entry: position, tier, transaction, key, payload. A payload "
                       "prints as text when it is printable UTF-8 (no newline or tab), otherwise as a Python bytes "
                       f"literal (b'...'); either is cut at {PAYLOAD_CHARS} characters, then '...'.")
    p.add_argument("topic", help="the topic (partition) to read, e.g. orders-partition-0")
    p.add_argument("--from", dest="from_position", default="earliest", metavar="L:E",
                   help="start position, inclusive: L:E, L:-1 (before ledger L's first entry) or earliest (-1:-1, the "
                   "default); a filtered-out position starts at the next entry")
    p.add_argument("--max", type=non_negative(), default=None, metavar="N", help="at most N entries (default all)")
    p.set_defaults(func=cmd_read)

    p = sub.add_parser("offload", help="copy eligible CLOSED ledgers to the filtered offload tier (a Dagster run)",
                       description="Materializes offloaded_entries and offload_manifest for the ledger partitions "
                       "(LEDGERs, else every eligible ledger) with their checks, then refreshes ledgers, ledger_sizes "
                       "and tier_sizes. Exit 1 when a check fails, 2 on an error.")
    p.add_argument("ledgers", nargs="*", type=_ledger_argument, metavar="LEDGER",
                   help="only these ledgers: TOPIC/LEDGER_ID (a partition key, as the UI shows it) or LEDGER_ID (that "
                        "ledger of every topic); default: every eligible one")
    _add_quiet(p)
    p.set_defaults(func=cmd_offload)

    p = sub.add_parser("retention", help="delete old ledgers from the hot tables (by default only offloaded ones)",
                       description="A ledger goes when any given limit says so; per topic the oldest go first and "
                       "deletion stops at the first ledger that stays. Without a limit: --max-age 7d (Kafka's default).")
    p.add_argument("--max-age", metavar="AGE", type=_parsed("parse_duration"), help="delete ledgers whose last entry is older, e.g. 7d, 36h, 90m")
    p.add_argument("--max-bytes", metavar="SIZE", type=_parsed("parse_bytes"), help="per topic, delete the oldest while the hot ledgers hold more, e.g. 10GB")
    p.add_argument("--keep-ledgers", type=non_negative(), metavar="N", help="per topic, keep the newest N ledgers")
    p.add_argument("--include-not-offloaded", action="store_true",
                   help="also delete CLOSED ledgers the tier does not hold (their data is then gone)")
    p.add_argument("--include-not-buffered", action="store_true",
                   help="also delete ledgers the transaction buffer has not run over (their markers and sequence ids "
                   "are then gone: a later retry reads as new, a later part of their transactions as open, holding "
                   "the stable position back); run `txnlake run` first instead")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted; write nothing")
    _add_quiet(p)
    p.set_defaults(func=cmd_retention)

    p = sub.add_parser("doctor", help="check every table's Delta log (is each head commit whole?)",
                       description="Reads the last commit file of every table's _delta_log (no Spark) and names any "
                       "that is cut short or damaged, with what to do. Exit 1 when one is.")
    p.set_defaults(func=cmd_doctor)
    return parser


def _ledger_argument(text: str) -> int | tuple[str, int]:
    """A ledger on the command line: LEDGER_ID, or TOPIC/LEDGER_ID (a ledger partition key)."""
    from txn_engine.core.positions import ledger_of_partition

    if text.isdigit():
        return int(text)
    try:
        return ledger_of_partition(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; or a bare LEDGER_ID for that ledger of every topic") from None


def _add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", "-q", action="store_true",
                   help="print no progress (stage lines on stderr); results and errors still print")


def _attach_positions(argv: Sequence[str]) -> list[str]:
    """`--from -1:-1` as `--from=-1:-1`: argparse takes a value starting with '-' for an option (it
    knows only plain negative numbers), and no option holds a ':'."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] == "--from" and arg.startswith("-") and ":" in arg:
            out[-1] = f"--from={arg}"
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(_attach_positions(argv))
    if getattr(args, "precheck", None):
        try:
            args.precheck(args)  # in milliseconds, before anything starts
        except TxnlakeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    _wind_down_arrow_scans_at_exit()
    return _main(args, argv)


@functools.cache
def _wind_down_arrow_scans_at_exit() -> None:
    """pyarrow's dataset scans can leave reader threads running a moment after they return; one
    still running when the interpreter finalizes aborts the process ("terminate called without an
    active exception", exit 134; apache/arrow#39862, #34314): `txnlake offload` ended so in 4 of 8
    runs on the demo warehouse (its work all done and committed). At exit, once (atexit runs
    before finalization), their objects are collected and their threads get that moment while
    Arrow is still alive; not after every command, which a process running many pays each time."""
    atexit.register(_let_arrow_scans_wind_down)


def _let_arrow_scans_wind_down() -> None:
    gc.collect()
    time.sleep(0.2)


# Commands that read or write the warehouse: their tables' logs are checked before they start.
WAREHOUSE_COMMANDS = {"ingest", "run", "sql", "snapshot", "demo", "txn", "read", "offload", "retention"}


def _main(args: argparse.Namespace, argv: list[str]) -> int:
    _command.argv = argv
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if _on_main_thread() else None
    try:
        with Console(quiet=getattr(args, "quiet", False)) as console:
            _command.console = console
            if args.command in WAREHOUSE_COMMANDS:
                _require_whole_logs()
            return args.func(args)
    except TxnlakeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        for note in getattr(exc, "__notes__", ()):
            print(f"  {note}", file=sys.stderr)
        return 2
    except ValueError as exc:
        if getattr(args, "command", None) != "txn":
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BaseException as exc:
        # Ctrl-C, SIGTERM: a KeyboardInterrupt, or Dagster's own error for one inside a step.
        if not isinstance(exc, KeyboardInterrupt) and type(exc).__name__ != "DagsterExecutionInterruptedError":
            raise
        print(f"interrupted: {_cancel_current_run()}", file=sys.stderr)
        return 130
    finally:
        _command.console = Console(quiet=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _on_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _cancel_current_run() -> str:
    """Mark the run this process was executing cancelled (when Dagster has not ended it already); say which."""
    from dagster import DagsterRunStatus

    from pipelines.progress import mark_cancelling
    from pipelines.runs import current_run

    instance, run_id = current_run.get("instance"), current_run.get("run_id")
    if instance is None:
        return "nothing was left half done by a run (no run was executing)"
    mark_cancelling()
    run = instance.get_run_by_id(run_id)
    if run is not None and run.status not in (DagsterRunStatus.CANCELED, DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE):
        instance.report_run_canceled(run, message="interrupted (Ctrl-C or SIGTERM) at the command line")
        run = instance.get_run_by_id(run_id)
    current_run.clear()
    return f"run {run_id} of job {run.job_name} is marked {run.status.value.lower()}"


def _require_whole_logs() -> None:
    from pipelines.definitions import MAINTAINED_TABLES, RESOURCES
    from txn_engine.storage.logs import require_whole_logs
    from txn_engine.storage.migrate import require_current_layout

    settings = RESOURCES["warehouse"].settings()
    require_whole_logs(settings, MAINTAINED_TABLES)
    require_current_layout(settings)


def cmd_doctor(args: argparse.Namespace) -> int:
    from pipelines.definitions import MAINTAINED_TABLES, RESOURCES
    from txn_engine.storage.logs import check_logs

    settings = RESOURCES["warehouse"].settings()
    found = [h for h in check_logs(settings, MAINTAINED_TABLES) if h.version is not None]
    damaged = [h for h in found if h.problem]
    for health in found:
        print(f"  {'DAMAGED' if health.problem else 'ok':<8} {health.table:<28} version {health.version}  {health.path}")
    for health in damaged:
        print(f"error: {health.advice()}", file=sys.stderr)
    print(f"{len(found)} table(s) checked under {settings.warehouse}: "
          + (f"{len(damaged)} damaged" if damaged else "every head commit is whole"))
    return 1 if damaged else 0


if __name__ == "__main__":
    sys.exit(main())
