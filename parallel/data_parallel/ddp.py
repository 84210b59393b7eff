"""Data parallelism with our own bucketed, overlapped gradient all-reduce (the algorithm of torch DDP's reducer).

Each of the N ranks in `process_group` holds a full replica of the model and sees different data. After backward
every rank must hold the same gradient, the average over ranks:

    g = (1/N) * sum_r g_r

Gradients are grouped into buckets (reverse registration order, which is roughly the order backward
produces them). Each bucket owns one flat fp32 buffer and every parameter's `.grad` *is* a view into
it, and the buffer itself is all-reduced: no copy back out. After `zero_grad(set_to_none=True)` a step's
first backward writes each gradient into its view once, already scaled by 1/N (autograd hands the
gradient over, the hook multiplies it into the view); later backwards (accumulation) add into the views.
A bucket's all-reduce is launched asynchronously from the gradient hook of its last parameter, while
backward goes on computing earlier layers; one callback at the end of backward waits for all of them.

Bit-compatibility with torch DDP: torch's reducer scales each gradient by the fp32 scalar (1/N) while copying it
into its bucket (`at::mul_out(bucket_view, grad, 1./div_factor)`), then all-reduces SUM and copies the bucket back
into `.grad`. We do the same multiply into the view (or in place on the buffer, when the gradients were accumulated
into it), then all-reduce SUM, so for the same inputs both produce the same bits (for every N where the backend
sums in the same order; always for N = 2, where a + b = b + a). Dividing after the SUM instead would also be
bit-equal for powers of two, but not for N = 3, where x * fl(1/3) and x / 3 can differ in the last bit.

Not copied from torch's reducer: its small (1 MB) first bucket, the rebuild of buckets in the gradient arrival
order seen in the first iteration, and the autograd-graph walk that lets find_unused_parameters mark unused
parameters ready at the start of backward (we launch those buckets at its end instead).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel import comm

_engine = torch.autograd.Variable._execution_engine


@dataclass
class Bucket:
    """One flat gradient buffer and the parameters whose `.grad` are views into it.

    Every rank builds the same buckets (same module, same cap), so bucket i is the same tensor shape on
    every rank and the all-reduces line up.
    """

    names: list[str]
    params: list[nn.Parameter]
    buffer: torch.Tensor  # (sum of numels,) in the parameters' dtype: the gradients themselves
    views: list[torch.Tensor]  # views[j] = buffer[offset_j : offset_j + numel_j].view_as(params[j])
    group: dist.ProcessGroup | None = None  # reduced over: the wrapper's group, or the parameters' own

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def replica_group(p: nn.Parameter, default: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The ranks p's gradient is reduced over: `default` (the data-parallel group), or the smaller group a
    dimension keeps p's copies on (expert parallelism: an expert's copies, `parallel.marks.mark_replicas`)."""
    return getattr(p, "_replica_group", default)


