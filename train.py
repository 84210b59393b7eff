"""Train GPT-2 on one process or many: `python train.py ...` or `torchrun --nproc_per_node=N train.py ...`.

The layout is a 2D mesh (dp x tp). Whatever the layout, step s trains on the same global batch
(data/batches.py) from the same initial weights (model.py), so every layout logs the same losses up to
float rounding. Bad input is reported in one line with exit code 2 on every rank before any work.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from data.batches import BatchSource, micro_batch_chunk, DataError, prepare_hint, resolve_dataset_dir
from model import GPT, PRESETS, GPTConfig, make_config
import checkpoint
import metrics as observe
from parallel import comm
from parallel.mesh import ParallelDims, dp_group, env_world, init_distributed, pick_device
from parallel.parallelize import ParallelConfig, Parallelized, not_implemented, parallelize

HF_MODELS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


class UsageError(ValueError):
    """Bad input: reported as one line, exit code 2, before any work."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise UsageError(message)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description=__doc__.splitlines()[0])
    a = p.add_argument
    # the seed's flags
    a("--tensor_parallel_size", type=int, default=1, help="degree of tensor parallelism")
    a("--enable_loss_parallelism", action="store_true", help="vocab-parallel cross-entropy under TP")
    a("--sequence_parallel", action="store_true", help="TP: LayerNorms/residuals on sequence-sharded activations")
    a("--data_parallel_size", type=int, default=1, help="degree of data parallelism")
    a("--data_parallel_type", choices=["ddp", "fsdp"], default=None, help="required when dp > 1")
    a("--implementation", choices=["custom", "pytorch"], default="custom")
    a("--deferred_init", action="store_true", help="build on meta, materialise after sharding")
    a("--gradient_clipping", action="store_true", help="clip the global gradient norm at 1.0")
    a("--bucket_cap_mb", type=float, default=25.0, help="custom DDP: gradient bucket size")
    a("--grad_compression", choices=["none", "bf16"], default="none", help="custom DDP: bf16 on the wire")
    a("--param_dtype", choices=["float32", "bfloat16", "float16"], default="float32",
      help="FSDP: dtype of the gathered compute copies of the parameters (the master shard stays fp32)")
    a("--reduce_dtype", choices=["float32", "bfloat16", "float16"], default="float32",
      help="FSDP: dtype gradients are reduce-scattered in")
    a("--eval_interval", type=int, default=25)
    a("--dataset", default="shakespeare", help="shakespeare, openwebtext, or a dir with train.bin/val.bin")
    # model
    a("--model", default="gpt2", help=f"preset: {', '.join(PRESETS)}")
    a("--init_from", choices=["scratch", *HF_MODELS], default="scratch", help="start from OpenAI's weights")
    a("--n_layer", type=int)
    a("--n_head", type=int)
    a("--n_embd", type=int)
    a("--block_size", type=int)
    # batch and optimisation
    a("--micro_batch_size", type=int, default=8)
    a("--seq_len", type=int, default=1024)
    a("--total_batch_size", type=int, default=524288, help="tokens per optimizer step")
    a("--max_steps", type=int, default=250)
    a("--lr", type=float, default=6e-4, help="peak; linear warmup then cosine to 10%%")
    a("--warmup_steps", type=int, default=10)
    a("--weight_decay", type=float, default=0.1)
    a("--seed", type=int, default=1337)
    # system
    a("--device", choices=["auto", "cpu", "cuda"], default="auto")
    a("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    a("--out_dir", default=None, help="default: runs/<model>-<dataset>")
    a("--overwrite", action="store_true", help="start afresh in an --out_dir that already holds a run")
    a("--eval_iters", type=int, default=20)
    a("--timeout", type=float, default=600.0, help="seconds a collective may wait before the run fails")
    a("--peak_flops", type=float, default=None,
      help="peak FLOP/s of one device, for MFU (default: datasheet for known GPUs, else measured)")
    a("--profile", type=int, default=0, metavar="N",
      help="write a torch.profiler trace of N steps (after 2 warm-up steps) to <out_dir>/profile")
    # checkpoints and resuming
    a("--checkpoint_interval", type=int, default=0, metavar="N",
      help="save a checkpoint every N steps and at the end, in <out_dir>/checkpoints (default 0: never)")
    a("--keep_checkpoints", type=int, default=3, metavar="K", help="keep the newest K checkpoints (default 3)")
    a("--resume", action="store_true",
      help="continue from the newest complete checkpoint in --out_dir (none there: start fresh)")
    args = p.parse_args(argv)
    if args.out_dir is None:
        args.out_dir = os.path.join("runs", f"{args.model}-{os.path.basename(os.path.normpath(args.dataset))}")
    return args


@dataclass
class Plan:
    """Everything validated from the arguments and the environment, before any process group exists."""
    dims: ParallelDims
    config: GPTConfig
    device: torch.device
    dtype: torch.dtype
    grad_accum: int
    rows: int  # sequences per global batch
    data_dir: str
    rank: int
    hf_state: dict | None = None
    resume_from: str | None = None  # checkpoint directory (--resume found one)


def validate(args: argparse.Namespace) -> Plan:
    """Check the arguments against each other, the environment and the data; raise UsageError."""
    rank, _, world_size = env_world()
    for flag in ("tensor_parallel_size", "data_parallel_size", "micro_batch_size", "seq_len",
                 "total_batch_size", "max_steps", "eval_interval", "eval_iters"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.checkpoint_interval < 0 or args.keep_checkpoints < 1:
        raise UsageError(f"--checkpoint_interval must be >= 0 and --keep_checkpoints >= 1, got "
                         f"{args.checkpoint_interval} and {args.keep_checkpoints}")
    if args.resume and args.overwrite:
        raise UsageError("--resume continues the run in --out_dir and --overwrite discards it: pass one of them")
    try:
        dims = ParallelDims(args.data_parallel_size, args.tensor_parallel_size, world_size)
        device = pick_device(args.device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if dims.dp > 1 and args.data_parallel_type is None:
        raise UsageError(f"--data_parallel_type ddp|fsdp is required with --data_parallel_size {dims.dp}")
    if args.enable_loss_parallelism and dims.tp == 1:
        raise UsageError("--enable_loss_parallelism needs --tensor_parallel_size > 1")
    if args.sequence_parallel and dims.tp == 1:
        raise UsageError("--sequence_parallel needs --tensor_parallel_size > 1")
    if args.sequence_parallel and args.seq_len % dims.tp:
        raise UsageError(f"--sequence_parallel needs --seq_len ({args.seq_len}) divisible by "
                         f"--tensor_parallel_size ({dims.tp})")

    hf_state = None
    if args.init_from != "scratch":
        hf_state = fetch_hf_weights(args.init_from)
        config = GPT.from_hf_state_dict(hf_state).config
    else:
        try:
            config = make_config(args.model, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                                 block_size=args.block_size)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if config.n_embd % config.n_head:
        raise UsageError(f"n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")
    for what, n in (("n_head", config.n_head), ("n_embd", config.n_embd), ("vocab_size", config.vocab_size)):
        if n % dims.tp:
            raise UsageError(f"{what} ({n}) is not divisible by --tensor_parallel_size {dims.tp}")
    if args.seq_len > config.block_size:
        raise UsageError(f"--seq_len {args.seq_len} exceeds the model's block_size {config.block_size}")
    tokens_per_micro = args.micro_batch_size * args.seq_len * dims.dp
    if args.total_batch_size % tokens_per_micro:
        raise UsageError(f"--total_batch_size {args.total_batch_size} is not divisible by micro_batch_size x "
                         f"seq_len x data_parallel_size = {args.micro_batch_size} x {args.seq_len} x {dims.dp} "
                         f"= {tokens_per_micro}")
    dtype = resolve_dtype(args.dtype, device)
    cfg = parallel_config(args, dtype)
    reason = not_implemented(dims, cfg)
    if reason:
        raise UsageError(reason)
    if args.deferred_init and hf_state is not None:
        raise UsageError("--deferred_init builds a fresh model; it cannot be combined with --init_from")
    data_dir = resolve_dataset_dir(args.dataset)
    if not os.path.isdir(data_dir):
        raise UsageError(f"dataset {args.dataset!r}: no directory {data_dir}; prepare it with: "
                         f"{prepare_hint(args.dataset)}")
    try:
        BatchSource(data_dir, args.seq_len, config.vocab_size, args.seed, prepare_hint(args.dataset))
    except DataError as e:
        raise UsageError(str(e)) from None
    metrics = os.path.join(args.out_dir, "metrics.jsonl")
    held = metrics if os.path.exists(metrics) else (checkpoint.newest(args.out_dir) or None)
    if held and not (args.overwrite or args.resume):
        raise UsageError(f"{args.out_dir} already holds a run ({held}); pass --resume to continue it, "
                         f"--overwrite to start afresh, or choose another --out_dir")
    resume_from = resume_checkpoint(args, config) if args.resume else None
    return Plan(dims, config, device, dtype, args.total_batch_size // tokens_per_micro,
                args.total_batch_size // args.seq_len, data_dir, rank, hf_state, resume_from)


def resume_checkpoint(args: argparse.Namespace, config: GPTConfig) -> str | None:
    """--resume: the newest complete checkpoint in --out_dir (None if there is none), refused in one line
    if it holds another model config. Every rank reads the manifest, so every rank refuses alike."""
    path = checkpoint.newest(args.out_dir)
    if path is None:
        return None
    try:
        diff = checkpoint.config_mismatch(checkpoint.read_manifest(path), config)
    except checkpoint.CheckpointError as e:
        raise UsageError(f"--resume: {e}") from None
    except KeyError as e:
        raise UsageError(f"--resume: {path}: the manifest has no {e} entry") from None
    if diff:
        raise UsageError(f"--resume: checkpoint {path} holds another model config ({diff}); resume with the "
                         f"same --model/--n_layer/--n_head/--n_embd/--block_size, or choose another --out_dir")
    return path


def fetch_hf_weights(name: str) -> dict:
    """OpenAI's GPT-2 weights through transformers' hub cache; one clear error when they can't be had.

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
        raise UsageError(f"--init_from {name}: could not fetch the weights from the Hugging Face hub "
                         f"({type(e).__name__}); this needs internet access or a populated HF cache") from None


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': bf16 on a GPU that has it, fp16 (with a GradScaler) on one that doesn't, fp32 on CPU."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return getattr(torch, name)


def parallel_config(args: argparse.Namespace, dtype: torch.dtype) -> ParallelConfig:
    return ParallelConfig(dp_type=args.data_parallel_type if args.data_parallel_size > 1 else None,
                          implementation=args.implementation, loss_parallel=args.enable_loss_parallelism,
                          sequence_parallel=args.sequence_parallel,
                          param_dtype=None if args.param_dtype == "float32" else getattr(torch, args.param_dtype),
                          reduce_dtype=getattr(torch, args.reduce_dtype),
                          deferred_init=args.deferred_init, seed=args.seed, bucket_cap_mb=args.bucket_cap_mb,
                          grad_compression=None if args.grad_compression == "none" else args.grad_compression)


# ----------------------------------------------------------------------------- building

@dataclass
class Trainer:
    args: argparse.Namespace
    plan: Plan
    mesh: object
    par: Parallelized
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    data: BatchSource
    dp_rank: int
    flops_per_token: float = 0.0
    peak_flops: float = 0.0

    @property
    def model(self) -> torch.nn.Module:
        return self.par.model


def build(args: argparse.Namespace, plan: Plan) -> Trainer:
    """Join the process group, build the model (on meta if deferred), parallelise it, make the optimizer."""
    torch.manual_seed(args.seed)
    mesh = init_distributed(plan.dims, plan.device, args.timeout)
    if plan.hf_state is not None:
        model = GPT.from_hf_state_dict(plan.hf_state).to(plan.device)
    elif args.deferred_init:
        with torch.device("meta"):
            model = GPT(plan.config)
    else:
        model = GPT(plan.config)
        model.init_weights(args.seed, plan.device)
    par = parallelize(model, mesh, plan.dims, parallel_config(args, plan.dtype), plan.device)
    groups = par.param_groups(args.weight_decay)
    fused = plan.device.type == "cuda" and not any(_is_dtensor(p) for p in par.model.parameters())
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)
    scaler = torch.amp.GradScaler(plan.device.type) if plan.dtype == torch.float16 else None
    data = BatchSource(plan.data_dir, args.seq_len, plan.config.vocab_size, args.seed)
    dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
    with torch.device("meta"):
        n_params = GPT(plan.config).num_params(non_embedding=True)
    peak = args.peak_flops or observe.peak_flops(plan.device, plan.dtype)
    return Trainer(args, plan, mesh, par, optimizer, scaler, data, dp_rank,
                   observe.flops_per_token(plan.config, n_params, args.seq_len), peak)


def _is_dtensor(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(p, DTensor)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup over warmup_steps, then cosine decay to 10% of --lr at max_steps (step is 1-based)."""
    it = step - 1
    if it < args.warmup_steps:
        return args.lr * (it + 1) / args.warmup_steps
    progress = (it - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    return args.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


# ----------------------------------------------------------------------------- one step

def _loss_context(t: Trainer):
    if t.args.enable_loss_parallelism and t.args.implementation == "pytorch":
        from torch.distributed.tensor.parallel import loss_parallel
        return loss_parallel()
    return contextlib.nullcontext()


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if _is_dtensor(x) else x


def _no_sync(t: Trainer, last: bool):
    """DDP communicates only on the last micro-step. FSDP reduce-scatters every micro-step: its no_sync
    would keep a full unsharded gradient per rank, undoing the point of sharding."""
    if not last and t.args.data_parallel_type == "ddp" and t.plan.dims.dp > 1:
        return t.model.no_sync()
    return contextlib.nullcontext()


def _mean_over_dp(t: Trainer, value: torch.Tensor) -> torch.Tensor:
    """Average a scalar over data-parallel ranks (SUM then divide: works on every backend)."""
    if t.mesh is not None and t.plan.dims.dp > 1:
        dist.all_reduce(value, group=dp_group(t.mesh))
        value = value / t.plan.dims.dp
    return value


def train_step(t: Trainer, step: int) -> dict:
    """One optimizer step over the global batch of `step`; returns this step's metrics."""
    args, plan = t.args, t.plan
    lr = lr_at(step, args)
    for group in t.optimizer.param_groups:
        group["lr"] = lr
    comm.COUNTER.reset()
    t0 = time.perf_counter()
    loss_sum = torch.zeros((), device=plan.device)
    autocast = torch.autocast(plan.device.type, dtype=plan.dtype, enabled=plan.dtype != torch.float32)
    for micro in range(plan.grad_accum):
        chunk = micro_batch_chunk(micro, t.dp_rank, plan.dims.dp)
        x, y = t.data.get("train", step, plan.rows, chunk, args.micro_batch_size)
        x, y = x.to(plan.device, non_blocking=True), y.to(plan.device, non_blocking=True)
        with _no_sync(t, micro == plan.grad_accum - 1), _loss_context(t):
            with autocast:
                _, loss = t.model(x, y)
            loss = loss / plan.grad_accum
            (t.scaler.scale(loss) if t.scaler else loss).backward()
        loss_sum += _local(loss).detach()
    if t.scaler:
        t.scaler.unscale_(t.optimizer)
    clip = 1.0 if args.gradient_clipping else None
    norm = t.par.clip_grad_norm_(clip)
    if t.scaler:
        t.scaler.step(t.optimizer)
        t.scaler.update()
    else:
        t.optimizer.step()
    comm_bytes = comm.COUNTER.snapshot()  # before the scalar reductions below, which are not wrapper traffic
    loss = _mean_over_dp(t, loss_sum)
    loss_value, norm_value = loss.item(), float(norm)  # .item() synchronises the device, so dt is honest
    dt = time.perf_counter() - t0
    state = t.par.state_bytes(t.optimizer)  # gradients still allocated: the step's true peak state
    t.optimizer.zero_grad(set_to_none=True)
    tokens_per_sec = args.total_batch_size / dt
    metrics = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": norm_value,
               "step_time_ms": dt * 1000, "tokens_per_sec": tokens_per_sec,
               "mfu": t.flops_per_token * tokens_per_sec / (t.peak_flops * plan.dims.world_size),
               "peak_memory_bytes": observe.peak_memory_bytes(plan.device), "state_bytes": state}
    if args.implementation == "custom" and plan.dims.world_size > 1:
        metrics["comm_bytes"] = comm_bytes
    return metrics


@torch.no_grad()
def evaluate(t: Trainer) -> float:
    """Mean loss over the --eval_iters validation micro-batches of one fixed batch (the same at every
    eval, and in every layout). Chunks go round-robin over dp ranks; a rank left without one runs the
    last chunk again with weight 0, so every rank makes the same collective calls."""
    args, plan = t.args, t.plan
    dp, mb = plan.dims.dp, args.micro_batch_size
    t.model.eval()
    total = torch.zeros((), device=plan.device)
    autocast = torch.autocast(plan.device.type, dtype=plan.dtype, enabled=plan.dtype != torch.float32)
    for i in range(math.ceil(args.eval_iters / dp)):
        chunk = i * dp + t.dp_rank
        x, y = t.data.get("val", 0, args.eval_iters * mb, min(chunk, args.eval_iters - 1), mb)
        with _loss_context(t), autocast:
            _, loss = t.model(x.to(plan.device), y.to(plan.device))
        total += _local(loss).detach().float() * (chunk < args.eval_iters)
    t.model.train()
    return (_mean_over_dp(t, total) * dp / args.eval_iters).item()


# ----------------------------------------------------------------------------- logging and main

class Logger:
    """Rank 0 writes metrics.jsonl (one JSON object per line) and TensorBoard scalars under --out_dir."""

    def __init__(self, out_dir: str, enabled: bool, append: bool = False):
        self.enabled = enabled
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        self.file = open(os.path.join(out_dir, "metrics.jsonl"), "a" if append else "w")
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(out_dir)
        except ImportError:
            self.tb = None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])
                elif isinstance(v, dict):
                    for kk, vv in v.items():
                        self.tb.add_scalar(f"{k}/{kk}", vv, record["step"])

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()


def describe(t: Trainer) -> str:
    d, a = t.plan.dims, t.args
    layout = f"dp={d.dp}" + (f" ({a.data_parallel_type})" if d.dp > 1 else "") + f" tp={d.tp}"
    with torch.device("meta"):
        n = GPT(t.plan.config).num_params()
    return (f"{a.implementation} {layout} on {t.plan.device} {str(t.plan.dtype).removeprefix('torch.')} | "
            f"{n / 1e6:.1f}M params | grad_accum {t.plan.grad_accum} x micro_batch {a.micro_batch_size} "
            f"x seq_len {a.seq_len} | MFU against {t.peak_flops / 1e9:.1f} GFLOP/s per device")


def progress_bar(total: int, is_main: bool):
    """A tqdm bar when stdout is a terminal (rank 0 only); plain lines otherwise."""
    if not (is_main and sys.stdout.isatty()):
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="step", dynamic_ncols=True)


def say(bar, line: str, is_main: bool) -> None:
    if bar is not None:
        bar.set_description_str(line.split(" | dt")[0])
        if "val loss" not in line:
            bar.update(1)
        else:
            bar.write(line)
    elif is_main:
        print(line, flush=True)


def make_profiler(args: argparse.Namespace):
    """--profile N: a torch.profiler trace of N steps after 2 warm-up steps, for TensorBoard or Perfetto."""
    if not args.profile:
        return None
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities, schedule=schedule(wait=0, warmup=2, active=args.profile, repeat=1),
                   on_trace_ready=tensorboard_trace_handler(os.path.join(args.out_dir, "profile")),
                   record_shapes=True, with_stack=False)
    prof.start()
    return prof


