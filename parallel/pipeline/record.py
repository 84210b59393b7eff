"""What a pipeline step measured, kept apart from its work: `StepRecord`, which the composition
(parallel/parallelize.py) hands to the runner (parallel/pipeline/runner.py) as its `record`."""

from __future__ import annotations

import contextlib

import torch

from parallel.pipeline.actions import COMPUTE, B, F, W
from runtime.device import make_timer


class StepRecord:
    """What the runner's last step measured (as train.StepWatch for train_step).

    `timeline`: [(action, start, end)] in seconds, one per action (device events on CUDA, the host clock on the
    CPU: device.make_timer); `idle_fraction()` from it. `events`: the ("post", SEND/RECV), ("wait",
    SEND/RECV) and ("run", F/B/W) in the order they happened. `peak_in_flight`: the most (chunk, micro) whose
    forward ran and whose backward (W, when split) has not, at once. `action` sees the step's state (the
    runner's `_Step`), so a recorder that measures more (tests/test_pipeline.py's held bytes) extends it without
    touching the runner."""

    def __init__(self, device: torch.device):
        self.timer = make_timer(device)
        self.start(split=False)

    def start(self, split: bool) -> None:
        """Forget the last step's; a split schedule's (chunk, micro) is in flight until its W, else its B."""
        self.events: list[tuple[str, tuple]] = []
        self.peak_in_flight = 0
        self._marks: list[tuple[tuple, object, object]] = []
        self._live: set[tuple[int, int]] = set()
        self._release = W if split else B

    def waited(self, a: tuple) -> None:
        self.events.append(("wait", a))

    @contextlib.contextmanager
    def action(self, a: tuple, step: object):
        """Around one action's handler: its clock, its event, and after it the in-flight peak."""
        t0 = self.timer.mark()
        self.events.append(("run" if a.kind in COMPUTE else "post", a))
        yield
        self._marks.append((a, t0, self.timer.mark()))
        if a.kind == F:
            self._live.add(a[1:])
            self.peak_in_flight = max(self.peak_in_flight, len(self._live))
        elif a.kind == self._release:
            self._live.discard(a[1:])

    @property
    def timeline(self) -> list[tuple[tuple, float, float]]:
        times = self.timer.seconds([m for _, a, b in self._marks for m in (a, b)])
        return [(a, times[2 * i], times[2 * i + 1]) for i, (a, _, _) in enumerate(self._marks)]

    def idle_fraction(self) -> float | None:
        """This rank's share of the last step's span not spent in F, B or W (its bubble, plus waiting on
        messages), from `timeline`; None before a step."""
        timeline = self.timeline
        if not timeline:
            return None
        busy = sum(end - start for a, start, end in timeline if a.kind in COMPUTE)
        span = timeline[-1][2] - timeline[0][1]
        return 1.0 - busy / span if span > 0 else 0.0
