"""Our tensor parallelism (parallel/tensor_parallel/apply.py) on 2 gloo ranks against one process and DTensor.

Each distributed class spawns its ranks once (setUpClass) and every test method checks one property of
what the ranks measured; under `torchrun --standalone --nproc_per_node=2 -m unittest tests/test_tp.py`
each rank checks its own measurements. Both TP ranks see the same batch, so one process running the
same batch is the reference.

Tolerances: 1e-5 relative per tensor (max |a - b| / max |b|). TP splits matmul reductions across ranks
and sums the parts in another order, so results agree to float rounding (~1e-7), not bitwise. The one
exception is the key bias: its gradient is zero in exact arithmetic (softmax ignores a constant added to
every score of a query), so what autograd computes for it is rounding noise, compared in absolute terms.
"""

from __future__ import annotations

import contextlib
import unittest

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from model.gpt import GPT, GPTConfig, init_parameter, param_groups
from parallel import comm
from parallel.grads import clip_grad_norm_, grad_groups, norm_items
from parallel.marks import shard_dim
from parallel.tensor_parallel.apply import (
    TP_PLAN,
    apply_tensor_parallel,
    check_tp_divisibility,
    plan_style,
    vocab_parallel_cross_entropy,
)
from parallel.tensor_parallel.mappings import all_gather_along
from parallel.twins.tensor_parallel import pytorch_tp_plan
from plan.theory import tp_comm_bytes_per_micro_step, tp_comm_calls_per_micro_step
from runtime.memory import LargestTensor
from tests.harness import run_distributed

CFG = GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64)
WORLD, B, T, SEED = 2, 2, 32, 1337
STEPS, LR, MAX_NORM = 3, 1e-3, 0.5
LAYOUTS = [(lp, sp) for lp in (False, True) for sp in (False, True)]  # (loss_parallel, sequence_parallel)
NOISE = "attn.c_k.bias"  # gradient zero in exact arithmetic (see module docstring)
# TP vs one process, at most this many times one process (fp32) vs itself in fp64: two fp32 runs, each about
# 1x from the exact result, differ by up to ~2x; measured 0.5-1.0x here (2026-11, torch 2.13 CPU); 2x margin.
ROUNDING_FACTOR = 4
EPS32 = torch.finfo(torch.float32).eps


def _batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s tokens, the same on every rank; a few targets are ignored (-1)."""
    tokens = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(100 + step))
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    y[0, :3] = -1
    return x, y


def _eager(cfg: GPTConfig = CFG) -> GPT:
    model = GPT(cfg)
    model.init_weights(SEED)
    return model


def _tp(lp: bool, sp: bool, **kw) -> GPT:
    return apply_tensor_parallel(_eager(), dist.group.WORLD, lp, sp, **kw)


def _full_params(model: GPT, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient) re-assembled from the ranks' shards, by name."""
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        if hasattr(t, "full_tensor"):  # DTensor (grads of SP LayerNorms are Partial: this sums them)
            out[name] = t.full_tensor()
        else:  # our TP's shard along its marked dim (all-gathered), or the replicated tensor itself
            dim = shard_dim(p, "tp")
            out[name] = t if dim is None else all_gather_along(t.detach(), dim, dist.group.WORLD)
    return out


def _rel_errors(got: dict, ref: dict) -> dict[str, float]:
    """max |a - b| / max |b| per tensor; the key bias (pure noise) as max |a - b| / max over all |b|."""
    scale = max(float(r.abs().max()) for r in ref.values())
    return {k: float((got[k] - ref[k]).abs().max()) / (scale if NOISE in k else float(ref[k].abs().max())) for k in ref}


def _norm_errors(got: dict, ref: dict) -> dict[str, float]:
    """||a - b|| / ||b|| per tensor, and over the whole model under "all"; the key bias against the whole."""
    total = sum(float(r.double().norm() ** 2) for r in ref.values()) ** 0.5
    out = {
        k: float((got[k] - ref[k]).double().norm()) / (total if NOISE in k else float(ref[k].double().norm()))
        for k in ref
    }
    out["all"] = sum(float((got[k] - ref[k]).double().norm() ** 2) for k in ref) ** 0.5 / total
    return out


