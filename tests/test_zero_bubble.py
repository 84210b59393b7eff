"""The split backward (parallel/pipeline/zero_bubble.py) and ZB-H1 (parallel/pipeline_schedule.zb_h1) at run time.

Bit-identity, and why it is the right bar. ZB-H1 splits each chunk's backward into B (input gradient) and W
(weight gradients) and moves W later; the products are those autograd computes for the whole backward
(parallel/pipeline/zero_bubble.py names them), and each chunk's W's run in the order of its B's, micro-batch 0..M-1,
so every .grad sums the same terms in the same order as under 1F1B: the gradients, losses and grad norms are
1F1B's bits (torch.equal), not merely close. Against one process the bar is then 1F1B's: 1e-5 relative on the
losses (tests/test_pipeline_train.py derives it).

- TestSplitBackward (fast, one process): the store against autograd on a whole GPT, fp32 and bf16 autocast and
  full activation checkpointing; that B really leaves the linears' weight gradients to W.
- TestZeroBubbleRanks (slow, one launch of 4 spawned gloo ranks): the runner at P = 4 (the whole world) and
  P = 2 (two pipelines of 2): ZB-H1's gradients and loss torch.equal to 1F1B's, the loss within 1e-5 of one
  process, and the held micro-batches at the schedule's bound (P on every rank).
- TestZeroBubbleTrain (slow, whole train.py runs): P = 2 and P = 2 x DDP 2 against 1F1B bit for bit and one
  process at 1e-5: DDP's bucket all-reduce runs once, after the schedule's last W (reduce_on_exit); ZB-H1 x
  FSDP and x TP + SP against 1F1B's bits; the PyTorch twin's zb_h1, zbv and dualpipev against one process; and
  the bad-input refusals. Every split schedule at P = 2, 3, 4 alone and at P = 2 x ddp / zero2 / fsdp / tp + sp
  (and x fsdp in bf16) against one process: parallel/pipeline/concept.sweep_rows, run by tests/test_sweep.py; at
  P = 4 x ddp / zero2 / fsdp / tp + sp and P = 2 x dp x tp, under HSDP (8 ranks): sweep_large_rows, run by
  GPT_SWEEP_LARGE=1 pytest -m sweep and python -m bench.sweep --sample 12.
"""

from __future__ import annotations

import contextlib
import unittest
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from model.gpt import GPT, make_config
from parallel.data_parallel.fsdp import FullyShardedDataParallel
from parallel.pipeline.parts import GPT_PARTS
from parallel.pipeline.record import StepRecord
from parallel.pipeline.runner import PipelineRunner, PipelineStage, embedding_group
from parallel.pipeline.zero_bubble import WeightGradStore, hold_for_w, split_backward
from parallel.protocol import Placement, Sharded
from parallel.tensor_parallel.apply import apply_tensor_parallel
from runtime.blocks import AC_COUNTER, apply_activation_checkpointing
from tests.harness import (
    Measurements,
    WholeRuns,
    assert_close,
    expect_train_error_in_process,
    expect_train_error_on_ranks,
    rank0_only,
    steps_of,
)
from tests.rounding import rounding_rtol_of

aten = torch.ops.aten

SEED, MB, T, N_LAYER = 0, 2, 16, 4


def config():
    return make_config("tiny", n_layer=N_LAYER, vocab_size=256, block_size=32)


