"""The SparkSession: Delta configured, sized for this machine, one per process.

A session costs seconds to start and its static config is fixed once created (a second
builder's settings are silently ignored by Spark), so every caller in a process shares the
session made by the first `get_spark()`; later differing static settings are reported, not lost
silently. Override anything from Dagster config (`SparkResource(master=..., conf={...})`) or the
environment (`TXNLAKE_SPARK_MASTER`, `TXNLAKE_SPARK_CONF="key=value,key=value"`, see
`txn_engine.core.settings.conf_from_environment`).

On a cluster (any master but `local[...]`) executors need Delta's jars, the Kafka segment
reader's (`resources.kafka_jars`) and this project's code: the jars go by `spark.jars` (every master), the code as a zip of its packages by
`spark.submit.pyFiles` (`code_zip`; not when the user ships code themselves or sets
TXNLAKE_SHIP_CODE=0), and their Python workers run this interpreter unless told otherwise
(docs/deployment.md).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import threading
import time
import zipfile
from pathlib import Path
from typing import Mapping

from dagster import ConfigurableResource
from pydantic import Field
from pyspark.logger import PySparkLogger
from pyspark.sql import SparkSession

from resources.delta_jars import LOCAL_FS_CLASS, LOG_STORE_CLASS, cached_local_fs_jar, require_delta_jars, require_s3_jars
from resources.jvm_archive import conf_dir, driver_java_options, empty_conf_dir
from resources.kafka_jars import cached_segment_reader_jars
from txn_engine.core.errors import ConfigurationError
from txn_engine.core.settings import (WarehouseSettings, conf_from_environment, executors_on_this_host, is_local_master,
                                      is_loopback_master, switched_off)

log = logging.getLogger(__name__)

# Local mode on 2 cores / 24 GiB: both cores, a driver heap that leaves room for Python and
# Dagster, few shuffle partitions (the default 200 costs more in task overhead than it saves).
DEFAULT_SPARK_CONF: dict[str, str] = {
    "spark.master": "local[2]",
    "spark.app.name": "txnlake",
    "spark.driver.memory": "8g",
    # The throughput collector: batch jobs, no latency to keep; faster than the default G1 for the
    # buffer's full run and the plain copy alike (docs/benchmarks.md, "Spark settings").
    "spark.driver.extraJavaOptions": "-XX:+UseParallelGC",
    "spark.sql.shuffle.partitions": "8",
    # Cached frames (the buffer's narrow facts) stay uncompressed: building the compressed column
    # batches cost more time than the memory saved is worth here (docs/benchmarks.md, "Spark settings").
    "spark.sql.inMemoryColumnarStorage.compressed": "false",
    "spark.default.parallelism": "4",
    "spark.sql.adaptive.enabled": "true",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
    "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
    # Delta reads its log with 50 tasks by default: pure overhead on small local tables.
    "spark.databricks.delta.snapshotPartitions": "2",
    # Delta's VACUUM lists a table's folders with this many tasks (Spark's default: 10,000), pure
    # overhead on 2 cores even for a tiny table (docs/benchmarks.md, "Spark settings").
    "spark.sql.sources.parallelPartitionDiscovery.parallelism": "4",
    # PySpark's DataFrame query context: every `pyspark.sql.functions` call first records its
    # Python call site in the JVM, several round trips each, which makes building a job's columns
    # cost more than running it on a small log (docs/benchmarks.md, "Spark settings").
    "spark.python.sql.dataFrameDebugging.enabled": "false",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
}

# For a log of a few thousand rows (the demo `make run` generates): Spark interprets expressions
# rather than generating and compiling code for each query, which costs more than it saves there
# (docs/benchmarks.md, "make run"). SQL settings: they change at run time too.
SMALL_LOG_SPARK_CONF: dict[str, str] = {
    "spark.sql.codegen.wholeStage": "false",
    "spark.sql.codegen.factoryMode": "NO_CODEGEN",
}

# The packages executors import (pyproject's [tool.setuptools] packages), shipped as one zip.
CODE_PACKAGES = ("txn_engine", "assets", "resources", "pipelines")
CODE_ZIP_MAX_AGE_S = 30 * 24 * 3600  # past any session's life: its executors fetch the zip from the driver

_lock = threading.Lock()
_session: SparkSession | None = None
_session_conf: dict[str, str] = {}
_startup_seconds: float | None = None

def effective_conf(master: str | None = None, conf: Mapping[str, str] | None = None) -> dict[str, str]:
    """Defaults, then the environment, then explicit settings (Dagster config, tests)."""
    merged = {**DEFAULT_SPARK_CONF, **conf_from_environment(), **(conf or {})}
    if master:
        merged["spark.master"] = master
    own_delta = _brings_own_delta(merged)
    # `txnlake import-kafka` parses segments in the JVM (any session may run it): kafka-clients and
    # the reader go wherever the executors are, like Delta's; without them only the import refuses to run.
    ours = [*([] if own_delta else require_delta_jars()), *cached_segment_reader_jars()]
    merged["spark.jars"] = ",".join(filter(None, [merged.get("spark.jars", ""), *map(str, ours)]))
    storage = WarehouseSettings()  # the environment's warehouse and store, as delta-rs gets them
    if storage.uses_s3():
        merged = {**storage.spark_storage_conf(), **merged}  # a Spark setting given explicitly wins
        if not own_delta:
            _add_s3_jars(merged)
    if not is_local_master(merged["spark.master"]):
        _add_cluster_conf(merged)
    else:
        _use_forkless_local_fs(merged)
    options = driver_java_options(merged, _conf_dir())
    if options:
        merged["spark.driver.extraJavaOptions"] = " ".join(filter(None, [merged.get("spark.driver.extraJavaOptions", ""), *options]))
    return merged


def _use_forkless_local_fs(merged: dict[str, str]) -> None:
    """Local paths through `ForklessLocalFileSystem` (`resources/java`) once `make setup` built it:
    Hadoop without its native library starts a `chmod` for every file it creates and a `readlink`
    for every rename, each Delta commit included. On the driver's class path (spark-submit reads
    local files before it loads `spark.jars`), so in local mode only. A user's setting wins."""
    class_path = local_driver_class_path()
    if not class_path or "spark.hadoop.fs.file.impl" in merged:
        return
    merged["spark.hadoop.fs.file.impl"] = LOCAL_FS_CLASS
    merged.setdefault("spark.hadoop.fs.AbstractFileSystem.file.impl", f"{LOCAL_FS_CLASS}$Fs")
    merged["spark.driver.extraClassPath"] = os.pathsep.join(filter(None, [merged.get("spark.driver.extraClassPath", ""), class_path]))


