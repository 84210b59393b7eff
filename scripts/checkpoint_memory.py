"""Peak memory of a checkpoint save and load, over the training state already in memory.

    python scripts/checkpoint_memory.py                       # small and gpt2, one process and FSDP x2
    python scripts/checkpoint_memory.py --models gpt2 --layouts single tp_pytorch

For each preset and layout the trainer is built as train.py builds it (one process, or gloo ranks on
this machine) and takes one training step (gradients, AdamW state): the process's peak RSS so far is the
run's peak without a save ("run peak"). Then, per rank:
- save: `resume.save_trainer` (entries + rank file + manifest, streamed), after one warm-up save;
- async: the same through an `AsyncSaver` (staging its copies, then writing in its thread), waited for;
- load: `resume.restore_trainer` of that checkpoint.
"x run" is the run's peak RSS with the save over the run's peak without it: max(run peak, RSS + save peak)
/ run peak (#55 asks for at most 1.25 on gpt2); "x state" is (RSS + save peak) / RSS, the stricter.
Each is measured as the rise of the kernel's peak RSS (VmHWM, reset through /proc/self/clear_refs just
before) above the RSS before it, i.e. the extra memory the operation needs on top of the model, gradients
and optimizer state (with glibc told to return freed blocks, so the numbers do not depend on what earlier
steps left in the heap). Loading counts the checkpoint's memory-mapped pages it touches. "int64" is the
largest int64 tensor any torch op created meanwhile (indices, runs), recorded by memory.LargestTensor.
Linux (glibc) only.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from runtime.memory import LargestTensor  # noqa: E402

LAYOUTS = {  # name: (ranks, train.py flags)
    "single": (1, []),
    "ddp_custom": (2, ["--implementation", "custom", "--data_parallel_size", "2", "--data_parallel_type", "ddp"]),
    "fsdp_custom": (2, ["--implementation", "custom", "--data_parallel_size", "2", "--data_parallel_type", "fsdp"]),
    "fsdp_pytorch": (2, ["--implementation", "pytorch", "--data_parallel_size", "2", "--data_parallel_type", "fsdp"]),
    "tp_custom": (2, ["--implementation", "custom", "--tensor_parallel_size", "2"]),
    "tp_pytorch": (2, ["--implementation", "pytorch", "--tensor_parallel_size", "2"]),
}
MiB = 2**20


def _status(key: str) -> int:
    """A /proc/self/status memory field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _exact_rss() -> None:
    """Make RSS follow allocations: blocks of 128 KiB and more are mmap'd and unmapped when freed (glibc's
    adaptive threshold would keep them in the heap), and free heap memory is handed back now. Without
    this a save reusing memory an earlier one freed shows no rise at all."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    libc.malloc_trim(0)


def measure(fn) -> dict:
    """{"peak": bytes VmHWM rose above VmRSS, "int64": bytes of the largest int64 tensor} while fn() runs."""
    _exact_rss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    with LargestTensor(lambda t: t.dtype == torch.int64) as mode:
        fn()
    return {"peak": _status("VmHWM") - before, "int64": mode.numel * 8}


def run(rank: int, world: int, model: str, flags: list[str], data: str, out: str) -> dict:
    import dataclasses

    import train
    from checkpoints import checkpoint, entries
    from trainer import config, resume

    args = config.parse_args(
        [
            "--model",
            model,
            "--dataset",
            data,
            "--out_dir",
            out,
            "--micro_batch_size",
            "1",
            "--seq_len",
            "64",
            "--total_batch_size",
            str(64 * world),
            *flags,
        ]
    )
    trainer = train.build(config.validate(args))
    held = sum(
        e.tensors["param"].numel() for e in entries.entries(trainer.parallelized, trainer.optimizer)
    )  # + AdamW state
    _exact_rss()
    train.train_step(trainer, 1)
    run_peak = _status("VmHWM")  # the run's peak without a save
    resume.save_trainer(trainer, 0)  # warm-up: lazy imports, first-use buffers
    state = _status("VmRSS")
    save = measure(lambda: resume.save_trainer(trainer, 1))
    trainer.saver = checkpoint.AsyncSaver(trainer.spec.device)
    async_save = measure(lambda: resume.save_trainer(trainer, 2, wait=True))  # its staging blocks included
    trainer.saver = None
    trainer.spec = dataclasses.replace(trainer.spec, resume_from=checkpoint.step_dir(args.out_dir, 1))
    load = measure(lambda: resume.restore_trainer(trainer))
    ratio = max(run_peak, state + save["peak"]) / run_peak
    return {
        "held": held,
        "state": state,
        "run_peak": run_peak,
        "ratio": ratio,
        "save": save,
        "async": async_save,
        "load": load,
    }


def _spawned(rank: int, world: int, model: str, flags: list[str], data: str, out: str) -> dict:
    return run(rank, world, model, flags, data, out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["small", "gpt2"])
    p.add_argument("--layouts", nargs="+", default=["single", "fsdp_custom"], choices=list(LAYOUTS))
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from tests.harness import make_token_bins, spawn

    print(
        f"{'model':<6} {'layout':<12} {'rank':>4} {'held elems':>11} {'RSS MiB':>8} {'run peak':>9} "
        f"{'save peak':>10} {'x state':>7} {'x run':>6} {'async peak':>11} {'save int64':>11} {'load peak':>10} "
        f"{'load int64':>11}   (MiB)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        data = make_token_bins(os.path.join(tmp, "data"), n_train=20_000, n_val=4_000)
        for model in a.models:
            for layout in a.layouts:
                nproc, flags = LAYOUTS[layout]
                out = os.path.join(tmp, f"{model}-{layout}")
                results = (
                    [run(0, 1, model, flags, data, out)]
                    if nproc == 1
                    else spawn(_spawned, nproc, model, flags, data, out)
                )
                for r, res in enumerate(results):
                    print(
                        f"{model:<6} {layout:<12} {r:>4} {res['held']:>11,} {res['state'] / MiB:>8.0f} "
                        f"{res['run_peak'] / MiB:>9.0f} {res['save']['peak'] / MiB:>10.1f} "
                        f"{(res['state'] + res['save']['peak']) / res['state']:>7.2f} {res['ratio']:>6.2f} "
                        f"{res['async']['peak'] / MiB:>11.1f} {res['save']['int64'] / MiB:>11.1f} "
                        f"{res['load']['peak'] / MiB:>10.1f} {res['load']['int64'] / MiB:>11.1f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
