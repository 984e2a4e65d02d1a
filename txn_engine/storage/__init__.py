"""Where tables live: Delta I/O (Spark and delta-rs), the warehouse and its settings, writer
locks and table upkeep (compaction, vacuum)."""
