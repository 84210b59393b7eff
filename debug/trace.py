"""--trace_step S: step S's module outputs and gradients as layout-independent fingerprints, one file per rank.

What is recorded, under the names one process gives them (model/gpt.py's; wrapper prefixes such as DDP's "module."
dropped):
- forward: each module's output, per micro-batch, keyed (micro, name) where `micro` is the micro-batch's index
  in the global batch (data/batches.micro_batch_chunk): the rows of step S's batch are a pure function of
  (seed, S), so every dp x micro-batch split keys the same rows alike. The head's loss is recorded as
  ("loss", micro, "lm_head"). A forward that runs again inside backward (activation checkpointing) is skipped.
- gradients: each parameter's gradient after the step's backward and gradient reduction, before clipping,
  found through the checkpoint entries (checkpoints/entries.py: every layout's elements of a parameter, by name,
  with their flat positions in the full tensor): FSDP flat shards, TP shards, DTensors and pipeline stages
  alike. The last stage's copy of the tied matrix is not written (the first stage's is), as in checkpoints.

Every rank writes only what it is the one holder of (replicated outputs and gradients: tp rank 0, replica 0):
its pieces of each full tensor as (start, length) runs of flat positions, with their float64 sum and abs sum,
the values at SAMPLES positions that are a pure function of (name, full shape), and all its values where the
full tensor has at most FULL_NUMEL elements. debug/diff.py adds the pieces up to the full tensor's fingerprint.
Nothing is communicated: each rank writes <out_dir>/trace/rank_NNNNN.pt.
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import asdict

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from checkpoints.entries import Entry, _axes, entries
from data.batches import micro_batch_chunk
from parallel.comm import local
from parallel.context_parallel.ring import local_positions
from parallel.tensor_parallel.apply import plan_style

FORMAT, VERSION = "gpt2-parallel-trace", 1
SUBDIR = "trace"
SAMPLES = 16  # sampled elements per tensor
FULL_NUMEL = 1 << 20  # tensors of at most this many elements are recorded whole
_WRAPPER_PARTS = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def canonical(name: str) -> str | None:
    """The one-process GPT name of a module or parameter name inside any wrapper; None for the wrappers and
    containers themselves (the GPT, a pipeline stage, DDP)."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
    if "transformer" in parts:
        parts = parts[parts.index("transformer") :]
    elif "lm_head" in parts:
        parts = parts[parts.index("lm_head") :]
    else:
        return None
    return ".".join(parts) if len(parts) > 1 or parts == ["lm_head"] else None


def unit_of(name: str) -> str:
    """The module that runs once per micro-batch around module `name`: its Block, or a direct child of
    `transformer` (wte, wpe, drop, ln_f)."""
    parts = name.split(".")
    return ".".join(parts[:3] if parts[1] == "h" else parts[:2])


def sample_positions(name: str, shape: tuple[int, ...]) -> list[int]:
    """SAMPLES flat positions (sorted) of a tensor `name` of full shape `shape`: a pure function of the two."""
    numel = 1
    for d in shape:
        numel *= d
    seed = int.from_bytes(hashlib.sha256(f"{name}:{tuple(shape)}".encode()).digest()[:8], "little")
    return sorted(random.Random(seed).sample(range(numel), min(SAMPLES, numel)))


def piece(
    kind: str,
    micro: int | None,
    name: str,
    shape: tuple[int, ...],
    runs: torch.Tensor,
    values: torch.Tensor,
    combine: str = "place",
) -> dict:
    """One rank's piece of a full tensor: `values` (1-D, in run order) at the flat positions `runs` covers.
    combine "place": pieces tile the tensor; "sum": each piece covers it all and they add up (CP's loss)."""
    v = values.detach().reshape(-1).to(torch.float64).cpu()
    numel = 1
    for d in shape:
        numel *= d
    offsets = torch.cumsum(runs[:, 1], 0) - runs[:, 1]  # where each run's values start in `values`
    order = torch.argsort(runs[:, 0])  # runs are in local order; a strided DTensor shard's need not ascend
    starts, lengths, offsets = runs[order, 0], runs[order, 1], offsets[order]
    want = torch.tensor(sample_positions(name, shape), dtype=torch.int64)
    k = (torch.searchsorted(starts, want, right=True) - 1).clamp(min=0)
    held = (
        (want >= starts[k]) & (want < starts[k] + lengths[k])
        if len(starts)
        else torch.zeros_like(want, dtype=torch.bool)
    )
    at = want[held]
    record = {
        "kind": kind,
        "micro": micro,
        "name": name,
        "shape": tuple(shape),
        "combine": combine,
        "n": v.numel(),
        "sum": float(v.sum()),
        "abs": float(v.abs().sum()),
        "sample_at": at,
        "sample": v[offsets[k[held]] + at - starts[k[held]]] if len(starts) else v[:0],
        "runs": runs.clone(),
    }
    if numel <= FULL_NUMEL:
        record["values"] = values.detach().reshape(-1).cpu().clone()
    return record


