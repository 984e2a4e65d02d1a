"""The JVM jars: fetched once from Maven Central into a cache folder, then only checked.

Delta Lake's, and for a warehouse on S3 Hadoop's S3A connector (`hadoop-aws` of the Hadoop that
pyspark is built on, with the AWS SDK bundle it needs) plus txnlake's Delta log store for S3
(`resources/java`: commits with conditional PUTs, safe across hosts), compiled once from its
source with `javac`. `python -m resources.delta_jars fetch` (what `make setup` runs) downloads
what is missing, verifies each jar against Maven Central's SHA-1, and builds the log store.
Sessions never download: they call `require_delta_jars()` / `require_s3_jars()`, which fail with
a message naming `make setup`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

import pyspark

from txn_engine.core.errors import ConfigurationError, DeltaJarsMissingError

DELTA_VERSION = "4.4.0"
MAVEN_CENTRAL = "https://repo.maven.apache.org/maven2"
# (group, artifact, version): delta-spark for Spark 4.2 / Scala 2.13, and the storage layer it needs.
DELTA_ARTIFACTS = (
    ("io.delta", "delta-spark_4.2_2.13", DELTA_VERSION),
    ("io.delta", "delta-storage", DELTA_VERSION),
)
# S3A for pyspark 4.2's Hadoop 3.5.0 client, and what hadoop-aws 3.5.0 declares it needs at run time
# (hadoop-project 3.5.0 pins the SDK at 2.35.4): the same versions, or S3A fails at class loading.
HADOOP_VERSION = "3.5.0"
S3_ARTIFACTS = (
    ("org.apache.hadoop", "hadoop-aws", HADOOP_VERSION),
    ("software.amazon.awssdk", "bundle", "2.35.4"),
    ("software.amazon.s3.analyticsaccelerator", "analyticsaccelerator-s3", "1.3.1"),
)
LOG_STORE_SOURCE = Path(__file__).parent / "java" / "io" / "txnlake" / "storage" / "S3ConditionalLogStore.java"
LOG_STORE_CLASS = "io.txnlake.storage.S3ConditionalLogStore"
LOCAL_FS_SOURCE = Path(__file__).parent / "java" / "io" / "txnlake" / "storage" / "ForklessLocalFileSystem.java"
LOCAL_FS_CLASS = "io.txnlake.storage.ForklessLocalFileSystem"


def jar_cache_dir() -> Path:
    """Where the jars are cached: `TXNLAKE_JAR_CACHE`, else `~/.cache/txnlake/jars`."""
    configured = os.environ.get("TXNLAKE_JAR_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "txnlake" / "jars"


def jar_name(artifact: str, version: str) -> str:
    return f"{artifact}-{version}.jar"


def delta_jar_paths() -> list[Path]:
    return [jar_cache_dir() / jar_name(a, v) for _, a, v in DELTA_ARTIFACTS]


def log_store_jar_path() -> Path:
    return source_jar_path("txnlake-s3-logstore", [LOG_STORE_SOURCE])


def local_fs_jar_path() -> Path:
    return source_jar_path("txnlake-local-fs", [LOCAL_FS_SOURCE])


def cached_local_fs_jar() -> Path | None:
    """The local file system's jar (`ForklessLocalFileSystem`) when built, else None (Hadoop's own then)."""
    try:
        return require_local_fs_jar()[0]
    except DeltaJarsMissingError:
        return None


def s3_jar_paths() -> list[Path]:
    return [jar_cache_dir() / jar_name(a, v) for _, a, v in S3_ARTIFACTS] + [log_store_jar_path()]


def require_jars(paths: list[Path], what: str, error: type[ConfigurationError] = DeltaJarsMissingError) -> list[Path]:
    """`paths` when all are cached; else `error` naming the missing ones and `make setup`."""
    missing = [p for p in paths if not p.is_file() or p.stat().st_size == 0]
    if missing:
        raise error(
            f"{what} are missing from the cache: "
            + ", ".join(str(p) for p in missing)
            + ". Run `make setup` (it fetches them once from Maven Central), or point "
            "TXNLAKE_JAR_CACHE at a folder that holds them."
        )
    return paths


def require_delta_jars() -> list[Path]:
    """The cached jar paths; raises DeltaJarsMissingError naming what is missing and what to do."""
    return require_jars(delta_jar_paths(), "Delta Lake jars")


def require_s3_jars() -> list[Path]:
    """The S3A connector's jars and the log store's, for a warehouse on S3; DeltaJarsMissingError
    naming what is missing otherwise."""
    return require_jars(s3_jar_paths(), "The S3 connector's jars (hadoop-aws, the AWS SDK bundle, txnlake's log store)")


def _download(url: str, target: Path | None = None) -> bytes | str:
    """The body of `url`; with `target`, streamed into that file instead (the SDK bundle is
    hundreds of MiB), and its SHA-1 returned."""
    with urllib.request.urlopen(url, timeout=120) as response:
        if target is None:
            return response.read()
        digest = hashlib.sha1()
        with open(target, "wb") as out:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        return digest.hexdigest()


def fetch_jars(artifacts: tuple[tuple[str, str, str], ...], cache: Path | None = None,
               error: type[ConfigurationError] = DeltaJarsMissingError) -> None:
    """Download the missing jars into `cache` (default `jar_cache_dir()`), each checked by its SHA-1."""
    cache = cache or jar_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    for group, artifact, version in artifacts:
        target = cache / jar_name(artifact, version)
        if target.is_file() and target.stat().st_size > 0:
            continue
        base = f"{MAVEN_CENTRAL}/{group.replace('.', '/')}/{artifact}/{version}/{target.name}"
        print(f"fetching {base}", flush=True)
        partial = target.with_suffix(f".jar.{os.getpid()}.part")
        try:
            actual = _download(base, partial)
            expected = _download(base + ".sha1").decode().split()[0].strip()
        except OSError as exc:
            partial.unlink(missing_ok=True)
            raise error(
                f"could not download {base}: {exc}. Check that Maven Central is reachable, "
                "then run `make setup` again."
            ) from exc
        if actual != expected:
            partial.unlink(missing_ok=True)
            raise error(
                f"{target.name} from Maven Central has SHA-1 {actual}, expected {expected}; "
                "nothing was cached. Run `make setup` again."
            )
        partial.replace(target)  # atomic: a half-written jar never looks cached


def _javac() -> str:
    java_home = os.environ.get("JAVA_HOME")
    found = str(Path(java_home) / "bin" / "javac") if java_home and (Path(java_home) / "bin" / "javac").is_file() \
        else shutil.which("javac")
    if not found:
        raise DeltaJarsMissingError(
            "javac is not installed: `make setup` compiles txnlake's Delta log store for S3 once with it. Install a "
            "JDK 17+ (e.g. the openjdk-17-jdk-headless package) or set JAVA_HOME to one, then run `make setup` again.")
    return found


def source_jar_path(prefix: str, sources: list[Path]) -> Path:
    """A jar compiled from `sources`, named by their hash: an edited source is built anew."""
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in sources)).hexdigest()[:12]
    return jar_cache_dir() / f"{prefix}-{digest}.jar"


def compile_jar(sources: list[Path], classpath: list[Path], target: Path,
                error: type[ConfigurationError] = DeltaJarsMissingError) -> Path:
    """Compile `sources` (`resources/java`) against `classpath` into the jar `target`; idempotent."""
    if target.is_file() and target.stat().st_size > 0:
        return target
    print(f"building {target.name}", flush=True)
    with tempfile.TemporaryDirectory() as build:
        done = subprocess.run([_javac(), "--release", "17", "-nowarn", "-cp", os.pathsep.join(map(str, classpath)),
                               "-d", build, *map(str, sources)], capture_output=True, text=True)
        if done.returncode != 0:
            raise error(f"compiling {', '.join(s.name for s in sources)} failed:\n{done.stderr.strip()}")
        partial = target.with_suffix(f".jar.{os.getpid()}.part")
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as jar:
            jar.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\nCreated-By: txnlake\n")
            for path in sorted(Path(build).rglob("*.class")):
                jar.write(path, path.relative_to(build).as_posix())
        partial.replace(target)
    return target


def build_log_store() -> Path:
    """Compile the log store (`resources/java`) against the cached Delta and S3A jars and pyspark's
    Hadoop client, into a jar in the cache; idempotent."""
    classpath = [*_hadoop_client(), *require_delta_jars(), jar_cache_dir() / jar_name("hadoop-aws", HADOOP_VERSION)]
    return compile_jar([LOG_STORE_SOURCE], classpath, log_store_jar_path())


def build_local_fs() -> Path:
    """Compile the local file system (`resources/java`) against pyspark's Hadoop client; idempotent."""
    return compile_jar([LOCAL_FS_SOURCE], _hadoop_client(), local_fs_jar_path())


def _hadoop_client() -> list[Path]:
    return sorted((Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar"))


def require_local_fs_jar() -> list[Path]:
    return require_jars([local_fs_jar_path()], "txnlake's local file system jar")


def fetch_delta_jars() -> list[Path]:
    """Download the missing jars, verified by SHA-1, and build the log store; idempotent."""
    fetch_jars(DELTA_ARTIFACTS + S3_ARTIFACTS)
    build_log_store()
    build_local_fs()
    return require_delta_jars() + require_s3_jars() + require_local_fs_jar()


def jar_cli(argv: list[str] | None, fetch, require, error: type[ConfigurationError]) -> int:
    """A jar module's command line: `fetch` downloads what is missing; `check` (or nothing) only
    checks; prints the jars' paths, or the error and exits 1."""
    args = sys.argv[1:] if argv is None else argv
    try:
        paths = fetch() if args[:1] == ["fetch"] else require()
    except error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    return jar_cli(argv, fetch_delta_jars, lambda: require_delta_jars() + require_s3_jars() + require_local_fs_jar(),
                   DeltaJarsMissingError)


if __name__ == "__main__":
    sys.exit(main())
