"""`txnlake txn list|describe|find-hanging|abort`: the operators' transaction tools."""

from __future__ import annotations

import argparse
import getpass
from datetime import datetime, timedelta, timezone

from pipelines.arguments import non_negative
from txn_engine.core.log_types import TxnId
from txn_engine.core.schema import TXN_STATES

# The states `txn list` shows: txn_log's, and those of transactions known only from the ledgers
# (txn_engine.producers.admin.ledger_state).
LIST_STATES = (*TXN_STATES, "PARTIALLY_COMMITTED", "MIXED")


def add_txn_parser(sub, handler) -> None:
    p = sub.add_parser("txn", help="inspect and abort transactions (txn_log and ledgers)",
                       description="The operators' transaction tools: list, describe, find hanging and abort "
                       "transactions, from txn_log and the ledgers.")
    txn_sub = p.add_subparsers(dest="txn_command", required=True)
    q = txn_sub.add_parser("list", help="every known transaction, from txn_log and from the ledgers",
                           description="Lists every known transaction: state, source, transactional id, start, topics.")
    q.add_argument("--state", type=str.upper, choices=LIST_STATES, metavar="STATE",
                   help=f"only this state (any case), one of {', '.join(LIST_STATES)}")
    q.add_argument("--limit", type=non_negative(int), default=100, help="rows to print (default 100)")
    q = txn_sub.add_parser("describe", help="one transaction: state, topics, history",
                           description="Prints one transaction: its state, producer, timeout, its state on each "
                           "topic and its txn_log history.")
    q.add_argument("txn_id", help="MOST_BITS:LEAST_BITS, e.g. 0:42")
    q = txn_sub.add_parser("find-hanging", help="open past their timeout, or holding a stable position back",
                           description="Lists transactions open past their timeout, or holding a topic's stable "
                           "position back longer than --held-back.")
    q.add_argument("--held-back", type=non_negative(float), default=300.0, metavar="SECONDS",
                   help="report transactions holding a topic's stable position back longer than this (default 300)")
    q = txn_sub.add_parser("abort", help="abort a transaction (ABORT markers), recorded with who/why in txn_log",
                           description="Aborts a transaction: writes its ABORT markers through the engine and "
                           "records who and why in txn_log.")
    q.add_argument("txn_id", help="MOST_BITS:LEAST_BITS, e.g. 0:42")
    q.add_argument("--who", default=getpass.getuser(), help="operator name (default: the current user)")
    q.add_argument("--why", required=True, help="reason, recorded in txn_log")
    p.set_defaults(func=handler)


def _admin(warehouse):
    from txn_engine.storage.delta_io import DeltaTables
    from txn_engine.producers.admin import TxnAdmin

    return TxnAdmin(DeltaTables(warehouse))


def _warehouse():
    from pipelines.definitions import RESOURCES
    from txn_engine.storage.warehouse import Warehouse

    from txn_engine.core.errors import TableMissingError

    # The configured warehouse resource, as the runs see it. No Spark: the engine and these tools
    # read and write Delta through delta-rs.
    settings = RESOURCES["warehouse"].settings()
    if settings.root_missing():
        # A mistyped root would list "0 transactions", and an abort would create it (its lock file).
        raise TableMissingError(
            f"the warehouse root {settings.warehouse} does not exist: no transaction was ever written there. "
            "Point TXNLAKE_WAREHOUSE at your warehouse."
        )
    return Warehouse(None, settings)


def _time(value) -> str:
    return "-" if value is None else f"{value:%Y-%m-%d %H:%M:%S}"


def _print_info(info) -> None:
    print(f"transaction {info.txn}: {info.state} (known from {info.source})")
    print(f"  transactional id: {info.transactional_id or '-'}   producer id: {info.producer_id if info.producer_id is not None else '-'}")
    print(f"  started: {_time(info.started_at)}   timeout: {info.timeout_ms if info.timeout_ms is not None else '-'} ms")
    for part in info.parts:
        extra = ""
        if part.first_position is not None:
            extra = f"  first entry {part.first_position}, {part.entries_held_back} entries held back since {_time(part.held_back_since)}"
        print(f"  topic {part.topic}: {part.state}{extra}")
    for row in info.history:
        print(f"  [{row['log_seq']}] {_time(row['recorded_at'])} {row['state']:<16} by {row['actor']}"
              + (f": {row['reason']}" if row["reason"] else ""))


def run_txn_command(args: argparse.Namespace) -> int:
    warehouse = _warehouse()
    command = args.txn_command
    if command == "list":
        infos = [i for i in _admin(warehouse).transactions().values() if not args.state or i.state == args.state]
        print(f"{'TXN':<12} {'STATE':<20} {'SOURCE':<8} {'TRANSACTIONAL ID':<28} {'STARTED':<19} TOPICS")
        for info in infos[: args.limit]:
            topics = ",".join(f"{p.topic}={p.state}" for p in info.parts) or "-"
            print(f"{str(info.txn):<12} {info.state:<20} {info.source:<8} {info.transactional_id or '-':<28} "
                  f"{_time(info.started_at):<19} {topics}")
        print(f"{len(infos)} transaction(s)" + (f", first {args.limit} shown" if len(infos) > args.limit else ""))
    elif command == "describe":
        _print_info(_admin(warehouse).describe(TxnId.parse(args.txn_id)))
    elif command == "find-hanging":
        now = datetime.now(timezone.utc)
        hanging = _admin(warehouse).find_hanging(now, timedelta(seconds=args.held_back))
        for info, reason in hanging:
            print(f"{info.txn} ({info.state}, {info.source}, {info.transactional_id or 'no transactional id'}): {reason}")
        print(f"{len(hanging)} hanging transaction(s)"
              + ("; abort one with `txnlake txn abort ID --why REASON`" if hanging else ""))
    elif command == "abort":
        from txn_engine.producers.engine import Engine
        from txn_engine.producers.admin import operator_abort

        with Engine(warehouse) as engine:
            info = operator_abort(engine, TxnId.parse(args.txn_id), args.who, args.why)
        print(f"aborted by operator {args.who}:")
        _print_info(info)
    return 0
