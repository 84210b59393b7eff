"""HellaSwag, completion style (build-nanogpt's and llm.c's scoring), for a run's checkpoint or inside training.

    python -m evals.fetch_hellaswag                                    # -> data/hellaswag/hellaswag_val.jsonl
    python -m evals.hellaswag --out_dir runs/gpt2-124m [--step N] [--data FILE.jsonl]
    python -m evals.hellaswag --init_from gpt2                         # OpenAI's GPT-2: acc_norm 0.2955

An example (the original jsonl: ctx, endings, label) makes 4 rows, one per ending: the context's tokens followed by
those of " " + ending. An ending's score is the cross-entropy of its tokens given all before them: summed over them
(sum_loss) and their mean (avg_loss). acc counts the examples whose label has the least sum_loss; acc_norm those
whose label has the least avg_loss (ties: the first ending).

The rows go through the model's own loss: their targets are -1 (loss.IGNORE_INDEX) outside the ending, and
`per_row_losses` has the head return each row's summed loss (B,) instead of the micro-batch's mean. So every layout
scores through its `forward_only` (train.py --hellaswag): each data-parallel rank takes every dp-th row, micro-batches
of equal shape padded with empty rows (their targets all -1: they add 0); a pipeline's last stage holds the sums, a
context-parallel rank the sums over its share of each row; sums over pp and dp x cp give every row's sum on every rank.
One process runs the same code (this CLI). The scores include the model's padded vocab rows in the softmax, as
build-nanogpt's do (50304 for GPT-2: 47 rows a trained model never predicts).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from model.loss import IGNORE_INDEX

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = os.path.join(ROOT, "data", "hellaswag", "hellaswag_val.jsonl")
FETCH_HINT = "python -m evals.fetch_hellaswag"


class HellaSwagError(ValueError):
    """A HellaSwag file that is missing or malformed, or rows the model cannot take (one line)."""


class Encoding(Protocol):
    def encode_ordinary(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Rows:
    """4 rows an example, padded to one length L: inputs x (n, L), targets y (n, L) (-1 outside the ending and
    in the padding), the scored tokens of each row (n,), and each example's label (n / 4,)."""

    x: torch.Tensor
    y: torch.Tensor
    counts: torch.Tensor
    labels: torch.Tensor

    @property
    def length(self) -> int:
        return self.x.shape[1]


def load_examples(path: str) -> list[tuple[str, list[str], int]]:
    """(ctx, endings, label) of each line of a HellaSwag jsonl file; HellaSwagError naming the line otherwise."""
    if not os.path.isfile(path):
        raise HellaSwagError(f"no HellaSwag file {path}; fetch the validation set with: {FETCH_HINT}")
    examples = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                ex = json.loads(line)
            except json.JSONDecodeError as e:
                raise HellaSwagError(f"{path} line {i}: not JSON ({e.msg})") from None
            if not isinstance(ex, dict) or not isinstance(ex.get("ctx"), str):
                raise HellaSwagError(f"{path} line {i}: no 'ctx' string")
            endings, label = ex.get("endings"), ex.get("label")
            if not (isinstance(endings, list) and len(endings) == 4 and all(isinstance(e, str) for e in endings)):
                raise HellaSwagError(f"{path} line {i}: 'endings' is not a list of 4 strings")
            if isinstance(label, str) and label.isdigit():
                label = int(label)
            if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < 4:
                raise HellaSwagError(
                    f"{path} line {i}: 'label' {label!r} is not 0-3 (the test split has no labels: "
                    f"use the validation set)"
                )
            examples.append((ex["ctx"], endings, label))
    if not examples:
        raise HellaSwagError(f"{path} holds no examples")
    return examples


