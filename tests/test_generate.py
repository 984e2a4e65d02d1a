"""`generate_ledger_file`: a realistic raw ledger log, deterministic per seed, in three formats.

Pure Python (no Spark): the files are read back with pyarrow, json and csv, and the log is
replayed through the reference transaction buffer.
"""

from __future__ import annotations

import base64
import csv
import json
import re
from collections import Counter, defaultdict
from datetime import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from txn_engine.core.errors import TxnlakeError
from txn_engine.log.generate import GenerateSummary, generate_ledger_file, topic_names
from txn_engine.core.log_types import LogEntry, Violation
from txn_engine.log.generate import GENERATED_COLUMNS as LEDGER_ENTRY_COLUMNS
from txn_engine.reference.transaction_buffer import replay, stable_position_trace

N = 2000
SEED = 7
FORMATS = ("parquet", "jsonl", "csv")
INT_COLUMNS = ("ledger_id", "entry_id", "txn_most_bits", "txn_least_bits", "producer_id", "producer_epoch", "sequence_id")
ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")


# -- reading the files back -----------------------------------------------------------------


def read_parquet(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def _from_text(row: dict) -> dict:
    """A row of a text format, decoded to the Python values a Parquet row reads as."""
    out = dict(row)
    for c in INT_COLUMNS:
        out[c] = None if out[c] is None else int(out[c])
    if out["publish_time"] is not None:
        assert ISO_UTC.match(out["publish_time"]), out["publish_time"]
        out["publish_time"] = datetime.fromisoformat(out["publish_time"])
    if out["payload"] is not None:
        out["payload"] = base64.b64decode(out["payload"], validate=True)
    return out


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            obj = json.loads(line)
            assert list(obj) == list(LEDGER_ENTRY_COLUMNS)
            rows.append(_from_text(obj))
    return rows


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        assert header == list(LEDGER_ENTRY_COLUMNS)
        return [_from_text({c: (v if v != "" else None) for c, v in zip(header, fields)}) for fields in reader]


READERS = {"parquet": read_parquet, "jsonl": read_jsonl, "csv": read_csv}


def txn_of(row: dict) -> tuple[int, int] | None:
    if row["txn_most_bits"] is None:
        return None
    return (row["txn_most_bits"], row["txn_least_bits"])


def by_topic(rows: list[dict]) -> dict[str, list[dict]]:
    """Each topic's entries in log order."""
    topics: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        topics[r["topic"]].append(r)
    return {t: sorted(rs, key=lambda r: (r["ledger_id"], r["entry_id"])) for t, rs in topics.items()}


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> dict[str, tuple[Path, GenerateSummary]]:
    folder = tmp_path_factory.mktemp("generated")
    out = {}
    for fmt in FORMATS:
        path = folder / f"log.{fmt}"
        out[fmt] = (path, generate_ledger_file(path, entries=N, seed=SEED))
    return out


@pytest.fixture(scope="module")
def rows(generated) -> list[dict]:
    return read_parquet(generated["parquet"][0])


@pytest.fixture(scope="module")
def summary(generated) -> GenerateSummary:
    return generated["parquet"][1]


# -- determinism and formats ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_same_seed_gives_the_same_bytes_and_another_seed_does_not(tmp_path, fmt):
    a = generate_ledger_file(tmp_path / f"a.{fmt}", entries=N, seed=3)
    b = generate_ledger_file(str(tmp_path / f"b.{fmt}"), entries=N, seed=3)  # str or Path
    c = generate_ledger_file(tmp_path / f"c.{fmt}", entries=N, seed=4)
    assert (tmp_path / f"a.{fmt}").read_bytes() == (tmp_path / f"b.{fmt}").read_bytes()
    assert (tmp_path / f"a.{fmt}").read_bytes() != (tmp_path / f"c.{fmt}").read_bytes()
    assert a.entries == b.entries == c.entries == N
    assert (a.ledgers, a.transactions_committed, a.transactions_aborted) == (
        b.ledgers, b.transactions_committed, b.transactions_aborted
    )
    assert not list(tmp_path.glob("*.tmp"))


def test_parquet_columns_and_types(generated):
    schema = pq.read_schema(generated["parquet"][0])
    assert schema.names == list(LEDGER_ENTRY_COLUMNS)
    expected = {
        "topic": pa.string(),
        "ledger_id": pa.int64(),
        "entry_id": pa.int64(),
        "entry_type": pa.string(),
        "txn_most_bits": pa.int64(),
        "txn_least_bits": pa.int64(),
        "producer_id": pa.int64(),
        "producer_epoch": pa.int32(),
        "sequence_id": pa.int64(),
        "publish_time": pa.timestamp("us", tz="UTC"),
        "key": pa.string(),
        "payload": pa.binary(),
    }
    assert {f.name: f.type for f in schema} == expected
    assert pq.read_metadata(generated["parquet"][0]).num_rows == N


def test_jsonl_lines_hold_exactly_the_columns_with_base64_payload_and_iso_times(generated):
    path = generated["jsonl"][0]
    lines = path.read_text().splitlines()
    assert len(lines) == N and path.read_text().endswith("}\n")
    raw = [json.loads(line) for line in lines]
    assert all(list(obj) == list(LEDGER_ENTRY_COLUMNS) for obj in raw)
    assert all(ISO_UTC.match(obj["publish_time"]) for obj in raw)
    assert raw[0]["publish_time"].startswith("2026-01-01T00:00:00.")
    data = [obj for obj in raw if obj["entry_type"] == "DATA"]
    assert all(20 <= len(base64.b64decode(obj["payload"], validate=True)) <= 400 for obj in data)
    markers = [obj for obj in raw if obj["entry_type"] != "DATA"]
    assert markers and all(obj["payload"] is None and obj["key"] is None for obj in markers)
    assert all(isinstance(obj["ledger_id"], int) for obj in raw)  # numbers, not strings
    assert any(obj["producer_id"] is None for obj in raw)  # JSON null


def test_csv_has_a_header_and_empty_fields_for_null(generated):
    with open(generated["csv"][0], newline="") as f:
        table = list(csv.reader(f))
    assert table[0] == list(LEDGER_ENTRY_COLUMNS)
    assert len(table) == N + 1 and all(len(fields) == len(LEDGER_ENTRY_COLUMNS) for fields in table)
    column = {c: i for i, c in enumerate(table[0])}
    markers = [fields for fields in table[1:] if fields[column["entry_type"]] != "DATA"]
    assert markers and all(fields[column["payload"]] == "" and fields[column["sequence_id"]] == "" for fields in markers)
    assert all(ISO_UTC.match(fields[column["publish_time"]]) for fields in table[1:])


def test_the_three_formats_hold_the_same_entries(generated):
    parquet = read_parquet(generated["parquet"][0])
    assert read_jsonl(generated["jsonl"][0]) == parquet
    assert read_csv(generated["csv"][0]) == parquet
    summaries = [generated[fmt][1] for fmt in FORMATS]
    assert [s.format for s in summaries] == list(FORMATS)
    assert len({(s.entries, s.ledgers, s.duplicates, s.transactions_open) for s in summaries}) == 1


@pytest.mark.parametrize("name", ["log.xml", "log.json.gz", "log", "log.txt"])
def test_unknown_extension_is_a_clear_error_and_writes_nothing(tmp_path, name):
    with pytest.raises(ValueError, match=r"\.parquet.*\.jsonl.*\.csv") as raised:
        generate_ledger_file(tmp_path / name, entries=10, seed=1)
    assert isinstance(raised.value, TxnlakeError)  # the CLI prints it without a traceback
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("kwargs", [{"entries": -1, "seed": 1}, {"entries": 10, "seed": 1, "topics": 0},
                                    {"entries": 10, "seed": -5}, {"entries": 1.5, "seed": 1}])
def test_bad_arguments_are_clear_errors(tmp_path, kwargs):
    with pytest.raises(ValueError, match="must be an integer"):
        generate_ledger_file(tmp_path / "log.parquet", **kwargs)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_entries_gives_a_readable_empty_file(tmp_path, fmt):
    summary = generate_ledger_file(tmp_path / f"empty.{fmt}", entries=0, seed=1)
    assert summary.entries == 0 and summary.ledgers == 0
    assert READERS[fmt](tmp_path / f"empty.{fmt}") == []


def test_summary(summary, generated):
    assert summary.path == str(generated["parquet"][0])
    assert summary.entries == N and summary.topics == 4
    assert summary.transactions == summary.transactions_committed + summary.transactions_aborted + summary.transactions_open
    text = str(summary)
    assert f"{N:,} entries on 4 topics" in text and "aborted" in text and "open" in text


# -- topics, ledgers, positions -------------------------------------------------------------


def test_topic_names():
    assert topic_names(4) == ["orders-partition-0", "orders-partition-1", "payments-partition-0", "payments-partition-1"]
    for n in (1, 3, 7, 20):
        names = topic_names(n)
        assert len(set(names)) == n and all(re.fullmatch(r"[a-z]+-partition-\d+", t) for t in names)


def test_positions_are_unique_and_entry_ids_contiguous_per_ledger(rows):
    assert len({(r["topic"], r["ledger_id"], r["entry_id"]) for r in rows}) == len(rows)
    ledgers: dict[tuple[str, int], list[int]] = defaultdict(list)
    for r in rows:
        ledgers[(r["topic"], r["ledger_id"])].append(r["entry_id"])
    for entry_ids in ledgers.values():
        assert sorted(entry_ids) == list(range(len(entry_ids)))


def test_ledgers_unique_across_topics_several_per_topic_and_ordered_by_creation(rows, summary):
    topics_of: dict[int, set[str]] = defaultdict(set)
    created: dict[int, datetime] = {}
    for r in rows:
        topics_of[r["ledger_id"]].add(r["topic"])
        if r["entry_id"] == 0:
            created[r["ledger_id"]] = r["publish_time"]
    assert all(len(t) == 1 for t in topics_of.values())  # no ledger id shared by two topics
    assert len(topics_of) == summary.ledgers
    per_topic = Counter(next(iter(t)) for t in topics_of.values())
    assert set(per_topic) == set(topic_names(4)) and min(per_topic.values()) >= 3
    # Like BookKeeper: ids increase with creation time, across topics.
    ids_by_creation = [lid for _, lid in sorted((t, lid) for lid, t in created.items())]
    assert ids_by_creation == sorted(ids_by_creation)
    # Within a topic, later ledgers have larger ids.
    for topic_rows in by_topic(rows).values():
        ids = [r["ledger_id"] for r in topic_rows]
        assert ids == sorted(ids)


def test_file_is_in_log_order_and_publish_time_increases_within_a_topic(rows):
    for topic_rows in by_topic(rows).values():
        times = [r["publish_time"] for r in topic_rows]
        assert all(a < b for a, b in zip(times, times[1:]))
    # The file lists each topic's entries together, in position order.
    order = [(r["topic"], r["ledger_id"], r["entry_id"]) for r in rows]
    topic_rank = {t: i for i, t in enumerate(dict.fromkeys(r["topic"] for r in rows))}
    assert order == sorted(order, key=lambda p: (topic_rank[p[0]], p[1], p[2]))


def test_keys_payloads_and_entry_types(rows):
    assert {r["entry_type"] for r in rows} == {"DATA", "COMMIT", "ABORT"}
    data = [r for r in rows if r["entry_type"] == "DATA"]
    assert all(r["key"] is None or re.fullmatch(r"customer-\d+", r["key"]) for r in data)
    assert 0 < sum(r["key"] is None for r in data) < 0.1 * len(data)
    assert all(20 <= len(r["payload"]) <= 400 for r in data)
    assert len({r["payload"] for r in data}) > 100  # varied


# -- transactions ---------------------------------------------------------------------------


def test_every_marker_carries_its_transaction_and_producer(rows):
    markers = [r for r in rows if r["entry_type"] != "DATA"]
    assert markers
    for m in markers:
        assert txn_of(m) is not None and m["txn_most_bits"] in (0, 1)
        assert m["producer_id"] is not None and m["producer_epoch"] is not None
        assert m["sequence_id"] is None and m["key"] is None and m["payload"] is None
    # One marker per touched topic, and the transaction's producer on it.
    assert len({(m["topic"], txn_of(m)) for m in markers}) == len(markers)
    producer_of = {txn_of(r): (r["producer_id"], r["producer_epoch"]) for r in rows if r["entry_type"] == "DATA" and txn_of(r)}
    assert all(producer_of[txn_of(m)] == (m["producer_id"], m["producer_epoch"]) for m in markers)


def test_outcomes_commits_aborts_and_a_few_open_transactions_near_the_end(rows, summary):
    outcome: dict[tuple, set[str]] = defaultdict(set)
    topics_with_data: dict[tuple, set[str]] = defaultdict(set)
    for r in rows:
        if txn_of(r) is None:
            continue
        if r["entry_type"] == "DATA":
            topics_with_data[txn_of(r)].add(r["topic"])
        else:
            outcome[txn_of(r)].add(r["entry_type"])
    assert all(len(o) == 1 for o in outcome.values())  # atomic: the same outcome on every topic
    committed = sum(o == {"COMMIT"} for o in outcome.values())
    aborted = sum(o == {"ABORT"} for o in outcome.values())
    open_txns = [t for t in topics_with_data if t not in outcome]
    assert committed == summary.transactions_committed > 0
    assert aborted == summary.transactions_aborted > 0
    assert len(open_txns) == summary.transactions_open and 1 <= len(open_txns) <= 8
    assert 0.05 < aborted / (committed + aborted) < 0.25
    assert set(outcome) <= set(topics_with_data)  # no marker without data
    # Some transactions span two topics, with a marker on each.
    spanning = [t for t, topics in topics_with_data.items() if len(topics) == 2]
    assert spanning and all(len(topics) <= 2 for topics in topics_with_data.values())
    markers_on = Counter(txn_of(r) for r in rows if r["entry_type"] != "DATA")
    assert all(markers_on[t] == 2 for t in spanning if t in outcome)
    # Open transactions began near the end of their topics' logs.
    for topic, topic_rows in by_topic(rows).items():
        for i, r in enumerate(topic_rows):
            if txn_of(r) in open_txns:
                assert i >= 0.5 * len(topic_rows), (topic, i, len(topic_rows))
                break


def test_transactions_interleave_and_overlap_on_every_topic(rows):
    for topic, topic_rows in by_topic(rows).items():
        data = [r for r in topic_rows if r["entry_type"] == "DATA"]
        assert any(txn_of(r) is None for r in data) and any(txn_of(r) is not None for r in data)
        # 1..10 entries per transaction on a topic (retries aside).
        sizes = Counter(txn_of(r) for r in {(r["producer_id"], r["sequence_id"]): r for r in data}.values())
        sizes.pop(None, None)
        assert 1 <= min(sizes.values()) and max(sizes.values()) <= 10
        # Overlap: most markers land after data of other transactions that began before them.
        first_at: dict[tuple, int] = {}
        overlapped = markers = 0
        for i, r in enumerate(topic_rows):
            t = txn_of(r)
            if r["entry_type"] == "DATA":
                if t is not None:
                    first_at.setdefault(t, i)
                continue
            markers += 1
            between = topic_rows[first_at[t] + 1 : i]
            overlapped += any(txn_of(o) not in (None, t) and o["entry_type"] == "DATA" for o in between)
        assert overlapped > 0.5 * markers, topic


def test_retried_duplicates_repeat_producer_sequence_key_payload_and_transaction(rows, summary):
    duplicates = 0
    for topic, topic_rows in by_topic(rows).items():
        first: dict[tuple[int, int], dict] = {}
        marker_at = {txn_of(r): i for i, r in enumerate(topic_rows) if r["entry_type"] != "DATA"}
        for i, r in enumerate(topic_rows):
            if r["entry_type"] != "DATA" or r["sequence_id"] is None:
                continue
            ps = (r["producer_id"], r["sequence_id"])
            if ps not in first:
                first[ps] = r
                continue
            duplicates += 1
            original = first[ps]
            for c in ("producer_epoch", "key", "payload", "txn_most_bits", "txn_least_bits"):
                assert r[c] == original[c], (topic, c)
            assert r["publish_time"] > original["publish_time"]
            if txn_of(r) in marker_at:
                assert i < marker_at[txn_of(r)]  # retried before the transaction ended
    assert duplicates == summary.duplicates == round(N * 0.005)


def test_sequence_ids_increase_per_producer_and_topic_except_retries(rows):
    seen: dict[tuple[str, int], list[int]] = defaultdict(list)
    epochs: dict[tuple[str, int], list[int]] = defaultdict(list)
    for topic, topic_rows in by_topic(rows).items():
        for r in topic_rows:
            if r["producer_id"] is None:
                assert r["producer_epoch"] is None and r["sequence_id"] is None and txn_of(r) is None
                continue
            epochs[(topic, r["producer_id"])].append(r["producer_epoch"])
            if r["entry_type"] == "DATA":
                seen[(topic, r["producer_id"])].append(r["sequence_id"])
    non_idempotent = [r for r in rows if r["producer_id"] is None]
    assert non_idempotent
    for sequences in seen.values():
        kept_set: set[int] = set()
        kept: list[int] = []
        for s in sequences:
            if s in kept_set:
                continue  # a retry repeats an earlier sequence id
            assert not kept or s > kept[-1]
            kept.append(s)
            kept_set.add(s)
        assert kept[0] >= 0
    for values in epochs.values():
        assert values == sorted(values)  # epochs only move forward (a restarted producer)
    assert len({e for values in epochs.values() for e in values}) > 1


def test_reference_buffer_replays_the_log_with_only_retries_dropped(rows, summary):
    buffers = replay(LogEntry.from_row(r) for r in rows)
    violations = Counter()
    for buffer in buffers.values():
        violations.update(buffer.violations)
    assert violations == Counter({Violation.DUPLICATE: summary.duplicates})
    assert sum(len(b.markers) for b in buffers.values()) == summary.markers
    assert sum(b.ongoing_txn_count for b in buffers.values()) >= summary.transactions_open
    # The open transactions hold the stable position back on some topic at the end ...
    assert any(b.max_read_position < b.last_position for b in buffers.values())
    # ... and overlapping transactions make it lag while the log is written.
    for topic, topic_rows in by_topic(rows).items():
        trace = stable_position_trace(LogEntry.from_row(r) for r in topic_rows)
        positions = [(r["ledger_id"], r["entry_id"]) for r in topic_rows]
        lagging = sum(tuple(stable) < pos for stable, pos in zip(trace, positions))
        assert lagging > 0.5 * len(positions), topic


@pytest.mark.parametrize("topics", [1, 7])
def test_other_topic_counts(tmp_path, topics):
    summary = generate_ledger_file(tmp_path / "log.parquet", entries=1000, seed=5, topics=topics)
    rows = read_parquet(tmp_path / "log.parquet")
    assert len(rows) == 1000 and summary.topics == topics
    assert {r["topic"] for r in rows} == set(topic_names(topics))
    buffers = replay(LogEntry.from_row(r) for r in rows)
    assert all(set(b.violations) <= {Violation.DUPLICATE} for b in buffers.values())


# -- at scale -------------------------------------------------------------------------------


def test_200k_entries_parquet_at_scale(tmp_path):
    summary = generate_ledger_file(tmp_path / "big.parquet", entries=200_000, seed=11)
    table = pq.read_table(tmp_path / "big.parquet", columns=[c for c in LEDGER_ENTRY_COLUMNS if c != "payload"])
    assert table.num_rows == summary.entries == 200_000
    col = {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}
    topic = np.unique(col["topic"], return_inverse=True)[1]
    ledger, entry = col["ledger_id"].astype(np.int64), col["entry_id"].astype(np.int64)

    # Positions unique; entry ids 0..n-1 per ledger; no ledger in two topics.
    pos = np.stack([topic, ledger, entry], axis=1)
    assert len(np.unique(pos, axis=0)) == len(pos)
    ledgers, counts = np.unique(ledger, return_counts=True)
    maxima = np.zeros(ledger.max() + 1, np.int64)
    np.maximum.at(maxima, ledger, entry)
    assert np.array_equal(maxima[ledgers] + 1, counts)
    assert len(np.unique(np.stack([topic, ledger], axis=1), axis=0)) == len(ledgers) == summary.ledgers
    per_topic = np.bincount(topic[np.unique(ledger, return_index=True)[1]])
    assert per_topic.min() >= 10

    # Mix: ~0.5% retries, ~12% aborts, some open; markers carry a transaction id.
    assert summary.duplicates == 1000
    closed = summary.transactions_committed + summary.transactions_aborted
    assert 0.09 < summary.transactions_aborted / closed < 0.16 and summary.transactions_open >= 1
    marker = col["entry_type"] != "DATA"
    assert marker.sum() == summary.markers
    assert not table.column("txn_most_bits").is_null().to_numpy(zero_copy_only=False)[marker].any()

    # publish_time strictly increasing within each topic, in file order.
    t = col["publish_time"].astype("datetime64[us]").astype(np.int64)
    same_topic = topic[1:] == topic[:-1]
    assert (np.diff(t)[same_topic] > 0).all()
    assert (np.diff(entry)[same_topic & (ledger[1:] == ledger[:-1])] == 1).all()


def test_cli_refuses_to_overwrite_an_existing_file_without_force(tmp_path, capsys):
    from pipelines.cli import main

    out = tmp_path / "mine.jsonl"
    out.write_text("existing\n")
    assert main(["generate", "--entries", "10", str(out)]) == 2
    assert "already exists; generate does not overwrite a file unless asked: pass --force" in capsys.readouterr().err
    assert out.read_text() == "existing\n"
    assert main(["generate", "--entries", "10", "--force", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 10
