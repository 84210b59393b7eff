"""The layout sweep: every layout up to 4 ranks, a seeded sample at 6 and 8, and the GPU's bf16 defaults, each
trained a few steps and held against one process.

    python -m bench.sweep                    # every layout up to 4 ranks + the bf16 rows: the table
    python -m bench.sweep --sample 12        # + 12 layouts at 6 and 8 ranks (seeded, see `sample`), and the
                                             #   concepts' 8-rank rows (Sweep.large)
    python -m bench.sweep --only 'pp=3*'     # the layouts whose name matches

Each layout is `train.py` on the `tiny` GPT with 4 Blocks, or 12 where its P·V chunks need more (pp=4 with V=3
gives every chunk a Block; `Layout.n_layer`), against the one-process run of as many Blocks, a
512-token vocabulary (the stand-in corpus of tests/harness.make_token_bins), 12 rows of 32 tokens per step (16
where a layout names `rows=16`, against one process of 16)
(`Layout.micro_batches`: one micro-batch per dp rank without a pipeline, >= 2P with one), 3 steps, started
by bench.forkserver (forked ranks: no interpreter start per rank). Every step's loss and grad norm and the val losses
at steps 0 and 3 must be within the
layout's tolerance (`tolerance`) of the one-process run in the same dtype; a layout validation refuses must
exit 2 on every rank with one line `train.py: error: ...` and write nothing. Anything else (a crash, a hang
past the timeout, a traceback) is a failure.

Layouts are named `pp=2(1f1b) dp=2(fsdp) cp=2 tp=2`: the dims that are > 1, with the pp schedule (V) and the
dp type. tp layouts run sequence parallelism and loss parallelism (the most of TP), except the row `tp=2(plain)`.
"""

from __future__ import annotations

import argparse
import fnmatch
import itertools
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

from bench.forkserver import ForkServer
from trainer.concepts import concepts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS, T, STEPS, VOCAB = 12, 32, 3, 512
N_LAYERS = (4, 12)  # a layout's Blocks: the fewest of these giving each of its P·V chunks one (Layout.n_layer)
BASE = [
    "--model",
    "tiny",
    "--vocab_size",
    str(VOCAB),
    "--seq_len",
    str(T),
    "--total_batch_size",
    str(ROWS * T),
    "--max_steps",
    str(STEPS),
    "--eval_interval",
    "1000",
    "--warmup_steps",
    "1",
    "--lr",
    "3e-3",
    "--gradient_clipping",
    "--no_checkpoint",
    "--device",
    "cpu",
    "--peak_flops",
    "1e12",
    "--timeout",
    "120",
]
DP_TYPES = ("ddp", "zero1", "zero2", "fsdp")
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3))

