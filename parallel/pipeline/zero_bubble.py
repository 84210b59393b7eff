"""The split backward of the zero-bubble schedules: B computes a chunk's input gradient, W its weight gradients later.

How (Megatron's / Qi et al.'s WeightGradStore). A store is built over a model's linears (`routable`: each nn.Linear
and our TP's column/row-parallel linears, not lm_head, whose chunked head_loss makes its gradients in forward).
While a chunk runs under `WeightGradStore.defer(key)` (its F, and its B), and only then, those modules' linear
product is swapped for `_InputGradLinear` (nn.Linear: its `forward`; our TP linears: their `linear` attribute, the
F.linear inside their forward, so their communication stays where it is); no other op is touched, and outside
`defer` the modules are their own. Its backward computes only dx = dy W, and pushes (x, dy) to the store under
`key`, the (chunk, micro) whose forward ran it; `WeightGradStore.flush(key)` (the schedule's W action) then
computes dW = dy^T x and db = sum(dy) and accumulates them. Nothing runs twice: B never computes a linear's dW, and
W runs only those two products. Everything else of the backward (LayerNorm, embeddings, the chunked lm_head + loss)
stays in B.

Bit-identity with the whole backward. The products are those autograd computes for F.linear on a contiguous
(B, T, in) input (aten addmm / mm backward, derivatives.yaml): dx = dy2 @ W, dW = dy2^T @ x2, db = dy2 summed
over rows, with dy2, x2 the (B·T, ·) views, in the compute dtype under autocast (inputs cast as autocast's
F.linear casts them; dx and dW cast back as its ToCopy backward does); and W adds dW to .grad in place as
AccumulateGrad does. W actions run each chunk's micro-batches in the order its B's ran, so every .grad sums
the same terms in the same order as under 1F1B: ZB-H1's gradients are 1F1B's bit for bit
(tests/test_zero_bubble.py). A linear on any other input (2D, non-contiguous) is left to autograd whole.

Where W's gradients land. A weight that is a leaf parameter (no data parallelism, DDP, TP): its `.grad`. A
weight that is a view of a flat buffer (our ZeRO/FSDP engine, parallel/data_parallel/flat_param.py: a unit's parameters
are views of its `flat` leaf, new views at each gather): the unit's gradient of that B, which the engine's
post-accumulate hook hands to `hold_for_w` instead of reducing it, when the B deferred linears on that flat
(`defers`, recorded at forward). B has filled it except at the deferred slices (zeros there, from autograd's
split backward); W adds each dW into its slice (0 + dW: exact) and then calls the engine back with the
completed gradient, in the order the B's hooks ran, which reduces it exactly as it would have at B.

Activation checkpointing. A checkpointed Block recomputes its forward inside B's backward, and B runs under
`defer` of the same key as its F: the swapped modules route the recompute as they routed the forward (the
swap is process state, not a thread-local mode, so it also holds where autograd runs on its own thread); the
recomputation pushes (x, dy) for W, recomputed once for B and W together.

Memory: per deferred linear, x and dy stay from B until W (what W needs; the rest of the chunk's graph is freed at
B: x is pushed detached, as its history would hold the chunk's input and its gradient until W); under autocast its
weight's compute-dtype copy from F until B, one per weight shared by every micro-batch in flight (`cast_once`, as
autocast's cache shares it for autograd's linears); under TP with sequence parallelism, a column-parallel linear's
x is the all-gathered (B, T, C) input (one storage shared by q, k, v; autograd saves the same from F to B under
1F1B), and a row-parallel one's dy is the all-gathered output gradient. Under the sharding engine, one full unit
gradient (padded, compute dtype) per (unit, key) from B until W. Communication: none here; TP's stay in B (dx), W
needs none (dW = dy^T x of local tensors); a data-parallel reduction runs after the last W that feeds it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from functools import partial
from typing import Callable, Hashable

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.moe import ExpertLinear, grouped_linear, runs_grouped


class _InputGradLinear(torch.autograd.Function):
    """y = F.linear(x, weight, bias); backward: dx only, (x, dy) pushed to the store for W. The parameters come
    in a tuple, so autograd sees no edge to them: their AccumulateGrad (and the post-accumulate hooks of a
    data-parallel wrapper) do not run in B for them; W accumulates."""

    @staticmethod
    def forward(ctx, x, params, store, key):
        weight, bias = params
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        with torch.autocast(kind, enabled=False):
            xc, wc = (x.to(dtype), cast_once(weight, dtype)) if dtype is not None else (x, weight)  # autocast's casts
            bc = bias.to(dtype) if bias is not None and dtype is not None else bias
            y = F.linear(xc, wc, bc)
        ctx.save_for_backward(xc, wc)
        ctx.store, ctx.key, ctx.x_dtype = store, key, x.dtype
        ctx.weight, ctx.bias = weight, bias
        for p in params:
            if p is not None and p._base is not None:
                store.defers[key].add(id(p._base))  # a flat buffer's view: its unit's gradient waits for W
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, wc = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])  # (B·T, out)
        dx = dy2.mm(wc).view(xc.shape).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        ctx.store.push(ctx.key, ctx.weight, ctx.bias, xc.detach(), dy2)
        return dx, None, None, None


_CASTS: dict[tuple[int, torch.dtype], tuple] = {}  # (id(weight), dtype) -> (weakref(weight), version, weakref(cast))


def cast_once(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight.to(dtype), made once and shared by every micro-batch in flight: what autocast's own cast cache does for
    autograd's F.linear (one copy of a leaf weight per autocast region), which a cast made with autocast off, as
    _InputGradLinear's must be, bypasses, so each (chunk, micro-batch) would save its own copy from F until B.

    The copy is looked up by the weight's identity and version (a view of a flat buffer re-gathered, or a weight
    stepped, is another weight: a new copy) and held only weakly: it lives while some micro-batch's B still needs it
    (autograd holds it as a saved tensor) and is freed after the last one's, so a step holds at most one copy per
    weight, never one per micro-batch, and none between steps. The same bits as a fresh cast."""
    key = (id(weight), dtype)
    hit = _CASTS.get(key)
    if hit is not None:
        owner, version, ref = hit
        cast = ref()
        if cast is not None and owner() is weight and version == weight._version:
            return cast
    cast = weight.to(dtype)

    def forget(dead, key=key):
        if _CASTS.get(key, (None, None, None))[2] is dead:
            del _CASTS[key]

    _CASTS[key] = (weakref.ref(weight), weight._version, weakref.ref(cast, forget))
    return cast


