"""Warehouse settings, Spark configuration and the Delta jar check (no Spark started here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from resources.delta_jars import require_delta_jars
from resources.kafka_jars import require_segment_reader_jars
from resources.spark import DEFAULT_SPARK_CONF, effective_conf
from txn_engine.core.settings import conf_from_environment
from resources.warehouse import WarehouseResource
from txn_engine.core.errors import ConfigurationError, DeltaJarsMissingError, KafkaJarsMissingError
from txn_engine.core.settings import WarehouseSettings


def test_default_root_is_warehouse_under_cwd(monkeypatch, tmp_path):
    monkeypatch.delenv("TXNLAKE_WAREHOUSE", raising=False)
    monkeypatch.chdir(tmp_path)
    settings = WarehouseSettings()
    assert settings.root == str(tmp_path / "warehouse")
    assert settings.table_path("ledger_entries") == str(tmp_path / "warehouse" / "ledger_entries")
    assert settings.cold_table_path("offloaded_entries") == str(tmp_path / "warehouse" / "cold" / "offloaded_entries")
    assert settings.lock_path("ledgers") == str(tmp_path / "warehouse" / "_internal" / "locks" / "ledgers.lock")
    # Internal state apart from the analyst's tables; the tier's entries at the tier's root, its manifest public.
    assert settings.table_path("buffer_ledger_txns") == str(tmp_path / "warehouse" / "_internal" / "buffer_ledger_txns")
    assert settings.table_path("offloaded_entries") == str(tmp_path / "warehouse" / "cold" / "offloaded_entries")
    assert settings.table_path("offload_manifest") == str(tmp_path / "warehouse" / "offload_manifest")
    assert settings.table_path("tier_sizes") == str(tmp_path / "warehouse" / "tier_sizes")


def test_environment_overrides_root_and_cold_tier(monkeypatch, tmp_path):
    monkeypatch.setenv("TXNLAKE_WAREHOUSE", str(tmp_path / "wh"))
    monkeypatch.setenv("TXNLAKE_COLD_TIER", "s3a://cold-bucket/tier/")
    settings = WarehouseSettings()
    assert settings.table_path("ledgers") == str(tmp_path / "wh" / "ledgers")
    assert settings.cold_table_path("offloaded_entries") == "s3a://cold-bucket/tier/offloaded_entries"


@pytest.mark.parametrize(
    "root,table_path,local",
    [
        ("s3a://bucket/lake/", "s3a://bucket/lake/ledgers", False),
        ("file:///data/lake", "file:///data/lake/ledgers", True),
        ("abfss://c@acct.dfs.core.windows.net/lake", "abfss://c@acct.dfs.core.windows.net/lake/ledgers", False),
    ],
)
def test_any_uri_spark_can_write(root, table_path, local):
    settings = WarehouseSettings(warehouse=root)
    assert settings.table_path("ledgers") == table_path
    assert settings.is_local() is local
    if root.startswith("s3a:"):  # leases in the store itself (tests/test_s3_leases.py)
        assert settings.lock_path("ledgers") == "s3a://bucket/lake/_internal/locks/ledgers.lock"
    elif not local:  # no lease there: a lock on this machine
        assert settings.lock_path("ledgers") == str(Path.home() / ".cache" / "txnlake" / "locks" / "ledgers.lock")


def test_one_store_setting_reaches_spark_and_delta_rs():
    settings = WarehouseSettings(warehouse="s3://lake/wh", s3_endpoint="http://127.0.0.1:9000/", s3_region="eu-west-1",
                                 s3_access_key_id="id", s3_secret_access_key="secret", s3_path_style=True)
    assert settings.storage_options("s3://lake/wh/ledgers") == {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_REGION": "eu-west-1", "AWS_ACCESS_KEY_ID": "id",
        "AWS_SECRET_ACCESS_KEY": "secret", "AWS_ALLOW_HTTP": "true", "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "false"}
    assert settings.storage_options("/local/table") is None
    conf = settings.spark_storage_conf()
    assert conf["spark.hadoop.fs.s3.impl"] == "org.apache.hadoop.fs.s3a.S3AFileSystem"
    assert conf["spark.hadoop.fs.s3a.endpoint"] == "http://127.0.0.1:9000"
    assert conf["spark.hadoop.fs.s3a.connection.ssl.enabled"] == "false"
    assert conf["spark.hadoop.fs.s3a.path.style.access"] == "true"
    assert conf["spark.hadoop.fs.s3a.endpoint.region"] == "eu-west-1"
    assert (conf["spark.hadoop.fs.s3a.access.key"], conf["spark.hadoop.fs.s3a.secret.key"]) == ("id", "secret")
    assert WarehouseSettings(warehouse="/tmp/wh").spark_storage_conf() == {}


def test_the_environment_s_store_reaches_the_spark_session(monkeypatch):
    monkeypatch.setenv("TXNLAKE_WAREHOUSE", "s3://lake/wh")
    monkeypatch.setenv("TXNLAKE_S3_ENDPOINT", "https://store.example:9443")
    conf = effective_conf()
    assert conf["spark.hadoop.fs.s3a.endpoint"] == "https://store.example:9443"
    assert conf["spark.hadoop.fs.s3a.connection.ssl.enabled"] == "true"
    assert conf["spark.delta.logStore.s3.impl"] == conf["spark.delta.logStore.s3a.impl"] == (
        "io.txnlake.storage.S3ConditionalLogStore")
    assert "hadoop-aws-3.5.0.jar" in conf["spark.driver.extraClassPath"] and "txnlake-s3-logstore-" in conf["spark.jars"]
    monkeypatch.setenv("TXNLAKE_SPARK_CONF", "spark.hadoop.fs.s3a.endpoint=http://elsewhere:1")
    assert effective_conf()["spark.hadoop.fs.s3a.endpoint"] == "http://elsewhere:1"  # explicit Spark settings win


@pytest.mark.parametrize("settings,message", [
    ({"s3_endpoint": "store:9000"}, r"TXNLAKE_S3_ENDPOINT\) is 'store:9000'; set it to http://host:port"),
    ({"s3_access_key_id": "id"}, r"TXNLAKE_S3_ACCESS_KEY_ID and TXNLAKE_S3_SECRET_ACCESS_KEY go together"),
    ({"lock_lease_seconds": 0.5}, r"TXNLAKE_LOCK_LEASE_SECONDS is 0.5; set it to 1 or more"),
])
def test_bad_store_settings_are_one_line_errors(settings, message):
    with pytest.raises(ConfigurationError, match=message):
        WarehouseSettings(warehouse="s3://lake/wh", **settings)


def test_empty_root_is_a_clear_error():
    with pytest.raises(ConfigurationError, match=r"warehouse root \(TXNLAKE_WAREHOUSE\) is empty"):
        WarehouseSettings(warehouse="  ")


@pytest.mark.parametrize(
    "settings,error",
    [
        ({"warehouse": "{f}"}, r"warehouse root \(TXNLAKE_WAREHOUSE\) is {f}, which is a file, not a folder"),
        ({"warehouse": "file://{f}"}, r"TXNLAKE_WAREHOUSE\) is file://{f}, which is a file"),
        ({"warehouse": "{f}/sub"}, r"TXNLAKE_WAREHOUSE\) is {f}/sub, which lies under {f}, which is a file"),
        ({"warehouse": "{d}", "cold_tier": "{f}"}, r"offload tier root \(TXNLAKE_COLD_TIER.*\) is {f}, which is a file"),
        ({"warehouse": "{d}", "lock_dir": "{f}"}, r"writer lock folder \(TXNLAKE_LOCK_DIR.*\) is {f}, which is a file"),
        ({"warehouse": "{d}/wh"}, r"writer lock folder .* is {d}/wh/_internal/locks, which lies under {d}/wh/_internal, "
         "which is a file"),  # the default one
    ],
)
def test_a_folder_setting_that_is_a_file_is_a_clear_error(tmp_path, settings, error):
    (tmp_path / "folder" / "wh").mkdir(parents=True)
    (tmp_path / "folder" / "wh" / "_internal").write_text("")
    (tmp_path / "afile").write_text("")
    names = {"f": str(tmp_path / "afile"), "d": str(tmp_path / "folder")}
    with pytest.raises(ConfigurationError, match=error.format(**{k: re.escape(v) for k, v in names.items()})):
        WarehouseSettings(**{k: v.format(**names) for k, v in settings.items()})


def test_a_warehouse_file_fails_the_cli_cleanly(monkeypatch, tmp_path, capsys):
    from pipelines.cli import main

    (tmp_path / "afile").write_text("kept")
    monkeypatch.setenv("TXNLAKE_WAREHOUSE", str(tmp_path / "afile"))
    assert main(["txn", "list"]) == 2  # a command that needs no Spark
    assert "error: the warehouse root (TXNLAKE_WAREHOUSE) is" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "kept"
    # Missing folders, remote roots and real folders are fine.
    assert WarehouseSettings(warehouse=str(tmp_path / "new" / "wh"), cold_tier="s3a://b/cold", lock_dir=str(tmp_path)).root


def test_dagster_resource_config_wins_over_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TXNLAKE_WAREHOUSE", str(tmp_path / "env"))
    assert WarehouseResource().settings().root == str(tmp_path / "env")
    assert WarehouseResource(root=str(tmp_path / "cfg")).settings().root == str(tmp_path / "cfg")


def test_compute_comes_from_resource_then_environment_then_auto(monkeypatch, tmp_path):
    monkeypatch.delenv("TXNLAKE_COMPUTE", raising=False)
    assert WarehouseSettings(warehouse=str(tmp_path)).compute == "auto"
    monkeypatch.setenv("TXNLAKE_COMPUTE", "Spark")
    monkeypatch.setenv("TXNLAKE_DRIVER_SCOPE_MAX_BYTES", "1024")
    settings = WarehouseResource(root=str(tmp_path)).settings()
    assert (settings.compute, settings.driver_scope_max_bytes) == ("spark", 1024)
    assert WarehouseResource(root=str(tmp_path), compute="driver").settings().compute == "driver"


@pytest.mark.parametrize("variable, value, error", [
    ("TXNLAKE_COMPUTE", "gpu", r"TXNLAKE_COMPUTE is 'gpu'; set it to one of auto, driver, spark"),
    ("TXNLAKE_DRIVER_FULL_RUN_MAX_BYTES", "-1", r"TXNLAKE_DRIVER_FULL_RUN_MAX_BYTES is -1; set it to a byte count"),
])
def test_a_bad_compute_setting_is_a_clear_error(monkeypatch, tmp_path, variable, value, error):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigurationError, match=error):
        WarehouseSettings(warehouse=str(tmp_path))


def test_spark_conf_layers(monkeypatch):
    monkeypatch.setenv("TXNLAKE_SPARK_MASTER", "spark://cluster:7077")
    monkeypatch.setenv("TXNLAKE_SPARK_CONF", "spark.executor.memory=16g, spark.sql.shuffle.partitions=64")
    conf = effective_conf(conf={"spark.sql.shuffle.partitions": "32"})
    assert conf["spark.master"] == "spark://cluster:7077"
    assert conf["spark.executor.memory"] == "16g"
    assert conf["spark.sql.shuffle.partitions"] == "32"  # explicit config beats the environment
    assert conf["spark.sql.extensions"] == DEFAULT_SPARK_CONF["spark.sql.extensions"]
    assert "delta-spark_4.2_2.13-4.4.0.jar" in conf["spark.jars"]
    assert effective_conf(master="local[1]")["spark.master"] == "local[1]"


@pytest.mark.parametrize("raw", ["spark.driver.memory", "=4g", "spark.driver.memory=4g,=8g", "driver memory=4g"])
def test_bad_spark_conf_in_environment(monkeypatch, raw):
    monkeypatch.setenv("TXNLAKE_SPARK_CONF", raw)
    with pytest.raises(ConfigurationError, match="is not key=value"):
        conf_from_environment()


def test_spark_conf_values_may_hold_commas(monkeypatch):
    # A comma starts a new setting only before `property.name=`: lists and -D options stay whole.
    packages = "io.delta:delta-spark_4.2_2.13:4.4.0,org.apache.hadoop:hadoop-aws:3.4.1"
    monkeypatch.setenv(
        "TXNLAKE_SPARK_CONF",
        f"spark.jars.packages={packages},spark.driver.extraJavaOptions=-Da=1,-Db=2\n"
        "spark.hadoop.fs.s3a.bucket.my-bucket.endpoint = http://minio:9000,\n"
        "spark.hadoop.parquet.enable.dictionary#payload=true",  # Parquet's per-column keys
    )
    assert conf_from_environment() == {
        "spark.jars.packages": packages,
        "spark.driver.extraJavaOptions": "-Da=1,-Db=2",
        "spark.hadoop.fs.s3a.bucket.my-bucket.endpoint": "http://minio:9000",
        "spark.hadoop.parquet.enable.dictionary#payload": "true",
    }
    assert effective_conf()["spark.jars.packages"] == packages


def test_missing_delta_jars_name_make_setup(monkeypatch, tmp_path):
    monkeypatch.setenv("TXNLAKE_JAR_CACHE", str(tmp_path / "empty"))
    with pytest.raises(DeltaJarsMissingError, match="Run `make setup`"):
        require_delta_jars()
    with pytest.raises(DeltaJarsMissingError, match="delta-spark_4.2_2.13-4.4.0.jar"):
        effective_conf()
    # A cluster that brings its own Delta does not need the cache.
    conf = effective_conf(conf={"spark.jars.packages": "io.delta:delta-spark_4.2_2.13:4.4.0"})
    assert "spark.jars" not in conf or "delta" not in conf["spark.jars"]
    # Nor the Kafka segment reader's, until an import asks for it.
    with pytest.raises(KafkaJarsMissingError, match=r"kafka-clients-4.1.1.jar.*Run `make setup`"):
        require_segment_reader_jars()


def test_sessions_carry_the_kafka_segment_reader():
    assert {p.name for p in require_segment_reader_jars()} <= {Path(j).name for j in effective_conf()["spark.jars"].split(",")}


@pytest.mark.parametrize("master,loopback", [
    ("spark://127.0.0.1:7077", True), ("spark://localhost:7077", True), ("spark://[::1]:7077", True),
    ("spark://127.0.0.1:7077,localhost:7078", True), ("spark://127.0.0.1:7077,spark-2:7077", False),
    ("spark://10.1.2.3:7077", False), ("yarn", False), ("local[2]", False),
])
def test_loopback_masters(master, loopback):
    from txn_engine.core.settings import is_loopback_master

    assert is_loopback_master(master) is loopback


def test_a_cluster_master_ships_code_and_python(monkeypatch, tmp_path):
    import os
    import sys
    import zipfile

    import resources.spark as spark_module
    import txn_engine.core.positions

    for name in ("TXNLAKE_SPARK_MASTER", "TXNLAKE_SPARK_CONF", "TXNLAKE_SHIP_CODE", "PYSPARK_PYTHON"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(spark_module, "_code_zip", None)
    monkeypatch.setattr(spark_module, "code_cache_dir", lambda: tmp_path / "code")
    cluster_only = ("spark.submit.pyFiles", "spark.pyspark.python", "spark.driver.host")

    local = effective_conf()
    assert not set(cluster_only) & set(local)

    loopback = effective_conf(master="spark://127.0.0.1:7077")
    assert loopback["spark.driver.host"] == "127.0.0.1" and loopback["spark.pyspark.python"] == sys.executable
    assert "spark.executor.memory" not in loopback  # Spark's 1g, or the cluster's spark-defaults.conf
    shipped = Path(loopback["spark.submit.pyFiles"])
    assert shipped.parent == tmp_path / "code" and "delta-spark" in loopback["spark.jars"]
    with zipfile.ZipFile(shipped) as archive:
        names = set(archive.namelist())
        # The code this process runs (this checkout), not another copy of the package.
        assert archive.read("txn_engine/core/positions.py") == Path(txn_engine.core.positions.__file__).read_bytes()
    assert {f"{p}/__init__.py" for p in ("txn_engine", "assets", "resources", "pipelines")} <= names
    assert "resources/log4j2.properties" in names and not any("__pycache__" in n for n in names)
    assert effective_conf(master="spark://127.0.0.1:7077")["spark.submit.pyFiles"] == str(shipped)  # built once
    # Zips of older code go once unused for a month; a rebuild of the same code makes the same file.
    stale, recent = tmp_path / "code" / "txnlake-code-0.zip", tmp_path / "code" / "txnlake-code-1.zip"
    stale.write_bytes(b"old"), recent.write_bytes(b"old")
    os.utime(stale, (0, 0))
    shipped.unlink()
    monkeypatch.setattr(spark_module, "_code_zip", None)
    assert spark_module.code_zip() == shipped and not stale.exists() and recent.exists()

    remote = effective_conf(master="spark://spark-master:7077")
    assert "spark.driver.host" not in remote and remote["spark.submit.pyFiles"] == str(shipped)

    # What the user sets wins; code is not shipped when they ship their own or install it on the workers.
    mine = {"spark.submit.pyFiles": "hdfs:///apps/txnlake.zip", "spark.pyspark.python": "/opt/py/bin/python3",
            "spark.driver.host": "10.0.0.5", "spark.executor.memory": "4g"}
    assert {k: effective_conf(master="spark://127.0.0.1:7077", conf=mine)[k] for k in mine} == mine
    monkeypatch.setenv("TXNLAKE_SHIP_CODE", "0")
    monkeypatch.setenv("PYSPARK_PYTHON", "/opt/py/bin/python3")
    installed = effective_conf(master="spark://spark-master:7077")
    assert "spark.submit.pyFiles" not in installed and "spark.pyspark.python" not in installed
