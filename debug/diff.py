"""python -m debug diff RUN_A RUN_B: the first module output or gradient where two `--trace_step` runs part.

Each run's rank files (debug/trace.py) are merged into one fingerprint per full tensor: the pieces' float64 sums
and abs sums added, their sampled elements and (tensors of at most trace.FULL_NUMEL elements) their values put
in place, every element covered exactly once. The two runs' fingerprints are then walked in execution order:
forward outputs by micro-batch, each micro-batch in the order one process runs its modules (found by running
the model's forward on meta), the head's loss last; then gradients in backward order (reverse module order).
The first record outside the tolerance is printed with the size of the difference, then the next few.

Tolerance (relative to the tensor's largest element, max |b|, but never to less than FLOOR = 2^-10 of the step's
largest gradient element, or output element for outputs; sums relative to the abs sum): the rule the
layout tests state (tests/test_train.py, docs/testing.md): 0 (bit-equal) for two runs of the same layout on CPU
(on CUDA 1e-5: atomics reorder sums);
1e-5 when either run is data-, pipeline- or context-parallel; 1e-4 when either is tensor-parallel; 2^-8 when
either computes in bf16/fp16 (bench/sweep.BF16_RULE). Sums also get float64 rounding slack (n * 2^-52 of the
abs sum), as the pieces are added in another order than one process adds the whole.

Exit codes: 0 agree, 1 part, 2 bad input (one line): a run without a trace, a trace missing ranks, traces of
different steps, models or batches.
"""

from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass

import torch

from debug import trace
from trainer.config import Parser, UsageError

EPS64 = 2.0**-52
SHOW = 5  # divergences printed after the first


class BadInput(Exception):
    """A run directory or trace that cannot be compared: one line, exit 2."""


@dataclass
class Fingerprint:
    shape: tuple[int, ...]
    n: int
    sum: float
    abs: float
    samples: dict[int, float]
    full: torch.Tensor | None  # float64, flat: every element, for small tensors


def load(run: str) -> tuple[dict, dict[tuple, Fingerprint]]:
    """(meta, {(kind, micro, name): Fingerprint}) of the trace in run directory `run`, merged over its ranks."""
    files = sorted(glob.glob(os.path.join(run, trace.SUBDIR, "rank_*.pt")))
    if not os.path.isdir(run):
        raise BadInput(f"{run}: no such run directory")
    if not files:
        raise BadInput(f"{run}: no trace (no {trace.SUBDIR}/rank_*.pt): run train.py with --trace_step S")
    parts = []
    for f in files:
        try:
            parts.append(torch.load(f, map_location="cpu", weights_only=True))
        except Exception as e:  # noqa: BLE001 -- a damaged or foreign file: say which
            raise BadInput(f"{f}: not a readable trace ({type(e).__name__})") from None
    meta = parts[0].get("meta", {}) if isinstance(parts[0], dict) else {}
    if meta.get("format") != trace.FORMAT or meta.get("version") != trace.VERSION:
        raise BadInput(f"{files[0]}: not a version-{trace.VERSION} {trace.FORMAT} file")
    ranks = sorted(p["meta"]["rank"] for p in parts)
    if ranks != list(range(meta["world_size"])) or any(p["meta"]["step"] != meta["step"] for p in parts):
        raise BadInput(
            f"{run}: the trace holds ranks {ranks} (steps {sorted({p['meta']['step'] for p in parts})}) "
            f"of a {meta['world_size']}-rank run: some ranks' files are missing or from another run"
        )
    pieces: dict[tuple, list[dict]] = {}
    for p in parts:
        for r in p["records"]:
            pieces.setdefault((r["kind"], r["micro"], r["name"]), []).append(r)
    return meta, {key: merge(run, key, group) for key, group in pieces.items()}


def merge(run: str, key: tuple, pieces: list[dict]) -> Fingerprint:
    """One full tensor's fingerprint from its ranks' pieces (`trace.piece`)."""
    shape = pieces[0]["shape"]
    numel = 1
    for d in shape:
        numel *= d
    adding = pieces[0]["combine"] == "sum"
    covered = sum(r["n"] for r in pieces)
    if covered != numel * (len(pieces) if adding else 1):
        raise BadInput(f"{run}: {describe(key)}: the ranks' pieces cover {covered} of {numel} elements")
    samples: dict[int, float] = {}
    for r in pieces:
        for at, v in zip(r["sample_at"].tolist(), r["sample"].tolist()):
            samples[at] = samples.get(at, 0.0) + v if adding else v
    full = None
    if all("values" in r for r in pieces):
        full = torch.zeros(numel, dtype=torch.float64)
        for r in pieces:
            where = torch.cat([torch.arange(s, s + n) for s, n in r["runs"].tolist()])
            full[where] += r["values"].to(torch.float64)
    return Fingerprint(tuple(shape), numel, sum(r["sum"] for r in pieces), sum(r["abs"] for r in pieces), samples, full)