# ----------------------------------------------------------------------------- checkpoints

MATH_ARGS = ("seed", "lr", "warmup_steps", "max_steps", "weight_decay", "total_batch_size", "seq_len",
             "gradient_clipping", "grad_compression", "param_dtype", "reduce_dtype", "init_from",
             "dataset")  # stored with each checkpoint; a resume with other values says so


def save_checkpoint(t: Trainer, step: int) -> str:
    """Collective: every rank writes its elements of the state after `step` (format: checkpoint.py)."""
    a, d = t.args, t.plan.dims
    extra = {"config": {"model": asdict(t.plan.config),
                        "train": {**{k: getattr(a, k, None) for k in MATH_ARGS},
                                  "dtype": str(t.plan.dtype).removeprefix("torch.")}},
             "layout": {"world_size": d.world_size, "dp": d.dp, "tp": d.tp, "implementation": a.implementation,
                        "dp_type": a.data_parallel_type if d.dp > 1 else None}}
    if t.scaler is not None:
        extra["scaler"] = t.scaler.state_dict()
    return checkpoint.save(a.out_dir, step, t.par.checkpoint_entries(t.optimizer), t.optimizer, extra,
                           rank=t.plan.rank, world_size=d.world_size, keep=a.keep_checkpoints,
                           device=t.plan.device)


