"""Faults a run meets on a cluster, and hooks that inject them in tests.

What train.py uses: `Preemption` (SIGTERM/SIGINT -> finish the step, save, exit PREEMPTED on every rank),
`StepWatchdog` (a step past --timeout writes every thread's stack), `is_comm_failure` (a collective that lost
its peer: exit 4) and `warn_shared_rendezvous_store` (torchrun --max-restarts pitfall).

Test hooks, switched on by environment variables; each is a no-op otherwise:

- GPT_INJECT_NAN_AT_STEP=s: before step s every parameter becomes NaN, so the step's loss is NaN on
  every rank (the trainer must stop without saving).
- GPT_KILL_AT_STEP=s: after step s (its eval and checkpoint included) rank GPT_KILL_RANK (default 0, or
  "all") sends itself GPT_KILL_SIGNAL (KILL, or STOP to stall). With GPT_KILL_MARKER=file it happens only
  while that file does not exist (it is created first), i.e. once across torchrun restarts.
- GPT_CKPT_FAIL_AFTER_FILES=n: the n-th checkpoint file this process writes raises, as a full disk would.
- GPT_SIGNAL_AT_STEP=s: in the middle of step s (after its backward, before the optimizer step) rank
  GPT_SIGNAL_RANK (default 0, or "all") sends itself GPT_SIGNAL (TERM or INT), as a cluster preempting it would
  (KILL: a rank lost mid-step). With GPT_SIGNAL_MARKER=file, only the one process that creates that file (once,
  across restarts and across the jobs that share the variable).
- GPT_COMM_FAULT=skip|shape: in step GPT_COMM_FAULT_STEP (default 1) rank GPT_COMM_FAULT_RANK (default 0)
  skips (does not issue) the GPT_COMM_FAULT_NTH-th (default 0) op GPT_COMM_FAULT_OP (all_reduce, default, or
  recv) that goes through parallel/comm.py, or (shape) issues it on one element fewer: a rank out of step
  with its group (skip all_reduce), a mismatched collective (shape), a pipeline send left without its receive
  (skip recv). What `python -m debug hang` is tested on (with GPT_KILL_SIGNAL=STOP for a stopped rank).

Wrong-math hooks for the divergence bisector's tests (`python -m debug diff`), on rank GPT_FAULT_RANK (default 0):
- GPT_FAULT_GRAD=name: after every backward, this rank's elements of parameter `name`'s gradient (its TP shard,
  say) are raised by a tenth of their largest magnitude, as a wrong reduction of that shard would.
- GPT_FAULT_DDP_DROP_BUCKET=k: our DDP zeroes bucket k's gradient buffer after each step's first local
  micro-step (inside no_sync): that micro-batch's gradients never reach the bucket's all-reduce.
- GPT_FAULT_TIED_COPY=1: before step 1, a pipeline's last stage draws its copy of the tied embedding
  (lm_head.weight) under its own name instead of transformer.wte.weight's (model.init_parameter's rule), so
  lm_head uses the wrong matrix.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from checkpoints import checkpoint
from parallel import comm
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


class CommFault:
    """GPT_COMM_FAULT's hook, parallel.comm.HOOKS.op on the faulty rank: "skip" or "shape" for the nth `op` of
    `step` this rank issues, None for every other op."""

    def __init__(self, kind: str, op: str, step: int, nth: int, rank: int):
        if kind not in ("skip", "shape") or op not in ("all_reduce", "recv") or (kind, op) == ("shape", "recv"):
            raise ValueError(f"GPT_COMM_FAULT={kind} GPT_COMM_FAULT_OP={op}: not a fault this hook injects")
        self.kind, self.op, self.step, self.nth, self.rank, self.seen = kind, op, step, nth, rank, 0

    def __call__(self, op: str, tensor: torch.Tensor) -> str | None:
        if op != self.op or comm.RECORDER.step != self.step:
            return None
        self.seen += 1
        if self.seen - 1 != self.nth:
            return None
        print(
            f"GPT_COMM_FAULT={self.kind}: rank {self.rank} {'skips' if self.kind == 'skip' else 'narrows'} its "
            f"{op} #{self.nth} of step {self.step} (shape {tuple(tensor.shape)}) (test hook)",
            flush=True,
        )
        return self.kind


def comm_fault(rank: int) -> CommFault | None:
    """GPT_COMM_FAULT's hook for this rank (None when unset or meant for another rank)."""
    kind = os.environ.get("GPT_COMM_FAULT")
    if not kind or int(os.environ.get("GPT_COMM_FAULT_RANK", "0")) != rank:
        return None
    return CommFault(
        kind,
        os.environ.get("GPT_COMM_FAULT_OP", "all_reduce"),
        _env_int("GPT_COMM_FAULT_STEP") or 1,
        _env_int("GPT_COMM_FAULT_NTH") or 0,
        rank,
    )


