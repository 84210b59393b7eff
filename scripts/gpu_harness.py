"""What the one-GPU check's stages share (scripts/gpu_check.py, scripts/gpu_measure.py): the setups, the report
rows (printed, and appended to the report, as each is made), in-process trainers on a one-rank mesh whose dims are
switched on at size 1, forced collectives, and the memory released between builds."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass, field, replace
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from parallel.mesh import MeshDim, ParallelDims  # noqa: E402

BF16_U = 2.0**-8  # bf16 unit roundoff: 8 significand bits
# Loss tolerances, relative to the CPU fp32 run. bf16: 2u, one rounding of the matmul inputs (u) plus, on a
# GPU, one of fused attention's bf16 softmax probabilities (u). Measured on CPU bf16 autocast for the GPU
# setup's model: at most 1e-4 (0.03 u) over its 6 steps, so 2u has margin and still catches a real bug (a wrong
# gradient or a lost reduction moves the loss by far more). fp32 across devices: summation order only.
RTOL = {torch.bfloat16: 2 * BF16_U, torch.float32: 1e-4}
SAME_RTOL = 1e-6  # forced collectives vs short-circuited: identities on one rank, expected bit-equal
CP_RTOL = 1e-5  # fp32 attention by two kernels (block-merged vs one softmax): summation order only, as on CPU


RECIPE = os.path.join(ROOT, "configs", "gpt2-124m.toml")


def recipe_flags(path: str = RECIPE) -> list[str]:
    """train.py flags of one rank of the GPT-2 124M recipe for one micro-step: its model, micro-batch, sequence,
    dtype, compile and optimizer settings, one rank (no data parallelism), a step of one micro-batch."""
    import tomllib

    with open(path, "rb") as f:
        r = tomllib.load(f)
    flags = ["--model", r["model"], "--micro_batch_size", str(r["micro_batch_size"]), "--seq_len", str(r["seq_len"])]
    flags += ["--total_batch_size", str(r["micro_batch_size"] * r["seq_len"]), "--dtype", r["dtype"]]
    flags += ["--lr", str(r["lr"]), "--weight_decay", str(r["weight_decay"])]
    return flags + ["--compile"] * bool(r.get("compile")) + ["--gradient_clipping"] * bool(r.get("gradient_clipping"))


@dataclass(frozen=True)
class Setup:
    device: str
    dtype: str  # compute dtype of the wrapper and resume stages
    throughput: list[str]  # flags of the real-size stage's model on the CPU (on CUDA: gpu_measure.GPT2_FLAGS)
    small: list[str]  # flags of the model the other stages train
    steps: int  # steps of the wrapper, fp16 and resume stages
    recipe: list[str]  # train.py flags of the end-to-end compiled run (the recipe's micro-batch on CUDA)
    recipe_steps: int
    fp16: list[str]  # flags of the fp16 stage: on CUDA GPT-2's vocabulary and 16k rows a micro-batch


SMALL = [
    "--model",
    "small",
    "--n_layer",
    "4",
    "--micro_batch_size",
    "4",
    "--seq_len",
    "128",
    "--total_batch_size",
    "1024",
]
GPU = Setup(
    "cuda",
    "bfloat16",
    ["--model", "gpt2", "--micro_batch_size", "16", "--seq_len", "1024", "--total_batch_size", "32768"],
    SMALL,
    steps=6,
    recipe=recipe_flags(),
    recipe_steps=10,
    fp16=[
        "--model",
        "small",
        "--n_layer",
        "4",
        "--vocab_size",
        "50304",
        "--micro_batch_size",
        "16",
        "--seq_len",
        "1024",
    ]
    + ["--total_batch_size", "16384"],
)
TINY = ["--model", "tiny", "--vocab_size", "512"]  # the stand-in corpus's 512 tokens: a 50304-way head would dominate
DRY = Setup(
    "cpu",
    "float32",
    [*TINY, "--micro_batch_size", "2", "--seq_len", "64", "--total_batch_size", "256"],
    [*TINY, "--micro_batch_size", "2", "--seq_len", "32", "--total_batch_size", "128"],
    steps=4,
    recipe=[*TINY, "--micro_batch_size", "2", "--seq_len", "64", "--total_batch_size", "128", "--compile"],
    recipe_steps=3,
    # 4x the corpus's 512 tokens: the loss falls within 8 steps as the unused logits drop (at 512 it stays near ln 512)
    fp16=[*TINY[:2], "--vocab_size", "2048", "--micro_batch_size", "2", "--seq_len", "32", "--total_batch_size", "128"],
)
COMMON = ["--lr", "3e-3", "--warmup_steps", "2", "--eval_interval", "1000", "--eval_iters", "1", "--gradient_clipping"]


@dataclass
class Row:
    check: str
    status: str  # ok | FAIL | skip; goals (reported, never failing): met | missed
    detail: str


@dataclass
class Context:
    setup: Setup
    tmp: str
    data: str
    rows: list[Row] = field(default_factory=list)
    cpu_losses: list[float] | None = None
    measured: dict = field(default_factory=dict)  # stage -> numbers, for the JSON report
    report_md: str | None = None  # each row is appended to this markdown table as it is made (a cut run keeps them)

    def add(self, check: str, ok: bool | None, detail: str) -> None:
        self._emit(Row(check, "skip" if ok is None else ("ok" if ok else "FAIL"), detail))

    def goal(self, check: str, met: bool | None, detail: str) -> None:
        self._emit(Row(check, "skip" if met is None else ("met" if met else "missed"), detail))

    def _emit(self, row: Row) -> None:
        """Keep the row for the final table, print it now, and append it to the report on disk now."""
        self.rows.append(row)
        print(f"   [{row.status}] {row.check}: {row.detail}", flush=True)
        if self.report_md is not None:
            with open(self.report_md, "a") as f:
                f.write(md_row(row) + "\n")

    def out_dir(self, name: str) -> str:
        return os.path.join(self.tmp, name)


def md_row(r: Row) -> str:
    return f"| {r.check} | {r.status} | {r.detail.replace('|', '/')} |"


# ----------------------------------------------------------------------------- in-process trainers


def make_plan(ctx: Context, name: str, flags: list[str], device: str, dtype: str, steps: int, *extra: str):
    from trainer.config import parse_args, validate

    return validate(
        parse_args(
            [
                *flags,
                *COMMON,
                "--dataset",
                ctx.data,
                "--device",
                device,
                "--dtype",
                dtype,
                "--max_steps",
                str(steps),
                "--out_dir",
                ctx.out_dir(name),
                *extra,
            ]
        )
    )


class _ForcedOne(int):
    """1 that is not `== 1`: parallel/comm.py and the wrappers skip their one-rank short-cut and issue the
    collectives, while every division, split and `> 1` test still sees 1."""

    def __eq__(self, other):
        return False

    def __ne__(self, other):
        return True

    __hash__ = int.__hash__


@contextlib.contextmanager
def forced_collectives(on: bool):
    """With `on`, parallel.comm.world reports a one-rank group as _ForcedOne (see there)."""
    if not on:
        yield
        return
    from parallel import comm

    real = comm.world

    def world(group):
        n = real(group)
        return _ForcedOne(1) if n == 1 and dist.is_initialized() else n

    with mock.patch.object(comm, "world", world):
        yield


class OneRankMesh:
    """The one-rank run's Mesh (parallel/mesh.py), but with the dims in `on` enabled at size 1, so parallelize
    applies their wrappers (whose collectives over one rank then short-circuit, or are forced to run)."""

    def __init__(self, mesh, on: set[str]):
        self.mesh, self.on = mesh, on

    def __getattr__(self, name):
        return getattr(self.mesh, name)

    def __getitem__(self, name: str):
        dim = self.mesh[name]
        return _EnabledDim(**vars(dim)) if name in self.on else dim


@dataclasses.dataclass(frozen=True)
class _EnabledDim(MeshDim):
    @property
    def enabled(self) -> bool:
        return True


DATA_DIMS = frozenset({"loss", "fsdp", "batch"})  # what a data-parallel wrapper needs switched on


def build_on(spec, mesh, on: set[str], **par_changes):
    """train.build on one rank with the mesh dims in `on` enabled at size 1 (init_distributed hands that mesh
    over) and the run's ParallelConfig changed by `par_changes` (always our own wrappers), so parallelize
    applies the wrappers those dims switch on."""
    import train

    parallel = replace(spec.parallel, implementation="custom", **par_changes)
    with mock.patch.object(train, "init_distributed", lambda *a, **k: OneRankMesh(mesh, set(on))):
        return train.build(replace(spec, parallel=parallel))


def build_wrapped(spec, mesh, dp_type: str | None, tp: bool, param_dtype: torch.dtype | None):
    """build_on with the data dims (loss, fsdp, batch) on for `dp_type`, and/or tp."""
    on = (set(DATA_DIMS) if dp_type is not None else set()) | ({"tp"} if tp else set())
    return build_on(spec, mesh, on, dp_type=dp_type, param_dtype=param_dtype)


def train_losses(t, steps: int) -> tuple[list[float], list[dict]]:
    """train.train_step for steps 1..steps; (losses, per-step comm bytes as parallel/comm.COUNTER saw them)."""
    import train
    from parallel import comm

    losses, comm_bytes = [], []
    for step in range(1, steps + 1):
        losses.append(train.train_step(t, step)["loss"])
        comm_bytes.append(comm.COUNTER.snapshot())  # train_step counts nothing after its own snapshot
    return losses, comm_bytes


def max_rel(a: list[float], b: list[float]) -> float:
    return (
        max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=math.inf) if len(a) == len(b) else math.inf
    )


def init_one_rank_group(device: torch.device) -> str:
    """A world-size-1 default process group on `device` (NCCL on CUDA, gloo on the CPU), as the stages and the
    preflight (scripts/gpu_preflight.py) make it; returns the backend."""
    from runtime.device import backend_for
    from tests.harness import free_port

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        device_id=device if device.type == "cuda" else None,
    )
    return dist.get_backend()


def one_rank_mesh(device: torch.device):
    """A world-size-1 process group (init_one_rank_group, once) and the run's Mesh over it (every dim size 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.mesh import DIMS, Mesh

    if not dist.is_initialized():
        init_one_rank_group(device)
    return Mesh(ParallelDims(1, 1, 1), init_device_mesh(device.type, (1,) * len(DIMS), mesh_dim_names=DIMS))


