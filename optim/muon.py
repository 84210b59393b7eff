"""Muon on one process, written to equal `torch.optim.Muon` bit for bit, and the optimizer the trainer steps:
Muon on each Block's weight matrices, AdamW (torch's) on everything else.

Muon (Jordan et al. 2024; torch.optim.Muon), per weight matrix W with gradient G:
    B <- mu B + (1 - mu) G                       (momentum, `lerp`: elementwise)
    U <- G + mu (B - G)  if nesterov else B      (elementwise)
    O <- NS_k(U)                                 (Newton-Schulz: the whole matrix, in bf16)
    W <- W (1 - lr wd) - adjust(lr, shape) O     (elementwise)
Only NS_k needs the matrix whole; everything else is elementwise and runs on whatever piece a rank holds.
`orthogonalize` is the one place NS runs: on one process it orthogonalises each matrix here; a layout swaps
in optim/distributed_muon.py's, which sends each matrix to one owner rank and the result back.

Which matrices (`is_muon`): in each Block, attention's q, k, v (three matrices, as the model holds them:
Keller Jordan's and modded-nanogpt's choice, orthogonalising each of q, k, v on its own) and its output
projection, the MLP's c_fc and c_proj, and each expert's c_fc and c_proj one expert at a time (an
`ExpertLinear` weight (E, in, out) is E matrices (in, out)). AdamW keeps the embeddings and the tied head,
LayerNorms, biases and the MoE router (a gate, not a hidden layer: Moonlight keeps it out too).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from checkpoints.entries import ensure_optimizer_state, full_shape
from model.gpt import param_groups as adamw_groups
from parallel.marks import MOMENTS, shards_of
from runtime.device import DeviceTimer, HostTimer, make_timer

MOMENTUM = ("momentum_buffer",)  # Muon's per-element state, as torch.optim.Muon names it (it keeps no step count)

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)
EPS = 1e-7
MUON_WEIGHTS = re.compile(
    r"(^|\.)h\.\d+\.(attn\.c_[qkv]|attn\.c_proj|mlp\.c_fc|mlp\.c_proj|mlp\.experts\.c_fc|"
    r"mlp\.experts\.c_proj)\.weight$"
)


def is_muon(name: str) -> bool:
    """Whether the parameter called `name` (any wrapper prefix) is one Muon steps: a Block's weight matrix."""
    return MUON_WEIGHTS.search(name) is not None


def zeropower_via_newtonschulz(
    g: torch.Tensor, ns_steps: int, coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = EPS
) -> torch.Tensor:
    """k quintic Newton-Schulz steps towards the orthogonal factor of g (m, n), in bf16, the op order of
    torch.optim._muon._zeropower_via_newtonschulz (so that the bits agree): X = g / ||g||_F on the wide side,
    then X <- a X + (b A + c A^2) X with A = X X^T."""
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T  # (m, m), m = min(rows, cols)
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


