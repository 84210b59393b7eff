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
from collections import Counter
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.gpt import GPT, make_config
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


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_each_lr_adjustment_equals_torch_muon_on_wide_and_tall_matrices(adjust_lr_fn):
    """Both of torch.optim.Muon's lr adjustments, on a tall (64, 16) and a wide (16, 64) matrix: "original"
    scales by sqrt(max(1, rows/cols)), so the two matrices step by different factors (2 and 1), and a ratio
    taken the wrong way round shows on one of them; "match_rms_adamw" is symmetric in the shape."""
    shapes = [(64, 16), (16, 64)]
    w = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    ours_w = [t.clone().requires_grad_() for t in w]
    theirs = [t.clone().requires_grad_() for t in w]
    hyper = {**MUON, "adjust_lr_fn": adjust_lr_fn}
    names = ["transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_proj.weight"]
    ours = one_process(list(zip(names, ours_w)), 0.0, ADAMW, hyper)
    ref = torch.optim.Muon(theirs, **hyper)
    for step in range(STEPS):
        for i, s in enumerate(shapes):
            g = torch.randn(s, generator=torch.Generator().manual_seed(100 * step + i))
            ours_w[i].grad, theirs[i].grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(ours_w, theirs))
    assert not any(torch.equal(a.detach(), b) for a, b in zip(ours_w, w))  # both moved


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


class _Kernels(TorchDispatchMode):
    """The aten ops run inside, by name (a foreach op counts once: the mode sees the call, not its per-tensor
    fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_a_step_batches_newton_schulz_and_its_momentum_by_shape():
    """One step of the tiny model's 12 Muon matrices, two shapes ((64, 64) x 8; (256, 64) x 2 and (64, 256) x 2,
    one wide shape once the tall ones are transposed, as NS does): 5 NS steps of one bmm and two baddbmm per
    shape, no per-matrix GEMM (one at a time it made 3 x 5 x 12 = 180); momentum, weight decay and the update
    by foreach ops, no per-parameter lerp; one pair of timing marks for the step, not one per matrix."""
    m = model()
    opt = one_process(list(m.named_parameters()), 0.1, ADAMW, MUON)
    for name, p in m.named_parameters():
        p.grad = grads(m, 0)[name]
    with _Kernels() as k:
        opt.muon.step()
    ops = k.ops
    assert (ops["bmm"], ops["baddbmm"], ops["mm"], ops["addmm"]) == (2 * 5, 2 * 2 * 5, 0, 0), ops
    assert (ops["_foreach_lerp_"], ops["_foreach_lerp"], ops["lerp_"], ops["lerp"]) == (1, 1, 0, 0), ops
    assert (ops["_foreach_mul_"], ops["_foreach_add_"]) == (1, 2), ops  # 2 adjusted lrs: the two shapes
    assert len(opt.ledger.marks) == 2 and opt.ledger.total == 12


@pytest.mark.parametrize("shapes", [[(64, 64)] * 5, [(96, 32), (32, 96), (96, 32)], [(48, 80)], [(7, 300), (300, 7)]])
def test_batched_newton_schulz_is_each_matrix_own_bit_for_bit(shapes):
    """zeropower_batched equals torch.optim.Muon's single-matrix NS on every member of a batch, bit for bit on the
    CPU, whatever else the batch holds (tall and wide mixed, one alone, other subsets): so an owner's result does
    not depend on which matrices a layout gave it."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    from optim.muon import EPS, NS_COEFFICIENTS, zeropower_batched

    g = torch.Generator().manual_seed(len(shapes))
    gs = [torch.randn(s, generator=g) * 0.01 for s in shapes]
    want = [_zeropower_via_newtonschulz(x, NS_COEFFICIENTS, 5, EPS) for x in gs]
    for subset in (range(len(gs)), range(0, len(gs), 2), range(len(gs) - 1, len(gs))):
        got = zeropower_batched([gs[i] for i in subset], 5)
        for i, o in zip(subset, got):
            assert o.shape == want[i].shape and torch.equal(o, want[i]), (shapes, list(subset), i)