class FaultHooks:
    """The runtime's test seam (parallel/comm.HOOKS, whose comment lists what it asks) as these hooks fill it:
    GPT_COMM_FAULT's op fault and GPT_FAULT_DDP_DROP_BUCKET's dropped bucket."""

    def __init__(self, op_fault: CommFault | None):
        self.op_fault = op_fault

    def op(self, name: str, tensor: torch.Tensor) -> str | None:
        return self.op_fault(name, tensor) if self.op_fault is not None else None

    def local_gradients(self, buffers: list[torch.Tensor]) -> None:
        maybe_drop_bucket(buffers)


def runtime_hooks(rank: int) -> FaultHooks | None:
    """What this rank sets parallel/comm.HOOKS to: None (no hook asked at all) unless a hook's variable is set."""
    op_fault = comm_fault(rank)
    if op_fault is None and _env_int("GPT_FAULT_DDP_DROP_BUCKET") is None:
        return None
    return FaultHooks(op_fault)


def checkpoint_file_written() -> None:
    global _files_written
    _files_written += 1
    limit = _env_int("GPT_CKPT_FAIL_AFTER_FILES")
    if limit and _files_written >= limit:
        raise RuntimeError(
            f"GPT_CKPT_FAIL_AFTER_FILES={limit}: injected failure after writing "
            f"{_files_written} checkpoint files (test hook)"
        )


def _claim(marker: str) -> bool:
    """Create `marker`; False if it exists (one process of all that race for it wins)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def maybe_signal_mid_step(step: int, rank: int) -> None:
    if _env_int("GPT_SIGNAL_AT_STEP") != step:
        return
    who, marker = os.environ.get("GPT_SIGNAL_RANK", "0"), os.environ.get("GPT_SIGNAL_MARKER")
    if (who == "all" or int(who) == rank) and (not marker or _claim(marker)):
        sig = getattr(signal, "SIG" + os.environ.get("GPT_SIGNAL", "TERM"))
        print(f"GPT_SIGNAL_AT_STEP={step}: rank {rank} sends itself {sig.name} (test hook)", flush=True)
        os.kill(os.getpid(), sig)


def _fault_rank() -> bool:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return rank == int(os.environ.get("GPT_FAULT_RANK", "0"))


def _named(model: torch.nn.Module, name: str) -> torch.nn.Parameter | None:
    """Parameter `name` (model/gpt.py's name) of `model`, inside any wrapper that prefixes it (DDP's "module.")."""
    return next((p for n, p in model.named_parameters() if n == name or n.endswith("." + name)), None)


def maybe_perturb_grad(model: torch.nn.Module) -> None:
    name = os.environ.get("GPT_FAULT_GRAD")
    p = _named(model, name) if name and _fault_rank() else None
    if p is not None and p.grad is not None:
        g = local(p.grad)
        g.add_(0.1 * float(g.abs().max()))
        print(f"GPT_FAULT_GRAD={name}: perturbed this rank's {tuple(g.shape)} gradient (test hook)", flush=True)


_bucket_dropped = False  # this step's (GPT_FAULT_DDP_DROP_BUCKET), reset by Faults.before_step


def maybe_drop_bucket(buffers: list[torch.Tensor]) -> None:
    """Our DDP, after a backward inside no_sync: GPT_FAULT_DDP_DROP_BUCKET's hook (see the module docstring)."""
    global _bucket_dropped
    k = _env_int("GPT_FAULT_DDP_DROP_BUCKET")
    if k is not None and not _bucket_dropped and _fault_rank():
        buffers[k].zero_()
        _bucket_dropped = True


