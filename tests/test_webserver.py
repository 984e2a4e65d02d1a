"""The Dagster webserver serves the asset graph: over its GraphQL API on loopback, and as a person
sees it, in headless Chromium (Debian's, driven by Playwright): the asset graph and a partitioned
asset's page render, screenshots taken (kept under TXNLAKE_SCREENSHOTS when set)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parent.parent
QUERY = "{ assetNodes { assetKey { path } dependencyKeys { path } groupName } }"
CHROMIUM = os.environ.get("TXNLAKE_CHROMIUM", "/usr/bin/chromium")
# Chromium on a closed network: no background connections, no sandbox as root (the machine's notes).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def graphql(port: int, query: str) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=json.dumps({"query": query}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


@contextmanager
def running_webserver(home: Path) -> Iterator[int]:
    """`dagster-webserver` on this checkout's workspace and the Dagster home `home`; its port once it answers."""
    port = free_port()
    env = {**os.environ, "DAGSTER_HOME": str(home), "TXNLAKE_WAREHOUSE": str(home / "wh")}
    if not (home / "dagster.yaml").exists():
        (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "dagster-webserver"), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "webserver did not answer in 120 s"
            try:
                if graphql(port, QUERY)["data"]["assetNodes"]:
                    break
            except (OSError, KeyError, TypeError):
                time.sleep(0.5)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.slow
def test_webserver_serves_the_asset_graph(tmp_path):
    with running_webserver(tmp_path) as port:
        nodes = graphql(port, QUERY)["data"]["assetNodes"]
    graph = {"/".join(n["assetKey"]["path"]): {"/".join(d["path"]) for d in n["dependencyKeys"]} for n in nodes}
    assert graph["ledgers"] == {"ledger_entries"}
    assert graph["ledger_sizes"] == {"ledger_entries", "ledgers"}
    assert {"ledger_entries", "quarantine_entries"} <= set(graph)


@pytest.mark.slow
def test_the_asset_graph_and_a_partitioned_asset_render_in_a_browser(tmp_path):
    from dagster import DagsterInstance
    from playwright.sync_api import sync_playwright

    from assets.partitions import LEDGER_PARTITIONS
    from txn_engine.core.positions import ledger_partition_key

    assert Path(CHROMIUM).is_file(), f"no Chromium at {CHROMIUM}: `make test` installs Debian's chromium (make browser)"
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    keys = [ledger_partition_key(topic, i) for topic in ("orders-0", "payments-0") for i in (7, 8)]
    with DagsterInstance.from_config(str(tmp_path)) as instance:
        instance.add_dynamic_partitions(LEDGER_PARTITIONS.name, keys)
    shots = Path(os.environ.get("TXNLAKE_SCREENSHOTS") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    with running_webserver(tmp_path) as port, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        try:
            page.goto("about:blank")
            blank = len(page.screenshot(path=str(shots / "blank.png")))
            # The global lineage: every group drawn, by name.
            page.goto(f"http://127.0.0.1:{port}/asset-groups")
            dismiss_the_welcome(page)
            for group in ("ledger", "transaction_buffer", "offload", "snapshots", "sql_models"):
                page.get_by_text(group, exact=True).first.wait_for(timeout=60_000)
            groups = len(page.screenshot(path=str(shots / "asset-groups.png")))
            # A group's graph: its assets and their upstream ones.
            page.goto(f"http://127.0.0.1:{port}/locations/__repository__@txnlake/asset-groups/transaction_buffer")
            dismiss_the_welcome(page)
            for name in ("committed_entries", "stable_positions", "txn_markers", "ledger_entries"):
                page.get_by_text(name, exact=True).first.wait_for(timeout=60_000)
            graph = len(page.screenshot(path=str(shots / "transaction_buffer-graph.png")))
            # A partitioned asset's partitions: the ledger keys a person launches backfills by.
            page.goto(f"http://127.0.0.1:{port}/assets/stable_positions?view=partitions")
            dismiss_the_welcome(page)
            for key in keys:  # e.g. orders-0/7: topic and ledger
                page.get_by_text(key, exact=True).first.wait_for(timeout=60_000)
            page.get_by_text("Missing (4)").first.wait_for(timeout=60_000)
            partitions = len(page.screenshot(path=str(shots / "stable_positions-partitions.png")))
        finally:
            browser.close()
    # Drawn pages compress far worse than a blank one of the same size.
    assert min(groups, graph, partitions) > 5 * blank, (blank, groups, graph, partitions)


def dismiss_the_welcome(page) -> None:
    """Dagster's first-visit dialog (community links, newsletter) covers the page: skip it."""
    from playwright.sync_api import TimeoutError as NotShown

    skip = page.get_by_role("button", name="Skip")
    try:
        skip.wait_for(timeout=5_000)
    except NotShown:  # already dismissed in this browser
        return
    skip.click()
