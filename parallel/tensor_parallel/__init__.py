"""Tensor parallelism: f and g (mappings.py), the parallel linears (layers.py), the model's plan (apply.py)."""
