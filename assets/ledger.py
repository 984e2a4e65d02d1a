"""Assets of the raw log: `ledger_entries` (with `quarantine_entries`) and the `ledgers` catalog."""


from collections import Counter

from dagster import (
    Definitions,
    AssetExecutionContext,
    AssetKey,
    AssetMaterialization,
    AssetSelection,
    AssetSpec,
    Config,
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    Failure,
    MaterializeResult,
    MetadataValue,
    OpExecutionContext,
    RunsFilter,
    asset,
    define_asset_job,
    job,
    op,
)
from pydantic import Field

from assets.metadata import table_metadata
from resources.spark import SparkResource
from resources.warehouse import WarehouseResource
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.log.ingest import IngestSummary, gap_warnings, ingest_files
from txn_engine.log.kafka_import import import_kafka, partition_folders
from txn_engine.log.ledgers import catalog_source_versions, write_ledger_catalog
from txn_engine.core.schema import LEDGER_ENTRIES, LEDGERS, LEDGERS_SCHEMA, QUARANTINE_ENTRIES

GROUP = "ledger"
# Metadata of an `import_kafka` run's ledger_entries materialization: the partition folders it read,
# which the `aborted_txns_match_kafka_index` check compares with.
KAFKA_PARTITION_FOLDERS = "kafka_partition_folders"


class IngestConfig(Config):
    paths: list[str] = Field(
        default_factory=list,
        description="Raw ledger files or folders to ingest (.jsonl, .csv, .parquet).",
    )


# The raw log is written by jobs, not by materializing the asset graph: `ingest` (raw files) and the
# engine (`demo`, producers). So these are external assets whose materializations those jobs
# report, and the UI's "Materialize all" recomputes what is derived from them, without asking for
# files or writing a demo workload into the warehouse.
LEDGER_SPECS = [
    AssetSpec(
        LEDGER_ENTRIES,
        group_name=GROUP,
        description="Every entry of every ledger, validated; appended by the `ingest` job (`txnlake ingest`) and by "
        "the transaction engine (the `demo` job, producers), which report its materializations.",
    ),
    AssetSpec(
        QUARANTINE_ENTRIES,
        group_name=GROUP,
        description="Input rows that failed validation, with rule, reason, file and line (written by the `ingest` job).",
    ),
]


@op(name="ingest_ledger_entries", description="Validate raw ledger files and append them to ledger_entries.")
def ingest_ledger_entries(
    context: OpExecutionContext, config: IngestConfig, spark: SparkResource, warehouse: WarehouseResource
) -> None:
    """Ingest raw ledger files: valid rows to ledger_entries, invalid ones to quarantine_entries."""
    wh = _open_for_append(config.paths, spark, warehouse, "no input files: set config `paths` to the raw ledger "
                          "files to ingest (or run `txnlake ingest FILE...`).")
    _report_append(context, wh, ingest_files(wh, config.paths))


def _open_for_append(paths: list[str], spark: SparkResource, warehouse: WarehouseResource, no_input: str):
    if not paths:
        raise Failure(description=no_input)
    return warehouse.open(spark.session())


def _report_append(context: OpExecutionContext, wh, summary: IngestSummary, **extra) -> None:
    """Log an append's summary and report the materializations of the two tables it wrote."""
    for line in summary.lines():
        context.log.info(line)
    if summary.entry_id_gaps:
        context.log.warning("\n".join(gap_warnings(summary.entry_id_gaps)))
    common = {
        "ingest_id": summary.ingest_id,
        "files": MetadataValue.json(summary.files),
        "rows_read": summary.rows_read,
        "rows_written": summary.rows_written,
        "rows_already_present": summary.rows_already_present,
        "rows_repeated_in_input": summary.rows_repeated_in_input,
        "rows_quarantined": summary.rows_quarantined,
        "rows_in_deleted_ledgers": summary.rows_in_deleted_ledgers,
        "quarantine_by_rule": MetadataValue.json(summary.quarantine_by_rule),
        # A warning, not an error: ledgers written to whose entry ids are not dense.
        "entry_id_gaps": MetadataValue.json(summary.entry_id_gaps),
        **extra,
    }
    for table in (LEDGER_ENTRIES, QUARANTINE_ENTRIES):
        context.log_event(AssetMaterialization(asset_key=table, metadata=table_metadata(wh, table, **common)))


