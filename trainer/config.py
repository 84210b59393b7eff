"""Command-line flags and their validation into one frozen `RunSpec`, before any process group exists.

train.py, sample.py, export.py and bench share what lives here: `UsageError` (bad input: one line, exit code 2,
on every rank, before any work; runtime/registry.py's, which every concept's checks raise), the one-line argument
parser, and fetching OpenAI's weights. After `validate` the trainer reads layout questions from `spec.parallel` and
`spec.dims` only.

The trainer's own flags and checks are here; each concept's (a parallelism, the optimizer, the experts) are
its own, registered from its folder (runtime/registry.py, trainer/concepts.py): the parser adds their groups,
`check_ranges` their ranges, and `check_layout` runs their checks at their phase (registry.PHASES).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from dataclasses import dataclass

import torch

from checkpoints import checkpoint
from data.batches import BatchSource, DataError, prepare_hint, prepared_dir, resolve_dataset_dir
from data.chars import holds_chars, load_chars
from model.gpt import GPT, PRESETS, GPTConfig, make_config
from parallel.mesh import ParallelDims, WorldSizeError
from parallel.parallelize import ParallelConfig
from runtime.device import pick_device
from runtime.launch import env_world
from runtime.registry import AT_LEAST_ONE, AT_LEAST_ZERO, NON_NEGATIVE, POSITIVE, RANGES, Checking, UsageError
from trainer import config_file
from trainer.concepts import concepts

HF_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
DTYPES = ("float32", "bfloat16", "float16")


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one line) instead of printing usage and exiting."""

    def error(self, message: str):
        raise UsageError(message)