class _InputGradGrouped(torch.autograd.Function):
    """The MoE experts' product (moe.grouped_linear: rows grouped by expert times each expert's (in, out)
    weight); backward: dx only, as autograd computes it, and (x, dy, the groups) pushed to the store for W, which
    computes each expert's dW = x_e^T dy_e as autograd would (the grouped kernel where the forward ran it, else
    per expert). Under autocast, x and the weight are cast once, as autograd's casts of each expert's matmul
    give the same values, and grouped_linear on the cast operands, autocast off, picks the kernel it picks under
    autocast without the store (moe.grouped_mm_runs: the same device and compute dtype), so B and W issue 1F1B's
    products op for op: the per-expert loop, or torch._grouped_mm on both paths (bf16 on sm90/sm100)."""

    @staticmethod
    def forward(ctx, x, params, store, key, ends, sizes):
        (weight,) = params
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        with torch.autocast(kind, enabled=False):
            xc, wc = (x.to(dtype), cast_once(weight, dtype)) if dtype is not None else (x, weight)
            y = grouped_linear(xc, wc, ends, sizes)
            ctx.grouped = runs_grouped(xc, wc)  # the path it took, for W's product (a flag: nothing allocated)
        ctx.save_for_backward(xc, wc, ends)
        ctx.store, ctx.key, ctx.x_dtype, ctx.weight, ctx.sizes = store, key, x.dtype, weight, sizes
        if weight._base is not None:
            store.defers[key].add(id(weight._base))  # a flat buffer's view: its unit's gradient waits for W
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, wc, ends = ctx.saved_tensors
        dx = (
            grouped_linear(dy, wc.transpose(1, 2), ends, ctx.sizes).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        )
        ctx.store.push(ctx.key, ctx.weight, None, xc.detach(), dy, (ends, ctx.sizes, ctx.grouped))
        return dx, None, None, None, None, None


