"""txnlake's domain core, in layers; a module imports only from its own layer or lower ones.

core < storage < log < buffer < snapshots < tier < producers < sql. `reference` (the pure-Python
oracle of the buffer and its snapshots) depends on `core` alone and is imported only by tests and
benchmarks. docs/architecture.md says what each layer owns.
"""
