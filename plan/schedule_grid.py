"""A schedule printed: `python -m plan.schedule_grid SCHEDULE --pp P --micro M [--virtual V]` prints each rank's
action list (parallel/pipeline/schedule.py) as a grid, the way torch.distributed.pipelining's
_format_pipeline_order prints its schedules. For example `1f1b --pp 2 --micro 4`:

             Rank 0   Rank 1
    Step 00: 0F0      1RECV_F0
    Step 01: 0SEND_F0 1F0
    Step 02: 0F1      1RECV_F1
    Step 03: 0SEND_F1 1B0
    ...

`grid` reads each action's chunk, kind and micro; `main` builds the schedule."""

from __future__ import annotations

import argparse
import sys

from parallel.pipeline.schedule import ALL_SCHEDULES, V_SCHEDULES


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
    return "".join(
        (label + " " + " ".join(col[i].ljust(w) for col, w in zip(cols, widths))).rstrip() + "\n"
        for i, label in enumerate(labels)
    )


class Parser(argparse.ArgumentParser):
    """argparse whose bad input is one line on stderr and exit code 2 (no usage block)."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    """`python -m plan.schedule_grid SCHEDULE --pp P --micro M [--virtual V]`: each rank's list as a grid; bad
    input: one line, exit 2."""
    p = Parser(prog="python -m plan.schedule_grid", description="Each rank's action list, as a grid.")
    p.add_argument("schedule", choices=list(ALL_SCHEDULES))
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks P")
    p.add_argument("--micro", type=int, required=True, help="micro-batches M per step")
    p.add_argument("--virtual", type=int, help="chunks per rank V (default: 2 for the V schedules, else 1)")
    a = p.parse_args(argv)
    virtual = a.virtual if a.virtual is not None else 2 if a.schedule in V_SCHEDULES else 1
    try:
        schedule = ALL_SCHEDULES[a.schedule](a.pp, a.micro, virtual)
    except ValueError as e:
        p.error(str(e))
    sys.stdout.write(grid(schedule))


if __name__ == "__main__":
    main()
