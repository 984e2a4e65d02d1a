"""The Dagster webserver serves the asset graph (checked over its GraphQL API on loopback)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
QUERY = "{ assetNodes { assetKey { path } dependencyKeys { path } groupName } }"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_webserver_serves_the_asset_graph(tmp_path):
    port = free_port()
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path), "TXNLAKE_WAREHOUSE": str(tmp_path / "wh")}
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "dagster-webserver"), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        nodes = None
        deadline = time.monotonic() + 120
        while nodes is None:
            assert server.poll() is None, server.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "webserver did not answer in 120 s"
            try:
                request = urllib.request.Request(
                    f"http://127.0.0.1:{port}/graphql", data=json.dumps({"query": QUERY}).encode(),
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(request, timeout=5) as response:
                    payload = json.loads(response.read())
                nodes = payload["data"]["assetNodes"]
            except (OSError, KeyError, TypeError):
                time.sleep(0.5)
    finally:
        server.terminate()
        server.wait(timeout=30)
    graph = {"/".join(n["assetKey"]["path"]): {"/".join(d["path"]) for d in n["dependencyKeys"]} for n in nodes}
    assert graph["ledgers"] == {"ledger_entries"}
    assert graph["ledger_sizes"] == {"ledger_entries", "ledgers"}
    assert {"ledger_entries", "quarantine_entries"} <= set(graph)
