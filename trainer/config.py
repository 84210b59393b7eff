"""Command-line flags and their validation into one frozen `RunSpec`, before any process group exists.

train.py, sample.py, export.py and bench share what lives here: `UsageError` (bad input: one line,
exit code 2, on every rank, before any work), the one-line argument parser, and fetching OpenAI's
weights. After `validate` the trainer reads layout questions from `spec.parallel` and `spec.dims` only.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from dataclasses import dataclass

import torch

from checkpoints import checkpoint
from data.batches import BatchSource, DataError, prepare_hint, prepared_dir, resolve_dataset_dir
from data.chars import holds_chars, load_chars
from ft import flags as ft_flags
from model.gpt import GPT, PRESETS, GPTConfig, make_config
from optim import flags as optim_flags
from parallel.mesh import ParallelDims, WorldSizeError
from parallel.parallelize import ParallelConfig
from parallel.pipeline.partition import check_counts, layers_for
from parallel.tensor_parallel.apply import check_tp_divisibility
from runtime.device import pick_device
from runtime.launch import env_world
from trainer import config_file

HF_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
DTYPES = ("float32", "bfloat16", "float16")


class UsageError(ValueError):
    """Bad input: reported as one line, exit code 2, before any work."""


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
    p = Parser(prog="train.py", description="Train GPT-2 on one process or many (torchrun).")
    a = p.add_argument
    a(
        "--config",
        metavar="FILE.toml",
        help="read the flags from a TOML file (key = value; each run writes its "
        "own to <out_dir>/config.toml); flags given here override it",
    )
    # layout
    a("--tensor_parallel_size", type=int, default=1, help="degree of tensor parallelism")
    a("--enable_loss_parallelism", action="store_true", help="vocab-parallel cross-entropy under TP")
    a("--sequence_parallel", action="store_true", help="TP: LayerNorms/residuals on sequence-sharded activations")
    a("--data_parallel_size", type=int, default=1, help="degree of data parallelism")
    a(
        "--data_parallel_type",
        choices=["ddp", "zero1", "zero2", "fsdp"],
        default=None,
        help="required when dp > 1: replicate (ddp) or shard optimizer state (zero1), + gradients (zero2), "
        "+ parameters (fsdp = ZeRO-3)",
    )
    a(
        "--data_parallel_replicate_size",
        type=int,
        default=1,
        metavar="R",
        help="HSDP: the dp ranks are R replicas x dp/R shards (zero1, zero2, fsdp)",
    )
    a("--pipeline_parallel_size", type=int, default=1, help="degree of pipeline parallelism (stages)")
    a(
        "--pp_schedule",
        choices=["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev"],
        default="1f1b",
        help="pipeline schedule; the step's micro-batches are the pipeline's micro-batches (zb_h1, zbv, dualpipev: "
        "zero-bubble, the backward split into input and weight gradients; zbv and dualpipev cut 2 chunks per "
        "rank in a V)",
    )
    a(
        "--pp_virtual_stages",
        type=int,
        default=None,
        metavar="V",
        help="interleaved_1f1b: model chunks per pipeline rank (V > 1); zbv, dualpipev: 2",
    )
    a(
        "--pp_layers_per_stage",
        default=None,
        metavar="A,B,...",
        help="Blocks per pipeline chunk, P x V counts in chunk order (default: partitioned by the cost model, "
        "parallel/pipeline/partition.py)",
    )
    a(
        "--context_parallel_size",
        type=int,
        default=1,
        metavar="C",
        help="split every sequence over C ranks (ring attention); gradients reduced over dp x C",
    )
    a(
        "--expert_parallel_size",
        type=int,
        default=1,
        metavar="N",
        help="split each MoE layer's experts over N of the dp x cp ranks; tokens reach them by all_to_all",
    )
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
    a("--bucket_cap_mb", type=float, default=25.0, help="custom DDP: gradient bucket size")
    a("--grad_compression", choices=["none", "bf16"], default="none", help="custom DDP: bf16 on the wire")
    a(
        "--param_dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="FSDP: dtype of the gathered compute copies (the master shard stays fp32); auto: the --dtype "
        "autocast computes in",
    )
    a("--reduce_dtype", choices=DTYPES, default="float32", help="FSDP: dtype gradients are reduce-scattered in")
    a("--no_tf32", action="store_true", help="CUDA, --dtype float32: keep fp32 matmuls in full fp32 (default: TF32)")
    # model and data
    a("--model", default="gpt2", help=f"preset: {', '.join(PRESETS)}")
    a("--init_from", choices=["scratch", *HF_MODELS], default="scratch", help="start from OpenAI's weights")
    a("--n_layer", type=int)
    a("--n_head", type=int)
    a("--n_embd", type=int)
    a("--block_size", type=int)
    a("--vocab_size", type=int, help="override the preset's vocabulary (50304), e.g. for a small test corpus")
    a(
        "--moe_num_experts",
        type=int,
        default=0,
        metavar="E",
        help="mixture of experts: E experts per MoE layer (0: the dense GPT-2 MLP)",
    )
    a("--moe_top_k", type=int, default=2, metavar="K", help="experts each token is routed to")
    a("--moe_every", type=int, default=1, metavar="N", help="an MoE layer in every N-th Block (Blocks N-1, 2N-1, ...)")
    a("--moe_ffn_hidden", type=int, default=0, metavar="H", help="each expert's hidden width (0: 4 x n_embd)")
    a("--moe_aux_loss_coeff", type=float, default=0.0, help="Switch/GShard load-balancing loss coefficient")
    a(
        "--moe_bias_update_rate",
        type=float,
        default=0.0,
        help="DeepSeek-V3 auxiliary-loss-free balancing: the expert bias's step per optimizer step",
    )
    a("--dataset", default="shakespeare", help="shakespeare, shakespeare_char, openwebtext, fineweb, or a dir: data.md")
    # batch and optimisation
    a("--micro_batch_size", type=int, default=8)
    a("--seq_len", type=int, default=1024)
    a("--total_batch_size", type=int, default=524288, help="tokens per optimizer step")
    a("--max_steps", type=int, default=250)
    a("--lr", type=float, default=6e-4, help="peak; linear warmup then cosine to 10%%")
    a("--warmup_steps", type=int, default=10)
    a("--weight_decay", type=float, default=0.1)
    optim_flags.add_flags(a)  # --optimizer and Muon's (optim/flags.py)
    ft_flags.add_flags(a)  # --ft_*: replica groups on torchft (ft/flags.py)
    a("--seed", type=int, default=1337)
    a("--eval_interval", type=int, default=25)
    a("--eval_iters", type=int, default=20)
    a(
        "--hellaswag",
        metavar="FILE.jsonl",
        help="also score HellaSwag at every eval, spread over the ranks (python -m evals.fetch_hellaswag)",
    )
    # system
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
    # checkpoints
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
    return p


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
    """The layout settings `parallel.parallelize` composes, with every default resolved (`pp_layers`: the
    pipeline's Blocks per chunk, `_check_pipeline`'s)."""
    param_dtype = args.param_dtype
    if param_dtype == "auto":  # gather what autocast computes in: half the bytes, no fp32 copies kept alive
        param_dtype = str(dtype).removeprefix("torch.")
    # context parallelism replicates the parameters over cp: a data-parallel wrapper reduces over dp x cp
    dp_type = (args.data_parallel_type or "ddp") if dims.cp_enabled else args.data_parallel_type
    return ParallelConfig(
        dp_type=dp_type if dims.dp_enabled or dims.cp_enabled else None,
        implementation=args.implementation,
        loss_parallel=args.enable_loss_parallelism,
        sequence_parallel=args.sequence_parallel,
        param_dtype=None if param_dtype == "float32" else getattr(torch, param_dtype),
        reduce_dtype=getattr(torch, args.reduce_dtype),
        deferred_init=args.deferred_init,
        seed=args.seed,
        bucket_cap_mb=args.bucket_cap_mb,
        grad_compression=None if args.grad_compression == "none" else args.grad_compression,
        pp_schedule=args.pp_schedule,
        pp_virtual=args.pp_virtual_stages or 1,
        pp_layers=pp_layers,
        activation_checkpointing=args.activation_checkpointing,
        ac_every=args.ac_every,
        compile=args.compile,
    )


# every numeric flag's range, checked before any work: (flag, lowest allowed value, None: optional)
AT_LEAST_ONE = (
    "tensor_parallel_size",
    "data_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_replicate_size",
    "context_parallel_size",
    "expert_parallel_size",
    "moe_top_k",
    "moe_every",
    "pp_virtual_stages",
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
    "muon_ns_steps",
)
AT_LEAST_ZERO = ("warmup_steps", "checkpoint_interval", "profile", "moe_num_experts", "moe_ffn_hidden")
POSITIVE_FLOATS = ("lr", "timeout", "bucket_cap_mb", "peak_flops", "muon_lr")  # finite and > 0
NON_NEGATIVE_FLOATS = (
    "weight_decay",
    "moe_aux_loss_coeff",
    "moe_bias_update_rate",
    "muon_weight_decay",
    "muon_momentum",
)  # finite and >= 0


def _check_flags(args: argparse.Namespace) -> None:
    for flag in AT_LEAST_ONE + AT_LEAST_ZERO:
        value, low = getattr(args, flag), 1 if flag in AT_LEAST_ONE else 0
        if value is not None and value < low:
            raise UsageError(f"--{flag} must be >= {low}, got {value}")
    for flag in POSITIVE_FLOATS + NON_NEGATIVE_FLOATS:
        value = getattr(args, flag)
        if value is not None and not (
            math.isfinite(value) and (value > 0 or (flag in NON_NEGATIVE_FLOATS and value == 0))
        ):
            raise UsageError(
                f"--{flag} must be a finite number {'>= 0' if flag in NON_NEGATIVE_FLOATS else '> 0'}, got {value}"
            )
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
    if args.trace_step is not None and args.implementation == "pytorch" and args.context_parallel_size > 1:
        raise UsageError(
            "--trace_step cannot place the sequence shards of torch's context_parallel; trace CP "
            "with --implementation custom"
        )
    if args.deferred_init and args.init_from != "scratch":
        raise UsageError("--deferred_init builds a fresh model; it cannot be combined with --init_from")
    if args.init_from != "scratch" and holds_chars(args.dataset):
        raise UsageError(f"--init_from {args.init_from} reads GPT-2 BPE ids; --dataset {args.dataset} holds characters")
    _check_fake(args)


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


def _check_layout(args: argparse.Namespace, dims: ParallelDims, dtype: torch.dtype) -> None:
    if dims.dp_enabled and args.data_parallel_type is None:
        raise UsageError(f"--data_parallel_type ddp|zero1|zero2|fsdp is required with --data_parallel_size {dims.dp}")
    R = args.data_parallel_replicate_size
    if R > 1 and (dims.dp % R or args.data_parallel_type in (None, "ddp")):
        raise UsageError(
            f"--data_parallel_replicate_size {R} needs a sharded --data_parallel_type (zero1, zero2, "
            f"fsdp) and must divide --data_parallel_size {dims.dp}"
        )
    if R > 1 and args.data_parallel_type == "zero1" and args.implementation == "pytorch":
        raise UsageError(
            "--implementation pytorch has no hybrid ZeRO-1: ZeroRedundancyOptimizer shards over one "
            "group and would ignore --data_parallel_replicate_size; use the custom engine or zero2/fsdp"
        )
    for flag in ("enable_loss_parallelism", "sequence_parallel"):
        if getattr(args, flag) and not dims.tp_enabled:
            raise UsageError(f"--{flag} needs --tensor_parallel_size > 1")
    if args.sequence_parallel and args.seq_len % dims.tp:
        raise UsageError(
            f"--sequence_parallel needs --seq_len ({args.seq_len}) divisible by --tensor_parallel_size ({dims.tp})"
        )
    fp16 = [f"--{f} float16" for f in ("param_dtype", "reduce_dtype") if getattr(args, f) == "float16"]
    if fp16 and dtype != torch.float16:
        raise UsageError(
            f"{' and '.join(fp16)} need --dtype float16, whose GradScaler keeps fp16 gradients "
            f"from overflowing; use bfloat16 instead"
        )


def _check_model(args: argparse.Namespace, dims: ParallelDims) -> tuple[GPTConfig, dict | None]:
    hf_state = None
    if args.init_from != "scratch" and args.moe_num_experts:  # before fetching anything
        raise UsageError(f"--init_from {args.init_from} with --moe_num_experts: OpenAI's GPT-2 has no experts")
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
                **moe_fields(args),
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
    if config.n_embd % config.n_head:
        raise UsageError(f"n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")
    reason = check_tp_divisibility(config, dims.tp)
    if reason:
        raise UsageError(f"--tensor_parallel_size {dims.tp}: {reason}")
    if args.seq_len > config.block_size:
        raise UsageError(f"--seq_len {args.seq_len} exceeds the model's block_size {config.block_size}")
    return config, hf_state


def _check_context(args: argparse.Namespace, dims: ParallelDims, config: GPTConfig, device: torch.device) -> None:
    """Context parallelism: what it needs of the sequence and what it does not compose with (yet)."""
    C = dims.cp
    if C == 1:
        return
    if args.seq_len % (2 * C):
        raise UsageError(
            f"--context_parallel_size {C} needs --seq_len ({args.seq_len}) divisible by 2 x {C}: "
            f"each sequence is cut into 2C chunks (zigzag)"
        )
    if args.implementation == "pytorch" and device.type != "cuda":
        raise UsageError(
            "--implementation pytorch --context_parallel_size needs CUDA: PyTorch's context_parallel "
            "rings only the flash, memory-efficient and cuDNN SDPA kernels, and attention on "
            f"{device.type} is none of them (--implementation custom runs our ring anywhere)"
        )
    if args.implementation == "pytorch" and (
        dims.tp_enabled or dims.pp_enabled or args.compile or args.data_parallel_replicate_size > 1
    ):
        raise UsageError(
            "--implementation pytorch --context_parallel_size composes with data parallelism only "
            "(DDP, FSDP2); for CP with TP, PP, HSDP or --compile use --implementation custom"
        )
    if args.sequence_parallel and (args.seq_len // C) % dims.tp:
        raise UsageError(
            f"--sequence_parallel with --context_parallel_size {C} needs each rank's share of a "
            f"sequence (--seq_len / C = {args.seq_len // C}) divisible by --tensor_parallel_size "
            f"({dims.tp})"
        )
    if config.dropout > 0:
        raise UsageError(f"--context_parallel_size needs dropout 0 (got {config.dropout}): ring attention has none")


def _check_pipeline(
    args: argparse.Namespace, dims: ParallelDims, config: GPTConfig, micro: int
) -> tuple[int, ...] | None:
    """The schedule, its virtual stages and the micro-batch count M against the partition of n_layer Blocks.
    Returns the partition, Blocks per chunk: --pp_layers_per_stage's, else the cost model's at --seq_len
    (parallel/pipeline/partition.py); None without a pipeline."""
    interleaved, v_shape = args.pp_schedule == "interleaved_1f1b", args.pp_schedule in ("zbv", "dualpipev")
    if args.pp_virtual_stages is not None and not (interleaved or v_shape):
        raise UsageError(
            f"--pp_virtual_stages is for --pp_schedule interleaved_1f1b; {args.pp_schedule} runs "
            f"one chunk per pipeline rank (zbv and dualpipev take --pp_virtual_stages 2)"
        )
    if not dims.pp_enabled:
        if args.pp_schedule != "1f1b" or args.pp_virtual_stages is not None:
            raise UsageError("--pp_schedule and --pp_virtual_stages need --pipeline_parallel_size > 1")
        if args.pp_layers_per_stage is not None:
            raise UsageError("--pp_layers_per_stage needs --pipeline_parallel_size > 1")
        return None
    virtual = args.pp_virtual_stages or 1
    if interleaved and virtual < 2:
        raise UsageError("--pp_schedule interleaved_1f1b needs --pp_virtual_stages V > 1 (model chunks per rank)")
    if v_shape and virtual != 2:
        raise UsageError(f"--pp_schedule {args.pp_schedule} needs --pp_virtual_stages 2 (two chunks per rank in a V)")
    if config.n_layer < dims.pp * virtual:
        raise UsageError(
            f"n_layer ({config.n_layer}) < pipeline_parallel_size x virtual stages = {dims.pp} x "
            f"{virtual}: every pipeline chunk needs at least one Block"
        )
    if args.pp_schedule in ("zb_h1", "zbv", "dualpipev"):
        _check_zero_bubble(args, dims, micro)
    if interleaved and micro % dims.pp:
        raise UsageError(
            f"--pp_schedule interleaved_1f1b needs the step's micro-batches M = total_batch_size / "
            f"(micro_batch_size x seq_len x data_parallel_size) = {micro} to be a multiple of "
            f"--pipeline_parallel_size {dims.pp} (Megatron's rule)"
        )
    if args.implementation == "pytorch" and (args.sequence_parallel or args.enable_loss_parallelism):
        raise UsageError(
            "--implementation pytorch with --pipeline_parallel_size > 1 runs DTensor TP without "
            "--sequence_parallel / --enable_loss_parallelism: their DTensor activations and logits "
            "are not plain tensors torch.distributed.pipelining can send or feed its loss_fn"
        )
    if args.implementation == "pytorch" and args.dtype == "float16":
        raise UsageError(
            "--implementation pytorch with --pipeline_parallel_size > 1 has no fp16 loss scaling "
            "(torch's schedules compute the loss inside step()); use --dtype bfloat16"
        )
    counts = None
    if args.pp_layers_per_stage is not None:
        flag = f"--pp_layers_per_stage {args.pp_layers_per_stage}"
        try:
            counts = tuple(int(n) for n in args.pp_layers_per_stage.split(","))
        except ValueError:
            raise UsageError(f"{flag}: not a comma-separated list of integers (Blocks per chunk)") from None
        reason = check_counts(counts, config.n_layer, dims.pp * virtual)
        if reason:
            raise UsageError(f"{flag} {reason}")
    return _partition(config, dims.pp, virtual, args.seq_len, counts, v_shape)


@functools.lru_cache(maxsize=1024)
def _partition(
    config: GPTConfig, pp: int, virtual: int, seq_len: int, counts: tuple[int, ...] | None, v_shape: bool
) -> tuple[int, ...]:
    """layers_for's Blocks per chunk, once per argument set (the planner checks thousands of layouts that share
    a few partitions, and the cost model builds a Block on meta each time)."""
    return tuple(len(r) for r in layers_for(config, pp, virtual, seq_len, counts, v_shape=v_shape))


def _check_zero_bubble(args: argparse.Namespace, dims: ParallelDims, micro: int) -> None:
    """The zero-bubble schedules: enough micro-batches (zb_h1, zbv: M >= P; dualpipev: M >= 2P), and the layouts
    their split backward is built and tested for (parallel/pipeline/zero_bubble.py: no data parallelism, DDP,
    ZeRO-1/2/3 and
    HSDP, our TP with or without SP and beside them; eager Blocks; the PyTorch twin, torch's
    ScheduleInterleavedZeroBubble / ScheduleZBVZeroBubble / ScheduleDualPipeV, without data parallelism)."""
    name, least = args.pp_schedule, 2 * dims.pp if args.pp_schedule == "dualpipev" else dims.pp
    if micro < least:
        raise UsageError(
            f"--pp_schedule {name} needs the step's micro-batches M = total_batch_size / (micro_batch_size "
            f"x seq_len x data_parallel_size) = {micro} >= "
            + (f"2 x --pipeline_parallel_size = {least}" if least > dims.pp else f"--pipeline_parallel_size {dims.pp}")
        )
    if args.implementation == "pytorch" and (dims.dp_enabled or dims.tp_enabled):
        raise UsageError(
            f"--implementation pytorch --pp_schedule {name} runs without data or tensor parallelism "
            "here: torch's split backward under its DDP / FSDP2 / DTensor TP is not tested; use "
            "--implementation custom"
        )
    if dims.cp_enabled or args.compile:
        raise UsageError(
            f"--pp_schedule {name} does not run under --context_parallel_size or --compile: its split "
            "backward is not tested with ring attention, and torch refuses its own input/weight split "
            "under compile"
        )


def moe_fields(args: argparse.Namespace) -> dict:
    """The model config's mixture-of-experts fields from the flags (model.GPTConfig)."""
    return {
        k: getattr(args, k)
        for k in (
            "moe_num_experts",
            "moe_top_k",
            "moe_every",
            "moe_ffn_hidden",
            "moe_aux_loss_coeff",
            "moe_bias_update_rate",
        )
    }


