"""An S3-compatible server on loopback for the S3 warehouse tests: moto in server mode (pinned in
pyproject's dev extras), in a process of its own, with a bucket made for the caller.

moto answers S3's conditional writes (If-None-Match, If-Match on PutObject) by checking and then
storing in two steps, so two overlapping conditional PUTs could both pass its check; S3 makes
them atomic. The server therefore runs moto's application behind one lock for every request that
changes something, and concurrent reads: what commits race against is S3's guarantee, not moto's
thread scheduling.

`slow_jvm_commits` delays the JVM's (Spark's) PUTs of Delta log entries before they reach moto: a
slow link, which widens the window between a writer's check that version N is free and its PUT,
so a log store that checks and then writes loses commits where a conditional PUT does not.

`python -m tests.s3_server PORT [DELAY]` serves until killed; `s3_server()` starts and stops one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tests.spark_standalone import free_port, log_tail

REPO = Path(__file__).resolve().parent.parent
ACCESS_KEY, SECRET_KEY, REGION = "txnlake-test", "txnlake-test-secret", "us-east-1"


@dataclass
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    bucket: str

    def env(self, prefix: str = "warehouse") -> dict[str, str]:
        """The settings of a warehouse under s3://BUCKET/PREFIX on this server, as the environment gives them."""
        return {"TXNLAKE_WAREHOUSE": f"s3://{self.bucket}/{prefix}", "TXNLAKE_S3_ENDPOINT": self.endpoint,
                "TXNLAKE_S3_REGION": REGION, "TXNLAKE_S3_ACCESS_KEY_ID": ACCESS_KEY,
                "TXNLAKE_S3_SECRET_ACCESS_KEY": SECRET_KEY, "TXNLAKE_S3_PATH_STYLE": "true"}

    def settings(self, prefix: str = "warehouse", **extra):
        """The same warehouse as `env(prefix)` gives, as settings (`extra`: other fields)."""
        from txn_engine.core.settings import WarehouseSettings

        return WarehouseSettings(warehouse=f"s3://{self.bucket}/{prefix}", s3_endpoint=self.endpoint, s3_region=REGION,
                                 s3_access_key_id=ACCESS_KEY, s3_secret_access_key=SECRET_KEY, s3_path_style=True,
                                 **extra)

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, config=Config(s3={"addressing_style": "path"}))

    def keys(self, prefix: str) -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return [o["Key"] for page in pages for o in page.get("Contents", [])]


@contextmanager
def s3_server(folder: Path, bucket: str = "txnlake-test", timeout: float = 60.0,
              slow_jvm_commits: float = 0.0) -> Iterator[S3Server]:
    """A server on a free loopback port with `bucket` made, its log in `folder`; stopped on exit."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = folder / "s3-server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "tests.s3_server", str(port), str(slow_jvm_commits)], cwd=REPO, stdout=out,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    server = S3Server(f"http://127.0.0.1:{port}", bucket)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the S3 server exited with {process.returncode}; its log:\n{log_tail(log)}")
            try:
                urllib.request.urlopen(f"{server.endpoint}/moto-api/", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the S3 server did not answer within {timeout:.0f}s; its log:\n{log_tail(log)}")
                time.sleep(0.2)
        server.client().create_bucket(Bucket=bucket)
        yield server
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


class _WritesInTurn:
    """moto's WSGI application with every request but GET and HEAD run one at a time (module docstring)."""

    def __init__(self, app, slow_jvm_commits: float):
        self.app = app
        self.lock = threading.Lock()
        self.slow_jvm_commits = slow_jvm_commits

    def __call__(self, environ, start_response):
        if environ["REQUEST_METHOD"] in ("GET", "HEAD"):
            return self.app(environ, start_response)
        if (self.slow_jvm_commits and environ["REQUEST_METHOD"] == "PUT" and "aws-sdk-java" in environ.get("HTTP_USER_AGENT", "")
                and "/_delta_log/" in environ["PATH_INFO"] and environ["PATH_INFO"].endswith(".json")):
            time.sleep(self.slow_jvm_commits)
        with self.lock:
            return list(self.app(environ, start_response))


def main(port: int, slow_jvm_commits: float = 0.0) -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    app = _WritesInTurn(DomainDispatcherApplication(create_backend_app), slow_jvm_commits)
    server = make_server("127.0.0.1", port, app, threaded=True, request_handler=MotoRequestHandler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"serving S3 on 127.0.0.1:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
