"""The transaction-buffer domain: its four tables, partitioned by ledger, and their checks
(`tables`); its job and the sensor that runs it as ledgers close (`sensors`)."""

from dagster import Definitions

from assets.transaction_buffer.sensors import ledgers_closed_sensor, transaction_buffer_job
from assets.transaction_buffer.tables import BUFFER_CHECKS, transaction_buffer_tables

defs = Definitions(assets=[transaction_buffer_tables], asset_checks=BUFFER_CHECKS, jobs=[transaction_buffer_job],
                   sensors=[ledgers_closed_sensor])
