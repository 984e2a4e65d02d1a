"""A process standing for another host in the lease tests (tests/test_s3_leases.py).

Usage: python -m tests.lease_holder count NAME TIMES   increment the counter object TIMES times, each
                                                       read-modify-write under the lease NAME
       python -m tests.lease_holder hold NAME READY    take the lease NAME, touch READY, hold it until killed
       python -m tests.lease_holder hold NAME READY S  the same, releasing it after S seconds
The store and the warehouse come from the environment (TXNLAKE_WAREHOUSE, TXNLAKE_S3_*).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from txn_engine.core.settings import WarehouseSettings, split_s3_uri
from txn_engine.storage.locks import writer_lock
from txn_engine.storage.s3 import s3_client

COUNTER = "counter"


def counter_key(settings: WarehouseSettings) -> tuple[str, str]:
    bucket, prefix = split_s3_uri(settings.warehouse)
    return bucket, f"{prefix}/{COUNTER}"


def read_counter(settings: WarehouseSettings) -> int:
    bucket, key = counter_key(settings)
    try:
        return int(s3_client(settings).get_object(Bucket=bucket, Key=key)["Body"].read())
    except s3_client(settings).exceptions.NoSuchKey:
        return 0


def main() -> None:
    action, name = sys.argv[1:3]
    settings = WarehouseSettings()
    if action == "count":
        bucket, key = counter_key(settings)
        for _ in range(int(sys.argv[3])):
            with writer_lock(settings, name, timeout_s=120):
                value = read_counter(settings)
                time.sleep(0.01)  # widen the window a lost update would need
                s3_client(settings).put_object(Bucket=bucket, Key=key, Body=str(value + 1).encode())
    elif action == "hold":
        with writer_lock(settings, name, timeout_s=30):
            Path(sys.argv[3]).touch()
            time.sleep(float(sys.argv[4]) if len(sys.argv) > 4 else 3600)


if __name__ == "__main__":
    main()
