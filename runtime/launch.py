"""How a rank's process starts and ends: who it is in torchrun's job (`env_world`), the environment for launching a
separate job from inside one (`child_env`), and the exit that a rank takes once its work is done (`exit_process`).
Above parallel/: the runtime never starts or ends a process.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def env_world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) for a plain `python`."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
)


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without torchrun's variables (plus `extra`), for launching a separate job:
    a run started from inside a torchrun rank must not join that rank's job."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
    env.update(extra)
    return env


def exit_process(code: int) -> NoReturn:
    """End this rank's process now, with `code`, skipping the interpreter's finalization. Call it last, once
    everything is flushed and closed and the group destroyed. Gloo's threads outlive destroy_process_group()
    while anything still references their group (FSDP2's DeviceMesh, kept by DTensor's caches, holds it in
    _pg_registry); one that drops the last reference to a Python-owned tensor after finalization has begun is
    killed mid-destructor: "terminate called without an active exception", SIGABRT, though the work is done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
