"""Generate a realistic raw ledger file, deterministic per seed, for `txnlake ingest`.

The file holds the `ledger_entries` columns of the brief and looks like what a broker with
transactions writes: several topics, each a run of ledgers (ids unique across topics, increasing
in creation time as BookKeeper hands them out), transactional and non-transactional entries
interleaved, overlapping transactions (so the stable position lags), some aborted, some left
open, and retried duplicates; all vectorized with numpy, no loop per entry. How a log is made,
and in what proportions: docs/architecture.md, "The demo log generator".

Formats, by the file's extension: `.parquet` (typed), `.jsonl` (one JSON object per line,
payload base64, publish_time ISO-8601 UTC, nulls as null) and `.csv` (a header row, the same
encodings, an empty field for null).
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from txn_engine.core.errors import TxnlakeError
from txn_engine.core.schema import LEDGER_ENTRY_COLUMNS, LOSSLESS_COLUMNS

FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".csv": "csv"}

# The Arrow types of a Parquet output; names and order are the ledger_entries contract.
ARROW_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string(), nullable=False),
        pa.field("ledger_id", pa.int64(), nullable=False),
        pa.field("entry_id", pa.int64(), nullable=False),
        pa.field("entry_type", pa.string(), nullable=False),
        pa.field("txn_most_bits", pa.int64()),
        pa.field("txn_least_bits", pa.int64()),
        pa.field("producer_id", pa.int64()),
        pa.field("producer_epoch", pa.int32()),
        pa.field("sequence_id", pa.int64()),
        pa.field("publish_time", pa.timestamp("us", tz="UTC")),
        pa.field("key", pa.string()),
        pa.field("payload", pa.binary()),
    ]
)
# The generated log is Pulsar-like: text keys, no headers, so none of the columns added for Kafka.
GENERATED_COLUMNS = tuple(c for c in LEDGER_ENTRY_COLUMNS if c not in LOSSLESS_COLUMNS)
assert tuple(ARROW_SCHEMA.names) == GENERATED_COLUMNS, "generate.ARROW_SCHEMA drifted from schema.py"

ENTRY_TYPE_NAMES = ("DATA", "COMMIT", "ABORT")
_DATA, _COMMIT, _ABORT = 0, 1, 2

_TOPIC_BASES = ("orders", "payments", "shipments", "inventory", "refunds", "invoices", "customers", "audit")
_BASE_TIME_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
_MEAN_GAP_MS = 5.0  # between two entries of an average topic
_TXN_SHARE = 0.55  # of the entries: transactional data and markers
_DUP_RATE = 0.005  # retried duplicates, of all entries
_TWO_TOPIC_SHARE = 0.2  # transactions that span two topics
_ABORT_SHARE = 0.125  # of the closed transactions
_NON_IDEMPOTENT_SHARE = 0.2  # of the non-transactional entries
_KEYLESS_SHARE = 0.05  # of the non-transactional entries
_OWN_KEY_SHARE = 0.8  # of a transaction's entries, keyed by the transaction's customer
_TXN_SIZE_WEIGHTS = np.array([0.22, 0.18, 0.14, 0.11, 0.09, 0.07, 0.06, 0.05, 0.04, 0.04])  # 1..10 entries
_TXN_MEDIAN_DURATION_GAPS = 40.0  # a transaction's median duration, in mean entry gaps
_PRODUCER_DUTY = 0.6  # share of its time a transactional producer spends inside a transaction
_MARKER_JITTER_MS = 2.0
_DUP_MEAN_DELAY_MS = 30.0
_CUSTOMERS = 5000
_PAYLOAD_POOL = 2048
_PAYLOAD_MIN, _PAYLOAD_MAX = 20, 400
_PARQUET_ROW_GROUP = 1 << 20
_TEXT_CHUNK = 1 << 18


class GenerateArgumentError(TxnlakeError, ValueError):
    """A bad output path or argument: a ValueError, which the CLI prints without a traceback."""


@dataclass(frozen=True)
class GenerateSummary:
    """What `generate_ledger_file` wrote."""

    path: str
    format: str
    entries: int
    topics: int
    ledgers: int
    transactions_committed: int
    transactions_aborted: int
    transactions_open: int
    duplicates: int
    markers: int = 0
    topic_names: tuple[str, ...] = field(default=())

    @property
    def transactions(self) -> int:
        return self.transactions_committed + self.transactions_aborted + self.transactions_open

    def __str__(self) -> str:
        return (
            f"{self.entries:,} entries on {self.topics} topics in {self.ledgers} ledgers; "
            f"{self.transactions:,} transactions ({self.transactions_committed:,} committed, "
            f"{self.transactions_aborted:,} aborted, {self.transactions_open:,} open), "
            f"{self.markers:,} markers, {self.duplicates:,} retried duplicates"
        )


def format_of(path: str | Path) -> str:
    """The output format named by `path`'s extension, or a ValueError naming the supported ones."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise GenerateArgumentError(
            f"cannot generate {path}: unknown extension {suffix or '(none)'!r}; "
            f"supported are {', '.join(FORMATS)}"
        )
    return FORMATS[suffix]