def maybe_untie_copy(step: int, model: torch.nn.Module) -> None:
    p = _named(model, "lm_head.weight") if os.environ.get("GPT_FAULT_TIED_COPY") and step == 1 else None
    if p is not None:  # only a pipeline's last stage has its own copy (a tied lm_head is named as wte)
        from model.gpt import init_parameter

        with torch.no_grad():
            local(p).copy_(init_parameter("lm_head.copy.weight", p.shape, model_config(model), 0))


def model_config(model: torch.nn.Module):
    return next(m.config for m in model.modules() if hasattr(m, "config") and not callable(m.config))


# ----------------------------------------------------------------------------- what train.py uses


def warn_shared_rendezvous_store() -> None:
    """torchrun --max-restarts: by default the restarted workers join through the launcher's rendezvous
    store, which still holds the previous attempt's process-group keys, so a restarted rank can read a dead
    peer's address and fail or hang (torch 2.13). A fresh store per attempt avoids it."""
    if (
        os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0"
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    ):
        sys.stderr.write(
            "warning: torchrun --max-restarts without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a "
            "restarted job may read the previous attempt's peer addresses and fail or hang; export "
            "it before torchrun\n"
        )


def is_comm_failure(e: BaseException) -> bool:
    """A collective that timed out or lost its peer (gloo and NCCL raise RuntimeErrors that say so)."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(
        s in text
        for s in ("gloo", "NCCL", "Timed out", "timed out", "Connection reset", "Connection closed", "Broken pipe")
    )


# ----------------------------------------------------------------------------- preemption

PREEMPTED = 5  # exit code: stopped by SIGTERM/SIGINT after finishing a step and saving it


class Preemption:
    """SIGTERM and SIGINT (on any rank) ask the run to stop after the current step: the handler only sets a
    flag; `agreed()`, the last collective of every step (a MAX over all ranks of one int), tells every rank
    whether any rank was signalled, so all stop after the same step, save it and exit with PREEMPTED.
    A second signal on a rank restores the default handler and raises it again: an immediate stop."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, device: torch.device):
        self.device, self.signal = device, None
        self._flag, self._work = None, None  # this step's vote (vote -> agreed)
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:  # the second one: stop now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.signal = signal.Signals(signum).name
        sys.stderr.write(f"train.py: {self.signal} received: stopping after this step, with a checkpoint\n")

    def vote(self) -> None:
        """Start this step's agreement (a MAX over all ranks of one int, asynchronous): called before the step's
        end-of-step scalars, so that reading it in `agreed` waits for nothing more than they did.
        The flag is filled on the device (a fill kernel with the value as its argument): `torch.tensor([v],
        device=...)` would copy a pageable host buffer, a copy that blocks the host on CUDA."""
        self._flag = torch.full((1,), 1 if self.signal else 0, dtype=torch.int32, device=self.device)
        self._work = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._work = comm.all_reduce(self._flag, op="max", async_op=True, counted=False)  # not wrapper traffic

    def agreed(self) -> bool:
        """Whether any rank was signalled by its vote (one is started here if the step started none)."""
        if self._flag is None:
            self.vote()
        if self._work is not None:
            self._work.wait()
        flag, self._flag = self._flag, None
        return bool(flag.item())


def ring_path(out_dir: str, rank: int) -> str:
    """Where rank `rank`'s flight recorder lives while the run does (debug/flight_recorder.py)."""
    return os.path.join(out_dir, "flight_recorder", f"rank_{rank}.bin")


