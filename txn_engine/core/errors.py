"""Errors a user can cause. Each message says what happened and what to do about it."""


class TxnlakeError(Exception):
    """Base of every error txnlake raises on purpose; the CLI prints it without a traceback."""


class ConfigurationError(TxnlakeError):
    """A setting is missing or wrong."""


class DeltaJarsMissingError(ConfigurationError):
    """Delta Lake's JVM jars are not in the cache."""


class KafkaJarsMissingError(ConfigurationError):
    """The jars of the Kafka broker the tests start, or of the segment reader `import-kafka` runs, are missing."""


class InputFileError(TxnlakeError):
    """An input file is missing, unreadable or of an unknown format. Nothing was written."""


class WarehouseMigrationError(TxnlakeError):
    """A table was written before columns the contract has since added; `txnlake migrate` adds them."""


class TableMissingError(TxnlakeError):
    """A table that an operation reads does not exist yet."""


class EngineError(TxnlakeError):
    """Base of the transaction engine's errors."""


class ProducerFencedError(EngineError):
    """A newer instance of the same transactional id took over; this one may never write again."""


class OutOfOrderSequenceError(EngineError):
    """A send's sequence number is not the next one for (producer, topic); nothing was written."""


class InvalidTxnStateError(EngineError):
    """A call that the producer's transaction state does not allow (begin twice, send outside one, ...)."""


class TransactionAbortedError(EngineError):
    """The coordinator (timeout) or an operator aborted the producer's open transaction."""


class UnknownTransactionError(EngineError):
    """No transaction with this id in txn_log or in the ledgers."""


class EngineLockedError(EngineError):
    """Another engine holds the warehouse's engine lock."""


class EngineStoppedError(EngineError):
    """The engine stopped (closed, or a write failed); nothing more is accepted until it restarts."""


class InjectedCrash(EngineError):
    """Raised by a test's crash hook to stop the engine between two steps of a multi-step write."""
