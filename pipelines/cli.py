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


def _materialize(selection, run_config: dict | None = None):
    """Materialize assets in this process (one SparkSession), unwrapping user errors."""
    from dagster import DagsterExecutionStepExecutionError, materialize

    from pipelines.definitions import ALL_ASSETS, ALL_CHECKS, RESOURCES

    config = {"loggers": {"console": {"config": {"log_level": "INFO"}}}, **(run_config or {})}
    try:
        return materialize(
            [*ALL_ASSETS, *ALL_CHECKS], selection=selection, resources=RESOURCES, run_config=config, instance=_instance()
        )
    except DagsterExecutionStepExecutionError as exc:
        cause = exc.user_exception or exc.__cause__
        if isinstance(cause, TxnlakeError):
            raise cause from None
        raise


def _print_materializations(result) -> None:
    for event in result.get_asset_materialization_events():
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

    started = time.perf_counter()
    print("materializing every derived asset over the warehouse, in this process ...", flush=True)
    result = _materialize(DERIVED_SELECTION)
    print(f"done in {time.perf_counter() - started:.1f}s:")
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


def cmd_generate(args: argparse.Namespace) -> int:
    from txn_engine.generate import generate_ledger_file

    started = time.perf_counter()
    summary = generate_ledger_file(args.out, entries=args.entries, seed=args.seed, topics=args.topics)
    print(f"wrote {args.out} in {time.perf_counter() - started:.1f}s: {summary}")
    return 0


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
    print(f"offloaded {len(result.offloaded)} ledger(s): {result.savings()}")
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

    p = sub.add_parser("generate", help="write a realistic raw ledger file (deterministic per seed)")
    p.add_argument("out", help="output file: .parquet, .jsonl or .csv")
    p.add_argument("--entries", type=int, default=10_000, help="number of entries (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--topics", type=int, default=4, help="number of topics (default 4)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("read", help="read a topic from a position, hot ledgers and offload tier together")
    p.add_argument("topic")
    p.add_argument("--from", dest="from_position", default="-1:-1", metavar="L:E",
                   help="start position, inclusive (default: the beginning); a filtered-out position starts at the next entry")
    p.add_argument("--max", type=int, default=None, metavar="N", help="at most N entries (default all)")
    p.set_defaults(func=cmd_read)

    p = sub.add_parser("offload", help="copy eligible CLOSED ledgers to the filtered offload tier")
    p.add_argument("ledgers", nargs="*", type=int, metavar="LEDGER_ID", help="only these ledgers (default: every eligible one)")
    p.set_defaults(func=cmd_offload)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TxnlakeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
