# txnlake: `make run` and `make test` are all a fresh clone needs.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
export DAGSTER_HOME ?= $(CURDIR)/.dagster_home
export TXNLAKE_WAREHOUSE ?= $(CURDIR)/warehouse
DEMO_FILE := $(CURDIR)/data/demo-ledgers.jsonl
DEMO_ENTRIES ?= 20000

.PHONY: setup browser run test test-fast bench ui clean-warehouse

## setup: create .venv, install the project (pinned), fetch the jars once (Delta Lake, S3A, and the
## Kafka broker the tests start: tests/kafka_broker.py) and compile the S3 log store
## (resources/delta_jars.py; needs a JDK), then build the driver JVM's class archive once
## (resources/jvm_archive.py: a small quickstart run). Idempotent.
setup: $(INSTALLED)
	@$(PY) -m resources.delta_jars check >/dev/null 2>&1 || $(PY) -m resources.delta_jars fetch
	@$(PY) -m resources.kafka_jars check >/dev/null 2>&1 || $(PY) -m resources.kafka_jars fetch
	@$(PY) -m pipelines.jvm_archive

$(INSTALLED): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(INSTALLED)

$(DAGSTER_HOME)/dagster.yaml:
	@mkdir -p $(DAGSTER_HOME)
	@printf 'telemetry:\n  enabled: false\nconcurrency:\n  pools:\n    granularity: run\n    default_limit: 1\n' > $@

## run: generate and ingest a small demo log into an empty warehouse (plus a workload through the
## engine), derive every table, take the transaction-buffer snapshots and offload eligible ledgers:
## `txnlake quickstart`, every step its own named Dagster run, all in one process.
run: setup $(DAGSTER_HOME)/dagster.yaml
	$(VENV)/bin/txnlake quickstart --entries $(DEMO_ENTRIES) --file $(DEMO_FILE)
	@echo
	@echo "Tables (Delta) are under $(TXNLAKE_WAREHOUSE)/<table>."
	@echo "Open the UI:  make ui   (DAGSTER_HOME=$(DAGSTER_HOME) $(VENV)/bin/dagster dev -w workspace.yaml)"

## test: the whole suite on real Spark, Delta and Dagster, on TEST_WORKERS processes with a JVM
## each (one JVM leaves cores idle); a worker that runs out of tests takes half of the other's
## queue (worksteal). Evidence: docs/benchmarks.md, "The test suite". It lists its slowest tests,
## to keep an eye on the suite's time.
## `make test TEST_WORKERS=0` runs it in this process.
TEST_WORKERS ?= 2
test: setup browser
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=30

## browser: Debian's Chromium for the UI test in a headless browser (tests/test_webserver.py), once.
browser:
	@test -x /usr/bin/chromium || { echo "== installing Debian's chromium (the UI test's browser)"; \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
		else sudo apt-get install -y chromium; fi; }

## test-fast: the tests that need no JVM, server or subprocess (marked from their fixtures in
## tests/conftest.py; one that starts Spark anyway fails at once).
test-fast: setup
	TXNLAKE_TEST_TIER=fast $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not spark and not server and not subprocess and not slow"

## bench: benchmarks; figures go to stdout and docs/benchmarks.md records them.
bench: setup
	$(PY) -m benchmarks.run

## ui: the webserver and the daemon on DAGSTER_HOME; the transaction_buffer pool gets its limit row
## first (`pipelines.cli.ensure_pool_limits`: Dagster 1.13 makes it too late on a new home).
ui: setup $(DAGSTER_HOME)/dagster.yaml
	@$(PY) -c 'import pipelines.cli as c; c.prepare_instance()'
	@echo "(dagster dev warns that it is superseded by 'dg dev', from the dagster-dg package this project does not install: it works as it is)"
	$(VENV)/bin/dagster dev -w workspace.yaml

clean-warehouse:
	rm -rf $(TXNLAKE_WAREHOUSE) $(DAGSTER_HOME) data
