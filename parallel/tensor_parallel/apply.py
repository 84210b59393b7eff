"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et al. 2022)
for our GPT, by hand.

Each of the p ranks of `tp_group` holds 1/p of every matmul weight: whole heads of c_q/c_k/c_v, a slice
of the MLP's hidden units, a slice of the vocab. A block then costs two all-reduces forward (after
attn.c_proj and mlp.c_proj, g) and two backward (of the gradients entering the block's two regions, f).
Under sequence parallelism the activations outside those regions (residual stream, LayerNorms) are
split along the sequence, (B, T/p, C), and each all-reduce becomes a reduce-scatter plus an all-gather
of the same payload, while those activations take 1/p of the memory.

The sharding is `TP_PLAN`; `apply_tensor_parallel` swaps modules in place and keeps every parameter's name, so
optimizer groups and checkpoints map by name (`transformer.h.0.attn.c_q.weight` is now this rank's rows). Sharded
parameters carry a shard mark (`parallel.marks.mark_shard`, over "tp"), replicated ones none: a global grad norm
sums the squares of the former over the group and counts the latter once (`parallel.grads.grad_groups`). Under SP
the replicated parameters that see only T/p positions (LayerNorms, row-parallel biases, wpe) get their gradients
made whole over the group inside backward, so they too count once.

The layers (`ColumnParallelLinear`, `RowParallelLinear`, ...) live in parallel/tensor_parallel/layers.py, the
communication
primitives in parallel/tensor_parallel/mappings.py; those go through parallel/comm.py, so
`tp_comm_bytes_per_micro_step` can be
checked against parallel/comm.COUNTER.
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.gpt import GPT, GPTConfig, init_parameter, materialize_module
from model.loss import WholeVocab, compiled, linear_cross_entropy, loss_chunk_rows
from model.moe import MoE, moe_layers
from parallel import comm
from parallel.marks import mark_shard, shard_dim
from parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelLayerNorm,
    RowParallelLinear,
    SequenceParallelPositionEmbedding,
    VocabParallelEmbedding,
)
from parallel.tensor_parallel.mappings import all_gather_along, gather_sequence_replicated, scatter_to_sequence

# Module name (fnmatch pattern) -> style. Read top to bottom, this is the whole sharding.
TP_PLAN: dict[str, str] = {
    "transformer.wte": "vocab",  # rows of the vocab: masked lookup, then g (reduce-scatter over T under SP)
    "transformer.wpe": "position",  # replicated; under SP each rank adds only its T/p positions
    "transformer.h.*.ln_1": "norm",  # replicated; its output enters the region: f (all-gather over T under SP)
    "transformer.h.*.attn.c_q": "colwise",  # whole heads per rank
    "transformer.h.*.attn.c_k": "colwise",
    "transformer.h.*.attn.c_v": "colwise",
    "transformer.h.*.attn.c_proj": "rowwise",  # g: all-reduce (reduce-scatter over T under SP), then + bias
    "transformer.h.*.ln_2": "norm",
    "transformer.h.*.mlp": "moe",  # an MoE layer: replicated, run whole by every rank (else left as it is)
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
    "transformer.ln_f": "norm",
    "lm_head": "vocab_head",  # colwise over the vocab with wte's (tied) shard; logits gathered
}  # over the vocab unless loss parallel


# ----------------------------------------------------------------------------- loss


class VocabShard:
    """The rows of loss.linear_cross_entropy when its weight is this rank's vocab rows [start, start + V/p) (see
    loss.WholeVocab for the interface): softmax statistics over the whole vocab from every rank's slice, with a
    constant count of collectives per call, whatever the number of chunks.

    With loss parallelism (Megatron's vocab-parallel cross-entropy), two passes over the chunks of this rank's
    logits z (n, V/p). The first keeps, per row, the local max m, the local sum of exp(z - m) and the target's logit
    (from the rank owning it, zero elsewhere). Then two all-reduces for all N rows: the max (MAX; N fp32), after
    which each rank rescales its sums by exp(m - max), and (target logit, sum-exp) (SUM; 2N fp32): 12 bytes a row.
    The second pass, only where a gradient is needed, takes each chunk's z again, newest first: the last chunk's is
    still alive, the others are recomputed (x_c W^T once more: the alternative, keeping every chunk's z, is the
    (N, V/p) tensor the chunks exist to avoid), and turns it into softmax - one-hot of this rank's columns.
    d(x) is then this rank's columns' part, summed over the ranks where x entered the region (f, at ln_f).
    Without it (`gather`), each rank forms whole rows itself: lm_head's weight all-gathered once over the vocab
    ((V, C) in the compute dtype) and loss.WholeVocab's single pass, of which it keeps its columns' gradient.
    """

    def __init__(self, group, start: int, gather: bool = False, fused: bool = False):
        self.group, self.start, self.gather, self.fused = group, start, gather, fused
        self.whole = WholeVocab(fused)  # the gather path's rows

    def _mine(self, targets: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo = self.start
        mine = (targets >= lo) & (targets < lo + n)  # target in columns [lo, lo + n) (never an ignored -1)
        return mine, (targets - lo).masked_fill(~mine, 0)

    def log_probs(
        self, xc: torch.Tensor, wc: torch.Tensor, targets: torch.Tensor, chunk: int, scale: torch.Tensor, grads
    ) -> torch.Tensor:
        if self.gather:
            return self._whole_rows(xc, wc, targets, chunk, scale, grads)
        N, n_cols = xc.shape[0], wc.shape[0]
        stats = torch.empty(3, N, dtype=torch.float32, device=xc.device)  # max, sum of exp(z - max), target logit
        z = None
        for lo in range(0, N, chunk):
            rows = slice(lo, lo + chunk)
            z = self._logits(xc[rows], wc)  # (n, V/p)
            mine, local_t = self._mine(targets[rows], n_cols)
            last = grads.needed and lo + chunk >= N  # its z stays for the second pass
            if self.fused:
                stats[:, rows] = compiled(shard_statistics)(z, local_t, mine)
                continue
            torch.amax(z, dim=-1, out=stats[0, rows])
            stats[2, rows] = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
            shifted = (z - stats[0, rows].unsqueeze(-1)) if last else z.sub_(stats[0, rows].unsqueeze(-1))
            torch.sum(shifted.exp_(), dim=-1, out=stats[1, rows])
        local_max = stats[0].clone()
        comm.all_reduce(stats[0], self.group, op="max")
        stats[1].mul_(torch.exp(local_max - stats[0]))  # the local sums, of exp(z - the global max)
        comm.all_reduce(stats[1:], self.group)
        z_max, sum_exp = stats[0].unsqueeze(-1), stats[1].unsqueeze(-1)
        for lo in reversed(range(0, N, chunk)) if grads.needed else ():
            rows = slice(lo, lo + chunk)
            if lo + chunk < N:
                z = self._logits(xc[rows], wc)  # recomputed (the last chunk's is kept)
            mine, local_t = self._mine(targets[rows], n_cols)
            if self.fused:
                g = compiled(shard_gradient)(z, z_max[rows], sum_exp[rows], local_t, mine, scale[rows])
            else:
                g = z.sub_(z_max[rows]).exp_().div_(sum_exp[rows])  # softmax, this rank's columns
                g.scatter_add_(-1, local_t.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))  # - one-hot
                g.mul_(scale[rows].unsqueeze(-1))
            grads.add(rows, g, xc, wc)
            z = g = None  # g is z's storage: both names let go before the next chunk's logits
        return stats[2] - stats[0] - stats[1].log()  # log p(target)

    def _logits(self, xc: torch.Tensor, wc: torch.Tensor) -> torch.Tensor:
        """A chunk's logits of this rank's columns: fp32 for the eager kernels, the compute dtype for the fused."""
        z = F.linear(xc, wc)
        return z if self.fused else z.float()

    def _whole_rows(
        self, xc: torch.Tensor, wc: torch.Tensor, targets: torch.Tensor, chunk: int, scale: torch.Tensor, grads
    ) -> torch.Tensor:
        w_all = all_gather_along(wc, 0, self.group)  # (V, C): the whole lm_head, once
        cols = slice(self.start, self.start + wc.shape[0])
        N = xc.shape[0]
        picked = torch.empty(N, dtype=torch.float32, device=xc.device)
        for lo in range(0, N, chunk):
            rows = slice(lo, lo + chunk)
            picked[rows], g = self.whole.rows(
                F.linear(xc[rows], w_all), targets[rows], scale[rows] if grads.needed else None
            )
            if g is not None:
                grads.add(rows, g[:, cols], xc, wc)
            del g  # else it lives on beside the next chunk's logits (as in WholeVocab.log_probs)
        return picked


def shard_statistics(z: torch.Tensor, local_t: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """VocabShard's first pass over a chunk's logits z (n, V/p) (any float dtype), as one compiled kernel
    (`fused`): (3, n) fp32, each row's max m, sum of exp(z - m) and target logit (0 where this rank holds no
    target), from two reads of z; z is left as it is (the last chunk's serves the second pass)."""
    zf = z.float()
    m = zf.amax(-1)
    sum_exp = (zf - m.unsqueeze(-1)).exp().sum(-1)
    target = zf.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
    return torch.stack([m, sum_exp, target])


def shard_gradient(
    z: torch.Tensor,
    z_max: torch.Tensor,
    sum_exp: torch.Tensor,
    local_t: torch.Tensor,
    mine: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """VocabShard's second pass as one compiled kernel (`fused`): z (n, V/p) overwritten by this rank's columns of
    (softmax - one-hot) * scale, from the whole rows' max and sum of exp (n, 1), in fp32, written once in z's dtype;
    returns z."""
    hot = (torch.arange(z.shape[-1], device=z.device) == local_t.unsqueeze(-1)) & mine.unsqueeze(-1)
    p = (z.float() - z_max).exp() / sum_exp
    return z.copy_((p - hot.float()) * scale.unsqueeze(-1))


def vocab_parallel_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    group,
    gather: bool = False,
    chunk_rows: int | None = None,
    fused: bool = False,
) -> torch.Tensor:
    """cross_entropy(F.linear(x, full weight), targets) (mean over targets != -1) from this rank's vocab rows
    `weight` (V/p, C) of the tied matrix: x (..., C) the same on every rank, targets (...) global ids. Chunked over
    rows as loss.linear_cross_entropy (only one chunk's logits at a time, (n, V/p), or (n, V) with `gather`); the
    rows reduce over the vocab by VocabShard: 2 all-reduces of per-row statistics (loss parallelism), or with
    `gather` 1 all-gather of the weight. Computed in fp32; with `fused` (--compile: loss.compile_head) each chunk's
    passes by one compiled kernel (`shard_statistics`, `shard_gradient`, or the whole rows' loss.fused_rows)."""
    vocab = VocabShard(group, comm.rank(group) * weight.shape[0], gather, fused)
    # chunks sized by the fp32 logits they make: this rank's columns, or whole rows
    chunk_rows = chunk_rows or loss_chunk_rows(weight.shape[0] * (comm.world(group) if gather else 1), x.device.type)
    return linear_cross_entropy(x, weight, targets, vocab, chunk_rows)


# ----------------------------------------------------------------------------- applying the plan


def check_tp_divisibility(config: GPTConfig, tp: int, seq_len: int | None = None) -> str | None:
    """A one-line reason why `config` cannot be split over `tp` ranks, else None. With `seq_len` (pass it
    when sequence parallelism is on) the sequence must split too."""
    if tp < 1:
        return f"tensor-parallel size must be >= 1, got {tp}"
    for what, n, why in (
        ("n_head", config.n_head, "each rank holds whole heads"),
        ("n_embd", config.n_embd, "the MLP and attention widths are split"),
        ("vocab_size", config.vocab_size, "the embedding and lm_head are split by vocab"),
    ):
        if n % tp:
            return f"{what} ({n}) is not divisible by the tensor-parallel size {tp} ({why})"
    if seq_len is not None and seq_len % tp:
        return (
            f"sequence parallelism needs seq_len ({seq_len}) divisible by the tensor-parallel size {tp} "
            f"(each rank holds T/tp positions)"
        )
    return None


@dataclass
class _Builder:
    """What every style needs: the group, the switches, and (for a meta model) how to make shards."""

    group: object
    loss_parallel: bool
    sequence_parallel: bool
    config: GPTConfig
    seed: int | None
    device: torch.device
    shards: dict  # id(original Parameter) -> (original, shard): tied parameters stay tied
    model: nn.Module  # what is being split (a style may ask about a module's neighbours)

    def shard(self, name: str, p: nn.Parameter | None, dim: int) -> nn.Parameter | None:
        """This rank's 1/p slice of `p` along dim as a new Parameter, marked (`mark_shard`, over "tp"). Sliced from
        p's values, or (p on meta) drawn by init_parameter for just that slice: no full-size tensor."""
        if p is None:
            return None
        if id(p) in self.shards:
            _, out = self.shards[id(p)]
            assert shard_dim(out, "tp") == dim, f"{name} is tied to a parameter sharded along another dim"
            return out
        n = p.shape[dim] // comm.world(self.group)
        idx = slice(comm.rank(self.group) * n, (comm.rank(self.group) + 1) * n)
        if not p.is_meta:
            local = p.detach().narrow(dim, idx.start, n).clone()
        else:
            rows, cols = (idx, None) if dim == 0 else (None, idx)
            local = init_parameter(name, p.shape, self.config, self.seed, rows=rows, cols=cols)
            local = local.to(self.device, p.dtype)
            if local._base is not None:  # a view (biases come as slices of zeros): keep only the slice
                local = local.clone()
        out = nn.Parameter(local, requires_grad=p.requires_grad)
        mark_shard(out, dim, comm.rank(self.group), comm.world(self.group), self.group, "tp")
        self.shards[id(p)] = (p, out)
        return out

    def replicated(self, name: str, p: nn.Parameter | None) -> nn.Parameter | None:
        """p itself, or (p on meta) a new Parameter holding its init value."""
        if p is None or not p.is_meta:
            return p
        return nn.Parameter(
            init_parameter(name, p.shape, self.config, self.seed).to(self.device, p.dtype),
            requires_grad=p.requires_grad,
        )

    def materialize(self, module: nn.Module, name: str) -> None:
        if any(p.is_meta for p in module.parameters()):
            materialize_module(module, name, self.config, self.seed, self.device)


# which dim of each parameter a style splits over the tp ranks (absent: replicated); the styles below read it,
# and so does the layout planner's per-rank shapes (plan/counts.py tp_local_shape)
SHARD_DIMS: dict[str, dict[str, int]] = {
    "vocab": {"weight": 0},
    "colwise": {"weight": 0, "bias": 0},
    "rowwise": {"weight": 1},
    "vocab_head": {"weight": 0},
}


def _vocab(b: _Builder, name: str, m: nn.Embedding) -> nn.Module:
    return VocabParallelEmbedding(
        b.shard(f"{name}.weight", m.weight, SHARD_DIMS["vocab"]["weight"]), b.group, b.sequence_parallel
    )


def _position(b: _Builder, name: str, m: nn.Embedding) -> nn.Module:
    b.materialize(m, name)
    return SequenceParallelPositionEmbedding(m, b.group) if b.sequence_parallel else m


def _norm(b: _Builder, name: str, m: nn.LayerNorm) -> nn.Module:
    b.materialize(m, name)
    block, _, attr = name.rpartition(".")
    if attr == "ln_2" and isinstance(b.model.get_submodule(block).mlp, MoE):  # feeds a replicated MoE layer
        return ParallelLayerNorm(m, b.group, b.sequence_parallel, gather=False) if b.sequence_parallel else m
    return ParallelLayerNorm(m, b.group, b.sequence_parallel)


def _moe(b: _Builder, name: str, m: nn.Module) -> nn.Module:
    """An MoE layer under TP: its router and experts replicated over the tp ranks, each rank running it whole on
    the whole sequence (its own expert-parallel all_to_alls, over the ranks of its tp coordinate): no partial
    sums, so no reduction. Under SP its input is all-gathered along T (backward: this rank's slice of the same,
    complete gradient) and its output cut back to this rank's T/p (backward: all-gathered). Experts are not split
    by TP: compute and expert parallelism then need no TP collective, at tp x the experts' compute."""
    if not isinstance(m, MoE):
        return m  # the dense MLP: its c_fc and c_proj are split by their own entries
    b.materialize(m.router, f"{name}.router")
    if any(p.is_meta for p in m.experts.parameters()):  # not already this rank's experts (expert parallelism)
        b.materialize(m.experts, f"{name}.experts")
    if b.sequence_parallel:
        m.register_forward_pre_hook(lambda _, args: (gather_sequence_replicated(args[0], b.group),))
        m.register_forward_hook(lambda _, args, y: scatter_to_sequence(y, b.group))
    return m


def _colwise(b: _Builder, name: str, m: nn.Linear) -> nn.Module:
    dims = SHARD_DIMS["colwise"]
    return ColumnParallelLinear(
        b.shard(f"{name}.weight", m.weight, dims["weight"]), b.shard(f"{name}.bias", m.bias, dims["bias"]), b.group
    )


def _rowwise(b: _Builder, name: str, m: nn.Linear) -> nn.Module:
    return RowParallelLinear(
        b.shard(f"{name}.weight", m.weight, SHARD_DIMS["rowwise"]["weight"]),
        b.replicated(f"{name}.bias", m.bias),
        b.group,
        b.sequence_parallel,
    )


def _vocab_head(b: _Builder, name: str, m: nn.Linear) -> nn.Module:
    # GPT ties this weight to wte's, already sharded by "vocab": shard() returns that same Parameter.
    return ColumnParallelLinear(
        b.shard(f"{name}.weight", m.weight, SHARD_DIMS["vocab_head"]["weight"]),
        None,
        b.group,
        gather_output=not b.loss_parallel,
    )


STYLES = {
    "vocab": _vocab,
    "position": _position,
    "norm": _norm,
    "colwise": _colwise,
    "rowwise": _rowwise,
    "vocab_head": _vocab_head,
    "moe": _moe,
}


def plan_entry(name: str, plan: dict[str, str] = TP_PLAN) -> str | None:
    """The first pattern of `plan` that module `name` matches, or None: the module is left as it is."""
    return next((pattern for pattern in plan if fnmatch.fnmatchcase(name, pattern)), None)


def plan_style(name: str, plan: dict[str, str] = TP_PLAN) -> str | None:
    """The style of module `name` under `plan`, or None."""
    pattern = plan_entry(name, plan)
    return plan[pattern] if pattern else None


def apply_tensor_parallel(
    model: GPT,
    tp_group,
    loss_parallel: bool,
    sequence_parallel: bool,
    seed: int | None = None,
    device: torch.device | str | None = None,
) -> GPT:
    """Shard `model` in place over `tp_group` by TP_PLAN and return it.

    With `seed` the model may be on meta: only this rank's shards (and the replicated LayerNorms and
    position table) are materialised on `device` (default CPU), bit-identical to the matching slices of
    eager init. The model's head_loss becomes vocab_parallel_cross_entropy: lm_head and loss chunked over rows
    from this rank's vocab rows. Without loss parallelism lm_head's weight is all-gathered over the vocab once
    per loss, each rank making whole rows (and lm_head(x) returns the whole (B, T, V)); with it, per-row
    statistics are all-reduced instead and lm_head(x) returns this rank's (B, T, V/p).
    """
    tp = comm.world(tp_group)
    reason = check_tp_divisibility(model.config, tp)
    if reason:
        raise ValueError(f"cannot apply tensor parallelism: {reason}")
    if model.config.dropout > 0 and tp > 1:
        raise ValueError(
            f"dropout ({model.config.dropout}) under tensor parallelism is not supported: the ranks "
            f"would need coordinated RNG streams (Megatron's RNG tracker); set dropout=0"
        )
    meta = any(p.is_meta for p in model.parameters())
    if meta and seed is None:
        raise ValueError("the model is on meta: pass seed= so apply_tensor_parallel can materialise its shards")
    if device is None:
        device = torch.device("cpu") if meta else next(model.parameters()).device
    b = _Builder(tp_group, loss_parallel, sequence_parallel, model.config, seed, torch.device(device), {}, model)
    matched = set()
    for name, module in list(model.named_modules()):
        pattern = plan_entry(name)
        if pattern is None:
            continue
        matched.add(pattern)
        new = STYLES[TP_PLAN[pattern]](b, name, module)
        if new is not module:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
    unmatched = set(TP_PLAN) - matched
    if moe_layers(model):  # the dense MLP's entries may have nothing left to match
        unmatched -= {p for p in unmatched if ".mlp." in p}
    if unmatched and isinstance(model, GPT):  # a pipeline stage holds only some of them
        raise ValueError(f"TP_PLAN entries match no module of the model: {sorted(unmatched)}")
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise ValueError(f"parameters outside TP_PLAN left on meta: {still_meta}")
    # lm_head + loss chunked from this rank's vocab rows; with loss parallelism no rank has whole logits
    model.head_loss = functools.partial(vocab_parallel_cross_entropy, group=tp_group, gather=not loss_parallel)
    if loss_parallel:
        model.loss_fn = None  # lm_head gives this rank's vocab slice: no loss of whole logits
    return model
