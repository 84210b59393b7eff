"""The mixture-of-experts layer that replaces a Block's MLP (`MoE`: Switch / GShard, dropless), its router,
its experts (`Experts`, E stacked MLPs over rows grouped by expert) and their one-rank dispatch, the side
losses a forward collects (`SideLosses`), and the step's balancing (`balance_experts`). Knows no parallelism:
expert parallelism swaps `MoE.dispatch` (parallel/expert_parallel/dispatch.py). model/gpt.py's Block builds an `MoE`
from its
GPTConfig; this module imports nothing of model/gpt.py: `MoEConfig` names the fields it reads (arrows point down).
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F


class MoEConfig(Protocol):
    """What an MoE layer reads of the model's config (model.GPTConfig has these)."""

    n_embd: int
    bias: bool
    moe_num_experts: int
    moe_top_k: int
    moe_aux_loss_coeff: float
    moe_bias_update_rate: float

    @property
    def expert_hidden(self) -> int: ...


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype x's matmuls run in: autocast's where autocast is on for x's device and casts x (a floating type
    narrower than float64), else x's own."""
    kind = x.device.type
    on = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
    return torch.get_autocast_dtype(kind) if on and x.is_floating_point() and x.dtype != torch.float64 else x.dtype


def grouped_mm_runs(device: torch.device, dtype: torch.dtype, k: int, n: int) -> bool:
    """Whether torch._grouped_mm multiplies rows (r, k) by E matrices (k, n) in `dtype` on `device` as a kernel of
    its own, reading nothing back to the host; else moe.grouped_linear loops over the experts. From the dtype and
    sizes alone: it allocates nothing.
    - CPU: fp32 (its CPU kernel, the same products as the loop; under bf16 autocast the loop, as ever, eagerly);
    - an accelerator: bf16 where its device module (torch.get_device_module) reports compute capability 9.x or
      10.x: the fast path of torch's CUDA _grouped_mm (CUTLASS, sm90/sm100; not on ROCm). Anywhere else it reads
      the group ends back (offs.cpu()) and loops itself: a hidden host sync per call, where the loop needs one
      per layer;
    - inside torch.compile: bf16 only, wherever it is a kernel (the CPU's included: torch 2.13's traced
      _grouped_mm takes bf16 only, and on the CPU gives the loop's bits, forward and backward; tests), so a
      compiled MoE layer keeps the grouped kernel in bf16;
    - rows and columns 16-byte aligned."""
    es = dtype.itemsize
    if not hasattr(torch, "_grouped_mm") or (k * es) % 16 or (n * es) % 16:
        return False
    if torch.compiler.is_compiling():
        if dtype != torch.bfloat16:
            return False
        if device.type == "cpu":
            return True
    if device.type == "cpu":
        return dtype == torch.float32
    if dtype != torch.bfloat16 or torch.version.hip or device.type == "meta":
        return False
    capability = getattr(torch.get_device_module(device), "get_device_capability", None)
    cap = capability(device) if capability is not None else None  # (major, minor) on CUDA
    return isinstance(cap, tuple) and cap[0] in (9, 10)


