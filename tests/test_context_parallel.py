"""Ring attention (parallel/context_parallel/ring.py) on 1, 2 and 4 gloo ranks against full causal attention on the
gathered sequence: output and the gradients of q, k and v, with and without the zigzag split, including
sequences whose chunks are single tokens; the p2p bytes per call against the docstring's count; the order the
ring posts its transfers in (NCCL-safe, and before the compute they overlap); which chunk pairs the kernel calls
cover; and, on meta tensors, the CUDA kernels' calls.

Tolerances are derived, not picked. fp32: the reference is SDPA on the same inputs in float64, and the
yardstick is how far one-process fp32 SDPA (the same fused CPU kernel, on the whole sequence) is from it. The
ring runs that kernel per block and merges blocks by their log-sum-exp, so it sums in another order, and two
fp32 results of the same math in different orders are each about one yardstick from the exact one: the ring
may be ROUNDING_FACTOR (4, tests/rounding.py: a 2x margin) yardsticks from float64, at least EPS32, each
relative to the reference tensor's largest value. bf16: see test_bf16_autocast_computes_in_fp32."""

import functools
import re
import unittest
from contextlib import contextmanager
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parallel.context_parallel.ring as cp
from parallel import comm
from parallel.context_parallel.ring import exchange_order, local_positions, ring_attention, shard_sequence
from parallel.groups import link_groups, new_groups, p2p_link
from tests.harness import run_distributed
from tests.rounding import EPS32, ROUNDING_FACTOR

B, H, D = 2, 3, 8
KEYS = ("out", "dq", "dk", "dv")


def attention_and_grads(q, k, v, dout) -> list[torch.Tensor]:
    """One-process causal SDPA of (q, k, v) and its gradients for output gradient dout: [out, dq, dk, dv]."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    out.backward(dout)
    return [out.detach(), *(t.grad for t in leaves)]


@contextmanager
def recorded():
    """Everything the ring does that orders its overlap, in order, on this rank: each comm.send / comm.recv as
    (kind, peer, shape, dtype), each kernel call as ("fwd",) or ("bwd",)."""
    events = []

    def post(kind, real):
        def call(t, peer, group=None):
            events.append((kind, peer, tuple(t.shape), str(t.dtype)))
            return real(t, peer, group)

        return call

    def kernel(kind, real):
        def call(*args):
            events.append((kind,))
            return real(*args)

        return call

    with (
        mock.patch.object(comm, "send", post("send", comm.send)),
        mock.patch.object(comm, "recv", post("recv", comm.recv)),
        mock.patch.object(cp, "kernel_forward", kernel("fwd", cp.kernel_forward)),
        mock.patch.object(cp, "kernel_backward", kernel("bwd", cp.kernel_backward)),
    ):
        yield events


def case(rank: int, world: int, T: int, zigzag: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    exact = attention_and_grads(q.double(), k.double(), v.double(), dout.double())
    one = attention_and_grads(q, k, v, dout)
    mine = [shard_sequence(t, rank, world, zigzag, dim=2).clone().requires_grad_() for t in (q, k, v)]
    comm.COUNTER.reset()
    with recorded() as events:
        out = ring_attention(*mine, None, zigzag)
        out.backward(shard_sequence(dout, rank, world, zigzag, dim=2))
    sent = comm.COUNTER.snapshot().get("p2p", 0)
    pos = local_positions(T, rank, world, zigzag)
    # max error relative to the largest value of the whole reference tensor (a rank's own slice can be all 0:
    # position 0 attends only to itself, so its dq is 0 up to rounding)
    rel = lambda a, full, at: ((a.double() - full[:, :, at]).abs().max() / full.abs().max()).item()  # noqa: E731
    got = [out, *(t.grad for t in mine)]
    return {
        "err": {key: rel(a, full, pos) for key, a, full in zip(KEYS, got, exact)},
        "yardstick": {key: rel(a, full, slice(None)) for key, a, full in zip(KEYS, one, exact)},
        "p2p": sent,
        "block_bytes": B * H * (T // world) * D * 4,
        "events": everyone(events, world),
    }


def everyone(x, world: int) -> list:
    """Every rank's x on every rank (a matching torchrun gives each rank only its own result)."""
    if world == 1:
        return [x]
    out = [None] * world
    dist.all_gather_object(out, x)
    return out


