"""Analyst SQL models over the warehouse's tables (`dbt-free-sql/`)."""
