"""Muon (optim/): ours equals torch.optim.Muon on one process, bit for bit; every layout that runs it orthogonalises
each matrix once (the ledger) and, given one process's gradients, updates every parameter to one process's bits;
bad input is refused in one line.

The layout tests set each rank's gradients to its part of one process's (seeded normal draws per step and name)
instead of running a backward: a layout reorders the fp32 sums of a backward, so its gradients are equal to one
process's only to rounding, and then nothing after them could be bit-equal. With equal gradients, everything
Muon adds is bit-equal by construction: momentum and the step are elementwise on each piece; Newton-Schulz runs
on the whole matrix, cast to bf16 before the gather (a cast is elementwise), with one process's op sequence.
"""
from __future__ import annotations

import argparse
import copy

import pytest
import torch

from model import GPT, make_config
from optim.build import make_optimizer
from optim.muon import is_muon, one_process
from tests.harness import run_distributed

CFG = make_config("tiny", n_layer=2, vocab_size=128, block_size=32)
MOE = make_config("tiny", n_layer=2, vocab_size=128, block_size=32, moe_num_experts=4, moe_top_k=2)
STEPS = 5
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw")
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)


def grads(model: GPT, step: int) -> dict[str, torch.Tensor]:
    """One process's gradient of every parameter at `step`: seeded normal draws, per step and name."""
    out = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        g = torch.Generator().manual_seed(1000 * step + i)
        out[name] = torch.randn(p.shape, generator=g) * 0.01
    return out


def model(cfg=CFG) -> GPT:
    m = GPT(cfg)
    m.init_weights(7)
    return m


def one_process_run(cfg=CFG, reference: bool = False) -> dict[str, torch.Tensor]:
    m = model(cfg)
    opt = one_process(list(m.named_parameters()), 0.1, ADAMW, MUON, reference=reference)
    for step in range(STEPS):
        for name, p in m.named_parameters():
            p.grad = grads(m, step)[name]
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def test_ours_equals_torch_muon_bit_for_bit():
    """5 steps of ours (Muon on the Block matrices, torch's AdamW on the rest) against torch.optim.Muon + AdamW."""
    ours, torch_ = one_process_run(), one_process_run(reference=True)
    assert ours.keys() == torch_.keys()
    assert all(torch.equal(ours[n], torch_[n]) for n in ours), [n for n in ours if not torch.equal(ours[n], torch_[n])]
    start = {n: p.detach() for n, p in model().named_parameters()}
    assert all(not torch.equal(ours[n], start[n]) for n in ours)  # every parameter moved


def test_an_experts_matrices_are_torch_muon_on_each_slice():
    """An ExpertLinear weight (E, in, out) steps as torch.optim.Muon on each expert's (in, out) slice."""
    w = torch.randn(4, 16, 24)
    ours_w = w.clone().requires_grad_()
    theirs = [w[e].clone().requires_grad_() for e in range(4)]
    ours = one_process([("transformer.h.1.mlp.experts.c_fc.weight", ours_w)], 0.0, ADAMW, MUON)
    ref = torch.optim.Muon(theirs, **MUON)
    for step in range(STEPS):
        g = torch.randn(4, 16, 24, generator=torch.Generator().manual_seed(step))
        ours_w.grad = g.clone()
        for e in range(4):
            theirs[e].grad = g[e].clone()
        ours.step()
        ref.step()
    assert all(torch.equal(ours_w[e].detach(), theirs[e].detach()) for e in range(4))
    assert ours.ledger.counts == {f"transformer.h.1.mlp.experts.c_fc.weight[{e}]": 1 for e in range(4)}


def test_which_matrices_muon_takes():
    names = [n for n, _ in model(MOE).named_parameters()]
    assert sorted(n.split(".", 3)[3] for n in names if is_muon(n) and ".h.0." in n) == sorted(
        ["attn.c_q.weight", "attn.c_k.weight", "attn.c_v.weight", "attn.c_proj.weight",
         "mlp.experts.c_fc.weight", "mlp.experts.c_proj.weight"])
    assert not any(is_muon(n) for n in names if "wte" in n or "wpe" in n or "ln_" in n or "bias" in n
                   or "router" in n)
    assert is_muon("module.transformer.h.3.mlp.c_fc.weight") and not is_muon("lm_head.weight")


