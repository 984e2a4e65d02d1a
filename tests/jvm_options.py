"""JVM options of the JVMs the tests start in other processes: spark-submit's drivers (CLI runs,
racing writers; `SPARK_SUBMIT_OPTS`, tests/conftest.py), the standalone cluster's daemons and
executors (tests/spark_standalone.py) and the Kafka broker (tests/kafka_broker.py)."""

# They live for seconds to a minute, often several at once, where the JIT's optimizing tier costs
# CPU the suite lacks: its first tier only (docs/benchmarks.md, "The test suite").
SUBPROCESS_JVM_OPTIONS = "-XX:TieredStopAtLevel=1"
