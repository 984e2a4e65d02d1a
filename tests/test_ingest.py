"""Ingest on real Spark and Delta: formats, every validation rule, idempotence, quarantine."""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.rows import entry, write_csv, write_jsonl
from txn_engine.core.errors import InputFileError
from txn_engine.log.ingest import ingest_files
from txn_engine.core.schema import LEDGER_ENTRIES, LEDGER_ENTRY_COLUMNS, QUARANTINE_ENTRIES

GOOD = [
    entry("orders-0", 3, 0, producer=1, seq=0, key="k0", payload=b"hello"),
    entry("orders-0", 3, 1, txn=(0, 7), producer=2, seq=0, payload=b"\x00\xffbin"),
    entry("orders-0", 3, 2, "COMMIT", txn=(0, 7), producer=2),
    entry("orders-0", 5, 0, payload=None),
    entry("payments-1", 4, 0, txn=(1, 9), producer=3, seq=5),
    entry("payments-1", 4, 1, "ABORT", txn=(1, 9), producer=3),
]


def stored(warehouse, table=LEDGER_ENTRIES):
    return sorted(tuple(r) for r in warehouse.read(table).select(*LEDGER_ENTRY_COLUMNS).collect())


def quarantine(warehouse):
    return warehouse.read(QUARANTINE_ENTRIES).orderBy("source_file", "line").collect()


def test_jsonl_rows_land_typed(warehouse, tmp_path):
    summary = ingest_files(warehouse, [str(write_jsonl(tmp_path / "a.jsonl", GOOD))])
    assert (summary.rows_read, summary.rows_written, summary.rows_quarantined) == (6, 6, 0)
    rows = {(r.topic, r.ledger_id, r.entry_id): r for r in warehouse.read(LEDGER_ENTRIES).collect()}
    first = rows[("orders-0", 3, 0)]
    assert first.payload == bytearray(b"hello") and first.key == "k0" and first.producer_epoch == 0
    assert first.publish_time == dt.datetime(2026, 1, 1, 0, 0)
    assert rows[("orders-0", 3, 1)].payload == bytearray(b"\x00\xffbin")
    commit = rows[("orders-0", 3, 2)]
    assert (commit.entry_type, commit.txn_most_bits, commit.txn_least_bits, commit.payload) == ("COMMIT", 0, 7, None)
    assert rows[("orders-0", 5, 0)].txn_most_bits is None
    assert warehouse.read(QUARANTINE_ENTRIES).count() == 0  # the table the summary names exists, empty


def test_jsonl_keys_as_bytes_headers_and_timestamp_types(warehouse, tmp_path):
    """The lossless columns from text: a key of bytes (base64) that is UTF-8 is stored as text,
    one that is not as key_bytes; headers a JSON array, values base64 or null; bad ones quarantined."""
    b64 = lambda raw: base64.b64encode(raw).decode()  # noqa: E731
    rows = [
        {**entry("k-0", 1, 0), "key_bytes": b64(b"\xff\x00"), "timestamp_type": "LOG_APPEND_TIME",
         "headers": json.dumps([{"key": "a", "value": b64(b"\x00")}, {"key": "a", "value": None}, {"key": "e", "value": ""}])},
        {**entry("k-0", 1, 1), "key_bytes": b64("t\u00e9xt".encode())},
        {**entry("k-0", 1, 2), "key_bytes": "", "timestamp_type": "CREATE_TIME"},
        {**entry("k-0", 1, 3), "key": "k", "key_bytes": b64(b"\xff")},
        {**entry("k-0", 1, 4), "timestamp_type": "WALL_CLOCK"},
        {**entry("k-0", 1, 5), "headers": json.dumps([{"value": b64(b"x")}])},
    ]
    summary = ingest_files(warehouse, [str(write_jsonl(tmp_path / "a.jsonl", rows))])
    assert summary.quarantine_by_rule == {"key_twice": 1, "timestamp_type": 1, "type": 1}
    got = {r.entry_id: r for r in warehouse.read(LEDGER_ENTRIES).collect()}
    assert (got[0].key, got[0].key_bytes, got[0].timestamp_type) == (None, bytearray(b"\xff\x00"), "LOG_APPEND_TIME")
    assert [(h.key, h.value) for h in got[0].headers] == [("a", bytearray(b"\x00")), ("a", None), ("e", bytearray())]
    assert (got[1].key, got[1].key_bytes) == ("t\u00e9xt", None)
    assert (got[2].key, got[2].key_bytes, got[2].headers) == ("", None, None)


