"""The transaction engine as a Dagster resource: its settings, configured once in Definitions."""

from __future__ import annotations

from datetime import timedelta

from dagster import ConfigurableResource
from pydantic import Field

from txn_engine.producers.engine import ABORT_EXPIRED_INTERVAL_S, Engine
from txn_engine.producers.ledger_writer import RolloverPolicy
from txn_engine.storage.upkeep import UpkeepPolicy
from txn_engine.storage.warehouse import Warehouse

_DEFAULT = RolloverPolicy()
_UPKEEP = UpkeepPolicy()


class EngineResource(ConfigurableResource):
    """Opens the warehouse's one engine (see txn_engine.producers.engine: a second one is refused)."""

    txn_groups: int = Field(default=1, description="Transaction groups of the coordinator log (txn_most_bits).")
    rollover_max_entries: int = Field(default=_DEFAULT.max_entries, description="Roll a ledger over after this many entries.")
    rollover_max_bytes: int = Field(default=_DEFAULT.max_bytes, description="... or this many payload+key bytes.")
    rollover_max_age_seconds: float = Field(
        default=_DEFAULT.max_age.total_seconds(), description="... or when it has been open this long."
    )

    log_retention_seconds: float = Field(
        default=_UPKEEP.log_retention.total_seconds(),
        description="Delta history (time travel) kept on the tables the engine appends to, unless a table sets "
        "its own delta.logRetentionDuration. Each 1,000 commit files slow an append (txn_engine.storage.upkeep).",
    )
    file_retention_seconds: float = Field(
        default=_UPKEEP.file_retention.total_seconds(),
        description="How long a file replaced by compaction stays on disk before the engine's VACUUM deletes it "
        "(readers mid-scan), unless a table sets its own delta.deletedFileRetentionDuration.",
    )
    compact_every_commits: int = Field(
        default=_UPKEEP.compact_every, description="Compact a table's small files every this many of its commits (0: never)."
    )

    abort_expired_interval_seconds: float = Field(
        default=ABORT_EXPIRED_INTERVAL_S,
        description="The running engine aborts the transactions open past their timeout this often (Kafka's "
        "transaction.abort.timed.out.transaction.cleanup.interval.ms), or as often as its producers' shortest "
        "timeout when that is shorter.",
    )

    def upkeep(self) -> UpkeepPolicy:
        return UpkeepPolicy(
            log_retention=timedelta(seconds=self.log_retention_seconds),
            file_retention=timedelta(seconds=self.file_retention_seconds),
            compact_every=self.compact_every_commits,
        )

    def rollover(self) -> RolloverPolicy:
        return RolloverPolicy(
            self.rollover_max_entries, self.rollover_max_bytes, timedelta(seconds=self.rollover_max_age_seconds)
        )

    def open(self, warehouse: Warehouse) -> Engine:
        return Engine(warehouse, txn_groups=self.txn_groups, rollover=self.rollover(), upkeep=self.upkeep(),
                      abort_expired_interval=self.abort_expired_interval_seconds)
