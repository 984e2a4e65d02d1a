"""The transaction buffer's tables: txn_markers, stable_positions, aborted_txns, committed_entries.

One multi-asset, partitioned by ledger (`LEDGER_PARTITIONS`), computes the four from
`ledger_entries` (the kernel, `txn_engine.buffer.kernel`, driven incrementally by
`txn_engine.buffer.refresh`): a run over a ledger range recomputes those ledgers plus whatever the
catalog shows changed, so the tables always describe everything in `ledger_entries`; a run over
every partition is a full recompute, a backfill one run per range. The run reports the protocol
violations in the ledgers it recomputed and records as materialized every known partition it
recomputed beyond its range; each partition's materialization carries that ledger's own rows
(`dagster/partition_row_count`), the table's and the run's figures beside them. Asset checks guard
the invariants. One buffer run at a time: the buffer lock, and the Dagster pool
`transaction_buffer`, so the daemon queues a second run (docs/transaction-buffer.md, "Concurrency").
"""

from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    AssetKey,
    AssetMaterialization,
    AssetSpec,
    BackfillPolicy,
    MaterializeResult,
    MetadataValue,
    asset_check,
    multi_asset,
)
import pyarrow.compute as pc

from assets.ledger import imported_kafka_partitions
from assets.metadata import PARTITION_ROW_COUNT, table_metadata
from assets.partitions import LEDGER_PARTITIONS, check_partitions_exist, requested_partition_keys
from resources.spark import SparkResource
from resources.warehouse import WarehouseResource
from txn_engine.buffer.checks import committed_once, markers_match, stable_moves_back
from txn_engine.buffer.ledger_rows import rows_by_ledger, stable_positions_by_topic
from txn_engine.buffer.refresh import refresh_buffer
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.core.errors import TxnlakeError
from txn_engine.log.kafka_import import verify_against_index
from txn_engine.core.positions import ledger_of_partition
from txn_engine.core.schema import (
    ABORTED_TXNS,
    COMMITTED_ENTRIES,
    LEDGER_ENTRIES,
    LEDGERS,
    STABLE_POSITIONS,
    STABLE_POSITIONS_SCHEMA,
    TXN_MARKERS,
)

GROUP = "transaction_buffer"
# The Dagster pool of the buffer's runs: one at a time (they would wait on the buffer lock anyway).
POOL = "transaction_buffer"

DESCRIPTIONS = {
    TXN_MARKERS: "The first COMMIT/ABORT marker of each transaction on each topic.",
    STABLE_POSITIONS: "Per topic: the max read position (stable position), the last position, ongoing transactions.",
    ABORTED_TXNS: "The abort set: aborted transactions per topic with their abort marker position.",
    COMMITTED_ENTRIES: "The read-committed view: ledger order (WHERE in_stable_prefix) and commit order "
    "(ORDER BY visible_ledger_id, visible_entry_id, local_seq).",
}