def write_parquet(path, rows, publish_time):
    """`rows` (tests.rows.entry dicts) as Parquet with typed columns; `publish_time` an Arrow array."""
    table = pa.table(
        {
            "topic": [r["topic"] for r in rows],
            "ledger_id": pa.array([r["ledger_id"] for r in rows], pa.int64()),
            "entry_id": pa.array([r["entry_id"] for r in rows], pa.int64()),
            "entry_type": [r["entry_type"] for r in rows],
            "txn_most_bits": pa.array([r["txn_most_bits"] for r in rows], pa.int64()),
            "txn_least_bits": pa.array([r["txn_least_bits"] for r in rows], pa.int64()),
            "producer_id": pa.array([r["producer_id"] for r in rows], pa.int64()),
            "producer_epoch": pa.array([r["producer_epoch"] for r in rows], pa.int32()),
            "sequence_id": pa.array([r["sequence_id"] for r in rows], pa.int64()),
            "publish_time": publish_time,
            "key": [r["key"] for r in rows],
            "payload": pa.array([None if r["payload"] is None else base64.b64decode(r["payload"]) for r in rows], pa.binary()),
        }
    )
    pq.write_table(table, path)
    return path


def test_csv_and_parquet_give_the_same_table_as_jsonl_alone_and_mixed(spark, tmp_path, warehouse):
    from txn_engine.core.settings import WarehouseSettings
    from txn_engine.storage.warehouse import Warehouse

    jsonl = str(write_jsonl(tmp_path / "a.jsonl", GOOD))
    ingest_files(warehouse, [jsonl])
    expected = stored(warehouse)

    csv = str(write_csv(tmp_path / "a.csv", GOOD))
    csv_wh = Warehouse(spark, WarehouseSettings(warehouse=str(tmp_path / "csv")))
    summary = ingest_files(csv_wh, [csv])
    assert summary.rows_written == 6 and summary.rows_quarantined == 0
    assert stored(csv_wh) == expected

    # A TIMESTAMP column is taken as it is; an integer one is epoch milliseconds (Pulsar's publishTime).
    typed = str(write_parquet(tmp_path / "a.parquet", GOOD, pa.array(
        [dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)] * len(GOOD), pa.timestamp("us", "UTC"))))
    millis = str(write_parquet(tmp_path / "b.parquet", GOOD, pa.array([1767225600000] * len(GOOD), pa.int64())))
    pq_wh = Warehouse(spark, WarehouseSettings(warehouse=str(tmp_path / "pq")))
    summary = ingest_files(pq_wh, [typed])
    assert summary.rows_written == 6 and summary.rows_quarantined == 0
    assert stored(pq_wh) == expected

    # All four files in one ingest: each is typed by its own format (a union of the raw files
    # stored JSONL's base64 text undecoded). The 18 rows after the first file's are repeats,
    # not position_repeated_in_input, only if every file reads to the same values.
    mixed_wh = Warehouse(spark, WarehouseSettings(warehouse=str(tmp_path / "mixed")))
    summary = ingest_files(mixed_wh, [millis, jsonl, typed, csv])
    assert (summary.rows_written, summary.rows_repeated_in_input, summary.rows_quarantined) == (6, 18, 0)
    assert stored(mixed_wh) == expected


