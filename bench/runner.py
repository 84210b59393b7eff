"""Running the matrix: one `torchrun` job per layout (`python train.py` for single), its metrics.jsonl
summarised into one bench.json row. Members of a custom/pytorch pair run back to back, and with repeats
the pair's order alternates, so slow drift on a shared machine hits both alike."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from bench.matrix import KINDS, MOE_LAYOUTS, Layout, Setup, comm_theory, ep_all_to_all_at_load, expert_param_count
from model.gpt import GPT
from runtime.launch import child_env
from runtime.metrics import active_params, read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: train.py's directory


@dataclass
class JobResult:
    returncode: int | None  # None: killed at the timeout
    output: str  # stdout + stderr
    seconds: float


def run_job(cmd: list[str], log_path: str, timeout: float) -> JobResult:
    """Run cmd in its own session (so a timeout can stop torchrun and all its ranks), output to log_path."""
    env = child_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={lay.nproc}",
        train,
        *setup.train_args(lay, out_dir),
    ]


def summarize(records: list[dict], warmup: int) -> dict | None:
    """Medians over the training steps after `warmup` (None if there are none).

    tokens_per_sec, mfu, step_time_ms, comm_bytes (total) and comm_bytes_by_kind: medians; peak_memory_bytes
    and state_bytes: the largest seen (the first is a running peak anyway)."""
    steps = [r for r in records if "loss" in r and r["step"] > warmup]
    if not steps:
        return None
    med = lambda key: statistics.median(r[key] for r in steps)  # noqa: E731
    out = {
        "tokens_per_sec": med("tokens_per_sec"),
        "mfu": med("mfu"),
        "step_time_ms": med("step_time_ms"),
        "peak_memory_bytes": max(r.get("peak_memory_bytes", 0) for r in steps) or None,
        "state_bytes": max(r.get("state_bytes", 0) for r in steps) or None,
        "state_bytes_by_kind": max(
            (r["state_bytes_by_kind"] for r in steps if "state_bytes_by_kind" in r),
            key=lambda d: sum(d.values()),
            default=None,
        ),
        "comm_bytes": None,
        "comm_bytes_by_kind": None,
        "measured_steps": len(steps),
    }
    if all("comm_bytes" in r for r in steps):
        kinds = sorted({k for r in steps for k in r["comm_bytes"]})
        out["comm_bytes_by_kind"] = {k: int(statistics.median(r["comm_bytes"].get(k, 0) for r in steps)) for k in kinds}
        out["comm_bytes"] = int(statistics.median(sum(r["comm_bytes"].values()) for r in steps))
    if all("muon_ns_ms" in r for r in steps):
        out["muon"] = muon_summary(steps)
    return out


def muon_summary(steps: list[dict]) -> dict:
    """A Muon run's measured steps (train.step_metrics' muon_* fields, rank 0's): medians of the Newton-Schulz
    time, of its share of each step's time, of the matrices orthogonalised; the exchange's bytes planned from the
    holds (`sent_bytes`, optim/distributed_muon.Exchange.sent_bytes) and what comm counted of all_to_all (None
    without counters: one process). Without MoE nothing else sends all_to_all, so the two must be equal."""
    med = lambda f: statistics.median(f(r) for r in steps)  # noqa: E731
    counted = all("comm_bytes" in r for r in steps)
    return {
        "ns_ms": med(lambda r: r["muon_ns_ms"]),
        "ns_share": med(lambda r: r["muon_ns_ms"] / r["step_time_ms"]),
        "orthogonalized": med(lambda r: r["muon_orthogonalized"]),
        "sent_bytes": int(med(lambda r: r["muon_sent_bytes"])),
        "all_to_all": int(med(lambda r: r["comm_bytes"].get("all_to_all", 0))) if counted else None,
    }


def moe_steps(records: list[dict], lay: Layout, setup: Setup) -> dict | None:
    """A run's MoE numbers per training step, warm-up included (the heatmap shows it): `steps`, each MoE layer's
    tokens per expert over the whole batch (`expert_tokens`) and their max over mean; under EP also rank 0's
    all_to_all bytes measured and `ep_all_to_all_at_load` (the formula at that step's load; None where it has
    none). None for a run without MoE layers."""
    steps = [r for r in records if "loss" in r and "expert_tokens" in r]
    if not steps:
        return None
    out = {
        "steps": [r["step"] for r in steps],
        "expert_tokens": [r["expert_tokens"] for r in steps],
        "max_over_mean": [r["expert_load_max_over_mean"] for r in steps],
    }
    if lay.ep > 1 and all("all_to_all" in r.get("comm_bytes", {}) for r in steps):
        out["all_to_all"] = [r["comm_bytes"]["all_to_all"] for r in steps]
        out["all_to_all_at_load"] = [ep_all_to_all_at_load(lay, setup, r["expert_tokens"]) for r in steps]
    return out


_EXC = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)(:|$)")


def failure_line(output: str) -> str:
    """The line that says why a job failed: train.py's one-line error, else the first exception raised,
    else the last line. When train.py's error only says a peer rank was lost, the exception that rank
    died of (if the log has it) says more."""
    lines = [re.sub(r"^\[(default|rank)\d*\]:\s*", "", ln).strip() for ln in output.splitlines()]
    lines = [ln for ln in lines if ln]
    error = next((ln.split("train.py: error:", 1)[1].strip() for ln in lines if "train.py: error:" in ln), None)
    exc = next((ln for ln in lines if _EXC.match(ln) and "ChildFailedError" not in ln), None)
    if error is not None and not (exc and "peer rank was lost" in error):
        return error[:300]
    if exc is not None:
        return exc[:300]
    return lines[-1][:300] if lines else "no output"


def classify(result: JobResult, summary: dict | None, timeout: float) -> str:
    if result.returncode is None:
        return f"failed: timed out after {timeout:.0f} s"
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
        wrote = os.path.exists(os.path.join(out_dir, "metrics.jsonl"))
        records = read_jsonl(out_dir) if result.returncode == 0 and wrote else []
        summary = summarize(records, setup.warmup) if records else None
        status = classify(result, summary, setup.timeout)
        if summary is not None and lay.name in MOE_LAYOUTS:
            summary["moe"] = moe_steps(records, lay, setup)
    except Exception as e:  # noqa: BLE001 -- the bench goes on whatever one job does
        result, summary, status = JobResult(None, "", 0.0), None, f"failed: {type(e).__name__}: {e}"[:300]
    return {
        "status": status,
        "summary": summary,
        "seconds": round(result.seconds, 1),
        "out_dir": out_dir,
        "command": shlex.join(cmd),
    }


def run_matrix(
    layouts: list[Layout],
    setup: Setup,
    out: str,
    repeats: int = 1,
    runner: Runner | None = None,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Run every layout `repeats` times (pairs, and the MoE layouts, back to back, order alternating) and return
    the rows."""
    groups: dict[str, list[Layout]] = {}
    for lay in layouts:
        groups.setdefault(lay.group, []).append(lay)
    runs: dict[Layout, list[dict]] = {lay: [] for lay in layouts}
    for r in range(repeats):
        for members in groups.values():
            for lay in members if r % 2 == 0 else members[::-1]:
                res = run_layout(lay, setup, out, r, runner)
                runs[lay].append(res)
                tps = res["summary"]["tokens_per_sec"] if res["summary"] else None
                log(
                    f"[bench] {lay.key:<16} repeat {r}: {res['status']}"
                    + (f", {tps:,.0f} tok/s" if tps else "")
                    + f" ({res['seconds']:.0f} s)"
                )
    return [make_row(lay, runs[lay], setup) for lay in layouts]


