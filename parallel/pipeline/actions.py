"""A pipeline schedule's vocabulary: `Action(kind, chunk, micro)` and its seven kinds (what each means:
parallel/pipeline/schedule.py's docstring), in the one module that the schedules, the runner and the step's record
(parallel/pipeline/record.py) import."""

from __future__ import annotations

from typing import NamedTuple

F, B, W, SEND_F, RECV_F, SEND_B, RECV_B = "F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W)  # the kinds that compute; the others post a message


class Action(NamedTuple):
    kind: str
    chunk: int
    micro: int

    def __repr__(self) -> str:
        return f"{self.kind}(c{self.chunk},m{self.micro})"
