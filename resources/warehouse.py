"""The warehouse as a Dagster resource: settings configured once in Definitions."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field

from resources.spark import get_spark
from txn_engine.core.settings import WarehouseSettings
from txn_engine.storage.warehouse import Warehouse


class WarehouseResource(ConfigurableResource):
    """Where the Delta tables live. Unset fields fall back to TXNLAKE_* environment, then defaults."""

    root: str | None = Field(default=None, description="Warehouse root; default TXNLAKE_WAREHOUSE or ./warehouse.")
    cold_tier: str | None = Field(default=None, description="Offload tier root; default <root>/cold.")
    lock_dir: str | None = Field(default=None, description="Writer lock folder.")
    compute: str | None = Field(
        default=None, description="Where transaction-buffer runs compute: auto, driver or spark; default TXNLAKE_COMPUTE or auto."
    )

    def settings(self) -> WarehouseSettings:
        overrides = {
            k: v
            for k, v in {"warehouse": self.root, "cold_tier": self.cold_tier, "lock_dir": self.lock_dir,
                         "compute": self.compute}.items()
            if v is not None
        }
        return WarehouseSettings(**overrides)

    def open(self, spark=None) -> Warehouse:
        """The warehouse on `spark` (a session, or a factory such as `SparkResource.session`);
        without one, on the process's session (`get_spark`), started when first needed."""
        return Warehouse(spark or get_spark, self.settings())
