"""sim.verify's part for --optimizer muon: the build's one host read answered from the plan, and the checks that
the exchange is consistent and its owners balanced.

- The answer (`answer_holds`): optim/build.matrices_of all-gathers what each rank of a stage holds of each Muon
  matrix (`all_gather_object`, host objects), which the fake backend cannot carry. A simulated rank gets every
  rank's list from plan/muon_counts.stage_matrices (the layout's rules), as fake_rank answers a dispatch's split
  sizes with balanced ones; its own list must equal the plan's (else the run raises, and that is a finding).
- `findings`: per stage, (a) every byte the exchange sends is received: summed over the group, what the ranks
  send (theory.muon_exchange_bytes_per_step, the sender's view) equals what they receive (`received`, the
  receiver's view, counted apart), gather and return each; (b) balanced owners: each rank's Newton-Schulz FLOPs
  at most Graham's LPT bound (theory.muon_lpt_bound), and the loads sum to every matrix once; (c) each simulated
  rank's recorded all_to_alls of the exchange (site optim.distributed_muon) send and receive the theory's bytes.
The exchange's all_to_alls move different sizes on different ranks (the owners differ), so their signature for
sim.verify's collectives check leaves the sizes out (fake_rank.Op.signature); (c) holds them instead.
"""

from __future__ import annotations

import argparse

from plan import muon_counts, theory
from plan.counts import Setup

SITE = "optim.distributed_muon."


def setup_of(spec) -> Setup:
    args = argparse.Namespace(**{**vars(spec.args), "device": "auto"})
    return Setup(args, spec.dims, spec.config, spec.dtype, spec.grad_accum, spec.parallel.pp_layers)


def answer_holds(spec):
    """An all_gather_object for a simulated rank (plan/fake_rank.run_fake_rank patches it in): Muon's holds from the
    plan
    (module docstring); any other object cannot be answered and raises."""
    s = setup_of(spec)

    def all_gather_object(object_list: list, obj, group=None) -> None:
        if not (isinstance(obj, list) and all(isinstance(x, tuple) and len(x) == 3 for x in obj)):
            raise RuntimeError("a simulated rank can all_gather_object only Muon's holds (sim/muon_verify.py)")
        G = muon_counts.stage_ranks(s)
        pp, g = divmod(spec.rank, G)
        lists = [[] for _ in range(G)]
        for key, shape, row in muon_counts.stage_matrices(s, pp):
            for r, h in enumerate(row):
                if h is not None:
                    lists[r].append((key, shape, h))
        mine = sorted((k, tuple(sh), tuple(h)) for k, sh, h in obj)
        if mine != sorted(lists[g]):
            raise RuntimeError(
                f"rank {spec.rank}: Muon holds {mine[:2]}... differ from the plan's {sorted(lists[g])[:2]}..."
            )
        object_list[:] = lists

    return all_gather_object


def received(holds, owners) -> list[dict[str, int]]:
    """What each rank of the group receives per step, in bytes, counted from the receiving side: as owner, one
    copy of each piece it does not hold itself (pieces: distinct elements; replicas count once); as holder of a
    matrix it does not own, its elements back."""
    world = len(holds[0]) if holds else 1
    gather, back = [0] * world, [0] * world
    for row, o in zip(holds, owners):
        mine = row[o][0] if row[o] is not None else None
        gather[o] += sum(n for piece, n in {h[0]: h[1] for h in row if h is not None}.items() if piece != mine)
        for r, h in enumerate(row):
            if h is not None and r != o:
                back[r] += h[1]
    return [{"gather": 2 * g, "return": 2 * b} for g, b in zip(gather, back)]


def findings(w, plans: dict) -> list[str]:
    """(a), (b) over every stage of the layout, (c) over the simulated ranks (module docstring)."""
    some = plans[min(plans)]
    if getattr(some.args, "optimizer", "adamw") != "muon":
        return []
    s, out = setup_of(some), []
    G = muon_counts.stage_ranks(s)
    if G == 1:
        return []
    for pp in range(s.dims.pp):
        holds, owners, flops = muon_counts.exchange(s, pp)
        sent, got = muon_counts.sent_by_rank(s, pp), received(holds, owners)
        for k in ("gather", "return"):
            if sum(x[k] for x in sent) != sum(x[k] for x in got):
                out.append(
                    f"muon: stage {pp}: the {k} sends {sum(x[k] for x in sent)} B, receives {sum(x[k] for x in got)} B"
                )
        load = muon_counts.ns_flops_by_rank(s, pp)
        bound = theory.muon_lpt_bound(flops, G)
        if sum(load) != sum(flops) or max(load) > bound:
            out.append(
                f"muon: stage {pp}: owners' NS FLOPs {max(load)} (busiest) of {sum(load)} exceed the LPT bound "
                f"{bound:.0f} or miss the total {sum(flops)}"
            )
        for r, run in w.runs.items():
            if r // G != pp or not run.steps:
                continue
            ops = [
                o
                for o in run.events
                if o.op == "all_to_all_single" and o.site.startswith(SITE) and o.step == max(run.steps)
            ]
            calls = theory.muon_exchange_calls_per_step(holds, owners)  # one call: the return (a gather needs one)
            pairs = [(sent[r % G][k], got[r % G][k]) for k in ("gather", "return")][2 - calls :]
            if [(o.numel, o.out) for o in ops] != pairs:
                seen = [(o.numel, o.out) for o in ops]
                out.append(f"muon: rank {r}: the exchange's all_to_alls (bytes in, out) {seen} != theory's {pairs}")
    return out
