"""Our FSDP (parallel/data_parallel/fsdp.py) on 2 gloo ranks against torch's FSDP2 (`fully_shard`) and a single process.

Each test reads one measurement, registered right above it (`@measures.register`, tests/harness.py's
Measurements): a function that runs inside the ranks and returns what the test checks. The ranks are started
once for the whole file (spawning costs seconds), in the first class's setUpClass, and run every measurement
in turn; the training runs several measurements compare against are computed once per rank (`_run_ours`,
`_run_fsdp2`). Under torchrun each rank checks its own measurements. Properties are measured from outside the
module where it can be done: collectives as torch.distributed receives them, bytes from the storages
actually held, coverage as exact intervals.
"""

from __future__ import annotations

import functools
import gc
import unittest
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from checkpoints.entries import entries_for_fsdp
from debug import flight_recorder
from model.gpt import GPT, GPTConfig, materialize_module, param_groups
from parallel import comm
from parallel.data_parallel.fsdp import FullyShardedDataParallel as FSDP
from parallel.protocol import Placement, Sharded
from plan.theory import engine_comm_bytes_per_micro_step
from tests.harness import Measurements

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
WORLD, STEPS, ACCUM, B, T = 2, 3, 2, 2, 32
LR, WD = 1e-2, 0.1
MAX_NORM = 0.25  # below the gradient norms of this run (0.4-0.8), so clipping acts at every step


# ----------------------------------------------------------------------------- whole-model views, for the tests
# The runtime reads our engine only through its sharded views (checkpoints/entries.py); a test compares the
# whole model against one process, through these views of FlatLayout's shards.


def full_state_dict(model: FSDP) -> dict[str, torch.Tensor] | None:
    """The unsharded fp32 state dict, keyed like GPT.state_dict() (tied weight under both names), on group rank 0;
    None elsewhere. Every rank must call it: one all-gather per unit, over its group."""
    layout, out = model.layout, {}
    for unit in layout.units:
        full = torch.empty(unit.padded, dtype=torch.float32, device=unit.shard.device)
        comm.all_gather_into_tensor(full, unit.shard, unit.group)
        if layout.rank == 0:
            for spec in unit.specs:
                value = full[spec.offset : spec.offset + spec.numel].view(spec.shape).clone()
                out.update((name, value) for name in spec.names)
    return {name: out[name] for name in layout.names} if layout.rank == 0 else None


def load_sharded_state_dict(model: FSDP, sd: dict) -> None:
    """Copy this rank's pieces (the layout `sharded_state_dict()` gives) into the shards."""
    layout = model.layout
    for unit in layout.units:
        unit.reshard()
        for spec in unit.specs:
            a, b, start = layout.held(unit, spec)
            piece = sd[spec.names[0]]
            assert (piece.offset, piece.flat.numel()) == (a, b - a), spec.names[0]
            unit.shard[start : start + b - a].copy_(piece.flat)


def load_full_state_dict_from_rank0(model: FSDP, sd: dict | None) -> None:
    """Load group rank 0's unsharded state dict (the others pass None): each unit's flat buffer broadcast."""
    layout = model.layout
    for unit in layout.units:
        unit.reshard()
        full = torch.zeros(unit.padded, dtype=torch.float32, device=unit.shard.device)
        if layout.rank == 0:
            for spec in unit.specs:
                full[spec.offset : spec.offset + spec.numel].copy_(sd[spec.names[0]].reshape(-1))
        src = dist.get_global_rank(layout.group, 0) if layout.group is not None and layout.world > 1 else 0
        comm.broadcast(full, src, layout.group)
        S = unit.shard.numel()
        unit.shard.copy_(full[layout.rank * S : (layout.rank + 1) * S])


