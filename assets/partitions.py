"""Ledger partitions, shared by the ledger, buffer and offload domains: one Dagster partition per
ledger (keys from `txn_engine.core.positions.ledger_partition_key`), the tags of a run over a range
of them, and the backoff of a sensor asking again for a failed run.

Dynamic, because ledgers appear as the log grows: a sensor adds a ledger's key when it closes.
"""

from dagster import DynamicPartitionsDefinition
# Private, but dagster 1.13 has no public name for the range tags, nor a public RunRequest
# argument for a partition range (RunRequest.partition_key_range reads these very tags).
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

RETRY_BACKOFF_S = 60.0  # a failed run is requested again after this, doubled per attempt ...
RETRY_BACKOFF_MAX_S = 3600.0  # ... up to an hour

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


def range_tags(first_key: str, last_key: str) -> dict[str, str]:
    """Run tags that make one run cover a partition range."""
    return {ASSET_PARTITION_RANGE_START_TAG: first_key, ASSET_PARTITION_RANGE_END_TAG: last_key}


def retry_after_s(attempt: int) -> float:
    """How long after the `attempt`-th request (0: the first) of a ledger its failed run is requested again."""
    return min(RETRY_BACKOFF_S * 2 ** attempt, RETRY_BACKOFF_MAX_S)