def _check_experts(args: argparse.Namespace, dims: ParallelDims, config: GPTConfig) -> None:
    """Mixture of experts and expert parallelism: what they need of each other and of the layout."""
    E, K, N = config.moe_num_experts, config.moe_top_k, dims.ep
    if E == 0:
        if N > 1:
            raise UsageError(f"--expert_parallel_size {N} needs an MoE model: pass --moe_num_experts")
        return
    if K > E:
        raise UsageError(f"--moe_top_k {K} > --moe_num_experts {E}: a token cannot pick more experts than exist")
    if not any(config.is_moe(i) for i in range(config.n_layer)):
        raise UsageError(
            f"--moe_every {config.moe_every} with {config.n_layer} Blocks gives no Block experts (the "
            f"first MoE Block would be Block {config.moe_every - 1}): use --moe_every <= {config.n_layer}"
        )
    if E % N:
        raise UsageError(
            f"--moe_num_experts {E} is not divisible by --expert_parallel_size {N}: every EP rank "
            f"holds the same number of experts"
        )
    if N > 1 and args.implementation == "pytorch":
        raise UsageError(
            "--implementation pytorch has no expert-parallel wrapper in torch 2.13: use "
            "--implementation custom with --expert_parallel_size"
        )
    if args.implementation == "pytorch" and dims.pp_enabled:
        raise UsageError(
            "--implementation pytorch --pipeline_parallel_size with --moe_num_experts: torch's "
            "pipelining takes no balancing loss from a chunk; use --implementation custom"
        )


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
    return resume_checkpoint(args.out_dir, config, env_world()[0] == 0, args.optimizer) if args.resume else None


