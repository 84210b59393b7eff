"""A layout's ranks simulated on fake tensors, above train.py: `python -m sim.fake_rank` plays one rank of an
N-rank job, `python -m sim.verify` many, against the planner's prediction."""
