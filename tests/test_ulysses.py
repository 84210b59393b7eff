"""Ulysses attention (parallel/context_parallel/ulysses.py) on 2 and 4 gloo ranks against one process: the attention
output and the q, k, v gradients bit for bit; a whole tiny GPT's loss, gradients and logits; the bytes and order
of every all-to-all against the docstring's count; the head check; the swap.

What is bit-equal and why. Ulysses only moves elements: each head's attention is the model's own core (SDPA) on
the same (T, D) inputs as one process's, with heads the kernel's batch dimension, and nothing is summed across
ranks. So out, dq, dk and dv equal one process's bits (fp32, and bf16 with bf16 inputs), with and without zigzag.

The whole GPT is within a derived tolerance instead: its loss and parameter gradients are sums over the tokens,
taken per rank and then over ranks (the loss mean, each weight's gradient), so in another order than one
process's. As tests/test_context_parallel.py does, the reference is the same model in float64, and the yardstick
is how far one process (fp32, or under bf16 autocast) is from it; Ulysses may be ROUNDING_FACTOR (4,
tests/rounding.py: a 2x margin) yardsticks from float64, at least EPS32. A gradient's error is relative to the
largest gradient value of its module (a Linear's weight and bias, a LayerNorm's, an embedding): the key
projection's bias has an exact gradient of 0 (it adds q·b to every score of a query's row, which the softmax
cancels), so its own largest value is rounding noise. (Measured: the logits equal one process's bits at
every token; the loss is within 7.7e-8 of float64 in fp32; the worst gradient is 1.41 yardsticks.)
"""

import contextlib
import functools
import unittest
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from model.gpt import GPT, AttentionCore, make_config
from parallel import comm
from parallel.context_parallel import ulysses
from parallel.context_parallel.ring import ZigzagPositions, local_positions, shard_sequence, zigzag_share
from parallel.context_parallel.theory import (
    ulysses_all_to_all_bytes_per_micro_step,
    ulysses_all_to_all_calls_per_micro_step,
)
from parallel.context_parallel.ulysses import (
    UlyssesAttentionCore,
    apply_ulysses,
    check_ulysses,
    seq_to_heads,
    ulysses_attention,
)
from tests.harness import run_distributed
from tests.rounding import EPS32, ROUNDING_FACTOR

B, H, D = 2, 8, 16  # attention: 4 heads a rank at C = 2, 2 at C = 4
KEYS = ("out", "dq", "dk", "dv")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MB, T, V, N_LAYER, SEED = 2, 32, 512, 2, 0  # the GPT: `tiny` (n_embd 64), 2 Blocks, a 512-token vocab, and
CONFIG = make_config("tiny", n_layer=N_LAYER, n_head=8, vocab_size=V)  # 8 heads: 2 a rank at C = 4 (1 hides an order)
WORLDS = (2, 4)


@contextlib.contextmanager
def recorded_all_to_alls():
    """Every comm.all_to_all_single this rank issues, in order: (unit, bytes of its input, dtype)."""
    calls, real = [], comm.all_to_all_single

    def record(output, input, *args, **kwargs):
        calls.append((kwargs.get("unit"), input.numel() * input.element_size(), str(input.dtype)))
        return real(output, input, *args, **kwargs)

    with mock.patch.object(comm, "all_to_all_single", record):
        yield calls


