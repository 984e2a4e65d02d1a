"""`txnlake`: the command line. Each command is a thin shell over txn_engine or a Dagster run."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import uuid
from typing import Sequence

from pipelines.txn_cli import add_txn_parser, run_txn_command
from txn_engine.core.errors import TxnlakeError


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


def _user_error_names() -> set[str]:
    names, todo = set(), [TxnlakeError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def _is_user_error_failure(record) -> bool:
    """A step's or run's failure log record whose error is a TxnlakeError (a user error the CLI
    prints as one line); unexpected errors keep their traces."""
    from dagster import DagsterEventType
    from dagster._core.log_manager import LOG_RECORD_METADATA_ATTR

    event = (getattr(record, LOG_RECORD_METADATA_ATTR, None) or {}).get("dagster_event")
    if event is None or event.event_type not in (DagsterEventType.STEP_FAILURE, DagsterEventType.RUN_FAILURE):
        return False
    error = getattr(event.event_specific_data, "error", None)
    # A step failure wraps the user's exception as its cause; a run failure is the exception itself.
    if error is not None and error.cls_name == "DagsterExecutionStepExecutionError":
        error = error.cause
    return error is not None and error.cls_name in _user_error_names()


def _console_logger():
    """Dagster's console logger without the stack traces of user errors."""
    from dagster import LoggerDefinition, colored_console_logger

    def make(init_context):
        log = colored_console_logger.logger_fn(init_context)
        log.addFilter(lambda record: not _is_user_error_failure(record))
        return log

    return LoggerDefinition(make, config_schema=colored_console_logger.config_schema,
                            description=colored_console_logger.description)


def _materialize(selection, run_config: dict | None = None, instance=None, tags: dict | None = None,
                 partition_key: str | None = None):
    """Materialize assets in this process (one SparkSession), unwrapping user errors (`_execute`)."""
    from dagster import define_asset_job
    from dagster._core.definitions.materialize import EPHEMERAL_JOB_NAME

    return _execute(define_asset_job(EPHEMERAL_JOB_NAME, selection=selection), run_config, instance, tags, partition_key)


def _execute(job, run_config: dict | None = None, instance=None, tags: dict | None = None,
             partition_key: str | None = None):
    """Run `job` (an asset job, or an op job such as `ingest`) in this process with our console
    logger: a user error (TxnlakeError) is raised as itself, its message naming what to do, with a
    note of the run that holds the full log."""
    from dagster import DagsterExecutionStepExecutionError, Definitions

    from pipelines.definitions import ALL_ASSETS, ALL_CHECKS, RESOURCES

    instance = instance or _instance()
    config = {"loggers": {"console": {"config": {"log_level": "INFO"}}}, **(run_config or {})}
    defs = Definitions(jobs=[job], assets=[*ALL_ASSETS, *ALL_CHECKS], resources=RESOURCES, loggers={"console": _console_logger()})
    run_id = str(uuid.uuid4())
    try:
        return defs.resolve_job_def(job.name).execute_in_process(
            run_config=config, instance=instance, partition_key=partition_key, tags=tags, run_id=run_id,
        )
    except Exception as exc:
        # In process, Dagster raises the asset's own exception (or wraps it in a step error).
        cause = (exc.user_exception or exc.__cause__) if isinstance(exc, DagsterExecutionStepExecutionError) else exc
        if isinstance(cause, TxnlakeError):
            where = ("an ephemeral Dagster instance" if instance.is_ephemeral
                     else f"the Dagster instance at {instance.root_directory} (`make ui` shows it)")
            cause.add_note(f"run {run_id} failed; its full log is in {where}")
            raise cause from None
        raise


def _print_materializations(*results) -> None:
    # A run over a partition range reports each asset once per partition, and several runs may
    # materialize one asset: print each table once, as last written. The partitions a full buffer
    # run recomputed beside its own carry no table figures (`recomputed_by_run_range`): skipped.
    latest = {}
    for result in results:
        for event in result.get_asset_materialization_events():
            mat = event.event_specific_data.materialization
            meta = {k: getattr(v, "value", v) for k, v in mat.metadata.items()}
            if "rows" in meta:
                latest[mat.asset_key] = meta
    for key, meta in latest.items():
        print(f"  {key.to_user_string():<24} rows={meta['rows']}  {meta.get('table_location', '')}")


def cmd_ingest(args: argparse.Namespace) -> int:
    from assets.ledger import ingest_job
    from txn_engine.log.ingest import gap_warnings

    result = _execute(ingest_job, {"ops": {"ingest_ledger_entries": {"config": {"paths": list(args.paths)}}}})
    events = result.get_asset_materialization_events()
    meta = {k: getattr(v, "value", v) for k, v in events[0].event_specific_data.materialization.metadata.items()}
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
    return 0