def local_driver_class_path() -> str:
    """What a local session adds to the driver's class path (the local file system's jar once
    built), as the class archive is keyed (`pipelines.jvm_archive`)."""
    jar = cached_local_fs_jar()
    return str(jar) if jar else ""


def _conf_dir() -> str:
    """The driver's SPARK_CONF_DIR: the user's when set (a cluster's spark-defaults.conf wins), else
    an empty one of ours (`resources.jvm_archive`)."""
    return os.environ.get("SPARK_CONF_DIR") or str(conf_dir())


def _add_s3_jars(merged: dict[str, str]) -> None:
    """S3A, and Delta's log entries created by conditional PUTs (`resources/java`): commits from
    several hosts, and from delta-rs, cannot overwrite each other.

    The connector (the AWS SDK bundle is by far the largest jar) goes on the JVMs' class path where
    they run on this host (the driver; the executors of a master on loopback), not by `spark.jars`,
    which would copy it into every executor of every application; executors elsewhere fetch it so.
    The log store extends Delta's, so it is loaded beside Delta, by `spark.jars`."""
    *connector, log_store = (str(p) for p in require_s3_jars())
    here = executors_on_this_host(merged["spark.master"])
    by_jars = [log_store] + ([] if here else connector)
    merged["spark.jars"] = ",".join(filter(None, [merged.get("spark.jars", ""), *by_jars]))
    for role in ("driver", "executor") if here else ("driver",):
        key = f"spark.{role}.extraClassPath"
        merged[key] = os.pathsep.join(filter(None, [merged.get(key, ""), *connector]))
    for scheme in ("s3", "s3a"):
        merged.setdefault(f"spark.delta.logStore.{scheme}.impl", LOG_STORE_CLASS)


