"""A real Kafka log to import: a single-node KRaft broker on loopback (from the jars `make setup`
caches, `resources.kafka_jars`), a transactional workload written by a real client
(confluent-kafka, i.e. librdkafka), and the broker's own truth read back.

`kafka_log(folder)` does it all once per test run (the first xdist worker to ask writes it under
a file lock, the others reuse it): starts the broker, writes the workload, reads the truth (a
`read_committed` consumer to the end of every partition, the last stable offsets and high
watermarks by ListOffsets), stops the broker, and returns the log directory with the truth.
"""

from __future__ import annotations

import base64
import fcntl
import logging
import pickle
import signal
import socket
import subprocess
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from resources.kafka_jars import require_kafka_jars
from tests.jvm_options import SUBPROCESS_JVM_OPTIONS

# Small segments, so that one test's workload spans several segments per partition. Kafka 4
# refuses `segment.bytes` under 1 MiB; this internal topic setting is the way for tests.
SEGMENT_BYTES = 4096
TOPIC = "orders"  # 2 partitions: the transactional workload
PLAIN = "plain"  # 1 partition, LogAppendTime: plain sends without a producer id
COMPACTED = "compacted"  # 1 partition, cleanup.policy=compact, cleaned before the truth is read
CLEAN_TIMEOUT_S = 30
STABLE_TIMEOUT_S = 30
START_TIMEOUT_S = 60
# librdkafka's own log (the clients reconnecting while the broker stops, expected aborts) goes to
# Python logging, which pytest captures, not to stderr.
CLIENT_LOG = logging.getLogger("tests.kafka_client")
# A transaction the coordinator aborts: its timeout, and how often the coordinator looks.
SHORT_TXN_TIMEOUT_MS = 1000
TXN_ABORT_SCAN_MS = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Broker:
    bootstrap: str
    log_dir: Path
    process: subprocess.Popen
    out: Path

    def stop(self) -> None:
        """A clean shutdown (bounded), else killed: the segments are complete either way."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def random_cluster_id() -> str:
    """A KRaft cluster id as Kafka's `Uuid.randomUuid` makes them: URL-safe base64 of 16 random
    bytes, never starting with "-" (StorageTool would read `-t -abc...` as another option)."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


