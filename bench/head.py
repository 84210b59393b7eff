"""The loss head's share of a training step, eager and under --compile (#55 item 3):

    python -m bench.head --out results/head                 # `small` (V = 50304), 4 x 128 tokens, one thread
    python -m bench.head --model gpt2 --rows 2 --out out/head

Each variant is its own process (one thread, as the bench's ranks): train.py's step on one process
(train.build, train.train_step), --compile or not, with the model's head_loss timed from inside:
- forward: the call of head_loss (lm_head and the loss, and the gradients the fused head makes in forward:
  model/loss.py's linear_cross_entropy, chunk by chunk);
- backward: from the loss's gradient arriving to the head's input's (the head's backward scales dx and dW).
The head's share is their sum over the step's time, medians over the measured steps. Under --compile the run
alternates, step by step, the fused head and the same head without `fused` (the eager kernels, as before #55),
so a before/after of the head shares one process, its compiled Blocks and its load. On the CPU both are the
process's CPU time (time.process_time: one thread, so the work done), not the wall clock, which on a shared
machine mostly measures the wait for a core (measured under load ~20 on 2 cores: the same head 0.9-3.0 s by the
wall clock, 0.24-0.49 s of CPU); on a GPU, device events (device.make_timer) and train_step's step time.
Under --compile the Blocks are compiled and the head's per-chunk softmax and gradient run as one kernel
(loss.compile_head); eager, torch's log_softmax, its backward and the casts. Timings move with the machine's
load: compare variants run back to back (--repeats alternates them), and a before/after on the same machine.

Outputs in --out: head.json (the command, the config, per variant its steps' step and head ms) and head.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

VARIANTS = {"eager": [], "compile": ["--compile"]}


def train_args(args: argparse.Namespace, variant: str, out_dir: str, dataset: str) -> list[str]:
    """train.py's flags for one variant: one process, `rows` x `seq_len` tokens a step in one micro-batch, fp32."""
    return [
        "--model",
        args.model,
        "--dataset",
        dataset,
        "--seq_len",
        str(args.seq_len),
        "--micro_batch_size",
        str(args.rows),
        "--total_batch_size",
        str(args.rows * args.seq_len),
        "--max_steps",
        str(args.warmup + args.steps),
        "--warmup_steps",
        "1",
        "--eval_interval",
        str(args.warmup + args.steps + 1),
        "--no_checkpoint",
        "--out_dir",
        out_dir,
        "--overwrite",
        "--device",
        args.device,
        *VARIANTS[variant],
    ]


class CpuTimer:
    """Marks by the process's CPU time (HostTimer's interface): the work one thread did, whatever else runs."""

    def mark(self) -> float:
        return time.process_time()

    def seconds(self, marks: list) -> list[float]:
        return list(marks)


class HeadClock:
    """Wraps `owner.head_loss`: marks (device.make_timer's) around its call and at its backward's two ends."""

    def __init__(self, owner, timer) -> None:
        self.inner, self.timer, self.marks = owner.head_loss, timer, []
        owner.head_loss = self

    def __call__(self, x, weight, targets, **kw):
        self.marks.append(self.timer.mark())
        loss = self.inner(x, weight, targets, **kw)
        self.marks.append(self.timer.mark())
        if loss.requires_grad:
            loss.register_hook(lambda g: self.marks.append(self.timer.mark()))  # the head's backward starts
            x.register_hook(lambda g: self.marks.append(self.timer.mark()))  # its input's gradient is made
        return loss

    def seconds(self) -> float:
        """The head's seconds since the last call (forward, then backward: pairs of marks); clears the marks."""
        t = self.timer.seconds(self.marks)
        self.marks = []
        return sum(b - a for a, b in zip(t[::2], t[1::2]))


def heads_of(owner) -> dict[str, object]:
    """The heads a run can step with: its own ("eager", or under --compile "fused": loss.compile_head's
    head_loss with fused=True) and, under --compile, the same head without fused ("eager": torch's kernels
    per chunk, the head before #55), so that one process alternates them step by step."""
    head = owner.head_loss
    if isinstance(head, functools.partial) and head.keywords.get("fused"):
        keywords = {k: v for k, v in head.keywords.items() if k != "fused"}
        return {"eager": functools.partial(head.func, *head.args, **keywords), "fused": head}
    return {"eager": head}


def worker(args: argparse.Namespace) -> None:
    """One variant in this process: warm-up and measured steps, the heads it has alternating step by step;
    writes {steps: [{head, step_ms, head_ms}]} to --json."""
    import torch

    import train
    from runtime import allocator
    from runtime.device import make_timer
    from trainer import config

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        argv = train_args(args, args.worker, os.path.join(tmp, "out"), args.dataset)
        spec = config.validate(config.parse_args(argv))
        cpu = spec.device.type == "cpu"
        if cpu:  # as train.py's main: glibc keeps what a step frees (else the head's chunks fault in afresh)
            allocator.keep_freed_memory()
        trainer = train.build(spec)
        heads = heads_of(trainer.parallelized.model)
        clock = HeadClock(trainer.parallelized.model, CpuTimer() if cpu else make_timer(spec.device))
        steps, names = [], sorted(heads)
        for s in range(1, args.warmup + len(names) * args.steps + 1):
            name = names[s % len(names)]  # every head warms up (compiles) before the measured steps
            clock.inner = heads[name]
            t0 = time.process_time()
            record = train.train_step(trainer, s)
            step = (time.process_time() - t0) * 1000 if cpu else record["step_time_ms"]
            head = clock.seconds() * 1000
            if s > args.warmup:
                steps.append({"head": name, "step_ms": step, "head_ms": head})
    with open(args.json, "w") as f:
        json.dump({"variant": args.worker, "steps": steps}, f)


