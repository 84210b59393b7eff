"""Train GPT-2 on one process or many: `python train.py ...` or `torchrun --nproc_per_node=N train.py ...`.

parse (config.py) -> validate (config.py) -> build -> loop (train_step, evaluate) -> save (checkpoint.py).
Whatever the layout, step s trains on the same global batch (data/batches.py) from the same initial
weights (model.py), so every layout logs the same losses up to float rounding. Bad input is reported in
one line with exit code 2 on every rank before any work.
"""
from __future__ import annotations

import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import checkpoint
import faults
import metrics
from config import Plan, UsageError, error_line, parse_args, validate
from data.batches import BatchSource, micro_batch_chunk
from model import GPT
from parallel import blocks, comm
from parallel.grads import AgreeingGradScaler
from parallel.mesh import init_distributed
from parallel.pipeline_schedule import bubble_fraction
from parallel.parallelize import Parallelized, parallelize


@dataclass
class Trainer:
    plan: Plan
    mesh: object  # DeviceMesh ("dp", "tp"), None for one process
    par: Parallelized
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    data: BatchSource
    dp_rank: int
    flops_per_token: float
    peak_flops: float
    step: int = 0  # the step being run, for error messages
    saver: checkpoint.AsyncSaver | None = None  # --async_checkpoint: writes in a background thread
    built: dict = field(default_factory=dict)  # what build() measured of the model it made (run() logs it)

    @property
    def model(self) -> torch.nn.Module:
        return self.par.model


def build(plan: Plan) -> Trainer:
    """Join the process group, build the model (on meta if deferred), parallelise it, make the optimizer.
    Every parameter, and so every optimizer state, ends on plan.device."""
    args = plan.args
    torch.manual_seed(args.seed)
    mesh = init_distributed(plan.dims, plan.device, args.timeout)
    if plan.hf_state is not None:
        model = GPT.from_hf_state_dict(plan.hf_state).to(plan.device)
    elif plan.par.deferred_init:
        with torch.device("meta"):
            model = GPT(plan.config)
    else:
        model = GPT(plan.config)
        model.init_weights(args.seed, plan.device)
    on_meta = sum(p.numel() for p in model.parameters() if p.is_meta)  # all of them under deferred init
    par = parallelize(model, mesh, plan.dims, plan.par, plan.device)
    fused = plan.device.type == "cuda" and not any(isinstance(p, DTensor) for p in par.model.parameters())
    adamw = {"lr": args.lr, "betas": (0.9, 0.95), "eps": 1e-8, "fused": fused or None}
    if par.zero_optimizer:  # torch's ZeRO-1: each dp rank keeps AdamW state for its partition of the parameters
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(par.param_groups(args.weight_decay), torch.optim.AdamW,
                                            process_group=mesh["dp"].get_group(), **adamw)
    else:
        optimizer = torch.optim.AdamW(par.param_groups(args.weight_decay), **adamw)
    scaler = AgreeingGradScaler(plan.device.type) if plan.dtype == torch.float16 else None
    data = BatchSource(plan.data_dir, args.seq_len, plan.config.vocab_size, args.seed)
    with torch.device("meta"):
        n_params = GPT(plan.config).num_params(non_embedding=True)
    saver = checkpoint.AsyncSaver() if args.async_checkpoint else None  # collective: its own gloo group
    built = {"params_on_meta": on_meta, "distributed_classes": distributed_classes(par, optimizer)}
    return Trainer(plan, mesh, par, optimizer, scaler, data, saver=saver, built=built,
                   dp_rank=plan.dims.coordinates(plan.rank)["dp"],
                   flops_per_token=metrics.flops_per_token(plan.config, n_params, args.seq_len),
                   peak_flops=args.peak_flops or metrics.peak_flops(plan.device, plan.dtype))


def distributed_classes(par: Parallelized, optimizer: torch.optim.Optimizer) -> list[str]:
    """The distributed classes the built model is made of, found on its objects (not read from the flags):
    each module, parameter, optimizer or pipeline runner whose class is ours (parallel/) or PyTorch's
    (torch.distributed, torch.nn.parallel), as "module.Class"; FSDP2's generated classes as FSDPModule."""
    from torch.distributed.fsdp import FSDPModule
    modules = [*par.model.modules(), *getattr(par.model, "chunk_modules", {}).values()]
    objects = [*modules, *par.model.parameters(), optimizer, par.pipeline]
    names = {f"{c.__module__}.{c.__qualname__}"
             for c in (FSDPModule if isinstance(o, FSDPModule) else type(o) for o in objects)}
    return sorted(n for n in names if n.startswith(("parallel.", "torch.distributed.", "torch.nn.parallel.")))