def zeropower_batched(
    gs: list[torch.Tensor], ns_steps: int, coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = EPS
) -> list[torch.Tensor]:
    """`zeropower_via_newtonschulz` of each of gs, the matrices of one wide shape (m, n), m <= n (a tall matrix
    transposed, as NS does) stacked into one (B, m, n) bf16 tensor: per step one bmm and two baddbmm for the
    whole group, where one at a time makes 3 GEMMs per matrix. Each matrix divided by its own norm, then the op
    sequence of the single-matrix one; each slice is the same matrix product as one matrix's, and on the CPU
    the same bits whatever the batch holds (tests/test_muon.py); returned in gs' order and shapes."""
    a, b, c = coefficients
    groups: dict[tuple[int, int], list[int]] = {}
    for i, g in enumerate(gs):
        groups.setdefault((min(g.shape), max(g.shape)), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(gs)
    for members in groups.values():
        tall = [gs[i].size(0) > gs[i].size(1) for i in members]
        x = torch.stack([gs[i].bfloat16().T if t else gs[i].bfloat16() for i, t in zip(members, tall)])  # (B, m, n)
        x.div_(x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(ns_steps):
            gram = torch.bmm(x, x.mT)  # (B, m, m)
            gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, gram_update, x, beta=a)
        for i, t, xi in zip(members, tall, x.unbind(0)):
            out[i] = xi.T if t else xi
    return out


def ns_flops(shape: tuple[int, int], ns_steps: int) -> int:
    """Newton-Schulz's matmul FLOPs for one (rows, cols) matrix, m = min, n = max: per step X X^T (2 m^2 n),
    A A (2 m^3), (.) X (2 m^2 n)."""
    m, n = sorted(shape)
    return ns_steps * (4 * m * m * n + 2 * m**3)


def adjusted_lr(lr: float, adjust_lr_fn: str, shape: tuple[int, ...]) -> float:
    """torch.optim._muon._adjust_lr: "original" scales by sqrt(max(1, A/B)); "match_rms_adamw" by 0.2 sqrt(max(A, B))
    (Moonlight: the update's RMS then matches AdamW's, so AdamW's lr and weight decay carry over)."""
    A, B = shape[:2]
    ratio = math.sqrt(max(1, A / B)) if adjust_lr_fn == "original" else 0.2 * math.sqrt(max(A, B))
    return lr * ratio


class Piece(NamedTuple):
    """One matrix's update as this rank holds it: `key` names the matrix on every layout (the parameter's
    original name, and the expert's global index for an expert), `shape` is the whole matrix's, `update` this
    rank's elements of it (the whole matrix on one process; its `Hold` says which)."""

    key: str
    shape: tuple[int, int]
    update: torch.Tensor


class Ledger:
    """How many times this rank orthogonalised each matrix in the last step (by key): summed over the ranks,
    every Muon matrix must be 1 (none skipped, none done twice). Also what the benchmark reads: `ns_seconds()`,
    the time this rank spent in Newton-Schulz in the last step (`timer`: device.make_timer's, one pair of marks
    around the step's batched NS: on CUDA two events a step, whatever the matrices), and `sent_bytes`, what the
    layout's exchange sends per step from this rank (0 on one process)."""

    def __init__(self, timer: HostTimer | DeviceTimer | None = None) -> None:
        self.counts: Counter[str] = Counter()
        self.timer, self.marks, self.sent_bytes = timer or HostTimer(), [], 0

    def reset(self) -> None:
        self.counts.clear()
        self.marks.clear()

    def add(self, key: str) -> None:
        self.counts[key] += 1

    def newton_schulz(self, keys: list[str], gs: list[torch.Tensor], ns_steps: int) -> list[torch.Tensor]:
        """Count each of `keys` and orthogonalise their matrices gs, same shapes batched (`zeropower_batched`),
        timed as one interval."""
        for key in keys:
            self.add(key)
        self.marks.append(self.timer.mark())
        out = zeropower_batched(gs, ns_steps)
        self.marks.append(self.timer.mark())
        return out

    def ns_seconds(self) -> float:
        """Seconds in Newton-Schulz in the last step (syncs a device timer: call it after the step)."""
        t = self.timer.seconds(self.marks)
        return sum(b - a for a, b in zip(t[::2], t[1::2]))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def orthogonalize_locally(pieces: list[Piece], ns_steps: int, ledger: Ledger) -> list[torch.Tensor]:
    """One process (or a layout whose every rank holds every matrix whole and wants all of them): NS of each."""
    return ledger.newton_schulz([p.key for p in pieces], [p.update.view(p.shape) for p in pieces], ns_steps)


class Hold(NamedTuple):
    """Which elements of a matrix (R, C) one rank holds: TP's slice (`tp_dim` 0: rows [t R/n, (t+1) R/n); 1:
    columns likewise; -1: the whole matrix), then elements [lo, hi) of that slice flattened row-major (our flat
    engine's shard of it; all of it otherwise)."""

    tp_dim: int
    tp_rank: int
    tp_size: int
    lo: int
    hi: int

    def positions(self, shape: tuple[int, int], device: torch.device | str = "cpu") -> slice | torch.Tensor:
        """These elements' positions in the whole matrix flattened row-major, in this rank's order: a slice where
        they are consecutive (whole, row slices, flat ranges of them), else an index (column slices) made on
        `device` (the exchange's: built once there, so indexing a device tensor copies nothing from the host)."""
        R, C = shape
        if self.tp_dim == 1 and self.tp_size > 1:
            c = C // self.tp_size
            cols = self.tp_rank * c + torch.arange(c, device=device)
            return (torch.arange(R, device=device)[:, None] * C + cols[None, :]).reshape(-1)[self.lo : self.hi]
        base = self.tp_rank * (R // self.tp_size) * C if self.tp_dim == 0 else 0
        return slice(base + self.lo, base + self.hi)


@dataclass
class Slot:
    """One Muon parameter as the optimizer steps it: `param` (a tensor this rank holds), `grad()` its gradient
    (None: not this step), and its matrices: (key, whole shape, view of param's elements of it, hold) each, in
    order; `hold`: which elements of the whole matrix those are."""

    param: torch.Tensor
    grad: Callable[[], torch.Tensor | None]
    matrices: list[tuple[str, tuple[int, int], Callable[[torch.Tensor], torch.Tensor], Hold]]


def whole_slot(name: str, p: torch.Tensor) -> Slot:
    """A Muon parameter held as a tensor: a 2-D matrix, whole or TP's slice of it; or E experts (E, in, out), EP's
    share of the layer's (each expert's key carries its global index). On one process: the matrices whole."""
    name = name.removeprefix("module.")
    marks = {m.over: m for m in shards_of(p)}
    if p.dim() == 2:
        tp = marks.get("tp")
        hold = Hold(tp.dim, tp.rank, tp.size, 0, p.numel()) if tp else Hold(-1, 0, 1, 0, p.numel())
        return Slot(p, lambda: p.grad, [(name, full_shape(p)[:2], lambda t: t, hold)])
    ep, m = marks.get("ep"), p.shape[1] * p.shape[2]
    first = ep.rank * p.shape[0] if ep else 0
    return Slot(
        p,
        lambda: p.grad,
        [
            (f"{name}[{first + e}]", tuple(p.shape[1:]), lambda t, e=e: t[e], Hold(-1, 0, 1, 0, m))
            for e in range(p.shape[0])
        ],
    )


class Muon(torch.optim.Optimizer):
    """Muon over `slots` (one param group; `orthogonalize(pieces) -> results` runs NS, and may communicate).
    The state per parameter is its momentum buffer, in the parameter's own sharding."""

    def __init__(
        self,
        slots: list[Slot],
        lr: float,
        weight_decay: float,
        momentum: float,
        nesterov: bool,
        ns_steps: int,
        adjust_lr_fn: str,
        orthogonalize: Callable | None = None,
    ):
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        super().__init__([{"params": [s.param for s in slots]}], defaults)
        self.slots, self.ledger = slots, Ledger(make_timer(slots[0].param.device) if slots else None)
        self.orthogonalize = orthogonalize or (lambda pieces: orthogonalize_locally(pieces, ns_steps, self.ledger))

    @torch.no_grad()
    def step(self, closure=None):
        """Momentum for every slot with a gradient (foreach lerps), NS of every matrix (`orthogonalize`: batched,
        and it may communicate, so every rank calls it, with or without pieces), then weight decay (a foreach mul)
        and the update (a foreach add per distinct adjusted lr): torch.optim.Muon's elementwise ops, per tensor
        the same ones, so the same bits."""
        self.ledger.reset()
        group = self.param_groups[0]
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        stepped = [(slot, g) for slot in self.slots if (g := slot.grad()) is not None]
        grads, bufs = [g for _, g in stepped], [self._buffer(slot.param, g) for slot, g in stepped]
        if stepped:
            torch._foreach_lerp_(bufs, grads, 1 - mu)
        updates = torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] and stepped else bufs
        pieces = [
            Piece(key, shape, view(u))
            for (slot, _), u in zip(stepped, updates)
            for key, shape, view, _ in slot.matrices
        ]
        results = iter(self.orthogonalize(pieces))
        if not stepped:
            return
        torch._foreach_mul_([slot.param for slot, _ in stepped], 1 - lr * wd)
        by_lr: dict[float, tuple[list, list]] = {}  # -adjusted lr -> (the parameters' views, their NS results)
        for slot, _ in stepped:
            for _key, shape, view, _ in slot.matrices:
                views, outs = by_lr.setdefault(-adjusted_lr(lr, group["adjust_lr_fn"], shape), ([], []))
                views.append(view(slot.param))
                outs.append(next(results).view(views[-1].shape))
        for alpha, (views, outs) in by_lr.items():
            torch._foreach_add_(views, outs, alpha=alpha)

    def _buffer(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        return state["momentum_buffer"]


class MuonAdamW(torch.optim.Optimizer):
    """What the trainer steps: `muon` (ours or torch's) on the Block matrices and torch's `adamw` on the rest,
    as one optimizer. Both share one `param_groups` list and one `state` (their parameters are disjoint), so
    the lr schedule, the GradScaler and `zero_grad` see every group; a Muon group carries `base_lr` (its peak lr,
    optim.schedule.lr_at's input). `before_step`: what binds this step's gradients to the slots (flat shards' views).

    Checkpoints (checkpoints/entries.py asks `kinds`, `element_state`, `ensure_state`): a Block matrix keeps Muon's
    momentum, every other parameter AdamW's two moments, in whatever sharding the layout gives the parameter; under
    our flat engine the optimizer steps views of the shard pieces, and `stepped` maps (id(piece), lo, hi) to the
    view holding those elements (optim/build.sharded)."""

    name = "muon"  # what a checkpoint records as its --optimizer

    def __init__(
        self,
        muon: torch.optim.Optimizer,
        adamw: torch.optim.Optimizer,
        muon_lr: float,
        before_step: Callable[[], None] | None = None,
        also_clear: list[torch.Tensor] = (),
        stepped: dict[tuple[int, int, int], torch.Tensor] | None = None,
    ):
        self.muon, self.adamw, self.before_step, self.also_clear = muon, adamw, before_step, list(also_clear)
        self.stepped = stepped or {}
        for g in muon.param_groups:
            g["base_lr"] = muon_lr
        super().__init__(adamw.param_groups + muon.param_groups, adamw.defaults)  # the same group dicts
        self.state = adamw.state
        self.state.update(muon.state)
        muon.state = self.state

    @property
    def ledger(self) -> Ledger | None:
        return getattr(self.muon, "ledger", None)

    @torch.no_grad()
    def step(self, closure=None):
        if self.before_step is not None:
            self.before_step()
        self.adamw.step()
        self.muon.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.also_clear:
            p.grad = None

    def kinds(self, name: str) -> tuple[str, ...]:
        """The per-element state parameter `name` keeps: Muon's momentum for a Block matrix, else AdamW's moments."""
        return MOMENTUM if is_muon(name) else MOMENTS

    def element_state(self, name: str, p: torch.Tensor, lo: int = 0, hi: int | None = None) -> dict[str, torch.Tensor]:
        """{kind: 1-D view of the live state} of elements [lo, hi) of `p` flattened (a parameter, or a flat shard
        piece whose elements this optimizer steps through a view)."""
        q, a, b = self.stepped[id(p), lo, hi] if (id(p), lo, hi) in self.stepped else (p, lo, hi)
        return {k: self.state[q][k].view(-1)[a:b] for k in self.kinds(name)}

    def ensure_state(self) -> None:
        """The state a first step makes, without changing a parameter, so that a checkpoint can load into it:
        AdamW's (zero moments, step 0; checkpoint_entries.ensure_optimizer_state) and Muon's zero momentum."""
        ensure_optimizer_state(self.adamw)
        for group in self.muon.param_groups:
            for p in group["params"]:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def split_named(named: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]], list]:
    """(Muon's, AdamW's) of named parameters, the tied weight once."""
    seen, muon, rest = set(), [], []
    for n, p in named:
        if id(p) in seen:
            continue
        seen.add(id(p))
        (muon if is_muon(n) else rest).append((n, p))
    return muon, rest


