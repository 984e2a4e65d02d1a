"""What reads the buffer's results: the filtered offload tier, retention, the read-committed
reader and consumer."""