def test_which_matrices_muon_takes():
    names = [n for n, _ in model(MOE).named_parameters()]
    assert sorted(n.split(".", 3)[3] for n in names if is_muon(n) and ".h.0." in n) == sorted(
        [
            "attn.c_q.weight",
            "attn.c_k.weight",
            "attn.c_v.weight",
            "attn.c_proj.weight",
            "mlp.experts.c_fc.weight",
            "mlp.experts.c_proj.weight",
        ]
    )
    assert not any(is_muon(n) for n in names if "wte" in n or "wpe" in n or "ln_" in n or "bias" in n or "router" in n)
    assert is_muon("module.transformer.h.3.mlp.c_fc.weight") and not is_muon("lm_head.weight")


# ----------------------------------------------------------------------------- layouts


def args(**kw) -> argparse.Namespace:
    base = dict(
        optimizer="muon",
        implementation="custom",
        weight_decay=0.1,
        lr=MUON["lr"],
        muon_lr=None,
        muon_momentum=None,
        muon_nesterov=None,
        muon_ns_steps=None,
        muon_weight_decay=None,
        muon_adjust_lr_fn=None,
    )
    return argparse.Namespace(**{**base, **kw})


def local_part(full: torch.Tensor, marks) -> torch.Tensor:
    """This rank's slice of a whole tensor under `mark_shard` marks (TP's, EP's)."""
    for m in marks:
        full = full.chunk(m.size, m.dim)[m.rank]
    return full


def set_grads(parallelized, full: dict[str, torch.Tensor]) -> None:
    """Each rank's part of one process's gradients: its TP/EP slice, and under our engine its flat shard."""
    from parallel.marks import shards_of

    fsdp = parallelized.fsdp
    if fsdp is None:
        for n, p in parallelized.model.named_parameters():
            p.grad = local_part(full[_name(n)], shards_of(p)).clone()
        return
    for unit in fsdp.units:
        flat = torch.zeros(unit.padded)
        for spec in unit.specs:
            g = local_part(full[_name(spec.names[0])], fsdp.shard_marks.get(spec.names[0], ()))
            flat[spec.offset : spec.offset + spec.numel] = g.reshape(-1)
        S = unit.shard.numel()
        shard = flat[unit.rank * S : (unit.rank + 1) * S]
        for p, a, b in unit.pieces:
            p.grad = shard[a:b].clone()


def _name(n: str) -> str:
    n = n.removeprefix("module.")
    return "transformer.wte.weight" if n == "lm_head.weight" else n


def differing(parallelized, want: dict[str, torch.Tensor]) -> list[str]:
    """Names of this rank's parameters (or flat pieces of them) whose bits differ from one process's."""
    from parallel.marks import shards_of

    out = []
    if parallelized.fsdp is None:
        for n, p in parallelized.model.named_parameters():
            if not torch.equal(p.detach(), local_part(want[_name(n)], shards_of(p))):
                out.append(n)
        return out
    for n, piece in parallelized.fsdp.sharded_state_dict().items():
        marks = parallelized.fsdp.shard_marks.get(n) or parallelized.fsdp.shard_marks.get(
            _name(n), ()
        )  # the tied copy: its own
        ref = local_part(want[_name(n)], marks).reshape(-1)
        if not torch.equal(piece.flat, ref[piece.offset : piece.offset + piece.flat.numel()]):
            out.append(n)
    return out


def stepped_layout(world: int, dims: dict, dp_type: str | None, moe: bool, n_steps: int = STEPS):
    """This rank's layout, with Muon, stepped `n_steps` times on one process's gradients (`grads`) instead of a
    backward. Returns (the one-process model, the layout, its optimizer, per step: the all_to_all bytes and calls
    comm counted, and the ledger's counts)."""
    from parallel import comm
    from parallel.mesh import ParallelDims, init_distributed
    from parallel.parallelize import ParallelConfig, parallelize

    mesh = init_distributed(ParallelDims(**{"dp": 1, "tp": 1, **dims}, world_size=world), torch.device("cpu"))
    ref = model(MOE if moe else CFG)
    parallelized = parallelize(
        copy.deepcopy(ref), mesh, ParallelConfig(dp_type=dp_type, implementation="custom"), torch.device("cpu")
    )
    opt = make_optimizer(parallelized, args(lr=ADAMW["lr"], muon_lr=MUON["lr"]), **ADAMW)
    steps = []
    for step in range(n_steps):
        set_grads(parallelized, grads(ref, step))
        comm.COUNTER.reset()
        opt.step()
        steps.append(
            (
                comm.COUNTER.snapshot().get("all_to_all", 0),
                comm.COUNTER.snapshot_calls().get("all_to_all", 0),
                dict(opt.ledger.counts),
            )
        )
        opt.zero_grad()
        parallelized.after_optimizer_step()
    return ref, parallelized, opt, steps


