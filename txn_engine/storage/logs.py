"""The health of the tables' Delta logs, read as files (no Spark, no delta-rs): is each table's head
commit whole? A storage crash can leave the last commit file cut short; Spark then fails deep in a
job with a `ChecksumException` and delta-rs with a JSON error, neither naming the table or the fix.
`txnlake doctor` checks every table; the commands check before they start (milliseconds).
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable
from urllib.parse import urlparse

from txn_engine.core.errors import TxnlakeError
from txn_engine.core.settings import WarehouseSettings


class DamagedTableError(TxnlakeError):
    """A table's Delta log is damaged (its head commit cut short); nothing was read or written."""


@dataclass(frozen=True)
class LogHealth:
    table: str
    path: str
    version: int | None  # the head commit's version; None: no table there
    problem: str | None = None  # what is wrong with the head commit, None when it is whole

    def advice(self) -> str:
        previous = f"version {self.version - 1}" if self.version else "no version (the table did not exist before)"
        return (f"table {self.table}: {self.problem}; move that file (and its .crc beside it, if any) out of "
                f"{Path(self.path) / '_delta_log'}: the table then reads as of {previous}; then re-run the command "
                "that wrote it (ingest and the derived tables are idempotent)")


def _local_dir(table_path: str) -> Path | None:
    if table_path.startswith("file:"):
        return Path(urlparse(table_path).path)
    return None if "://" in table_path else Path(table_path)


def _hadoop_crc_mismatch(data: bytes, crc_file: Path) -> bool:
    """Whether Hadoop's checksum file beside a commit (Spark on a local disk writes one) disagrees
    with the commit's bytes: a CRC32 per chunk after an 8-byte header."""
    try:
        raw = crc_file.read_bytes()
    except OSError:
        return False
    if len(raw) < 8 or raw[:4] != b"crc\x00":
        return False
    chunk = struct.unpack(">I", raw[4:8])[0]
    if chunk <= 0:
        return False
    stored = [struct.unpack(">I", raw[i:i + 4])[0] for i in range(8, len(raw) - 3, 4)]
    return stored != [zlib.crc32(data[i:i + chunk]) for i in range(0, len(data), chunk)]


def head_commit_problem(commit: Path) -> str | None:
    """What is wrong with one commit file, or None: empty, a line that is not a whole JSON object,
    or bytes that disagree with its Hadoop checksum."""
    name = f"its last commit {commit.name}"
    try:
        data = commit.read_bytes()
    except OSError as exc:
        return f"{name} cannot be read ({exc.strerror})"
    if not data.strip():
        return f"{name} is empty (cut short)"
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            action = json.loads(line)
        except ValueError:
            return f"{name} is cut short or damaged (line {number} is not whole JSON)"
        if not isinstance(action, dict):
            return f"{name} is damaged (line {number} is not a Delta action)"
    if _hadoop_crc_mismatch(data, commit.with_name(f".{commit.name}.crc")):
        return f"{name} does not match its checksum file .{commit.name}.crc (cut short or damaged)"
    return None


def log_health(settings: WarehouseSettings, table: str) -> LogHealth:
    path = settings.table_path(table)
    folder = _local_dir(path)
    if folder is None:  # object storage: commits are written whole (put-if-absent)
        return LogHealth(table, path, None)
    log = folder / "_delta_log"
    try:
        versions = [int(p.name[:-5]) for p in log.iterdir() if p.name.endswith(".json") and p.name[:-5].isdigit()]
    except (FileNotFoundError, NotADirectoryError):
        return LogHealth(table, path, None)
    if not versions:
        return LogHealth(table, path, None)
    head = max(versions)
    return LogHealth(table, path, head, head_commit_problem(log / f"{head:020d}.json"))


def check_logs(settings: WarehouseSettings, tables: Iterable[str]) -> list[LogHealth]:
    """Each table's log health (the tables that do not exist too, version None)."""
    return [log_health(settings, t) for t in tables]


def require_whole_logs(settings: WarehouseSettings, tables: Iterable[str]) -> None:
    """Raise DamagedTableError naming the first table whose head commit is damaged, and what to do."""
    for health in check_logs(settings, tables):
        if health.problem:
            raise DamagedTableError(health.advice() + "; `txnlake doctor` checks every table")
