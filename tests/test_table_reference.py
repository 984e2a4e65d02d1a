"""The table reference (docs/tables.md) and the descriptions it shows, from the one source: schema.TABLES."""

from __future__ import annotations

import os
from pathlib import Path

from txn_engine.core.schema import TABLES, Place, table_reference
from txn_engine.sql.models import discover_models

DOC = Path(__file__).resolve().parents[1] / "docs" / "tables.md"


def test_docs_tables_md_is_generated_from_the_schema_module():
    text = table_reference() + "\n"
    if os.environ.get("TXNLAKE_UPDATE_TABLES_DOC"):
        DOC.write_text(text)
    assert DOC.read_text() == text, "docs/tables.md drifted: regenerate it with TXNLAKE_UPDATE_TABLES_DOC=1"


def test_every_column_of_every_table_is_described():
    undescribed = {name: [f.name for f in spec.schema.fields if not f.metadata.get("comment")]
                   for name, spec in TABLES.items()}
    assert not {k: v for k, v in undescribed.items() if v}


def test_every_shipped_sql_model_is_a_named_public_table():
    for model in discover_models():
        assert model.name in TABLES and TABLES[model.name].place == Place.PUBLIC, model.name
        assert (TABLES[model.name].kind == "view") == model.view


def test_public_tables_with_a_transaction_carry_the_readable_txn_id_next_to_its_halves():
    for name, spec in TABLES.items():
        names = spec.schema.fieldNames()
        if spec.place == Place.INTERNAL or "txn_most_bits" not in names:
            continue
        at = names.index("txn_least_bits")
        assert names[at - 1: at + 2] == ["txn_most_bits", "txn_least_bits", "txn_id"], name


def test_readme_links_the_table_reference():
    assert "docs/tables.md" in (DOC.parents[1] / "README.md").read_text()
