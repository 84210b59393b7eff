"""The pipeline runtime (parallel/pipeline.py) against one process, on 2 and 4 spawned gloo ranks.

Equality with one process (fp32, 1e-6 relative). Each chunk runs exactly the reference's modules on the
same micro-batch shapes, so the forward and each micro-batch's backward compute the same numbers; only the
summation order of accumulations differs: the losses are summed on the last rank in schedule order, and the
tied embedding's gradient is summed as (sum over micro-batches of the embedding use) + (sum of the lm_head
use) across two ranks, where one process adds both uses micro-batch by micro-batch. fp32 addition reordered
over a handful of terms errs by a few ulps (~1e-7 relative), so 1e-6 leaves margin and still catches any
missing, doubled or misscaled micro-batch (errors of order 1/M).

p2p bytes (theory): with C = P·V chunks there are C-1 chunk boundaries, all across ranks when P > 1 (none
when P = 1: chunks then hand over in memory); each
moves M activations (mb, T, n_embd) forward and M gradients of the same shape backward, fp32:
total = 2·(C-1)·M·mb·T·n_embd·4 bytes, and per rank `p2p_bytes_per_step`.
"""
from __future__ import annotations

import unittest

import torch

from model import GPT, make_config
from parallel import comm
from parallel.pipeline import PipelineRunner, PipelineStage, p2p_bytes_per_step
from parallel.pipeline_schedule import SCHEDULES, chunk_of, split_layers
from tests.harness import run_distributed

SEED, MB, T = 0, 2, 16


def config(n_layer: int):
    return make_config("tiny", n_layer=n_layer, vocab_size=256, block_size=32)


