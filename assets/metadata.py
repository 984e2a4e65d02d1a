"""Metadata every materialization reports: rows, columns, where the table is, its Delta version."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from dagster import MetadataValue, TableColumn, TableColumnConstraints, TableSchema

from pyspark.sql import DataFrame
from pyspark.sql.types import StructType

from resources.spark import spark_startup_seconds
from txn_engine.core.schema import table_spec
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.storage.warehouse import Warehouse

# Dagster's own keys (its TableMetadataSet, not exported by dagster 1.13): the UI shows them as the
# asset's row count and column schema.
# `dagster/row_count` is the table's rows, `dagster/partition_row_count` those of the partition reported.
ROW_COUNT, PARTITION_ROW_COUNT, COLUMN_SCHEMA = "dagster/row_count", "dagster/partition_row_count", "dagster/column_schema"


def table_metadata(warehouse: Warehouse, table: str, rows: int | None = None, **extra: Any) -> dict[str, Any]:
    """Rows (by default the table's, from its Delta log), columns, location and Delta version: read
    with delta-rs from the log, where a Spark count and history cost a few Spark jobs per table."""
    tables = DeltaTables(warehouse)
    count = tables.row_count(table) if rows is None else rows
    metadata: dict[str, Any] = {
        ROW_COUNT: MetadataValue.int(count),
        "rows": count,  # `txnlake run` prints it (pipelines/cli.py)
        "table_location": MetadataValue.path(warehouse.path(table)),
        "delta_version": warehouse.version(table),
    }
    schema = tables.schema(table)
    if schema is not None:
        metadata[COLUMN_SCHEMA] = MetadataValue.table_schema(column_schema(table, schema))
    started = spark_startup_seconds()
    if started is not None:
        metadata["spark_session_start_s"] = round(started, 2)
    metadata.update(extra)
    return metadata


def column_schema(table: str, stored: StructType | None = None) -> TableSchema | None:
    """The table's columns as Dagster shows them: name, type, nullability and the description of
    `schema.TABLES` (the Delta column comments' source). `stored`: the table's actual schema (a
    materialization's), else the declared one; None for a table neither names."""
    spec = table_spec(table)
    fields = stored.fields if stored is not None else spec.schema.fields if spec is not None else None
    if fields is None:
        return None
    return TableSchema(columns=[
        TableColumn(f.name, f.dataType.simpleString(), description=spec.description(f.name) if spec else None,
                    constraints=TableColumnConstraints(nullable=f.nullable))
        for f in fields
    ])


def markdown_preview(df: DataFrame | pa.Table, limit: int = 10) -> str:
    """The first rows of a DataFrame or an Arrow table as a Markdown table, for the asset's metadata."""
    if isinstance(df, pa.Table):
        rows, columns = [tuple(r.values()) for r in df.slice(0, limit).to_pylist()], df.column_names
    else:
        rows, columns = df.limit(limit).collect(), df.columns
    if not rows:
        return "(empty)"
    header = "| " + " | ".join(columns) + " |"
    rule = "| " + " | ".join("---" for _ in columns) + " |"
    body = ["| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join([header, rule, *body])
