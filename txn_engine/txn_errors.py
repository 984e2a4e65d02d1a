"""Errors of the transaction engine. Each says what happened and what the caller should do."""

from __future__ import annotations

from txn_engine.errors import TxnlakeError


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
