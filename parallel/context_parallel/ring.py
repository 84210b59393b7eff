"""Context parallelism: causal ring attention over a cp group, one fused attention kernel per block pair
(docs/context_parallel.md derives the split, the ring, its NCCL ordering and the kernels at length).

- **What is sharded.** Each of the C ranks holds a slice of every sequence along time, and the matching slices
  of q, k and v: with `zigzag` (the default; Megatron's and torchtitan's causal load balance) chunks r and
  2C-1-r of 2C equal chunks, so every rank does the same causal work; without it the r-th of C contiguous
  slices. `local_positions` says which global positions a rank holds; position embeddings use them.
- **Forward.** C steps: at step s a rank attends its queries to the k/v block that started on rank r-s, while it
  sends that block on to rank r+1 and receives the next from rank r-1 (isend/irecv, posted before the block's
  compute). With zigzag each block is one kernel call, `is_causal` on a rank's own block only, no mask
  (`_ring_layout`); blocks merge by an online softmax on their log-sum-exp, in fp32.
- **Backward.** The k/v blocks go round again, each with the dK, dV (fp32) accumulated for it so far; a rank
  runs the kernel's backward on the same pairs, given the merged output and log-sum-exp (the pair's exact share
  of dQ, dK, dV); the C-th dK/dV move hands each block's gradients back to its owner.
- **Kernels** (model/attention.py, below parallel/): CPU, the flash kernel for CPU in fp32; CUDA, the flash
  kernel in bf16/fp16 and the memory-efficient kernel in fp32.

Per attention call a rank sends C-1 (k, v) pairs forward, and C-1 (k, v) pairs plus C (dK, dV) pairs in
backward, each tensor of shape (B, heads, T/C, head_dim): `cp_p2p_bytes_per_micro_step`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

from model.attention import kernel_backward, kernel_forward, kernel_of
from parallel import comm
from parallel.groups import p2p_link


def chunks_of(rank: int, cp: int, zigzag: bool = True) -> list[int]:
    """The sequence chunks rank `rank` holds, in ascending order: (r, 2C-1-r) of 2C with zigzag, (r,) of C
    without."""
    return [rank, 2 * cp - 1 - rank] if zigzag else [rank]


def local_positions(T: int, rank: int, cp: int, zigzag: bool = True) -> torch.Tensor:
    """Global positions (int64, in local order) of the tokens rank `rank` holds of a length-T sequence."""
    n = 2 * cp if zigzag else cp
    if T % n:
        raise ValueError(f"sequence length {T} is not divisible by {n} ({'2 x ' if zigzag else ''}cp={cp})")
    size = T // n
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks_of(rank, cp, zigzag)])


def shard_sequence(x: torch.Tensor, rank: int, cp: int, zigzag: bool = True, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `x` along `dim` (the time dim), in local order."""
    return x.index_select(dim, local_positions(x.shape[dim], rank, cp, zigzag).to(x.device))


def zigzag_share(x: torch.Tensor, y: torch.Tensor, rank: int, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens of a micro-batch's rows (B, T): its zigzag share of both the inputs and the targets."""
    return shard_sequence(x, rank, cp), shard_sequence(y, rank, cp)


def exchange_order(rank: int, cp: int) -> tuple[str, str]:
    """The order a rank posts its ring step's two halves in: even ranks send first, odd ranks receive first.
    gloo's isend/irecv never block, so any order works there; NCCL runs a rank's p2p operations on one group in
    posting order, across both its neighbours (the group is eagerly initialised: plan/timeline.py "nccl_eager"),
    so "receive first" on every rank would wait forever. The alternation gives every blocking send a posted
    receive (tests/test_context_parallel.py simulates it for C = 1..8, for the forward's exchanges and for the
    backward's interleaved k/v and dK/dV ones). It still runs half duplex on one group: a rank's two sends and
    two receives one after the other, 4 transfer times per exchange for an even ring against 2 (more for an odd
    one); hence `_exchange`'s link groups on NCCL, where the order no longer matters."""
    return ("send", "recv") if rank % 2 == 0 else ("recv", "send")


def _exchange(tensors: list[torch.Tensor], group, links: tuple = ()) -> tuple[list[torch.Tensor], list]:
    """Post the send of `tensors` to the next rank and the receive of the same shapes from the previous one,
    in `exchange_order`; returns (receive buffers, works to wait for). With `links` (the cp dim's link groups,
    parallel.groups.serial_p2p: NCCL) the sends go on link r's group and the receives on link r-1's
    (`p2p_link`), which differ: on NCCL, where a group's unbatched p2p ops run one after another on its one
    stream, the two directions then run at once (full duplex) instead of four transfers in a row."""
    C, r = comm.world(group), comm.rank(group)
    to_next, from_prev = (
        (links[p2p_link(r, (r + 1) % C, C)], links[p2p_link((r - 1) % C, r, C)]) if links else (group, group)
    )
    bufs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]  # contiguous, unlike empty_like
    post = {
        "recv": lambda: [comm.recv(b, (r - 1) % C, from_prev) for b in bufs],
        "send": lambda: [comm.send(t.contiguous(), (r + 1) % C, to_next) for t in tensors],
    }
    first, second = exchange_order(r, C)
    return bufs, post[first]() + post[second]()


