"""Muon's bytes = theory (issue 46 item 5): in each layout, what every rank's exchange sends per step (parallel/comm's
all_to_all bytes and calls), its optimizer state (the wrapper's state_breakdown) and which rank owns which matrix
equal optim/theory.py's formulas over its holds (the layout's rules, not the live layout), exactly.

The runs set one process's gradients on each rank (tests/test_muon.py's `set_grads`) and take two steps: the first
makes the momentum, the second is the steady state; the exchange sends the same every step.
"""

from __future__ import annotations

import pytest
import torch

from optim import theory
from plan.counts import Setup
from tests.harness import run_distributed
from tests.test_muon import ADAMW, MUON, args, grads, set_grads, stepped_layout
from trainer.config import check_layout, train_parser

STEPS = 2
FLAGS = [
    "--model",
    "tiny",
    "--n_layer",
    "2",
    "--vocab_size",
    "128",
    "--block_size",
    "32",
    "--seq_len",
    "32",
    "--micro_batch_size",
    "1",
    "--optimizer",
    "muon",
    "--no_checkpoint",
]
MOE_FLAGS = ["--moe_num_experts", "4", "--moe_top_k", "2"]
# name -> (ranks, dims, dp_type, MoE, train.py's layout flags)
LAYOUTS = {
    "ddp2": (2, {"dp": 2}, "ddp", False, ["--data_parallel_size", "2"]),
    "ddp4": (4, {"dp": 4}, "ddp", False, ["--data_parallel_size", "4"]),
    "zero1x2": (2, {"dp": 2}, "zero1", False, ["--data_parallel_size", "2", "--data_parallel_type", "zero1"]),
    "zero2x4": (4, {"dp": 4}, "zero2", False, ["--data_parallel_size", "4", "--data_parallel_type", "zero2"]),
    "zero3x2": (2, {"dp": 2}, "fsdp", False, ["--data_parallel_size", "2", "--data_parallel_type", "fsdp"]),
    "zero3x4": (4, {"dp": 4}, "fsdp", False, ["--data_parallel_size", "4", "--data_parallel_type", "fsdp"]),
    "tp2": (2, {"tp": 2}, None, False, ["--tensor_parallel_size", "2"]),
    "tp2_ddp2": (4, {"dp": 2, "tp": 2}, "ddp", False, ["--data_parallel_size", "2", "--tensor_parallel_size", "2"]),
    "ep2_ddp2": (2, {"dp": 2, "ep": 2}, "ddp", True, ["--data_parallel_size", "2", "--expert_parallel_size", "2"]),
    "ep2_zero3x4": (
        4,
        {"dp": 4, "ep": 2},
        "fsdp",
        True,
        ["--data_parallel_size", "4", "--expert_parallel_size", "2", "--data_parallel_type", "fsdp"],
    ),
    "pp2_ddp2": (4, {"pp": 2, "dp": 2}, "ddp", False, ["--pipeline_parallel_size", "2", "--data_parallel_size", "2"]),
}


def setup(world: int, moe: bool, layout: list[str]) -> Setup:
    dp = (
        ["--data_parallel_type", "ddp"]
        if "--data_parallel_size" in layout and "--data_parallel_type" not in layout
        else []
    )
    a = train_parser().parse_args(
        [
            *FLAGS,
            *(MOE_FLAGS if moe else []),
            *layout,
            *dp,
            "--total_batch_size",
            str(32 * world),
            "--implementation",
            "custom",
            "--out_dir",
            "-",
        ]
    )
    dims, config, dtype, _, accum, pp_layers = check_layout(a, world, torch.device("meta"))
    return Setup(a, dims, config, dtype, accum, pp_layers)


def measure(rank: int, world: int, dims: dict, dp_type: str | None, moe: bool) -> dict:
    """This rank's exchange per step (all_to_all bytes, calls), its holds and owners, and its optimizer state."""
    ref, parallelized, opt, steps = stepped_layout(world, dims, dp_type, moe, STEPS)
    ex = opt.muon.orthogonalize
    set_grads(parallelized, grads(ref, STEPS - 1))  # the state is counted with gradients present, as after a step
    return {
        "sent": [b for b, _, _ in steps],
        "calls": [c for _, c, _ in steps],
        "owner": ex.owner,
        "holds": [(m.key, m.shape, tuple(None if h is None else tuple(h) for h in m.holds)) for m in ex.matrices],
        "optimizer": parallelized.state_breakdown(opt)["optimizer"],
    }


def make(parallelized):
    from optim.build import make_optimizer

    return make_optimizer(parallelized, args(lr=ADAMW["lr"], muon_lr=MUON["lr"]), **ADAMW)


@pytest.mark.parametrize("name", LAYOUTS)
def test_muon_bytes_state_and_owners_equal_theory(name):
    world, dims, dp_type, moe, flags = LAYOUTS[name]
    s = setup(world, moe, flags)
    ranks = run_distributed(measure, world, dims, dp_type, moe)
    G = theory.stage_ranks(s)
    for r, x in enumerate(ranks):
        pp, g = divmod(r, G)
        want = theory.stage_matrices(s, pp)
        assert x["holds"] == [(k, shape, row) for k, shape, row in want], f"rank {r}: holds differ from the plan's"
        _, owners, _ = theory.exchange(s, pp)
        assert x["owner"] == {k: o for (k, _, _), o in zip(want, owners)}, f"rank {r}: owners differ from LPT's"
        b = theory.exchange_bytes(s, pp, g).get("all_to_all", 0)
        c = theory.exchange_calls(s, pp).get("all_to_all", 0)
        assert x["sent"] == [b] * STEPS and x["calls"] == [c] * STEPS, (
            f"rank {r}: sent {x['sent']} in {x['calls']} calls, theory {b} in {c}"
        )
        c = theory.coords(s.dims, g)
        state = theory.optimizer_state_bytes(s, pp, c["shard"] * s.dims.cp + c["cp"], c["edp"])
        assert x["optimizer"] == state, f"rank {r}: optimizer state {x['optimizer']} B, theory {state}"
    assert any(x["sent"][0] for x in ranks), "nothing sent: the layout would not test the formulas"