class StepWatchdog:
    """A step that runs longer than --timeout explains itself: a timer started with each step writes every
    thread's Python stack to <out_dir>/hang/rank_<r>.txt (faulthandler), and this rank's flight recorder (its
    last comm ops) to rank_<r>.json beside it, and prints one line pointing there.
    A collective that waits on a stalled peer releases the GIL, so the timer runs; the collective's own
    timeout (the same --timeout, counted from when it started, after the step did) then ends the run."""

    def __init__(self, out_dir: str, rank: int, timeout: float):
        self.path = os.path.join(out_dir, "hang", f"rank_{rank}.txt")
        self.ops_path = os.path.join(out_dir, "hang", f"rank_{rank}.json")
        self.rank, self.timeout, self.timer, self.step, self.dumped = rank, timeout, None, 0, False

    def start(self, step: int) -> None:
        self.stop()
        self.step = step
        self.timer = threading.Timer(self.timeout, self._dump)
        self.timer.daemon = True
        self.timer.start()

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _dump(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w") as f:
            f.write(
                f"rank {self.rank}: step {self.step} still running after --timeout {self.timeout:g}s; "
                f"every thread's stack:\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        self.dump_ops(f"step {self.step} still running after --timeout {self.timeout:g}s")
        sys.stderr.write(
            f"train.py: rank {self.rank}: step {self.step} has run for more than --timeout "
            f"{self.timeout:g}s; Python stacks in {self.path}, its last comm ops in {self.ops_path} "
            f"(python -m debug hang {os.path.dirname(os.path.dirname(self.path)) or '.'})\n"
        )
        sys.stderr.flush()

    def dump_ops(self, reason: str) -> None:
        """This rank's flight recorder to rank_<r>.json (once: the first reason, the watchdog's or a failure's)."""
        if not self.dumped:
            self.dumped = True
            comm.RECORDER.dump(self.ops_path, reason)


class Faults:
    """Every fault hook of a training step behind one object: the watchdog and the test hooks around each step,
    the mid-step signal hook, and whether the ranks agreed to stop for a preemption.

        before_step(s, model)   watchdog armed for step s (and the flight recorder's step); GPT_INJECT_NAN_AT_STEP,
                                GPT_FAULT_TIED_COPY
        mid_step(s, model)      after the backward, before the optimizer step: GPT_SIGNAL_AT_STEP, GPT_FAULT_GRAD
        vote()                  start the preemption vote (asynchronous), before the step's end-of-step scalars
        after_step(s)           the step, its eval and checkpoint are done: watchdog off; GPT_KILL_AT_STEP
        preempted()             collective: a rank was signalled (every rank then stops after this step)"""

    def __init__(self, out_dir: str, rank: int, timeout: float, device: torch.device | None = None):
        self.rank = rank
        self.watchdog = StepWatchdog(out_dir, rank, timeout)
        self.preemption = Preemption(device) if device is not None else None
        comm.HOOKS = runtime_hooks(rank)
        checkpoint.FILE_WRITTEN = checkpoint_file_written if _env_int("GPT_CKPT_FAIL_AFTER_FILES") else None

    def before_step(self, step: int, model: torch.nn.Module) -> None:
        global _bucket_dropped
        comm.RECORDER.step, comm.RECORDER.micro = step, -1
        self.watchdog.start(step)
        maybe_inject_nan(step, model)
        maybe_untie_copy(step, model)
        _bucket_dropped = False

    def mid_step(self, step: int, model: torch.nn.Module | None = None) -> None:
        maybe_signal_mid_step(step, self.rank)
        if model is not None:
            maybe_perturb_grad(model)

    def after_step(self, step: int) -> None:
        self.watchdog.stop()
        maybe_kill(step, self.rank)

    def vote(self) -> None:
        """Start the preemption vote that `preempted` reads (train_step: just before its end-of-step scalars)."""
        if self.preemption is not None:
            self.preemption.vote()

    def preempted(self) -> bool:
        return self.preemption is not None and self.preemption.agreed()

    @property
    def signal(self) -> str | None:
        return self.preemption.signal if self.preemption is not None else None

    def close(self) -> None:
        self.watchdog.stop()
        comm.HOOKS = None
        checkpoint.FILE_WRITTEN = None