def restore_checkpoint(t: Trainer) -> int:
    """Load --resume's checkpoint (saved in any layout) into this one; returns its step. The data position
    is the step itself: batches are a pure function of (seed, step)."""
    path = t.plan.resume_from
    m = checkpoint.load(path, t.par.checkpoint_entries(t.optimizer), t.optimizer, rank=t.plan.rank,
                        world_size=t.plan.dims.world_size, device=t.plan.device)
    if t.scaler is not None and "scaler" in m:
        t.scaler.load_state_dict(m["scaler"])
    if t.plan.rank == 0:
        lay = m["layout"]
        print(f"resuming from {path} (saved by {lay['implementation']} dp={lay['dp']}"
              f"{' (' + lay['dp_type'] + ')' if lay['dp_type'] else ''} tp={lay['tp']}): continuing at step "
              f"{m['step'] + 1}" + (f" (nothing left: --max_steps {t.args.max_steps})"
                                    if m["step"] >= t.args.max_steps else ""), flush=True)
        saved = m["config"]["train"]
        changed = [f"--{k} {saved.get(k)!r} -> {getattr(t.args, k, None)!r}" for k in MATH_ARGS
                   if saved.get(k) != getattr(t.args, k, None)]
        if changed:
            print(f"note: arguments differ from the checkpoint's run, so losses will differ from an "
                  f"uninterrupted run: {', '.join(changed)}", flush=True)
    return int(m["step"])