def _received(pending: tuple[list[torch.Tensor], list]) -> list[torch.Tensor]:
    """Wait for an `_exchange` (its send and its receive) and return the received tensors."""
    bufs, works = pending
    for w in works:
        w.wait()
    return bufs


class _Call(NamedTuple):
    """One fused-kernel call of a ring step: the query rows `q` of this rank's block against the key rows `k`
    of the visiting block (local indices), with `causal` when they are the same tokens."""

    q: slice
    k: slice
    causal: bool


@functools.lru_cache(maxsize=64)
def _ring_layout(T: int, C: int, zigzag: bool) -> tuple[tuple[tuple[_Call, ...], ...], ...]:
    """calls[i][j]: the kernel calls that attend rank i's queries to rank j's keys, from the chunk pairs: a
    query chunk sees a key chunk fully if the key chunk comes first in the sequence, causally if it is the
    same chunk, and not at all if it comes later. Local order is ascending, so a rank's own block is one causal
    call, and another rank's block is seen, by each query chunk, up to a prefix of its chunks; neighbouring
    query chunks that see the same prefix share one call. With zigzag: rank j < i's block, first chunk, for
    all of i's queries; rank j > i's block, whole, for i's second chunk; () would be a block fully masked.
    Made once per (T, C, zigzag), from Python ints: no host <-> device traffic per layer."""
    local_positions(T, 0, C, zigzag)  # raises unless T cuts into the chunks
    size = T // (2 * C if zigzag else C)
    chunks = [chunks_of(i, C, zigzag) for i in range(C)]
    calls = []
    for i in range(C):
        row = []
        for j in range(C):
            if i == j:
                block = slice(0, len(chunks[i]) * size)
                row.append((_Call(block, block, True),))
                continue
            groups: list[list[int]] = []  # [first query chunk, end query chunk, key chunks seen]
            for a, qc in enumerate(chunks[i]):
                seen = sum(kc < qc for kc in chunks[j])
                if seen and groups and groups[-1][1] == a and groups[-1][2] == seen:
                    groups[-1][1] = a + 1
                elif seen:
                    groups.append([a, a + 1, seen])
            row.append(tuple(_Call(slice(a * size, b * size), slice(0, n * size), False) for a, b, n in groups))
        calls.append(tuple(row))
    return tuple(calls)


