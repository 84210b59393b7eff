"""Context parallelism: causal ring attention over a cp group, in plain PyTorch ops (so it runs on CPU too).

Each of the C ranks holds a slice of every sequence along time, and the matching slices of q, k and v.
- **The split.** With `zigzag` (the default; Megatron's and torchtitan's causal load balance), a sequence is
  cut into 2C equal chunks and rank r holds chunks r and 2C-1-r, so every rank does the same causal
  attention work. Without it, rank r holds the r-th of C contiguous slices. `local_positions` says which
  global positions a rank holds; position embeddings use them.
- **Forward.** C steps. At step s a rank attends its queries to the k/v block that started on rank r-s,
  while it already sends that block on to rank r+1 and receives the next one from rank r-1 (isend/irecv,
  posted before the block's compute, counted as "p2p" by parallel/comm.py). Partial results merge by an
  online softmax: a running max and sum per query, in fp32. A block whose keys all lie after every query
  of this rank (fully masked under causality) is skipped.
- **Backward.** The k/v blocks go round the ring again, and with each block travel the gradients dK, dV
  accumulated for it so far: at each step a rank adds its queries' contribution (from the saved
  log-sum-exp, without re-running the softmax merge). After C steps every block has been seen by every
  rank, and one more send hands each dK/dV back to the rank that owns the block.

Per attention call a rank sends C-1 k/v blocks forward, and 2(C-1) k/v blocks plus one dK/dV pair in
backward (each of shape (B, heads, T/C, head_dim)).
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.distributed as dist

from parallel import comm


def chunks_of(rank: int, cp: int, zigzag: bool = True) -> list[int]:
    """The sequence chunks rank `rank` holds: (r, 2C-1-r) of 2C with zigzag, (r,) of C without."""
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


def exchange_order(rank: int, cp: int) -> tuple[str, str]:
    """The order a rank posts its ring step's two halves in: even ranks send first, odd ranks receive first.
    gloo's isend/irecv never block, so any order works there; NCCL runs a rank's p2p operations in posting
    order, and with C = 2 both ranks' sends and receives share one pair, so "receive first" on both would
    wait forever. The alternation gives every blocking send a posted receive (tests/test_context_parallel.py
    simulates it for C = 1..8)."""
    return ("send", "recv") if rank % 2 == 0 else ("recv", "send")


def _exchange(tensors: list[torch.Tensor], group) -> tuple[list[torch.Tensor], list]:
    """Post the send of `tensors` to the next rank and the receive of the same shapes from the previous one,
    in `exchange_order`; returns (receive buffers, works to wait for)."""
    C, r = comm.world(group), comm.rank(group)
    bufs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]  # contiguous, unlike empty_like
    post = {"recv": lambda: [comm.recv(b, (r - 1) % C, group) for b in bufs],
            "send": lambda: [comm.send(t.contiguous(), (r + 1) % C, group) for t in tensors]}
    first, second = exchange_order(r, C)
    return bufs, post[first]() + post[second]()


def _scores(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Causally masked attention scores in fp32: (B, H, Tq, Tk), -inf where a key lies after its query."""
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    return s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))


