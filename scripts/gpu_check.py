"""One-shot GPU check: every CUDA path of the trainer once on one GPU; each row printed and appended to the report
as it finishes, one table at the end.

    bash scripts/gpu_check.sh              # on a machine with a CUDA device (docs/gpu.md); report in results/gpu/
    timeout -k 15 540 bash scripts/gpu_check.sh --report "$OUT"   # the lent machine's one call (docs/gpu.md)
    bash scripts/gpu_check.sh --dry-run    # anywhere: CPU, tiny model, few steps; checks the plumbing

Its first line is torch's version (and CUDA's, Python's, the device), and the table and report carry it: the GPU
machine runs torch 2.11.0+cu130 on Python 3.12 (scripts/gpu_dry_run_torch211.sh runs the dry run on that torch).
SIGTERM or SIGINT stops it at once: the running stage unwinds (a child process is killed), the finished rows and
a `stopped` row make the table and the report, and it exits 128 + the signal number.

What one GPU cannot check (world-size-1 NCCL groups only), and where it is checked instead: the order of
NCCL p2p between two ranks (the schedule simulator's "nccl" pair-FIFO model, tests/test_pipeline_schedule.py),
collectives that move data between GPUs (every wrapper against one process on gloo ranks, tests/), a ring
exchange of CP (torchrun --nproc_per_node=2 on two GPUs, docs/gpu.md), NVLink/InfiniBand bandwidth.

Stages (a row each; a stage that raises is a FAIL row, and the others still run):
- process group preflight (first, when a chosen stage builds a process group in this process): a child process
  inits a one-rank NCCL group (gloo on the CPU) and runs one all_reduce within 30 s (scripts/gpu_preflight.py);
  if it fails, that is the one row, and the stages that build a group (real size, wrappers, context parallel,
  sync audit, overlap) are skipped rather than failing or hanging one by one.
- real size (scripts/gpu_measure.py) comes first: its MFU numbers are what a GPU run is for, and a run cut short
  keeps them. It includes Muon's row (--optimizer muon: tokens/s and Newton-Schulz ms a step).
- recipe (scripts/gpu_measure.py): `train.py --compile` end to end at configs/gpt2-124m.toml's micro-batch
  (GPT-2, 64 x 1024, bf16; one rank): tokens/s, MFU, written to <report>/efficiency.json as the planner's
  efficiency (plan/cluster.py), and peak memory against the planner's prediction (a goal row).
- ddp / fsdp / tp: our wrappers on a one-rank group of this device (NCCL on CUDA), built by train.build
  through parallelize's APPLY table and stepped by train.train_step, against the same config on the CPU in
  fp32. A one-rank group short-circuits parallel/comm.py (`world(group) == 1`), so each wrapper runs again
  with that short-cut off (`forced_collectives`): the collectives are then really issued, on one rank they
  are identities, so the losses must be unchanged, and the bytes counted must equal the wrapper's formula.
- context parallel: our ring attention on this device against SDPA (fp32, output and input gradients); and the
  PyTorch twin (torch's context_parallel, CUDA only) on a one-rank cp mesh against the plain model: loss and
  gradients. One rank makes the ring a single block, so this checks the plumbing (positions, sharding, the
  DTensor dispatch of SDPA, the kernel choice), not the exchange: `torchrun --nproc_per_node=2 train.py
  --implementation pytorch --context_parallel_size 2` against one process does that (docs/gpu.md).
- fp16: --dtype float16 with the AgreeingGradScaler: losses finite and falling; on CUDA at GPT-2's vocabulary
  (50304) and 16,384 rows a micro-batch, the regime of fp16's loss-head overflow.
- fused adamw: train.build chose torch's fused AdamW (every device torch fuses on, CPU included).
- resume: an uninterrupted run against one SIGKILLed after its step-3 checkpoint and `--resume`d: the
  same losses bit for bit (the runs use deterministic kernels: math SDPA, deterministic algorithms).
- gpu tests: `pytest -m gpu tests/test_gpu.py` (needs requirements-dev.txt; says so when pytest is missing).
- sync audit, overlap, goals: scripts/gpu_measure.py (its docstring).
- fp8: a row for FP8 when it lands; until then it says "not built" (a skip, not a pass).

The data is a synthetic learnable token corpus written to a temporary directory: the GPU box has no internet.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import gpu_measure
import gpu_preflight
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_harness import (
    COMMON,
    CP_RTOL,
    DRY,
    GPU,
    ROOT,
    RTOL,
    SAME_RTOL,
    Context,
    Row,
    _ForcedOne,
    build_wrapped,
    by_step,
    child_env,
    deterministic_train,
    eager_compile_train,
    first_line,
    fmt_bytes,
    forced_collectives,
    last_line,
    make_plan,
    max_rel,
    md_row,
    one_rank_mesh,
    read_jsonl,
    row_on_error,
    run_train,
    train_losses,
)

# ----------------------------------------------------------------------------- stages


WRAPPERS = {  # name: (dp_type, tp, param_dtype)
    "ddp": ("ddp", False, None),
    "fsdp": ("fsdp", False, torch.bfloat16),  # --param_dtype bfloat16: bf16 compute copies, fp32 master shard
    "tp": (None, True, None),
}


def comm_theory(name: str, t, spec) -> dict[str, int]:
    """Bytes per step the wrapper's own formula gives (plan/theory.py)."""
    a = spec.args
    if name == "ddp":  # every trainable parameter's fp32 gradient, once per step (no_sync before the last micro-step)
        return {"all_reduce": sum(b.nbytes for b in t.model.buckets)}
    if name == "fsdp":
        from plan.theory import engine_comm_bytes_per_micro_step

        return {k: v * spec.grad_accum for k, v in engine_comm_bytes_per_micro_step(t.model).items()}
    from plan.theory import tp_comm_bytes_per_micro_step

    lowp = spec.dtype != torch.float32  # under autocast the matmul outputs are low precision, the residual fp32
    per = tp_comm_bytes_per_micro_step(
        spec.config,
        a.micro_batch_size,
        a.seq_len,
        _ForcedOne(1),
        False,
        False,
        dtype_bytes=2 if lowp else 4,
        residual_bytes=4,
    )
    return {k: v * spec.grad_accum for k, v in per.items()}