def topic_names(n: int) -> list[str]:
    """`n` topic partitions: partitions 0, 1, ... of a few partitioned topics."""
    bases = min(len(_TOPIC_BASES), max(1, -(-n // 2)))
    per_base = -(-n // bases)
    return [f"{_TOPIC_BASES[b]}-partition-{p}" for b in range(bases) for p in range(per_base)][:n]


def generate_ledger_file(
    out_path: str | Path, entries: int, seed: int, topics: int = 4, overwrite: bool = True
) -> GenerateSummary:
    """Write `entries` ledger entries over `topics` topics to `out_path` (.parquet, .jsonl or .csv).

    The same arguments give a byte-identical file. See the module docstring for what is in it.
    An existing `out_path` is replaced only when `overwrite` (`txnlake generate` asks for --force).
    """
    path = Path(out_path)
    fmt = format_of(path)
    for name, value, least in (("entries", entries, 0), ("topics", topics, 1), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
            raise GenerateArgumentError(f"{name} must be an integer >= {least}, got {value!r}")
    if not overwrite and path.exists():
        raise GenerateArgumentError(
            f"{path} already exists; generate does not overwrite a file unless asked: pass --force to replace "
            "it, or name another output file. Nothing was written."
        )
    log = _generate(int(entries), int(seed), int(topics))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        {"parquet": _write_parquet, "jsonl": _write_jsonl, "csv": _write_csv}[fmt](log, tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return GenerateSummary(
        path=str(path),
        format=fmt,
        entries=len(log.topic),
        topics=len(log.topic_names),
        ledgers=log.ledgers,
        transactions_committed=log.committed,
        transactions_aborted=log.aborted,
        transactions_open=log.open,
        duplicates=log.duplicates,
        markers=log.markers,
        topic_names=tuple(log.topic_names),
    )


@dataclass
class _Log:
    """The entries in file order (topic, then ledger_id, entry_id), column by column."""

    topic_names: list[str]
    topic: np.ndarray  # int16 index into topic_names
    ledger_id: np.ndarray
    entry_id: np.ndarray
    entry_type: np.ndarray  # int8 index into ENTRY_TYPE_NAMES
    txn: np.ndarray  # int32 transaction number, -1 for none
    producer: np.ndarray  # int32 producer number, -1 for none (a non-idempotent producer)
    sequence_id: np.ndarray
    publish_us: np.ndarray
    key: np.ndarray  # int16 customer number (key `customer-N`), -1 for null
    payload: np.ndarray  # int16 index into payload_pool, -1 for null
    payload_pool: list[bytes]
    txn_most: np.ndarray  # by transaction number
    txn_least: np.ndarray  # by transaction number
    txn_epoch: np.ndarray  # by transaction number: its producer's epoch
    producer_ids: np.ndarray  # by producer number
    ledgers: int
    committed: int
    aborted: int
    open: int
    duplicates: int
    markers: int


def _generate(n: int, seed: int, n_topics: int) -> _Log:
    rng = np.random.default_rng(seed)
    names = topic_names(n_topics)
    weights = rng.dirichlet(np.full(n_topics, 6.0))  # uneven traffic over the topics
    span = max(n, 1) / n_topics * _MEAN_GAP_MS  # the log's length in ms
    payload_pool = _payload_pool(rng)

    n_dup = int(round(n * _DUP_RATE))
    budget = n - n_dup  # entries that are not retried duplicates
    txn_budget = int(round(budget * _TXN_SHARE))

    # -- transactions: sizes and topics -------------------------------------------------------
    cap = txn_budget // 2 + 1  # every transaction costs at least one data entry and one marker
    two = (rng.random(cap) < _TWO_TOPIC_SHARE) if n_topics > 1 else np.zeros(cap, bool)
    size = rng.choice(len(_TXN_SIZE_WEIGHTS), size=(cap, 2), p=_TXN_SIZE_WEIGHTS) + 1
    size[:, 1] *= two
    cost = size.sum(axis=1) + 1 + two
    n_txn = int(np.searchsorted(np.cumsum(cost), txn_budget, side="right"))
    two, size = two[:n_txn], size[:n_txn]
    first_topic = rng.choice(n_topics, size=n_txn, p=weights).astype(np.int16)
    second_topic = ((first_topic + 1 + rng.integers(0, max(n_topics - 1, 1), n_txn)) % n_topics).astype(np.int16)
    customer = _customers(rng, n_txn)

    # -- transactions: producers and time -----------------------------------------------------
    median = _TXN_MEDIAN_DURATION_GAPS * _MEAN_GAP_MS
    duration = np.minimum(median * np.exp(rng.standard_normal(n_txn)), span / 4)
    n_prod = int(min(n_txn, max(1, math.ceil(duration.sum() / (_PRODUCER_DUTY * span))))) if n_txn else 0
    mean_gap = (duration.mean() if n_txn else 0.0) * (1 - _PRODUCER_DUTY) / _PRODUCER_DUTY
    gap = rng.exponential(mean_gap, n_txn) if n_txn else np.zeros(0)
    prod = (rng.permutation(n_txn) % max(n_prod, 1)).astype(np.int64)
    chain = np.argsort(prod, kind="stable")  # each producer's transactions, one after another
    per_prod = np.bincount(prod, minlength=n_prod)
    first_of = np.cumsum(per_prod) - per_prod  # where each producer's chain starts in `chain`
    tail = rng.exponential(mean_gap, n_prod)  # idle time after the last transaction
    window_start = rng.random(n_prod) * 0.02 * span
    window = span - window_start
    sum_d = np.bincount(prod, duration, n_prod)
    sum_g = np.bincount(prod, gap, n_prod) + tail
    fits = sum_d <= 0.9 * window
    d_scale = np.where(fits, 1.0, 0.9 * window / np.maximum(sum_d, 1e-9))
    g_scale = np.where(fits, window - sum_d, 0.1 * window) / np.maximum(sum_g, 1e-9)
    p = prod[chain]
    seg = duration[chain] * d_scale[p] + gap[chain] * g_scale[p]  # gap, then the transaction
    before = np.cumsum(seg) - seg
    start = np.empty(n_txn)
    start[chain] = window_start[p] + before - before[first_of[p]] + gap[chain] * g_scale[p]
    duration = duration * d_scale[prod]
    end = start + duration
    index_in_chain = np.empty(n_txn, np.int64)
    index_in_chain[chain] = np.arange(n_txn) - first_of[p]

    # A few transactions are still open when the log ends: the latest-begun last transactions
    # of their producers.
    n_open = min(n_prod, int(rng.integers(2, 2 + max(2, n_topics))))
    open_ = np.zeros(n_txn, bool)
    if n_open:
        last = chain[first_of + per_prod - 1]
        open_[last[np.argsort(-start[last], kind="stable")[:n_open]]] = True
    aborted = ~open_ & (rng.random(n_txn) < _ABORT_SHARE)

    # Producer ids, epochs (bumped now and then: a restarted producer) and coordinators.
    n_idem = 2 * n_topics + 2
    id_range = max(100_000, 10 * (n_prod + n_idem))
    producer_ids = rng.choice(np.arange(1, id_range), n_prod + n_idem, replace=False)  # distinct
    base_epoch = rng.integers(0, 4, n_prod)
    bump_every = np.maximum(1, np.ceil(per_prod * rng.uniform(0.35, 2.5, n_prod))).astype(np.int64)
    txn_epoch = (base_epoch[prod] + index_in_chain // bump_every[prod]).astype(np.int32)
    coordinator = rng.integers(0, 2, n_prod)
    txn_most = coordinator[prod]
    by_begin = np.lexsort((start, txn_most))
    coord_first = np.searchsorted(txn_most[by_begin], [0, 1])
    txn_least = np.empty(n_txn, np.int64)
    txn_least[by_begin] = np.arange(n_txn) - coord_first[txn_most[by_begin]]
    txn_least += rng.integers(1, 1000, 2)[txn_most]

    # -- transactional entries ----------------------------------------------------------------
    pair_txn = np.concatenate((np.arange(n_txn), np.flatnonzero(two)))
    pair_topic = np.concatenate((first_topic, second_topic[two]))
    pair_size = np.concatenate((size[:, 0], size[two, 1]))
    d_txn = np.repeat(pair_txn, pair_size)
    n_data = len(d_txn)
    d_time = start[d_txn] + rng.random(n_data) * duration[d_txn]
    d_key = np.where(rng.random(n_data) < _OWN_KEY_SHARE, customer[d_txn], _customers(rng, n_data))
    m_pair = np.flatnonzero(~open_[pair_txn])
    m_txn = pair_txn[m_pair]
    n_markers = len(m_txn)
    # Markers strictly after the transaction's end (data and retries are strictly before it).
    m_time = end[m_txn] + 0.01 + rng.random(n_markers) * _MARKER_JITTER_MS

    # -- non-transactional entries ------------------------------------------------------------
    n_plain = budget - n_data - n_markers
    u_topic = rng.choice(n_topics, size=n_plain, p=weights).astype(np.int16)
    u_time = rng.random(n_plain) * span
    u_prod = np.where(rng.random(n_plain) < _NON_IDEMPOTENT_SHARE, -1, n_prod + rng.integers(0, n_idem, n_plain))
    u_key = np.where(rng.random(n_plain) < _KEYLESS_SHARE, -1, _customers(rng, n_plain))

    # -- all entries, in generation order: txn data, markers, plain data, then duplicates -----
    none = lambda k, dtype: np.full(k, -1, dtype)  # noqa: E731
    topic = np.concatenate((np.repeat(pair_topic, pair_size), pair_topic[m_pair], u_topic))
    time = np.concatenate((d_time, m_time, u_time))
    etype = np.concatenate(
        (np.zeros(n_data, np.int8), np.where(aborted[m_txn], _ABORT, _COMMIT).astype(np.int8), np.zeros(n_plain, np.int8))
    )
    txn = np.concatenate((d_txn, m_txn, none(n_plain, np.int64))).astype(np.int32)
    producer = np.concatenate((prod[d_txn], prod[m_txn], u_prod)).astype(np.int32)
    key = np.concatenate((d_key, none(n_markers, np.int32), u_key)).astype(np.int16)
    payload = np.concatenate(
        (rng.integers(0, _PAYLOAD_POOL, n_data), none(n_markers, np.int64), rng.integers(0, _PAYLOAD_POOL, n_plain))
    ).astype(np.int16)

    # Retried duplicates: copies of data entries that carry a producer and sequence, a little
    # later, and for a transaction's entry before its end (and so before its markers).
    candidates = np.concatenate((np.arange(n_data), n_data + n_markers + np.flatnonzero(u_prod >= 0)))
    n_dup = min(n_dup, len(candidates))
    original = np.sort(candidates[rng.choice(len(candidates), n_dup, replace=False)])
    delay = rng.exponential(_DUP_MEAN_DELAY_MS, n_dup) + 0.01
    of_txn = txn[original]
    room = end[np.maximum(of_txn, 0)] - time[original] if n_txn else np.zeros(n_dup)
    delay = np.where(of_txn >= 0, np.minimum(delay, room * rng.uniform(0.05, 0.95, n_dup)), delay)
    topic = np.concatenate((topic, topic[original]))
    time = np.concatenate((time, time[original] + delay))
    etype = np.concatenate((etype, np.zeros(n_dup, np.int8)))
    txn = np.concatenate((txn, of_txn))
    producer = np.concatenate((producer, producer[original]))
    key = np.concatenate((key, key[original]))
    payload = np.concatenate((payload, payload[original]))
    n = len(time)

    # -- log order: by topic, then time --------------------------------------------------------
    # Times in whole microseconds; every ordering that matters (data < its retry < the marker)
    # is at least 10 us apart, and equal ticks keep generation order. One sort of a packed
    # int64 key (topic | tick | generation index) when it fits, a lexsort otherwise.
    ticks = np.floor(time * 1000.0).astype(np.int64)
    del time
    idx_bits = max(1, (n - 1).bit_length())
    tick_bits = max(1, int(ticks.max()).bit_length()) if n else 1
    if idx_bits + tick_bits + max(1, (n_topics - 1).bit_length()) <= 63:
        packed = (topic.astype(np.int64) << (tick_bits + idx_bits)) | (ticks << idx_bits) | np.arange(n)
        packed.sort()
        order = packed & ((1 << idx_bits) - 1)
        ticks = (packed >> idx_bits) & ((1 << tick_bits) - 1)
        del packed
    else:
        order = np.lexsort((ticks, topic))
        ticks = ticks[order]
    counts = np.bincount(topic, minlength=n_topics)
    bounds = np.concatenate(([0], np.cumsum(counts)))
    topic = np.repeat(np.arange(n_topics, dtype=np.int16), counts)
    etype, txn, producer, key, payload = etype[order], txn[order], producer[order], key[order], payload[order]

    # Publish time: milliseconds, strictly increasing within each topic.
    publish_ms = ticks // 1000
    # Ledgers: roll over after a random number of entries; ids by creation time across topics.
    entry_id = np.empty(n, np.int64)
    ledger_of = np.empty(n, np.int64)
    ledger_first: list[np.ndarray] = []
    n_ledgers = 0
    for t in range(n_topics):
        lo, hi = bounds[t], bounds[t + 1]
        steps = np.arange(hi - lo)
        publish_ms[lo:hi] = np.maximum.accumulate(publish_ms[lo:hi] - steps) + steps
        sizes = _ledger_sizes(rng, hi - lo)
        firsts = np.cumsum(sizes) - sizes
        ledger_index = np.repeat(np.arange(len(sizes)), sizes)
        ledger_of[lo:hi] = n_ledgers + ledger_index
        entry_id[lo:hi] = steps - firsts[ledger_index]
        ledger_first.append(lo + firsts)
        n_ledgers += len(sizes)
    first_pos = np.concatenate(ledger_first)
    ids = np.empty(n_ledgers, np.int64)
    ids[np.lexsort((ticks[first_pos], publish_ms[first_pos]))] = int(rng.integers(3, 5000)) + np.cumsum(
        rng.integers(1, 6, n_ledgers)
    )
    ledger_id = ids[ledger_of]
    del ledger_of, ticks

    # Sequence ids: per (producer, topic), counting up in log order; retries repeat theirs.
    is_dup = order >= n - n_dup
    counted = np.flatnonzero((producer >= 0) & ~is_dup & (etype == _DATA))
    group = producer[counted] * n_topics + topic[counted]
    n_groups = (n_prod + n_idem) * n_topics
    group = group.astype(np.int16 if n_groups < 2**15 else np.int64)  # int16 sorts by radix
    by_group = np.argsort(group, kind="stable")
    group_counts = np.bincount(group, minlength=n_groups)
    sequence = np.full(n, -1, np.int64)
    sequence[counted[by_group]] = np.arange(len(by_group)) - np.repeat(np.cumsum(group_counts) - group_counts, group_counts)
    is_original = np.zeros(n, bool)
    is_original[original] = True
    at = np.flatnonzero(is_original[order])  # log positions of the originals
    original_at = np.empty(n_dup, np.int64)
    original_at[np.searchsorted(original, order[at])] = at  # ... in the order `original` lists them
    dup_at = np.flatnonzero(is_dup)
    sequence[dup_at] = sequence[original_at[order[dup_at] - (n - n_dup)]]
    del order

    if not n_txn:  # lookups by transaction number must hold index 0 even when there is none
        txn_most, txn_least, txn_epoch = np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int32)
    return _Log(
        topic_names=names,
        topic=topic,
        ledger_id=ledger_id,
        entry_id=entry_id,
        entry_type=etype,
        txn=txn,
        producer=producer,
        sequence_id=sequence,
        publish_us=(publish_ms + _BASE_TIME_MS) * 1000,
        key=key,
        payload=payload,
        payload_pool=payload_pool,
        txn_most=txn_most,
        txn_least=txn_least,
        txn_epoch=txn_epoch,
        producer_ids=producer_ids,
        ledgers=n_ledgers,
        committed=int(np.count_nonzero(~open_ & ~aborted)),
        aborted=int(np.count_nonzero(aborted)),
        open=int(np.count_nonzero(open_)),
        duplicates=n_dup,
        markers=n_markers,
    )


def _customers(rng: np.random.Generator, k: int) -> np.ndarray:
    """Customer numbers, skewed: low numbers are the busy customers."""
    return (np.square(rng.random(k)) * _CUSTOMERS).astype(np.int32)


def _payload_pool(rng: np.random.Generator) -> list[bytes]:
    lengths = rng.integers(_PAYLOAD_MIN, _PAYLOAD_MAX + 1, _PAYLOAD_POOL)
    blob = rng.bytes(int(lengths.sum()))
    ends = np.cumsum(lengths)
    return [blob[e - n : e] for e, n in zip(ends.tolist(), lengths.tolist())]


def _ledger_sizes(rng: np.random.Generator, k: int) -> np.ndarray:
    """Entries per ledger for a topic of `k` entries: ~100 ledgers at 2.5M entries, ~6 at 250."""
    if k == 0:
        return np.zeros(0, np.int64)
    target = 5 + math.sqrt(k) / 16
    mean = k / target
    sizes = np.zeros(0, np.int64)
    while sizes.sum() < k:
        factor = np.clip(rng.lognormal(0.0, 0.4, int(target) + 8), 0.35, 2.2)
        sizes = np.concatenate((sizes, np.maximum(1, np.round(mean * factor)).astype(np.int64)))
    ends = np.cumsum(sizes)
    last = int(np.searchsorted(ends, k))  # the last ledger is the open one, partly written
    sizes = sizes[: last + 1].copy()
    sizes[-1] -= ends[last] - k
    return sizes


# -- writers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pools:
    """The distinct values that entries index: topic names, entry types, keys, payloads."""

    topics: pa.Array
    types: pa.Array
    keys: pa.Array
    payloads: pa.Array

    @classmethod
    def of(cls, log: _Log, base64_payloads: bool = False) -> "_Pools":
        payloads = (
            pa.array([base64.b64encode(p).decode("ascii") for p in log.payload_pool], pa.string())
            if base64_payloads
            else pa.array(log.payload_pool, pa.binary())
        )
        return cls(
            topics=pa.array(log.topic_names, pa.string()),
            types=pa.array(ENTRY_TYPE_NAMES, pa.string()),
            keys=pa.array([f"customer-{i}" for i in range(_CUSTOMERS)], pa.string()),
            payloads=payloads,
        )


def _columns(log: _Log, lo: int, hi: int, pools: _Pools) -> list[pa.Array]:
    """Arrow columns of rows [lo, hi), typed as ARROW_SCHEMA (payload as the pool holds it)."""
    s = slice(lo, hi)
    key, payload, txn, producer, sequence = log.key[s], log.payload[s], log.txn[s], log.producer[s], log.sequence_id[s]
    no_txn, no_producer = txn < 0, producer < 0
    txn = np.maximum(txn, 0)
    # Non-transactional producers (idempotent) have epoch 0; non-idempotent entries have none.
    epoch = np.where(no_txn, 0, log.txn_epoch[txn]).astype(np.int32)
    return [
        pools.topics.take(log.topic[s]),
        pa.array(log.ledger_id[s]),
        pa.array(log.entry_id[s]),
        pools.types.take(log.entry_type[s]),
        pa.array(log.txn_most[txn], mask=no_txn),
        pa.array(log.txn_least[txn], mask=no_txn),
        pa.array(log.producer_ids[np.maximum(producer, 0)], mask=no_producer),
        pa.array(epoch, mask=no_producer),
        pa.array(sequence, mask=sequence < 0),
        pa.array(log.publish_us[s], type=pa.timestamp("us", tz="UTC")),
        pools.keys.take(pa.array(key, mask=key < 0)),
        pools.payloads.take(pa.array(payload, mask=payload < 0)),
    ]


def _write_parquet(log: _Log, path: Path) -> None:
    # Monotonic or near-monotonic numbers delta-encode far smaller than a dictionary or plain
    # (Spark's vectorized reader reads DELTA_BINARY_PACKED); the rest dictionary-encode well.
    delta = ("entry_id", "txn_least_bits", "sequence_id", "publish_time")
    pools = _Pools.of(log)
    n = len(log.topic)
    with pq.ParquetWriter(
        path,
        ARROW_SCHEMA,
        compression="snappy",
        use_dictionary=[c for c in ARROW_SCHEMA.names if c not in delta],
        column_encoding={c: "DELTA_BINARY_PACKED" for c in delta},
    ) as writer:
        for lo in range(0, n, _PARQUET_ROW_GROUP):
            hi = min(n, lo + _PARQUET_ROW_GROUP)
            table = pa.Table.from_arrays(_columns(log, lo, hi, pools), schema=ARROW_SCHEMA)
            writer.write_table(table, row_group_size=_PARQUET_ROW_GROUP)
        if n == 0:
            writer.write_table(ARROW_SCHEMA.empty_table())


_QUOTED = ("topic", "entry_type", "publish_time", "key", "payload")


def _text_fields(log: _Log, lo: int, hi: int, pools: _Pools, null: str, quote: str) -> list[pa.Array]:
    """Each column of rows [lo, hi) as text: JSON values (quote='"', null='null') or CSV fields.

    Nothing needs escaping: topics, keys, types, numbers, ISO times and base64 hold no quote,
    backslash, comma or newline.
    """
    cols = _columns(log, lo, hi, pools)  # payloads already base64
    # 2026-01-01 00:00:00.123000 -> 2026-01-01T00:00:00.123000Z by a cast, not strftime (docs/benchmarks.md, "Generate")
    naive = pc.cast(cols[9].cast(pa.timestamp("us")), pa.string())
    cols[9] = pc.binary_join_element_wise(pc.replace_substring(naive, " ", "T"), pa.scalar("Z"), pa.scalar(""))
    q, empty, none = pa.scalar(quote), pa.scalar(""), pa.scalar(null)
    out = []
    for name, col in zip(GENERATED_COLUMNS, cols):
        text = col if pa.types.is_string(col.type) else pc.cast(col, pa.string())
        if quote and name in _QUOTED:
            text = pc.binary_join_element_wise(q, text, q, empty)
        out.append(pc.fill_null(text, none))
    return out


def _write_lines(path: Path, header: bytes, log: _Log, make_lines) -> None:
    """Write `header`, then the text lines `make_lines(lo, hi)` builds, chunk by chunk."""
    n = len(log.topic)
    with open(path, "wb") as f:
        f.write(header)
        for lo in range(0, n, _TEXT_CHUNK):
            lines = make_lines(lo, min(n, lo + _TEXT_CHUNK))
            # The lines are back to back in the string array's data buffer: write it at once.
            offsets = np.frombuffer(lines.buffers()[1], np.int32, len(lines) + 1, lines.offset * 4)
            f.write(memoryview(lines.buffers()[2])[offsets[0] : offsets[-1]])


def _write_jsonl(log: _Log, path: Path) -> None:
    pools = _Pools.of(log, base64_payloads=True)

    def lines(lo: int, hi: int) -> pa.Array:
        parts: list = []
        for i, (name, text) in enumerate(zip(GENERATED_COLUMNS, _text_fields(log, lo, hi, pools, "null", '"'))):
            parts += [pa.scalar(("{" if i == 0 else ",") + f'"{name}":'), text]
        return pc.binary_join_element_wise(*parts, pa.scalar("}\n"), pa.scalar(""))

    _write_lines(path, b"", log, lines)


def _write_csv(log: _Log, path: Path) -> None:
    pools = _Pools.of(log, base64_payloads=True)

    def lines(lo: int, hi: int) -> pa.Array:
        fields = _text_fields(log, lo, hi, pools, "", "")
        joined = pc.binary_join_element_wise(*fields, pa.scalar(","))
        return pc.binary_join_element_wise(joined, pa.scalar("\n"), pa.scalar(""))

    _write_lines(path, (",".join(GENERATED_COLUMNS) + "\n").encode(), log, lines)
