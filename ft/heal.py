"""What a rejoining replica group takes from a live peer, rank by rank: torchft's checkpoint transport carries it
from the peer's rank r to the rejoining group's rank r (the groups run one layout, so their ranks hold the same
elements).

The state is checkpoints/entries.py's view of this rank: every element it holds of each parameter and of its
optimizer state (AdamW's two moments, or a Muon matrix's momentum), in entry order, plus the optimizer's step count
and hyperparameters (`checkpoint.optimizer_state`) and the training step. Each tensor is copied out to the CPU
whole (a view would carry its whole storage: an FSDP flat shard per parameter); the receiver copies each into its
own live storage. Nothing is read from or written to disk.
"""

from __future__ import annotations

import torch

from checkpoints.checkpoint import load_optimizer_state, optimizer_state
from checkpoints.entries import entries


class HealError(RuntimeError):
    """The peer's state does not fit this rank's: another layout, model or optimizer."""


def _views(parallelized, optimizer: torch.optim.Optimizer) -> tuple[list[str], list[torch.Tensor]]:
    """(labels, 1-D views of the live storage), in entry order: each entry's parameter, then its optimizer state."""
    labels, views = [], []
    for e in entries(parallelized, optimizer):
        for kind, view in e.tensors.items():
            labels.append(f"{e.name}[{e.span[0]}:{e.span[1]}].{kind}")
            views.append(view)
    return labels, views


def state(parallelized, optimizer: torch.optim.Optimizer, step: int, group: int) -> dict:
    """This rank's training state after `step`, copied to the CPU (what a peer sends)."""
    labels, views = _views(parallelized, optimizer)
    return {
        "group": group,
        "step": step,
        "labels": labels,
        "values": [v.detach().to("cpu", copy=True) for v in views],
        "optimizer": optimizer_state(parallelized.checkpoint_optimizer(optimizer)),
    }


@torch.no_grad()
def load(sent: dict, parallelized, optimizer: torch.optim.Optimizer) -> int:
    """Copy a peer's `state` into this rank's live storage; returns its step. HealError if it does not fit."""
    labels, views = _views(parallelized, optimizer)
    sizes = [v.numel() for v in views]
    if sent["labels"] != labels or [v.numel() for v in sent["values"]] != sizes:
        raise HealError(
            f"replica group {sent['group']}'s state does not fit this rank's ({len(sent['labels'])} tensors against "
            f"{len(labels)}): every group must run the same flags"
        )
    for view, value in zip(views, sent["values"]):
        view.copy_(value)
    load_optimizer_state(parallelized.checkpoint_optimizer(optimizer), sent["optimizer"])
    parallelized.dp.after_optimizer_step()  # the shards changed: ZeRO-1/2 regather their kept full copies
    return int(sent["step"])


def nbytes(sent: dict) -> int:
    return sum(v.numel() * v.element_size() for v in sent["values"])
