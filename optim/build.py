"""The optimizer the trainer steps, for the layout `parallelize` made (train.build calls `make_optimizer`):
AdamW as the data-parallel wrapper makes it, or Muon + AdamW (optim/muon.py), with Muon's matrices found
where this rank holds them and orthogonalised across ranks (optim/distributed_muon.py)."""
from __future__ import annotations

import argparse

import torch

from optim.distributed_muon import Exchange, Matrix
from optim.flags import muon_settings
from optim.muon import Ledger, Muon, MuonAdamW, Slot, is_muon, one_process, whole_slot


def make_optimizer(par, args: argparse.Namespace, **adamw) -> torch.optim.Optimizer:
    """`args.optimizer` over `par` (a Parallelized): "adamw" as before (par.make_optimizer); "muon" with torch's
    Muon on one process's twin (`--implementation pytorch`), ours elsewhere."""
    if args.optimizer == "adamw":
        return par.make_optimizer(args.weight_decay, **adamw)
    muon = muon_settings(args)
    if args.implementation == "pytorch":  # config allows it only where every rank holds its matrices whole
        return one_process(list(par.model.named_parameters()), args.weight_decay, adamw, muon, reference=True)
    if par.fsdp is not None:
        return sharded(par.fsdp, args.weight_decay, adamw, muon, par.device)
    loss = par.mesh["loss"]
    if par.engine != "ddp" or not loss.enabled:  # every matrix here is this rank's alone (one process, a stage)
        return one_process(list(par.model.named_parameters()), args.weight_decay, adamw, muon)
    named = [(n, p) for n, p in par.model.named_parameters() if is_muon(n)]
    world = loss.size
    matrices = [Matrix(key, shape, ((0, shape[0] * shape[1]),) * world)
                for n, p in named for key, shape, _ in whole_slot(n, p).matrices]
    ledger = Ledger()
    opt = one_process(list(par.model.named_parameters()), args.weight_decay, adamw, muon,
                      orthogonalize=Exchange(matrices, loss.group, muon["ns_steps"], ledger, par.device))
    opt.muon.ledger = ledger
    return opt


def sharded(fsdp, weight_decay: float, adamw: dict, muon: dict, device: torch.device) -> MuonAdamW:
    """Our flat engine (ZeRO-1/2/3): Muon steps 1-D views of each matrix's elements in this rank's shard, AdamW
    views of the rest of the decay piece and the no-decay pieces whole; the views' gradients are bound to the
    shard gradients' before each step."""
    slots, matrices, decay_views, whole_rest, clear = [], [], [], [], []
    groups = {id(u.group) for u in fsdp.units}
    if len(groups) != 1:
        raise ValueError("Muon over units with their own groups (experts) is not built yet")
    for unit, spec, piece, lo, hi in fsdp.layout.slices():
        name = spec.names[0]
        S = unit.shard.numel()
        if is_muon(name):
            if len(spec.shape) != 2:
                raise ValueError(f"{name}: Muon over flat shards of expert weights is not built yet")
            matrices.append(Matrix(name, tuple(spec.shape), _ranges(spec, S, unit.world)))
            if piece is not None and hi > lo:
                slots.append(Slot(piece.detach()[lo:hi], lambda piece=piece, lo=lo, hi=hi: None if piece.grad is None
                                  else piece.grad[lo:hi], [(name, tuple(spec.shape), lambda t: t)]))
        elif piece is not None and hi > lo and _decay_piece(unit, piece):
            decay_views.append((piece.detach()[lo:hi], piece, lo, hi))
    for unit in fsdp.units:
        for (p, _, _), decay in zip(unit.pieces, unit.decay):
            (clear if decay else whole_rest).append(p)

    def bind() -> None:
        for view, piece, lo, hi in decay_views:
            view.grad = None if piece.grad is None else piece.grad[lo:hi]

    ledger = Ledger()
    ex = Exchange(matrices, fsdp.units[0].group, muon["ns_steps"], ledger, device)
    opt_muon = Muon(slots, orthogonalize=ex, **muon)
    opt_muon.ledger = ledger
    opt_adamw = torch.optim.AdamW([{"params": [v for v, *_ in decay_views], "weight_decay": weight_decay},
                                   {"params": whole_rest, "weight_decay": 0.0}], **adamw)
    return MuonAdamW(opt_muon, opt_adamw, muon["lr"], before_step=bind, also_clear=clear)


def _decay_piece(unit, piece) -> bool:
    return any(p is piece and d for (p, _, _), d in zip(unit.pieces, unit.decay))


def _ranges(spec, S: int, world: int) -> tuple[tuple[int, int], ...]:
    """For each rank r of a unit's group, the elements [a, b) of `spec`'s flattened parameter inside its shard
    [r S, (r + 1) S) of the unit's flat buffer ((0, 0) when none): parallel/flat_param's layout."""
    out = []
    for r in range(world):
        a, b = max(spec.offset, r * S), min(spec.offset + spec.numel, (r + 1) * S)
        out.append((a - spec.offset, b - spec.offset) if b > a else (0, 0))
    return tuple(out)
