"""The chunked lm_head + cross-entropy (loss.linear_cross_entropy) against today's whole-logits path,
F.cross_entropy(F.linear(x, W)), in one process.

The tolerance, any chunking (tests/rounding.py's rule): both are fp32 evaluations of the same math in other
orders, each within about one yardstick eps of the exact value, eps = the whole-logits path's distance from the
same computation in float64; so they differ by up to about 2 eps, and ROUNDING_FACTOR = 4 allows a 2x margin
(per tensor, max |a - b| / max |b|; at least EPS32).

Where the arithmetic allows, bit for bit: with chunks of a multiple of LOSS_CHUNK_ALIGN rows each chunk starts
where the GEMM's row blocks start, so each row's logits are the whole GEMM's bits (on this CPU's MKL; one row
or 7 are not: other kernels, other sum orders); log-softmax, its backward and nll_loss's sum over the rows are
torch's own kernels, as in F.cross_entropy. The head makes its gradients in forward, for an incoming gradient of
1, and backward scales them by the real one, g. Where g is 1 or a power of 2 (scaling by it is exact) the loss and
d(x) = d(logits) W are equal bit for bit, and only dW = d(logits)^T x is summed over the rows in another order:
chunk by chunk, each chunk's GEMM then an fp32 add. Any order of an n-term sum is within gamma_n * sum |terms| of
the exact sum (gamma_n = n u / (1 - n u), u = 2^-24; Higham, Accuracy and Stability of Numerical Algorithms, eq.
4.4), so the two dW differ elementwise by at most 2 gamma_N (|G|^T |X|). Under bf16 autocast the products are bf16
(u_b = 2^-8), each chunk's and today's one: at most 2 u_b + 2 gamma_N on the same |G|^T |X|.

Any other g (0.75 here): d(logits) differs before the products. nll_loss's gradient is s = fl(g / n_valid) where
today's path has it, fl(1 / n_valid) in ours; log-softmax's backward makes fl(p s) off the target and
fl(fl(p s) - s) on it. Off the target the two differ by at most 4u relative (two roundings of s, two of the
product); on it the subtraction can cancel (p near 1), but the difference is at most 4u |G| + 2u p s <= 4u (|G| + S)
with S = s at each row's target, 0 elsewhere. Then each side's product sums within gamma of the exact, and ours
rounds once more when scaled by g (u |dx|): |d dx| <= (2 gamma_V + 6u) (|G| + S) |W|, |d dW| <= (2 gamma_N + 6u)
(|G| + S)^T |X|. Under bf16 the two d(logits) are also rounded to bf16 (u_b each) and so are the products: + 4 u_b.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import unittest
import unittest.mock

import pytest
import torch
import torch.nn.functional as F

from bench.pipeline import SavedBytes
from model.gpt import GPT, GPTConfig
from model.loss import LOSS_CHUNK_ALIGN, WHOLE_VOCAB, linear_cross_entropy, loss_chunk_rows, loss_share
from parallel.tensor_parallel.apply import VocabShard
from runtime.memory import LargestTensor
from tests.rounding import EPS32, ROUNDING_FACTOR

U32, U_BF16 = 2.0**-24, 2.0**-8
N, C, V = 200, 32, 1000
CFG = GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=2, n_embd=32)


def gamma(n: int, u: float = U32) -> float:
    return n * u / (1 - n * u)


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, generator=g)
    w = torch.randn(V, C, generator=g) * 0.5
    t = torch.randint(0, V, (N,), generator=g)
    t[::7] = -1  # ignored targets
    return x, w, t


def _whole(x, w, t, autocast: bool = False, grad: float = 0.75):
    """Today's path: (loss, dx, dw, d(logits)) of F.cross_entropy(F.linear(x, w).float(), t), in x's dtype, under an
    incoming gradient `grad` (as 1/M under accumulation)."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = F.linear(x, w)
        logits.retain_grad()
        loss = F.cross_entropy(logits if x.dtype == torch.float64 else logits.float(), t, ignore_index=-1)
    (loss * grad).backward()
    return loss.detach(), x.grad, w.grad, logits.grad.float()


def _chunked(x, w, t, chunk_rows=None, autocast: bool = False, vocab=None, grad: float = 0.75):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    kw = {} if vocab is None else {"vocab": vocab}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = linear_cross_entropy(x, w, t, chunk_rows=chunk_rows, **kw)
    (loss * grad).backward()
    return loss.detach(), x.grad, w.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _dw_bound(g: torch.Tensor, x: torch.Tensor, factor: float) -> torch.Tensor:
    """factor * (|G|^T |X|), elementwise, in float64."""
    return factor * (g.double().abs().t() @ x.double().abs())


def _with_targets(g: torch.Tensor, t: torch.Tensor, grad: float) -> torch.Tensor:
    """|G| + S: S = grad / (targets != -1) at each row's target, 0 elsewhere (the module docstring's bound)."""
    valid = t != -1
    s = torch.zeros_like(g, dtype=torch.float64)
    s[valid, t[valid]] = abs(grad) / int(valid.sum())
    return g.double().abs() + s


