"""Shared fixtures: one real SparkSession for the whole run, a fresh warehouse per test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Sized for the suite on 2 cores: small shuffles, a modest heap (TXNLAKE_TEST_DRIVER_MEMORY
# lowers it when several suites share the machine).
TEST_SPARK_CONF = {
    "spark.driver.memory": os.environ.get("TXNLAKE_TEST_DRIVER_MEMORY", "4g"),
    "spark.sql.shuffle.partitions": "4",
    "spark.app.name": "txnlake-tests",
}


@pytest.fixture(scope="session")
def spark():
    from resources.spark import get_spark

    return get_spark(conf=TEST_SPARK_CONF)


@pytest.fixture
def warehouse_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "warehouse"
    monkeypatch.setenv("TXNLAKE_WAREHOUSE", str(root))
    return root


@pytest.fixture
def warehouse(spark, warehouse_root: Path):
    from txn_engine.settings import WarehouseSettings
    from txn_engine.warehouse import Warehouse

    return Warehouse(spark, WarehouseSettings(warehouse=str(warehouse_root)))


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


def pytest_configure(config):
    import tempfile

    os.environ.setdefault("TXNLAKE_SPARK_LOG_LEVEL", "ERROR")
    # Runs made by the tests go to a throwaway Dagster instance, not the repository's.
    os.environ["DAGSTER_HOME"] = tempfile.mkdtemp(prefix="txnlake-dagster-home-")
