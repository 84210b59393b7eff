"""One rank of an N-rank job, simulated: `python -m sim.fake_rank <train.py flags> --fake_world_size N --fake_rank r`.

The rank runs train.py's own code: `train.build` (the mesh, the model at full size, `parallelize`, the optimizer)
and `train.run` (an evaluation, two training steps, the evaluation after the last), then main's closing barrier,
with two things swapped underneath:
- the process group is torch's fake backend (`parallel.mesh.init_distributed(..., fake_rank=r)`): every
  collective and p2p op is accepted, returns at once and moves nothing, and no peer exists;
- every tensor is fake (torch's FakeTensorMode): shapes, dtypes and storages' sizes, no data, so a GPT-2 XL
  stage is built and stepped in seconds without its gigabytes. A read of a value (`.item()`, `float()`) gets 0:
  what needs the values (a non-finite loss, a preemption vote) takes the path of a healthy step.
The data batches are real token ids (they are small); the optimizer, our wrappers' hooks, autograd and the
schedule's runner run as on a real rank, on the CPU code path.

Recorded, in the order the rank issues them (`Recorder`, which wraps torch.distributed for the run: nothing in
the runtime changes):
- every new_group call: the ranks, whether this rank is one of them, the call site;
- every torch.distributed op: the op, the group's global ranks, dtype, element count in and out, the peer (p2p)
  or source (broadcast) as a global rank, the reduce op, the call site (the first frame above parallel/comm and
  torch, with the unit comm was moving), the phase ("init" while building, "eval", "step") and the step;
- every wait on a p2p op's work (the order of posts and waits is what a deadlock is made of).
Why a wrapper around torch.distributed rather than the flight recorder: the recorder's records are fixed-size
slots read after a hang (no reduce op, no new_group), and the wrapper sees what bypasses parallel/comm too
(DeviceMesh's groups, a stray collective), at no cost to a real run.

`run_fake_rank(plan)` returns a `RankRun`; `python -m sim.verify` runs many ranks in one process, one after another
(the fake process group destroyed between them), and checks them against each other and the planner.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import signal
import sys
import time
import weakref
from dataclasses import asdict, dataclass, field, replace
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


@dataclass(frozen=True, slots=True)
class Op:
    """One torch.distributed call of a rank (or, op "wait", its wait on the p2p op numbered `peer`)."""

    n: int  # this rank's event index
    op: str  # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv, barrier, ...
    group: tuple[int, ...]  # the group's global ranks
    dtype: str = ""
    numel: int = 0  # elements of the input (all_gather: this rank's shard; reduce_scatter: the full input)
    out: int = 0  # elements of the output where it differs in size (all_gather, reduce_scatter)
    peer: int = -1  # send: the destination, recv: the source, broadcast: the source (global ranks); wait: n
    reduce: str = ""  # sum, max, ... for the reducing ops
    site: str = ""
    phase: str = ""  # init (train.build), eval (train.evaluate), step (the rest of train.run), exit
    step: int = 0

    def signature(self) -> tuple:
        """What every member of a group must agree on, op by op (the group's own ranks and the site aside)."""
        if self.site.startswith(uneven_sites()):  # a concept's collectives whose sizes differ by rank
            return self.op, self.dtype, self.reduce
        return self.op, self.dtype, self.numel, self.out, self.reduce


@dataclass
class RankRun:
    """What one simulated rank did: its new_group calls (ranks, member, site) in order, its events, each training
    step's record (train.step_metrics: state, comm bytes and calls, the peak), the exit code and seconds."""

    rank: int
    world: int
    groups: list[tuple[tuple[int, ...], bool, str]] = field(default_factory=list)
    events: list[Op] = field(default_factory=list)
    steps: dict[int, dict] = field(default_factory=dict)
    code: int = 0
    seconds: float = 0.0
    error: str = ""

    def ops(self, phase: str | None = None) -> list[Op]:
        return [e for e in self.events if e.op != "wait" and (phase is None or e.phase == phase)]


REDUCE = {int(v): k.lower() for k, v in vars(dist.ReduceOp).items() if isinstance(v, dist.ReduceOp.RedOpType)}
# op name recorded -> (the argument holding the tensor this rank puts in, the one it gets out, reduce-op argument)
OPS = {
    "all_reduce": ("tensor", None, "op"),
    "all_gather_single": ("input_tensor", "output_tensor", None),
    "all_gather_into_tensor": ("input_tensor", "output_tensor", None),
    "reduce_scatter_single": ("input", "output", "op"),
    "reduce_scatter_tensor": ("input", "output", "op"),
    "all_to_all_single": ("input", "output", None),
    "broadcast": ("tensor", None, None),
    "isend": ("tensor", None, None),
    "irecv": ("tensor", None, None),
    "send": ("tensor", None, None),
    "recv": ("tensor", None, None),
    "barrier": (None, None, None),
    "all_gather": ("tensor", None, None),
    "reduce": ("tensor", None, "op"),
    "gather": ("tensor", None, None),
    "scatter": ("tensor", None, None),
    "all_gather_object": (None, None, None),
    "broadcast_object_list": (None, None, None),
}
NAMES = {
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "isend": "send",
    "irecv": "recv",
}
SKIP_FRAMES = ("torch.", "parallel.comm", __name__, "contextlib", "functools")


class Recorder:
    """While open, every call of torch.distributed's ops and new_group (in torch.distributed, its c10d module and
    DeviceMesh's) is recorded into `run` before it runs; a p2p op's work comes back wrapped, so its wait is
    recorded too. Calls a recorded call makes inside torch (all_gather_object's all_gather) are not recorded again.
    `phase` is set by the caller ("init" while building); an op inside train.evaluate is phase "eval"."""

    def __init__(self, run: RankRun):
        self.run, self.phase, self._depth = run, "init", 0
        self._groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._world: tuple[int, ...] | None = None
        self._stack = contextlib.ExitStack()
        import train  # the module whose evaluate marks phase "eval" (its own code, not torch.no_grad's wrapper's)

        self._evaluate = inspect.unwrap(train.evaluate).__code__

    def __enter__(self) -> "Recorder":
        import torch.distributed.device_mesh as device_mesh

        for name in OPS:
            original = getattr(c10d, name, None)
            if original is not None:
                wrapped = self._wrap(name, original, inspect.signature(original))
                for module in (dist, c10d):
                    self._stack.enter_context(mock.patch.object(module, name, wrapped))
        new_group = self._wrap_new_group(c10d.new_group)
        for module in (dist, c10d, device_mesh):
            self._stack.enter_context(mock.patch.object(module, "new_group", new_group))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _ranks(self, group) -> tuple[int, ...]:
        if group is None or group is dist.group.WORLD:
            if self._world is None:
                self._world = tuple(range(dist.get_world_size()))
            return self._world
        ranks = self._groups.get(group)
        if ranks is None:
            ranks = self._groups[group] = tuple(dist.get_process_group_ranks(group))
        return ranks

    def _site(self) -> tuple[str, str]:
        """(the call site: module.function of the first frame outside torch, comm and this module, with the unit
        comm was moving; the phase)."""
        f, site, unit, phase = sys._getframe(2), "", None, self.phase
        while f is not None:
            name = f.f_globals.get("__name__", "?")
            if not site:
                if name == "parallel.comm":
                    unit = f.f_locals.get("unit")
                elif not name.startswith(SKIP_FRAMES):
                    site = f"{name}.{f.f_code.co_name}" + (f" [{unit}]" if unit else "")
            if f.f_code is self._evaluate:
                phase = "eval"
                break
            if site and phase in ("init", "exit"):
                break
            f = f.f_back
        return site, phase

    def _add(self, **kw) -> Op:
        site, phase = self._site()
        from parallel import comm

        op = Op(
            n=len(self.run.events),
            site=site,
            phase="step" if phase == "run" else phase,
            step=comm.RECORDER.step if phase not in ("init", "exit") else 0,
            **kw,
        )
        self.run.events.append(op)
        return op

    def _wrap(self, name: str, original, sig: inspect.Signature):
        into, out_arg, op_arg = OPS[name]
        kind = NAMES.get(name, name)
        p2p = kind in ("send", "recv")

        def wrapped(*args, **kwargs):
            if self._depth:
                return original(*args, **kwargs)
            a = sig.bind(*args, **kwargs)
            a.apply_defaults()
            a = a.arguments
            group = a.get("group")
            t = a.get(into) if into else None
            out = a.get(out_arg) if out_arg else None
            peer = -1
            if p2p or kind == "broadcast":
                peer = a.get("dst" if kind == "send" else "src")
                local = a.get("group_dst" if kind == "send" else "group_src")
                peer = dist.get_global_rank(group, local) if peer is None and local is not None else peer
            op = self._add(
                op=kind,
                group=self._ranks(group),
                dtype=str(t.dtype).removeprefix("torch.") if isinstance(t, torch.Tensor) else "",
                numel=t.numel() if isinstance(t, torch.Tensor) else 0,
                out=out.numel() if isinstance(out, torch.Tensor) else 0,
                peer=-1 if peer is None else int(peer),
                reduce=REDUCE.get(int(a[op_arg]), str(a[op_arg])) if op_arg else "",
            )
            self._depth += 1
            try:
                work = original(*args, **kwargs)
            finally:
                self._depth -= 1
            return _Waited(work, op.n, self) if p2p and work is not None else work

        return wrapped

    def _wrap_new_group(self, original):
        def new_group(*args, **kwargs):
            if self._depth:
                return original(*args, **kwargs)
            ranks = kwargs.get("ranks", args[0] if args else None)
            ranks = tuple(sorted(ranks)) if ranks is not None else tuple(range(dist.get_world_size()))
            site, _ = self._site()
            self.run.groups.append((ranks, dist.get_rank() in ranks, site))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return new_group

    def waited(self, n: int) -> None:
        self._add(op="wait", group=(), peer=n)


class _Waited:
    """A p2p op's work whose every wait() is recorded before it waits (sim.verify's check_waits wants exactly one:
    a second wait on a gloo receive hangs)."""

    def __init__(self, work, n: int, recorder: Recorder):
        self.work, self.n, self.recorder = work, n, recorder

    def wait(self, *args):
        self.recorder.waited(self.n)
        return self.work.wait(*args)

    def __getattr__(self, name: str):
        return getattr(self.work, name)


def fake_mode():
    """torch's FakeTensorMode (real inputs, such as the data batches, taken in as they are), in which a read of a
    tensor's value (`.item()`, `float()`, `.tolist()`) gets 0, the value of a healthy step's checks (a finite loss,
    no preemption vote, no inf found). One mode, not a second one stacked on it: the autograd engine asks every
    tensor its device through the mode stack, ~10 times per op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class Fake(FakeTensorMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                return False if args[0].dtype == torch.bool else 0.0 if args[0].is_floating_point() else 0
            return super().__torch_dispatch__(func, types, args, kwargs)

    return Fake(allow_non_fake_inputs=True)


def _no_values(name: str, shape, config, seed: int, rows: slice | None = None, cols: slice | None = None):
    """model.init_parameter's tensor without its values (a fake tensor holds none): its [rows, cols] slice of an
    empty tensor of the full shape, where init_parameter draws 64-row blocks from seeded generators, ~5 ops a block
    (10,000 blocks in GPT-2 XL)."""
    rows, cols = rows or slice(None), cols or slice(None)
    full = torch.empty(shape)
    return full[rows] if len(shape) == 1 else full[rows, cols]


def balanced_split_sizes(
    dispatch, counts: torch.Tensor, per: torch.Tensor, assignments: int
) -> tuple[list[int], list[int], list[int]]:
    """ExpertParallelDispatch.split_sizes for a simulated rank, whose counts hold no values: the routing the
    planner assumes, balanced. Every rank sends each expert assignments // E rows (the first assignments % E
    experts one more), so an EP rank sends each rank the rows of its experts, receives from each the rows of its
    own, and each local expert gets P times its share. What a real router decides (an expert that gets more,
    the all_to_all's sizes from step to step) a fake rank cannot see (docs/planner.md)."""
    from parallel import comm

    P, L = per.shape
    share = balanced_local_sizes(dispatch, counts, assignments)
    me = comm.rank(dispatch.group) if P > 1 else 0
    send = [sum(share[j * L : (j + 1) * L]) for j in range(P)]
    mine = share[me * L : (me + 1) * L]
    return send, [sum(mine)] * P, [P * c for c in mine]


def balanced_local_sizes(dispatch, counts: torch.Tensor, assignments: int) -> list[int]:
    """moe.LocalDispatch.split_sizes (an MoE layer without expert parallelism) for a simulated rank: each of the E
    experts gets assignments // E rows, the first assignments % E one more (the balanced routing the planner
    assumes)."""
    E = counts.shape[0]
    return [assignments // E + (e < assignments % E) for e in range(E)]


@contextlib.contextmanager
def fake_tensors():
    """Every tensor made inside is fake (`fake_mode`), and parameters are initialised without values
    (`_no_values`, in every module that imported model.init_parameter); a dispatch's split sizes, the one
    host read of a routing, are balanced (`balanced_split_sizes` under EP, `balanced_local_sizes` without).
    The loss walks its rows in an accelerator's chunks (loss.LOSS_CHUNK_BYTES_ACCELERATOR: 1280 rows at
    V = 50304, not the CPU's 128): the memory plan of the GPU rank the planner predicts, whose peak the chunk's
    three (rows, V) fp32 buffers are part of, though the code path is the CPU's."""
    import model
    from model import loss, moe

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(loss.LOSS_CHUNK_BYTES, {"cpu": loss.LOSS_CHUNK_BYTES_ACCELERATOR}))
        from parallel.expert_parallel.dispatch import ExpertParallelDispatch

        stack.enter_context(mock.patch.object(ExpertParallelDispatch, "split_sizes", balanced_split_sizes))
        stack.enter_context(mock.patch.object(moe.LocalDispatch, "split_sizes", balanced_local_sizes))
        grouped = moe.grouped_mm_runs  # torch 2.13's fake (meta) _grouped_mm takes bf16 only: else the loop
        stack.enter_context(
            mock.patch.object(
                moe,
                "grouped_mm_runs",
                lambda device, dtype, k, n: grouped(device, dtype, k, n) and dtype == torch.bfloat16,
            )
        )
        for module in list(sys.modules.values()):
            if getattr(module, "init_parameter", None) is model.init_parameter:
                stack.enter_context(mock.patch.object(module, "init_parameter", _no_values))
        stack.enter_context(fake_mode())
        yield


def uneven_sites() -> tuple[str, ...]:
    """The call sites whose collectives move other sizes on other ranks (runtime/registry.Concept.uneven_sites: an
    optimizer's exchange, whose sizes follow its owners): their signature leaves the sizes out."""
    from trainer.concepts import concepts

    return tuple(site for c in concepts() for site in c.uneven_sites)


def planner_view(spec):
    """The planner's view of `spec`'s layout (plan/counts.Setup), on the planner's GPUs (device auto)."""
    import argparse

    from plan.counts import Setup

    args = argparse.Namespace(**{**vars(spec.args), "device": "auto"})
    return Setup(args, spec.dims, spec.config, spec.dtype, spec.grad_accum, spec.parallel.pp_layers)


@contextlib.contextmanager
def concept_seams(spec):
    """What each registered concept swaps for a simulated rank (runtime/registry.Concept.simulate: the optimizer
    answers its one host read at build, an all_gather_object, from the plan), entered outside the Recorder, which
    then records each call as the rank makes it."""
    from trainer.concepts import concepts

    view = planner_view(spec)
    with contextlib.ExitStack() as stack:
        for c in concepts():
            if c.simulate is not None:
                stack.enter_context(c.simulate(spec, view))
        yield


class _Records:
    """train.run's logger, in memory: each training step's record by step."""

    def __init__(self):
        self.steps: dict[int, dict] = {}

    def log(self, record: dict) -> None:
        if "loss" in record:
            self.steps[record["step"]] = record

    def close(self) -> None:
        pass


def simulated_plan(spec):
    """The plan a simulated rank runs: at most two training steps (the second is the first with AdamW's moments and
    the planner's steady state), nothing saved, no profile or trace, and a stated peak FLOP/s (MFU means nothing
    here, and measuring the CPU's would time fake matmuls for half a second)."""
    args = dict(
        vars(spec.args),
        max_steps=min(spec.args.max_steps, 2),
        no_checkpoint=True,
        checkpoint_interval=0,
        async_checkpoint=False,
        profile=0,
        trace_step=None,
        peak_flops=spec.args.peak_flops or 1e12,
    )
    import argparse

    return replace(spec, args=argparse.Namespace(**args))


def run_fake_rank(spec, quiet: bool = True, catch: bool = True) -> RankRun:
    """Play `spec.rank` of `spec.dims.world_size` (spec.fake: config.validate of --fake_world_size/--fake_rank):
    train.build, train.run and main's closing barrier, recorded (module docstring). `quiet`: rank 0's progress
    lines go nowhere. `catch`: an exception the rank raises ends its run with code 1 and `error` saying what and
    where (raise it instead with catch False). Leaves no process group behind."""
    import train
    from debug import flight_recorder
    from parallel import comm
    from trainer import faults

    spec = simulated_plan(spec)
    run = RankRun(spec.rank, spec.dims.world_size)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    flight_recorder.install(None, spec.rank, spec.dims.world_size)
    comm.RECORDER.step, comm.RECORDER.micro = 0, -1  # a process's recorder: the last simulated rank left its step
    comm.COUNTER.reset()
    t0 = time.perf_counter()
    out = open(os.devnull, "w") if quiet else None
    try:
        with (
            concept_seams(spec),
            Recorder(run) as rec,
            fake_tensors(),
            contextlib.redirect_stdout(out) if quiet else contextlib.nullcontext(),
        ):
            trainer = train.build(spec)
            rec.phase = "run"
            trainer.faults = faults.Faults(spec.args.out_dir, spec.rank, spec.args.timeout, spec.device)
            logger = _Records()
            try:
                run.code = train.run(trainer, logger)
                if run.code in (0, faults.PREEMPTED) and dist.is_initialized():
                    rec.phase = "exit"
                    dist.barrier()  # train.main's: no rank tears the group down while a peer still has work
            finally:
                trainer.faults.close()
            run.steps = logger.steps
    except Exception as e:  # noqa: BLE001 -- what the rank would have died of, reported (a verdict, not a crash)
        if not catch:
            raise
        import traceback

        frame = traceback.extract_tb(e.__traceback__)[-1]
        run.code, run.error = (
            1,
            f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]} "
            f"({os.path.relpath(frame.filename)}:{frame.lineno})",
        )
    finally:
        if out is not None:
            out.close()
        comm.HOOKS = None
        comm.RECORDER.close()
        for s, h in handlers.items():
            signal.signal(s, h)
        if dist.is_initialized():
            dist.destroy_process_group()
        run.seconds = time.perf_counter() - t0
    return run


