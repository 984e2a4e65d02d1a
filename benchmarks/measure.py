"""Timing and peak-memory helpers shared by the benchmarks."""

from __future__ import annotations

import os
import resource
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


def jvm_peak_rss_mib(spark) -> float:
    """Peak resident memory of this process's Spark driver JVM (VmHWM), in MiB."""
    pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


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
