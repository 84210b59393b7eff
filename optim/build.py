"""The optimizer the trainer steps, for the layout `parallelize` made (train.build calls `make_optimizer`):
AdamW as the data-parallel wrapper makes it, or Muon + AdamW (optim/muon.py), with each Muon matrix found where
this rank holds it and orthogonalised once, on one owner, across the ranks of its pipeline stage
(optim/distributed_muon.py).

What a rank holds of a matrix (a `Hold`) is read off the layout: a parameter held whole, or TP's slice of it
(`mark_shard` over "tp"), or EP's experts (over "ep": the global index of each expert), and under our flat
engine the elements [lo, hi) of that local tensor in this rank's flat shard. Every rank of the stage then says
what it holds once, at build (`all_gather_object`), so that every rank knows every matrix's holders."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from model.gpt import param_groups as adamw_groups
from optim.distributed_muon import Exchange, Matrix
from optim.flags import muon_settings
from optim.muon import Hold, Ledger, Muon, MuonAdamW, Slot, is_muon, one_process, whole_slot
from parallel.groups import group_timeout, new_groups
from runtime.device import make_timer


def make_optimizer(parallelized, args: argparse.Namespace, **adamw) -> torch.optim.Optimizer:
    """`args.optimizer` over `parallelized` (a Parallelized): "adamw" as before (parallelized.make_optimizer); "muon"
    with torch's
    Muon on a twin (`--implementation pytorch`: config allows it only where every rank holds its matrices whole),
    ours elsewhere."""
    if args.optimizer == "adamw":
        return parallelized.make_optimizer(args.weight_decay, **adamw)
    muon = muon_settings(args)
    if args.implementation == "pytorch":
        return one_process(list(parallelized.model.named_parameters()), args.weight_decay, adamw, muon, reference=True)
    group, size = stage_group(parallelized.mesh)
    if size == 1:  # one process, or a pipeline stage on one rank: its matrices are its own, whole
        return one_process(list(parallelized.model.named_parameters()), args.weight_decay, adamw, muon)
    if parallelized.fsdp is not None:
        slots, opt_adamw, bind, clear, stepped = sharded(parallelized.fsdp, args.weight_decay, adamw)
    else:
        named = list(parallelized.model.named_parameters())
        slots = [whole_slot(n, p) for n, p in _unique(named) if is_muon(n)]
        opt_adamw = torch.optim.AdamW(
            adamw_groups([(n, p) for n, p in _unique(named) if not is_muon(n)], args.weight_decay), **adamw
        )
        bind, clear, stepped = None, [], {}
    ledger = Ledger(make_timer(parallelized.device))
    ex = Exchange(matrices_of(slots, group, size), group, muon["ns_steps"], ledger, parallelized.device)
    opt_muon = Muon(slots, orthogonalize=ex, **muon)
    opt_muon.ledger = ledger
    return MuonAdamW(opt_muon, opt_adamw, muon["lr"], before_step=bind, also_clear=clear, stepped=stepped)


def stage_group(mesh) -> tuple[dist.ProcessGroup | None, int]:
    """The ranks of this rank's pipeline stage (every dim but pp: they hold all the stage's matrices between
    them) and their number: the world's group without a pipeline, else one new group per stage (every rank makes
    every stage's, in order)."""
    dims = mesh.dims
    size = dims.world_size // dims.pp
    if size == 1 or dims.pp == 1:
        return None, size
    lists = [list(range(p * size, (p + 1) * size)) for p in range(dims.pp)]
    return new_groups(lists, group_timeout()), size


def matrices_of(slots: list[Slot], group, size: int) -> list[Matrix]:
    """Every matrix of the stage, with what each of its `size` ranks holds: each rank's (key, shape, hold)s,
    all-gathered once (host objects)."""
    mine = [(key, shape, hold) for s in slots for key, shape, _, hold in s.matrices]
    everyone = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    shapes, holds = {}, {}
    for r, items in enumerate(everyone):
        for key, shape, hold in items:
            shapes[key] = tuple(shape)
            holds.setdefault(key, [None] * size)[r] = Hold(*hold)
    return [Matrix(k, shapes[k], tuple(holds[k])) for k in sorted(shapes)]