def _add_cluster_conf(merged: dict[str, str]) -> None:
    """What a cluster's executors need that local mode gets for free, unless the user set it.

    Memory: spark.executor.memory stays Spark's (1g, which a small worker hosts) unless the user or
    the cluster's spark-defaults.conf sets it; a value here would override the latter. The driver
    keeps its local-mode heap: it still builds the broadcasts and collects the small results."""
    if is_loopback_master(merged["spark.master"]):
        merged.setdefault("spark.driver.host", "127.0.0.1")
    # A session built in-process (not by spark-submit) takes its workers' Python from
    # PYSPARK_PYTHON only (`get_spark` exports this); by default the driver's own interpreter.
    if "spark.pyspark.python" not in merged and not os.environ.get("PYSPARK_PYTHON"):
        merged["spark.pyspark.python"] = sys.executable
    # spark-submit (which starts the driver's JVM) also adds these to spark.files: executors fetch
    # the zip and put it on their workers' PYTHONPATH.
    if not merged.get("spark.submit.pyFiles") and not switched_off("TXNLAKE_SHIP_CODE"):
        merged["spark.submit.pyFiles"] = str(code_zip())


_code_zip: Path | None = None


def code_cache_dir() -> Path:
    return Path.home() / ".cache" / "txnlake" / "code"


def code_zip() -> Path:
    """A zip of the project's packages as this process imports them (a checkout, an editable or a
    wheel install alike), built once per process. Named by its content, so executors never run a
    stale copy and processes running the same code share one file."""
    global _code_zip
    if _code_zip is not None and _code_zip.is_file():
        return _code_zip
    files: list[tuple[str, Path]] = []
    for package in CODE_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigurationError(f"cannot ship package {package!r} to executors: it is not importable here")
        root = Path(next(iter(spec.submodule_search_locations)))
        for path in sorted(root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo"):
                files.append((f"{package}/{path.relative_to(root).as_posix()}", path))
    digest = hashlib.sha256()
    for name, path in files:
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    target = code_cache_dir() / f"txnlake-code-{digest.hexdigest()[:16]}.zip"
    if target.is_file():
        target.touch()  # in use: kept by the pruning below
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as archive:
            for name, path in files:
                archive.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), path.read_bytes(),
                                 compress_type=zipfile.ZIP_DEFLATED)
        os.replace(partial, target)  # atomic: a concurrent process sees no half-written zip
        # Every edit of the code makes a new zip: drop those no session has started with for a month.
        for old in target.parent.glob("txnlake-code-*"):
            try:
                if time.time() - old.stat().st_mtime > CODE_ZIP_MAX_AGE_S:
                    old.unlink()
            except FileNotFoundError:  # pruned by another process
                pass
    _code_zip = target
    return target


def _brings_own_delta(conf: Mapping[str, str]) -> bool:
    # On a cluster Delta may come from spark.jars.packages or the image; then the cache is moot.
    return "delta-spark" in conf.get("spark.jars.packages", "") or "delta-spark" in conf.get(
        "spark.jars", ""
    )


