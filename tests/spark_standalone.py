"""A Spark standalone cluster on loopback, started from the installed pyspark (`standalone_cluster`).

A master and its workers, each a JVM in its own process group (so stopping a worker also stops
the executors it launched), each worker with its own SPARK_WORKER_DIR; started within a bound and
stopped completely, or a failure naming what did not start and the tail of its log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pyspark

from tests.jvm_options import SUBPROCESS_JVM_OPTIONS

SPARK_CLASS = Path(pyspark.__file__).parent / "bin" / "spark-class"
MASTER = "org.apache.spark.deploy.master.Master"
WORKER = "org.apache.spark.deploy.worker.Worker"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.is_file() else "(no log)"


@dataclass
class Daemon:
    name: str
    process: subprocess.Popen
    log: Path


@dataclass
class StandaloneCluster:
    url: str  # spark://127.0.0.1:PORT
    webui: str  # http://127.0.0.1:PORT
    worker_dirs: list[Path]
    daemons: list[Daemon] = field(default_factory=list)

    def state(self) -> dict:
        """The master's JSON view: workers, aliveworkers, activeapps, completedapps, status."""
        with urllib.request.urlopen(f"{self.webui}/json/", timeout=10) as response:
            return json.load(response)


def _start(name: str, args: list[str], env: dict[str, str], log: Path) -> Daemon:
    with open(log, "wb") as out:
        process = subprocess.Popen([str(SPARK_CLASS), *args], env=env, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    return Daemon(name, process, log)


def _group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` still runs (zombies do not count: an executor orphaned by
    its worker waits for init to reap it)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # after "pid (comm)": state, ppid, pgrp
            return True
    return False


def _stop(daemon: Daemon, grace: float = 20.0) -> None:
    """SIGTERM to the daemon's process group, SIGKILL past `grace`; returns once the group is gone."""
    pgid = daemon.process.pid  # start_new_session: the group is the daemon's own
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            daemon.process.poll()  # reap the daemon itself
            if not _group_alive(pgid):
                return
            time.sleep(0.2)
    daemon.process.poll()
    if _group_alive(pgid):
        raise RuntimeError(f"{daemon.name} (process group {pgid}) still has processes after SIGKILL")


def _stop_all(daemons: list[Daemon]) -> None:
    """Workers first (and their executors), then the master; every one, even if one fails to stop."""
    errors = []
    for daemon in reversed(daemons):
        try:
            _stop(daemon)
        except RuntimeError as exc:
            errors.append(str(exc))
    if errors:
        raise RuntimeError("; ".join(errors))


def _wait_for(what: str, ready, daemons: list[Daemon], timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        for d in daemons:
            if d.process.poll() is not None:
                raise RuntimeError(f"{d.name} exited with {d.process.returncode} before {what}; "
                                   f"its log ({d.log}):\n{log_tail(d.log)}")
        try:
            result = ready()
        except (OSError, ValueError):  # not listening, or not answering JSON, yet
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {d.name} ({d.log}):\n{log_tail(d.log, 1500)}" for d in daemons)
            raise RuntimeError(f"{what}: not within {timeout:.0f} s\n{logs}")
        time.sleep(0.5)


@contextmanager
def standalone_cluster(folder: Path, workers: int = 2, cores: int = 1, memory: str = "2g",
                       timeout: float = 120.0) -> Iterator[StandaloneCluster]:
    """A master and `workers` workers of `cores` cores and `memory` each, on 127.0.0.1, logs and
    worker dirs under `folder`; all registered on entry, all processes gone on exit."""
    folder.mkdir(parents=True, exist_ok=True)
    # JDK_JAVA_OPTIONS reaches the daemons and the executors they start; each JVM notes it in its own log.
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "JDK_JAVA_OPTIONS": SUBPROCESS_JVM_OPTIONS}
    # Nothing of the caller's Spark setup (a conf dir with spark-defaults.conf, ports): only the arguments.
    for inherited in ("SPARK_CONF_DIR", "SPARK_WORKER_DIR", "SPARK_MASTER_HOST", "SPARK_MASTER_PORT", "SPARK_WORKER_PORT"):
        env.pop(inherited, None)
    port, webui_port = free_port(), free_port()
    cluster = StandaloneCluster(f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{webui_port}",
                                [folder / f"worker-{i}" for i in range(1, workers + 1)])
    try:
        master = _start("Spark master", [MASTER, "--host", "127.0.0.1", "--port", str(port),
                                         "--webui-port", str(webui_port)], env, folder / "master.log")
        cluster.daemons.append(master)
        _wait_for(f"Spark master at {cluster.url} (web UI {cluster.webui}) to be ALIVE",
                  lambda: cluster.state().get("status") == "ALIVE", [master], timeout)
        worker_ui_ports = {}
        for i, work_dir in enumerate(cluster.worker_dirs, 1):
            work_dir.mkdir()
            worker_ui_ports[f"Spark worker {i}"] = ui_port = free_port()
            cluster.daemons.append(_start(
                f"Spark worker {i}",
                [WORKER, "--host", "127.0.0.1", "--cores", str(cores), "--memory", memory,
                 "--webui-port", str(ui_port), cluster.url],
                {**env, "SPARK_WORKER_DIR": str(work_dir)}, folder / f"worker-{i}.log"))
        deadline = time.monotonic() + timeout
        for name, ui_port in worker_ui_ports.items():  # the master knows a worker by its web UI address
            _wait_for(f"{name} (web UI port {ui_port}, {cores} core(s), {memory}) to register with the master at {cluster.url}",
                      lambda: _worker_alive(cluster.state(), ui_port), cluster.daemons, max(deadline - time.monotonic(), 1.0))
        assert cluster.state().get("aliveworkers") == workers, cluster.state()
        yield cluster
    finally:
        _stop_all(cluster.daemons)


def _worker_alive(state: dict, ui_port: int) -> bool:
    return any(w.get("state") == "ALIVE" and w.get("webuiaddress", "").endswith(f":{ui_port}")
               for w in state.get("workers", []))
