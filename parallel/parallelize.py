"""The one composition point: `parallelize` wraps a GPT for a layout, always in this order,

    0. FP8 linears in the Blocks (--fp8)            (the same parameters; each GEMM casts whole operands)
       then the pipeline stage over mesh["pp"]      (keeps this pp rank's chunks; the rest is dropped)
       then context parallelism over mesh["cp"]     (ring attention or Ulysses, or torch's context_parallel around
                                                     each micro-step for "pytorch"; parameters replicated over cp)
       then expert parallelism over mesh["ep"]      (each MoE layer keeps its experts; tokens go by all_to_all)
    1. tensor parallelism over mesh["tp"]           (shards matmul weights; materialises its own shards)
       then activation checkpointing and torch.compile of each Block (runtime/blocks.py)
    2. FSDP / ZeRO-1/2 over mesh["fsdp"]            (shards what is left; materialises one unit at a time;
                                                     HSDP: replicated over mesh["dp_replicate"])
    3. materialise whatever is still on meta        (deferred init: only the local slices of DTensors)
    4. DDP over mesh["loss"]                        (replicates: needs real values, broadcasts rank 0's)
    5. the pipeline runner over mesh["pp"]          (runs the schedule through whatever 1-4 made)

Each step is an `apply_*` function looked up in `APPLY` by (implementation, what): "custom" are ours, below;
"pytorch" are PyTorch's own, on the same mesh, reached only through parallel/twins/'s one table (`STEPS`). A step
takes (model, mesh, cfg, device) and returns what it made: the model, or a `Cut` (the model, and how each
micro-batch is cut to this rank's tokens or wrapped in a context). `protocol` then adapts the data-parallel wrapper
to what the trainer asks (parallel/protocol.py); from then on the wrapper is spoken to only through it, never asked
which class it is. `apply_runner` builds the pipeline runner, handed what it runs besides the stage: the record,
the split backward (zero-bubble schedules only), the sharding engine. `parallelize` alone assigns what the steps
return. A new dimension is one more entry (docs/adding-a-dimension.md).

`Parallelized` is what the trainer sees: `forward_backward`, `forward_only`, `mean_loss`, `clip_grad_norm_`
and what the wrapper answers (optimizer groups, checkpoint parts, state bytes), the same for every layout.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable

import torch
import torch.nn as nn

from model.gpt import GPT, materialize_module
from model.loss import loss_share
from parallel import comm, twins
from parallel.context_parallel.ring import apply_context_parallel, zigzag_share
from parallel.context_parallel.ulysses import apply_ulysses
from parallel.data_parallel.flat_param import ZERO_STAGES
from parallel.data_parallel.fsdp import FullyShardedDataParallel
from parallel.data_parallel.fsdp_extensions import PipelineAndExperts
from parallel.deferred_init import materialize
from parallel.expert_parallel.dispatch import ExpertBalance, apply_expert_parallel
from parallel.grads import AgreeingGradScaler, clip_grad_norm_, grad_groups
from parallel.mesh import Mesh
from parallel.pipeline import zero_bubble
from parallel.pipeline.parts import GPT_PARTS
from parallel.pipeline.record import StepRecord
from parallel.pipeline.runner import PipelineRunner, PipelineStage, embedding_group, sharded_units
from parallel.pipeline.schedule import SPLIT_SCHEDULES, V_SCHEDULES
from parallel.protocol import Accumulating, Cut, DataParallel, Placement, Replicated, Sharded
from runtime.blocks import AC_COUNTER, apply_activation_checkpointing, apply_compile, compiled_graphs
from runtime.device import to_device
from runtime.metrics import expert_record


@dataclass(frozen=True)
class ParallelConfig:
    """The validated layout settings (config.validate builds it from the flags)."""

    dp_type: str | None = None  # "ddp" | "zero1" | "zero2" | "fsdp" (ZeRO-3) | None (no data parallelism)
    implementation: str = "pytorch"  # "pytorch" | "custom"
    loss_parallel: bool = False
    sequence_parallel: bool = False
    deferred_init: bool = False
    seed: int = 1337
    param_dtype: torch.dtype | None = None  # FSDP: dtype of the gathered compute copies (None: fp32)
    reduce_dtype: torch.dtype = torch.float32  # FSDP: dtype gradients are reduce-scattered in
    bucket_cap_mb: float = 25.0
    grad_compression: str | None = None  # custom DDP: "bf16" on the wire
    pp_schedule: str = "1f1b"  # pipeline: "gpipe" | "1f1b" | "interleaved_1f1b" | "zb_h1" | "zbv" | "dualpipev"
    pp_virtual: int = 1  # pipeline: model chunks per pp rank (interleaved_1f1b: > 1)
    pp_layers: tuple[int, ...] | None = None  # pipeline: Blocks per chunk (P·V counts); None: the cost model's
    activation_checkpointing: str = "none"  # "none" | "full" | "selective" (every ac_every-th Block)
    ac_every: int = 2
    compile: bool = False  # torch.compile each Block's forward
    cp_algorithm: str = "ring"  # context parallelism: "ring" | "ulysses" (all-to-alls to head shards and back)
    fp8: str | None = None  # the Blocks' linears in FP8: "tensorwise" | "rowwise" (parallel/fp8/) | None


def _whole(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x, y


@dataclass(kw_only=True)
class Parallelized:
    """The wrapped model and everything the trainer does with it, the same way for every layout: the steps of
    `parallelize` fill the typed fields, and the methods only delegate (to `dp`, parallel/protocol.py, and
    to the pipeline runner) or reduce over the mesh."""

    model: nn.Module
    mesh: Mesh
    cfg: ParallelConfig
    device: torch.device
    dp: DataParallel | None = None  # the data-parallel wrapper's protocol (Replicated without one)
    pipeline: PipelineRunner | None = None  # pp > 1: runs a step's micro-batches by `schedule`
    schedule: str = "1f1b"
    shard_tokens: Callable = _whole  # (x, y) -> this rank's tokens of the rows (our CP: its zigzag share)
    micro_contexts: list[Callable] = field(default_factory=list)  # (x, y) -> context yielding (x, y): the twins'
    stage: nn.Module | None = None  # what the pp step made (a PipelineStage), or the model without pp
    engine: str | None = None  # "ddp" | "fsdp" | None: what the data-parallel step runs on
    experts: ExpertBalance | None = None  # the MoE layers' per-step statistics and bias (a model with experts)
    expert_stats: dict | None = None  # after a step: ExpertBalance.step's tokens per expert and balancing loss

    # ---- one step

    def forward_backward(
        self,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        scale: Callable | None = None,
        autocast: Callable = contextlib.nullcontext,
    ) -> torch.Tensor:
        """Forward and backward of the step's micro-batches (full rows, on any device), with the data-parallel
        gradient reduction (DDP: on the last micro-step; FSDP: every micro-step, in its hooks) and, under a
        pipeline, the tied-embedding all-reduce over [first, last] stage. `scale`: a GradScaler's, for the
        backward. Returns this rank's share of the mean loss (0 off a pipeline's last stage): `mean_loss`."""
        batches = self._on_device(batches)
        if self.pipeline is not None:  # autocast around the whole schedule: backward runs inside it
            with autocast(), self.dp.step_sync():
                loss = self.pipeline.step(batches, self.schedule, scale)
            comm.RECORDER.micro = -1
            with autocast():
                self.pipeline.reduce_tied_grads()
            return loss
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(batches):
            comm.RECORDER.micro = i  # the flight recorder's context
            with self.dp.grad_sync(i == len(batches) - 1), self.micro_step(x, y) as (x, y):
                with autocast(), loss_share(len(batches), scale):
                    _, loss = self.model(x, y)
                loss = loss / len(batches)
                (scale(loss) if scale else loss).backward()
            loss_sum += comm.full(loss).detach()
        comm.RECORDER.micro = -1
        return loss_sum

    @torch.no_grad()
    def forward_only(
        self, batches: list[tuple[torch.Tensor, torch.Tensor]], autocast: Callable = contextlib.nullcontext
    ) -> list[torch.Tensor]:
        """Each micro-batch's mean loss (fp32), for evaluation: on a pipeline's last stage only (0 elsewhere)."""
        batches = self._on_device(batches)
        if self.pipeline is not None:
            with autocast():
                return self.pipeline.forward_only(batches)
        losses = []
        for x, y in batches:
            with self.micro_step(x, y) as (x, y), autocast():
                losses.append(comm.full(self.model(x, y)[1]).detach().float())
        return losses

    def _on_device(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's tokens of every micro-batch (cut on the host), all copied to the device at the step's start
        without a host sync (device.to_device): the next micro-batch's copy runs while this one computes."""
        return [tuple(to_device(t, self.device) for t in self.shard_tokens(x, y)) for x, y in batches]

    def mean_loss(self, value: torch.Tensor) -> torch.Tensor:
        """The loss over the whole batch from this rank's share: summed over pp (only the last stage holds it),
        averaged over the loss dim (dp x cp: the ranks that saw other rows or other tokens of them). SUM then
        divide: every backend has it. Scalars: not counted as wrapper traffic."""
        value = value.detach().float()
        pp, loss = self.mesh["pp"], self.mesh["loss"]
        if pp.enabled:
            comm.all_reduce(value, group=pp.group, counted=False)
        if loss.enabled:
            comm.all_reduce(value, group=loss.group, counted=False)
            value = value / loss.size
        return value

    @contextlib.contextmanager
    def micro_step(self, x: torch.Tensor, y: torch.Tensor):
        """Around one micro-batch's forward (and backward): what the PyTorch twins need open while they run
        (DTensor loss parallel; torch's context_parallel, which takes the full rows and yields its share)."""
        with contextlib.ExitStack() as stack:
            for context in self.micro_contexts:
                x, y = stack.enter_context(context(x, y))
            yield x, y

    def clip_grad_norm_(self, max_norm: float | None) -> torch.Tensor:
        """The global gradient norm (and clip): per-pattern sums over their groups, then over pp."""
        pp = self.mesh["pp"]
        return clip_grad_norm_(self.dp.grad_norm_items(), max_norm, across=pp.group if pp.enabled else None)

    # ---- what a step's record reports

    def reset_counters(self) -> None:
        """Zero the bytes our collectives counted (parallel/comm.COUNTER) and the AC counts (blocks.AC_COUNTER)."""
        comm.COUNTER.reset()
        AC_COUNTER.reset()

    def step_counters(self) -> dict:
        """What the step's AC, compile, pipeline and MoE layers report: Blocks x micro-batches this rank
        checkpointed and recomputed (not when compiled: recomputed unseen), graphs compiled so far, ours pipeline's
        idle fraction (train.py logs its theory beside it) and the most (chunk, micro-batch) activations it held,
        and each MoE layer's tokens per expert, near ties and balancing loss (metrics.expert_record)."""
        cfg, m = self.cfg, {}
        if cfg.activation_checkpointing != "none" and not cfg.compile:
            m["ac_checkpointed_blocks"], m["ac_recomputed_blocks"] = AC_COUNTER.checkpointed, AC_COUNTER.recomputed
        if cfg.compile:
            m["compiled_graphs"] = compiled_graphs()
        if self.pipeline is not None and self.pipeline.record.timeline:  # ours records one (torch's schedules don't)
            m["pp_idle_fraction"] = self.pipeline.record.idle_fraction()
            m["pp_peak_in_flight"] = self.pipeline.record.peak_in_flight
        if self.expert_stats is not None:  # the MoE layers' step over the whole batch (ExpertBalance.step)
            m.update(
                expert_record(
                    self.experts.all,
                    self.expert_stats["tokens"].tolist(),
                    self.expert_stats["aux"].tolist(),
                    self.experts.with_aux,
                )
            )
        return m

    def parameter_tensors(self) -> tuple[list[torch.Tensor], Callable[[], list[torch.Tensor]] | None]:
        """(fixed, moving): the tensors holding parameter values (memory.SavedActivations leaves their storages
        out of the activations), as the wrapper answers them (`DataParallel.parameter_tensors`)."""
        return self.dp.parameter_tensors()

    def make_grad_scaler(self) -> AgreeingGradScaler:
        """fp16's GradScaler whose ranks agree on found-inf (parallel/grads.py)."""
        return AgreeingGradScaler(self.device.type)

    # ---- delegated to the wrapper (parallel/protocol.py)

    def make_optimizer(self, weight_decay: float, **adamw) -> torch.optim.Optimizer:
        return self.dp.make_optimizer(weight_decay, **adamw)

    def param_groups(self, weight_decay: float) -> list[dict]:
        return self.dp.param_groups(weight_decay)

    def after_optimizer_step(self) -> None:
        """The wrapper's (ZeRO-1/2: full copies stale), then the MoE layers' step: their tokens per expert over
        the whole batch, and the expert bias where it is on (`ExpertBalance.step`, `moe.balance_experts`)."""
        self.dp.after_optimizer_step()
        if self.experts is not None:
            self.expert_stats = self.experts.step()

    def state_breakdown(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        return self.dp.state_breakdown(optimizer)

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        return sum(self.state_breakdown(optimizer).values())

    def checkpoint_parts(self, optimizer: torch.optim.Optimizer) -> list:
        """What this rank holds of the training state (checkpoint_entries.entries makes it entries)."""
        return self.dp.checkpoint_parts(optimizer)

    def checkpoint_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self.dp.checkpoint_optimizer(optimizer)

    @property
    def fsdp(self) -> FullyShardedDataParallel | None:
        """Our sharding engine, whose shards the optimizer steps, as the wrapper's protocol names it (None for
        every other wrapper)."""
        return self.dp.fsdp

    def runner_args(self, cfg: ParallelConfig) -> dict:
        """What a pipeline runner takes, from the mesh: the pp group and its link groups (NCCL), the tied-embedding
        group (every rank of the world builds every pipeline's, member or not), the activations' dtype and shape
        between chunks; and what it runs besides the stage: the step's record, the split backward for the
        zero-bubble schedules only (parallel/pipeline/zero_bubble.py), our sharding engine (the protocol's)."""
        v_shape = cfg.pp_schedule in V_SCHEDULES  # one rank holds both ends: no embedding group
        return {
            "group": self.mesh["pp"].group,
            "links": self.mesh["pp"].links,
            "embed_group": embedding_group(self.mesh.pipelines(), v_shape),
            "act_dtype": activation_dtype(cfg, self.engine),
            "seq_shard": self.mesh["tp"].size if cfg.sequence_parallel else 1,
            "device": self.device,
            "record": StepRecord(self.device),
            "split_backward": zero_bubble.split_backward if cfg.pp_schedule in SPLIT_SCHEDULES else None,
            "engine": self.dp.fsdp,
        }


# ----------------------------------------------------------------------------- our steps
# Each step takes (model, mesh, cfg, device) and returns what it made: the wrapped model, a `Cut` (a dimension
# that also cuts each micro-batch), a protocol adapter, a runner. `parallelize` alone puts them together.


def apply_fp8(model: GPT, mesh: Mesh, cfg: ParallelConfig, device: torch.device) -> GPT:
    """Our FP8 linear (parallel/fp8/linear.py) in the Blocks' dense linears, before any other step: the parameters
    stay the same objects (fp32 master weights, on meta where deferred), so every wrapper after it sees nn.Linears'
    weights; each scale is the whole operand's (where the layout cuts one, its amax is all-reduced: layouts.py)."""
    from parallel.fp8.layouts import layout_reduces
    from parallel.fp8.linear import convert_to_fp8

    return convert_to_fp8(model, cfg.fp8, layout_reduces(mesh))


def apply_pp(model: GPT, mesh: Mesh, cfg: ParallelConfig, device: torch.device) -> PipelineStage:
    """Our pipeline stage (parallel/pipeline/runner.py): this pp rank's chunks of the GPT, nothing of the others',
    running the GPT's own head, side losses and init (parallel/pipeline/parts.py)."""
    pp, v_shape = mesh["pp"], cfg.pp_schedule in V_SCHEDULES
    return PipelineStage(model, pp.rank, pp.size, cfg.pp_virtual, cfg.pp_layers, v_shape, parts=GPT_PARTS)


def apply_cp(model: nn.Module, mesh: Mesh, cfg: ParallelConfig, device: torch.device) -> Cut:
    """Our ring attention (parallel/context_parallel/ring.py) or Ulysses's all-to-alls (ulysses.py, by
    cfg.cp_algorithm) over mesh["cp"] in every attention core, zigzag positions, and each micro-batch cut to this
    rank's zigzag share of its rows: both algorithms split the data alike."""
    cp = mesh["cp"]
    if cfg.cp_algorithm == "ulysses":
        apply_ulysses(model, cp.group)
    else:
        apply_context_parallel(model, cp.group, cp.links)
    return Cut(model, tokens=partial(zigzag_share, rank=cp.rank, cp=cp.size))


def apply_tp(model: nn.Module, mesh: Mesh, cfg: ParallelConfig, device: torch.device) -> nn.Module:
    """Our Megatron TP (parallel/tensor_parallel/apply.py); on meta it materialises only this rank's shards."""
    from parallel.tensor_parallel.apply import apply_tensor_parallel

    apply_tensor_parallel(
        model,
        mesh["tp"].group,
        cfg.loss_parallel,
        cfg.sequence_parallel,
        seed=cfg.seed if cfg.deferred_init else None,
        device=device,
    )
    return model


def apply_fsdp(model: nn.Module, mesh: Mesh, cfg: ParallelConfig, device: torch.device) -> FullyShardedDataParallel:
    """Our sharding engine at the ZeRO stage of cfg.dp_type, sharded over mesh["fsdp"] (dp_shard x cp), with
    HSDP replicated over mesh["dp_replicate"]; composed with what the pipeline and EP add (a pipeline stage's tied
    matrix a unit of its own, the experts' units over their own group); on meta, materialised one unit at a time
    by the GPT's own init at the run's seed."""
    meta = any(p.is_meta for p in model.parameters())
    rep, group = mesh["dp_replicate"], mesh["fsdp"].group
    return FullyShardedDataParallel(
        model,
        process_group=group,
        param_dtype=cfg.param_dtype,
        reduce_dtype=cfg.reduce_dtype,
        device=device,
        materialize=partial(materialize_module, config=model.config, seed=cfg.seed, device=device) if meta else None,
        zero_stage=ZERO_STAGES[cfg.dp_type],
        replicate_group=rep.group if rep.enabled else None,
        extras=PipelineAndExperts(model, group, sharded_units(model) if mesh["pp"].enabled else None),
    )


def apply_ddp(model: nn.Module, mesh: Mesh, cfg: ParallelConfig, device: torch.device) -> nn.Module:
    """Our bucketed DDP over mesh["loss"] (dp x cp: every rank with the same parameters)."""
    from parallel.data_parallel.ddp import DistributedDataParallel

    return DistributedDataParallel(
        model, process_group=mesh["loss"].group, bucket_cap_mb=cfg.bucket_cap_mb, grad_compression=cfg.grad_compression
    )


def protocol(model: nn.Module, mesh: Mesh, cfg: ParallelConfig, at: Placement, groups: dict) -> DataParallel:
    """What the trainer asks of our data-parallel wrapper (parallel/protocol.py), once its parameters are final,
    by the engine the layout asked for (`engine_of`, not the class of what it holds): `Sharded` for the sharding
    engine (checkpoint writers: replica 0 of HSDP), `Accumulating` for DDP (writers: loss rank 0), `Replicated`
    without one."""
    engine = engine_of("custom", cfg, mesh)
    if engine == "fsdp":
        return Sharded(model, replace(at, replica_rank=mesh["dp_replicate"].rank))
    if engine == "ddp":
        return Accumulating(model, replace(at, replica_rank=mesh["loss"].rank), groups)
    return Replicated(model, at, groups)


def apply_ep(model: nn.Module, mesh: Mesh, cfg: ParallelConfig, device: torch.device) -> nn.Module:
    """Our expert parallelism (parallel/expert_parallel/dispatch.py): every MoE layer keeps this EP rank's experts and
    sends each token to the rank holding its expert, over mesh["ep"]; the experts' copies are mesh["edp"]."""
    apply_expert_parallel(model, mesh["ep"], mesh["edp"], seed=cfg.seed if cfg.deferred_init else None, device=device)
    return model


def apply_runner(stage: PipelineStage, mesh: Mesh, cfg: ParallelConfig, **runner_args) -> PipelineRunner:
    """Our pipeline runner (parallel/pipeline/runner.py) through whatever the steps before made (`runner_args`:
    Parallelized.runner_args, the device among them)."""
    return PipelineRunner(stage, **runner_args)


APPLY: dict[tuple[str, str], Callable] = {
    ("custom", "fp8"): apply_fp8,
    ("custom", "pp"): apply_pp,
    ("custom", "cp"): apply_cp,
    ("custom", "tp"): apply_tp,
    ("custom", "ep"): apply_ep,  # PyTorch 2.13 has no expert-parallel wrapper: config refuses the twin
    ("custom", "fsdp"): apply_fsdp,
    ("custom", "ddp"): apply_ddp,
    ("custom", "protocol"): protocol,
    ("custom", "runner"): apply_runner,
    **{("pytorch", what): step for what, step in twins.STEPS.items()},
}
# which engine a dp_type runs on: ours shard on one engine; torch's ZeRO-1 is DDP + ZeroRedundancyOptimizer
ENGINE = {"ddp": "ddp", "zero1": "fsdp", "zero2": "fsdp", "fsdp": "fsdp"}


def engine_of(impl: str, cfg: ParallelConfig, mesh: Mesh) -> str | None:
    """The data-parallel engine a layout runs on: "ddp", "fsdp" or None (no data parallelism: one loss rank)."""
    dp_type = cfg.dp_type if mesh["loss"].enabled else None
    return "ddp" if impl == "pytorch" and dp_type == "zero1" else ENGINE.get(dp_type)


CUTS = ("cp", "ep", "tp")  # the dimensions that cut each layer, in order (each returns a model or a Cut)


def parallelize(model: GPT, mesh: Mesh, cfg: ParallelConfig, device: torch.device) -> Parallelized:
    """PP cut -> CP -> TP -> AC/compile -> FSDP or ZeRO -> materialise -> DDP -> pipeline runner (see the
    module docstring). `model` may be on meta when cfg.deferred_init; `mesh` has size-1 dims on one process."""
    impl = cfg.implementation
    parallelized = Parallelized(model=model, mesh=mesh, cfg=cfg, device=device, schedule=cfg.pp_schedule)
    if cfg.fp8 is not None:  # the Blocks' linears first: every step below wraps what it made
        parallelized.model = APPLY[impl, "fp8"](parallelized.model, mesh, cfg, device)
    if mesh["pp"].enabled:
        parallelized.model = APPLY[impl, "pp"](parallelized.model, mesh, cfg, device)
    parallelized.stage = parallelized.model
    for what in CUTS:  # CP: a ring over mesh["cp"] (the dp wrappers below then reduce over dp x cp); TP
        if mesh[what].enabled:
            made = APPLY[impl, what](parallelized.model, mesh, cfg, device)
            made = made if isinstance(made, Cut) else Cut(made)
            parallelized.model = made.model
            parallelized.shard_tokens = made.tokens or parallelized.shard_tokens
            parallelized.micro_contexts += [made.context] if made.context else []
    c = model.config
    if any(c.is_moe(i) for i in range(c.n_layer)):  # the batch's statistics; every stage joins, one without MoE too
        parallelized.experts = ExpertBalance(parallelized.model, mesh, device)
    if cfg.activation_checkpointing != "none":
        apply_activation_checkpointing(parallelized.model, cfg.activation_checkpointing, cfg.ac_every)
    if cfg.compile:
        apply_compile(parallelized.model)
    engine = parallelized.engine = engine_of(impl, cfg, mesh)
    if engine == "fsdp":
        parallelized.model = APPLY[impl, "fsdp"](parallelized.model, mesh, cfg, device)
    materialize(parallelized.model, cfg.seed, device)
    tp = mesh["tp"]
    groups = grad_groups(parallelized.model)  # by name, before DDP renames the parameters "module.*"
    if engine == "ddp":
        parallelized.model = APPLY[impl, "ddp"](parallelized.model, mesh, cfg, device)
    at = Placement(
        tp_group=tp.group,
        tp_rank=tp.rank,
        tp_size=tp.size,  # the wrapper sets its replica_rank
        lm_head_copy=mesh["pp"].enabled and parallelized.stage.last and not parallelized.stage.both_ends,
    )
    parallelized.dp = APPLY[impl, "protocol"](parallelized.model, mesh, cfg, at, groups)
    if mesh["pp"].enabled:
        parallelized.pipeline = APPLY[impl, "runner"](parallelized.stage, mesh, cfg, **parallelized.runner_args(cfg))
    return parallelized


# ----------------------------------------------------------------------------- helpers


def activation_dtype(cfg: ParallelConfig, engine: str | None) -> torch.dtype:
    """The dtype of the residual stream between pipeline chunks, on every rank alike: the embedding's output
    dtype, which every Block keeps (x + f(x) promotes autocast's bf16 f(x) to x's dtype). That is the compute
    copies' param_dtype under a sharding engine (ours or FSDP2, which also casts chunk inputs to it), and the
    parameters' fp32 otherwise (autocast alone leaves embeddings and the residual in fp32)."""
    return cfg.param_dtype if engine == "fsdp" and cfg.param_dtype is not None else torch.float32