# ----------------------------------------------------------------------------- order and tolerance


def module_order(model_config: dict) -> list[str]:
    """Module names in the order one process's forward finishes them (forward hooks on a meta GPT)."""
    from model.gpt import GPT, GPTConfig

    with torch.device("meta"):
        gpt = GPT(GPTConfig(**model_config))
    order: list[str] = []

    def finished(name: str) -> None:  # a module's j-th run in one forward is traced as name#j (trace.Tracer)
        j = sum(o.split("#")[0] == name for o in order)
        order.append(name if j == 0 else f"{name}#{j}")

    for name, m in gpt.named_modules():
        if name:
            m.register_forward_hook(lambda *_, name=name: finished(name))
    with torch.no_grad():
        gpt(torch.zeros(1, 1, dtype=torch.long, device="meta"))
    return order


def execution_order(keys, model_config: dict) -> list[tuple]:
    """Forward records by (micro-batch, module order, the loss last), then gradients in backward order."""
    modules = module_order(model_config)
    rank = {n: i for i, n in enumerate(modules)}
    params = {}  # parameter -> the module that owns it, in backward order (reverse module order)
    for i, m in enumerate(reversed(modules)):
        params.update({f"{m}.{p}": (i, j) for j, p in enumerate(["weight", "bias"])})
    last = len(modules)

    def at(key: tuple) -> tuple:
        kind, micro, name = key
        if kind == "grad":
            return 1, 0, *params.get(name, (last, 0)), name
        return 0, micro, rank.get(name, last) if kind == "forward" else last + 1, 0, name

    return sorted(keys, key=at)


def layout_rtol(meta: dict) -> float:
    lay = meta["layout"]
    # TP splits matmul reductions across ranks; EP sums an expert's weight gradient over other row groupings
    rtol = 1e-4 if max(lay["tp"], lay.get("ep", 1)) > 1 else 1e-5 if max(lay["dp"], lay["pp"], lay["cp"]) > 1 else 0.0
    return max(rtol, 2.0**-8) if meta["dtype"] in ("bfloat16", "float16") else rtol


def tolerance(a: dict, b: dict) -> float:
    """The relative tolerance two traces' layouts are held to (the module docstring's rule)."""
    if (a["layout"], a["dtype"]) != (b["layout"], b["dtype"]):
        return max(layout_rtol(a), layout_rtol(b))
    # one layout twice: bit-equal on CPU; CUDA's atomics (embedding backward) reorder sums as DP's reductions do
    return 0.0 if "cuda" not in (a.get("device"), b.get("device")) else max(layout_rtol(a), 1e-5)


def layout_name(meta: dict) -> str:
    lay = meta["layout"]
    dims = (
        " ".join(f"{k}={lay.get(k, 1)}" for k in ("pp", "dp", "cp", "tp", "ep") if lay.get(k, 1) > 1) or "one process"
    )
    extra = [lay["dp_type"]] if lay["dp_type"] else []
    extra += [f for f in ("sequence_parallel", "loss_parallel") if lay[f]]
    return f"{dims}{' (' + ', '.join(extra) + ')' if extra else ''}, {lay['implementation']}, {meta['dtype']}"


# ----------------------------------------------------------------------------- comparing

FLOOR = 2.0**-10  # of the step's largest element of the same kind: the least scale an element is held to


def largest(f: Fingerprint) -> float:
    """The largest magnitude the fingerprint knows of: of every element, or of the samples (at least the mean)."""
    if f.full is not None:
        return float(f.full.abs().max()) if f.n else 0.0
    return max([abs(v) for v in f.samples.values()] + [f.abs / max(f.n, 1)])