def one_process(
    named: list[tuple[str, torch.Tensor]], weight_decay: float, adamw: dict, muon: dict, reference: bool = False
) -> MuonAdamW:
    """Every parameter whole on this rank: ours, or with `reference` torch.optim.Muon (the twin; `muon`'s keys are
    torch's). AdamW: model.param_groups's groups."""
    mine, rest = split_named(named)
    opt_adamw = torch.optim.AdamW(adamw_groups(rest, weight_decay), **adamw)
    if reference:
        opt_muon = torch.optim.Muon([p for _, p in mine], **muon)
    else:
        opt_muon = Muon([whole_slot(n, p) for n, p in mine], **muon)
    return MuonAdamW(opt_muon, opt_adamw, muon["lr"])


def rounding_rtol(
    shapes: list[tuple[int, int]], adjust_lr_fn: str, lrs: list[float], grad_norms: list[float], losses: list[float]
) -> float:
    """How far a layout's loss may sit from one process's, relatively, because Muon's Newton-Schulz runs in bf16
    on gradients that a layout rounds differently (its fp32 sums in another order), to first order.

    A gradient element within rounding of a bf16 boundary may round to the neighbouring bf16 value, and NS's
    bf16 products then re-round: bound each element of the output O of matrix m by one bf16 spacing, 2u |O|
    (u = 2^-8). NS's singular values lie in (0.5, 1.5) (torch.optim.Muon's docstring), so ||O||_F <= 1.5
    sqrt(min(A, B)), and step s moves the weights by dW_s with ||dW_s|| <= 2u * 1.5 * lr_s * sqrt(sum_m adj_m^2
    min_m) (adj_m: `adjusted_lr`'s ratio). The loss at step t then moves by <g_t, sum_{s<t} dW_s> <= ||g_t||
    sum_{s<t} ||dW_s||. Returns the largest such bound over the steps, over the loss. `lrs`, `grad_norms`,
    `losses`: one process's, per step."""
    u = 2.0**-8
    per_lr = 3 * u * math.sqrt(sum(adjusted_lr(1.0, adjust_lr_fn, s) ** 2 * min(s) for s in shapes))
    worst, moved = 0.0, 0.0
    for lr, g, loss in zip(lrs, grad_norms, losses):
        worst = max(worst, g * moved / abs(loss))
        moved += per_lr * lr
    return worst