def summary(run: RankRun) -> str:
    """One rank's recording in a few lines: its groups, its init and per-step collectives, bytes, state, peak."""
    mine = sum(m for _, m, _ in run.groups)
    init_world = [o for o in run.ops("init") if len(o.group) == run.world]
    lines = [
        f"rank {run.rank} of {run.world}: exit {run.code}"
        + (f" ({run.error})" if run.error else "")
        + f", {run.seconds:.1f} s; {len(run.groups)} new_group calls "
        f"({mine} with this rank), {len(run.ops('init'))} ops at init ({len(init_world)} world-wide)"
    ]
    for s, m in sorted(run.steps.items()):
        ops = [o for o in run.ops("step") if o.step == s]
        lines.append(
            f"  step {s}: {len(ops)} ops ({sum(o.op in ('send', 'recv') for o in ops)} p2p); comm bytes "
            f"{m.get('comm_bytes', {})}, calls {m.get('comm_calls', {})}; state {m['state_bytes']} B"
            + (f"; peak {m['peak_allocated_bytes']} B (live storages)" if "peak_allocated_bytes" in m else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m sim.fake_rank <train.py's flags> --fake_world_size N --fake_rank r`: simulate the rank (a driver
    above train.py: it calls train's build and run, train never calls it), print its summary, write its recording
    to <out_dir>/fake_rank_<r>.json. Exit code: the simulated run's; 2 on bad flags, in one line."""
    from trainer.config import UsageError, error_line, parse_args, validate

    try:
        spec = validate(parse_args(argv))
        if not spec.fake:
            raise UsageError("python -m sim.fake_rank plays one rank: pass --fake_world_size N --fake_rank r")
    except UsageError as e:
        error_line("python -m sim.fake_rank", e)
        return 2
    run = run_fake_rank(spec, quiet=True)
    print(summary(run), flush=True)
    os.makedirs(spec.args.out_dir, exist_ok=True)
    path = os.path.join(spec.args.out_dir, f"fake_rank_{spec.rank}.json")
    with open(path, "w") as f:
        json.dump({**asdict(run), "events": [asdict(e) for e in run.events]}, f)
    print(f"recording: {path}", flush=True)
    return run.code


if __name__ == "__main__":
    raise SystemExit(main())
