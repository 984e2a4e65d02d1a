"""The whole asset graph, pinned: keys, groups, kinds, deps, partitions, checks, jobs, sensors and
schedules. An accidental change to the graph fails here; a deliberate one is recorded with
`TXNLAKE_UPDATE_ASSET_GRAPH=1 pytest tests/test_asset_graph.py` and reviewed in the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipelines.definitions import defs

PINNED = Path(__file__).with_name("asset_graph.json")


def describe_graph() -> dict:
    graph = defs.resolve_asset_graph()
    assets = {}
    for key in sorted(graph.get_all_asset_keys(), key=lambda k: k.to_user_string()):
        node = graph.get(key)
        partitions = node.partitions_def
        assets[key.to_user_string()] = {
            "group": node.group_name,
            "kinds": sorted(node.kinds),
            "deps": sorted(k.to_user_string() for k in node.parent_keys),
            "partitions": None if partitions is None else f"{type(partitions).__name__}:{getattr(partitions, 'name', '')}",
            "checks": sorted(c.name for c in node.check_keys),
            "pools": sorted(node.pools or ()),
        }
    return {
        "assets": assets,
        "jobs": sorted(j.name for j in defs.resolve_all_job_defs() if not j.name.startswith("__")),
        "sensors": sorted(s.name for s in defs.sensors or ()),
        "schedules": sorted(s.name for s in defs.schedules or ()),
    }


def test_asset_graph_is_the_pinned_one() -> None:
    described = describe_graph()
    if os.environ.get("TXNLAKE_UPDATE_ASSET_GRAPH"):
        PINNED.write_text(json.dumps(described, indent=1, sort_keys=True) + "\n")
    assert described == json.loads(PINNED.read_text())
