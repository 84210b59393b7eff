"""Train GPT-2 on one process or many: `python train.py ...` or `torchrun --nproc_per_node=N train.py ...`.

parse (trainer/config.py) -> validate (trainer/config.py) -> build -> loop (train_step, evaluate) -> save
(checkpoints/checkpoint.py).
Whatever the layout, step s trains on the same global batch (data/batches.py) from the same initial
weights (model/gpt.py), so every layout logs the same losses up to float rounding. Bad input is reported in
one line with exit code 2 on every rank before any work.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from checkpoints import checkpoint
from data.batches import BatchSource, micro_batch_chunk
from debug import flight_recorder
from debug.trace import Tracer
from evals import hellaswag
from ft import replicas
from model.gpt import GPT
from optim.build import make_optimizer
from optim.schedule import lr_at
from parallel import comm
from parallel.mesh import OPTIONAL_DIMS, Mesh, init_distributed
from parallel.parallelize import Parallelized, parallelize
from parallel.pipeline.partition import describe_partition, layers_for, stage_costs
from parallel.pipeline.schedule import V_SCHEDULES
from plan.predict import for_run, summary
from plan.theory import bubble_fraction
from runtime import allocator, memory, metrics
from runtime.device import fused_optimizer
from runtime.launch import exit_process
from trainer import config_file, faults, resume
from trainer.config import RunSpec, UsageError, error_line, parse_args, train_parser, validate


@dataclass
class Trainer:
    spec: RunSpec
    mesh: Mesh  # always there: size-1 dims on one process (parallel/mesh.py)
    parallelized: Parallelized
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    data: BatchSource
    dp_rank: int
    flops_per_token: float
    peak_flops: float
    step: int = 0  # the step being run, for error messages
    saver: checkpoint.AsyncSaver | None = None  # --async_checkpoint: writes in a background thread
    faults: faults.Faults | None = None  # watchdog, preemption and the test hooks (run() sets it)
    built: dict = field(default_factory=dict)  # what build() measured of the model it made (run() logs it)
    tracer: Tracer = field(default_factory=Tracer)  # --trace_step: step S's outputs and gradients (debug/trace.py)
    saved_step: int = 1  # the step whose saved activations are measured (memory.SavedActivations: one step)
    peak_step: int = 2  # the CPU's allocated peak's step: the first with optimizer state (memory.AllocatedPeak)
    hellaswag_rows: hellaswag.Rows | None = None  # --hellaswag: its rows, scored at every eval (log_eval)
    ft: replicas.Alone = field(default_factory=replicas.Alone)  # --ft_lighthouse: replica groups (ft/replicas.py)

    @property
    def model(self) -> torch.nn.Module:
        return self.parallelized.model


def build(spec: RunSpec) -> Trainer:
    """Join the process group, build the model (on meta if deferred), parallelise it, make the optimizer.
    Every parameter, and so every optimizer state, ends on spec.device."""
    args = spec.args
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = spec.tf32  # config.use_tf32
    mesh = init_distributed(spec.dims, spec.device, args.timeout, fake_rank=spec.rank if spec.fake else None)
    if spec.hf_state is not None:
        model = GPT.from_hf_state_dict(spec.hf_state).to(spec.device)
    elif spec.parallel.deferred_init:
        with torch.device("meta"):
            model = GPT(spec.config)
    else:
        model = GPT(spec.config)
        model.init_weights(args.seed, spec.device)
    on_meta = sum(p.numel() for p in model.parameters() if p.is_meta)  # all of them under deferred init
    parallelized = parallelize(model, mesh, spec.parallel, spec.device)
    optimizer = make_optimizer(
        parallelized,
        args,
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,  # --optimizer (optim/build.py)
        fused=fused_optimizer(spec.device, list(parallelized.model.parameters())) or None,
    )
    scaler = parallelized.make_grad_scaler() if spec.dtype == torch.float16 else None
    data = BatchSource(spec.data_dir, args.seq_len, spec.config.vocab_size, args.seed)
    n_params = metrics.active_params(spec.config, non_embedding=True)  # MoE: top_k of each layer's experts
    saver = checkpoint.AsyncSaver(spec.device) if args.async_checkpoint else None  # collective: its own gloo group
    built = {"params_on_meta": on_meta, "distributed_classes": distributed_classes(parallelized, optimizer)}
    return Trainer(
        spec,
        mesh,
        parallelized,
        optimizer,
        scaler,
        data,
        saver=saver,
        built=built,
        tracer=Tracer(args.trace_step),
        dp_rank=mesh["batch"].rank,
        flops_per_token=metrics.flops_per_token(spec.config, n_params, args.seq_len),
        peak_flops=args.peak_flops or metrics.peak_flops(spec.device, spec.dtype),
    )


def distributed_classes(parallelized: Parallelized, optimizer: torch.optim.Optimizer) -> list[str]:
    """The distributed classes the built model is made of, found on its objects (not read from the flags):
    each module, parameter, optimizer or pipeline runner whose class is ours (parallel/) or PyTorch's
    (torch.distributed, torch.nn.parallel), as "module.Class"; FSDP2's generated classes as FSDPModule."""
    from torch.distributed.fsdp import FSDPModule

    modules = [*parallelized.model.modules(), *getattr(parallelized.model, "chunk_modules", {}).values()]
    objects = [*modules, *parallelized.model.parameters(), optimizer, parallelized.pipeline]
    names = {
        f"{c.__module__}.{c.__qualname__}"
        for c in (FSDPModule if isinstance(o, FSDPModule) else type(o) for o in objects)
    }
    return sorted(n for n in names if n.startswith(("parallel.", "torch.distributed.", "torch.nn.parallel.")))


