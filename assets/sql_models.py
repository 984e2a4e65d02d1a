"""One Dagster asset per `dbt-free-sql/*.sql` model; upstream deps come from the SQL itself."""

from dagster import Definitions, AssetExecutionContext, AssetsDefinition, MaterializeResult, MetadataValue, asset

from assets.metadata import markdown_preview, table_metadata
from resources.spark import SparkResource
from resources.warehouse import WarehouseResource
from txn_engine.storage.delta_io import overwrite_small
from txn_engine.sql.models import SqlModel, discover_models, run_model

GROUP = "sql_models"


def sql_model_asset(model: SqlModel) -> AssetsDefinition:
    @asset(
        name=model.name,
        group_name=GROUP,
        deps=list(model.reads),
        description=model.description,
        metadata={"sql_file": MetadataValue.path(str(model.path)), "sql": MetadataValue.md(f"```sql\n{model.sql}\n```")},
    )
    def _model(context: AssetExecutionContext, spark: SparkResource, warehouse: WarehouseResource) -> MaterializeResult:
        wh = warehouse.open(spark.session())
        result = run_model(wh, model).cache()
        try:
            overwrite_small(wh, model.name, result)  # aggregates: a row per topic or ledger
            rows = result.count()
            preview = markdown_preview(result)
        finally:
            result.unpersist()
        context.log.info(f"{model.name}: {rows} rows")
        return MaterializeResult(metadata=table_metadata(wh, model.name, rows, preview=MetadataValue.md(preview)))

    return _model


def sql_model_assets() -> list[AssetsDefinition]:
    return [sql_model_asset(m) for m in discover_models()]


defs = Definitions(assets=sql_model_assets())
