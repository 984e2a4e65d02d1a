"""The warehouse as a Dagster resource: settings configured once in Definitions."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field

from resources.spark import get_spark
from txn_engine.core.settings import WarehouseSettings
from txn_engine.storage.migrate import require_current_layout
from txn_engine.storage.warehouse import Warehouse


class WarehouseResource(ConfigurableResource):
    """Where the Delta tables live. Unset fields fall back to TXNLAKE_* environment, then defaults."""

    root: str | None = Field(default=None, description="Warehouse root; default TXNLAKE_WAREHOUSE or ./warehouse.")
    cold_tier: str | None = Field(default=None, description="Offload tier root; default <root>/cold.")
    lock_dir: str | None = Field(default=None, description="Writer lock folder.")
    s3_endpoint: str | None = Field(default=None, description="An S3-compatible store's http(s)://host[:port].")
    s3_region: str | None = Field(default=None, description="The store's region.")
    s3_access_key_id: str | None = Field(default=None, description="The store's access key id.")
    s3_secret_access_key: str | None = Field(default=None, description="The store's secret access key.")
    s3_session_token: str | None = Field(default=None, description="A session token of temporary credentials.")
    s3_path_style: bool | None = Field(default=None, description="Path-style bucket addressing.")
    compute: str | None = Field(
        default=None, description="Where transaction-buffer and snapshot runs compute: auto, driver or spark; default TXNLAKE_COMPUTE or auto."
    )

    def settings(self) -> WarehouseSettings:
        overrides = {
            k: v
            for k, v in {"warehouse": self.root, "cold_tier": self.cold_tier, "lock_dir": self.lock_dir,
                         "compute": self.compute, "s3_endpoint": self.s3_endpoint, "s3_region": self.s3_region,
                         "s3_access_key_id": self.s3_access_key_id, "s3_secret_access_key": self.s3_secret_access_key,
                         "s3_session_token": self.s3_session_token, "s3_path_style": self.s3_path_style}.items()
            if v is not None
        }
        return WarehouseSettings(**overrides)

    def open(self, spark=None) -> Warehouse:
        """The warehouse on `spark` (a session, or a factory such as `SparkResource.session`);
        without one, on the process's session (`get_spark`), started when first needed."""
        settings = self.settings()
        require_current_layout(settings)  # a run would start new tables beside an older txnlake's
        return Warehouse(spark or get_spark, settings)
