"""Ring attention (parallel/context_parallel.py) on 2 and 4 gloo ranks against full causal attention on the
gathered sequence: output and the gradients of q, k and v within 1e-5 of the reference tensor's largest value
(fp32; the ring merges softmax blocks in another order than one softmax), with and without the zigzag split, including sequences whose chunks
are single tokens. Also the p2p bytes per call against the docstring's count."""
import unittest

import torch
import torch.nn.functional as F

from parallel import comm
from parallel.context_parallel import exchange_order, local_positions, ring_attention, shard_sequence
from tests.harness import run_distributed

B, H, D = 2, 3, 8


def case(rank: int, world: int, T: int, zigzag: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, is_causal=True)
    ref.backward(dout)
    mine = [shard_sequence(t, rank, world, zigzag, dim=2).clone().requires_grad_() for t in (q, k, v)]
    comm.COUNTER.reset()
    out = ring_attention(*mine, None, zigzag)
    out.backward(shard_sequence(dout, rank, world, zigzag, dim=2))
    sent = comm.COUNTER.snapshot().get("p2p", 0)
    pos = local_positions(T, rank, world, zigzag)
    # max error relative to the largest value of the whole reference tensor (a rank's own slice can be all 0:
    # position 0 attends only to itself, so its dq is 0 up to rounding)
    err = lambda a, full: ((a - full[:, :, pos]).abs().max() / full.abs().max()).item()  # noqa: E731
    return {"out": err(out, ref), "dq": err(mine[0].grad, ref_q.grad), "dk": err(mine[1].grad, ref_k.grad),
            "dv": err(mine[2].grad, ref_v.grad),
            "p2p": sent, "block_bytes": B * H * (T // world) * D * 4}


def run_cases(rank: int, world: int) -> list:
    out = []
    for zigzag in (True, False):
        for T in ((2 * world, 8 * world) if zigzag else (max(world, 2), 8 * world)):  # the first: 1-token chunks
            out.append(((T, zigzag), case(rank, world, T, zigzag)))
    return out


def bf16_case(rank: int, world: int) -> dict:
    """Ring attention under CPU bf16 autocast (bf16 q, k, v, as the linears give them) against fp32 SDPA on
    the same bf16-rounded inputs and output gradient: max error relative to the reference's largest value."""
    g = torch.Generator().manual_seed(1)
    T = 16 * world
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(4))
    ref_in = [t.float().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
    ref.backward(dout.float())
    mine = [shard_sequence(t, rank, world, dim=2).clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ring_attention(*mine, None)
    out.backward(shard_sequence(dout, rank, world, dim=2))
    pos = local_positions(T, rank, world)
    err = lambda a, full: ((a.float() - full[:, :, pos]).abs().max() / full.abs().max()).item()  # noqa: E731
    return {"dtype": out.dtype, "out": err(out, ref), "dq": err(mine[0].grad, ref_in[0].grad),
            "dk": err(mine[1].grad, ref_in[1].grad), "dv": err(mine[2].grad, ref_in[2].grad)}


class TestRingAttention(unittest.TestCase):
    def test_bf16_autocast_computes_in_fp32(self):
        """Under bf16 autocast the ring still computes in fp32 (its backward, which autocast never reaches,
        recomputes the softmax from the forward's log-sum-exp, so both must agree). Given the same bf16 inputs,
        it then differs from fp32 attention only by fp32 summation order and one rounding of its bf16 output
        and gradients: half a bf16 ulp, 2^-9 relative, bounded here by 2^-8 of the largest value. (Scores left
        to autocast gave dq off by 4.9e-3 to 8.7e-3 here.)"""
        for world in (1, 2):
            results = run_distributed(bf16_case, world) if world > 1 else [bf16_case(0, 1)]
            for rank, r in enumerate(results):
                with self.subTest(world=world, rank=rank):
                    self.assertEqual(r["dtype"], torch.bfloat16)
                    for key in ("out", "dq", "dk", "dv"):
                        self.assertLess(r[key], 2 ** -8, key)

    def test_equals_full_causal_attention(self):
        for world in (1, 2, 4):
            results = run_distributed(run_cases, world) if world > 1 else [run_cases(0, 1)]
            for rank, cases in enumerate(results):
                for (T, zigzag), r in cases:
                    with self.subTest(world=world, rank=rank, T=T, zigzag=zigzag):
                        for key in ("out", "dq", "dk", "dv"):
                            self.assertLess(r[key], 1e-5, f"{key}: {r[key]}")
                        # forward: C-1 k/v pairs; backward: C-1 (k, v, dK, dV) moves and 1 (dK, dV) return
                        C = world
                        blocks = 2 * (C - 1) + 4 * (C - 1) + 2 if C > 1 else 0
                        self.assertEqual(r["p2p"], blocks * r["block_bytes"])

    def test_exchange_order_never_waits_forever_with_blocking_p2p(self):
        """NCCL runs each rank's p2p operations in posting order, a send waiting for its receive: simulate that
        (one queue per rank; the heads of two queues meet when one sends to the other, which receives from
        it) for a ring step of k and v, C = 1..8. The order parallel/context_parallel.py posts always finishes;
        "receive first" on every rank, the naive order, hangs at every C > 1 (so this test can fail)."""
        def ops(rank: int, C: int, order) -> list:
            half = {"send": [("send", (rank + 1) % C)] * 2, "recv": [("recv", (rank - 1) % C)] * 2}
            return [op for kind in order(rank, C) for op in half[kind]]

        def finishes(C: int, order) -> bool:
            queues = [ops(r, C, order) for r in range(C)] if C > 1 else [[]]
            while any(queues):
                for r, q in enumerate(queues):
                    if q and q[0][0] == "send" and queues[q[0][1]][:1] == [("recv", r)]:
                        queues[q[0][1]].pop(0)
                        q.pop(0)
                        break
                else:
                    return False
            return True

        for C in range(1, 9):
            with self.subTest(C=C):
                self.assertTrue(finishes(C, exchange_order))
                self.assertEqual(finishes(C, lambda r, c: ("recv", "send")), C == 1)

    def test_positions(self):
        self.assertEqual(local_positions(8, 0, 2).tolist(), [0, 1, 6, 7])
        self.assertEqual(local_positions(8, 1, 2).tolist(), [2, 3, 4, 5])
        self.assertEqual(local_positions(8, 1, 2, zigzag=False).tolist(), [4, 5, 6, 7])
        with self.assertRaises(ValueError):
            local_positions(6, 0, 2)


if __name__ == "__main__":
    unittest.main()
