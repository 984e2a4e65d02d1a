"""The driver JVM's class archive: Spark's, Delta's and the JDK's classes as loaded by a txnlake run,
mapped ready-parsed and verified into each new driver (the JDK's dynamic CDS archive).

A short command's JVM spends much of its CPU loading and verifying the same tens of thousands of
classes every time; the archive removes that work (docs/benchmarks.md, "Spark start-up"). It is
built once per machine by `make setup` (`python -m pipelines.jvm_archive`, a small quickstart run
with `-XX:ArchiveClassesAtExit`), like the jars, and kept in the jar cache under a key of everything
the JVM checks it against: the JDK, and the driver's class path (pyspark's jars, the conf folder,
any extra class path). A session whose key has no archive runs as before, only slower to start.
CDS refuses class-path folders that hold files, so the driver's conf folder is an empty one here
and the log4j2 configuration is named by a system property.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path
from typing import Mapping

import pyspark

from resources.delta_jars import jar_cache_dir
from txn_engine.core.settings import switched_off

LOG4J2_PROPERTIES = Path(__file__).parent / "log4j2.properties"
BUILD_ENV = "TXNLAKE_JVM_ARCHIVE_BUILD"  # set by the builder: the path the driver dumps its archive to
ARCHIVE_ENV = "TXNLAKE_JVM_ARCHIVE"  # "0" turns the archive off


def archive_dir() -> Path:
    return jar_cache_dir() / "jvm-archive"


def conf_dir() -> Path:
    """The driver's SPARK_CONF_DIR unless the user sets one: empty (no spark-defaults.conf)."""
    return archive_dir() / "conf"


def empty_conf_dir() -> Path:
    """`conf_dir()`, created."""
    folder = conf_dir()
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _java() -> Path | None:
    java_home = os.environ.get("JAVA_HOME")
    found = Path(java_home) / "bin" / "java" if java_home else shutil.which("java")
    return Path(found).resolve() if found and Path(found).exists() else None


@functools.lru_cache(maxsize=1)
def _installed_digest() -> str | None:
    """The JDK's build and pyspark's jars (names, sizes, times), once per process; None without a JDK."""
    java = _java()
    if java is None:
        return None
    digest = hashlib.sha256()
    libjvm = next(iter(sorted(java.parent.parent.glob("lib/server/libjvm.so"))), java)
    for path in (java, libjvm):
        stat = path.stat()
        digest.update(f"{path}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    for entry in sorted(os.scandir(Path(pyspark.__file__).parent / "jars"), key=lambda e: e.name):
        stat = entry.stat()
        digest.update(f"{entry.name}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def archive_key(conf: Mapping[str, str], driver_conf_dir: str) -> str | None:
    """What the JVM checks an archive against: the JDK and the driver's class path; None without a JDK."""
    installed = _installed_digest()
    if installed is None:
        return None
    extra = conf.get("spark.driver.extraClassPath", "")
    return hashlib.sha256(f"{installed}|conf={driver_conf_dir}|extra={extra}".encode()).hexdigest()[:16]


def archive_path(conf: Mapping[str, str], driver_conf_dir: str) -> Path | None:
    key = archive_key(conf, driver_conf_dir)
    return archive_dir() / f"driver-{key}.jsa" if key else None


def driver_java_options(conf: Mapping[str, str], driver_conf_dir: str) -> list[str]:
    """JVM options for the driver: our log4j2 configuration, and the archive when this machine has
    one for this class path (or the dump of one, for the builder). Only with our own conf folder:
    a user's (a cluster's spark-defaults.conf) is not ours to empty."""
    if driver_conf_dir != str(conf_dir()):
        return []
    options = [f"-Dlog4j2.configurationFile={LOG4J2_PROPERTIES.as_uri()}"]
    if switched_off(ARCHIVE_ENV):
        return options
    if os.environ.get(BUILD_ENV):
        return [*options, f"-XX:ArchiveClassesAtExit={os.environ[BUILD_ENV]}"]
    path = archive_path(conf, driver_conf_dir)
    if path is not None and path.is_file():
        # A stale archive is the JVM's to refuse (it then runs without); its one-line warning is noise.
        options += [f"-XX:SharedArchiveFile={path}", "-Xlog:cds=off", "-Xlog:cds+dynamic=off"]
    return options
