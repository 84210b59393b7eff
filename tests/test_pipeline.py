"""The pipeline runtime (parallel/pipeline/runner.py) against one process, on 2 and 4 spawned gloo ranks.

Equality with one process, fp32, to derived bounds. Each chunk runs exactly the reference's modules on the
same micro-batch shapes, so the forward and each micro-batch's backward compute the same numbers, and every
gradient but the tied matrix's is accumulated in the same order: bit-equal. What is summed in another order:
- the loss: the last rank adds l_m / M in fp32 (M roundings per term at most), one process in float64, so
  |sum - ref| <= (gamma_M(fp32) + 2 gamma_M(fp64)) ref (all terms positive);
- the tied matrix: P > 1 sums each end's M terms (embedding use e_m, lm_head use h_m) and all-reduces the two
  sums; P = 1 with V > 1 adds e_m and h_m to one .grad in turn; one process adds fl(e_m + h_m) micro-batch by
  micro-batch. With the terms recorded (hooks), |got - ref| <= gamma_d sum_m(|e_m| + |h_m|) elementwise, d
  the roundings on both paths (gamma_n = n u / (1 - n u), u = 2^-24: Higham, Accuracy and Stability, 4.4);
- the grad norm: ours accumulates in fp64 and rounds once to fp32, the reference is computed in fp64, so
  |norm - ref| <= ||g - g_ref|| + u (ref + ...), the distance measured (the tied matrix counted once);
- clipping: every gradient, the lm_head copy's too, is the pre-clip one times max_norm / (norm + 1e-6)
  within gamma_4 relative (the norm's fp32 rounding, the fp32 coefficient, the multiply).
A missing, doubled or misscaled micro-batch (errors of order 1/M), or a tied matrix counted twice, is far
outside these bounds.

p2p bytes (theory): with C = P·V chunks there are C-1 chunk boundaries, all across ranks when P > 1 (none
when P = 1: chunks then hand over in memory); each
moves M activations (mb, T, n_embd) forward and M gradients of the same shape backward, fp32:
total = 2·(C-1)·M·mb·T·n_embd·4 bytes, and per rank `p2p_bytes_per_step`.
"""

from __future__ import annotations

import contextlib
import unittest
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from debug import flight_recorder
from model.gpt import GPT, make_config
from parallel import comm
from parallel.grads import clip_grad_norm_
from parallel.groups import link_groups, new_groups, p2p_link
from parallel.pipeline.parts import GPT_PARTS
from parallel.pipeline.record import StepRecord
from parallel.pipeline.runner import PipelineRunner, PipelineStage
from parallel.pipeline.schedule import (
    ALL_SCHEDULES,
    RECV_B,
    RECV_F,
    SCHEDULES,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    boundary,
    chunk_of,
    even_partition,
    rank_of,
    send_waits,
)
from parallel.pipeline.zero_bubble import split_backward
from parallel.protocol import Placement, Replicated, Sharded
from plan.theory import p2p_bytes_per_step
from plan.timeline import P2P_MODELS, simulate_schedule
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


U32, U64 = 2.0**-24, 2.0**-53  # unit roundoff of fp32 and fp64