def compiled_graphs() -> int:
    """Graphs torch.compile (dynamo) has compiled in this process so far."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def lr_at(step: int, lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warmup over warmup_steps, then cosine decay to 10% of lr at max_steps (step is 1-based)."""
    it = step - 1
    if it < warmup_steps:
        return lr * (it + 1) / warmup_steps
    progress = (it - warmup_steps) / max(1, max_steps - warmup_steps)
    return lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def _mean_over_dp(t: Trainer, value: torch.Tensor) -> torch.Tensor:
    """Average a scalar over data-parallel ranks, and context-parallel ones, whose tokens are equal shares of
    the same rows (mesh["dp"] is dp x cp then). SUM then divide: works on every backend. Not counted as
    wrapper traffic."""
    d = t.plan.dims
    if t.mesh is not None and (d.dp_enabled or d.cp_enabled):
        dist.all_reduce(value, group=t.mesh["dp"].get_group())
        value = value / (d.dp * d.cp)
    return value


def _tokens(t: Trainer, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens of a micro-batch's rows: all of them, or its zigzag share under our context
    parallelism (torch's twin takes the whole rows and shards them itself: Parallelized.micro_step)."""
    if not t.plan.dims.cp_enabled or t.par.torch_cp is not None:
        return x, y
    from parallel.context_parallel import shard_sequence
    cp, C = t.plan.dims.coordinates(t.plan.rank)["cp"], t.plan.dims.cp
    return shard_sequence(x, cp, C), shard_sequence(y, cp, C)


def _sum_over_pp(t: Trainer, value: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's loss on every stage (the others add zeros). Not counted as wrapper traffic."""
    value = value.detach().float()
    if t.par.pp_group is not None:
        dist.all_reduce(value, group=t.par.pp_group)
    return value


def _autocast(plan: Plan):
    return torch.autocast(plan.device.type, dtype=plan.dtype, enabled=plan.dtype != torch.float32)


def train_step(t: Trainer, step: int) -> dict:
    """One optimizer step over the global batch of `step`; returns this step's metrics."""
    plan, args = t.plan, t.plan.args
    lr = lr_at(step, args.lr, args.warmup_steps, args.max_steps)
    for group in t.optimizer.param_groups:
        group["lr"] = lr
    comm.COUNTER.reset()
    blocks.AC_COUNTER.reset()
    metrics.reset_peak_memory(plan.device)
    t0 = time.perf_counter()
    if t.par.pipeline is not None:  # the step's micro-batches flow through the pipeline's schedule
        batches = [_tokens(t, *t.data.get("train", step, plan.rows, micro_batch_chunk(m, t.dp_rank, plan.dims.dp),
                                          args.micro_batch_size)) for m in range(plan.grad_accum)]
        with _autocast(plan):
            loss_sum = _sum_over_pp(t, t.par.pipeline_step(batches, t.scaler.scale if t.scaler else None))
    else:
        loss_sum = torch.zeros((), device=plan.device)
        for micro in range(plan.grad_accum):
            chunk = micro_batch_chunk(micro, t.dp_rank, plan.dims.dp)
            x, y = _tokens(t, *t.data.get("train", step, plan.rows, chunk, args.micro_batch_size))
            x, y = x.to(plan.device, non_blocking=True), y.to(plan.device, non_blocking=True)
            with t.par.grad_sync(micro == plan.grad_accum - 1), t.par.micro_step(x, y) as (x, y):
                with _autocast(plan):
                    _, loss = t.model(x, y)
                loss = loss / plan.grad_accum
                (t.scaler.scale(loss) if t.scaler else loss).backward()
            loss_sum += comm.full(loss).detach()
    faults.maybe_signal_mid_step(step, plan.rank)
    if t.scaler:
        t.scaler.unscale_(t.optimizer)  # ranks agree on found-inf here (AgreeingGradScaler)
    norm = t.par.clip_grad_norm_(1.0 if args.gradient_clipping else None)
    if t.scaler:
        t.scaler.step(t.optimizer)
        t.scaler.update()
    else:
        t.optimizer.step()
    t.par.after_optimizer_step()
    comm_bytes = comm.COUNTER.snapshot()  # before the scalar reductions below, which are not wrapper traffic
    loss = _mean_over_dp(t, loss_sum)
    loss_value, norm_value = loss.item(), float(norm)  # .item() synchronises the device, so dt is honest
    dt = time.perf_counter() - t0
    state = t.par.state_breakdown(t.optimizer)  # gradients still allocated: the step's true peak state
    t.optimizer.zero_grad(set_to_none=True)
    tokens_per_sec = args.total_batch_size / dt
    m = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": norm_value, "step_time_ms": dt * 1000,
         "tokens_per_sec": tokens_per_sec,
         "mfu": t.flops_per_token * tokens_per_sec / (t.peak_flops * plan.dims.world_size),
         "peak_memory_bytes": metrics.peak_memory_bytes(plan.device), "state_bytes": sum(state.values()),
         "state_bytes_by_kind": state}
    if plan.par.implementation == "custom" and plan.dims.world_size > 1:
        m["comm_bytes"] = comm_bytes
    if t.scaler:
        m["loss_scale"] = t.scaler.get_scale()
    if plan.par.activation_checkpointing != "none" and not plan.par.compile:  # compiled: recomputed unseen
        m["ac_checkpointed_blocks"] = blocks.AC_COUNTER.checkpointed  # this rank's Blocks x micro-batches
        m["ac_recomputed_blocks"] = blocks.AC_COUNTER.recomputed
    if plan.par.compile:
        m["compiled_graphs"] = compiled_graphs()
    if t.par.pipeline is not None and t.par.pipeline.timeline:  # ours records one (torch's schedules don't)
        m["pp_idle_fraction"] = t.par.pipeline.idle_fraction()
        m["pp_bubble_theory"] = bubble_fraction(plan.par.pp_schedule, plan.dims.pp, plan.grad_accum,
                                                plan.par.pp_virtual)
        m["pp_peak_in_flight"] = t.par.pipeline.peak_in_flight  # most (chunk, micro-batch) activations held
    return m


@torch.no_grad()
def evaluate(t: Trainer) -> float:
    """Mean loss over the --eval_iters validation micro-batches of one fixed batch (the same at every
    eval, and in every layout). Chunks go round-robin over dp ranks; a rank left without one runs the
    last chunk again with weight 0, so every rank makes the same collective calls."""
    plan, args = t.plan, t.plan.args
    dp, mb, n = plan.dims.dp, args.micro_batch_size, args.eval_iters
    t.model.eval()
    chunks = [micro_batch_chunk(i, t.dp_rank, dp) for i in range(math.ceil(n / dp))]
    batches = [_tokens(t, *t.data.get("val", 0, n * mb, min(chunk, n - 1), mb)) for chunk in chunks]
    if t.par.pipeline is not None:
        with _autocast(plan):
            losses = t.par.pipeline.forward_only(batches)
    else:
        losses = []
        for x, y in batches:
            with t.par.micro_step(x.to(plan.device), y.to(plan.device)) as (x, y), _autocast(plan):
                losses.append(comm.full(t.model(x, y)[1]).detach().float())
    total = sum(loss * (chunk < n) for loss, chunk in zip(losses, chunks))
    total = _sum_over_pp(t, total)
    t.model.train()
    return (_mean_over_dp(t, total) * dp / n).item()


def describe(t: Trainer) -> str:
    d, par, a = t.plan.dims, t.plan.par, t.plan.args
    layout = (f"cp={d.cp} " if d.cp_enabled else "") + f"dp={d.dp}" + (f" ({par.dp_type})" if par.dp_type else "") + \
        (f" = {d.dp_replicate} replicas x {d.dp_shard} shards" if d.dp_replicate > 1 else "") + \
        (" (sharded over dp_shard x cp)" if d.dp_replicate > 1 and d.cp_enabled else "") + f" tp={d.tp}"
    if d.pp_enabled:
        virtual = f", V={par.pp_virtual}" if par.pp_virtual > 1 else ""
        layout = f"pp={d.pp} ({par.pp_schedule}{virtual}) {layout}"
    with torch.device("meta"):
        n = GPT(t.plan.config).num_params()
    return (f"{par.implementation} {layout} on {t.plan.device} {str(t.plan.dtype).removeprefix('torch.')} | "
            f"{n / 1e6:.1f}M params | grad_accum {t.plan.grad_accum} x micro_batch {a.micro_batch_size} "
            f"x seq_len {a.seq_len} | MFU against {t.peak_flops / 1e9:.1f} GFLOP/s per device")


# ----------------------------------------------------------------------------- checkpoints

MATH_ARGS = ("seed", "lr", "warmup_steps", "max_steps", "weight_decay", "total_batch_size", "seq_len",
             "gradient_clipping", "grad_compression", "param_dtype", "reduce_dtype", "init_from",
             "dataset")  # stored with each checkpoint; a resume with other values says so


def save_checkpoint(t: Trainer, step: int, wait: bool = False) -> tuple[str, float]:
    """Collective: every rank writes its elements of the state after `step` (format: checkpoint.py).
    Returns (directory, milliseconds training was blocked). With --async_checkpoint only the snapshot (a CPU
    copy) blocks and a background thread writes it, unless `wait` (the final save, a preemption)."""
    plan, a, d = t.plan, t.plan.args, t.plan.dims
    extra = {"config": {"model": asdict(plan.config),
                        "train": {**{k: getattr(a, k, None) for k in MATH_ARGS},
                                  "dtype": str(plan.dtype).removeprefix("torch.")}},
             "layout": {"world_size": d.world_size, "pp": d.pp, "dp": d.dp, "dp_replicate": d.dp_replicate,
                        "cp": d.cp, "tp": d.tp,
                        "implementation": plan.par.implementation, "dp_type": plan.par.dp_type}}
    if t.scaler is not None:
        extra["scaler"] = t.scaler.state_dict()
    t0 = time.perf_counter()
    snap = checkpoint.snapshot(a.out_dir, step, t.par.checkpoint_entries(t.optimizer),
                               t.par.checkpoint_optimizer(t.optimizer), extra, rank=plan.rank,
                               world_size=d.world_size, keep=a.keep_checkpoints, device=plan.device)
    if t.saver is None:
        path = checkpoint.write(snap)
    else:
        t.saver.save(snap)
        path = t.saver.path
        if wait:
            t.saver.wait()
    return path, (time.perf_counter() - t0) * 1000


def restore_checkpoint(t: Trainer) -> int:
    """Load --resume's checkpoint (saved in any layout) into this one; returns its step. The data position
    is the step itself: batches are a pure function of (seed, step)."""
    plan, args = t.plan, t.plan.args
    m = checkpoint.load(plan.resume_from, t.par.checkpoint_entries(t.optimizer),
                        t.par.checkpoint_optimizer(t.optimizer), rank=plan.rank,
                        world_size=plan.dims.world_size, device=plan.device)
    if t.scaler is not None and "scaler" in m:
        t.scaler.load_state_dict(m["scaler"])
    if plan.rank == 0:
        lay = m["layout"]
        cp = f" cp={lay['cp']}" if lay.get("cp", 1) > 1 else ""
        print(f"resuming from {plan.resume_from} (saved by {lay['implementation']} pp={lay.get('pp', 1)}{cp} dp={lay['dp']}"
              f"{' (' + lay['dp_type'] + ')' if lay['dp_type'] else ''} tp={lay['tp']}): continuing at step "
              f"{m['step'] + 1}" + (f" (nothing left: --max_steps {args.max_steps})"
                                    if m["step"] >= args.max_steps else ""), flush=True)
        saved = m["config"]["train"]
        changed = [f"--{k} {saved.get(k)!r} -> {getattr(args, k, None)!r}" for k in MATH_ARGS
                   if saved.get(k) != getattr(args, k, None)]
        if changed:
            print(f"note: arguments differ from the checkpoint's run, so losses will differ from an "
                  f"uninterrupted run: {', '.join(changed)}", flush=True)
    return int(m["step"])


# ----------------------------------------------------------------------------- the loop

def run(t: Trainer, logger: metrics.Logger, preemption: faults.Preemption | None = None,
        watchdog: faults.StepWatchdog | None = None) -> int:
    """Evaluate, then train from the start (or the resumed step) to --max_steps, evaluating and saving
    on schedule. Returns the exit code: 0, 3 for a non-finite step (nothing of it is saved), or faults.PREEMPTED
    when a rank was signalled (the step is finished and saved first)."""
    plan, args, is_main = t.plan, t.plan.args, t.plan.rank == 0
    start = restore_checkpoint(t) if plan.resume_from else 0
    if args.resume and not plan.resume_from and is_main:
        print(f"--resume: no intact checkpoint in {os.path.join(args.out_dir, checkpoint.SUBDIR)}; "
              f"starting fresh", flush=True)
    progress = metrics.Progress(args.max_steps - start, is_main)
    logger.log({"step": start, **t.built})
    if start == 0:  # a resumed run skips it: its checkpoint step's eval was logged before the save
        val = evaluate(t)
        logger.log({"step": 0, "val_loss": val})
        progress.eval(0, val)
    profiler = metrics.make_profiler(args.profile, args.out_dir, t.plan.device)
    for step in range(start + 1, args.max_steps + 1):
        t.step = step
        if watchdog is not None:
            watchdog.start(step)
        faults.maybe_inject_nan(step, t.model)
        m = train_step(t, step)
        logger.log(m)
        progress.step(m)
        if profiler is not None:
            profiler.step()
        # the same all-reduced numbers on every rank: all stop together. A GradScaler skips such steps.
        if not math.isfinite(m["loss"]) or (t.scaler is None and not math.isfinite(m["grad_norm"])):
            if is_main:
                error_line("train.py", f"step {step}: loss {m['loss']} / grad norm {m['grad_norm']} is not "
                                       f"finite; stopped without saving it. The newest checkpoint is "
                                       f"{checkpoint.newest(args.out_dir) or 'none'}")
            return 3
        if step % args.eval_interval == 0 or step == args.max_steps:
            val = evaluate(t)
            logger.log({"step": step, "val_loss": val})
            progress.eval(step, val)
        every = args.checkpoint_interval and step % args.checkpoint_interval == 0
        stop = preemption is not None and preemption.agreed()
        path = None
        if not args.no_checkpoint and (every or step == args.max_steps or stop):
            path, blocked_ms = save_checkpoint(t, step, wait=stop or step == args.max_steps)
            logger.log({"step": step, "checkpoint_blocked_ms": blocked_ms, "async_checkpoint": t.saver is not None})
            if step == args.max_steps:
                progress.write(f"saved {path}")
        if stop:
            progress.close()
            sys.stderr.write(f"train.py: rank {plan.rank}: preempted ({preemption.signal or 'a peer was signalled'}):"
                             f" stopped after step {step}, " + (f"saved {path}; continue with --resume\n" if path
                                                                else "nothing saved (--no_checkpoint)\n"))
            return faults.PREEMPTED
        if watchdog is not None:
            watchdog.stop()
        faults.maybe_kill(step, plan.rank)
    progress.close()
    if profiler is not None:
        profiler.stop()
    if t.saver is not None:
        t.saver.wait()
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        plan = validate(parse_args(argv))
    except UsageError as e:
        error_line("train.py", e)
        return 2
    args, is_main = plan.args, plan.rank == 0
    t = build(plan)
    if args.overwrite and is_main:  # a fresh run: old checkpoints must not be resumed into it later
        shutil.rmtree(os.path.join(args.out_dir, checkpoint.SUBDIR), ignore_errors=True)
    logger = metrics.Logger(args.out_dir, is_main, append=args.resume)  # a resumed run appends
    if is_main:
        print(describe(t), flush=True)
        faults.warn_shared_rendezvous_store()
    watchdog = faults.StepWatchdog(args.out_dir, plan.rank, args.timeout)
    try:
        code = run(t, logger, faults.Preemption(plan.device), watchdog)
        if code in (0, faults.PREEMPTED) and dist.is_initialized():
            dist.barrier()  # no rank tears the group down while a peer still has collectives in flight
        return code
    except checkpoint.CheckpointError as e:
        error_line("train.py", e)
        return 2
    except RuntimeError as e:
        if plan.dims.world_size == 1 or not faults.is_comm_failure(e):
            raise
        error_line("train.py", f"rank {plan.rank}: a collective failed at step {t.step} (--timeout {args.timeout:g}s): a peer "
                               f"rank was lost or stalled; restart with --resume to continue from "
                               f"{checkpoint.newest(args.out_dir) or 'the start'} "
                               f"[{str(e).strip().splitlines()[0][:200]}]")
        return 4
    finally:
        watchdog.stop()
        logger.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    # Gloo worker threads outlive destroy_process_group() while anything still references their group (FSDP2's
    # DeviceMesh, kept by DTensor's caches, holds it in _pg_registry). One that drops the last reference to a
    # Python-owned tensor after interpreter finalization has begun is killed mid-destructor:
    # "terminate called without an active exception" (SIGABRT). Everything is flushed and closed: skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