def _grouped_weight_grad(
    x: torch.Tensor, dy: torch.Tensor, ends: torch.Tensor, sizes: list[int] | None, grouped: bool
) -> torch.Tensor:
    """(E, in, out): each expert's x_e^T dy_e, by the path its forward took (`grouped`: torch._grouped_mm, else
    the per-expert loop), with autograd's products on either."""
    if grouped:
        return torch._grouped_mm(x.t(), dy, offs=ends)
    sizes = sizes if sizes is not None else torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    return torch.stack([xe.t() @ ge for xe, ge in zip(x.split(sizes), dy.split(sizes))])


def routable(name: str, module: nn.Module) -> bool:
    """The linears a store defers: nn.Linear, our TP's linears and the MoE experts' stacked linears (a `linear`
    attribute), lm_head excluded."""
    from parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    return name.rpartition(".")[2] != "lm_head" and (
        type(module) is nn.Linear or isinstance(module, (ColumnParallelLinear, RowParallelLinear, ExpertLinear))
    )


_ACTIVE: list[tuple["WeightGradStore", Hashable]] = []  # the (store, key) of each open `defer`, innermost last


def hold_for_w(base: torch.Tensor, grad: torch.Tensor, done: Callable[[torch.Tensor], None]) -> bool:
    """For a sharding engine's post-accumulate hook on a flat leaf `base`: if the B running now deferred linears
    on views of `base`, keep `grad` (its gradient from that B) for the W of the same key, which adds the
    deferred weight gradients into it and then calls `done(grad)`; returns whether it was kept."""
    if not _ACTIVE:
        return False
    store, key = _ACTIVE[-1]
    if id(base) not in store.defers.get(key, ()):
        return False
    store.held[key].append((base, grad, done))
    return True


def split_backward(stage: nn.Module, engine: nn.Module | None = None) -> WeightGradStore:
    """What the composition hands a pipeline runner for the split schedules (PipelineRunner's `split_backward`):
    the store of their deferred weight gradients over `stage`'s linears, built on the first split step. Under our
    sharding engine (`engine`) a unit whose linears B deferred is complete only after the W that computes them:
    the engine then hands that B's unit gradient to the store (`hold_for_w`), and the W reduces it exactly as B
    would have: 1F1B's collectives and bytes per (unit, micro-batch), moved from B to W (ZeRO-2/3's last
    reduce-scatter waited for when the step exits), at the cost of one full unit gradient (padded, compute dtype)
    held from B to W per deferred (unit, micro-batch). ZeRO-3 still frees the gathered unit at B: W needs x and
    dy."""
    if engine is not None:
        engine.defer_reduction = hold_for_w
    return WeightGradStore(stage)