def compare(a: Fingerprint, b: Fingerprint, rtol: float, floor: float = 0.0) -> str | None:
    """None when a and b agree within rtol of b's scale: its largest element, or `floor` where that is larger
    (a tensor that is zero in exact arithmetic, such as c_k's bias gradient, is rounding noise of the terms that
    cancelled, which no tolerance relative to itself can hold); else the size of their difference, in one line."""
    if a.shape != b.shape:
        return f"shape {a.shape} vs {b.shape}"
    own = largest(b)
    scale = max(own, floor)
    if a.full is not None and b.full is not None and a.n:
        diff = (a.full - b.full).abs()
        worst = int(diff.argmax())
        if float(diff[worst]) > rtol * scale:
            index = [int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape)]
            return (
                f"max |a-b| {float(diff[worst]):.3g} at {index} ({float(diff[worst]) / max(own, 1e-300):.2g} of "
                f"max |b| {own:.3g}); {int((diff > rtol * scale).sum())} of {a.n} elements differ; "
                f"sum {a.sum:.6g} vs {b.sum:.6g}"
            )
    common = sorted(set(a.samples) & set(b.samples))
    bad = [i for i in common if abs(a.samples[i] - b.samples[i]) > rtol * scale]
    if bad:
        i = max(bad, key=lambda i: abs(a.samples[i] - b.samples[i]))
        return (
            f"sampled element {i}: {a.samples[i]:.6g} vs {b.samples[i]:.6g} ({len(bad)} of {len(common)} "
            f"samples differ); sum {a.sum:.6g} vs {b.sum:.6g}"
        )
    slack = 2 * a.n * EPS64 * max(a.abs, b.abs)  # float64 sums of the pieces, in another order
    for what, x, y in (("sum", a.sum, b.sum), ("abs sum", a.abs, b.abs)):
        if abs(x - y) > rtol * max(a.abs, b.abs, a.n * floor) + slack:
            return (
                f"{what} {x:.9g} vs {y:.9g} (|a-b| {abs(x - y):.3g}, {abs(x - y) / max(b.abs, 1e-300):.2g} of "
                f"the abs sum)"
            )
    return None


def describe(key: tuple) -> str:
    kind, micro, name = key
    if kind == "grad":
        return f"gradient  {name}"
    return f"forward   micro-batch {micro}  {name}" + ("  (its loss)" if kind == "loss" else "")


def check_comparable(a: dict, b: dict) -> None:
    if a["step"] != b["step"]:
        raise BadInput(f"traces of different steps: {a['step']} vs {b['step']}")
    if a["model"] != b["model"]:
        diff = ", ".join(
            f"{k} {a['model'].get(k)} vs {b['model'].get(k)}"
            for k in a["model"]
            if a["model"].get(k) != b["model"].get(k)
        )
        raise BadInput(f"traces of different models: {diff}")
    if a["batch"] != b["batch"]:
        diff = ", ".join(
            f"{k} {a['batch'][k]} vs {b['batch'][k]}" for k in a["batch"] if a["batch"][k] != b["batch"][k]
        )
        raise BadInput(f"traces of different batches ({diff}): their micro-batches do not line up")


def diff(run_a: str, run_b: str, out=None) -> int:
    """Print the comparison of two runs' traces (to `out`, default stdout); return 0 (agree) or 1 (part). BadInput
    for what can't be compared."""
    out = out or sys.stdout
    meta_a, fa = load(run_a)
    meta_b, fb = load(run_b)
    check_comparable(meta_a, meta_b)
    rtol = tolerance(meta_a, meta_b)
    print(
        f"A: {run_a} ({layout_name(meta_a)})\nB: {run_b} ({layout_name(meta_b)})\nstep {meta_a['step']}; "
        f"tolerance {'bit-equal' if rtol == 0 else f'{rtol:.3g} relative'}",
        file=out,
    )
    both = execution_order(set(fa) & set(fb), meta_a["model"])
    floor = {g: FLOOR * max([largest(fb[k]) for k in both if (k[0] == "grad") == g] + [0.0]) for g in (False, True)}
    parted = [(k, why) for k in both if (why := compare(fa[k], fb[k], rtol, floor[k[0] == "grad"])) is not None]
    if meta_a.get("device") != meta_b.get("device"):
        print(
            f"note: A ran on {meta_a.get('device')}, B on {meta_b.get('device')}: the tolerance is the layouts'; "
            f"kernels of two devices may differ by more",
            file=out,
        )
    only = [(run, sorted(set(x) - set(y), key=str)) for run, x, y in (("A", fa, fb), ("B", fb, fa))]
    for run, keys in only:
        if keys:
            print(f"note: {len(keys)} records only in {run} (not compared), e.g. {describe(keys[0])}", file=out)
    n_fwd = sum(k[0] != "grad" for k in both)
    if not parted:
        print(f"agree: {n_fwd} forward records and {len(both) - n_fwd} gradients within tolerance", file=out)
        return 0
    (key, why), rest = parted[0], parted[1:]
    print(f"first divergence: {describe(key)}\n    {why}", file=out)
    for key, why in rest[:SHOW]:
        print(f"then: {describe(key)}\n    {why}", file=out)
    print(
        f"{len(parted)} of {len(both)} records differ ({sum(k[0] != 'grad' for k, _ in parted)} forward, "
        f"{sum(k[0] == 'grad' for k, _ in parted)} gradients)",
        file=out,
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m debug diff", description=__doc__.split("\n")[0])
    p.add_argument("run_a")
    p.add_argument("run_b")
    try:
        args = p.parse_args(argv)
        return diff(args.run_a, args.run_b)
    except (BadInput, UsageError) as e:
        print(f"debug diff: error: {e}", file=sys.stderr)
        return 2
