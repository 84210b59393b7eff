"""The parallel-layouts benchmark: `python -m bench` (see bench/__main__.py and docs/benchmarks.md)."""
