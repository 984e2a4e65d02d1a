"""What the transaction buffer's tables hold for given ledgers: the figures a ledger partition's
materialization reports (its own rows, not the whole table's)."""

from __future__ import annotations

from typing import Iterable

import pyarrow as pa
import pyarrow.compute as pc

from txn_engine.buffer.refresh import LEDGER_COLUMN
from txn_engine.core.positions import Position
from txn_engine.core.schema import ABORTED_TXNS, COMMITTED_ENTRIES, STABLE_POSITIONS, STABLE_POSITIONS_SCHEMA, TXN_MARKERS
from txn_engine.storage.delta_io import DeltaTables, scan
from txn_engine.storage.warehouse import Warehouse

LedgerKey = tuple[str, int]
# The tables whose rows each belong to one ledger (`LEDGER_COLUMN`); stable_positions has a row per topic.
PER_LEDGER_TABLES = (TXN_MARKERS, ABORTED_TXNS, COMMITTED_ENTRIES)


def rows_by_ledger(wh: Warehouse, ledgers: Iterable[LedgerKey]) -> dict[str, dict[LedgerKey, int]]:
    """Per table of `PER_LEDGER_TABLES`, the rows of each of `ledgers` (absent: none).

    Read by delta-rs: two narrow columns of the files whose statistics may hold those ledger ids."""
    wanted = set(ledgers)
    ids = sorted({ledger for _, ledger in wanted})
    counts: dict[str, dict[LedgerKey, int]] = {}
    tables = DeltaTables(wh)
    for table in PER_LEDGER_TABLES:
        column = LEDGER_COLUMN[table]
        if not ids or not tables.exists(table):
            counts[table] = {}
            continue
        rows = scan(tables.dataset(table), pushed=pc.field(column).isin(pa.array(ids, pa.int64())), columns=["topic", column])
        rows = pa.table({"topic": pc.cast(rows["topic"], pa.string()), "ledger": rows[column]})
        grouped = rows.group_by(["topic", "ledger"]).aggregate([([], "count_all")])
        found = zip(grouped["topic"].to_pylist(), grouped["ledger"].to_pylist(), grouped["count_all"].to_pylist())
        counts[table] = {(t, ledger): n for t, ledger, n in found if (t, ledger) in wanted}
    return counts


def stable_positions_by_topic(wh: Warehouse) -> dict[str, dict]:
    """Per topic, its `stable_positions` row as text positions: `stable_position`, `last_position`,
    `ongoing_txns`."""
    rows = DeltaTables(wh).read(STABLE_POSITIONS, STABLE_POSITIONS_SCHEMA).to_pylist()
    return {r["topic"]: {"stable_position": str(Position(r["max_read_ledger_id"], r["max_read_entry_id"])),
                         "last_position": str(Position(r["last_ledger_id"], r["last_entry_id"])),
                         "ongoing_txns": r["ongoing_txn_count"]} for r in rows}
