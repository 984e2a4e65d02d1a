"""Metadata every materialization reports: rows, where the table is, its Delta version."""

from __future__ import annotations

from typing import Any

from dagster import MetadataValue

from resources.spark import spark_startup_seconds
from txn_engine.delta_io import DeltaTables
from txn_engine.warehouse import Warehouse


def table_metadata(warehouse: Warehouse, table: str, rows: int | None = None, **extra: Any) -> dict[str, Any]:
    """Rows (by default the table's, from its Delta log), location and Delta version: read with
    delta-rs, where a Spark count and history cost a few Spark jobs per table."""
    metadata: dict[str, Any] = {
        "rows": DeltaTables(warehouse).row_count(table) if rows is None else rows,
        "table_location": MetadataValue.path(warehouse.path(table)),
        "delta_version": warehouse.version(table),
    }
    started = spark_startup_seconds()
    if started is not None:
        metadata["spark_session_start_s"] = round(started, 2)
    metadata.update(extra)
    return metadata


def markdown_preview(df, limit: int = 10) -> str:
    """The first rows of a DataFrame as a Markdown table, for the asset's metadata."""
    rows = df.limit(limit).collect()
    if not rows:
        return "(empty)"
    header = "| " + " | ".join(df.columns) + " |"
    rule = "| " + " | ".join("---" for _ in df.columns) + " |"
    body = ["| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join([header, rule, *body])