def run_cases(rank: int, world: int) -> list:
    out = []
    for zigzag in (True, False):
        for T in (2 * world, 8 * world) if zigzag else (max(world, 2), 8 * world):  # the first: 1-token chunks
            out.append(((T, zigzag), case(rank, world, T, zigzag)))
    return out


@functools.cache
def ring_results(world: int) -> list:
    """run_cases on `world` ranks, once per test session: [rank] -> [((T, zigzag), result)]."""
    return run_distributed(run_cases, world) if world > 1 else [run_cases(0, 1)]


def drain_timed(queues: list[list[tuple]], group=lambda rank, op: 0) -> int | None:
    """NCCL's p2p on eagerly initialised groups (the cp group is one: runtime/device.py passes device_id; the
    pipeline's model is plan/timeline.py's "nccl_eager"): each rank's ops on a group (`group(rank, op)`; one
    group by default) run one after another in posting order, whichever neighbour they name; the head send of
    rank a to b runs with the head receive of b from a on the same group, and both must describe the same
    message (gloo too meets the k-th send from a to b with b's k-th receive from a). A transfer takes one unit,
    from when both heads are free. Returns when the last transfer ends, all ops posted at time 0 (the comm time,
    no compute); None when no head can move: a hang."""
    streams: dict[tuple[int, int], list] = {}
    for r, q in enumerate(queues):
        for op in q:
            streams.setdefault((r, group(r, op)), []).append(op)
    free = dict.fromkeys(streams, 0)
    end = 0
    while any(streams.values()):
        for (a, g), s in streams.items():
            b = s[0][1] if s and s[0][0] == "send" else None
            if b is not None and streams.get((b, g)) and streams[(b, g)][0][:2] == ("recv", a):
                theirs = streams[(b, g)][0]
                assert theirs[2:] == s[0][2:], f"rank {a}'s send {s[0]} meets rank {b}'s {theirs}"
                free[(a, g)] = free[(b, g)] = end_ab = max(free[(a, g)], free[(b, g)]) + 1
                end = max(end, end_ab)
                streams[(b, g)].pop(0)
                s.pop(0)
                break
        else:
            return None
    return end


def drain(queues: list[list[tuple]]) -> bool:
    """`drain_timed` on one group per rank: False on a hang."""
    return drain_timed(queues) is not None


def ring_ops(rank: int, C: int, order, exchanges: int) -> list:
    """What a rank posts over `exchanges` ring exchanges, in `order`: per exchange two sends to r+1 and two
    receives from r-1 (k and v, or dK and dV)."""
    half = {
        "send": [("send", (rank + 1) % C, i) for i in range(2)],
        "recv": [("recv", (rank - 1) % C, i) for i in range(2)],
    }
    return [op for _ in range(exchanges) for kind in order(rank, C) for op in half[kind]]


def link_of(C: int):
    """The link group each op goes on under `_exchange`'s links: sends on link r's, receives on link r-1's."""
    return lambda r, op: p2p_link(r, op[1], C) if op[0] == "send" else p2p_link(op[1], r, C)


