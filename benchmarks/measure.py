"""Timing and peak-memory helpers shared by the benchmarks."""

from __future__ import annotations

import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
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


def python_peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
