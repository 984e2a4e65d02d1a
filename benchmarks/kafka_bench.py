"""Benchmark: `txnlake import-kafka` of a Kafka log of BENCH_KAFKA_MB megabytes (default 1024).

The log is written directly as segment files (record batch format v2, uncompressed, CRC-32C;
`write_log`), a Kafka log as a broker stores it: PARTITIONS partitions of SEGMENT_MB segments,
transactional producers committing batches of BATCH_RECORDS records of VALUE_BYTES-byte values,
each different (`_value`), an abort now and then, keys and headers on every record. Measured on
the same files:
- binary read: Spark reads every segment as bytes (`binaryFile`) and sums their lengths, the
  floor of any import (after a first such read, which pays the JVM's warm-up), ROUNDS times;
- import: `import_kafka` into an empty warehouse (parse on Spark, validate, append to
  `ledger_entries`), ROUNDS + 1 times, each into a warehouse of its own: the first pays the JVM's
  warm-up of the import's code (as a `txnlake import-kafka` process does), the others do not (as
  the read it is compared with);
- writer floor: the same segments parsed and their records written as plain Parquet by Spark's
  writer doing the least it can (no statistics, dictionaries or page checksums; no validation, no
  Delta): what any import that writes through Spark costs at least.
After the first read and the first import, each round times a read, a floor and an import, one
after the other (the machine's speed moves between minutes); each figure is the median of its rounds.
Target: the import at most 2x the binary read. Prints seconds, records/s and MB/s, the ratios to
the read, and the driver JVM's CPU seconds of each (all of Spark's work in local mode; on a shared
machine their ratio moves far less than the wall times').
"""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path

import crc32c

from benchmarks.measure import jvm_cpu_seconds, jvm_peak_rss_mib, timed

PARTITIONS = 4
SEGMENT_MB = 128
BATCH_RECORDS = 50
VALUE_BYTES = 1000
ABORT_EVERY = 10  # one transaction in ten aborts
ROUNDS = 5  # rounds of a read, a floor and an import; each figure is their median (this machine swings)


def _varint(value: int) -> bytes:
    zigzag = (value << 1) ^ (value >> 63)
    out = bytearray()
    while zigzag >= 0x80:
        out.append((zigzag & 0x7F) | 0x80)
        zigzag >>= 7
    out.append(zigzag)
    return bytes(out)


def _record(offset_delta: int, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]) -> bytes:
    body = bytearray(b"\x00")  # attributes
    body += _varint(0) + _varint(offset_delta)
    body += _varint(-1) if key is None else _varint(len(key)) + key
    body += _varint(-1) if value is None else _varint(len(value)) + value
    body += _varint(len(headers))
    for name, raw in headers:
        body += _varint(len(name)) + name.encode() + _varint(len(raw)) + raw
    return _varint(len(body)) + bytes(body)


def _batch(base_offset: int, records: list[bytes], producer: int, sequence: int, control: bool, ts: int) -> bytes:
    attributes = 0x10 | (0x20 if control else 0)  # transactional (and control), uncompressed, CreateTime
    after_crc = struct.pack(">hiqqqhii", attributes, len(records) - 1, ts, ts, producer, 0,
                            -1 if control else sequence, len(records)) + b"".join(records)
    length = 4 + 1 + 4 + len(after_crc)  # partitionLeaderEpoch, magic, crc, rest
    return struct.pack(">qiibI", base_offset, length, 0, 2, crc32c.crc32c(after_crc)) + after_crc


def _value(rng: random.Random, shared: bytes) -> bytes:
    """A record's value: every one different, about 2:1 compressible (half random bytes, half a
    pattern all share), as serialized events are; equal values would flatter the write's compression
    and burden Parquet's dictionary."""
    half = VALUE_BYTES // 2
    return rng.randbytes(half) + shared[:VALUE_BYTES - half]