BAD_ROWS = [
    ({"entry_type": "DATTA"}, "entry_type", "entry_type must be one of DATA, COMMIT, ABORT, got 'DATTA'"),
    ({"entry_type": None}, "entry_type", "got nothing"),
    ({"txn_most_bits": 1, "txn_least_bits": None}, "txn_id_pair", "must both be set or both be null"),
    ({"entry_type": "COMMIT"}, "marker_without_txn", "must carry a transaction id"),
    ({"ledger_id": -1}, "negative_id", "ledger_id must not be negative, got -1"),
    ({"sequence_id": -5, "producer_id": 1}, "negative_id", "sequence_id must not be negative"),
    ({"entry_id": "seven"}, "type", "entry_id is not an integer: 'seven'"),
    ({"ledger_id": 1.5}, "type", "ledger_id is not an integer"),
    ({"producer_epoch": 2**40}, "type", "producer_epoch is not a 32-bit integer"),
    ({"publish_time": "yesterday"}, "type", "publish_time is not an ISO-8601 timestamp"),
    # Integers are epoch milliseconds: seconds land in 1970, microseconds past 2262 (timestamp[ns]'s end).
    ({"publish_time": 1767225600}, "publish_time_range",
     "publish_time must be in [2000-01-01, 2262-04-11) UTC, got 1767225600 (read as 1970-01-21 10:53:45.6 UTC); "
     "an integer publish_time is epoch milliseconds"),
    ({"publish_time": "2262-04-11T00:00:00Z"}, "publish_time_range", "got 2262-04-11T00:00:00Z; an integer"),
    ({"publish_time": 999999999999999999}, "publish_time_range", "got 999999999999999999; "),  # past Spark's own range
    ({"payload": "not base64!"}, "type", "payload is not base64"),
    ({"payload": "plain text payload"}, "type",
     "payload is not base64: 'plain text payload'; a payload in JSONL or CSV (or a Parquet string column) must be base64"),
    ({"topic": ""}, "missing", "topic is missing or empty"),
    # A JSON value of another type for a string column is not its text ('123', '{"a":1}').
    ({"topic": 123}, "type", "topic must be a JSON string, got 123 (bigint); write it as a JSON string"),
    ({"key": {"a": 1}}, "type", 'key must be a JSON string, got {"a":1} (object)'),
    ({"topic": " t"}, "topic_whitespace", "topic ' t' starts or ends with whitespace; topic names are compared exactly"),
    ({"entry_id": None}, "missing", "entry_id is missing"),
]


def test_each_validation_rule_quarantines_with_its_message(warehouse, tmp_path):
    # One ingest holds one bad row per rule (line i + 2), so the whole table is checked at once;
    # beside it a Parquet file, typed by its own rules: integer times are epoch milliseconds,
    # a double id must be whole.
    bad_rows = [{**entry("t", 1, i + 1), **change} for i, (change, _, _) in enumerate(BAD_ROWS)]
    path = write_jsonl(tmp_path / "in.jsonl", [entry("t", 1, 0)] + bad_rows)
    pq.write_table(pa.table({
        "topic": ["t"] * 4, "ledger_id": pa.array([2.0, 2.5, 2.0, 2.0]), "entry_id": pa.array([0, 1, 2, 3], pa.int64()),
        "entry_type": ["DATA"] * 4, "publish_time": pa.array([1767225600000, 1767225600000, 1767225600, 1767225600000], pa.int64()),
        "key": pa.array([None, None, None, b"\xff\xfe"], pa.binary()),  # not UTF-8: was stored as U+FFFD
    }), tmp_path / "in.parquet")
    summary = ingest_files(warehouse, [str(path), str(tmp_path / "in.parquet")])
    assert (summary.rows_written, summary.rows_quarantined) == (2, len(BAD_ROWS) + 3)
    rows = quarantine(warehouse)
    by_line = {row.line: row for row in rows if row.source_file.endswith("in.jsonl")}
    assert sorted(by_line) == list(range(2, len(BAD_ROWS) + 2))
    for i, (change, rule, message) in enumerate(BAD_ROWS):
        row = by_line[i + 2]
        assert row.rule == rule and message in row.reason, (change, row.rule, row.reason)
        assert json.loads(row.raw) == bad_rows[i]
    assert [(r.line, r.rule, r.reason.split(";")[0]) for r in rows if r.source_file.endswith("in.parquet")] == [
        (2, "type", "ledger_id has type double, expected bigint"),
        (3, "publish_time_range", "publish_time must be in [2000-01-01, 2262-04-11) UTC, got 1767225600 (read as 1970-01-21 10:53:45.6 UTC)"),
        (4, "type", "key must be UTF-8 text, but this Parquet binary value is not valid UTF-8"),
    ]
    assert summary.quarantine_by_rule == Counter([r for _, r, _ in BAD_ROWS] + ["type", "publish_time_range", "type"])
    assert stored(warehouse) == [
        ("t", 1, 0, "DATA", None, None, None, None, None, dt.datetime(2026, 1, 1), None, bytearray(b"x"), None, None, None),
        ("t", 2, 0, "DATA", None, None, None, None, None, dt.datetime(2026, 1, 1), None, None, None, None, None),
    ]


