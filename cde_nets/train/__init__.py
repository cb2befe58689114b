"""Training: the loop, its atomic snapshots and its progress lines."""