def stage_wrappers(ctx: Context) -> None:
    s = ctx.setup
    device = torch.device(s.device, 0) if s.device == "cuda" else torch.device("cpu")
    ref_plan = make_plan(ctx, "cpu-ref", s.small, "cpu", "float32", s.steps)
    import train

    ctx.cpu_losses, _ = train_losses(train.build(ref_plan), s.steps)
    mesh = one_rank_mesh(device)
    for name, (dp_type, tp, param_dtype) in WRAPPERS.items():
        dtype = "bfloat16" if param_dtype == torch.bfloat16 else s.dtype
        spec = make_plan(ctx, name, s.small, s.device, dtype, s.steps)
        with row_on_error(ctx, f"{name}"):
            runs = {}
            for forced in (False, True):
                with forced_collectives(forced):
                    trainer = build_wrapped(spec, mesh, dp_type, tp, param_dtype)
                    runs[forced] = train_losses(trainer, s.steps) + (trainer,)
            losses, _, _ = runs[False]
            rtol = RTOL[torch.bfloat16 if param_dtype == torch.bfloat16 else spec.dtype]
            d = max_rel(losses, ctx.cpu_losses)
            what = f"custom {name}" + (" param_dtype=bf16" if param_dtype else "")
            ctx.add(
                f"{name} vs cpu fp32",
                d <= rtol and all(map(math.isfinite, losses)),
                f"{what} on {device} {dtype}: max rel loss diff {d:.1e} <= {rtol:.1e} over {s.steps} steps",
            )
            forced_losses, forced_bytes, t = runs[True]
            d = max_rel(forced_losses, losses)
            want = {k: v for k, v in comm_theory(name, trainer, spec).items() if v}
            got = [{k: v for k, v in b.items() if v} for b in forced_bytes]
            bytes_ok = all(g == want for g in got) and bool(want)
            same = "bit-equal" if forced_losses == losses else f"max rel diff {d:.1e}"
            ctx.add(
                f"{name} collectives issued",
                d <= SAME_RTOL and bytes_ok,
                f"losses {same} to the short-circuited run; bytes/step {fmt_bytes(got[-1])}"
                + ("" if bytes_ok else f" != formula {fmt_bytes(want)}"),
            )