def micro_batches(cfg, m: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (m, MB, T + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def gpt(n_layer: int = N_LAYER, **moe) -> GPT:
    model = GPT(make_config("tiny", n_layer=n_layer, vocab_size=256, block_size=32, **moe))
    model.init_weights(SEED)
    return model


LINEARS = ("c_q", "c_k", "c_v", "c_proj", "c_fc")


FAST_LAYERS, FAST_M = 2, 2
MOE = {"moe_num_experts": 4, "moe_top_k": 2, "moe_aux_loss_coeff": 0.01}


class TestSplitBackward(unittest.TestCase):
    """One 2-Block GPT, M = 2 micro-batches: backward whole (autograd) vs B under the store then W micro-batch by
    micro-batch; every gradient torch.equal."""

    def grads(
        self, split: bool, autocast: bool = False, ac: bool = False, tp: bool = False, moe: bool = False
    ) -> tuple[dict, dict]:
        model = gpt(FAST_LAYERS, **(MOE if moe else {}))
        if tp:  # our TP's layers on one rank (their collectives return at once): what the store must route
            apply_tensor_parallel(model, None, loss_parallel=False, sequence_parallel=True)
        if ac:
            apply_activation_checkpointing(model, "full", 2)
        store = WeightGradStore(model)
        batches = micro_batches(model.config, FAST_M)
        for m, (x, y) in enumerate(batches):
            with (
                torch.autocast("cpu", torch.bfloat16, enabled=autocast),
                store.defer(m) if split else contextlib.nullcontext(),
            ):
                _, loss = model(x, y)
                (loss / len(batches)).backward()
        after_b = {n: p.grad is not None for n, p in model.named_parameters()}
        for m in range(len(batches)):
            store.flush(m)
        self.assertEqual(len(store), 0)
        return {n: p.grad for n, p in model.named_parameters()}, after_b

    def check_equal(self, **kw) -> None:
        ref, _ = self.grads(False, **kw)
        got, after_b = self.grads(True, **kw)
        self.assertEqual(ref.keys(), got.keys())
        for n in ref:
            self.assertTrue(torch.equal(got[n], ref[n]), n)
        # deferral is real: after every B, the linears of the Blocks have no gradient yet, everything else has
        # (a row-parallel bias is added after TP's reduce, outside the product: its db stays in B)
        for n, has in after_b.items():
            row_bias = kw.get("tp") and n.endswith("c_proj.bias")
            expert_bias = ".experts." in n and n.endswith(".bias")  # added after the grouped product: in B
            deferred = (
                n.startswith("transformer.h.") and n.split(".")[-2] in LINEARS and not row_bias and not expert_bias
            )
            self.assertEqual(has, not deferred, n)

    def test_fp32(self):
        self.check_equal()

    def test_bf16_autocast(self):
        self.check_equal(autocast=True)

    def test_activation_checkpointing_recomputes_once(self):
        AC_COUNTER.reset()
        self.check_equal(ac=True)
        self.assertEqual(AC_COUNTER.recomputed, 2 * FAST_M * FAST_LAYERS)  # both runs, each micro-batch's Blocks once

    def test_tensor_parallel_linears(self):
        """Column- and row-parallel linears defer too: the store swaps the product inside their forward."""
        self.check_equal(tp=True)

    def test_moe_experts(self):
        """The MoE experts' stacked weights defer too (their grouped product: torch._grouped_mm in fp32, the
        per-expert loop under bf16 autocast); the router's product stays whole, in B."""
        self.check_equal(moe=True)
        self.check_equal(moe=True, autocast=True)
        self.check_equal(moe=True, ac=True)

    def moe_products(self, split: bool) -> list:
        """Every product (mm, addmm, bmm, _grouped_mm: op, operand shapes, strides, dtypes) one MoE micro-batch's
        forward, backward and W issue under bf16 autocast, sorted."""
        products = []

        class Products(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket in (aten.mm, aten.addmm, aten.bmm, aten._grouped_mm):
                    products.append(
                        (
                            str(func),
                            [
                                (tuple(a.shape), a.stride(), a.dtype)
                                for a in args
                                if isinstance(a, torch.Tensor) and a.is_floating_point()
                            ],
                        )
                    )
                return func(*args, **(kwargs or {}))

        model = gpt(FAST_LAYERS, **MOE)
        store = WeightGradStore(model)
        ((x, y),) = micro_batches(model.config, 1)
        with Products(), store.defer(0) if split else contextlib.nullcontext():
            with torch.autocast("cpu", torch.bfloat16):
                _, loss = model(x, y)
            loss.backward()
        with Products():
            store.flush(0)
        return sorted(products, key=str)

    def test_moe_experts_run_one_kernel_on_both_paths(self):
        """Under bf16 autocast B and W issue the products 1F1B's autograd issues, the experts' included, op for op:
        the split forward casts and turns autocast off, and moe.grouped_linear picks its kernel from the device
        and the compute dtype, so both take the per-expert loop here (before, the split one took
        torch._grouped_mm and 1F1B the loop: the same bits on CPU, whose grouped kernel is a loop of mm, but CUTLASS
        against cuBLAS on an sm90 GPU), and both the grouped kernel where it runs in bf16 (an sm90 GPU; this CPU
        standing in): then also the same bits."""
        from model import moe
        from tests.test_moe import fast_path_here

        for fast in (False, True):
            with mock.patch.object(moe, "grouped_mm_runs", fast_path_here) if fast else contextlib.nullcontext():
                whole, split = self.moe_products(False), self.moe_products(True)
                self.assertEqual(split, whole, "fast path" if fast else "loop")
                self.assertEqual(any("_grouped_mm" in op for op, _ in whole), fast)
                if fast:
                    self.check_equal(moe=True, autocast=True)

    def test_w_allocates_nothing_to_pick_its_product(self):
        """W computes each expert weight's gradient by the path its forward took (a flag the forward recorded):
        no tensor is allocated to ask (before: an (E, in, out) empty tensor per weight per W, only to call the
        predicate)."""
        allocations = []

        class Allocations(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket in (aten.empty, aten.new_empty, aten.empty_like, aten.empty_strided):
                    allocations.append(str(func))
                return func(*args, **(kwargs or {}))

        model = gpt(FAST_LAYERS, **MOE)
        store = WeightGradStore(model)
        ((x, y),) = micro_batches(model.config, 1)
        with store.defer(0):
            model(x, y)[1].backward()
        with Allocations():
            store.flush(0)
        self.assertEqual(allocations, [])

    def test_w_takes_the_path_its_forward_took(self):
        """W's product follows the flag its forward recorded, not a second reading of moe.grouped_mm_runs: a
        simulated rank (sim/fake_rank.py) patches the predicate to take the per-expert loop in fp32 (torch 2.13's
        fake _grouped_mm takes bf16 only), and W read the unpatched one from its own import, so python -m
        sim.verify of ZB-H1 x MoE x EP in fp32 raised "Expected inputs of BF16 type" on every rank. Here: F and B
        with the loop patched in, W after it: W runs no torch._grouped_mm, and the gradients are the loop's."""
        from model import moe

        grads = []
        for patched in (False, True):
            model = gpt(FAST_LAYERS, **MOE)
            store = WeightGradStore(model)
            ((x, y),) = micro_batches(model.config, 1)
            loop = mock.patch.object(moe, "grouped_mm_runs", lambda *a: False)
            with loop if patched else contextlib.nullcontext(), store.defer(0):
                model(x, y)[1].backward()
            ops = []

            class Grouped(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    ops.append(func.overloadpacket)
                    return func(*args, **(kwargs or {}))

            with Grouped():
                store.flush(0)
            self.assertEqual(aten._grouped_mm in ops, not patched)
            grads.append([p.grad for p in model.parameters()])
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(*grads)))  # CPU fp32: the kernel's bits are the loop's

    def test_autocast_keeps_one_weight_copy_for_all_micro_batches(self):
        """GPipe's order on one process under bf16 autocast: M = 4 forwards under the store, then their B's and W's.
        Each B needs its linears' bf16 weights (dx = dy W), so F saves them: one copy per weight, shared by all M
        micro-batches in flight (zero_bubble.cast_once), as autocast's own cache shares them for autograd's linears
        (the same pattern without the store), not one per micro-batch."""
        M = 4

        def copies(split: bool) -> int:
            model = gpt(FAST_LAYERS)
            store = WeightGradStore(model)
            shapes = {tuple(m.weight.shape) for m in store.modules}
            seen = set()

            def pack(t):
                if t.dtype == torch.bfloat16 and t.dim() == 2 and tuple(t.shape) in shapes:
                    seen.add(t.untyped_storage().data_ptr())  # all alive at once: distinct storages, distinct ptrs
                return t

            defer = store.defer if split else lambda m: contextlib.nullcontext()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
                losses = []
                for m, (x, y) in enumerate(micro_batches(model.config, M)):
                    with defer(m):
                        losses.append(model(x, y)[1])
                for m, loss in enumerate(losses):
                    with defer(m):
                        (loss / M).backward()
                for m in range(M):
                    store.flush(m)
            return len(seen), len(store.modules)

        for split in (False, True):
            got, weights = copies(split)
            self.assertEqual(got, weights, "split" if split else "autograd")

    def test_w_issues_autograds_own_products(self):
        """The products B and W run are the ones autograd's F.linear backward runs, op for op: the same aten op on
        operands of the same shapes, strides and dtypes (for a 3D input, with and without bias, fp32 and bf16), so
        bit-equality does not rest on a kernel giving two layouts of one product the same bits. (Autograd's weight
        gradient is mm_mat2_backward's grad.t().mm(x), as the weight's transpose is column-major.)"""

        class Products(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.seen = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
                    self.seen.append(
                        (
                            str(func),
                            [(tuple(a.shape), a.stride(), a.dtype) for a in args if isinstance(a, torch.Tensor)],
                        )
                    )
                return func(*args, **(kwargs or {}))

        for bias in (True, False):
            for autocast in (False, True):
                lin = torch.nn.Linear(32, 48, bias=bias)
                x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
                runs = []
                for split in (False, True):
                    store = WeightGradStore(torch.nn.Sequential(lin))
                    with (
                        torch.autocast("cpu", torch.bfloat16, enabled=autocast),
                        store.defer(0) if split else contextlib.nullcontext(),
                    ):
                        y = lin(x)
                    with Products() as products:
                        y.backward(torch.ones_like(y))
                        store.flush(0)
                    runs.append(sorted(products.seen, key=str))
                self.assertEqual(len(runs[0]), 2)  # dx and dW
                self.assertEqual(runs[1], runs[0], (bias, autocast))

    def test_w_adds_into_ddps_buckets(self):
        """A pipeline step runs inside our DDP's reduce_on_exit, and W adds dW to `.grad` outside autograd (no
        AccumulateGrad, no hook). After zero_grad(set_to_none=True) each W made `.grad` a tensor of its own, a
        second fp32 copy of every deferred gradient beside the buckets until the step's end (gpt2-xl, pp=2 ZB-V x
        DDP: 2.8 GB of 21.2 on stage 0, found by sim.verify's simulated peak). Every gradient is its bucket's view
        from the first W on, and equals autograd's bit for bit."""
        from parallel.data_parallel.ddp import DistributedDataParallel

        grads = []
        for split in (False, True):
            model = gpt(FAST_LAYERS)
            ddp = DistributedDataParallel(model)  # one process: no group, the buckets all the same
            store = WeightGradStore(model)
            ddp.zero_grad()
            for p in model.parameters():
                p.grad = None  # train.py's optimizer.zero_grad(set_to_none=True)
            views = {id(p): v for b in ddp.buckets for p, v in zip(b.params, b.views)}
            with ddp.reduce_on_exit():
                for m, (x, y) in enumerate(micro_batches(model.config, FAST_M)):
                    with store.defer(m) if split else contextlib.nullcontext():
                        (model(x, y)[1] / FAST_M).backward()
                    store.flush(m)
                    loose = [n for n, p in model.named_parameters() if p.grad is not views[id(p)]]
                    self.assertEqual(loose, [], f"split={split}, after micro-batch {m}'s W")
            grads.append([p.grad.clone() for p in model.parameters()])
        for a, b in zip(*grads):
            self.assertTrue(torch.equal(a, b))

    def test_w_needs_b(self):
        store = WeightGradStore(gpt(FAST_LAYERS))
        store.flush((0, 0))  # nothing pushed: a W without its B adds nothing
        self.assertEqual(len(store), 0)


class TestSplitBackwardSharded(unittest.TestCase):
    """The store under our sharding engine (parallel/data_parallel/fsdp.py, one rank: the hooks, the held gradients and
    the
    reduction path are those of N ranks, the collectives copies): a 2-Block GPT, M = 2, whole backward per
    micro-batch vs B under the store then W micro-batch by micro-batch, inside the pipeline's step_sync. The
    linears' weights are views of each unit's flat buffer, so B hands each Block unit's gradient to the store
    (its linear slices still zero) instead of reducing it, and W completes and reduces it: every shard gradient
    torch.equal. Without the hold, W finds no gradient to add into (RuntimeError); reduced at B, the shards
    would miss the linears' dW."""

    def shard_grads(self, stage: int, split: bool) -> tuple[list, int]:
        fsdp = FullyShardedDataParallel(gpt(FAST_LAYERS), zero_stage=stage)
        fsdp.defer_reduction = hold_for_w  # what a split schedule's runner sets (zero_bubble.split_backward)
        store = WeightGradStore(fsdp.module)
        batches = micro_batches(fsdp.config, FAST_M)
        held = 0
        with Sharded(fsdp, Placement()).step_sync():
            for m, (x, y) in enumerate(batches):
                with store.defer(m) if split else contextlib.nullcontext():
                    _, loss = fsdp(x, y)
                    (loss / len(batches)).backward()
            held = sum(len(v) for v in store.held.values())
            for m in range(len(batches)):
                store.flush(m)
        self.assertEqual(len(store), 0)
        return [p.grad for p in fsdp.flat_params], held

    def test_zero_stages(self):
        for stage in (1, 2, 3):
            with self.subTest(zero_stage=stage):
                ref, _ = self.shard_grads(stage, False)
                got, held = self.shard_grads(stage, True)
                self.assertEqual(held, FAST_M * FAST_LAYERS)  # every Block unit's gradient of every B waited for W
                self.assertEqual(len(got), len(ref))
                for i, (g, r) in enumerate(zip(got, ref)):
                    self.assertTrue(torch.equal(g, r), i)


# ----------------------------------------------------------------------------- the runner on spawned ranks


def runner_case(rank: int, pp: int, group, embed_group, m: int) -> dict:
    """One stage of a P = pp pipeline: a 1F1B step, then a ZB-H1 step from zero gradients, same micro-batches.
    Returns whether every gradient (tied copies summed) and the loss are torch.equal, the summed loss (the pp
    SUM of every rank's share), and each step's peak in-flight count."""
    cfg = config()
    batches = micro_batches(cfg, m)
    stage = PipelineStage(gpt(), rank, pp, parts=GPT_PARTS)
    record = StepRecord(torch.device("cpu"))
    runner = PipelineRunner(stage, group, embed_group=embed_group, record=record, split_backward=split_backward)
    flushed, real_flush = [], WeightGradStore.flush

    def flush(store: WeightGradStore, key) -> None:  # each W: how many deferred linears it found, what it changed
        before = [p.grad.clone() if p.grad is not None else None for p in stage.parameters()]
        pending = len(store.pending.get(key, ()))
        real_flush(store, key)
        changed = sum(
            b is None and p.grad is not None or b is not None and not torch.equal(b, p.grad)
            for b, p in zip(before, stage.parameters())
        )
        flushed.append((key, pending, changed))

    out = {}
    for name in ("1f1b", "zb_h1"):
        for p in stage.parameters():
            p.grad = None
        flushed.clear()
        with mock.patch.object(WeightGradStore, "flush", flush):
            loss = runner.step(batches, name)
        runner.reduce_tied_grads()
        dist.all_reduce(loss, group=group)
        out[name] = (loss, {n: p.grad.clone() for n, p in stage.named_parameters()}, runner.record.peak_in_flight)
    (l1, g1, f1), (l2, g2, f2) = out["1f1b"], out["zb_h1"]
    linears = {
        c: sum(type(m) is torch.nn.Linear for i in stage.layers[c] for m in stage.transformer.h[str(i)].modules())
        for c in stage.chunks
    }  # what each W(c, m) must find: every linear of chunk c's Blocks
    return {
        "loss_equal": torch.equal(l1, l2),
        "grads_equal": {n: torch.equal(g1[n], g2[n]) for n in g1},
        "loss": float(l2),
        "in_flight": (f1, f2),
        "grads": g1,
        "flushed": list(flushed),
        "linears": linears,
    }


U32 = 2.0**-24


def gamma(n: int) -> float:
    """gamma_n = n u / (1 - n u), fp32: the relative bound of a sum whose terms went through n roundings
    (Higham 4.4)."""
    return n * U32 / (1 - n * U32)


def v_case(rank: int, group, embed_group, m: int, one: dict[str, torch.Tensor]) -> dict:
    """zbv and dualpipev on a P = 2 V cut (rank 0: chunks 0 and 3, the tied embedding one parameter; rank 1:
    chunks 1 and 2, handed over in memory) against `one`, the P = 2 1F1B gradients of the same micro-batches.
    Every Block, wpe and ln_f gradient sums the same per-micro-batch terms in the same order (each chunk's W's
    run in micro-batch order): torch.equal. The tied matrix: the V adds e_m (embedding use) and h_m (lm_head use)
    to one .grad, 2M terms in turn; 1F1B sums M per end and all-reduces the two: both within gamma_2M resp.
    gamma_(M+1) of the exact sum, so |v - 1f1b| <= (gamma_2M + gamma_(M+1)) sum_m (|e_m| + |h_m|), elementwise,
    the terms recorded by a hook on the V's tied parameter."""
    cfg = config()
    batches = micro_batches(cfg, m)
    out = {}
    for name in ("zbv", "dualpipev"):
        stage = PipelineStage(gpt(), rank, 2, 2, v_shape=True, parts=GPT_PARTS)
        record = StepRecord(torch.device("cpu"))
        runner = PipelineRunner(stage, group, embed_group=embed_group, record=record, split_backward=split_backward)
        magnitude = torch.zeros(cfg.vocab_size, cfg.n_embd, dtype=torch.float64)

        def record(g: torch.Tensor) -> None:
            magnitude.add_(g.double().abs())

        hooks = [stage.transformer.wte.weight.register_hook(record)] if stage.first else []
        loss = runner.step(batches, name)
        for h in hooks:
            h.remove()
        runner.reduce_tied_grads()  # nothing to sum: one rank holds both ends
        dist.all_reduce(loss, group=group)
        grads = {n: p.grad for n, p in stage.named_parameters()}
        tied = "transformer.wte.weight"
        bound = (gamma(2 * m) + gamma(m + 1)) * magnitude
        out[name] = {
            "loss": float(loss),
            "names": sorted(grads),
            "tied_copy": runner.tied_weight() is not None,
            "equal": [n for n in grads if n != tied and not torch.equal(grads[n], one[n])],
            "tied_excess": float(((grads[tied].double() - one[tied].double()).abs() - bound).max())
            if tied in grads
            else None,
            "in_flight": runner.record.peak_in_flight,
        }
    return out


def reference_loss(m: int) -> float:
    """One process: the mean over the M micro-batches' losses, in float64."""
    model = gpt()
    with torch.no_grad():
        return sum(float(model(x, y)[1]) for x, y in micro_batches(model.config, m)) / m


MEASURES = Measurements(world_size=4)
M_RANKS = 8


@pytest.mark.slow
class TestZeroBubbleRanks(unittest.TestCase):
    """P = 4 over the 4 ranks, and P = 2 as two pipelines [0, 1], [2, 3], M = 8: ZB-H1 against 1F1B bit for
    bit, and its loss within 1e-5 of one process."""

    @classmethod
    def setUpClass(cls):
        MEASURES.run()

    @MEASURES.register("p4")
    def measure_p4(rank, world):
        return runner_case(rank, 4, None, embedding_group([[0, 1, 2, 3]]), M_RANKS)

    @MEASURES.register("p2")
    def measure_p2(rank, world):
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank builds both, in this order
        embed = embedding_group([[0, 1], [2, 3]])
        got = runner_case(rank % 2, 2, groups[rank // 2], embed, M_RANKS)
        stages = [None, None]  # both stages' 1F1B gradients: the V cuts the Blocks otherwise
        dist.all_gather_object(stages, got.pop("grads"), group=groups[rank // 2])
        one = {n: g for grads in stages for n, g in grads.items() if n != "lm_head.weight"}
        got["v"] = v_case(rank % 2, groups[rank // 2], embedding_group([[0, 1], [2, 3]], v_shape=True), M_RANKS, one)
        return got

    def check(self, name: str, pp: int) -> None:
        ref = reference_loss(M_RANKS)
        for rank, got in enumerate(MEASURES[name]):
            with self.subTest(rank=rank):
                self.assertTrue(got["loss_equal"])
                self.assertEqual([n for n, ok in got["grads_equal"].items() if not ok], [])
                self.assertLessEqual(abs(got["loss"] - ref), 1e-5 * ref)
                # 1F1B holds P - rank micro-batches; ZB-H1 holds what W needs until W: P on every rank
                self.assertEqual(got["in_flight"], (pp - rank % pp, pp))
                # each W(c, m) computes the weight gradients its B deferred: every linear of chunk c, 2 Blocks x
                # 6 here, each changing that linear's .grad (plus biases): a W that found nothing to do (its B
                # computed them, as a whole backward would) leaves ZB-H1 1F1B's bits, so only this tells
                c = rank % pp
                self.assertEqual([k for k, _, _ in got["flushed"]], [(c, m) for m in range(M_RANKS)])
                self.assertEqual({p for _, p, _ in got["flushed"]}, {got["linears"][c]})
                self.assertEqual({ch for _, _, ch in got["flushed"]}, {2 * got["linears"][c]})  # weight and bias

    def test_p4_bit_equal_to_1f1b(self):
        self.check("p4", 4)

    def test_p2_bit_equal_to_1f1b(self):
        self.check("p2", 2)

    def test_v_schedules(self):
        """zbv and dualpipev at P = 2, M = 8 (v_case derives the bounds): the loss within 1e-5 of one process;
        rank 0 holds wte, wpe, Block 0, Block 3, ln_f and the tied lm_head as one parameter (no copy, no
        embedding group), rank 1 Blocks 1 and 2; the held micro-batches are the simulator's (chunk, micro)
        bound, 4 (zbv) and 5 (dualpipev) on both ranks."""
        ref = reference_loss(M_RANKS)
        for rank, got in enumerate(MEASURES["p2"]):
            for name, v in got["v"].items():
                with self.subTest(rank=rank, schedule=name):
                    self.assertLessEqual(abs(v["loss"] - ref), 1e-5 * ref)
                    self.assertEqual(v["equal"], [])
                    self.assertFalse(v["tied_copy"])
                    self.assertEqual(v["in_flight"], {"zbv": 4, "dualpipev": 5}[name])
                    if rank % 2 == 0:
                        self.assertLessEqual(v["tied_excess"], 0.0)
                        self.assertNotIn("lm_head.weight", v["names"])
                        self.assertIn("transformer.ln_f.weight", v["names"])
                    else:
                        self.assertEqual([n for n in v["names"] if not n.startswith("transformer.h.")], [])


# ----------------------------------------------------------------------------- whole train.py runs

STEPS, M = 6, 4  # test_pipeline_train's STEPS: its runs are shared by name
BASE = [
    "--model",
    "tiny",
    "--n_layer",
    str(N_LAYER),
    "--micro_batch_size",
    str(MB),
    "--seq_len",
    "32",
    "--total_batch_size",
    str(M * MB * 32),
    "--eval_interval",
    "5",
    "--eval_iters",
    "2",
    "--warmup_steps",
    "2",
    "--lr",
    "3e-3",
    "--gradient_clipping",
    "--peak_flops",
    "1e12",
]  # tests/test_pipeline_train.py's
PP2 = ["--pipeline_parallel_size", "2"]
ZB = [*PP2, "--pp_schedule", "zb_h1"]
DDP2 = ["--data_parallel_size", "2", "--data_parallel_type", "ddp"]
TP2_SP = ["--tensor_parallel_size", "2", "--sequence_parallel", "--enable_loss_parallelism"]  # test_pipeline_train's


def dp(dp_type: str) -> list[str]:
    return ["--data_parallel_size", "2", "--data_parallel_type", dp_type]


RUNS = WholeRuns(BASE)
setUpModule, tearDownModule = RUNS.set_up, RUNS.tear_down


def run(name: str, flags: list[str], nproc: int) -> dict[int, dict]:
    return steps_of(RUNS.run(name, ["--max_steps", str(STEPS), "--no_checkpoint", *flags], nproc))


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestZeroBubbleTrain(unittest.TestCase):
    """train.py --pp_schedule zb_h1: each step's loss and grad_norm are the 1F1B run's bits (the same runs as
    tests/test_pipeline_train.py, shared by name), and within 1e-5 of one process."""

    def check(self, got: dict, same_as: dict, ref: dict, what: str, rtol: float = 1e-5) -> None:
        for key in ("loss", "grad_norm"):
            assert_close(self, got, same_as, key, 0, f"{what} vs 1f1b")
            assert_close(self, got, ref, key, rtol, f"{what} vs one process")

    def test_p2(self):
        self.check(run("zb_h1", ZB, 2), run("1f1b", PP2, 2), run("single", [], 1), "zb_h1")

    def test_p2_ddp2(self):
        """DDP reduces the buckets after the schedule (reduce_on_exit), so after every W: a W left out of the
        all-reduce would leave the two replicas' gradients apart and the losses off 1F1B's."""
        self.check(
            run("zb_h1_ddp", [*ZB, *DDP2], 4), run("pp_ddp", [*PP2, *DDP2], 4), run("single", [], 1), "zb_h1 x ddp"
        )

    def test_sharded(self):
        """zb_h1 x fsdp at P = 2 x dp = 2 (4 ranks) is the 1F1B x fsdp run's bits (tests/test_pipeline_train.py's
        pp_fsdp): each unit's gradient of micro-batch m is reduce-scattered after the W that completes it, in the
        order 1F1B reduces it at its B, so the shards sum the same terms in the same order. A unit reduced at its
        B would miss its linears' weight gradients. Every split schedule x ddp / zero2 / fsdp / tp + sp against
        one process: parallel/pipeline/concept.sweep_rows (tests/test_sweep.py)."""
        self.check(
            run("zb_h1_fsdp", [*ZB, *dp("fsdp")], 4),
            run("pp_fsdp", [*PP2, *dp("fsdp")], 4),
            run("single", [], 1),
            "zb_h1 x fsdp",
        )

    def test_tp_sequence_parallel(self):
        """pp = 2 x tp = 2 with --sequence_parallel: W needs no communication (a column-parallel dW = dy_i^T x from
        the all-gathered x the store keeps; a row-parallel one dy^T x_i from the all-gathered dy), so ZB-H1 is the
        1F1B run's bits (tests/test_pipeline_train.py's pp_tp_sp) and within its tolerance of one process
        (tests/rounding.py: 4x the one-process run's own distance from float64)."""
        ref = run("single", [], 1)
        self.check(
            run("zb_h1_tp_sp", [*ZB, *TP2_SP], 4),
            run("pp_tp_sp", [*PP2, *TP2_SP], 4),
            ref,
            "zb_h1 x tp sp",
            rtol=rounding_rtol_of(RUNS, "single"),
        )

    def test_v_schedules_need_two_virtual_stages(self):
        for flags in ([*PP2, "--pp_schedule", "zbv"], [*PP2, "--pp_schedule", "dualpipev", "--pp_virtual_stages", "3"]):
            with self.subTest(flags):
                expect_train_error_on_ranks(
                    self,
                    RUNS.args("--max_steps", "2", *flags),
                    f"--pp_schedule {flags[3]} needs --pp_virtual_stages 2",
                    2,
                    RUNS.path("bad"),
                )

    def test_dualpipev_needs_2p_micro_batches(self):
        expect_train_error_on_ranks(
            self,
            RUNS.args(
                "--max_steps",
                "2",
                *PP2,
                "--pp_schedule",
                "dualpipev",
                "--pp_virtual_stages",
                "2",
                "--total_batch_size",
                str(3 * MB * 32),
            ),
            "= 3 >= 2 x --pipeline_parallel_size = 4",
            2,
            RUNS.path("bad"),
        )

    def test_too_few_micro_batches(self):
        expect_train_error_on_ranks(
            self,
            RUNS.args("--max_steps", "2", *ZB, "--total_batch_size", str(MB * 32)),
            "--pp_schedule zb_h1 needs the step's micro-batches M = total_batch_size / "
            "(micro_batch_size x seq_len x data_parallel_size) = 1 >= "
            "--pipeline_parallel_size 2",
            2,
            RUNS.path("bad"),
        )

    def test_pytorch_twin(self):
        """torch's ScheduleInterleavedZeroBubble (one stage per rank), ScheduleZBVZeroBubble and ScheduleDualPipeV
        on the same cuts, on gloo: within 1e-5 of one process (torch's W accumulates in its own order)."""
        ref = run("single", [], 1)
        for name, flags in (
            ("zb_h1", ZB),
            ("zbv", [*PP2, "--pp_schedule", "zbv", "--pp_virtual_stages", "2"]),
            ("dualpipev", [*PP2, "--pp_schedule", "dualpipev", "--pp_virtual_stages", "2"]),
        ):
            with self.subTest(name):
                got = run(f"torch_{name}", [*flags, "--implementation", "pytorch"], 2)
                for key in ("loss", "grad_norm"):
                    assert_close(self, got, ref, key, 1e-5, f"torch {name} vs one process")


class TestZeroBubbleRefusals(unittest.TestCase):
    """What the split backward is not built or tested for is refused in one line, exit 2, before any work
    (parallel/pipeline/concept.check_zero_bubble; train.main in this process as one rank of WORLD_SIZE, each well
    under a second)."""

    def test_refused_layouts(self):
        for flags, world, needle in (
            (
                [*ZB, "--context_parallel_size", "2"],
                4,
                "--pp_schedule zb_h1 does not run under --context_parallel_size",
            ),
            ([*ZB, "--compile"], 2, "--pp_schedule zb_h1 does not run under --context_parallel_size or --compile"),
            (
                [*ZB, "--implementation", "pytorch", "--tensor_parallel_size", "2"],
                4,
                "--implementation pytorch --pp_schedule zb_h1 runs without data or tensor parallelism",
            ),
        ):
            with self.subTest(flags):
                expect_train_error_in_process(
                    self,
                    RUNS.args("--max_steps", "2", *flags),
                    needle,
                    RUNS.path("bad_in_process"),
                    env={"WORLD_SIZE": str(world)},
                )


if __name__ == "__main__":
    unittest.main()
