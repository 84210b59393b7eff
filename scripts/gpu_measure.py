"""The one-GPU check's measuring stages (scripts/gpu_check.py's STAGES: real size and the recipe first, the others
after its correctness stages).

- sync audit: steps 2..N of every one-rank path (PATHS: plain, DDP, DDP's multi-rank branch, ZeRO-1, ZeRO-2 with
  bf16 compute copies, FSDP, TP with SP and loss parallelism, the CP ring at C = 1, the pipeline runner at pp = 1
  with interleaved 1F1B at V = 2 and with ZB-H1 (dense and MoE), AC, compile, MoE with 8 experts top-2 in bf16,
  and expert parallelism's dispatch) under `torch.cuda.set_sync_debug_mode("error")` on CUDA, with the host
  syncs from our code recorded (debug/host_sync.py: scalar reads, blocking host <-> device copies, tensors made
  from Python data, data-dependent shapes) on every device: only its ALLOWED end-of-step reads may happen, and
  on CUDA they alone run with the sync debugger off. Step 1 is warm-up (AdamW's lazy state, compile). The
  trainer's faults.Faults (the preemption vote is one of the step's reads) is closed after each path, and its
  SIGTERM/SIGINT handlers are the check's own again at once: a SIGTERM still stops the check.
- overlap: every collective DDP and FSDP post completes only `delay` after it was posted. On CUDA a
  device-side sleep (`torch.cuda._sleep`, cycles calibrated by events) on a side stream that waited for the
  posting stream, and `wait()` makes the waiting stream wait for the sleep too; on the CPU a host sleep until
  posted + delay. The losses must stay bit-equal to the same run without delays (a missing wait or an early
  free reads or frees data too soon), and the step time grows only by the delay that compute did not hide:
  exposed = (t_delayed - t_forced) / (collectives per step x delay), 0 = all hidden, 1 = none.
- real size: GPT-2 124M, bf16 autocast, micro-batch 16 x 1024 (the dry run: the tiny model), for REAL_SIZE's
  paths: tokens/s, MFU against the datasheet bf16 dense peak (Muon's path: also its Newton-Schulz ms a step, the
  ledger's timing events, train.py's muon_ns_ms), max allocated and reserved memory against state
  bytes plus the activation estimate 34·s·b·h·L bytes (Korthikanti et al. 2022, bf16, no recompute, fused
  attention: no s² term), which SDPA kernel ran (profiler), fused AdamW, and zero dynamo recompiles after
  warm-up. Every build starts from released memory (the earlier trainers collected, the device's cache emptied)
  and every compiled build (the sync audit's compile path) from a fresh dynamo (`torch._dynamo.reset()`: else
  Block.forward, compiled at other shapes, recompiles with dynamic shapes). GPT-2 compiled is the recipe row's
  (scripts/gpu_check.py: train.py --compile at the recipe's micro-batch), not a path here: one compile, not two.
- recipe: `train.py --compile` end to end at the GPT-2 124M recipe's micro-batch (stage_recipe's docstring); its
  MFU is written to <report>/efficiency.json, the planner's efficiency for this GPU (plan/cluster.py).
- goals (reported as met / missed rows, never failing the check): the compiled recipe's MFU >= 45% (CUDA only);
  every wrapper's tokens/s >= 0.95 x its model without it at one rank (EP's: x MoE's); max reserved <= 1.15 x
  max allocated.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from unittest import mock

import torch
from gpu_harness import (
    DATA_DIMS,
    Context,
    build_on,
    forced_collectives,
    last_line,
    make_plan,
    one_rank_mesh,
    read_jsonl,
    release_memory,
    row_on_error,
    run_train,
)

MOE = ("--moe_num_experts", "8", "--moe_top_k", "2")  # Mixtral's shape: 8 experts, top-2, in every Block
FORCED_RANKS = 2  # DDP's group as its multi-rank branch sees it
BOTH = ("sync audit", "real size")


@dataclass(frozen=True)
class Path:
    """One layout on the one-rank mesh. `on`: the mesh dims enabled at size 1; `par`: ParallelConfig changes;
    `flags`: model flags added (MoE); `dtype`: the compute dtype it always runs in (else the stage's); `forced`:
    the stages in which its collectives are really issued (over one rank, identities); `ranks`: the group size its data-
    parallel wrapper is built for (> 1: DDP takes its multi-rank branch, the fresh-bucket multiply by 1/N into the
    bucket view and the bucket all-reduces; over one rank each gradient is then 1/N of the one-rank run's, so
    these paths' losses are not compared, only their syncs and speed). `one_micro_step`: the step's batch cut to one
    micro-batch (a step's first micro-batch finds DDP's buckets fresh, and only with one does it also sync them)."""

    on: frozenset = frozenset()
    par: dict = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    dtype: str | None = None
    forced: tuple[str, ...] = ()
    ranks: int = 1
    one_micro_step: bool = False  # the step's batch one micro-batch: DDP's fresh buckets then sync in that backward


PATHS: dict[str, Path] = {
    "plain": Path(),
    "ddp": Path(DATA_DIMS, {"dp_type": "ddp"}),
    "ddp multi-rank branch": Path(DATA_DIMS, {"dp_type": "ddp"}, forced=BOTH, ranks=FORCED_RANKS, one_micro_step=True),
    "zero1": Path(DATA_DIMS, {"dp_type": "zero1"}),
    "zero2 bf16 copies": Path(DATA_DIMS, {"dp_type": "zero2", "param_dtype": torch.bfloat16}, dtype="bfloat16"),
    "fsdp": Path(DATA_DIMS, {"dp_type": "fsdp"}),
    "tp+sp": Path(frozenset({"tp"}), {"sequence_parallel": True, "loss_parallel": True}, forced=("real size",)),
    "cp ring": Path(frozenset({"cp"})),
    "pp V=2": Path(frozenset({"pp"}), {"pp_schedule": "interleaved_1f1b", "pp_virtual": 2}),
    "pp zb_h1": Path(frozenset({"pp"}), {"pp_schedule": "zb_h1"}),
    "pp zb_h1 moe": Path(frozenset({"pp"}), {"pp_schedule": "zb_h1"}, MOE, "bfloat16"),
    "ac": Path(par={"activation_checkpointing": "full"}),
    "compile": Path(par={"compile": True}),
    "moe": Path(flags=MOE, dtype="bfloat16"),
    "ep dispatch": Path(frozenset({"ep"}), flags=MOE, dtype="bfloat16", forced=BOTH),
    "muon": Path(flags=("--optimizer", "muon")),
}
AUDITED = tuple(p for p in PATHS if p != "muon")  # Muon is measured at real size only (its timing events: #55 item 5)
REAL_SIZE = (
    "plain",
    "ddp multi-rank branch",
    "fsdp",
    "zero1",
    "zero2 bf16 copies",
    "tp+sp",
    "ac",
    "pp zb_h1",
    "moe",
    "ep dispatch",
    "muon",
)
DRY_REAL_SIZE = ("plain", "fsdp", "ddp multi-rank branch", "pp zb_h1", "moe", "ep dispatch", "muon")  # plumbing
BASELINE = {"ep dispatch": "moe"}  # the goal's "x plain": a path's model without its wrapper
GPT2_FLAGS = ["--model", "gpt2", "--micro_batch_size", "16", "--seq_len", "1024", "--total_batch_size", "16384"]
GOAL_MFU, GOAL_WRAPPER, GOAL_RESERVED = 0.45, 0.95, 1.15


def device_of(ctx: Context) -> torch.device:
    return torch.device(ctx.setup.device, 0) if ctx.setup.device == "cuda" else torch.device("cpu")


@contextmanager
def ranks_seen(n: int):
    """While a path is built: every group looks like `n` ranks to parallel/comm.py (n = 1: as it is), so the
    data-parallel wrapper takes the branches of an n-rank group; its collectives then run over the real one rank."""
    if n == 1:
        yield
        return
    from parallel import comm

    with mock.patch.object(comm, "world", lambda group: n):
        yield


def build_path(ctx: Context, name: str, flags: list[str], dtype: str, steps: int):
    """The trainer of one PATHS entry on the one-rank mesh (call and step it inside `path_collectives`). Starts
    from released memory, and a compiled path from a fresh dynamo."""
    path = PATHS[name]
    release_memory(device_of(ctx))
    if path.par.get("compile"):
        torch._dynamo.reset()  # forget the frames compiled at other shapes: else a dynamic-shape recompile
    flags = [*flags, *path.flags]
    if path.one_micro_step:
        flag = {f: int(v) for f, v in zip(flags, flags[1:]) if f in ("--micro_batch_size", "--seq_len")}
        flags += ["--total_batch_size", str(flag["--micro_batch_size"] * flag["--seq_len"])]
    spec = make_plan(
        ctx,
        name.replace(" ", "-").replace("+", "-").replace("=", ""),
        flags,
        ctx.setup.device,
        path.dtype or dtype,
        steps,
    )
    with ranks_seen(path.ranks):
        return build_on(spec, one_rank_mesh(device_of(ctx)), path.on, **path.par)


def path_collectives(name: str, stage: str):
    """The context a PATHS entry is built and stepped in by `stage`: its collectives forced or not."""
    return forced_collectives(stage in PATHS[name].forced)


# ----------------------------------------------------------------------------- sync audit


@contextmanager
def closed_faults(trainer, out_dir: str):
    """trainer.faults as train.main makes it (its preemption vote is one of the step's host reads), closed on exit. Its
    Preemption puts SIGTERM/SIGINT handlers in place that only ask a training run to stop after its step: the
    check's own are put back at once, so a SIGTERM during the audit still stops the check."""
    from trainer import faults

    sigs = (signal.SIGTERM, signal.SIGINT)
    saved = {s: signal.getsignal(s) for s in sigs}
    try:
        trainer.faults = faults.Faults(out_dir, 0, 600.0, trainer.spec.device)
    finally:
        for s in sigs:
            signal.signal(s, saved[s])
    try:
        yield trainer.faults
    finally:
        trainer.faults.close()


def stage_sync_audit(ctx: Context) -> None:
    skip_compile = ctx.setup.device != "cuda"  # inductor's CPU compile of even the tiny model costs ~30 s
    for name in AUDITED:
        if name == "compile" and skip_compile:
            ctx.add("sync audit compile", None, "skipped in the dry run: a CPU compile costs ~30 s; runs on CUDA")
            continue
        with row_on_error(ctx, f"sync audit {name}"):
            audit_path(ctx, name)


def audit_path(ctx: Context, name: str) -> None:
    """One sync-audit row (its trainer is freed on return)."""
    import train
    from debug.host_sync import recording, unallowed

    s, cuda = ctx.setup, ctx.setup.device == "cuda"
    with path_collectives(name, "sync audit"):
        trainer = build_path(ctx, name, s.small, s.dtype, s.steps)
        with closed_faults(trainer, ctx.out_dir(f"sync-{len(ctx.rows)}")):
            train.train_step(trainer, 1)
            trainer.faults.preempted()
            seen: list = []
            with recording(seen, audit=cuda, device=trainer.spec.device), sync_debugger(cuda):
                for step in range(2, s.steps + 1):
                    train.train_step(trainer, step)
                    trainer.faults.preempted()
    extra = unallowed(seen)
    how = "set_sync_debug_mode('error') and " if cuda else ""
    ctx.add(
        f"sync audit {name}",
        not extra,
        f"steps 2-{s.steps} under {how}the sync recorder: "
        + (
            f"{len(seen)} allowed syncs"
            if not extra
            else "unallowed " + ", ".join(f"{f}:{fn} {kind}" for f, fn, kind in extra[:3])
        ),
    )


@contextmanager
def sync_debugger(on: bool):
    if not on:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


# ----------------------------------------------------------------------------- overlap


class DelayedWork:
    """CPU: a collective that runs only `wait()`: after sleeping until posted + delay, it runs blocking, so
    its output is unwritten until then (a missing wait reads stale data, as on a GPU)."""

    def __init__(self, run, deadline: float):
        self.run, self.deadline = run, deadline

    def wait(self, *args) -> bool:
        time.sleep(max(0.0, self.deadline - time.perf_counter()))
        if self.run is not None:
            self.run()
            self.run = None
        return True


class Delays:
    """Patches parallel.comm's three collectives so each completes `seconds` after it is posted; counts them.

    CUDA: the collective is issued from a side stream that first waited for the posting stream and then
    slept `seconds` on the device, so NCCL's stream (which waits for its issuing stream) starts it late;
    `Work.wait()` makes the waiting stream wait for NCCL's, as without delays. The compute stream itself is
    never delayed: only what waits on the collective is."""

    def __init__(self, device: torch.device, seconds: float):
        self.device, self.seconds, self.count = device, seconds, 0
        if device.type == "cuda":
            self.side = torch.cuda.Stream(device)
            self.cycles = int(seconds * sleep_cycles_per_second(device))

    def issue(self, real, args, kw, async_op: bool):
        self.count += 1
        if self.device.type != "cuda":
            deadline = time.perf_counter() + self.seconds
            if async_op:
                return DelayedWork(lambda: real(*args, async_op=False, **kw), deadline)
            DelayedWork(None, deadline).wait()  # a blocking collective: its delay is exposed by construction
            return real(*args, async_op=False, **kw)
        compute = torch.cuda.current_stream()
        self.side.wait_stream(compute)
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(self.cycles)
            work = real(*args, async_op=async_op, **kw)
        if not async_op:
            compute.wait_stream(self.side)
        return work

    @contextmanager
    def applied(self):
        from parallel import comm

        def delayed(real):
            def call(*args, async_op: bool = False, **kw):
                return self.issue(real, args, kw, async_op)

            return call

        names = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
        with mock.patch.multiple(comm, **{n: delayed(getattr(comm, n)) for n in names}):
            yield

    def has_teeth(self, device: torch.device) -> bool:
        """An all-gather read before its wait() still holds the output's old zeros, and after it the ones:
        so a wrapper that forgot a wait, or freed a buffer early, would change the losses."""
        from parallel import comm

        out, shard = torch.zeros(4, device=device), torch.ones(4, device=device)
        with self.applied():
            work = comm.all_gather_into_tensor(out, shard, None, async_op=True)
            early = out.clone()
            work.wait()
            late = out.clone()
        self.count -= 1
        return bool((early == 0).all() and (late == 1).all())


def sleep_cycles_per_second(device: torch.device) -> float:
    """GPU clock cycles per second of torch.cuda._sleep, timed with events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm-up
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / (start.elapsed_time(end) / 1e3)


def timed_losses(t, steps: int) -> tuple[list[float], float]:
    """Losses of steps 1..steps and the median step time of steps 2..steps (train_step's own dt)."""
    import train

    records = [train.train_step(t, step) for step in range(1, steps + 1)]
    return [r["loss"] for r in records], statistics.median(r["step_time_ms"] / 1e3 for r in records[1:])


def stage_overlap(ctx: Context) -> None:
    s, device = ctx.setup, device_of(ctx)
    delay = 2e-3 if device.type == "cuda" else 5e-3
    steps = s.steps + 2 if device.type == "cuda" else s.steps
    for name in ("ddp", "fsdp"):
        with row_on_error(ctx, f"overlap {name}"):
            with forced_collectives(True):
                forced, t_forced = timed_losses(build_path(ctx, name, s.small, s.dtype, steps), steps)
            delays = Delays(device, delay)
            with forced_collectives(True):
                teeth = delays.has_teeth(device)
            with forced_collectives(True), delays.applied():
                trainer = build_path(ctx, name, s.small, s.dtype, steps)
                delays.count = 0
                got, t_delayed = timed_losses(trainer, steps)
            per_step = delays.count / steps
            exposed = (t_delayed - t_forced) / (per_step * delay) if per_step else math.nan
            ctx.measured.setdefault("overlap", {})[name] = {
                "delay_s": delay,
                "collectives_per_step": per_step,
                "step_s_forced": t_forced,
                "step_s_delayed": t_delayed,
                "exposed_fraction": exposed,
                "early_read_sees_old_data": teeth,
            }
            ctx.add(
                f"overlap {name}",
                got == forced and per_step > 0 and teeth,
                f"{per_step:.0f} collectives/step each delayed {delay * 1e3:.0f} ms (a read before wait sees "
                f"old data: {teeth}): losses "
                f"{'bit-equal' if got == forced else 'DIFFER'}; step {t_forced * 1e3:.1f} -> "
                f"{t_delayed * 1e3:.1f} ms, exposed {exposed:.2f} of the delay",
            )


# ----------------------------------------------------------------------------- the compiled recipe, end to end


RECIPE_MEMORY_TOL = 0.15  # the goal: the compiled recipe's peak within 15% of the planner's (eager) prediction


def stage_recipe(ctx: Context) -> None:
    """`train.py --compile` end to end at the 124M recipe's micro-batch (configs/gpt2-124m.toml: GPT-2, 64 x 1024,
    bf16, compiled; one rank, one micro-step a step): tokens/s, MFU (written to <report>/efficiency.json for the
    planner, plan/cluster.py), and its peak memory against the planner's prediction for the run (train.py logs it
    at step 0). The dry run compiles with dynamo's eager backend (the flag's plumbing, not inductor)."""
    s = ctx.setup
    out = ctx.out_dir("recipe")
    run = ["--warmup_steps", "2", "--eval_interval", "1000", "--eval_iters", "1", "--no_checkpoint"]
    run += ["--dataset", ctx.data, "--device", s.device, "--max_steps", str(s.recipe_steps), "--out_dir", out]
    proc = run_train(s.recipe + run, eager_compile=s.device != "cuda")
    if proc.returncode != 0:
        raise RuntimeError(f"train.py exited {proc.returncode}: {last_line(proc.stderr)}")
    records = read_jsonl(out)
    steps = [r for r in records if "loss" in r]
    timed = steps[min(3, len(steps) - 1) :]  # the first steps compile, allocate and select kernels
    tok = statistics.median(r["tokens_per_sec"] for r in timed)
    mfu = statistics.median(r["mfu"] for r in timed)
    peak = max(r["peak_memory_bytes"] for r in steps[1:] or steps)
    predicted = next((r["predicted"]["peak_memory_bytes"] for r in records if "predicted" in r), None)
    name = torch.cuda.get_device_name() if s.device == "cuda" else "cpu"
    where = write_efficiency(ctx, name, mfu, timed) if s.device == "cuda" else None
    ok = len(steps) == s.recipe_steps and all(math.isfinite(r["loss"]) for r in steps) and 0 < mfu <= 1
    model = s.recipe[s.recipe.index("--model") + 1]
    mb = s.recipe[s.recipe.index("--micro_batch_size") + 1]
    ratio = peak / predicted if predicted else math.nan
    ctx.measured["recipe"] = {"tokens_per_sec": tok, "mfu": mfu, "peak": peak, "predicted_peak": predicted}
    ctx.add(
        "train.py --compile recipe",
        ok,
        f"{model} mb {mb} on {name}: {tok:,.0f} tok/s, MFU {100 * mfu:.1f}% (median of steps {timed[0]['step']}-"
        f"{timed[-1]['step']}){f'; efficiency {mfu:.3f} written to {where}' if where else ''}; peak "
        f"{size(peak)}, planner {size(predicted) if predicted else 'none'} ({ratio:.2f}x)",
    )
    ctx.goal(
        f"goal recipe peak within {RECIPE_MEMORY_TOL:.0%} of the planner's",
        abs(ratio - 1) <= RECIPE_MEMORY_TOL if s.device == "cuda" and predicted else None,
        f"{ratio:.2f}x the prediction" if s.device == "cuda" else "skipped on CPU: its peak is RSS, not the device's",
    )


def size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def write_efficiency(ctx: Context, device_name: str, mfu: float, timed: list[dict]) -> str | None:
    """The measured efficiency into <report>/efficiency.json, under the planner's preset for this GPU
    (plan/cluster.preset_of; the device's own name when it is no preset), other GPUs' entries kept. Returns the
    path, or None without a report directory."""
    from plan.cluster import preset_of

    if ctx.report_md is None:
        return None
    path = os.path.join(os.path.dirname(ctx.report_md), "efficiency.json")
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        table = {}
    table[preset_of(device_name) or device_name] = {
        "efficiency": mfu,
        "device": device_name,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "how": f"scripts/gpu_check.py: train.py {' '.join(ctx.setup.recipe)}, median MFU of steps "
        f"{timed[0]['step']}-{timed[-1]['step']} (plan/counts.step_flops' FLOPs over the datasheet peak)",
    }
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
    return path


# ----------------------------------------------------------------------------- real size


def sdpa_kernel(trainer) -> str:
    """The attention kernels one training step launched, by the profiler's names."""
    from torch.profiler import ProfilerActivity, profile

    import train

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.spec.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        train.train_step(trainer, 10_000)
    names = {e.key for e in prof.key_averages()}
    found = sorted(
        {
            n
            for n in names
            for k in ("flash", "efficient", "cudnn", "math_attention")
            if k in n.lower() and ("attention" in n.lower() or "fmha" in n.lower() or "flash" in n.lower())
        }
    )
    return ", ".join(found[:2]) or "none found"


def stage_real_size(ctx: Context) -> None:
    cuda = ctx.setup.device == "cuda"
    for name in REAL_SIZE if cuda else DRY_REAL_SIZE:
        with row_on_error(ctx, f"real size {name}"):
            real_size_path(ctx, name)
    release_memory(device_of(ctx))  # the last build's memory back to the device: the next stage runs train.py


def real_size_path(ctx: Context, name: str) -> None:
    """One real-size row (its trainer is freed on return: the next build's memory is its own)."""
    import train
    from runtime import metrics

    s, device = ctx.setup, device_of(ctx)
    cuda = device.type == "cuda"
    flags = GPT2_FLAGS if cuda else s.throughput
    dtype, steps = ("bfloat16", 10) if cuda else ("float32", 3)
    memory = torch.get_device_module(device)
    with path_collectives(name, "real size"):
        trainer = build_path(ctx, name, flags, dtype, steps)
        records = [train.train_step(trainer, step) for step in range(1, 3)]  # warm-up: state, compile
        compiles = dynamo_frames()
        if cuda:
            memory.reset_peak_memory_stats(device)
        records = [train.train_step(trainer, step) for step in range(3, steps + 1)]
        recompiles = dynamo_frames() - compiles
        kernel = sdpa_kernel(trainer)
    tok = statistics.median(r["tokens_per_sec"] for r in records)
    mfu = statistics.median(r["mfu"] for r in records)
    alloc = memory.max_memory_allocated(device) if cuda else metrics.peak_memory_bytes(device)
    reserved = memory.max_memory_reserved(device) if cuda else alloc
    state = records[-1]["state_bytes"]
    a = trainer.spec.args
    acts = 34 * a.seq_len * a.micro_batch_size * trainer.spec.config.n_embd * trainer.spec.config.n_layer
    adamw = trainer.spec.args.optimizer == "adamw"  # Muon's optimizer pairs Muon with AdamW: not fused as one
    fused = trainer.optimizer.defaults.get("fused") is True
    ns = statistics.median(r["muon_ns_ms"] for r in records) if "muon_ns_ms" in records[-1] else None
    step_ms = statistics.median(r["step_time_ms"] for r in records)
    ctx.measured.setdefault("real_size", {})[name] = {
        "tokens_per_sec": tok,
        "mfu": mfu,
        "max_allocated": alloc,
        "max_reserved": reserved,
        "state_bytes": state,
        "activation_estimate": acts,
        "sdpa": kernel,
        "fused_adamw": fused,
        "recompiles": recompiles,
        "params": sum(p.numel() for p in trainer.model.parameters()),
        "ns_ms": ns,
        "step_ms": step_ms,
    }
    muon = f"Newton-Schulz {ns:.2f} ms of a {step_ms:.1f} ms step ({ns / step_ms:.1%}); " if ns is not None else ""
    ctx.add(
        f"real size {name}",
        (fused or not adamw) and recompiles == 0 and all(map(math.isfinite, (tok, mfu))) and (adamw or ns is not None),
        f"{tok:,.0f} tok/s, MFU {100 * mfu:.1f}%; {muon}allocated {alloc / 2**30:.2f} GiB (state "
        f"{state / 2**30:.2f} + activations ~{acts / 2**30:.2f}), reserved {reserved / 2**30:.2f}; "
        f"attention {kernel}; {'fused AdamW ' + str(fused) + '; ' if adamw else ''}recompiles {recompiles}",
    )


def dynamo_frames() -> int:
    """Frames dynamo has compiled so far in this process (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(sum(counters["frames"].values())) if "frames" in counters else 0


def stage_goals(ctx: Context) -> None:
    real = ctx.measured.get("real_size", {})
    if not real:
        ctx.goal("goals", None, "no real-size numbers (that stage did not run)")
        return
    recipe = ctx.measured.get("recipe") if ctx.setup.device == "cuda" else None  # the CPU's MFU is no goal's
    ctx.goal(
        f"goal MFU >= {GOAL_MFU:.0%} (compile)",
        (recipe["mfu"] >= GOAL_MFU) if recipe else None,
        f"train.py --compile recipe: {100 * recipe['mfu']:.1f}%" if recipe else "no compiled GPU run (recipe row)",
    )
    for name, r in real.items():
        base = BASELINE.get(name, "plain")
        if name in ("plain", "ac", "compile", "moe", "muon") or base not in real:  # AC recomputes by design;
            continue  # compile, MoE and Muon are no wrapper
        ratio = r["tokens_per_sec"] / real[base]["tokens_per_sec"]
        ctx.goal(f"goal {name} >= {GOAL_WRAPPER} x {base}", ratio >= GOAL_WRAPPER, f"tokens/s ratio {ratio:.3f}")
    worst = max(real.items(), key=lambda kv: kv[1]["max_reserved"] / kv[1]["max_allocated"])
    ratio = worst[1]["max_reserved"] / worst[1]["max_allocated"]
    ctx.goal(f"goal reserved <= {GOAL_RESERVED} x allocated", ratio <= GOAL_RESERVED, f"worst {worst[0]}: {ratio:.3f}")