def make_row(lay: Layout, runs: list[dict], setup: Setup) -> dict:
    """One bench.json row from a layout's runs: medians over the ok repeats; status the first non-ok one."""
    ok = [r["summary"] for r in runs if r["status"] == "ok"]
    bad = [r["status"] for r in runs if r["status"] != "ok"]
    theory = comm_theory(lay, setup)
    muon = muon_row(ok)
    if muon is not None and muon["sent_bytes"]:  # Muon's exchange, beside the layout's own traffic
        theory = {**theory, "all_to_all": theory.get("all_to_all", 0) + muon["sent_bytes"]}

    def pick(key: str, f: Callable = statistics.median):
        values = [s[key] for s in ok if s[key] is not None]
        return f(values) if values else None

    comm = pick("comm_bytes")
    by_kind = None
    if comm is not None:
        kinds = sorted({k for s in ok if s["comm_bytes_by_kind"] for k in s["comm_bytes_by_kind"]})
        by_kind = {
            k: int(statistics.median(s["comm_bytes_by_kind"].get(k, 0) for s in ok if s["comm_bytes_by_kind"]))
            for k in kinds
        }
        comm = int(comm)
    if lay.nproc == 1 and ok:
        comm, by_kind = 0, {k: 0 for k in KINDS}  # one process: nothing to communicate
    theory_total = sum(theory.values())
    return {
        "layout": lay.name,
        "implementation": lay.implementation,
        "nproc": lay.nproc,
        "dp": lay.dp,
        "tp": lay.tp,
        "pp": lay.pp,
        "status": bad[0] if bad else "ok",
        "tokens_per_sec": pick("tokens_per_sec"),
        "mfu": pick("mfu"),
        "step_time_ms": pick("step_time_ms"),
        "peak_memory_bytes": pick("peak_memory_bytes", max),
        "state_bytes": pick("state_bytes", max),
        "state_bytes_by_kind": max(
            (s["state_bytes_by_kind"] for s in ok if s.get("state_bytes_by_kind")),
            key=lambda d: sum(d.values()),
            default=None,
        ),
        "replicate": lay.replicate,
        "dp_type": lay.dp_type,
        "comm_bytes": comm,
        "comm_bytes_by_kind": by_kind,
        "comm_theory_bytes": theory_total,
        "comm_theory_by_kind": theory,
        "comm_ratio": comm / theory_total if comm is not None and theory_total else None,
        "tokens_per_sec_runs": [r["summary"]["tokens_per_sec"] if r["summary"] else None for r in runs],
        "measured_steps": sum(s["measured_steps"] for s in ok),
        "micro_batch_size": setup.micro_batch(lay.dp, lay.pp),
        "grad_accum": setup.grad_accum(lay.dp, lay.pp),
        "model": setup.model,
        "seq_len": setup.seq_len,
        "global_batch_tokens": setup.global_batch_tokens,
        "device": setup.device,
        "peak_flops": setup.peak_flops,
        "out_dirs": [r["out_dir"] for r in runs],
        "seconds": sum(r["seconds"] for r in runs),
        **({"moe": moe_row(lay, ok, setup)} if lay.name in MOE_LAYOUTS else {}),
        **({"muon": muon} if muon is not None else {}),
    }