def _data(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s micro-batch: the same numbers on every rank and in the single-process reference."""
    tokens = torch.randint(
        0, CFG.vocab_size, (STEPS, ACCUM, WORLD, B, T + 1), generator=torch.Generator().manual_seed(1234)
    )[step, micro, rank]
    return tokens[:, :-1], tokens[:, 1:]


def _eager_gpt() -> GPT:
    model = GPT(CFG)
    model.init_weights(seed=0)
    return model


def _fsdp2(mp: MixedPrecisionPolicy | None = None) -> GPT:
    model = _eager_gpt()
    kw = {"mp_policy": mp} if mp is not None else {}
    for block in model.transformer.h:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _train(model, optimizer, clip, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """STEPS optimizer steps of ACCUM micro-steps each; returns (this rank's micro losses, grad norms)."""
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(ACCUM):
            _, loss = model(*_data(step, micro, rank))
            (loss / ACCUM).backward()
            losses.append(loss.detach())
        if clip is not None:
            norm = clip(MAX_NORM)
            norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        optimizer.step()
        optimizer.zero_grad()
    return torch.stack(losses), torch.stack(norms) if norms else torch.zeros(0)


@functools.cache
def _run_ours(rank: int, clip: bool, **kw) -> tuple:
    """(micro losses, grad norms, full state dict on rank 0, model, optimizer), trained once per rank and
    (clip, kw): several measurements compare against the same run, and only read it."""
    model = FSDP(_eager_gpt(), **kw)
    opt = torch.optim.AdamW(model.param_groups(WD), lr=LR)
    losses, norms = _train(model, opt, model.clip_grad_norm_ if clip else None, rank)
    return losses, norms, full_state_dict(model), model, opt


@functools.cache
def _run_fsdp2(rank: int, clip: bool, mp: MixedPrecisionPolicy | None = None):
    """The same for FSDP2, trained once per rank and (clip, mp)."""
    model = _fsdp2(mp)
    opt = torch.optim.AdamW(param_groups(list(model.named_parameters()), WD), lr=LR)
    clip_fn = (lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c)) if clip else None
    losses, norms = _train(model, opt, clip_fn, rank)
    return losses, norms, {k: v.full_tensor() for k, v in model.state_dict().items()}, model, opt


def _rel(a: dict, b: dict) -> float:
    """Whole-model relative error ||a - b|| / ||b|| over every parameter."""
    num = sum(((a[k] - b[k]).double() ** 2).sum() for k in b) ** 0.5
    return float(num / sum((b[k].double() ** 2).sum() for k in b) ** 0.5)


def _intervals(pieces: dict) -> dict:
    """Every rank's [start, end) element intervals of each key's piece (`pieces`: key -> (offset, numel)),
    gathered onto every rank; empty pieces left out."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {k: (o, o + n) for k, (o, n) in pieces.items() if n})
    return {k: sorted(r[k] for r in everyone if k in r) for k in pieces}


def _gamma(n: int, u: float) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of n roundings to unit roundoff u."""
    return n * u / (1 - n * u)


def tiles(intervals: list[tuple[int, int]], numel: int) -> bool:
    """The intervals, in order, cover [0, numel) exactly: no gap, no overlap."""
    end = 0
    for a, b in intervals:
        if a != end:
            return False
        end = b
    return end == numel


def _live_storages() -> dict[int, int]:
    """data_ptr -> nbytes of the storage of every tensor Python can reach (meta and empty ones left out)."""
    gc.collect()
    out = {}
    for o in gc.get_objects():
        if not issubclass(type(o), torch.Tensor) or o.is_meta:
            continue
        try:
            ptr, n = o.untyped_storage().data_ptr(), o.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses (DTensor): their local tensor counts
            continue
        if n:
            out[ptr] = n
    return out


measures = Measurements(WORLD)


# ------------------------------------------------------------------------------------------- parity


class TestFSDPParity(unittest.TestCase):
    """Losses and weights after 3 AdamW steps of 2 accumulated micro-steps, each rank its own data."""

    @classmethod
    def setUpClass(cls):
        measures.run()

    @measures.register("fsdp2_fp32")
    def measure_fsdp2_fp32(rank: int, world_size: int) -> dict:
        """Against FSDP2, fp32, no clipping: the same math on the same numbers."""
        ours, theirs = _run_ours(rank, clip=False), _run_fsdp2(rank, clip=False)
        out = {"rank": rank, "losses": (ours[0], theirs[0])}
        if rank == 0:
            out["params_equal"] = list(ours[2]) == list(theirs[2]) and all(
                torch.equal(ours[2][k], theirs[2][k]) for k in theirs[2]
            )
        return out

    def test_equals_fsdp2_bitwise_without_clipping(self):
        # Same per-element math: grads of the same ops, SUM/2 == AVG for 2 ranks, elementwise AdamW.
        for r in measures["fsdp2_fp32"]:
            self.assertTrue(torch.equal(*r["losses"]), r["losses"])
            if r["rank"] == 0:
                self.assertTrue(r["params_equal"])

    @measures.register("fsdp2_moments")
    def measure_fsdp2_moments(rank: int, world_size: int) -> dict:
        """The same runs' AdamW moments: this rank's slices of them (as checkpoints read them) against FSDP2's,
        gathered."""
        ours, theirs = _run_ours(rank, clip=False), _run_fsdp2(rank, clip=False)
        entries = {e.name: e for e in entries_for_fsdp(ours[3], ours[4], tp_rank=0)}  # the checkpoint's view
        match, held, sizes = True, {}, {}
        for name, p in theirs[3].named_parameters():
            for key in ("exp_avg", "exp_avg_sq"):
                full, piece, (lo, hi) = (
                    theirs[4].state[p][key].full_tensor().reshape(-1),
                    entries[name].tensors[key],
                    entries[name].span,
                )
                match &= torch.equal(piece, full[lo:hi])
                held[f"{name}/{key}"] = (lo, hi - lo)
                sizes[f"{name}/{key}"] = p.numel()
        return {"match": match, "intervals": _intervals(held), "numel": sizes}

    def test_sharded_optimizer_state_equals_fsdp2_bitwise(self):
        for r in measures["fsdp2_moments"]:
            self.assertTrue(r["match"])
            for key, intervals in r["intervals"].items():  # the ranks' slices tile each moment
                self.assertTrue(tiles(intervals, r["numel"][key]), f"{key}: {intervals}")

    @measures.register("fsdp2_clipped")
    def measure_fsdp2_clipped(rank: int, world_size: int) -> dict:
        """Against FSDP2 with clipping: the global norm is summed in a different order."""
        ours, theirs = _run_ours(rank, clip=True), _run_fsdp2(rank, clip=True)
        out = {"rank": rank, "losses": (ours[0], theirs[0]), "norms": (ours[1], theirs[1])}
        if rank == 0:
            out["params_rel"] = _rel(ours[2], theirs[2])
        return out

    def test_equals_fsdp2_with_clipping_within_1e6(self):
        # Not bitwise: FSDP2 sums per-parameter norms of its row shards, we sum squares of our flat shards,
        # so the norm (hence the clip coefficient) may differ in the last bit. Tolerance 1e-6 relative for
        # norms and losses, and for the weights as a whole (||ours - fsdp2|| / ||fsdp2||): elementwise,
        # AdamW turns last-bit noise in zero-mean gradients (the attention key biases) into ~1e-6 moves.
        for r in measures["fsdp2_clipped"]:
            ours, theirs = r["norms"]
            self.assertTrue(bool((theirs > MAX_NORM).all()), f"clipping never acted: {theirs}")
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
            torch.testing.assert_close(*r["losses"], rtol=1e-6, atol=0)
            if r["rank"] == 0:
                self.assertLessEqual(r["params_rel"], 1e-6)

    @measures.register("fsdp2_mixed_precision")
    def measure_fsdp2_mixed_precision(rank: int, world_size: int) -> dict:
        """Against FSDP2 in mixed precision (bf16 compute copies, fp32 reduce-scatter), no clipping."""
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        ours = _run_ours(rank, clip=False, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        theirs = _run_fsdp2(rank, clip=False, mp=mp)
        out = {"rank": rank, "losses": (ours[0], theirs[0])}
        if rank == 0:
            out["params_equal"] = all(torch.equal(ours[2][k], theirs[2][k]) for k in theirs[2])
        return out

    def test_mixed_precision_equals_fsdp2_bitwise(self):
        for r in measures["fsdp2_mixed_precision"]:
            self.assertTrue(torch.equal(*r["losses"]), r["losses"])
            if r["rank"] == 0:
                self.assertTrue(r["params_equal"])

    @measures.register("single_process")
    def measure_single_process(rank: int, world_size: int) -> dict:
        """Against one process on the concatenated global batch (all ranks' micro-batches), with clipping."""
        ref = _eager_gpt()
        opt = torch.optim.AdamW(param_groups(list(ref.named_parameters()), WD), lr=LR)
        ref_losses, ref_norms = [], []
        for step in range(STEPS):
            xs, ys = zip(*[_data(step, m, r) for m in range(ACCUM) for r in range(world_size)])
            _, loss = ref(torch.cat(xs), torch.cat(ys))
            loss.backward()
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.detach())
        ours = _run_ours(rank, clip=True)
        global_losses = ours[0].view(STEPS, ACCUM).mean(1)
        dist.all_reduce(global_losses)
        out = {
            "rank": rank,
            "losses": (global_losses / world_size, torch.stack(ref_losses)),
            "norms": (ours[1], torch.stack(ref_norms)),
        }
        if rank == 0:
            out["params_rel"] = _rel(ours[2], ref.state_dict())
        return out

    def test_equals_single_process_on_concatenated_batch(self):
        # One batch of 8 sums in a different order than 2 ranks x 2 micro-batches of 2: losses and gradient
        # norms within 1e-6 relative, weights within 1e-5 relative as a whole (AdamW amplifies last bits).
        for r in measures["single_process"]:
            torch.testing.assert_close(*r["losses"], rtol=1e-6, atol=0)
            torch.testing.assert_close(*r["norms"], rtol=1e-6, atol=0)
            if r["rank"] == 0:
                self.assertLessEqual(r["params_rel"], 1e-5)

    @measures.register("deferred_vs_eager")
    def measure_deferred_vs_eager(rank: int, world_size: int) -> dict:
        """A meta GPT materialised unit by unit: its state dict, and its training against eager init's."""
        with torch.device("meta"):
            meta_gpt = GPT(CFG)
        init = functools.partial(materialize_module, config=CFG, seed=0, device="cpu")  # what parallelize hands in
        deferred = FSDP(meta_gpt, materialize=init, device="cpu")
        deferred_sd = full_state_dict(deferred)
        opt = torch.optim.AdamW(deferred.param_groups(WD), lr=LR)
        out = {
            "rank": rank,
            "losses": (_train(deferred, opt, deferred.clip_grad_norm_, rank)[0], _run_ours(rank, clip=True)[0]),
        }
        if rank == 0:
            eager_sd = _eager_gpt().state_dict()
            out["init_equal"] = list(deferred_sd) == list(eager_sd) and all(
                torch.equal(deferred_sd[k], eager_sd[k]) for k in eager_sd
            )
        return out

    def test_deferred_init_equals_eager_bitwise(self):
        for r in measures["deferred_vs_eager"]:
            self.assertTrue(torch.equal(*r["losses"]), r["losses"])
            if r["rank"] == 0:
                self.assertTrue(r["init_equal"])

    @measures.register("deferred_materialisation")
    def measure_deferred_materialisation(rank: int, world_size: int) -> dict:
        """Which units held real parameters as each unit was materialised, and what construction left alive,
        found by scanning every reachable tensor (not by asking the module)."""
        with torch.device("meta"):
            meta_gpt = GPT(CFG)
        real_at_materialize = []  # (unit being materialised, units that held real parameters at that moment)

        def unit_of(name: str) -> int:  # a whole GPT's units: 0 the root, i + 1 for transformer.h.i
            return int(name.split(".")[2]) + 1 if name.startswith("transformer.h.") else 0

        def spy(module, prefix):
            held = {unit_of(n) for n, p in meta_gpt.named_parameters() if not p.is_meta}
            real_at_materialize.append((unit_of(prefix + "."), held))
            return materialize_module(module, prefix, CFG, 0, "cpu")

        before = _live_storages()
        deferred = FSDP(meta_gpt, materialize=spy, device="cpu")
        # only the shards may hold storage; a retained full parameter or unit would show up here
        shards = {u.shard.untyped_storage().data_ptr() for u in deferred.units}
        return {
            "materialize": real_at_materialize,
            "new_storages": sorted(n for ptr, n in _live_storages().items() if ptr not in before and ptr not in shards),
            "shards_alive": shards <= set(_live_storages()),
        }

    def test_deferred_init_holds_one_unit_at_a_time(self):
        # While a unit is materialised, no other unit may hold full (non-meta) parameters.
        for r in measures["deferred_materialisation"]:
            units = [u for u, _ in r["materialize"]]
            self.assertEqual(sorted(set(units)), list(range(CFG.n_layer + 1)))
            for unit, held in r["materialize"]:
                self.assertLessEqual(held, {unit}, f"materialising unit {unit} while {held} hold full params")
            # and afterwards nothing but the shards holds new storage (no retained full copy)
            self.assertTrue(r["shards_alive"])
            self.assertEqual(r["new_storages"], [], "storages (bytes) left alive by deferred init")


# ---------------------------------------------------------------------------------------- mechanics


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.is_meta or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        total += t.untyped_storage().nbytes()
    return total


def _original_attrs(model: FSDP) -> dict[str, torch.Tensor]:
    gpt = model.module
    return {n: getattr(gpt.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in model._state_dict_names}


def _micro_step(model, rank: int, step: int = 0, micro: int = 0) -> torch.Tensor:
    _, loss = model(*_data(step, micro, rank))
    (loss / ACCUM).backward()
    return loss.detach()


def _recorded_micro_step(model: FSDP, rank: int) -> list[tuple[str, str]]:
    """One micro-step, recording in order: every all-gather as torch.distributed receives it (the unit is
    the one whose flat buffer is the output), the end of h.0's MLP forward, and the start of h.1's attention
    backward (a hook on the gradient of its output). Marks come from hooks on submodules, not the FSDP
    module's own bookkeeping."""
    log: list[tuple[str, str]] = []
    real = getattr(dist, comm.ALL_GATHER)

    def all_gather(output, *args, **kwargs):
        ptr = output.untyped_storage().data_ptr()
        log.append(
            ("all_gather", next((u.name for u in model.units if u.flat.untyped_storage().data_ptr() == ptr), "other"))
        )
        return real(output, *args, **kwargs)

    def mark_backward(module, args, output) -> None:  # returns None: the output is left as it is
        output.register_hook(lambda grad: log.append(("backward_start", "transformer.h.1")))

    h = model.module.transformer.h
    handles = [
        h[0].mlp.register_forward_hook(lambda m, a, o: log.append(("forward_end", "transformer.h.0"))),
        h[1].attn.register_forward_hook(mark_backward),
    ]
    try:
        with mock.patch.object(dist, comm.ALL_GATHER, all_gather):
            _micro_step(model, rank)
    finally:
        for handle in handles:
            handle.remove()
    return log


def _record_local_grads(model: FSDP) -> dict[str, list[torch.Tensor]]:
    """unit name -> this rank's full (padded) gradient of each backward, as autograd hands it to the unit's flat
    leaf, before FSDP accumulates or reduces it: the terms of the reduced gradient."""
    local: dict[str, list[torch.Tensor]] = {u.name: [] for u in model.units}
    for u in model.units:
        u.flat.register_hook(lambda g, name=u.name: local[name].append(g.detach().clone()))
    return local


def _reduced_reference(model: FSDP, local: dict[str, list[torch.Tensor]]) -> list[tuple]:
    """Per shard piece (model.parameters() order): (the float64 mean over ranks of the sum over backwards of
    the recorded local gradients, the same of their absolute values, how many backwards were recorded)."""
    out, world = [], dist.get_world_size()
    for u in model.units:
        terms = torch.stack([t.double() for t in local[u.name]])
        total, magnitude = terms.sum(0), terms.abs().sum(0)
        dist.all_reduce(total)
        dist.all_reduce(magnitude)
        lo = model.rank * u.shard.numel()
        out += [
            (total[lo + a : lo + b] / world, magnitude[lo + a : lo + b] / world, len(terms)) for _, a, b in u.pieces
        ]
    return out


def _stepped(rank: int) -> tuple[FSDP, torch.optim.Optimizer]:
    """An FSDP GPT after one optimizer step (ACCUM micro-steps, clipping), its gradients kept: the state that
    the bytes and storage measurements count."""
    model = FSDP(_eager_gpt())
    opt = torch.optim.AdamW(model.param_groups(WD), lr=LR)
    for micro in range(ACCUM):
        _micro_step(model, rank, micro=micro)
    model.clip_grad_norm_(MAX_NORM)
    opt.step()
    return model, opt


def _two_micro_steps(rank: int, reshard: bool) -> dict:
    """ACCUM micro-steps of a fresh FSDP GPT (reshard_after_forward=`reshard`): their losses, what was counted
    and what the module expects per micro-step, the gradients, and their float64 reference."""
    model = FSDP(_eager_gpt(), reshard_after_forward=reshard)
    local = _record_local_grads(model)
    comm.COUNTER.reset()
    losses = torch.stack([_micro_step(model, rank, micro=m) for m in range(ACCUM)])
    return {
        "losses": losses,
        "comm": (comm.COUNTER.snapshot(), engine_comm_bytes_per_micro_step(model)),
        "grads": [p.grad.clone() for p in model.parameters()],
        "reference": _reduced_reference(model, local),
        "padded": [(u.numel, u.padded) for u in model.units],
    }


class TestFSDPMechanics(unittest.TestCase):
    """Memory, communication, prefetch order and state dicts, measured on 2 gloo ranks."""

    @classmethod
    def setUpClass(cls):
        measures.run()

    @measures.register("state_dicts")
    def measure_state_dicts(rank: int, world_size: int) -> dict:
        """Full and sharded state dicts at init against the eager model; a trained state loaded into a fresh
        FSDP from every rank's pieces and from rank 0's full state dict only."""
        model = FSDP(_eager_gpt())
        full = full_state_dict(model)
        ref_sd = _eager_gpt().state_dict()
        pieces = model.sharded_state_dict()
        out = {
            "rank": rank,
            "pieces_match": list(pieces) == list(ref_sd)
            and all(
                p.shape == ref_sd[k].shape and torch.equal(p.flat, ref_sd[k].reshape(-1)[p.offset :][: p.flat.numel()])
                for k, p in pieces.items()
            ),
            "pieces_intervals": _intervals({k: (p.offset, p.flat.numel()) for k, p in pieces.items()}),
            "pieces_numel": {k: ref_sd[k].numel() for k in pieces},
        }
        if rank == 0:
            out["full_sd_equal"] = list(full) == list(ref_sd) and all(torch.equal(full[k], ref_sd[k]) for k in ref_sd)
        model, _ = _stepped(rank)
        trained = full_state_dict(model)
        fresh = FSDP(GPT(CFG))
        load_full_state_dict_from_rank0(fresh, trained if rank == 0 else None)
        again = full_state_dict(fresh)
        fresh2 = FSDP(GPT(CFG))
        load_sharded_state_dict(fresh2, model.sharded_state_dict())
        again2 = full_state_dict(fresh2)
        if rank == 0:
            out["roundtrip"] = all(
                torch.equal(again[k], trained[k]) and torch.equal(again2[k], trained[k]) for k in trained
            )
        return out

    def test_full_state_dict_reassembles_unsharded_model(self):
        for r in measures["state_dicts"]:
            self.assertTrue(r["pieces_match"])
            for name, intervals in r["pieces_intervals"].items():  # the ranks' pieces tile each parameter
                self.assertTrue(tiles(intervals, r["pieces_numel"][name]), f"{name}: {intervals}")
            if r["rank"] == 0:
                self.assertTrue(r["full_sd_equal"])
                self.assertTrue(r["roundtrip"])

    @measures.register("state_bytes")
    def measure_state_bytes(rank: int, world_size: int) -> dict:
        """Unsharded params + grads + AdamW state after one step, against the same held by one rank of FSDP:
        counted here from every tensor the model and optimizer hold (views of one storage once), and by the
        protocol the trainer asks (`Sharded.state_breakdown`)."""
        eager = _eager_gpt()
        ref_opt = torch.optim.AdamW(param_groups(list(eager.named_parameters()), WD), lr=LR)
        _micro_step(eager, 0)
        ref_opt.step()
        model, opt = _stepped(rank)
        return {
            "ref_state_bytes": _storage_bytes(
                [p for p in eager.parameters()]
                + [p.grad for p in eager.parameters()]
                + [v for s in ref_opt.state.values() for v in s.values()]
            ),
            "state_bytes": sum(Sharded(model, Placement()).state_breakdown(opt).values()),  # what the trainer logs
            "state_bytes_measured": _storage_bytes(
                [t for u in model.units for t in (u.shard, u.flat, u.flat.grad, u.acc_grad)]
                + [t for p in model.parameters() for t in (p, p.grad)]
                + list(_original_attrs(model).values())
                + [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
            ),
            "unit_bytes": 16 * max(u.numel for u in model.units),
        }  # fp32 param + grad + 2 AdamW moments

    def test_state_bytes_at_most_one_nth_plus_one_unit(self):
        """Measured from the storages the model and optimizer hold (not the module's own count, which must
        agree with it): within one unit's 16 bytes/element of 1/N of the unsharded state."""
        for r in measures["state_bytes"]:
            bound = r["ref_state_bytes"] / WORLD + r["unit_bytes"]
            self.assertLessEqual(r["state_bytes_measured"], bound)
            self.assertGreaterEqual(r["state_bytes_measured"], r["ref_state_bytes"] / WORLD - r["unit_bytes"])
            self.assertEqual(r["state_bytes"], r["state_bytes_measured"])

    @measures.register("storage_between_uses")
    def measure_storage_between_uses(rank: int, world_size: int) -> dict:
        """What holds storage after an optimizer step: the original parameters, the gathered flat buffers."""
        model, _ = _stepped(rank)
        attrs = _original_attrs(model)
        return {
            "attrs_meta": all(t.is_meta for t in attrs.values()),
            "flats_freed": all(u.flat.untyped_storage().nbytes() == 0 for u in model.units),
            "real_param_bytes": _storage_bytes(
                list(attrs.values()) + list(model.parameters()) + [u.flat for u in model.units]
            ),
            "tied": attrs["lm_head.weight"] is attrs["transformer.wte.weight"],
            "padded": [(u.numel, u.padded) for u in model.units],
            "numel": sum(p.numel() for p in _eager_gpt().parameters()),
        }

    def test_only_shards_hold_storage_between_uses(self):
        for r in measures["storage_between_uses"]:
            self.assertTrue(r["attrs_meta"], "an original parameter still holds storage after the step")
            self.assertTrue(r["flats_freed"], "a gathered flat buffer was not freed")
            self.assertTrue(r["tied"])
            shard_elems = sum(padded for _, padded in r["padded"]) // WORLD
            self.assertEqual(r["real_param_bytes"], 4 * shard_elems)
            self.assertLess(shard_elems, r["numel"] / WORLD + len(r["padded"]))

    @measures.register("comm_per_micro_step")
    def measure_comm_per_micro_step(rank: int, world_size: int) -> dict:
        """parallel/comm's count of one micro-step of a fresh FSDP GPT, and what the module expects; the ops the
        flight recorder kept of that micro-step (op, call site), decoded as `python -m debug hang` reads them."""
        model = FSDP(_eager_gpt())
        comm.COUNTER.reset()
        start = flight_recorder.install(None, rank, world_size).count  # a fresh in-memory ring
        _micro_step(model, rank)
        ring = [(o["op"], o["site"]) for o in comm.RECORDER.read()["ops"] if o["n"] >= start]
        return {
            "comm": comm.COUNTER.snapshot(),
            "comm_expected": engine_comm_bytes_per_micro_step(model),
            "padded": [(u.numel, u.padded) for u in model.units],
            "units": [u.name for u in model.units],
            "ring": ring,
        }

    def test_comm_bytes_per_micro_step(self):
        # 2 all-gathers per Block, 1 for the root (kept from forward to backward, as FSDP2 does), 1
        # reduce-scatter of everything; sizes are the padded flat buffers (< N elements per unit extra).
        for r in measures["comm_per_micro_step"]:
            numel = [n for n, _ in r["padded"]]
            padded = [p for _, p in r["padded"]]
            self.assertEqual(r["comm"]["all_gather"], 4 * (padded[0] + 2 * sum(padded[1:])))
            self.assertEqual(r["comm"]["reduce_scatter"], 4 * sum(padded))
            self.assertEqual(r["comm"]["all_reduce"], 0)
            self.assertEqual({k: r["comm"][k] for k in r["comm_expected"]}, r["comm_expected"])
            self.assertLess(sum(padded) - sum(numel), WORLD * len(padded))

    def test_flight_recorder_names_the_unit_of_each_gather_and_scatter(self):
        """Each op in the ring carries its unit's name in the call site (what a hang report names): forward
        gathers the root, then transformer.h.0 and h.1; backward re-gathers h.1 and h.0 (the root stays gathered)
        and reduce-scatters each unit once, the last Block first. A wrapper that dropped `unit=` fails here."""
        for r in measures["comm_per_micro_step"]:
            self.assertEqual(r["units"], ["root", "transformer.h.0", "transformer.h.1"])
            gathers = [site for op, site in r["ring"] if op == "all_gather"]
            scatters = [site for op, site in r["ring"] if op == "reduce_scatter"]
            g, s = "parallel.data_parallel.flat_param.gather", "parallel.data_parallel.flat_param.start"
            self.assertEqual(
                gathers,
                [
                    f"{g} [root]",
                    f"{g} [transformer.h.0]",
                    f"{g} [transformer.h.1]",
                    f"{g} [transformer.h.1]",
                    f"{g} [transformer.h.0]",
                ],
            )
            self.assertEqual(scatters, [f"{s} [transformer.h.1]", f"{s} [transformer.h.0]", f"{s} [root]"])
            self.assertEqual({op for op, _ in r["ring"]}, {"all_gather", "reduce_scatter"})

    @measures.register("hsdp_replica_all_reduce")
    def measure_hsdp_replica_all_reduce(rank: int, world_size: int) -> dict:
        """One micro-step of HSDP with 2 replicas x 1 shard (each rank its own shard group), recording every
        all-reduce over the replicate group as torch.distributed receives it (async or not) and when its Work is
        waited; and the gradient against plain FSDP over both ranks (the same sum and division)."""
        singles = [dist.new_group([r]) for r in range(world_size)]  # every rank calls every new_group
        log, real = [], dist.all_reduce

        class Waited:
            def __init__(self, work, i):
                self.work, self.i = work, i

            def wait(self, *a, **kw):
                log.append(("wait", self.i))
                return self.work.wait(*a, **kw)

        def all_reduce(tensor, *args, async_op=False, **kw):
            i = sum(e[0] == "start" for e in log)
            log.append(("start", i, async_op))
            work = real(tensor, *args, async_op=async_op, **kw)
            return Waited(work, i) if async_op else work

        hsdp = FSDP(_eager_gpt(), process_group=singles[rank], replicate_group=dist.group.WORLD)
        with mock.patch.object(dist, "all_reduce", all_reduce):
            _micro_step(hsdp, rank)
        plain = FSDP(_eager_gpt())
        _micro_step(plain, rank)
        held = lambda u: torch.cat([p.grad for p, _, _ in u.pieces]) if u.pieces else torch.zeros(0)  # noqa: E731
        grads_hsdp = torch.cat([held(u) for u in hsdp.units])  # one shard: every unit whole
        parts = [None] * world_size  # plain FSDP: this rank's half of each unit, gathered in rank order
        dist.all_gather_object(parts, [held(u) for u in plain.units])
        grads_plain = torch.cat([torch.cat(pieces) for pieces in zip(*parts)])
        return {"log": log, "units": len(hsdp.units), "equal": torch.equal(grads_hsdp, grads_plain)}

    def test_hsdp_replica_all_reduce_is_async_and_overlaps(self):
        """HSDP sums each reduce-scattered piece over the replicas with an asynchronous all-reduce, waited only
        after the next unit's has started (so, on NCCL, not on the compute stream per unit), with the gradient
        plain FSDP over the same ranks gives, bit for bit."""
        for r in measures["hsdp_replica_all_reduce"]:
            starts = [e for e in r["log"] if e[0] == "start"]
            self.assertEqual(len(starts), r["units"])  # one per unit
            self.assertTrue(all(async_op for _, _, async_op in starts), "a synchronous replica all-reduce")
            at = {e: i for i, e in enumerate(r["log"])}
            for i in range(r["units"] - 1):
                self.assertLess(at[("start", i + 1, True)], at[("wait", i)], f"all-reduce {i} waited before the next")
            self.assertTrue(r["equal"])

    @measures.register("prefetch_order")
    def measure_prefetch_order(rank: int, world_size: int) -> dict:
        """One recorded micro-step (_recorded_micro_step) of a fresh FSDP GPT with prefetch, one without."""
        return {
            prefetch: _recorded_micro_step(FSDP(_eager_gpt(), prefetch=prefetch), rank) for prefetch in (True, False)
        }

    def test_prefetch_is_issued_before_current_unit_finishes(self):
        """The all-gather calls themselves (recorded at torch.distributed): with prefetch, h.1's is issued
        before h.0's MLP has run, and h.0's backward re-gather before h.1's attention backward starts; without
        prefetch each comes only after. Root once, each Block twice (forward, backward) per micro-step."""
        for r in measures["prefetch_order"]:
            for prefetch in (True, False):
                log = r[prefetch]
                gathers = [u for what, u in log if what == "all_gather"]
                self.assertEqual(
                    sorted(gathers), sorted(["root"] + 2 * [f"transformer.h.{i}" for i in range(CFG.n_layer)]), log
                )
                h1_forward = log.index(("all_gather", "transformer.h.1"))
                h0_backward = len(log) - 1 - log[::-1].index(("all_gather", "transformer.h.0"))
                mlp_end = log.index(("forward_end", "transformer.h.0"))
                attn_bwd = log.index(("backward_start", "transformer.h.1"))
                self.assertEqual(h1_forward < mlp_end, prefetch, f"prefetch={prefetch}: {log}")
                self.assertEqual(h0_backward < attn_bwd, prefetch, f"prefetch={prefetch}: {log}")

    @measures.register("reshard_after_forward_off")
    def measure_reshard_after_forward_off(rank: int, world_size: int) -> dict:
        """ZeRO-2 style (keep gathered until backward) against the default, on the same micro-steps."""
        return {reshard: _two_micro_steps(rank, reshard) for reshard in (True, False)}

    def test_reshard_after_forward_off_gathers_once(self):
        for r in measures["reshard_after_forward_off"]:
            self.assertTrue(torch.equal(r[True]["losses"], r[False]["losses"]))
            for a, b in zip(r[True]["grads"], r[False]["grads"]):
                self.assertTrue(torch.equal(a, b))
            counted, expected = r[False]["comm"]
            self.assertEqual(counted["all_gather"], ACCUM * expected["all_gather"])
            self.assertEqual(expected["all_gather"], 4 * sum(p for _, p in r[False]["padded"]))

    @measures.register("no_sync")
    def measure_no_sync(rank: int, world_size: int) -> dict:
        """The first micro-step under no_sync (keeps full gradients), the second reduce-scatters their sum;
        and the same micro-steps reduce-scattered each time (_two_micro_steps)."""
        model = FSDP(_eager_gpt())
        local = _record_local_grads(model)
        comm.COUNTER.reset()
        with model.no_sync():
            _micro_step(model, rank, micro=0)
        out = {
            "numel": sum(p.numel() for p in _eager_gpt().parameters()),
            "comm": comm.COUNTER.snapshot(),
            "state_bytes": sum(Sharded(model, Placement()).state_breakdown(None).values()),
        }
        _micro_step(model, rank, micro=1)
        every_step = _two_micro_steps(rank, reshard=True)
        out["grads"] = {"no_sync": [p.grad.clone() for p in model.parameters()], "reshard_True": every_step["grads"]}
        out["reference"] = {"no_sync": _reduced_reference(model, local), "reshard_True": every_step["reference"]}
        return out

    def test_no_sync_defers_reduce_scatter_at_full_gradient_cost(self):
        """Under no_sync nothing is reduce-scattered and a full gradient is kept; the gradient after the syncing
        micro-step is, like reduce-scattering every micro-step, the mean over ranks of the sum over micro-steps
        of the local gradients t_i (float64 reference from the recorded t_i), within the bound of its fp32 sums.

        Both orders are trees of depth 2 over the N x ACCUM = 4 terms (no_sync: (t_00 + t_01) + (t_10 + t_11),
        each rank's accumulation, then the reduce-scatter's sum; per micro-step: (t_00 + t_10) + (t_01 + t_11),
        the reduce-scatters, then the shard gradient's accumulation); dividing by N = 2 is exact. So
        |got - mean| <= gamma_2 * sum|t_i| / N with gamma_n = n u / (1 - n u), u = 2^-24 (Higham, Accuracy and
        Stability, eq. 4.4), plus 2 gamma_2 of float64 for the reference's own sums, plus 2^-149 for a halving
        that lands in fp32's subnormals. A dropped or doubled micro-batch moves an element by a whole |t_i|."""
        for r in measures["no_sync"]:
            self.assertEqual(r["comm"]["reduce_scatter"], 0)
            self.assertGreaterEqual(r["state_bytes"], 4 * r["numel"])  # a full fp32 gradient
            for key in ("no_sync", "reshard_True"):
                for i, (got, (mean, magnitude, n)) in enumerate(zip(r["grads"][key], r["reference"][key])):
                    with self.subTest(key, piece=i):
                        self.assertEqual(n, ACCUM)  # one recorded local gradient per micro-step
                        bound = (_gamma(2, 2**-24) + 2 * _gamma(2, 2**-53)) * magnitude + 2**-149
                        j = ((got.double() - mean).abs() - bound).argmax().item()
                        self.assertLessEqual(
                            abs(got[j].item() - mean[j].item()),
                            bound[j].item(),
                            f"{key} piece {i}: element {j} of {got.numel()} is {got[j].item()}, "
                            f"the float64 mean {mean[j].item()}, sum|t_i|/N {magnitude[j].item()}",
                        )

    @measures.register("mixed_precision_vs_fp32")
    def measure_mixed_precision_vs_fp32(rank: int, world_size: int) -> dict:
        """Compute copies in bf16, master weights and gradients in fp32: the dtypes seen, and the losses of
        training with clipping against fp32's (_run_ours)."""
        seen_dtypes = []
        model = FSDP(_eager_gpt(), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model.module.transformer.h[0].mlp.c_fc.register_forward_pre_hook(
            lambda m, args: seen_dtypes.append(m.weight.dtype)
        )
        opt = torch.optim.AdamW(model.param_groups(WD), lr=LR)
        mp_losses, _ = _train(model, opt, model.clip_grad_norm_, rank)
        return {
            "dtypes": (set(seen_dtypes), {p.dtype for p in model.parameters()}, {u.shard.dtype for u in model.units}),
            "losses": (mp_losses, _run_ours(rank, clip=True)[0]),
        }

    def test_mixed_precision_within_tolerance_of_fp32(self):
        # bf16 keeps 8 bits of mantissa: losses within 1e-2 relative of fp32 over 3 steps.
        for r in measures["mixed_precision_vs_fp32"]:
            compute, master, shards = r["dtypes"]
            self.assertEqual(compute, {torch.bfloat16})
            self.assertEqual(master, {torch.float32})
            self.assertEqual(shards, {torch.float32})
            torch.testing.assert_close(*r["losses"], rtol=1e-2, atol=0)
            self.assertFalse(torch.equal(*r["losses"]), "bf16 run identical to fp32: not in bf16")


if __name__ == "__main__":
    unittest.main()