def _add_closed_ledger_partitions(instance, wh) -> None:
    """Add the `ledgers` catalog's newly closed ledgers as ledger partitions (what the
    ledgers_closed_sensor does), in ledger order."""
    from assets.transaction_buffer.sensors import closed_ledgers_of
    from assets.partitions import LEDGER_PARTITIONS

    new = closed_ledgers_of(wh, instance).new_keys
    if new:
        instance.add_dynamic_partitions(LEDGER_PARTITIONS.name, new)
        print(f"  {len(new)} newly closed ledger(s) added as ledger partitions (transaction buffer, offload tier)")


def _add_open_ledger_partitions(instance, wh) -> list[str]:
    """Add the catalog's OPEN ledgers as ledger partitions, in ledger order; return their keys."""
    from assets.partitions import LEDGER_PARTITIONS
    from txn_engine.core.positions import ledger_partition_key
    from txn_engine.log.ledgers import open_ledger_ids

    keys = [ledger_partition_key(i) for i in open_ledger_ids(wh)]
    if keys:
        instance.add_dynamic_partitions(LEDGER_PARTITIONS.name, keys)
        print(f"  no closed ledger yet: the {len(keys)} OPEN ledger(s) added as ledger partitions")
    return keys


def cmd_run(args: argparse.Namespace) -> int:
    from pipelines.definitions import DERIVED_SELECTION

    from dagster import AssetSelection

    from assets.partitions import LEDGER_PARTITIONS, range_tags
    from assets.transaction_buffer.sensors import BUFFER_SELECTION
    from txn_engine.core.schema import LEDGERS

    started = time.perf_counter()
    print("materializing every derived asset over the warehouse, in this process ...", flush=True)
    instance = _instance()  # one instance: the ledger partitions added below must be seen by the run
    catalog = _materialize(AssetSelection.assets(LEDGERS), instance=instance)
    # The transaction buffer is partitioned by closed ledger: add the newly closed ones, then run
    # the whole range (a full recompute; the OPEN ledgers are included by every buffer run).
    wh = _open_warehouse()
    _add_closed_ledger_partitions(instance, wh)
    keys = instance.get_dynamic_partitions(LEDGER_PARTITIONS.name)
    if not keys:
        # Every ledger still OPEN (a log's first ledgers): they become the partitions, so the buffer
        # has a range to run over and every topic gets its stable position now.
        keys = _add_open_ledger_partitions(instance, wh)
    rest = DERIVED_SELECTION - AssetSelection.assets(LEDGERS)
    if keys:
        result = _materialize(rest, instance=instance, tags=range_tags(keys[0], keys[-1]))
    else:
        print("  no ledger yet: the transaction buffer tables (and the models reading them) wait for one")
        result = _materialize(rest - BUFFER_SELECTION.downstream(), instance=instance)
    print(f"done in {time.perf_counter() - started:.1f}s:")
    _print_materializations(catalog)
    _print_materializations(result)
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    from txn_engine.sql.models import load_model, run_model

    model = load_model(args.file)
    print(f"-- {model.name}: reads {', '.join(model.reads) or 'no table'}")
    result = run_model(_open_warehouse(), model)
    result.show(args.limit, truncate=False)
    return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    from dagster import AssetCheckSeverity, AssetSelection

    from assets.snapshots import GROUP

    config = {"force": args.force}
    if args.max_aborts_per_segment is not None:
        config["max_aborts_per_segment"] = args.max_aborts_per_segment
    if args.max_segment_bytes is not None:
        config["max_segment_bytes"] = args.max_segment_bytes
    result = _materialize(AssetSelection.groups(GROUP), {"ops": {"txn_snapshot_segments": {"config": config}}})
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
    from assets.engine import DEMO_WORKLOAD, demo_job

    config = {"producers": args.producers, "transactions_per_producer": args.transactions, "seed": args.seed}
    result = _execute(demo_job, {"ops": {DEMO_WORKLOAD: {"config": config}}})
    print("demo workload through the engine:", result.output_for_node(DEMO_WORKLOAD))
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
    key = "" if e.key is None else payload_text(e.key.encode("utf-8", "surrogateescape"))
    return f"{e.ledger_id}:{e.entry_id}\t{e.tier}\ttxn={txn}\tkey={key}\t{payload_text(e.payload)}"


