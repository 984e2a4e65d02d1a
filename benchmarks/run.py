"""`make bench`: every benchmark, one after the other, in one process (one SparkSession).

Each entry of BENCHMARKS is a module with `run_benchmark(workdir: Path) -> dict`; it prints
its figures and ratios as it goes. `make bench BENCH=name` runs one; BENCH_ENTRIES scales the
log-sized ones (default 10 million).
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

BENCHMARKS = {
    "buffer": "benchmarks.buffer_bench",
    "engine": "benchmarks.engine_bench",
    "snapshots": "benchmarks.snapshot_bench",
    "offload": "benchmarks.offload_bench",
    "kafka": "benchmarks.kafka_bench",
}


def work_parent(folder: str | None) -> str | None:
    """The folder the benchmarks' work folders go in (`TXNLAKE_BENCH_DIR`), created if missing;
    None for the system's temp folder."""
    if not folder:
        return None
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"TXNLAKE_BENCH_DIR={folder!r} cannot be created ({exc.strerror}); point it at a "
                         "writable folder, or unset it to use the temp folder") from None
    return folder


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    wanted = args or os.environ.get("BENCH", "").split() or list(BENCHMARKS)
    unknown = [w for w in wanted if w not in BENCHMARKS]
    if unknown:
        print(f"error: unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    try:
        parent = work_parent(os.environ.get("TXNLAKE_BENCH_DIR"))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name in wanted:
        workdir = Path(tempfile.mkdtemp(prefix=f"txnlake-bench-{name}-", dir=parent))
        try:
            importlib.import_module(BENCHMARKS[name]).run_benchmark(workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
