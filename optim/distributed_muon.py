"""Muon across ranks: each matrix orthogonalised whole, once per step, by one owner rank, and the result sent to
the ranks that hold its pieces. Momentum and the rest of the update stay elementwise on each rank's pieces
(optim/muon.py); only Newton-Schulz (NS) needs the matrix whole.

What each rank holds, per layout (the `ranges`: which elements of the row-major flattened matrix each rank of
the group holds):
- DDP (and CP, PP x DDP): every rank of the data-parallel group holds every matrix whole (ranges all whole);
  the owner needs nothing sent to it, and sends its result to every other rank;
- ZeRO-1/2/3 (our flat engine, parallel/flat_param.py): rank r of the unit's group holds the elements of each
  matrix inside its flat shard [r S, (r + 1) S): a contiguous range, possibly empty, possibly the whole
  matrix, and a matrix cut by a shard boundary is spread over neighbours in rank order. The owner gathers
  every other rank's range (concatenated in rank order they are the whole matrix) and sends each its range of
  the result back.
- one process, or a pipeline stage without data parallelism: the rank holds its own matrices whole and
  orthogonalises them itself (optim/muon.orthogonalize_locally).

What is sent, which way (`Exchange.__call__`, once per step over `group`): one all_to_all of bf16 pieces to
their owners (NS casts to bf16 first, and a cast is elementwise, so the owner gets the bits one process
orthogonalises), then one all_to_all of bf16 results back to the holders. Owners are chosen by `owners`:
matrices in decreasing NS FLOPs, each to the least loaded rank (LPT), identically on every rank.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from optim.muon import Ledger, Piece, ns_flops, zeropower_via_newtonschulz
from parallel import comm


class Matrix(NamedTuple):
    """A Muon matrix as every rank of the group sees it: key, whole shape, and per group rank the elements
    [a, b) of the flattened matrix it holds."""
    key: str
    shape: tuple[int, int]
    ranges: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def whole_at(self, rank: int) -> bool:
        return self.ranges[rank] == (0, self.numel)


def owners(matrices: list[Matrix], world: int, ns_steps: int) -> dict[str, int]:
    """{key: owner rank}: longest NS first, each to the rank with the fewest FLOPs so far (lowest rank on ties);
    a matrix held whole by some ranks goes to the least loaded of those (nothing to gather), else to the least
    loaded of the ranks holding a piece of it."""
    load, out = [0] * world, {}
    for m in sorted(matrices, key=lambda m: (-ns_flops(m.shape, ns_steps), m.key)):
        whole = [r for r in range(world) if m.whole_at(r)] or [r for r in range(world) if _len(m.ranges[r])]
        r = min(whole, key=lambda r: (load[r], r))
        out[m.key] = r
        load[r] += ns_flops(m.shape, ns_steps)
    return out


class Exchange:
    """The layout's `orthogonalize` for Muon (optim/muon.Muon): over `group` (this rank its `rank`-th of
    `world`), every matrix in `matrices` (the same list, in the same order, on every rank) is orthogonalised
    by its owner; `ledger` counts what this rank did."""

    def __init__(self, matrices: list[Matrix], group: dist.ProcessGroup | None, ns_steps: int, ledger: Ledger,
                 device: torch.device):
        self.matrices, self.group, self.ns_steps, self.ledger = matrices, group, ns_steps, ledger
        self.device = device
        self.world, self.rank = comm.world(group), comm.rank(group)
        self.owner = owners(matrices, self.world, ns_steps)
        self.load = [sum(ns_flops(m.shape, ns_steps) for m in matrices if self.owner[m.key] == r)
                     for r in range(self.world)]

    def __call__(self, pieces: list[Piece]) -> list[torch.Tensor]:
        mine = {p.key: p.update.reshape(-1).bfloat16() for p in pieces}
        me, world = self.rank, self.world
        held = [m for m in self.matrices if m.ranges[me][1] > m.ranges[me][0]]
        if {m.key for m in held} != set(mine):
            raise RuntimeError(f"rank {me}: Muon pieces {sorted(set(mine) ^ {m.key for m in held})} "
                               f"missing or unexpected this step")
        gathers = [m for m in self.matrices if not m.whole_at(self.owner[m.key])]  # the owner lacks some pieces
        # 1. pieces to owners: to rank d, my range of each matrix d owns (and lacks), in list order
        send = [[mine[m.key] for m in gathers if self.owner[m.key] == d and m.key in mine and d != me]
                for d in range(world)]
        recv_sizes = [sum(_len(m.ranges[s]) for m in gathers if self.owner[m.key] == me) if s != me else 0
                      for s in range(world)]
        received = self._all_to_all(send, recv_sizes) if gathers else [None] * world  # the same on every rank
        # 2. NS on every matrix this rank owns, from its pieces in rank order
        results: dict[str, torch.Tensor] = {}
        offsets = [0] * world
        for m in self.matrices:
            if self.owner[m.key] != me:
                continue
            if m.whole_at(me):
                whole = mine[m.key]
            else:
                parts = []
                for s in range(world):
                    n = _len(m.ranges[s])
                    parts.append(mine.get(m.key, received[s][:0]) if s == me else received[s][offsets[s]:offsets[s] + n])
                    offsets[s] += 0 if s == me else n
                whole = torch.cat(parts)
            self.ledger.add(m.key)
            results[m.key] = zeropower_via_newtonschulz(whole.view(m.shape), self.ns_steps).reshape(-1)
        # 3. results back: to rank d, its range of each matrix this rank owns, in list order
        send = [[results[m.key][slice(*m.ranges[d])] for m in self.matrices
                 if self.owner[m.key] == me and _len(m.ranges[d])] if d != me else [] for d in range(world)]
        recv_sizes = [sum(_len(m.ranges[me]) for m in self.matrices if self.owner[m.key] == s) if s != me else 0
                      for s in range(world)]
        received = self._all_to_all(send, recv_sizes)
        offsets = [0] * world
        out = {}
        for m in self.matrices:
            o, n = self.owner[m.key], _len(m.ranges[me])
            if not n:
                continue
            if o == me:
                out[m.key] = results[m.key][slice(*m.ranges[me])]
            else:
                out[m.key] = received[o][offsets[o]:offsets[o] + n]
                offsets[o] += n
        return [out[p.key] for p in pieces]

    def _all_to_all(self, send: list[list[torch.Tensor]], recv_sizes: list[int]) -> list[torch.Tensor]:
        """One all_to_all_single of bf16 lists, sent as their bytes (gloo has no 16-bit all_to_all); returns
        what each rank sent here."""
        flat = [torch.cat(ts) if ts else torch.empty(0, dtype=torch.bfloat16, device=self.device) for ts in send]
        out = torch.empty(2 * sum(recv_sizes), dtype=torch.uint8, device=self.device)
        comm.all_to_all_single(out, torch.cat(flat).view(torch.uint8), [2 * n for n in recv_sizes],
                               [2 * t.numel() for t in flat], group=self.group)
        return list(out.view(torch.bfloat16).split(recv_sizes))


def _len(r: tuple[int, int]) -> int:
    return r[1] - r[0]