# ----------------------------------------------------------------------------- layouts

def args(**kw) -> argparse.Namespace:
    base = dict(optimizer="muon", implementation="custom", weight_decay=0.1, lr=MUON["lr"], muon_lr=None,
                muon_momentum=None, muon_nesterov=None, muon_ns_steps=None, muon_weight_decay=None,
                muon_adjust_lr_fn=None)
    return argparse.Namespace(**{**base, **kw})


def set_grads(par, full: dict[str, torch.Tensor]) -> None:
    """Each rank's part of one process's gradients: whole (DDP), or its flat shard (our engine)."""
    fsdp = par.fsdp
    if fsdp is None:
        for n, p in par.model.named_parameters():
            p.grad = full[n.removeprefix("module.")].clone()
        return
    for unit in fsdp.units:
        flat = torch.zeros(unit.padded)
        for spec in unit.specs:
            flat[spec.offset:spec.offset + spec.numel] = full[spec.names[0]].reshape(-1)
        S = unit.shard.numel()
        shard = flat[unit.rank * S:(unit.rank + 1) * S]
        for p, a, b in unit.pieces:
            p.grad = shard[a:b].clone()


def layout_run(rank: int, world: int, dp_type: str) -> dict:
    from parallel.mesh import ParallelDims, init_distributed
    from parallel.parallelize import ParallelConfig, parallelize
    mesh = init_distributed(ParallelDims(dp=world, tp=1, world_size=world), torch.device("cpu"))
    ref = model()
    par = parallelize(copy.deepcopy(ref), mesh, ParallelConfig(dp_type=dp_type, implementation="custom"),
                      torch.device("cpu"))
    opt = make_optimizer(par, args(lr=ADAMW["lr"], muon_lr=MUON["lr"]), **ADAMW)
    ledgers, cut = [], []
    if par.fsdp is not None:
        cut = [m.key for m in opt.muon.orthogonalize.matrices if sum(b > a for a, b in m.ranges) > 1]
    for step in range(STEPS):
        set_grads(par, grads(ref, step))
        opt.step()
        opt.zero_grad()
        par.after_optimizer_step()
        ledgers.append(dict(opt.ledger.counts))
    if par.fsdp is not None:
        params = par.fsdp.full_state_dict()
    else:
        params = {n.removeprefix("module."): p.detach().clone() for n, p in par.model.named_parameters()}
    return {"params": params, "ledgers": ledgers, "cut": cut, "load": opt.muon.orthogonalize.load}


MUON_KEYS = sorted(n for n, _ in model().named_parameters() if is_muon(n))


@pytest.mark.parametrize("dp_type,world", [("ddp", 2), ("zero1", 2), ("zero2", 2), ("fsdp", 2), ("fsdp", 3)])
def test_layout_updates_equal_one_process_and_each_matrix_is_done_once(dp_type, world):
    ranks = run_distributed(layout_run, world, dp_type)
    want = one_process_run()
    got = ranks[0]["params"]
    differ = [n for n in want if not torch.equal(got[n], want[n])]
    assert not differ, f"{dp_type} x{world}: differ from one process in {differ}"
    for step in range(STEPS):  # the ledger: summed over ranks, every matrix exactly once
        total = {}
        for r in ranks:
            for k, v in r["ledgers"][step].items():
                total[k] = total.get(k, 0) + v
        assert total == {k: 1 for k in MUON_KEYS}, f"step {step}: {total}"
    assert all(sum(r["ledgers"][0].values()) > 0 for r in ranks), "an owner did nothing: owners unbalanced"
    if dp_type != "ddp":
        assert ranks[0]["cut"], "no matrix was cut by a shard boundary: the test would not see a gather"


def test_owners_balanced_by_flops():
    from optim.distributed_muon import Matrix, owners
    from optim.muon import ns_flops
    ms = [Matrix(f"m{i}", s, ((0, s[0] * s[1]),) * 4) for i, s in enumerate([(64, 256)] * 4 + [(64, 64)] * 8)]
    own = owners(ms, 4, 5)
    load = [sum(ns_flops(m.shape, 5) for m in ms if own[m.key] == r) for r in range(4)]
    assert max(load) == min(load)
