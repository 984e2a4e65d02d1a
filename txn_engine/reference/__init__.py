"""The pure-Python reference of the transaction buffer and its snapshots: the test oracle.
Production code never imports it."""
