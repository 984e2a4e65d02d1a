"""A lock held by another writer, for tests: a thread here (a flock serializes threads too)."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, ContextManager, Iterator


@contextmanager
def held_elsewhere(lock: Callable[[], ContextManager]) -> Iterator[None]:
    """`lock()` taken and held by another thread for the block."""
    taken, release = threading.Event(), threading.Event()

    def hold():
        with lock():
            taken.set()
            release.wait(300)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert taken.wait(60)
        yield
    finally:
        release.set()
        holder.join(60)
