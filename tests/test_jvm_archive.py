"""The driver JVM's class archive (resources/jvm_archive.py): which options a session gets, and that
the archive `make setup` built maps into a real driver."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from resources.jvm_archive import ARCHIVE_ENV, archive_key, archive_path, conf_dir, driver_java_options
from resources.spark import effective_conf, local_driver_class_path

REPO = Path(__file__).resolve().parent.parent


def test_a_session_gets_our_log4j_and_the_archive_of_its_class_path(monkeypatch, tmp_path):
    monkeypatch.setenv("TXNLAKE_JAR_CACHE", str(tmp_path / "jars"))
    monkeypatch.delenv(ARCHIVE_ENV, raising=False)
    ours = str(conf_dir())
    options = driver_java_options({}, ours)
    assert [o for o in options if "log4j2.configurationFile" in o] and not [o for o in options if "Archive" in o]

    archive = archive_path({}, ours)
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"built by make setup")
    assert f"-XX:SharedArchiveFile={archive}" in driver_java_options({}, ours)
    # Another class path is another archive: an S3 driver's connector jars, a user's conf folder.
    assert archive_key({"spark.driver.extraClassPath": "/opt/aws-bundle.jar"}, ours) != archive_key({}, ours)
    assert not [o for o in driver_java_options({"spark.driver.extraClassPath": "/opt/aws-bundle.jar"}, ours) if "Archive" in o]
    assert driver_java_options({}, str(tmp_path / "their-conf")) == []
    monkeypatch.setenv(ARCHIVE_ENV, "0")
    assert not [o for o in driver_java_options({}, ours) if "Archive" in o]
    # The session's settings carry them after the user's own JVM options.
    monkeypatch.delenv(ARCHIVE_ENV)
    monkeypatch.delenv("SPARK_CONF_DIR", raising=False)
    monkeypatch.setenv("TXNLAKE_SPARK_CONF",  # Delta from the user's own jar: this cache holds none
                       "spark.driver.extraJavaOptions=-XX:+UseSerialGC,spark.jars=/opt/delta-spark_4.2_2.13-4.4.0.jar")
    merged = effective_conf()["spark.driver.extraJavaOptions"]
    assert merged.startswith("-XX:+UseSerialGC ") and f"-XX:SharedArchiveFile={archive}" in merged


def test_the_archive_built_by_make_setup_maps_into_a_driver(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_CONF_DIR", "TXNLAKE_SPARK_CONF", ARCHIVE_ENV)}
    archive = archive_path({"spark.driver.extraClassPath": local_driver_class_path()}, str(conf_dir()))
    assert archive is not None and archive.is_file(), f"no class archive for this machine at {archive}: run `make setup`"
    log = tmp_path / "cds.log"
    # -Xshare:on makes an archive the JVM cannot map a failure to start, not a silent fallback.
    script = (
        "from resources.spark import get_spark\n"
        f"spark = get_spark(conf={{'spark.driver.extraJavaOptions': '-Xshare:on -Xlog:cds=info:file={log}'}})\n"
        f"spark.range(100).write.format('delta').save({str(tmp_path / 't')!r})\n"
        f"print(spark.read.format('delta').load({str(tmp_path / 't')!r}).count())\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "100", done.stderr[-3000:]
    assert str(archive) in log.read_text() and "Mapped dynamic region" in log.read_text()
    assert "default log4j profile" not in done.stderr, done.stderr[-2000:]