# Tolerances (relative, on every loss, grad norm and val loss). fp32, from the statement and the suite's
# measurements: 1e-5 without TP (a layout only reorders fp32 sums: measured <= 5.2e-7 here), 1e-4 with TP (it
# also splits the matmul reductions; measured <= 1.7e-7). bf16: BF16_RTOL on what BF16_RULE says.
FP32_RTOL, FP32_TP_RTOL = 1e-5, 1e-4
BF16_RTOL = 2.0**-8  # u, bf16's relative spacing (8 significant bits)
BF16_RULE = (
    "bf16 rows: every loss and val loss, and step 1's grad norm, within u = 2^-8 of one process in bf16. "
    "Both runs compute the same math from the same fp32 weights with bf16 roundings in other places (other "
    "sum splits; bf16 compute copies and residual stream under FSDP/ZeRO where autocast keeps fp32), each "
    "within u/2 of the exact value to first order; a mean (the loss, fp32 cross-entropy over bf16 logits) or "
    "a norm of such values is too, so two runs differ by <= u. Grad norms after step 1 are not compared: "
    "AdamW's update m/sqrt(v) turns a rounding-sized change of a near-zero gradient into a full lr-sized "
    "step, so weights, and norms, part by more than rounding (measured: 1.6e-2 at step 3 under FSDP's bf16 "
    "compute copies, 4u), while the loss stays within 1e-4"
)


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    cp: int = 1
    dp_type: str | None = None
    replicate: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    sp: bool = True  # tp > 1: sequence parallelism + loss parallelism
    dtype: str = "float32"
    deferred: bool = False  # --deferred_init
    impl: str = "custom"  # --implementation
    blocks: int = 0  # --n_layer; 0: the fewest of N_LAYERS with a Block per chunk (a reference names it)
    rows: int = 0  # rows per step; 0: ROWS (more where a schedule needs more micro-batches per dp rank)
    experts: int = 0  # --moe_num_experts (top-2, the balancing loss and the bias rule on; MOE)
    ep: int = 1  # --expert_parallel_size
    moe_every: int = 1  # --moe_every: an MoE layer in every N-th Block (a stage may then hold none)
    stages: str = ""  # --pp_layers_per_stage; "": the cost model's split
    micro: int = 0  # --micro_batch_size; 0: the rank's rows over `micro_batches` (a reference's, SweepOption.per_micro)
    extra: tuple[str, ...] = ()  # a concept's own flags for this row (Sweep.rows), named in the row's name
    options: tuple[
        tuple[str, str], ...
    ] = ()  # (flag, value) the whole sweep runs with (SweepOption), the reference too

    @property
    def n_layer(self) -> int:
        return self.blocks or next(n for n in N_LAYERS if n >= self.pp * self.virtual)

    @property
    def n_rows(self) -> int:
        return self.rows or ROWS

    @property
    def nproc(self) -> int:
        return self.pp * self.dp * self.tp * self.cp

    @property
    def name(self) -> str:
        parts = []
        if self.pp > 1:
            parts.append(f"pp={self.pp}({self.schedule}{f',V={self.virtual}' if self.virtual > 1 else ''})")
        if self.dp > 1 or self.dp_type:
            hsdp = f",R={self.replicate}" if self.replicate > 1 else ""
            parts.append(f"dp={self.dp}({self.dp_type}{hsdp})")
        if self.cp > 1:
            parts.append(f"cp={self.cp}")
        if self.tp > 1:
            parts.append(f"tp={self.tp}" + ("" if self.sp else "(plain)"))
        return (
            " ".join(parts or ["single"])
            + ("" if self.dtype == "float32" else f" {self.dtype}")
            + (" deferred" if self.deferred else "")
            + ("" if self.impl == "custom" else f" [{self.impl}]")
            + (f" L={self.blocks}" if self.blocks else "")
            + (f" rows={self.rows}" if self.rows else "")
            + (f" moe={self.experts}" + (f" ep={self.ep}" if self.ep > 1 else "") if self.experts else "")
            + (f" every={self.moe_every}" if self.moe_every > 1 else "")
            + (f" split={self.stages}" if self.stages else "")
            + (f" mb={self.micro}" if self.micro else "")
            + "".join(f" {name}" for name in _extra_names(self.extra))
            + "".join(f" {value}" for _, value in self.options)
        )

    @property
    def micro_batches(self) -> int:
        """M, the step's micro-batches per dp rank: 1 without a pipeline (fewest collectives per step), else
        the smallest multiple of P of at least 2P that divides the rank's rows (so interleaving's M % P == 0
        holds), or the largest multiple of P, or one row each when no multiple of P divides them."""
        rows = self.n_rows // self.dp if self.n_rows % self.dp == 0 else 1
        if self.pp == 1:
            return 1
        fits = [m for m in range(self.pp, rows + 1, self.pp) if rows % m == 0]
        return min([m for m in fits if m >= 2 * self.pp] or fits[-1:] or [rows])

    @property
    def micro_rows(self) -> int:
        """--micro_batch_size: `micro`, or the rank's rows over `micro_batches`."""
        return self.micro or max(1, self.n_rows // self.dp // self.micro_batches)

    def flags(self) -> list[str]:
        """train.py's flags for this layout (after BASE). The validation set is the same n_rows rows for the layout
        and its reference: --eval_iters x --micro_batch_size = n_rows."""
        mb = self.micro_rows
        f = [
            "--n_layer",
            str(self.n_layer),
            "--micro_batch_size",
            str(mb),
            "--eval_iters",
            str(max(1, self.n_rows // mb)),
            "--dtype",
            self.dtype,
            "--implementation",
            self.impl,
        ]
        if self.rows:
            f += ["--total_batch_size", str(self.rows * T)]
        if self.dtype != "float32":
            f += ["--param_dtype", self.dtype]
        if self.pp > 1:
            f += ["--pipeline_parallel_size", str(self.pp), "--pp_schedule", self.schedule]
            f += ["--pp_virtual_stages", str(self.virtual)] if self.virtual > 1 else []
            f += ["--pp_layers_per_stage", self.stages] if self.stages else []
        if self.dp > 1:
            f += ["--data_parallel_size", str(self.dp)]
        if self.dp_type:
            f += ["--data_parallel_type", self.dp_type]
        if self.replicate > 1:
            f += ["--data_parallel_replicate_size", str(self.replicate)]
        if self.cp > 1:
            f += ["--context_parallel_size", str(self.cp)]
        if self.deferred:
            f += ["--deferred_init"]
        if self.tp > 1:
            f += ["--tensor_parallel_size", str(self.tp)] + (
                ["--sequence_parallel", "--enable_loss_parallelism"] if self.sp else []
            )
        if self.experts:
            f += [
                "--moe_num_experts",
                str(self.experts),
                *MOE,
                "--expert_parallel_size",
                str(self.ep),
                "--moe_every",
                str(self.moe_every),
            ]
        f += list(self.extra)
        for flag, value in self.options:
            f += [flag, value]
        return f

    @property
    def is_reference(self) -> bool:
        return replace(self, blocks=self.n_layer) == self.reference()

    def reference(self) -> "Layout":
        """The one-process run it is held against: the same dtype and Blocks, and under an option whose math is a
        function of the micro-batch (SweepOption.per_micro: a scale over its tokens) the same micro-batch size."""
        ref = Layout(
            dtype=self.dtype,
            blocks=self.n_layer,
            rows=self.rows,
            experts=self.experts,
            moe_every=self.moe_every,
            options=self.options,
        )
        per_micro = {o.flag for o in sweep_options() if o.per_micro}
        if any(flag in per_micro for flag, _ in self.options) and self.micro_rows != ref.micro_rows:
            ref = replace(ref, micro=self.micro_rows)
        return ref


def _extra_names(extra: tuple[str, ...]) -> list[str]:
    """A row's own flags as its name shows them: `--flag value` as flag=value, a switch as its name."""
    out, tokens = [], list(extra)
    while tokens:
        flag = tokens.pop(0).removeprefix("--")
        out.append(f"{flag}={tokens.pop(0)}" if tokens and not tokens[0].startswith("--") else flag)
    return out


def concept_rows(which: str = "rows") -> list[Layout]:
    """Every registered concept's rows (runtime/registry.Sweep: `rows` in every sweep, `large` with the 6- and
    8-rank sample), in registration order (trainer/concepts.py)."""
    out = []
    for c in concepts():
        rows = getattr(c.sweep, which, None) if c.sweep is not None else None
        out += [Layout(**kw) for kw in rows()] if rows is not None else []
    return out


def sweep_options() -> list:
    """The registered concepts' sweep-wide options (runtime/registry.SweepOption), in order."""
    return [c.sweep.option for c in concepts() if c.sweep is not None and c.sweep.option is not None]


def layouts(max_world: int = 4) -> list[Layout]:
    """Every layout up to max_world ranks: pp in 1..4, dp in 1..4 with each dp type (HSDP R=2 where dp = 4),
    tp in {1, 2}, cp in {1, 2}, each pp schedule (interleaved with V = 2 and 3); the one process first. With
    cp > 1 and dp == 1 the dp types still apply (gradients reduce over dp x cp), and no type is tried too."""
    out = [Layout()]
    for pp, dp, tp, cp in itertools.product((1, 2, 3, 4), (1, 2, 3, 4), (1, 2), (1, 2)):
        if pp * dp * tp * cp > max_world or pp * dp * tp * cp == 1:
            continue
        schedules = SCHEDULES if pp > 1 else (("1f1b", 1),)
        if dp > 1:
            dp_types = [(t, 1) for t in DP_TYPES] + ([(t, 2) for t in DP_TYPES[1:]] if dp == 4 else [])
        elif cp > 1:
            dp_types = [(None, 1)] + [(t, 1) for t in DP_TYPES]
        else:
            dp_types = [(None, 1)]
        for (schedule, v), (dp_type, r) in itertools.product(schedules, dp_types):
            out.append(Layout(pp, dp, tp, cp, dp_type, r, schedule, v))
        if tp > 1 and pp == dp == cp == 1:
            out.append(Layout(tp=tp, sp=False))
    return out


def sample(n: int, seed: int = 0) -> list[Layout]:
    """n layouts at 6 and 8 ranks, drawn with `seed` from every valid-looking combination, always including
    pp=3 x dp=2, dp=3 (pp=2 x dp=3), and pp x cp x tp (pp=2 x cp=2 x tp=2)."""
    pool = []
    for world in (6, 8):
        for pp, dp, tp, cp in itertools.product((1, 2, 3, 4, 8), (1, 2, 3, 4, 6, 8), (1, 2), (1, 2)):
            if pp * dp * tp * cp != world:
                continue
            for (schedule, v), dp_type in itertools.product(
                SCHEDULES if pp > 1 else (("1f1b", 1),), DP_TYPES if dp > 1 or cp > 1 else (None,)
            ):
                x = Layout(pp, dp, tp, cp, dp_type, 1, schedule, v)
                if v * pp > max(N_LAYERS) or (schedule.startswith("interleaved") and x.micro_batches % pp):
                    continue  # refused by validation for certain: sampling them teaches nothing
                pool.append(x)
    must = [
        Layout(pp=3, dp=2, dp_type="zero1", schedule="interleaved_1f1b", virtual=2),
        Layout(pp=3, dp=2, dp_type="fsdp", schedule="gpipe"),
        Layout(pp=2, dp=3, dp_type="zero2"),
        Layout(pp=2, cp=2, tp=2, dp_type="ddp"),
    ]
    rng = random.Random(seed)
    rest = [x for x in pool if x not in must]
    return must + rng.sample(rest, max(0, n - len(must)))


MOE = ["--moe_top_k", "2", "--moe_aux_loss_coeff", "0.01", "--moe_bias_update_rate", "1e-3"]


def bf16_rows() -> list[Layout]:
    """The GPU's default precision (bf16 autocast and bf16 compute copies) on the layouts where it matters:
    PP x FSDP, PP x ZeRO-2, TP, DDP; PP x DDP (fp32 activations under autocast alone); and the
    torch.distributed.pipelining twin over FSDP2 (its stages' output_args follow the same dtypes)."""
    bf = "bfloat16"
    return [
        Layout(pp=2, dp=2, dp_type="fsdp", dtype=bf),
        Layout(pp=2, dp=2, dp_type="zero2", dtype=bf),
        Layout(tp=2, dtype=bf),
        Layout(dp=2, dp_type="ddp", dtype=bf),
        Layout(dp=2, dp_type="fsdp", dtype=bf),
        Layout(pp=2, dp=2, dp_type="ddp", dtype=bf),
        Layout(pp=2, schedule="interleaved_1f1b", virtual=2, dp=2, dp_type="fsdp", dtype=bf),
        Layout(pp=2, dp=2, dp_type="fsdp", dtype=bf, impl="pytorch"),
    ]


def tolerance(layout: Layout) -> float:
    """Relative tolerance against the one-process run in the layout's dtype (see BF16_RULE for bf16)."""
    if layout.dtype != "float32":
        return BF16_RTOL
    return FP32_TP_RTOL if layout.tp > 1 else FP32_RTOL


def compared(layout: Layout) -> dict[str, slice]:
    """Which logged numbers are held to the tolerance: everything in fp32; in bf16, and under a sweep option,
    step 1's grad norm only (BF16_RULE; SweepOption.rule)."""
    return {
        "loss": slice(None),
        "val_loss": slice(None),
        "grad_norm": slice(None) if layout.dtype == "float32" and not layout.options else slice(0, 1),
    }


def option_tolerance(layout: Layout, ref: dict) -> float:
    """`tolerance` plus each of the layout's sweep options' bound (SweepOption.rtol) for the reference run `ref`:
    given the layout's model and the lr of each step (BASE's schedule; 0 for the val loss after the last)."""
    from model.gpt import make_config
    from optim.schedule import lr_at

    cfg = make_config(
        "tiny", n_layer=layout.n_layer, vocab_size=VOCAB, moe_num_experts=layout.experts, moe_every=layout.moe_every
    )
    lr = float(BASE[BASE.index("--lr") + 1])
    lrs = [lr_at(s, lr, 1, STEPS) for s in range(1, len(ref["loss"]) + 1)] + [0.0]  # BASE's --warmup_steps 1
    out = tolerance(layout)
    by_flag = {o.flag: o for o in sweep_options()}
    for flag, _ in layout.options:
        if by_flag[flag].rtol is not None:
            out += by_flag[flag].rtol(cfg, lrs, ref)
    return out


# ----------------------------------------------------------------------------- running


@dataclass
class Row:
    layout: Layout
    status: str  # "ok" | "refused" | "FAIL"
    detail: str = ""  # refused: validation's line; FAIL: what went wrong
    worst: float | None = None  # largest relative difference from the reference over every compared number
    rtol: float | None = None
    seconds: float = 0.0
    values: dict = field(default_factory=dict)


def read_run(out_dir: str) -> dict[str, list[float]]:
    """{"loss": [...], "grad_norm": [...], "val_loss": [...]} of a finished run, by step."""
    from runtime.metrics import read_jsonl

    recs = read_jsonl(out_dir)
    steps = {r["step"]: r for r in recs if "loss" in r}
    evals = {r["step"]: r["val_loss"] for r in recs if "val_loss" in r}
    return {
        "loss": [steps[s]["loss"] for s in sorted(steps)],
        "grad_norm": [steps[s]["grad_norm"] for s in sorted(steps)],
        "val_loss": [evals[s] for s in sorted(evals)],
    }


def worst_difference(
    got: dict[str, list[float]], ref: dict[str, list[float]], which: dict[str, slice] | None = None
) -> float:
    """max |got - ref| / |ref| over the compared numbers (`which`: key -> steps; default every loss, grad norm
    and val loss); inf if the runs logged other steps."""
    worst = 0.0
    for key in ("loss", "grad_norm", "val_loss"):
        if len(got[key]) != len(ref[key]) or not got[key]:
            return math.inf
        part = (which or {}).get(key, slice(None))
        for a, b in zip(got[key][part], ref[key][part]):
            d = abs(a - b) / abs(b) if math.isfinite(a) else math.inf
            worst = max(worst, d)
    return worst


def run_layout(
    server: ForkServer, layout: Layout, data: str, out_root: str, timeout: float = 300
) -> tuple[object, str]:
    """Train `layout`; returns (RunResult, out_dir)."""
    out = os.path.join(out_root, layout.name.replace(" ", "_").replace("/", "_") + f"-{time.monotonic_ns()}")
    return server.run([*BASE, "--dataset", data, "--out_dir", out, *layout.flags()], layout.nproc, timeout=timeout), out


def judge(layout: Layout, result, out: str, ref: dict | None) -> Row:
    """The row for a finished `run_layout` against the reference values `ref`."""
    row = Row(layout, "FAIL", seconds=result.seconds)
    errors = [e.strip().splitlines() for e in result.stderr]
    if result.codes == [2] * layout.nproc:
        if (
            all(len(e) == 1 and e[0].startswith("train.py: error: ") for e in errors)
            and len({e[0] for e in errors}) == 1
        ):
            if os.path.exists(out):
                row.detail = f"refused, but wrote {out}"
            else:
                row.status, row.detail = "refused", errors[0][0].removeprefix("train.py: error: ")
        else:
            row.detail = "exit 2 without exactly one 'train.py: error:' line per rank: " + repr(errors)[:300]
        return row
    if result.codes != [0] * layout.nproc:
        tail = next((e for e in errors if e and e != [""]), ["?"])[-1]
        row.detail = f"exit codes {result.codes}: {tail[:300]}"
        return row
    row.values = read_run(out)
    row.rtol = option_tolerance(layout, ref) if layout.options and ref is not None else tolerance(layout)
    row.worst = worst_difference(row.values, ref, compared(layout)) if ref is not None else 0.0
    if row.worst <= row.rtol:
        row.status = "ok"
    else:
        row.detail = f"worst relative difference {row.worst:.2e} > {row.rtol:.1e}"
    return row


def sweep(todo: list[Layout], data: str, out_root: str, server: ForkServer, log=print) -> list[Row]:
    """Run the one-process reference of each dtype and Block count, then every other layout of `todo`; one Row
    each (references first)."""
    refs: dict[Layout, dict] = {}
    rows = []
    for ref in sorted({x.reference() for x in todo}, key=lambda r: (r.dtype != "float32", r.n_layer)):
        row = judge(ref, *run_layout(server, ref, data, out_root), None)
        if row.status != "ok":
            raise RuntimeError(f"the one-process reference {ref.name} failed: {row.detail}")
        refs[ref] = row.values
        rows.append(row)
        log(format_row(row))
    for layout in todo:
        if not layout.is_reference:
            rows.append(judge(layout, *run_layout(server, layout, data, out_root), refs[layout.reference()]))
            log(format_row(rows[-1]))
    return rows


def bitwise_against(rows: list[Row], path: str) -> tuple[list[str], list[str]]:
    """(names whose losses, grad norms and val losses equal those recorded in the sweep.json at `path`, exactly;
    names that differ, or that `path` lacks). Refused layouts must be refused there too."""
    with open(path) as f:
        before = {r["layout"]: r for r in json.load(f)}
    same, differ = [], []
    for r in rows:
        old = before.get(r.layout.name)
        ok = old is not None and old["status"] == r.status and old.get("values", {}) == r.values
        (same if ok else differ).append(r.layout.name)
    return same, differ


def format_row(row: Row) -> str:
    worst = "" if row.worst is None else f"{row.worst:.1e}"
    rtol = "" if row.rtol is None else f"{row.rtol:.0e}"
    cells = [row.layout.name, row.layout.nproc, row.status, worst, rtol, f"{row.seconds:.1f}", row.detail]
    return "| " + " | ".join(map(str, cells)) + " |"


HEADER = "| layout | ranks | result | worst rel. diff | tolerance | seconds | note |\n|---|---|---|---|---|---|---|"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--max_world", type=int, default=4, help="every layout up to this many ranks")
    p.add_argument("--sample", type=int, default=0, help="also this many seeded layouts at 6 and 8 ranks")
    p.add_argument("--seed", type=int, default=0, help="the sample's seed")
    p.add_argument("--no_bf16", action="store_true", help="skip the bf16 rows")
    p.add_argument("--only", default=None, help="glob over layout names")
    for o in sweep_options():  # a concept's (runtime/registry.SweepOption): every layout and reference with it
        p.add_argument(o.flag, default=o.default, choices=o.choices, help=o.help)
    p.add_argument("--out", default=None, help="also write sweep.json and sweep.md here")
    p.add_argument(
        "--against",
        default=None,
        help="a sweep.json: also require every layout's logged numbers to equal its bit for bit (a refactor's proof)",
    )
    args = p.parse_args(argv)
    todo = (
        layouts(args.max_world)
        + concept_rows("rows")
        + (sample(args.sample, args.seed) + concept_rows("large")) * (args.sample > 0)
        + ([] if args.no_bf16 else bf16_rows())
    )
    chosen = tuple((o.flag, v) for o in sweep_options() if (v := getattr(args, o.flag.removeprefix("--"))) != o.default)
    todo = [replace(x, options=chosen) for x in todo]
    if args.only:
        todo = [x for x in todo if fnmatch.fnmatch(x.name, args.only)]
    sys.path.insert(0, ROOT)
    from tests.harness import make_token_bins

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ForkServer() as server:
        data = make_token_bins(os.path.join(tmp, "data"), vocab=VOCAB)
        print(HEADER, flush=True)
        rows = sweep(todo, data, os.path.join(tmp, "runs"), server, log=lambda s: print(s, flush=True))
    fails = [r for r in rows if r.status == "FAIL"]
    by = {s: sum(r.status == s for r in rows) for s in ("ok", "refused", "FAIL")}
    print(
        f"\n{len(rows)} layouts: {by['ok']} ok, {by['refused']} refused, {by['FAIL']} failed in "
        f"{time.perf_counter() - t0:.0f} s. {BF16_RULE}."
    )
    differ = []
    if args.against:
        same, differ = bitwise_against(rows, args.against)
        print(f"against {args.against}: {len(same)} layouts bit-identical; differ or missing: {differ or 'none'}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sweep.json"), "w") as f:
            json.dump(
                [
                    {
                        "layout": r.layout.name,
                        "ranks": r.layout.nproc,
                        "flags": r.layout.flags(),
                        "status": r.status,
                        "detail": r.detail,
                        "worst": r.worst,
                        "rtol": r.rtol,
                        "seconds": round(r.seconds, 2),
                        "values": r.values,
                    }
                    for r in rows
                ],
                f,
                indent=1,
            )
        with open(os.path.join(args.out, "sweep.md"), "w") as f:
            f.write(HEADER + "\n" + "\n".join(format_row(r) for r in rows) + "\n")
    return 1 if fails or differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
