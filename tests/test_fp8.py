"""Our FP8 linear (parallel/fp8/) against torchao's Float8Linear (parallel/twins/fp8.py) and against float64.

- Bit for bit with torchao, per recipe (tensorwise, rowwise), in fp32 and under bf16 autocast (fp32 master weights):
  one linear's output and its three gradients (backward outside autocast, as train.py's micro-steps run it, and
  inside, as a pipeline schedule runs it); a GPT's loss, every gradient and every parameter over 4 AdamW steps.
- Independently of torchao: each cast is within the format's rounding of its input (relative 2^-4 for E4M3, 2^-3
  for E5M2, or half the smallest subnormal spacing over the scale), and each scaled GEMM within float32
  accumulation plus its output's rounding of the float64 product of the dequantized operands.
- The scales: tensorwise max_fp8 / amax; rowwise one per row along the contracted dim, a power of two; a zero
  tensor's amax is clamped (a finite scale, zeros out). The reduce hook sees the amax and its dim.
- Which linears: the Blocks' dense ones; the head, embeddings, an MoE router and its experts keep the compute dtype;
  parameters keep their names and objects.
- check_fp8's refusals: fp16, a dimension or a token count not a multiple of 16, an unknown recipe.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

from model.gpt import GPT, make_config
from parallel.fp8 import RECIPES, Fp8Linear, Reduces, check_fp8, convert_to_fp8, fp8_linear_names, linear_dims
from parallel.fp8.recipes import scaled_mm
from parallel.fp8.scaling import E4M3, E5M2, amax, amax_to_scale, to_fp8

warnings.filterwarnings("ignore", module="torchao")
twins = pytest.importorskip("parallel.twins.fp8")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def autocast(dtype: torch.dtype):
    return torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


# ----------------------------------------------------------------------------- one linear, bit for bit


def linear_pair(recipe: str, bias: bool = True) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=bias)
    wrapper = nn.Sequential(copy.deepcopy(linear))
    twins.convert_to_torchao_fp8(wrapper, recipe, names=["0"])
    return Fp8Linear.from_linear(copy.deepcopy(linear), RECIPES[recipe]), wrapper[0]


def run_linear(m: nn.Module, dtype: torch.dtype, backward_in_autocast: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(4, 32, 64, generator=g)).requires_grad_()
    dy = torch.randn(4, 32, 96, generator=g)
    with autocast(dtype):
        y = m(x)
        if backward_in_autocast:
            y.backward(dy.to(y.dtype))
    if not backward_in_autocast:
        y.backward(dy.to(y.dtype))
    return [y, x.grad, m.weight.grad, m.bias.grad]


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("inside", [False, True], ids=["backward-outside", "backward-inside-autocast"])
def test_a_linear_equals_torchao_bit_for_bit(recipe, dtype, inside):
    ours, theirs = linear_pair(recipe)
    a, b = run_linear(ours, DTYPES[dtype], inside), run_linear(theirs, DTYPES[dtype], inside)
    for name, u, v in zip(("output", "grad_input", "grad_weight", "grad_bias"), a, b):
        assert u.dtype == v.dtype and torch.equal(u, v), f"{name}: max diff {(u.float() - v.float()).abs().max()}"
    assert a[0].dtype == DTYPES[dtype] and a[2].dtype == torch.float32  # the compute dtype out, fp32 master grads


# ----------------------------------------------------------------------------- a GPT, several optimizer steps

CONFIG = make_config("tiny", n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=128)
STEPS, BATCH = 4, 4  # 4 x 32 = 128 token rows per linear call: a multiple of 16


def train(convert, dtype: torch.dtype, steps: int = STEPS) -> tuple[list[torch.Tensor], list[dict], dict]:
    """Losses, each step's gradients and the final parameters of a GPT trained `steps` AdamW steps after
    `convert`."""
    model = GPT(CONFIG)
    model.init_weights(seed=0)
    convert(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(2)
    losses, grads = [], []
    for _ in range(steps):
        idx = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=g)
        with autocast(dtype):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_gpt_trains_as_torchao_bit_for_bit(recipe, dtype):
    ours = train(lambda m: convert_to_fp8(m, recipe), DTYPES[dtype])
    theirs = train(lambda m: twins.convert_to_torchao_fp8(m, recipe), DTYPES[dtype])
    assert [x.item() for x in ours[0]] == [x.item() for x in theirs[0]]
    for step, (a, b) in enumerate(zip(ours[1], theirs[1])):
        unequal = [n for n in a if not torch.equal(a[n], b[n])]
        assert not unequal, f"step {step}: gradients differ: {unequal}"
    assert all(torch.equal(ours[2][n], theirs[2][n]) for n in ours[2])
    assert all(p.dtype == torch.float32 for p in ours[2].values())  # fp32 master weights throughout


def test_fp8_changes_the_loss_and_the_recipes_differ():
    """The comparisons above can fail: FP8 is not the plain model, and the two recipes are not each other."""
    plain = train(lambda m: None, torch.float32, steps=1)[0]
    tensorwise = train(lambda m: convert_to_fp8(m, "tensorwise"), torch.float32, steps=1)[0]
    rowwise = train(lambda m: convert_to_fp8(m, "rowwise"), torch.float32, steps=1)[0]
    assert plain[0] != tensorwise[0] != rowwise[0] != plain[0]


# ----------------------------------------------------------------------------- against float64

# (unit roundoff, half the smallest subnormal spacing) of each format: E4M3 3 mantissa bits, min subnormal 2^-9;
# E5M2 2 mantissa bits, min subnormal 2^-16
ROUNDING = {E4M3: (2.0**-4, 2.0**-10), E5M2: (2.0**-3, 2.0**-17)}


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dim", [None, 0, -1])
def test_a_cast_is_within_the_formats_rounding(dtype, dim):
    """|data / scale - x| <= max(u |x|, half the least subnormal spacing / scale), plus fp32's rounding of x * s."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 48, generator=g) * torch.logspace(-6, 2, 48)  # columns over 8 decades: subnormals too
    data, scale = to_fp8(x, dtype, dim)
    back = data.double() / scale.double()
    u, half_sub = ROUNDING[dtype]
    bound = torch.maximum(u * x.abs().double(), half_sub / scale.double()) * (1 + 2.0**-20)
    assert (back - x.double()).abs().le(bound).all()
    assert data.float().abs().max() <= torch.finfo(dtype).max  # saturated, never inf or nan


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fast_accum", [True, False])
def test_a_scaled_gemm_is_within_float32_accumulation_of_float64(recipe, out_dtype, fast_accum):
    """|C - A B| <= (K + 2) 2^-24 sum_k |a_k b_k| + u_out |A B| for the dequantized A, B (products of two FP8
    values are exact in fp32; K - 1 additions and two scalings round), u_out: the output's rounding (bf16's 2^-8
    where torchao's rowwise path rounds an fp32 output through bf16)."""
    r, g = RECIPES[recipe], torch.Generator().manual_seed(4)
    a, b = torch.randn(48, 64, generator=g), torch.randn(32, 64, generator=g)
    ad, as_ = to_fp8(a, r.input, -1 if r.rowwise else None, r.pow2)
    bd, bs = to_fp8(b, r.weight, -1 if r.rowwise else None, r.pow2)
    c = scaled_mm(ad, as_, bd.t(), bs.t(), out_dtype, fast_accum).double()
    A, B = ad.double() / as_.double(), (bd.double() / bs.double()).t()
    exact = A @ B
    u_out = 2.0**-8 if out_dtype == torch.bfloat16 or r.rowwise else 2.0**-24
    bound = (64 + 2) * 2.0**-24 * (A.abs() @ B.abs()) + u_out * exact.abs()
    assert (c - exact).abs().le(bound).all()


