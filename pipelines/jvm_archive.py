"""`make setup`'s last step: the driver JVM's class archive (`resources.jvm_archive`), built once by
a small `txnlake quickstart` in a scratch warehouse whose driver dumps the classes it loaded as it
exits. Idempotent: an archive for this machine's JDK and class path is kept (others after a month go).
Sessions run without one (slower to start) when it is missing or the build fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from resources.jvm_archive import BUILD_ENV, archive_dir, archive_path, conf_dir
from resources.spark import local_driver_class_path

QUICKSTART_ENTRIES = 2000
BUILD_TIMEOUT_S = 900
STALE_AFTER_S = 30 * 24 * 3600
# Settings of the user's own deployment that would change the class path or send the run elsewhere.
ISOLATED_ENV = ("SPARK_CONF_DIR", "TXNLAKE_SPARK_MASTER", "TXNLAKE_SPARK_CONF", "DAGSTER_HOME", "TXNLAKE_WAREHOUSE")


def _clean_env(scratch: Path, dump: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ISOLATED_ENV}
    home = scratch / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    return {**env, BUILD_ENV: str(dump), "DAGSTER_HOME": str(home), "TXNLAKE_WAREHOUSE": str(scratch / "warehouse")}


def _dumping(dump: Path) -> bool:
    """A JVM still writing `dump` (it writes the archive as it exits, after its Python has gone)."""
    marker = f"-XX:ArchiveClassesAtExit={dump}".encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker in (proc / "cmdline").read_bytes():
                    return True
            except OSError:
                continue
    return False


def build() -> Path | None:
    """The archive for the default local session: its path, built when missing; None when it cannot be."""
    target = archive_path({"spark.driver.extraClassPath": local_driver_class_path()}, str(conf_dir()))  # the default session
    if target is None:
        print("warning: no java found: Spark sessions start without a class archive", file=sys.stderr)
        return None
    if target.is_file():
        return target
    print(f"== building the driver JVM's class archive {target.name} (a {QUICKSTART_ENTRIES}-entry quickstart, once)",
          flush=True)
    started = time.monotonic()
    dump = target.with_suffix(f".{os.getpid()}.part")
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(
            [sys.executable, "-m", "pipelines.cli", "quickstart", "--quiet", "--entries", str(QUICKSTART_ENTRIES),
             "--file", str(Path(scratch) / "demo.jsonl")],
            env=_clean_env(Path(scratch), dump), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        deadline = time.monotonic() + 120
        while _dumping(dump) and time.monotonic() < deadline:
            time.sleep(0.2)
    if done.returncode != 0 or not dump.is_file() or _dumping(dump):
        dump.unlink(missing_ok=True)
        log = archive_dir() / "build.log"
        log.write_text(f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
        print(f"warning: the class archive was not built (quickstart exited {done.returncode}, "
              f"{'no archive dumped' if done.returncode == 0 else 'see the log'}: {log}); Spark sessions start without it",
              file=sys.stderr)
        return None
    for old in archive_dir().glob("driver-*.jsa"):  # other checkouts' (their own venvs) stay a while
        if time.time() - old.stat().st_mtime > STALE_AFTER_S:
            old.unlink(missing_ok=True)
    dump.replace(target)
    print(f"built {target} ({target.stat().st_size >> 20} MiB) in {time.monotonic() - started:.0f}s", flush=True)
    return target


if __name__ == "__main__":
    build()
