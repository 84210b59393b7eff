"""Per-Block transforms, no parallelism in them, that parallelize (parallel/parallelize.py) applies after TP and
before FSDP/DDP (torchtitan's order): activation checkpointing, then torch.compile.

Both replace a Block's `forward` (an instance attribute), never the Block module itself. So the hooks our FSDP
and DDP put on the Block (gather before forward, re-gather before backward, gradient hooks on the parameters)
stay outside and run eagerly once per forward and once per backward.

- **Activation checkpointing** (`torch.utils.checkpoint`, non-reentrant). A checkpointed Block saves only its
  input in forward and recomputes its forward inside backward, when autograd first needs a tensor it would
  have saved. The recomputation replays the forward's RNG state (dropout is bit-identical) and re-runs the
  collectives inside the Block: our TP's all-gathers / all-reduces, counted again in `comm_bytes`. Under a
  zero-bubble schedule it runs while B's `defer` is open, so the split backward routes it as it routed the
  forward (parallel/pipeline/zero_bubble.py).
  `AC_COUNTER` counts the checkpointed forwards and their recomputations (train.py logs them per step).
  - `full` checkpoints every Block.
  - `selective` checkpoints every k-th Block (`every`, by global Block index, so every layout checkpoints
    the same Blocks). Saved activations fall by about (k-1)/k of full's saving, for 1/k of the recompute.
    We picked this over an op-level policy (save matmul/attention outputs, recompute the rest): an op policy
    sees aten ops through a dispatch mode, but our TP collectives are Python autograd Functions around c10d
    calls, so such a policy would silently re-run or drop them. Block granularity composes with every
    wrapper here, and its trade-off is one number.
- **torch.compile** compiles each Block's forward (after AC, so the checkpoint is inside the compiled
  region), and the loss head's per-chunk softmax and gradient (model/loss.compile_head). Hooks stay eager.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from model.loss import compile_head

AC_MODES = ("none", "full", "selective")


def blocks_by_index(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(global Block index, Block) of a GPT (ModuleList) or a pipeline stage (ModuleDict keyed by index)."""
    h = model.transformer.h
    return [(int(i), b) for i, b in h.items()] if isinstance(h, nn.ModuleDict) else list(enumerate(h))


def checkpointed(block: nn.Module) -> bool:
    return getattr(block, "_ac", False)


class RecomputeCounter:
    """Since `reset()`: `checkpointed`, forwards through a checkpointed Block; `recomputed`, how many of them
    backward ran again (checkpoint calling the forward's function a second time). Eager only: under
    torch.compile the checkpoint is traced into the compiled graph, whose recomputation nothing here sees."""

    def __init__(self) -> None:
        self.checkpointed = self.recomputed = 0

    def reset(self) -> None:
        self.checkpointed = self.recomputed = 0


AC_COUNTER = RecomputeCounter()  # one per process, as parallel/comm.COUNTER


def _checkpointed(inner):
    """A Block forward that runs `inner` through checkpoint, counted in AC_COUNTER."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # traced: the plain checkpoint, nothing of the counting
            return checkpoint(inner, x, use_reentrant=False, preserve_rng_state=True)
        calls = 0

        def run(x: torch.Tensor) -> torch.Tensor:
            nonlocal calls
            calls += 1
            if calls > 1:
                AC_COUNTER.recomputed += 1
            return inner(x)

        AC_COUNTER.checkpointed += 1
        return checkpoint(run, x, use_reentrant=False, preserve_rng_state=True)

    return forward


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 2) -> list[int]:
    """Checkpoint the Blocks `mode` picks ("full": all; "selective": index % every == 0); returns their
    global indices."""
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode must be one of {AC_MODES}, got {mode!r}")
    picked = []
    for i, block in blocks_by_index(model):
        if mode == "full" or (mode == "selective" and i % every == 0):
            block.forward, block._ac = _checkpointed(block.forward), True
            picked.append(i)
    return picked


def apply_compile(model: nn.Module) -> None:
    """torch.compile each Block's forward (its hooks stay eager), and the loss head's per-chunk kernels
    (model/loss.compile_head: its GEMMs stay eager)."""
    for _, block in blocks_by_index(model):
        block.forward = torch.compile(block.forward)
    compile_head(model)


def compiled_graphs() -> int:
    """Graphs torch.compile (dynamo) has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