def gamma(n: int, u: float) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of a sum whose every term went through at most n
    roundings to unit roundoff u (Higham, Accuracy and Stability, eq. 3.8 / 4.4)."""
    return n * u / (1 - n * u)


def run_case(rank: int, world: int, name: str, n_layer: int, virtual: int, m: int) -> dict:
    """One step of the pipeline against one process, with the bounds its numbers must hold to (the module
    docstring derives them). Returns, among others, "grads" and "clipped": per stage parameter, how far its
    worst element is past its bound (<= 0 passes)."""
    cfg = config(n_layer)
    batches = micro_batches(cfg, m)
    with torch.device("meta"):
        model = GPT(cfg)
    stage = PipelineStage(model, rank, world, virtual, parts=GPT_PARTS)
    stage.materialize(SEED)
    runner = PipelineRunner(stage, record=StepRecord(torch.device("cpu")))
    # the tied matrix's terms: each backward's gradient of this rank's copy (P = 1: of wte, both uses)
    tied = runner.tied or ([stage.transformer.wte.weight] if world == 1 else [])
    magnitude = torch.zeros(cfg.vocab_size, cfg.n_embd, dtype=torch.float64)
    terms = torch.zeros((), dtype=torch.int64)

    def record(g: torch.Tensor) -> None:
        magnitude.add_(g.double().abs())
        terms.add_(1)

    hooks = [w.register_hook(record) for w in tied]
    comm.COUNTER.reset()
    flight_recorder.install(None, rank, world)  # a fresh in-memory ring: this step's ops only
    with receives_waited(runner) as waited:
        loss = runner.step(batches, name)
    p2p = comm.COUNTER.snapshot().get("p2p", 0)
    ops = comm.RECORDER.read()["ops"]
    for h in hooks:
        h.remove()
    dist.all_reduce(magnitude)  # sum|t_i| over both ends' terms
    dist.all_reduce(terms, op=dist.ReduceOp.MAX)
    runner.reduce_tied_grads()
    _, ref_grads = reference(cfg, batches)
    depth = int(terms) - 1 + (world > 1) + m  # this side's sums (+ the tied all-reduce), and one process's
    tied_bound = gamma(depth + 1, U32) * magnitude  # + 1: covers the float64 arithmetic of the check itself
    ids = {id(w) for w in tied}
    copy = runner.tied_weight() if stage.last else None  # P > 1: lm_head's copy, counted once (as wte)
    grads, pre, dist_sq, n_elems = {}, {}, torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.int64)
    for n, p in stage.named_parameters():
        ref = ref_grads["transformer.wte.weight" if n == "lm_head.weight" else n]
        diff = (p.grad.double() - ref.double()).abs()
        grads[n] = (diff - (tied_bound if id(p) in ids else 0)).max().item()
        pre[n] = p.grad.clone()
        if p is not copy:
            dist_sq += (diff**2).sum()
            n_elems += p.numel()
    dist.all_reduce(dist_sq)
    dist.all_reduce(n_elems)
    # the global norm counts the tied matrix once; clipping scales the lm_head copy like wte
    ref_norm = sum(float((g.double() ** 2).sum()) for g in ref_grads.values()) ** 0.5  # GPT lists it once
    max_norm = 0.5 * ref_norm
    copy_items = Replicated(stage, Placement(lm_head_copy=stage.last and not stage.both_ends), {}).grad_norm_items()
    norm = clip_grad_norm_(copy_items, max_norm, across=dist.group.WORLD).item()  # the trainer's: summed over pp
    distance = float(dist_sq) ** 0.5
    norm_bound = distance + (U32 + 4 * gamma(int(n_elems) + 2, U64)) * (ref_norm + 2 * distance)
    coef = max_norm / (norm + 1e-6)  # what clip_grad_norm_ scales by, from its own (fp32-rounded) norm
    clipped = {
        n: ((p.grad.double() - coef * pre[n].double()).abs() - gamma(4, U32) * coef * pre[n].double().abs())
        .max()
        .item()
        for n, p in stage.named_parameters()
    }
    return {
        "loss": loss.item(),
        "grads": grads,
        "p2p": p2p,
        "peak": runner.record.peak_in_flight,
        "norm": (norm, ref_norm, norm_bound),
        "clipped": clipped,
        "coef": coef,
        "p2p_theory": p2p_bytes_per_step(world, virtual, rank, m, (MB, T, cfg.n_embd)),
        "timeline": len(runner.record.timeline),
        "executed": [a for a, _, _ in runner.record.timeline],
        "events": list(runner.record.events),
        "ops": [(o["op"], o["state"]) for o in ops],
        "waited": waited,
    }


@contextlib.contextmanager
def receives_waited(runner: PipelineRunner):
    """Yields [(i, RECV action)]: each receive's work really waited on (torch's wait, not the runner's record of
    it) when the runner's `events` held i entries. The runner posts ("post", a) before it calls comm.recv."""
    waited, real = [], comm.recv

    class Work:
        def __init__(self, work, a):
            self.work, self.a = work, a

        def wait(self, *args):
            waited.append((len(runner.record.events), self.a))
            return self.work.wait(*args)

    def recv(*args, **kwargs):
        return Work(real(*args, **kwargs), runner.record.events[-1][1])

    with mock.patch.object(comm, "recv", recv):
        yield waited


def check_cases(rank: int, world: int, cases) -> dict:
    return {case: run_case(rank, world, *case) for case in cases}


def every_rank(rank: int, world: int, fn, *args) -> list:
    """fn's results of all ranks, by rank, gathered on each: the tests compare ranks with each other, and
    under a torchrun of the same size run_distributed hands each rank only its own result."""
    out = [None] * world
    dist.all_gather_object(out, fn(rank, world, *args))
    return out


