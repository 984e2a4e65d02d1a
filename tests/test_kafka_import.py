"""`txnlake import-kafka` against a real broker's log (`tests/kafka_broker.py`): the import and
`txnlake run` reproduce the broker's read_committed records, last stable offsets and aborted
index; the segment parser's codecs, checksums and refusals."""

from __future__ import annotations

import os
import shutil
import struct
from collections import Counter
from pathlib import Path

import pytest
from pyspark.sql import functions as F

from tests.kafka_broker import kafka_log
from txn_engine.buffer.refresh import ledger_inventory, refresh_buffer
from txn_engine.core.errors import InputFileError
from txn_engine.core.schema import COMMITTED_ENTRIES, LEDGER_ENTRIES, QUARANTINE_ENTRIES, STABLE_POSITIONS
from txn_engine.log import kafka_log as K
from txn_engine.log.kafka_import import import_kafka, verify_against_index

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


def imported(warehouse, kafka, prepared):
    def build(wh, _folder):
        import_kafka(wh, [str(kafka.log_dir)])
        refresh_buffer(wh, ledger_inventory(wh), full=True)

    return prepared("kafka-imported", build)


def test_import_reproduces_the_brokers_read_committed_view(warehouse, prepared, kafka):
    wh = imported(warehouse, kafka, prepared)
    truth = kafka.truth
    for topic, records in sorted(truth.records.items()):
        got = (wh.read(COMMITTED_ENTRIES).where((F.col("topic") == topic) & F.col("in_stable_prefix"))
               .orderBy("ledger_id", "entry_id").collect())
        assert [r.ledger_id + r.entry_id for r in got] == [r[0] for r in records], topic
        assert [r.payload for r in got] == [r[2] for r in records], topic
        assert [r.publish_time.timestamp() * 1000 for r in got] == [r[5] for r in records], topic
        stable = wh.read(STABLE_POSITIONS).where(F.col("topic") == topic).first()
        # The stable position is the offset before the last stable offset (a position of this topic).
        assert stable.max_read_ledger_id + stable.max_read_entry_id == truth.last_stable_offsets[topic] - 1, topic
        assert stable.last_ledger_id + stable.last_entry_id == truth.high_watermarks[topic] - 1, topic
    # The open transaction holds partition 1 back; committed data lies past it.
    assert truth.last_stable_offsets["orders-1"] < truth.high_watermarks["orders-1"]
    comparison = verify_against_index(wh, [str(kafka.log_dir)])
    assert comparison.equal and not comparison.marker_only, comparison
    assert len({a[1] for a in comparison_index(wh, kafka)}) >= 3  # zombie, timeout and client aborts


def comparison_index(wh, kafka):
    from txn_engine.log.kafka_import import index_entries, resolve_segments

    return index_entries(wh.spark, resolve_segments(wh.spark, [str(kafka.log_dir)]))


def test_a_bumped_epoch_restarts_sequences_and_nothing_is_dropped(warehouse, prepared, kafka):
    """The zombie's successor and the timed-out producer's next instance write sequence 0 again
    under a new epoch: with the old duplicate key (topic, producer, sequence) their committed
    records would be dropped as retries, and the comparison above would fail."""
    wh = imported(warehouse, kafka, prepared)
    entries = wh.read(LEDGER_ENTRIES).where("entry_type = 'DATA' and producer_id is not null").collect()
    by_key = Counter((r.topic, r.producer_id, r.sequence_id) for r in entries)
    by_epoch_key = Counter((r.topic, r.producer_id, r.producer_epoch, r.sequence_id) for r in entries)
    assert max(by_key.values()) > 1 and max(by_epoch_key.values()) == 1
    committed = wh.read(COMMITTED_ENTRIES).where(F.col("payload").isin(b"successor0", b"after-timeout0")).count()
    assert committed == 2


def test_reimport_adds_nothing_and_segments_one_by_one_give_the_same_rows(warehouse, spark, kafka, tmp_path):
    """A transaction spans segments; imported a segment at a time (the carried ones resolved from
    the stored rows), the rows equal a whole-log import's, and importing again adds nothing."""
    whole = import_kafka(warehouse, [str(kafka.log_dir / "orders-0")])
    expected = sorted(tuple(r) for r in warehouse.read(LEDGER_ENTRIES).collect())
    assert any(r[5] is not None and r[5] < r[1] for r in expected), "no transaction spans a segment boundary"
    shutil.rmtree(warehouse.path(LEDGER_ENTRIES))
    for segment in segments_of(kafka.log_dir, "orders-0"):
        import_kafka(warehouse, [str(segment)])
    assert sorted(tuple(r) for r in warehouse.read(LEDGER_ENTRIES).collect()) == expected
    again = import_kafka(warehouse, [str(kafka.log_dir / "orders-0")])
    assert again.ingest.rows_written == 0 and again.ingest.rows_already_present == whole.ingest.rows_read


def test_every_codec_parses_and_checks_its_crc(kafka):
    codecs = Counter()
    for segment in sorted(kafka.log_dir.glob("*-*/*.log")):
        name = K.segment_name(str(segment))
        if name is None or name.topic.startswith("__"):
            continue
        buf = segment.read_bytes()
        for start, _end in K.batch_spans(buf):
            codecs[K.CODECS[struct.unpack_from(">h", buf, start + K.CRC_START)[0] & 7]] += 1
        table = K.parse_segment(name.topic, name.base_offset, buf)
        assert table.column("error").null_count == table.num_rows, table.column("error")
    assert set(codecs) == set(K.CODECS), codecs


def test_a_corrupt_batch_is_quarantined_with_its_position(warehouse, kafka, tmp_path):
    source = max(segments_of(kafka.log_dir, "orders-0"), key=lambda s: len(list(K.batch_spans(s.read_bytes()))))
    folder = tmp_path / "orders-0"
    folder.mkdir()
    buf = bytearray(source.read_bytes())
    start, end = list(K.batch_spans(bytes(buf)))[1]
    buf[end - 1] ^= 0xFF  # the last byte of the second batch: its CRC no longer matches
    (folder / source.name).write_bytes(bytes(buf))
    summary = import_kafka(warehouse, [str(folder)]).ingest
    assert summary.quarantine_by_rule == {"corrupt_batch": 1}
    row = warehouse.read(QUARANTINE_ENTRIES).first()
    assert row.line == start and "CRC-32C" in row.reason and source.name in row.source_file
    whole = K.parse_segment("orders-0", K.segment_name(str(source)).base_offset, source.read_bytes())
    lost = sum(1 for p in whole.column("batch_position").to_pylist() if p == start)
    assert summary.rows_written == whole.num_rows - lost


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