def cmd_read(args: argparse.Namespace) -> int:
    from txn_engine.core.positions import start_position
    from txn_engine.log.ledgers import known_topics
    from txn_engine.tier.reader import TopicReader

    try:
        start = start_position(args.from_position, "--from")
    except ValueError as exc:
        raise TxnlakeError(str(exc)) from None
    wh = _open_warehouse()
    reader = TopicReader(wh)
    batch = reader.read(args.topic, start, args.max)
    if not batch.entries:
        # Nothing read: say so when the topic is unknown, rather than print an empty topic.
        known = known_topics(wh)
        if args.topic not in known:
            listed = ", ".join(sorted(known)[:20]) + (", ..." if len(known) > 20 else "")
            raise TxnlakeError(f"unknown topic {args.topic!r}; the warehouse has "
                               + (f"{len(known)} topic(s): {listed}" if known else "no topic yet (`txnlake ingest FILE`)"))
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
    from dagster import AssetSelection

    from txn_engine.log.ledgers import stale_catalog
    from txn_engine.core.schema import LEDGER_ENTRIES, LEDGERS

    if not wh.exists(LEDGER_ENTRIES):
        raise wh.missing(LEDGER_ENTRIES)
    if stale_catalog(wh) is not None:
        _print_materializations(_materialize(AssetSelection.assets(LEDGERS), instance=instance))
    _add_closed_ledger_partitions(instance, wh)


def cmd_offload(args: argparse.Namespace) -> int:
    from dagster import AssetKey, AssetSelection

    from assets.offload import OFFLOAD_SELECTION
    from assets.partitions import LEDGER_PARTITIONS, partition_spans, range_tags
    from txn_engine.core.errors import TableMissingError
    from txn_engine.log.ledgers import catalog_rows
    from txn_engine.tier.offload import OffloadResult, OffloadWaitingError, eligible_not_offloaded
    from txn_engine.core.positions import ledger_partition_key
    from txn_engine.tier.reader import views_behind_log
    from txn_engine.core.schema import LEDGERS, OFFLOAD_MANIFEST, OFFLOADED_ENTRIES, STABLE_POSITIONS

    started = time.perf_counter()
    instance, wh = _instance(), _open_warehouse()
    _refresh_stale_catalog(instance, wh)
    waiting: dict[str, str] = {}
    if args.ledgers:
        keys = set()
        for row in catalog_rows(wh, args.ledgers):
            if row["state"] == "OPEN":  # not a partition (those are closed ledgers): nothing to run
                waiting[f"{row['topic']}/{row['ledger_id']}"] = "ledger is OPEN"
            else:
                keys.add(ledger_partition_key(row["ledger_id"]))
    else:
        if not wh.exists(STABLE_POSITIONS):
            raise TableMissingError(f"table {STABLE_POSITIONS} does not exist yet at {wh.path(STABLE_POSITIONS)}: which "
                                    "ledgers are eligible depends on it; materialize the transaction buffer first (`txnlake run`).")
        # As the offload sensor chooses: eligible by the stored stable positions, not offloaded yet.
        keys = {ledger_partition_key(ledger_id) for _, ledger_id in eligible_not_offloaded(wh)}
    known = instance.get_dynamic_partitions(LEDGER_PARTITIONS.name)
    missing = sorted(keys - set(known))
    if missing:
        instance.add_dynamic_partitions(LEDGER_PARTITIONS.name, missing)
    # One run per range of ledger partitions; without LEDGER_IDs one range over every eligible
    # ledger (those between that are not are reported waiting, and not recorded as materialized;
    # re-running one is harmless).
    spans = partition_spans(instance.get_dynamic_partitions(LEDGER_PARTITIONS.name), keys, contiguous=bool(args.ledgers))
    runs = []
    for first, last in spans:
        try:
            runs.append(_materialize(OFFLOAD_SELECTION, instance=instance, partition_key=first) if first == last
                        else _materialize(OFFLOAD_SELECTION, instance=instance, tags=range_tags(first, last)))
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
    savings = {k: sum(m[k] for m in metas) for k in timing.savings()}  # OffloadResult.savings() names the totals
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
        runs.append(_materialize(AssetSelection.checks_for_assets(OFFLOADED_ENTRIES, OFFLOAD_MANIFEST), instance=instance))
    if offloaded or recovered or any(m["recovered"]["states_recorded"] for m in metas):
        # What the offload changed: the catalog's states (OFFLOADED), and the models over it and the tier.
        refreshed = [LEDGERS, "ledger_sizes", *(["tier_sizes"] if wh.exists(OFFLOAD_MANIFEST) else [])]
        runs.append(_materialize(AssetSelection.assets(*map(AssetKey, refreshed)), instance=instance))
    _print_materializations(*runs)
    # A check evaluated in several runs: failed when any run failed it.
    checks: dict[str, bool] = {}
    for check in (c for run in runs for c in run.get_asset_check_evaluations()):
        checks[check.check_name] = checks.get(check.check_name, True) and check.passed
    for name, passed in checks.items():
        print(f"  check {name}: {'passed' if passed else 'FAILED'}")
    behind = views_behind_log(wh)
    if behind:
        listed = ", ".join(f"{t} (log reaches {p})" for t, p in sorted(behind.items())[:5]) + (", ..." if len(behind) > 5 else "")
        print(f"note: the transaction buffer's view of {len(behind)} topic(s) is behind the log: {listed}; ledgers "
              "past its last run are not eligible until then; run `txnlake run`, then offload again", file=sys.stderr)
    print(f"done in {time.perf_counter() - started:.1f}s")
    return 0 if all(checks.values()) else 1


