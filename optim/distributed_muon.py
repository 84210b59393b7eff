"""Muon across ranks: each matrix orthogonalised whole, once per step, by one owner rank, and the result sent to
the ranks that hold its pieces. Momentum and the rest of the update stay elementwise on each rank's pieces
(optim/muon.py); only Newton-Schulz (NS) needs the matrix whole.

What each rank of a pipeline stage holds of each matrix is a `Hold` (optim/build.py reads it off the layout):
- DDP, CP: every rank the whole matrix (the owner gathers nothing and sends its result to every other rank);
- ZeRO-1/2/3 and HSDP (our flat engine): the elements in its flat shard, a range, possibly empty; a matrix cut
  by a shard boundary is spread over neighbours (the owner gathers one copy of each piece);
- TP: its row slice (column-parallel q, k, v, c_fc) or column slice (row-parallel c_proj), placed by index;
- EP: its experts, each expert a matrix of its own (keyed by its global index);
- PP: only its stage's matrices; the group is the stage's ranks.
docs/muon.md has the table.

What is sent, which way (`Exchange.__call__`, once per step over the stage's group): one all_to_all of bf16
pieces to their owners (NS casts to bf16 first, and a cast is elementwise, so the owner gets the bits one process
orthogonalises; skipped where every owner holds its matrices whole), then one all_to_all of bf16 results to
every rank holding a piece. Owners are chosen by `owners`: matrices in decreasing NS FLOPs, each to the least
loaded rank (LPT), identically on every rank.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from optim.muon import Hold, Ledger, Piece, ns_flops
from parallel import comm


class Matrix(NamedTuple):
    """A Muon matrix as every rank of the group sees it: its key, whole shape, and what each group rank holds
    (None: nothing)."""

    key: str
    shape: tuple[int, int]
    holds: tuple[Hold | None, ...]

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def whole_at(self, rank: int) -> bool:
        h = self.holds[rank]
        return h is not None and h.hi - h.lo == self.numel


def owners(matrices: list[Matrix], world: int, ns_steps: int) -> dict[str, int]:
    """{key: owner rank}: longest NS first, each to the rank with the fewest FLOPs so far; on ties the rank
    holding most of the matrix (least to gather), then the lowest."""
    load, out = [0] * world, {}
    for m in sorted(matrices, key=lambda m: (-ns_flops(m.shape, ns_steps), m.key)):
        held = [0 if h is None else h.hi - h.lo for h in m.holds]
        r = min(range(world), key=lambda r: (load[r], -held[r], r))
        out[m.key] = r
        load[r] += ns_flops(m.shape, ns_steps)
    return out


def sources(m: Matrix, owner: int) -> list[int]:
    """The ranks the owner assembles `m` from: itself first if it holds any, then each rank in order whose
    elements no chosen rank has (replicas hold equal pieces: one of them is enough)."""
    covered = torch.zeros(m.numel, dtype=torch.bool)
    out = []
    for s in [owner] + [r for r in range(len(m.holds)) if r != owner]:
        h = m.holds[s]
        if h is None or h.hi == h.lo:
            continue
        seen = covered[h.positions(m.shape)]
        if seen.all():
            continue
        if seen.any():
            raise ValueError(f"{m.key}: rank {s}'s piece partly overlaps another's")
        covered[h.positions(m.shape)] = True
        out.append(s)
    if not covered.all():
        raise ValueError(f"{m.key}: the ranks hold {int(covered.sum())} of its {m.numel} elements")
    return out


class Exchange:
    """The layout's `orthogonalize` for Muon (optim/muon.Muon) over `group` (this rank its `rank`-th): every
    matrix in `matrices` (the same list on every rank) is orthogonalised by its owner; `ledger` counts what this
    rank did. Per step: one all_to_all of bf16 pieces to the owners (skipped where every owner holds its matrices
    whole), NS, one all_to_all of bf16 results to every rank holding a piece."""

    def __init__(
        self,
        matrices: list[Matrix],
        group: dist.ProcessGroup | None,
        ns_steps: int,
        ledger: Ledger,
        device: torch.device,
    ):
        self.matrices, self.group, self.ns_steps, self.ledger = matrices, group, ns_steps, ledger
        self.device = device
        self.world, self.rank = comm.world(group), comm.rank(group)
        self.owner = owners(matrices, self.world, ns_steps)
        self.sources = {m.key: sources(m, self.owner[m.key]) for m in matrices}
        self.load = [
            sum(ns_flops(m.shape, ns_steps) for m in matrices if self.owner[m.key] == r) for r in range(self.world)
        ]
        self.gathers = any(s != self.owner[k] for k, ss in self.sources.items() for s in ss)
        self.returns = any(h is not None and r != self.owner[m.key] for m in matrices for r, h in enumerate(m.holds))
        me = self.rank
        self.owned = [m for m in matrices if self.owner[m.key] == me]
        self._pos = {  # built once, index tensors on the device: no host-to-device copy per matrix per step
            (m.key, r): h.positions(m.shape, device) for m in self.owned for r, h in enumerate(m.holds) if h is not None
        }
        ledger.sent_bytes = self.sent_bytes()  # what the benchmark reports beside comm's count

    def sent_bytes(self) -> int:
        """What this rank sends per step, from the holds alone (2 bytes an element, bf16): its pieces of the
        matrices it is a source of but does not own, and of each matrix it owns, every other holder's elements.
        DDP over N ranks: 2 (N - 1) x the elements of the matrices it owns."""
        me = self.rank
        gather = sum(_n(m.holds[me]) for m in self.matrices if self.owner[m.key] != me and me in self.sources[m.key])
        back = sum(_n(h) for m in self.owned for r, h in enumerate(m.holds) if r != me)
        return 2 * (gather + back)

    def __call__(self, pieces: list[Piece]) -> list[torch.Tensor]:
        me, world = self.rank, self.world
        mine = {p.key: p.update.reshape(-1).bfloat16() for p in pieces}  # NS's first op, elementwise: no change
        expected = {m.key for m in self.matrices if m.holds[me] is not None}
        if set(mine) != expected:
            raise RuntimeError(f"rank {me}: Muon pieces {sorted(set(mine) ^ expected)} missing or unexpected")
        # 1. pieces to their owners, in list order
        send = [
            [mine[m.key] for m in self.matrices if self.owner[m.key] == d != me and me in self.sources[m.key]]
            for d in range(world)
        ]
        sizes = [
            0 if s == me else sum(_n(m.holds[s]) for m in self.owned if s in self.sources[m.key]) for s in range(world)
        ]
        received = self._all_to_all(send, sizes) if self.gathers else [None] * world  # alike on every rank
        # 2. NS of every matrix this rank owns, assembled from its sources
        at, wholes = [0] * world, []
        for m in self.owned:
            whole = torch.empty(m.numel, dtype=torch.bfloat16, device=self.device)
            for s in self.sources[m.key]:
                n = _n(m.holds[s])
                whole[self._pos[m.key, s]] = mine[m.key] if s == me else received[s][at[s] : at[s] + n]
                at[s] += 0 if s == me else n
            wholes.append(whole.view(m.shape))
        done = self.ledger.newton_schulz([m.key for m in self.owned], wholes, self.ns_steps)  # same shapes batched
        results = {m.key: o.reshape(-1) for m, o in zip(self.owned, done)}
        # 3. results to every rank holding a piece, in list order
        send = [
            [results[m.key][self._pos[m.key, d]] for m in self.owned if m.holds[d] is not None] if d != me else []
            for d in range(world)
        ]
        sizes = [
            0 if s == me else sum(_n(m.holds[me]) for m in self.matrices if self.owner[m.key] == s)
            for s in range(world)
        ]
        received = self._all_to_all(send, sizes) if self.returns else [None] * world
        at, out = [0] * world, {}
        for m in self.matrices:
            o, n = self.owner[m.key], _n(m.holds[me])
            if m.holds[me] is None:
                continue
            if o == me:
                out[m.key] = results[m.key][self._pos[m.key, me]]
            else:
                out[m.key] = received[o][at[o] : at[o] + n]
                at[o] += n
        return [out[p.key] for p in pieces]

    def _all_to_all(self, send: list[list[torch.Tensor]], recv_sizes: list[int]) -> list[torch.Tensor]:
        """One all_to_all_single of bf16 lists, sent as their bytes (gloo has no 16-bit all_to_all); returns
        what each rank sent here."""
        flat = [torch.cat(ts) if ts else torch.empty(0, dtype=torch.bfloat16, device=self.device) for ts in send]
        out = torch.empty(2 * sum(recv_sizes), dtype=torch.uint8, device=self.device)
        comm.all_to_all_single(
            out,
            torch.cat(flat).view(torch.uint8),
            [2 * n for n in recv_sizes],
            [2 * t.numel() for t in flat],
            group=self.group,
        )
        return list(out.view(torch.bfloat16).split(recv_sizes))


def _n(h: Hold | None) -> int:
    return 0 if h is None else h.hi - h.lo
