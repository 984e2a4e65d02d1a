"""Ledger partitions, shared by the ledger, buffer and offload domains: one Dagster partition per
closed ledger of a topic, keyed `<topic>/<ledger_id>` (`txn_engine.core.positions.ledger_partition_key`),
the tags of a run over a range of them, what to say about a key that is not a partition, and the
backoff of a sensor asking again for a failed run.

Dynamic, because ledgers appear as the log grows: a sensor adds a ledger's key when it closes.
Why this scheme and not a topic x ledger multi-partition: docs/architecture.md, "Ledger partitions".
"""

from __future__ import annotations

from typing import Iterable

from dagster import DagsterInstance, DynamicPartitionsDefinition
# Private, but dagster 1.13 has no public name for the range tags, nor a public RunRequest
# argument for a partition range (RunRequest.partition_key_range reads these very tags).
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG, PARTITION_NAME_TAG

from txn_engine.buffer.refresh import read_catalog
from txn_engine.core.errors import TxnlakeError
from txn_engine.core.positions import ledger_of_partition, ledger_partition_key
from txn_engine.core.schema import LEDGERS
from txn_engine.storage.warehouse import Warehouse

RETRY_BACKOFF_S = 60.0  # a failed run is requested again after this, doubled per attempt ...
RETRY_BACKOFF_MAX_S = 3600.0  # ... up to an hour

LEDGER_PARTITIONS = DynamicPartitionsDefinition(name="topic_ledgers")
# The dynamic partitions of releases whose keys were bare ledger ids; `txnlake migrate` renames them.
LEGACY_PARTITIONS = "ledgers"


class LegacyPartitionsError(TxnlakeError):
    """The Dagster instance still holds ledger partitions keyed by ledger id alone."""


class NotALedgerPartitionError(TxnlakeError):
    """A run names a ledger partition the instance does not hold (an OPEN ledger, an unknown key)."""


def ledger_keys(ledgers: Iterable[tuple[str, int]]) -> list[str]:
    """Partition keys of (topic, ledger_id) pairs, in the order they are added: by topic, then ledger,
    so that each batch of new keys holds each topic's ledgers together and in ledger order."""
    return [ledger_partition_key(topic, ledger) for topic, ledger in sorted(set(ledgers))]


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


def legacy_partitions_message(instance: DagsterInstance) -> str | None:
    """What to do when the instance still holds partitions keyed by ledger id alone; None when it does not."""
    old = instance.get_dynamic_partitions(LEGACY_PARTITIONS)
    if not old:
        return None
    return (f"this Dagster instance holds {len(old)} ledger partition(s) keyed by ledger id alone (an older release, "
            f"e.g. {old[0]}); ledger ids repeat across topics: run `txnlake migrate` once, which renames them "
            "to <topic>/<ledger_id> and keeps their materialized status")


def refuse_legacy_partitions(instance: DagsterInstance) -> None:
    """Raise `LegacyPartitionsError` (naming `txnlake migrate`) when the instance holds old keys."""
    message = legacy_partitions_message(instance)
    if message:
        raise LegacyPartitionsError(message)


def requested_partition_keys(tags: dict[str, str]) -> list[str]:
    """The partition keys a run names in its tags (one key, or the two ends of a range), before
    Dagster resolves them: a key it does not hold fails there without saying why."""
    if PARTITION_NAME_TAG in tags:
        return [tags[PARTITION_NAME_TAG]]
    return [tags[t] for t in (ASSET_PARTITION_RANGE_START_TAG, ASSET_PARTITION_RANGE_END_TAG) if t in tags]


def check_partitions_exist(wh: Warehouse, instance: DagsterInstance, keys: list[str]) -> None:
    """Raise `NotALedgerPartitionError` with one line saying why, when a key is not a ledger partition."""
    known = set(instance.get_dynamic_partitions(LEDGER_PARTITIONS.name))
    missing = [k for k in dict.fromkeys(keys) if k not in known]
    if missing:
        raise NotALedgerPartitionError("; ".join(why_not_a_partition(wh, k) for k in missing))


def why_not_a_partition(wh: Warehouse, key: str) -> str:
    """Why `key` is not a ledger partition and when it can be materialized, in one line."""
    try:
        topic, ledger = ledger_of_partition(key)
    except ValueError as exc:
        return str(exc)
    states = {}
    if wh.exists(LEDGERS):
        catalog = read_catalog(wh, ["topic", "ledger_id", "state"]).to_pylist()
        states = {(r["topic"], r["ledger_id"]): r["state"] for r in catalog}
    state = states.get((topic, ledger))
    if state == "OPEN":
        return (f"ledger {key} is still OPEN (the last ledger of {topic}, still written): a ledger becomes a partition "
                f"when it closes, when {topic}'s next ledger starts; ledgers_closed_sensor (or `txnlake run`) adds it "
                "then and materializes it. Its entries so far are already in the tables every buffer run writes")
    if state == "DELETED":
        return f"ledger {key} was deleted by retention: it is no partition any more (the offload tier holds its data)"
    if state is not None:
        return (f"ledger {key} is {state} but not a partition yet: turn on ledgers_closed_sensor or run `txnlake run`, "
                "which add the closed ledgers as partitions")
    same_topic = sorted(l for t, l in states if t == topic)
    where = (f"{topic} has ledgers {same_topic[0]}..{same_topic[-1]}" if same_topic else
             f"no topic {topic!r} in the catalog" if states else "there is no `ledgers` catalog yet (`txnlake run`)")
    return f"no ledger {key} in the `ledgers` catalog ({where})"