def on_all_ranks(fn, world: int, *args) -> list:
    """fn(rank, world, *args) of every rank, by rank, in every launch mode (spawned, or any torchrun)."""
    return run_distributed(every_rank, world, fn, *args)[0]


def deferred_init(rank: int, world: int, n_layer: int, virtual: int) -> dict:
    """A stage built on meta: its parameter names, what it allocated, and whether values equal eager init."""
    cfg = config(n_layer)
    with torch.device("meta"):
        model = GPT(cfg)
    stage = PipelineStage(model, rank, world, virtual, parts=GPT_PARTS)
    stage.materialize(SEED)
    eager = GPT(cfg)
    eager.init_weights(SEED)
    ref = dict(eager.named_parameters())
    ref["lm_head.weight"] = eager.transformer.wte.weight
    names = [n for n, _ in stage.named_parameters()]
    own = {id(p) for p in stage.parameters()}
    return {
        "names": names,
        "meta_left": all(p.is_meta for p in model.parameters() if id(p) not in own),
        "stage_meta": any(p.is_meta for p in stage.parameters()),
        "equal": all(torch.equal(p, ref[n]) for n, p in stage.named_parameters()),
    }


CASES_2 = [
    (name, n_layer, v, m)
    for name, n_layer, v in (("gpipe", 2, 1), ("1f1b", 2, 1), ("interleaved_1f1b", 4, 2))
    for m in (2, 4)
]
CASES_1 = [("1f1b", 2, 1, 2), ("interleaved_1f1b", 4, 2, 2)]  # P = 1: chunks hand over locally, lm_head tied
CASES_4 = [("1f1b", 4, 1, m) for m in (4, 8)] + [("gpipe", 4, 1, 8)]


def expected_names(cfg, rank: int, pp: int, virtual: int) -> set[str]:
    layers = even_partition(cfg.n_layer, pp, virtual)
    chunks = [chunk_of(rank, v, pp) for v in range(virtual)]
    names = {
        n
        for n, _ in GPT(cfg).named_parameters()
        if n.startswith("transformer.h.") and any(int(n.split(".")[2]) in layers[c] for c in chunks)
    }
    if 0 in chunks:
        names |= {"transformer.wte.weight", "transformer.wpe.weight"}
    if pp * virtual - 1 in chunks:
        names |= {"transformer.ln_f.weight", "transformer.ln_f.bias", "lm_head.weight"}
    return names