def _within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> bool:
    return bool(((got.double() - ref.double()).abs() <= bound).all())


class TestAgainstWholeLogits(unittest.TestCase):
    def test_fp32_within_rounding_of_whole_logits_for_any_chunking(self):
        x, w, t = _inputs()
        today = _whole(x, w, t)[:3]
        exact = _whole(x.double(), w.double(), t)[:3]
        eps = [max(_rel(a, b), EPS32) for a, b in zip(today, exact)]  # loss, dx, dW: the yardsticks
        self.assertGreater(max(eps), EPS32)  # not degenerate
        for rows in (1, 7, 64, N, None):  # one row, uneven chunks, aligned ones, one chunk, the default
            for what, got, ref, e in zip(("loss", "dx", "dW"), _chunked(x, w, t, rows), today, eps):
                self.assertLessEqual(_rel(got, ref), ROUNDING_FACTOR * e, f"{rows} rows: {what}")

    def test_fp32_aligned_chunks_bit_equal_but_dw_within_the_reordering_bound(self):
        x, w, t = _inputs()
        for grad in (1.0, 0.5):  # an incoming gradient the scaling takes exactly
            ref_loss, ref_dx, ref_dw, g = _whole(x, w, t, grad=grad)
            bound = _dw_bound(g, x, 2 * gamma(N))
            for rows in (LOSS_CHUNK_ALIGN, 3 * LOSS_CHUNK_ALIGN, None):  # 64 + 64 + 64 + 8 rows; 192 + 8; one chunk
                loss, dx, dw = _chunked(x, w, t, rows, grad=grad)
                self.assertTrue(torch.equal(loss, ref_loss), (grad, rows))
                self.assertTrue(torch.equal(dx, ref_dx), (grad, rows))
                err = (dw.double() - ref_dw.double()).abs()
                self.assertTrue(bool((err <= bound).all()), f"{grad}, {rows}: worst {float((err - bound).max())}")

    def test_fp32_any_incoming_gradient_within_the_scaling_bound(self):
        """g = 0.75: the loss's bits, dx and dW within the module docstring's bound (the gradients are made for
        g = 1 and scaled after the products)."""
        x, w, t = _inputs()
        ref_loss, ref_dx, ref_dw, g = _whole(x, w, t, grad=0.75)
        gs = _with_targets(g, t, 0.75)
        dx_bound = (2 * gamma(V) + 6 * U32) * (gs @ w.double().abs())
        dw_bound = (2 * gamma(N) + 6 * U32) * (gs.t() @ x.double().abs())
        for rows in (LOSS_CHUNK_ALIGN, 7, None):
            loss, dx, dw = _chunked(x, w, t, rows, grad=0.75)
            self.assertTrue(torch.equal(loss, ref_loss), rows)
            self.assertTrue(_within(dx, ref_dx, dx_bound), rows)
            self.assertTrue(_within(dw, ref_dw, dw_bound), rows)

    def test_bf16_autocast(self):
        """The logits in bf16 as autocast's F.linear makes them, the loss in fp32 of those: the same bits; at an
        incoming gradient of 1 also dx; dW's chunk products each rounded to bf16, summed in fp32; at 0.75 the
        scaling bound with bf16's roundings (see the module docstring for both)."""
        x, w, t = _inputs(1)
        ref_loss, ref_dx, ref_dw, g = _whole(x, w, t, autocast=True, grad=1.0)
        bound = _dw_bound(g, x, 2 * U_BF16 + 2 * gamma(N))
        for rows in (LOSS_CHUNK_ALIGN, None):
            loss, dx, dw = _chunked(x, w, t, rows, autocast=True, grad=1.0)
            self.assertTrue(torch.equal(loss, ref_loss), rows)
            self.assertTrue(torch.equal(dx, ref_dx), rows)
            self.assertEqual(dw.dtype, torch.float32)
            self.assertTrue(_within(dw, ref_dw, bound), rows)
        ref_loss, ref_dx, ref_dw, g = _whole(x, w, t, autocast=True, grad=0.75)
        gs = _with_targets(g, t, 0.75)
        dx_bound = (4 * U_BF16 + 2 * gamma(V) + 6 * U32) * (gs @ w.double().abs())
        dw_bound = (4 * U_BF16 + 2 * gamma(N) + 6 * U32) * (gs.t() @ x.double().abs())
        for rows in (LOSS_CHUNK_ALIGN, None):
            loss, dx, dw = _chunked(x, w, t, rows, autocast=True, grad=0.75)
            self.assertTrue(torch.equal(loss, ref_loss), rows)
            self.assertTrue(_within(dx, ref_dx, dx_bound), rows)
            self.assertTrue(_within(dw, ref_dw, dw_bound), rows)

    def test_vocab_shard_of_one_rank_equals_the_whole_vocab(self):
        """VocabShard (tensor parallelism's rows) on a group of one holds the whole vocab: its Megatron-style
        statistics (max, sum of exp) give F.cross_entropy within rounding (tests/test_tp.py runs it on 2 ranks)."""
        x, w, t = _inputs(2)
        today = _whole(x, w, t)[:3]
        exact = _whole(x.double(), w.double(), t)[:3]
        for gather in (False, True):
            got = _chunked(x, w, t, 7, vocab=VocabShard(None, 0, gather))
            for what, a, ref, e in zip(("loss", "dx", "dW"), got, today, exact):
                self.assertLessEqual(_rel(a, ref), ROUNDING_FACTOR * max(_rel(ref, e), EPS32), (gather, what))

    def test_rows_an_exact_multiple_of_the_chunk(self):
        """The chunk edge: 192 rows as 3 chunks of 64 and as 1 of 192, the last chunk ending exactly at N (where
        VocabShard keeps its logits for the second pass, `lo + chunk >= N`; the other sizes here end past N). The
        whole vocab: the loss and dx bit-equal to the whole logits, dW within the reordering bound (as above);
        VocabShard (one rank, with and without gather) within rounding of them."""
        x, w, t = _inputs(4)
        x, t = x[: 3 * LOSS_CHUNK_ALIGN], t[: 3 * LOSS_CHUNK_ALIGN]
        ref_loss, ref_dx, ref_dw, g = _whole(x, w, t, grad=1.0)
        today, exact = (ref_loss, ref_dx, ref_dw), _whole(x.double(), w.double(), t, grad=1.0)[:3]
        bound = _dw_bound(g, x, 2 * gamma(x.shape[0]))
        for rows in (LOSS_CHUNK_ALIGN, x.shape[0]):
            loss, dx, dw = _chunked(x, w, t, rows, grad=1.0)
            self.assertTrue(torch.equal(loss, ref_loss) and torch.equal(dx, ref_dx), rows)
            self.assertTrue(_within(dw, ref_dw, bound), rows)
            for gather in (False, True):
                got = _chunked(x, w, t, rows, vocab=VocabShard(None, 0, gather), grad=1.0)
                for what, a, ref, e in zip(("loss", "dx", "dW"), got, today, exact):
                    self.assertLessEqual(_rel(a, ref), ROUNDING_FACTOR * max(_rel(ref, e), EPS32), (rows, gather, what))

    def test_ignored_rows_get_no_gradient(self):
        x, w, t = _inputs(3)
        _, dx, _ = _chunked(x, w, t, 5)
        self.assertTrue(bool((dx[t == -1] == 0).all()))
        self.assertTrue(bool((dx[t != -1] != 0).any(dim=-1).all()))


