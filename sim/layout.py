"""The mesh of a layout, its classes of ranks and the shifts between them: what lets sim.verify simulate one rank
per class and stand it for the others.

A class is the set of ranks whose recordings must be the same up to a shift of the mesh (`Layout.shift`): the class
of its pipeline stage, the parity of its cp rank (`context_parallel.exchange_order`: even ranks send first), under
expert parallelism its EP rank, and nothing else; a rank that a fault hook names (GPT_COMM_FAULT_RANK,
GPT_FAULT_RANK, ...) is a class of its own. Pipeline stages share a class when their `Stage` keys are equal
(`stage_signatures`, computed from the plan without simulating): the Blocks they hold (each by its parameters'
shapes: an uneven split, an MoE Block every N-th keep stages apart), whether they hold the first or last chunk (wte
and the token ids; lm_head and the loss; the embedding group), and their training schedule's action list and
evaluation order, peers written as pp offsets. So GPipe's interior stages of equal Blocks share a class (pp=32 x
cp=2: 8 classes, not 64), and 1F1B's never do (stage r runs P-1-r warm-up forwards: another order of posts and
waits); the first and last stage are always classes of their own. Every other rank's recording is its class
representative's with every rank in it shifted, pp included (its peers are at the same offsets, so none crosses an
end; a group over the whole pp dim maps onto itself); call sites name Blocks by their place in the stage
(`Layout.local_site`).
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

from sim.replay import span

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FAULT_RANKS = (
    ("GPT_COMM_FAULT", "GPT_COMM_FAULT_RANK"),
    ("GPT_FAULT_GRAD", "GPT_FAULT_RANK"),
    ("GPT_FAULT_DDP_DROP_BUCKET", "GPT_FAULT_RANK"),
    ("GPT_SIGNAL_AT_STEP", "GPT_SIGNAL_RANK"),
    ("GPT_KILL_AT_STEP", "GPT_KILL_RANK"),
)  # (the hook's switch, the variable naming its rank, default 0)


class Layout:
    """The mesh of a dims (parallel.mesh.ParallelDims): coordinates (pp, dp_replicate, dp_shard, cp, tp) of a rank,
    tp fastest (parallel/mesh.py), and the classes of ranks that must record alike."""

    def __init__(self, dims, special: frozenset[int] = frozenset(), stages: Sequence[Stage] | None = None):
        """`stages`: each pipeline rank's `Stage` (`stage_signatures`); pipeline ranks whose keys are equal share
        classes. None: every pipeline rank is a class of its own (and a shift never moves pp)."""
        self.dims, self.special = dims, special
        self.sizes = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
        self.world = dims.world_size
        self._coords = [self._coordinates(r) for r in range(self.world)]
        self.stages = list(stages) if stages is not None else None
        if self.stages is not None and len(self.stages) != dims.pp:
            raise ValueError(f"{len(self.stages)} stage signatures for pp={dims.pp}")
        first: dict[tuple, int] = {}
        self.stage_class = (
            [first.setdefault(s.key, p) for p, s in enumerate(self.stages)] if self.stages else list(range(dims.pp))
        )  # pp rank -> the lowest pp rank whose stage records alike

    @classmethod
    def of(cls, spec, special: frozenset[int] = frozenset()) -> "Layout":
        """The layout of a validated plan (config.validate), its pipeline ranks' classes from `stage_signatures`."""
        return cls(spec.dims, special, stage_signatures(spec))

    def _coordinates(self, rank: int) -> tuple[int, ...]:
        out = []
        for size in reversed(self.sizes):
            out.append(rank % size)
            rank //= size
        return tuple(reversed(out))

    def coords(self, rank: int) -> tuple[int, ...]:
        return self._coords[rank]

    def rank(self, coords) -> int:
        r = 0
        for c, size in zip(coords, self.sizes):
            r = r * size + c
        return r

    def class_key(self, rank: int) -> tuple:
        """What decides a rank's control flow: its pipeline stage's class (`stage_class`: the lowest pipeline rank
        whose `Stage.key` equals its own), the parity of its cp rank and, under expert parallelism, its EP rank
        (the experts it holds: which rows it sends where; a shift that keeps it maps EP groups onto EP groups)
        (or, for a rank a fault hook names, the rank itself)."""
        if rank in self.special:
            return ("rank", rank)
        pp, dr, ds, cp, _ = self.coords(rank)
        ep = getattr(self.dims, "ep", 1)
        loss = (dr * self.dims.dp_shard + ds) * self.dims.cp + cp  # parallel.mesh.expert_dims' loss rank
        return ("stage", self.stage_class[pp], cp % 2) + ((loss % ep,) if ep > 1 else ())

    def classes(self) -> dict[int, list[int]]:
        """{representative: members}, the representative the lowest member."""
        by: dict[tuple, list[int]] = defaultdict(list)
        for r in range(self.world):
            by[self.class_key(r)].append(r)
        return {members[0]: members for members in by.values()}

    def representative(self) -> dict[int, int]:
        return {m: rep for rep, members in self.classes().items() for m in members}

    def shift(self, src: int, dst: int):
        """The map of global ranks that carries rank src's recording to rank dst's (same class): every coordinate
        moved by dst's minus src's, modulo its size. pp moves only between stages of one class, whose pipeline
        peers are the neighbours at the same offsets (`Stage.key`), so no peer crosses the pipeline's ends; a
        group spanning the whole pp dim maps onto itself."""
        a, b = self.coords(src), self.coords(dst)
        delta = [(y - x) for x, y in zip(a, b)]
        if not any(delta):
            return lambda r: r
        sizes, coords, rank = self.sizes, self._coords, self.rank
        return lambda r: rank([(c + d) % s for c, d, s in zip(coords[r], delta, sizes)])

    def local_site(self, site: str, rank: int) -> str:
        """A call site with each Block it names by global index (`transformer.h.17`) named by its place among
        rank's stage's Blocks (`transformer.h.@1`): what a shift in pp keeps."""
        if self.stages is None:
            return site
        blocks = self.stages[self.coords(rank)[0]].blocks
        return BLOCK.sub(lambda m: f"@{blocks.index(int(m[0]))}" if int(m[0]) in blocks else f"?{m[0]}", site)

    def describe_group(self, ranks: tuple[int, ...]) -> str:
        """A group by the mesh dims its members span, and its ranks: `tp [4, 5]`, `world (16 ranks)`."""
        if len(ranks) == self.world:
            return f"world ({self.world} ranks)"
        coords = [self.coords(r) for r in ranks]
        spans = [d for i, d in enumerate(DIMS) if len({c[i] for c in coords}) > 1]
        return f"{'x'.join(spans) or 'self'} {span(ranks)}"


