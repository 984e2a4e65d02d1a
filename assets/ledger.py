"""Assets of the raw log: `ledger_entries` (with `quarantine_entries`) and the `ledgers` catalog."""


from dagster import AssetExecutionContext, AssetSpec, Config, Failure, MaterializeResult, MetadataValue, asset, multi_asset
from pydantic import Field

from assets.metadata import table_metadata
from resources.spark import SparkResource
from resources.warehouse import WarehouseResource
from txn_engine.delta_io import overwrite_small
from txn_engine.ingest import gap_warnings, ingest_files
from txn_engine.ledgers import current_ledger_catalog
from txn_engine.schema import LEDGER_ENTRIES, LEDGERS, QUARANTINE_ENTRIES

GROUP = "ledger"


class IngestConfig(Config):
    paths: list[str] = Field(
        default_factory=list,
        description="Raw ledger files or folders to ingest (.jsonl, .csv, .parquet).",
    )


@multi_asset(
    specs=[
        AssetSpec(
            LEDGER_ENTRIES,
            group_name=GROUP,
            description="Every entry of every ledger, validated; appended by ingest and by the engine.",
        ),
        AssetSpec(
            QUARANTINE_ENTRIES,
            group_name=GROUP,
            description="Input rows that failed validation, with rule, reason, file and line.",
        ),
    ],
)
def ingest_ledger_entries(
    context: AssetExecutionContext, config: IngestConfig, spark: SparkResource, warehouse: WarehouseResource
):
    """Ingest raw ledger files: valid rows to ledger_entries, invalid ones to quarantine_entries."""
    if not config.paths:
        raise Failure(
            description="no input files: set config `paths` to the raw ledger files to ingest "
            "(or run `txnlake ingest FILE...`)."
        )
    wh = warehouse.open(spark.session())
    summary = ingest_files(wh, config.paths)
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
    }
    yield MaterializeResult(asset_key=LEDGER_ENTRIES, metadata=table_metadata(wh, LEDGER_ENTRIES, **common))
    yield MaterializeResult(asset_key=QUARANTINE_ENTRIES, metadata=table_metadata(wh, QUARANTINE_ENTRIES, **common))


@asset(
    name=LEDGERS,
    group_name=GROUP,
    deps=[LEDGER_ENTRIES],
    description="The ledger catalog: state, entry range, entry count and bytes per (topic, ledger).",
)
def ledgers(context: AssetExecutionContext, spark: SparkResource, warehouse: WarehouseResource) -> MaterializeResult:
    wh = warehouse.open(spark.session())
    catalog = current_ledger_catalog(wh).cache()
    try:
        overwrite_small(wh, LEDGERS, catalog)  # a row per ledger
        states = {r["state"]: r["n"] for r in catalog.groupBy("state").count().withColumnRenamed("count", "n").collect()}
        rows = sum(states.values())
    finally:
        catalog.unpersist()
    context.log.info(f"ledgers: {rows} ledgers ({states})")
    return MaterializeResult(
        metadata=table_metadata(wh, LEDGERS, rows, ledgers_by_state=MetadataValue.json(states))
    )
