"""`txnlake migrate`: a warehouse written before the lossless columns is refused with a message
naming the command, which adds them without changing a stored row."""

from __future__ import annotations

import pytest

from tests.rows import entry, write_jsonl
from txn_engine.core.errors import WarehouseMigrationError
from txn_engine.core.schema import LEDGER_ENTRIES, LEDGER_ENTRY_COLUMNS, LOSSLESS_COLUMNS
from txn_engine.log.ingest import ingest_files
from txn_engine.storage.delta_io import DeltaTables


def test_an_old_warehouse_is_refused_then_migrated(warehouse, tmp_path, capsys):
    from pipelines.cli import main

    ingest_files(warehouse, [str(write_jsonl(tmp_path / "a.jsonl", [entry("t", 1, 0, key="k"), entry("t", 1, 1)]))])
    stored = sorted(tuple(r) for r in warehouse.read(LEDGER_ENTRIES).select(*LEDGER_ENTRY_COLUMNS).collect())
    # What an older txnlake wrote: the table without the columns added since.
    old = [c for c in LEDGER_ENTRY_COLUMNS if c not in LOSSLESS_COLUMNS]
    frame = warehouse.read(LEDGER_ENTRIES).select(*old).localCheckpoint()
    frame.write.format("delta").mode("overwrite").option("overwriteSchema", "true").save(warehouse.path(LEDGER_ENTRIES))
    with pytest.raises(WarehouseMigrationError, match=r"ledger_entries at .* has no column\(s\) key_bytes, headers, "
                       r"timestamp_type.*Run `txnlake migrate` once"):
        warehouse.read(LEDGER_ENTRIES)
    with pytest.raises(WarehouseMigrationError, match="txnlake migrate"):
        DeltaTables(warehouse).read(LEDGER_ENTRIES, frame.schema)
    assert main(["migrate"]) == 0
    assert "ledger_entries: added key_bytes, headers, timestamp_type" in capsys.readouterr().out
    migrated = warehouse.read(LEDGER_ENTRIES)
    assert tuple(migrated.columns) == LEDGER_ENTRY_COLUMNS
    assert sorted(tuple(r) for r in migrated.collect()) == stored
    assert main(["migrate"]) == 0
    assert "already current" in capsys.readouterr().out