def resume_checkpoint(out_dir: str, config: GPTConfig, report: bool = True, optimizer: str = "adamw") -> str | None:
    """--resume: the newest intact checkpoint in `out_dir` (None if there is none): damaged newer ones are
    skipped with one line each (`report`: rank 0 says it), so a crash mid-write or a flipped byte never stops a
    restart. Refused in one line if it holds another model config or another `optimizer`'s state. Every rank
    verifies and reads the manifest, so every rank decides alike."""
    path = checkpoint.newest_intact(out_dir, (lambda line: print(f"--resume: {line}", flush=True)) if report else None)
    if path is None:
        return None
    try:
        diff = checkpoint.config_mismatch(manifest := checkpoint.read_manifest(path), config)
        optim_flags.check_resume(manifest, optimizer, path, refuse=UsageError)
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
    chunk or None). Raises UsageError. The layout
    planner (plan/) asks it which layouts the trainer accepts, with a world size and device of its choosing.
    `launch`: the hint, for n ranks, when the sizes multiply to another world size than `world_size`."""
    _check_flags(args)
    if world_size % args.pipeline_parallel_size:
        raise UsageError(
            f"--pipeline_parallel_size {args.pipeline_parallel_size} does not divide the world size "
            f"({world_size} ranks)"
        )
    try:
        dims = ParallelDims(
            args.data_parallel_size,
            args.tensor_parallel_size,
            world_size,
            args.pipeline_parallel_size,
            args.data_parallel_replicate_size,
            args.context_parallel_size,
            args.expert_parallel_size,
        )
    except WorldSizeError as e:
        raise UsageError(f"{e}; {launch.format(n=e.needed)}") from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    dtype = resolve_dtype(args.dtype, device)
    if args.compile and device.type == "cpu" and not cxx_compiler():
        raise UsageError(
            "--compile on CPU needs a C++ compiler for inductor and none was found (looked for $CXX, "
            "g++, c++, clang++); install one (Debian/Ubuntu: apt-get install g++) or drop --compile"
        )
    _check_layout(args, dims, dtype)
    config, hf_state = _check_model(args, dims)
    tokens_per_micro = args.micro_batch_size * args.seq_len * dims.dp
    if args.total_batch_size % tokens_per_micro:
        raise UsageError(
            f"--total_batch_size {args.total_batch_size} is not divisible by micro_batch_size x "
            f"seq_len x data_parallel_size = {args.micro_batch_size} x {args.seq_len} x {dims.dp} "
            f"= {tokens_per_micro}"
        )
    pp_layers = _check_pipeline(args, dims, config, args.total_batch_size // tokens_per_micro)
    _check_context(args, dims, config, device)
    _check_experts(args, dims, config)
    optim_flags.check(args, dims, config.moe_num_experts > 0, dtype, refuse=UsageError)
    return dims, config, dtype, hf_state, args.total_batch_size // tokens_per_micro, pp_layers


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
    ft_flags.check(args, dims, grad_accum, refuse=UsageError)  # replica groups: the lighthouse answers; --resume set
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
