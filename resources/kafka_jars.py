"""The jars of a Kafka broker (`kafka_2.13` and its runtime dependencies), for the tests that
start a real KRaft broker on loopback (`tests/kafka_broker.py`), and of the segment reader that
`txnlake import-kafka` runs on Spark (`resources/java/io/txnlake/kafka`: Kafka's own record
classes from `kafka-clients`, whose codecs' libraries Spark ships).

Like Delta's (`resources.delta_jars`): `python -m resources.kafka_jars fetch` (what `make setup`
runs) downloads them once from Maven Central into `<jar cache>/kafka-<version>/`, each checked
against its SHA-1; it also compiles the segment reader. Sessions and the tests only check the cache and name
`make setup` when something is missing.
The list is `kafka_2.13`'s runtime closure as Maven resolves it, pinned here so that no resolver
runs at setup.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pyspark

from resources.delta_jars import compile_jar, fetch_jars, jar_cache_dir, jar_cli, jar_name, require_jars, source_jar_path
from txn_engine.core.errors import KafkaJarsMissingError

KAFKA_VERSION = "4.1.1"
KAFKA_ARTIFACTS = (
    ("com.dynatrace.hash4j", "hash4j", "0.22.0"),
    ("com.fasterxml.jackson.core", "jackson-annotations", "2.19.0"),
    ("com.fasterxml.jackson.core", "jackson-core", "2.19.0"),
    ("com.fasterxml.jackson.core", "jackson-databind", "2.19.0"),
    ("com.fasterxml.jackson.dataformat", "jackson-dataformat-csv", "2.19.0"),
    ("com.fasterxml.jackson.dataformat", "jackson-dataformat-yaml", "2.19.0"),
    ("com.fasterxml.jackson.datatype", "jackson-datatype-jdk8", "2.19.0"),
    ("com.github.ben-manes.caffeine", "caffeine", "3.2.0"),
    ("com.github.luben", "zstd-jni", "1.5.6-10"),
    ("com.google.re2j", "re2j", "1.8"),
    ("com.typesafe.scala-logging", "scala-logging_2.13", "3.9.5"),
    ("com.yammer.metrics", "metrics-core", "2.2.0"),
    ("commons-beanutils", "commons-beanutils", "1.9.4"),
    ("commons-collections", "commons-collections", "3.2.2"),
    ("commons-digester", "commons-digester", "2.1"),
    ("commons-logging", "commons-logging", "1.3.2"),
    ("commons-validator", "commons-validator", "1.9.0"),
    ("net.sf.jopt-simple", "jopt-simple", "5.0.4"),
    ("net.sourceforge.argparse4j", "argparse4j", "0.7.0"),
    ("org.apache.kafka", "kafka-clients", "4.1.1"),
    ("org.apache.kafka", "kafka-coordinator-common", "4.1.1"),
    ("org.apache.kafka", "kafka-group-coordinator-api", "4.1.1"),
    ("org.apache.kafka", "kafka-group-coordinator", "4.1.1"),
    ("org.apache.kafka", "kafka-metadata", "4.1.1"),
    ("org.apache.kafka", "kafka-raft", "4.1.1"),
    ("org.apache.kafka", "kafka-server-common", "4.1.1"),
    ("org.apache.kafka", "kafka-server", "4.1.1"),
    ("org.apache.kafka", "kafka-share-coordinator", "4.1.1"),
    ("org.apache.kafka", "kafka-storage-api", "4.1.1"),
    ("org.apache.kafka", "kafka-storage", "4.1.1"),
    ("org.apache.kafka", "kafka-tools-api", "4.1.1"),
    ("org.apache.kafka", "kafka-transaction-coordinator", "4.1.1"),
    ("org.apache.kafka", "kafka_2.13", "4.1.1"),
    ("org.apache.logging.log4j", "log4j-api", "2.24.3"),
    ("org.apache.logging.log4j", "log4j-core", "2.24.3"),
    ("org.bitbucket.b_c", "jose4j", "0.9.6"),
    ("org.hdrhistogram", "HdrHistogram", "2.2.2"),
    ("org.jspecify", "jspecify", "1.0.0"),
    ("org.lz4", "lz4-java", "1.8.0"),
    ("org.pcollections", "pcollections", "4.0.2"),
    ("org.scala-lang", "scala-library", "2.13.16"),
    ("org.scala-lang", "scala-reflect", "2.13.16"),
    ("org.slf4j", "slf4j-api", "1.7.36"),
    ("org.xerial.snappy", "snappy-java", "1.1.10.7"),
    ("org.yaml", "snakeyaml", "2.4"),
)


def kafka_jar_dir() -> Path:
    return jar_cache_dir() / f"kafka-{KAFKA_VERSION}"


# txnlake's classes that run on Spark: the segment reader, and the grouped count its import observes while it writes.
JVM_SOURCES = [Path(__file__).parent / "java" / "io" / "txnlake" / "kafka" / "SegmentReader.java",
               Path(__file__).parent / "java" / "io" / "txnlake" / "spark" / "Tally.java"]


def kafka_clients_jar() -> Path:
    return kafka_jar_dir() / jar_name("kafka-clients", KAFKA_VERSION)


def segment_reader_jar_path() -> Path:
    return source_jar_path("txnlake-spark", JVM_SOURCES)


def require_segment_reader_jars() -> list[Path]:
    """`kafka-clients` and the compiled segment reader, for every session's `spark.jars`;
    KafkaJarsMissingError naming `make setup` if either is missing."""
    return require_jars([kafka_clients_jar(), segment_reader_jar_path()], "The Kafka segment reader's jars",
                        KafkaJarsMissingError)


def cached_segment_reader_jars() -> list[Path]:
    """The segment reader's jars when both are cached, else none (`require_segment_reader_jars` says what to do)."""
    try:
        return require_segment_reader_jars()
    except KafkaJarsMissingError:
        return []


def build_segment_reader() -> Path:
    """Compile the segment reader against pyspark's jars and `kafka-clients`; idempotent."""
    classpath = [*sorted((Path(pyspark.__file__).parent / "jars").glob("*.jar")), kafka_clients_jar()]
    return compile_jar(JVM_SOURCES, classpath, segment_reader_jar_path(), KafkaJarsMissingError)


def require_kafka_jars() -> list[Path]:
    """The cached jars (a broker's classpath); KafkaJarsMissingError naming `make setup` if any is missing."""
    paths = [kafka_jar_dir() / jar_name(a, v) for _, a, v in KAFKA_ARTIFACTS]
    return require_jars(paths, f"Kafka {KAFKA_VERSION} jars", KafkaJarsMissingError)


def fetch_kafka_jars() -> list[Path]:
    fetch_jars(KAFKA_ARTIFACTS, kafka_jar_dir(), KafkaJarsMissingError)
    build_segment_reader()
    return require_kafka_jars() + require_segment_reader_jars()[1:]


def main(argv: list[str] | None = None) -> int:
    return jar_cli(argv, fetch_kafka_jars, lambda: require_kafka_jars() + require_segment_reader_jars()[1:],
                   KafkaJarsMissingError)


if __name__ == "__main__":
    sys.exit(main())
