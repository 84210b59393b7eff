"""Context parallelism: the zigzag split and the ring of k/v blocks."""