def attention_case(rank: int, world: int, T: int, zigzag: bool, dtype: torch.dtype) -> dict:
    """Ulysses over this rank's share of random q, k, v (B, H, T, D) against one-process SDPA on the whole of
    them, in `dtype`: whether each of out, dq, dk, dv equals it at this rank's positions, bit for bit."""
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*whole, is_causal=True)
    out.backward(dout)
    ref = [out.detach(), *(t.grad for t in whole)]
    mine = [shard_sequence(t, rank, world, zigzag, dim=2).clone().requires_grad_() for t in (q, k, v)]
    with recorded_all_to_alls() as calls:
        got = ulysses_attention(*mine, None, AttentionCore(), zigzag)
        got.backward(shard_sequence(dout, rank, world, zigzag, dim=2))
    pos = local_positions(T, rank, world, zigzag)
    equal = {key: torch.equal(a, full[:, :, pos]) for key, a, full in zip(KEYS, [got, *(t.grad for t in mine)], ref)}
    return {"equal": equal, "calls": calls, "block_bytes": B * H * (T // world) * D * q.element_size()}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, V, (MB, T + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def autocast(dtype: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


def gpt_step(model: GPT, x: torch.Tensor, y: torch.Tensor, dtype: str) -> tuple[torch.Tensor, dict]:
    """One forward + backward of `model` on (x, y): the loss and every parameter's gradient."""
    with autocast(dtype):
        loss = model(x, y)[1]
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def gpt_case(rank: int, world: int, dtype: str) -> dict:
    """The tiny GPT with Ulysses over all ranks, on this rank's zigzag share of the batch: the loss averaged and
    the gradients summed / C over the ranks (what DDP over dp x cp does), the all-to-alls of the step (recorded,
    and as COUNTER counts them), and this rank's logits from a forward without targets."""
    model = GPT(CONFIG)
    model.init_weights(SEED)
    apply_ulysses(model, None)
    x, y = zigzag_share(*batch(), rank, world)
    comm.COUNTER.reset()
    with recorded_all_to_alls() as calls:
        loss, grads = gpt_step(model, x, y, dtype)
    counted = (comm.COUNTER.snapshot()["all_to_all"], comm.COUNTER.snapshot_calls()["all_to_all"])
    for t in (loss, *grads.values()):
        dist.all_reduce(t)
        t.div_(world)
    with torch.no_grad(), autocast(dtype):
        logits = model(x)[0]
    return {"rank": rank, "loss": loss, "grads": grads, "logits": logits, "calls": calls, "counted": counted}


def run_cases(rank: int, world: int) -> dict:
    attention = []
    for name, dtype in DTYPES.items():
        for zigzag in (True, False):
            for T in (2 * world, 8 * world, 40 * world):  # the first: 1-token chunks under zigzag
                attention.append(((name, zigzag, T), attention_case(rank, world, T, zigzag, dtype)))
    try:  # 5 heads over C ranks: refused before any collective, so the ranks stay in step
        seq_to_heads(torch.zeros(1, 5, 8, 2), None)
        refused = None
    except ValueError as e:
        refused = str(e)
    return {"attention": attention, "gpt": {d: gpt_case(rank, world, d) for d in DTYPES}, "refused": refused}


@functools.cache
def results(world: int) -> list[dict]:
    """run_cases on `world` ranks, once per test session (every rank's, or this rank's under a matching torchrun)."""
    return run_distributed(run_cases, world)


@functools.cache
def one_process(dtype: str, float64: bool = False) -> dict:
    """The same GPT in one process on the whole batch: loss, gradients, logits (float64: no autocast)."""
    model = GPT(CONFIG)
    model.init_weights(SEED)
    if float64:
        model.double()
    x, y = batch()
    loss, grads = gpt_step(model, x, y, "fp32" if float64 else dtype)
    with torch.no_grad(), autocast("fp32" if float64 else dtype):
        logits = model(x)[0]
    return {"loss": loss, "grads": grads, "logits": logits}


def module_scales(grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each gradient's yardstick scale: the largest value over its module's gradients (see the module docstring)."""
    by_module: dict[str, float] = {}
    for name, g in grads.items():
        module = name.rpartition(".")[0]
        by_module[module] = max(by_module.get(module, 0.0), g.abs().max().item())
    return {name: by_module[name.rpartition(".")[0]] for name in grads}


class TestUlyssesAttention(unittest.TestCase):
    def test_equals_one_process_bit_for_bit(self):
        """out, dq, dk, dv at C = 2 and 4, fp32 and bf16, zigzag and contiguous shares, T = 2C (one token a
        zigzag chunk), 8C and 40C: each rank's equals one-process SDPA's at its positions, bit for bit."""
        for world in WORLDS:
            for res in results(world):
                for (dtype, zigzag, T), r in res["attention"]:
                    with self.subTest(world=world, dtype=dtype, zigzag=zigzag, T=T):
                        self.assertEqual(r["equal"], dict.fromkeys(KEYS, True))

    def test_each_all_to_all_moves_one_block(self):
        """Per attention: forward q, k, v and the output, backward the output's gradient first, then dq, dk,
        dv; each this rank's input of A = B x (T/C) x H x D elements, in the inputs' dtype (the docstring's
        8A per layer)."""
        for world in WORLDS:
            for (_, _, T), r in results(world)[0]["attention"]:
                with self.subTest(world=world, T=T):
                    units = [u for u, _, _ in r["calls"]]
                    self.assertEqual(units[:5], ["ulysses q", "ulysses k", "ulysses v", "ulysses out", "ulysses dout"])
                    self.assertEqual(sorted(units[5:]), ["ulysses dk", "ulysses dq", "ulysses dv"])
                    self.assertEqual({b for _, b, _ in r["calls"]}, {r["block_bytes"]})

    def test_heads_not_divisible_by_c_are_refused_before_sending(self):
        for world in WORLDS:
            for res in results(world):
                self.assertIn(f"5 heads and 8 tokens a rank must divide into {world} and 2", res["refused"])


class TestUlyssesGPT(unittest.TestCase):
    def check_close(self, got: torch.Tensor, one: torch.Tensor, exact: torch.Tensor, scale: float, what: str) -> None:
        """got within ROUNDING_FACTOR x max(one's distance from exact, EPS32) of exact, both relative to scale."""
        err = ((got.double() - exact).abs().max() / scale).item()
        yardstick = ((one.double() - exact).abs().max() / scale).item()
        tol = ROUNDING_FACTOR * max(yardstick, EPS32)
        self.assertLessEqual(err, tol, f"{what}: {err:.2e} > {tol:.2e} (one process: {yardstick:.2e})")

    def test_loss_and_gradients_equal_one_process(self):
        """A forward + backward of the tiny GPT with Ulysses at C = 2 and 4, fp32 and bf16 autocast: the loss
        (averaged over the ranks) and every parameter's gradient (summed / C) within the module docstring's
        tolerance of the float64 reference."""
        exact = one_process("fp32", float64=True)
        scales = module_scales(exact["grads"])
        for dtype in DTYPES:
            one = one_process(dtype)
            for world in WORLDS:
                got = results(world)[0]["gpt"][dtype]
                with self.subTest(dtype=dtype, world=world):
                    self.check_close(got["loss"], one["loss"], exact["loss"], exact["loss"].abs().item(), "loss")
                    for name, g in got["grads"].items():
                        self.check_close(g, one["grads"][name], exact["grads"][name], scales[name], name)

    def test_logits_equal_one_process_at_each_rank_positions(self):
        """The forward alone: every rank's logits are one process's at its zigzag positions (the position
        embeddings included), within the same tolerance."""
        exact = one_process("fp32", float64=True)["logits"]
        for dtype in DTYPES:
            one = one_process(dtype)["logits"]
            for world in WORLDS:
                for got in (r["gpt"][dtype] for r in results(world)):
                    with self.subTest(dtype=dtype, world=world, rank=got["rank"]):
                        pos = local_positions(T, got["rank"], world)
                        scale = exact.abs().max().item()
                        self.check_close(got["logits"], one[:, pos], exact[:, pos], scale, "logits")

    def test_bytes_equal_the_formula(self):
        """Each all-to-all of the step moves A x element_size with A = MB x (T/C) x n_embd (all of a rank's heads
        for its tokens), 8 a Block, and COUNTER's all_to_all equals ulysses_all_to_all_bytes_per_micro_step. By
        hand at C = 2, fp32: A = 2 x 16 x 64 = 2,048 elements, 8A x 4 bytes = 65,536 bytes a Block, 131,072 for
        the 2 Blocks (the ring's count at C = 2 too; at C = 4 the ring's 163,840 against 65,536 here)."""
        self.assertEqual(ulysses_all_to_all_bytes_per_micro_step(N_LAYER, MB, T, 64, 2), 131_072)
        self.assertEqual(ulysses_all_to_all_bytes_per_micro_step(N_LAYER, MB, T, 64, 4), 65_536)
        for dtype in DTYPES:
            size = DTYPES[dtype].itemsize
            for world in WORLDS:
                for got in (r["gpt"][dtype] for r in results(world)):
                    with self.subTest(dtype=dtype, world=world, rank=got["rank"]):
                        block = MB * (T // world) * CONFIG.n_embd * size
                        self.assertEqual([b for _, b, _ in got["calls"]], [block] * 8 * N_LAYER)
                        formula = ulysses_all_to_all_bytes_per_micro_step(N_LAYER, MB, T, CONFIG.n_embd, world, 1, size)
                        calls = ulysses_all_to_all_calls_per_micro_step(N_LAYER, world)
                        self.assertEqual(got["counted"], (formula, calls))


class TestUlyssesSetup(unittest.TestCase):
    def test_check_ulysses(self):
        """C must divide the heads a TP rank holds: n_head / tp / cp whole."""
        self.assertIsNone(check_ulysses(12, 1, 4))
        self.assertIsNone(check_ulysses(12, 2, 2))
        self.assertIsNone(check_ulysses(25, 1, 5))
        for n_head, tp, cp in ((12, 2, 4), (12, 4, 2), (25, 1, 2), (4, 1, 8)):
            with self.subTest(n_head=n_head, tp=tp, cp=cp):
                line = check_ulysses(n_head, tp, cp)
                self.assertEqual(
                    line,
                    f"Ulysses context parallelism needs n_head ({n_head}) divisible by tensor_parallel_size ({tp}) "
                    f"x context_parallel_size ({cp}): each cp rank attends whole sequences for (n_head / tp) / cp "
                    f"of the heads",
                )
                self.assertNotIn("\n", line)

    def test_apply_ulysses_swaps_every_core_and_keeps_the_state_dict(self):
        """Every Block's core wraps the model's own AttentionCore; positions are the ring's zigzag ones (one rank
        here: all of them); the state dict's names and values are unchanged."""
        model = GPT(CONFIG)
        model.init_weights(SEED)
        before = model.state_dict()
        apply_ulysses(model, None)
        cores = [b.attn.core for b in model.transformer.h]
        self.assertTrue(all(isinstance(c, UlyssesAttentionCore) for c in cores))
        self.assertTrue(all(type(c.inner) is AttentionCore for c in cores))
        self.assertIsInstance(model.positions, ZigzagPositions)
        after = model.state_dict()
        self.assertEqual(list(after), list(before))
        self.assertTrue(all(torch.equal(after[n], before[n]) for n in before))

    def test_one_rank_is_the_core(self):
        """With one rank no all-to-all is issued: the core itself, on the same tensors."""
        q, k, v = (torch.randn(B, H, 8, D) for _ in range(3))
        with mock.patch.object(ulysses.comm, "all_to_all_single", side_effect=AssertionError("sent")):
            out = ulysses_attention(q, k, v, None, AttentionCore())
        self.assertTrue(torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True)))


if __name__ == "__main__":
    unittest.main()