# ----------------------------------------------------------------------------- the scales


def test_scales_tensorwise_rowwise_and_zero():
    x = torch.tensor([[1.0, -4.0], [0.5, 2.0]])
    assert amax_to_scale(amax(x), E4M3).item() == pytest.approx(448 / 4)
    rows = amax_to_scale(amax(x, dim=-1), E4M3, pow2=True)
    assert rows.shape == (2, 1) and rows.flatten().tolist() == [64.0, 128.0]  # 448/4 = 112 -> 64, 448/2 = 224 -> 128
    data, scale = to_fp8(torch.zeros(3, 3), E5M2)
    assert torch.isfinite(scale) and scale.item() == pytest.approx(57344 / 1e-12) and not data.float().any()


def test_the_reduce_hook_sees_the_amax_and_its_dim():
    """The seam a layout plugs into: the hook gets this piece's amax (and the dim it spans) and returns the
    whole tensor's, and the scale follows it."""
    seen = []

    def whole(a, dim):
        seen.append((tuple(a.shape), dim))
        return torch.full_like(a, 8.0)

    _, scale = to_fp8(torch.ones(4, 16), E4M3, dim=-1, reduce=whole)
    assert seen == [((4, 1), -1)] and torch.equal(scale, torch.full((4, 1), 448 / 8))


def test_tensorwise_reduces_each_tensors_amax_once_per_step():
    """Tensorwise: x and W in forward, dy in backward (backward reuses forward's scales); rowwise: x and W again
    along the backward GEMMs' axes, and dy along two."""
    for recipe, expected in (("tensorwise", ["x", "w", "dy"]), ("rowwise", ["x", "w", "dy", "w", "dy", "x"])):
        calls = []

        def hook(name):
            return lambda a, dim: calls.append(name) or a

        m = Fp8Linear.from_linear(nn.Linear(32, 16), RECIPES[recipe])
        m.reduce = Reduces(input=hook("x"), weight=hook("w"), grad_output=hook("dy"))
        m(torch.randn(2, 16, 32, requires_grad=True)).sum().backward()
        assert calls == expected, recipe


# ----------------------------------------------------------------------------- which linears