@job(name="ingest", description="Ingest raw ledger files: set ops.ingest_ledger_entries.config.paths (what `txnlake "
     "ingest` does).")
def ingest_job():
    ingest_ledger_entries()


class KafkaImportConfig(Config):
    paths: list[str] = Field(
        default_factory=list,
        description="A Kafka log directory, <topic>-<partition> folders or .log segment files (any URI Spark reads).",
    )


@op(name="import_kafka_segments", description="Import Kafka log segments into ledger_entries (docs/kafka-import.md).")
def import_kafka_segments(
    context: OpExecutionContext, config: KafkaImportConfig, spark: SparkResource, warehouse: WarehouseResource
) -> None:
    wh = _open_for_append(config.paths, spark, warehouse, "no input: set config `paths` to a Kafka log directory, "
                          "partition folders or segment files (or run `txnlake import-kafka PATH...`).")
    result = import_kafka(wh, config.paths, progress=context.log.info)
    _report_append(context, wh, result.ingest, partitions=MetadataValue.json(result.ingest.rows_by_topic),
                   **{KAFKA_PARTITION_FOLDERS: MetadataValue.json(partition_folders([s.path for s in result.segments]))})


def imported_kafka_partitions(instance: DagsterInstance) -> list[str]:
    """The `<topic>-<partition>` folders every successful `import_kafka` run of this instance
    imported from, from those runs' `ledger_entries` materializations (not every ingest's)."""
    folders: set[str] = set()
    runs = instance.get_run_records(RunsFilter(job_name="import_kafka", statuses=[DagsterRunStatus.SUCCESS]))
    for run in runs:
        events = instance.get_records_for_run(run.dagster_run.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION)
        for record in events.records:
            materialization = record.event_log_entry.asset_materialization
            if materialization is not None and materialization.asset_key == AssetKey(LEDGER_ENTRIES):
                value = materialization.metadata.get(KAFKA_PARTITION_FOLDERS)
                folders.update(value.value if value is not None else [])
    return sorted(folders)


@job(name="import_kafka", description="Import a Kafka log: set ops.import_kafka_segments.config.paths (what `txnlake "
     "import-kafka` does).")
def import_kafka_job():
    import_kafka_segments()


@asset(
    name=LEDGERS,
    group_name=GROUP,
    deps=[LEDGER_ENTRIES],
    description="The ledger catalog: state, entry range, entry count and bytes per (topic, ledger).",
)
def ledgers(context: AssetExecutionContext, spark: SparkResource, warehouse: WarehouseResource) -> MaterializeResult:
    wh = warehouse.open(spark.session())
    sources = catalog_source_versions(wh)  # before reading them: what `stale_catalog` compares with
    write_ledger_catalog(wh, commit_metadata=sources)  # a row per ledger
    # Counted from the table written, by delta-rs: no second Spark job.
    states = dict(Counter(DeltaTables(wh).read(LEDGERS, LEDGERS_SCHEMA, ["state"])["state"].to_pylist()))
    rows = sum(states.values())
    context.log.info(f"ledgers: {rows} ledgers ({states})")
    return MaterializeResult(
        metadata=table_metadata(wh, LEDGERS, rows, ledgers_by_state=MetadataValue.json(states))
    )


ledgers_catalog_job = define_asset_job(
    "ledgers_catalog",
    selection=AssetSelection.assets(LEDGERS),
    description="Materialize the `ledgers` catalog from ledger_entries (ledgers_closed_sensor asks for it when "
                "the catalog is stale: after an ingest, the engine's appends, an offload or a retention run).",
)


defs = Definitions(assets=[*LEDGER_SPECS, ledgers], jobs=[ingest_job, import_kafka_job, ledgers_catalog_job])