def get_spark(master: str | None = None, conf: Mapping[str, str] | None = None) -> SparkSession:
    """The process's SparkSession, created on first use."""
    global _session, _session_conf, _startup_seconds
    wanted = effective_conf(master, conf)
    with _lock:
        if _session is not None and _session.sparkContext._jsc is not None:
            _apply_runtime_conf(_session, wanted)
            return _session
        if executors_on_this_host(wanted["spark.master"]):
            # Local mode (or a master on loopback) talks to this host only: bind to loopback, not to
            # whatever eth0 is. Elsewhere Spark advertises the host's address (docs/deployment.md).
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        # Our log4j2 configuration (`driver_java_options`), for the driver whatever the master:
        # without one Spark logs at INFO and announces its default profile on every start, burying
        # the CLI's story. A set conf dir (a cluster's spark-defaults.conf) wins.
        if not os.environ.get("SPARK_CONF_DIR"):
            os.environ["SPARK_CONF_DIR"] = str(empty_conf_dir())
        if is_local_master(wanted["spark.master"]):
            # Python workers (the buffer kernel's and the snapshot index's Arrow UDFs) need this
            # interpreter's packages; PySpark would start the first `python3` on PATH. A set PYSPARK_PYTHON wins.
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        if "spark.pyspark.python" in wanted:
            # Honoured by spark-submit only (over PYSPARK_PYTHON); a session built here reads the environment.
            os.environ["PYSPARK_PYTHON"] = wanted["spark.pyspark.python"]
        started = time.perf_counter()
        # Spark's launcher always loads the JVM's incubating vector module, and the JVM then warns
        # "Using incubator modules: jdk.incubator.vector" on stderr: said once here, before it shows.
        logging.getLogger("txnlake.spark").info(
            f"starting Spark ({wanted['spark.master']}); the JVM's 'Using incubator modules' warning that "
            "follows is Spark's own and harmless")
        builder = SparkSession.builder
        for key, value in wanted.items():
            builder = builder.config(key, value)
        session = builder.getOrCreate()
        session.sparkContext.setLogLevel(os.environ.get("TXNLAKE_SPARK_LOG_LEVEL", "ERROR"))
        # PySpark logs each Spark SQL error it converts as a JSON blob on stderr before raising it:
        # a duplicate of the exception, which buries the CLI's one-line `error:` under it.
        for name in ("SQLQueryContextLogger", "DataFrameQueryContextLogger"):
            PySparkLogger.getLogger(name).setLevel(logging.CRITICAL)
        _startup_seconds = time.perf_counter() - started
        _session, _session_conf = session, wanted
        log.info("SparkSession started in %.1fs (master %s)", _startup_seconds, wanted["spark.master"])
        return session


def _apply_runtime_conf(session: SparkSession, wanted: Mapping[str, str]) -> None:
    ignored = []
    for key, value in wanted.items():
        if _session_conf.get(key) == value:
            continue
        if key.startswith("spark.sql.") and key not in (
            "spark.sql.extensions",
            "spark.sql.catalog.spark_catalog",
        ):
            session.conf.set(key, value)  # SQL settings can change at run time
        else:
            ignored.append(key)
    if ignored:
        log.warning(
            "SparkSession already running; static settings %s keep their first values. "
            "Start a new process to change them.",
            ", ".join(sorted(ignored)),
        )


def running_session() -> SparkSession | None:
    """This process's session when one runs (never starts one): for progress reports."""
    session = _session
    return session if session is not None and session.sparkContext._jsc is not None else None


def spark_startup_seconds() -> float | None:
    """How long this process's SparkSession took to start (None before it has)."""
    return _startup_seconds


class SparkResource(ConfigurableResource):
    """The shared SparkSession as a Dagster resource."""

    master: str | None = Field(
        default=None, description="spark.master; default local[2] or TXNLAKE_SPARK_MASTER."
    )
    conf: dict[str, str] = Field(
        default_factory=dict, description="Extra Spark settings, applied over the defaults."
    )

    def session(self) -> SparkSession:
        return get_spark(self.master, self.conf)
