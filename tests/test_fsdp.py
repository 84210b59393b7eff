"""Our FSDP (parallel/fsdp.py) on 2 gloo ranks against torch's FSDP2 (`fully_shard`) and a single process.

The ranks are started once for the whole file (spawning costs seconds): `_body` measures everything and
every test method checks one property of what the ranks measured. Under torchrun each rank checks its
own measurements. Properties are measured from outside the module where it can be done: collectives as
torch.distributed receives them, bytes from the storages actually held, coverage as exact intervals.
"""
from __future__ import annotations

import gc
import unittest
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import parallel.fsdp as fsdp_module
from model import GPT, GPTConfig, param_groups
from parallel import comm
from parallel.fsdp import FullyShardedDataParallel as FSDP
from tests.harness import run_distributed

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
WORLD, STEPS, ACCUM, B, T = 2, 3, 2, 2, 32
LR, WD = 1e-2, 0.1
MAX_NORM = 0.25  # below the gradient norms of this run (0.4-0.8), so clipping acts at every step


def _data(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s micro-batch: the same numbers on every rank and in the single-process reference."""
    tokens = torch.randint(0, CFG.vocab_size, (STEPS, ACCUM, WORLD, B, T + 1),
                           generator=torch.Generator().manual_seed(1234))[step, micro, rank]
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


def _run_ours(rank: int, clip: bool, **kw) -> tuple:
    """(micro losses, grad norms, full state dict on rank 0, model, optimizer)"""
    model = FSDP(_eager_gpt(), **kw)
    opt = torch.optim.AdamW(model.param_groups(WD), lr=LR)
    losses, norms = _train(model, opt, model.clip_grad_norm_ if clip else None, rank)
    return losses, norms, model.full_state_dict(), model, opt


def _run_fsdp2(rank: int, clip: bool, mp: MixedPrecisionPolicy | None = None):
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


def _body(rank: int, world_size: int) -> dict:
    return {**_parity_body(rank, world_size), **_mechanics_body(rank, world_size)}


_RESULTS: list[dict] | None = None


def _results() -> list[dict]:
    """Every rank's measurements, from one start of the ranks shared by all test classes."""
    global _RESULTS
    if _RESULTS is None:
        _RESULTS = run_distributed(_body, WORLD)
    return _RESULTS


# ------------------------------------------------------------------------------------- parity body

def _parity_body(rank: int, world_size: int) -> dict:
    out: dict = {"rank": rank}
    # 1. Against FSDP2, fp32, no clipping: the same math on the same numbers.
    ours, theirs = _run_ours(rank, clip=False), _run_fsdp2(rank, clip=False)
    out["fsdp2_losses"] = (ours[0], theirs[0])
    if rank == 0:
        out["fsdp2_params_equal"] = list(ours[2]) == list(theirs[2]) and all(
            torch.equal(ours[2][k], theirs[2][k]) for k in theirs[2])
    # ... and so are AdamW's moments: this rank's slices of them against FSDP2's, gathered.
    moments, match, held, sizes = ours[3].sharded_optimizer_state(ours[4]), True, {}, {}
    for name, p in theirs[3].named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            full, piece = theirs[4].state[p][key].full_tensor().reshape(-1), moments[name][key]
            match &= torch.equal(piece.flat, full[piece.offset:piece.offset + piece.flat.numel()])
            held[f"{name}/{key}"] = (piece.offset, piece.flat.numel())
            sizes[f"{name}/{key}"] = p.numel()
    out["moments_match"], out["moments_intervals"], out["moments_numel"] = match, _intervals(held), sizes
    # 2. Against FSDP2 with clipping: the global norm is summed in a different order.
    ours, theirs = _run_ours(rank, clip=True), _run_fsdp2(rank, clip=True)
    out["clip_losses"], out["clip_norms"] = (ours[0], theirs[0]), (ours[1], theirs[1])
    if rank == 0:
        out["clip_params_rel"] = _rel(ours[2], theirs[2])
    # 3. Against FSDP2 in mixed precision (bf16 compute copies, fp32 reduce-scatter), no clipping.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ours = _run_ours(rank, clip=False, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    theirs = _run_fsdp2(rank, clip=False, mp=mp)
    out["mp_losses"] = (ours[0], theirs[0])
    if rank == 0:
        out["mp_params_equal"] = all(torch.equal(ours[2][k], theirs[2][k]) for k in theirs[2])
    # 4. Against one process on the concatenated global batch (all ranks' micro-batches), with clipping.
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
    out["single_losses"] = (global_losses / world_size, torch.stack(ref_losses))
    out["single_norms"] = (ours[1], torch.stack(ref_norms))
    if rank == 0:
        out["single_params_rel"] = _rel(ours[2], ref.state_dict())
    # 5. Deferred init: a meta GPT materialised unit by unit equals eager init bit for bit.
    with torch.device("meta"):
        meta_gpt = GPT(CFG)
    real_at_materialize = []  # (unit being materialised, units that held real parameters at that moment)
    original = fsdp_module.materialize_module

    def unit_of(name: str) -> int:  # a whole GPT's units: 0 the root, i + 1 for transformer.h.i
        return int(name.split(".")[2]) + 1 if name.startswith("transformer.h.") else 0

    def spy(module, prefix, *args, **kwargs):
        held = {unit_of(n) for n, p in meta_gpt.named_parameters() if not p.is_meta}
        real_at_materialize.append((unit_of(prefix + "."), held))
        return original(module, prefix, *args, **kwargs)

    fsdp_module.materialize_module = spy
    before = _live_storages()
    try:
        deferred = FSDP(meta_gpt, deferred_init_seed=0, device="cpu")
    finally:
        fsdp_module.materialize_module = original
    out["deferred_materialize"] = real_at_materialize
    # What construction left alive, found by scanning every reachable tensor (not by asking the module):
    # only the shards may hold storage; a retained full parameter or unit would show up here.
    shards = {u.shard.untyped_storage().data_ptr() for u in deferred.units}
    out["deferred_new_storages"] = sorted(n for ptr, n in _live_storages().items()
                                          if ptr not in before and ptr not in shards)
    out["deferred_shards_alive"] = shards <= set(_live_storages())
    deferred_sd = deferred.full_state_dict()
    opt = torch.optim.AdamW(deferred.param_groups(WD), lr=LR)
    out["deferred_losses"] = (_train(deferred, opt, deferred.clip_grad_norm_, rank)[0],
                              _run_ours(rank, clip=True)[0])
    if rank == 0:
        eager_sd = _eager_gpt().state_dict()
        out["deferred_init_equal"] = list(deferred_sd) == list(eager_sd) and all(
            torch.equal(deferred_sd[k], eager_sd[k]) for k in eager_sd)
    return out


class TestFSDPParity(unittest.TestCase):
    """Losses and weights after 3 AdamW steps of 2 accumulated micro-steps, each rank its own data."""

    @classmethod
    def setUpClass(cls):
        cls.results = _results()

    def test_equals_fsdp2_bitwise_without_clipping(self):
        # Same per-element math: grads of the same ops, SUM/2 == AVG for 2 ranks, elementwise AdamW.
        for r in self.results:
            self.assertTrue(torch.equal(*r["fsdp2_losses"]), r["fsdp2_losses"])
            if r["rank"] == 0:
                self.assertTrue(r["fsdp2_params_equal"])

    def test_sharded_optimizer_state_equals_fsdp2_bitwise(self):
        for r in self.results:
            self.assertTrue(r["moments_match"])
            for key, intervals in r["moments_intervals"].items():  # the ranks' slices tile each moment
                self.assertTrue(tiles(intervals, r["moments_numel"][key]), f"{key}: {intervals}")

    def test_equals_fsdp2_with_clipping_within_1e6(self):
        # Not bitwise: FSDP2 sums per-parameter norms of its row shards, we sum squares of our flat shards,
        # so the norm (hence the clip coefficient) may differ in the last bit. Tolerance 1e-6 relative for
        # norms and losses, and for the weights as a whole (||ours - fsdp2|| / ||fsdp2||): elementwise,
        # AdamW turns last-bit noise in zero-mean gradients (the attention key biases) into ~1e-6 moves.
        for r in self.results:
            ours, theirs = r["clip_norms"]
            self.assertTrue(bool((theirs > MAX_NORM).all()), f"clipping never acted: {theirs}")
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
            torch.testing.assert_close(*r["clip_losses"], rtol=1e-6, atol=0)
            if r["rank"] == 0:
                self.assertLessEqual(r["clip_params_rel"], 1e-6)

    def test_mixed_precision_equals_fsdp2_bitwise(self):
        for r in self.results:
            self.assertTrue(torch.equal(*r["mp_losses"]), r["mp_losses"])
            if r["rank"] == 0:
                self.assertTrue(r["mp_params_equal"])

    def test_equals_single_process_on_concatenated_batch(self):
        # One batch of 8 sums in a different order than 2 ranks x 2 micro-batches of 2: losses and gradient
        # norms within 1e-6 relative, weights within 1e-5 relative as a whole (AdamW amplifies last bits).
        for r in self.results:
            torch.testing.assert_close(*r["single_losses"], rtol=1e-6, atol=0)
            torch.testing.assert_close(*r["single_norms"], rtol=1e-6, atol=0)
            if r["rank"] == 0:
                self.assertLessEqual(r["single_params_rel"], 1e-5)

    def test_deferred_init_equals_eager_bitwise(self):
        for r in self.results:
            self.assertTrue(torch.equal(*r["deferred_losses"]), r["deferred_losses"])
            if r["rank"] == 0:
                self.assertTrue(r["deferred_init_equal"])

    def test_deferred_init_holds_one_unit_at_a_time(self):
        # While a unit is materialised, no other unit may hold full (non-meta) parameters.
        for r in self.results:
            units = [u for u, _ in r["deferred_materialize"]]
            self.assertEqual(sorted(set(units)), list(range(CFG.n_layer + 1)))
            for unit, held in r["deferred_materialize"]:
                self.assertLessEqual(held, {unit}, f"materialising unit {unit} while {held} hold full params")
            # and afterwards nothing but the shards holds new storage (no retained full copy)
            self.assertTrue(r["deferred_shards_alive"])
            self.assertEqual(r["deferred_new_storages"], [], "storages (bytes) left alive by deferred init")


# ---------------------------------------------------------------------------------- mechanics body

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
    return {n: getattr(gpt.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2])
            for n in model._state_dict_names}


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
        log.append(("all_gather", next((u.name for u in model.units if u.flat.untyped_storage().data_ptr() == ptr),
                                       "other")))
        return real(output, *args, **kwargs)

    def mark_backward(module, args, output) -> None:  # returns None: the output is left as it is
        output.register_hook(lambda grad: log.append(("backward_start", "transformer.h.1")))

    h = model.module.transformer.h
    handles = [h[0].mlp.register_forward_hook(lambda m, a, o: log.append(("forward_end", "transformer.h.0"))),
               h[1].attn.register_forward_hook(mark_backward)]
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
        out += [(total[lo + a:lo + b] / world, magnitude[lo + a:lo + b] / world, len(terms)) for _, a, b in u.pieces]
    return out


