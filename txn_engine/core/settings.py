"""Warehouse settings: where the tables live. Every table location is derived here, once."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from txn_engine.core.errors import ConfigurationError

# What each folder setting is, as its errors name it.
_WAREHOUSE = "the warehouse root (TXNLAKE_WAREHOUSE)"
_COLD_TIER = "the offload tier root (TXNLAKE_COLD_TIER, default <warehouse>/cold)"
_LOCK_DIR = "the writer lock folder (TXNLAKE_LOCK_DIR, default <warehouse>/_locks)"

# Where the transaction buffer's kernel runs (`TXNLAKE_COMPUTE`): chosen by size, or forced.
COMPUTE_CHOICES = ("auto", "driver", "spark")
# `auto`'s bounds, by the catalog's `size_bytes` of the entries a run reads: the driver holds the
# narrow facts and the full rows it writes, Spark's heap beside it.
DRIVER_SCOPE_MAX_BYTES = 256 * 1024 * 1024
DRIVER_FULL_RUN_MAX_BYTES = 2 * 1024 * 1024 * 1024


def is_local_uri(uri: str) -> bool:
    """True for a plain path or a `file:` URI: the ones a file lock on this machine can guard."""
    scheme = urlparse(uri).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")


def _normalize_root(uri: str, setting: str) -> str:
    if not uri or not uri.strip():
        raise ConfigurationError(f"{setting} is empty; set it to a path or URI")
    uri = uri.strip()
    if urlparse(uri).scheme in ("",):
        return str(Path(uri).expanduser().resolve())
    return uri.rstrip("/")


def _require_folder(uri: str, setting: str) -> None:
    """Refuse a local folder that is a file, or lies under one: said at once, not as a
    NotADirectoryError in the first write, nor as "table does not exist" on every read."""
    if not is_local_uri(uri):
        return
    path = Path(_local_path(uri)).expanduser()
    for candidate in (path, *path.parents):
        if candidate.exists():  # the nearest existing one; the missing ones below it are made on write
            if not candidate.is_dir():
                where = "is" if candidate == path else f"lies under {candidate}, which is"
                raise ConfigurationError(
                    f"{setting} is {uri}, which {where} a file, not a folder. Set it to a folder "
                    "(a missing one is created) or a URI such as s3a://bucket/prefix."
                )
            return


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

    compute: str = Field(
        default="auto",
        description="Where transaction-buffer runs compute: auto (the driver while the entries read fit the bounds "
        "below, else Spark), driver, or spark.",
    )
    driver_scope_max_bytes: int = Field(
        default=DRIVER_SCOPE_MAX_BYTES, description="auto: incremental runs over at most this many entry bytes run in the driver."
    )
    driver_full_run_max_bytes: int = Field(
        default=DRIVER_FULL_RUN_MAX_BYTES, description="auto: full runs of a log of at most this many entry bytes run in the driver."
    )

    @field_validator("compute")
    @classmethod
    def _compute(cls, value: str) -> str:
        if value.strip().lower() not in COMPUTE_CHOICES:
            raise ConfigurationError(
                f"TXNLAKE_COMPUTE is {value!r}; set it to one of {', '.join(COMPUTE_CHOICES)} (auto chooses by size)"
            )
        return value.strip().lower()

    @field_validator("driver_scope_max_bytes", "driver_full_run_max_bytes")
    @classmethod
    def _bound(cls, value: int, info) -> int:
        if value < 0:
            raise ConfigurationError(f"TXNLAKE_{info.field_name.upper()} is {value}; set it to a byte count, 0 or more")
        return value

    @field_validator("warehouse")
    @classmethod
    def _root(cls, value: str) -> str:
        return _normalize_root(value, _WAREHOUSE)

    @field_validator("cold_tier")
    @classmethod
    def _cold(cls, value: str | None) -> str | None:
        return None if value is None else _normalize_root(value, _COLD_TIER)

    @model_validator(mode="after")
    def _folders(self) -> "WarehouseSettings":
        _require_folder(self.warehouse, _WAREHOUSE)
        _require_folder(self.cold_root(), _COLD_TIER)
        _require_folder(str(self.lock_folder()), _LOCK_DIR)
        return self

    @property
    def root(self) -> str:
        return self.warehouse

    def table_path(self, table: str) -> str:
        """The location of a hot table: one folder per table under the root."""
        return _join(self.warehouse, table)

    def cold_root(self) -> str:
        """The root of the cold (offload) tier."""
        return self.cold_tier or _join(self.warehouse, "cold")

    def cold_table_path(self, table: str) -> str:
        """The location of a table in the cold (offload) tier."""
        return _join(self.cold_root(), table)

    def lock_folder(self) -> Path:
        if self.lock_dir:
            return Path(self.lock_dir).expanduser()
        if is_local_uri(self.warehouse):
            return Path(_local_path(self.warehouse)) / "_locks"
        return Path.home() / ".cache" / "txnlake" / "locks"

    def lock_path(self, table: str) -> Path:
        return self.lock_folder() / f"{table}.lock"

    def is_local(self) -> bool:
        return is_local_uri(self.warehouse)

    def root_missing(self) -> bool:
        """True when the root is a local folder that does not exist: nothing was ever written there."""
        return self.is_local() and not Path(_local_path(self.warehouse)).expanduser().exists()


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def _local_path(uri: str) -> str:
    parsed = urlparse(uri)
    return parsed.path if parsed.scheme == "file" else uri