def write_log(folder: Path, total_mb: int) -> tuple[int, int]:
    """Segments of PARTITIONS partitions holding about `total_mb` MB; (records, bytes) written."""
    per_partition = total_mb * 1024 * 1024 // PARTITIONS
    shared = bytes(range(256)) * (VALUE_BYTES // 256 + 1)
    records = written = 0
    for partition in range(PARTITIONS):
        directory = folder / f"bench-{partition}"
        directory.mkdir(parents=True)
        offset, size, txn, segment, out = 0, 0, 0, None, None
        sequence = {}
        rng = random.Random(partition)
        while size < per_partition:
            if out is None or out.tell() >= SEGMENT_MB * 1024 * 1024:
                if out:
                    out.close()
                segment = directory / f"{offset:020d}.log"
                out = open(segment, "wb")
            producer = txn % 8
            seq = sequence.get(producer, 0)
            data = [_record(i, f"key-{txn}-{i}".encode(), _value(rng, shared), [("trace", f"{txn}".encode())])
                    for i in range(BATCH_RECORDS)]
            batch = _batch(offset, data, producer, seq, False, 1_700_000_000_000 + offset)
            sequence[producer] = seq + BATCH_RECORDS
            kind = 0 if txn % ABORT_EVERY == ABORT_EVERY - 1 else 1
            marker = _batch(offset + BATCH_RECORDS, [_record(0, struct.pack(">hh", 0, kind), struct.pack(">hi", 0, 0), [])],
                            producer, -1, True, 1_700_000_000_000 + offset)
            out.write(batch + marker)
            offset += BATCH_RECORDS + 1
            size += len(batch) + len(marker)
            records += BATCH_RECORDS + 1
            txn += 1
        out.close()
        written += size
    return records, written


def run(total_mb: int, workdir: Path) -> dict:
    from resources.spark import get_spark
    from txn_engine.core.schema import LEDGER_ENTRY_COLUMNS
    from txn_engine.core.settings import WarehouseSettings
    from txn_engine.log.kafka_import import import_kafka, parse_segments, resolve_segments
    from txn_engine.storage.warehouse import Warehouse

    print(f"== kafka import benchmark: {total_mb} MB, workdir {workdir}")
    log = workdir / "kafka-logs"
    with timed(f"write the log ({PARTITIONS} partitions, {SEGMENT_MB} MB segments)"):
        records, size = write_log(log, total_mb)
    mb = size / 1e6
    spark = get_spark()
    segments = resolve_segments(spark, [str(log)])
    paths = [s.path for s in segments]

    def read() -> None:
        assert spark.read.format("binaryFile").load(paths).selectExpr("sum(length(content))").first()[0] == size

    def floor(i: int) -> None:
        parsed = parse_segments(spark, segments)
        (parsed.select(*[c for c in LEDGER_ENTRY_COLUMNS if c in parsed.columns]).write
         .option("parquet.column.statistics.enabled", "false").option("parquet.enable.dictionary", "false")
         .option("parquet.page.write-checksum.enabled", "false").mode("overwrite").parquet(str(workdir / f"floor-{i}")))

    def import_into(i: int) -> None:
        summary = import_kafka(Warehouse(spark, WarehouseSettings(warehouse=str(workdir / f"wh-{i}"))), [str(log)]).ingest
        assert summary.rows_written == records, (summary.rows_written, records)

    def step(label: str, body) -> tuple[float, float]:
        os.sync()  # the log's (or a write's) dirty pages written back before, not during, what is timed
        cpu = jvm_cpu_seconds(spark)
        with timed(label) as t:
            body()
        return t.seconds, jvm_cpu_seconds(spark) - cpu

    # The session's first job pays the JVM's warm-up; the floor is a read without it.
    read()
    t_first, cpu_first = step("import 0: parse, validate, append (pays the warm-up)", lambda: import_into(0))
    reads, floors, imports = [], [], []
    for i in range(1, ROUNDS + 1):
        reads.append(step(f"binary read {i}: Spark reads every segment as bytes", read))
        floors.append(step(f"writer floor {i}: parsed records as plain Parquet", lambda: floor(i)))
        imports.append(step(f"import {i}: parse, validate, append to ledger_entries", lambda: import_into(i)))
    (t_read, cpu_read), (t_floor, cpu_floor), (t_import, cpu_import) = _median(reads), _median(floors), _median(imports)
    ratio = t_import / t_read
    figures = {
        "records": records, "megabytes": round(mb, 1),
        "binary_read_s": round(t_read, 2), "writer_floor_s": round(t_floor, 2), "import_s": round(t_import, 2),
        "first_import_s": round(t_first, 2), "first_import_cpu_s": round(cpu_first, 2),
        "import_records_per_s": round(records / t_import), "import_mb_per_s": round(mb / t_import, 1),
        "read_mb_per_s": round(mb / t_read, 1), "ratio": round(ratio, 2), "floor_ratio": round(t_floor / t_read, 2),
        "binary_read_cpu_s": round(cpu_read, 2), "writer_floor_cpu_s": round(cpu_floor, 2),
        "import_cpu_s": round(cpu_import, 2), "cpu_ratio": round(cpu_import / cpu_read, 2),
        # The read swings most (its arrays are whole segments): ratios of each step's fastest round too.
        "fastest_ratio": round(min(t for t, _ in imports) / min(t for t, _ in reads), 2),
        "fastest_floor_ratio": round(min(t for t, _ in floors) / min(t for t, _ in reads), 2),
        "load_average": os.getloadavg()[0],
        "jvm_peak_mib": round(jvm_peak_rss_mib(spark)),
    }
    print(f"  {records:,} records, {mb:,.0f} MB: import {figures['import_records_per_s']:,} records/s, "
          f"{figures['import_mb_per_s']} MB/s; binary read {figures['read_mb_per_s']} MB/s; "
          f"import / read = {ratio:.1f}x (target at most 2x); writer floor / read = {t_floor / t_read:.1f}x, "
          f"import / floor = {t_import / t_floor:.1f}x; fastest rounds: import / read = {figures['fastest_ratio']}x, "
          f"floor / read = {figures['fastest_floor_ratio']}x; JVM CPU: import {cpu_import:.1f} s, floor {cpu_floor:.1f} s, "
          f"read {cpu_read:.1f} s (medians of {ROUNDS}); first import {t_first:.1f} s, {cpu_first:.1f} s of CPU; "
          f"load average {os.getloadavg()[0]:.1f}")
    return figures


def _median(runs: list[tuple[float, float]]) -> tuple[float, float]:
    """The run of median wall time: (seconds, CPU seconds)."""
    return sorted(runs)[len(runs) // 2]


def run_benchmark(workdir: Path) -> dict:
    return run(int(os.environ.get("BENCH_KAFKA_MB", "1024")), workdir)