def stage_context_parallel(ctx: Context) -> None:
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from model.gpt import GPT
    from parallel.context_parallel.ring import positions_for, ring_attention
    from parallel.twins.context_parallel import torch_context_parallel

    s = ctx.setup
    device = torch.device(s.device, 0) if s.device == "cuda" else torch.device("cpu")
    one_rank_mesh(device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here: the tolerances are fp32's
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(2, 4, 128, 16, generator=g).to(device) for _ in range(4))
        errs = []
        for attend in (
            lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
            lambda a, b, c: ring_attention(a, b, c, None),
        ):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = attend(*leaves)
            out.backward(dout)
            errs.append([out.detach(), *(t.grad for t in leaves)])
        worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(errs[1], errs[0]))
        ctx.add(
            "cp ring vs sdpa",
            worst <= CP_RTOL,
            f"ours on {device} fp32, T=128, one rank: max rel diff of out, dq, dk, dv {worst:.1e} <= {CP_RTOL:.0e}",
        )
        if device.type != "cuda":
            ctx.add(
                "cp torch twin",
                None,
                "skipped: needs CUDA (torch's context_parallel rings only the flash, "
                "efficient and cuDNN kernels: tests/test_context_parallel_twin.py)",
            )
            return
        spec = make_plan(ctx, "cp-twin", s.small, s.device, "float32", 1)
        model = GPT(spec.config).to(device)
        twin = copy.deepcopy(model)
        twin.positions = positions_for(0, 1)  # the twin's zigzag positions (parallel/twins/context_parallel.apply_cp)
        x = torch.randint(spec.config.vocab_size, (4, spec.args.seq_len), generator=g).to(device)
        y = torch.roll(x, -1, 1)
        ref = model(x, y)[1]
        ref.backward()
        with torch_context_parallel(init_device_mesh("cuda", (1,), mesh_dim_names=("cp",)), x, y) as (lx, ly):
            loss = twin(lx, ly)[1]
            loss.backward()
        d_loss = abs(loss.item() - ref.item()) / abs(ref.item())
        d_grad = max(
            ((a.grad - b.grad).abs().max() / b.grad.abs().max()).item()
            for a, b in zip(twin.parameters(), model.parameters())
        )
        ctx.add(
            "cp torch twin",
            d_loss <= CP_RTOL and d_grad <= CP_RTOL,
            f"torch context_parallel on a 1-rank cp mesh vs the plain model, fp32: loss rel diff {d_loss:.1e}, "
            f"max rel grad diff {d_grad:.1e} (<= {CP_RTOL:.0e})",
        )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def stage_fp16(ctx: Context) -> None:
    s = ctx.setup
    import train
    from parallel.grads import AgreeingGradScaler

    spec = make_plan(ctx, "fp16", s.fp16, s.device, "float16", 2 * s.steps)
    trainer = train.build(spec)
    records = [train.train_step(trainer, step) for step in range(1, 2 * s.steps + 1)]
    losses = [r["loss"] for r in records]
    finite = all(map(math.isfinite, losses))
    falling = losses[-1] < losses[0]
    scales = [r["loss_scale"] for r in records]
    rows = spec.args.micro_batch_size * spec.args.seq_len
    ctx.add(
        "fp16 + GradScaler",
        finite and falling and isinstance(trainer.scaler, AgreeingGradScaler),
        f"vocab {spec.config.vocab_size}, {rows} rows a micro-batch: loss {losses[0]:.3f} -> {losses[-1]:.3f} in "
        f"{len(losses)} steps (finite: {finite}), loss scale {scales[0]:g} -> {scales[-1]:g}",
    )
    fused = trainer.optimizer.defaults.get("fused")
    ctx.add("fused AdamW", fused is True, f"optimizer.defaults['fused'] = {fused} on {spec.device}")


def stage_fp8(ctx: Context) -> None:
    """FP8's row, kept for when it lands: train.py has no FP8 path yet, so the row says so (a skip, not a pass)."""
    from trainer.config import train_parser

    flags = [o for a in train_parser()._actions for o in a.option_strings if "fp8" in o or "float8" in o]
    ctx.add(
        "fp8",
        None,
        f"not built: no stage measures {', '.join(flags)} yet; add it here"
        if flags
        else "not built: train.py has no FP8 path (no --fp8 flag); its check goes here",
    )


