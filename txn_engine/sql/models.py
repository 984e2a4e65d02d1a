"""dbt-free SQL models: every `dbt-free-sql/*.sql` file is a query over the warehouse's tables.

A model's upstream tables are found from its SQL (sqlglot's Spark parser: every table it reads,
minus its own CTEs), never listed by hand. Running a model registers each table it reads as a
temporary view of the Delta table, runs the query with Spark SQL, and (for the asset) writes the
result as a Delta table named after the file. The shipped models are portable SQL: on small tables
the asset runs them with DuckDB in the driver instead (`runs_in_driver`), over the same tables.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import sqlglot
from sqlglot import exp
import duckdb
import pyarrow as pa
from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame
from pyspark.sql.types import StructType

from txn_engine.core import schema
from txn_engine.core.errors import InputFileError, TableMissingError
from txn_engine.storage.arrow_frames import arrow_schema
from txn_engine.storage.delta_io import DeltaTables
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


@functools.lru_cache(maxsize=256)
def referenced_tables(sql: str) -> tuple[str, ...]:
    """The tables a query reads, sorted; CTE names are not tables. Cached: every command that
    lists the models (the asset graph, `txnlake sql`) parses the same files again."""
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


def _sources(warehouse: Warehouse, model: SqlModel, named_views: dict[str, SqlModel]) -> list[tuple[str, object]]:
    """What each table the model reads is, a view's own reads before the view: (name, the view's
    model | the schema of a table read as empty until written | the Delta table's location)."""
    found: list[tuple[str, object]] = []
    for table in model.reads:
        location = warehouse.path(table)
        if table in named_views:
            found += _sources(warehouse, named_views[table], named_views)
            found.append((table, named_views[table]))
        elif table in EMPTY_UNTIL_WRITTEN:
            found.append((table, EMPTY_UNTIL_WRITTEN[table]))
        elif warehouse.exists(table, location):
            found.append((table, location))
        elif table in known_tables():
            spec = schema.table_spec(table)
            raise TableMissingError(
                f"SQL model {model.name} reads table {table}, which does not exist yet at "
                f"{location}; write it first ({spec.written_by if spec else '`txnlake run`'})."
            )
        else:
            raise InputFileError(
                f"SQL model {model.name} ({model.path}) reads table {table}, which is not a txnlake table "
                f"(nor a Delta table at {location}). Fix the table name; the tables are: {', '.join(known_tables())}."
            )
    return found


def register_reads(warehouse: Warehouse, model: SqlModel, named_views: dict[str, SqlModel] | None = None) -> None:
    """Make each table the model reads a temporary view of its Delta table, and each view it reads
    the view's query (over its own tables, registered the same way)."""
    for table, source in _sources(warehouse, model, views() if named_views is None else named_views):
        if isinstance(source, SqlModel):
            warehouse.spark.sql(source.sql).createOrReplaceTempView(table)
        elif isinstance(source, StructType):
            warehouse.read_or_empty(table, source).createOrReplaceTempView(table)
        else:
            warehouse.read(table, source).createOrReplaceTempView(table)


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


def runs_in_driver(warehouse: Warehouse, model: SqlModel) -> bool:
    """Where the model runs: a shipped model (its columns declared in `schema.TABLES`, its SQL
    portable) in the driver with DuckDB when `TXNLAKE_COMPUTE` is `driver`, or `auto` and the Delta
    files it reads fit the driver's full-run bound; on Spark otherwise, and always for a model of
    your own (Spark's SQL)."""
    if schema.table_spec(model.name) is None or warehouse.settings.compute == "spark":
        return False
    tables = DeltaTables(warehouse)
    read = {t for t, source in _sources(warehouse, model, views()) if not isinstance(source, SqlModel)}
    return warehouse.settings.whole_tables_in_driver(sum(tables.stored_bytes(t) for t in read))


def run_model_in_driver(warehouse: Warehouse, model: SqlModel) -> pa.Table:
    """The shipped model's result computed by DuckDB in this process over delta-rs's Arrow datasets
    of the same tables `run_model` reads (no JVM), in the columns and types its spec declares."""
    declared = schema.table_spec(model.name)
    if declared is None:
        raise InputFileError(f"SQL model {model.name} declares no columns in txn_engine/core/schema.py: run it on Spark")
    con = duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")  # Delta's timestamps are instants; DuckDB shows them in UTC
    tables = DeltaTables(warehouse)
    for table, source in _sources(warehouse, model, views()):
        if isinstance(source, SqlModel):
            con.execute(f"CREATE OR REPLACE VIEW {table} AS {source.sql}")
        elif isinstance(source, StructType) and not tables.exists(table):
            con.register(table, arrow_schema(source).empty_table())
        else:
            con.register(table, tables.dataset(table))
    target = arrow_schema(declared.schema)
    result = con.sql(model.sql).to_arrow_table()
    return result.rename_columns(target.names).cast(target)
