"""Writing transactionally: the engine, producers, the transaction coordinator, the ledger
writer, the operator's transaction admin and the demo workload."""