def _autocast(spec: RunSpec):
    return torch.autocast(spec.device.type, dtype=spec.dtype, enabled=spec.dtype != torch.float32)


class StepWatch:
    """Everything a training step measures and every hook it runs, around the step's work, so train_step reads
    as the loop itself. Entering: zero the comm and AC counters, start the peak-memory window and the clock,
    the tracer's forward hooks, the saved-activations window (step `saved_step`) and the CPU's allocated peak
    (step `peak_step`). `after_backward()`: the tracer's gradients and the test hooks that act mid-step. Exiting:
    close the windows, start the preemption vote, read the bytes and calls our collectives counted (before the
    end-of-step scalar reductions, which are not wrapper traffic). `seconds()` after the loss was read (a sync)."""

    def __init__(self, trainer: Trainer, step: int):
        self.trainer, self.step, self.record = trainer, step, {}

    def __enter__(self) -> "StepWatch":
        trainer, spec = self.trainer, self.trainer.spec
        trainer.parallelized.reset_counters()
        metrics.reset_peak_memory(spec.device)
        self.t0 = time.perf_counter()
        trainer.tracer.before_step(trainer, self.step)
        self.saved = memory.SavedActivations(
            trainer.parallelized.parameter_tensors() if self.step == trainer.saved_step else None
        )
        self.peak = memory.AllocatedPeak(
            self.step == trainer.peak_step and spec.device.type == "cpu" and (spec.rank == 0 or spec.fake)
        )  # a simulated rank measures its own
        self.peak.__enter__()
        self.saved.__enter__()
        return self

    def after_backward(self) -> None:
        self.saved.__exit__(None, None, None)  # what backward needed is freed: the window closes here
        if self.trainer.faults is not None:
            self.trainer.faults.mid_step(
                self.step, self.trainer.model
            )  # the test hooks that signal a rank or perturb a gradient
        self.trainer.tracer.after_backward(self.trainer, self.step)

    def __exit__(self, *exc) -> None:
        self.peak.__exit__(*exc)
        if exc[0] is not None:
            return
        if self.trainer.faults is not None:
            self.trainer.faults.vote()  # read by run() after the step: its all-reduce finishes with the scalars
        self.record = {"comm_bytes": comm.COUNTER.snapshot(), "comm_calls": comm.COUNTER.snapshot_calls()}
        if self.saved.peak is not None:
            self.record["saved_activation_bytes"] = self.saved.peak
        if self.peak.bytes is not None:
            self.record["peak_allocated_bytes"] = self.peak.bytes

    def seconds(self) -> float:
        return time.perf_counter() - self.t0


