"""What a simulated rank needs of Muon (sim/fake_rank.py runs train.py's code on fake tensors and a fake process
group; sim/verify.py checks many), registered as Muon's `simulate` and `findings` (optim/concept.py):

- `simulate`: optim/build.matrices_of all-gathers what each rank of a stage holds of each Muon matrix
  (`all_gather_object`, host objects), which the fake backend cannot carry. A simulated rank gets every rank's list
  from the plan (optim/theory.stage_matrices: the layout's rules), as fake_rank answers a dispatch's split sizes
  with balanced ones; its own list must equal the plan's (else the run raises, and that is a finding). The
  exchange's `sources` (host bookkeeping on index tensors) runs on real tensors.
- `findings`: per stage, (a) every byte the exchange sends is received: summed over the group, what the ranks send
  (theory.muon_exchange_bytes_per_step, the sender's view) equals what they receive (`received`, the receiver's
  view, counted apart), gather and return each; (b) balanced owners: each rank's Newton-Schulz FLOPs at most
  Graham's LPT bound (theory.muon_lpt_bound), and the loads sum to every matrix once; (c) each simulated rank's
  recorded all_to_alls of the exchange (site optim.distributed_muon) send and receive the theory's bytes.
The exchange's all_to_alls move different sizes on different ranks (the owners differ), so sim.verify's collectives
check leaves their sizes out (Concept.uneven_sites); (c) holds them instead.

Nothing here runs in training: only the simulator asks the registry for it.
"""

from __future__ import annotations

import contextlib
from unittest import mock

from optim import theory

SITE = "optim.distributed_muon."


def answer_holds(spec, s):
    """An all_gather_object for a simulated rank of `spec` (`s`: the planner's view of its layout): Muon's holds
    from the plan (module docstring); any other object cannot be answered and raises."""

    def all_gather_object(object_list: list, obj, group=None) -> None:
        if not (isinstance(obj, list) and all(isinstance(x, tuple) and len(x) == 3 for x in obj)):
            raise RuntimeError("a simulated rank can all_gather_object only Muon's holds (optim/simulate.py)")
        G = theory.stage_ranks(s)
        pp, g = divmod(spec.rank, G)
        lists = [[] for _ in range(G)]
        for key, shape, row in theory.stage_matrices(s, pp):
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


@contextlib.contextmanager
def simulate(spec, s):
    """--optimizer muon's one host read at build answered from the plan (`answer_holds`), and the exchange's
    `sources` on real tensors; nothing without Muon."""
    if not theory.muon_on(s):
        yield
        return
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed import distributed_c10d as c10d

    from optim import distributed_muon

    fake, real = answer_holds(spec, s), distributed_muon.sources

    def sources(m, owner: int) -> list[int]:  # host bookkeeping (which ranks cover a matrix): real tensors
        with unset_fake_temporarily():
            return real(m, owner)

    with (
        mock.patch.object(c10d, "all_gather_object", fake),
        mock.patch.object(dist, "all_gather_object", fake),
        mock.patch.object(distributed_muon, "sources", sources),
    ):
        yield


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


def findings(w, s) -> list[str]:
    """(a), (b) over every stage of the layout, (c) over the simulated ranks of `w` (sim.verify's World; `s` the
    planner's view of the layout)."""
    if not theory.muon_on(s):
        return []
    out = []
    G = theory.stage_ranks(s)
    if G == 1:
        return []
    for pp in range(s.dims.pp):
        holds, owners, flops = theory.exchange(s, pp)
        sent, got = theory.sent_by_rank(s, pp), received(holds, owners)
        for k in ("gather", "return"):
            if sum(x[k] for x in sent) != sum(x[k] for x in got):
                out.append(
                    f"muon: stage {pp}: the {k} sends {sum(x[k] for x in sent)} B, receives {sum(x[k] for x in got)} B"
                )
        load = theory.ns_flops_by_rank(s, pp)
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