def links_case(rank: int, world: int) -> dict:
    """The ring with the cp group's link groups (built here on gloo, as Mesh.build_links builds them on NCCL),
    against the ring on the group alone: output and gradients, and each transfer's group."""
    links = tuple(new_groups([list(range(world))]) for _ in range(link_groups(world)))
    g = torch.Generator().manual_seed(2)
    T = 4 * world
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    got, used = [], []
    real_send, real_recv = comm.send, comm.recv

    def post(kind, real):
        def call(tensor, peer, group=None):
            used.append((kind, peer, links.index(group) if group in links else None))
            return real(tensor, peer, group)

        return call

    for ring in ((), links):
        mine = [shard_sequence(t, rank, world, dim=2).clone().requires_grad_() for t in (q, k, v)]
        with (
            mock.patch.object(comm, "send", post("send", real_send)),
            mock.patch.object(comm, "recv", post("recv", real_recv)),
        ):
            out = ring_attention(*mine, None, links=ring)
            out.backward(shard_sequence(dout, rank, world, dim=2))
        got.append([out.detach(), *(t.grad for t in mine)])
    half = len(used) // 2
    return {"equal": all(torch.equal(a, b) for a, b in zip(*got)), "plain": used[:half], "links": used[half:]}


def bf16_case(rank: int, world: int) -> dict:
    """Ring attention under CPU bf16 autocast (bf16 q, k, v, as the linears give them) against fp32 SDPA on
    the same bf16-rounded inputs and output gradient: max error relative to the reference's largest value."""
    g = torch.Generator().manual_seed(1)
    T = 16 * world
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(4))
    ref = attention_and_grads(q.float(), k.float(), v.float(), dout.float())
    mine = [shard_sequence(t, rank, world, dim=2).clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ring_attention(*mine, None)
    out.backward(shard_sequence(dout, rank, world, dim=2))
    pos = local_positions(T, rank, world)
    err = lambda a, full: ((a.float() - full[:, :, pos]).abs().max() / full.abs().max()).item()  # noqa: E731
    got = [out, *(t.grad for t in mine)]
    return {"dtype": out.dtype, **{key: err(a, full) for key, a, full in zip(KEYS, got, ref)}}


class TestRingAttention(unittest.TestCase):
    def test_equals_full_causal_attention(self):
        for world in (1, 2, 4):
            for rank, cases in enumerate(ring_results(world)):
                for (T, zigzag), r in cases:
                    with self.subTest(world=world, rank=rank, T=T, zigzag=zigzag):
                        for key in KEYS:
                            tol = ROUNDING_FACTOR * max(r["yardstick"][key], EPS32)
                            self.assertLessEqual(r["err"][key], tol, f"{key}: {r['err'][key]:.2e} > {tol:.2e}")
                        # forward: C-1 k/v pairs; backward: C-1 (k, v) and C-1 (dK, dV) moves, and 1 (dK, dV) home
                        C = world
                        blocks = 2 * (C - 1) + 4 * (C - 1) + 2 if C > 1 else 0
                        self.assertEqual(r["p2p"], blocks * r["block_bytes"])

    def test_bf16_autocast_computes_in_fp32(self):
        """Under bf16 autocast the ring still computes in fp32 on CPU (the kernels get fp32 copies of the bf16
        q, k, v), so given the same bf16 inputs it differs from fp32 attention by fp32 summation order (about
        1e-7) and one rounding of its output and of each gradient to bf16: at most half a bf16 ulp, 2^-8
        relative (bf16 keeps 8 significant bits), so at most 2^-8 of the largest value. (Scores left to
        autocast gave dq off by 4.9e-3 to 8.7e-3 here.)"""
        for world in (1, 2):
            results = run_distributed(bf16_case, world) if world > 1 else [bf16_case(0, 1)]
            for rank, r in enumerate(results):
                with self.subTest(world=world, rank=rank):
                    self.assertEqual(r["dtype"], torch.bfloat16)
                    for key in KEYS:
                        self.assertLess(r[key], 2**-8, key)

    def test_exchange_order_never_waits_forever_with_blocking_p2p(self):
        """NCCL runs each rank's p2p operations on a group in posting order, across both its neighbours, a send
        waiting for its receive (`drain`). A ring exchange is two sends to r+1 and two receives from r-1; a
        forward posts C-1 of them, a backward 2C-1 (k/v and dK/dV interleaved: k/v before a step's compute,
        dK/dV after it). parallel/context_parallel/ring.py's order always finishes, C = 1..8; "receive first" on
        every rank, the naive order, hangs at every C > 1 (so this test can fail)."""
        naive = lambda r, c: ("recv", "send")  # noqa: E731
        for C in range(1, 9):
            for exchanges in (C - 1, 2 * C - 1, 3 * C - 2) if C > 1 else (0,):  # forward, backward, both
                with self.subTest(C=C, exchanges=exchanges):
                    self.assertTrue(drain([ring_ops(r, C, exchange_order, exchanges) for r in range(C)]))
                    self.assertEqual(drain([ring_ops(r, C, naive, exchanges) for r in range(C)]), C == 1)

    def test_one_group_runs_half_duplex_link_groups_full(self):
        """On one eagerly initialised group a rank's two sends and two receives of an exchange run one after the
        other: an even ring takes 4 transfer times per exchange where sending and receiving at once would take
        2, an odd ring more (its alternation has two even ranks side by side: ranks C-1 and 0 both send first,
        so C-1 waits for 0's sends). On the link groups (`_exchange`'s links: sends on link r's group, receives
        on link r-1's, never the same) every ring takes the 2 of full duplex, in any exchange order, and every
        message still meets its receive. C = 2..8, a forward's C-1 exchanges, a backward's 2C-1, or one."""
        naive = lambda r, c: ("recv", "send")  # noqa: E731
        for C in range(2, 9):
            for exchanges in (1, C - 1, 2 * C - 1):
                with self.subTest(C=C, exchanges=exchanges):
                    one = drain_timed([ring_ops(r, C, exchange_order, exchanges) for r in range(C)])
                    if C % 2 == 0:
                        self.assertEqual(one, 4 * exchanges)
                    else:
                        self.assertGreater(one, 4 * exchanges)
                    for order in (exchange_order, naive):
                        self.assertEqual(
                            drain_timed([ring_ops(r, C, order, exchanges) for r in range(C)], link_of(C)), 2 * exchanges
                        )

    def test_link_groups_carry_the_ring_on_three_ranks(self):
        """3 gloo ranks (an odd ring: 3 link groups): the ring over the cp group's link groups gives the ring's
        output and gradients bit for bit, and every send goes on link r's group, every receive on link
        r-1's, as `link_of` (and so the half-duplex check above) has them; without links, on the group."""
        per_rank = run_distributed(links_case, 3)
        if len(per_rank) == 1:  # a same-size torchrun: each rank checks its own
            return
        for r, res in enumerate(per_rank):
            with self.subTest(rank=r):
                self.assertTrue(res["equal"])
                self.assertEqual({g for _, _, g in res["plain"]}, {None})
                want = [(kind, peer, link_of(3)(r, (kind, peer))) for kind, peer, _ in res["links"]]
                self.assertEqual(res["links"], want)
                self.assertEqual(len({g for kind, _, g in res["links"] if kind == "send"}), 1)
                self.assertNotEqual(
                    {g for kind, _, g in res["links"] if kind == "send"},
                    {g for kind, _, g in res["links"] if kind == "recv"},
                )

    def test_posted_transfers_drain_and_overlap_the_compute(self):
        """What the 2- and 4-rank runs above posted, as recorded on every rank: fed to `drain` (NCCL's blocking
        p2p), every rank's sends and receives over one forward + backward finish, each message meeting a
        receive of its shape and dtype. And the overlap: with E one exchange (2 sends, 2 receives), F a forward
        and K a backward kernel call, every rank posts, with zigzag (one call per block), the forward as
        (E F) x (C-1), F (the next block's transfer is posted before this block's compute) and the backward as
        E K E, (E K E) x (C-2), K E (the next k/v posted before the compute, this block's dK/dV after it)."""
        for world in (2, 4):
            for (T, zigzag), r in ring_results(world)[0]:
                with self.subTest(world=world, T=T, zigzag=zigzag):
                    events = r["events"]
                    self.assertTrue(drain([[e for e in ev if e[0] in ("send", "recv")] for ev in events]))
                    if not zigzag:
                        continue
                    C = world
                    for rank, ev in enumerate(events):
                        shape = "".join("E" if e[0] in ("send", "recv") else "F" if e[0] == "fwd" else "K" for e in ev)
                        self.assertEqual(
                            re.sub("E{4}", "E", shape), "EF" * (C - 1) + "F" + "EKE" * (C - 1) + "KE", f"rank {rank}"
                        )

    def test_layout_attends_every_causal_pair_once(self):
        """`_ring_layout`'s kernel calls, over all (query rank, key rank) blocks, cover each (query, key) pair that
        causal attention allows exactly once and no other (a causal call covers its square's lower triangle),
        for C = 1..4 with and without zigzag. With zigzag each block is at most one call, and every rank attends
        the same number of pairs."""
        for C in range(1, 5):
            for zigzag in (True, False):
                T = 3 * (2 * C if zigzag else C)  # 3-token chunks
                pos = [local_positions(T, i, C, zigzag) for i in range(C)]
                layout = cp._ring_layout(T, C, zigzag)
                work = []
                for i in range(C):
                    pairs = 0
                    for j in range(C):
                        with self.subTest(C=C, zigzag=zigzag, i=i, j=j):
                            seen = torch.zeros(len(pos[i]), len(pos[j]), dtype=torch.int64)
                            for c in layout[i][j]:
                                block = torch.ones_like(seen[c.q, c.k])
                                seen[c.q, c.k] += block.tril() if c.causal else block
                            want = (pos[j][None, :] <= pos[i][:, None]).long()
                            self.assertTrue(torch.equal(seen, want), f"{seen}\n!=\n{want}")
                            if zigzag:
                                self.assertLessEqual(len(layout[i][j]), 1)
                            pairs += int(want.sum())
                    work.append(pairs)
                if zigzag:
                    self.assertEqual(len(set(work)), 1, work)

    def test_cuda_kernel_calls_match_their_ops(self):
        """The CUDA path as far as a CPU build can check it (the kernels themselves need a GPU): on meta tensors
        (torch's meta kernels give shapes and dtypes only), every call a C = 2 zigzag ring makes, forward and
        backward, with the flash kernel (bf16) and the memory-efficient one (fp32; its lse rows come padded to
        a multiple of 32, so Tq = 24 checks the unpadding), takes the arguments its op's schema asks for and
        gives what the merge and the gradient sums expect: out like q, fp32 lse (B, H, Tq), gradients like
        their inputs."""
        T, C = 48, 2
        for kernel, dtype in (("flash", torch.bfloat16), ("efficient", torch.float32)):
            for r in range(C):
                for src in range(C):
                    for c in cp._ring_layout(T, C, True)[r][src]:
                        with self.subTest(kernel=kernel, r=r, src=src, call=c):
                            q, k, v, g = (
                                torch.empty(B, T // C, H, D, dtype=dtype, device="meta").transpose(1, 2)
                                for _ in range(4)
                            )
                            q, g, k, v = q[:, :, c.q], g[:, :, c.q], k[:, :, c.k], v[:, :, c.k]
                            out, lse, state = cp.kernel_forward(kernel, q, k, v, c.causal)
                            self.assertEqual((out.shape, out.dtype), (q.shape, dtype))
                            self.assertEqual((lse.shape, lse.dtype), (q.shape[:3], torch.float32))
                            grads = cp.kernel_backward(kernel, g, q, k, v, out, lse, c.causal, state)
                            self.assertEqual([(t.shape, t.dtype) for t in grads], [(t.shape, dtype) for t in (q, k, v)])

    def test_positions(self):
        self.assertEqual(local_positions(8, 0, 2).tolist(), [0, 1, 6, 7])
        self.assertEqual(local_positions(8, 1, 2).tolist(), [2, 3, 4, 5])
        self.assertEqual(local_positions(8, 1, 2, zigzag=False).tolist(), [4, 5, 6, 7])
        with self.assertRaises(ValueError):
            local_positions(6, 0, 2)


if __name__ == "__main__":
    unittest.main()