def train_step(trainer: Trainer, step: int) -> dict | None:
    """One optimizer step over the global batch of `step`; returns this step's metrics (None: not committed)."""
    spec, args = trainer.spec, trainer.spec.args
    lr = lr_at(step, args.lr, args.warmup_steps, args.max_steps)
    for group in trainer.optimizer.param_groups:  # a Muon group has its own peak lr (optim/muon.MuonAdamW)
        group["lr"] = lr if "base_lr" not in group else lr_at(step, group["base_lr"], args.warmup_steps, args.max_steps)
    batches = [
        trainer.data.get(
            "train", step, spec.rows, micro_batch_chunk(m, trainer.dp_rank, spec.dims.dp), args.micro_batch_size
        )
        for m in trainer.ft.micro_steps(spec.grad_accum)  # all of them, or this replica group's share
    ]
    with StepWatch(trainer, step) as watch:  # counters, clock, memory windows, tracer and fault hooks
        loss = trainer.parallelized.forward_backward(
            batches, trainer.scaler.scale if trainer.scaler else None, lambda: _autocast(spec)
        )
        watch.after_backward()
        loss = trainer.ft.reduce(trainer.parallelized, loss)  # summed over the replica groups, if any
        if loss is None:  # a replica group was lost mid-step: not committed, the loop redoes it
            trainer.optimizer.zero_grad(set_to_none=True)
            return None
        if trainer.scaler:
            trainer.scaler.unscale_(trainer.optimizer)  # ranks agree on found-inf here (AgreeingGradScaler)
        norm = trainer.parallelized.clip_grad_norm_(1.0 if args.gradient_clipping else None)
        if trainer.scaler:
            trainer.scaler.step(trainer.optimizer)
            trainer.scaler.update()
        else:
            trainer.optimizer.step()
        trainer.parallelized.after_optimizer_step()
    loss_value, norm_value = (
        trainer.parallelized.mean_loss(loss).item(),
        float(norm),
    )  # .item() syncs the device: dt is honest
    dt = watch.seconds()
    state = trainer.parallelized.state_breakdown(
        trainer.optimizer
    )  # gradients still allocated: the step's true peak state
    trainer.optimizer.zero_grad(set_to_none=True)
    return step_metrics(trainer, step, lr, loss_value, norm_value, dt, state, watch.record)