def test_a_row_with_several_problems_lists_them_all_in_order_under_its_first_rule(warehouse, tmp_path):
    # Value types first (in column order), then each column's own rules, each message once,
    # without its rule; a topic of the wrong type is not also reported missing.
    path = write_jsonl(tmp_path / "in.jsonl", [
        {**entry("t", 1, 0), "topic": 123, "key": {"a": 1}, "ledger_id": -1, "entry_type": "DATTA"},
        {**entry("t", 1, 1), "topic": None, "sequence_id": -5, "producer_id": 1},
    ])
    summary = ingest_files(warehouse, [str(path)])
    assert summary.rows_quarantined == 2
    again = "write it as a JSON string (in double quotes) and ingest the row again"
    assert [(r.line, r.rule, r.reason) for r in quarantine(warehouse)] == [
        (1, "type", f"topic must be a JSON string, got 123 (bigint); {again}; "
                    f'key must be a JSON string, got {{"a":1}} (object); {again}; '
                    "entry_type must be one of DATA, COMMIT, ABORT, got 'DATTA'; ledger_id must not be negative, got -1"),
        (2, "missing", "topic is missing or empty; sequence_id must not be negative, got -5"),
    ]


def test_malformed_lines_and_line_numbers_across_file_blocks(spark, warehouse, tmp_path):
    rows: list = [entry("t", 1, i) for i in range(3000)]
    rows[1499] = "{not json"
    rows[2999] = "[1, 2]"
    rows.insert(10, "")  # blank lines are skipped but still counted as lines
    path = write_jsonl(tmp_path / "big.jsonl", rows)
    spark.conf.set("spark.sql.files.maxPartitionBytes", "16384")  # force many blocks
    try:
        summary = ingest_files(warehouse, [str(path)])
    finally:
        spark.conf.unset("spark.sql.files.maxPartitionBytes")
    assert summary.rows_written == 2998 and summary.rows_quarantined == 2
    assert [(r.line, r.rule, r.reason) for r in quarantine(warehouse)] == [
        (1501, "malformed_line", "not a JSON object on one line"),
        (3001, "malformed_line", "not a JSON object on one line"),
    ]


def test_csv_line_numbers_and_bad_field_count(warehouse, tmp_path):
    path = write_csv(tmp_path / "in.csv", [entry("t", 1, 0), entry("t", 1, 1, "ABORT", txn=(0, 1))])
    with open(path, "a") as f:
        f.write("t,1,2,DATA\n")
    summary = ingest_files(warehouse, [str(path)])
    assert summary.rows_written == 2
    [row] = quarantine(warehouse)
    assert (row.line, row.rule) == (4, "malformed_line") and f"expected {len(LEDGER_ENTRY_COLUMNS)} fields" in row.reason


def test_reingest_is_idempotent(warehouse, tmp_path):
    path = str(write_jsonl(tmp_path / "a.jsonl", GOOD + [{**entry("t", 1, 0), "entry_type": "BAD"}]))
    ingest_files(warehouse, [path])
    version = warehouse.version(LEDGER_ENTRIES)
    before, quarantined = stored(warehouse), len(quarantine(warehouse))
    again = ingest_files(warehouse, [path])
    assert (again.rows_written, again.rows_already_present, again.rows_quarantined) == (0, 6, 1)
    assert stored(warehouse) == before
    assert warehouse.version(LEDGER_ENTRIES) == version  # nothing committed
    assert len(quarantine(warehouse)) == quarantined  # quarantine is idempotent too


def test_different_row_at_stored_position_is_quarantined_never_overwrites(warehouse, tmp_path):
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "a.jsonl", GOOD))])
    before = stored(warehouse)
    changed = {**GOOD[0], "key": "changed"}
    micros = {**GOOD[1], "publish_time": 1767225600000000}  # a unit mistake at a stored position
    # orders-0/3 is no longer its topic's last ledger (CLOSED only by derivation): still appendable,
    # files may arrive out of order.
    summary = ingest_files(warehouse, [str(write_jsonl(tmp_path / "b.jsonl", [changed, entry("orders-0", 3, 3), micros]))])
    assert (summary.rows_written, summary.rows_quarantined) == (1, 2)
    conflict, out_of_range = quarantine(warehouse)
    assert conflict.rule == "position_conflict"
    assert "position orders-0 3:0 already holds a different entry" in conflict.reason
    assert out_of_range.rule == "publish_time_range" and "got 1767225600000000 (read as +57971" in out_of_range.reason
    assert len(stored(warehouse)) == len(before) + 1 and set(before) <= set(stored(warehouse))


