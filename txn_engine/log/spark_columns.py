"""Spark column expressions for the log's words: entry kinds, transaction ids, positions.

Predicates that Spark plans filter and join by (the offload, snapshots, the reader); the buffer's
rules themselves live once, in the kernel (`kernel`).
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable, Hashable, TypeVar

from pyspark import SparkContext
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from txn_engine.core.log_types import EntryType

# A broadcast to every executor (the offload's decided transactions) stays within this many bytes
# of its hash relation; past it the join shuffles (`delta_io.fits_driver` counts it).
BROADCAST_MAX_BYTES = 1 << 30

Built = TypeVar("Built")


def built_per_session(build: Callable[..., Built]) -> Callable[..., Built]:
    """`build(*args)` (hashable arguments, returning Spark columns), built once per SparkContext and
    reused: every function a column is built of costs Py4J round trips, and ingest's rules are
    hundreds of them, the same for every file of a format (docs/benchmarks.md, "Spark settings").
    Columns are unresolved expressions, shared safely by any number of frames of their session."""
    built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @functools.wraps(build)
    def cached(*args: Hashable) -> Built:
        context = SparkContext._active_spark_context
        if context is None:
            return build(*args)
        known = built.setdefault(context, {})
        if args not in known:
            known[args] = build(*args)
        return known[args]

    return cached


def is_data() -> Column:
    return F.col("entry_type") == EntryType.DATA.value


def has_txn() -> Column:
    """Transactional: both halves of the id set (ingest never stores only one)."""
    return F.col("txn_most_bits").isNotNull() & F.col("txn_least_bits").isNotNull()


def is_marker() -> Column:
    return (F.col("entry_type") != EntryType.DATA.value) & has_txn()


def has_sequence() -> Column:
    """Only DATA with both producer_id and sequence_id takes part in de-duplication."""
    return F.col("producer_id").isNotNull() & F.col("sequence_id").isNotNull()


def position_lt(ledger: Column, entry: Column, other_ledger: Column, other_entry: Column) -> Column:
    """(ledger, entry) < (other_ledger, other_entry) in log order, on two long columns. Operators
    only, so pyarrow expressions (`pc.field`) work as well: the reader's limit is one rule both ways."""
    return (ledger < other_ledger) | ((ledger == other_ledger) & (entry < other_entry))


def position_le(ledger: Column, entry: Column, other_ledger: Column, other_entry: Column) -> Column:
    """(ledger, entry) <= (other_ledger, other_entry) in log order, on two long columns."""
    return (ledger < other_ledger) | ((ledger == other_ledger) & (entry <= other_entry))


def conform(frame: DataFrame, schema: StructType) -> DataFrame:
    """Exactly the schema's columns, in its order and types."""
    return frame.select(*[F.col(f.name).cast(f.dataType).alias(f.name) for f in schema.fields])