@contextmanager
def running_broker(root: Path) -> Iterator[Broker]:
    root.mkdir(parents=True, exist_ok=True)
    port, controller = free_port(), free_port()
    log_dir = root / "kafka-logs"
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{controller}",
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(log_dir),
        # One broker: internal topics of one replica and one partition, no rebalance delay.
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "1",
        "group.initial.rebalance.delay.ms": "0",
        "transaction.abort.timed.out.transaction.cleanup.interval.ms": str(TXN_ABORT_SCAN_MS),
        "auto.create.topics.enable": "false",
        # The log cleaner looks for work often, so the compacted topic is cleaned within the test.
        "log.cleaner.backoff.ms": "200",
    }
    config = root / "server.properties"
    config.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
    classpath = ":".join(str(p) for p in require_kafka_jars())
    # A small heap and the client JIT: the broker shares 2 cores with Spark.
    java = ["java", "-Xmx384m", "-XX:+UseSerialGC", SUBPROCESS_JVM_OPTIONS, "-cp", classpath]
    cluster_id = random_cluster_id()
    out = root / "broker.log"
    subprocess.run(java + ["kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(config)],
                   check=True, capture_output=True, timeout=60)
    with open(out, "wb") as sink:
        process = subprocess.Popen(java + ["kafka.Kafka", str(config)], stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    broker = Broker(f"127.0.0.1:{port}", log_dir, process, out)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the Kafka broker exited with {process.returncode}: {out.read_text()[-3000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the Kafka broker did not listen within {START_TIMEOUT_S}s: {out.read_text()[-3000:]}")
                time.sleep(0.2)
        yield broker
    finally:
        broker.stop()


HEADERS = [("bin", b"\x00\xff\x80"), ("empty", b""), ("none", None), ("bin", b"again")]
KEYS = [None, b"", b"\xff\xfe not utf-8", "k\u00e9y".encode()]
VALUES = [b"", None, bytes(range(256)), "v\u00e4lue".encode() * 10]


def write_workload(bootstrap: str) -> list:
    """Transactional producers over the partitions, every codec, commits and aborts, transactions
    over several segments, a fenced zombie, a transaction the coordinator aborts on timeout,
    idempotent and plain sends, binary and empty keys, values and headers, and one transaction
    left open. Returns the clients to keep alive until the truth is read (the open transaction)."""
    from confluent_kafka import KafkaException, Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap, "logger": CLIENT_LOG})
    small = {"internal.segment.bytes": str(SEGMENT_BYTES)}
    topics = [NewTopic(TOPIC, 2, 1, config=small),
              NewTopic(PLAIN, 1, 1, config={**small, "message.timestamp.type": "LogAppendTime"}),
              NewTopic(COMPACTED, 1, 1, config={**small, "cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.01",
                                                "segment.ms": "100"})]
    for future in admin.create_topics(topics).values():
        future.result(30)

    def transactional(tid: str, codec: str = "none", **extra) -> Producer:
        producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": tid, "compression.type": codec,
                             "linger.ms": 5, "logger": CLIENT_LOG, **extra})
        producer.init_transactions(30)
        return producer

    producers = [transactional(f"tx-{codec}", codec) for codec in ("gzip", "snappy", "lz4", "zstd")]
    for i in range(4):
        for n, p in enumerate(producers):
            p.begin_transaction()
            for j in range(5):
                p.produce(TOPIC, partition=(i + j) % 2, key=KEYS[j % 4], value=VALUES[(i + j + n) % 4],
                          headers=HEADERS if j % 2 else None, timestamp=1_700_000_000_000 + j)
            if (i + n) % 3 == 0:
                p.flush(30)  # else the abort only drops the client's queue: nothing reaches the log
                p.abort_transaction(30)
            else:
                p.commit_transaction(30)
    # Transactions over several segments (a batch at a time), one committed and one aborted.
    for p, commit in ((producers[1], True), (producers[2], False)):
        p.begin_transaction()
        for j in range(8):
            p.produce(TOPIC, partition=0, key=f"big{j}".encode(), value=bytes([j]) * 900)
            p.flush(30)
        p.commit_transaction(30) if commit else p.abort_transaction(30)
    # A zombie: the same transactional id started again fences the first instance, aborts its
    # transaction and restarts the sequence at 0 under a new epoch.
    zombie = transactional("tx-zombie")
    zombie.begin_transaction()
    for j in range(3):
        zombie.produce(TOPIC, partition=j % 2, key=b"z", value=f"zombie{j}".encode())
    zombie.flush(30)
    successor = transactional("tx-zombie")
    successor.begin_transaction()
    for j in range(3):
        successor.produce(TOPIC, partition=j % 2, key=b"z", value=f"successor{j}".encode())
    successor.commit_transaction(30)
    try:
        zombie.commit_transaction(10)
        raise AssertionError("the fenced zombie committed")
    except KafkaException as exc:
        assert exc.args[0].fatal(), exc
    # A transaction the coordinator aborts when it times out; the id starts again, epoch bumped.
    slow = transactional("tx-slow", **{"transaction.timeout.ms": SHORT_TXN_TIMEOUT_MS})
    slow.begin_transaction()
    for j in range(4):
        slow.produce(TOPIC, partition=j % 2, value=f"timed-out{j}".encode())
    slow.flush(30)
    wait_until_stable(admin, TOPIC, range(2))  # the coordinator's abort markers are written
    try:
        slow.commit_transaction(10)
        raise AssertionError("a timed-out transaction committed")
    except KafkaException as exc:
        assert exc.args[0].fatal(), exc
    again = transactional("tx-slow")
    again.begin_transaction()
    for j in range(4):
        again.produce(TOPIC, partition=j % 2, value=f"after-timeout{j}".encode())
    again.commit_transaction(30)
    # Idempotent (a producer id, no transaction) and plain sends (no producer id).
    idempotent = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "compression.type": "snappy",
                           "linger.ms": 5, "logger": CLIENT_LOG})
    plain = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": False, "acks": 1,
                      "compression.type": "gzip", "linger.ms": 5, "logger": CLIENT_LOG})
    for j in range(12):
        idempotent.produce(TOPIC, partition=j % 2, key=KEYS[j % 4], value=f"idempotent{j}".encode(),
                           headers=[("k", b"")] if j % 2 else None)
        plain.produce(PLAIN, key=b"\x00" * (j % 3), value=None if j % 5 == 0 else f"plain{j}".encode())
    idempotent.flush(30)
    plain.flush(30)
    # A compacted topic: keys written over and over, a transaction committed and one aborted.
    for j in range(60):  # a batch per 10 records, each in a segment of its own (segment.ms)
        plain.produce(COMPACTED, key=f"c{j % 6}".encode(), value=f"v{j}".encode() * 20)
        if j % 10 == 9:
            plain.flush(30)
            time.sleep(0.12)
    for p, commit in ((producers[3], True), (producers[0], False)):
        p.begin_transaction()
        for j in range(3):
            p.produce(COMPACTED, key=f"c{j}".encode(), value=f"txn{j}".encode() * 20)
        p.flush(30)
        p.commit_transaction(30) if commit else p.abort_transaction(30)
        time.sleep(0.12)
    for j in range(60, 90):
        plain.produce(COMPACTED, key=f"c{j % 6}".encode(), value=f"v{j}".encode() * 20)
        if j % 10 == 9:
            plain.flush(30)
            time.sleep(0.12)
    # One transaction left open over several segments of partition 1, with committed data after
    # it: above the last stable offset, below the high watermark.
    left_open = transactional("tx-open", **{"transaction.timeout.ms": 600_000})
    left_open.begin_transaction()
    for j in range(5):
        left_open.produce(TOPIC, partition=1, value=b"open" * 300)
        left_open.flush(30)
        idempotent.produce(TOPIC, partition=1, value=f"after-open{j}".encode())
        idempotent.flush(30)
    producers[0].begin_transaction()
    for partition in (0, 1):
        producers[0].produce(TOPIC, partition=partition, value=b"late")
    producers[0].commit_transaction(30)
    return [left_open, *producers, idempotent, plain]


