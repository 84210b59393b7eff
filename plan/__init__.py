"""The layout planner: for a model and a cluster, which layouts fit and which is fastest (`python -m plan`).

predict.py: per-rank bytes held and sent, from the formulas beside the wrappers; cluster.py: GPU presets and
links; search.py: the layouts the trainer accepts (config.check_layout decides) and the step-time model.
"""
