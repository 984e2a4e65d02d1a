"""Operators' view of transactions: list, describe, find hanging ones, abort one.

Two sources, as in Kafka's `kafka-transactions.sh` and Pulsar's admin: the coordinator's
`txn_log` and the ledgers themselves (`ledger_entries`), so transactions known only from
ingested ledgers are listed, described and abortable too. Per-topic state comes from the
buffer kernel (`kernel.txns_of`: its rules for ongoing/committed/aborted), never restated here.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from txn_engine.producers.coordinator import TxnStatus
from txn_engine.storage.delta_io import DeltaTables
from txn_engine.buffer import kernel
from txn_engine.buffer.kernel import NARROW_COLUMNS
from txn_engine.core.log_types import EntryType, TxnId, TxnState
from txn_engine.core.positions import Position
from txn_engine.core.schema import LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA, LEDGER_ENTRY_COLUMNS, TXN_LOG, TXN_LOG_SCHEMA
from txn_engine.core.errors import InvalidTxnStateError, UnknownTransactionError


@dataclass
class TopicPart:
    """A transaction on one topic, as that topic's transaction buffer sees it."""

    topic: str
    state: TxnState
    first_position: Position | None  # first data position while ongoing
    entries_held_back: int = 0  # entries at or after it: what ledger-order readers cannot read yet
    held_back_since: datetime | None = None  # publish time of its first entry


@dataclass
class TxnInfo:
    txn: TxnId
    state: str  # a TxnStatus from txn_log, or derived from the ledgers
    source: str  # "txn_log" or "ledgers"
    transactional_id: str | None = None
    producer_id: int | None = None
    started_at: datetime | None = None
    timeout_ms: int | None = None
    parts: list[TopicPart] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)  # txn_log rows, oldest first

    def expired(self, now: datetime) -> bool:
        return (
            self.state == TxnStatus.ONGOING
            and self.started_at is not None
            and self.timeout_ms is not None
            and now - self.started_at > timedelta(milliseconds=self.timeout_ms)
        )


class TxnAdmin:
    """Read-only over the warehouse (no engine lock needed); see the module docstring."""

    def __init__(self, tables: DeltaTables, with_ledgers: bool = True):
        """`with_ledgers=False` reads txn_log only (cheap: what the timeout sensor needs)."""
        self.tables = tables
        columns = [c for c in LEDGER_ENTRY_COLUMNS if c != "payload"]
        rows = tables.read(LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA, columns).to_pylist() if with_ledgers else []
        # Where each transaction stands on each topic, by the buffer kernel.
        narrow = tables.read(LEDGER_ENTRIES, LEDGER_ENTRIES_SCHEMA, list(NARROW_COLUMNS)) if with_ledgers else None
        self._states: dict[str, dict[TxnId, tuple[TxnState, Position | None]]] = {}
        for t in (kernel.txns_of(narrow).to_pylist() if narrow is not None else []):
            ongoing = t["marker_count"] == 0
            state = TxnState.ONGOING if ongoing else TxnState.COMMITTED if t["outcome"] == EntryType.COMMIT else TxnState.ABORTED
            first = Position(t["first_data_ledger_id"], t["first_data_entry_id"]) if ongoing else None
            self._states.setdefault(t["topic"], {})[TxnId(t["txn_most_bits"], t["txn_least_bits"])] = (state, first)
        self._positions: dict[str, list[Position]] = {}
        for r in rows:
            self._positions.setdefault(r["topic"], []).append(Position(r["ledger_id"], r["entry_id"]))
        for positions in self._positions.values():
            positions.sort()
        self._first_time = {}
        self._producer = {}
        for r in rows:
            if r["txn_most_bits"] is not None and r["entry_type"] == "DATA":
                key = (TxnId(r["txn_most_bits"], r["txn_least_bits"]), r["topic"])
                pos = Position(r["ledger_id"], r["entry_id"])
                if key not in self._first_time or pos < self._first_time[key][0]:
                    self._first_time[key] = (pos, r["publish_time"])
                self._producer.setdefault(key[0], r["producer_id"])
        self.log = tables.read(TXN_LOG, TXN_LOG_SCHEMA).sort_by("log_seq").to_pylist()

    def _parts(self, txn: TxnId) -> list[TopicPart]:
        parts = []
        for topic, states in sorted(self._states.items()):
            if txn not in states:
                continue
            state, first = states[txn]
            part = TopicPart(topic, state, None)
            if state == TxnState.ONGOING:
                part.first_position = first
                positions = self._positions[topic]
                part.entries_held_back = len(positions) - bisect_left(positions, first)
                part.held_back_since = self._first_time.get((txn, topic), (None, None))[1]
            parts.append(part)
        return parts

    def transactions(self) -> dict[TxnId, TxnInfo]:
        infos: dict[TxnId, TxnInfo] = {}
        for row in self.log:
            if row["txn_most_bits"] is None:
                continue
            txn = TxnId(row["txn_most_bits"], row["txn_least_bits"])
            info = infos.setdefault(txn, TxnInfo(txn, row["state"], "txn_log"))
            info.state = row["state"]
            info.transactional_id = row["transactional_id"]
            info.producer_id = row["producer_id"]
            info.started_at = row["txn_started_at"]
            info.timeout_ms = row["timeout_ms"]
            info.history.append(row)
        in_ledgers = {txn for states in self._states.values() for txn in states}
        for txn in in_ledgers - set(infos):
            infos[txn] = TxnInfo(txn, "", "ledgers", producer_id=self._producer.get(txn))
        for txn, info in infos.items():
            info.parts = self._parts(txn)
            if info.source == "ledgers":
                info.state = ledger_state(info.parts)
        return dict(sorted(infos.items()))

    def describe(self, txn: TxnId) -> TxnInfo:
        info = self.transactions().get(txn)
        if info is None:
            raise UnknownTransactionError(
                f"transaction {txn} is neither in txn_log nor in any ledger; `txnlake txn list` shows the known ones"
            )
        return info

    def find_hanging(self, now: datetime, held_back: timedelta) -> list[tuple[TxnInfo, str]]:
        """Open past their timeout, or holding a topic's stable position back longer than `held_back`."""
        hanging = []
        for info in self.transactions().values():
            reasons = []
            if info.expired(now):
                reasons.append(f"open past its timeout of {info.timeout_ms} ms (since {info.started_at:%Y-%m-%d %H:%M:%S})")
            for part in info.parts:
                if part.state == TxnState.ONGOING and part.held_back_since is not None and now - part.held_back_since > held_back:
                    reasons.append(
                        f"holds {part.topic} back at {part.first_position} for {_duration(now - part.held_back_since)}, "
                        f"{part.entries_held_back} entries behind it"
                    )
            if reasons:
                hanging.append((info, "; ".join(reasons)))
        return hanging


