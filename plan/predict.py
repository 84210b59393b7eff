"""A rank's prediction, in the keys train.py measures each step (state_bytes, state_bytes_by_kind, comm_bytes,
comm_calls, saved_activation_bytes, peak_memory_bytes), so a run logs prediction and measurement side by side:
plan/counts.py's state, saved activations and bytes sent (each concept's terms, through the registry), and
plan/peak.py's peak built on them.
"""

from __future__ import annotations

import argparse

from plan.counts import Setup, comm_by_group, comm_bytes, comm_calls_by_group, saved_activation_bytes, state_bytes
from plan.peak import peak_memory_bytes


def predict(s: Setup, pp_rank: int = 0) -> dict:
    """The keys train.py measures, for global rank 0 of pipeline stage `pp_rank`."""
    state, saved = state_bytes(s, pp_rank), saved_activation_bytes(s, pp_rank)
    out = {
        "state_bytes": sum(state.values()),
        "state_bytes_by_kind": state,
        "saved_activation_bytes": saved,
        "peak_memory_bytes": peak_memory_bytes(s, pp_rank),
    }
    if s.dims.world_size > 1:
        out["comm_bytes"] = comm_bytes(s, pp_rank, comm_by_group)
        out["comm_calls"] = comm_bytes(s, pp_rank, comm_calls_by_group)
    return out


def worst_rank(s: Setup) -> dict:
    """`predict` for the pipeline stage with the highest peak (the one that decides whether a layout fits)."""
    peaks = [peak_memory_bytes(s, r) for r in range(s.dims.pp)]
    return predict(s, peaks.index(max(peaks)))  # the first highest, as max() picks it


def for_run(spec) -> dict | None:
    """train.py's prediction for its own layout (rank 0's), or None for --implementation pytorch (its twins'
    buffers and collectives are torch's, which these formulas do not describe)."""
    if spec.parallel.implementation != "custom":
        return None
    args = argparse.Namespace(**{**vars(spec.args), "device": spec.device.type})  # --device auto, resolved
    return predict(Setup(args, spec.dims, spec.config, spec.dtype, spec.grad_accum, spec.parallel.pp_layers))


def summary(p: dict) -> str:
    """One line for a run's start: predicted state, saved activations, peak and bytes sent per step."""
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    comm = f", sends {mib(sum(p['comm_bytes'].values()))}/step" if "comm_bytes" in p else ""
    return (
        f"predicted (python -m plan): state {mib(p['state_bytes'])}, saved activations "
        f"{mib(p['saved_activation_bytes'])}, peak {mib(p['peak_memory_bytes'])}{comm}"
    )