def layout_run(rank: int, world: int, dims: dict, dp_type: str | None, moe: bool) -> dict:
    _, parallelized, opt, steps = stepped_layout(world, dims, dp_type, moe)
    ex = opt.muon.orthogonalize
    cut = [
        m.key
        for m in getattr(ex, "matrices", [])
        if sum(h is not None for h in m.holds) > 1 and not any(m.whole_at(r) for r in range(len(m.holds)))
    ]
    want = one_process_run(MOE if moe else CFG)
    return {
        "differ": differing(parallelized, want),
        "ledgers": [led for _, _, led in steps],
        "cut": cut,
        "load": getattr(ex, "load", None),
        "sent": [b for b, _, _ in steps],
        "planned": ex.sent_bytes() if hasattr(ex, "sent_bytes") else 0,
    }


MUON_KEYS = {
    False: sorted(n for n, _ in model().named_parameters() if is_muon(n)),
    True: sorted(
        f"{n}[{e}]" if p.dim() == 3 else n
        for n, p in model(MOE).named_parameters()
        if is_muon(n)
        for e in range(p.shape[0] if p.dim() == 3 else 1)
    ),
}
# name -> (ranks, dims, dp_type, MoE, whether some matrix is held in pieces by no rank whole)
LAYOUTS = {
    "ddp2": (2, {"dp": 2}, "ddp", False, False),
    "zero1x2": (2, {"dp": 2}, "zero1", False, True),
    "zero2x2": (2, {"dp": 2}, "zero2", False, True),
    "fsdp2": (2, {"dp": 2}, "fsdp", False, True),
    "fsdp3": (3, {"dp": 3}, "fsdp", False, True),
    "tp2": (2, {"tp": 2}, None, False, True),
    "pp2": (2, {"pp": 2}, None, False, False),
    "hsdp2x2": (4, {"dp": 4, "dp_replicate": 2}, "fsdp", False, True),
    "tp2_fsdp2": (4, {"dp": 2, "tp": 2}, "fsdp", False, True),
    "pp2_tp2_ddp": (4, {"pp": 2, "tp": 2, "dp": 1}, None, False, True),
    "ep2_ddp2": (2, {"dp": 2, "ep": 2}, "ddp", True, False),
    "ep2_zero2": (2, {"dp": 2, "ep": 2}, "zero2", True, True),
    "pp2_tp2_fsdp2": (8, {"pp": 2, "tp": 2, "dp": 2}, "fsdp", False, True),
    "pp2_tp2_ep2_fsdp2": (8, {"pp": 2, "tp": 2, "dp": 2, "ep": 2}, "fsdp", True, True),  # 4-D: 3 matrices a rank
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if LAYOUTS[n][0] >= 8 else n for n in LAYOUTS]
)  # 8 ranks: out of the fast loop
def test_layout_updates_equal_one_process_and_each_matrix_is_done_once(name):
    world, dims, dp_type, moe, pieces = LAYOUTS[name]
    ranks = run_distributed(layout_run, world, dims, dp_type, moe)
    differ = {r: x["differ"] for r, x in enumerate(ranks) if x["differ"]}
    assert not differ, f"{name}: differ from one process: {differ}"
    for step in range(STEPS):  # the ledger: summed over ranks, every matrix exactly once
        total = {}
        for r in ranks:
            for k, v in r["ledgers"][step].items():
                total[k] = total.get(k, 0) + v
        assert total == {k: 1 for k in MUON_KEYS[moe]}, f"step {step}: {total}"
    if pieces:
        assert any(r["cut"] for r in ranks), "no matrix held only in pieces: the test would not see a gather"
    for r, x in enumerate(ranks):  # the bytes: what each rank sent is what the holds say, every step
        assert x["sent"] == [x["planned"]] * STEPS, f"rank {r}: sent {x['sent']}, planned {x['planned']}"