def ledger_state(parts: list[TopicPart]) -> str:
    """The state a transaction known only from the ledgers is in, named like txn_log's."""
    states = {p.state for p in parts}
    if TxnState.ONGOING in states:
        return "ONGOING" if TxnState.COMMITTED not in states else "PARTIALLY_COMMITTED"
    if states == {TxnState.COMMITTED}:
        return TxnStatus.COMPLETE_COMMIT.value
    if states == {TxnState.ABORTED}:
        return TxnStatus.COMPLETE_ABORT.value
    return "MIXED"


def _duration(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"


def operator_abort(engine, txn: TxnId, who: str, why: str) -> TxnInfo:
    """An operator's abort through the running engine, recorded with who/why in txn_log."""
    if not who or not why:
        raise ValueError("an operator's abort needs who and why (--who NAME --why REASON); they go to txn_log")
    actor = f"operator:{who}"
    coordinator = engine.coordinator
    known = coordinator.txns.get(txn)
    if known is not None and known.state != TxnStatus.ONGOING:
        raise InvalidTxnStateError(
            f"transaction {txn} is {known.state} ({known.actor}: {known.reason or 'no reason'}); "
            + ("the engine finishes it (recovery on restart); nothing to abort."
               if known.state.is_prepared else "it is decided; nothing to abort.")
        )
    if known is not None:
        engine.coordinator.end_txn(txn, EntryType.ABORT, actor, why).result()
        return TxnAdmin(engine.tables).describe(txn)
    info = TxnAdmin(engine.tables).describe(txn)
    if info.source == "txn_log" and info.state in (TxnStatus.COMPLETE_COMMIT, TxnStatus.COMPLETE_ABORT):
        # The coordinator keeps no finished transaction in memory: txn_log says how it ended.
        last = info.history[-1]
        raise InvalidTxnStateError(
            f"transaction {txn} is {info.state} ({last['actor']}: {last['reason'] or 'no reason'}); "
            "it is decided; nothing to abort."
        )
    committed = [p.topic for p in info.parts if p.state == TxnState.COMMITTED]
    ongoing = [p.topic for p in info.parts if p.state == TxnState.ONGOING]
    if committed and not ongoing:
        raise InvalidTxnStateError(
            f"transaction {txn} is committed (COMMIT markers on {', '.join(committed)}); nothing to abort"
        )
    if committed:
        raise InvalidTxnStateError(
            f"transaction {txn} already has COMMIT markers on {', '.join(committed)}; aborting the rest would "
            "break its atomicity. Nothing was written."
        )
    if not ongoing:
        raise InvalidTxnStateError(f"transaction {txn} is already aborted on every topic; nothing to abort")
    engine.coordinator.abort_from_ledgers(txn, ongoing, info.producer_id, actor, why).result()
    return TxnAdmin(engine.tables).describe(txn)
