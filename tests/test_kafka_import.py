"""`txnlake import-kafka` against a real broker's log (`tests/kafka_broker.py`): the import and
`txnlake run` reproduce the broker's read_committed records, last stable offsets and aborted
index; the segment parser's codecs, checksums and refusals."""

from __future__ import annotations

import os
import re
import shutil
import struct
from collections import Counter
from pathlib import Path

import pytest
from pyspark.sql import functions as F

from tests.kafka_broker import kafka_log
from txn_engine.buffer.refresh import ledger_inventory, refresh_buffer
from txn_engine.core.errors import InputFileError
from txn_engine.core.schema import ABORTED_TXNS, COMMITTED_ENTRIES, OFFLOADED_ENTRIES, LEDGER_ENTRIES, QUARANTINE_ENTRIES, STABLE_POSITIONS
from txn_engine.log import kafka_log as K
from txn_engine.core.positions import start_position
from txn_engine.log.kafka_import import Segment, import_kafka, parse_segments, transactions_open_before
from txn_engine.tier.offload import offload_ledgers
from txn_engine.tier.reader import TopicReader

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def kafka(tmp_path_factory):
    """The workload's log and truth, written once per test run (shared by xdist workers)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    return kafka_log(base / "kafka-log")


def segments_of(log_dir: Path, partition: str) -> list[Path]:
    return sorted((log_dir / partition).glob("*.log"))


TIMESTAMP_TYPE_CODES = {"CREATE_TIME": 1, "LOG_APPEND_TIME": 2}  # confluent_kafka's TIMESTAMP_* constants


def record_of(row) -> tuple:
    """A committed_entries row as the consumer gave its record (`kafka_broker.Truth.records`)."""
    key = row.key.encode() if row.key is not None else None if row.key_bytes is None else bytes(row.key_bytes)
    headers = [(h["key"], None if h["value"] is None else bytes(h["value"])) for h in row.headers or []]
    return (row.ledger_id + row.entry_id, key, None if row.payload is None else bytes(row.payload), headers,
            TIMESTAMP_TYPE_CODES[row.timestamp_type], round(row.publish_time.timestamp() * 1000))


def test_import_run_verify_read_reproduce_the_broker(warehouse, warehouse_root, kafka, capsys):
    """`txnlake import-kafka`, then the buffer: committed_entries in ledger order is the
    read_committed consumer's output, the stable position the offset before the LSO, and
    `import-kafka --verify` finds aborted_txns equal to the .txnindex."""
    from pipelines.cli import main

    assert main(["import-kafka", str(kafka.log_dir)]) == 0
    out, err = capsys.readouterr()
    # A line per partition as its segments are parsed, before the summary.
    assert re.search(r"orders-1: parsed \d+ segment\(s\), \d+ records, [\d.]+s", err)
    assert "orders-1: " in out and "0 quarantined" in out
    # The compacted partition's gaps are warned about, as ingest does.
    assert "warning: entry ids not dense" in out and "compacted-0/0: " in out
    # What `txnlake run` computes of the buffer, without the rest of its asset graph (test_cli runs it).
    refresh_buffer(warehouse, ledger_inventory(warehouse), full=True)
    assert main(["import-kafka", "--verify", str(kafka.log_dir)]) == 0
    assert "aborted_txns matches the .txnindex" in capsys.readouterr().out
    truth = kafka.truth
    wh = warehouse
    for topic, records in sorted(truth.records.items()):
        got = (wh.read(COMMITTED_ENTRIES).where((F.col("topic") == topic) & F.col("in_stable_prefix"))
               .orderBy("ledger_id", "entry_id").collect())
        # Byte for byte: offset, key (null, empty, not UTF-8), value, headers in order, timestamp and its type.
        assert [record_of(r) for r in got] == records, topic
        stable = wh.read(STABLE_POSITIONS).where(F.col("topic") == topic).first()
        # The stable position is the offset before the last stable offset (a position of this topic).
        assert stable.max_read_ledger_id + stable.max_read_entry_id == truth.last_stable_offsets[topic] - 1, topic
        assert stable.last_ledger_id + stable.last_entry_id == truth.high_watermarks[topic] - 1, topic
    # The open transaction holds partition 1 back; committed data lies past it.
    assert truth.last_stable_offsets["orders-1"] < truth.high_watermarks["orders-1"]
    aborted = wh.read(ABORTED_TXNS).collect()
    assert len({r.txn_most_bits for r in aborted}) >= 3  # the clients', the zombie's, the timed-out one

    # The zombie's successor and the timed-out producer's next instance write sequence 0 again
    # under a new epoch: with the old duplicate key (topic, producer, sequence) their committed
    # records would be dropped as retries.
    entries = wh.read(LEDGER_ENTRIES).where("entry_type = 'DATA' and producer_id is not null").collect()
    assert max(Counter((r.topic, r.producer_id, r.sequence_id) for r in entries).values()) > 1
    assert max(Counter((r.topic, r.producer_id, r.producer_epoch, r.sequence_id) for r in entries).values()) == 1
    assert wh.read(COMMITTED_ENTRIES).where(F.col("payload").isin(b"successor0", b"after-timeout0")).count() == 2

    # The offload tier keeps them too, and a reader across both tiers gives the same records.
    offload_ledgers(wh)
    tier = wh.read(OFFLOADED_ENTRIES)
    assert tier.where("key_bytes is not null").count() and tier.where("headers is not null").count()
    for topic, records in sorted(truth.records.items()):
        read = TopicReader(wh).read(topic, start_position("earliest", "--from"), None).entries
        assert [record_of(r) for r in read] == records, topic
        assert {r.tier for r in read} == ({"hot"} if topic == "plain-0" else {"cold", "hot"}), topic

    assert main(["read", "plain-0", "--from", "earliest"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("--")]
    assert [line.split("\t")[-1] for line in lines] == [
        "" if v is None else v.decode() for _o, _k, v, *_rest in truth.records["plain-0"]]


def segment(path: Path) -> Segment:
    name = K.segment_name(str(path))
    return Segment(path.resolve().as_uri().replace("file:///", "file:/"), name.topic, name.base_offset)


def parsed_rows(warehouse, paths: list[Path]) -> list:
    """The import's parse of the segments in one pass (their carried transactions chained)."""
    segments = [segment(p) for p in paths]
    return parse_segments(warehouse.spark, segments, transactions_open_before(warehouse, segments)).collect()


