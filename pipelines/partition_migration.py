"""`txnlake migrate`, the Dagster instance's part: ledger partitions keyed by ledger id alone (releases
before `<topic>/<ledger_id>` keys) renamed to one key per topic's ledger, their materialized status kept.

An old key named a ledger id, which every topic's ledger of that id shared; a buffer run replaced
rows by id, so each of those ledgers was computed by the runs that materialized the old key. The
tier holds only the ledgers it offloaded: an offload partition's status goes to those alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dagster import AssetKey, AssetMaterialization, DagsterInstance

from assets.offload import OFFLOAD_KEYS
from assets.partitions import LEDGER_PARTITIONS, LEGACY_PARTITIONS, ledger_keys
from assets.transaction_buffer.tables import DESCRIPTIONS as BUFFER_TABLES
from txn_engine.buffer.refresh import read_catalog
from txn_engine.core.positions import ledger_of_partition, ledger_partition_key
from txn_engine.core.schema import LEDGERS
from txn_engine.storage.warehouse import Warehouse

RENAMED_FROM = "renamed_from_partition"  # on the materializations the migration records


@dataclass
class PartitionMigration:
    renamed: dict[str, list[str]] = field(default_factory=dict)  # old key -> its new keys
    dropped: list[str] = field(default_factory=list)  # old keys of no ledger in the catalog
    statuses: int = 0  # materializations recorded under new keys


def migrate_ledger_partitions(instance: DagsterInstance, wh: Warehouse) -> PartitionMigration:
    """Rename the instance's legacy ledger partitions (`LEGACY_PARTITIONS`) to `<topic>/<ledger_id>`
    keys, added by topic then ledger; carry each asset's materialized status over to the new keys
    (an event naming the old key: nothing is recomputed); then delete the old keys. Idempotent."""
    result = PartitionMigration()
    old = instance.get_dynamic_partitions(LEGACY_PARTITIONS)
    if not old:
        return result
    catalog = read_catalog(wh, ["topic", "ledger_id", "state"]).to_pylist() if wh.exists(LEDGERS) else []
    by_id: dict[int, list[dict]] = {}
    for row in catalog:
        by_id.setdefault(row["ledger_id"], []).append(row)
    for key in old:
        rows = by_id.get(int(key), []) if key.isdigit() else []
        if rows:
            result.renamed[key] = ledger_keys((r["topic"], r["ledger_id"]) for r in rows)
        else:
            result.dropped.append(key)
    known = set(instance.get_dynamic_partitions(LEDGER_PARTITIONS.name))
    new = [k for k in ledger_keys(map(ledger_of_partition, {k for keys in result.renamed.values() for k in keys}))
           if k not in known]
    if new:
        instance.add_dynamic_partitions(LEDGER_PARTITIONS.name, new)
    in_tier = {ledger_partition_key(r["topic"], r["ledger_id"]) for r in catalog if r["state"] in ("OFFLOADED", "DELETED")}
    for asset_key in [*map(AssetKey, BUFFER_TABLES), *sorted(OFFLOAD_KEYS, key=str)]:
        materialized = instance.get_materialized_partitions(asset_key)  # old keys and new ones
        for old_key in sorted(set(result.renamed) & materialized):
            for key in result.renamed[old_key]:
                # Already there: materialized since, or carried by a migration stopped midway.
                if key in materialized or (asset_key in OFFLOAD_KEYS and key not in in_tier):
                    continue
                instance.report_runless_asset_event(AssetMaterialization(
                    asset_key=asset_key, partition=key,
                    metadata={RENAMED_FROM: old_key, "note": "`txnlake migrate` renamed the partition; nothing was recomputed"}))
                result.statuses += 1
    for key in old:  # last: a migration stopped before this point runs again from the start
        instance.delete_dynamic_partition(LEGACY_PARTITIONS, key)
    return result
