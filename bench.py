"""Benchmark every parallel layout on this machine: throughput, MFU, memory and communication vs theory.

    python bench.py --quick --out out/bench            # tiny model, a few steps: minutes on 2 CPU cores
    python bench.py --out out/bench                    # `small` for longer: the numbers to publish
    python bench.py --section out/bench                # the README "Results" snippet from bench.json

The matrix is single; ddp, fsdp and tp (tp with loss parallelism), each with `--implementation custom`
and `pytorch`; and with >= 4 ranks 2d-ddp and 2d-fsdp (tp=2 x dp=N/2). Ranks are the GPUs present, or
`--nproc` gloo ranks on CPU (2D: `--nproc 4`, or `--include_2d` for 4 ranks besides 2). Every layout
trains the same model on the same global batch, each as its own `torchrun` job (`python train.py` for
single) under <out>/runs/. The micro-batch is rows/dp, capped at --micro_batch_size on GPU (then
gradient accumulation makes up the rest). Members of a custom/pytorch pair run back to back, and
with --repeats the pair's order alternates.

Peak matmul FLOP/s is measured once (CPU: one thread, as torchrun gives each rank; GPU: the datasheet,
see metrics.peak_flops) and passed to every job, so MFU is comparable. Throughput is the median
tokens/s over the steps after --warmup. Communication is what parallel/comm.COUNTER saw on rank 0 per
step (custom layouts only: PyTorch's collectives bypass it), next to theory in the same units, payload
bytes per rank per optimizer step (Psi = fp32 parameter bytes, tied weight once; A = grad_accum):

    DDP:   all-reduce Psi                        (no_sync on all but the last micro-step)
    FSDP:  all-gather 2 Psi + reduce-scatter Psi, per micro-step: 3 Psi x A  (reshard after forward)
    TP:    parallel.tensor_parallel.tp_comm_bytes_per_micro_step x A; if that is missing, Megatron's
           (4L+2)·B·T·H·b all-reduce (f and g of every block, the embedding's g, ln_f's f) + the loss:
           3 fp32 per token with loss parallelism, else an all-gather of the (B, T, V) logits
    2D:    the DP term on this rank's TP shard of the parameters (~Psi/TP), plus the TP term

Outputs in --out: bench.json (one row per layout x implementation), bench_meta.json (command, machine),
bench.md, results_section.md, and throughput.png, memory.png, comm_vs_world.png.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch

from model import GPT, GPTConfig, make_config

ROOT = os.path.dirname(os.path.abspath(__file__))
LAYOUTS = ("single", "ddp", "fsdp", "tp", "2d-ddp", "2d-fsdp")
KINDS = ("all_reduce", "all_gather", "reduce_scatter")
MiB = 2 ** 20


# ----------------------------------------------------------------------------- the matrix

@dataclass(frozen=True)
class Layout:
    """One cell of the matrix: a layout name, an implementation and its (dp, tp) degrees."""
    name: str            # one of LAYOUTS
    implementation: str  # "custom" | "pytorch" | "none" (single)
    dp: int = 1
    tp: int = 1

    @property
    def nproc(self) -> int:
        return self.dp * self.tp

    @property
    def dp_type(self) -> str | None:
        return None if self.dp == 1 else ("fsdp" if self.name.endswith("fsdp") else "ddp")

    @property
    def key(self) -> str:
        return self.name if self.implementation == "none" else f"{self.name}-{self.implementation}"

    def flags(self) -> list[str]:
        if self.name == "single":
            return []
        out = ["--implementation", self.implementation]
        if self.dp > 1:
            out += ["--data_parallel_size", str(self.dp), "--data_parallel_type", self.dp_type]
        if self.tp > 1:
            out += ["--tensor_parallel_size", str(self.tp), "--enable_loss_parallelism"]
        if self.dp_type == "fsdp":
            out.append("--deferred_init")  # materialise only this rank's shard, as one would at scale
        return out


def matrix(nproc: int, on_gpu: bool, include_2d: bool, wanted: list[str] | None = None) -> list[Layout]:
    """The layouts to run, in order; 2D (tp=2 x dp=N/2) needs >= 4 ranks (on CPU: 4 with --include_2d)."""
    lays = [Layout("single", "none")]
    if nproc >= 2:
        for impl in ("custom", "pytorch"):
            lays.append(Layout("ddp", impl, dp=nproc))
        for impl in ("custom", "pytorch"):
            lays.append(Layout("fsdp", impl, dp=nproc))
        for impl in ("custom", "pytorch"):
            lays.append(Layout("tp", impl, tp=nproc))
    n2d = nproc if nproc >= 4 else (4 if include_2d and not on_gpu else 0)
    if n2d and n2d % 2 == 0:
        for name in ("2d-ddp", "2d-fsdp"):
            for impl in ("custom", "pytorch"):
                lays.append(Layout(name, impl, dp=n2d // 2, tp=2))
    if wanted:
        lays = [lay for lay in lays if lay.name in wanted]
    return lays


@dataclass(frozen=True)
class Setup:
    """What every layout shares: model, global batch, steps, peak FLOP/s, dtype."""
    model: str
    config: GPTConfig
    seq_len: int
    rows: int               # sequences per global batch (the same for every layout)
    micro_cap: int          # largest micro-batch per rank
    warmup: int
    steps: int              # measured steps
    peak_flops: float
    device: str             # "cpu" | "cuda"
    dataset: str
    timeout: float          # seconds per job
    dtype_bytes: int = 4    # matmul outputs: 2 under bf16/fp16 autocast
    residual_bytes: int = 4  # residual stream, embeddings, LayerNorm outputs: fp32 also under autocast

    @property
    def global_batch_tokens(self) -> int:
        return self.rows * self.seq_len

    def micro_batch(self, dp: int) -> int:
        """The largest divisor of rows/dp that is <= micro_cap."""
        per_rank = self.rows // dp
        return max(d for d in range(1, min(per_rank, self.micro_cap) + 1) if per_rank % d == 0)

    def grad_accum(self, dp: int) -> int:
        return self.rows // (dp * self.micro_batch(dp))

    def train_args(self, lay: Layout, out_dir: str) -> list[str]:
        c = self.config
        return ["--model", self.model, "--n_layer", str(c.n_layer), "--n_head", str(c.n_head),
                "--n_embd", str(c.n_embd), "--dataset", self.dataset, "--seq_len", str(self.seq_len),
                "--micro_batch_size", str(self.micro_batch(lay.dp)),
                "--total_batch_size", str(self.global_batch_tokens),
                "--max_steps", str(self.warmup + self.steps), "--warmup_steps", "1",
                "--eval_interval", str(self.warmup + self.steps + 1), "--eval_iters", "1",
                "--peak_flops", repr(float(self.peak_flops)), "--timeout", str(int(self.timeout)),
                "--out_dir", out_dir, "--overwrite", *lay.flags()]


def fit_heads(config: GPTConfig, tp: int) -> GPTConfig:
    """The config with n_head raised to the nearest count that divides by tp and divides n_embd, if needed."""
    if config.n_head % tp == 0:
        return config
    for h in range(config.n_head + 1, config.n_embd + 1):
        if h % tp == 0 and config.n_embd % h == 0:
            return replace(config, n_head=h)
    raise ValueError(f"no head count divides both n_embd={config.n_embd} and tp={tp}")


# ----------------------------------------------------------------------------- theory

def param_bytes(config: GPTConfig, tp: int = 1, dtype_bytes: int = 4, root_only: bool = False) -> int:
    """Bytes of one rank's parameters under Megatron TP (tp=1: Psi, the tied weight counted once).

    Split over the tp ranks: the vocab (wte = lm_head), column-parallel weights and biases (c_q, c_k, c_v,
    mlp.c_fc) and row-parallel weights (attn.c_proj, mlp.c_proj). Replicated: LayerNorms, the position
    embedding and the row-parallel biases. root_only: just the parameters outside the Blocks (FSDP's root
    unit: wte = lm_head, wpe, ln_f)."""
    with torch.device("meta"):
        model = GPT(config)
    total = 0
    for name, p in model.named_parameters():  # named_parameters yields the tied weight once
        if root_only and name.startswith("transformer.h."):
            continue
        replicated = ".ln_" in name or "ln_f" in name or "wpe" in name or name.endswith("c_proj.bias")
        total += p.numel() if replicated else p.numel() // tp
    return total * dtype_bytes


def tp_bytes_fallback(config: GPTConfig, B: int, T: int, tp: int, loss_parallel: bool,
                      dtype_bytes: int = 4, residual_bytes: int | None = None) -> dict[str, int]:
    """Megatron TP without sequence parallelism, one micro-step, payload bytes by kind.

    Per block 4 all-reduces of a (B, T, H) activation (f backward at ln_1 and ln_2, g forward after
    attn.c_proj and mlp.c_proj), plus the embedding's g and ln_f's f; the loss adds 3 fp32 per token
    (max, target logit, sum-exp) with loss parallelism, else the all-gather of the (B, T, V) logits."""
    out = {k: 0 for k in KINDS}
    if tp == 1:
        return out
    rb = dtype_bytes if residual_bytes is None else residual_bytes
    act = B * T * config.n_embd
    out["all_reduce"] = (2 * config.n_layer + 2) * act * rb + 2 * config.n_layer * act * dtype_bytes
    if loss_parallel:
        out["all_reduce"] += 3 * B * T * 4
    else:
        out["all_gather"] = B * T * config.vocab_size * dtype_bytes
    return out


def tp_bytes_per_micro_step(config: GPTConfig, B: int, T: int, tp: int, loss_parallel: bool,
                            dtype_bytes: int = 4, residual_bytes: int = 4) -> tuple[dict[str, int], str]:
    """(bytes by kind, source): parallel.tensor_parallel's own formula when it is there, else ours."""
    try:
        from parallel.tensor_parallel import tp_comm_bytes_per_micro_step as fn
    except Exception:  # noqa: BLE001 -- missing or half-written module: fall back to our formula
        fallback = tp_bytes_fallback(config, B, T, tp, loss_parallel, dtype_bytes, residual_bytes)
        return fallback, "bench.tp_bytes_fallback"
    extra = {"residual_bytes": residual_bytes} if "residual_bytes" in inspect.signature(fn).parameters else {}
    got = fn(config, B, T, tp, loss_parallel, False, dtype_bytes=dtype_bytes, **extra)
    return {k: int(got.get(k, 0)) for k in KINDS}, "parallel.tensor_parallel.tp_comm_bytes_per_micro_step"