def sharded(fsdp, weight_decay: float, adamw: dict):
    """Our flat engine (ZeRO-1/2/3): Muon steps 1-D views of each matrix's elements in this rank's shard; AdamW
    steps views of the rest of each decay piece, and the no-decay pieces whole. Returns (slots, AdamW, what
    binds the AdamW views' gradients to the shards' before a step, the pieces whose gradients zero_grad clears,
    {(id(piece), lo, hi): (the view stepped, 0, hi - lo)}: where a checkpoint finds the state of those elements)."""
    slots, decay_views, whole_rest, clear, stepped = [], [], [], [], {}
    for unit, spec, piece, lo, hi in fsdp.layout.slices():
        name = spec.names[0]
        if piece is None or hi <= lo:
            continue
        if is_muon(name):
            a, b, _ = fsdp.layout.held(unit, spec)  # the same elements, counted in the parameter
            slots.append(_flat_slot(name, spec.shape, fsdp.shard_marks.get(name, ()), piece, (lo, hi), a, b))
            stepped[id(piece), lo, hi] = (slots[-1].param, 0, hi - lo)
        elif any(p is piece and d for (p, _, _), d in zip(unit.pieces, unit.decay)):
            decay_views.append((piece.detach()[lo:hi], piece, lo, hi))
            stepped[id(piece), lo, hi] = (decay_views[-1][0], 0, hi - lo)
    for unit in fsdp.units:
        for (p, _, _), decay in zip(unit.pieces, unit.decay):
            (clear if decay else whole_rest).append(p)

    def bind() -> None:
        for view, piece, lo, hi in decay_views:
            view.grad = None if piece.grad is None else piece.grad[lo:hi]

    opt = torch.optim.AdamW(
        [
            {"params": [v for v, *_ in decay_views], "weight_decay": weight_decay},
            {"params": whole_rest, "weight_decay": 0.0},
        ],
        **adamw,
    )
    return slots, opt, bind, clear, stepped


def _flat_slot(
    name: str, shape: torch.Size, marks: tuple, piece: torch.Tensor, at: tuple[int, int], lo: int, hi: int
) -> Slot:
    """Elements at[0]:at[1] of a flat shard piece (and of its .grad) are elements [lo, hi) of a local parameter of
    `shape` (its TP or EP slice: `marks`), flattened."""
    view = piece.detach()[at[0] : at[1]]
    grad = lambda: None if piece.grad is None else piece.grad[at[0] : at[1]]  # noqa: E731
    by = {m.over: m for m in marks}
    if len(shape) == 2:
        tp = by.get("tp")
        hold = Hold(tp.dim, tp.rank, tp.size, lo, hi) if tp else Hold(-1, 0, 1, lo, hi)
        whole = [*shape]
        if tp:
            whole[tp.dim] *= tp.size
        return Slot(view, grad, [(name, tuple(whole), lambda t: t, hold)])
    ep = by.get("ep")
    first, m = (ep.rank * shape[0] if ep else 0), shape[1] * shape[2]
    matrices = []
    for e in range(shape[0]):  # expert e's elements [e m, (e + 1) m) of the local tensor, where they meet [lo, hi)
        a, b = max(lo, e * m), min(hi, (e + 1) * m)
        if b > a:
            matrices.append(
                (
                    f"{name}[{first + e}]",
                    tuple(shape[1:]),
                    lambda t, a=a, b=b: t[a - lo : b - lo],
                    Hold(-1, 0, 1, a - e * m, b - e * m),
                )
            )
    return Slot(view, grad, matrices)


def _unique(named):
    seen = set()
    for n, p in named:
        if id(p) not in seen:
            seen.add(id(p))
            yield n, p