def _merge(o: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Fold one call's (o_b, lse_b) into the running fp32 (o, lse) of the same query rows, in place: the
    softmax over both key sets weighs o_b by e^lse_b / (e^lse + e^lse_b) = sigmoid(lse_b - lse)."""
    o.lerp_(o_b.to(o.dtype), torch.sigmoid(lse_b - lse).unsqueeze(-1))
    lse.copy_(torch.logaddexp(lse, lse_b))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, zigzag: bool, links: tuple = ()):
        # autocast off inside: the kernels run in kernel_of's dtype, and the backward (which autocast never
        # reaches) must recompute the forward's softmax from the same inputs
        with torch.autocast(q.device.type, enabled=False):
            return _RingAttention._forward(ctx, q, k, v, group, zigzag, links)

    @staticmethod
    def _forward(ctx, q, k, v, group, zigzag: bool, links: tuple):
        C, r = comm.world(group), comm.rank(group)
        calls = _ring_layout(q.shape[2] * C, C, zigzag)[r]
        kernel, kd = kernel_of(q)
        qc = q.to(kd)
        pending = _exchange([k, v], group, links) if C > 1 else None
        # step 0, this rank's own block: causal, and every query sees itself, so it starts every row's merge.
        # The kernel lays its output out (B, Tq, H, D) like SDPA's, so the caller's transpose + reshape to
        # (B, Tq, H*D) is a view: the output is then saved once, here and as c_proj's input
        o, lse, state = kernel_forward(kernel, qc, k.to(kd), v.to(kd), True)
        if C > 1:
            o = o.float()
            for step in range(1, C):
                kv, src = _received(pending), (r - step) % C
                pending = _exchange(kv, group, links) if step < C - 1 else None
                kb, vb = kv[0].to(kd), kv[1].to(kd)
                for c in calls[src]:
                    o_b, lse_b, _ = kernel_forward(kernel, qc[:, :, c.q], kb[:, :, c.k], vb[:, :, c.k], c.causal)
                    _merge(o[:, :, c.q], lse[:, :, c.q], o_b, lse_b)
        out = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.links, ctx.calls, ctx.kernel, ctx.state = group, links, calls, kernel, state
        return out

    @staticmethod
    def backward(ctx, grad_o):
        with torch.autocast(grad_o.device.type, enabled=False):
            return _RingAttention._backward(ctx, grad_o)

    @staticmethod
    def _backward(ctx, grad_o):
        q, k, v, out, lse = ctx.saved_tensors
        group, links, calls, kernel, state = ctx.group, ctx.links, ctx.calls, ctx.kernel, ctx.state
        C, r = comm.world(group), comm.rank(group)
        kd = kernel_of(q)[1]
        g, o, qc = grad_o.to(kd), out.to(kd), q.to(kd)
        pending_kv = _exchange([k, v], group, links) if C > 1 else None
        dq, dk, dv = kernel_backward(kernel, g, qc, k.to(kd), v.to(kd), o, lse, True, state)
        if C == 1:
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
        dq = dq.float()
        pending_dkv = _exchange([dk.float(), dv.float()], group, links)  # this block's dK, dV so far, on to rank r+1
        for step in range(1, C):
            kv, src = _received(pending_kv), (r - step) % C
            pending_kv = _exchange(kv, group, links) if step < C - 1 else None
            kb, vb = kv[0].to(kd), kv[1].to(kd)
            shares = []
            for c in calls[src]:
                dq_c, dk_c, dv_c = kernel_backward(
                    kernel,
                    g[:, :, c.q],
                    qc[:, :, c.q],
                    kb[:, :, c.k],
                    vb[:, :, c.k],
                    o[:, :, c.q],
                    lse[:, :, c.q],
                    c.causal,
                    state,
                )
                dq[:, :, c.q] += dq_c
                shares.append((c.k, dk_c, dv_c))
            dk, dv = _received(pending_dkv)  # block src's dK, dV from the ranks it visited before this one
            for ks, dk_c, dv_c in shares:
                dk[:, :, ks] += dk_c
                dv[:, :, ks] += dv_c
            pending_dkv = _exchange([dk, dv], group, links)  # after the last step: home, to the block's owner r+1
        dk, dv = _received(pending_dkv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    zigzag: bool = True,
    links: tuple = (),
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, spread over `group` (see the module
    docstring). q, k, v: (B, heads, T/C, head_dim), this rank's tokens in `local_positions` order; returns
    this rank's output, same shape and dtype. With one rank it is plain causal attention. `links`: the cp dim's
    link groups (`_exchange`), or () for every transfer on `group`."""
    return _RingAttention.apply(q, k, v, group, zigzag, tuple(links))


class RingAttentionCore(torch.nn.Module):
    """model.AttentionCore's causal attention with the keys and values of the whole sequence, which `group`'s
    ranks hold in zigzag shares: `ring_attention`. No dropout (config refuses it under CP)."""

    def __init__(self, group: dist.ProcessGroup | None, links: tuple = ()):
        super().__init__()
        self.group, self.links = group, tuple(links)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.group, links=self.links)


class ZigzagPositions:
    """model.GPT's `positions` for rank `rank` of `cp`: the absolute positions of its zigzag share (T of them)
    of a sequence of T * cp tokens."""

    def __init__(self, rank: int, cp: int):
        self.rank, self.cp = rank, cp
        self._made: dict[tuple[int, str], torch.Tensor] = {}  # one host -> device copy per (T, device), not per forward

    def __call__(self, T: int, device) -> torch.Tensor:
        key = (T, str(device))
        if key not in self._made:
            self._made[key] = local_positions(T * self.cp, self.rank, self.cp).to(device)
        return self._made[key]


def positions_for(rank: int, cp: int) -> ZigzagPositions:
    return ZigzagPositions(rank, cp)


def apply_context_parallel(model: torch.nn.Module, group: dist.ProcessGroup, links: tuple = ()) -> None:
    """Make `model` (a GPT or a pipeline stage) run on this rank's zigzag share of every sequence: its positions
    from `local_positions`, and every attention core a ring over `group` (the tokens themselves are cut by
    `shard_sequence` before the forward). Parameters are untouched (replicated over cp; their gradients are
    reduced over dp x cp by the data-parallel wrapper). `links`: the cp dim's link groups (MeshDim.links)."""
    model.positions = positions_for(comm.rank(group), comm.world(group))
    for module in list(model.modules()):
        if hasattr(module, "core"):
            module.core = RingAttentionCore(group, links)