def muon_row(ok: list[dict]) -> dict | None:
    """A Muon layout's row's "muon": each of muon_summary's numbers, the median over the ok repeats; None
    without Muon."""
    runs = [s["muon"] for s in ok if s.get("muon")]
    if not runs:
        return None
    pick = lambda k: statistics.median(m[k] for m in runs) if all(m[k] is not None for m in runs) else None  # noqa
    out = {k: pick(k) for k in runs[0]}
    return {
        **out,
        "sent_bytes": int(out["sent_bytes"]),
        "all_to_all": None if out["all_to_all"] is None else int(out["all_to_all"]),
    }


def moe_row(lay: Layout, ok: list[dict], setup: Setup) -> dict:
    """An MoE layout's row's "moe": the model (E, K, expert hidden width, parameters in all and active per token,
    the number MFU counts: metrics.active_params), and from its ok runs: each MoE layer's max/mean load, the
    median over measured steps; rank 0's all_to_all per step measured and at the measured load (medians over the
    measured steps of every ok run, and how many of those steps the two agree exactly); `per_step`: the first
    ok run's numbers of every step, for the heatmap and the per-step table."""
    config = setup.moe_config(lay.experts)
    with torch.device("meta"):
        total = GPT(config).num_params()
    out = {
        "experts": lay.experts,
        "top_k": config.moe_top_k if lay.experts else None,
        "expert_hidden": config.expert_hidden if lay.experts else None,
        "ep": lay.ep,
        "params": total,
        "params_active": active_params(config),
        "expert_params": expert_param_count(config),
        "warmup": setup.warmup,
        "max_over_mean": None,
        "all_to_all": None,
        "all_to_all_at_load": None,
        "all_to_all_exact_steps": None,
        "per_step": None,
    }
    runs = [s["moe"] for s in ok if s.get("moe")]
    if not runs:
        return out
    out["per_step"] = runs[0]
    measured = [[i for i, step in enumerate(m["steps"]) if step > setup.warmup] for m in runs]
    layers = list(runs[0]["max_over_mean"][0])
    out["max_over_mean"] = {
        layer: statistics.median(m["max_over_mean"][i][layer] for m, idx in zip(runs, measured) for i in idx)
        for layer in layers
    }
    pairs = [
        (m["all_to_all"][i], m["all_to_all_at_load"][i])
        for m, idx in zip(runs, measured)
        if "all_to_all" in m
        for i in idx
    ]
    if pairs:
        out["all_to_all"] = int(statistics.median(a for a, _ in pairs))
        if all(b is not None for _, b in pairs):
            out["all_to_all_at_load"] = int(statistics.median(b for _, b in pairs))
            out["all_to_all_exact_steps"] = [sum(a == b for a, b in pairs), len(pairs)]
    return out


# ----------------------------------------------------------------------------- the machine

PROBE = r"""
import json, os, sys, torch
sys.path.insert(0, os.getcwd())
from runtime import metrics
from trainer.config import resolve_dtype
measure = sys.argv[1] == "1"
if torch.cuda.is_available():
    dev = torch.device("cuda", 0)
    dtype = resolve_dtype("auto", dev)  # the trainer's rule: bf16 where native (capability >= 8), else fp16
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
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, "1" if measure else "0"],
        cwd=ROOT,
        env=child_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")), None)
    if line is None:
        raise RuntimeError(f"machine probe failed: {proc.stderr.strip()[-500:]}")
    return json.loads(line[len("PROBE ") :])