def stage_resume(ctx: Context) -> None:
    s = ctx.setup
    kill = s.steps // 2
    base = (
        s.small
        + COMMON
        + [
            "--dataset",
            ctx.data,
            "--device",
            s.device,
            "--dtype",
            s.dtype,
            "--max_steps",
            str(s.steps),
            "--keep_checkpoints",
            "2",
        ]
    )
    whole, cut = ctx.out_dir("resume-whole"), ctx.out_dir("resume-cut")
    u = run_train(base + ["--out_dir", whole], deterministic=True)
    k = run_train(
        base + ["--out_dir", cut, "--checkpoint_interval", str(kill)],
        deterministic=True,
        env={"GPT_KILL_AT_STEP": str(kill)},
    )
    r = run_train(base + ["--out_dir", cut, "--resume"], deterministic=True)
    if u.returncode != 0 or k.returncode != -signal.SIGKILL or r.returncode != 0:
        raise RuntimeError(
            f"exit codes: whole {u.returncode}, killed {k.returncode} (want -9), resumed "
            f"{r.returncode}: {last_line(u.stderr + k.stderr + r.stderr)}"
        )
    ref = by_step(read_jsonl(whole))
    got = by_step(read_jsonl(cut))  # a step logged twice counts as its last record
    after = [st for st in sorted(ref) if st > kill]
    equal = [st for st in after if got.get(st) == ref[st]]
    resumed = "resuming from" in r.stdout
    ctx.add(
        "checkpoint + --resume",
        resumed and len(equal) == len(after) == s.steps - kill,
        f"killed after step {kill}, resumed on {s.device} {s.dtype}: steps {kill + 1}-{s.steps} bit-equal "
        f"{len(equal)}/{len(after)}"
        + (
            ""
            if len(equal) == len(after)
            else f", max diff {max(abs(got.get(x, math.inf) - ref[x]) for x in after):.1e}"
        ),
    )


def stage_gpu_tests(ctx: Context) -> None:
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        ctx.add("gpu tests", None, "skipped: pytest is not installed (pip install -r requirements-dev.txt)")
        return
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
            os.path.join("tests", "test_gpu.py"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )
    summary = last_line(proc.stdout)
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", summary))
    if proc.returncode == 0 and counts.get("skipped") and not counts.get("passed"):
        ctx.add("gpu tests", None, f"skipped: needs CUDA ({summary})")
    else:
        ctx.add("gpu tests", proc.returncode == 0 and counts.get("passed", 0) > 0, summary)
        if proc.returncode != 0:
            print(proc.stdout[-4000:], file=sys.stderr)


# (name, function, whether it builds a process group in this process: skipped when the preflight fails). Real
# size first: the MFU numbers are what a GPU run is for, and a run cut short keeps them
STAGES = [
    ("real size", gpu_measure.stage_real_size, True),
    ("recipe", gpu_measure.stage_recipe, False),
    ("wrappers", stage_wrappers, True),
    ("context parallel", stage_context_parallel, True),
    ("fp16", stage_fp16, False),
    ("resume", stage_resume, False),
    ("gpu tests", stage_gpu_tests, False),
    ("sync audit", gpu_measure.stage_sync_audit, True),
    ("overlap", gpu_measure.stage_overlap, True),
    ("fp8", stage_fp8, False),
    ("goals", gpu_measure.stage_goals, False),
]


class Stopped(BaseException):
    """SIGTERM or SIGINT: raised in the main thread at once (not an Exception: no stage's handler keeps it), so
    subprocess.run kills its child, the stage unwinds, and the table and report of the finished rows are written."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum, frame) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second signal ends the process at once
    raise Stopped(signum)


def counts(rows: list[Row]) -> str:
    n = {k: sum(r.status == k for r in rows) for k in ("ok", "FAIL", "skip", "met", "missed")}
    return (
        f"{len(rows)} checks: {n['ok']} ok, {n['FAIL']} FAIL, {n['skip']} skipped; goals {n['met']} met, "
        f"{n['missed']} missed"
    )


def machine(dry_run: bool) -> dict:
    device = "cpu (dry run)" if dry_run else torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return {
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def print_table(rows: list[Row], seconds: float, dry_run: bool) -> None:
    w = max([len(r.check) for r in rows] + [5])
    title = f"GPU check{' (dry run on CPU)' if dry_run else ''}, torch {torch.__version__}: {seconds:.0f}s"
    print(f"\n{title}\n{'check':<{w}}  result  detail\n{'-' * w}  ------  {'-' * 60}")
    for r in rows:
        print(f"{r.check:<{w}}  {r.status:<6}  {r.detail}")
    print(counts(rows), flush=True)


def report_header(m: dict, status: str) -> list[str]:
    return [
        f"# GPU check: {m['device']}, torch {m['torch']}, {status}",
        "",
        f"`bash scripts/gpu_check.sh`: torch {m['torch']} (CUDA {m['cuda']}), Python {m['python']}, {m['date']}.",
        "",
        "| check | result | detail |",
        "|---|---|---|",
    ]


def start_report(directory: str, m: dict) -> str:
    """gpu_check.md with its header; each row is appended as it is made (Context.add), so a run cut short, even
    by SIGKILL, leaves the rows it finished. write_report rewrites the file whole at the end."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "gpu_check.md")
    with open(path, "w") as f:
        f.write("\n".join(report_header(m, "in progress (rows appended as they finish)")) + "\n")
    return path


