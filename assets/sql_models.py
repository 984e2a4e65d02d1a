"""One Dagster asset per `dbt-free-sql/*.sql` model; upstream deps come from the SQL itself."""

from dagster import AssetExecutionContext, AssetsDefinition, AssetSpec, Definitions, MaterializeResult, MetadataValue, asset

from assets.metadata import markdown_preview, table_metadata
from resources.spark import SparkResource
from resources.warehouse import WarehouseResource
from txn_engine.core.schema import stored_schema
from txn_engine.storage.delta_io import DeltaTables, overwrite_small
from txn_engine.sql.models import SqlModel, discover_models, run_model, run_model_in_driver, runs_in_driver, upstream_tables

GROUP = "sql_models"


def sql_view_spec(view: SqlModel) -> AssetSpec:
    """A view: in the graph with what it reads and its columns, materialized by nothing (no table)."""
    return AssetSpec(view.name, group_name=GROUP, deps=list(view.reads), description=view.description,
                     metadata={"sql_file": MetadataValue.path(str(view.path)), "sql": MetadataValue.md(f"```sql\n{view.sql}\n```"),
                               "materialized": "view: `txnlake sql` and the models read its query, nothing is stored"})


def sql_model_asset(model: SqlModel, named_views: dict[str, SqlModel]) -> AssetsDefinition:
    @asset(
        name=model.name,
        group_name=GROUP,
        deps=list(upstream_tables(model, named_views)),  # through a view: the view and what it reads
        description=model.description,
        metadata={"sql_file": MetadataValue.path(str(model.path)), "sql": MetadataValue.md(f"```sql\n{model.sql}\n```")},
    )
    def _model(context: AssetExecutionContext, spark: SparkResource, warehouse: WarehouseResource) -> MaterializeResult:
        wh = warehouse.open(spark.session())
        if runs_in_driver(wh, model):
            table = run_model_in_driver(wh, model)
            rows = DeltaTables(wh).overwrite(model.name, table, stored_schema(model.name))
            preview, computed_by = markdown_preview(table), "driver"
        else:
            result = run_model(wh, model).cache()
            try:
                # Aggregates: a row per topic or ledger. In the declared columns, as the driver writes them.
                overwrite_small(wh, model.name, result, schema=stored_schema(model.name))
                rows = result.count()
                preview, computed_by = markdown_preview(result), "spark"
            finally:
                result.unpersist()
        context.log.info(f"{model.name}: {rows} rows (computed by {computed_by})")
        return MaterializeResult(metadata=table_metadata(wh, model.name, rows, preview=MetadataValue.md(preview),
                                                         computed_by=computed_by))

    return _model


def sql_model_assets() -> list[AssetsDefinition | AssetSpec]:
    models = discover_models()
    named_views = {m.name: m for m in models if m.view}
    return [sql_view_spec(m) if m.view else sql_model_asset(m, named_views) for m in models]


defs = Definitions(assets=sql_model_assets())
