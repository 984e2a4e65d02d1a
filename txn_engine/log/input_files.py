"""The checks of ingest's input files that need neither Spark nor the warehouse: a missing, empty,
binary or unknown-format file, or a Parquet footer that lacks a required column, is refused in
milliseconds, before a command starts its JVM or its Dagster run (`txn_engine.log.ingest` reads
the files; it runs these checks first too).
"""

from __future__ import annotations

import codecs
import difflib
import json
import re
from pathlib import Path
from typing import NoReturn, Sequence

from txn_engine.core.errors import InputFileError
from txn_engine.core.settings import executors_on_this_host
from txn_engine.core.schema import LEDGER_ENTRY_COLUMNS

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet"}
REQUIRED_COLUMNS = ("topic", "ledger_id", "entry_id", "entry_type")
def _format_of(path: str) -> str | None:
    lower = path.lower()
    for suffix, fmt in FORMATS.items():
        if lower.endswith(suffix):
            return fmt
    return None


def unknown_columns_error(path: str, unknown: Sequence[str], where: str = "") -> InputFileError:
    """The file-level error for columns ingest does not know: their values would be dropped silently
    (a misspelled `txnMostBits` would turn transactional rows non-transactional)."""
    hints = []
    for name in unknown:
        snake = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower().strip()
        close = difflib.get_close_matches(snake, LEDGER_ENTRY_COLUMNS, n=1, cutoff=0.75)
        if close:
            hints.append(f"{name} -> {close[0]}")
    return InputFileError(
        f"{path} has unknown column(s) {', '.join(sorted(unknown))}{where}; ingest knows only the ledger_entries "
        f"columns ({', '.join(LEDGER_ENTRY_COLUMNS)}; {', '.join(REQUIRED_COLUMNS)} required, the others optional) "
        "and would drop the values of any other. Rename or remove them"
        + (f" (did you mean {', '.join(hints)}?)" if hints else "")
        + " and ingest the file again. Nothing was ingested."
    )


SNIFF_BYTES = 64 * 1024  # of a text file read up front to tell it is text, and JSONL
SNIFF_LINES = 50  # JSONL lines looked at up front: a file none of which is a JSON object is refused


def check_input_files(paths: Sequence[str], master: str | None = None) -> None:
    """The file-level checks ingest can make in milliseconds, in Python, before Spark starts: for
    each local path (a folder: its files), that it exists, has a known format and is readable, that
    it is not empty, that a Parquet file has a readable footer with the required columns and no
    unknown one, and that a text file is text (a JSONL one with a JSON object among its first lines).
    Paths on other file systems (s3a://, hdfs://) are left to `resolve_sources`. With the Spark
    `master` given, a plain local path is refused when executors run on other hosts."""
    if not paths:
        raise InputFileError("no input files given; name one or more .jsonl, .csv or .parquet files")
    check_readable_by_executors(paths, master)
    for raw in paths:
        if "://" in raw and not raw.startswith("file:"):
            continue
        path = Path(raw[5:] if raw.startswith("file:") else raw)
        if not path.exists():
            raise missing_input(raw)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and _format_of(p.name))
            for child in found or [no_input_in_folder(raw)]:
                _check_file(child, _format_of(child.name))
            continue
        _check_file(path, format_or_error(raw))


def check_readable_by_executors(paths: Sequence[str], master: str | None) -> None:
    """Executors on other hosts cannot read a plain path of this one. A URI passes: a store's
    (s3://, hdfs://) they reach, or a `file:` one, which says every host mounts it at the same place."""
    if master is None or executors_on_this_host(master):
        return
    for raw in paths:
        if "://" in raw or raw.startswith("file:"):
            continue
        raise InputFileError(
            f"input {raw} is a path on this host, but the executors of {master} run on other hosts and cannot "
            f"read it: put it on the warehouse's store (e.g. s3://bucket/incoming/) or, if every worker mounts it "
            f"at the same place, name it file://{Path(raw).resolve()}")


def missing_input(raw: str) -> InputFileError:
    return InputFileError(f"input file {raw} does not exist; nothing was ingested")


def no_input_in_folder(raw: str) -> NoReturn:
    raise InputFileError(f"folder {raw} holds no .jsonl, .csv or .parquet file; nothing was ingested")


def format_or_error(raw: str) -> str:
    """The format of an input file by its name, or the error naming the known ones."""
    fmt = _format_of(raw)
    if fmt is None:
        raise InputFileError(
            f"unknown format of {raw}: supported are .jsonl (or .ndjson/.json), .csv and "
            ".parquet; rename the file or convert it. Nothing was ingested."
        )
    return fmt


def _check_file(path: Path, fmt: str) -> None:
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError as exc:
        raise InputFileError(f"cannot read {path}: {exc.strerror}; nothing was ingested") from None
    if not head.strip():
        raise InputFileError(f"input file {path} is empty: it holds no entry to ingest; nothing was ingested")
    if fmt == "parquet":
        import pyarrow as pa  # here: only a Parquet input pays for the import
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(path)
            rows = pq.read_metadata(path).num_rows
        except (pa.ArrowException, OSError) as exc:
            raise InputFileError(f"cannot read {path}: it is not a Parquet file ({str(exc).splitlines()[0]}); "
                                 "nothing was ingested") from None
        if rows == 0:
            raise InputFileError(f"input file {path} is empty: its Parquet footer counts 0 rows; nothing was ingested")
        check_columns(str(path), schema.names)
        return
    # Text: a cut multi-byte character at the end of the sample is not an error.
    text = codecs.getincrementaldecoder("utf-8")()
    try:
        sample = text.decode(head, final=len(head) < SNIFF_BYTES)
    except UnicodeDecodeError as exc:
        raise InputFileError(f"cannot read {path} as {fmt.upper()}: byte {exc.start} is not UTF-8 text (is it a "
                             "binary file?); nothing was ingested") from None
    if "\x00" in sample:
        raise InputFileError(f"cannot read {path} as {fmt.upper()}: it holds NUL bytes (is it a binary file?); "
                             "nothing was ingested")
    if fmt == "jsonl":
        lines = [line for line in sample.splitlines()[: SNIFF_LINES + 1] if line.strip()]
        if len(head) == SNIFF_BYTES and len(lines) > 1:
            lines = lines[:-1]  # the sample may end inside a line
        if not any(_is_json_object(line) for line in lines[:SNIFF_LINES]):
            raise InputFileError(f"{path} is not JSONL: none of its first {len(lines[:SNIFF_LINES])} line(s) is a JSON "
                                 "object (one entry per line, e.g. {\"topic\": ..., \"ledger_id\": ...}); "
                                 "nothing was ingested")


def check_columns(path: str, columns: Sequence[str], header: bool = False) -> None:
    """An input's columns (a Parquet schema's, or a CSV `header`'s): the required ones there, no unknown one."""
    where = " in its header" if header else ""
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    if missing:
        raise InputFileError(
            f"{path} has no column(s) {', '.join(missing)}{where}; "
            f"{'the header must name' if header else 'a Parquet input needs'} the "
            f"ledger_entries columns ({', '.join(LEDGER_ENTRY_COLUMNS)}). Nothing was ingested."
        )
    unknown = [c for c in columns if c not in LEDGER_ENTRY_COLUMNS]
    if unknown:
        raise unknown_columns_error(path, unknown, where)


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


