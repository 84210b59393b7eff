"""The loss head: lm_head and the mean cross-entropy together, chunk by chunk over the rows, so that no (N, V)
logits are ever made (`linear_cross_entropy`, GPT's default `head_loss`), its gradients made in forward
(`HeadGradients`), the vocab's rows as one process has them (`WholeVocab`; tensor parallelism brings its own
shard), gradient accumulation's 1/M and fp16's loss scale told to forward (`loss_share`), `head_output`,
which picks the head's path, and under --compile each chunk's softmax and gradient as one compiled kernel
(`compile_head`, `fused_rows`). Knows no parallelism and imports nothing of model/gpt.py.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.torch_version import TorchVersion

IGNORE_INDEX = -1  # a target that counts for nothing: the loss is the mean over the others
# The most bytes of fp32 logits one row chunk of `linear_cross_entropy` makes, by device type (x.device.type): on
# the CPU 32 MiB, where 128 rows of GPT-2's vocab already run its GEMMs at full speed and a chunk's few (n, V) fp32
# tensors stay under 100 MiB beside the activations; any other device (an accelerator: bigger GEMMs are faster
# there, and memory is not the CPU's) LOSS_CHUNK_BYTES_ACCELERATOR.
LOSS_CHUNK_BYTES: dict[str, int] = {"cpu": 32 * 2**20}
LOSS_CHUNK_BYTES_ACCELERATOR = 256 * 2**20
LOSS_CHUNK_ALIGN = 64  # chunk rows are a multiple of it: each chunk starts where a GEMM's row blocks start


def loss_chunk_rows(vocab: int, device_type: str = "cpu") -> int:
    """Rows per chunk of `linear_cross_entropy` for logits `vocab` wide on a `device_type` device: the most multiple of
    LOSS_CHUNK_ALIGN whose fp32 logits fit its LOSS_CHUNK_BYTES (at least LOSS_CHUNK_ALIGN): 128 rows (24.6 MiB)
    at V = 50304 on the CPU, 1280 (245.6 MiB) on an accelerator."""
    budget = LOSS_CHUNK_BYTES.get(device_type, LOSS_CHUNK_BYTES_ACCELERATOR)
    return max(1, budget // (4 * vocab) // LOSS_CHUNK_ALIGN) * LOSS_CHUNK_ALIGN


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all B*T targets in fp32, skipping targets of -1, from the whole logits: GPT's
    `loss_fn`, for a head that runs whole (see `head_output`) and for torch's pipeline schedules, which take logits."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=IGNORE_INDEX)


@functools.cache
def fp32_accumulating_addmm(device_type: str) -> bool:
    """Whether torch adds fp16/bf16 products into an fp32 matrix in one GEMM on `device_type` devices:
    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc) with acc fp32, a and b fp16/bf16. Asked of torch's
    dispatcher (a kernel for aten::addmm.dtype_out under the device's dispatch key): CUDA's (cuBLAS, fp32
    accumulation and output) and meta's have one, the CPU's has not (torch 2.13). torch 2.8-2.9 had the kernel
    but refused an fp32 `acc` ("self and mat2 must have the same dtype"); from 2.10 it takes `acc` of out_dtype
    (torch 2.11's libtorch_cuda.so, the GPU image's, carries the new check, "self dtype must match either out_dtype
    or mat1 dtype", and not the old)."""
    if TorchVersion(torch.__version__) < (2, 10):
        return False
    key = torch._C._dispatch_key_for_device(device_type)
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::addmm.dtype_out", key)


class HeadGradients:
    """d(loss)/dx (N, C) and d(loss)/dW (V, C) of `linear_cross_entropy` for an incoming gradient of 1, filled in
    its forward chunk by chunk (`add`), each None where it is not needed: dx's rows are each chunk's g W (n, C),
    dW the sum over chunks of g^T x_c, addmm'd into one buffer. Both buffers are fp32 (float64 for float64
    inputs); the products are in the compute dtype, as autocast's F.linear backward makes them. dW's, under
    autocast: where the device adds bf16 x bf16 products into fp32 in one GEMM (`fp32_accumulating_addmm`: CUDA),
    each chunk's g^T x_c goes straight into the fp32 buffer; elsewhere (the CPU) it is rounded to a bf16 (V, C)
    temporary, then added in fp32, as autocast's backward and AccumulateGrad would."""

    def __init__(self, xc: torch.Tensor, wc: torch.Tensor, need_dx: bool, need_dw: bool):
        acc = torch.promote_types(xc.dtype, torch.float32)
        self.dx = torch.empty(xc.shape, dtype=acc, device=xc.device) if need_dx else None
        self.dw = torch.zeros(wc.shape, dtype=acc, device=wc.device) if need_dw else None
        self.dw_in_one_gemm = (
            need_dw
            and wc.dtype in (torch.float16, torch.bfloat16)
            and acc == torch.float32
            and fp32_accumulating_addmm(wc.device.type)
        )

    @property
    def needed(self) -> bool:
        return self.dx is not None or self.dw is not None

    def add(self, rows: slice, g: torch.Tensor, xc: torch.Tensor, wc: torch.Tensor) -> None:
        """Chunk `rows`' d(loss)/d(logits) g (n, V) against its inputs x_c = xc[rows] (n, C) and the weight wc
        (V, C): dx[rows] = g wc, dW += g^T x_c."""
        g = g.to(xc.dtype)  # autocast's F.linear backward gets the logits' gradient in the compute dtype
        if self.dx is not None:
            if self.dx.dtype == g.dtype:
                torch.mm(g, wc, out=self.dx[rows])  # (n, C)
            else:
                self.dx[rows] = g @ wc
        if self.dw is None:
            return
        if self.dw.dtype == g.dtype:
            self.dw.addmm_(g.t(), xc[rows])  # (V, C)
        elif self.dw_in_one_gemm:  # fp32 += bf16 x bf16, accumulated and written in fp32: no (V, C) temporary
            torch.addmm(self.dw, g.t(), xc[rows], out_dtype=self.dw.dtype, out=self.dw)
        else:
            self.dw += g.t() @ xc[rows]


class WholeVocab:
    """The rows of `linear_cross_entropy` when its weight holds the whole vocab: torch's log-softmax, so each
    row's log-probabilities, and their gradient, are F.cross_entropy's; with `fused` (--compile: `compile_head`)
    one compiled kernel per chunk instead (`fused_rows`).

    What `linear_cross_entropy` asks of its `vocab` (tensor parallelism has its own, VocabShard in
    parallel/tensor_parallel/apply.py): `log_probs(xc, wc, targets, chunk, scale, grads)`, from x (N, C) and the weight
    (V, C) in the compute dtype, -> each row's fp32 log-probability of its target (N,) (any value where the target
    is IGNORE_INDEX), walking the rows `chunk` at a time; where `grads.needed`, it also hands `grads.add` each
    chunk's d/dz of sum_r scale_r * -log p_r(target_r), (n, V): (softmax - one-hot) * scale.
    """

    def __init__(self, fused: bool = False):
        self.fused = fused

    def log_probs(
        self,
        xc: torch.Tensor,
        wc: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        scale: torch.Tensor,
        grads: HeadGradients,
    ) -> torch.Tensor:
        N = xc.shape[0]
        picked = torch.empty(N, dtype=torch.float32, device=xc.device)
        for lo in range(0, N, chunk):
            rows = slice(lo, lo + chunk)
            picked[rows], g = self.rows(F.linear(xc[rows], wc), targets[rows], scale[rows] if grads.needed else None)
            if g is not None:
                grads.add(rows, g, xc, wc)
            del g  # else it lives on beside the next chunk's logits, log-softmax and gradient: a 4th (n, V)
        return picked

    def rows(
        self, z: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One chunk's whole logits z (n, V) (overwritten) -> (each row's log p(target) (n,), and with `scale` the
        logits' gradient (n, V), else None): eagerly by F.cross_entropy's own kernels (fp32: its bits), or `fused`
        by one compiled kernel (`fused_rows`: the gradient in z's dtype, in z's storage)."""
        if self.fused:
            return compiled(fused_rows)(z, targets, scale), None if scale is None else z
        z = z.float()
        logp = torch.log_softmax(z, dim=-1)  # (n, V)
        t = targets.clamp(min=0).unsqueeze(-1)
        picked = logp.gather(-1, t).squeeze(-1)
        if scale is None:
            return picked, None
        grad_logp = z.zero_().scatter_(-1, t, -scale.unsqueeze(-1))  # nll_loss's gradient
        # log_softmax's own backward kernel (its exp is not torch.exp's): F.cross_entropy's gradient bit for bit
        return picked, torch._log_softmax_backward_data(grad_logp, logp, -1, torch.float32)


def fused_rows(z: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """One chunk's loss and gradient as one kernel (torch.compile: `compiled`), for logits z (n, V) in the compute
    dtype -> each row's fp32 log p(target) (n,), and with `scale` (n,) z overwritten by (softmax - one-hot) * scale.
    In fp32: the row's log-sum-exp m + log sum exp(z - m) (m its max), p = exp(z - lse); the gradient cast once, to
    z's dtype, into z's storage. Inductor makes it one loop nest per row: the max, the sum, then the gradient,
    three reads of z and one write (the eager path's passes: `compile_head`).
    Not F.cross_entropy's bits (other sums, other exp): within the bound tests/test_loss.py derives."""
    zf = z.float()
    lse = torch.logsumexp(zf, dim=-1, keepdim=True)  # (n, 1)
    t = targets.clamp(min=0).unsqueeze(-1)
    picked = (zf.gather(-1, t) - lse).squeeze(-1)
    if scale is not None:
        hot = torch.arange(z.shape[-1], device=z.device) == t  # (n, V) one-hot, never materialised
        z.copy_(((zf - lse).exp() - hot.float()) * scale.unsqueeze(-1))
    return picked


@functools.cache
def compiled(fn: Callable) -> Callable:
    """torch.compile of one of the head's per-chunk kernels (`fused_rows`, VocabShard's), once per process: its
    graphs (one per chunk shape and whether a gradient is made; a shape seen twice compiles dynamic) are cached."""
    return torch.compile(fn, fullgraph=True)


WHOLE_VOCAB = WholeVocab()
FUSED_WHOLE_VOCAB = WholeVocab(fused=True)


_LOSS_SHARE: list[tuple[int, Callable | None]] = [(1, None)]  # the innermost `loss_share`'s (M, scale)


@contextlib.contextmanager
def loss_share(M: int, scale: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """The losses of the forwards inside will be divided by M (gradient accumulation's 1/M), then multiplied by
    `scale` (fp16's GradScaler.scale: a tensor times the loss scale S), before backward: `linear_cross_entropy`
    makes its gradients in forward already scaled by scale(1)/M, as a head whose gradient waits for backward gets
    them, so each row's gradient rounds alike whatever M a layout splits the step into (in bf16, a gradient scaled
    after its products parts from one process's by an ulp; measured 2.4e-3 relative in a grad norm at M = 12),
    and fp16's products see S before the cast (without it, at GPT-2's 1/(M rows) = 1/16384 and V = 50304 every
    off-target entry, ~1e-9, flushes to zero in fp16). Backward multiplies by (incoming gradient) / (S/M): exactly
    1 when the hint holds, any other gradient still exact to a rounding."""
    _LOSS_SHARE.append((M, scale))
    try:
        yield
    finally:
        _LOSS_SHARE.pop()


def _told_gradient(device: torch.device) -> torch.Tensor:
    """The incoming gradient the innermost `loss_share` tells forward to expect: scale(1) / M, 0-dim fp32."""
    M, scale = _LOSS_SHARE[-1]
    one = torch.ones((), device=device)
    return (one if scale is None else scale(one)) / M


class _LinearCrossEntropy(torch.autograd.Function):
    """cross_entropy(x W^T, targets), `chunk` rows at a time, so that no (N, V) tensor is ever made; its
    gradients are made in forward, so nothing is recomputed (as fused-linear-cross-entropy kernels do, Liger's).

    forward: per chunk of rows, the logits z = x_c W^T (in autocast's dtype where it is on, as F.linear), their
    rows' log-probabilities of the targets (`vocab.log_probs`); the loss is nll_loss of those (mean over targets
    != -1). Where a gradient is needed (`need`: grad mode on and x or W requiring it), the same pass turns each
    chunk's logits into d(loss)/dz = (softmax - one-hot) S / (M (targets != -1)) at once (`loss_share`'s M and
    loss scale S), and that into its rows of dx and its part of dW (HeadGradients, fp32): the only tensors saved
    for backward.
    backward: grad_loss is a scalar: dx and dW times grad_loss / (S/M) (`loss_share`: 1 when forward knew it), in
    place, cast to x's and W's dtypes.
    """

    @staticmethod
    def forward(ctx, x, weight, targets, vocab, chunk, need):  # x (N, C), weight (V, C), targets (N,)
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
        with torch.autocast(kind, enabled=False):
            xc, wc = x.to(dtype), weight.to(dtype)  # the casts autocast's F.linear makes (backward needs neither)
            grads = HeadGradients(xc, wc, *need)
            valid = targets != IGNORE_INDEX
            hint = _told_gradient(x.device)  # the gradient backward expects (fp32)
            scale = torch.where(valid, hint / valid.sum(), 0.0)  # (N,) nll_loss's gradient: d(loss)/d(-log p)
            picked = vocab.log_probs(xc, wc, targets, chunk, scale, grads)  # (N,)
            # nll_loss of the (N, 1) picked log-probabilities: F.cross_entropy's own sum over rows
            loss = F.nll_loss(picked.unsqueeze(-1), targets.clamp(max=0), ignore_index=IGNORE_INDEX)
        ctx.save_for_backward(grads.dx, grads.dw)
        ctx.hint = hint  # a 0-dim tensor, beside the saved gradients
        ctx.dtypes = (x.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dx, dw = ctx.saved_tensors  # a second backward through this graph finds them modified: autograd refuses
        x_dtype, w_dtype = ctx.dtypes
        factor = grad_loss / ctx.hint  # 1 exactly where `loss_share` told forward the gradient to come
        dx = None if dx is None else dx.mul_(factor).to(x_dtype)
        dw = None if dw is None else dw.mul_(factor).to(w_dtype)
        return dx, dw, None, None, None, None


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab=None,
    chunk_rows: int | None = None,
    fused: bool = False,
) -> torch.Tensor:
    """cross_entropy(F.linear(x, weight), targets): lm_head and the mean cross-entropy over targets != -1 together,
    without the (..., V) logits or their log-softmax: GPT's default `head_loss`.

    x (..., C), weight (V, C) (under tensor parallelism this rank's vocab rows, with `vocab` saying how rows
    reduce over the vocab), targets (...). The rows are taken `chunk_rows` at a time (default `loss_chunk_rows` for
    x's device: 128 for V = 50304 on the CPU); only one chunk's logits are alive at a time. Where a gradient is
    needed, forward computes it too (x W^T, then g W and g^T x per chunk: nothing recomputed) and holds dx (N, C)
    and dW (V, C) in fp32 until backward, which only scales them by the incoming gradient; with no gradient
    needed (torch.no_grad, evaluation) only the loss. Each row goes through F.cross_entropy's own kernels, so the
    loss is its bits where each chunk's logits are the whole matmul's (chunks of LOSS_CHUNK_ALIGN rows), and so is
    d(x) under an incoming gradient of 1 (or any power of 2: scaling by it is exact); dW is summed over the rows
    chunk by chunk: within 2*gamma_N*(|G|^T |X|) of one matmul; other incoming gradients scale after the
    products: a few more roundings (tests/test_loss.py derives the bound). `vocab`: default the whole vocab, each
    chunk by torch's eager kernels, or with `fused` (--compile) by one compiled kernel (`fused_rows`)."""
    vocab = vocab or (FUSED_WHOLE_VOCAB if fused else WHOLE_VOCAB)
    chunk_rows = chunk_rows or loss_chunk_rows(weight.shape[0], x.device.type)
    grad = torch.is_grad_enabled()
    need = (grad and x.requires_grad, grad and weight.requires_grad)
    return _LinearCrossEntropy.apply(x.reshape(-1, x.shape[-1]), weight, targets.reshape(-1), vocab, chunk_rows, need)


def head_output(owner: nn.Module, x: torch.Tensor, targets: torch.Tensor | None):
    """lm_head and the loss of `owner` (a GPT, or a pipeline's last stage) on x (B, T, C), ln_f's output.

    Without targets: (logits (B, T, V), None). With them: (None, the mean cross-entropy), by `owner.head_loss`
    (x, lm_head's weight, targets), which never holds the whole logits. A head whose forward is hooked runs as
    a module instead (skipping its forward would skip the hooks: PyTorch's DTensor TP plan redistributes
    lm_head's input and output there), and so does a head of an owner whose head_loss is None: its whole
    logits go to `owner.loss_fn`.
    """
    head = owner.lm_head
    if targets is None:
        return head(x), None
    if owner.head_loss is not None and not (head._forward_pre_hooks or head._forward_hooks):
        return None, owner.head_loss(x, head.weight, targets)
    if owner.loss_fn is None:
        raise ValueError(
            "lm_head must run whole here (its forward is hooked), but this model's loss needs "
            "head_loss: its logits are this rank's vocab slice (loss parallelism)"
        )
    return None, owner.loss_fn(head(x), targets)


def compile_head(owner: nn.Module) -> None:
    """--compile (runtime/blocks.apply_compile): `owner`'s head_loss (GPT's linear_cross_entropy, TP's
    vocab_parallel_cross_entropy, a last pipeline stage's copy of either) runs each chunk's loss and gradient through
    one compiled kernel (`fused=True`). Per chunk of n rows, besides the logits' GEMM and the two gradient GEMMs
    that read d(logits), the eager head makes these full-width (n, V) passes: z.float() (under autocast),
    log_softmax (reads z, writes log p), z.zero_() (nll_loss's gradient), log-softmax's backward (reads that and
    log p, writes d(logits) in fp32) and its cast to the compute dtype: 3 kernels in fp32, 5 under autocast, with
    three (n, V) fp32 tensors alive. Fused: one loop nest per row (max, sum of exp, gradient: three reads of z, one
    write of d(logits) in the compute dtype, into z), one (n, V) tensor alive. TP's loss-parallel head likewise
    (first pass: .float(), amax, sub_, exp_, sum; second: .float(), sub_, exp_, div_, mul_, the cast; each pass
    one kernel fused). Only the head: its GEMMs stay torch's."""
    if getattr(owner, "head_loss", None) is not None:
        owner.head_loss = functools.partial(owner.head_loss, fused=True)
