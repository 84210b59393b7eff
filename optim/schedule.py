"""The learning rate of step s: the same for every layout and optimizer (train.py sets each param group's lr from
it; bench.sweep and the tests recompute it)."""

from __future__ import annotations

import math


def lr_at(step: int, lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warmup over warmup_steps, then cosine decay to 10% of lr at max_steps (step is 1-based)."""
    it = step - 1
    if it < warmup_steps:
        return lr * (it + 1) / warmup_steps
    progress = (it - warmup_steps) / max(1, max_steps - warmup_steps)
    return lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))
