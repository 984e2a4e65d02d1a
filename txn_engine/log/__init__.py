"""The ledger log: ingest of input files, the ledger catalog (`ledgers`), the demo log generator
and the Spark column predicates over ledger entries."""