def expected_txn_ids(warehouse, segments: list[Path]) -> dict[tuple[int, int], tuple[int, int]]:
    """{(ledger, entry): (txn_most_bits, txn_least_bits)} of one partition's transactional rows,
    parsed in one pass into an empty warehouse."""
    return {(r.ledger_id, r.entry_id): (r.txn_most_bits, r.txn_least_bits)
            for r in parsed_rows(warehouse, segments) if r.txn_most_bits is not None}


CODECS = ("none", "gzip", "snappy", "lz4", "zstd")


def batch_spans(buf: bytes) -> list[tuple[int, int]]:
    """(start, end) of each record batch of a well-formed segment: baseOffset, then batchLength."""
    spans, pos = [], 0
    while pos < len(buf):
        end = pos + 12 + struct.unpack_from(">i", buf, pos + 8)[0]
        spans.append((pos, end))
        pos = end
    return spans


def codec_of(buf: bytes, start: int) -> str:
    return CODECS[struct.unpack_from(">h", buf, start + 21)[0] & 7]  # attributes follow the CRC


def test_transactions_over_segments_and_imports_and_reimport(warehouse, kafka):
    """A transaction spans segments; imported in two parts (the second's carried rows resolved
    from the stored ones) its rows carry the ids a one-pass parse gives, and importing the whole
    partition again adds nothing."""
    segments = segments_of(kafka.log_dir, "orders-0")
    expected = expected_txn_ids(warehouse, segments)
    assert any(least < ledger for (ledger, _e), (_m, least) in expected.items()), "no transaction spans segments"
    first = import_kafka(warehouse, [str(s) for s in segments[:2]])
    # One pass over the input: every segment parsed once (a second pass would double the import).
    assert first.segment_reads == {s.path: 1 for s in first.segments}
    import_kafka(warehouse, [str(s) for s in segments[2:]])
    rows = warehouse.read(LEDGER_ENTRIES).where("txn_most_bits is not null").collect()
    assert {(r.ledger_id, r.entry_id): (r.txn_most_bits, r.txn_least_bits) for r in rows} == expected
    again = import_kafka(warehouse, [str(kafka.log_dir / "orders-0")]).ingest
    assert again.rows_written == 0 and again.rows_quarantined == 0 and again.rows_already_present > len(expected)


def test_every_codec_parses_and_checks_its_crc(warehouse, kafka):
    codecs, records = Counter(), 0
    segments = [p for p in sorted(kafka.log_dir.glob("*-*/*.log"))
                if K.segment_name(str(p)) is not None and not K.segment_name(str(p)).topic.startswith("__")]
    for path in segments:
        buf = path.read_bytes()
        codecs.update(codec_of(buf, start) for start, _end in batch_spans(buf))
        records += sum(struct.unpack_from(">i", buf, start + 57)[0] for start, _end in batch_spans(buf))  # recordCount
    rows = parsed_rows(warehouse, segments)
    assert [r.error for r in rows if r.error is not None] == []
    assert len(rows) == records
    assert set(codecs) == set(CODECS), codecs


