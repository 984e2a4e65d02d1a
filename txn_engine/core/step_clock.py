"""Where a multi-step run's time went: seconds per named step, measured between calls."""

from __future__ import annotations

import time


class StepClock:
    """Called with a step's name when it ends: records the seconds since the previous call (or creation)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, step: str) -> None:
        now = time.perf_counter()
        self.seconds[step] = now - self._last
        self._last = now