def micro_batches(cfg, m: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (m, MB, T + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def reference(cfg, batches) -> tuple[float, dict[str, torch.Tensor]]:
    """One process: each micro-batch's loss scaled by 1/M, gradients accumulated."""
    model = GPT(cfg)
    model.init_weights(SEED)
    total = 0.0
    for x, y in batches:
        _, loss = model(x, y)
        (loss / len(batches)).backward()
        total += loss.item() / len(batches)
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def run_case(rank: int, world: int, name: str, n_layer: int, virtual: int, m: int) -> dict:
    cfg = config(n_layer)
    batches = micro_batches(cfg, m)
    with torch.device("meta"):
        model = GPT(cfg)
    stage = PipelineStage(model, rank, world, virtual)
    stage.materialize(SEED)
    runner = PipelineRunner(stage)
    comm.COUNTER.reset()
    loss = runner.step(batches, name)
    p2p = comm.COUNTER.snapshot().get("p2p", 0)
    runner.reduce_tied_grads()
    _, ref_grads = reference(cfg, batches)
    grads = {}
    for n, p in stage.named_parameters():
        ref = ref_grads["transformer.wte.weight" if n == "lm_head.weight" else n]
        grads[n] = rel(p.grad, ref)
    # the global norm counts the tied matrix once; clipping scales the lm_head copy like wte
    ref_norm = torch.stack([g.norm() for g in ref_grads.values()]).norm()  # GPT lists the tied matrix once
    max_norm = 0.5 * ref_norm.item()
    norm = runner.clip_grad_norm_(max_norm)
    coef = max_norm / (ref_norm + 1e-6)
    clipped = {n: rel(p.grad, coef * ref_grads["transformer.wte.weight" if n == "lm_head.weight" else n])
               for n, p in stage.named_parameters()}
    return {"loss": loss.item(), "grads": grads, "p2p": p2p, "peak": runner.peak_in_flight,
            "norm": rel(norm, ref_norm), "clipped": clipped,
            "p2p_theory": p2p_bytes_per_step(world, virtual, rank, m, (MB, T, cfg.n_embd)),
            "timeline": len(runner.timeline)}


def check_cases(rank: int, world: int, cases) -> dict:
    return {case: run_case(rank, world, *case) for case in cases}


def deferred_init(rank: int, world: int, n_layer: int, virtual: int) -> dict:
    """A stage built on meta: its parameter names, what it allocated, and whether values equal eager init."""
    cfg = config(n_layer)
    with torch.device("meta"):
        model = GPT(cfg)
    stage = PipelineStage(model, rank, world, virtual)
    stage.materialize(SEED)
    eager = GPT(cfg)
    eager.init_weights(SEED)
    ref = dict(eager.named_parameters())
    ref["lm_head.weight"] = eager.transformer.wte.weight
    names = [n for n, _ in stage.named_parameters()]
    own = {id(p) for p in stage.parameters()}
    return {"names": names,
            "meta_left": all(p.is_meta for p in model.parameters() if id(p) not in own),
            "stage_meta": any(p.is_meta for p in stage.parameters()),
            "equal": all(torch.equal(p, ref[n]) for n, p in stage.named_parameters())}


CASES_2 = [(name, n_layer, v, m) for name, n_layer, v in (("gpipe", 2, 1), ("1f1b", 2, 1),
                                                          ("interleaved_1f1b", 4, 2)) for m in (2, 4)]
CASES_1 = [("1f1b", 2, 1, 2), ("interleaved_1f1b", 4, 2, 2)]  # P = 1: chunks hand over locally, lm_head tied
CASES_4 = [("1f1b", 4, 1, m) for m in (4, 8)] + [("gpipe", 4, 1, 8)]


def expected_names(cfg, rank: int, pp: int, virtual: int) -> set[str]:
    layers = split_layers(cfg.n_layer, pp, virtual)
    chunks = [chunk_of(rank, v, pp) for v in range(virtual)]
    names = {n for n, _ in GPT(cfg).named_parameters() if n.startswith("transformer.h.")
             and any(int(n.split(".")[2]) in layers[c] for c in chunks)}
    if 0 in chunks:
        names |= {"transformer.wte.weight", "transformer.wpe.weight"}
    if pp * virtual - 1 in chunks:
        names |= {"transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"}
    return names


class PipelineMatchesOneProcess(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.res = {p: run_distributed(check_cases, p, cases) for p, cases in ((1, CASES_1), (2, CASES_2), (4, CASES_4))}

    def each(self):
        for world, cases in ((1, CASES_1), (2, CASES_2), (4, CASES_4)):
            for case in cases:
                yield world, case, [r[case] for r in self.res[world]]

    def test_summed_loss_equals_one_process(self):
        for world, case, per_rank in self.each():
            with self.subTest(pp=world, case=case):
                ref, _ = reference(config(case[1]), micro_batches(config(case[1]), case[3]))
                self.assertLess(abs(sum(r["loss"] for r in per_rank) - ref) / ref, 1e-6)
                self.assertTrue(all(r["loss"] == 0.0 for r in per_rank[:-1]))  # only the last stage has a loss

    def test_every_gradient_equals_one_process_after_tied_reduce(self):
        for world, case, per_rank in self.each():
            with self.subTest(pp=world, case=case):
                names = set()
                for r in per_rank:
                    bad = {n: e for n, e in r["grads"].items() if not e < 1e-6}
                    self.assertEqual(bad, {})
                    names |= set(r["grads"])
                cfg = config(case[1])
                tied_copy = {"lm_head.weight"} if world > 1 else set()
                self.assertEqual(names, {n for n, _ in GPT(cfg).named_parameters()} | tied_copy)

    def test_grad_norm_counts_tied_matrix_once_and_clip_scales_both_copies(self):
        for world, case, per_rank in self.each():
            with self.subTest(pp=world, case=case):
                self.assertTrue(all(r["norm"] < 1e-6 for r in per_rank), [r["norm"] for r in per_rank])
                bad = {n: e for r in per_rank for n, e in r["clipped"].items() if not e < 1e-6}
                self.assertEqual(bad, {})

    def test_p2p_bytes_equal_theory(self):
        for world, (name, n_layer, v, m), per_rank in self.each():
            with self.subTest(pp=world, case=(name, n_layer, v, m)):
                act = MB * T * config(n_layer).n_embd * 4
                boundaries = world * v - 1 if world > 1 else 0  # P = 1: every boundary is local
                self.assertEqual(sum(r["p2p"] for r in per_rank), 2 * boundaries * m * act)
                self.assertEqual([r["p2p"] for r in per_rank], [r["p2p_theory"] for r in per_rank])

    def test_stored_activations_1f1b_at_most_p_minus_rank_gpipe_m(self):
        for world, (name, n_layer, v, m), per_rank in self.each():
            if v != 1:
                continue
            with self.subTest(pp=world, case=(name, n_layer, v, m)):
                peaks = [r["peak"] for r in per_rank]
                if name == "1f1b":
                    self.assertTrue(all(p <= world - rank for rank, p in enumerate(peaks)), peaks)
                    self.assertEqual(peaks[0], min(world, m))  # the bound is reached on rank 0
                else:
                    self.assertEqual(peaks, [m] * world)

    def test_timeline_has_one_entry_per_action(self):
        for world, (name, n_layer, v, m), per_rank in self.each():
            lists = SCHEDULES[name](world, m, v)
            self.assertEqual([r["timeline"] for r in per_rank], [len(a) for a in lists])


class DeferredInit(unittest.TestCase):
    def test_stage_allocates_only_its_own_parameters_with_eager_values(self):
        for world, n_layer, v in ((4, 4, 1), (2, 4, 2)):
            res = run_distributed(deferred_init, world, n_layer, v)
            for rank, r in enumerate(res):
                with self.subTest(pp=world, virtual=v, rank=rank):
                    self.assertEqual(sorted(r["names"]), sorted(expected_names(config(n_layer), rank, world, v)))
                    self.assertTrue(r["meta_left"])  # every other stage's parameter is still on meta
                    self.assertFalse(r["stage_meta"])
                    self.assertTrue(r["equal"])


if __name__ == "__main__":
    unittest.main()


def held_cases(rank: int, world: int) -> dict:
    """One step of each (schedule, M): rank 0's peak held bytes and peak in-flight count, on every rank (so the
    result reads the same under spawn and under a same-size torchrun)."""
    cfg = config(2)
    out = {}
    for name in ("1f1b", "gpipe"):
        for m in (4, 16):
            with torch.device("meta"):
                model = GPT(cfg)
            stage = PipelineStage(model, rank, world)
            stage.materialize(SEED)
            runner = PipelineRunner(stage)
            runner.step(micro_batches(cfg, m), name)
            out[name, m] = {"held": runner.peak_held_bytes, "in_flight": runner.peak_in_flight}
    mine = [out]
    torch.distributed.broadcast_object_list(mine, src=0)
    return mine[0]


class RunnerHoldsWhatTheScheduleBounds(unittest.TestCase):
    """Bytes of live tensor storages the runner keeps (stored inputs and outputs, received buffers, tensors in
    or waiting for a send), rank 0 of P = 2, fp32 activations of A = mb·T·n_embd·4 bytes. Under 1F1B rank 0 holds
    at most P - 0 = 2 micro-batches' outputs plus one received gradient: 3A, whatever M. A sent activation shares
    its output's storage, so a runner that kept its sends until the step's end would hold M outputs (16A at
    M = 16), as GPipe does by design (M outputs + one gradient)."""

    @classmethod
    def setUpClass(cls):
        cls.res = run_distributed(held_cases, 2)[0]

    def test_1f1b_stays_within_its_bound_at_any_m(self):
        A = MB * T * config(2).n_embd * 4
        for m in (4, 16):
            with self.subTest(m=m):
                self.assertEqual(self.res["1f1b", m]["in_flight"], 2)
                self.assertLessEqual(self.res["1f1b", m]["held"], 3 * A)
        self.assertEqual(self.res["1f1b", 16]["held"], self.res["1f1b", 4]["held"])

    def test_gpipe_holds_every_micro_batch(self):
        """The measurement sees growth where there is some: GPipe's M outputs."""
        A = MB * T * config(2).n_embd * 4
        for m in (4, 16):
            with self.subTest(m=m):
                self.assertEqual(self.res["gpipe", m]["held"], (m + 1) * A)


def new_group_calls(rank: int, world: int) -> list:
    """parallelize a pp = world GPT (pp spans the world: rank 1 is a middle stage); every dist.new_group call's
    ranks, in order, on this rank."""
    from unittest import mock

    import torch.distributed as dist

    from parallel.mesh import ParallelDims, init_distributed
    from parallel.parallelize import ParallelConfig, parallelize
    dims = ParallelDims(dp=1, tp=1, world_size=world, pp=world)
    mesh = init_distributed(dims, torch.device("cpu"))
    calls, real = [], dist.new_group

    def recording(ranks=None, *args, **kw):
        calls.append(sorted(ranks) if ranks is not None else None)
        return real(ranks, *args, **kw)
    with torch.device("meta"):
        model = GPT(config(world))
    with mock.patch.object(dist, "new_group", recording):
        par = parallelize(model, mesh, dims, ParallelConfig(implementation="custom", deferred_init=True, seed=SEED),
                          torch.device("cpu"))
    return {"calls": calls, "embed": par.pipeline.embed_group is not None}


class EveryRankCallsEveryNewGroup(unittest.TestCase):
    """On NCCL a new_group that some rank skips hangs the ranks that call it; gloo only misnames later groups.
    With pp = 3 spanning the world, the middle stage has no embedding group: it must still call new_group for
    [first, last] with the others, and not once more on its own."""

    def test_pp3_middle_stage(self):
        per_rank = run_distributed(new_group_calls, 3)
        if len(per_rank) == 1:  # a same-size torchrun: each rank checks its own, against the expected list
            self.assertEqual(per_rank[0]["calls"], [[0, 2]])
            return
        self.assertEqual([r["calls"] for r in per_rank], [[[0, 2]]] * 3)
        self.assertEqual([r["embed"] for r in per_rank], [True, False, True])


class TimerIsChosenWithTheDevice(unittest.TestCase):
    """pp_idle_fraction and the timeline time the work: device events where the device queues it (CUDA: a
    wait() returns at once there), the host clock on the CPU (parallel.mesh.make_timer, the one place)."""

    def test_choice(self):
        from parallel.mesh import DeviceTimer, HostTimer, make_timer
        self.assertIsInstance(make_timer(torch.device("cpu")), HostTimer)
        self.assertIsInstance(make_timer(torch.device("cuda", 0)), DeviceTimer)  # built without touching CUDA

    def test_device_marks_become_host_seconds_from_the_first(self):
        from parallel.mesh import DeviceTimer

        class Event:  # torch.cuda.Event's elapsed_time is in milliseconds
            def __init__(self, ms):
                self.ms = ms

            def elapsed_time(self, other):
                return other.ms - self.ms

            def synchronize(self):
                pass
        marks = [(100.0, Event(5.0)), (100.9, Event(7.5)), (101.0, Event(1005.0))]
        self.assertEqual(DeviceTimer(torch.device("cuda", 0)).seconds(marks), [100.0, 100.0025, 101.0])
