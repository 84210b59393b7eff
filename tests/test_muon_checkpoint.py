"""Muon's checkpoints (issue #46 item 6): the momentum of each Block matrix saves as a checkpoint entry in whatever
sharding the layout gives it (AdamW keeps its two moments and step count on the rest), a checkpoint saved in one
layout loads into any other, and the run continues bit for bit as the uninterrupted one; a resume with the other
optimizer is refused in one line.

Across layouts (in process, as tests/test_muon.py's layout tests): layout A steps SAVED steps and saves; a fresh
layout B loads that checkpoint and steps to STEPS; B's parameters must equal one process's uninterrupted STEPS
steps bit for bit. Each rank's gradients are its part of one process's (tests/test_muon.py's seeded draws), so
everything after them is bit-equal by construction: Muon's update and AdamW's are elementwise on each piece and NS
runs on the whole matrix. A lost or zeroed momentum (or AdamW moment, or step count) changes step SAVED + 1's
update, so the bits differ.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

from checkpoints import checkpoint
from checkpoints.entries import entries
from tests.test_muon import ADAMW, CFG, MOE, MUON, STEPS, args, differing, grads, model, one_process_run, set_grads

SAVED = 2  # steps before the checkpoint; STEPS - SAVED after it

# name -> (ranks, dims, dp_type, MoE)
LAYOUTS = {
    "single": (1, {}, None, False),
    "single_moe": (1, {}, None, True),
    "ddp2": (2, {"dp": 2}, "ddp", False),
    "zero2x2": (2, {"dp": 2}, "zero2", False),
    "fsdp2": (2, {"dp": 2}, "fsdp", False),
    "tp2": (2, {"tp": 2}, None, False),
    "pp2": (2, {"pp": 2}, None, False),
    "ep2_zero2": (2, {"dp": 2, "ep": 2}, "zero2", True),
    "ep2_ddp2": (2, {"dp": 2, "ep": 2}, "ddp", True),
}


def phase(rank: int, world: int, dims: dict, dp_type: str | None, moe: bool, path: str, save: bool) -> dict:
    """Save: steps 0..SAVED-1 from the model's init, then a checkpoint of step SAVED under `path`'s out_dir.
    Load: the checkpoint at `path` into a fresh layout (initialised with another seed, so nothing is inherited),
    then steps SAVED..STEPS-1; returns the names whose bits differ from one process's STEPS steps."""
    from optim.build import make_optimizer
    from parallel.mesh import ParallelDims, init_distributed
    from parallel.parallelize import ParallelConfig, parallelize

    cfg = MOE if moe else CFG
    mesh = init_distributed(ParallelDims(**{"dp": 1, "tp": 1, **dims}, world_size=world), torch.device("cpu"))
    ref = model(cfg)
    start = ref if save else _reinit(ref)
    parallelized = parallelize(
        copy.deepcopy(start), mesh, ParallelConfig(dp_type=dp_type, implementation="custom"), torch.device("cpu")
    )
    opt = make_optimizer(parallelized, args(lr=ADAMW["lr"], muon_lr=MUON["lr"]), **ADAMW)
    if not save:
        checkpoint.load(
            path, entries(parallelized, opt), parallelized.checkpoint_optimizer(opt), rank=rank, world_size=world
        )
    for step in range(0, SAVED) if save else range(SAVED, STEPS):
        set_grads(parallelized, grads(ref, step))
        opt.step()
        opt.zero_grad()
        parallelized.after_optimizer_step()
    if save:
        checkpoint.save(
            path,
            SAVED,
            entries(parallelized, opt),
            parallelized.checkpoint_optimizer(opt),
            {"layout": {"world_size": world}},
            rank=rank,
            world_size=world,
            keep=1,
        )
        return {}
    return {"differ": differing(parallelized, one_process_run(cfg))}


def _reinit(m):
    m = copy.deepcopy(m)
    m.init_weights(8)
    return m


def saved_by(name: str, tmp: str) -> str:
    """The step-SAVED checkpoint of layout `name` (one per test session)."""
    from tests.harness import run_distributed

    out = os.path.join(tmp, name)
    if not os.path.isdir(checkpoint.step_dir(out, SAVED)):
        world, dims, dp_type, moe = LAYOUTS[name]
        run_distributed(phase, world, dims, dp_type, moe, out, True)
    return checkpoint.step_dir(out, SAVED)


PAIRS = [
    ("single", "zero2x2"),
    ("single", "fsdp2"),
    ("tp2", "ddp2"),
    ("fsdp2", "tp2"),
    ("pp2", "single"),
    ("zero2x2", "pp2"),
    ("single_moe", "ep2_zero2"),
    ("ep2_zero2", "ep2_ddp2"),
]


@pytest.mark.parametrize(
    "source,target",
    [p if p == PAIRS[0] else pytest.param(*p, marks=pytest.mark.slow) for p in PAIRS],
    ids=[f"{a}->{b}" for a, b in PAIRS],
)
def test_resume_in_another_layout_continues_bit_for_bit(source, target, tmp_path_factory):
    from tests.harness import run_distributed

    path = saved_by(source, str(tmp_path_factory.getbasetemp() / "muon-ckpt"))
    world, dims, dp_type, moe = LAYOUTS[target]
    assert LAYOUTS[source][3] == moe
    ranks = run_distributed(phase, world, dims, dp_type, moe, path, False)
    differ = {r: x["differ"] for r, x in enumerate(ranks) if x["differ"]}
    assert not differ, f"{source} -> {target}: differ from one process's uninterrupted run: {differ}"


