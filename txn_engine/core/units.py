"""Ages and sizes as operators write them (`7d`, `10GB`): parsed without importing anything heavy,
so a command refuses a bad value in milliseconds."""

from __future__ import annotations

import re
from datetime import timedelta

from txn_engine.core.errors import TxnlakeError


class UnitError(TxnlakeError, ValueError):
    """An age or a size that cannot be read."""


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
               "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_duration(text: str) -> timedelta:
    """`90m`, `36h`, `7d`, `2w` or plain seconds, as a timedelta (what `--max-age` takes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if not match:
        raise UnitError(f"cannot read {text!r} as an age: write a number with s, m, h, d or w, e.g. 7d or 36h")
    return timedelta(seconds=float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"])


def parse_bytes(text: str) -> int:
    """`500000`, `512MiB`, `10GB` ... as a number of bytes (what `--max-bytes` takes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in _BYTE_UNITS:
        raise UnitError(f"cannot read {text!r} as a size: write bytes, or a number with KB, MB, GB, "
                                   "KiB, MiB or GiB, e.g. 10GB")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2)])