def step_metrics(
    trainer: Trainer, step: int, lr: float, loss: float, norm: float, dt: float, state: dict[str, int], watched: dict
) -> dict:
    """The step's record: loss, speed (tokens/s, MFU), memory, bytes moved, and what AC, compile and the
    pipeline and the MoE layers report (Parallelized.step_counters); `watched`: what the step's StepWatch measured."""
    spec, args = trainer.spec, trainer.spec.args
    tokens_per_sec = args.total_batch_size / dt
    m = {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": norm,
        "step_time_ms": dt * 1000,
        "tokens_per_sec": tokens_per_sec,
        "mfu": trainer.flops_per_token * tokens_per_sec / (trainer.peak_flops * spec.dims.world_size),
        "peak_memory_bytes": metrics.peak_memory_bytes(spec.device),
        "state_bytes": sum(state.values()),
        "state_bytes_by_kind": state,
    }
    if spec.parallel.implementation == "custom" and spec.dims.world_size > 1:
        m["comm_bytes"], m["comm_calls"] = watched["comm_bytes"], watched["comm_calls"]
    if trainer.scaler:
        m["loss_scale"] = trainer.scaler.get_scale()
    m.update(trainer.parallelized.step_counters())
    if getattr(trainer.optimizer, "ledger", None) is not None:  # Muon: matrices this rank orthogonalised this step
        m["muon_orthogonalized"] = trainer.optimizer.ledger.total
        m["muon_ns_ms"] = trainer.optimizer.ledger.ns_seconds() * 1000  # bench: Newton-Schulz's share of the step
        m["muon_sent_bytes"] = trainer.optimizer.ledger.sent_bytes  # the exchange's, planned from the holds
    if "pp_idle_fraction" in m:  # beside what the runner measured, what the schedule's theory says (plan/theory.py)
        m["pp_bubble_theory"] = bubble_fraction(
            spec.parallel.pp_schedule, spec.dims.pp, spec.grad_accum, spec.parallel.pp_virtual
        )
    m.update({k: v for k, v in watched.items() if k not in ("comm_bytes", "comm_calls")})
    m.update(trainer.ft.record())
    return m


@torch.no_grad()
def evaluate(trainer: Trainer) -> float:
    """Mean loss over the --eval_iters validation micro-batches of one fixed batch (the same at every
    eval, and in every layout). Chunks go round-robin over dp ranks; a rank left without one runs the
    last chunk again with weight 0, so every rank makes the same collective calls."""
    spec, args = trainer.spec, trainer.spec.args
    dp, mb, n = spec.dims.dp, args.micro_batch_size, args.eval_iters
    trainer.model.eval()
    chunks = [micro_batch_chunk(i, trainer.dp_rank, dp) for i in range(math.ceil(n / dp))]
    batches = [trainer.data.get("val", 0, n * mb, min(chunk, n - 1), mb) for chunk in chunks]
    losses = trainer.parallelized.forward_only(batches, lambda: _autocast(spec))
    total = sum(loss * (chunk < n) for loss, chunk in zip(losses, chunks))
    trainer.model.train()
    return (trainer.parallelized.mean_loss(total) * dp / n).item()


