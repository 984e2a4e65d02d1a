"""The brief's words as code: positions, the table schemas, settings, errors and the shared
log types. Depends on nothing else in txn_engine."""
