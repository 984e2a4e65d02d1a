"""Shared fixtures: one real SparkSession per test process (`make test` runs two), a fresh warehouse per test."""

from __future__ import annotations

import inspect
import os
import shutil
from pathlib import Path

import pytest

from resources.spark import SMALL_LOG_SPARK_CONF
from tests.jvm_options import SUBPROCESS_JVM_OPTIONS

# Sized for the suite on 2 cores: small shuffles, a modest heap (TXNLAKE_TEST_DRIVER_MEMORY
# lowers it when several suites share the machine).
# The suite is thousands of tiny Spark jobs in one JVM, CPU-bound on the JVM's own work (JIT
# compilation, code Spark regenerates after its cache of 100 classes evicted it), not on data:
# hence fewer, later JIT compilations, Spark's code kept, and the throughput collector. The
# collector is every run's default (`resources.spark`); the JIT and codegen-cache settings are for
# tests only. Most tests also evaluate expressions interpreted, without generating and compiling
# Java per query (Spark's own suites run both ways): on a few rows compiling is most of a query's
# JVM time. The differential tests, Spark against the reference on random histories, run with
# Spark's production codegen and adaptive execution (`production_spark`), as every subprocess the
# tests start does (`make run`'s demo interprets, `SMALL_LOG_SPARK_CONF`). Evidence:
# docs/benchmarks.md, "The test suite".
PRODUCTION_SPARK_CONF = {"spark.sql.codegen.wholeStage": "true", "spark.sql.codegen.factoryMode": "FALLBACK",
                         "spark.sql.adaptive.enabled": "true"}
TEST_SPARK_CONF = {
    "spark.driver.memory": os.environ.get("TXNLAKE_TEST_DRIVER_MEMORY", "4g"),
    "spark.driver.extraJavaOptions": "-XX:+UseParallelGC -XX:CompileThresholdScaling=10",
    "spark.sql.codegen.cache.maxEntries": "10000",
    **SMALL_LOG_SPARK_CONF,
    "spark.sql.shuffle.partitions": "4",
    # Adaptive execution re-plans after every shuffle: on the tests' tiny tables that costs more than
    # it saves (the plans' results are the same; the differential tests run it, `production_spark`).
    "spark.sql.adaptive.enabled": "false",
    "spark.app.name": "txnlake-tests",
}


@pytest.fixture(scope="session")
def spark():
    from resources.spark import get_spark

    # This process's JVM lives for the whole run and keeps both JIT tiers (tests/jvm_options.py).
    for_subprocesses = os.environ.pop("SPARK_SUBMIT_OPTS", None)
    try:
        return get_spark(conf=TEST_SPARK_CONF)
    finally:
        if for_subprocesses is not None:
            os.environ["SPARK_SUBMIT_OPTS"] = for_subprocesses


@pytest.fixture
def production_spark(spark):
    """Spark's codegen (whole-stage, generated expressions) and adaptive execution as outside the
    tests, for one test."""
    for key, value in PRODUCTION_SPARK_CONF.items():
        spark.conf.set(key, value)
    yield spark
    for key in PRODUCTION_SPARK_CONF:
        spark.conf.set(key, TEST_SPARK_CONF[key])


@pytest.fixture
def warehouse_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "warehouse"
    monkeypatch.setenv("TXNLAKE_WAREHOUSE", str(root))
    return root


@pytest.fixture
def warehouse(spark, warehouse_root: Path):
    from txn_engine.core.settings import WarehouseSettings
    from txn_engine.storage.warehouse import Warehouse

    return Warehouse(spark, WarehouseSettings(warehouse=str(warehouse_root)))


@pytest.fixture(scope="session")
def _prepared_roots(spark, tmp_path_factory):
    from txn_engine.core.settings import WarehouseSettings
    from txn_engine.storage.warehouse import Warehouse

    built: dict[str, Path] = {}

    def root_of(name: str, build) -> Path:
        if name not in built:
            folder = tmp_path_factory.mktemp(f"prepared-{name}")
            build(Warehouse(spark, WarehouseSettings(warehouse=str(folder / "warehouse"))), folder)
            built[name] = folder / "warehouse"
        return built[name]

    return root_of


@pytest.fixture
def prepared(_prepared_roots, warehouse_root: Path, warehouse):
    """`prepared(name, build)`: this test's warehouse, starting as a copy of the one `build(warehouse,
    folder)` made the first time `name` was asked for in this run. For tests that start from the same
    ingested (derived, offloaded) history: Spark and Delta's fixed cost per write is what makes the
    suite slow, and a Delta table (its log holds relative paths) copies as a folder."""

    def copy(name: str, build):
        shutil.copytree(_prepared_roots(name, build), warehouse_root, dirs_exist_ok=True)
        return warehouse

    return copy


@pytest.fixture
def dagster_resources(spark, warehouse_root: Path):
    from resources.engine import EngineResource
    from resources.spark import SparkResource
    from resources.warehouse import WarehouseResource

    return {
        "spark": SparkResource(conf=TEST_SPARK_CONF),
        "warehouse": WarehouseResource(root=str(warehouse_root)),
        "engine": EngineResource(),
    }


# Fixtures that start a server; a test that uses one is marked `server`.
SERVER_FIXTURES = {"spark_cluster", "s3_store", "kafka"}


def _starts_subprocess(item: pytest.Item) -> bool:
    function = getattr(item, "function", None)
    try:
        return function is not None and "subprocess." in inspect.getsource(function)
    except (OSError, TypeError):
        return False


def pytest_collection_modifyitems(config, items):
    """Mark each test by what it needs, from its fixtures (`spark`, transitively; a server's) and
    its code (a subprocess): `make test-fast` runs the tests that need none of them."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if "spark" in fixtures:
            item.add_marker(pytest.mark.spark)
        if fixtures & SERVER_FIXTURES:
            item.add_marker(pytest.mark.server)
        if _starts_subprocess(item):
            item.add_marker(pytest.mark.subprocess)
    # The slow modules (servers, clusters, racing processes) first, each kept whole: xdist hands out
    # the collection in halves and balances by stealing queued tests, which cannot split a long
    # test that started last (docs/benchmarks.md, "The test suite").
    slow = {item.module for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module not in slow)


def _refuse_jvm(*args, **kwargs):
    raise RuntimeError("this test starts Spark but is in the fast tier: give it the `spark` fixture "
                       "(tests/conftest.py marks tests that use it)")


def pytest_configure(config):
    import tempfile

    if os.environ.get("TXNLAKE_TEST_TIER") == "fast":
        from pyspark.sql import SparkSession

        SparkSession.Builder.getOrCreate = _refuse_jvm  # a misfiled test fails at once, not slowly

    os.environ.setdefault("TXNLAKE_SPARK_LOG_LEVEL", "ERROR")
    # Read by spark-submit for the driver JVM it starts (tests/jvm_options.py).
    os.environ["SPARK_SUBMIT_OPTS"] = " ".join(filter(None, [os.environ.get("SPARK_SUBMIT_OPTS"), SUBPROCESS_JVM_OPTIONS]))
    # Runs made by the tests go to a throwaway Dagster instance, not the repository's.
    config._txnlake_dagster_home = os.environ["DAGSTER_HOME"] = tempfile.mkdtemp(prefix="txnlake-dagster-home-")


def pytest_unconfigure(config):
    home = getattr(config, "_txnlake_dagster_home", None)
    if home:
        shutil.rmtree(home, ignore_errors=True)
