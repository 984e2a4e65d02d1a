"""The object store's client for what Delta's clients do not do: the leases (`locks.Lease`),
listing and copying objects. Configured by `WarehouseSettings` like Spark's S3A and delta-rs."""

from __future__ import annotations

import threading

import boto3
import pyarrow.fs as pafs
from botocore.config import Config
from botocore.exceptions import ClientError

from txn_engine.core.settings import WarehouseSettings, is_s3_uri, split_s3_uri

_clients: dict[tuple, object] = {}
_clients_lock = threading.Lock()


def s3_client(settings: WarehouseSettings):
    """A boto3 S3 client for the store `settings` name, one per configuration and process (boto3
    clients are thread-safe)."""
    config = settings.s3_client_config()
    key = (tuple(sorted(config.items())), settings.s3_path_style)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            style = Config(s3={"addressing_style": "path" if settings.s3_path_style else "auto"},
                           retries={"max_attempts": 5, "mode": "standard"})
            client = _clients[key] = boto3.session.Session().client("s3", config=style, **config)
        return client


def arrow_filesystem(settings: WarehouseSettings, uri: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow file system for `uri` and the path in it: the store `settings` name for an S3 URI."""
    if not is_s3_uri(uri):
        return pafs.FileSystem.from_uri(uri)
    endpoint = settings.s3_endpoint
    fs = pafs.S3FileSystem(
        access_key=settings.s3_access_key_id, secret_key=settings.s3_secret_access_key,
        session_token=settings.s3_session_token, region=settings.s3_region,
        endpoint_override=endpoint.split("://", 1)[1] if endpoint else None,
        scheme=endpoint.split("://", 1)[0] if endpoint else "https",
        force_virtual_addressing=not settings.s3_path_style and endpoint is not None)
    bucket, key = split_s3_uri(uri)
    return fs, f"{bucket}/{key}"


def error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def precondition_failed(exc: ClientError) -> bool:
    """A conditional write lost: the object exists (If-None-Match) or changed (If-Match). S3 answers
    409 ConditionalRequestConflict when two such writes overlap; that one lost too."""
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status in (409, 412) or error_code(exc) in ("PreconditionFailed", "ConditionalRequestConflict")


def not_found(exc: ClientError) -> bool:
    return error_code(exc) in ("NoSuchKey", "404", "NotFound")
