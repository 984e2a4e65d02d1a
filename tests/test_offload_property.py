"""Property: for random histories, reading through the tier and the hot ledgers equals the reference.

Each example is a batch of histories, one topic each, offloaded and read together (one set of
Spark jobs per example, not per history). After the offload, and again after retention deleted
every offloaded ledger but the newest (to the engine's consumer, and to the reader once the buffer
was recomputed over what is left), every topic reads exactly as the reference
`TopicTransactionBuffer.read_committed` over its whole history.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from txn_engine.buffer.refresh import ledger_inventory, refresh_buffer
from txn_engine.tier.consumer import Consumer
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.log.ledgers import write_ledger_catalog
from txn_engine.core.log_types import EntryType, LogEntry, Violation
from txn_engine.tier.offload import FROM_BUFFER_STATE, offload_ledgers
from txn_engine.core.positions import EARLIEST
from txn_engine.tier.reader import TopicReader
from txn_engine.tier.retention import RetentionPolicy, apply_retention
from txn_engine.core.schema import COMMITTED_ENTRIES, LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA, LEDGER_ENTRY_COLUMNS
from txn_engine.reference.transaction_buffer import TopicTransactionBuffer, replay

# One step: (starts a new ledger?, what to append, which open transaction / earlier send it picks).
STEP = st.tuples(st.booleans(), st.sampled_from(["plain", "retry", "data", "data", "commit", "abort"]), st.integers(0, 5))
HISTORIES = st.lists(st.lists(STEP, min_size=1, max_size=14), min_size=4, max_size=7)


def build_history(topic: str, steps, first_ledger: int) -> list[LogEntry]:
    entries: list[LogEntry] = []
    ledger, entry_id, seq, next_txn = first_ledger, 0, 0, 0
    open_txns: list[tuple[int, int]] = []
    sent: list[int] = []
    for new_ledger, op, pick in steps:
        if new_ledger and entries:
            ledger, entry_id = ledger + 1, 0
        common = dict(topic=topic, ledger_id=ledger, entry_id=entry_id)
        if op in ("commit", "abort") and open_txns:
            txn = open_txns.pop(pick % len(open_txns))
            entries.append(LogEntry(**common, entry_type=op.upper(), txn_most_bits=txn[0], txn_least_bits=txn[1]))
        elif op == "data" and (open_txns and pick % 2 or not open_txns):
            if not open_txns or pick % 3 == 0:
                open_txns.append((first_ledger, next_txn))
                next_txn += 1
            txn = open_txns[pick % len(open_txns)]
            entries.append(LogEntry(**common, entry_type="DATA", txn_most_bits=txn[0], txn_least_bits=txn[1],
                                    producer_id=2, sequence_id=seq, payload=f"{topic}-{seq}".encode()))
            seq += 1
        elif op == "retry" and sent:
            again = sent[pick % len(sent)]  # a retried send: same producer and sequence id, later position
            entries.append(LogEntry(**common, entry_type="DATA", producer_id=1, sequence_id=again, payload=f"{topic}-p{again}".encode()))
        else:
            entries.append(LogEntry(**common, entry_type="DATA", producer_id=1, sequence_id=seq, payload=f"{topic}-p{seq}".encode()))
            sent.append(seq)
            seq += 1
        entry_id += 1
    return entries


def reference(entries: list[LogEntry]) -> dict[str, list[tuple]]:
    return {topic: [(e.ledger_id, e.entry_id, e.payload) for e in buffer.read_committed(EARLIEST)]
            for topic, buffer in replay(entries).items()}


COUNTED = ("entries_before", "entries_kept", "dropped_markers", "dropped_aborted", "dropped_duplicates", "dropped_other")


def reference_manifest(entries: list[LogEntry]) -> dict[tuple[str, int], Counter]:
    """Per ledger, the manifest's counts as the reference buffer meets each entry of the topic in
    order: a marker, a retried send or late data (the violation it counts), else DATA that ends up
    visible, aborted, or still ongoing."""
    counts: dict[tuple[str, int], Counter] = {}
    for topic in sorted({e.topic for e in entries}):
        buffer, data = TopicTransactionBuffer(topic), []
        for e in sorted((e for e in entries if e.topic == topic), key=lambda e: e.position):
            before = Counter(buffer.violations)
            buffer.append(e)
            met = buffer.violations - before
            count = counts.setdefault((topic, e.ledger_id), Counter(dict.fromkeys(COUNTED, 0)))
            count["entries_before"] += 1
            reason = ("dropped_markers" if e.is_marker else "dropped_duplicates" if met[Violation.DUPLICATE]
                      else "dropped_other" if met[Violation.DATA_AFTER_MARKER] else None)
            if reason:
                count[reason] += 1
            else:
                data.append(e)
        visible = {c.entry.position for c in buffer.committed_entries()}
        outcome = {txn: m.outcome for txn, m in buffer.markers.items()}
        for e in data:
            counts[(topic, e.ledger_id)]["entries_kept" if e.position in visible else "dropped_aborted"
                                         if outcome.get(e.txn_id) == EntryType.ABORT else "ongoing"] += 1
    return counts


def write_catalog(warehouse) -> None:
    """The `ledgers` catalog of the log as it is, as `txnlake run` writes it before the buffer runs
    (the buffer's scope and a read's budget come from it)."""
    write_ledger_catalog(warehouse)


def read_all(warehouse, topics, **read_budget) -> dict[str, list[tuple]]:
    reader = TopicReader(warehouse, **read_budget)
    assert {reader.fits_driver(t, EARLIEST, reader.published(t)) for t in topics} <= {not read_budget}  # the path asked for
    return {t: [(e.ledger_id, e.entry_id, bytes(e.payload)) for e in reader.read(t).entries] for t in topics}


def consume_all(warehouse, topics) -> dict[str, list[tuple]]:
    return {t: [(e.ledger_id, e.entry_id, e.payload) for e in Consumer(DeltaTables(warehouse), t).read()] for t in topics}


@settings(max_examples=2, deadline=None, database=None, phases=(Phase.explicit, Phase.generate), suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(histories=HISTORIES)
def test_tier_plus_hot_reads_equal_the_reference(production_spark, warehouse, histories):
    # Ledger ids are unique across topics, as BookKeeper's are: topic i uses ids from 100*i.
    entries = [e for i, steps in enumerate(histories) for e in build_history(f"h{i}", steps, 100 * (i + 1))]
    rows = [tuple(getattr(e, c) for c in LEDGER_ENTRY_COLUMNS) for e in entries]
    warehouse.overwrite(LEDGER_ENTRIES, warehouse.spark.createDataFrame(rows, LEDGER_ENTRIES_SCHEMA))
    for table in ("offloaded_entries", "offload_manifest", "ledger_states", "deleted_ledgers", "ledgers"):
        warehouse.delete(table, "true")  # a fresh warehouse per example
    expected = reference(entries)
    write_catalog(warehouse)
    refresh_buffer(warehouse, ledger_inventory(warehouse), full=True)
    # The buffer's state describes this log, so the offload decides from it and copies from its
    # committed_entries (the differential check against deciding from the log itself is in test_offload).
    result = offload_ledgers(warehouse)
    assert (result.facts_from, result.kept_from) == (FROM_BUFFER_STATE, COMMITTED_ENTRIES)
    assert read_all(warehouse, expected) == expected  # in the process (delta-rs, Arrow)
    assert read_all(warehouse, expected, driver_max_bytes=0) == expected  # on Spark
    # The manifest's counts are the reference's, ledger by ledger (an offloaded ledger holds nothing ongoing).
    by_reference = reference_manifest(entries)
    assert {(r["topic"], r["ledger_id"]): {c: r[c] for c in COUNTED} for r in result.manifest} == {
        key: dict(by_reference[key]) for key in result.offloaded}
    apply_retention(warehouse, RetentionPolicy(keep_ledgers=1))
    # The engine's consumer (no Spark) reads the same: deleted ledgers from the tier, the rest decided
    # with the facts the buffer's state kept of them.
    assert consume_all(warehouse, expected) == expected
    write_catalog(warehouse)
    refresh_buffer(warehouse, ledger_inventory(warehouse))  # incremental: the topics that lost ledgers
    assert read_all(warehouse, expected) == expected  # in the process (delta-rs, Arrow)
    assert read_all(warehouse, expected, driver_max_bytes=0) == expected  # on Spark
