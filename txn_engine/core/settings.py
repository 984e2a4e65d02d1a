"""Warehouse settings: where the tables live, and how to reach the object store they may live on.

Every table location is derived here, once, and so are the object store's settings as Spark
(`spark_storage_conf`) and delta-rs (`storage_options`) each spell them: one setting reaches both.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlparse, urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from txn_engine.core.errors import ConfigurationError
from txn_engine.core.schema import INTERNAL_FOLDER, OFFLOAD_MANIFEST, OFFLOADED_ENTRIES, Place, table_place

# What each folder setting is, as its errors name it.
_WAREHOUSE = "the warehouse root (TXNLAKE_WAREHOUSE)"
_COLD_TIER = "the offload tier root (TXNLAKE_COLD_TIER, default <warehouse>/cold)"
_LOCK_DIR = "the writer lock folder (TXNLAKE_LOCK_DIR, default <warehouse>/_internal/locks)"
LOCKS_FOLDER = "locks"  # under the internal folder
FORMER_TIER_TABLES = (OFFLOADED_ENTRIES, OFFLOAD_MANIFEST)  # at the tier's root before the split
_ENDPOINT = "the object store's endpoint (TXNLAKE_S3_ENDPOINT)"

# URI schemes of an S3 (or S3-compatible) store: delta-rs reads both, Spark maps both to S3A.
S3_SCHEMES = ("s3", "s3a")

# Where the transaction buffer's kernel runs (`TXNLAKE_COMPUTE`): chosen by size, or forced.
COMPUTE_CHOICES = ("auto", "driver", "spark")
# `auto`'s bounds, by the catalog's `size_bytes` of the entries a run reads: the driver holds the
# narrow facts and the full rows it writes, Spark's heap beside it.
DRIVER_SCOPE_MAX_BYTES = 256 * 1024 * 1024
DRIVER_FULL_RUN_MAX_BYTES = 2 * 1024 * 1024 * 1024


LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


def is_local_uri(uri: str) -> bool:
    """True for a plain path or a `file:` URI: the ones a file lock on this machine can guard."""
    scheme = urlparse(uri).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")


# A Spark (or spark.hadoop.*) property name: dotted words, e.g. spark.hadoop.fs.s3a.bucket.my-bucket.endpoint.
# Dotted names; `#` as in Parquet's per-column keys (`spark.hadoop.parquet.enable.dictionary#payload`).
_PROPERTY = re.compile(r"\s*([A-Za-z][\w-]*(?:\.[\w#-]+)+)\s*=(.*)")


def conf_from_environment() -> dict[str, str]:
    """TXNLAKE_SPARK_MASTER and TXNLAKE_SPARK_CONF as Spark settings.

    TXNLAKE_SPARK_CONF is `key=value` items separated by commas or newlines. A comma (or newline)
    starts a new item only where a property name and `=` follow (`spark.x.y=`); otherwise it
    belongs to the value, so lists need no quoting:
    `spark.jars.packages=io.delta:delta-spark_4.2_2.13:4.4.0,org.apache.hadoop:hadoop-aws:3.4.1`.
    Empty items are skipped; a newline inside a value becomes a comma.
    """
    conf: dict[str, str] = {}
    master = os.environ.get("TXNLAKE_SPARK_MASTER")
    if master:
        conf["spark.master"] = master
    raw = os.environ.get("TXNLAKE_SPARK_CONF", "")
    key = None
    for part in raw.replace("\n", ",").split(","):
        if not part.strip():
            continue
        item = _PROPERTY.fullmatch(part)
        if item:
            key = item.group(1)
            conf[key] = item.group(2).strip()
        elif key is None or part.strip().startswith("="):
            raise ConfigurationError(
                f"TXNLAKE_SPARK_CONF item {part.strip()!r} is not key=value with a property name as key; "
                "write it as TXNLAKE_SPARK_CONF='spark.driver.memory=4g,spark.sql.shuffle.partitions=4'"
            )
        else:  # a comma inside the previous value
            conf[key] = f"{conf[key]},{part.rstrip()}"
    return conf


def switched_off(variable: str) -> bool:
    """An on-by-default switch in the environment (`0`, `false`, `no`, `off` turn it off)."""
    return os.environ.get(variable, "1").strip().lower() in ("0", "false", "no", "off")


def is_local_master(master: str) -> bool:
    return master.startswith("local")


def is_loopback_master(master: str) -> bool:
    """A standalone master on this host's loopback (`spark://127.0.0.1:7077`, `spark://localhost:7077`):
    the driver must be reachable there too, so it binds to loopback as in local mode."""
    if not master.startswith("spark://"):
        return False
    hosts = [urlsplit(f"spark://{part}").hostname for part in master[len("spark://"):].split(",")]
    return all(h in LOOPBACK_HOSTS for h in hosts)


def executors_on_this_host(master: str) -> bool:
    """Whether every executor of `master` runs on this host, so a path here is a path there."""
    return is_local_master(master) or is_loopback_master(master)


def is_s3_uri(uri: str) -> bool:
    return urlparse(uri).scheme in S3_SCHEMES


def split_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, key) of `s3://bucket/key` or `s3a://bucket/key`; the key without a leading slash."""
    parsed = urlparse(uri)
    return parsed.netloc, parsed.path.lstrip("/")


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
        description="Where the writer locks live: a local folder (flock) or an s3:// prefix (leases with "
        "expiry); default: <warehouse>/_internal/locks for a local or S3 warehouse, ~/.cache/txnlake/locks otherwise.",
    )

    lock_lease_seconds: float = Field(
        default=60.0, description="Locks in an S3 store are leases this long, renewed while held: a crashed "
        "holder blocks the others this long at most.")

    # The object store: one setting for Spark (S3A) and delta-rs alike. Unset credentials fall back
    # to each client's own chain (AWS_* variables, profiles, instance roles).
    s3_endpoint: str | None = Field(
        default=None, description="http(s)://host[:port] of an S3-compatible store (TLS follows the scheme); "
        "default: AWS S3.")
    s3_region: str | None = Field(default=None, description="The store's region, e.g. us-east-1.")
    s3_access_key_id: str | None = Field(default=None, description="Access key id; default: the client's chain.")
    s3_secret_access_key: str | None = Field(default=None, description="Secret access key.")
    s3_session_token: str | None = Field(default=None, description="Session token of temporary credentials.")
    s3_path_style: bool = Field(
        default=False, description="Address buckets as host/bucket/key (most S3-compatible servers) rather than "
        "bucket.host/key.")

    compute: str = Field(
        default="auto",
        description="Where transaction-buffer runs, their whole-table checks, snapshot runs and the shipped SQL models compute: "
        "auto (the driver while what they read fits the bounds below, else Spark), driver, or spark.",
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

    @field_validator("lock_lease_seconds")
    @classmethod
    def _lease(cls, value: float) -> float:
        if value < 1:
            raise ConfigurationError(f"TXNLAKE_LOCK_LEASE_SECONDS is {value}; set it to 1 or more (default 60)")
        return value

    @field_validator("s3_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        parsed = urlparse(value.strip())
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ConfigurationError(
                f"{_ENDPOINT} is {value!r}; set it to http://host:port or https://host[:port] (the scheme says "
                "whether TLS is used), or unset it for AWS S3")
        return value.strip().rstrip("/")

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
        _require_folder(self.lock_root(), _LOCK_DIR)
        if self.s3_secret_access_key and not self.s3_access_key_id or self.s3_access_key_id and not self.s3_secret_access_key:
            raise ConfigurationError(
                "TXNLAKE_S3_ACCESS_KEY_ID and TXNLAKE_S3_SECRET_ACCESS_KEY go together: set both, or neither "
                "to use the client's own credential chain")
        return self

    @property
    def root(self) -> str:
        return self.warehouse

    def whole_tables_in_driver(self, stored_bytes: int) -> bool:
        """Whether work over whole tables of `stored_bytes` (their Delta files) runs in the driver:
        `compute` says so, or `auto` and they fit the full-run bound."""
        return self.compute == "driver" or (self.compute == "auto" and stored_bytes <= self.driver_full_run_max_bytes)

    def table_path(self, table: str) -> str:
        """Where `table` lives, by its place (`schema.TABLES`): the analyst's tables one folder each
        under the root, internal state under `<root>/_internal/`, the tier's data under the tier's root."""
        place = table_place(table)
        if place == Place.TIER:
            return self.cold_table_path(table)
        if place == Place.INTERNAL:
            return _join(self.internal_root(), table)
        return _join(self.warehouse, table)

    def former_table_path(self, table: str) -> str | None:
        """Where a txnlake before the public/internal split kept `table` (every table under the root,
        the offload manifest beside the tier's entries), when that is not where it lives now:
        `txnlake migrate` moves it."""
        former = self.cold_table_path(table) if table in FORMER_TIER_TABLES else _join(self.warehouse, table)
        return None if former == self.table_path(table) else former

    def former_lock_root(self) -> str | None:
        """The lock folder a txnlake before the split used by default, when it is not the one in use."""
        if self.lock_dir or not (is_local_uri(self.warehouse) or is_s3_uri(self.warehouse)):
            return None
        return _join(self.warehouse, "_locks")

    def internal_root(self) -> str:
        """The folder of the internal state: incremental runs, the engine's log, snapshots' state, locks."""
        return _join(self.warehouse, INTERNAL_FOLDER)

    def cold_root(self) -> str:
        """The root of the cold (offload) tier."""
        return self.cold_tier or _join(self.warehouse, "cold")

    def cold_table_path(self, table: str) -> str:
        """The location of a table in the cold (offload) tier."""
        return _join(self.cold_root(), table)

    def lock_root(self) -> str:
        """Where the locks live: a local folder (flock) or an S3 prefix (leases in the store)."""
        if self.lock_dir:
            return _normalize_root(self.lock_dir, _LOCK_DIR)
        if is_local_uri(self.warehouse):
            return str(Path(_local_path(self.warehouse)) / INTERNAL_FOLDER / LOCKS_FOLDER)
        if is_s3_uri(self.warehouse):
            return _join(self.internal_root(), LOCKS_FOLDER)
        return str(Path.home() / ".cache" / "txnlake" / "locks")

    def lock_path(self, name: str) -> str:
        """The lock `name` (a table's, or the buffer's, the engine's...): a file, or an S3 object."""
        return _join(self.lock_root(), f"{name}.lock")

    def locks_in_store(self) -> bool:
        """True when the locks are leases in the object store, shared by every host that reaches it."""
        return is_s3_uri(self.lock_root())

    def uses_s3(self) -> bool:
        """Whether anything here lives on an S3 store (or the store is configured, for inputs on it)."""
        return (any(is_s3_uri(u) for u in (self.warehouse, self.cold_root(), self.lock_root()))
                or self.s3_endpoint is not None)

    def storage_options(self, uri: str) -> dict[str, str] | None:
        """delta-rs's `storage_options` for a table at `uri`: the store's settings for an S3 URI
        (unset ones left to delta-rs's own AWS_* chain), None for any other. Commits stay safe
        across hosts: delta-rs creates each log entry with a conditional PUT (If-None-Match)."""
        if not is_s3_uri(uri):
            return None
        options = {
            "AWS_ENDPOINT_URL": self.s3_endpoint,
            "AWS_REGION": self.s3_region,
            "AWS_ACCESS_KEY_ID": self.s3_access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.s3_secret_access_key,
            "AWS_SESSION_TOKEN": self.s3_session_token,
        }
        if self.s3_endpoint and self.s3_endpoint.startswith("http://"):
            options["AWS_ALLOW_HTTP"] = "true"
        if self.s3_path_style:
            options["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] = "false"
        return {k: v for k, v in options.items() if v is not None}

    def spark_storage_conf(self) -> dict[str, str]:
        """The store's settings as Spark's (S3A) Hadoop configuration; empty when nothing is on S3.
        `s3://` URIs are read by S3A too, so one URI serves Spark and delta-rs."""
        if not self.uses_s3():
            return {}
        conf = {"spark.hadoop.fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",
                "spark.hadoop.fs.s3a.path.style.access": str(self.s3_path_style).lower()}
        if self.s3_endpoint:
            conf["spark.hadoop.fs.s3a.endpoint"] = self.s3_endpoint
            conf["spark.hadoop.fs.s3a.connection.ssl.enabled"] = str(self.s3_endpoint.startswith("https://")).lower()
        if self.s3_region:
            conf["spark.hadoop.fs.s3a.endpoint.region"] = self.s3_region
        if self.s3_access_key_id:
            conf["spark.hadoop.fs.s3a.access.key"] = self.s3_access_key_id
            conf["spark.hadoop.fs.s3a.secret.key"] = self.s3_secret_access_key or ""
            if self.s3_session_token:
                conf["spark.hadoop.fs.s3a.session.token"] = self.s3_session_token
                conf["spark.hadoop.fs.s3a.aws.credentials.provider"] = (
                    "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider")
            else:
                conf["spark.hadoop.fs.s3a.aws.credentials.provider"] = (
                    "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider")
        return conf

    def s3_client_config(self) -> dict[str, object]:
        """The store's settings as boto3 client arguments (the leases' client)."""
        config: dict[str, object] = {"region_name": self.s3_region or "us-east-1"}
        if self.s3_endpoint:
            config["endpoint_url"] = self.s3_endpoint
        if self.s3_access_key_id:
            config.update(aws_access_key_id=self.s3_access_key_id, aws_secret_access_key=self.s3_secret_access_key,
                          aws_session_token=self.s3_session_token)
        return config

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