@multi_asset(
    specs=[AssetSpec(t, group_name=GROUP, deps=[LEDGER_ENTRIES, LEDGERS], description=d) for t, d in DESCRIPTIONS.items()],
    partitions_def=LEDGER_PARTITIONS,
    backfill_policy=BackfillPolicy.single_run(),
    pool=POOL,
)
def transaction_buffer_tables(context: AssetExecutionContext, spark: SparkResource, warehouse: WarehouseResource):
    keys = context.instance.get_dynamic_partitions(LEDGER_PARTITIONS.name)
    if not (context.has_partition_key or context.has_partition_key_range):
        raise NoLedgerPartitionError(no_partition_message(len(keys)))
    # Started only if the run needs Spark: an incremental run small enough for the driver does not.
    wh = warehouse.open(spark.session)
    # A run of one key the instance does not hold reaches this step: say why it is no partition.
    check_partitions_exist(wh, context.instance, requested_partition_keys(context.run.tags))
    # The range as Dagster resolves it (partition order: the order keys were added, which is not
    # ledger order across topics), so the ledgers computed are the partitions marked materialized.
    in_range = context.partition_keys
    every_partition = bool(keys) and set(in_range) == set(keys)
    # The catalog is read once the run holds the buffer lock (a run may wait for another).
    refresh = refresh_buffer(wh, ledgers=sorted({ledger_of_partition(k)[1] for k in in_range}), full=every_partition)
    context.log.info(f"transaction buffer: {refresh.summary()}; protocol violations there: {refresh.violations}")
    # A run replaces rows by ledger id: every topic's ledger of a recomputed id was recomputed.
    recomputed_ids = set(refresh.ledgers)
    recomputed = [k for k in keys if ledger_of_partition(k)[1] in recomputed_ids]
    facts = PartitionFacts(wh, [*in_range, *recomputed])
    ongoing = DeltaTables(wh).read(STABLE_POSITIONS, STABLE_POSITIONS_SCHEMA, ["ongoing_txn_count"])["ongoing_txn_count"]
    extra = {
        "mode": "full" if refresh.full else "incremental",
        "written_by": refresh.written_by,
        "computed_by": refresh.computed_by,
        "ledgers_recomputed": len(refresh.ledgers),
        "deleted_ledgers_retained": refresh.retained_ledgers,
        "violations": MetadataValue.json(dict(refresh.violations)),
        "table_topics": len(ongoing),
        "table_ongoing_txns": int(pc.sum(ongoing).as_py() or 0),
    }
    for table in DESCRIPTIONS:
        for key in in_range:
            context.add_asset_metadata(facts.of(table, key), asset_key=table, partition_key=key)
        # The table's figures (`dagster/row_count` is the whole table's, as Dagster defines it) and
        # the run's, under every partition of the range; each partition's own rows above.
        metadata = table_metadata(wh, table, **extra)
        del metadata["rows"]
        yield MaterializeResult(asset_key=table, metadata=metadata)
    # After the run's own materializations (those of its range), which carry the tables' metadata.
    _record_partitions_beyond_range(context, refresh, [k for k in recomputed if k not in set(in_range)], in_range, facts)


class PartitionFacts:
    """What each buffer table holds for a ledger partition: its rows (`dagster/partition_row_count`),
    and for `stable_positions` its topic's positions; read once for all the partitions of a run."""

    def __init__(self, wh, keys: list[str]):
        self._rows = rows_by_ledger(wh, [ledger_of_partition(k) for k in keys])
        self._stable = stable_positions_by_topic(wh)

    def of(self, table: str, key: str) -> dict:
        topic, ledger = ledger_of_partition(key)
        facts: dict = {"topic": topic, "ledger_id": ledger}
        if table == STABLE_POSITIONS:  # a row per topic: the partition's topic's row
            stable = self._stable.get(topic)
            facts[PARTITION_ROW_COUNT] = MetadataValue.int(0 if stable is None else 1)
            facts.update(stable or {})
        else:
            facts[PARTITION_ROW_COUNT] = MetadataValue.int(self._rows[table].get((topic, ledger), 0))
        return facts


class NoLedgerPartitionError(TxnlakeError):
    """A buffer run launched without a ledger partition (e.g. `derive_all` from the UI with none picked)."""


def no_partition_message(known_partitions: int) -> str:
    """What to do when the buffer tables are launched without a ledger partition."""
    where = (f"launch it over ledger partitions ({known_partitions} known): pick a partition or a range in the "
             "launchpad, or backfill a range (all partitions: a full recompute)" if known_partitions else
             "the instance has no ledger partition yet: ledgers_closed_sensor adds them as ledgers close "
             "(turn it on), or `txnlake run` does")
    return ("the transaction buffer tables are partitioned by ledger and this run has no partition; "
            f"{where}; or run `txnlake run`, which derives every table over all closed ledgers")


def _record_partitions_beyond_range(context: AssetExecutionContext, refresh, beyond: list[str], in_range: list[str],
                                    facts: PartitionFacts) -> None:
    """Mark materialized the known partitions the run recomputed outside its range, each with its own rows.

    A run recomputes more than it is asked (`plan_scope`): every ledger when it is a full run (the
    first run on a warehouse, whatever its range), the ledgers the catalog shows changed otherwise,
    and another topic's ledger of the same id. Their tables are rewritten either way; without these
    events Dagster would show those partitions as never (or earlier) materialized.
    """
    if not beyond:
        return
    run_range = in_range[0] if len(in_range) == 1 else f"{in_range[0]}...{in_range[-1]}"
    reason = ("full run: every ledger recomputed" if refresh.full
              else "changed (the ledgers catalog differs from what the buffer state held), or another topic's "
              "ledger of the same id")
    for key in beyond:
        for table in DESCRIPTIONS:
            context.log_event(AssetMaterialization(
                asset_key=AssetKey(table), partition=key,
                metadata={**facts.of(table, key), "recomputed_by_run_range": run_range, "reason": reason},
            ))
    context.log.info(f"also recomputed, outside the range {run_range} ({reason}): {beyond}")


