"""`txnlake`: the command line. Each command is a thin shell over txn_engine or a Dagster run."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from txn_engine.errors import TxnlakeError


def _instance():
    from dagster import DagsterInstance

    # With DAGSTER_HOME (as `make run` sets it) the runs show up in `dagster dev`.
    home = os.environ.get("DAGSTER_HOME")
    if not home:
        return DagsterInstance.ephemeral()
    os.makedirs(home, exist_ok=True)
    return DagsterInstance.get()


def _materialize(selection, run_config: dict | None = None, instance=None, tags: dict | None = None):
    """Materialize assets in this process (one SparkSession), unwrapping user errors."""
    from dagster import DagsterExecutionStepExecutionError, materialize

    from pipelines.definitions import ALL_ASSETS, ALL_CHECKS, RESOURCES

    config = {"loggers": {"console": {"config": {"log_level": "INFO"}}}, **(run_config or {})}
    try:
        return materialize(
            [*ALL_ASSETS, *ALL_CHECKS], selection=selection, resources=RESOURCES, run_config=config,
            instance=instance or _instance(), tags=tags,
        )
    except DagsterExecutionStepExecutionError as exc:
        cause = exc.user_exception or exc.__cause__
        if isinstance(cause, TxnlakeError):
            raise cause from None
        raise


def _print_materializations(result) -> None:
    # A run over a partition range reports each asset once per partition: print each asset once.
    latest = {e.event_specific_data.materialization.asset_key: e for e in result.get_asset_materialization_events()}
    for event in latest.values():
        mat = event.event_specific_data.materialization
        meta = {k: getattr(v, "value", v) for k, v in mat.metadata.items()}
        print(f"  {mat.asset_key.to_user_string():<24} rows={meta.get('rows')}  {meta.get('table_location', '')}")


def cmd_ingest(args: argparse.Namespace) -> int:
    from dagster import AssetSelection

    from txn_engine.schema import LEDGER_ENTRIES, QUARANTINE_ENTRIES

    result = _materialize(
        AssetSelection.assets(LEDGER_ENTRIES, QUARANTINE_ENTRIES),
        {"ops": {"ingest_ledger_entries": {"config": {"paths": list(args.paths)}}}},
    )
    events = result.get_asset_materialization_events()
    meta = {k: getattr(v, "value", v) for k, v in events[0].event_specific_data.materialization.metadata.items()}
    print(
        f"ingested {len(meta['files'])} file(s): {meta['rows_read']} rows read, "
        f"{meta['rows_written']} appended, {meta['rows_already_present']} already present, "
        f"{meta['rows_repeated_in_input']} repeated in input, {meta['rows_quarantined']} quarantined"
    )
    for rule, n in sorted(meta["quarantine_by_rule"].items()):
        print(f"  quarantined {n} x {rule}")
    _print_materializations(result)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from pipelines.definitions import DERIVED_SELECTION

    from dagster import AssetSelection

    from pipelines.buffer_sensors import BUFFER_SELECTION, new_closed_ledger_keys, range_tags
    from pipelines.definitions import RESOURCES
    from pipelines.partitions import LEDGER_PARTITIONS
    from txn_engine.schema import LEDGERS

    started = time.perf_counter()
    print("materializing every derived asset over the warehouse, in this process ...", flush=True)
    instance = _instance()  # one instance: the ledger partitions added below must be seen by the run
    catalog = _materialize(AssetSelection.assets(LEDGERS), instance=instance)
    # The transaction buffer is partitioned by closed ledger: add the newly closed ones, then run
    # the whole range (a full recompute; the OPEN ledgers are included by every buffer run).
    new = new_closed_ledger_keys(RESOURCES["warehouse"].open(RESOURCES["spark"].session()), instance)
    if new:
        instance.add_dynamic_partitions(LEDGER_PARTITIONS.name, new)
        print(f"  {len(new)} newly closed ledger(s) added as partitions of the transaction buffer")
    keys = instance.get_dynamic_partitions(LEDGER_PARTITIONS.name)
    rest = DERIVED_SELECTION - AssetSelection.assets(LEDGERS)
    if keys:
        result = _materialize(rest, instance=instance, tags=range_tags(keys[0], keys[-1]))
    else:
        print("  no closed ledger yet: the transaction buffer tables (and the models reading them) wait for one")
        result = _materialize(rest - BUFFER_SELECTION.downstream(), instance=instance)
    print(f"done in {time.perf_counter() - started:.1f}s:")
    _print_materializations(catalog)
    _print_materializations(result)
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    from resources.spark import get_spark
    from txn_engine.settings import WarehouseSettings
    from txn_engine.sql_models import load_model, run_model
    from txn_engine.warehouse import Warehouse

    model = load_model(args.file)
    print(f"-- {model.name}: reads {', '.join(model.reads) or 'no table'}")
    result = run_model(Warehouse(get_spark(), WarehouseSettings()), model)
    result.show(args.limit, truncate=False)
    return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    from dagster import AssetSelection

    from assets.snapshots import GROUP

    config = {"force": args.force}
    if args.max_aborts_per_segment is not None:
        config["max_aborts_per_segment"] = args.max_aborts_per_segment
    if args.max_segment_bytes is not None:
        config["max_segment_bytes"] = args.max_segment_bytes
    result = _materialize(AssetSelection.groups(GROUP), {"ops": {"txn_snapshot_segments": {"config": config}}})
    _print_materializations(result)
    for check in result.get_asset_check_evaluations():
        print(f"  check {check.check_name}: {'passed' if check.passed else 'FAILED'}")
    return 0 if all(c.passed for c in result.get_asset_check_evaluations()) else 1


def cmd_generate(args: argparse.Namespace) -> int:
    from txn_engine.generate import generate_ledger_file

    started = time.perf_counter()
    summary = generate_ledger_file(args.out, entries=args.entries, seed=args.seed, topics=args.topics)
    print(f"wrote {args.out} in {time.perf_counter() - started:.1f}s: {summary}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from dagster import AssetSelection

    from assets.engine import DEMO_WORKLOAD

    config = {"producers": args.producers, "transactions_per_producer": args.transactions, "seed": args.seed}
    result = _materialize(AssetSelection.assets(DEMO_WORKLOAD), {"ops": {DEMO_WORKLOAD: {"config": config}}})
    meta = result.get_asset_materialization_events()[0].event_specific_data.materialization.metadata
    print("demo workload through the engine:", getattr(meta["outcome"], "value", meta["outcome"]))
    _print_materializations(result)
    return 0


def cmd_txn(args: argparse.Namespace) -> int:
    from pipelines.txn_cli import run_txn_command

    return run_txn_command(args)
def _open_warehouse():
    from resources.spark import get_spark
    from txn_engine.settings import WarehouseSettings
    from txn_engine.warehouse import Warehouse

    return Warehouse(get_spark(), WarehouseSettings())


def cmd_read(args: argparse.Namespace) -> int:
    from txn_engine.positions import Position
    from txn_engine.reader import TopicReader

    try:
        start = Position.parse(args.from_position)
    except ValueError as exc:
        raise TxnlakeError(str(exc)) from None
    batch = TopicReader(_open_warehouse()).read(args.topic, start, args.max)
    for e in batch.entries:
        txn = "-" if e.txn_most_bits is None else f"{e.txn_most_bits}:{e.txn_least_bits}"
        payload = "" if e.payload is None else bytes(e.payload)[:60].decode("utf-8", errors="replace")
        print(f"{e.ledger_id}:{e.entry_id}\t{e.tier}\ttxn={txn}\tkey={e.key or ''}\t{payload}")
    nxt = batch.next_position
    print(f"-- {len(batch.entries)} entries" + (f"; continue with --from {nxt}" if nxt else ""))
    return 0


def cmd_offload(args: argparse.Namespace) -> int:
    from txn_engine.offload import offload_ledgers

    result = offload_ledgers(_open_warehouse(), args.ledgers or None)
    for key in result.offloaded:
        print(f"  offloaded {key[0]}/{key[1]}")
    for key, reason in sorted(result.waiting.items()):
        print(f"  waiting   {key[0]}/{key[1]}: {reason}")
    for key in result.finished_orphans + result.rolled_back_orphans:
        print(f"  recovered {key[0]}/{key[1]} ({'finished' if key in result.finished_orphans else 'rolled back'})")
    print(f"offloaded {len(result.offloaded)} ledger(s), deciding from {result.facts_from}, "
          f"copying from {result.kept_from}: {result.savings()}")
    print(f"took {result.time_spent()}")
    return 0


def cmd_retention(args: argparse.Namespace) -> int:
    from dagster import AssetSelection

    from assets.offload import RetentionConfig
    from txn_engine.retention import DEFAULT_MAX_AGE, parse_bytes, parse_duration
    from txn_engine.schema import DELETED_LEDGERS, LEDGERS

    named = args.max_age is not None or args.max_bytes is not None or args.keep_ledgers is not None
    age = parse_duration(args.max_age) if args.max_age is not None else (None if named else DEFAULT_MAX_AGE)
    config = {
        "max_age_hours": None if age is None else age.total_seconds() / 3600,
        "max_bytes": None if args.max_bytes is None else parse_bytes(args.max_bytes),
        "keep_ledgers": args.keep_ledgers,
        "require_offloaded": not args.include_not_offloaded,
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

    p = sub.add_parser("ingest", help="validate raw ledger files and append them to ledger_entries")
    p.add_argument("paths", nargs="+", metavar="PATH", help=".jsonl, .csv or .parquet files (or folders)")
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("run", help="materialize every derived asset over what the warehouse holds")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("sql", help="run one SQL model ad hoc and print its result")
    p.add_argument("file", help="a .sql file, e.g. dbt-free-sql/ledger_sizes.sql")
    p.add_argument("--limit", type=int, default=50, help="rows to print (default 50)")
    p.set_defaults(func=cmd_sql)

    p = sub.add_parser("snapshot", help="take the due transaction-buffer snapshots, compact, recover and check")
    p.add_argument("--force", action="store_true", help="snapshot every topic with transactional data")
    p.add_argument("--max-aborts-per-segment", type=int, help="aborts per segment at most (default 100000)")
    p.add_argument("--max-segment-bytes", type=int, help="bytes per segment at most (default 5 MiB)")
    p.set_defaults(func=cmd_snapshot)

    p = sub.add_parser("generate", help="write a realistic raw ledger file (deterministic per seed)")
    p.add_argument("out", help="output file: .parquet, .jsonl or .csv")
    p.add_argument("--entries", type=int, default=10_000, help="number of entries (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--topics", type=int, default=4, help="number of topics (default 4)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="run the demo workload through the transaction engine")
    p.add_argument("--producers", type=int, default=4, help="concurrent producers (default 4)")
    p.add_argument("--transactions", type=int, default=20, help="transactions per producer (default 20)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.set_defaults(func=cmd_demo)

    from pipelines.txn_cli import add_txn_parser

    add_txn_parser(sub, cmd_txn)
    p = sub.add_parser("read", help="read a topic from a position, hot ledgers and offload tier together")
    p.add_argument("topic")
    p.add_argument("--from", dest="from_position", default="-1:-1", metavar="L:E",
                   help="start position, inclusive (default: the beginning); a filtered-out position starts at the next entry")
    p.add_argument("--max", type=int, default=None, metavar="N", help="at most N entries (default all)")
    p.set_defaults(func=cmd_read)

    p = sub.add_parser("offload", help="copy eligible CLOSED ledgers to the filtered offload tier")
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
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted; write nothing")
    p.set_defaults(func=cmd_retention)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TxnlakeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        if getattr(args, "command", None) != "txn":
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
