"""Replica groups on torchft: the one object train.py's loop asks about the replica dimension.

Each replica group is its own torchrun job running any layout we have; the groups are replicas of each other, and
torchft's `Manager` (one per rank) keeps them a job: at every step it asks the lighthouse for a quorum (the live
groups), rebuilds the cross-group process group when the quorum changed (gloo on CPU, NCCL on GPU: group rank r of
every group in one group), heals a group that is behind from a live peer through its checkpoint transport, and
decides whether the step commits (`should_commit`: no error anywhere in the group).

What we do differently from torchft's DDP (its `Manager.allreduce` averages: divides by the groups that answered,
so after a loss the global batch shrinks and the math changes): the global batch of step s is a pure function of
(seed, s) (data/batches.py), and the live groups cut the step's micro-steps among themselves by their position in
the quorum (`flags.shares`), so the survivors take a lost group's micro-batches. A group's gradients, already the
mean over its own micro-batches (its layout reduced them inside the group), are scaled by its share of the step,
micro-steps / grad_accum, and SUMMED over the groups: the mean over the whole global batch, whoever is alive. A step
in which a group dies is not committed anywhere (its all-reduce fails), and the quorum that follows redoes it with
the survivors' shares: no micro-batch is counted twice or dropped. Every step's loss and parameters equal one
process's within the data-parallel tolerance (tests/test_ft.py).

The loop's side (train.py), the same calls with or without replica groups (`Alone` is the job of one group):

    join(restore) -> start      restore() the newest checkpoint (as --resume), then the first quorum: a group behind
                                a live peer heals from it
    steps(start, max_steps)     each step after a quorum; a step that did not commit comes again
    micro_steps(grad_accum)     this group's share of the step's micro-steps (a range of their indices)
    reduce(parallelized, loss)  the cross-group SUM of gradients and loss, then the commit vote: the summed loss,
                                or None (not committed: the loop redoes the step)
    record()                    what the step's metrics add (ft_replicas: the live groups)
    saves                       this group writes the checkpoints (the first live group)

A test hook (tests/test_ft.py, bench/ft.py; a group lost mid-step is trainer/faults.py's GPT_SIGNAL_AT_STEP with
GPT_SIGNAL=KILL): GPT_FT_FULL_AT=s1,s2,... makes a group wait before each of these steps, taking quorums, until all
--ft_replica_groups are live (a test holds the survivors until a relaunched group is back).
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Callable, Iterator

import torch

from ft import flags, heal
from parallel import comm
from runtime.device import backend_for


class Alone:
    """No replica groups: the loop as it always ran."""

    saves = True

    def join(self, restore: Callable[[], int]) -> int:
        return restore()

    def steps(self, start: int, max_steps: int) -> range:
        return range(start + 1, max_steps + 1)

    def micro_steps(self, grad_accum: int) -> range:
        return range(grad_accum)

    def reduce(self, parallelized, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def record(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def connect(spec, trainer, logger) -> Alone:
    """The run's replica groups (`Replicas`, joined to the lighthouse's job) under --ft_lighthouse, else `Alone`."""
    return Replicas(spec, trainer, logger) if flags.enabled(spec.args) else Alone()


def quorum_group(backend: str, timeout: timedelta):
    """torchft's reconfigurable process group for `backend` ("gloo" or "nccl", runtime/device.py's choice), which
    also keeps the quorum's members: the replica groups' ids, from the ranks torchft configures it with."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    base = {"gloo": ProcessGroupGloo, "nccl": ProcessGroupNCCL}[backend]

    class QuorumGroup(base):
        members: list[int] | None = None

        def configure(
            self, store_addr, replica_id, rank, world_size, quorum_id=None, group_rank=None, size=None, ranks=None
        ):
            # torchft numbers rank r of replica group g (replica_id "group_g") g * size + r
            self.members = sorted({r // size for r in ranks}) if ranks and size else None
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank, size, ranks)

    return QuorumGroup(timeout=timeout)


def _store(spec) -> tuple[str, int, object]:
    """The group's TCPStore, where torchft's manager finds rank 0's server: torchrun's (MASTER_ADDR/PORT), or for a
    one-rank `python train.py` one of our own, kept alive with the run."""
    if "MASTER_ADDR" in os.environ:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None
    store = torch.distributed.TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
    return socket.gethostname(), store.port, store


def timed_transport(timeout: timedelta):
    """torchft's HTTP checkpoint transport, timing what it sends and receives (a heal's seconds, by side)."""
    from torchft.checkpointing import HTTPTransport

    class TimedTransport(HTTPTransport):
        sent_s = received_s = 0.0

        def send_checkpoint(self, dst_ranks, step, state_dict, timeout):
            t0 = time.perf_counter()
            super().send_checkpoint(dst_ranks, step, state_dict, timeout)
            self.sent_s = time.perf_counter() - t0

        def recv_checkpoint(self, src_rank, metadata, step, timeout):
            t0 = time.perf_counter()
            out = super().recv_checkpoint(src_rank, metadata, step, timeout)
            self.received_s = time.perf_counter() - t0
            return out

    return TimedTransport(timeout=timeout, num_chunks=0)


class Replicas:
    """This rank of replica group `--ft_replica_group` in a job of `--ft_replica_groups`, on torchft's Manager (the
    module docstring). Events (a group lost or joined, this group healed, a step not committed) are logged on rank
    0 of the group, as records with `ft_event` and a numeric `ft_<event>` (plotted in TensorBoard), and printed."""

    def __init__(self, spec, trainer, logger):
        from torchft.manager import Manager

        args = spec.args
        self.trainer, self.logger, self.main = trainer, logger, spec.rank == 0
        self.group, self.groups, self.grad_accum = args.ft_replica_group, args.ft_replica_groups, spec.grad_accum
        timeout, connect_s = (timedelta(seconds=s) for s in flags.timeouts(args))
        self.pg = quorum_group(backend_for(spec.device), timeout)
        self.transport = timed_transport(timeout)
        addr, port, self._own_store = _store(spec)
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=1,
            use_async_quorum=False,  # the quorum (and a heal) completes before the step's forward
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=connect_s,
            rank=spec.rank,
            world_size=spec.dims.world_size,
            store_addr=addr,
            store_port=port,
            lighthouse_addr=args.ft_lighthouse,
            replica_id=f"group_{self.group}",
            checkpoint_transport=self.transport,
            init_sync=False,  # every group builds the same initial weights: a pure function of (seed, name)
        )
        self.members: list[int] = []
        self.share, self.step, self.healed, self.fresh = range(0), 0, None, False
        self.timing: dict[str, float] = {}
        self.nbytes = 0  # the last reduce's

    # ---- what torchft calls: this rank's state for a peer that heals, and a peer's state when this group heals

    def _state(self) -> dict:
        t = self.trainer
        return heal.state(t.parallelized, t.optimizer, self.manager.current_step(), self.group)

    def _load(self, sent: dict) -> None:
        t = self.trainer
        self.healed = (heal.load(sent, t.parallelized, t.optimizer), sent["group"], heal.nbytes(sent))

    # ---- the loop's calls

    @property
    def saves(self) -> bool:
        return bool(self.members) and self.members[0] == self.group

    def join(self, restore: Callable[[], int]) -> int:
        """The newest checkpoint (`restore`, as --resume), then the first quorum, which is also the first step's:
        a group behind a live peer heals from it (the peer's state and step replace the restored ones). Every quorum
        is taken with the group's true step, so torchft picks the most advanced group as the source of a heal."""
        start = restore()
        if start:
            self.manager.load_state_dict({"step": start, "batches_committed": 0})
        self._quorum()
        self.fresh = True  # the first step runs in this quorum: every group takes exactly one quorum per step
        return self.manager.current_step()

    def steps(self, start: int, max_steps: int) -> Iterator[int]:
        """The step after the quorum's, once each quorum, up to max_steps; a step that did not commit comes again
        (in a new quorum: the survivors')."""
        while self.manager.current_step() < max_steps:
            if not self.fresh:
                self._quorum()
            self.fresh = False
            self._wait_for_all(self.manager.current_step() + 1)
            self.step = self.manager.current_step() + 1
            yield self.step

    def micro_steps(self, grad_accum: int) -> range:
        return self.share

    def _wait_for_all(self, step: int) -> None:
        """GPT_FT_FULL_AT's hook (the module docstring)."""
        while str(step) in os.environ.get("GPT_FT_FULL_AT", "").split(",") and len(self.members) < self.groups:
            time.sleep(0.1)
            self._quorum()

    def _quorum(self) -> None:
        """torchft's quorum (a heal inside it), then this group's share of the step and the events it brought."""
        before, self.healed = self.members, None
        t0 = time.perf_counter()
        self.manager.start_quorum()
        self.timing = {"quorum": time.perf_counter() - t0}
        self.members = self.pg.members or before
        if self.group not in self.members:  # the quorum failed to configure: the step will not commit
            self.share = range(0, 0)
            return
        self.share = flags.shares(self.grad_accum, len(self.members))[self.members.index(self.group)]
        step = self.manager.current_step() + 1  # the step this quorum runs
        if self.healed is not None:
            healed_step, source, nbytes = self.healed
            self._event(
                step,
                "healed",
                f"healed with step {healed_step}'s state from replica group {source}: {nbytes / 1e6:.1f} MB in "
                f"{self.transport.received_s:.2f}s (the quorum took {self.timing['quorum']:.2f}s)",
                ft_from=source,
                ft_heal_s=self.transport.received_s,
                ft_heal_bytes=nbytes,
            )
        lost, joined = sorted(set(before) - set(self.members)), sorted(set(self.members) - set(before))
        if lost:
            self._event(
                step, "lost", f"lost replica groups {lost}: {len(self.members)} live {self.members}", ft_groups=lost
            )
        if joined:
            self._event(
                step,
                "joined",
                f"replica groups {joined} joined: {len(self.members)} live {self.members}",
                ft_groups=joined,
            )

    def reduce(self, parallelized, loss: torch.Tensor) -> torch.Tensor | None:
        """The cross-group SUM (the module docstring), then the commit vote: the summed loss share, or None when the
        step did not commit (gradients and loss are then garbage: the loop zeroes them and redoes the step)."""
        t0 = time.perf_counter()
        weight = len(self.share) / self.grad_accum
        grads = _gradients(parallelized)
        self.nbytes = 0
        for dtype in sorted({g.dtype for g in grads} | {torch.float32}, key=str):  # the loss rides in fp32
            mine = [g for g in grads if g.dtype == dtype]
            extra = [loss.detach().float().reshape(1)] if dtype == torch.float32 else []
            flat = torch.cat([g.reshape(-1) for g in mine] + extra).mul_(weight)
            self._all_reduce(flat)
            for g, part in zip(mine, flat.split([g.numel() for g in mine] + [len(extra)])):
                g.copy_(part.view_as(g))
            if extra:
                loss = flat[-1]
        self.timing["reduce"] = time.perf_counter() - t0
        if not self.manager.should_commit():
            error = self.manager.errored()
            text = str(error.original_exception if error else "another rank's").strip().splitlines()[0][:160]
            self._event(
                self.step,
                "uncommitted",
                f"step {self.step} not committed ({text}): redone",
                ft_replicas=len(self.members),
            )
            return None
        return loss

    def _all_reduce(self, flat: torch.Tensor) -> None:
        """SUM over the quorum's groups through torchft (an error is recorded, not raised: the commit vote fails),
        counted as parallel/comm.py counts every collective of ours."""
        from torch.distributed import ReduceOp

        comm.COUNTER.add("all_reduce", flat.numel() * flat.element_size())
        self.nbytes += flat.numel() * flat.element_size()
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()

    def record(self) -> dict:
        return {
            "ft_replicas": len(self.members),
            "ft_micro_steps": len(self.share),
            "ft_quorum_ms": self.timing["quorum"] * 1000,
            "ft_reduce_ms": self.timing.get("reduce", 0.0) * 1000,
            "ft_reduce_bytes": self.nbytes,
        }

    def _event(self, step: int, event: str, line: str, **fields) -> None:
        if self.main:
            print(f"ft: replica group {self.group}: {line}", flush=True)
            self.logger.log({"step": step, "ft_event": event, f"ft_{event}": 1, "time": time.time(), **fields})

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _gradients(parallelized) -> list[torch.Tensor]:
    """This rank's gradient tensors, each once (an FSDP flat shard's is listed once per parameter it holds), as the
    gradient norm sees them (the wrapper's grad_norm_items): local shards of DTensors."""
    out, seen = [], set()
    for p, *_ in parallelized.dp.grad_norm_items():
        if p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            out.append(comm.local(p.grad))
    return out
