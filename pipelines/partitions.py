"""Partitions: one Dagster partition per ledger (keys from `txn_engine.core.positions.ledger_partition_key`).

Dynamic, because ledgers appear as the log grows: a sensor adds a ledger's key when it closes.
"""

from dagster import DynamicPartitionsDefinition

LEDGER_PARTITIONS = DynamicPartitionsDefinition(name="ledgers")


def partition_spans(order: list[str], keys: set[str], contiguous: bool) -> list[tuple[str, str]]:
    """(first, last) partition ranges over `keys`, in the instance's partition order (`order`):
    one span from the first to the last, or (contiguous) one per run of consecutive keys, so that
    no other partition is in a range."""
    spans: list[tuple[str, str]] = []
    previous = None
    for position, key in enumerate(order):
        if key not in keys:
            continue
        if spans and (not contiguous or previous == position - 1):
            spans[-1] = (spans[-1][0], key)
        else:
            spans.append((key, key))
        previous = position
    return spans