# ----------------------------------------------------------------------------- train.py: resume, and the refusal

RUN = [
    "--model",
    "tiny",
    "--micro_batch_size",
    "2",
    "--seq_len",
    "64",
    "--total_batch_size",
    "256",
    "--max_steps",
    "6",
    "--eval_interval",
    "3",
    "--eval_iters",
    "2",
    "--warmup_steps",
    "2",
    "--lr",
    "3e-3",
    "--gradient_clipping",
    "--peak_flops",
    "1e12",
    "--checkpoint_interval",
    "3",
    "--keep_checkpoints",
    "2",
]
MUON_RUN = [*RUN, "--optimizer", "muon"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The stand-in corpus, and train.py's uninterrupted 6-step one-process runs with each optimizer (checkpoints at
    steps 3 and 6)."""
    from tests.harness import forked, make_token_bins

    tmp = tmp_path_factory.mktemp("muon-runs")
    data = make_token_bins(str(tmp / "data"))
    out = {"tmp": tmp, "data": data}
    for name, flags in (("muon", MUON_RUN), ("adamw", RUN)):
        out[name] = str(tmp / name)
        proc = forked([*flags, "--dataset", data, "--out_dir", out[name]], 1)
        assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.parametrize("saved,resumed", [("muon", "adamw"), ("adamw", "muon")])
def test_resume_with_the_other_optimizer_is_refused_on_every_rank(runs, saved, resumed):
    """One line `train.py: error: --resume: ...`, exit 2 on both ranks, before any work (nothing logged)."""
    import shutil

    from tests.harness import forked

    out = str(runs["tmp"] / f"{saved}-as-{resumed}")
    shutil.copytree(checkpoint.step_dir(runs[saved], 3), checkpoint.step_dir(out, 3))
    flags = [*(MUON_RUN if resumed == "muon" else RUN), "--data_parallel_size", "2", "--data_parallel_type", "ddp"]
    run = forked([*flags, "--dataset", runs["data"], "--out_dir", out, "--resume"], 2)
    for rank, (code, stderr) in enumerate(zip(run.codes, run.stderr)):
        lines = stderr.splitlines()
        assert code == 2 and len(lines) == 1, f"rank {rank}: exit {code}\n{stderr}"
        assert lines[0].startswith(
            f"train.py: error: --resume: checkpoint {checkpoint.step_dir(out, 3)} was written "
            f"with --optimizer {saved}, and this run has --optimizer {resumed}"
        ), lines[0]
    assert os.listdir(out) == ["checkpoints"]  # no metrics.jsonl: refused before any work


OTHER = {  # name -> (ranks, flags, the sweep's tolerance for the layout: bench/sweep.tolerance)
    "zero2x2": (2, ["--data_parallel_size", "2", "--data_parallel_type", "zero2"], "FP32_RTOL"),
    "ddp2_pytorch": (
        2,
        ["--implementation", "pytorch", "--data_parallel_size", "2", "--data_parallel_type", "ddp"],
        "FP32_RTOL",
    ),  # torch.optim.Muon's state, loaded from ours
    "tp2": (2, ["--tensor_parallel_size", "2"], "FP32_TP_RTOL"),
}


@pytest.mark.slow
def test_train_resumes_muon_in_its_layout_bit_for_bit_and_in_others_within_the_sweeps_tolerance(runs):
    """train.py --optimizer muon from the uninterrupted one-process run's step-3 checkpoint: one process continues
    with the same loss and grad norm bits at steps 4-6; each layout of OTHER within bench/sweep.py's Muon tolerance
    (optim/concept.RULE: the layout's rtol plus optim/muon.rounding_rtol's bound, accumulated from step 4, since the
    state at step 3 is the same bits)."""
    import unittest

    import bench.sweep
    from model.gpt import GPT, make_config
    from optim.muon import is_muon, rounding_rtol
    from optim.schedule import lr_at
    from tests.harness import check_resume_from, steps_of

    test, ref = unittest.TestCase(), steps_of(runs["muon"])
    args = [*MUON_RUN[: MUON_RUN.index("--checkpoint_interval")], "--optimizer", "muon", "--dataset", runs["data"]]
    check_resume_from(test, runs["muon"], 3, args, 1, str(runs["tmp"] / "resumed-single"), 6)
    got = steps_of(str(runs["tmp"] / "resumed-single"))
    assert [(got[s]["loss"], got[s]["grad_norm"]) for s in got] == [(ref[s]["loss"], ref[s]["grad_norm"]) for s in got]
    later = range(4, 7)
    shapes = [tuple(p.shape) for n, p in GPT(make_config("tiny")).named_parameters() if is_muon(n)]
    bound = rounding_rtol(
        shapes,
        "match_rms_adamw",
        [lr_at(s, 3e-3, 2, 6) for s in later],
        [ref[s]["grad_norm"] for s in later],
        [ref[s]["loss"] for s in later],
    )
    for name, (nproc, flags, rtol_name) in OTHER.items():
        out = str(runs["tmp"] / f"resumed-{name}")
        check_resume_from(test, runs["muon"], 3, [*args, *flags], nproc, out, 6)
        got, rtol = steps_of(out), getattr(bench.sweep, rtol_name) + bound
        worst = max(abs(got[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in later)
        print(
            f"\n  {name} resumed from one process's step 3: loss off by {worst:.2e} relative (tolerance {rtol:.2e})",
            file=sys.stderr,
        )
        assert worst <= rtol, f"{name} resumed: loss off by {worst:.2e} relative, tolerance {rtol:.2e}"
