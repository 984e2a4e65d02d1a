"""Warehouse settings: where the tables live. Every table location is derived here, once."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict



def is_local_uri(uri: str) -> bool:
    """True for a plain path or a `file:` URI: the ones a file lock on this machine can guard."""
    scheme = urlparse(uri).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")


def _normalize_root(uri: str) -> str:
    if not uri or not uri.strip():
        raise ValueError("the warehouse root is empty; set TXNLAKE_WAREHOUSE to a path or URI")
    uri = uri.strip()
    if urlparse(uri).scheme in ("",):
        return str(Path(uri).expanduser().resolve())
    return uri.rstrip("/")


class WarehouseSettings(BaseSettings):
    """Root of the Delta tables. Environment: TXNLAKE_WAREHOUSE, TXNLAKE_COLD_TIER, TXNLAKE_LOCK_DIR.

    Any URI Spark can write works (a local path, `file:/...`, `s3a://bucket/prefix`, ...).
    """

    model_config = SettingsConfigDict(env_prefix="TXNLAKE_", extra="ignore")

    warehouse: str = Field(default="./warehouse", description="Root of the hot tables.")
    cold_tier: str | None = Field(
        default=None, description="Root of the offload tier; default: <warehouse>/cold."
    )
    lock_dir: str | None = Field(
        default=None,
        description="Folder of the per-table writer locks; default: <warehouse>/_locks for a "
        "local warehouse, ~/.cache/txnlake/locks otherwise.",
    )

    @field_validator("warehouse")
    @classmethod
    def _root(cls, value: str) -> str:
        return _normalize_root(value)

    @field_validator("cold_tier")
    @classmethod
    def _cold(cls, value: str | None) -> str | None:
        return None if value is None else _normalize_root(value)

    @property
    def root(self) -> str:
        return self.warehouse

    def table_path(self, table: str) -> str:
        """The location of a hot table: one folder per table under the root."""
        return _join(self.warehouse, table)

    def cold_table_path(self, table: str) -> str:
        """The location of a table in the cold (offload) tier."""
        return _join(self.cold_tier or _join(self.warehouse, "cold"), table)

    def lock_path(self, table: str) -> Path:
        if self.lock_dir:
            base = Path(self.lock_dir).expanduser()
        elif is_local_uri(self.warehouse):
            base = Path(_local_path(self.warehouse)) / "_locks"
        else:
            base = Path.home() / ".cache" / "txnlake" / "locks"
        return base / f"{table}.lock"

    def is_local(self) -> bool:
        return is_local_uri(self.warehouse)


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def _local_path(uri: str) -> str:
    parsed = urlparse(uri)
    return parsed.path if parsed.scheme == "file" else uri