@asset_check(asset=STABLE_POSITIONS, description="The stable position of a topic never moves backwards.")
def stable_position_never_moves_backwards(warehouse: WarehouseResource) -> AssetCheckResult:
    moves = stable_moves_back(warehouse.open())
    if moves is None:
        return AssetCheckResult(passed=True, metadata={"compared_versions": "first version: nothing to compare"})
    return AssetCheckResult(
        passed=not moves.moved_back,
        metadata={"compared_versions": moves.compared_versions,
                  "topics_moved_back": MetadataValue.json(moves.moved_back[:20])},
    )


@asset_check(
    asset=COMMITTED_ENTRIES,
    description="committed_entries holds no entry of an aborted or ongoing transaction, and no duplicate "
    "(the rows the last buffer run wrote, against the rest; every row after a full run).",
)
def committed_entries_are_committed_once(spark: SparkResource, warehouse: WarehouseResource) -> AssetCheckResult:
    report = committed_once(warehouse.open(spark.session))
    return AssetCheckResult(
        passed=report.passed,
        metadata={
            "entries_of_uncommitted_txns": report.entries_of_uncommitted_txns,
            "duplicate_positions": report.duplicate_positions,
            "duplicate_sequences": report.duplicate_sequences,
            "markers": report.markers,
            "checked": report.checked,
        },
    )


@asset_check(
    asset=TXN_MARKERS,
    description="Every marker row matches a marker entry in ledger_entries, and a transaction has one outcome on all "
    "its topics (the markers the last buffer run wrote; every marker after a full run).",
)
def markers_have_matching_outcomes(spark: SparkResource, warehouse: WarehouseResource) -> AssetCheckResult:
    report = markers_match(warehouse.open(spark.session))
    return AssetCheckResult(
        passed=report.markers_without_entry == 0 and not report.txns_with_split_outcome,
        # Unmatched rows mean the table is wrong; a split outcome is the input's fault (a broken
        # coordinator), worth an alarm but not a wrong table.
        severity=AssetCheckSeverity.ERROR if report.markers_without_entry else AssetCheckSeverity.WARN,
        metadata={"markers_without_entry": report.markers_without_entry,
                  "txns_with_split_outcome": MetadataValue.json(report.txns_with_split_outcome),
                  "checked": report.checked},
    )


@asset_check(
    asset=ABORTED_TXNS,
    description="aborted_txns equals the .txnindex files of the Kafka partitions imported (`txnlake import-kafka "
    "--verify`): Kafka's own record of every aborted transaction, (producer id, first offset, last offset). An ABORT "
    "marker without data before it is in aborted_txns only, as expected (docs/kafka-import.md).",
)
def aborted_txns_match_kafka_index(context: AssetCheckExecutionContext, spark: SparkResource,
                                   warehouse: WarehouseResource) -> AssetCheckResult:
    folders = imported_kafka_partitions(context.instance)
    comparison = verify_against_index(warehouse.open(spark.session), folders, skip_missing=True)
    return AssetCheckResult(
        passed=comparison.equal,
        metadata={"kafka_partitions": MetadataValue.json(folders),
                  "only_in_index": MetadataValue.json([list(a) for a in comparison.only_in_index[:20]]),
                  "only_in_aborted_txns": MetadataValue.json([list(a) for a in comparison.only_in_aborted_txns[:20]]),
                  "aborts_without_data": len(comparison.marker_only),
                  "aborts_cleaned_by_compaction": len(comparison.cleaned)},
    )


BUFFER_CHECKS = [
    stable_position_never_moves_backwards,
    committed_entries_are_committed_once,
    markers_have_matching_outcomes,
    aborted_txns_match_kafka_index,
]