def comm_theory(lay: Layout, setup: Setup) -> tuple[dict[str, int], str]:
    """Payload bytes per rank per optimizer step for this layout, by kind, and where the TP term came from."""
    out = {k: 0 for k in KINDS}
    A = setup.grad_accum(lay.dp)
    psi = param_bytes(setup.config, lay.tp)
    if lay.dp_type == "ddp":
        out["all_reduce"] += psi
    elif lay.dp_type == "fsdp":
        # each Block is gathered before its forward and again before its backward; the root unit is
        # gathered once, as it is needed at both ends of forward and first in backward (FSDP2 does the same)
        out["all_gather"] += (2 * psi - param_bytes(setup.config, lay.tp, root_only=True)) * A
        out["reduce_scatter"] += psi * A
    source = ""
    if lay.tp > 1:
        tp, source = tp_bytes_per_micro_step(setup.config, setup.micro_batch(lay.dp), setup.seq_len, lay.tp, True,
                                             setup.dtype_bytes, setup.residual_bytes)
        for k in KINDS:
            out[k] += tp[k] * A
    return out, source


# ----------------------------------------------------------------------------- running one job

@dataclass
class JobResult:
    returncode: int | None  # None: killed at the timeout
    output: str             # stdout + stderr
    seconds: float


def run_job(cmd: list[str], log_path: str, timeout: float) -> JobResult:
    """Run cmd in its own session (so a timeout can stop torchrun and all its ranks), output to log_path."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE"):
        env.pop(k, None)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session we started: torchrun and its ranks
            proc.wait()
            rc = None
    with open(log_path) as f:
        return JobResult(rc, f.read(), time.perf_counter() - t0)


def command(lay: Layout, setup: Setup, out_dir: str) -> list[str]:
    train = os.path.join(ROOT, "train.py")
    if lay.nproc == 1:
        return [sys.executable, train, *setup.train_args(lay, out_dir)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={lay.nproc}",
            train, *setup.train_args(lay, out_dir)]


def read_metrics(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(records: list[dict], warmup: int) -> dict | None:
    """Medians over the training steps after `warmup` (None if there are none).

    tokens_per_sec, mfu, step_time_ms, comm_bytes (total) and comm_bytes_by_kind: medians; peak_memory_bytes
    and state_bytes: the largest seen (the first is a running peak anyway)."""
    steps = [r for r in records if "loss" in r and r["step"] > warmup]
    if not steps:
        return None
    med = lambda key: statistics.median(r[key] for r in steps)  # noqa: E731
    out = {"tokens_per_sec": med("tokens_per_sec"), "mfu": med("mfu"), "step_time_ms": med("step_time_ms"),
           "peak_memory_bytes": max(r.get("peak_memory_bytes", 0) for r in steps) or None,
           "state_bytes": max(r.get("state_bytes", 0) for r in steps) or None,
           "comm_bytes": None, "comm_bytes_by_kind": None, "measured_steps": len(steps)}
    if all("comm_bytes" in r for r in steps):
        kinds = sorted({k for r in steps for k in r["comm_bytes"]})
        out["comm_bytes_by_kind"] = {k: int(statistics.median(r["comm_bytes"].get(k, 0) for r in steps))
                                     for k in kinds}
        out["comm_bytes"] = int(statistics.median(sum(r["comm_bytes"].values()) for r in steps))
    return out


_EXC = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)(:|$)")


def failure_line(output: str) -> str:
    """The line that says why a job failed: train.py's one-line error, else the first exception raised,
    else the last line."""
    lines = [re.sub(r"^\[(default|rank)\d*\]:\s*", "", ln).strip() for ln in output.splitlines()]
    lines = [ln for ln in lines if ln]
    for ln in lines:
        if "train.py: error:" in ln:
            return ln.split("train.py: error:", 1)[1].strip()[:300]
    for ln in lines:
        if _EXC.match(ln) and "ChildFailedError" not in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "no output"


def classify(result: JobResult, summary: dict | None, timeout: float) -> str:
    if result.returncode is None:
        return f"failed: timed out after {timeout:.0f} s"
    if "not implemented yet" in result.output:
        return "not implemented"
    if result.returncode != 0:
        return f"failed: {failure_line(result.output)}"
    if summary is None:
        return "failed: no training steps after warm-up in metrics.jsonl"
    return "ok"


Runner = Callable[[list[str], str, float], JobResult]


def run_layout(lay: Layout, setup: Setup, out: str, repeat: int, runner: Runner | None = None) -> dict:
    """One job: {status, summary, seconds, out_dir, command}. Never raises: a failure becomes the status."""
    runner = runner or run_job
    out_dir = os.path.join(out, "runs", lay.key + (f"-r{repeat}" if repeat else ""))
    os.makedirs(out_dir, exist_ok=True)
    cmd = command(lay, setup, out_dir)
    try:
        result = runner(cmd, os.path.join(out_dir, "bench.log"), setup.timeout)
        summary = summarize(read_metrics(out_dir), setup.warmup) if result.returncode == 0 else None
        status = classify(result, summary, setup.timeout)
    except Exception as e:  # noqa: BLE001 -- the bench goes on whatever one job does
        result, summary, status = JobResult(None, "", 0.0), None, f"failed: {type(e).__name__}: {e}"[:300]
    return {"status": status, "summary": summary, "seconds": round(result.seconds, 1), "out_dir": out_dir,
            "command": shlex.join(cmd)}


def run_matrix(layouts: list[Layout], setup: Setup, out: str, repeats: int = 1, runner: Runner | None = None,
               log: Callable[[str], None] = print) -> list[dict]:
    """Run every layout `repeats` times (pairs back to back, order alternating) and return the rows."""
    groups: dict[str, list[Layout]] = {}
    for lay in layouts:
        groups.setdefault(lay.name, []).append(lay)
    runs: dict[Layout, list[dict]] = {lay: [] for lay in layouts}
    for r in range(repeats):
        for members in groups.values():
            for lay in (members if r % 2 == 0 else members[::-1]):
                res = run_layout(lay, setup, out, r, runner)
                runs[lay].append(res)
                tps = res["summary"]["tokens_per_sec"] if res["summary"] else None
                log(f"[bench] {lay.key:<16} repeat {r}: {res['status']}"
                    + (f", {tps:,.0f} tok/s" if tps else "") + f" ({res['seconds']:.0f} s)")
    return [make_row(lay, runs[lay], setup) for lay in layouts]


def make_row(lay: Layout, runs: list[dict], setup: Setup) -> dict:
    """One bench.json row from a layout's runs: medians over the ok repeats; status the first non-ok one."""
    ok = [r["summary"] for r in runs if r["status"] == "ok"]
    bad = [r["status"] for r in runs if r["status"] != "ok"]
    theory, source = comm_theory(lay, setup)

    def pick(key: str, f: Callable = statistics.median):
        values = [s[key] for s in ok if s[key] is not None]
        return f(values) if values else None

    comm = pick("comm_bytes")
    by_kind = None
    if comm is not None:
        kinds = sorted({k for s in ok if s["comm_bytes_by_kind"] for k in s["comm_bytes_by_kind"]})
        by_kind = {k: int(statistics.median(s["comm_bytes_by_kind"].get(k, 0) for s in ok
                                            if s["comm_bytes_by_kind"])) for k in kinds}
        comm = int(comm)
    if lay.nproc == 1 and ok:
        comm, by_kind = 0, {k: 0 for k in KINDS}  # one process: nothing to communicate
    theory_total = sum(theory.values())
    return {
        "layout": lay.name, "implementation": lay.implementation, "nproc": lay.nproc, "dp": lay.dp, "tp": lay.tp,
        "status": bad[0] if bad else "ok",
        "tokens_per_sec": pick("tokens_per_sec"), "mfu": pick("mfu"), "step_time_ms": pick("step_time_ms"),
        "peak_memory_bytes": pick("peak_memory_bytes", max), "state_bytes": pick("state_bytes", max),
        "comm_bytes": comm, "comm_bytes_by_kind": by_kind,
        "comm_theory_bytes": theory_total, "comm_theory_by_kind": theory,
        "comm_ratio": comm / theory_total if comm is not None and theory_total else None,
        "tp_theory_source": source or None,
        "tokens_per_sec_runs": [r["summary"]["tokens_per_sec"] if r["summary"] else None for r in runs],
        "measured_steps": sum(s["measured_steps"] for s in ok),
        "micro_batch_size": setup.micro_batch(lay.dp), "grad_accum": setup.grad_accum(lay.dp),
        "model": setup.model, "seq_len": setup.seq_len, "global_batch_tokens": setup.global_batch_tokens,
        "device": setup.device, "peak_flops": setup.peak_flops,
        "out_dirs": [r["out_dir"] for r in runs], "seconds": sum(r["seconds"] for r in runs),
    }


