"""Expert parallelism: each MoE layer's E experts split over the P ranks of an EP group, every token sent to the
rank that holds its expert and its output sent back (Lepikhin et al. 2020, GShard; Fedus et al. 2021, Switch).

What each rank stores: the dense parameters whole (as without EP), and of every MoE layer only its E/P experts,
experts [r·E/P, (r+1)·E/P) of EP rank r: slices along dim 0 of the stacked (E, in, out) weights, marked so
checkpoints and norms see where they sit (`parallel/marks.py`). EP borrows its ranks from the ones that hold the
same dense parameters and different tokens (the `loss` dim, dp x cp): EP rank r of group g is loss rank g·P + r.
The ranks that hold the same experts form the expert-data-parallel group (loss rank ≡ r mod P); expert gradients
are reduced over it, divided by the whole loss group's size, since each expert saw every EP rank's tokens.

One MoE layer's forward on each rank (`ExpertParallelDispatch`), per micro-batch:
1. route its own tokens (model/moe.py's `MoE`: the same routing as one process);
2. all_to_all of the per-expert row counts (P·E/P int64 each way), then one host read of the split sizes;
3. all_to_all of the rows, in expert order (each rank's rows for rank j's experts, to rank j), in the compute
   dtype (`moe.expert_rows`: bf16 under autocast, where ln_2's output is fp32; the experts' first matmul cast them
   anyway, so the same values arrive in half the bytes);
4. the local experts on their rows, grouped by expert (rows from source rank 0 first, then 1, ...);
5. all_to_all of the outputs back; each assignment's output lands in its (token, slot) place, and the combine
   (gate-weighted sum over the k slots, in slot order) runs as on one process.
Backward sends the gradients the same two ways. Bytes per MoE layer and micro-batch: the rows this rank sends,
twice forward and twice backward (`plan.theory.ep_all_to_all_bytes_per_micro_step`).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn

from model.gpt import init_parameter
from model.moe import Experts, balance_experts, expert_counts, expert_rows, moe_layers
from parallel import comm
from parallel.marks import mark_replicas, mark_shard


class _AllToAll(torch.autograd.Function):
    """Rows of x to the ranks of `group` (in_splits[j] rows to rank j), rank j's rows back (out_splits[j]);
    backward: the gradients the other way round."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group, unit="experts")
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        dx = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        comm.all_to_all_single(dx, grad.contiguous(), in_splits, out_splits, ctx.group, unit="experts")
        return dx, None, None, None


def expert_major(per: torch.Tensor, total: int) -> torch.Tensor:
    """Rows received as [source j][local expert e] blocks, per[j, e] rows each, `total` in all (known on the host:
    the split sizes) -> the index that reorders them to [expert e][source j] (an expert's rows together, its
    sources in rank order). On the device: no host read (repeat_interleave told its output size)."""
    P, L = per.shape
    sizes = per.reshape(-1)  # (P*L,) in [j][e] order
    starts = (sizes.cumsum(0) - sizes).view(P, L).t().reshape(-1)  # where each [e][j] block starts
    em = per.t().reshape(-1)  # (L*P,) block sizes in [e][j] order
    block = torch.repeat_interleave(torch.arange(L * P, device=per.device), em, output_size=total)
    within = torch.arange(block.shape[0], device=per.device) - (em.cumsum(0) - em)[block]
    return starts[block] + within


