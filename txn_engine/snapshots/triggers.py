"""When a topic is due for a snapshot, stated once over Arrow.

`snapshot_states` (Spark) runs `due_reasons` as an Arrow UDF over its per-topic rows; the snapshot
run's pre-check (`assets.snapshots.snapshots_pending`) calls it on the `txn_snapshot_state` rows it
reads, at a later time. Spark's Python workers import this module: its imports stay light.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import pyarrow as pa
import pyarrow.compute as pc

from txn_engine.snapshots.index import as_array

# The columns `due_reasons` reads of each topic.
DUE_COLUMNS = ("has_snapshot", "unfinished", "first_due", "changes_since_snapshot", "last_snapshot_at")


@dataclass(frozen=True)
class TriggerConfig:
    """When a topic is due for a snapshot (Pulsar: transactionBufferSnapshotMaxTransactionCount,
    transactionBufferSnapshotMinTimeInMillis)."""

    max_changes: int = 1000  # max-read-position changes + aborts since the last snapshot
    interval_seconds: float = 300.0  # and at least this often while anything changed

    def __post_init__(self) -> None:
        if self.max_changes < 1:
            raise ValueError(f"max_changes must be at least 1, got {self.max_changes}")
        if self.interval_seconds <= 0:
            raise ValueError(f"interval_seconds must be positive, got {self.interval_seconds}")


def _whole(values: pa.Array) -> pa.Array:
    """Numbers as text without decimals, rounded half up (as Java's `%.0f`)."""
    return pc.round(values, round_mode="half_up").cast(pa.int64()).cast(pa.string())


def due_reasons(rows: pa.Table | pa.RecordBatch, config: TriggerConfig, now: datetime) -> pa.Array:
    """Why each topic (`DUE_COLUMNS`) is due for a snapshot at `now`, null when it is not.

    Due, in this order: its first snapshot (`first_due`: no usable snapshot and transactional
    data); an unfinished snapshot (parts without their end: its writer stopped, written again);
    with a snapshot, `max_changes` changes since it, or any change and `interval_seconds` since it.
    """
    has = pc.fill_null(as_array(rows.column("has_snapshot")), False)
    changes = pc.fill_null(as_array(rows.column("changes_since_snapshot")), 0).cast(pa.int64())
    last = as_array(rows.column("last_snapshot_at")).cast(pa.timestamp("us", "UTC")).cast(pa.int64())
    age = pc.subtract(pa.scalar(now.timestamp()), pc.divide(last.cast(pa.float64()), 1e6))
    text = changes.cast(pa.string())
    reasons = {  # in order: (condition, reason)
        "first": (as_array(rows.column("first_due")), pa.scalar("first snapshot: the topic has transactional data")),
        "unfinished": (as_array(rows.column("unfinished")),
                       pa.scalar("an unfinished snapshot (parts without their end, its writer stopped): written again")),
        "changes": (pc.and_(has, pc.greater_equal(changes, config.max_changes)),
                    pc.binary_join_element_wise(text, f" changes since the last snapshot (threshold {config.max_changes})", "")),
        "interval": (pc.and_(pc.and_(has, pc.greater(changes, 0)), pc.greater_equal(age, config.interval_seconds)),
                     pc.binary_join_element_wise(
                         text, " changes and ", _whole(age),
                         f" s since the last snapshot (interval {_whole(pa.array([float(config.interval_seconds)]))[0]} s)", "")),
    }
    conditions = pc.make_struct(*[pc.fill_null(c, False) for c, _ in reasons.values()], field_names=list(reasons))
    return pc.case_when(conditions, *[reason for _, reason in reasons.values()])


def due_inputs(states: pa.Table) -> pa.Table:
    """`DUE_COLUMNS` of `txn_snapshot_state` rows, to decide again at a later time: a topic has a
    snapshot when its state names one, is unfinished when INITIALIZING; one without a snapshot was
    written due exactly when its first snapshot was (or when unfinished, due either way)."""
    has = pc.is_valid(states["snapshot_id"])
    return pa.table({"has_snapshot": has, "unfinished": pc.equal(states["state"], "INITIALIZING"),
                     "first_due": pc.and_(pc.invert(has), pc.fill_null(states["due"], False)),
                     "changes_since_snapshot": states["changes_since_snapshot"],
                     "last_snapshot_at": states["last_snapshot_at"]})
