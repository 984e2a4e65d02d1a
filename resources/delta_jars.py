"""Delta Lake's JVM jars: fetched once from Maven Central into a cache folder, then only checked.

`python -m resources.delta_jars fetch` (what `make setup` runs) downloads what is missing and
verifies each jar against Maven Central's SHA-1. Sessions never download: they call
`require_delta_jars()`, which fails with a message naming `make setup`.
"""

from __future__ import annotations

import hashlib
import os
import sys
import urllib.request
from pathlib import Path

from txn_engine.core.errors import DeltaJarsMissingError

DELTA_VERSION = "4.4.0"
MAVEN_CENTRAL = "https://repo.maven.apache.org/maven2"
# (group, artifact, version): delta-spark for Spark 4.2 / Scala 2.13, and the storage layer it needs.
DELTA_ARTIFACTS = (
    ("io.delta", "delta-spark_4.2_2.13", DELTA_VERSION),
    ("io.delta", "delta-storage", DELTA_VERSION),
)


def jar_cache_dir() -> Path:
    """Where the jars are cached: `TXNLAKE_JAR_CACHE`, else `~/.cache/txnlake/jars`."""
    configured = os.environ.get("TXNLAKE_JAR_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "txnlake" / "jars"


def _jar_name(artifact: str, version: str) -> str:
    return f"{artifact}-{version}.jar"


def delta_jar_paths() -> list[Path]:
    return [jar_cache_dir() / _jar_name(a, v) for _, a, v in DELTA_ARTIFACTS]


def require_delta_jars() -> list[Path]:
    """The cached jar paths; raises DeltaJarsMissingError naming what is missing and what to do."""
    paths = delta_jar_paths()
    missing = [p for p in paths if not p.is_file() or p.stat().st_size == 0]
    if missing:
        raise DeltaJarsMissingError(
            "Delta Lake jars are missing from the cache: "
            + ", ".join(str(p) for p in missing)
            + ". Run `make setup` (it fetches them once from Maven Central), or point "
            "TXNLAKE_JAR_CACHE at a folder that holds them."
        )
    return paths


def _download(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=120) as response:
        return response.read()


def fetch_delta_jars() -> list[Path]:
    """Download the missing jars, verified by SHA-1; idempotent."""
    cache = jar_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    for group, artifact, version in DELTA_ARTIFACTS:
        target = cache / _jar_name(artifact, version)
        if target.is_file() and target.stat().st_size > 0:
            continue
        base = f"{MAVEN_CENTRAL}/{group.replace('.', '/')}/{artifact}/{version}/{target.name}"
        print(f"fetching {base}", flush=True)
        try:
            body = _download(base)
            expected = _download(base + ".sha1").decode().split()[0].strip()
        except OSError as exc:
            raise DeltaJarsMissingError(
                f"could not download {base}: {exc}. Check that Maven Central is reachable, "
                "then run `make setup` again."
            ) from exc
        actual = hashlib.sha1(body).hexdigest()
        if actual != expected:
            raise DeltaJarsMissingError(
                f"{target.name} from Maven Central has SHA-1 {actual}, expected {expected}; "
                "nothing was cached. Run `make setup` again."
            )
        partial = target.with_suffix(".jar.part")
        partial.write_bytes(body)
        partial.replace(target)  # atomic: a half-written jar never looks cached
    return require_delta_jars()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv  # `fetch` downloads; `check` (or nothing) only checks
    try:
        paths = fetch_delta_jars() if args[:1] == ["fetch"] else require_delta_jars()
    except DeltaJarsMissingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
