"""The transaction engine in Dagster: the demo workload job, the timeout sensor and its job.

(No `from __future__ import annotations`: Dagster reads the config and context annotations.)
"""


from datetime import datetime, timezone

from dagster import (
    Definitions,
    AssetMaterialization,
    Config,
    MetadataValue,
    OpExecutionContext,
    RunRequest,
    SensorEvaluationContext,
    SkipReason,
    job,
    op,
    sensor,
)
from pydantic import Field

from assets.metadata import table_metadata
from resources.engine import EngineResource
from resources.spark import SparkResource
from resources.warehouse import WarehouseResource
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.producers.demo_workload import WorkloadMix, run_demo_workload
from txn_engine.core.schema import LEDGER_ENTRIES
from txn_engine.producers.admin import TxnAdmin
from txn_engine.core.errors import EngineLockedError
from txn_engine.storage.warehouse import Warehouse

GROUP = "engine"
DEMO_WORKLOAD = "demo_workload"
ABORT_EXPIRED_JOB = "abort_expired_transactions"


class DemoWorkloadConfig(Config):
    producers: int = Field(default=4, description="Concurrent producer threads.")
    transactions_per_producer: int = Field(default=20)
    messages_per_transaction: int = Field(default=5)
    topics: int = Field(default=3)
    abort_ratio: float = Field(default=0.15)
    timeout_ratio: float = Field(default=0.05, description="Transactions left open until the coordinator aborts them.")
    retry_ratio: float = Field(default=0.1, description="Sends retried with the same sequence number.")
    seed: int = Field(default=0)


@op(name=DEMO_WORKLOAD, description="A workload that really goes through the engine (commits, aborts, timeouts, "
    "retries, a zombie producer) into ledger_entries and txn_log; reports the ledger_entries materialization, with "
    "the outcome. A job, not an asset: the UI's 'Materialize all' must not write a demo into the warehouse.")
def demo_workload(
    context: OpExecutionContext,
    config: DemoWorkloadConfig,
    engine: EngineResource,
    warehouse: WarehouseResource,
    spark: SparkResource,
) -> dict:
    wh = warehouse.open(spark.session())
    mix = WorkloadMix(
        producers=config.producers,
        transactions_per_producer=config.transactions_per_producer,
        messages_per_transaction=config.messages_per_transaction,
        topics=config.topics,
        abort_ratio=config.abort_ratio,
        timeout_ratio=config.timeout_ratio,
        retry_ratio=config.retry_ratio,
        seed=config.seed,
    )
    with engine.open(wh) as running:
        counts = run_demo_workload(running, mix)
        rounds = running.writer.rounds
    context.log.info(f"demo workload: {counts} in {rounds} group commits")
    # The engine appended to ledger_entries (an external asset, see assets.ledger): a materialization
    # event of it from this run, so the UI and what watches ledger_entries see it updated.
    context.log_event(AssetMaterialization(
        asset_key=LEDGER_ENTRIES, description=f"appended by the engine in the {DEMO_WORKLOAD} run",
        metadata=table_metadata(wh, LEDGER_ENTRIES, written_by=DEMO_WORKLOAD, demo_outcome=MetadataValue.json(counts),
                                group_commits=rounds),
    ))
    return counts


@job(name="demo", description="Run the demo workload through the transaction engine (what `txnlake demo` does).")
def demo_job():
    demo_workload()


@op(description="Abort every transaction open past its timeout (the coordinator's timeout abort) when no "
    "engine runs; a running engine aborts its expired transactions itself.")
def abort_expired_op(context: OpExecutionContext, engine: EngineResource, warehouse: WarehouseResource, spark: SparkResource):
    try:
        running = engine.open(warehouse.open(spark.session()))
    except EngineLockedError as exc:
        # Not a failure: the engine holding the warehouse aborts what is open past its timeout itself
        # (txn_engine.producers.engine), at least every abort_expired_interval_seconds.
        context.log.info(
            "an engine is running on this warehouse and aborts its expired transactions itself; nothing to "
            f"do here ({exc})"
        )
        return []
    with running:
        aborted = running.abort_expired()
    context.log.info(f"aborted {len(aborted)} expired transaction(s): {', '.join(map(str, aborted)) or 'none'}")
    return [str(t) for t in aborted]


@job(name=ABORT_EXPIRED_JOB, description="Abort transactions open past their timeout; launched by the timeout sensor.")
def abort_expired_job():
    abort_expired_op()


def expired_transactions(warehouse: WarehouseResource, now: datetime) -> list[str]:
    """Ids of the transactions txn_log shows open past their timeout (read-only, no engine)."""
    tables = DeltaTables(Warehouse(None, warehouse.settings()))
    return [str(i.txn) for i in TxnAdmin(tables, with_ledgers=False).transactions().values() if i.expired(now)]


@sensor(job=abort_expired_job, minimum_interval_seconds=30, description="Launch the timeout abort when a transaction is open past its timeout.")
def txn_timeout_sensor(context: SensorEvaluationContext, warehouse: WarehouseResource):
    expired = expired_transactions(warehouse, datetime.now(timezone.utc))
    if not expired:
        return SkipReason("no transaction is open past its timeout")
    # No run key: a key made of the expired ids repeats while they stay expired, and Dagster never
    # launches a key twice, so a run that could not abort them (it failed, or found an engine running
    # that had not come by yet) would be the last. Ticks are 30 s apart; a run with nothing left to
    # abort does nothing.
    return RunRequest(tags={"txnlake/expired": ",".join(expired)[:200]})


defs = Definitions(jobs=[demo_job, abort_expired_job], sensors=[txn_timeout_sensor])
