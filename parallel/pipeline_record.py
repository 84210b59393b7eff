"""What a pipeline step measured, kept apart from its work: `StepRecord` (PipelineRunner.record), as
train.StepWatch is for train_step. Nothing here changes what the runner computes or sends."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from device import make_timer
from parallel import comm
from parallel.pipeline_schedule import B, COMPUTE, F, W, Action


class StepRecord:
    """What the runner's last step measured, kept apart from its work (as train.StepWatch for train_step).

    `timeline`: [(action, start, end)] in seconds, one per action (device events on CUDA, the host clock on the
    CPU: device.make_timer); `idle_fraction()` from it. `events`: the ("post", SEND/RECV), ("wait",
    SEND/RECV) and ("run", F/B/W) in the order they happened. `peak_in_flight`: the most (chunk, micro) whose
    forward ran and whose backward (W, when split) has not, at once. With `measure_held` set (host time per
    action, so off unless asked), `peak_held_bytes`: the most bytes of distinct tensor storages the step held at
    once (stored inputs and outputs, received buffers, gradients and activations waiting for or in a send, the
    (input, output gradient) pairs waiting for W, and under our sharding engine the unit gradients held for W).
    Each action also sets the flight recorder's micro-batch (comm.RECORDER.micro)."""

    def __init__(self, device: torch.device):
        self.timer = make_timer(device)
        self.measure_held = False
        self.start(split=False)

    def start(self, split: bool) -> None:
        """Forget the last step's; a split schedule's (chunk, micro) is in flight until its W, else its B."""
        self.events: list[tuple[str, Action]] = []
        self.peak_in_flight, self.peak_held_bytes = 0, 0
        self._marks: list[tuple[Action, object, object]] = []
        self._live: set[tuple[int, int]] = set()
        self._release = W if split else B

    def waited(self, a: Action) -> None:
        self.events.append(("wait", a))

    @contextlib.contextmanager
    def action(self, a: Action, held: Callable[[], tuple[dict, ...]]):
        """Around one action's handler: its clock, its event, and after it the in-flight and held peaks."""
        t0 = self.timer.mark()
        comm.RECORDER.micro = a.micro  # the flight recorder's context
        self.events.append(("run" if a.kind in COMPUTE else "post", a))
        yield
        self._marks.append((a, t0, self.timer.mark()))
        if a.kind == F:
            self._live.add(a[1:])
            self.peak_in_flight = max(self.peak_in_flight, len(self._live))
        elif a.kind == self._release:
            self._live.discard(a[1:])
        if self.measure_held:
            self.peak_held_bytes = max(self.peak_held_bytes, held_bytes(*held()))

    @property
    def timeline(self) -> list[tuple[Action, float, float]]:
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


def held_bytes(*containers: dict) -> int:
    """Bytes of the distinct storages of every tensor in the containers' values (tensors, or tuples of them):
    what a runner's bookkeeping keeps alive. A tensor and a view of it count once."""
    seen: dict[int, int] = {}
    for box in containers:
        for v in box.values():
            for t in v if isinstance(v, tuple) else (v,):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())