class WeightGradStore:
    """One rank's deferred weight gradients: per key (chunk, micro), the (weight, bias, x, dy) of each linear
    its B ran, and the flat-buffer gradients held for them (`hold_for_w`), kept until `flush(key)`. `model`:
    the module whose `routable` linears may be deferred (a pipeline stage). Stores tensors only; communicates
    nothing."""

    def __init__(self, model: nn.Module):
        self.modules = [m for name, m in model.named_modules() if routable(name, m)]
        self.pending: dict[Hashable, list[tuple]] = defaultdict(list)
        self.defers: dict[Hashable, set[int]] = defaultdict(set)  # key -> id of each flat its F deferred on
        self.held: dict[Hashable, list[tuple]] = defaultdict(list)  # key -> [(flat, its gradient, callback)]

    @contextlib.contextmanager
    def defer(self, key: Hashable):
        """Inside, the store's linears compute only their input gradient in backward (F and B of `key`)."""
        _ACTIVE.append((self, key))
        swapped = [self._swap(m, key) for m in self.modules]
        try:
            yield
        finally:
            for m, attr, before in swapped:
                if before is None:
                    del m.__dict__[attr]
                else:
                    m.__dict__[attr] = before
            _ACTIVE.pop()

    def _swap(self, m: nn.Module, key: Hashable) -> tuple[nn.Module, str, object]:
        attr = "forward" if type(m) is nn.Linear else "linear"
        before = m.__dict__.get(attr)
        m.__dict__[attr] = (
            partial(self._forward, m, key)
            if attr == "forward"
            else partial(self._grouped, key)
            if isinstance(m, ExpertLinear)
            else partial(self._linear, key)
        )
        return m, attr, before

    def _grouped(
        self, key: Hashable, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, sizes: list[int] | None = None
    ) -> torch.Tensor:
        if torch.is_grad_enabled() and weight.requires_grad:
            return _InputGradGrouped.apply(x, (weight,), self, key, ends, sizes)
        return grouped_linear(x, weight, ends, sizes)

    def _forward(self, m: nn.Linear, key: Hashable, x: torch.Tensor) -> torch.Tensor:
        return self._linear(key, x, m.weight, m.bias)

    def _linear(
        self, key: Hashable, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if torch.is_grad_enabled() and weight.requires_grad and x.dim() == 3 and x.is_contiguous():
            return _InputGradLinear.apply(x, (weight, bias), self, key)
        return F.linear(x, weight, bias)

    def push(
        self,
        key: Hashable,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        x: torch.Tensor,
        dy2: torch.Tensor,
        groups: tuple | None = None,
    ) -> None:
        """What W needs of one product: (x, dy), and for the experts' grouped one its groups (ends, sizes, and
        whether its forward ran torch._grouped_mm)."""
        self.pending[key].append((weight, bias, x, dy2, groups))

    @torch.no_grad()
    def flush(self, key: Hashable) -> None:
        """W: dW = dy^T x and db = sum of dy over rows for every linear `key`'s B ran, added to .grad in place
        (set where it is None), or into the held gradient of the flat buffer they are views of, in the order B
        met them; then each held gradient goes back to its engine, in the order B held them."""
        held = {id(base): grad for base, grad, _ in self.held.get(key, [])}
        for weight, bias, x, dy2, groups in self.pending.pop(key, []):
            if groups is not None:  # the experts': (E, in, out)
                dw = _grouped_weight_grad(x, dy2, *groups).to(weight.dtype)
            else:
                dw = dy2.t().mm(x.reshape(-1, x.shape[-1])).to(weight.dtype)  # (out, in)
            _accumulate(weight, dw, held)
            del dw  # not alive beside the next product and its fp32 cast
            if bias is not None:
                _accumulate(bias, dy2.sum(0).to(bias.dtype), held)  # (out,)
        self.defers.pop(key, None)
        for _, grad, done in self.held.pop(key, []):
            done(grad)

    def held_tensors(self) -> dict[Hashable, tuple]:
        """Every tensor the store keeps, by key (what a step holds: _Step.held)."""
        out = {(k, i): (x, dy) for k, items in self.pending.items() for i, (_, _, x, dy, _) in enumerate(items)}
        out.update({(k, "held", i): g for k, items in self.held.items() for i, (_, g, _) in enumerate(items)})
        return out

    def __len__(self) -> int:
        return len(self.pending) + len(self.held)


def _accumulate(p: torch.Tensor, g: torch.Tensor, held: dict[int, torch.Tensor]) -> None:
    """AccumulateGrad's rule outside autograd: .grad += g in place, or .grad = g when there is none; for a view
    of a flat buffer, += into its slice of the buffer's held gradient."""
    if p._base is None:
        if p.grad is None:
            p.grad = g
        else:
            p.grad += g
        return
    grad = held.get(id(p._base))
    if grad is None:
        raise RuntimeError(
            "a deferred linear's weight is a view of a flat buffer whose gradient no B held "
            "(parallel/zero_bubble.hold_for_w)"
        )
    offset = p.storage_offset() - p._base.storage_offset()
    grad[offset : offset + p.numel()].view(p.shape).add_(g)
