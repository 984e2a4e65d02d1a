"""Timing and peak-memory helpers shared by the benchmarks."""

from __future__ import annotations

import os
import resource
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator


@dataclass
class Timing:
    label: str
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


@contextmanager
def timed(label: str) -> Iterator[Timing]:
    timing = Timing(label)
    started = time.perf_counter()
    try:
        yield timing
    finally:
        timing.seconds = time.perf_counter() - started
        print(f"  {label:<48} {timing.seconds:8.2f} s", flush=True)


def peak_rss_mib(pid: int) -> float:
    """Peak resident memory of process `pid` (VmHWM), in MiB; NaN once it is gone."""
    kib = _status(pid, "VmHWM:")
    return float("nan") if kib is None else kib / 1024


def jvm_peak_rss_mib(spark) -> float:
    """Peak resident memory of this process's Spark driver JVM (VmHWM), in MiB."""
    return peak_rss_mib(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())


def jvm_cpu_seconds(spark) -> float:
    """CPU time (user + system) of this process's Spark driver JVM and its children (the Python
    workers, and those they reaped): in local mode all of Spark's work. On a loaded machine it
    moves far less than the wall time, so ratios of it compare runs."""
    jvm = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
    stats = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        stats[int(stat.parent.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]))
    tree, total, grew = {jvm}, 0, True
    while grew:
        more = {pid for pid, (parent, _) in stats.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    total = sum(stats[pid][1] for pid in tree if pid in stats)
    return total / os.sysconf("SC_CLK_TCK")


def python_peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status(pid: int, key: str) -> int | None:
    """A /proc/<pid>/status field in KiB (None once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _python_workers(pid: int) -> list[int]:
    """The PySpark daemon and workers below `pid` (not the JVM's other children: a fork of the JVM
    reports the JVM's own peak)."""
    found = []
    for child in _descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"pyspark" in f.read():
                    found.append(child)
        except OSError:
            pass
    return found


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class ChildPeaks:
    """The peak resident memory (VmHWM) of the Python workers below `pid` (the Spark JVM), polled
    every `interval_s` from a thread: a worker's peak is read while it lives."""

    def __init__(self, pid: int, interval_s: float = 0.2):
        self.pid, self.interval_s = pid, interval_s
        self.peaks_kib: dict[int, int] = {}
        self.limits: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            for child in _python_workers(self.pid):
                peak = _status(child, "VmHWM:")
                if peak is not None:
                    self.peaks_kib[child] = max(peak, self.peaks_kib.get(child, 0))
                try:  # the soft limit, as the worker sets it once started
                    with open(f"/proc/{child}/limits") as f:
                        self.limits[child] = next((line.split()[3] for line in f if line.startswith("Max address space")), "?")
                except OSError:
                    pass
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "ChildPeaks":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_mib(self) -> float:
        return max(self.peaks_kib.values(), default=0) / 1024
