"""Pipeline parallelism at run time: a GPT cut into stages, and a runner that executes a schedule's actions.

Schedules (which compute runs when, and every SEND/RECV) come from parallel/pipeline/schedule.py as per-rank action
lists; this module only executes them. It imports nothing of model/: what a stage runs besides the GPT's modules
(the head and its loss, the side losses, the init) comes in as `ModelParts`, and the split backward and the step's
record as arguments, all handed in by the composition (parallel/parallelize.py).

- `PipelineStage`: the part of a GPT that pp rank r of P keeps, for V virtual chunks per rank: the Blocks of
  chunks r, r+P, ... (`chunk_of`; the V schedules: r and 2P-1-r; how many Blocks each chunk holds is given:
  config's partition by cost, parallel/pipeline/partition.py), plus wte/wpe on chunk 0's rank and ln_f/lm_head on the
  last chunk's rank. Parameter names stay the GPT's (transformer.h.3.attn.c_q.weight), so optimizer groups and
  checkpoints map by name.
- Tied embedding (Megatron's rule; docs/pipeline.md derives it): the last stage holds its own copy of the
  embedding matrix, `lm_head.weight`, initialised as wte; `PipelineRunner.reduce_tied_grads` all-reduces (SUM)
  the two gradients over [first rank, last rank] after each backward, so the copies stay equal. Where one rank
  holds both ends (P == 1, rank 0 of the V schedules) lm_head is tied to wte as in GPT.
- `PipelineRunner.step`: M micro-batches by the named schedule, one handler per action kind; a split
  schedule's B and W go through the store `split_backward` builds (parallel/pipeline/zero_bubble.py). Point-to-point
  only (counted as "p2p"): per micro-batch and stage boundary one activation (mb, T, C) forward and its gradient
  backward, shapes known to both sides (no handshake). What a step measures is its `record`'s
  (parallel/pipeline/record.py).

Order per step: `step` -> `reduce_tied_grads` -> the global norm's clip -> optimizer step.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable, ContextManager, NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from parallel import comm
from parallel.groups import group_timeout, new_groups, p2p_link
from parallel.pipeline.actions import RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, W
from parallel.pipeline.schedule import (
    ALL_SCHEDULES,
    SPLIT_SCHEDULES,
    V_SCHEDULES,
    boundary,
    chunk_of,
    consecutive,
    evaluation,
    even_partition,
    peer_of,
    rank_of,
    send_waits,
)


class ModelParts(NamedTuple):
    """What a stage runs of the model besides its modules, handed in (parallel/pipeline/parts.py: model/'s).

    `head(stage, x, targets)`: lm_head and the loss on ln_f's output, as the GPT's (`model.loss.head_output`);
    `side_losses()`: a context collecting the side losses a forward adds, `.total` (`model.moe.SideLosses`);
    `loss_share(M, scale)`: the context a micro-batch's forward runs in, its loss to be divided by M and scaled
    (`model.loss.loss_share`); `materialize(module, prefix, config, seed, device)`: init one unit as the GPT's
    (`model.gpt.materialize_module`)."""

    head: Callable
    side_losses: Callable[[], ContextManager]
    loss_share: Callable[[int, Callable | None], ContextManager]
    materialize: Callable


def chunk_ranges(n_layer: int, chunks: int, counts: Sequence[int] | None = None) -> list[range]:
    """Block indices of each chunk: `counts` Blocks per chunk in order, or (None) `even_partition`'s."""
    if counts is None:
        return even_partition(n_layer, chunks)
    if len(counts) != chunks or min(counts) < 1 or sum(counts) != n_layer:
        raise ValueError(
            f"Blocks per chunk {list(counts)} is not a partition of {n_layer} Blocks into {chunks} non-empty chunks"
        )
    return consecutive(counts)


class PipelineStage(nn.Module):
    """Pipeline rank `rank` of `pp` with `virtual` chunks: stores only its own chunks' parameters.

    Built from a GPT on meta (then `materialize(seed)` allocates and inits exactly this stage's parameters,
    by name, as GPT.init_weights would) or from an initialised GPT (the stage shares its modules; the
    lm_head copy is a clone of wte). Holds no reference to the GPT: other stages' modules are not kept.
    `parts`: what it runs besides the modules (`ModelParts`); without them a stage is only cut (the planner
    counts its units), and neither runs nor materialises.
    `layers`: Blocks per chunk, P·V counts (every rank passes the same: trainer/config.py resolves them from
    --pp_layers_per_stage or the cost model, parallel/pipeline/partition.py); None: as even as possible, the extra
    Blocks to the front (`even_partition`). `self.layers[c]` is chunk c's range of Block indices.
    """

    def __init__(
        self,
        model: nn.Module,
        rank: int,
        pp: int,
        virtual: int = 1,
        layers: Sequence[int] | None = None,
        v_shape: bool = False,
        parts: ModelParts | None = None,
    ):
        super().__init__()
        self.parts = parts
        self.config, self.rank, self.pp, self.virtual, self.v_shape = model.config, rank, pp, virtual, v_shape
        if v_shape and virtual != 2:
            raise ValueError(f"a V layout has two chunks per rank; got virtual={virtual}")
        self.n_chunks = pp * virtual
        self.layers = chunk_ranges(model.config.n_layer, self.n_chunks, layers)
        self.chunks = [chunk_of(rank, v, pp, v_shape) for v in range(virtual)]  # this rank's global chunk indices
        self.first, self.last = 0 in self.chunks, self.n_chunks - 1 in self.chunks
        self.both_ends = self.first and self.last  # lm_head stays tied to wte here (P == 1; a V's rank 0)
        t = model.transformer
        self.transformer = nn.ModuleDict()
        if self.first:
            self.transformer["wte"], self.transformer["wpe"], self.transformer["drop"] = t.wte, t.wpe, t.drop
        # a ModuleDict keyed by the global Block index keeps the names transformer.h.<i>.*
        self.transformer["h"] = nn.ModuleDict({str(i): t.h[i] for c in self.chunks for i in self.layers[c]})
        if self.last:
            self.transformer["ln_f"] = t.ln_f
            if self.both_ends:
                self.lm_head = model.lm_head  # tied to wte, as in GPT
            else:
                w = model.transformer.wte.weight
                self.lm_head = nn.Linear(
                    self.config.n_embd, self.config.vocab_size, bias=False, device=w.device, dtype=w.dtype
                )
                if not w.is_meta:
                    with torch.no_grad():
                        self.lm_head.weight.copy_(w)
        self.head_loss, self.loss_fn = model.head_loss, model.loss_fn  # lm_head + loss chunked; on whole logits
        self.positions = model.positions  # (T, device) -> positions; context parallelism may have swapped them
        self.side_loss: torch.Tensor | None = None  # the last forward_chunk's side losses (a chunk before the last)

    def init_units(self) -> list[tuple[str, nn.Module]]:
        """(GPT name, module) pairs that together own each of this stage's parameters once."""
        t = self.transformer
        units = [("transformer.wte", t.wte), ("transformer.wpe", t.wpe)] if self.first else []
        units += [(f"transformer.h.{i}", b) for i, b in t.h.items()]
        if self.last:
            units.append(("transformer.ln_f", t.ln_f))
            if not self.both_ends:
                units.append(("lm_head", self.lm_head))  # materialize_module inits it as transformer.wte.weight
        return units

    def materialize(self, seed: int, device: torch.device | str | None = None) -> None:
        """Allocate and init this stage's parameters only, one unit at a time (values equal GPT's eager init)."""
        for prefix, module in self.init_units():
            self.parts.materialize(module, prefix, self.config, seed, device)
        if self.both_ends:
            self.lm_head.weight = self.transformer.wte.weight

    def forward_chunk(self, chunk: int, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Chunk `chunk` on its input: token ids (B, T) for chunk 0, else the activation (B, T, C).
        Returns the activation (B, T, C), or on the last chunk the mean cross-entropy against `targets`, lm_head
        and loss computed together chunk by chunk over rows as GPT's (`ModelParts.head`), plus the chunk's side
        losses (the MoE balancing loss), or the logits (B, T, V) without targets. A chunk before the last leaves
        its side losses in `side_loss` (None without), for the runner to add to its backward."""
        t = self.transformer
        with self.parts.side_losses() as side:
            if chunk == 0:
                pos = self.positions(x.shape[1], x.device)
                x = t.drop(t.wte(x) + t.wpe(pos))  # (B, T, C)
            for i in self.layers[chunk]:
                x = t.h[str(i)](x)  # (B, T, C)
        if chunk == self.n_chunks - 1:
            logits, loss = self.parts.head(self, t.ln_f(x), targets)  # (B, T, V) logits, or the loss
            self.side_loss = None
            return logits if targets is None else loss if side.total is None else loss + side.total
        self.side_loss = side.total
        return x


def embedding_group(pipelines: list[list[int]], v_shape: bool = False) -> dist.ProcessGroup | None:
    """The two-rank group [first, last] of this rank's pipeline (None if this rank is in neither end, or P==1;
    and for every rank under a V layout, whose first rank holds both ends: no group is built).

    `pipelines` lists every pipeline's global ranks in pp order; every rank of the world must call this with
    the same list, member or not (a middle stage too), because dist.new_group is collective over the whole
    world: on NCCL a new_group that some rank skips hangs the ranks that call it. All W/P groups are built by
    `new_groups`: on eager NCCL one split_group, one world-wide call instead of W/P."""
    pairs = [[ranks[0], ranks[-1]] for ranks in pipelines if len(ranks) >= 2 and not v_shape]
    return new_groups(pairs, group_timeout()) if pairs else None


TIED = "tied"  # the sharding engine's unit for a stage's end of the tied embedding


def sharded_units(stage: PipelineStage) -> dict[str, tuple[str, ...]]:
    """Where the pipeline meets sharding: the units our sharding engine (parallel/data_parallel/fsdp.py, `separate`)
    cuts a stage into beyond its root and Blocks. A stage holding one end of the tied embedding (the first stage wte,
    the last its lm_head copy) keeps it as a unit of its own, so both ends shard it alike and
    `reduce_tied_grads` sums their shard gradients elementwise (dp rank d of each holds the same elements); a
    rank holding both ends (P == 1, a V layout's rank 0) has one tied parameter, as a GPT, in its root."""
    one_end = stage.pp > 1 and (stage.first or stage.last) and not stage.both_ends
    return {TIED: ("transformer.wte", "lm_head")} if one_end else {}


WHOLE_WORLD = "whole world"  # PipelineRunner's embed_group default: the pipeline is the world, build it here


class PipelineRunner:
    """Runs one rank's action list of a schedule over its `PipelineStage`, each action by its handler; what a
    step measured is in `record` (parallel/pipeline/record.py's StepRecord, or nothing without one).

    Stores, per micro-batch whose forward ran and whose backward has not: each chunk's input (a leaf) and
    output (or scaled loss) with its graph; freed at that backward. Under a split schedule, from B to W: the
    (input, output gradient) of each of the chunk's linears (`self.store`). A sent tensor is held until its send
    is waited on where the list says (`send_waits`), so every rank holds what the schedule bounds (1F1B: P - rank
    micro-batches, plus one gradient in flight). A receive is waited on just before the F or B that reads it.
    Sends to the neighbouring chunks' ranks in `group` (the pp group; None: the whole world) or on a boundary's
    link group; all-reduces the tied embedding's gradient over `embed_group` (`reduce_tied_grads`)."""

    def __init__(
        self,
        stage: PipelineStage,
        group: dist.ProcessGroup | None = None,
        embed_group: dist.ProcessGroup | None | str = WHOLE_WORLD,
        act_dtype: torch.dtype = torch.float32,
        seq_shard: int = 1,
        engine: nn.Module | None = None,
        device: torch.device | None = None,
        links: Sequence[dist.ProcessGroup] = (),
        record: object | None = None,
        split_backward: Callable | None = None,
    ):
        """`act_dtype`: the dtype of the activations between chunks, what the stages really produce (the
        residual stream's: fp32, or the compute copies' dtype when FSDP gathers bf16 ones); both sides of a
        send must agree, since the receiver allocates it. `seq_shard`: activations between chunks are (mb, T /
        seq_shard, C) (tp under sequence parallelism). `engine`: our sharding engine wrapping the stage
        (parallel/data_parallel/fsdp.py), which then runs every chunk (`engine.run`, so its hooks see each one) and
        holds the tied matrix's shard pieces (`sharded_units`) that `reduce_tied_grads` sums. `links` (NCCL:
        parallel.groups.serial_p2p): the pp group's link groups, one per link colour, each message on its chunk
        boundary's (`p2p_link`; docs/pipeline.md, Messages), or () for every message on `group`. `embed_group`:
        `embedding_group(...)`, which every rank of the world builds together (None on a middle stage; by
        default built here, for a pipeline that is the whole world). `record`: what sees each action (a
        StepRecord; None: nothing). `split_backward(stage, engine)`: the zero-bubble schedules' machinery
        (parallel/pipeline/zero_bubble.py), built on the first split step: a store whose `defer(key)` the F and B of
        (chunk, micro) run in and whose `flush(key)` is W; None: this runner runs no split schedule."""
        self.stage, self.group, self.act_dtype, self.seq_shard = stage, group, act_dtype, seq_shard
        self.links = tuple(links)
        self.engine = engine
        self.forward = stage.forward_chunk if engine is None else partial(engine.run, stage.forward_chunk)
        self.device = device if device is not None else next(stage.parameters()).device
        self.tied = (
            engine.unit_pieces(TIED) if engine is not None else [w for w in [self.tied_weight()] if w is not None]
        )
        if comm.world(group) != stage.pp:
            raise ValueError(f"pp group has {comm.world(group)} ranks, the stage was cut for pp={stage.pp}")
        if isinstance(embed_group, str):
            if stage.pp > 1 and comm.world(group) != dist.get_world_size():
                raise ValueError(
                    "the pp group is not the whole world: pass embed_group=embedding_group(...), "
                    "built by every rank of the world"
                )
            embed_group = embedding_group([list(range(stage.pp))], stage.v_shape) if stage.pp > 1 else None
        self.embed_group = embed_group
        self.record = record if record is not None else _Unrecorded()  # the last step's timeline, events, peaks
        self.split_backward = split_backward
        self.store = None  # a split schedule's deferred weight gradients (built by its first step)

    def step(
        self,
        micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
        schedule_name: str = "1f1b",
        scale: Callable | None = None,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch; gradients accumulate into the stage's .grad.

        Every rank passes the same list (only chunk 0 reads x, only the last chunk y; the others read the
        shapes). Each micro-batch's loss is scaled by 1/M (then by `scale`, e.g. a GradScaler's, for its
        backward), so summed over ranks the return values are the mean loss; this rank returns its share
        (0 unless it holds the last chunk)."""
        st = self.stage
        if (schedule_name in V_SCHEDULES) != st.v_shape:
            raise ValueError(
                f"schedule {schedule_name} needs a stage cut {'in' if not st.v_shape else 'without'} "
                "a V (PipelineStage(..., v_shape=True) for zbv and dualpipev)"
            )
        split = schedule_name in SPLIT_SCHEDULES
        if split and self.store is None:
            if self.split_backward is None:
                raise ValueError(f"schedule {schedule_name} splits the backward: build the runner with split_backward")
            self.store = self.split_backward(st, self.engine)
        s = _Step(micro_batches, self, scale, self.store if split else None, train=True)
        self.record.start(split)
        self._run(ALL_SCHEDULES[schedule_name](st.pp, s.M, st.virtual)[st.rank], s, self.record)
        return s.loss

    @torch.no_grad()
    def forward_only(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Each micro-batch's loss (evaluation): `evaluation`'s list, micro-batch after micro-batch, each rank's
        chunks in order, by the same handlers (a receive waited on at once by its F, the sends at the end). Every
        rank passes the same list; the rank of the last chunk returns the losses, the others zeros."""
        st = self.stage
        s = _Step(micro_batches, self, None, None, train=False)
        self._run(evaluation(st.pp, s.M, st.virtual, st.v_shape)[st.rank], s, _Unrecorded())
        return [loss if loss is not None else torch.zeros((), device=self.device) for loss in s.losses]

    def _run(self, actions: list[Action], s: _Step, record) -> None:
        """Each action by its handler, in the list's order. Before it (off its clock: waiting is idle): the sends
        `send_waits` names there, and for an F or B the receive of its input; after the last, the sends no B
        waited on."""
        waits = send_waits(actions)
        handlers = {
            F: self._forward,
            B: self._backward,
            W: self._weights,
            SEND_F: self._send,
            SEND_B: self._send,
            RECV_F: self._recv,
            RECV_B: self._recv,
        }
        for a in actions:
            for sent in waits.get(a, ()):
                s.sends.pop(sent)[0].wait()
                record.waited(sent)
            if a.kind in (F, B) and (recv := Action(RECV_F if a.kind == F else RECV_B, a.chunk, a.micro)) in s.recvs:
                s.recvs[recv][0].wait()
                record.waited(recv)
                (s.act_in if a.kind == F else s.grad_out)[a[1:]] = s.recvs.pop(recv)[1]
            comm.RECORDER.micro = a.micro  # the flight recorder's context
            with record.action(a, s):
                handlers[a.kind](s, a)
        for sent in list(s.sends):
            s.sends.pop(sent)[0].wait()
            record.waited(sent)
        assert not s.held_over(), "schedule left work undone"

    def _forward(self, s: _Step, a: Action) -> None:
        """F(c, m): chunk c on micro-batch m's tokens (c = 0) or its received input; the output to the next chunk
        (kept, if local; else for its SEND_F), or on the last chunk the loss: / M into the step's (training), or
        the micro-batch's own (evaluation). Training stores (input, output) with the graph for B(c, m)."""
        st, key, last = self.stage, a[1:], a.chunk == self.stage.n_chunks - 1
        x, y = s.batches[a.micro]
        inp = x.to(self.device) if a.chunk == 0 else s.act_in.pop(key)
        if a.chunk > 0 and s.train:
            inp.requires_grad_()  # received or handed on locally: a leaf the chunk's backward fills
        with s.defer(key), st.parts.loss_share(s.M, s.scale):
            out = self.forward(a.chunk, inp, y.to(self.device) if last else None)
        if not s.train:
            if last:
                s.losses[a.micro] = out.detach().float()
            else:
                self._hand_on(s, Action(SEND_F, *key), a.chunk + 1, out.detach())
            return
        if not last and st.side_loss is not None:  # a chunk's own loss terms (MoE)
            s.sides[key] = st.side_loss / s.M
            s.loss += s.sides[key].detach()
        if last:
            out = out / s.M
            s.loss += out.detach()
        else:
            self._hand_on(s, Action(SEND_F, *key), a.chunk + 1, out.detach())
        s.stored[key] = (inp if a.chunk > 0 else None, out)

    def _backward(self, s: _Step, a: Action) -> None:
        """B(c, m): F(c, m)'s graph backward from the loss (last chunk) or from its output's gradient, with the
        chunk's side losses seeded as the loss is; the input's gradient to the previous chunk (kept, if local;
        else for its SEND_B). Split: the input gradient only (and a checkpointed Block's recompute), W the rest."""
        st, key, scale = self.stage, a[1:], s.scale
        inp, out = s.stored.pop(key)
        with s.defer(key), self._hold_roots(a.chunk):
            if a.chunk == st.n_chunks - 1:
                torch.autograd.backward(scale(out) if scale is not None else out)
            elif (side := s.sides.pop(key, None)) is not None:  # its side loss, seeded as the loss is
                torch.autograd.backward([out, scale(side) if scale is not None else side], [s.grad_out.pop(key), None])
            else:
                torch.autograd.backward(out, s.grad_out.pop(key))
        if a.chunk > 0:
            self._hand_on(s, Action(SEND_B, *key), a.chunk - 1, inp.grad)

    def _weights(self, s: _Step, a: Action) -> None:
        """W(c, m): the weight gradients B(c, m) left, in the order of the B's: 1F1B's sums."""
        s.store.flush(a[1:])

    def _hand_on(self, s: _Step, send: Action, to: int, t: torch.Tensor) -> None:
        """What F or B made for chunk `to`: its input (F) or output gradient (B) there if `to` is this rank's
        (P == 1; the V), else kept for `send`."""
        st = self.stage
        if rank_of(to, st.pp, st.v_shape) == st.rank:
            (s.act_in if send.kind == SEND_F else s.grad_out)[(to, send.micro)] = t  # in memory
        else:
            s.to_send[send] = self._check(t.contiguous())

    def _send(self, s: _Step, a: Action) -> None:
        """SEND_F / SEND_B: post the send of what F or B left; held in `sends` until it is waited on."""
        t = s.to_send.pop(a)
        s.sends[a] = (comm.send(t, peer_of(a, self.stage.pp, self.stage.v_shape), self.p2p_group(boundary(a))), t)

    def _recv(self, s: _Step, a: Action) -> None:
        """RECV_F / RECV_B: post the receive into a new buffer; its F or B waits on it."""
        buf = torch.empty(s.shape, dtype=self.act_dtype, device=self.device)
        s.recvs[a] = (comm.recv(buf, peer_of(a, self.stage.pp, self.stage.v_shape), self.p2p_group(boundary(a))), buf)

    def _hold_roots(self, chunk: int):
        """Under our sharding engine on a rank holding both ends of more than one chunk (a V's rank 0): inside the
        last chunk's B, the engine keeps the root's gradient (the head's ln_f and lm_head = wte) unreduced
        (`hold_root_grads`), and chunk 0's B of the same micro-batch, which always comes later, reduce-scatters the
        sum once: one reduce-scatter of the root per micro-batch, as for every unit, not two."""
        st = self.stage
        if self.engine is None or not st.both_ends or st.n_chunks == 1 or chunk != st.n_chunks - 1:
            return contextlib.nullcontext()
        return self.engine.hold_root_grads()

    def p2p_group(self, c: int) -> dist.ProcessGroup | None:
        """The group the messages across chunk boundary c (between chunks c and c+1) go on: `group`, or the
        boundary's link group (both ends name it from the same boundary, so both post on the same group; the
        link groups' ranks are the pp group's, so a pp rank is its rank in them too)."""
        if not self.links:
            return self.group
        st = self.stage
        return self.links[p2p_link(rank_of(c, st.pp, st.v_shape), rank_of(c + 1, st.pp, st.v_shape), st.pp)]

    def _check(self, t: torch.Tensor) -> torch.Tensor:
        """t, if it has the act_dtype both sides allocate; otherwise a TypeError naming both."""
        if t.dtype != self.act_dtype:
            raise TypeError(
                f"activation dtype {t.dtype} is not the runner's act_dtype {self.act_dtype}: "
                "the receiving rank allocates act_dtype"
            )
        return t

    def tied_weight(self) -> nn.Parameter | None:
        """This rank's copy of the embedding matrix: wte on the first stage, lm_head's on the last (None where
        one rank holds both ends: they are one tied parameter)."""
        if self.stage.both_ends:
            return None
        return (
            self.stage.transformer.wte.weight
            if self.stage.first
            else (self.stage.lm_head.weight if self.stage.last else None)
        )

    def reduce_tied_grads(self) -> None:
        """All-reduce (SUM, counted) the embedding gradient over [first, last]: both then hold wte's
        one-process gradient (embedding use + lm_head use). A no-op with P == 1 and on middle stages."""
        for w in self.tied:
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            if isinstance(w.grad, DTensor) and w.grad.placements != w.placements:
                # DTensor TP leaves the embedding's gradient Replicate while its weight is Shard(0): take the
                # weight's layout (a local slice), so both ends sum the same rows
                w.grad = w.grad.redistribute(w.device_mesh, w.placements)
            comm.all_reduce(comm.local(w.grad), group=self.embed_group)  # a DTensor (FSDP2, DTensor TP): its shard


class _Unrecorded:
    """A runner's record when none is handed in (and evaluation's): sees every action, keeps nothing."""

    def start(self, split: bool) -> None:
        pass

    def waited(self, a: Action) -> None:
        pass

    def action(self, a: Action, step: _Step) -> ContextManager:
        return contextlib.nullcontext()


class _Step:
    """What one step (or evaluation) holds between its actions, keyed by (chunk, micro) or by message; all of it is
    gone at the step's end. The handlers read and fill it; `held` lists it (a test's recorder counts its bytes)."""

    def __init__(
        self,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        runner: PipelineRunner,
        scale: Callable | None,
        store,
        train: bool,
    ):
        st, (mb, T) = runner.stage, batches[0][0].shape
        self.batches, self.M, self.scale, self.store, self.train = batches, len(batches), scale, store, train
        self.shape = (mb, T // runner.seq_shard, st.config.n_embd)  # every activation between chunks
        self.loss = torch.zeros((), device=runner.device) if train else None  # training: this rank's share
        self.losses: list[torch.Tensor | None] = [None] * self.M  # evaluation: each micro-batch's, on the last chunk
        self.stored: dict[tuple[int, int], tuple] = {}  # (c, m) -> F(c, m)'s (input, output), until B(c, m)
        self.act_in: dict[tuple[int, int], torch.Tensor] = {}  # (c, m) -> input of F(c, m), received or local
        self.grad_out: dict[tuple[int, int], torch.Tensor] = {}  # (c, m) -> grad of chunk c's output
        self.sides: dict[tuple[int, int], torch.Tensor] = {}  # (c, m) -> chunk c's side losses / M (MoE), until B
        self.to_send: dict[Action, torch.Tensor] = {}  # SEND -> what F or B made for it, until posted
        self.sends: dict[Action, tuple[dist.Work, torch.Tensor]] = {}  # posted until waited: keeps the tensor alive
        self.recvs: dict[Action, tuple[dist.Work, torch.Tensor]] = {}  # posted, until its F or B waits on it

    def defer(self, key: tuple[int, int]):
        """A split schedule's F and B: the linears' weight gradients wait for W (the store `split_backward` built)."""
        return self.store.defer(key) if self.store is not None else contextlib.nullcontext()

    def held(self) -> tuple[dict, ...]:
        return (
            self.stored,
            self.act_in,
            self.grad_out,
            self.to_send,
            self.sends,
            self.recvs,
            self.store.held_tensors() if self.store is not None else {},
        )

    def held_over(self) -> bool:
        """Whether anything is left that the list should have consumed (a schedule missing work)."""
        return any((self.stored, self.act_in, self.grad_out, self.to_send, self.recvs, self.store))
