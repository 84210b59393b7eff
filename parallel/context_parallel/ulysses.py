"""Ulysses context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all turns sequence shards into
head shards, attention runs on the whole sequence for this rank's heads, and a second all-to-all turns them back
(docs/context_parallel.md, Ulysses, draws the shapes).

- **What is sharded.** As under the ring, each of the C ranks holds a share of every sequence along time, S = T/C
  tokens, and q, k, v for those tokens and all of its H heads (H = n_head / tp: TP takes its share of the heads
  first). Inside attention rank r holds instead heads [r·H/C, (r+1)·H/C) for all T tokens: H/C must be whole
  (`check_ulysses`).
- **Forward.** q, k and v each go through one all-to-all (`_SeqToHeads`): (B, H, S, D) -> (B, H/C, T, D); rank r
  sends head group j of its tokens to rank j. The model's own attention core (model.AttentionCore: SDPA, causal)
  runs on the whole sequence, and one all-to-all (`_HeadsToSeq`) sends each rank its tokens back, for all heads.
- **Backward.** Each all-to-all's backward is the inverse all-to-all, as the data movement is a permutation of
  elements across ranks: out's gradient goes sequence -> heads, the core's backward runs on whole sequences, and
  dq, dk, dv go heads -> sequence. Nothing is summed across ranks, so every per-head value (outputs and q, k, v
  gradients) equals one process's bit for bit: each head's attention is the same kernel on the same (T, D) inputs.
- **The split: the ring's zigzag, reused.** Ulysses does not need it for balance: every rank runs the whole causal
  triangle for H/C heads, and everything outside attention is per token. But the received blocks must be copied
  from (source rank, its tokens) into time order for the kernel anyway, so putting zigzag chunks back in order is
  the same one copy, a gather by chunk (`_held`) instead of a strided copy: it costs nothing. So the positions
  (`positions_for`), the data split (`zigzag_share`), the loss and sequence parallelism inside a cp share are the
  ring's, and the two algorithms differ only in the attention core. The price is the ring's constraint, seq_len
  divisible by 2C rather than C. `zigzag=False` (the r-th of C contiguous slices) is here for the tests.

Bytes, as parallel/comm counts an all-to-all (this rank's whole input, its own split included): with A =
B·(T/C)·(n_embd/tp) elements (one q, k, v or output block: all of this rank's heads for its tokens), per attention
forward moves q, k, v and the output, 4·A, and backward the output's gradient and dq, dk, dv, 4·A, all in the
compute dtype: 8·A·element_size per layer, 8 calls (theory.py: `ulysses_all_to_all_bytes_per_micro_step`). Of it (C-1)/C
leaves the rank. The ring sends (6(C-1)+2)·A: equal at C = 2 in fp32, and Ulysses's falls as 1/C at fixed T·C.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from parallel import comm
from parallel.context_parallel.ring import chunks_of, positions_for


def check_ulysses(n_head: int, tp: int, cp: int) -> str | None:
    """The one-line refusal when Ulysses cannot split the heads over cp (each tp rank holds n_head / tp of them,
    each cp rank attends whole sequences for (n_head / tp) / cp), else None."""
    if n_head % (tp * cp) == 0:
        return None
    return (
        f"Ulysses context parallelism needs n_head ({n_head}) divisible by tensor_parallel_size ({tp}) x "
        f"context_parallel_size ({cp}): each cp rank attends whole sequences for (n_head / tp) / cp of the heads"
    )


@functools.lru_cache(maxsize=64)
def _held(C: int, zigzag: bool) -> tuple[int, ...]:
    """The sequence chunks in the order the all-to-all lays them out: rank 0's (in its local order), rank 1's, ..."""
    return tuple(c for j in range(C) for c in chunks_of(j, C, zigzag))


@functools.lru_cache(maxsize=64)
def _indices(C: int, zigzag: bool, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(to_time, to_ranks): index_select indices over the chunk dim. to_time[c] is where chunk c sits in the
    received rank-major order; to_ranks[i] is the chunk the i-th rank-major slot takes (`_held` itself)."""
    held = _held(C, zigzag)
    to_time = sorted(range(len(held)), key=held.__getitem__)
    return torch.tensor(to_time, device=device), torch.tensor(held, device=device)


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None, zigzag: bool = True, unit: str = "") -> torch.Tensor:
    """(B, H, S, D), this rank's S tokens of every head (local order) -> (B, H/C, T = C·S, D), this rank's head
    group of the whole sequence in time order. Sends rank j its head group j; one copy each side."""
    C = comm.world(group)
    if C == 1:
        return x
    B, H, S, D = x.shape
    m = len(chunks_of(0, C, zigzag))  # chunks a rank holds
    if H % C or S % m:
        raise ValueError(f"Ulysses over {C} ranks: {H} heads and {S} tokens a rank must divide into {C} and {m}")
    h, s = H // C, S // m
    # (B, C, h, m, s, D) -> (C, m, B, h, s, D): the block for rank j is [j], its chunks outermost
    send = x.reshape(B, C, h, m, s, D).permute(1, 3, 0, 2, 4, 5).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group=group, unit=f"ulysses {unit}")
    to_time = _indices(C, zigzag, str(x.device))[0]
    # (C·m chunks, B, h, s, D) rank-major -> (B, h, 2C or C chunks, s, D) in time order, one gather
    return recv.view(C * m, B, h, s, D).permute(1, 2, 0, 3, 4).index_select(2, to_time).view(B, h, C * S, D)


def heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup | None, zigzag: bool = True, unit: str = "") -> torch.Tensor:
    """The inverse of `seq_to_heads`: (B, H/C, T, D), this rank's head group of the whole sequence in time order
    -> (B, H, S, D), this rank's S tokens of every head, laid out (B, S, H, D) (as SDPA's output is, so the
    caller's transpose + reshape to (B, S, H·D) is a view). Sends rank j its tokens; one copy each side."""
    C = comm.world(group)
    if C == 1:
        return y
    B, h, T, D = y.shape
    n = len(_held(C, zigzag))
    m, s = n // C, T // n
    to_ranks = _indices(C, zigzag, str(y.device))[1]
    # (B, h, n, s, D) -> (n, B, h, s, D) rank-major = (C, m, B, h, s, D): rank j's chunks at [j]
    send = y.unflatten(2, (n, s)).permute(2, 0, 1, 3, 4).index_select(0, to_ranks)
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group=group, unit=f"ulysses {unit}")
    out = torch.empty(B, m, s, C, h, D, dtype=y.dtype, device=y.device)  # (B, S, H, D), H = (source rank, head)
    out.copy_(recv.view(C, m, B, h, s, D).permute(2, 1, 4, 0, 3, 5))
    return out.view(B, m * s, C * h, D).transpose(1, 2)


class _SeqToHeads(torch.autograd.Function):
    """Forward `seq_to_heads`; backward its inverse, `heads_to_seq`, of the gradient."""

    @staticmethod
    def forward(ctx, x, group, zigzag: bool, unit: str):
        ctx.group, ctx.zigzag, ctx.unit = group, zigzag, unit
        return seq_to_heads(x, group, zigzag, unit)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad, ctx.group, ctx.zigzag, "d" + ctx.unit), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    """Forward `heads_to_seq`; backward its inverse, `seq_to_heads`, of the gradient."""

    @staticmethod
    def forward(ctx, y, group, zigzag: bool, unit: str):
        ctx.group, ctx.zigzag, ctx.unit = group, zigzag, unit
        return heads_to_seq(y, group, zigzag, unit)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad, ctx.group, ctx.zigzag, "d" + ctx.unit), None, None, None


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    core: torch.nn.Module,
    zigzag: bool = True,
) -> torch.Tensor:
    """Causal attention of this rank's tokens over the whole sequence, by head groups over `group` (the module
    docstring). q, k, v: (B, H, T/C, D), this rank's tokens in `local_positions` order; `core`: the model's own
    attention on (B, H/C, T, D); returns this rank's output (B, H, T/C, D). With one rank it is `core`."""
    if comm.world(group) == 1:
        return core(q, k, v)
    q, k, v = (_SeqToHeads.apply(t, group, zigzag, name) for t, name in zip((q, k, v), "qkv"))
    return _HeadsToSeq.apply(core(q, k, v), group, zigzag, "out")


class UlyssesAttentionCore(torch.nn.Module):
    """model.AttentionCore's causal attention over the whole sequence, whose tokens `group`'s ranks hold in zigzag
    shares: `ulysses_attention` around `inner`, the core it replaces (no parameters: the state dict is unchanged)."""

    def __init__(self, group: dist.ProcessGroup | None, inner: torch.nn.Module, zigzag: bool = True):
        super().__init__()
        self.group, self.inner, self.zigzag = group, inner, zigzag

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ulysses_attention(q, k, v, self.group, self.inner, self.zigzag)


def apply_ulysses(model: torch.nn.Module, group: dist.ProcessGroup | None) -> None:
    """Make `model` (a GPT or a pipeline stage) run on this rank's zigzag share of every sequence, as
    `apply_context_parallel` does (the same positions; the tokens are cut by `zigzag_share` before the forward),
    with every attention core wrapped in Ulysses's all-to-alls over `group` instead of a ring. Parameters are
    untouched (replicated over cp; the data-parallel wrapper reduces their gradients over dp x cp)."""
    model.positions = positions_for(comm.rank(group), comm.world(group))
    for module in list(model.modules()):
        if hasattr(module, "core"):
            module.core = UlyssesAttentionCore(group, module.core)