def _rel(a, b) -> float:
    a, b = (float(v.detach()) if isinstance(v, torch.Tensor) else float(v) for v in (a, b))
    return abs(a - b) / abs(b)


# ------------------------------------------------------------------------------------- one process


def _train(model: GPT, clip) -> tuple[list[float], list[float]]:
    """STEPS AdamW steps (weight decay on >= 2-D params), clipping the global grad norm at MAX_NORM."""
    opt = torch.optim.AdamW(param_groups(list(model.named_parameters()), 0.1), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        _, loss = model(*_batch(step + 1))
        loss.backward()
        norms.append(float(clip(model)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, norms


def _saved_bytes(model: GPT) -> tuple[int, int]:
    """(bytes of all activations autograd saves in one forward, bytes of those saved by LayerNorms),
    counting each storage once and leaving out parameters."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    in_ln = [False]
    ln_ptrs = set()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs:
            seen[ptr] = t.untyped_storage().nbytes()
            if in_ln[0]:
                ln_ptrs.add(ptr)
        return t

    hooks = []
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            hooks.append(m.register_forward_pre_hook(lambda *_: in_ln.__setitem__(0, True)))
            hooks.append(m.register_forward_hook(lambda *_: in_ln.__setitem__(0, False)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*_batch())
    for h in hooks:
        h.remove()
    return sum(seen.values()), sum(seen[p] for p in ln_ptrs)


# ------------------------------------------------------------------------------------- bodies


def _one_process_body(rank: int, world_size: int) -> dict:
    group = dist.group.WORLD
    out: dict = {"rank": rank}
    ref = _eager()
    _, ref_loss = ref(*_batch())
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    ref_model = _eager()
    out["ref_train"] = _train(ref_model, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM))
    ref_params = {n: p.detach() for n, p in ref_model.named_parameters()}
    # The yardstick for "float rounding": how far this float32 run is from the same run in float64.
    ref64 = _eager().double()
    out["ref64_train"] = _train(ref64, lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM))
    out["fp32_vs_fp64"] = _norm_errors(ref_params, {n: p.detach() for n, p in ref64.named_parameters()})

    # 1. Loss and re-assembled gradients; comm bytes against the formula; a few AdamW steps.
    for lp, sp in LAYOUTS:
        model = _tp(lp, sp)
        comm.COUNTER.reset()
        _, loss = model(*_batch())
        loss.backward()
        r = {
            "loss_rel": _rel(loss, ref_loss),
            "comm": comm.COUNTER.snapshot(),
            "comm_formula": tp_comm_bytes_per_micro_step(CFG, B, T, world_size, lp, sp),
            "calls": comm.COUNTER.snapshot_calls(),
            "calls_formula": tp_comm_calls_per_micro_step(CFG, B, T, world_size, lp, sp),
            "grad_rel": _rel_errors(_full_params(model, grads=True), ref_grads),
            "shard_dims": {n: shard_dim(p, "tp") for n, p in model.named_parameters()},
        }
        model = _tp(lp, sp)
        r["train"] = _train(
            model, lambda m: clip_grad_norm_(norm_items(m.named_parameters(), grad_groups(m)), MAX_NORM)
        )
        r["param_rel"] = _norm_errors(_full_params(model), ref_params)
        out[(lp, sp)] = r

    # 2. Mixed precision (CPU autocast bf16): matmul outputs travel in bf16, the residual stream in fp32.
    for lp, sp in ((False, True), (True, False)):
        model = _tp(lp, sp)
        comm.COUNTER.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(*_batch())
        loss.backward()
        out[("bf16", lp, sp)] = (
            comm.COUNTER.snapshot(),
            tp_comm_bytes_per_micro_step(CFG, B, T, world_size, lp, sp, dtype_bytes=2, residual_bytes=4),
        )

    # 3. Saved activations: TP alone, TP + SP, one process.
    out["saved"] = {
        "tp": _saved_bytes(_tp(False, False)),
        "tp_sp": _saved_bytes(_tp(False, True)),
        "one": _saved_bytes(_eager()),
    }

    # 4. Deferred init: a meta GPT gets only this rank's shards, equal to slices of eager init bit for bit.
    with torch.device("meta"):
        lazy = GPT(CFG)
    with LargestTensor() as spy:
        apply_tensor_parallel(lazy, group, False, True, seed=SEED)
    eager_sharded = _tp(False, True)
    eager_full = dict(_eager().named_parameters())
    out["deferred"] = {
        "largest_alloc": spy.numel,
        "full_wte": eager_full["transformer.wte.weight"].numel(),
        "largest_shard": max(p.numel() for p in lazy.parameters()),
        "tied": lazy.lm_head.weight is lazy.transformer.wte.weight,
        "storage_is_shard": all(
            p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in lazy.parameters()
        ),
        "equal_eager_shards": all(torch.equal(p, q) for p, q in zip(lazy.parameters(), eager_sharded.parameters())),
        "equal_slices": all(
            torch.equal(p, _slice(eager_full[n], shard_dim(p, "tp"), rank, world_size))
            for n, p in lazy.named_parameters()
        ),
        "shapes": {n: tuple(p.shape) for n, p in lazy.named_parameters()},
        "init_slice_equal": torch.equal(
            lazy.transformer.h[0].mlp.c_proj.weight,
            init_parameter(
                "transformer.h.0.mlp.c_proj.weight",
                (CFG.n_embd, 4 * CFG.n_embd),
                CFG,
                SEED,
                cols=slice(4 * CFG.n_embd // world_size * rank, 4 * CFG.n_embd // world_size * (rank + 1)),
            ),
        ),
    }

    # 5. vocab_parallel_cross_entropy against F.cross_entropy on the whole logits, values and grads. The logits
    # are x W^T with W the identity (V, V), exact in fp32, so x carries them; each rank holds W's vocab rows.
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 16, CFG.vocab_size, generator=g) * 4
    logits[0, 0, 3] = 1e4  # exp would overflow without the max
    logits[0, 1] = -1e4
    logits[0, 1, 300] = 0.0  # the max of the row sits on rank 1's half
    logits[1, 2] *= 1e3  # a huge spread
    logits[2, 5, :256] = -1e30  # rank 0's half contributes nothing
    targets = torch.randint(0, CFG.vocab_size, (5, 16), generator=g)
    targets[0, 0], targets[0, 1], targets[2, 5] = 3, 300, 0
    targets[3, :7] = -1
    eye = torch.eye(CFG.vocab_size).chunk(world_size, 0)[rank]  # (V/p, V)
    mine = slice(rank * CFG.vocab_size // world_size, (rank + 1) * CFG.vocab_size // world_size)
    out["xent"] = []
    # 80 rows: in one chunk (None: 32768 rows), 7 at a time, and at the chunk edge, where the last chunk ends exactly
    # at row 80 (16 at a time, or one of 80: the last chunk's logits kept for the second pass, `lo + chunk >= N`)
    for scale, gather, rows in (
        (1.0, False, None),
        (2.5, False, 7),
        (2.5, True, 7),
        (2.5, False, 16),
        (1.0, False, 80),
        (2.5, True, 16),
    ):
        full = logits.clone().requires_grad_()
        ref_l = F.cross_entropy(full.flatten(0, 1), targets.flatten(), ignore_index=-1)
        (scale * ref_l).backward()
        x = logits.clone().requires_grad_()
        got = vocab_parallel_cross_entropy(x, eye, targets, group, gather=gather, chunk_rows=rows)
        (scale * got).backward()  # x.grad: this rank's columns (the identity's rows it holds), zeros elsewhere
        out["xent"].append(
            (
                float(got.detach()),
                float(ref_l.detach()),
                float((x.grad[..., mine] - full.grad[..., mine]).abs().max()),
                float(full.grad.abs().max()),
                bool(torch.isfinite(got.detach())),
                float(torch.cat([x.grad[..., : mine.start], x.grad[..., mine.stop :]], -1).abs().max()),
            )
        )
    # the loss's collectives (forward and backward): with 7 rows a chunk (12 chunks) and with one chunk of 80
    out["loss_calls"] = {}
    for gather in (False, True):
        for rows in (7, 80):
            x = logits.clone().requires_grad_()
            comm.COUNTER.reset()
            vocab_parallel_cross_entropy(x, eye, targets, group, gather=gather, chunk_rows=rows).backward()
            out["loss_calls"][(gather, rows)] = comm.COUNTER.snapshot_calls()

    # 6. Bad meshes and unsupported settings: clear errors before any work.
    errors = {}
    for what, cfg in (
        ("n_head", GPTConfig(vocab_size=512, n_layer=1, n_head=3, n_embd=48)),
        ("vocab_size", GPTConfig(vocab_size=511, n_layer=1, n_head=4, n_embd=64)),
        ("dropout", GPTConfig(vocab_size=512, n_layer=1, n_head=4, n_embd=64, dropout=0.1)),
    ):
        try:
            apply_tensor_parallel(GPT(cfg), group, False, False)
            errors[what] = None
        except ValueError as e:
            errors[what] = str(e)
    try:
        _tp(False, True)(_batch()[0][:, :31])
        errors["seq_len"] = None
    except ValueError as e:
        errors["seq_len"] = str(e)
    out["errors"] = errors
    return out


def _slice(full: torch.Tensor, dim: int | None, rank: int, world: int) -> torch.Tensor:
    return full if dim is None else full.chunk(world, dim)[rank]


class TestTPMatchesOneProcess(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(_one_process_body, WORLD)

    def test_loss_and_gradients_match_one_process(self):
        for r in self.results:
            for layout in LAYOUTS:
                m = r[layout]
                self.assertLessEqual(m["loss_rel"], 1e-5, layout)
                worst = max(m["grad_rel"], key=m["grad_rel"].get)
                self.assertLessEqual(m["grad_rel"][worst], 1e-5, f"{layout}: {worst}")

    def test_params_match_one_process_after_adamw_steps(self):
        """After 3 clipped AdamW steps, TP differs from one process by no more than ROUNDING_FACTOR times
        what float32 rounding alone does to the one-process run (its distance from the same run in float64),
        measured here: for losses and clipped norms, for the weights as a whole (||a - b|| / ||b||) and for
        the worst tensor. (AdamW divides by sqrt(v), so rounding noise in a near-zero gradient moves a weight
        by a visible part of lr; the float64 run shows how much that is for this model and these steps.)"""
        for r in self.results:
            ref_losses, ref_norms = r["ref_train"]
            losses64, norms64 = r["ref64_train"]
            self.assertTrue(all(n > MAX_NORM for n in ref_norms), f"clipping never acted: {ref_norms}")
            scalar_base = max(_rel(a, b) for a, b in zip(ref_losses + ref_norms, losses64 + norms64))
            base = dict(r["fp32_vs_fp64"])
            base_all = base.pop("all")
            base_worst = max(base.values())
            self.assertGreater(base_all, 0)  # the yardstick is not degenerate
            for layout in LAYOUTS:
                losses, norms = r[layout]["train"]
                for a, b in zip(losses + norms, ref_losses + ref_norms):
                    self.assertLessEqual(_rel(a, b), ROUNDING_FACTOR * max(scalar_base, EPS32), layout)
                rel = dict(r[layout]["param_rel"])
                self.assertLessEqual(rel.pop("all"), ROUNDING_FACTOR * base_all, layout)
                worst = max(rel, key=rel.get)
                self.assertLessEqual(rel[worst], ROUNDING_FACTOR * base_worst, f"{layout}: {worst}")

    def test_shards_are_marked_and_names_kept(self):
        # Column-parallel weights and biases by rows (dim 0), row-parallel weights by columns (dim 1), the
        # tied embedding by vocab rows; everything else (LayerNorms, wpe, row-parallel biases) replicated.
        def expected(name: str) -> int | None:
            if any(f".{m}." in name for m in ("c_q", "c_k", "c_v", "c_fc")) or name == "transformer.wte.weight":
                return 0
            return 1 if name.endswith("c_proj.weight") else None

        names = [n for n, _ in _eager().named_parameters()]
        for r in self.results:
            dims = r[(True, True)]["shard_dims"]
            self.assertEqual(list(dims), names)
            self.assertEqual(sum(d is not None for d in dims.values()), 1 + 10 * CFG.n_layer)
            for n, d in dims.items():
                self.assertEqual(d, expected(n), n)

    def test_comm_bytes_equal_formula(self):
        for r in self.results:
            for layout in LAYOUTS:
                self.assertEqual(r[layout]["comm"], r[layout]["comm_formula"], layout)
                self.assertEqual(r[layout]["calls"], r[layout]["calls_formula"], layout)
                self.assertGreater(sum(r[layout]["comm"].values()), 0)
            for lp, sp in ((False, True), (True, False)):
                got, want = r[("bf16", lp, sp)]
                self.assertEqual(got, want, ("bf16", lp, sp))

    def test_sequence_parallel_shards_saved_activations(self):
        for r in self.results:
            (tp_total, tp_ln), (sp_total, sp_ln), (one_total, _) = (r["saved"][k] for k in ("tp", "tp_sp", "one"))
            self.assertGreater(tp_ln, 0)
            self.assertEqual(sp_ln * WORLD, tp_ln)  # LayerNorm inputs (and stats): 1/TP of the sequence
            self.assertEqual(tp_total - sp_total, tp_ln - sp_ln)  # and nothing else grew
            self.assertLess(sp_total, tp_total)
            self.assertLess(tp_total, one_total)

    def test_deferred_init_materialises_only_local_shards(self):
        for r in self.results:
            d = r["deferred"]
            self.assertTrue(d["equal_slices"])
            self.assertTrue(d["equal_eager_shards"])
            self.assertTrue(d["init_slice_equal"])
            self.assertTrue(d["tied"])
            self.assertTrue(d["storage_is_shard"])
            self.assertEqual(d["shapes"]["transformer.wte.weight"], (CFG.vocab_size // WORLD, CFG.n_embd))
            self.assertEqual(d["shapes"]["transformer.h.0.mlp.c_proj.weight"], (CFG.n_embd, 4 * CFG.n_embd // WORLD))
            self.assertLess(d["largest_alloc"], d["full_wte"])  # never the whole embedding
            self.assertLessEqual(d["largest_alloc"], d["largest_shard"])

    def test_vocab_parallel_cross_entropy_equals_full(self):
        for r in self.results:
            for got, ref, grad_err, grad_scale, finite, elsewhere in r["xent"]:
                self.assertTrue(finite)
                self.assertLessEqual(_rel(got, ref), 1e-6)
                self.assertLessEqual(grad_err, 1e-6 * grad_scale)
                self.assertEqual(elsewhere, 0.0)

    def test_loss_collectives_do_not_grow_with_its_chunks(self):
        """Per loss, forward and backward: with loss parallelism 2 all-reduces (the row max for all rows; then the
        target logit and sum-exp for all rows), without it 1 all-gather (lm_head's weight), at 12 chunks as at 1."""
        want = {
            False: {"all_reduce": 2, "all_gather": 0, "reduce_scatter": 0},
            True: {"all_reduce": 0, "all_gather": 1, "reduce_scatter": 0},
        }
        for r in self.results:
            for (gather, rows), calls in r["loss_calls"].items():
                self.assertEqual(calls, want[gather], (gather, rows))

    def test_bad_meshes_and_settings_give_clear_errors(self):
        for r in self.results:
            e = r["errors"]
            self.assertIn("n_head (3) is not divisible by the tensor-parallel size 2", e["n_head"] or "")
            self.assertIn("vocab_size (511) is not divisible", e["vocab_size"] or "")
            self.assertIn("dropout", e["dropout"] or "")
            self.assertIn("seq_len (31) divisible by the tensor-parallel size (2)", e["seq_len"] or "")


# ------------------------------------------------------------------------------------- against DTensor


def _dtensor_body(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    out: dict = {"rank": rank}
    for lp, sp in LAYOUTS:
        ours = _tp(lp, sp)
        _, loss = ours(*_batch())  # lm_head + loss chunked: no logits
        loss.backward()
        with torch.no_grad():
            logits, _ = ours(_batch()[0])
        theirs = _eager()
        parallelize_module(theirs, mesh, pytorch_tp_plan(theirs, lp, sp))
        theirs.lm_head.weight = theirs.transformer.wte.weight  # the tie, undone by the swap to DTensors
        with loss_parallel() if lp else contextlib.nullcontext():
            _, their_loss = theirs(*_batch())  # their lm_head is hooked: it runs whole (loss.head_output)
            their_loss.backward()
            with torch.no_grad():
                their_logits, _ = theirs(_batch()[0])
        if lp:  # both keep this rank's vocab slice of the logits
            their_logits, their_loss = their_logits.to_local(), their_loss.full_tensor()
        out[(lp, sp)] = {
            "loss_rel": _rel(loss, their_loss),
            "logits_err": float((logits - their_logits).abs().max() / their_logits.abs().max()),
            "logits_shape": (tuple(logits.shape), tuple(their_logits.shape)),
            "grad_rel": _rel_errors(_full_params(ours, grads=True), _full_params(theirs, grads=True)),
        }
    return out


@pytest.mark.slow  # a multi-rank launch: kept out of the fast loop
class TestTPMatchesDTensor(unittest.TestCase):
    """Ours against PyTorch's parallelize_module with pytorch_tp_plan, same weights and batch."""

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(_dtensor_body, WORLD)

    def test_loss_logits_and_gradients_match_dtensor(self):
        for r in self.results:
            for layout in LAYOUTS:
                m = r[layout]
                self.assertLessEqual(m["loss_rel"], 1e-5, layout)
                ours, theirs = m["logits_shape"]
                self.assertEqual(ours, theirs)
                self.assertEqual(ours[-1], CFG.vocab_size // WORLD if layout[0] else CFG.vocab_size)
                self.assertLessEqual(m["logits_err"], 1e-5, layout)
                worst = max(m["grad_rel"], key=m["grad_rel"].get)
                self.assertLessEqual(m["grad_rel"][worst], 1e-5, f"{layout}: {worst}")


# ------------------------------------------------------------------------------------- no processes


class TestValidation(unittest.TestCase):
    def test_divisibility_messages(self):
        self.assertIsNone(check_tp_divisibility(CFG, 2))
        self.assertIsNone(check_tp_divisibility(CFG, 4, seq_len=64))
        self.assertIn("n_head (4) is not divisible by the tensor-parallel size 3", check_tp_divisibility(CFG, 3))
        bad_width = GPTConfig(vocab_size=512, n_head=2, n_embd=63)  # (only the check sees such a config)
        self.assertIn("n_embd (63) is not divisible", check_tp_divisibility(bad_width, 2))
        self.assertIn("vocab_size (50257) is not divisible", check_tp_divisibility(GPTConfig(vocab_size=50257), 2))
        self.assertIn("seq_len (30) divisible by the tensor-parallel size 4", check_tp_divisibility(CFG, 4, seq_len=30))

    def test_plan_covers_every_parameter_once(self):
        model = _eager()
        owners = {n.rpartition(".")[0] for n, _ in model.named_parameters()}
        self.assertTrue(all(plan_style(o) for o in owners), [o for o in owners if not plan_style(o)])
        self.assertEqual(plan_style("transformer.h.1.mlp.c_proj"), "rowwise")
        self.assertEqual(plan_style("lm_head"), "vocab_head")
        self.assertIsNone(plan_style("transformer.h.1.attn"))
        self.assertEqual(plan_style("transformer.h.1.mlp"), "moe")
        self.assertEqual(
            set(TP_PLAN.values()), {"vocab", "position", "norm", "colwise", "rowwise", "moe", "vocab_head"}
        )

    def test_formula_scales_as_theory(self):
        f = tp_comm_bytes_per_micro_step
        act = B * T * CFG.n_embd * 4
        self.assertEqual(f(CFG, B, T, 1, True, True), {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0})
        plain = f(CFG, B, T, 2, True, False)
        self.assertEqual(plain["all_reduce"], (4 * CFG.n_layer + 2) * act + 3 * B * T * 4)  # 4 per block
        sp = f(CFG, B, T, 2, True, True)
        self.assertEqual(sp["reduce_scatter"], (4 * CFG.n_layer + 2) * act)  # each all-reduce -> RS + AG
        self.assertEqual(sp["all_gather"], (4 * CFG.n_layer + 2) * act + T * CFG.n_embd * 4)
        self.assertEqual(f(CFG, B, T, 2, False, False)["all_gather"], CFG.vocab_size * CFG.n_embd * 4)  # lm_head's W
