"""Small builders of raw ledger rows for tests, in the ledger_entries columns of the brief."""

from __future__ import annotations

import base64
import csv
import json
from pathlib import Path
from typing import Any

from txn_engine.core.schema import LEDGER_ENTRY_COLUMNS


def entry(topic: str, ledger: int, entry: int, entry_type: str = "DATA", txn: tuple[int, int] | None = None,
          producer: int | None = None, seq: int | None = None, payload: bytes | None = b"x", key: str | None = None,
          publish_time: str | None = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    return {
        "topic": topic,
        "ledger_id": ledger,
        "entry_id": entry,
        "entry_type": entry_type,
        "txn_most_bits": None if txn is None else txn[0],
        "txn_least_bits": None if txn is None else txn[1],
        "producer_id": producer,
        "producer_epoch": None if producer is None else 0,
        "sequence_id": seq,
        "publish_time": publish_time,
        "key": key,
        "payload": None if payload is None or entry_type != "DATA" else base64.b64encode(payload).decode(),
    }


def write_jsonl(path: Path, rows: list[dict[str, Any] | str]) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def write_csv(path: Path, rows: list[dict[str, Any]], columns=LEDGER_ENTRY_COLUMNS) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for row in rows:
            writer.writerow(["" if row.get(c) is None else row.get(c) for c in columns])
    return path