def log_eval(trainer: Trainer, step: int, logger: metrics.Logger, progress: metrics.Progress) -> None:
    """One record: the validation loss and, with --hellaswag, HellaSwag through the layout (evals/hellaswag.py)."""
    record, args = {"step": step, "val_loss": evaluate(trainer)}, trainer.spec.args
    progress.eval(step, record["val_loss"])
    rows = trainer.hellaswag_rows
    if rows is not None:
        trainer.model.eval()
        per_micro = max(1, args.micro_batch_size * args.seq_len // rows.length)  # a training micro-batch's tokens
        s = hellaswag.score_layout(trainer.parallelized, trainer.mesh, rows, per_micro, lambda: _autocast(trainer.spec))
        trainer.model.train()
        record.update({f"hellaswag_{k}": v for k, v in s.items()})
        progress.write(f"step {step} | hellaswag acc {s['acc']:.4f} | acc_norm {s['acc_norm']:.4f}")
    logger.log(record)


def describe(trainer: Trainer) -> str:
    d, parallel, a = trainer.spec.dims, trainer.spec.parallel, trainer.spec.args
    optional = "".join(f"{k}={v} " for k, v in d.sizes().items() if k in OPTIONAL_DIMS and v > 1)
    layout = (
        optional
        + f"dp={d.dp}"
        + (f" ({parallel.dp_type})" if parallel.dp_type else "")
        + (f" = {d.dp_replicate} replicas x {d.dp_shard} shards" if d.dp_replicate > 1 else "")
        + (" (sharded over dp_shard x cp)" if d.dp_replicate > 1 and d.cp_enabled else "")
        + f" tp={d.tp}"
    )
    if d.pp_enabled:
        virtual = f", V={parallel.pp_virtual}" if parallel.pp_virtual > 1 else ""
        layout = f"pp={d.pp} ({parallel.pp_schedule}{virtual}) {layout}"
    with torch.device("meta"):
        n = GPT(trainer.spec.config).num_params()
    return (
        f"{parallel.implementation} {layout} on {trainer.spec.device} "
        f"{str(trainer.spec.dtype).removeprefix('torch.')} | "
        f"{n / 1e6:.1f}M params | grad_accum {trainer.spec.grad_accum} x micro_batch {a.micro_batch_size} "
        f"x seq_len {a.seq_len} | MFU against {trainer.peak_flops / 1e9:.1f} GFLOP/s per device"
    )


def describe_pipeline_partition(spec: RunSpec) -> str:
    """The pipeline's partition in one line: each chunk's Blocks and its cost (parallel/pipeline/partition.py)."""
    layers = layers_for(spec.config, spec.dims.pp, spec.parallel.pp_virtual, counts=spec.parallel.pp_layers)
    by = "--pp_layers_per_stage" if spec.args.pp_layers_per_stage else "cost"
    return describe_partition(
        layers, stage_costs(spec.config, spec.args.seq_len), by, v_shape=spec.parallel.pp_schedule in V_SCHEDULES
    )


# ----------------------------------------------------------------------------- the loop


def run(trainer: Trainer, logger: metrics.Logger) -> int:
    """Evaluate, then train from the start (or the resumed step) to --max_steps, evaluating and saving
    on schedule. Returns the exit code: 0, 3 for a non-finite step (nothing of it is saved), or faults.PREEMPTED
    when a rank was signalled (the step is finished and saved first)."""
    spec, args, is_main = trainer.spec, trainer.spec.args, trainer.spec.rank == 0
    start = trainer.ft.join(lambda: resume.restore_trainer(trainer) if spec.resume_from else 0)  # or a peer's step
    if args.resume and not spec.resume_from and is_main and start == 0:
        print(
            f"--resume: no intact checkpoint in {os.path.join(args.out_dir, checkpoint.SUBDIR)}; starting fresh",
            flush=True,
        )
    progress = metrics.Progress(args.max_steps - start, is_main)
    logger.log({"step": start, **trainer.built})
    trainer.saved_step = start + 1
    trainer.peak_step = start + 1 + (start == 0 and args.max_steps >= 2)  # a fresh run's step 1 has no AdamW moments
    if args.profile:  # torch.profiler is armed from here on (its warm-up steps too); a second one inside it crashes
        trainer.peak_step = 0
    predicted = for_run(spec) if is_main else None  # rank 0's prediction, which rank 0's records measure
    if predicted is not None:
        logger.log({"step": 0, "predicted": predicted})
        progress.write(summary(predicted))
    if start == 0:  # a resumed run skips it: its checkpoint step's eval was logged before the save
        log_eval(trainer, 0, logger, progress)
    profiler = metrics.make_profiler(args.profile, args.out_dir, trainer.spec.device)
    for step in trainer.ft.steps(start, args.max_steps):  # replica groups: a step not committed comes again
        trainer.step = step
        trainer.faults.before_step(step, trainer.model)
        m = train_step(trainer, step)
        if m is None:
            continue
        logger.log(m)
        progress.step(m)
        if profiler is not None:
            profiler.step()
        # the same all-reduced numbers on every rank: all stop together. A GradScaler skips such steps.
        if not math.isfinite(m["loss"]) or (trainer.scaler is None and not math.isfinite(m["grad_norm"])):
            if is_main:
                error_line(
                    "train.py",
                    f"step {step}: loss {m['loss']} / grad norm {m['grad_norm']} is not "
                    f"finite; stopped without saving it. The newest checkpoint is "
                    f"{checkpoint.newest(args.out_dir) or 'none'}",
                )
            return 3
        if step % args.eval_interval == 0 or step == args.max_steps:
            log_eval(trainer, step, logger, progress)
        every = args.checkpoint_interval and step % args.checkpoint_interval == 0
        stop = trainer.faults.preempted()
        path = None
        if not args.no_checkpoint and (every or step == args.max_steps or stop) and trainer.ft.saves:
            path, blocked_ms = resume.save_trainer(trainer, step, wait=stop or step == args.max_steps)
            logger.log(
                {"step": step, "checkpoint_blocked_ms": blocked_ms, "async_checkpoint": trainer.saver is not None}
            )
            if step == args.max_steps:
                progress.write(f"saved {path}")
        if stop:
            progress.close()
            sys.stderr.write(
                f"train.py: rank {spec.rank}: preempted ({trainer.faults.signal or 'a peer was signalled'}):"
                f" stopped after step {step}, "
                + (f"saved {path}; continue with --resume\n" if path else "nothing saved (--no_checkpoint)\n")
            )
            return faults.PREEMPTED
        trainer.faults.after_step(step)
    progress.close()
    if profiler is not None:
        profiler.stop()
    if trainer.saver is not None:
        trainer.saver.wait()
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        spec = validate(parse_args(argv))
        rows = hellaswag.for_plan(spec)
    except (UsageError, hellaswag.HellaSwagError) as e:
        error_line("train.py", e)
        return 2
    if spec.fake:  # a simulated rank is driven from above (sim/fake_rank.py wraps build and run)
        error_line("train.py", "--fake_world_size/--fake_rank: run python -m sim.fake_rank with the same flags")
        return 2
    args, is_main = spec.args, spec.rank == 0
    if spec.device.type == "cpu":
        allocator.keep_freed_memory()
    world = spec.dims.world_size  # the flight recorder's ring: in a file, so a killed or stopped rank's stays
    flight_recorder.install(faults.ring_path(args.out_dir, spec.rank) if world > 1 else None, spec.rank, world)
    trainer = build(spec)
    trainer.hellaswag_rows = rows
    if args.overwrite and is_main:  # a fresh run: old checkpoints must not be resumed into it later
        shutil.rmtree(os.path.join(args.out_dir, checkpoint.SUBDIR), ignore_errors=True)
    logger = metrics.Logger(args.out_dir, is_main, append=args.resume)  # a resumed run appends
    if is_main:
        config_file.write(args, train_parser())  # <out_dir>/config.toml: --config replays the run
        print(describe(trainer), flush=True)
        if spec.dims.pp_enabled:
            print(describe_pipeline_partition(spec), flush=True)
        faults.warn_shared_rendezvous_store()
    trainer.faults = faults.Faults(args.out_dir, spec.rank, args.timeout, spec.device)
    try:
        trainer.ft = replicas.connect(spec, trainer, logger)  # --ft_lighthouse: join the job's replica groups
        code = run(trainer, logger)
        if code in (0, faults.PREEMPTED) and dist.is_initialized():
            dist.barrier()  # no rank tears the group down while a peer still has collectives in flight
        return code
    except checkpoint.CheckpointError as e:
        error_line("train.py", e)
        return 2
    except RuntimeError as e:
        if spec.dims.world_size == 1 or not faults.is_comm_failure(e):
            raise
        trainer.faults.watchdog.dump_ops(
            f"a collective failed at step {trainer.step}: {str(e).strip().splitlines()[0][:200]}"
        )
        error_line(
            "train.py",
            f"rank {spec.rank}: a collective failed at step {trainer.step} (--timeout {args.timeout:g}s): a peer "
            f"rank was lost or stalled; restart with --resume to continue from "
            f"{checkpoint.newest(args.out_dir) or 'the start'} "
            f"[{str(e).strip().splitlines()[0][:200]}]",
        )
        return 4
    finally:
        trainer.ft.close()
        trainer.faults.close()
        comm.RECORDER.close()
        logger.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    exit_process(main())  # everything is flushed and closed: skip finalization (launch.exit_process)
