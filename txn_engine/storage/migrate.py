"""`txnlake migrate`: bring a warehouse written by an older txnlake to the current table contract.

Columns are only ever added (the brief): a migration adds them to the tables that lack them, as
nullable columns, empty for the rows already stored. Delta adds a column in its log alone (no data
file is rewritten), so nothing stored changes and a second run finds nothing to do.
"""

from __future__ import annotations

from txn_engine.core.schema import ENTRY_TABLES, LEDGER_ENTRIES_SCHEMA, LEDGER_ENTRY_COLUMNS, LOSSLESS_COLUMNS
from txn_engine.storage.warehouse import Warehouse


def migrate_warehouse(warehouse: Warehouse) -> dict[str, list[str]]:
    """Add the missing contract columns to every entry table; {table: columns added}."""
    added: dict[str, list[str]] = {}
    spark = warehouse.spark
    for table in ENTRY_TABLES:
        location = warehouse.path(table)
        if not warehouse.exists(table, location):
            continue
        with warehouse.writer(table):
            present = spark.read.format("delta").load(location).columns
            missing = [f for f in LEDGER_ENTRIES_SCHEMA.fields if f.name in LOSSLESS_COLUMNS and f.name not in present]
            if not missing:
                continue
            # Each where the contract has it (after the column before it in ledger_entries), so a
            # migrated table reads and writes column for column like a new one.
            for field in missing:
                before = LEDGER_ENTRY_COLUMNS[LEDGER_ENTRY_COLUMNS.index(field.name) - 1]
                spark.sql(f"ALTER TABLE delta.`{location}` ADD COLUMNS (`{field.name}` {field.dataType.simpleString()} "
                          f"AFTER `{before}`)")
        added[table] = [f.name for f in missing]
    return added
