"""Context parallelism: the zigzag split and the ring of k/v blocks (ring.py), or Ulysses's all-to-alls (ulysses.py)."""
