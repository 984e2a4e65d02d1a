"""Errors a user can cause. Each message says what happened and what to do about it."""


class TxnlakeError(Exception):
    """Base of every error txnlake raises on purpose; the CLI prints it without a traceback."""


class ConfigurationError(TxnlakeError):
    """A setting is missing or wrong."""


class DeltaJarsMissingError(ConfigurationError):
    """Delta Lake's JVM jars are not in the cache."""


class InputFileError(TxnlakeError):
    """An input file is missing, unreadable or of an unknown format. Nothing was written."""


class TableMissingError(TxnlakeError):
    """A table that an operation reads does not exist yet."""