class TestGradientAccumulation(unittest.TestCase):
    def test_micro_batches_round_as_the_whole_batch(self):
        """Under bf16 autocast, 3 micro-batches of 64 rows, each loss / 3 (gradient accumulation), give each row the
        same input gradient as the whole 192 rows at once, bit for bit, when forward is told the 1/3
        (`loss_share`): each row's softmax - one-hot is scaled by fl(1/3)/64 = fl(1/192) before its bf16 rounding
        either way. Told nothing, the head scales by 1/3 after its bf16 products, and rows part by an ulp."""
        g = torch.Generator().manual_seed(0)
        N, C, V, M = 192, 64, 512, 3
        x0, w = torch.randn(N, C, generator=g), torch.randn(V, C, generator=g) * 0.05
        t = torch.randint(0, V, (N,), generator=g)

        def dx(split: int, told: bool) -> torch.Tensor:
            x = x0.clone().requires_grad_()
            for rows in torch.arange(N).chunk(split):
                with torch.autocast("cpu", torch.bfloat16), loss_share(split if told else 1):
                    loss = linear_cross_entropy(x[rows], w, t[rows])
                (loss / split).backward()
            return x.grad

        whole = dx(1, True)
        self.assertTrue(torch.equal(dx(M, True), whole))
        self.assertFalse(torch.equal(dx(M, False), whole))


U16, TINY16, TINY32 = 2.0**-11, 2.0**-14, 2.0**-126  # fp16's unit roundoff, fp16's and fp32's smallest normals


def _rounding(a: torch.Tensor, u: float, h: float) -> torch.Tensor:
    """The most one rounding of a to a dtype of unit roundoff u and smallest normal h moves it: u |a| where a is
    normal, half the subnormal spacing (u h) below h; so u (|a| + h) always."""
    return u * (a.abs() + h)


