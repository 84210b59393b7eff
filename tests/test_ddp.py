"""Our DistributedDataParallel (parallel/data_parallel/ddp.py) against torch's, on 2 gloo ranks with different data.

Each distributed class runs one spawned body in setUpClass and each test method checks one property of
its results, so the file spawns three times in all. Runs under pytest and under
`torchrun --standalone --nproc_per_node=2 -m unittest tests/test_ddp.py` (each rank then checks its own
results; under a torchrun of another size every rank checks all the spawned ranks' results).
"""

from __future__ import annotations

import collections
import contextlib
import unittest

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from debug import flight_recorder
from model.gpt import GPT, GPTConfig, param_groups
from parallel import comm
from parallel.data_parallel.ddp import DistributedDataParallel
from tests.harness import run_distributed

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
SMALL_CAP_MB = 0.02  # ~20 KB: the 2-layer GPT (~136 KB of params) splits into ~7 buckets; wte (32 KB) alone
STEPS, ACCUM, B, T = 3, 2, 2, 16


def micro_steps(step: int) -> int:
    """Step 0 runs one micro-step: a syncing backward straight after zero_grad(set_to_none=True), where autograd
    hands each gradient to the hook that scales it into its bucket; later steps ACCUM, accumulating into them."""
    return 1 if step == 0 else ACCUM


def build_gpt(seed: int = 0) -> GPT:
    model = GPT(CFG)
    model.init_weights(seed)
    return model


def batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids that differ per rank, step and micro-step."""
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    tokens = torch.randint(0, CFG.vocab_size, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(list(model.named_parameters()), 0.1), lr=1e-3)


def unique_param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def mismatches(a: nn.Module, b: nn.Module, what: str = "param") -> list[str]:
    """Names whose parameter (or grad, incl. None-ness) differs in any bit between two modules."""
    out = []
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        x, y = (p, q) if what == "param" else (p.grad, q.grad)
        if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
            out.append(name)
    return out


def train_step(model, opt, rank: int, step: int, forward=None) -> list[float]:
    """micro_steps(step) micro-steps (no_sync on all but the last), averaged."""
    losses, accum = [], micro_steps(step)
    for micro in range(accum):
        ctx = model.no_sync() if micro < accum - 1 else contextlib.nullcontext()
        with ctx:
            idx, tgt = batch(rank, step, micro)
            loss = (forward(model, idx, tgt) if forward else model(idx, tgt)[1]) / accum
            loss.backward()
        losses.append(loss.item())
    return losses


class BucketWrites(TorchDispatchMode):
    """Counts, by op, the aten calls that write into any of `buffers`' storages (their schema marks the argument
    written: `out=`, or self for an in-place op)."""

    def __init__(self, buffers: list[torch.Tensor]):
        super().__init__()
        self.ptrs = {b.untyped_storage().data_ptr() for b in buffers}
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        given = list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args) :]]
        for a, v in zip(func._schema.arguments, given):
            if (
                a.alias_info is not None
                and a.alias_info.is_write
                and isinstance(v, torch.Tensor)
                and v.untyped_storage().data_ptr() in self.ptrs
            ):
                self.ops[str(func)] += 1
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------- bodies run on every rank


def ring_since(start: int) -> list[tuple[str, str]]:
    """(op, call site) of every op this rank's flight recorder (debug/flight_recorder.py) holds from op `start` on,
    read back through `decode`, as `python -m debug hang` reads a ring."""
    return [(o["op"], o["site"]) for o in comm.RECORDER.read()["ops"] if o["n"] >= start]


def _matches_torch_body(rank: int, world_size: int) -> dict:
    """Custom vs torch DDP over STEPS accumulated+clipped AdamW steps, plus no_sync and byte checks, and what the
    flight recorder kept of ours (torch's DDP does not go through parallel/comm)."""
    start = flight_recorder.install(None, rank, world_size).count  # a fresh in-memory ring
    ours = DistributedDataParallel(build_gpt(), bucket_cap_mb=SMALL_CAP_MB)
    ref = nn.parallel.DistributedDataParallel(build_gpt())
    local = build_gpt()  # plain single-process model, to see what "unreduced" gradients look like
    opt_ours, opt_ref = adamw(ours.module), adamw(ref.module)
    expected_bytes = unique_param_bytes(ours.module)
    res = dict(
        loss_ours=[],
        loss_ref=[],
        grad_mismatch=[],
        param_mismatch=[],
        norm_equal=[],
        bytes_per_step=[],
        expected_bytes=expected_bytes,
        nosync_bytes=[],
        nosync_vs_local=[],
        synced_vs_local=[],
        replicas_equal=True,
    )
    for step in range(STEPS):
        local.load_state_dict(ours.module.state_dict())
        comm.COUNTER.reset()
        accum = micro_steps(step)
        for micro in range(accum):
            idx, tgt = batch(rank, step, micro)
            local_loss = local(idx, tgt)[1] / accum
            local_loss.backward()
            sync = micro == accum - 1
            with contextlib.nullcontext() if sync else ours.no_sync():
                loss = ours(idx, tgt)[1] / accum
                loss.backward()
            with contextlib.nullcontext() if sync else ref.no_sync():
                loss_ref = ref(idx, tgt)[1] / accum
                loss_ref.backward()
            res["loss_ours"].append(loss.item())
            res["loss_ref"].append(loss_ref.item())
            if not sync:  # inside no_sync: nothing sent, grads equal the local model's own
                res["nosync_bytes"].append(comm.COUNTER.snapshot()["all_reduce"])
                res["nosync_vs_local"].append(mismatches(ours.module, local, "grad"))
        res["synced_vs_local"].append(len(mismatches(ours.module, local, "grad")))
        res["bytes_per_step"].append(comm.COUNTER.snapshot()["all_reduce"])
        res["grad_mismatch"].append(mismatches(ours.module, ref.module, "grad"))
        n1 = torch.nn.utils.clip_grad_norm_(ours.module.parameters(), 1.0)
        n2 = torch.nn.utils.clip_grad_norm_(ref.module.parameters(), 1.0)
        res["norm_equal"].append(bool(torch.equal(n1, n2)))
        res["grad_mismatch"].append(mismatches(ours.module, ref.module, "grad"))
        opt_ours.step(), opt_ref.step()
        opt_ours.zero_grad(set_to_none=True), opt_ref.zero_grad(set_to_none=True)
        local.zero_grad(set_to_none=True)
        res["param_mismatch"].append(mismatches(ours.module, ref.module, "param"))
    flat = torch.cat([p.detach().flatten() for p in ours.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    res["replicas_equal"] = all(torch.equal(gathered[0], g) for g in gathered)
    res["ring"], res["n_buckets"] = ring_since(start), len(ours.buckets)
    return res


def _overlap_and_bf16_body(rank: int, world_size: int) -> dict:
    """Event order of one backward (grad hooks vs. bucket launches vs. waits), and bf16 compression."""
    events: list[tuple] = []
    ours = DistributedDataParallel(build_gpt(), bucket_cap_mb=SMALL_CAP_MB)
    buffers = {b.buffer.data_ptr(): k for k, b in enumerate(ours.buckets)}
    for name, p in ours.module.named_parameters():  # registered after DDP's hooks, so they run after them
        p.register_post_accumulate_grad_hook(lambda _p, name=name: events.append(("grad", name)))

    class RecordedWork:
        def __init__(self, work, k):
            self.work, self.k = work, k

        def wait(self):
            events.append(("wait", self.k))
            return self.work.wait()

    real_all_reduce = comm.all_reduce

    def recording_all_reduce(tensor, group=None, op="sum", async_op=False, **kw):
        k = buffers.get(tensor.data_ptr())
        events.append(("launch", k))
        return RecordedWork(real_all_reduce(tensor, group, op, async_op, **kw), k)

    comm.all_reduce = recording_all_reduce
    try:
        idx, tgt = batch(rank, 0, 0)
        ours(idx, tgt)[1].backward()
        events.append(("backward_returned", None))
    finally:
        comm.all_reduce = real_all_reduce

    # What a step's syncing backward writes into the buckets after zero_grad(set_to_none=True), then accumulating.
    writes, first_backward = [], list(events)  # the grad hooks go on recording
    for p in ours.module.parameters():
        p.grad = None
    for sync in (True, False, True):
        with (
            contextlib.nullcontext() if sync else ours.no_sync(),
            BucketWrites([b.buffer for b in ours.buckets]) as seen,
        ):
            ours(idx, tgt)[1].backward()
        writes.append(dict(seen.ops))

    # bf16 on the wire vs fp32, same weights and data.
    fp32 = DistributedDataParallel(build_gpt())
    bf16 = DistributedDataParallel(build_gpt(), grad_compression="bf16")
    comm.COUNTER.reset()
    fp32(idx, tgt)[1].backward()
    fp32_bytes = comm.COUNTER.snapshot()["all_reduce"]
    comm.COUNTER.reset()
    bf16(idx, tgt)[1].backward()
    bf16_bytes = comm.COUNTER.snapshot()["all_reduce"]
    rel_err = {
        n: ((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item()
        for (n, p), q in zip(bf16.module.named_parameters(), fp32.module.parameters())
    }
    return dict(
        events=first_backward,
        n_buckets=len(ours.buckets),
        fp32_bytes=fp32_bytes,
        bf16_bytes=bf16_bytes,
        rel_err=rel_err,
        param_bytes=unique_param_bytes(fp32.module),
        writes=writes,
        n_params=len(list(ours.module.parameters())),
    )


class GPTWithExtras(nn.Module):
    """GPT plus `extra` (used only when asked, e.g. on rank 0) and `unused` (never used)."""

    def __init__(self):
        super().__init__()
        self.gpt = build_gpt()
        torch.manual_seed(0)
        self.extra = nn.Linear(CFG.n_embd, CFG.n_embd)
        self.unused = nn.Linear(4, 4)

    def forward(self, idx, targets, use_extra: bool = True):
        logits, loss = self.gpt(idx, targets)
        if use_extra:
            loss = loss + 0.1 * self.extra(self.gpt.transformer.wte(idx)).pow(2).mean()
        return logits, loss


def _unused_body(rank: int, world_size: int) -> dict:
    res = {}
    # Default: a parameter no rank uses is an error that names it.
    strict = DistributedDataParallel(GPTWithExtras(), bucket_cap_mb=SMALL_CAP_MB)
    idx, tgt = batch(rank, 0, 0)
    try:
        strict(idx, tgt)[1].backward()
        res["error"] = None
    except RuntimeError as e:
        res["error"] = str(e)

    # find_unused_parameters=True: `unused` unused everywhere, `extra` used on rank 0 only.
    ours = DistributedDataParallel(GPTWithExtras(), bucket_cap_mb=SMALL_CAP_MB, find_unused_parameters=True)
    ref = nn.parallel.DistributedDataParallel(GPTWithExtras(), find_unused_parameters=True)
    opt_ours, opt_ref = adamw(ours.module), adamw(ref.module)
    fwd = lambda m, i, t: m(i, t, use_extra=(rank == 0))[1]  # noqa: E731
    res.update(loss_equal=[], grad_mismatch=[], param_mismatch=[], unused_grad_none=[], extra_moved=False)
    extra0 = ours.module.extra.weight.detach().clone()
    unused0 = ours.module.unused.weight.detach().clone()
    for step in range(STEPS):
        l1 = train_step(ours, opt_ours, rank, step, fwd)
        l2 = train_step(ref, opt_ref, rank, step, fwd)
        res["loss_equal"].append(l1 == l2)
        res["grad_mismatch"].append(mismatches(ours.module, ref.module, "grad"))
        res["unused_grad_none"].append(ours.module.unused.weight.grad is None)
        torch.nn.utils.clip_grad_norm_(ours.module.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(ref.module.parameters(), 1.0)
        opt_ours.step(), opt_ref.step()
        opt_ours.zero_grad(set_to_none=True), opt_ref.zero_grad(set_to_none=True)
        res["param_mismatch"].append(mismatches(ours.module, ref.module, "param"))
    res["extra_moved"] = not torch.equal(extra0, ours.module.extra.weight)
    res["unused_moved"] = not torch.equal(unused0, ours.module.unused.weight)
    return res


# ----------------------------------------------------------------------------- single-process tests


class TestBuckets(unittest.TestCase):
    def test_layout_honours_cap_in_reverse_registration_order_each_param_once(self):
        ddp = DistributedDataParallel(build_gpt(), bucket_cap_mb=SMALL_CAP_MB)
        cap = int(SMALL_CAP_MB * 1024 * 1024)
        named = [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad]
        names = [n for b in ddp.buckets for n in b.names]
        self.assertGreaterEqual(len(ddp.buckets), 3)
        self.assertEqual(names, [n for n, _ in reversed(named)])  # reverse order, each exactly once
        self.assertNotIn("lm_head.weight", names)  # tied to transformer.wte.weight, which is in once
        sizes = dict((n, p.numel() * p.element_size()) for n, p in named)
        for k, b in enumerate(ddp.buckets):
            self.assertEqual(b.nbytes, sum(sizes[n] for n in b.names))
            self.assertTrue(b.nbytes <= cap or len(b.names) == 1, f"bucket {k} ({b.nbytes} B) over the cap")
            if k + 1 < len(ddp.buckets):  # greedy: the next parameter would not have fitted
                self.assertGreater(b.nbytes + sizes[ddp.buckets[k + 1].names[0]], cap)
        self.assertTrue(any(sizes[b.names[0]] > cap for b in ddp.buckets if len(b.names) == 1))

    def test_default_cap_is_25mb(self):
        ddp = DistributedDataParallel(build_gpt())
        self.assertEqual(ddp.bucket_cap_mb, 25)
        self.assertEqual(len(ddp.buckets), 1)


class TestGradientsLiveInBuckets(unittest.TestCase):
    def test_autograd_accumulates_into_the_bucket_views(self):
        """.grad stays the bucket view across accumulated backwards (no copies), with the right values,
        and zero_grad(set_to_none=True) is safe: the next forward re-attaches zeroed views."""
        ddp = DistributedDataParallel(build_gpt(), bucket_cap_mb=SMALL_CAP_MB)
        plain = build_gpt()
        ptrs = [(b.buffer.data_ptr(), b.buffer.data_ptr() + b.nbytes) for b in ddp.buckets]
        views = {id(p): v for b in ddp.buckets for p, v in zip(b.params, b.views)}
        opt = torch.optim.SGD(ddp.module.parameters(), lr=0.0)
        for step in range(2):
            for micro in range(2):
                idx, tgt = batch(0, step, micro)
                with ddp.no_sync():
                    ddp(idx, tgt)[1].backward()
                plain(idx, tgt)[1].backward()
                for p in ddp.module.parameters():
                    self.assertIs(p.grad, views[id(p)])
                    self.assertTrue(any(lo <= p.grad.data_ptr() < hi for lo, hi in ptrs))
                self.assertEqual(mismatches(ddp.module, plain, "grad"), [])
            opt.zero_grad(set_to_none=True)  # would detach the buffers; forward re-attaches them
            plain.zero_grad(set_to_none=True)
            self.assertTrue(all(p.grad is None for p in ddp.module.parameters()))


# ----------------------------------------------------------------------------- distributed tests


class TestMatchesTorchDDP(unittest.TestCase):
    """Custom DDP == torch DDP bit for bit: 3 AdamW steps (1, 2 and 2 micro-steps), clipping at 1.0."""

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(_matches_torch_body, 2)

    def test_losses_grads_and_params_equal_torch_ddp_bit_for_bit(self):
        for r in self.results:
            self.assertEqual(r["loss_ours"], r["loss_ref"])
            self.assertEqual(len(r["loss_ours"]), sum(map(micro_steps, range(STEPS))))
            self.assertEqual(r["grad_mismatch"], [[]] * (2 * STEPS))
            self.assertTrue(all(r["norm_equal"]))
            self.assertEqual(r["param_mismatch"], [[]] * STEPS)
            self.assertTrue(r["replicas_equal"])

    def test_no_sync_leaves_gradients_local_and_unreduced(self):
        for r in self.results:
            n = sum(micro_steps(s) - 1 for s in range(STEPS))
            self.assertEqual(r["nosync_bytes"], [0] * n)
            self.assertEqual(r["nosync_vs_local"], [[]] * n)
            self.assertTrue(all(n > 0 for n in r["synced_vs_local"]))  # after the sync they differ

    def test_all_reduce_bytes_per_optimizer_step_equal_parameter_bytes(self):
        for r in self.results:
            self.assertEqual(r["bytes_per_step"], [r["expected_bytes"]] * STEPS)

    def test_flight_recorder_names_each_bucket_of_each_step_in_order(self):
        """The ring (decoded as `python -m debug hang` reads it) holds the construction's broadcasts, then per
        step one all-reduce per bucket, bucket 0, 1, ... in launch order, each with its bucket in the call site:
        what a hang report names. A wrapper between DDP and comm that dropped `unit=` fails here."""
        for r in self.results:
            n = r["n_buckets"]
            self.assertGreater(n, 2)
            reduces = [site for op, site in r["ring"] if op == "all_reduce"]
            self.assertEqual(reduces, [f"parallel.data_parallel.ddp._launch [bucket {k}]" for k in range(n)] * STEPS)
            self.assertEqual(
                {site for op, site in r["ring"] if op == "broadcast"},
                {"parallel.data_parallel.ddp._broadcast_from_rank0"},
            )
            self.assertEqual({op for op, _ in r["ring"]}, {"broadcast", "all_reduce"})


class TestOverlapAndCompression(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(_overlap_and_bf16_body, 2)

    def test_first_bucket_launched_before_backward_finishes(self):
        for r in self.results:
            ev = r["events"]
            kinds = [e[0] for e in ev]
            launches = [e[1] for e in ev if e[0] == "launch"]
            last_grad = max(i for i, k in enumerate(kinds) if k == "grad")
            self.assertEqual(launches, list(range(r["n_buckets"])))  # every bucket once, in order
            self.assertLess(kinds.index("launch"), last_grad)  # overlaps with the rest of backward
            self.assertGreater(kinds[:last_grad].count("launch"), 1)
            waits = [i for i, k in enumerate(kinds) if k == "wait"]
            self.assertEqual(len(waits), r["n_buckets"])
            self.assertGreater(min(waits), last_grad)  # no waiting inside hooks
            self.assertLess(max(waits), kinds.index("backward_returned"))

    def test_fresh_gradients_are_written_into_the_buckets_once(self):
        """After zero_grad(set_to_none=True) a syncing backward writes each gradient into its bucket once, scaled
        on the way (torch's mul_out): no zeroing, accumulating or scaling passes over the buffers (those were three
        reads and three writes per gradient: zero_, AccumulateGrad's add_, mul_). Backwards that accumulate (the
        no_sync one, then the sync after it) add into the views, and the sync scales each bucket once."""
        for r in self.results:
            n, k = r["n_params"], r["n_buckets"]
            self.assertEqual(
                r["writes"],
                [{"aten.mul.out": n}, {"aten.add_.Tensor": n}, {"aten.add_.Tensor": n, "aten.mul_.Tensor": k}],
            )

    def test_bf16_compression_within_tolerance_and_half_the_bytes(self):
        tol = 2**-7  # bf16 keeps 8 significant bits: each element within 1/128 of the tensor's max |g|
        for r in self.results:
            self.assertEqual(r["fp32_bytes"], r["param_bytes"])
            self.assertEqual(r["bf16_bytes"], r["param_bytes"] // 2)
            worst = max(r["rel_err"].values())
            self.assertLess(worst, tol, r["rel_err"])
            self.assertGreater(worst, 0.0)  # it really went through bf16


class TestUnusedParameters(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(_unused_body, 2)

    def test_unused_parameter_is_a_clear_error_by_default(self):
        for r in self.results:
            self.assertIsNotNone(r["error"])
            self.assertIn("unused.weight", r["error"])
            self.assertIn("unused.bias", r["error"])
            self.assertNotIn("extra.weight", r["error"])
            self.assertIn("find_unused_parameters=True", r["error"])

    def test_find_unused_parameters_trains_and_matches_torch_ddp(self):
        for r in self.results:
            self.assertTrue(all(r["loss_equal"]))
            self.assertEqual(r["grad_mismatch"], [[]] * STEPS)
            self.assertEqual(r["param_mismatch"], [[]] * STEPS)
            self.assertTrue(all(r["unused_grad_none"]))  # as torch: globally unused grads stay None
            self.assertTrue(r["extra_moved"])  # used on rank 0 only, still trained everywhere
            self.assertFalse(r["unused_moved"])


if __name__ == "__main__":
    unittest.main()
