"""A schedule printed: `python -m parallel.pipeline_schedule SCHEDULE --pp P --micro M [--virtual V]` prints each
rank's action list (parallel/pipeline_schedule.py) as a grid, the way torch.distributed.pipelining's
_format_pipeline_order prints its schedules. For example `1f1b --pp 2 --micro 4`:

             Rank 0   Rank 1
    Step 00: 0F0      1RECV_F0
    Step 01: 0SEND_F0 1F0
    Step 02: 0F1      1RECV_F1
    Step 03: 0SEND_F1 1B0
    ...

It imports nothing of the pipeline: `grid` reads each action's chunk, kind and micro."""
from __future__ import annotations

import argparse
import sys


def grid(schedule: list[list]) -> str:
    """Each rank's list as a grid, as torch's _format_pipeline_order prints its schedules: a row per position in
    the lists ("Step i"), a column per rank, each action named as torch names it: chunk, kind, micro-batch
    ("0F1": F of chunk 0 on micro-batch 1; "1RECV_F0"; "0SEND_B3"). Rows are positions, not times: rank 1's
    first F sits in the row after its RECV_F, whatever rank 0 runs there."""
    cols = [[f"Rank {r}"] + [f"{a.chunk}{a.kind}{a.micro}" for a in ops] for r, ops in enumerate(schedule)]
    n = max(len(col) for col in cols) - 1
    cols = [col + [""] * (n + 1 - len(col)) for col in cols]
    widths = [max(map(len, col)) for col in cols]
    labels = [" " * (len(f"Step {n - 1}") + 1)] + [f"Step {i:0{len(str(n - 1))}d}:" for i in range(n)]
    return "".join((label + " " + " ".join(col[i].ljust(w) for col, w in zip(cols, widths))).rstrip() + "\n"
                   for i, label in enumerate(labels))


class Parser(argparse.ArgumentParser):
    """argparse whose bad input is one line on stderr and exit code 2 (no usage block)."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)