# ----------------------------------------------------------------------------- the machine

PROBE = r"""
import json, os, sys, torch
sys.path.insert(0, os.getcwd())
import metrics
measure = sys.argv[1] == "1"
if torch.cuda.is_available():
    dev = torch.device("cuda", 0)
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    out = {"device": "cuda", "count": torch.cuda.device_count(), "name": torch.cuda.get_device_name(dev),
           "dtype_bytes": 2, "peak_flops": metrics.peak_flops(dev, dtype) if measure else None}
else:
    torch.set_num_threads(1)  # as torchrun's ranks (OMP_NUM_THREADS=1)
    name = ""
    try:
        name = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except Exception:
        pass
    out = {"device": "cpu", "count": os.cpu_count(), "name": name or "CPU", "dtype_bytes": 4,
           "peak_flops": metrics.measure_matmul_flops(torch.device("cpu"), torch.float32, n=1024, seconds=2.0)
           if measure else None}
print("PROBE " + json.dumps(out))
"""


def probe_machine(measure: bool) -> dict:
    """Device kind, count, name and (if measure) peak FLOP/s per device, from a fresh one-thread process
    (so this process never holds a CUDA context while the jobs run)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", PROBE, "1" if measure else "0"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")), None)
    if line is None:
        raise RuntimeError(f"machine probe failed: {proc.stderr.strip()[-500:]}")
    return json.loads(line[len("PROBE "):])


def ensure_dataset(requested: str, out: str, vocab_size: int) -> str:
    """`requested` if given, else Shakespeare when prepared, else uniform random tokens written to
    <out>/data (throughput does not depend on what the tokens are)."""
    if requested:
        return requested
    shakespeare = os.path.join(ROOT, "data", "shakespeare")
    if all(os.path.exists(os.path.join(shakespeare, f"{s}.bin")) for s in ("train", "val")):
        return "shakespeare"
    import numpy as np
    d = os.path.join(out, "data")
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", 2_000_000), ("val", 200_000)):
        path = os.path.join(d, f"{split}.bin")
        if not os.path.exists(path):
            rng.integers(0, min(vocab_size, 50257), n, dtype=np.uint16).tofile(path + ".tmp")
            os.replace(path + ".tmp", path)
    return d


# ----------------------------------------------------------------------------- reporting

def _mib(x) -> str:
    return "—" if x is None else f"{x / MiB:,.1f}"


def _num(x, fmt: str = "{:,.0f}") -> str:
    return "—" if x is None else fmt.format(x)


def _impl(row: dict) -> str:
    return "—" if row["implementation"] == "none" else row["implementation"]


def _ranks(row: dict) -> str:
    return f"{row['nproc']} ({row['dp']}×{row['tp']})"


def _kinds(d: dict | None) -> str:
    if not d:
        return "—"
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "broadcast": "BC"}
    parts = [f"{short.get(k, k)} {v / MiB:,.2f}" for k, v in d.items() if v]
    return " / ".join(parts) or "0"


def results_table(rows: list[dict]) -> str:
    head = ("| layout | impl | ranks (dp×tp) | tokens/s | MFU | peak mem/rank (MiB) | state/rank (MiB) "
            "| comm/step measured (MiB) | by kind (MiB) | theory (MiB) | theory by kind (MiB) | measured/theory "
            "| status |\n|---|---|---|---:|---:|---:|---:|---:|---|---:|---|---:|---|")
    lines = [head]
    for r in rows:
        lines.append(" | ".join([
            f"| {r['layout']}", _impl(r), _ranks(r), _num(r["tokens_per_sec"]),
            _num(None if r["mfu"] is None else 100 * r["mfu"], "{:.1f}%"), _mib(r["peak_memory_bytes"]),
            _mib(r["state_bytes"]), _mib(r["comm_bytes"]), _kinds(r["comm_bytes_by_kind"]),
            _mib(r["comm_theory_bytes"]), _kinds(r["comm_theory_by_kind"]),
            _num(r["comm_ratio"], "{:.3f}"), r["status"] + " |"]))
    return "\n".join(lines)


def pair_ratios(rows: list[dict]) -> list[dict]:
    """custom tokens/s ÷ pytorch tokens/s for each layout that has both."""
    by = {(r["layout"], r["implementation"]): r for r in rows}
    out = []
    for layout in dict.fromkeys(r["layout"] for r in rows):
        c, p = by.get((layout, "custom")), by.get((layout, "pytorch"))
        if c is None or p is None:
            continue
        ratio = c["tokens_per_sec"] / p["tokens_per_sec"] if c["tokens_per_sec"] and p["tokens_per_sec"] else None
        out.append({"layout": layout, "custom": c["tokens_per_sec"], "pytorch": p["tokens_per_sec"], "ratio": ratio})
    return out


def ratio_table(rows: list[dict]) -> str:
    lines = ["| layout | custom tokens/s | pytorch tokens/s | custom / pytorch |", "|---|---:|---:|---:|"]
    for p in pair_ratios(rows):
        lines.append(f"| {p['layout']} | {_num(p['custom'])} | {_num(p['pytorch'])} | {_num(p['ratio'], '{:.2f}')} |")
    return "\n".join(lines)


def flops(x: float) -> str:
    return f"{x / 1e12:.4g} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.4g} GFLOP/s"


def setup_line(rows: list[dict], meta: dict | None) -> str:
    r = rows[0]
    meta = meta or {}
    params = f" ({meta['params'] / 1e6:.1f}M params)" if meta.get("params") else ""
    return (f"`{r['model']}`{params}, global batch {r['global_batch_tokens']:,} tokens (seq_len {r['seq_len']}), "
            f"{meta.get('steps', '?')} measured steps after {meta.get('warmup', '?')} warm-up, on "
            f"{meta.get('machine', r['device'])}; peak {flops(r['peak_flops'])} per device")


def render_markdown(rows: list[dict], meta: dict) -> str:
    notes = [
        "- tokens/s: median over the measured steps (median of repeats); MFU against the peak above.",
        "- peak mem: rank 0's peak (CUDA allocator peak on GPU, process peak RSS on CPU); state: rank 0's "
        "parameters + gradients + optimizer state.",
        "- comm: payload bytes rank 0's wrappers sent per optimizer step (parallel/comm.py), median; PyTorch "
        "layouts bypass our counter (—). Theory: DDP Ψ per step; FSDP per micro-step all-gather 2Ψ_blocks + Ψ_root and reduce-scatter Ψ; TP per "
        + (" and ".join(sorted({r["tp_theory_source"] for r in rows if r["tp_theory_source"]}))
           or "the Megatron formula") + "; 2D: the DP term on this rank's TP shard of Ψ plus the TP term.",
    ]
    if meta.get("notes"):
        notes += [f"- {n}" for n in meta["notes"]]
    plots = "".join(f"![{p}]({p}.png)\n" for p in ("throughput", "memory", "comm_vs_world")
                    if p in meta.get("plots", []))
    return "\n".join([
        "# Parallel layouts benchmark", "",
        setup_line(rows, meta) + ".", "",
        f"Command: `{meta.get('command', '')}`", "",
        f"Machine: {meta.get('machine', '')}; torch {meta.get('torch', '')}; peak "
        f"{rows[0]['peak_flops']:.4g} FLOP/s per device ({meta.get('peak_source', '')}); "
        f"wall time {meta.get('wall_seconds', 0):.0f} s.", "",
        results_table(rows), "",
        "Custom / PyTorch throughput:", "", ratio_table(rows), "",
        *notes, "", plots,
    ])


def render_section(rows: list[dict], meta: dict | None = None) -> str:
    """The README "Results" snippet: setup, the table (tokens/s, MFU, memory, comm vs theory), the ratios."""
    lines = ["### Parallel layouts (`python bench.py`)", "", setup_line(rows, meta) + ".", "",
             "| layout | impl | ranks | tokens/s | MFU | peak mem/rank | state/rank | comm/step (theory) |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['layout']} | {_impl(r)} | {_ranks(r)} | {r['status']} | | | | |")
            continue
        comm = _mib(r["comm_bytes"])
        comm = f"{comm} MiB ({_mib(r['comm_theory_bytes'])})" if r["comm_bytes"] is not None \
            else f"— ({_mib(r['comm_theory_bytes'])} MiB)"
        lines.append(f"| {r['layout']} | {_impl(r)} | {_ranks(r)} | {_num(r['tokens_per_sec'])} | "
                     f"{100 * r['mfu']:.1f}% | {_mib(r['peak_memory_bytes'])} MiB | {_mib(r['state_bytes'])} MiB | "
                     f"{comm} |")
    pairs = [p for p in pair_ratios(rows) if p["ratio"] is not None]
    if pairs:
        lines += ["", "Custom / PyTorch tokens/s: " + ", ".join(f"{p['layout']} {p['ratio']:.2f}" for p in pairs) + "."]
    lines += ["", "Comm is the payload our wrappers sent per optimizer step on rank 0 (parallel/comm.py) against "
              "theory (DDP Ψ, FSDP 2Ψ_blocks + Ψ_root all-gather and Ψ reduce-scatter per micro-step, TP per the Megatron formula); PyTorch's collectives are not "
              "counted."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- plots

def comm_curves(setup: Setup, world: list[int]) -> dict[str, list[dict[str, int]]]:
    """Theory payload by kind per rank per optimizer step vs world size N, for DDP, FSDP and TP alone on
    the bench model and global batch (micro-batch rows/N capped as in the runs; N = 1 moves nothing)."""
    psi, root = param_bytes(setup.config), param_bytes(setup.config, root_only=True)
    B1, A1 = setup.micro_batch(1), setup.grad_accum(1)
    curves: dict[str, list[dict[str, int]]] = {"ddp": [], "fsdp": [], "tp": []}
    for n in world:
        accum = max(1, math.ceil(setup.rows / (n * setup.micro_cap)))
        tp, _ = tp_bytes_per_micro_step(setup.config, B1, setup.seq_len, n, True, setup.dtype_bytes,
                                        setup.residual_bytes)
        on = n > 1
        curves["ddp"].append({"all_reduce": psi * on})
        curves["fsdp"].append({"all_gather": (2 * psi - root) * accum * on, "reduce_scatter": psi * accum * on})
        curves["tp"].append({k: v * A1 for k, v in tp.items()})
    return curves


def ring_bytes(by_kind: dict[str, int], n: int) -> float:
    """Bytes a rank sends on a ring for these payloads: 2(N-1)/N per all-reduce, (N-1)/N per gather/scatter."""
    return sum(v * (2 if k == "all_reduce" else 1) * (n - 1) / n for k, v in by_kind.items())


def write_plots(rows: list[dict], setup: Setup, out: str) -> list[str]:
    """throughput.png, memory.png, comm_vs_world.png; [] if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    labels = [f"{r['layout']}\n{_impl(r)}\n{r['nproc']} rk" for r in rows]
    colors = ["tab:gray" if r["implementation"] == "none" else
              ("tab:blue" if r["implementation"] == "custom" else "tab:orange") for r in rows]
    x = list(range(len(rows)))

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    tps = [r["tokens_per_sec"] or 0 for r in rows]
    ax.bar(x, tps, color=colors)
    for i, r in enumerate(rows):
        text = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else r["status"].split(":")[0]
        ax.text(i, tps[i], text, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("tokens/s (median)")
    ax.set_title(f"Throughput per layout ({setup.model}, {setup.global_batch_tokens} tokens/step; MFU on bars)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "throughput.png"), dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.4 * len(rows)), 4))
    for ax, key, title in ((axes[0], "peak_memory_bytes", "peak memory, rank 0"),
                           (axes[1], "state_bytes", "params + grads + optimizer state, rank 0")):
        ax.bar(x, [(r[key] or 0) / MiB for r in rows], color=colors)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel("MiB")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "memory.png"), dpi=120)
    plt.close(fig)

    world = list(range(2, 17))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    style = {"ddp": "tab:blue", "fsdp": "tab:green", "tp": "tab:red", "2d-ddp": "tab:purple", "2d-fsdp": "tab:brown"}
    for name, ds in comm_curves(setup, world).items():
        ax.plot(world, [sum(d.values()) / MiB for d in ds], color=style[name], label=f"{name} theory (payload)")
        ax.plot(world, [ring_bytes(d, n) / MiB for d, n in zip(ds, world)], color=style[name], ls="--", lw=0.8,
                label=f"{name} theory (ring bytes sent)")
    for r in rows:
        if r["implementation"] == "custom" and r["layout"] in style:
            if r["layout"].startswith("2d"):
                ax.scatter([r["nproc"]], [r["comm_theory_bytes"] / MiB], facecolors="none",
                           edgecolors=style[r["layout"]], s=60, label=f"{r['layout']} theory")
            if r["comm_bytes"] is not None:
                ax.scatter([r["nproc"]], [r["comm_bytes"] / MiB], color=style[r["layout"]], marker="x", s=60,
                           zorder=5, label=f"{r['layout']} measured")
    ax.set_yscale("log")
    ax.set_xlabel("world size N (N = 1: no communication)")
    ax.set_ylabel("MiB per rank per optimizer step")
    ax.set_title(f"Communication vs world size ({setup.model}, {setup.global_batch_tokens} tokens/step)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "comm_vs_world.png"), dpi=120)
    plt.close(fig)
    return ["throughput", "memory", "comm_vs_world"]


def write_outputs(rows: list[dict], meta: dict, setup: Setup, out: str) -> None:
    meta["plots"] = write_plots(rows, setup, out)
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out, "bench_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(render_markdown(rows, meta))
    with open(os.path.join(out, "results_section.md"), "w") as f:
        f.write(render_section(rows, meta))


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--out", default="out/bench", help="directory for bench.json, bench.md, plots and runs/")
    a("--quick", action="store_true", help="tiny model, few steps: a few minutes on 2 CPU cores")
    a("--nproc", type=int, default=None, help="ranks (default: the GPUs present, or 2 on CPU)")
    a("--include_2d", action="store_true", help="CPU with < 4 ranks: also run the 2D layouts on 4 ranks")
    a("--peak_flops", type=float, default=None, help="per device (default: measured / datasheet once)")
    a("--layouts", default=None, help=f"comma list out of {','.join(LAYOUTS)}")
    a("--repeats", type=int, default=1)
    a("--steps", type=int, default=None, help="measured steps (quick 8; else 30 on GPU, 12 on CPU)")
    a("--warmup", type=int, default=None, help="steps before measuring (quick 2; else 5 on GPU, 3 on CPU)")
    a("--model", default=None, help="preset (quick: tiny; else small)")
    a("--seq_len", type=int, default=None, help="quick 64; else 1024 on GPU, 128 on CPU")
    a("--rows", type=int, default=None, help="sequences per global batch (default: 4 per rank, 8 on GPU)")
    a("--micro_batch_size", type=int, default=None, help="largest micro-batch per rank (default: none on CPU, 8 GPU)")
    a("--dataset", default=None, help="default: shakespeare if prepared, else random tokens in <out>/data")
    a("--timeout", type=float, default=None, help="seconds per job (quick 300, else 3600)")
    a("--section", metavar="DIR", default=None, help="print the README Results snippet from DIR/bench.json")
    args = p.parse_args(argv)
    if args.layouts:
        unknown = set(args.layouts.split(",")) - set(LAYOUTS)
        if unknown:
            p.error(f"unknown layouts {sorted(unknown)}; choose from {','.join(LAYOUTS)}")
    if args.repeats < 1 or (args.steps is not None and args.steps < 1) or (args.warmup is not None and args.warmup < 0):
        p.error("--repeats and --steps must be >= 1, --warmup >= 0")
    return args


def make_setup(args: argparse.Namespace, machine: dict, nproc: int, layouts: list[Layout], peak: float,
               dataset: str = "") -> Setup:
    gpu = machine["device"] == "cuda"
    model = args.model or ("tiny" if args.quick else "small")
    config = make_config(model)
    for tp in {lay.tp for lay in layouts}:
        config = fit_heads(config, tp)
    dp_all = [lay.dp for lay in layouts] or [1]
    lcm = math.lcm(*dp_all)
    rows = args.rows or (8 if gpu else 4) * max(nproc, lcm)
    seq = args.seq_len or (64 if args.quick else (1024 if gpu else 128))
    return Setup(model=model, config=config, seq_len=seq, rows=rows,
                 micro_cap=args.micro_batch_size or (8 if gpu else rows),
                 warmup=args.warmup if args.warmup is not None else (2 if args.quick else (5 if gpu else 3)),
                 steps=args.steps or (8 if args.quick else (30 if gpu else 12)), peak_flops=peak,
                 device=machine["device"], dataset=dataset,
                 timeout=args.timeout or (300 if args.quick else 3600),
                 dtype_bytes=machine.get("dtype_bytes", 4), residual_bytes=4)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.section:
        with open(os.path.join(args.section, "bench.json")) as f:
            rows = json.load(f)
        meta_path = os.path.join(args.section, "bench_meta.json")
        meta = json.load(open(meta_path)) if os.path.exists(meta_path) else None
        print(render_section(rows, meta), end="")
        return 0
    t0 = time.perf_counter()
    args.out = os.path.abspath(args.out)  # the jobs run in the repository root
    os.makedirs(args.out, exist_ok=True)
    machine = probe_machine(measure=args.peak_flops is None)
    gpu = machine["device"] == "cuda"
    nproc = args.nproc or (machine["count"] if gpu else 2)
    layouts = matrix(nproc, gpu, args.include_2d, args.layouts.split(",") if args.layouts else None)
    if not layouts:
        print("bench.py: no layout left to run", file=sys.stderr)
        return 2
    peak = args.peak_flops or machine["peak_flops"]
    setup = make_setup(args, machine, nproc, layouts, peak)
    setup = replace(setup, dataset=ensure_dataset(args.dataset, args.out, setup.config.vocab_size))
    notes = []
    if any(lay.dp_type == "fsdp" for lay in layouts):
        notes.append("FSDP theory per micro-step: all-gather 2Ψ_blocks + Ψ_root (the root unit, wte = lm_head, "
                     "wpe and ln_f, stays gathered from forward to backward, as in FSDP2), reduce-scatter Ψ; "
                     "measured bytes also carry each unit's padding to a multiple of N (< N elements)")
    base = make_config(setup.model)
    if setup.config.n_head != base.n_head:
        notes.append(f"n_head raised from the preset's {base.n_head} to {setup.config.n_head} so that TP divides it")
    if not gpu and any(lay.nproc > os.cpu_count() for lay in layouts):
        notes.append(f"{max(lay.nproc for lay in layouts)} ranks on {os.cpu_count()} CPU cores: oversubscribed")
    with torch.device("meta"):
        params = GPT(setup.config).num_params()
    machine_desc = (f"{nproc}× {machine['name']}" if gpu else f"{machine['name']}, {os.cpu_count()} cores, "
                    f"1 thread per rank") + f" ({platform.node()})"
    print(f"[bench] {machine_desc}; peak {peak:.4g} FLOP/s per device; {len(layouts)} layouts; "
          f"{setup.model} {params / 1e6:.1f}M params, {setup.rows} x {setup.seq_len} tokens/step, "
          f"{setup.warmup}+{setup.steps} steps", flush=True)
    rows = run_matrix(layouts, setup, args.out, args.repeats,
                      log=lambda s: print(s, flush=True))
    meta = {"command": shlex.join(["python", "bench.py", *(sys.argv[1:] if argv is None else argv)]),
            "machine": machine_desc, "torch": torch.__version__,
            "peak_source": "--peak_flops" if args.peak_flops else
            ("datasheet / measured (metrics.peak_flops)" if gpu else "measured 1024³ fp32 matmul, 1 thread"),
            "params": params, "config": asdict(setup.config), "steps": setup.steps, "warmup": setup.warmup,
            "repeats": args.repeats, "dataset": setup.dataset, "notes": notes,
            "wall_seconds": time.perf_counter() - t0}
    write_outputs(rows, meta, setup, args.out)
    print(f"[bench] wrote {args.out}/bench.json, bench.md, results_section.md "
          f"({meta['wall_seconds']:.0f} s)", flush=True)
    return 0 if any(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