def tp_exchange_run(rank: int, world: int) -> tuple[int, set[str]]:
    """TP=2 with Muon: the exchange's index tensors (the column slices of row-parallel c_proj) are made at build on
    the exchange's device (one built for `meta` here, the CPU's own being the host's); a step builds none
    (Hold.positions raises if called)."""
    from optim.distributed_muon import Exchange
    from optim.muon import Hold, Ledger

    ref, parallelized, opt, _ = stepped_layout(world, {"tp": 2}, None, False, n_steps=1)
    ex = opt.muon.orthogonalize
    on_meta = Exchange(ex.matrices, ex.group, ex.ns_steps, Ledger(), torch.device("meta"))
    index = [p for p in on_meta._pos.values() if isinstance(p, torch.Tensor)]
    with mock.patch.object(Hold, "positions", side_effect=AssertionError("Hold.positions called in a step")):
        set_grads(parallelized, grads(ref, 1))
        opt.step()
    return len(index), {str(p.device) for p in index}


def test_tp_index_tensors_are_built_once_on_the_device():
    ranks = run_distributed(tp_exchange_run, 2)
    assert sum(count for count, _ in ranks) > 0, ranks  # some owner holds a column slice's index
    assert all(devices <= {"meta"} for _, devices in ranks), ranks


def test_owners_balanced_by_flops():
    """One (128, 128) matrix costs NS as much as eight (64, 64) ones: balanced by FLOPs, one rank takes it alone
    (balanced by count, it would take four more)."""
    from optim.distributed_muon import Matrix, owners
    from optim.muon import Hold, ns_flops

    ms = [
        Matrix(f"m{i}", s, (Hold(-1, 0, 1, 0, s[0] * s[1]),) * 2) for i, s in enumerate([(128, 128)] + [(64, 64)] * 8)
    ]
    own = owners(ms, 2, 5)
    load = [sum(ns_flops(m.shape, 5) for m in ms if own[m.key] == r) for r in range(2)]
    assert load[0] == load[1] and [own[f"m{i}"] for i in range(9)].count(own["m0"]) == 1


# ----------------------------------------------------------------------------- bad input


class TestBadInput:
    """One line `train.py: error: ...`, exit 2, nothing written, on every rank."""

    BASE = [
        "--model",
        "tiny",
        "--vocab_size",
        "512",
        "--micro_batch_size",
        "2",
        "--seq_len",
        "32",
        "--total_batch_size",
        "128",
        "--max_steps",
        "2",
        "--no_checkpoint",
    ]

    @pytest.fixture(autouse=True)
    def _data(self, tmp_path):
        import unittest

        from tests.harness import make_token_bins

        self.tmp, self.t = tmp_path, unittest.TestCase()
        self.data = make_token_bins(str(tmp_path / "data"), n_train=2000, n_val=500, vocab=512)

    def refused(self, flags: list[str], words: str, nproc: int = 1) -> None:
        from tests.harness import expect_train_error_in_process, expect_train_error_on_ranks

        args = [*self.BASE, "--dataset", self.data, *flags]
        if nproc == 1:
            expect_train_error_in_process(self.t, args, words, str(self.tmp / "out"))
        else:
            expect_train_error_on_ranks(self.t, args, words, nproc, str(self.tmp / "out"))

    def test_an_unknown_optimizer(self):
        self.refused(["--optimizer", "sgd"], "argument --optimizer: invalid choice: 'sgd'")

    @pytest.mark.parametrize(
        "flag,value",
        [
            ("--muon_lr", "0.02"),
            ("--muon_nesterov", "off"),
            ("--muon_adjust_lr_fn", "original"),
            ("--muon_ns_steps", "3"),
        ],
    )
    def test_muon_flags_without_muon(self, flag, value):
        self.refused([flag, value], f"{flag} sets Muon, which this run does not use")

    def test_momentum_of_one(self):
        self.refused(["--optimizer", "muon", "--muon_momentum", "1"], "--muon_momentum must be < 1")

    def test_float16(self):
        """fp16's GradScaler does not reach Muon's views of the flat shards: refused on both ranks of an FSDP x 2."""
        self.refused(
            ["--optimizer", "muon", "--dtype", "float16", "--data_parallel_size", "2", "--data_parallel_type", "fsdp"],
            "--optimizer muon with --dtype float16 is not built yet",
            nproc=2,
        )

    def test_a_twin_layout_that_cannot_run_it(self):
        self.refused(
            [
                "--optimizer",
                "muon",
                "--implementation",
                "pytorch",
                "--data_parallel_size",
                "2",
                "--data_parallel_type",
                "fsdp",
            ],
            "torch.optim.Muon needs each matrix whole",
            nproc=2,
        )