@dataclass
class Truth:
    """What the broker says: per partition (`<topic>-<partition>`)."""

    last_stable_offsets: dict[str, int] = field(default_factory=dict)
    high_watermarks: dict[str, int] = field(default_factory=dict)
    # (offset, key, value, headers as a list of (name, value)), timestamp type, timestamp ms)
    records: dict[str, list[tuple]] = field(default_factory=dict)


def wait_until_stable(admin, topic: str, partitions: Iterable[int]) -> None:
    """Until no transaction is open on the topic's partitions (last stable offset = high watermark).
    A commit returns before the coordinator writes its markers, so the truth waits for them too."""
    from confluent_kafka import IsolationLevel, TopicPartition
    from confluent_kafka.admin import OffsetSpec

    latest = {TopicPartition(topic, p): OffsetSpec.latest() for p in partitions}
    deadline = time.monotonic() + STABLE_TIMEOUT_S
    while time.monotonic() < deadline:
        offsets = [{tp: f.result(30).offset for tp, f in admin.list_offsets(latest, isolation_level=level).items()}
                   for level in (IsolationLevel.READ_COMMITTED, IsolationLevel.READ_UNCOMMITTED)]
        if offsets[0] == offsets[1]:
            return
        time.sleep(0.2)
    raise RuntimeError(f"a transaction on {topic} was still open after {STABLE_TIMEOUT_S}s")