def warn_shared_rendezvous_store() -> None:
    """torchrun --max-restarts: by default the restarted workers join through the launcher's rendezvous
    store, which still holds the previous attempt's process-group keys, so a restarted rank can read a dead
    peer's address and fail or hang (torch 2.13). A fresh store per attempt avoids it."""
    if (os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0"
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        print("warning: torchrun --max-restarts without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a restarted job "
              "may read the previous attempt's peer addresses and fail or hang; export it before torchrun",
              file=sys.stderr, flush=True)


def is_finite_step(t: Trainer, m: dict) -> bool:
    """A finite loss, and a finite gradient norm unless a GradScaler (which skips such steps) is in use."""
    return math.isfinite(m["loss"]) and (t.scaler is not None or math.isfinite(m["grad_norm"]))


def is_comm_failure(e: BaseException) -> bool:
    """A collective that timed out or lost its peer (gloo and NCCL raise RuntimeErrors that say so)."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(s in text for s in (
        "gloo", "NCCL", "Timed out", "timed out", "Connection reset", "Connection closed", "Broken pipe"))


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        plan = validate(args)
    except UsageError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    t = build(args, plan)
    is_main = plan.rank == 0
    if args.overwrite and is_main:  # a fresh run: old checkpoints must not be resumed into it later
        shutil.rmtree(os.path.join(args.out_dir, checkpoint.SUBDIR), ignore_errors=True)
    logger = Logger(args.out_dir, is_main, append=args.resume)  # a resumed run appends to metrics.jsonl
    if is_main:
        print(describe(t), flush=True)
        warn_shared_rendezvous_store()
    step = 0
    try:
        step = start = restore_checkpoint(t) if plan.resume_from else 0
        if args.resume and not plan.resume_from and is_main:
            print(f"--resume: no complete checkpoint in {os.path.join(args.out_dir, checkpoint.SUBDIR)}; "
                  f"starting fresh", flush=True)
        if start == 0:  # a resumed run skips it: its checkpoint step's eval was logged before the save
            val = evaluate(t)
            logger.log({"step": 0, "val_loss": val})
            if is_main:
                print(f"step 0 | val loss {val:.4f}", flush=True)
        bar = progress_bar(args.max_steps - start, is_main)
        profiler = make_profiler(args)
        for step in range(start + 1, args.max_steps + 1):
            checkpoint.maybe_inject_nan(step, t.model)  # test hook: GPT_INJECT_NAN_AT_STEP
            m = train_step(t, step)
            logger.log(m)
            if profiler is not None:
                profiler.step()
            line = (f"step {step} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | norm {m['grad_norm']:.3f} | "
                    f"dt {m['step_time_ms']:.0f}ms | tok/s {m['tokens_per_sec']:.0f} | mfu {100 * m['mfu']:.1f}%")
            say(bar, line, is_main)
            if not is_finite_step(t, m):  # the same all-reduced numbers on every rank: all stop together
                if is_main:
                    print(f"train.py: error: step {step}: loss {m['loss']} / grad norm {m['grad_norm']} is not "
                          f"finite; stopped without saving it. The newest checkpoint is "
                          f"{checkpoint.newest(args.out_dir) or 'none'}", file=sys.stderr, flush=True)
                return 3
            if step % args.eval_interval == 0 or step == args.max_steps:
                val = evaluate(t)
                logger.log({"step": step, "val_loss": val})
                say(bar, f"step {step} | val loss {val:.4f}", is_main)
            if args.checkpoint_interval and (step % args.checkpoint_interval == 0 or step == args.max_steps):
                save_checkpoint(t, step)
            checkpoint.maybe_kill(step, plan.rank)  # test hook: GPT_KILL_AT_STEP
        if profiler is not None:
            profiler.stop()
        if dist.is_initialized():
            dist.barrier()  # no rank tears the group down while a peer still has collectives in flight
    except checkpoint.CheckpointError as e:
        print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    except RuntimeError as e:
        if plan.dims.world_size == 1 or not is_comm_failure(e):
            raise
        print(f"train.py: error: rank {plan.rank}: a collective failed at step {step} (--timeout {args.timeout:g}s): "
              f"a peer rank was lost or stalled; restart with --resume to continue from "
              f"{checkpoint.newest(args.out_dir) or 'the start'} [{str(e).strip().splitlines()[0][:200]}]",
              file=sys.stderr, flush=True)
        return 4
    finally:
        logger.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Gloo worker threads outlive destroy_process_group() while anything still references their group (FSDP2's
    # DeviceMesh, kept by DTensor's caches, holds it in _pg_registry). One that drops the last reference to a
    # Python-owned tensor after interpreter finalization has begun is killed mid-destructor:
    # "terminate called without an active exception" (SIGABRT). Everything is flushed and closed: skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
