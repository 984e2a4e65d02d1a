"""Partitions: one Dagster partition per ledger (keys from `txn_engine.positions.ledger_partition_key`).

Dynamic, because ledgers appear as the log grows: a sensor adds a ledger's key when it closes.
"""

from dagster import DynamicPartitionsDefinition

LEDGER_PARTITIONS = DynamicPartitionsDefinition(name="ledgers")