def _runs(shape: tuple[int, ...], axes: list) -> torch.Tensor:
    """(start, length) runs of the block `axes` (per dim, the positions held) of a tensor of `shape`."""
    n = 1
    for a in axes:
        n *= len(a)
    return Entry("", tuple(shape), tuple(axes), (0, n), {}, True).runs()


class Tracer:
    """Records step `step` of a Trainer `trainer` (train.py): `before_step(trainer, step)` hooks every module and the
    head's
    loss, `after_backward(trainer, step)` removes them, adds the gradients and writes this rank's file. Any other
    step (all of them with step None): no-ops."""

    def __init__(self, step: int | None = None):
        self.step, self.trainer = step, None
        self.records: list[dict] = []
        self.handles: list = []
        self.calls: dict[str, int] = {}

    # ---- forward

    def before_step(self, trainer, step: int) -> None:
        if step != self.step:
            return
        self.trainer, mesh = trainer, trainer.mesh
        self.tp, self.cp, self.dp, self.dp_rank = mesh["tp"], mesh["cp"], trainer.spec.dims.dp, trainer.dp_rank
        self.mb, self.T = trainer.spec.args.micro_batch_size, trainer.spec.args.seq_len
        self.micro: dict[str, int] = {}  # unit -> the micro-batch it is running (global index)
        self.repeats: dict[tuple, int] = {}  # (micro, name) -> calls so far (a Block's dropout runs twice)
        parallelized, seen = trainer.parallelized, set()
        for root in (
            parallelized.model,
            parallelized.stage,
            *getattr(parallelized.model, "chunk_modules", {}).values(),
        ):
            for name, module in root.named_modules() if root is not None else ():
                name = canonical(name)
                if id(module) in seen or name == "lm_head":  # a hooked head would run whole (loss.head_output)
                    continue
                if ".mlp." in (name or "") and (".experts" in name or name.endswith(".router")):
                    continue  # inside an MoE layer rows are grouped by expert, not by token: its output is traced
                seen.add(id(module))
                if name is None:
                    if hasattr(module, "head_loss"):  # the GPT, or a pipeline stage: the head's loss
                        self._wrap_loss(module)
                    continue
                if name == unit_of(name):
                    self.handles.append(module.register_forward_pre_hook(self._enter(name)))
                self.handles.append(module.register_forward_hook(self._hook(name)))

    def _enter(self, unit: str):
        """A unit (a Block, wte, wpe, the embedding dropout, ln_f) runs once per micro-batch, in micro-batch order
        (every schedule runs a chunk's forwards in order): its k-th forward is this rank's k-th micro-batch."""

        def pre_hook(module: nn.Module, args) -> None:
            if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
                self.calls[unit] = self.calls.get(unit, 0) + 1
                self.micro[unit] = micro_batch_chunk(self.calls[unit] - 1, self.dp_rank, self.dp)

        return pre_hook

    def _hook(self, name: str):
        unit = unit_of(name)

        def hook(module: nn.Module, args, output) -> None:
            if not isinstance(output, torch.Tensor) or torch._C._current_graph_task_id() != -1:
                return  # not an activation, or a recomputation inside backward (activation checkpointing)
            micro = self.micro[unit]
            j = self.repeats[micro, name] = self.repeats.get((micro, name), -1) + 1
            placed = self._place(name, output)
            if placed is not None:
                shape, axes, values = placed
                key = name if j == 0 else f"{name}#{j}"
                self.records.append(piece("forward", micro, key, shape, _runs(shape, axes), values))

        return hook

    def _wrap_loss(self, owner: nn.Module) -> None:
        """The head's loss per micro-batch, as ("loss", micro, "lm_head"): under CP each rank's mean over its
        share of the tokens, divided by C, so that the pieces add up to the whole rows' mean."""
        for attr in ("head_loss", "loss_fn"):
            inner = getattr(owner, attr, None)
            if inner is None:
                continue

            def wrapped(*args, _inner=inner, _attr=attr, **kw):
                loss = _inner(*args, **kw)
                if torch._C._current_graph_task_id() == -1:
                    value = local(loss).detach().float().reshape(1) / self.cp.size
                    self.calls[_attr] = self.calls.get(_attr, 0) + 1
                    micro = micro_batch_chunk(self.calls[_attr] - 1, self.dp_rank, self.dp)
                    if self.tp.rank == 0:
                        self.records.append(
                            piece(
                                "loss",
                                micro,
                                "lm_head",
                                (1,),
                                torch.tensor([[0, 1]]),
                                value,
                                "sum" if self.cp.size > 1 else "place",
                            )
                        )
                return loss

            owner.__dict__[attr] = wrapped
            self.handles.append((owner, attr, inner))

    def _place(self, name: str, out: torch.Tensor):
        """(full shape, per-dim positions, local values) of this rank's piece of module `name`'s output, or None
        where another rank holds the same elements (replicated over tp: tp rank 0 writes them)."""
        if isinstance(out, DTensor):
            if any(pl.is_partial() for pl in out.placements):
                return None  # a partial sum: a later module's output has it whole
            coords = out.device_mesh.get_coordinate()
            if any(c != 0 for c, pl in zip(coords, out.placements) if pl.is_replicate()):
                return None
            return tuple(out.shape), list(_axes(out)), out.to_local()
        cfg = self.trainer.spec.config
        full = list(out.shape)
        axes: list = [range(n) for n in full]
        sharded = False
        seq = 0 if out.dim() == 2 else 2 if name.endswith(".attn.core") else 1  # wpe's output is (T, C)
        T, tp = self.T, self.tp.size
        positions = local_positions(T, self.cp.rank, self.cp.size) if self.cp.size > 1 else torch.arange(T)
        n = out.shape[seq]
        if n * tp == len(positions) and tp > 1:  # sequence parallel: this tp rank's slice of its share
            positions, sharded = positions[self.tp.rank * n : (self.tp.rank + 1) * n], True
        elif n != len(positions):
            raise ValueError(
                f"--trace_step: {name}'s output {tuple(out.shape)} has {n} positions along dim "
                f"{seq}; expected {len(positions)}"
            )
        full[seq], axes[seq] = T, _compact(positions)
        if name.endswith(".attn.core"):
            full_width, dim = cfg.n_head, 1
        else:
            full_width, dim = (
                (4 * cfg.n_embd if name.endswith(".mlp.c_fc") else cfg.vocab_size if name == "lm_head" else cfg.n_embd),
                out.dim() - 1,
            )
        w = out.shape[dim]
        if (
            w * tp == full_width
            and tp > 1
            and (plan_style(name) in ("colwise", "vocab_head") or name.endswith(".attn.core"))
        ):
            full[dim], axes[dim], sharded = full_width, range(self.tp.rank * w, (self.tp.rank + 1) * w), True
        elif w != full_width:
            raise ValueError(
                f"--trace_step: {name}'s output {tuple(out.shape)}: dim {dim} is {w}, expected {full_width}"
            )
        if tp > 1 and not sharded and self.tp.rank != 0:
            return None
        return tuple(full), axes, out

    # ---- gradients and the file

    def after_backward(self, trainer, step: int) -> None:
        if step != self.step:
            return
        for h in self.handles:
            if isinstance(h, tuple):
                owner, attr, inner = h
                owner.__dict__[attr] = inner
            else:
                h.remove()
        self.handles = []
        self.records += gradient_pieces(self.trainer.parallelized, self.trainer.optimizer)
        self.write()

    def write(self) -> str:
        spec = self.trainer.spec
        d, p = spec.dims, spec.parallel
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "step": self.step,
            "rank": spec.rank,
            "world_size": d.world_size,
            "model": asdict(spec.config),
            "batch": {"micro_batch_size": self.mb, "seq_len": self.T, "rows": spec.rows, "seed": spec.args.seed},
            "dtype": str(spec.dtype).removeprefix("torch."),
            "device": spec.device.type,
            "layout": {
                **d.sizes(),
                "implementation": p.implementation,
                "dp_type": p.dp_type,
                "sequence_parallel": p.sequence_parallel,
                "loss_parallel": p.loss_parallel,
            },
        }
        folder = os.path.join(spec.args.out_dir, SUBDIR)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank_{spec.rank:05d}.pt")
        torch.save({"meta": meta, "records": self.records}, path + ".tmp")
        os.replace(path + ".tmp", path)
        self.records = []
        return path


