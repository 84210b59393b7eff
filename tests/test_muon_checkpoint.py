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

import pytest
import torch

import checkpoint
from checkpoint_entries import entries
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
    from parallel.mesh import ParallelDims, init_distributed
    from parallel.parallelize import ParallelConfig, parallelize
    from optim.build import make_optimizer
    cfg = MOE if moe else CFG
    mesh = init_distributed(ParallelDims(**{"dp": 1, "tp": 1, **dims}, world_size=world), torch.device("cpu"))
    ref = model(cfg)
    start = ref if save else _reinit(ref)
    par = parallelize(copy.deepcopy(start), mesh, ParallelConfig(dp_type=dp_type, implementation="custom"),
                      torch.device("cpu"))
    opt = make_optimizer(par, args(lr=ADAMW["lr"], muon_lr=MUON["lr"]), **ADAMW)
    if not save:
        checkpoint.load(path, entries(par, opt), par.checkpoint_optimizer(opt), rank=rank, world_size=world)
    for step in range(0, SAVED) if save else range(SAVED, STEPS):
        set_grads(par, grads(ref, step))
        opt.step()
        opt.zero_grad()
        par.after_optimizer_step()
    if save:
        checkpoint.save(path, SAVED, entries(par, opt), par.checkpoint_optimizer(opt),
                        {"layout": {"world_size": world}}, rank=rank, world_size=world, keep=1)
        return {}
    return {"differ": differing(par, one_process_run(cfg))}


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


PAIRS = [("single", "zero2x2"), ("single", "fsdp2"), ("tp2", "ddp2"), ("fsdp2", "tp2"), ("pp2", "single"),
         ("zero2x2", "pp2"), ("single_moe", "ep2_zero2"), ("ep2_zero2", "ep2_ddp2")]


@pytest.mark.parametrize("source,target", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_resume_in_another_layout_continues_bit_for_bit(source, target, tmp_path_factory):
    from tests.harness import run_distributed
    path = saved_by(source, str(tmp_path_factory.getbasetemp() / "muon-ckpt"))
    world, dims, dp_type, moe = LAYOUTS[target]
    assert LAYOUTS[source][3] == moe
    ranks = run_distributed(phase, world, dims, dp_type, moe, path, False)
    differ = {r: x["differ"] for r, x in enumerate(ranks) if x["differ"]}
    assert not differ, f"{source} -> {target}: differ from one process's uninterrupted run: {differ}"