@functools.lru_cache(maxsize=64)
def _ring_layout(T: int, C: int, zigzag: bool, device: torch.device) -> tuple[list[torch.Tensor], list[list[bool]]]:
    """For a ring of C ranks over T tokens: each rank's positions on `device`, and attends[i][j], whether any
    query of rank i attends to any key of rank j (else every key lies after every query: the block is fully
    masked and skipped). Made once per (T, C, device), on the host: no host -> device copy or device read per
    layer."""
    host = [local_positions(T, i, C, zigzag) for i in range(C)]
    attends = [[bool(host[j].min() <= host[i].max()) for j in range(C)] for i in range(C)]
    return [p.to(device) for p in host], attends


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, zigzag: bool):
        # fp32 inside, as the backward (which autocast never reaches) recomputes it: under bf16 autocast the
        # matmuls below would otherwise give bf16 scores and a log-sum-exp the backward's softmax disagrees with
        with torch.autocast(q.device.type, enabled=False):
            return _RingAttention._forward(ctx, q, k, v, group, zigzag)

    @staticmethod
    def _forward(ctx, q, k, v, group, zigzag: bool):
        C, r = comm.world(group), comm.rank(group)
        T = q.shape[2] * C
        positions, attends = _ring_layout(T, C, zigzag, q.device)
        q_pos, scale = positions[r], 1.0 / math.sqrt(q.shape[-1])
        B, H, Tq, D = q.shape
        o = torch.zeros(B, H, Tq, D, dtype=torch.float32, device=q.device)
        m = torch.full((B, H, Tq), float("-inf"), device=q.device)
        l_sum = torch.zeros(B, H, Tq, device=q.device)
        kv, src = [k, v], r
        for step in range(C):
            pending = _exchange(kv, group) if step < C - 1 else None
            k_pos = positions[src]
            if attends[r][src]:
                s = _scores(q, kv[0], q_pos, k_pos, scale)
                m_new = torch.maximum(m, s.amax(-1))
                safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
                p = torch.exp(s - safe[..., None])
                corr = torch.exp(m - safe)
                l_sum = l_sum * corr + p.sum(-1)
                o = o * corr[..., None] + torch.matmul(p, kv[1].float())
                m = m_new
            if pending is not None:
                bufs, works = pending
                for w in works:
                    w.wait()
                kv, src = bufs, (src - 1) % C
        # laid out (B, Tq, H, D) like SDPA's output, so the caller's transpose + reshape to (B, Tq, H*D) is a
        # view: the output is then saved once, here and as c_proj's input (not a second, reshaped copy)
        out = torch.empty(B, Tq, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
        out.copy_(o / l_sum[..., None])
        lse = m + torch.log(l_sum)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.zigzag, ctx.positions, ctx.attends, ctx.scale = group, zigzag, positions, attends, scale
        return out

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, o, lse = ctx.saved_tensors
        group, positions, attends, scale = ctx.group, ctx.positions, ctx.attends, ctx.scale
        C, r = comm.world(group), comm.rank(group)
        q_pos, g = positions[r], grad_o.float()
        delta = (g * o.float()).sum(-1)  # (B, H, Tq): rowsum(dO * O)
        dq = torch.zeros_like(q, dtype=torch.float32)
        travel = [k, v, torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
        src = r
        for step in range(C):
            k_pos = positions[src]
            if attends[r][src]:
                kb, vb = travel[0].float(), travel[1].float()
                s = _scores(q, kb, q_pos, k_pos, scale)
                p = torch.exp(s - lse[..., None])                     # the forward's softmax, exactly merged
                travel[3] = travel[3] + torch.matmul(p.transpose(-2, -1), g)          # dV
                ds = p * (torch.matmul(g, vb.transpose(-2, -1)) - delta[..., None])
                dq += torch.matmul(ds, kb) * scale
                travel[2] = travel[2] + torch.matmul(ds.transpose(-2, -1), q.float()) * scale  # dK
            if C > 1:  # pass the block on (after C-1 moves it is rank r+1's; the C-th move returns dK/dV home)
                last = step == C - 1
                bufs, works = _exchange(travel[2:] if last else travel, group)
                for w in works:
                    w.wait()
                travel = [None, None, *bufs] if last else bufs
                src = (src - 1) % C
        dk, dv = travel[2], travel[3]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                   zigzag: bool = True) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, spread over `group` (see the module
    docstring). q, k, v: (B, heads, T/C, head_dim), this rank's tokens in `local_positions` order; returns
    this rank's output, same shape and dtype. With one rank it is plain causal attention."""
    return _RingAttention.apply(q, k, v, group, zigzag)


class RingAttentionCore(torch.nn.Module):
    """model.AttentionCore's causal attention with the keys and values of the whole sequence, which `group`'s
    ranks hold in zigzag shares: `ring_attention`. No dropout (config refuses it under CP)."""

    def __init__(self, group: dist.ProcessGroup | None):
        super().__init__()
        self.group = group

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.group)


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


def apply_context_parallel(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Make `model` (a GPT or a pipeline stage) run on this rank's zigzag share of every sequence: its positions
    from `local_positions`, and every attention core a ring over `group` (the tokens themselves are cut by
    `shard_sequence` before the forward). Parameters are untouched (replicated over cp; their gradients are
    reduced over dp x cp by the data-parallel wrapper)."""
    model.positions = positions_for(comm.rank(group), comm.world(group))
    for module in list(model.modules()):
        if hasattr(module, "core"):
            module.core = RingAttentionCore(group)


# ---- the PyTorch twin (CUDA only) ---------------------------------------------------------------------------

# torch 2.13's context_parallel rings these SDPA kernels and no others (_context_parallel/_attention.py,
# `_sdpa_handler`); on CPU, SDPA runs aten._scaled_dot_product_flash_attention_for_cpu, for which it raises
# "NotImplementedError: ... does not have a sharding strategy registered" (tried on gloo ranks)
TORCH_CP_KERNELS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


@contextlib.contextmanager
def torch_context_parallel(cp_mesh, x: torch.Tensor, y: torch.Tensor):
    """PyTorch's context parallelism around one micro-step's forward + backward, as torchtitan uses it:
    `context_parallel` shards copies of the full rows x and y along time in place (head-tail), and while it
    is open every F.scaled_dot_product_attention is a ring over cp_mesh (k/v all-gathered by default:
    torch's "allgather" rotater). Yields this rank's (x, y)."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    x, y = x.clone(), y.clone()  # sharded in place: x and y may be views of one token buffer
    with sdpa_kernel([getattr(SDPBackend, k) for k in TORCH_CP_KERNELS]), \
            context_parallel(cp_mesh, buffers=[x, y], buffer_seq_dims=[1, 1], no_restore_buffers={x, y}):
        yield x, y


def cp_p2p_bytes_per_micro_step(n_layer: int, B: int, T: int, n_embd: int, cp: int, tp: int = 1,
                                element_size: int = 4, recomputed_blocks: int = 0) -> int:
    """What parallel/comm.COUNTER records as "p2p" on one rank for one forward + backward: per attention, with
    A = B·(T/C)·(n_embd/tp) elements (one k or v block: all of this rank's heads), forward sends 2(C-1)·A
    (k and v, C-1 moves; fully masked blocks still travel, only their compute is skipped) and backward
    4(C-1)·A (k, v, dK, dV, C-1 moves) + 2·A (dK, dV home). Activation checkpointing re-runs the forward of
    each recomputed Block. Nothing with one cp rank."""
    if cp == 1:
        return 0
    A = B * (T // cp) * (n_embd // tp) * element_size
    per_layer_fwd, per_layer_bwd = 2 * (cp - 1) * A, (4 * (cp - 1) + 2) * A
    return n_layer * (per_layer_fwd + per_layer_bwd) + recomputed_blocks * per_layer_fwd