def error_line(prog: str, message: object) -> None:
    """Write `prog: error: message` to stderr in one write: ranks sharing a terminal or pipe never glue
    their lines together (print() writes the text and the newline separately)."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    sys.stderr.flush()


def fetch_hf_weights(name: str) -> dict:
    """OpenAI's GPT-2 weights through transformers' hub cache; one UsageError when they can't be had.

    The hub is probed first (5 s), so an offline machine answers at once from the local cache or fails,
    instead of sitting through the hub client's retries."""
    from data.common import url_reachable

    # transformers imports torchao where it is installed (the FP8 twin's): its prebuilt kernels for other CUDA
    # and Python builds, and torch's pytree, would each log a warning line before our one-line error
    for noisy in ("torchao", "torch.utils._pytree"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        import transformers
        from transformers import GPT2LMHeadModel

        transformers.logging.set_verbosity_error()
        online = url_reachable("https://huggingface.co", timeout=5.0)
        return GPT2LMHeadModel.from_pretrained(name, local_files_only=not online).state_dict()
    except Exception as e:  # noqa: BLE001 -- any failure here means "could not fetch"
        raise UsageError(
            f"--init_from {name}: could not fetch the weights from the Hugging Face hub "
            f"({type(e).__name__}); this needs internet access or a populated HF cache"
        ) from None


# ----------------------------------------------------------------------------- train.py's flags


def train_parser() -> Parser:
    """train.py's flags: the trainer's own, then each registered concept's in a group of its own."""
    p = Parser(prog="train.py", description="Train GPT-2 on one process or many (torchrun).")
    p.add_argument(
        "--config",
        metavar="FILE.toml",
        help="read the flags from a TOML file (key = value; each run writes its "
        "own to <out_dir>/config.toml); flags given here override it",
    )
    for title, add in (
        ("layout", _layout_flags),
        ("model and data", _model_flags),
        ("batch and optimisation", _batch_flags),
        ("system", _system_flags),
        ("checkpoints", _checkpoint_flags),
    ):
        add(p.add_argument_group(title).add_argument)
    for c in concepts():
        if c.flags is not None:
            c.flags(p.add_argument_group(c.title or c.name).add_argument)
    return p


def _layout_flags(a) -> None:
    """What every layout shares: which implementation, how the model is built and each Block wrapped."""
    a("--implementation", choices=["custom", "pytorch"], default="custom")
    a("--deferred_init", action="store_true", help="build on meta, materialise after sharding")
    a(
        "--activation_checkpointing",
        choices=["none", "full", "selective"],
        default="none",
        help="recompute Blocks in backward: every Block (full) or every --ac_every-th (selective)",
    )
    a("--ac_every", type=int, default=2, metavar="K", help="selective activation checkpointing: every K-th Block")
    a("--compile", action="store_true", help="torch.compile each Block (needs a C++ compiler on CPU)")
    a("--gradient_clipping", action="store_true", help="clip the global gradient norm at 1.0")
    a("--no_tf32", action="store_true", help="CUDA, --dtype float32: keep fp32 matmuls in full fp32 (default: TF32)")


def _model_flags(a) -> None:
    a("--model", default="gpt2", help=f"preset: {', '.join(PRESETS)}")
    a("--init_from", choices=["scratch", *HF_MODELS], default="scratch", help="start from OpenAI's weights")
    a("--n_layer", type=int)
    a("--n_head", type=int)
    a("--n_embd", type=int)
    a("--block_size", type=int)
    a("--vocab_size", type=int, help="override the preset's vocabulary (50304), e.g. for a small test corpus")
    a("--dataset", default="shakespeare", help="shakespeare, shakespeare_char, openwebtext, fineweb, or a dir: data.md")


def _batch_flags(a) -> None:
    a("--micro_batch_size", type=int, default=8)
    a("--seq_len", type=int, default=1024)
    a("--total_batch_size", type=int, default=524288, help="tokens per optimizer step")
    a("--max_steps", type=int, default=250)
    a("--lr", type=float, default=6e-4, help="peak; linear warmup then cosine to 10%%")
    a("--warmup_steps", type=int, default=10)
    a("--weight_decay", type=float, default=0.1)
    a("--seed", type=int, default=1337)
    a("--eval_interval", type=int, default=25)
    a("--eval_iters", type=int, default=20)
    a(
        "--hellaswag",
        metavar="FILE.jsonl",
        help="also score HellaSwag at every eval, spread over the ranks (python -m evals.fetch_hellaswag)",
    )


def _system_flags(a) -> None:
    a("--device", choices=["auto", "cpu", "cuda"], default="auto")
    a("--dtype", choices=["auto", *DTYPES], default="auto")
    a("--out_dir", default=None, help="default: runs/<model>-<dataset>")
    a("--overwrite", action="store_true", help="start afresh in an --out_dir that already holds a run")
    a("--timeout", type=float, default=600.0, help="seconds a collective may wait before the run fails")
    a(
        "--fake_world_size",
        type=int,
        default=None,
        metavar="N",
        help="with --fake_rank: play one rank of an N-rank job on torch's fake backend, on data-free (fake) tensors, "
        "recording its groups and collectives instead of training: python -m sim.fake_rank takes these flags "
        "(train.py refuses them); python -m sim.verify runs many",
    )
    a("--fake_rank", type=int, default=None, metavar="R", help="the rank --fake_world_size plays")
    a(
        "--peak_flops",
        type=float,
        default=None,
        help="peak FLOP/s of one device, for MFU (default: datasheet for known GPUs, else measured)",
    )
    a(
        "--trace_step",
        type=int,
        default=None,
        metavar="S",
        help="record step S's module outputs and gradients to <out_dir>/trace/ for `python -m debug diff`",
    )
    a(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="write a torch.profiler trace of N steps (after 2 warm-up steps) to <out_dir>/profile",
    )


def _checkpoint_flags(a) -> None:
    a(
        "--checkpoint_interval",
        type=int,
        default=0,
        metavar="N",
        help="also save a checkpoint every N steps (one is always saved at the end, unless --no_checkpoint)",
    )
    a("--no_checkpoint", action="store_true", help="save no checkpoint at all, not even the final one")
    a(
        "--async_checkpoint",
        action="store_true",
        help="copy the state to CPU memory and write it in a background thread while training goes on",
    )
    a("--keep_checkpoints", type=int, default=3, metavar="K", help="keep the newest K checkpoints (default 3)")
    a(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in --out_dir (none there: start fresh)",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = config_file.parse_args(train_parser(), argv)  # --config FILE.toml, then the command line
    if args.out_dir is None:
        args.out_dir = os.path.join("runs", f"{args.model}-{os.path.basename(os.path.normpath(args.dataset))}")
    return args


# ----------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class RunSpec:
    """Everything validated from the arguments and the environment. `args` is kept for the plain
    hyperparameters (lr, steps, intervals); the layout lives in `dims` and `parallel` alone."""

    args: argparse.Namespace
    dims: ParallelDims
    parallel: ParallelConfig
    config: GPTConfig
    device: torch.device
    dtype: torch.dtype
    grad_accum: int
    rows: int  # sequences per global batch
    data_dir: str
    rank: int
    hf_state: dict | None = None
    fake: bool = False  # --fake_world_size/--fake_rank: a simulated rank (fake backend and tensors, sim/fake_rank.py)
    resume_from: str | None = None  # checkpoint directory (--resume found one)
    tf32: bool = False  # fp32 matmuls and convolutions on CUDA in TF32 (use_tf32)


def cxx_compiler() -> str | None:
    """The C++ compiler torch.compile's CPU backend (inductor) would build with, or None."""
    import shutil

    return next(
        (
            path
            for name in (os.environ.get("CXX"), "g++", "c++", "clang++")
            if name
            for path in [shutil.which(name)]
            if path
        ),
        None,
    )


def use_tf32(device: torch.device, dtype: torch.dtype, no_tf32: bool = False) -> bool:
    """TF32 for fp32 matmuls: on CUDA when the run computes in fp32, unless --no_tf32. TF32 keeps fp32's range
    and 10 of its 23 mantissa bits in the matmul inputs (accumulation stays fp32): ~2^-11 relative per product,
    what Ampere+ GPUs run fp32 matmuls on at 8x the speed. autocast runs (bf16, fp16) are unaffected."""
    return device.type == "cuda" and dtype == torch.float32 and not no_tf32


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': bf16 on a GPU with native bf16 (compute capability >= 8.0), fp16 with a GradScaler on an
    older one, fp32 on CPU. A capability query touches no device memory, unlike
    torch.cuda.is_bf16_supported(), which also says True for emulated bf16 (V100, T4)."""
    if name != "auto":
        return getattr(torch, name)
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16


def parallel_config(
    args: argparse.Namespace, dims: ParallelDims, dtype: torch.dtype, pp_layers: tuple[int, ...] | None = None
) -> ParallelConfig:
    """The layout settings `parallel.parallelize` composes, with every default resolved: the trainer's own and each
    concept's (`Concept.parallel`; `pp_layers`: the pipeline's Blocks per chunk, its check's)."""
    c = Checking(args, dims=dims, dtype=dtype, found={"pp_layers": pp_layers})
    fields = dict(
        implementation=args.implementation,
        deferred_init=args.deferred_init,
        seed=args.seed,
        activation_checkpointing=args.activation_checkpointing,
        ac_every=args.ac_every,
        compile=args.compile,
    )
    for concept in concepts():
        if concept.parallel is not None:
            fields.update(concept.parallel(c))
    return ParallelConfig(**fields)


# the trainer's own numeric flags' ranges, checked before any work (each concept declares its own: Concept.ranges)
RANGES_OF = {
    **dict.fromkeys(
        (
            "ac_every",
            "micro_batch_size",
            "seq_len",
            "total_batch_size",
            "max_steps",
            "eval_interval",
            "eval_iters",
            "keep_checkpoints",
            "n_layer",
            "n_head",
            "n_embd",
            "block_size",
            "vocab_size",
            "trace_step",
        ),
        AT_LEAST_ONE,
    ),
    **dict.fromkeys(("warmup_steps", "checkpoint_interval", "profile"), AT_LEAST_ZERO),
    **dict.fromkeys(("lr", "timeout", "peak_flops"), POSITIVE),  # finite and > 0
    "weight_decay": NON_NEGATIVE,  # finite and >= 0
}


def check_ranges(args: argparse.Namespace) -> None:
    """Every numeric flag in its range (None: not given), the trainer's then each concept's: the integers (>= 1,
    then >= 0), then the floats (finite and > 0, then finite and >= 0)."""
    ranges = dict(RANGES_OF)
    for c in concepts():
        ranges.update(c.ranges)
    for kind in RANGES:
        for flag in (f for f, k in ranges.items() if k == kind):
            value = getattr(args, flag)
            if value is None:
                continue
            if kind in (AT_LEAST_ONE, AT_LEAST_ZERO) and value < (low := 1 if kind == AT_LEAST_ONE else 0):
                raise UsageError(f"--{flag} must be >= {low}, got {value}")
            if kind == POSITIVE and not (math.isfinite(value) and value > 0):
                raise UsageError(f"--{flag} must be a finite number > 0, got {value}")
            if kind == NON_NEGATIVE and not (math.isfinite(value) and value >= 0):
                raise UsageError(f"--{flag} must be a finite number >= 0, got {value}")


def _check_flags(args: argparse.Namespace) -> None:
    check_ranges(args)
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise UsageError(f"--out_dir {args.out_dir} is a file, not a directory")
    if args.no_checkpoint and args.checkpoint_interval:
        raise UsageError("--no_checkpoint saves nothing and --checkpoint_interval asks for saves: pass one of them")
    if args.resume and args.overwrite:
        raise UsageError("--resume continues the run in --out_dir and --overwrite discards it: pass one of them")
    if args.trace_step is not None and args.trace_step > args.max_steps:
        raise UsageError(
            f"--trace_step {args.trace_step} is past --max_steps {args.max_steps}: nothing would be traced"
        )
    if args.trace_step is not None and args.compile:
        raise UsageError(
            "--trace_step records through module hooks, which a compiled Block runs inside its graph; "
            "trace an eager run (without --compile)"
        )
    if args.deferred_init and args.init_from != "scratch":
        raise UsageError("--deferred_init builds a fresh model; it cannot be combined with --init_from")
    if args.init_from != "scratch" and holds_chars(args.dataset):
        raise UsageError(f"--init_from {args.init_from} reads GPT-2 BPE ids; --dataset {args.dataset} holds characters")
    _check_fake(args)
    run_checks("flags", Checking(args))


def run_checks(phase: str, c: Checking) -> None:
    """Every registered concept's checks of `phase` (registry.PHASES), in registration order; UsageError."""
    for concept in concepts():
        for when, check in concept.checks:
            if when == phase:
                check(c)


def _check_fake(args: argparse.Namespace) -> None:
    """--fake_world_size and --fake_rank: both or neither, 0 <= rank < N, and what a simulated rank cannot be: a
    torchrun rank (it plays its rank alone), on CUDA (fake CUDA tensors need a CUDA build's device guard), from
    OpenAI's weights (real data), resumed, or compiled (it trains nothing, and saves nothing)."""
    n, r = args.fake_world_size, args.fake_rank
    if n is None and r is None:
        return
    if n is None or r is None:
        raise UsageError(
            "--fake_world_size and --fake_rank go together: pass both (a simulated rank r of N) or neither"
        )
    if n < 1 or not 0 <= r < n:
        raise UsageError(f"--fake_rank {r} must be in [0, --fake_world_size {n}), and N >= 1")
    if env_world()[2] > 1:
        raise UsageError("--fake_world_size plays one rank in one process: launch it with python, not torchrun")
    refused = [
        f
        for f, on in (
            ("--device cuda", args.device == "cuda"),
            ("--init_from", args.init_from != "scratch"),
            ("--resume", args.resume),
            ("--compile", args.compile),
        )
        if on
    ]
    if refused:
        raise UsageError(
            f"--fake_world_size runs the CPU code path on fake tensors, from scratch and eager: it does "
            f"not take {refused[0]}"
        )


def _check_model(args: argparse.Namespace) -> tuple[GPTConfig, dict | None]:
    """The model's config, from OpenAI's weights or the flags (the trainer's and each concept's fields:
    `Concept.model`), checked; and the weights or None."""
    hf_state = None
    if args.init_from != "scratch":
        hf_state = fetch_hf_weights(args.init_from)
        config = GPT.from_hf_state_dict(hf_state).config
    else:
        try:
            chars = load_chars(resolve_dataset_dir(args.dataset))  # a character-level dataset sizes the vocab
            config = make_config(
                args.model,
                n_layer=args.n_layer,
                n_head=args.n_head,
                n_embd=args.n_embd,
                block_size=args.block_size,
                vocab_size=args.vocab_size or (chars and chars.padded_vocab),
                **model_fields(args),
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
    if config.n_embd % config.n_head:
        raise UsageError(f"n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")
    return config, hf_state


def model_fields(args: argparse.Namespace) -> dict:
    """The model config's fields each concept sets from its flags (model.GPTConfig; the experts')."""
    out = {}
    for c in concepts():
        if c.model is not None:
            out.update(c.model(args))
    return out


def _check_data(args: argparse.Namespace, config: GPTConfig | None, local_rank: int) -> str:
    """The dataset's directory (a built-in Shakespeare one prepared when missing, by local rank 0) and, given the
    model's `config`, its files and characters checked against it."""
    try:
        data_dir = prepared_dir(args.dataset, leader=local_rank == 0)
        if config is not None:
            load_chars(data_dir, config.vocab_size)  # a character-level dataset's characters fit the model's vocab
            BatchSource(data_dir, args.seq_len, config.vocab_size, args.seed, prepare_hint(args.dataset))
    except DataError as e:
        raise UsageError(str(e)) from None
    return data_dir


def _check_out_dir(args: argparse.Namespace, config: GPTConfig) -> str | None:
    """Refuse to overwrite a run by accident; with --resume, the checkpoint to continue from."""
    metrics = os.path.join(args.out_dir, "metrics.jsonl")
    held = metrics if os.path.exists(metrics) else (checkpoint.newest(args.out_dir) or None)
    if held and not (args.overwrite or args.resume):
        raise UsageError(
            f"{args.out_dir} already holds a run ({held}); pass --resume to continue it, "
            f"--overwrite to start afresh, or choose another --out_dir"
        )
    return resume_checkpoint(args.out_dir, config, env_world()[0] == 0, args) if args.resume else None


def resume_checkpoint(
    out_dir: str, config: GPTConfig, report: bool = True, args: argparse.Namespace | None = None
) -> str | None:
    """--resume: the newest intact checkpoint in `out_dir` (None if there is none): damaged newer ones are
    skipped with one line each (`report`: rank 0 says it), so a crash mid-write or a flipped byte never stops a
    restart. Refused in one line if it holds another model config, or what a concept refuses of it given the
    run's `args` (`Concept.resume`: another optimizer's state). Every rank verifies and reads the manifest, so
    every rank decides alike."""
    path = checkpoint.newest_intact(out_dir, (lambda line: print(f"--resume: {line}", flush=True)) if report else None)
    if path is None:
        return None
    try:
        diff = checkpoint.config_mismatch(manifest := checkpoint.read_manifest(path), config)
        for c in concepts():
            if c.resume is not None and args is not None:
                c.resume(manifest, args, path)
    except checkpoint.CheckpointError as e:
        raise UsageError(f"--resume: {e}") from None
    except KeyError as e:
        raise UsageError(f"--resume: {path}: the manifest has no {e} entry") from None
    if diff:
        raise UsageError(
            f"--resume: checkpoint {path} holds another model config ({diff}); resume with the "
            f"same --model/--n_layer/--n_head/--n_embd/--block_size, or choose another --out_dir"
        )
    return path


LAUNCH = "launch with torchrun --nproc_per_node={n}"  # how a user gets n ranks: train.py's hint by default


def check_layout(
    args: argparse.Namespace, world_size: int, device: torch.device, launch: str = LAUNCH
) -> tuple[ParallelDims, GPTConfig, torch.dtype, dict | None, int, tuple[int, ...] | None]:
    """Every check of the flags against each other and the model that needs no process group, data or out_dir:
    (dims, model config, dtype, OpenAI's weights or None, micro-steps per step, the pipeline's Blocks per
    chunk or None). Raises UsageError. The layout planner (plan/) asks it which layouts the trainer accepts, with
    a world size and device of its choosing. `launch`: the hint, for n ranks, when the sizes multiply to another
    world size than `world_size`. The trainer's checks, and each concept's at its phase (registry.PHASES)."""
    _check_flags(args)
    c = Checking(args, world=world_size, device=device)
    run_checks("world", c)
    try:
        sizes = {"dp": 1, "tp": 1}
        for concept in concepts():
            sizes.update(concept.mesh(args) if concept.mesh is not None else {})
        c.dims = ParallelDims(world_size=world_size, **sizes)
    except WorldSizeError as e:
        raise UsageError(f"{e}; {launch.format(n=e.needed)}") from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    c.dtype = resolve_dtype(args.dtype, device)
    if args.compile and device.type == "cpu" and not cxx_compiler():
        raise UsageError(
            "--compile on CPU needs a C++ compiler for inductor and none was found (looked for $CXX, "
            "g++, c++, clang++); install one (Debian/Ubuntu: apt-get install g++) or drop --compile"
        )
    run_checks("layout", c)
    c.config, hf_state = _check_model(args)
    run_checks("model", c)
    if args.seq_len > c.config.block_size:
        raise UsageError(f"--seq_len {args.seq_len} exceeds the model's block_size {c.config.block_size}")
    tokens_per_micro = args.micro_batch_size * args.seq_len * c.dims.dp
    if args.total_batch_size % tokens_per_micro:
        raise UsageError(
            f"--total_batch_size {args.total_batch_size} is not divisible by micro_batch_size x "
            f"seq_len x data_parallel_size = {args.micro_batch_size} x {args.seq_len} x {c.dims.dp} "
            f"= {tokens_per_micro}"
        )
    c.micro = args.total_batch_size // tokens_per_micro
    run_checks("batch", c)
    return c.dims, c.config, c.dtype, hf_state, c.micro, c.found.get("pp_layers")


def validate(args: argparse.Namespace, launch: str | None = None) -> RunSpec:
    """Check the arguments against each other, the environment and the data; raise UsageError.
    The built-in Shakespeare corpus is prepared here when it is missing (local rank 0 does it). `launch`: how
    the caller gets n ranks, for the world-size hint (default: torchrun's, or --fake_world_size's)."""
    rank, local_rank, world_size = env_world()
    fake = args.fake_world_size is not None
    if fake:
        _check_fake(args)  # before the world size is read from it
        rank, local_rank, world_size = args.fake_rank, 0, args.fake_world_size
    try:
        device = pick_device("cpu" if fake else args.device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    launch = launch or ("pass --fake_world_size {n}" if fake else LAUNCH)
    if args.dataset == "shakespeare_char":  # its characters size the model: prepared once the flags are checked
        _check_flags(args)
        _check_data(args, None, local_rank)
    dims, config, dtype, hf_state, grad_accum, pp_layers = check_layout(args, world_size, device, launch)
    data_dir = _check_data(args, config, local_rank)
    resume_from = None if fake else _check_out_dir(args, config)  # a simulated rank writes nothing there
    return RunSpec(
        args=args,
        dims=dims,
        parallel=parallel_config(args, dims, dtype, pp_layers),
        config=config,
        device=device,
        dtype=dtype,
        grad_accum=grad_accum,
        rows=args.total_batch_size // args.seq_len,
        data_dir=data_dir,
        rank=rank,
        hf_state=hf_state,
        resume_from=resume_from,
        tf32=use_tf32(device, dtype, args.no_tf32),
        fake=fake,
    )
