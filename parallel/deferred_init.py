"""Deferred init's last step: a model built on `meta` gets real storage and its init values, rank-locally, for
whatever the parallelisms before it left on meta (`parallelize` step 3). TP and EP materialise their own slices
as they cut (parallel/tensor_parallel/apply.py, parallel/expert_parallel/dispatch.py), our sharding engine one unit at
a time (parallel/data_parallel/fsdp.py); here, the rest, DTensor parameters as their local slices only.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from model.gpt import init_parameter


def materialize(model: nn.Module, seed: int, device: torch.device) -> None:
    """Give the parameters and buffers still on meta real storage and the init rule's values, rank-locally
    (buffers: zero, the MoE bias and counters). What a step before made real (TP's shards, EP's experts) keeps
    its values. A DTensor parameter gets only its local slice of the full init value (`src_data_rank=None`: no
    communication). Tied weights keep a single storage. A model with nothing on meta is left alone."""
    named = [*model.named_parameters(), *model.named_buffers()]
    if not any(t.is_meta for _, t in named):
        return
    kept = {name: t.detach().clone() for name, t in named if not t.is_meta}  # by name: to_empty makes new tensors
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(kept[name]) if name in kept else b.zero_()
        for name, p in model.named_parameters():
            if name in kept:
                p.copy_(kept[name])
                continue
            full = init_parameter(name, p.shape, model.config, seed).to(device)
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(full)
    t = model.transformer
    if "wte" in t and hasattr(model, "lm_head") and getattr(model, "both_ends", True):  # re-tie (not a PP copy)
        model.lm_head.weight = t.wte.weight