class ExpertParallelDispatch:
    """moe.MoE's `dispatch` under expert parallelism: this rank's assignments to the EP ranks holding their
    experts and their outputs back (the module docstring's steps 2-5). One host read per call: the split sizes
    of the all_to_alls (each rank must know how many rows it sends and receives before they move)."""

    def __init__(self, group: dist.ProcessGroup | None, experts: int):
        self.group, self.size, self.E = group, comm.world(group), experts

    def __call__(self, experts: Experts, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """x (N, C) and chosen (N, k) global expert indices -> each assignment's expert output (N, k, C)."""
        N, k = chosen.shape
        P, L = self.size, self.E // self.size
        flat = chosen.reshape(-1)  # (N*k,)
        order = torch.sort(flat, stable=True).indices  # by expert: so also by the rank that holds it
        counts = expert_counts(flat, self.E)  # (E,) this rank's rows per expert
        recv = torch.empty_like(counts)  # (P*L,): [source j][my expert e]
        comm.all_to_all_single(recv, counts, group=self.group, unit="expert counts")
        per = recv.view(P, L)
        send, got, local = self.split_sizes(counts, per, N * k)
        rows = _AllToAll.apply(expert_rows(x, order, k), got, send, self.group)  # [source j][expert e] blocks
        perm = expert_major(per, sum(got))
        y = experts(rows[perm], per.sum(0), local)  # (rows, C), expert-major
        y = torch.empty_like(y).index_copy_(0, perm, y)  # back to [source][expert]
        y = _AllToAll.apply(y, send, got, self.group)  # this rank's assignments, in `order`
        return torch.empty_like(y).index_copy_(0, order, y).view(N, k, -1)

    def split_sizes(
        self, counts: torch.Tensor, per: torch.Tensor, assignments: int
    ) -> tuple[list[int], list[int], list[int]]:
        """The one host read: (rows this rank sends to each EP rank, rows it receives from each, rows for each of
        its local experts), from its own counts (E,) and the received ones `per` (P, L). `assignments` (N·k, the
        rows sent in all) is what a simulated rank, whose tensors hold no values, answers with instead: balanced
        counts (sim/fake_rank.py `balanced_split_sizes`)."""
        P, L = per.shape
        sizes = torch.cat([counts.view(P, L).sum(1), per.sum(1), per.sum(0)]).tolist()
        return sizes[:P], sizes[P : 2 * P], sizes[2 * P :]


def apply_expert_parallel(
    model: nn.Module, ep, edp, seed: int | None = None, device: torch.device | None = None
) -> None:
    """Keep only EP rank `ep.rank`'s experts in every MoE layer (slices of materialised weights; on meta, with
    `seed`, init draws just those experts by name on `device`: no full-size tensor), mark them (`mark_shard` over
    "ep", `mark_replicas` over `edp`, the ranks with the same experts), and swap in the all_to_all dispatch.
    `ep`, `edp`: mesh dims."""
    config = next(m.config for m in model.modules() if hasattr(m, "config") and not callable(m.config))
    for i, moe in moe_layers(model):
        E = moe.router.weight.shape[0]
        L = E // ep.size
        mine = slice(ep.rank * L, (ep.rank + 1) * L)
        for lname, lin in (("c_fc", moe.experts.c_fc), ("c_proj", moe.experts.c_proj)):
            for attr in ("weight", "bias"):
                p = getattr(lin, attr)
                if p is None:
                    continue
                if p.is_meta and seed is not None:
                    name = f"transformer.h.{i}.mlp.experts.{lname}.{attr}"
                    part = init_parameter(name, tuple(p.shape), config, seed, rows=mine).to(device, p.dtype)
                else:
                    part = p.detach()[mine].clone() if not p.is_meta else torch.empty(p[mine].shape, device="meta")
                new = nn.Parameter(part, requires_grad=p.requires_grad)
                mark_shard(new, 0, ep.rank, ep.size, ep.group, "ep")
                mark_replicas(new, edp.group, edp.rank)
                setattr(lin, attr, new)
        moe.dispatch = ExpertParallelDispatch(ep.group, E)


class ExpertBalance:
    """The MoE layers' per-step statistics over the whole batch, on every layout alike. Each row's balancing loss
    counts the row's tokens wherever context parallelism put them (`reduce_counts`: a sum over mesh["cp"], and
    each cp rank's share 1/cp of the loss). After each optimizer step (`step`) every layer's
    tokens per expert and near ties are summed over mesh["loss"] (dp x cp: every row and token of the batch),
    the expert bias takes its step from those (moe.balance_experts), and for the record the layers of every
    pipeline stage are summed over mesh["pp"] into one (MoE layers, E + 1) tensor, by every stage, one without an
    MoE Block too (it adds zeros: a collective every rank of the group must join). Scalars of bookkeeping:
    recorded, not counted as wrapper traffic."""

    def __init__(self, model: nn.Module, mesh, device: torch.device):
        self.layers, self.mesh, self.device = moe_layers(model), mesh, device  # a pipeline stage's may be none
        config = next(m.config for m in model.modules() if hasattr(m, "config") and not callable(m.config))
        self.all = [i for i in range(config.n_layer) if config.is_moe(i)]
        self.E, self.with_aux = config.moe_num_experts, config.moe_aux_loss_coeff > 0
        self.rows = torch.tensor(
            [self.all.index(i) for i, _ in self.layers], dtype=torch.int64, device=device
        )  # mine among all
        cp = mesh["cp"]
        for _, moe in self.layers:
            if cp.enabled:
                moe.reduce_counts, moe.share = partial(_summed, group=cp.group), cp.size

    def step(self) -> dict[str, torch.Tensor]:
        """{"tokens": (MoE layers, E + 1) int64, each layer's tokens per expert and near ties over the batch;
        "aux": (MoE layers,) its balancing loss per micro-batch, the mean over the batch ranks}, every stage's
        layers, on the device."""
        loss, pp = self.mesh["loss"], self.mesh["pp"]
        tokens = torch.zeros(len(self.all), self.E + 1, dtype=torch.int64, device=self.device)
        per = torch.zeros(len(self.all), device=self.device)
        if self.layers:  # a stage with no MoE Block adds zeros, but joins the pp sum like every stage
            stats, aux = balance_experts(self.layers, partial(_summed, group=loss.group) if loss.enabled else None)
            tokens[self.rows], per[self.rows] = stats, aux / loss.size
        return (
            {"tokens": _summed(tokens, pp.group), "aux": _summed(per, pp.group)}
            if pp.enabled
            else {"tokens": tokens, "aux": per}
        )


def _summed(t: torch.Tensor, group) -> torch.Tensor:
    """t summed over `group` (in place; recorded, not counted: the MoE statistics are not wrapper traffic)."""
    comm.all_reduce(t, group=group, counted=False, unit="expert counts")
    return t