def render(examples: list[tuple[str, list[str], int]], enc: Encoding, multiple: int = 1) -> Rows:
    """Tokenise each example's 4 rows (ctx + " " + ending, as build-nanogpt) into padded `Rows`: row length L is
    the longest row's input (its tokens less the last), rounded up to `multiple` (what the layout's sequence split
    needs)."""
    xs, ys = [], []
    for ctx, endings, _ in examples:
        c = enc.encode_ordinary(ctx)
        for ending in endings:
            row = c + enc.encode_ordinary(" " + ending)
            xs.append(row[:-1])  # the target at j is row[j + 1]: the ending's tokens are targets from len(c) - 1
            ys.append([IGNORE_INDEX] * max(0, len(c) - 1) + row[max(1, len(c)) :])
    L = -(-max(map(len, xs)) // multiple) * multiple
    x = torch.zeros(len(xs), L, dtype=torch.long)
    y = torch.full((len(xs), L), IGNORE_INDEX, dtype=torch.long)
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        x[i, : len(xi)], y[i, : len(yi)] = torch.tensor(xi, dtype=torch.long), torch.tensor(yi, dtype=torch.long)
    counts = (y != IGNORE_INDEX).sum(1)
    if (counts == 0).any():
        raise HellaSwagError(
            f"example {int((counts == 0).nonzero()[0]) // 4}: an ending has no token to score "
            f"(an empty context and a one-token ending)"
        )
    return Rows(x, y, counts, torch.tensor([label for *_, label in examples]))


def check_fits(rows: Rows, block_size: int, vocab_size: int, path: str) -> None:
    """Rows the model can take: no longer than its context, token ids inside its vocabulary."""
    if rows.length > block_size:
        raise HellaSwagError(
            f"{path}: its longest row needs {rows.length} positions, more than the model's block_size {block_size}"
        )
    if int(rows.x.max()) >= vocab_size:
        raise HellaSwagError(f"{path}: token id {int(rows.x.max())} >= the model's vocab_size {vocab_size}")


# ----------------------------------------------------------------------------- scoring


def per_row(loss_of: Callable) -> Callable:
    """A loss function of (rows-first input, ..., targets (B, T)) whose mean is over targets != -1, turned into one
    returning each row's summed loss (B,) (fp32): the mean over the row's own targets times their count (0 for a
    row with none here: an empty row, or a context-parallel share without ending tokens)."""

    def rows(first: torch.Tensor, *rest):
        *middle, targets = rest
        sums = []
        for b in range(targets.shape[0]):
            n = (targets[b] != IGNORE_INDEX).sum()
            loss = loss_of(first[b : b + 1], *middle, targets[b : b + 1])
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # a DTensor (torch's TP)
            sums.append(torch.where(n > 0, loss.float() * n, 0.0))
        return torch.stack(sums)

    return rows


@contextlib.contextmanager
def per_row_losses(modules: list[torch.nn.Module]) -> Iterator[None]:
    """While open, every module among `modules` that carries a loss head (GPT, a pipeline stage: `head_loss`,
    `loss_fn`) returns per-row sums (`per_row`) from its forward with targets."""
    swapped = []
    for m in modules:
        for name in ("head_loss", "loss_fn"):
            fn = vars(m).get(name)
            if fn is not None:
                swapped.append((m, name, fn))
                setattr(m, name, per_row(fn))
    try:
        yield
    finally:
        for m, name, fn in reversed(swapped):
            setattr(m, name, fn)


def row_sums(
    forward: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], list[torch.Tensor]],
    rows: Rows,
    rank: int = 0,
    world: int = 1,
    batch_rows: int = 16,
) -> torch.Tensor:
    """Each row's summed loss (n,), fp32, from this data-parallel rank's share: rows rank, rank + world, ... in
    micro-batches of `batch_rows` rows, every rank the same number of them (empty rows pad); 0 for other ranks' rows.
    `forward`: micro-batches (x, y) -> each one's per-row sums (B,) (under `per_row_losses`; 0 off a pipeline's last
    stage)."""
    n = rows.x.shape[0]
    per_rank = math.ceil(n / world)
    ids = list(range(rank, n, world))
    ids += [-1] * (math.ceil(per_rank / batch_rows) * batch_rows - len(ids))
    empty_x, empty_y = torch.zeros(rows.length, dtype=torch.long), torch.full((rows.length,), IGNORE_INDEX)
    batches, groups = [], [ids[i : i + batch_rows] for i in range(0, len(ids), batch_rows)]
    for group in groups:
        batches.append(
            (
                torch.stack([rows.x[i] if i >= 0 else empty_x for i in group]),
                torch.stack([rows.y[i] if i >= 0 else empty_y for i in group]),
            )
        )
    sums = torch.zeros(n)
    for group, got in zip(groups, forward(batches)):
        got = got.detach().float().cpu().expand(len(group))
        for i, value in zip(group, got.tolist()):
            if i >= 0:
                sums[i] = value
    return sums


def summarize(rows: Rows, sums: torch.Tensor) -> dict[str, float]:
    """acc (least sum_loss), acc_norm (least avg_loss), and `loss`: the correct endings' avg_loss, averaged."""
    sum_loss = sums.view(-1, 4)
    avg_loss = (sums / rows.counts).view(-1, 4)
    n = len(rows.labels)
    return {
        "acc": (sum_loss.argmin(1) == rows.labels).sum().item() / n,
        "acc_norm": (avg_loss.argmin(1) == rows.labels).sum().item() / n,
        "loss": avg_loss.gather(1, rows.labels[:, None]).mean().item(),
    }


def score_model(
    model: torch.nn.Module,
    rows: Rows,
    device: torch.device,
    batch_rows: int = 16,
    autocast: Callable = contextlib.nullcontext,
) -> torch.Tensor:
    """Every row's summed loss (n,) on one process: `row_sums` through `model(x, y)`."""

    def forward(batches):
        return [model(x.to(device), y.to(device))[1] for x, y in batches]

    with torch.no_grad(), per_row_losses(list(model.modules())), autocast():
        return row_sums(forward, rows, batch_rows=batch_rows)


