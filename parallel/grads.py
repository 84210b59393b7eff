"""What every rank must agree on about the gradients, whatever the layout: their global norm (and the
clip that uses it), and, under fp16, whether any of them overflowed.

Norm: a layout describes its gradients as items (`norm_items` builds them by name): (param, groups) for
a whole gradient, or (param, groups, lo, hi) for one original parameter's slice of a flat FSDP shard
gradient; `groups` are the process groups that gradient is sharded over. Squares are summed locally per
pattern of groups and all-reduced (SUM, one fp32 scalar each) over exactly those groups, so each element
counts once whatever the layout; replicated gradients (groups == ()) are counted once, with no
communication. `grad_groups` reads each parameter's groups off the model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from parallel import comm
from parallel.marks import shards_of


def grad_groups(model: torch.nn.Module) -> dict[str, tuple]:
    """For each parameter name, the process groups its gradient is sharded over: a DTensor's non-replicated
    mesh dims (Shard, or _StridedShard under FSDP2 over TP); the groups of our layers' shard marks (TP's, EP's:
    parallel/marks.mark_shard); none for replicated parameters."""
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            out[name] = tuple(p.device_mesh.get_group(i) for i, pl in enumerate(p.placements) if not pl.is_replicate())
        else:
            out[name] = tuple(m.group for m in shards_of(p))
    return out


def norm_items(
    entries: Iterable[tuple],
    groups: Mapping[str, tuple | None] | None = None,
    within: tuple = (),
    every_pattern: bool = False,
) -> list[tuple]:
    """Items for `clip_grad_norm_`, one per entry, in order. An entry is (name, param) for a whole gradient
    or (name, param, lo, hi) for its [lo, hi) slice; its groups are `within` + groups[name] (names not in
    `groups`: `within` alone), or None where groups[name] is None: a copy counted elsewhere (scaled, not
    measured). `every_pattern`: the list starts with one empty item per pattern (`within` + (), then
    `within` + each distinct value of `groups`), so every rank issues the same all-reduces in the same
    order even where it holds no slice of some parameter (FSDP's shards)."""
    groups = groups or {}
    items: list[tuple] = []
    if every_pattern:
        patterns = [(), *(g for g in groups.values() if g is not None)]
        items = [(torch.empty(0), within + g) for g in dict.fromkeys(patterns)]
    for name, p, *segment in entries:
        extra = groups.get(name, ())
        items.append((p, None if extra is None else within + extra, *segment))
    return items


@torch.no_grad()
def clip_grad_norm_(
    norm_groups: list[tuple], max_norm: float | None, across: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Global L2 norm of all gradients; scales them by min(1, max_norm / (norm + 1e-6)) if max_norm.

    Squares are summed locally per sharding pattern, then all-reduced over the groups that pattern is
    sharded over, so each gradient element is counted exactly once whatever the layout. Items are
    (param, groups) or (param, groups, lo, hi) for a slice of a flat shard's gradient; groups None marks a
    copy of a gradient counted elsewhere (PP's lm_head copy of the tied embedding): scaled, not measured.
    `across` (the pp group) holds disjoint parameters on each of its ranks: the total is summed over it
    once, after the per-pattern sums, because its ranks list different patterns in different orders."""
    by_groups: dict[tuple, list[torch.Tensor]] = {}  # what to measure
    to_scale: dict[int, torch.Tensor] = {}  # the gradients' own storage, to clip in place
    for p, groups, *segment in norm_groups:
        g = p.grad
        if g is None:
            continue
        if groups is None:
            to_scale[id(g)] = g.to_local() if isinstance(g, DTensor) else g
            continue
        if segment:  # (lo, hi): one original parameter's slice of a flat FSDP shard
            to_scale[id(g)] = g
            by_groups.setdefault(groups, []).append(g[segment[0] : segment[1]])
            continue
        if isinstance(g, DTensor):
            to_scale[id(g)] = g.to_local()
            if any(pl.is_partial() for pl in g.placements):  # e.g. LayerNorm grads under DTensor SP
                g = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
            g = g.to_local()
        else:
            to_scale[id(g)] = g
        by_groups.setdefault(groups, []).append(g)
    # Every rank must issue the same all-reduces in the same order, even for patterns of which it holds
    # no element (an FSDP rank may hold no slice of some parameter): walk the patterns in list order.
    total = None
    device = next(iter(to_scale.values())).device if to_scale else torch.device("cpu")
    for groups in dict.fromkeys(item[1] for item in norm_groups if item[1] is not None):
        grads = by_groups.get(groups, [])
        # fp64 accumulation: an fp32 norm of a 3.2M-element embedding gradient is off by ~6e-5 relative on
        # CPU, more than layouts differ by, so each layout would log (and clip by) a different number
        sq = (
            torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).pow(2).sum()
            if grads
            else torch.zeros((), dtype=torch.float64, device=device)
        )
        for g in groups:
            comm.all_reduce(sq, group=g, counted=False)  # a scalar: not counted as wrapper traffic
        total = sq if total is None else total + sq
    if across is not None:
        total = total if total is not None else torch.zeros((), dtype=torch.float64, device=device)
        comm.all_reduce(total, group=across, counted=False)  # a scalar: not counted as wrapper traffic
    norm = total.sqrt() if total is not None else torch.zeros((), dtype=torch.float64)
    if max_norm is not None:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(list(to_scale.values()), coef.float())
    return norm.float()


class AgreeingGradScaler(torch.amp.GradScaler):
    """fp16's GradScaler for gradients spread over ranks (FSDP shards, TP shards, localised DDP x TP).

    torch's GradScaler looks for inf/NaN only in the gradients this rank holds; with sharded gradients
    one rank could skip a step that the others take, and the loss scales drift apart silently. Here
    `unscale_` also all-reduces (MAX) every found-inf flag over `group` (default: all ranks), so every
    rank skips together and keeps the same scale. Communication: one scalar per device per step (uncounted),
    as in torch's ShardedGradScaler, which FSDP1 pairs with."""

    def __init__(self, device_type: str, group: dist.ProcessGroup | None = None):
        super().__init__(device_type)
        self.group = group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            for found_inf in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                comm.all_reduce(found_inf, group=self.group, op="max", counted=False)
