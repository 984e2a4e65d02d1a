"""Dagster runs as `txnlake run` and the daemon make them, for tests: in-process, real instance."""

from __future__ import annotations

import json
import weakref

from dagster import AssetSelection, DagsterInstance, SensorResult, build_sensor_context, materialize

from assets.partitions import LEDGER_PARTITIONS, range_tags
from assets.transaction_buffer.sensors import ledgers_closed_sensor
from pipelines.definitions import ALL_ASSETS, ALL_CHECKS, DERIVED_SELECTION
from txn_engine.core.schema import LEDGERS


def derive_all(resources, instance=None):
    """What `txnlake run` does: the catalog run, the closed ledgers added as partitions, one run over all of them."""
    instance = instance or DagsterInstance.ephemeral()
    assets = [*ALL_ASSETS, *ALL_CHECKS]
    catalog = materialize(assets, selection=AssetSelection.assets(LEDGERS), resources=resources, instance=instance)
    assert catalog.success
    sensor = sensor_tick(instance, resources)
    keys = instance.get_dynamic_partitions(LEDGER_PARTITIONS.name)
    assert keys, sensor
    rest = materialize(assets, selection=DERIVED_SELECTION - AssetSelection.assets(LEDGERS), resources=resources,
                       instance=instance, tags=range_tags(keys[0], keys[-1]))
    return catalog, rest


_CURSORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # the sensor's cursor per instance, as the daemon keeps it


def sensor_tick(instance, resources):
    """Evaluate the sensor and apply its partition requests and cursor, as the daemon would."""
    context = build_sensor_context(instance=instance, resources=resources, cursor=_CURSORS.get(instance))
    result = ledgers_closed_sensor(context)
    _CURSORS[instance] = context.cursor
    if isinstance(result, SensorResult):
        for request in result.dynamic_partitions_requests:
            instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return result


def backdate_sensor_requests(instance, seconds: float) -> None:
    """As if `seconds` had passed since the ledgers_closed_sensor's requests (its cursor's times)."""
    cursor = json.loads(_CURSORS[instance])
    _CURSORS[instance] = json.dumps({name: {**last, "at": last["at"] - seconds} for name, last in cursor.items()})