def build_buckets(
    named_params: list[tuple[str, nn.Parameter]], cap_bytes: int, group: dist.ProcessGroup | None = None
) -> list[Bucket]:
    """Greedy buckets over `named_params` taken in reverse order: a bucket is closed when the next
    parameter would push it past `cap_bytes` (or has another dtype, device or `replica_group`). A parameter
    larger than the cap gets a bucket of its own."""
    groups: list[list[tuple[str, nn.Parameter]]] = []
    size = 0
    key = lambda p: (p.dtype, p.device, id(replica_group(p, group)))
    for name, p in reversed(named_params):
        nbytes = p.numel() * p.element_size()
        cur = groups[-1] if groups else None
        if cur is None or size + nbytes > cap_bytes or key(cur[0][1]) != key(p):
            groups.append([])
            size = 0
        groups[-1].append((name, p))
        size += nbytes
    buckets = []
    for members in groups:
        params = [p for _, p in members]
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for p in params:
            views.append(buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        buckets.append(Bucket([n for n, _ in members], params, buffer, views, replica_group(params[0], group)))
    return buckets


class DistributedDataParallel(nn.Module):
    """Data parallelism: replicate `module`, average gradients over `process_group` during backward.

    Each rank stores a full replica of `module` (parameters and buffers) and one flat gradient buffer per
    bucket; every parameter's `.grad` is a view into its bucket's buffer.

    Communication (all within `process_group`):
    - at construction: parameters and buffers are broadcast from the group's rank 0 to all ranks;
    - in each backward that syncs (i.e. outside `no_sync()`): each bucket is scaled by 1/N and
      all-reduced (SUM) asynchronously as soon as its last gradient has been accumulated, in bucket order,
      overlapping with the rest of backward; the end-of-backward callback waits for all of them. Per
      optimizer step this moves the unique trainable parameter bytes once (half that with
      `grad_compression="bf16"`);
    - inside `no_sync()`: nothing; gradients accumulate locally in the buffers and the next syncing
      backward reduces the accumulated sum.
    - with `find_unused_parameters=True`, additionally one int32 per parameter (the "used" map) is
      all-reduced at the end of each syncing backward, to find parameters no rank used.

    Zeroing. The buffers are the gradients, so `.grad` must end every backward attached to them.
    `optimizer.zero_grad(set_to_none=True)` detaches them. `forward` leaves a bucket whose grads are all None
    detached ("fresh"): autograd then hands each new gradient over as `.grad` (AccumulateGrad's steal), and the
    gradient hook writes it into its view (times 1/N in a syncing backward: torch's `mul_out`) and re-attaches the
    view. That is one read and one write per gradient, where zero + accumulate + scale were three of each. Other
    detached grads are re-attached at forward (zeroed if None, copied if the user assigned another tensor), and
    backward adds into the views. `zero_grad()` here zeroes the buffers in place (one fill per bucket). Gradient
    hooks also re-attach, with a copy, any `.grad` that is not its view (backward run without our forward).

    Unused parameters. With `find_unused_parameters=False` (default) a syncing backward that leaves a
    bucket incomplete raises an error naming the parameters that got no gradient. With True, the
    incomplete buckets are launched at the end of backward: unused parameters contribute their zero
    slices, exactly as in torch DDP; a parameter unused on every rank gets `.grad = None` back if its
    grad was None before this step (torch DDP leaves such grads untouched). Buckets after an incomplete
    one wait for the end of backward too, because all ranks must issue the all-reduces in the same order.
    """

    require_backward_grad_sync: bool = True  # False inside `no_sync`; read by `forward`

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        grad_compression: str | None = None,
    ):
        super().__init__()
        if grad_compression not in (None, "bf16"):
            raise ValueError(f"grad_compression must be None or 'bf16', got {grad_compression!r}")
        self.module = module
        self.process_group = process_group
        self.bucket_cap_mb = bucket_cap_mb
        self.find_unused_parameters = find_unused_parameters
        self.grad_compression = grad_compression
        self.world_size = comm.world(process_group)

        self._broadcast_from_rank0()

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]  # tied weights once
        self.buckets = build_buckets(named, int(bucket_cap_mb * 1024 * 1024), process_group)

        # Flat per-parameter tables (index i = position in bucket order) so the hooks do O(1) int work.
        self._params = [p for b in self.buckets for p in b.params]
        self._names = [n for b in self.buckets for n in b.names]
        self._views = [v for b in self.buckets for v in b.views]
        self._bucket_of = [k for k, b in enumerate(self.buckets) for _ in b.params]
        self._bucket_len = [len(b.params) for b in self.buckets]
        self._grad_buffers = [b.buffer for b in self.buckets]  # not `_buffers`: nn.Module's own registry
        self._wire = (
            [torch.empty_like(b.buffer, dtype=torch.bfloat16) for b in self.buckets]
            if grad_compression == "bf16"
            else None
        )

        # Per-backward state, mutated in place by the hooks.
        self._pending = list(self._bucket_len)  # gradients still to come, per bucket
        self._next_bucket = 0  # buckets [0, _next_bucket) are launched
        self._works: list = []
        self._fired = bytearray(len(self._params))  # hook ran in this backward
        self._used = bytearray(len(self._params))  # hook ran since the last sync (find_unused)
        self._was_none = bytearray(len(self._params))  # grad was None before this step
        self._fresh = bytearray(len(self.buckets))  # bucket left detached at forward: the hooks fill it
        self._inv_n = 1.0 / self.world_size
        self._callback_queued = False
        self._sync_backward = True

        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self._params)]

    # ------------------------------------------------------------------ user surface

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self._attach_grads(leave_fresh=True)
            self._sync_backward = self.require_backward_grad_sync  # decided at forward, like torch DDP
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward passes leave their gradients local (accumulated in the buckets); the first syncing
        backward after it all-reduces the sum (torch DDP's name)."""
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    @contextlib.contextmanager
    def reduce_on_exit(self):
        """For backward passes that run without this wrapper's forward (a pipeline's chunks): inside, they
        accumulate gradients locally; on a normal exit, every bucket is all-reduced once (scaled by 1/N,
        SUM) and waited for. A pipeline step thus moves each gradient once, after its last micro-batch,
        without the overlap with backward that DDP's forward-armed hooks give. The gradients are attached to
        their bucket views on entry: a zero-bubble schedule's W adds dW to `.grad` itself, outside autograd
        and its hooks, and into a detached `.grad` it would set a second fp32 gradient beside the buckets."""
        self._attach_grads()
        self._sync_backward = False
        try:
            yield
        finally:
            self._sync_backward = True
        self._attach_grads()
        for k in range(len(self.buckets)):
            self._launch(k)
        self._wait_all()
        if self._wire is not None and self.world_size > 1:
            for k in range(len(self.buckets)):
                self._grad_buffers[k].copy_(self._wire[k])

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero every bucket buffer in place (gradients stay attached). `set_to_none` is accepted and
        treated as False: the buffers *are* the gradients."""
        for b in self.buckets:
            b.buffer.zero_()
            for p, v in zip(b.params, b.views):
                p.grad = v

    # ------------------------------------------------------------------ construction helpers

    def _broadcast_from_rank0(self) -> None:
        """Overwrite every parameter and buffer with its group's rank 0 copy (rank 0 -> all): the wrapper's
        group, or the parameter's own `replica_group` (an expert's copies)."""
        if self.world_size == 1:
            return
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                group = replica_group(t, self.process_group)
                if comm.world(group) > 1:
                    src = dist.get_global_rank(group if group is not None else dist.group.WORLD, 0)
                    comm.broadcast(t.data, src=src, group=group)

    def _make_hook(self, i: int):
        view, k = self._views[i], self._bucket_of[i]
        fired, pending = self._fired, self._pending

        def hook(param: torch.Tensor) -> None:
            if param.grad is not view:
                self._reattach(i)
            if fired[i]:
                raise RuntimeError(
                    f"DistributedDataParallel: parameter {self._names[i]} received its gradient "
                    "twice in one backward (reentrant checkpointing or a reused graph?); "
                    "its bucket would be reduced before the second gradient arrived"
                )
            fired[i] = 1
            if not self._callback_queued:
                self._callback_queued = True
                _engine.queue_callback(self._end_of_backward)
            if self._sync_backward:
                pending[k] -= 1
                if pending[k] == 0 and k == self._next_bucket:
                    self._launch_ready()

        return hook

    # ------------------------------------------------------------------ gradient attachment

    def _attach_grads(self, leave_fresh: bool = False) -> None:
        """Point every `.grad` back at its view. A None grad (after zero_grad(set_to_none=True)) becomes a
        zeroed view; a whole bucket of None grads is zeroed with one fill, or, with `leave_fresh`, left
        detached for the hooks to fill (`_fresh`)."""
        i = 0
        for k, b in enumerate(self.buckets):
            grads = [p.grad for p in b.params]
            self._fresh[k] = 0
            if all(g is v for g, v in zip(grads, b.views)):
                i += len(grads)
                continue
            all_none = all(g is None for g in grads)
            if all_none and leave_fresh:
                self._fresh[k] = 1
                self._was_none[i : i + len(grads)] = b"\x01" * len(grads)
                i += len(grads)
                continue
            if all_none:
                b.buffer.zero_()
            for p, v, g in zip(b.params, b.views, grads):
                if g is None:
                    if not all_none:
                        v.zero_()
                    self._was_none[i] = 1
                    p.grad = v
                elif g is not v:
                    with torch.no_grad():
                        v.copy_(g)
                    p.grad = v
                i += 1

    def _reattach(self, i: int) -> None:
        """Backward set `.grad` to a new tensor holding the whole gradient (it was None: a fresh bucket; or it
        accumulated out of place): write it into the view, times 1/N if the fresh bucket's backward syncs
        (`_launch` then leaves the bucket as it is), and point `.grad` back at the view."""
        p, v = self._params[i], self._views[i]
        with torch.no_grad():
            if self._fresh[self._bucket_of[i]] and self._sync_backward and self.world_size > 1:
                torch.mul(p.grad, self._inv_n, out=v)
            else:
                v.copy_(p.grad)
        p.grad = v

    def _fill_unfired(self) -> None:
        """End of backward: a fresh bucket's parameters that got no gradient still hold last step's values in
        their views; zero those and attach them, as forward would have."""
        for i, p in enumerate(self._params):
            if not self._fired[i] and self._fresh[self._bucket_of[i]]:
                self._views[i].zero_()
                p.grad = self._views[i]

    # ------------------------------------------------------------------ communication

    def _launch_ready(self) -> None:
        """Launch every consecutive complete bucket from `_next_bucket` on. Buckets go out strictly in
        index order so that all ranks issue the same sequence of all-reduces."""
        k, pending, n = self._next_bucket, self._pending, len(self.buckets)
        while k < n and pending[k] == 0:
            self._launch(k)
            k += 1
        self._next_bucket = k

    def _launch(self, k: int) -> None:
        """Scale bucket k by 1/N (torch's reducer does grad * (1/N) too) and start its async SUM over the
        bucket's group. N is the wrapper's group size for every bucket: an expert's gradient, summed over its
        fewer copies, already holds every rank's tokens that reached it (parallel/expert_parallel/dispatch.py)."""
        if self.world_size == 1:
            return
        buf = self._grad_buffers[k]
        if not (self._fresh[k] and self._sync_backward):  # else the hooks scaled it on the way in
            buf.mul_(self._inv_n)
        wire = buf
        if self._wire is not None:  # bf16 on the wire, fp32 in the buffer
            wire = self._wire[k]
            wire.copy_(buf)
        work = comm.all_reduce(wire, group=self.buckets[k].group, async_op=True, unit=f"bucket {k}")
        if work is not None:  # None: the bucket's own group has one rank (each expert on one copy)
            self._works.append(work)

    def _wait_all(self) -> None:
        works, self._works = self._works, []
        for work in works:
            work.wait()

    def _end_of_backward(self) -> None:
        """Runs once, after the autograd engine has finished this backward: launch what is left (only
        with find_unused_parameters), wait for every all-reduce, copy bf16 results back."""
        self._callback_queued = False
        n = len(self._params)
        if any(self._fresh):
            self._fill_unfired()
        if self.find_unused_parameters:
            self._used[:] = bytes(a | b for a, b in zip(self._used, self._fired))
        if not self._sync_backward:
            self._fired[:] = bytes(n)
            self._fresh[:] = bytes(len(self.buckets))
            if comm.HOOKS is not None:  # the test seam (trainer/faults.py: GPT_FAULT_DDP_DROP_BUCKET)
                comm.HOOKS.local_gradients(self._grad_buffers)
            return
        try:
            if self._next_bucket < len(self.buckets):
                if not self.find_unused_parameters:
                    missing = [
                        self._names[i]
                        for i in range(n)
                        if not self._fired[i] and self._bucket_of[i] >= self._next_bucket
                    ]
                    raise RuntimeError(
                        "DistributedDataParallel: backward finished but these parameters received no gradient, "
                        f"so their buckets could not be all-reduced: {missing}. If they are legitimately "
                        "unused in some steps, wrap the model with DistributedDataParallel(..., "
                        "find_unused_parameters=True); otherwise make them take part in the loss or set "
                        "requires_grad=False on them."
                    )
                for k in range(self._next_bucket, len(self.buckets)):
                    self._launch(k)
                self._next_bucket = len(self.buckets)
            used = None
            if self.find_unused_parameters and self.world_size > 1:
                used = torch.tensor(list(self._used), dtype=torch.int32, device=self._grad_buffers[0].device)
                self._works.append(comm.all_reduce(used, group=self.process_group, async_op=True))
            self._wait_all()
            if self._wire is not None and self.world_size > 1:
                for k in range(self._next_bucket):
                    self._grad_buffers[k].copy_(self._wire[k])
            if self.find_unused_parameters:
                used_anywhere = used.tolist() if used is not None else list(self._used)
                for i in range(n):
                    if not used_anywhere[i] and self._was_none[i]:
                        self._params[i].grad = None  # as torch DDP: untouched, i.e. still None
        finally:
            self._wait_all()  # on error too: leave no collective in flight
            self._pending[:] = self._bucket_len
            self._next_bucket = 0
            self._fired[:] = bytes(n)
            self._used[:] = bytes(n)
            self._was_none[:] = bytes(n)
            self._fresh[:] = bytes(len(self.buckets))  # a second backward without forward adds into the views
