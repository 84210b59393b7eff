"""Muon's Newton-Schulz alone: a model's Muon matrices one at a time (torch.optim.Muon's way) against batched by
shape (optim/muon.zeropower_batched, what our Muon runs), on one device:

    python -m bench.ns --n_layer 4 --n_head 4 --n_embd 128      # the quick start's 24 matrices
    python -m bench.ns --model gpt2 --out out/ns                # GPT-2 124M's 72

The matrices are the Muon parameters of the model (optim/muon.is_muon; an expert's (E, in, out) weight is E
matrices) with random values, in fp32 as gradients are. Each way runs --repeats times, alternating; the table
gives the medians. On the CPU the time is the process's CPU time (one thread: the work done, not the wait for a
core on a shared machine: bench/head.CpuTimer), on a GPU device events; both ways give the same bits on the CPU
(tests/test_muon.py), which this checks again on the device it runs on ("bits equal").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def matrices(args: argparse.Namespace) -> list[tuple[int, int]]:
    """The (rows, cols) of each Muon matrix of the model, in parameter order."""
    import torch

    from model.gpt import GPT, make_config
    from optim.muon import is_muon

    shape = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd")}
    with torch.device("meta"):
        model = GPT(make_config(args.model, **shape))
    out = []
    for name, p in model.named_parameters():
        if is_muon(name):
            out += [tuple(p.shape[-2:])] * (p.shape[0] if p.dim() == 3 else 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ns", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    for dim in ("n_layer", "n_head", "n_embd"):
        p.add_argument(f"--{dim}", type=int, default=None)
    p.add_argument("--ns_steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None, help="directory for ns.json")
    args = p.parse_args(argv)
    import torch

    from bench.head import CpuTimer
    from optim.muon import zeropower_batched, zeropower_via_newtonschulz
    from runtime.device import make_timer, pick_device

    device = pick_device("auto")
    torch.set_num_threads(1)
    timer = CpuTimer() if device.type == "cpu" else make_timer(device)
    shapes = matrices(args)
    g = torch.Generator().manual_seed(0)
    gs = [torch.randn(s, generator=g).to(device) for s in shapes]
    ways = {
        "one at a time": lambda: [zeropower_via_newtonschulz(x, args.ns_steps) for x in gs],
        "batched": lambda: zeropower_batched(gs, args.ns_steps),
    }
    times, outs = {w: [] for w in ways}, {}
    for _ in range(args.repeats):
        for way, run in ways.items():
            marks = [timer.mark()]
            outs[way] = run()
            marks.append(timer.mark())
            a, b = timer.seconds(marks)
            times[way].append((b - a) * 1000)
    equal = all(torch.equal(a, b) for a, b in zip(outs["one at a time"], outs["batched"]))
    med = {w: statistics.median(t) for w, t in times.items()}
    kinds = sorted({(min(s), max(s)) for s in shapes})
    print(f"{len(shapes)} matrices in {len(kinds)} shapes {kinds}, {args.ns_steps} NS steps, on {device}")
    for way, ms in med.items():
        print(f"  {way:14s} {ms:8.1f} ms (median of {args.repeats}: {[round(t, 1) for t in times[way]]})")
    print(f"  batched / one at a time: {med['batched'] / med['one at a time']:.2f}; bits equal: {equal}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ns.json"), "w") as f:
            json.dump({"shapes": shapes, "device": str(device), "ms": times, "median_ms": med, "equal": equal}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