def _mechanics_body(rank: int, world_size: int) -> dict:
    out: dict = {"rank": rank}
    eager = _eager_gpt()
    out["numel"] = sum(p.numel() for p in eager.parameters())

    # Unsharded reference state: params + grads + AdamW state after one step.
    ref_opt = torch.optim.AdamW(param_groups(list(eager.named_parameters()), WD), lr=LR)
    _micro_step(eager, 0)
    ref_opt.step()
    out["ref_state_bytes"] = _storage_bytes(
        [p for p in eager.parameters()] + [p.grad for p in eager.parameters()]
        + [v for s in ref_opt.state.values() for v in s.values()])

    # Full and sharded state dicts at init, against the eager model.
    model = FSDP(_eager_gpt())
    full = model.full_state_dict()
    ref_sd = _eager_gpt().state_dict()
    if rank == 0:
        out["full_sd_equal"] = list(full) == list(ref_sd) and all(torch.equal(full[k], ref_sd[k]) for k in ref_sd)
    pieces = model.sharded_state_dict()
    out["pieces_match"] = list(pieces) == list(ref_sd) and all(
        p.shape == ref_sd[k].shape and torch.equal(p.flat, ref_sd[k].reshape(-1)[p.offset:][:p.flat.numel()])
        for k, p in pieces.items())
    out["pieces_intervals"] = _intervals({k: (p.offset, p.flat.numel()) for k, p in pieces.items()})
    out["pieces_numel"] = {k: ref_sd[k].numel() for k in pieces}

    # One micro-step: communication, prefetch order, storage between uses.
    comm.COUNTER.reset()
    out["calls_prefetch"] = _recorded_micro_step(model, rank)
    out["comm"] = comm.COUNTER.snapshot()
    out["comm_expected"] = model.comm_bytes_per_micro_step()
    out["padded"] = [(u.numel, u.padded) for u in model.units]
    opt = torch.optim.AdamW(model.param_groups(WD), lr=LR)
    _micro_step(model, rank, micro=1)
    model.clip_grad_norm_(MAX_NORM)
    opt.step()
    out["state_bytes"] = model.state_bytes(opt)
    # the same, counted here from every tensor the model and optimizer hold (views of one storage once)
    attrs = _original_attrs(model)
    out["state_bytes_measured"] = _storage_bytes(
        [t for u in model.units for t in (u.shard, u.flat, u.flat.grad, u.acc_grad)]
        + [t for p in model.parameters() for t in (p, p.grad)] + list(attrs.values())
        + [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)])
    out["unit_bytes"] = 16 * max(u.numel for u in model.units)  # fp32 param + grad + 2 AdamW moments
    attrs = _original_attrs(model)
    out["attrs_meta"] = all(t.is_meta for t in attrs.values())
    out["flats_freed"] = all(u.flat.untyped_storage().nbytes() == 0 for u in model.units)
    out["real_param_bytes"] = _storage_bytes(list(attrs.values()) + list(model.parameters())
                                             + [u.flat for u in model.units])
    out["tied"] = attrs["lm_head.weight"] is attrs["transformer.wte.weight"]

    # Round trips: a trained FSDP state loaded into a fresh one, from every rank and from rank 0 only.
    trained = model.full_state_dict()
    fresh = FSDP(GPT(CFG))
    fresh.load_full_state_dict(trained if rank == 0 else None, from_rank0=True)
    again = fresh.full_state_dict()
    fresh2 = FSDP(GPT(CFG))
    fresh2.load_sharded_state_dict(model.sharded_state_dict())
    again2 = fresh2.full_state_dict()
    if rank == 0:
        out["roundtrip"] = all(torch.equal(again[k], trained[k]) and torch.equal(again2[k], trained[k])
                               for k in trained)

    # Prefetch off: the next unit's all-gather comes only when it is needed.
    model = FSDP(_eager_gpt(), prefetch=False)
    out["calls_no_prefetch"] = _recorded_micro_step(model, rank)

    # ZeRO-2 style (keep gathered until backward): one all-gather per micro-step, same numbers.
    losses = {}
    for reshard in (True, False):
        model = FSDP(_eager_gpt(), reshard_after_forward=reshard)
        local = _record_local_grads(model)
        comm.COUNTER.reset()
        losses[reshard] = torch.stack([_micro_step(model, rank, micro=m) for m in range(ACCUM)])
        out[f"comm_reshard_{reshard}"] = (comm.COUNTER.snapshot(), model.comm_bytes_per_micro_step())
        out[f"grads_reshard_{reshard}"] = [p.grad.clone() for p in model.parameters()]
        out[f"reference_reshard_{reshard}"] = _reduced_reference(model, local)
    out["reshard_losses"] = (losses[True], losses[False])

    # no_sync: the first micro-step keeps full gradients, the second reduce-scatters their sum.
    model = FSDP(_eager_gpt())
    local = _record_local_grads(model)
    comm.COUNTER.reset()
    with model.no_sync():
        _micro_step(model, rank, micro=0)
    out["no_sync_comm"] = comm.COUNTER.snapshot()
    out["no_sync_state_bytes"] = model.state_bytes()
    _micro_step(model, rank, micro=1)
    out["grads_no_sync"] = [p.grad.clone() for p in model.parameters()]
    out["reference_no_sync"] = _reduced_reference(model, local)

    # Mixed precision: compute copies in bf16, master weights and gradients in fp32.
    seen_dtypes = []
    model = FSDP(_eager_gpt(), param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model.module.transformer.h[0].mlp.c_fc.register_forward_pre_hook(
        lambda m, args: seen_dtypes.append(m.weight.dtype))
    opt = torch.optim.AdamW(model.param_groups(WD), lr=LR)
    mp_losses, _ = _train(model, opt, model.clip_grad_norm_, rank)
    out["mp_dtypes"] = (set(seen_dtypes), {p.dtype for p in model.parameters()},
                        {u.shard.dtype for u in model.units})
    model = FSDP(_eager_gpt())
    opt = torch.optim.AdamW(model.param_groups(WD), lr=LR)
    out["mp_vs_fp32"] = (mp_losses, _train(model, opt, model.clip_grad_norm_, rank)[0])
    return out


class TestFSDPMechanics(unittest.TestCase):
    """Memory, communication, prefetch order and state dicts, measured on 2 gloo ranks."""

    @classmethod
    def setUpClass(cls):
        cls.results = _results()

    def test_full_state_dict_reassembles_unsharded_model(self):
        for r in self.results:
            self.assertTrue(r["pieces_match"])
            for name, intervals in r["pieces_intervals"].items():  # the ranks' pieces tile each parameter
                self.assertTrue(tiles(intervals, r["pieces_numel"][name]), f"{name}: {intervals}")
            if r["rank"] == 0:
                self.assertTrue(r["full_sd_equal"])
                self.assertTrue(r["roundtrip"])

    def test_state_bytes_at_most_one_nth_plus_one_unit(self):
        """Measured from the storages the model and optimizer hold (not the module's own count, which must
        agree with it): within one unit's 16 bytes/element of 1/N of the unsharded state."""
        for r in self.results:
            bound = r["ref_state_bytes"] / WORLD + r["unit_bytes"]
            self.assertLessEqual(r["state_bytes_measured"], bound)
            self.assertGreaterEqual(r["state_bytes_measured"], r["ref_state_bytes"] / WORLD - r["unit_bytes"])
            self.assertEqual(r["state_bytes"], r["state_bytes_measured"])

    def test_only_shards_hold_storage_between_uses(self):
        for r in self.results:
            self.assertTrue(r["attrs_meta"], "an original parameter still holds storage after the step")
            self.assertTrue(r["flats_freed"], "a gathered flat buffer was not freed")
            self.assertTrue(r["tied"])
            shard_elems = sum(padded for _, padded in r["padded"]) // WORLD
            self.assertEqual(r["real_param_bytes"], 4 * shard_elems)
            self.assertLess(shard_elems, r["numel"] / WORLD + len(r["padded"]))

    def test_comm_bytes_per_micro_step(self):
        # 2 all-gathers per Block, 1 for the root (kept from forward to backward, as FSDP2 does), 1
        # reduce-scatter of everything; sizes are the padded flat buffers (< N elements per unit extra).
        for r in self.results:
            numel = [n for n, _ in r["padded"]]
            padded = [p for _, p in r["padded"]]
            self.assertEqual(r["comm"]["all_gather"], 4 * (padded[0] + 2 * sum(padded[1:])))
            self.assertEqual(r["comm"]["reduce_scatter"], 4 * sum(padded))
            self.assertEqual(r["comm"]["all_reduce"], 0)
            self.assertEqual({k: r["comm"][k] for k in r["comm_expected"]}, r["comm_expected"])
            self.assertLess(sum(padded) - sum(numel), WORLD * len(padded))

    def test_prefetch_is_issued_before_current_unit_finishes(self):
        """The all-gather calls themselves (recorded at torch.distributed): with prefetch, h.1's is issued
        before h.0's MLP has run, and h.0's backward re-gather before h.1's attention backward starts; without
        prefetch each comes only after. Root once, each Block twice (forward, backward) per micro-step."""
        for r in self.results:
            for key, prefetch in (("calls_prefetch", True), ("calls_no_prefetch", False)):
                log = r[key]
                gathers = [u for what, u in log if what == "all_gather"]
                self.assertEqual(sorted(gathers), sorted(["root"] + 2 * [f"transformer.h.{i}" for i in range(CFG.n_layer)]),
                                 log)
                h1_forward = log.index(("all_gather", "transformer.h.1"))
                h0_backward = len(log) - 1 - log[::-1].index(("all_gather", "transformer.h.0"))
                mlp_end = log.index(("forward_end", "transformer.h.0"))
                attn_bwd = log.index(("backward_start", "transformer.h.1"))
                self.assertEqual(h1_forward < mlp_end, prefetch, f"{key}: {log}")
                self.assertEqual(h0_backward < attn_bwd, prefetch, f"{key}: {log}")

    def test_reshard_after_forward_off_gathers_once(self):
        for r in self.results:
            self.assertTrue(torch.equal(*r["reshard_losses"]))
            for a, b in zip(r["grads_reshard_True"], r["grads_reshard_False"]):
                self.assertTrue(torch.equal(a, b))
            counted, expected = r["comm_reshard_False"]
            self.assertEqual(counted["all_gather"], ACCUM * expected["all_gather"])
            self.assertEqual(expected["all_gather"], 4 * sum(p for _, p in r["padded"]))

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
        for r in self.results:
            self.assertEqual(r["no_sync_comm"]["reduce_scatter"], 0)
            self.assertGreaterEqual(r["no_sync_state_bytes"], 4 * r["numel"])  # a full fp32 gradient
            for key in ("no_sync", "reshard_True"):
                for i, (got, (mean, magnitude, n)) in enumerate(zip(r[f"grads_{key}"], r[f"reference_{key}"])):
                    with self.subTest(key, piece=i):
                        self.assertEqual(n, ACCUM)  # one recorded local gradient per micro-step
                        bound = (_gamma(2, 2 ** -24) + 2 * _gamma(2, 2 ** -53)) * magnitude + 2 ** -149
                        j = ((got.double() - mean).abs() - bound).argmax().item()
                        self.assertLessEqual(abs(got[j].item() - mean[j].item()), bound[j].item(),
                                             f"{key} piece {i}: element {j} of {got.numel()} is {got[j].item()}, "
                                             f"the float64 mean {mean[j].item()}, sum|t_i|/N {magnitude[j].item()}")

    def test_mixed_precision_within_tolerance_of_fp32(self):
        # bf16 keeps 8 bits of mantissa: losses within 1e-2 relative of fp32 over 3 steps.
        for r in self.results:
            compute, master, shards = r["mp_dtypes"]
            self.assertEqual(compute, {torch.bfloat16})
            self.assertEqual(master, {torch.float32})
            self.assertEqual(shards, {torch.float32})
            torch.testing.assert_close(*r["mp_vs_fp32"], rtol=1e-2, atol=0)
            self.assertFalse(torch.equal(*r["mp_vs_fp32"]), "bf16 run identical to fp32: not in bf16")


if __name__ == "__main__":
    unittest.main()
