"""The engine's delta-rs tables and Spark/Delta agree both ways; rollover shows in `ledgers`."""

from __future__ import annotations

from pyspark.sql import functions as F

from tests.rows import entry, write_jsonl
from txn_engine.buffer.spark_runner import compute_buffer_tables
from txn_engine.producers.engine import Engine
from txn_engine.log.ingest import ingest_files
from txn_engine.producers.ledger_writer import RolloverPolicy
from txn_engine.core.positions import Position
from txn_engine.log.ledgers import derive_ledger_catalog, recorded_ledger_states, recorded_states_table
from txn_engine.core.schema import CONSUMER_OFFSETS, LEDGER_ENTRIES, TXN_LOG


def test_engine_appends_to_a_spark_table_and_spark_reads_the_engine(warehouse, tmp_path):
    # Spark (ingest) creates ledger_entries; the engine appends; Spark derives the same view.
    ingested = [entry("orders", 40, 0, producer=900, seq=0), entry("orders", 40, 1, txn=(0, 5), producer=901, seq=0),
                entry("orders", 40, 2, "COMMIT", txn=(0, 5))]
    ingest_files(warehouse, [str(write_jsonl(tmp_path / "in.jsonl", ingested))])
    with Engine(warehouse) as engine:
        p = engine.producer("app")
        pid, _ = p.init_transactions()
        assert pid > 901  # above every producer id already stored
        txn = p.begin()
        assert txn.least_bits > 5  # above every transaction id already stored
        p.send("orders", b"engine-1")
        p.send_offsets("g", {"in": Position(3, 4)})
        assert engine.consumer("orders").read()[-1].payload == b"x"  # not decided yet: not read
        p.commit()
        engine.send("orders", b"engine-2").result()
        consumed = [(e.position, e.payload) for e in engine.consumer("orders").read()]
    stored = warehouse.read(LEDGER_ENTRIES)
    assert stored.count() == 6
    engine_ledgers = {r.ledger_id for r in stored.filter("ledger_id <> 40").select("ledger_id").collect()}
    assert engine_ledgers and min(engine_ledgers) > 40  # never collides with ingested ledgers
    spark_view = compute_buffer_tables(stored).committed_entries.filter("in_stable_prefix").orderBy("ledger_id", "entry_id")
    assert [(Position(r.ledger_id, r.entry_id), bytes(r.payload)) for r in spark_view.collect()] == consumed
    assert [p for _, p in consumed] == [b"x", b"x", b"engine-1", b"engine-2"]
    # The coordinator's tables, nested columns included, read in Spark SQL as well.
    log = warehouse.read(TXN_LOG).filter("state = 'PREPARE_COMMIT'").select("offsets", "topics").collect()
    assert [(o.group_id, o.topic, o.ledger_id, o.entry_id) for o in log[0].offsets] == [("g", "in", 3, 4)]
    assert log[0].topics == ["orders"]
    offsets = warehouse.read(CONSUMER_OFFSETS).collect()
    assert [(o.group_id, o.ledger_id, o.entry_id) for o in offsets] == [("g", 3, 4)]


def test_rollover_closes_ledgers_and_ledgers_shows_them(warehouse):
    with Engine(warehouse, rollover=RolloverPolicy(max_entries=2)) as engine:
        futures = [engine.send("t", f"m{i}") for i in range(5)]
        positions = [f.result() for f in futures]
    assert [p.entry_id for p in positions] == [0, 1, 0, 1, 0]
    ledger_ids = sorted({p.ledger_id for p in positions})
    assert len(ledger_ids) == 3
    catalog = derive_ledger_catalog(warehouse.read(LEDGER_ENTRIES), recorded_states_table(warehouse))
    states = {r.ledger_id: r.state for r in catalog.collect()}
    assert states == {ledger_ids[0]: "CLOSED", ledger_ids[1]: "CLOSED", ledger_ids[2]: "OPEN"}
    recorded = {r.ledger_id for r in recorded_ledger_states(warehouse).filter(F.col("state") == "CLOSED").collect()}
    assert recorded == set(ledger_ids[:2])