def test_closed_forms():
    """The per-layout closed forms in theory.muon_exchange_bytes_per_step's docstring, on synthetic holds: DDP's
    return 2 (G - 1) O_r, TP's 2 (N - O_r) / t + 2 (t - 1) O_r / t."""
    n = [64 * 64, 256 * 64, 64 * 64]
    G = 4
    whole = [[(0, k)] * G for k in n]
    owners = [1, 0, 1]
    for r in range(G):
        O = sum(k for k, o in zip(n, owners) if o == r)
        assert sum(theory.muon_exchange_bytes_per_step(whole, owners, r).values()) == 2 * (G - 1) * O
    sliced = [[(t, k // G) for t in range(G)] for k in n]
    for r in range(G):
        O = sum(k for k, o in zip(n, owners) if o == r)
        assert (
            sum(theory.muon_exchange_bytes_per_step(sliced, owners, r).values())
            == 2 * (sum(n) - O) // G + 2 * (G - 1) * O // G
        )


def test_lpt_bound_holds_and_is_tight():
    """Graham's bound on 2 ranks and matrices 3, 3, 2, 2, 2 (LPT: 7 against the optimum 6; the bound 6 + 1.5)."""
    flops = [3, 3, 2, 2, 2]
    owners = theory.muon_owners(flops, [[0, 0]] * 5, [str(i) for i in range(5)])
    load = [sum(f for f, o in zip(flops, owners) if o == r) for r in range(2)]
    assert max(load) == 7 <= theory.muon_lpt_bound(flops, 2) == 7.5


def table() -> str:
    """docs/muon.md's measured-against-theory table: `python -m tests.test_muon_theory`."""
    rows = [
        (
            "| layout | all_to_all bytes sent per rank per step, measured | theory | calls | optimizer state B, "
            "rank 0 (theory) | NS MFLOP per rank (LPT bound) |"
        ),
        "|---|---|---|---:|---|---|",
    ]
    for name, (world, dims, dp_type, moe, flags) in LAYOUTS.items():
        s = setup(world, moe, flags)
        ranks = run_distributed(measure, world, dims, dp_type, moe)
        G = theory.stage_ranks(s)
        theory_b = [theory.exchange_bytes(s, r // G, r % G).get("all_to_all", 0) for r in range(world)]
        c = theory.coords(s.dims, 0)
        state = theory.optimizer_state_bytes(s, 0, c["shard"] * s.dims.cp + c["cp"], c["edp"])
        load = theory.ns_flops_by_rank(s, 0)
        bound = theory.muon_lpt_bound(theory.exchange(s, 0)[2], G)
        measured = ", ".join(f"{x['sent'][-1]:,}" for x in ranks)
        want = ", ".join(f"{b:,}" for b in theory_b)
        flops = ", ".join(f"{f / 1e6:.1f}" for f in load)
        rows.append(
            f"| {name} | {measured} | {want} | {ranks[0]['calls'][-1]} | {ranks[0]['optimizer']:,} "
            f"({state:,}) | {flops} ({bound / 1e6:.1f}) |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())


def test_the_planner_counts_muon():
    """`python -m plan --optimizer muon`'s prediction: DDP x4's optimizer state is AdamW's less 4 B per Muon element
    (one moment, not two, and no step tensor: 4 B fewer per Muon tensor), its comm bytes gain the exchange's
    all_to_all, and its step time the exchange and the busiest owner's NS FLOPs."""
    from plan import counts
    from plan.cluster import PRESETS, Cluster
    from plan.predict import predict
    from plan.search import step_time

    world, _, _, _, flags = LAYOUTS["ddp4"]
    muon = setup(world, False, flags)
    a = train_parser().parse_args(
        [
            *[f for f in FLAGS if f != "muon" and f != "--optimizer"],
            *flags,
            "--data_parallel_type",
            "ddp",
            "--total_batch_size",
            str(32 * world),
            "--implementation",
            "custom",
            "--out_dir",
            "-",
        ]
    )
    adamw = Setup(a, *check_layout(a, world, torch.device("meta"))[:3], 1, None)
    muon_params = [
        (n, k) for n, k, _ in counts.local_params(adamw) if "attn.c_" in n or "mlp.c_" in n if n.endswith("weight")
    ]
    elements = sum(k for _, k in muon_params)
    assert elements == 98_304 and len(muon_params) == 12
    assert predict(muon)["state_bytes_by_kind"]["optimizer"] == predict(adamw)["state_bytes_by_kind"][
        "optimizer"
    ] - 4 * elements - 4 * len(muon_params)
    assert predict(muon)["comm_bytes"]["all_to_all"] == theory.exchange_bytes(muon)["all_to_all"] > 0
    assert "all_to_all" not in predict(adamw)["comm_bytes"]
    p = PRESETS["h100-sxm"]
    cluster = Cluster(world, world, p["memory"], p["peak_flops"], p["intra_bw"], p["inter_bw"], "h100-sxm")
    t_muon, t_adamw = step_time(muon, cluster, 0.5), step_time(adamw, cluster, 0.5)
    assert t_muon["muon"] > 0 and t_muon["compute"] > t_adamw["compute"] and "muon" not in t_adamw
