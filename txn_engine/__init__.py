"""txnlake's domain core: positions, transactions, the transaction buffer and the Spark jobs."""