def score_layout(parallelized, mesh, rows: Rows, batch_rows: int, autocast: Callable) -> dict[str, float]:
    """HellaSwag through a parallelized model (parallel.parallelize.Parallelized `parallelized` on `mesh`): rows spread
    over
    the dp ranks, summed over pp and over dp x cp (every rank ends with every row's sum). Collective: every rank."""
    from parallel import comm

    modules = [*parallelized.model.modules(), *getattr(parallelized.model, "chunk_modules", {}).values()]
    batch = mesh["batch"]
    with per_row_losses(modules):
        sums = row_sums(lambda b: parallelized.forward_only(b, autocast), rows, batch.rank, batch.size, batch_rows)
    sums = sums.to(parallelized.device)
    for name in ("pp", "loss"):  # pp: only the last stage's are not 0; dp: disjoint rows; cp: each rank's share
        if mesh[name].enabled:
            comm.all_reduce(sums, group=mesh[name].group, counted=False)
    return summarize(rows, sums.cpu())


def for_plan(spec) -> Rows | None:
    """train.py --hellaswag FILE: the file's rows for the validated `plan` (config.RunSpec), each padded to a length the
    layout's sequence split takes (2 x cp chunks, each divisible by tp under sequence parallelism); None without
    the flag. HellaSwagError (one line) for a file or layout it cannot score, before any work."""
    args, dims = spec.args, spec.dims
    if args.hellaswag is None:
        return None
    if dims.cp_enabled and args.implementation == "pytorch":
        raise HellaSwagError(
            "--hellaswag with --implementation pytorch --context_parallel_size: torch's "
            "context_parallel shards the rows inside its forward, where the scoring cannot count "
            "each rank's ending tokens; use --implementation custom"
        )
    from data.tokenizer import get_gpt2_encoding

    try:
        enc = get_gpt2_encoding()
    except RuntimeError as e:
        raise HellaSwagError(f"--hellaswag needs the GPT-2 tokenizer: {e}") from None
    multiple = (2 * dims.cp if dims.cp_enabled else 1) * (dims.tp if args.sequence_parallel else 1)
    rows = render(load_examples(args.hellaswag), enc, multiple)
    check_fits(rows, spec.config.block_size, spec.config.vocab_size, args.hellaswag)
    return rows


# ----------------------------------------------------------------------------- the command line


def main(argv: list[str] | None = None) -> int:
    from checkpoints import checkpoint
    from data.tokenizer import get_gpt2_encoding
    from model.gpt import GPT
    from runtime.device import pick_device
    from trainer.config import HF_MODELS, Parser, UsageError, error_line, fetch_hf_weights, resolve_dtype

    p = Parser(prog="python -m evals.hellaswag", description=__doc__.splitlines()[0])
    p.add_argument("--out_dir", default=None, help="a training run: score its newest intact checkpoint")
    p.add_argument("--step", type=int, default=None, help="score the checkpoint of step N instead")
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory")
    p.add_argument("--init_from", choices=HF_MODELS, default=None, help="OpenAI's weights from the Hugging Face hub")
    p.add_argument("--data", default=DEFAULT_DATA, help=f"a HellaSwag jsonl file (default: {DEFAULT_DATA})")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="autocast dtype (auto: bf16 on GPUs that have it, fp32 on CPU)",
    )
    p.add_argument("--batch_rows", type=int, default=16, help="rows a forward (default: 16)")
    try:
        args = p.parse_args(argv)
        if args.batch_rows < 1:
            raise UsageError(f"--batch_rows must be >= 1, got {args.batch_rows}")
        device = pick_device(args.device)
        rows = render(load_examples(args.data), get_gpt2_encoding())
        if args.init_from:
            model, what = GPT.from_hf_state_dict(fetch_hf_weights(args.init_from)), args.init_from
        else:
            path = args.checkpoint
            if path is None and args.out_dir is None:
                raise UsageError("pass --out_dir RUN (or --checkpoint DIR, or --init_from gpt2)")
            if path is None and args.step is not None:
                path = checkpoint.step_dir(args.out_dir, args.step)
                if not os.path.isdir(path):
                    raise UsageError(
                        f"no checkpoint of step {args.step} in {args.out_dir} (have: "
                        f"{[s for s, _ in checkpoint.list_checkpoints(args.out_dir)]})"
                    )
            path = path or checkpoint.newest_intact(args.out_dir, lambda line: sys.stderr.write(f"{line}\n"))
            if path is None:
                raise UsageError(f"no intact checkpoint in {os.path.join(args.out_dir, checkpoint.SUBDIR)}")
            checkpoint.verify(path)
            model, what = checkpoint.load_model(path), path
        check_fits(rows, model.config.block_size, model.config.vocab_size, args.data)
    except (UsageError, HellaSwagError, checkpoint.CheckpointError, ValueError) as e:
        error_line("python -m evals.hellaswag", e)
        return 2
    dtype = resolve_dtype(args.dtype, device)
    model = model.to(device).eval()
    sums = score_model(
        model,
        rows,
        device,
        args.batch_rows,
        lambda: torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32),
    )
    s = summarize(rows, sums)
    print(
        f"hellaswag: {len(rows.labels)} examples, acc {s['acc']:.4f}, acc_norm {s['acc_norm']:.4f} "
        f"(correct endings' loss {s['loss']:.4f}; {what})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