def test_convert_swaps_the_blocks_dense_linears_only():
    model = GPT(CONFIG)
    model.init_weights(seed=0)
    before = dict(model.named_parameters())
    convert_to_fp8(model, "tensorwise")
    swapped = sorted(n for n, m in model.named_modules() if isinstance(m, Fp8Linear))
    per_block = ["attn.c_k", "attn.c_proj", "attn.c_q", "attn.c_v", "mlp.c_fc", "mlp.c_proj"]
    assert swapped == [f"transformer.h.{i}.{n}" for i in range(2) for n in per_block]
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.transformer.wte.weight
    after = dict(model.named_parameters())
    assert list(after) == list(before) and all(after[n] is before[n] for n in before)  # same names, same objects


def test_an_moe_blocks_router_and_experts_stay_in_the_compute_dtype():
    config = make_config("tiny", n_layer=2, n_embd=64, vocab_size=128, block_size=32, moe_num_experts=4)
    model = convert_to_fp8(GPT(config), "rowwise")
    names = fp8_linear_names(model)
    assert not any("router" in n or "experts" in n for n in names)
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 2 * 4  # attention's four linears per Block


# ----------------------------------------------------------------------------- bad input


def test_check_fp8_refusals():
    good = linear_dims(GPT(CONFIG))
    assert good["transformer.h.0.mlp.c_fc"] == (64, 256)
    assert check_fp8("tensorwise", good, torch.bfloat16, tokens=128) is None
    assert check_fp8("rowwise", good, torch.float32) is None
    assert check_fp8("mxfp8", good, torch.bfloat16) == "--fp8 mxfp8: unknown recipe; choose one of tensorwise, rowwise"
    assert check_fp8("tensorwise", good, torch.float16).startswith("--fp8 with --dtype float16: ")
    odd = linear_dims(GPT(make_config("tiny", n_layer=1, n_head=4, n_embd=72, vocab_size=128, block_size=32)))
    line = check_fp8("tensorwise", odd, torch.bfloat16)
    assert line.startswith("--fp8: transformer.h.0.attn.c_q is 72 -> 72 features; torch._scaled_mm takes dimensions")
    assert check_fp8("rowwise", good, torch.bfloat16, tokens=6 * 63).startswith("--fp8: each linear sees 378 token")
    assert all("\n" not in s for s in (line, check_fp8("x", good, torch.float16)))


# ----------------------------------------------------------------------------- bench.fp8


def test_the_bench_table_gives_each_runs_gap_to_bf16():
    from bench import fp8 as bench_fp8

    rows = [
        {"name": "bf16", "val": {"0": 4.8, "50": 3.0, "100": 2.5}, "seconds_per_step": 1.0},
        {"name": "tensorwise", "val": {"0": 4.8, "50": 3.1, "100": 2.52}, "seconds_per_step": 2.0},
    ]
    md = bench_fp8.render(rows, {"steps": 100, "command": "python -m bench.fp8"})
    assert "| 50 | 3.0000 | 3.1000 |" in md
    assert "| tensorwise | 2.5200 | +0.0200 | +0.1000 | 2.00 |" in md


@pytest.mark.slow
def test_the_bench_trains_a_step_of_each_run(tmp_path):
    """bench.fp8 drives train.py's build, train_step and evaluate: 2 steps of each run, FP8 linears swapped in."""
    from bench import fp8 as bench_fp8

    assert bench_fp8.main(["--out", str(tmp_path), "--steps", "2", "--eval_interval", "1"]) == 0
    with open(tmp_path / "fp8.md") as f:
        assert "| rowwise |" in f.read()


# ----------------------------------------------------------------------------- the seam across ranks


def cut_casts(rank: int, world: int) -> dict:
    """A (8, 32) tensor cut by rows over 2 gloo ranks (rank 1's half holds the outlier): each rank's cast of its
    half with `max_over` against the one-process cast of the whole, tensorwise and rowwise along both dims."""
    from parallel import comm
    from parallel.fp8 import max_over

    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(5))
    x[6, 3] = 40.0
    mine = slice(4 * rank, 4 * rank + 4)
    comm.COUNTER.reset()
    out = {}
    for dim in (None, 0, -1):  # whole tensor; along the cut (columns span both ranks); along rows (each rank's own)
        data, scale = to_fp8(x[mine], E4M3, dim, pow2=dim is not None, reduce=max_over(None, cut=0))
        whole_data, whole_scale = to_fp8(x, E4M3, dim, pow2=dim is not None)
        whole_scale = whole_scale[mine] if dim == -1 else whole_scale
        out[dim] = torch.equal(bits(data), bits(whole_data[mine])) and torch.equal(scale, whole_scale)
    return {"equal": out, "bytes": comm.COUNTER.snapshot().get("all_reduce"), "calls": comm.COUNTER.calls["all_reduce"]}


def test_a_cut_tensor_casts_as_the_whole_with_max_over():
    """max_over reduces the amaxes that span the cut (tensorwise: 4 bytes; along the cut: 32 columns' 128 bytes) and
    leaves those that don't (each rank's own rows), and every rank's FP8 bits and scales are the whole's."""
    from tests.harness import run_distributed

    for r in run_distributed(cut_casts, 2):
        assert r["equal"] == {None: True, 0: True, -1: True}
        assert (r["bytes"], r["calls"]) == (4 + 32 * 4, 2)
