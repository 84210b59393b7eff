"""Sharded, atomic checkpoints (checkpoints/checkpoint.py) of a layout-independent view of each rank's state
(entries.py)."""