def test_repeats_inside_one_input(warehouse, tmp_path):
    first = entry("t", 1, 0, key="a")
    path = write_jsonl(tmp_path / "a.jsonl", [first, first, {**first, "key": "b"}])
    summary = ingest_files(warehouse, [str(path)])
    assert (summary.rows_written, summary.rows_repeated_in_input, summary.rows_quarantined) == (1, 1, 1)
    [row] = quarantine(warehouse)
    assert row.rule == "position_repeated_in_input" and row.line == 3
    assert "appears earlier in the input with different content" in row.reason and "a.jsonl:1" in row.reason
    assert stored(warehouse)[0][10] == "a"


def test_several_files_and_a_folder(warehouse, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    write_jsonl(folder / "one.jsonl", GOOD[:3])
    write_csv(folder / "two.csv", GOOD[3:])
    (folder / "notes.txt").write_text("ignored")
    summary = ingest_files(warehouse, [str(folder)])
    assert len(summary.files) == 2 and summary.rows_written == 6


def test_pandas_parquet_nanosecond_times_are_read_and_entry_id_gaps_are_warned(warehouse, tmp_path):
    # pandas and pyarrow write timestamp[ns] by default, which Spark reads only as raw INT64.
    times = [dt.datetime(2026, 1, 1, 1, 2, 3, 456789), dt.datetime(2026, 1, 2), dt.datetime(2026, 1, 3)]
    rows = [entry("t", 1, 0), entry("t", 1, 1), entry("t", 1, 5)]
    path = write_parquet(tmp_path / "pandas.parquet", rows, pa.array(times, pa.timestamp("ns")))
    summary = ingest_files(warehouse, [str(path)])
    assert (summary.rows_written, summary.rows_quarantined) == (3, 0)
    assert [r[9] for r in stored(warehouse)] == times
    # Entries 2..4 missing: stored (a compacted export may have gaps) but reported.
    assert summary.entry_id_gaps == [
        {"topic": "t", "ledger_id": 1, "first_entry_id": 0, "last_entry_id": 5, "entry_count": 3, "missing": 3}]
    assert "  warning: entry ids not dense in 1 ledger(s)" in "\n".join(summary.lines())
    assert "    t/1: 3 id(s) missing in 0..5 (3 entries)" in summary.lines()


def misspelled_parquet(folder):
    pq.write_table(pa.table({"topic": ["t"], "ledger_id": [9], "entry_id": [0], "entry_type": ["DATA"], "Key": ["k"]}),
                   folder / "typo.parquet")
    return folder / "typo.parquet"


@pytest.mark.parametrize(
    "make_path,message",
    [
        (lambda p: p / "missing.jsonl", "does not exist"),
        (lambda p: (p / "data.txt").write_text("x") and p / "data.txt", "unknown format"),
        (lambda p: (p / "broken.parquet").write_bytes(b"not parquet at all") and p / "broken.parquet", "cannot read"),
        (lambda p: (p / "h.csv").write_text("topic,ledger_id\nt,1\n") and p / "h.csv", "no column(s) entry_id, entry_type"),
        # An unknown column would be dropped: a misspelled txn id makes the rows non-transactional.
        (lambda p: write_jsonl(p / "typo.jsonl", [entry("t", 9, 0), {**entry("t", 9, 1), "txnMostBits": 0}]),
         "typo.jsonl has unknown column(s) txnMostBits (first on line 2); ingest knows only the ledger_entries columns "
         "(topic, ledger_id, entry_id, entry_type, txn_most_bits, txn_least_bits, producer_id, producer_epoch, sequence_id, "
         "publish_time, key, payload, key_bytes, headers, timestamp_type; topic, ledger_id, entry_id, entry_type required, the others optional) and would drop "
         "the values of any other. Rename or remove them (did you mean txnMostBits -> txn_most_bits"),
        (misspelled_parquet, "typo.parquet has unknown column(s) Key; ingest knows only"),
    ],
    ids=["missing", "unknown-format", "unreadable-parquet", "csv-missing-columns", "jsonl-unknown-column",
         "parquet-unknown-column"],
)
def test_file_level_errors_write_nothing(warehouse, tmp_path, make_path, message):
    good = write_jsonl(tmp_path / "good.jsonl", GOOD)
    bad = make_path(tmp_path)
    with pytest.raises(InputFileError, match="(?s)" + message.replace("(", r"\(").replace(")", r"\)") + ".*[Nn]othing"):
        ingest_files(warehouse, [str(good), str(bad)])
    assert not warehouse.exists(LEDGER_ENTRIES)
    assert not warehouse.exists(QUARANTINE_ENTRIES)
