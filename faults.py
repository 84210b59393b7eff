"""Fault hooks for the tests, switched on by environment variables; each is a no-op otherwise.

- GPT_INJECT_NAN_AT_STEP=s: before step s every parameter becomes NaN, so the step's loss is NaN on
  every rank (the trainer must stop without saving).
- GPT_KILL_AT_STEP=s: after step s (its eval and checkpoint included) rank GPT_KILL_RANK (default 0, or
  "all") sends itself GPT_KILL_SIGNAL (KILL, or STOP to stall). With GPT_KILL_MARKER=file it happens only
  while that file does not exist (it is created first), i.e. once across torchrun restarts.
- GPT_CKPT_FAIL_AFTER_FILES=n: the n-th checkpoint file this process writes raises, as a full disk would.
- GPT_SIGNAL_AT_STEP=s: in the middle of step s (after its backward, before the optimizer step) rank
  GPT_SIGNAL_RANK (default 0, or "all") sends itself GPT_SIGNAL (TERM or INT), as a cluster preempting it would.
"""
from __future__ import annotations

import os
import signal

import torch

from parallel.comm import local

_files_written = 0  # by this process, for GPT_CKPT_FAIL_AFTER_FILES


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def maybe_inject_nan(step: int, model: torch.nn.Module) -> None:
    if _env_int("GPT_INJECT_NAN_AT_STEP") == step:
        with torch.no_grad():
            for p in model.parameters():
                local(p).fill_(float("nan"))


def maybe_kill(step: int, rank: int) -> None:
    if _env_int("GPT_KILL_AT_STEP") != step:
        return
    who = os.environ.get("GPT_KILL_RANK", "0")
    if who != "all" and int(who) != rank:
        return
    marker = os.environ.get("GPT_KILL_MARKER")
    if marker:
        if os.path.exists(marker):
            return
        with open(marker, "w") as f:
            f.write(f"rank {rank} step {step}\n")
    sig = getattr(signal, "SIG" + os.environ.get("GPT_KILL_SIGNAL", "KILL"))
    print(f"GPT_KILL_AT_STEP={step}: rank {rank} sends itself {sig.name} (test hook)", flush=True)
    os.kill(os.getpid(), sig)


def checkpoint_file_written() -> None:
    global _files_written
    _files_written += 1
    limit = _env_int("GPT_CKPT_FAIL_AFTER_FILES")
    if limit and _files_written >= limit:
        raise RuntimeError(f"GPT_CKPT_FAIL_AFTER_FILES={limit}: injected failure after writing "
                           f"{_files_written} checkpoint files (test hook)")


def maybe_signal_mid_step(step: int, rank: int) -> None:
    if _env_int("GPT_SIGNAL_AT_STEP") != step:
        return
    who = os.environ.get("GPT_SIGNAL_RANK", "0")
    if who == "all" or int(who) == rank:
        os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get("GPT_SIGNAL", "TERM")))
