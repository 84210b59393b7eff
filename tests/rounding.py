"""The yardstick for "float rounding" in whole-run tests, as tests/test_tp.py measures it for its models: how far
the one-process float32 run of train.py is from the same run in float64.

Two float32 runs of the same math summed in different orders (TP splits matmul reductions across ranks) are
each about one yardstick from the exact result, so they differ by up to about two; `rounding_rtol` allows
ROUNDING_FACTOR = 4, a 2x margin (tests/test_tp.py's rule). The float64 run is train.py's own code (build,
train_step, evaluate) in this process, with the model converted to float64 after init (the same initial
values): one process, no autocast, the same batches.
"""

from __future__ import annotations

import functools
import os
import tempfile
from unittest import mock

import torch

from runtime.launch import child_env
from tests.harness import WholeRuns, evals_of, steps_of

ROUNDING_FACTOR = 4
EPS32 = torch.finfo(torch.float32).eps


def float64_run(args: list[str]) -> tuple[dict[int, dict], dict[int, float]]:
    """train.py `args` (one process, on the CPU) trained in float64 in this process, writing nothing: step ->
    train_step's record, and step -> val_loss at the evaluations train.run makes."""
    import train
    from trainer import config

    with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(os.environ, clear=True):
        os.environ.update(child_env())  # one rank, whatever launched this process
        spec = config.validate(config.parse_args([*args, "--out_dir", os.path.join(tmp, "out"), "--device", "cpu"]))
        assert spec.dims.world_size == 1 and spec.dtype == torch.float32, "a one-process float32 run"
        trainer = train.build(spec)
        # the same Parameters (AdamW holds them), now float64; its state starts at the first step
        trainer.model.double()
        a = spec.args
        steps, evals = {}, {0: train.evaluate(trainer)}
        for s in range(1, a.max_steps + 1):
            steps[s] = train.train_step(trainer, s)
            if s % a.eval_interval == 0 or s == a.max_steps:
                evals[s] = train.evaluate(trainer)
    return steps, evals


def rounding_rtol_of(runs: WholeRuns, name: str) -> float:
    """rounding_rtol of the finished one-process run `name` of `runs`, measured once per session."""
    return rounding_rtol(tuple(runs.argv[name]), runs[name])


@functools.cache
def rounding_rtol(args: tuple[str, ...], out_dir: str) -> float:
    """ROUNDING_FACTOR x the largest relative distance, over every step's loss and grad_norm and every val_loss,
    of the float32 one-process run in `out_dir` (train.py `args`) from the same run in float64 (at least EPS32)."""
    steps, evals = float64_run(list(args))
    got, got_evals = steps_of(out_dir), evals_of(out_dir)
    assert sorted(got) == sorted(steps) and sorted(got_evals) == sorted(evals), out_dir
    rel = [abs(got[s][k] - steps[s][k]) / abs(steps[s][k]) for s in steps for k in ("loss", "grad_norm")]
    rel += [abs(got_evals[s] - evals[s]) / abs(evals[s]) for s in evals]
    return ROUNDING_FACTOR * max(max(rel), EPS32)