def release_memory(device: torch.device) -> None:
    """Before a build: collect the trainers of earlier builds (a model's hooks hold it in reference cycles) and give
    their cached blocks back to the device (the device's own module, `torch.get_device_module`: the CUDA caching
    allocator's empty_cache; the CPU keeps no cache), so each build's reserved memory is its own."""
    gc.collect()
    module = torch.get_device_module(device)
    if hasattr(module, "empty_cache"):
        module.empty_cache()


# ----------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def row_on_error(ctx: Context, check: str):
    """Run the block; if it raises, add a FAIL row `check` with the error's first line (and print the
    traceback), so the stage's other checks still run."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 -- one row per check
        ctx.add(check, False, f"{type(e).__name__}: {first_line(e)}")
        traceback.print_exc()


def child_env(**extra: str) -> dict[str, str]:
    from runtime.launch import child_env as base

    return base(PYTHONUNBUFFERED="1", **extra)


def run_train(
    args: list[str], deterministic: bool = False, env: dict | None = None, eager_compile: bool = False
) -> subprocess.CompletedProcess:
    """`python train.py ARGS`; with `deterministic` the same main() after switching to deterministic kernels (math
    SDPA: the fused attention backwards accumulate with atomics, so two runs differ in bits); with `eager_compile`
    after pointing torch.compile at dynamo's eager backend (the dry run: the plumbing of --compile, not inductor's
    ~30 s CPU compile)."""
    check = [sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py")]
    launcher = (
        check + ["--deterministic-train"]
        if deterministic
        else check + ["--eager-compile-train"]
        if eager_compile
        else [sys.executable, os.path.join(ROOT, "train.py")]
    )
    return subprocess.run(
        launcher + args, cwd=ROOT, capture_output=True, text=True, timeout=600, env=child_env(**(env or {}))
    )


def deterministic_train(argv: list[str]) -> int:
    torch.use_deterministic_algorithms(True, warn_only=True)
    if torch.cuda.is_available():
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    import train

    return train.main(argv)


def eager_compile_train(argv: list[str]) -> int:
    import functools

    torch.compile = functools.partial(torch.compile, backend="eager")
    import train

    return train.main(argv)


def read_jsonl(out_dir: str) -> list[dict]:
    from runtime.metrics import read_jsonl as read

    return read(out_dir)


def by_step(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def fmt_bytes(b: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in b.items()) or "none"


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""
