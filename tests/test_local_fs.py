"""Local paths through txnlake's `file:` file system (resources/java, `ForklessLocalFileSystem`):
Spark's and Delta's writes start no `chmod` or `readlink` process, and the file system answers as
Hadoop's own does. Process starts are read from a Java Flight Recorder recording in the session's
own JVM."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from resources.delta_jars import LOCAL_FS_CLASS


class ProcessStarts:
    """The commands the JVM starts while the block runs (`jdk.ProcessStart` events)."""

    def __init__(self, spark, dump: Path):
        self.jvm, self.dump, self.commands = spark._jvm, dump, []

    def __enter__(self):
        self.recording = self.jvm.jdk.jfr.Recording()
        self.recording.enable("jdk.ProcessStart")
        self.recording.start()
        return self

    def __exit__(self, *exc):
        self.recording.stop()
        path = self.jvm.java.io.File(str(self.dump)).toPath()
        self.recording.dump(path)
        self.recording.close()
        self.commands = [e.getString("command") for e in self.jvm.jdk.jfr.consumer.RecordingFile.readAllEvents(path)]


def test_delta_writes_on_a_local_path_start_no_process(spark, tmp_path):
    jvm = spark._jvm
    conf = spark._jsc.hadoopConfiguration()
    uri = jvm.java.net.URI("file:///")
    assert jvm.org.apache.hadoop.fs.FileSystem.get(uri, conf).getClass().getName() == LOCAL_FS_CLASS
    assert jvm.org.apache.hadoop.fs.FileContext.getFileContext(uri, conf).getDefaultFileSystem().getClass().getName() \
        == f"{LOCAL_FS_CLASS}$Fs"

    table = str(tmp_path / "t")
    with ProcessStarts(spark, tmp_path / "ours.jfr") as ours:
        for _ in range(3):  # a create, then commits that rename into the log (FileContext)
            spark.range(10).write.format("delta").mode("append").save(table)
    assert spark.read.format("delta").load(table).count() == 30
    assert not [c for c in ours.commands if c.split()[0] in ("chmod", "readlink")], ours.commands

    # The recording sees Hadoop's own file system start them.
    stock = jvm.org.apache.hadoop.fs.RawLocalFileSystem()
    stock.initialize(uri, conf)
    file = tmp_path / "f"
    file.write_text("x")
    with ProcessStarts(spark, tmp_path / "stock.jfr") as hadoops:
        stock.setPermission(jvm.org.apache.hadoop.fs.Path(str(file)), jvm.org.apache.hadoop.fs.permission.FsPermission(0o640))
        stock.getFileLinkStatus(jvm.org.apache.hadoop.fs.Path(str(file)))
    assert {c.split()[0] for c in hadoops.commands} >= {"chmod", "readlink"}, hadoops.commands


def test_permissions_and_link_statuses_as_hadoop_gives_them(spark, tmp_path):
    jvm = spark._jvm
    hadoop_path = jvm.org.apache.hadoop.fs.Path
    fs = jvm.org.apache.hadoop.fs.FileSystem.get(jvm.java.net.URI("file:///"), spark._jsc.hadoopConfiguration())
    file, link, missing = tmp_path / "file", tmp_path / "link", tmp_path / "missing"
    file.write_text("x")
    link.symlink_to(file)

    fs.setPermission(hadoop_path(str(file)), jvm.org.apache.hadoop.fs.permission.FsPermission(0o640))
    assert stat.S_IMODE(os.stat(file).st_mode) == 0o640
    folder = tmp_path / "made"
    assert fs.mkdirs(hadoop_path(str(folder)), jvm.org.apache.hadoop.fs.permission.FsPermission(0o750))
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o750

    status = fs.getFileLinkStatus(hadoop_path(str(file)))
    assert not status.isSymlink() and status.getLen() == 1 and status.getPermission().toShort() == 0o640
    linked = fs.getFileLinkStatus(hadoop_path(str(link)))
    assert linked.isSymlink() and linked.getSymlink().toUri().getPath() == str(file)
    with pytest.raises(Exception, match="FileNotFoundException"):
        fs.getFileLinkStatus(hadoop_path(str(missing)))