def wait_until_cleaned(log_dir: Path, topic: str) -> None:
    """Until the log cleaner has cleaned `topic`'s partition 0 up to its active segment, the part it
    never cleans (its checkpoint says so): nothing is left for it, so the files do not change after
    the truth is read (a cleaning pass between the two once removed records the truth holds)."""
    checkpoint = log_dir / "cleaner-offset-checkpoint"
    partition = log_dir / f"{topic}-0"
    deadline = time.monotonic() + CLEAN_TIMEOUT_S
    while time.monotonic() < deadline:
        lines = checkpoint.read_text().splitlines()[2:] if checkpoint.is_file() else []
        active = max((int(segment.stem) for segment in partition.glob("*.log")), default=0)
        if any(line.split()[:2] == [topic, "0"] and int(line.split()[2]) >= max(active, 1) for line in lines):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the log cleaner did not clean {topic}-0 up to its active segment within {CLEAN_TIMEOUT_S}s")


def read_truth(bootstrap: str, topics: dict[str, int], settled: dict[str, list[int]]) -> Truth:
    from confluent_kafka import Consumer, IsolationLevel, KafkaError, KafkaException, TopicPartition
    from confluent_kafka.admin import AdminClient, OffsetSpec

    admin = AdminClient({"bootstrap.servers": bootstrap, "logger": CLIENT_LOG})
    for topic, numbers in settled.items():
        wait_until_stable(admin, topic, numbers)
    partitions = [TopicPartition(t, p) for t, n in topics.items() for p in range(n)]
    truth = Truth()
    latest = {tp: OffsetSpec.latest() for tp in partitions}
    for isolation, into in ((IsolationLevel.READ_COMMITTED, truth.last_stable_offsets),
                            (IsolationLevel.READ_UNCOMMITTED, truth.high_watermarks)):
        for tp, future in admin.list_offsets(latest, isolation_level=isolation).items():
            into[f"{tp.topic}-{tp.partition}"] = future.result(30).offset
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "truth", "isolation.level": "read_committed",
                         "enable.auto.commit": False, "enable.partition.eof": True, "logger": CLIENT_LOG})
    consumer.assign([TopicPartition(tp.topic, tp.partition, 0) for tp in partitions])
    done: set[str] = set()
    deadline = time.monotonic() + 30
    try:
        while len(done) < len(partitions):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the read_committed consumer did not reach the end of {len(partitions) - len(done)} partition(s)")
            message = consumer.poll(0.5)
            if message is None:
                continue
            name = f"{message.topic()}-{message.partition()}"
            if message.error():
                if message.error().code() == KafkaError._PARTITION_EOF:
                    done.add(name)
                    continue
                raise KafkaException(message.error())
            ts_type, ts = message.timestamp()
            truth.records.setdefault(name, []).append(
                (message.offset(), message.key(), message.value(), list(message.headers() or []), ts_type, ts))
    finally:
        consumer.close()
    return truth


@dataclass
class KafkaLog:
    log_dir: Path  # the broker's log.dirs: `<topic>-<partition>` folders
    truth: Truth


def kafka_log(shared: Path) -> KafkaLog:
    """The workload's log and truth, made once under `shared` (a folder the test processes share)."""
    shared.mkdir(parents=True, exist_ok=True)
    done = shared / "truth.pickle"
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            with running_broker(shared / "broker") as broker:
                alive = write_workload(broker.bootstrap)  # the open transaction's client included
                wait_until_cleaned(broker.log_dir, COMPACTED)
                # orders-1 holds the open transaction; every other partition settles first.
                truth = read_truth(broker.bootstrap, {TOPIC: 2, PLAIN: 1, COMPACTED: 1},
                                   settled={TOPIC: [0], PLAIN: [0], COMPACTED: [0]})
                broker.stop()  # before the clients go: the open transaction stays open
                alive.clear()
            done.write_bytes(pickle.dumps(truth))
    return KafkaLog(shared / "broker" / "kafka-logs", pickle.loads(done.read_bytes()))