def summary(steps: list[dict]) -> dict[str, dict]:
    """Per head: medians over its measured steps of the step ms, the head ms, and the head's share of each step."""
    out = {}
    for name in sorted({s["head"] for s in steps}):
        mine = [s for s in steps if s["head"] == name]
        med = lambda f: statistics.median(f(s) for s in mine)  # noqa: E731
        out[name] = {
            "step_ms": med(lambda s: s["step_ms"]),
            "head_ms": med(lambda s: s["head_ms"]),
            "head_share": med(lambda s: s["head_ms"] / s["step_ms"]),
            "steps": len(mine),
        }
    return out


def markdown(result: dict) -> str:
    lines = [
        f"Loss head's share of a one-process step: `{result['command']}`; {result['model']} "
        f"(V = {result['vocab_size']}), {result['rows']} x {result['seq_len']} tokens a step, one thread, "
        f"{result['steps']} measured steps per head after {result['warmup']}; torch {result['torch']}.",
        "",
        "| variant | head | repeat | step (ms) | head (ms) | head share | status |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for run in result["runs"]:
        for head, s in (run.get("summary") or {"": None}).items():
            cells = [f"{s['step_ms']:.1f}", f"{s['head_ms']:.1f}", f"{100 * s['head_share']:.1f}%"] if s else [""] * 3
            lines.append(f"| {run['variant']} | {head} | {run['repeat']} | {' | '.join(cells)} | {run['status']} |")
    lines += [
        "",
        "head: forward (lm_head, the loss and, made in forward, its gradients) plus backward (scaling them), timed "
        "inside the step (on the CPU: the process's CPU time, not the wall clock); share: of each step's time, "
        "median. eager head: torch's log_softmax, its backward and the casts per chunk of rows; fused: each "
        "chunk's softmax and gradient one compiled kernel (model/loss.compile_head). Under --compile (the Blocks "
        "compiled) the run alternates the two heads step by step, so both see the same load.",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.head", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--out", default="out/head")
    a("--model", default="small", help="preset (small: V = 50304, C = 384, 6 Blocks)")
    a("--seq_len", type=int, default=128)
    a("--rows", type=int, default=4, help="sequences a step, one micro-batch")
    a("--steps", type=int, default=6)
    a("--warmup", type=int, default=2, help="steps before measuring (compilation happens in the first)")
    a("--repeats", type=int, default=1, help="each variant this many times, alternating")
    a("--variants", default="eager,compile")
    a("--device", default="auto", help="train.py's --device (auto: runtime/device.py picks)")
    a("--dataset", default="", help="default: random tokens in <out>/data")
    a("--timeout", type=float, default=1800)
    a("--worker", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    a("--json", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import torch

    from bench.__main__ import ensure_dataset
    from bench.runner import run_job
    from model.gpt import make_config

    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    vocab = make_config(args.model).vocab_size
    args.dataset = ensure_dataset(args.dataset, args.out, vocab)
    runs = []
    for r in range(args.repeats):
        for variant in args.variants.split(",")[:: 1 if r % 2 == 0 else -1]:
            path = os.path.join(args.out, f"{variant}-{r}.json")
            flags = [a for a in sys.argv[1:] if a not in ("--worker", "--json")] if argv is None else list(argv)
            cmd = [sys.executable, "-m", "bench.head", *flags, "--dataset", args.dataset]
            job = run_job([*cmd, "--worker", variant, "--json", path], path[:-5] + ".log", args.timeout)
            run = {
                "variant": variant,
                "repeat": r,
                "status": "ok" if job.returncode == 0 else f"failed ({job.returncode})",
            }
            if job.returncode == 0:
                with open(path) as f:
                    run["steps"] = json.load(f)["steps"]
                run["summary"] = summary(run["steps"])
            runs.append(run)
            print(f"[bench.head] {variant} repeat {r}: {run['status']} {run.get('summary', '')}", flush=True)
    result = {
        "command": shlex.join(["python", "-m", "bench.head", *(sys.argv[1:] if argv is None else argv)]),
        "model": args.model,
        "vocab_size": vocab,
        "rows": args.rows,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "warmup": args.warmup,
        "torch": torch.__version__,
        "runs": runs,
    }
    with open(os.path.join(args.out, "head.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "head.md"), "w") as f:
        f.write(markdown(result))
    print(markdown(result), end="")
    return 0 if all(run["status"] == "ok" for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
