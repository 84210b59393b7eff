"""The split backward of the zero-bubble schedules: B computes a chunk's input gradient, W its weight gradients later.

How (Megatron's / Qi et al.'s WeightGradStore). While a chunk runs under `WeightGradStore.defer(key)`, every
`F.linear(x, weight, bias)` on a parameter of the stage is routed through `_InputGradLinear` (a torch function
mode: the model does not know). Its backward computes only dx = dy W, and pushes (x, dy) to the store under
`key`, the (chunk, micro) whose forward ran it; `WeightGradStore.flush(key)` (the schedule's W action) then
computes dW = dy^T x and db = sum(dy) and accumulates them into `.grad`. Nothing runs twice: B never computes
a linear's dW, and W runs only those two products. Everything else of the backward (LayerNorm, embeddings,
the chunked lm_head + loss, whose dW needs the logits' gradient that only its backward has) stays in B.

Bit-identity with the whole backward. The products are those autograd computes for F.linear on a contiguous
(B, T, in) input (aten addmm / mm backward, derivatives.yaml): dx = dy2 @ W, dW = dy2^T @ x2, db = dy2 summed
over rows, with dy2, x2 the (B·T, ·) views, in the compute dtype under autocast (inputs cast as autocast's
F.linear casts them; dx and dW cast back as its ToCopy backward does); and W adds dW to .grad in place as
AccumulateGrad does. W actions run each chunk's micro-batches in the order its B's ran, so every .grad sums
the same terms in the same order as under 1F1B: ZB-H1's gradients are 1F1B's bit for bit
(tests/test_zero_bubble.py). A linear on any other input (2D, non-contiguous) is left to autograd whole.

Activation checkpointing. A torch function mode is not active inside autograd's backward, where a checkpointed
Block recomputes its forward (under the mode in F, plain in the recompute: checkpoint then refuses the other
saved tensors). So B, also run under `defer`, names its key in `_ACTIVE`, and parallel/blocks.py's checkpoint
opens `recompute_context()`, which routes the recompute's linears under that key: the recomputation pushes
(x, dy) for W, recomputed once for B and W together.

Memory: per deferred linear, x and dy stay from B until W (what W needs; the rest of the chunk's graph is
freed at B). Communication: none; the data-parallel reduction runs after the last W (DDP's reduce_on_exit
wraps the whole schedule).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Hashable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class _InputGradLinear(torch.autograd.Function):
    """y = F.linear(x, weight, bias); backward: dx only, (x, dy) pushed to the store for W. The parameters come
    in a tuple, so autograd sees no edge to them: their AccumulateGrad (and the post-accumulate hooks of a
    data-parallel wrapper) do not run in B; W accumulates."""

    @staticmethod
    def forward(ctx, x, params, store, key):
        weight, bias = params
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        with torch.autocast(kind, enabled=False):
            xc, wc = (x.to(dtype), weight.to(dtype)) if dtype is not None else (x, weight)  # autocast's casts
            bc = bias.to(dtype) if bias is not None and dtype is not None else bias
            y = F.linear(xc, wc, bc)
        ctx.save_for_backward(xc, wc)
        ctx.store, ctx.key, ctx.x_dtype = store, key, x.dtype
        ctx.weight, ctx.bias = weight, bias
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, wc = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])  # (B·T, out)
        dx = dy2.mm(wc).view(xc.shape).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        ctx.store.push(ctx.key, ctx.weight, ctx.bias, xc, dy2)
        return dx, None, None, None


class _RouteLinears(TorchFunctionMode):
    """Sends F.linear on `params` (grad enabled, contiguous 3D input) through _InputGradLinear under `key`."""

    def __init__(self, store: "WeightGradStore", key: Hashable):
        super().__init__()
        self.store, self.key = store, key

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (id(weight) in self.store.params and weight.requires_grad and x.dim() == 3 and x.is_contiguous()
                    and (bias is None or id(bias) in self.store.params)):
                return _InputGradLinear.apply(x, (weight, bias), self.store, self.key)
        return func(*args, **kwargs)


_ACTIVE: list[tuple["WeightGradStore", Hashable]] = []  # the (store, key) of each open `defer`, innermost last


def recompute_context() -> contextlib.AbstractContextManager:
    """What a checkpointed Block's recomputation runs inside: the innermost open `defer`'s routing (the B that
    triggered it), or nothing."""
    return _RouteLinears(*_ACTIVE[-1]) if _ACTIVE else contextlib.nullcontext()


class WeightGradStore:
    """One rank's deferred weight gradients: per key (chunk, micro), the (weight, bias, x, dy) of each linear
    its B ran, kept until `flush(key)`. `params`: the parameters whose linears may be deferred (a stage's own).
    Stores tensors only; communicates nothing."""

    def __init__(self, params: Iterator[nn.Parameter]):
        self.params = {id(p) for p in params}
        self.pending: dict[Hashable, list[tuple]] = defaultdict(list)

    @contextlib.contextmanager
    def defer(self, key: Hashable):
        """Inside, linears on the stage's parameters compute only their input gradient in backward."""
        _ACTIVE.append((self, key))
        try:
            with _RouteLinears(self, key):
                yield
        finally:
            _ACTIVE.pop()

    def push(self, key: Hashable, weight: nn.Parameter, bias: nn.Parameter | None, x: torch.Tensor,
             dy2: torch.Tensor) -> None:
        self.pending[key].append((weight, bias, x, dy2))

    @torch.no_grad()
    def flush(self, key: Hashable) -> None:
        """W: dW = dy^T x and db = sum of dy over rows for every linear `key`'s B ran, added to .grad in place
        (set where it is None), in the order B met them."""
        for weight, bias, x, dy2 in self.pending.pop(key, []):
            dw = dy2.t().mm(x.reshape(-1, x.shape[-1])).to(weight.dtype)  # (out, in)
            _accumulate(weight, dw)
            if bias is not None:
                _accumulate(bias, dy2.sum(0).to(bias.dtype))  # (out,)

    def held(self) -> dict[Hashable, tuple]:
        """Every tensor the store keeps, by key (for parallel.pipeline.held_bytes)."""
        return {(k, i): (x, dy) for k, items in self.pending.items() for i, (_, _, x, dy) in enumerate(items)}

    def __len__(self) -> int:
        return len(self.pending)


def _accumulate(p: nn.Parameter, g: torch.Tensor) -> None:
    """AccumulateGrad's rule outside autograd: .grad += g in place, or .grad = g when there is none."""
    if p.grad is None:
        p.grad = g
    else:
        p.grad += g