class PipelineMatchesOneProcess(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.res = {p: on_all_ranks(check_cases, p, cases) for p, cases in ((1, CASES_1), (2, CASES_2), (4, CASES_4))}

    def each(self):
        for world, cases in ((1, CASES_1), (2, CASES_2), (4, CASES_4)):
            for case in cases:
                yield world, case, [r[case] for r in self.res[world]]

    def test_summed_loss_equals_one_process(self):
        for world, case, per_rank in self.each():
            with self.subTest(pp=world, case=case):
                m = case[3]
                ref, _ = reference(config(case[1]), micro_batches(config(case[1]), m))
                bound = (gamma(m, U32) + 2 * gamma(m, U64)) * ref
                self.assertLessEqual(abs(sum(r["loss"] for r in per_rank) - ref), bound)
                self.assertTrue(all(r["loss"] == 0.0 for r in per_rank[:-1]))  # only the last stage has a loss

    def test_every_gradient_equals_one_process_after_tied_reduce(self):
        for world, case, per_rank in self.each():
            with self.subTest(pp=world, case=case):
                names = set()
                for r in per_rank:
                    bad = {n: e for n, e in r["grads"].items() if not e <= 0}
                    self.assertEqual(bad, {})  # past the bound: bit-equal for all but the tied matrix
                    names |= set(r["grads"])
                cfg = config(case[1])
                tied_copy = {"lm_head.weight"} if world > 1 else set()
                self.assertEqual(names, {n for n, _ in GPT(cfg).named_parameters()} | tied_copy)

    def test_grad_norm_counts_tied_matrix_once_and_clip_scales_both_copies(self):
        for world, case, per_rank in self.each():
            with self.subTest(pp=world, case=case):
                for norm, ref, bound in (r["norm"] for r in per_rank):
                    self.assertLessEqual(abs(norm - ref), bound, (norm, ref))
                self.assertTrue(all(r["coef"] < 1 for r in per_rank))  # clipping acts
                bad = {n: e for r in per_rank for n, e in r["clipped"].items() if not e <= 0}
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
        for world, (name, _n_layer, v, m), per_rank in self.each():
            lists = SCHEDULES[name](world, m, v)
            self.assertEqual([r["timeline"] for r in per_rank], [len(a) for a in lists])

    def test_executed_actions_are_the_schedules_and_nccl_safe(self):
        """Every rank ran its schedule's list, in its order (the NCCL-safe "ready" pairing), and those executed
        lists run under every p2p model of the simulator: a runner on another pairing ("ready_meet" deadlocks
        interleaved 1F1B at P = 2, V = 2, M = 4 under NCCL's pair FIFOs) or order fails here."""
        for world, (name, n_layer, v, m), per_rank in self.each():
            with self.subTest(pp=world, case=(name, n_layer, v, m)):
                executed = [r["executed"] for r in per_rank]
                self.assertEqual(executed, SCHEDULES[name](world, m, v))
                for p2p in P2P_MODELS:
                    simulate_schedule(executed, world, v, m, p2p=p2p)  # raises ScheduleError on a deadlock or mismatch

    def test_receives_and_sends_are_waited_where_the_list_says(self):
        """A receive is posted at its place in the list and waited on just before the F or B that reads it (so a
        rank computes what needs no input while the data is in flight); each send is waited on, and freed, just
        before the compute `send_waits` names (SEND_F(c, m) at B(c, m), SEND_B at the rank's next B), or at the
        step's end, once. The receive's own wait (torch's work.wait, `receives_waited`) happens there too, not
        where it was posted: the runner's record alone would not show a wait moved to the post (on NCCL that
        serialises a stage behind its neighbour's compute)."""
        early = 0  # receives posted at least one action before their compute: the case where waiting matters
        for world, (name, n_layer, v, m), per_rank in self.each():
            for rank, r in enumerate(per_rank):
                with self.subTest(pp=world, case=(name, n_layer, v, m), rank=rank):
                    events, acts = r["events"], SCHEDULES[name](world, m, v)[rank]
                    self.assertEqual([a for kind, a in events if kind != "wait"], acts)  # posts in list order
                    waits = send_waits(acts)
                    for i, (kind, a) in enumerate(events):
                        if kind == "wait" and a.kind in (RECV_F, RECV_B):
                            consumer = Action(F if a.kind == RECV_F else B, a.chunk, a.micro)
                            self.assertEqual(events[i + 1], ("run", consumer))
                            early += acts.index(consumer) - acts.index(a) > 1
                        if kind == "wait" and a.kind in (SEND_F, SEND_B):
                            at = next((e for e in events[i + 1 :] if e[0] != "wait"), None)
                            named = next((c for c, ws in waits.items() if a in ws), None)
                            self.assertEqual(at, ("run", named) if named else None)
                    # the wait itself (torch's), not only the runner's record of it: right before that record, once
                    self.assertEqual([events[i] for i, _ in r["waited"]], [("wait", a) for _, a in r["waited"]])
                    self.assertEqual(
                        sorted(a for _, a in r["waited"]),
                        sorted(a for kind, a in events if kind == "post" and a.kind in (RECV_F, RECV_B)),
                    )
                    posted = sorted(
                        a for kind, a in events if kind == "post" and a.kind in (SEND_F, SEND_B, RECV_F, RECV_B)
                    )
                    waited = sorted(a for kind, a in events if kind == "wait")
                    self.assertEqual(waited, posted)  # every message waited on exactly once
        self.assertGreater(early, 0)

    def test_every_recorded_op_completed(self):
        """After a step every op the flight recorder saw is marked completed: the hang doctor names an op a rank
        is stuck in by its posted-not-completed records, so a send left unmarked would be named falsely."""
        for world, case, per_rank in self.each():
            with self.subTest(pp=world, case=case):
                ops = [o for r in per_rank for o in r["ops"]]
                self.assertEqual([o for o in ops if o[1] != "completed"], [])
                if world > 1:
                    self.assertTrue(any(op == "send" for op, _ in ops) and any(op == "recv" for op, _ in ops))


class RecordedCompletion(unittest.TestCase):
    """debug/flight_recorder.Recorded marks its record completed on wait() and on an is_completed() that says True
    (and only then): the hang doctor reads posted-not-completed records as the op a rank is stuck in."""

    def test_wait_and_a_true_is_completed_mark_the_record(self):
        from unittest import mock

        from debug.flight_recorder import FlightRecorder, Recorded

        class Work:
            def __init__(self, finished: bool):
                self.finished = finished

            def wait(self) -> bool:
                return True

            def is_completed(self) -> bool:
                return self.finished

        rec = FlightRecorder()
        with mock.patch.object(rec, "done") as done:
            self.assertFalse(Recorded(Work(False), 7, rec).is_completed())
            done.assert_not_called()
            self.assertTrue(Recorded(Work(True), 7, rec).is_completed())
            done.assert_called_once_with(7)
            Recorded(Work(False), 8, rec).wait()
            done.assert_called_with(8)


@pytest.mark.slow  # a multi-rank launch: kept out of the fast loop
class DeferredInit(unittest.TestCase):
    def test_stage_allocates_only_its_own_parameters_with_eager_values(self):
        for world, n_layer, v in ((4, 4, 1), (2, 4, 2)):
            res = on_all_ranks(deferred_init, world, n_layer, v)
            for rank, r in enumerate(res):
                with self.subTest(pp=world, virtual=v, rank=rank):
                    self.assertEqual(sorted(r["names"]), sorted(expected_names(config(n_layer), rank, world, v)))
                    self.assertTrue(r["meta_left"])  # every other stage's parameter is still on meta
                    self.assertFalse(r["stage_meta"])
                    self.assertTrue(r["equal"])


if __name__ == "__main__":
    unittest.main()


def held_bytes(*containers: dict) -> int:
    """Bytes of the distinct storages of every tensor in the containers' values (tensors, or tuples of them):
    what a runner's bookkeeping keeps alive. A tensor and a view of it count once."""
    seen: dict[int, int] = {}
    for box in containers:
        for v in box.values():
            for t in v if isinstance(v, tuple) else (v,):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class HeldRecord(StepRecord):
    """The runner's record, plus after each action the most bytes its step holds (`_Step.held`: stored inputs
    and outputs, received buffers, tensors waiting for or in a send, the split backward's (input, output
    gradient) pairs and unit gradients held for W). Host time per action: only here, never in a run."""

    peak_held_bytes = 0

    @contextlib.contextmanager
    def action(self, a: Action, step):
        with super().action(a, step):
            yield
        self.peak_held_bytes = max(self.peak_held_bytes, held_bytes(*step.held()))


def held_cases(rank: int, world: int) -> list[dict]:
    """One step of each (schedule, M): every rank's peak held bytes and peak in-flight count, by rank, gathered
    on every rank (so the result reads the same under spawn and under a same-size torchrun)."""
    cfg = config(2)
    out = {}
    for name in ("1f1b", "gpipe"):
        for m in (4, 16):
            with torch.device("meta"):
                model = GPT(cfg)
            stage = PipelineStage(model, rank, world, parts=GPT_PARTS)
            stage.materialize(SEED)
            runner = PipelineRunner(stage, record=HeldRecord(torch.device("cpu")))
            runner.step(micro_batches(cfg, m), name)
            out[name, m] = {"held": runner.record.peak_held_bytes, "in_flight": runner.record.peak_in_flight}
    every = [None] * world
    torch.distributed.all_gather_object(every, out)
    return every


@pytest.mark.slow  # a multi-rank launch: kept out of the fast loop
class RunnerHoldsWhatTheScheduleBounds(unittest.TestCase):
    """Bytes of live tensor storages the runner keeps (stored inputs and outputs, received buffers, tensors in
    or waiting for a send) on every rank of P = 2, fp32 activations of A = mb·T·n_embd·4 bytes. Under 1F1B rank 0
    holds at most P - 0 = 2 micro-batches' outputs plus one received gradient: 3A, whatever M; the last rank one
    micro-batch's received input, the next one's posted receive and one input gradient in flight until its next
    B (`send_waits`): 3A. A sent tensor shares its output's (or gradient's) storage, so a runner that kept its
    sends until the step's end would grow with M: the last rank's gradients, when sends were freed by polling
    `is_completed()` (which gloo's isend answers False until waited), held 4A at M = 4 and 16A at M = 16. GPipe
    holds M outputs by design (+ one gradient)."""

    @classmethod
    def setUpClass(cls):
        cls.res = run_distributed(held_cases, 2)[0]

    def test_1f1b_stays_within_its_bound_at_any_m_on_every_rank(self):
        A = MB * T * config(2).n_embd * 4
        for rank, res in enumerate(self.res):
            for m in (4, 16):
                with self.subTest(rank=rank, m=m):
                    self.assertEqual(res["1f1b", m]["in_flight"], 2 - rank)
                    self.assertLessEqual(res["1f1b", m]["held"], 3 * A)
            with self.subTest(rank=rank):
                self.assertEqual(res["1f1b", 16]["held"], res["1f1b", 4]["held"])

    def test_gpipe_holds_every_micro_batch(self):
        """The measurement sees growth where there is some: GPipe's M outputs on rank 0."""
        A = MB * T * config(2).n_embd * 4
        for m in (4, 16):
            with self.subTest(m=m):
                self.assertEqual(self.res[0]["gpipe", m]["held"], (m + 1) * A)


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
        parallelized = parallelize(
            model, mesh, ParallelConfig(implementation="custom", deferred_init=True, seed=SEED), torch.device("cpu")
        )
    return {"calls": calls, "embed": parallelized.pipeline.embed_group is not None}


@pytest.mark.slow  # a multi-rank launch: kept out of the fast loop
def links_case(rank: int, world: int) -> dict:
    """Interleaved 1F1B (V = 2) and ZB-V on `world` gloo ranks with the pp group's link groups (built here, as
    Mesh.build_links builds them on NCCL) against the same runs on the group alone: the loss, the gradients and
    forward_only's losses, and each send's and receive's (peer, group) as the runner posts them in a step."""
    links = tuple(new_groups([list(range(world))]) for _ in range(link_groups(world)))
    real_send, real_recv = comm.send, comm.recv

    def post(kind, real, used):
        def call(t, peer, group=None):
            used.append((kind, peer, links.index(group) if group in links else None))
            return real(t, peer, group)

        return call

    out = {}
    for name, v_shape in (("interleaved_1f1b", False), ("zbv", True)):
        cfg, m = config(2 * world), world
        batches = micro_batches(cfg, m)
        runs = []
        for ring in ((), links):
            with torch.device("meta"):
                model = GPT(cfg)
            stage = PipelineStage(model, rank, world, 2, v_shape=v_shape, parts=GPT_PARTS)
            stage.materialize(SEED)
            runner = PipelineRunner(stage, links=ring, split_backward=split_backward)
            used = []
            with (
                mock.patch.object(comm, "send", post("SEND", real_send, used)),
                mock.patch.object(comm, "recv", post("RECV", real_recv, used)),
            ):
                loss = runner.step(batches, name)
            runs.append(
                (loss, {n: p.grad.clone() for n, p in stage.named_parameters()}, runner.forward_only(batches), used)
            )
        (l0, g0, e0, plain), (l1, g1, e1, linked) = runs
        out[name] = {
            "equal": torch.equal(l0, l1)
            and all(torch.equal(g0[n], g1[n]) for n in g0)
            and all(torch.equal(a, b) for a, b in zip(e0, e1)),
            "plain": plain,
            "links": linked,
        }
    return out


class LinkGroups(unittest.TestCase):
    """The runner with the pp group's link groups (parallel.groups.p2p_link: what NCCL runs, where each rank's one
    stream per group would otherwise serialise its two neighbours' messages) on 3 gloo ranks, an odd ring (3
    link groups; interleaved 1F1B's closing link 2 -> 0 on the third): the same loss, gradients and evaluation
    losses bit for bit as on the pp group alone, and every message on its chunk boundary's link group, the
    group simulate_schedule(p2p="nccl_eager", links=True) posts it on, each rank meeting one peer per group."""

    def test_three_ranks(self):
        per_rank = on_all_ranks(links_case, 3)
        for name, v_shape in (("interleaved_1f1b", False), ("zbv", True)):
            lists = ALL_SCHEDULES[name](3, 3, 2)
            for rank, res in enumerate(per_rank):
                with self.subTest(schedule=name, rank=rank):
                    got = res[name]
                    self.assertTrue(got["equal"])
                    self.assertEqual({g for _, _, g in got["plain"]}, {None})
                    want = []
                    for a in lists[rank]:
                        if a.kind in (SEND_F, SEND_B, RECV_F, RECV_B):
                            c = boundary(a)
                            lo, hi = rank_of(c, 3, v_shape), rank_of(c + 1, 3, v_shape)
                            want.append((a.kind[:4], hi if lo == rank else lo, p2p_link(lo, hi, 3)))
                    self.assertEqual(got["links"], want)
                    peers = {}
                    for _, peer, g in want:
                        peers.setdefault(g, set()).add(peer)
                    self.assertTrue(all(len(s) == 1 for s in peers.values()), peers)


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


class ActivationDtypeIsWhatTheChunksProduce(unittest.TestCase):
    """parallelize.activation_dtype(cfg, engine), the dtype every pipeline rank allocates its received activations
    in (and PipelineRunner._check holds each sent one to), against what the chunks really produce: on one process,
    a 3-chunk stage wrapped by the same apply steps parallelize uses (our DDP, or our sharding engine at each
    ZeRO stage, with param_dtype None or bf16 compute copies), its runner's chunk forward run with and without
    bf16 autocast; chunk 0's output (from token ids) and chunk 1's (from chunk 0's, as a middle chunk receives
    it) must both be in the runner's act_dtype. Without it only the slow sweep's bf16 pipeline rows show a
    mismatch, as a crash on the first send."""

    def test_every_engine_and_param_dtype(self):
        from parallel.mesh import Mesh, ParallelDims
        from parallel.parallelize import APPLY, ENGINE, ParallelConfig, Parallelized

        cpu, cfg_m = torch.device("cpu"), config(3)
        x = micro_batches(cfg_m, 1)[0][0]
        seen = set()
        for dp_type in (None, "ddp", "zero1", "zero2", "fsdp"):
            for param_dtype in (None, torch.bfloat16):
                model = GPT(cfg_m)
                model.init_weights(SEED)
                cfg = ParallelConfig(dp_type=dp_type, implementation="custom", param_dtype=param_dtype, pp_virtual=3)
                mesh = Mesh(ParallelDims(dp=1, tp=1, world_size=1))
                parallelized = Parallelized(model=model, mesh=mesh, cfg=cfg, device=cpu)
                parallelized.model = parallelized.stage = PipelineStage(model, 0, 1, 3, parts=GPT_PARTS)
                parallelized.engine = ENGINE.get(dp_type)
                if parallelized.engine is not None:
                    parallelized.model = APPLY["custom", parallelized.engine](parallelized.model, mesh, cfg, cpu)
                sharded = parallelized.engine == "fsdp"  # the protocol names the engine the runner runs chunks on
                at = Placement()
                parallelized.dp = Sharded(parallelized.model, at) if sharded else Replicated(parallelized.model, at, {})
                runner = PipelineRunner(parallelized.stage, **parallelized.runner_args(cfg))
                for autocast in (False, True):
                    with (
                        self.subTest(dp_type=dp_type, param_dtype=param_dtype, autocast=autocast),
                        torch.autocast(cpu.type, dtype=torch.bfloat16, enabled=autocast),
                    ):
                        first = runner.forward(0, x)
                        middle = runner.forward(1, first)
                        self.assertEqual((first.dtype, middle.dtype), (runner.act_dtype,) * 2)
                        seen.add(first.dtype)
        self.assertEqual(seen, {torch.float32, torch.bfloat16})  # both answers occur: the table has teeth


class TimerIsChosenWithTheDevice(unittest.TestCase):
    """pp_idle_fraction and the timeline time the work: device events where the device queues it (CUDA: a
    wait() returns at once there), the host clock on the CPU (device.make_timer, the one place)."""

    def test_choice(self):
        from runtime.device import DeviceTimer, HostTimer, make_timer

        self.assertIsInstance(make_timer(torch.device("cpu")), HostTimer)
        self.assertIsInstance(make_timer(torch.device("cuda", 0)), DeviceTimer)  # built without touching CUDA

    def test_device_marks_become_host_seconds_from_the_first(self):
        from runtime.device import DeviceTimer

        class Event:  # torch.cuda.Event's elapsed_time is in milliseconds
            def __init__(self, ms):
                self.ms = ms

            def elapsed_time(self, other):
                return other.ms - self.ms

            def synchronize(self):
                pass

        marks = [(100.0, Event(5.0)), (100.9, Event(7.5)), (101.0, Event(1005.0))]
        self.assertEqual(DeviceTimer(torch.device("cuda", 0)).seconds(marks), [100.0, 100.0025, 101.0])
