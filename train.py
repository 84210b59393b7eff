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
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from data.batches import BatchSource, DataError, prepare_hint, resolve_dataset_dir
from model import GPT, PRESETS, GPTConfig, make_config, param_groups
import metrics as observe
from parallel import comm
from parallel.mesh import ParallelDims, dp_group, env_world, init_distributed, pick_device
from parallel.parallelize import ParallelConfig, Parallelized, clip_grad_norm_, not_implemented, parallelize

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
    a("--data_parallel_size", type=int, default=1, help="degree of data parallelism")
    a("--data_parallel_type", choices=["ddp", "fsdp"], default=None, help="required when dp > 1")
    a("--implementation", choices=["custom", "pytorch"], default="custom")
    a("--deferred_init", action="store_true", help="build on meta, materialise after sharding")
    a("--gradient_clipping", action="store_true", help="clip the global gradient norm at 1.0")
    a("--bucket_cap_mb", type=float, default=25.0, help="custom DDP: gradient bucket size")
    a("--grad_compression", choices=["none", "bf16"], default="none", help="custom DDP: bf16 on the wire")
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


def validate(args: argparse.Namespace) -> Plan:
    """Check the arguments against each other, the environment and the data; raise UsageError."""
    rank, _, world_size = env_world()
    for flag in ("tensor_parallel_size", "data_parallel_size", "micro_batch_size", "seq_len",
                 "total_batch_size", "max_steps", "eval_interval", "eval_iters"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    try:
        dims = ParallelDims(args.data_parallel_size, args.tensor_parallel_size, world_size)
        device = pick_device(args.device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if dims.dp > 1 and args.data_parallel_type is None:
        raise UsageError(f"--data_parallel_type ddp|fsdp is required with --data_parallel_size {dims.dp}")
    if args.enable_loss_parallelism and dims.tp == 1:
        raise UsageError("--enable_loss_parallelism needs --tensor_parallel_size > 1")

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
    if os.path.exists(metrics) and not args.overwrite:
        raise UsageError(f"{args.out_dir} already holds a run ({metrics}); pass --overwrite to start afresh "
                         f"or choose another --out_dir")
    return Plan(dims, config, device, dtype, args.total_batch_size // tokens_per_micro,
                args.total_batch_size // args.seq_len, data_dir, rank, hf_state)


def fetch_hf_weights(name: str) -> dict:
    """OpenAI's GPT-2 weights through transformers' hub cache; one clear error when offline."""
    try:
        from transformers import GPT2LMHeadModel
        return GPT2LMHeadModel.from_pretrained(name).state_dict()
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
    groups = par.param_groups(args.weight_decay) if hasattr(par, "param_groups") else \
        param_groups(par.named_parameters(), args.weight_decay)
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
    if not last and hasattr(t.model, "no_sync") and t.plan.dims.dp > 1:
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
        chunk = micro * plan.dims.dp + t.dp_rank
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
    norm = t.par.clip_grad_norm_(clip) if hasattr(t.par, "clip_grad_norm_") else \
        clip_grad_norm_(t.par.norm_groups, clip)
    if t.scaler:
        t.scaler.step(t.optimizer)
        t.scaler.update()
    else:
        t.optimizer.step()
    comm_bytes = comm.COUNTER.snapshot()  # before the scalar reductions below, which are not wrapper traffic
    loss = _mean_over_dp(t, loss_sum)
    loss_value, norm_value = loss.item(), float(norm)  # .item() synchronises the device, so dt is honest
    dt = time.perf_counter() - t0
    state = observe.state_bytes(t.model, t.optimizer)  # gradients still allocated: the step's true peak state
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
            f"x seq_len {a.seq_len}")


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


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        plan = validate(args)
    except UsageError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    t = build(args, plan)
    is_main = plan.rank == 0
    logger = Logger(args.out_dir, is_main)
    if is_main:
        print(describe(t), flush=True)
    try:
        val = evaluate(t)
        logger.log({"step": 0, "val_loss": val})
        if is_main:
            print(f"step 0 | val loss {val:.4f}", flush=True)
        bar = progress_bar(args.max_steps, is_main)
        profiler = make_profiler(args)
        for step in range(1, args.max_steps + 1):
            m = train_step(t, step)
            logger.log(m)
            if profiler is not None:
                profiler.step()
            line = (f"step {step} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | norm {m['grad_norm']:.3f} | "
                    f"dt {m['step_time_ms']:.0f}ms | tok/s {m['tokens_per_sec']:.0f} | mfu {100 * m['mfu']:.1f}%")
            say(bar, line, is_main)
            if step % args.eval_interval == 0 or step == args.max_steps:
                val = evaluate(t)
                logger.log({"step": step, "val_loss": val})
                say(bar, f"step {step} | val loss {val:.4f}", is_main)
        if profiler is not None:
            profiler.stop()
    finally:
        logger.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
