"""Multi-part transaction-buffer snapshots: the persisted format (`format`), the index rules
(`index`), taking snapshots (`jobs`) and recovery from them (`recovery`)."""
