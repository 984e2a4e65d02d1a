"""dbt-free SQL models: every `dbt-free-sql/*.sql` file is a query over the warehouse's tables.

A model's upstream tables are found from its SQL (sqlglot's Spark parser: every table it reads,
minus its own CTEs), never listed by hand. Running a model registers each table it reads as a
temporary view of the Delta table, runs the query with Spark SQL, and (for the asset) writes the
result as a Delta table named after the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import sqlglot
from sqlglot import exp
from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame

from txn_engine.core import schema
from txn_engine.core.errors import InputFileError, TableMissingError
from txn_engine.storage.warehouse import Warehouse

DEFAULT_SQL_DIR = Path(__file__).resolve().parents[2] / "dbt-free-sql"


def sql_dir() -> Path:
    """The models' folder: TXNLAKE_SQL_DIR, else the repository's `dbt-free-sql/`."""
    return Path(os.environ.get("TXNLAKE_SQL_DIR", DEFAULT_SQL_DIR))


# A model's line saying it is a view: a named query the other models and `txnlake sql` read, not stored.
VIEW_MARKER = "-- materialized: view"


@dataclass(frozen=True)
class SqlModel:
    name: str
    path: Path
    sql: str
    reads: tuple[str, ...]
    description: str
    view: bool = False


def referenced_tables(sql: str) -> tuple[str, ...]:
    """The tables a query reads, sorted; CTE names are not tables."""
    try:
        statements = sqlglot.parse(sql, read="spark")
    except sqlglot.errors.ParseError as exc:
        raise InputFileError(f"cannot parse the SQL: {str(exc).splitlines()[0]}") from None
    tables: set[str] = set()
    for statement in statements:
        if statement is None:
            continue
        ctes = {cte.alias_or_name for cte in statement.find_all(exp.CTE)}
        for table in statement.find_all(exp.Table):
            if table.name and table.name not in ctes:
                tables.add(table.name)
    return tuple(sorted(tables))


def load_model(path: Path) -> SqlModel:
    path = Path(path)
    if not path.is_file():
        raise InputFileError(f"SQL model {path} does not exist")
    sql = path.read_text()
    lines = sql.splitlines()
    comments = [line[2:].strip() for line in lines if line.startswith("--") and line.strip() != VIEW_MARKER]
    return SqlModel(
        name=path.stem,
        path=path,
        sql=sql.strip().rstrip(";"),
        reads=referenced_tables(sql),
        description=" ".join(comments) or f"SQL model {path.name}",
        view=any(line.strip() == VIEW_MARKER for line in lines),
    )


def discover_models(folder: Path | None = None) -> list[SqlModel]:
    folder = folder or sql_dir()
    return [load_model(p) for p in sorted(Path(folder).glob("*.sql"))]


def views(folder: Path | None = None) -> dict[str, SqlModel]:
    """The models that are views, by name."""
    return {m.name: m for m in discover_models(folder) if m.view}


def upstream_tables(model: SqlModel, named_views: dict[str, SqlModel] | None = None) -> tuple[str, ...]:
    """What a model depends on: the tables it reads, and through each view it reads, the view's own."""
    named_views = views() if named_views is None else named_views
    found: set[str] = set()

    def add(tables: tuple[str, ...]) -> None:
        for table in tables:
            if table not in found:
                found.add(table)
                if table in named_views:
                    add(named_views[table].reads)

    add(model.reads)
    return tuple(sorted(found))


def known_tables() -> tuple[str, ...]:
    """The tables txnlake writes, sorted: the contract's and the models' own (one per `*.sql` but views)."""
    named_views = set(views())
    stored = {name for name, spec in schema.TABLES.items() if spec.kind != schema.Kind.VIEW}
    return tuple(sorted(stored | {p.stem for p in sql_dir().glob("*.sql")} - named_views))


# Tables first written when something happens (a ledger offloaded, deleted, a state recorded): until
# then "none yet" is their true content, so a model reads them as empty instead of failing.
EMPTY_UNTIL_WRITTEN = {
    schema.OFFLOAD_MANIFEST: schema.OFFLOAD_MANIFEST_SCHEMA,
    schema.OFFLOADED_ENTRIES: schema.OFFLOADED_ENTRIES_SCHEMA,
    schema.DELETED_LEDGERS: schema.DELETED_LEDGERS_SCHEMA,
    schema.LEDGER_STATES_LOG: schema.LEDGER_STATES_SCHEMA,
}


def register_reads(warehouse: Warehouse, model: SqlModel, named_views: dict[str, SqlModel] | None = None) -> None:
    """Make each table the model reads a temporary view of its Delta table, and each view it reads
    the view's query (over its own tables, registered the same way)."""
    named_views = views() if named_views is None else named_views
    for table in model.reads:
        if table in named_views:
            view = named_views[table]
            register_reads(warehouse, view, named_views)
            warehouse.spark.sql(view.sql).createOrReplaceTempView(table)
            continue
        location = warehouse.path(table)
        if table in EMPTY_UNTIL_WRITTEN:
            warehouse.read_or_empty(table, EMPTY_UNTIL_WRITTEN[table], location).createOrReplaceTempView(table)
            continue
        if warehouse.exists(table, location):
            warehouse.spark.read.format("delta").load(location).createOrReplaceTempView(table)
            continue
        known = known_tables()
        if table in known:
            spec = schema.table_spec(table)
            raise TableMissingError(
                f"SQL model {model.name} reads table {table}, which does not exist yet at "
                f"{location}; write it first ({spec.written_by if spec else '`txnlake run`'})."
            )
        raise InputFileError(
            f"SQL model {model.name} ({model.path}) reads table {table}, which is not a txnlake table "
            f"(nor a Delta table at {location}). Fix the table name; the tables are: {', '.join(known)}."
        )


def run_model(warehouse: Warehouse, model: SqlModel) -> DataFrame:
    """The model's result as a DataFrame over the current Delta tables."""
    register_reads(warehouse, model)
    try:
        return warehouse.spark.sql(model.sql)
    # Also ParseException: Spark's parser is stricter than sqlglot's. Spark's first line is the
    # error class and message; the lines after it are its query plan.
    except AnalysisException as exc:
        raise InputFileError(
            f"SQL model {model.name} ({model.path}) does not run: {str(exc).splitlines()[0].rstrip(';')}. "
            f"Fix the SQL in {model.path} (the contract tables' columns: txn_engine/core/schema.py)."
        ) from None