def test_a_corrupt_batch_is_quarantined_with_its_position(warehouse, kafka, tmp_path):
    source = max(segments_of(kafka.log_dir, "orders-0"), key=lambda s: len(batch_spans(s.read_bytes())))
    folder = tmp_path / "orders-0"
    folder.mkdir()
    buf = bytearray(source.read_bytes())
    start, end = batch_spans(bytes(buf))[1]
    buf[end - 1] ^= 0xFF  # the last byte of the second batch: its CRC no longer matches
    (folder / source.name).write_bytes(bytes(buf))
    summary = import_kafka(warehouse, [str(folder)]).ingest
    assert summary.quarantine_by_rule == {"corrupt_batch": 1}
    row = warehouse.read(QUARANTINE_ENTRIES).first()
    assert row.line == start and "CRC-32C" in row.reason and source.name in row.source_file
    whole = parsed_rows(warehouse, [source])
    lost = sum(1 for r in whole if r.batch_position == start)
    assert lost and summary.rows_written == len(whole) - lost


def test_old_formats_and_other_files_are_refused_before_anything_is_read(warehouse, tmp_path):
    folder = tmp_path / "legacy-0"
    folder.mkdir()
    # A v1 message set: offset, size, crc, magic 1 ...
    (folder / "00000000000000000000.log").write_bytes(struct.pack(">qiIbb", 0, 30, 0, 1, 0) + bytes(30))
    with pytest.raises(InputFileError, match=r"00000000000000000000.log: message format v1.*v2 only"):
        import_kafka(warehouse, [str(folder)])
    stray = tmp_path / "notes.txt"
    stray.write_text("x")
    with pytest.raises(InputFileError, match="is not a Kafka segment"):
        import_kafka(warehouse, [str(stray)])
    with pytest.raises(InputFileError, match="does not exist"):
        import_kafka(warehouse, [str(tmp_path / "missing")])
    assert not warehouse.exists(LEDGER_ENTRIES)


def test_verify_is_an_asset_check_of_aborted_txns(dagster_resources, kafka, tmp_path):
    """The `import_kafka` job records the partitions it read; the buffer's run then checks
    aborted_txns against their .txnindex, and the check fails once an index names an abort the
    table does not hold."""
    from dagster import AssetSelection, DagsterInstance, materialize

    from assets.ledger import import_kafka_job
    from assets.transaction_buffer.tables import aborted_txns_match_kafka_index
    from pipelines.definitions import ALL_ASSETS, ALL_CHECKS
    from tests.dagster_runs import derive_all

    log = tmp_path / "kafka-log"
    shutil.copytree(kafka.log_dir, log)
    instance = DagsterInstance.ephemeral()
    imported = import_kafka_job.execute_in_process(
        run_config={"ops": {"import_kafka_segments": {"config": {"paths": [str(log)]}}}},
        resources=dagster_resources, instance=instance)
    assert imported.success
    _catalog, derived = derive_all(dagster_resources, instance)

    def evaluation(result):
        (found,) = [e for e in result.get_asset_check_evaluations() if e.check_name == "aborted_txns_match_kafka_index"]
        return found

    passed = evaluation(derived)
    folders = passed.metadata["kafka_partitions"].value
    assert passed.passed and len(folders) == len({p.parent for p in log.glob("*-*/*.log") if not p.parent.name.startswith("__")})
    assert passed.metadata["only_in_index"].value == [] and passed.metadata["only_in_aborted_txns"].value == []

    # An abort Kafka's index holds and aborted_txns does not: the index with one entry more.
    index = next(p for p in sorted(log.glob("*-*/*.txnindex")) if p.stat().st_size and not p.parent.name.startswith("__"))
    entry = K.parse_txn_index(index.read_bytes())[0]
    extra = K.TXN_INDEX_ENTRY.pack(0, entry.producer_id, entry.first_offset + 10**9, entry.last_offset + 10**9, 0)
    index.write_bytes(index.read_bytes() + extra)
    failed = evaluation(materialize([*ALL_ASSETS, *ALL_CHECKS], selection=AssetSelection.checks(aborted_txns_match_kafka_index),
                                    resources=dagster_resources, instance=instance, raise_on_error=False))
    assert not failed.passed
    assert failed.metadata["only_in_index"].value == [[index.parent.name, entry.producer_id, entry.first_offset + 10**9,
                                                         entry.last_offset + 10**9]]