def write_report(ctx: Context, directory: str, seconds: float, m: dict) -> None:
    """gpu_check.md (the table) and gpu_check.json (rows, the measured numbers, the machine) in `directory`."""
    m = {**m, "seconds": seconds}
    with open(os.path.join(directory, "gpu_check.json"), "w") as f:
        json.dump({"machine": m, "rows": [vars(r) for r in ctx.rows], "measured": ctx.measured}, f, indent=1)
    lines = report_header(m, f"{seconds:.0f} s")
    lines[2] += f" {counts(ctx.rows)}."
    lines += [md_row(r) for r in ctx.rows]
    with open(os.path.join(directory, "gpu_check.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"gpu_check: wrote {directory}/gpu_check.md and gpu_check.json")


def run_stages(ctx: Context, only: list[str] | None) -> None:
    chosen = [(name, fn, group) for name, fn, group in STAGES if not only or name in only]
    group_ok = True
    if any(group for _, _, group in chosen):
        ok, detail = gpu_preflight.run(ctx.setup.device)
        skipped = [name for name, _, group in chosen if group]
        ctx.add("process group preflight", ok, detail + ("" if ok else "; skipped: " + ", ".join(skipped)))
        group_ok = ok
    for name, fn, group in chosen:
        if group and not group_ok:
            print(f"== {name}: skipped (the process group preflight failed)", flush=True)
            continue
        print(f"== {name}", flush=True)
        t1 = time.perf_counter()
        try:
            fn(ctx)
        except Exception as e:  # noqa: BLE001 -- the table reports it; the other stages still run
            ctx.add(name, False, f"{type(e).__name__}: {first_line(e)}")
            traceback.print_exc()
        print(f"   {time.perf_counter() - t1:.1f}s", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--deterministic-train"]:
        return deterministic_train(argv[1:])
    if argv[:1] == ["--eager-compile-train"]:
        return eager_compile_train(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, few steps: check the plumbing")
    p.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (runs, metrics) instead of a temp dir")
    p.add_argument(
        "--report",
        metavar="DIR",
        help="write gpu_check.md (row by row as they finish), gpu_check.json and efficiency.json in DIR "
        "(default: results/gpu on a GPU, none in the dry run)",
    )
    p.add_argument("--only", nargs="*", choices=[name for name, _, _ in STAGES], help="run only these stages")
    args = p.parse_args(argv)
    m = machine(args.dry_run)
    print(f"gpu_check: torch {m['torch']} (CUDA {m['cuda']}), Python {m['python']}, {m['device']}", flush=True)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device; run with --dry-run to check the plumbing on CPU", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    tmp = args.keep or tempfile.mkdtemp(prefix="gpu_check_")
    os.makedirs(tmp, exist_ok=True)
    report = args.report or (None if args.dry_run else os.path.join(ROOT, "results", "gpu"))
    from tests.harness import make_token_bins

    ctx = Context(
        DRY if args.dry_run else GPU,
        tmp,
        make_token_bins(os.path.join(tmp, "data"), n_train=200_000, n_val=20_000),
        report_md=start_report(report, m) if report else None,
    )
    handlers = {sig: signal.signal(sig, _stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        run_stages(ctx, args.only)
    except Stopped as s:
        code = 128 + s.signum
        print(f"gpu_check: {s} received: stopping", file=sys.stderr, flush=True)
        ctx.add("stopped", False, f"{s} after {time.perf_counter() - t0:.0f} s: the rows above are the ones finished")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if dist.is_initialized():
            dist.destroy_process_group()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.perf_counter() - t0
    print_table(ctx.rows, seconds, args.dry_run)
    if report:
        write_report(ctx, report, seconds, m)
    return code or (1 if any(r.status == "FAIL" for r in ctx.rows) else 0)


if __name__ == "__main__":
    sys.exit(main())
