"""The transaction buffer's tables: txn_markers, stable_positions, aborted_txns, committed_entries.

One multi-asset computes the four from `ledger_entries` with shared work (the Spark jobs in
`txn_engine.buffer_jobs`), writes each as a Delta table, and reports the protocol violations it
found in the input. Asset checks guard the invariants.
"""

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetSpec,
    MaterializeResult,
    MetadataValue,
    asset_check,
    multi_asset,
)
from pyspark.sql import functions as F

from assets.metadata import table_metadata
from resources.spark import SparkResource
from resources.warehouse import WarehouseResource
from txn_engine.buffer_jobs import compute_buffer_tables
from txn_engine.schema import ABORTED_TXNS, COMMITTED_ENTRIES, LEDGER_ENTRIES, STABLE_POSITIONS, TXN_MARKERS

GROUP = "transaction_buffer"

DESCRIPTIONS = {
    TXN_MARKERS: "The first COMMIT/ABORT marker of each transaction on each topic.",
    STABLE_POSITIONS: "Per topic: the max read position (stable position), the last position, ongoing transactions.",
    ABORTED_TXNS: "The abort set: aborted transactions per topic with their abort marker position.",
    COMMITTED_ENTRIES: "The read-committed view: ledger order (WHERE in_stable_prefix) and commit order "
    "(ORDER BY visible_ledger_id, visible_entry_id, local_seq).",
}


@multi_asset(
    specs=[AssetSpec(t, group_name=GROUP, deps=[LEDGER_ENTRIES], description=d) for t, d in DESCRIPTIONS.items()],
)
def transaction_buffer_tables(context: AssetExecutionContext, spark: SparkResource, warehouse: WarehouseResource):
    wh = warehouse.open(spark.session())
    tables = compute_buffer_tables(wh.read(LEDGER_ENTRIES))
    violations = tables.violations
    context.log.info(f"protocol violations in ledger_entries: {violations}")
    try:
        frames = {
            TXN_MARKERS: tables.txn_markers,
            STABLE_POSITIONS: tables.stable_positions,
            ABORTED_TXNS: tables.aborted_txns,
            COMMITTED_ENTRIES: tables.committed_entries,
        }
        for table, frame in frames.items():
            wh.overwrite(table, frame)
            context.log.info(f"wrote {table}")
    finally:
        tables.unpersist()
    stable = wh.read(STABLE_POSITIONS)
    lag = stable.agg(
        F.count("*").alias("topics"),
        F.sum("ongoing_txn_count").alias("ongoing"),
    ).first()
    extra = {
        "violations": MetadataValue.json(dict(violations)),
        "topics": lag["topics"],
        "ongoing_txns": int(lag["ongoing"] or 0),
    }
    for table in frames:
        rows = wh.read(table).count()
        yield MaterializeResult(asset_key=table, metadata=table_metadata(wh, table, rows, **extra))


def _txn_key(prefix: str = ""):
    return [F.col(f"{prefix}topic"), F.col(f"{prefix}txn_most_bits"), F.col(f"{prefix}txn_least_bits")]


@asset_check(asset=STABLE_POSITIONS, description="The stable position of a topic never moves backwards.")
def stable_position_never_moves_backwards(spark: SparkResource, warehouse: WarehouseResource) -> AssetCheckResult:
    wh = warehouse.open(spark.session())
    version = wh.version(STABLE_POSITIONS)
    if not version:
        return AssetCheckResult(passed=True, metadata={"compared_versions": "first version: nothing to compare"})
    path = wh.path(STABLE_POSITIONS)
    now = wh.spark.read.format("delta").load(path)
    before = wh.spark.read.format("delta").option("versionAsOf", version - 1).load(path)
    moved_back = (
        now.alias("n")
        .join(before.alias("b"), "topic")
        .where(
            (F.col("n.max_read_ledger_id") < F.col("b.max_read_ledger_id"))
            | (
                (F.col("n.max_read_ledger_id") == F.col("b.max_read_ledger_id"))
                & (F.col("n.max_read_entry_id") < F.col("b.max_read_entry_id"))
            )
        )
        .select("topic", "b.max_read_ledger_id", "b.max_read_entry_id", "n.max_read_ledger_id", "n.max_read_entry_id")
        .collect()
    )
    return AssetCheckResult(
        passed=not moved_back,
        metadata={
            "compared_versions": f"{version - 1} -> {version}",
            "topics_moved_back": MetadataValue.json([str(tuple(r)) for r in moved_back[:20]]),
        },
    )


@asset_check(
    asset=COMMITTED_ENTRIES,
    description="committed_entries holds no entry of an aborted or ongoing transaction, and no duplicate.",
)
def committed_entries_are_committed_once(spark: SparkResource, warehouse: WarehouseResource) -> AssetCheckResult:
    wh = warehouse.open(spark.session())
    committed = wh.read(COMMITTED_ENTRIES)
    markers = wh.read(TXN_MARKERS)
    txn_rows = committed.where(F.col("txn_most_bits").isNotNull())
    commits = markers.where(F.col("outcome") == "COMMIT").select("topic", "txn_most_bits", "txn_least_bits")
    not_committed = txn_rows.join(commits, ["topic", "txn_most_bits", "txn_least_bits"], "left_anti").count()
    duplicate_positions = committed.groupBy("topic", "ledger_id", "entry_id").count().where("count > 1").count()
    duplicate_sequences = (
        committed.where(F.col("producer_id").isNotNull() & F.col("sequence_id").isNotNull())
        .groupBy("topic", "producer_id", "sequence_id")
        .count()
        .where("count > 1")
        .count()
    )
    markers_inside = committed.where(F.col("entry_type") != "DATA").count()
    return AssetCheckResult(
        passed=not (not_committed or duplicate_positions or duplicate_sequences or markers_inside),
        metadata={
            "entries_of_uncommitted_txns": not_committed,
            "duplicate_positions": duplicate_positions,
            "duplicate_sequences": duplicate_sequences,
            "markers": markers_inside,
        },
    )


@asset_check(
    asset=TXN_MARKERS,
    description="Every marker row matches a marker entry in ledger_entries, and a transaction has one outcome on all its topics.",
)
def markers_have_matching_outcomes(spark: SparkResource, warehouse: WarehouseResource) -> AssetCheckResult:
    wh = warehouse.open(spark.session())
    markers = wh.read(TXN_MARKERS)
    entries = wh.read(LEDGER_ENTRIES).select(
        "topic", "ledger_id", "entry_id", F.col("entry_type").alias("outcome"), "txn_most_bits", "txn_least_bits"
    )
    unmatched = markers.join(
        entries, ["topic", "ledger_id", "entry_id", "outcome", "txn_most_bits", "txn_least_bits"], "left_anti"
    ).count()
    split = (
        markers.groupBy("txn_most_bits", "txn_least_bits")
        .agg(F.countDistinct("outcome").alias("outcomes"))
        .where("outcomes > 1")
    )
    split_txns = [f"{r.txn_most_bits}:{r.txn_least_bits}" for r in split.limit(20).collect()]
    return AssetCheckResult(
        passed=unmatched == 0 and not split_txns,
        # Unmatched rows mean the table is wrong; a split outcome is the input's fault (a broken
        # coordinator), worth an alarm but not a wrong table.
        severity=AssetCheckSeverity.ERROR if unmatched else AssetCheckSeverity.WARN,
        metadata={"markers_without_entry": unmatched, "txns_with_split_outcome": MetadataValue.json(split_txns)},
    )


BUFFER_CHECKS = [
    stable_position_never_moves_backwards,
    committed_entries_are_committed_once,
    markers_have_matching_outcomes,
]
