"""argparse types shared by the `txnlake` commands."""

from __future__ import annotations

import argparse


def non_negative(kind: type = int):
    """An argparse `type`: a number of `kind` (int or float) that is 0 or more, else a clear usage error
    (argparse's plain `int` takes -1, and a count of -1 then means something it should not)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number") from None
        if not 0 <= value < float("inf"):  # also refuses nan and inf
            raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
        return value

    return parse