BLOCK = re.compile(r"(?<=\bh\.)\d+\b")  # a Block's global index in a unit's name: transformer.h.<17>


class Stage(NamedTuple):
    """A pipeline rank's part in the recording: `key`, everything its recording is made of beyond the mesh (two
    pipeline ranks with equal keys record alike up to a shift of pp; `stage_signatures`), and `blocks`, the
    global indices of the Blocks it holds, in its order (call sites name Blocks by them: `Layout.local_site`)."""

    key: tuple
    blocks: tuple[int, ...]


def stage_signatures(spec) -> list[Stage]:
    """Each pipeline rank's `Stage`, computed from the plan, without simulating. The key holds:
    - its chunks in local order, each as (holds chunk 0: wte, wpe and the token ids; holds the last chunk: ln_f,
      lm_head, the targets and the loss; its Blocks, each as its parameters' (name, shape, dtype) on meta):
      an uneven split (the cost model's, --pp_layers_per_stage) or an MoE Block every N-th (--moe_every) keeps
      stages apart, and so does any difference in state bytes, which the parameters decide;
    - its training step's action list, as PipelineRunner.step takes it (parallel/pipeline/schedule.py,
      ALL_SCHEDULES[schedule](P, M, V)[rank]; the sends' waits, `send_waits`, follow from it): each action as
      (kind, local chunk, micro-batch, peer's pp offset for a SEND/RECV). GPipe's interior stages have equal
      lists; 1F1B's do not (stage r runs P-1-r warm-up forwards), nor interleaved 1F1B's, ZB-H1's, ZB-V's or
      DualPipe-V's, whose warm-ups depend on the rank too;
    - its evaluation's order (PipelineRunner.forward_only): each local chunk in global order with the pp
      offsets it receives from and sends to.
    Peers as offsets: a stage sharing a class with another sends to and receives from the ranks at the same
    offsets, so the pp shift between them maps every peer onto the other's. Without a pipeline: one Stage."""
    import torch

    from model.gpt import Block
    from parallel.pipeline.runner import chunk_ranges
    from parallel.pipeline.schedule import ALL_SCHEDULES, RECV_B, RECV_F, SEND_B, SEND_F, V_SCHEDULES, chunk_of, rank_of

    d, parallel, n_layer = spec.dims, spec.parallel, spec.config.n_layer
    if d.pp == 1:
        return [Stage(("single",), tuple(range(n_layer)))]
    P, V, v_shape = d.pp, parallel.pp_virtual, parallel.pp_schedule in V_SCHEDULES
    C = P * V
    layers = chunk_ranges(n_layer, C, parallel.pp_layers)
    with torch.device("meta"):
        block = [
            tuple((n, tuple(p.shape), str(p.dtype)) for n, p in Block(spec.config, i).named_parameters())
            for i in range(n_layer)
        ]
    schedule = ALL_SCHEDULES[parallel.pp_schedule](P, spec.grad_accum, V)
    out = []
    for r in range(P):
        chunks = [chunk_of(r, v, P, v_shape) for v in range(V)]
        local = {c: v for v, c in enumerate(chunks)}

        def offset(c: int) -> int | None:  # the pp offset of chunk c's rank, None off the ends or on this rank
            return None if not 0 <= c < C or rank_of(c, P, v_shape) == r else rank_of(c, P, v_shape) - r

        held = tuple((c == 0, c == C - 1, tuple(block[i] for i in layers[c])) for c in chunks)
        peer = {SEND_F: 1, RECV_B: 1, RECV_F: -1, SEND_B: -1}
        actions = tuple(
            (a.kind, local[a.chunk], a.micro, offset(a.chunk + peer[a.kind]) if a.kind in peer else None)
            for a in schedule[r]
        )
        evaluation = tuple((local[c], offset(c - 1), offset(c + 1)) for c in sorted(chunks))
        out.append(Stage((held, actions, evaluation), tuple(i for c in chunks for i in layers[c])))
    return out


def fault_ranks(world: int) -> frozenset[int]:
    """The ranks a fault hook of trainer/faults.py is switched on for (each is then a class of its own)."""
    out = set()
    for switch, var in FAULT_RANKS:
        if os.environ.get(switch):
            who = os.environ.get(var, "0")
            out.update(range(world) if who == "all" else [int(who)])
    return frozenset(r for r in out if r < world)