def runs_grouped(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether grouped_linear(x, w, ...) takes torch._grouped_mm here (`grouped_mm_runs` in the dtype both operands
    compute in); else its loop, which needs the group sizes on the host."""
    dtype = compute_dtype(x)
    return dtype == compute_dtype(w) and grouped_mm_runs(x.device, dtype, w.shape[1], w.shape[2])


def expert_rows(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """The rows of x (N, C) the assignments `order` (indices a into N·k, token a // k) take to their experts, in the
    compute dtype (`compute_dtype`): gathered first, so backward sums a token's k slot gradients in x's dtype, as
    without the cast; then cast as the experts' first matmul would cast them (the same values reach it), so an
    all_to_all (expert parallelism) moves them in the compute dtype, not fp32 under autocast."""
    return x[order // k].to(compute_dtype(x))


def grouped_linear(
    x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, sizes: list[int] | None = None
) -> torch.Tensor:
    """Rows of x (n, K) grouped by expert times each group's w[e] (K, N): (n, N), in x's compute dtype
    (`compute_dtype`). `ends` (E,) int32: each group's end row (a cumulative sum of the group sizes, on x's
    device); `sizes`: the same on the host, for the loop where torch._grouped_mm does not run (`grouped_mm_runs`;
    the grouped kernel and the loop give the same numbers on CPU: tests).
    - The grouped kernel: under autocast (which has no rule for it) x and w cast to the compute dtype, as
      autocast casts a matmul's operands, and the kernel run with autocast off.
    - The loop: one matmul per expert over w.unbind(0), under autocast if it is on. Not w[e]: each select's
      backward makes a zero (E, K, N) tensor, E of them summed (E^2 K N); unbind's stacks the E gradients once.
      Inside torch.compile the loop is one custom op (`expert_loop`, operands cast as the grouped kernel's), so
      its host read of the sizes is no graph break."""
    if runs_grouped(x, w):
        dtype = compute_dtype(x)
        with no_autocast(x.device.type):
            return torch._grouped_mm(x.to(dtype), w.to(dtype), offs=ends)
    if x.is_meta:  # shapes only (debug.diff's module order): no sizes to read
        return x.new_empty(x.shape[0], w.shape[2], dtype=compute_dtype(x))
    if torch.compiler.is_compiling():  # the loop as one op the graph holds whole: its host read runs, not traced
        dtype = compute_dtype(x)
        with no_autocast(x.device.type):
            return expert_loop(x.to(dtype), w.to(dtype), ends)[0]
    if not x.shape[0]:
        return x @ w[0]
    sizes = sizes if sizes is not None else torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    return torch.cat([xe @ we for xe, we in zip(x.split(sizes), w.unbind(0))])


@torch.library.custom_op("gpt_moe::expert_loop", mutates_args=())
def expert_loop(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """grouped_linear's per-expert loop as one custom op, for torch.compile where torch._grouped_mm is no kernel
    (fp32): the graph holds the op whole, so the host read of the group sizes (`ends`, on x's device) happens when
    the op runs, with no graph break. x (n, K) and w (E, K, N) of one dtype (grouped_linear casts them, autocast
    off) -> (the eager loop's products (n, N), the group sizes (E,) (ends' dtype) on the host: backward's split, read
    with no second sync)."""
    sizes = torch.diff(ends, prepend=ends.new_zeros(1)).cpu()  # the one host read
    if not x.shape[0]:
        return x @ w[0], sizes
    return torch.cat([xe @ we for xe, we in zip(x.split(sizes.tolist()), w.unbind(0))]), sizes


@expert_loop.register_fake
def _(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape[0], w.shape[2]), torch.empty(w.shape[0], dtype=ends.dtype, device="cpu")


@torch.library.custom_op("gpt_moe::expert_loop_backward", mutates_args=())
def expert_loop_backward(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, sizes: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_loop's gradients as autograd makes the eager loop's: per expert dx_e = dy_e w_e^T and dW_e = x_e^T dy_e
    (MmBackward's products on row-major operands), dx the experts' rows in order, dW (E, K, N) stacked; `sizes` the
    forward's host copy of the group sizes."""
    sizes = sizes.tolist()
    pairs = list(zip(x.split(sizes), dy.split(sizes), w.unbind(0)))
    dx = torch.cat([dye.mm(we.t()) for _, dye, we in pairs])
    return dx, torch.stack([xe.t().mm(dye) for xe, dye, _ in pairs])


@expert_loop_backward.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


def _expert_loop_setup(ctx, inputs: tuple, output: tuple) -> None:
    ctx.save_for_backward(inputs[0], inputs[1], output[1])


def _expert_loop_grad(ctx, dy: torch.Tensor, _sizes_grad):
    x, w, sizes = ctx.saved_tensors
    dx, dw = expert_loop_backward(dy, x, w, sizes)
    return dx, dw, None


expert_loop.register_autograd(_expert_loop_grad, setup_context=_expert_loop_setup)


class ExpertLinear(nn.Module):
    """E linears stacked, weight (E, in, out) and bias (E, out), applied to rows grouped by expert."""

    linear = staticmethod(grouped_linear)  # the product alone: a zero-bubble schedule swaps it

    def __init__(self, experts: int, n_in: int, n_out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, n_in, n_out))
        self.bias = nn.Parameter(torch.empty(experts, n_out)) if bias else None

    def forward(self, x: torch.Tensor, ends: torch.Tensor, expert: torch.Tensor, sizes: list[int] | None = None):
        y = self.linear(x, self.weight, ends, sizes)  # (n, out)
        return y if self.bias is None else y + self.bias[expert].to(y.dtype)  # expert: (n,) each row's


class Experts(nn.Module):
    """E GPT-2 MLPs (C -> H -> C, GELU): `forward(x, counts)` runs rows grouped by expert, counts[e] rows each.
    Expert parallelism keeps only this rank's experts here (experts [first, first + E_local) of the layer)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        E, C, H = config.moe_num_experts, config.n_embd, config.expert_hidden
        self.c_fc = ExpertLinear(E, C, H, config.bias)
        self.c_proj = ExpertLinear(E, H, C, config.bias)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        ends = counts.cumsum(0).to(torch.int32)  # (E_local,)
        expert = torch.repeat_interleave(
            torch.arange(len(counts), device=x.device), counts, output_size=x.shape[0]
        )  # (n,): each row's local expert
        h = F.gelu(self.c_fc(x, ends, expert, sizes), approximate="tanh")  # (n, H)
        return self.c_proj(h, ends, expert, sizes)  # (n, C)


def route(scores: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts of each row of `scores` (N, E) by scores + bias, ties broken stably (the lower expert index
    first: a stable sort), so equal scores route alike on every layout. Returns (chosen (N, k), the margin
    between each row's k-th and (k+1)-th biased score (N,): how near it came to another choice)."""
    biased = scores + bias
    values, order = torch.sort(biased, dim=-1, descending=True, stable=True)
    margin = values[:, k - 1] - values[:, k] if biased.shape[1] > k else torch.full_like(values[:, 0], float("inf"))
    return order[:, :k], margin


class LocalDispatch:
    """How an MoE layer's assignments reach its experts on one rank: rows sorted by expert (stably: token order
    within an expert), each expert's rows through it, back to (token, slot) order. Expert parallelism swaps in
    a dispatcher that sends each row to the rank holding its expert (parallel/expert_parallel/dispatch.py)."""

    def __call__(self, experts: Experts, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """x (N, C) and chosen (N, k) -> each assignment's expert output (N, k, C)."""
        N, k = chosen.shape
        flat = chosen.reshape(-1)  # (N*k,): assignment a = (token a // k, slot a % k)
        order = torch.sort(flat, stable=True).indices  # assignments grouped by expert
        counts = expert_counts(flat, experts.c_fc.weight.shape[0])
        rows = expert_rows(x, order, k)
        # the per-expert loop needs the group sizes on the host (one read); torch._grouped_mm takes them on the
        # device, and under torch.compile the loop is one op (moe.expert_loop) that reads them when it runs
        on_device = rows.is_meta or runs_grouped(rows, experts.c_fc.weight) or torch.compiler.is_compiling()
        sizes = None if on_device else self.split_sizes(counts, N * k)
        y = experts(rows, counts, sizes)  # (N*k, C), in `order`
        return torch.empty_like(y).index_copy_(0, order, y).view(N, k, -1)

    def split_sizes(self, counts: torch.Tensor, assignments: int) -> list[int]:
        """The one host read: rows per expert, from counts (E,). `assignments` (N·k, the rows in all) is what a
        simulated rank, whose tensors hold no values, answers with instead: balanced counts (sim/fake_rank.py
        `balanced_local_sizes`), as under expert parallelism."""
        return counts.tolist()


def expert_counts(chosen: torch.Tensor, experts: int) -> torch.Tensor:
    """(E,) int64: how many of `chosen` (expert indices) each expert got. A scatter-add, not bincount: bincount's
    output size depends on the data, which a GPU would read back."""
    return torch.zeros(experts, dtype=torch.int64, device=chosen.device).scatter_add_(
        0, chosen, torch.ones_like(chosen, dtype=torch.int64)
    )


_SIDE: list["SideLosses"] = []  # the open collections, innermost last


class SideLosses:
    """Loss terms that layers add during a forward besides the head's (the MoE balancing loss): open one with
    `with SideLosses() as side:` around a forward; `side.total` is their sum (None when none was added).
    A recomputed forward (activation checkpointing, inside backward) adds nothing: it is not the forward."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None

    def __enter__(self) -> "SideLosses":
        _SIDE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _SIDE.remove(self)

    @staticmethod
    def add(term: torch.Tensor) -> None:
        if _SIDE and first_forward():
            side = _SIDE[-1]
            side.total = term if side.total is None else side.total + term


def first_forward() -> bool:
    """Not inside a backward pass: a forward, not activation checkpointing's recomputation of one."""
    return torch._C._current_graph_task_id() == -1


class MoE(nn.Module):
    """A mixture of E experts in place of a Block's MLP (Switch / GShard, dropless).

    Router: scores = softmax(x W_r^T) in fp32 or wider (N, E); each token picks its top k by scores + `expert_bias`
    (stably: `route`), and its gates are its chosen scores renormalised over the k. Output: the sum over its k
    experts of gate * expert(x), summed in slot order. Every token reaches its k experts (no capacity).
    Balancing, both as the field does it, off by default:
    - the auxiliary loss (`moe_aux_loss_coeff` a): per sequence, a * E * sum_e f_e * P_e, f_e the share of the
      row's assignments that chose e, P_e its tokens' mean score, averaged over the rows and added to the
      objective through `SideLosses` (`aux_loss`);
    - the auxiliary-loss-free bias (`moe_bias_update_rate` u, DeepSeek-V3): after each optimizer step
      bias_e += u * sign(mean load - load_e) (`balance_experts`), the loads counted over the whole step's batch.
    Statistics over a row's tokens are whole-row numbers on every layout: `reduce_counts` (set by context
    parallelism) sums them over the ranks holding other tokens of the same rows.
    Knows no parallelism: `dispatch` (LocalDispatch) is what expert parallelism swaps. `load` counts this
    step's assignments per expert, `near_ties` the tokens whose k-th choice beat the next by less than
    `near_tie_margin` (a routing that rounding could flip between layouts), for the step's record."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        E = config.moe_num_experts
        self.k, self.aux_coeff, self.bias_rate = (
            config.moe_top_k,
            config.moe_aux_loss_coeff,
            config.moe_bias_update_rate,
        )
        self.router = nn.Linear(config.n_embd, E, bias=False)
        self.experts = Experts(config)
        self.register_buffer("expert_bias", torch.zeros(E))  # state: checkpointed, equal on every layout
        self.register_buffer("load", torch.zeros(E, dtype=torch.int64), persistent=False)
        self.register_buffer("near_ties", torch.zeros((), dtype=torch.int64), persistent=False)
        self.register_buffer("aux_sum", torch.zeros(()), persistent=False)  # this step's balancing loss, summed
        self.forwards = 0  # micro-batches this step (first forwards: not recomputations)
        self.dispatch = LocalDispatch()
        self.reduce_counts = None  # counts (B, E + 1) int64 -> summed over the ranks holding the rows; None: local
        self.share = 1  # this rank's share of its micro-batch's aux loss is 1/share of it (context parallelism)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        xf = x.reshape(-1, C)  # (N, C)
        dtype = torch.promote_types(x.dtype, torch.float32)  # routing in fp32 (or float64) on every layout
        with no_autocast(x.device.type):
            scores = F.linear(xf.to(dtype), self.router.weight.to(dtype)).softmax(-1)  # (N, E)
        chosen, margin = route(scores.detach(), self.expert_bias, self.k)  # (N, k)
        gates = scores.gather(1, chosen)
        gates = gates / gates.sum(-1, keepdim=True)  # (N, k), renormalised over the chosen
        y = self.dispatch(self.experts, xf, chosen)  # (N, k, C)
        y = (y * gates.unsqueeze(-1).to(y.dtype)).sum(1)  # (N, C): slot 0 + slot 1 + ..., the same order everywhere
        if torch.is_grad_enabled():
            counts = expert_counts(chosen.reshape(-1), scores.shape[1])
            # recomputed under activation checkpointing too: the recomputation must save what the forward saved
            aux = self.aux_loss(scores, chosen, B) if self.aux_coeff else None
            if first_forward():
                self.load += counts
                self.near_ties += (margin < near_tie_margin(x)).sum()
                self.forwards += 1
                if aux is not None:
                    self.aux_sum += aux.detach()
                    SideLosses.add(aux)
        return y.view(B, T, C)

    def aux_loss(self, scores: torch.Tensor, chosen: torch.Tensor, B: int) -> torch.Tensor:
        """This rank's share of the balancing loss of its B rows, per row (sequence) and then their mean:
        a * E * sum_e f_{b,e} P_{b,e}, f the share of row b's assignments that chose e, P its tokens' mean score
        for e. Per row, not per micro-batch: a row's loss does not depend on which rows share its micro-batch,
        so every layout's micro-batches give the same objective (DeepSeek-V3's sequence-wise form; a batch-wise
        one would change with the micro-batch size under gradient accumulation). Under context parallelism a
        row's tokens sit on several ranks: f and the row's token count from all of them (`reduce_counts`), P's
        sum from this rank's tokens; the ranks' shares (x `share` = cp, each loss averaged over them) add up."""
        E, k = scores.shape[1], self.k
        rows = torch.arange(B, device=chosen.device).repeat_interleave(chosen.numel() // B)  # each assignment's row
        counts = torch.zeros(B * (E + 1), dtype=torch.int64, device=chosen.device)
        counts.scatter_add_(0, rows * (E + 1) + chosen.reshape(-1), torch.ones_like(rows))  # (B, E) assignments
        counts = counts.view(B, E + 1)
        counts[:, E] = counts[:, :E].sum(1) // k  # the row's tokens
        if self.reduce_counts is not None:
            counts = self.reduce_counts(counts)
        tokens = counts[:, E:].float()  # (B, 1)
        f = counts[:, :E].float() / (tokens * k)  # (B, E), no gradient
        P = scores.view(B, -1, E).sum(1) / tokens  # (B, E): this rank's part of each row's mean score
        return self.aux_coeff * E * self.share * (f * P).sum(1).mean()


def no_autocast(device_type: str):
    """Autocast off on `device_type` (nothing to turn off where it has none: meta, a fake rank's tensors)."""
    return (
        torch.autocast(device_type, enabled=False)
        if torch.amp.is_autocast_available(device_type)
        else contextlib.nullcontext()
    )


def near_tie_margin(x: torch.Tensor) -> float:
    """Below this margin a routing may differ between layouts by rounding: 2^-8 under autocast (bf16 inputs),
    1e-4 in fp32 (the sweep's fp32 tolerances are 1e-5 to 1e-4 relative)."""
    return 2.0**-8 if torch.is_autocast_enabled(x.device.type) else 1e-4


def moe_layers(model: nn.Module) -> list[tuple[int, MoE]]:
    """(global Block index, MoE) of every MoE layer this module holds, in index order."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, MoE):
            out.append((int(name.split("transformer.h.")[1].split(".")[0]), m))
    return sorted(out, key=lambda x: x[0])


@torch.no_grad()
def balance_experts(layers: list[tuple[int, MoE]], reduce=None) -> tuple[torch.Tensor, torch.Tensor]:
    """After an optimizer step, for `layers` (`moe_layers`): each layer's tokens per expert over the step and its
    near ties, (layers, E + 1) int64, and its balancing loss per micro-batch, (layers,) fp32 (`reduce`: summed
    over the ranks that saw other rows of the batch; it takes and returns a tensor, so a layout reduces all
    layers at once); the auxiliary-loss-free bias step where it is on; every count zeroed for the next step.
    Returns both on the device (no host read)."""
    stats = torch.stack([torch.cat([m.load, m.near_ties.view(1)]) for _, m in layers])  # (L, E + 1)
    aux = torch.stack([m.aux_sum / max(m.forwards, 1) for _, m in layers])  # (L,)
    if reduce is not None:
        stats, aux = reduce(stats), reduce(aux)
    for (_, m), row in zip(layers, stats):
        if m.bias_rate:
            load = row[:-1].float()
            m.expert_bias += m.bias_rate * torch.sign(load.mean() - load)
        m.load.zero_()
        m.near_ties.zero_()
        m.aux_sum.zero_()
        m.forwards = 0
    return stats, aux