def _head_bound(
    x: torch.Tensor, w: torch.Tensor, t: torch.Tensor, s: float, u: float, h: float, chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise bounds (float64) on |dx - exact| and |dW - exact| of linear_cross_entropy computed in a dtype of
    unit roundoff u and smallest normal h (autocast's: x, W, the logits, their gradient and the products rounded
    to it; every GEMM accumulating in fp32, as torch's CPU GEMMs do for fp16), every row's gradient scaled by s
    before the cast (s = S / (M rows): loss_share's loss scale S and share 1/M; a power of 2, so exact), all
    targets valid, `chunks` equal chunks of rows. In s's units (divide by S for the gradient).

    The logits: |z^ - z| <= E = r(x) |fl(W)|^T + |x| r(W)^T + gamma_C |fl(x)| |fl(W)|^T + u (|z^| + h), r the
    rounding above. Softmax moves each p_v by a factor within exp(+-2 max_v E) (its normaliser by at most the
    row's largest move); the fp32 kernels (F.cross_entropy's, or VocabShard's) evaluate it within exp(+-delta),
    delta = gamma_V (the sum of V exps) + u32 (3R + 3 log V + 8) (a few roundings of logits spread R and of log
    sum <= log V, and of exp). So |g^ - g| <= dG = s dp + 2 u32 s (p^ + one-hot) (the fp32 scaling and the
    one-hot's subtraction), dp = p expm1(2E + delta); the cast adds r(g^): dG' = dG + u (|g| + dG + h). Then dx =
    fl(fl(g^) fl(W)): |err| <= dG' |fl(W)| + |g| r(W) + (gamma_V + u (1 + gamma_V)) |fl(g^)| |fl(W)| + u h;
    dW summed per chunk of n rows, rounded, added over the chunks in fp32: the same with X, gamma_n, and gamma_K
    on the chunks' sums."""
    x64, w64 = x.double(), w.double()
    N, C = x64.shape
    V = w64.shape[0]
    xp, wp = x64.abs() + _rounding(x64, u, h), w64.abs() + _rounding(w64, u, h)  # |fl(x)|, |fl(W)| at most
    z = x64 @ w64.t()
    full = xp @ wp.t()  # (N, V): |fl(x)| |fl(W)|^T
    E = _rounding(x64, u, h) @ wp.t() + x64.abs() @ _rounding(w64, u, h).t() + gamma(C) * full
    E += u * (z.abs() + E + h)
    R = 2 * (z.abs() + E).amax(-1, keepdim=True)  # the spread of a row's computed logits, at most
    delta = gamma(V) + U32 * (3 * R + 3 * math.log(V) + 8)
    p = torch.softmax(z, -1)
    del full
    onehot = torch.zeros_like(p).scatter_(-1, t.unsqueeze(-1), 1.0)
    G = s * (p - onehot)  # the exact gradient, in s's units
    dp = p * torch.expm1(2 * E.amax(-1, keepdim=True) + delta)
    del E, z
    dG = s * dp + 2 * U32 * s * (p + dp + onehot)
    dG = dG + u * (G.abs() + dG + h)  # + the cast of g^ to the dtype
    Gh = G.abs() + dG  # |fl(g^)| at most
    dx = dG @ wp + G.abs() @ _rounding(w64, u, h) + (gamma(V) + u * (1 + gamma(V))) * (Gh @ wp) + u * h
    n = N // chunks
    sums = gamma(n) + u * (1 + gamma(n)) + gamma(chunks) * (1 + u) * (1 + gamma(n))
    dw = dG.t() @ xp + G.abs().t() @ _rounding(x64, u, h) + sums * (Gh.t() @ xp) + chunks * u * h * (1 + gamma(chunks))
    return dx, dw


def _scaled_head(x, w, t, M: int, fp16: bool, vocab, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One micro-batch of M as a step makes it: under loss_share(M, a GradScaler's scale) (fp16: autocast and
    the scaler, torch's default scale 2^16; else fp32 and a disabled scaler, scale 1), the loss / M scaled, its
    backward: (dx, dW, the scale), the gradients still scaled."""
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16, enabled=fp16), loss_share(M, scaler.scale):
        loss = linear_cross_entropy(x, w, t, vocab, chunk_rows)
    scaler.scale(loss / M).backward()
    return x.grad, w.grad, scaler.get_scale()


class TestLossScale(unittest.TestCase):
    def test_fp16_gradients_within_rounding_of_fp32_at_gpt2_vocab(self):
        """fp16 with its GradScaler at GPT-2's vocabulary (50304) and share (1/(M rows) = 1/16384: 16 x 1024 rows
        a step): the head scales each row's gradient by the loss scale S = 2^16 before the fp16 cast, so the
        off-target entries (p / 16384 ~ 1e-9, under fp16's smallest subnormal 6e-8 unscaled) keep their value:
        dx / S and dW / S within the fp16 bound of the exact gradients (`_head_bound`) plus fp32's of its own, of
        fp32's, elementwise; whole rows and VocabShard's (TP's head, one rank), 2 chunks of rows. Cast before S,
        dW's rows of tokens no target names are all zeros (and dx loses their part)."""
        N, C, V, M = 128, 64, 50304, 128
        g = torch.Generator().manual_seed(0)
        x = torch.randn(N, C, generator=g)
        w = torch.randn(V, C, generator=g) * 0.02  # GPT-2's init
        t = torch.randint(0, V, (N,), generator=g)
        b16 = _head_bound(x, w, t, 2.0**16 / (M * N), U16, TINY16, chunks=2)
        b32 = _head_bound(x, w, t, 1.0 / (M * N), U32, TINY32, chunks=2)
        for vocab in (WHOLE_VOCAB, VocabShard(None, 0)):
            dx, dw, S = _scaled_head(x, w, t, M, True, vocab, N // 2)
            ref_dx, ref_dw, one = _scaled_head(x, w, t, M, False, vocab, N // 2)
            self.assertEqual((S, one), (2.0**16, 1.0))
            for what, got, ref, (a, b) in (("dx", dx, ref_dx, (b16[0], b32[0])), ("dW", dw, ref_dw, (b16[1], b32[1]))):
                err = (got.double() / S - ref.double()).abs()
                bound = a / S + b
                self.assertTrue(
                    bool((err <= bound).all()),
                    f"{type(vocab).__name__} {what}: worst err/bound {float((err / bound).max())}",
                )


def _step_batches(M: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """6 rows of 32 tokens (CFG's vocab), as M micro-batches (each a multiple of LOSS_CHUNK_ALIGN rows of tokens)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, CFG.vocab_size, (2, 6, 32), generator=g)
    return list(zip(x.chunk(M), y.chunk(M)))


def _step(M: int, pipeline: bool, scale=None, autocast: bool = True) -> list[torch.Tensor]:
    """One training step's forward and backward of _step_batches(M) on one process, as the trainer runs it:
    Parallelized.forward_backward (no pipeline: one process, DDP and FSDP run this loop), or the pipeline runner's
    step (P = 1, 1F1B: the last stage's loop), under bf16 autocast; returns the gradient of each micro-batch's
    token embeddings (B, T, C) (wte's output: the last per-token gradient, from which wte's and wpe's are summed)."""
    from parallel.mesh import Mesh, ParallelDims
    from parallel.parallelize import ParallelConfig, parallelize
    from parallel.pipeline.parts import GPT_PARTS
    from parallel.pipeline.runner import PipelineRunner, PipelineStage

    model, seen = GPT(CFG), []
    model.init_weights(7)

    def keep_gradient(module, inputs, out):
        out.register_hook(seen.append)

    model.transformer.wte.register_forward_hook(keep_gradient)
    context = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16, enabled=autocast)
    if pipeline:
        with context():
            PipelineRunner(PipelineStage(model, 0, 1, 1, parts=GPT_PARTS)).step(_step_batches(M), "1f1b", scale)
    else:
        parallelized = parallelize(
            model,
            Mesh(ParallelDims(dp=1, tp=1, world_size=1)),
            ParallelConfig(implementation="custom"),
            torch.device("cpu"),
        )
        parallelized.forward_backward(_step_batches(M), scale, context)
    return seen


class TestTheStepTellsTheHead(unittest.TestCase):
    """The training step's part of loss_share: parallel/parallelize.py's forward_backward and the pipeline runner
    tell the head the share 1/M (and fp16's loss scale) its backward will bring."""

    def test_micro_batches_give_each_token_the_whole_batch_gradient(self):
        """bf16, 6 rows as M = 3 micro-batches against the M = 1 run of the same rows: every token's gradient at
        the embeddings is the same bits. Each row's head gradient is (softmax - one-hot) fl(fl(1/3) / 64) =
        fl(1/192), M = 1's, before its bf16 rounding (64 targets a micro-batch: dividing by them is exact), and
        everything below the head is per sequence (attention within a row, every matmul's rows in multiples of 64,
        the GEMMs' own row blocks). Told a share of 1, the head rounds to bf16 first and backward scales by 1/3
        after: rows part by an ulp. (The parameters' gradients are not bit-equal to M = 1's whatever the share:
        there each is one bf16 GEMM over all 192 tokens, here three, each rounded to bf16, summed in fp32; 33 of
        the 36 differ.)"""
        for pipeline in (False, True):
            whole = torch.cat(_step(1, pipeline))
            self.assertEqual(tuple(whole.shape), (6, 32, CFG.n_embd))
            self.assertTrue(torch.equal(torch.cat(_step(3, pipeline)), whole), f"pipeline={pipeline}")

    def test_the_head_is_told_the_gradient_backward_brings(self):
        """With fp16's GradScaler (scale S = 2^16) and M = 3, each micro-batch's head is told S/M in forward, so its
        backward's factor (incoming gradient / what forward was told) is exactly 1: the scale reaches the head's
        products before their fp16 cast (TestLossScale). Told 1/M alone, the factor would be S; told nothing, S/M."""
        from model.loss import _LinearCrossEntropy

        real = _LinearCrossEntropy.backward
        for pipeline in (False, True):
            factors = []

            def spy(ctx, grad_loss):
                factors.append(float(grad_loss / ctx.hint))
                return real(ctx, grad_loss)

            scaler = torch.amp.GradScaler("cpu")
            with unittest.mock.patch.object(_LinearCrossEntropy, "backward", staticmethod(spy)):
                _step(3, pipeline, scaler.scale, autocast=False)
            self.assertEqual(scaler.get_scale(), 2.0**16)
            self.assertEqual(factors, [1.0] * 3, f"pipeline={pipeline}")


class TestMemory(unittest.TestCase):
    def test_no_tensor_of_all_logits_and_only_the_gradients_saved(self):
        """Forward and backward never make an (N, V) tensor: the largest is a chunk's (rows, V) logits or dW
        (V, C); what is saved for backward is dx (N, C) and dW (V, C) in fp32, made in forward (x, the targets and
        the weight are not needed again)."""
        x, w, t = _inputs()
        x.requires_grad_()
        w = torch.nn.Parameter(w)
        with LargestTensor() as spy, SavedBytes(exclude=[w]) as saved:
            linear_cross_entropy(x, w, t, chunk_rows=16).backward()
        self.assertLessEqual(spy.numel, max(16 * V, V * C))
        self.assertEqual(saved.peak, (N * C + V * C) * 4)

    def test_no_gradient_work_without_grad(self):
        """Under torch.no_grad (evaluation) the loss alone: no (V, C) dW buffer, nothing saved, the same loss."""
        x, w, t = _inputs()
        ref = linear_cross_entropy(x.requires_grad_(), torch.nn.Parameter(w), t, chunk_rows=16)
        new = lambda out: out.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()  # noqa: E731 (not W^T)
        with torch.no_grad(), LargestTensor(new) as spy:
            loss = linear_cross_entropy(x, torch.nn.Parameter(w), t, chunk_rows=16)
        self.assertLessEqual(spy.numel, 16 * V)  # a chunk's logits; dW would be V * C = 2 x that
        self.assertLess(16 * V, V * C)
        self.assertTrue(torch.equal(loss, ref.detach()))
        self.assertFalse(loss.requires_grad)

    def test_a_second_backward_is_refused(self):
        """backward scales the saved gradients in place: autograd's version check refuses a second backward of the
        same graph (retain_graph) instead of scaling them twice."""
        x, w, t = _inputs()
        loss = linear_cross_entropy(x.requires_grad_(), torch.nn.Parameter(w), t, chunk_rows=16)
        loss.backward(retain_graph=True)
        with self.assertRaisesRegex(RuntimeError, "modified by an inplace operation"):
            loss.backward()

    def test_autocast_keeps_no_weight_copy_per_micro_batch(self):
        """M = 4 forwards under bf16 autocast before their backwards (a pipeline's last stage under GPipe): the head
        saves no bf16 copy of the weight (its backward needs none), where it used to save one per micro-batch."""
        x, w, t = _inputs()
        w = torch.nn.Parameter(w)
        copies = set()

        def pack(tensor):
            if tensor.dtype == torch.bfloat16 and tensor.shape == w.shape:
                copies.add(tensor.untyped_storage().data_ptr())
            return tensor

        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
            torch.autocast("cpu", dtype=torch.bfloat16),
        ):
            losses = [linear_cross_entropy(x[m::4].requires_grad_(), w, t[m::4], chunk_rows=16) for m in range(4)]
            for loss in losses:
                loss.backward()
        self.assertEqual(len(copies), 0)

    def test_forward_holds_three_chunks_of_logits_at_once(self):
        """The loss's live bytes beyond its inputs, gradients made in forward: the chunk's logits z (reused as the
        nll gradient), its log-softmax and its gradient, 3 x (rows, V) fp32 (plan.peak.loss_transient), beside
        dx and dW. The previous chunk's gradient is freed before the next chunk's logits are made: kept, it would
        be a 4th, 25.8 MB at GPT-2's vocabulary (the backward of before the fused head kept one; found by a row
        of tests/test_plan_runs.py at GPT-2's vocabulary)."""
        from runtime.memory import LiveStorages

        x, w, t = _inputs()
        x.requires_grad_()
        w = torch.nn.Parameter(w)
        rows = 16
        self.assertGreaterEqual(x.shape[0], 3 * rows)  # several chunks: one's gradient could outlive it
        with LiveStorages() as live:
            before = live.bytes
            linear_cross_entropy(x, w, t, chunk_rows=rows).backward()
        chunk, dw, dx = rows * V * 4, V * C * 4, x.numel() * 4
        # + the (N,) mask (bool), scale and picked log-probabilities (fp32), a chunk's (n, 1) int64 targets
        # and (n,) fp32 picked rows, and the 0-dim fp32 gradient backward expects (loss.loss_share)
        small = x.shape[0] * (1 + 4 + 4) + rows * (8 + 4) + 4
        self.assertLessEqual(live.peak - before, 3 * chunk + dw + dx + small)

    def test_default_chunk_rows(self):
        """The most multiple of 64 rows whose fp32 logits fit 32 MiB: 128 rows of GPT-2's 50304 (24.6 MiB), 320 of
        a TP=2 slice; at least 64."""
        self.assertEqual([loss_chunk_rows(v) for v in (50304, 25152, 512, 2**17, 2**20)], [128, 320, 16384, 64, 64])


class TestDeviceKernels(unittest.TestCase):
    def test_dw_accumulates_in_one_gemm_where_the_device_has_the_kernel(self):
        """Under bf16, dW's chunk products go into the fp32 buffer by one addmm with out_dtype fp32 where torch has
        that kernel for the device (CUDA; meta here, so CI runs the call's signature and dtypes): no bf16 (V, C)
        temporary, no separate fp32 add. On the CPU, which has none, the bf16 product then the fp32 add: the bits
        the rest of this file holds."""
        from torch.utils._python_dispatch import TorchDispatchMode

        from model.loss import HeadGradients, fp32_accumulating_addmm

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                seen.append(str(func))
                return func(*args, **(kwargs or {}))

        self.assertEqual((fp32_accumulating_addmm("cpu"), fp32_accumulating_addmm("meta")), (False, True))
        for device, dw_ops in (
            ("meta", ["aten.addmm.dtype_out"] * 2),
            ("cpu", ["aten.mm.default", "aten.add_.Tensor"] * 2),
        ):
            xc = torch.randn(128, C, dtype=torch.bfloat16, device=device)
            wc = torch.randn(V, C, dtype=torch.bfloat16, device=device)
            grads, seen = HeadGradients(xc, wc, need_dx=False, need_dw=True), []
            with Ops():
                for lo in (0, 64):
                    grads.add(slice(lo, lo + 64), torch.randn(64, V, device=device), xc, wc)
            self.assertEqual([op for op in seen if "mm" in op or op.startswith("aten.add")], dw_ops, device)
            self.assertEqual(grads.dw.dtype, torch.float32)


U64, TINY64, TINY_BF16 = 2.0**-53, 2.0**-1022, 2.0**-126  # float64's unit roundoff and smallest normal; bf16's


def _fused_heads():
    """--compile's three heads, each chunk one kernel: the whole vocab's loss.fused_rows, and VocabShard's (one rank:
    the whole vocab) with loss parallelism (shard_statistics, shard_gradient) and with the gather (fused_rows)."""
    return {
        "whole": None,
        "shard": VocabShard(None, 0, gather=False, fused=True),
        "gather": VocabShard(None, 0, gather=True, fused=True),
    }


@contextlib.contextmanager
def _kernels_by(compiled):
    """The head's kernels through `compiled(fn)` instead of torch.compile (the identity: the fused formulas run by
    eager torch, their arithmetic without inductor)."""
    import parallel.tensor_parallel.apply as tp_apply
    from model import loss

    with (
        unittest.mock.patch.object(loss, "compiled", compiled),
        unittest.mock.patch.object(tp_apply, "compiled", compiled),
    ):
        yield


class TestFusedHead(unittest.TestCase):
    """--compile's head (loss.compile_head): each chunk's loss and gradient by one compiled kernel, log-softmax in
    fp32, the gradient (softmax - one-hot) * share written once in the compute dtype. Not F.cross_entropy's bits (its
    own sums and exp): dx and dW within `_head_bound` of float64, the bound the fp16 test above derives (the fused
    kernel evaluates the softmax within its delta too: m + log sum exp(z - m), then exp(z - lse), round the row's
    spread R, log V and an exp a few times each, 2.5 R + 3 log V + 8 units at most), plus float64's own; the loss
    within ROUNDING_FACTOR of the eager path's distance from float64 (tests/rounding.py's rule). fp32 and bf16
    autocast, 2 chunks of 128 rows at V = 4096, every target valid (the bound's premise)."""

    N, C, V = 256, 64, 4096

    def check(self) -> None:
        g = torch.Generator().manual_seed(5)
        x = torch.randn(self.N, self.C, generator=g)
        w = torch.randn(self.V, self.C, generator=g) * 0.1
        t = torch.randint(0, self.V, (self.N,), generator=g)
        exact = _whole(x.double(), w.double(), t, grad=1.0)
        b64 = _head_bound(x, w, t, 1.0 / self.N, U64, TINY64, chunks=2)
        for autocast, u in ((False, U32), (True, U_BF16)):
            eager = _chunked(x, w, t, self.N // 2, autocast=autocast, grad=1.0)
            yardstick = max(_rel(eager[0], exact[0]), EPS32)
            b = _head_bound(x, w, t, 1.0 / self.N, u, TINY_BF16, chunks=2)  # bf16 keeps fp32's exponent range
            for name, vocab in _fused_heads().items():
                x_, w_ = x.clone().requires_grad_(), w.clone().requires_grad_()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = linear_cross_entropy(x_, w_, t, vocab, self.N // 2, fused=True)
                loss.backward()
                what = f"{name}, autocast={autocast}"
                self.assertLessEqual(_rel(loss.detach(), exact[0]), ROUNDING_FACTOR * yardstick, what)
                for grad, ref, bound in ((x_.grad, exact[1], b[0] + b64[0]), (w_.grad, exact[2], b[1] + b64[1])):
                    err = (grad.double() - ref).abs()
                    self.assertTrue(bool((err <= bound).all()), f"{what}: worst err/bound {float((err / bound).max())}")

    def test_the_fused_formulas_within_the_bound(self):
        """Run by eager torch: the fused formulas' arithmetic, fast."""
        with _kernels_by(lambda fn: fn):
            self.check()

    @unittest.skipUnless(os.environ.get("PATH") and shutil.which("g++"), "inductor needs a C++ compiler on CPU")
    @pytest.mark.slow
    def test_the_compiled_kernels_within_the_bound(self):
        """Through inductor, as --compile runs them (7 graphs: minutes on 2 cores the first time)."""
        self.check()

    def test_compile_fuses_every_head(self):
        """runtime.blocks.apply_compile sets fused=True on the head: GPT's whole-vocab head then runs fused_rows,
        TP's (a group of one here) shard_statistics and shard_gradient with loss parallelism, fused_rows with the
        gather; eval (no gradient) fused_rows alone."""
        from parallel.tensor_parallel.apply import vocab_parallel_cross_entropy
        from runtime.blocks import apply_compile

        idx = torch.randint(0, CFG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
        heads = {
            "whole": (None, ["fused_rows"]),
            "shard": (
                functools.partial(vocab_parallel_cross_entropy, group=None),
                ["shard_statistics", "shard_gradient"],
            ),
            "gather": (functools.partial(vocab_parallel_cross_entropy, group=None, gather=True), ["fused_rows"]),
        }
        for name, (head, kernels) in heads.items():
            model = GPT(CFG)
            model.init_weights(7)
            if head is not None:
                model.head_loss = head
            apply_compile(model)
            for block in model.transformer.h:
                block.forward = block.forward._torchdynamo_orig_callable  # the Blocks eager: only the head's kernels
            seen = []
            spy = lambda fn: seen.append(fn.__name__) or fn  # noqa: E731
            with _kernels_by(spy):
                model(idx, idx)[1].backward()
                self.assertEqual(sorted(set(seen)), sorted(kernels), name)
                seen.clear()
                with torch.no_grad():
                    model(idx, idx)
                self.assertEqual(sorted(set(seen)), ["fused_rows"] if name != "shard" else ["shard_statistics"], name)


class TestGPT(unittest.TestCase):
    def setUp(self):
        torch.manual_seed(0)
        self.idx = torch.randint(0, CFG.vocab_size, (3, 32))
        self.targets = torch.randint(0, CFG.vocab_size, (3, 32))
        self.targets[0, :5] = -1

    def _model(self) -> GPT:
        model = GPT(CFG)
        model.init_weights(7)
        return model

    def _loss_and_grads(self, model: GPT):
        logits, loss = model(self.idx, self.targets)
        loss.backward()
        return logits, loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    def test_equals_the_whole_logits_path(self):
        """head_loss None is today's path (lm_head on all rows, then loss_fn): the same loss bits, the same
        gradient bits everywhere but the tied matrix, whose lm_head part dW is summed over rows in another order
        (within 2 gamma_N |G|^T |X|) before the embedding's part is added (one more rounding, u |sum|, each)."""
        chunked, whole = self._model(), self._model()
        chunked.head_loss = functools.partial(linear_cross_entropy, chunk_rows=LOSS_CHUNK_ALIGN)  # 96 rows: 64 + 32
        whole.head_loss = None
        seen = {}

        def capture(module, inputs, logits):  # the whole path's lm_head input X and its logits (for G)
            seen["x"], seen["logits"] = inputs[0].detach(), logits
            logits.retain_grad()

        whole.lm_head.register_forward_hook(capture)
        logits, loss, grads = self._loss_and_grads(chunked)
        ref_logits, ref_loss, ref_grads = self._loss_and_grads(whole)
        self.assertIsNone(logits)
        self.assertIsNone(ref_logits)
        self.assertTrue(torch.equal(loss, ref_loss))
        self.assertEqual(grads.keys(), ref_grads.keys())
        self.assertNotIn("lm_head.weight", grads)  # tied: one Parameter, one gradient
        self.assertIs(chunked.lm_head.weight, chunked.transformer.wte.weight)
        for n in grads:
            if n != "transformer.wte.weight":
                self.assertTrue(torch.equal(grads[n], ref_grads[n]), n)
        wte = "transformer.wte.weight"
        g, x = seen["logits"].grad.flatten(0, 1), seen["x"].flatten(0, 1)
        bound = _dw_bound(g, x, 2 * gamma(x.shape[0])) + 2 * U32 * ref_grads[wte].double().abs()
        self.assertTrue(bool(((grads[wte].double() - ref_grads[wte].double()).abs() <= bound).all()))

    def test_sampling_and_evaluation_get_logits(self):
        model = self._model()
        logits, loss = model(self.idx)
        self.assertIsNone(loss)
        self.assertEqual(tuple(logits.shape), (3, 32, CFG.vocab_size))
        with torch.no_grad():
            _, eval_loss = model(self.idx, self.targets)
            ref = F.cross_entropy(logits.flatten(0, 1), self.targets.flatten(), ignore_index=-1)
        self.assertTrue(torch.equal(eval_loss, ref))

    def test_a_hooked_head_runs_whole(self):
        """A forward hook on lm_head (PyTorch's DTensor TP plan puts its redistributions there) sees the head
        run, on the whole logits; the loss is the same."""
        model, seen = self._model(), []
        _, ref = model(self.idx, self.targets)
        model.lm_head.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
        _, loss = model(self.idx, self.targets)
        self.assertEqual(seen, [(3, 32, CFG.vocab_size)])
        self.assertTrue(torch.equal(loss, ref))


if __name__ == "__main__":
    unittest.main()
