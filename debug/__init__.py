"""Tools for distributed runs: `python -m debug hang OUT_DIR` reads the ranks' flight-recorder dumps after a
hang; `python -m debug diff RUN_A RUN_B` finds the first tensor where two runs' `--trace_step` traces part."""