def cmd_retention(args: argparse.Namespace) -> int:
    from dagster import AssetSelection

    from assets.offload import RetentionConfig
    from txn_engine.tier.retention import DEFAULT_MAX_AGE, parse_bytes, parse_duration
    from txn_engine.core.schema import DELETED_LEDGERS, LEDGERS

    named = args.max_age is not None or args.max_bytes is not None or args.keep_ledgers is not None
    age = parse_duration(args.max_age) if args.max_age is not None else (None if named else DEFAULT_MAX_AGE)
    config = {
        "max_age_hours": None if age is None else age.total_seconds() / 3600,
        "max_bytes": None if args.max_bytes is None else parse_bytes(args.max_bytes),
        "keep_ledgers": args.keep_ledgers,
        "require_offloaded": not args.include_not_offloaded,
        "require_buffered": not args.include_not_buffered,
        "dry_run": args.dry_run,
    }
    RetentionConfig(**config).policy()  # bad limits fail here, before any run
    print("retention policy: " + ", ".join(f"{k}={v}" for k, v in config.items() if v is not None), flush=True)
    instance = _instance()
    result = _materialize(AssetSelection.assets(DELETED_LEDGERS), {"ops": {DELETED_LEDGERS: {"config": config}}}, instance=instance)
    # A real run materializes deleted_ledgers; a dry run only observes it (nothing changed).
    [event] = result.get_asset_observation_events() if args.dry_run else result.get_asset_materialization_events()
    outcome = event.event_specific_data.asset_observation if args.dry_run else event.event_specific_data.materialization
    meta = {k: getattr(v, "value", v) for k, v in outcome.metadata.items()}
    verb = "would delete" if args.dry_run else "deleted"
    for key in meta["ledgers_deleted"]:
        print(f"  {verb} {key}")
    for key in meta["ledgers_finished"]:
        print(f"  finished the interrupted deletion of {key}")
    for key in meta["ledgers_waiting_for_buffer"]:
        print(f"  kept {key}: the transaction buffer has not run over it yet (run `txnlake run`, then retention again)")
    print(f"{verb} {len(meta['ledgers_deleted'])} ledger(s): {meta['entries_freed']} entries, {meta['bytes_freed']} bytes")
    if not args.dry_run:
        print(f"VACUUM deleted {meta['files_reclaimed']} file(s) from disk: those earlier deletes replaced, past each "
              "table's delta.deletedFileRetentionDuration (Delta's default: 7 days)")
    _print_materializations(result)  # (none for a dry run)
    if meta["ledgers_deleted"] and not args.dry_run:
        _print_materializations(_materialize(AssetSelection.assets(LEDGERS), instance=instance))  # the catalog shows DELETED
    return 0


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
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("run", help="materialize every derived asset over what the warehouse holds",
                       description="Refreshes the ledgers catalog, then materializes the transaction buffer's tables and "
                       "the SQL models over every ledger the warehouse holds (snapshots, offload and retention have "
                       "their own commands). "
                       "Run it after an ingest: readers see nothing of the new entries before.")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("sql", help="run one SQL model ad hoc and print its result",
                       description="Runs one SQL file over the warehouse's Delta tables (each table by its name) and "
                       "prints its rows.")
    p.add_argument("file", help="a .sql file, e.g. dbt-free-sql/ledger_sizes.sql")
    p.add_argument("--limit", type=int, default=50, help="rows to print (default 50)")
    p.set_defaults(func=cmd_sql)

    p = sub.add_parser("snapshot", help="take the due transaction-buffer snapshots, compact, recover and check",
                       description="Takes the due transaction-buffer snapshots (multi-part segments), compacts the "
                       "snapshot log, recovers the buffer state from it and checks it against a full replay.")
    p.add_argument("--force", action="store_true", help="snapshot every topic with transactional data")
    p.add_argument("--max-aborts-per-segment", type=int, help="aborts per segment at most (default 100000)")
    p.add_argument("--max-segment-bytes", type=int, help="bytes per segment at most (default 5 MiB)")
    p.set_defaults(func=cmd_snapshot)

    p = sub.add_parser("generate", help="write a realistic raw ledger file (deterministic per seed)",
                       description="Writes a raw ledger file to ingest: topics, ledgers, transactions that commit, "
                       "abort or hang, retried sends. The same seed gives the same file.")
    p.add_argument("out", help="output file: .parquet, .jsonl or .csv")
    p.add_argument("--entries", type=int, default=10_000, help="number of entries (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--topics", type=int, default=4, help="number of topics (default 4)")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="run the demo workload through the transaction engine",
                       description="Runs concurrent transactional producers through the transaction engine, which "
                       "writes their entries into the warehouse's ledgers.")
    p.add_argument("--producers", type=int, default=4, help="concurrent producers (default 4)")
    p.add_argument("--transactions", type=int, default=20, help="transactions per producer (default 20)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.set_defaults(func=cmd_demo)


    add_txn_parser(sub, cmd_txn)
    p = sub.add_parser("read", help="read a topic from a position, hot ledgers and offload tier together",
                       description="Prints one line per entry: position, tier, transaction, key, payload. A payload "
                       "prints as text when it is printable UTF-8 (no newline or tab), otherwise as a Python bytes "
                       f"literal (b'...'); either is cut at {PAYLOAD_CHARS} characters, then '...'.")
    p.add_argument("topic", help="the topic (partition) to read, e.g. orders-partition-0")
    p.add_argument("--from", dest="from_position", default="earliest", metavar="L:E",
                   help="start position, inclusive: L:E, L:-1 (before ledger L's first entry) or earliest (-1:-1, the "
                   "default); a filtered-out position starts at the next entry")
    p.add_argument("--max", type=int, default=None, metavar="N", help="at most N entries (default all)")
    p.set_defaults(func=cmd_read)

    p = sub.add_parser("offload", help="copy eligible CLOSED ledgers to the filtered offload tier (a Dagster run)",
                       description="Materializes offloaded_entries and offload_manifest for the ledger partitions "
                       "(LEDGER_IDs, else every eligible ledger) with their checks, then refreshes ledgers, ledger_sizes "
                       "and tier_sizes. Exit 1 when a check fails, 2 on an error.")
    p.add_argument("ledgers", nargs="*", type=int, metavar="LEDGER_ID", help="only these ledgers (default: every eligible one)")
    p.set_defaults(func=cmd_offload)

    p = sub.add_parser("retention", help="delete old ledgers from the hot tables (by default only offloaded ones)",
                       description="A ledger goes when any given limit says so; per topic the oldest go first and "
                       "deletion stops at the first ledger that stays. Without a limit: --max-age 7d (Kafka's default).")
    p.add_argument("--max-age", metavar="AGE", help="delete ledgers whose last entry is older, e.g. 7d, 36h, 90m")
    p.add_argument("--max-bytes", metavar="SIZE", help="per topic, delete the oldest while the hot ledgers hold more, e.g. 10GB")
    p.add_argument("--keep-ledgers", type=int, metavar="N", help="per topic, keep the newest N ledgers")
    p.add_argument("--include-not-offloaded", action="store_true",
                   help="also delete CLOSED ledgers the tier does not hold (their data is then gone)")
    p.add_argument("--include-not-buffered", action="store_true",
                   help="also delete ledgers the transaction buffer has not run over (their markers and sequence ids "
                   "are then gone: a later retry reads as new, a later part of their transactions as open, holding "
                   "the stable position back); run `txnlake run` first instead")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted; write nothing")
    p.set_defaults(func=cmd_retention)
    return parser


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
    try:
        return _main(argv)
    finally:
        _let_arrow_scans_wind_down()


def _let_arrow_scans_wind_down() -> None:
    """pyarrow's dataset scans can leave reader threads running a moment after they return; one
    still running when the interpreter finalizes aborts the process ("terminate called without an
    active exception", exit 134; apache/arrow#39862, #34314): `txnlake offload` ended so in 4 of 8
    runs on the demo warehouse (its work all done and committed). Their objects are collected
    and their threads get that moment while Arrow is still alive."""
    gc.collect()
    time.sleep(0.2)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(_attach_positions(sys.argv[1:] if argv is None else argv))
    try:
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


if __name__ == "__main__":
    sys.exit(main())