def _compact(positions: torch.Tensor):
    start = int(positions[0])
    if bool((positions == torch.arange(start, start + len(positions))).all()):
        return range(start, start + len(positions))
    return positions


def gradient_pieces(parallelized, optimizer: torch.optim.Optimizer) -> list[dict]:
    """This rank's pieces of every parameter's gradient, by name: the checkpoint entries this rank writes, each
    with the gradient elements at the same places as the parameter elements its "param" view holds (the view's
    storage offset inside a parameter the optimizer steps, or a model parameter, gives the gradient's)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    params += [p for p in parallelized.model.parameters() if all(p is not q for q in params)]
    by_storage: dict[int, list] = {}
    for p in params:
        lp = local(p)
        if lp.numel():
            by_storage.setdefault(lp.untyped_storage().data_ptr(), []).append(p)
    out = []
    buffers = {id(b) for b in parallelized.model.buffers()}
    for e in entries(parallelized, optimizer):
        if not (e.write and e.numel) or any(
            e.tensors["param"]._base is b or e.tensors["param"] is b
            for b in parallelized.model.buffers()
            if id(b) in buffers
        ):
            continue  # a state buffer (the MoE expert bias) has no gradient
        view = e.tensors["param"]
        grad = None
        for p in by_storage.get(view.untyped_storage().data_ptr(), []):
            lp = local(p)
            lo = view.storage_offset() - lp.storage_offset()
            if 0 <= lo and lo + view.numel() <= lp.numel() and lp.is_contiguous():
                grad = (
                    torch.zeros(view.numel()) if p.grad is None else local(p.grad).reshape(-1)[lo : lo + view.numel()]
                )
                break
        if grad is None:
            raise RuntimeError(f"--trace_step: no parameter holds the elements of {e.name} this rank writes")
        out.append(piece("grad", None, e.name, e.shape, e.runs(), grad))
    return out
