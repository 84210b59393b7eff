"""`python -m debug diff`: the first module output or gradient where two `--trace_step` traces part.

Fast: synthetic traces written with debug/trace.py's own `piece` (one process, TP-like column shards, FSDP-like
flat shards cut anywhere), against the rules of debug/diff.py: pieces merge into the full tensor; bit-equal for
one layout twice, 1e-5 / 1e-4 relative across layouts; execution order (micro-batch, then module order, then
gradients backward); bad input in one line, exit 2. Slow: real train.py runs in tests/test_debug_diff_runs.py.
"""

from __future__ import annotations

import os
import unittest
from dataclasses import asdict

import pytest
import torch

from debug import diff, trace
from debug.__main__ import main
from model.gpt import PRESETS
from tests.harness import expect_train_error_in_process, make_token_bins

MODEL = asdict(PRESETS["tiny"])
ONE = {
    "pp": 1,
    "dp": 1,
    "dp_replicate": 1,
    "cp": 1,
    "tp": 1,
    "implementation": "custom",
    "dp_type": None,
    "sequence_parallel": False,
    "loss_parallel": False,
}
TP2 = {**ONE, "tp": 2}
DP2 = {**ONE, "dp": 2, "dp_type": "fsdp"}


def tensors(seed: int = 0) -> dict[tuple, torch.Tensor]:
    """A few records of each kind, named as the tiny model's modules and parameters."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for micro in (0, 1):
        for name in ("transformer.h.0.mlp", "transformer.h.1.ln_1", "transformer.h.1.mlp.c_fc"):
            width = 256 if name.endswith("c_fc") else 64
            out["forward", micro, name] = torch.randn(2, 8, width, generator=g)
        out["loss", micro, "lm_head"] = torch.rand(1, generator=g) + 5
    for name, shape in (
        ("transformer.h.0.attn.c_q.weight", (64, 64)),
        ("transformer.h.1.mlp.c_fc.bias", (256,)),
        ("transformer.h.1.mlp.c_proj.bias", (64,)),
    ):
        out["grad", None, name] = torch.randn(shape, generator=g) * 1e-3
    return out


def write(
    run: str,
    records: dict[tuple, torch.Tensor],
    layout: dict = ONE,
    split: str = "none",
    step: int = 1,
    model: dict = MODEL,
    skip_rank: int | None = None,
) -> str:
    """A trace of `records` as a run of `layout` would write it: whole on one rank, or on 2 ranks cut along
    the last dim ("columns", as TP's colwise shards) or at an arbitrary flat offset ("flat", as FSDP's shards)."""
    world = 1 if split == "none" else 2
    os.makedirs(os.path.join(run, trace.SUBDIR), exist_ok=True)
    for r in range(world):
        out = []
        for (kind, micro, name), full in records.items():
            shape = tuple(full.shape)
            if split == "columns" and full.dim() > 1:
                n = shape[-1] // 2
                axes = [range(s) for s in shape[:-1]] + [range(r * n, (r + 1) * n)]
                values = full[..., r * n : (r + 1) * n]
                out.append(trace.piece(kind, micro, name, shape, trace._runs(shape, axes), values))
            elif split == "flat" and full.numel() > 1:
                cut = full.numel() // 3  # not a row boundary
                lo, hi = (0, cut) if r == 0 else (cut, full.numel())
                values = full.reshape(-1)[lo:hi]
                out.append(trace.piece(kind, micro, name, shape, torch.tensor([[lo, hi - lo]]), values))
            elif r == 0:
                out.append(trace.piece(kind, micro, name, shape, torch.tensor([[0, full.numel()]]), full))
        meta = {
            "format": trace.FORMAT,
            "version": trace.VERSION,
            "step": step,
            "rank": r,
            "world_size": world,
            "model": model,
            "batch": {"micro_batch_size": 2, "seq_len": 8, "rows": 4, "seed": 1337},
            "dtype": "float32",
            "layout": layout,
        }
        if r != skip_rank:
            torch.save({"meta": meta, "records": out}, os.path.join(run, trace.SUBDIR, f"rank_{r:05d}.pt"))
    return run


def run_diff(a: str, b: str, capsys) -> tuple[int, list[str], str]:
    code = main(["diff", a, b])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def first(lines: list[str]) -> str:
    return next(line for line in lines if line.startswith("first divergence"))


def test_one_layout_twice_is_held_to_bit_equality(tmp_path, capsys):
    recs = tensors()
    a, b = write(str(tmp_path / "a"), recs), write(str(tmp_path / "b"), recs)
    code, lines, _ = run_diff(a, b, capsys)
    assert code == 0 and "bit-equal" in lines[2] and lines[-1].startswith("agree: 8 forward records and 3 gradients")
    nudged = dict(recs)
    w = recs["grad", None, "transformer.h.0.attn.c_q.weight"].clone()
    w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(1.0))  # one ulp
    nudged["grad", None, "transformer.h.0.attn.c_q.weight"] = w
    code, lines, _ = run_diff(a, write(str(tmp_path / "c"), nudged), capsys)
    assert code == 1 and first(lines) == "first divergence: gradient  transformer.h.0.attn.c_q.weight"
    assert "at [3, 5]" in lines[lines.index(first(lines)) + 1]


def test_shards_merge_into_the_full_tensor_and_layouts_get_their_tolerance(tmp_path, capsys):
    recs = tensors()
    a = write(str(tmp_path / "one"), recs)
    # TP column shards with a relative error of 1e-6 of each tensor's largest element: within TP's 1e-4
    g = torch.Generator().manual_seed(1)
    noisy = {k: v + 1e-6 * v.abs().max() * torch.randn(v.shape, generator=g) for k, v in recs.items()}
    code, lines, _ = run_diff(a, write(str(tmp_path / "tp"), noisy, TP2, "columns"), capsys)
    assert code == 0 and "tolerance 0.0001 relative" in lines[2], lines
    # the same error is beyond bit-equality, which one layout twice is held to
    code, _, _ = run_diff(a, write(str(tmp_path / "one_noisy"), noisy), capsys)
    assert code == 1
    # FSDP-like flat shards (cut inside rows), exactly the values: within 1e-5 (only float64 sums reordered)
    code, lines, _ = run_diff(a, write(str(tmp_path / "fsdp"), recs, DP2, "flat"), capsys)
    assert code == 0 and "tolerance 1e-05 relative" in lines[2], lines
    # one TP shard of an MLP bias gradient 1e-3 off: named, with the size of the difference
    bad = dict(noisy)
    bias = noisy["grad", None, "transformer.h.1.mlp.c_fc.bias"].clone()
    bias[128:] += 1e-3 * bias.abs().max()
    bad["grad", None, "transformer.h.1.mlp.c_fc.bias"] = bias
    code, lines, _ = run_diff(a, write(str(tmp_path / "tp_bad"), bad, TP2, "columns"), capsys)
    assert code == 1 and first(lines) == "first divergence: gradient  transformer.h.1.mlp.c_fc.bias", lines
    assert "128 of 256 elements differ" in lines[lines.index(first(lines)) + 1]
    assert lines[-1] == "1 of 11 records differ (0 forward, 1 gradients)"


def test_execution_order_forward_by_micro_batch_and_module_then_gradients_backward(tmp_path, capsys):
    recs = tensors()
    a = write(str(tmp_path / "a"), recs)
    bad = {k: v.clone() for k, v in recs.items()}
    for key in [
        ("grad", None, "transformer.h.0.attn.c_q.weight"),
        ("grad", None, "transformer.h.1.mlp.c_proj.bias"),
        ("forward", 1, "transformer.h.0.mlp"),
        ("forward", 0, "transformer.h.1.mlp.c_fc"),
        ("forward", 0, "transformer.h.1.ln_1"),
        ("loss", 0, "lm_head"),
    ]:
        bad[key] += 1.0
    code, lines, _ = run_diff(a, write(str(tmp_path / "b"), bad), capsys)
    named = [line.split(": ", 1)[1] for line in lines if line.startswith(("first divergence", "then"))]
    assert code == 1 and named == [
        "forward   micro-batch 0  transformer.h.1.ln_1",
        "forward   micro-batch 0  transformer.h.1.mlp.c_fc",
        "forward   micro-batch 0  lm_head  (its loss)",
        "forward   micro-batch 1  transformer.h.0.mlp",
        "gradient  transformer.h.1.mlp.c_proj.bias",
        "gradient  transformer.h.0.attn.c_q.weight",
    ]


def test_tensors_past_the_full_copy_size_are_compared_by_fingerprint(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(trace, "FULL_NUMEL", 16)  # every record here is fingerprint only
    recs = tensors()
    a = write(str(tmp_path / "a"), recs)
    records = torch.load(os.path.join(a, "trace", "rank_00000.pt"))["records"]
    assert all(("values" in r) == (r["kind"] == "loss") for r in records)  # only the 1-element losses are whole
    code, _, _ = run_diff(a, write(str(tmp_path / "flat"), recs, DP2, "flat"), capsys)
    assert code == 0
    w = recs["grad", None, "transformer.h.0.attn.c_q.weight"]
    sampled = set(trace.sample_positions("transformer.h.0.attn.c_q.weight", tuple(w.shape)))
    i = next(i for i in range(w.numel()) if i not in sampled)
    bad = dict(recs)
    bad["grad", None, "transformer.h.0.attn.c_q.weight"] = (
        w.reshape(-1).clone().index_add_(0, torch.tensor([i]), torch.tensor([10 * float(w.abs().max())])).view(w.shape)
    )
    code, lines, _ = run_diff(a, write(str(tmp_path / "b"), bad, DP2, "flat"), capsys)
    assert code == 1 and first(lines) == "first divergence: gradient  transformer.h.0.attn.c_q.weight"
    assert lines[lines.index(first(lines)) + 1].strip().startswith("sum ")  # not sampled: the sums part


@pytest.mark.parametrize(
    "case, needle",
    [
        ("missing", "no such run directory"),
        ("empty", "no trace"),
        ("step", "traces of different steps: 1 vs 2"),
        ("model", "traces of different models: n_layer 2 vs 3"),
        ("rank", "some ranks' files are missing"),
        ("args", "unrecognized arguments"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, needle):
    a = write(str(tmp_path / "a"), tensors())
    b = str(tmp_path / "b")
    if case == "empty":
        os.makedirs(b)
    elif case == "step":
        write(b, tensors(), step=2)
    elif case == "model":
        write(b, tensors(), model={**MODEL, "n_layer": 3})
    elif case == "rank":
        write(b, tensors(), TP2, "columns", skip_rank=1)
    argv = ["diff", a, b] + (["extra"] if case == "args" else [])
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.splitlines()) == 1, (out, err)
    assert err.startswith("debug diff: error: ") and needle in err, err


def test_tolerance_rule():
    meta = lambda **lay: {"layout": {**ONE, **lay}, "dtype": "float32"}
    assert diff.tolerance(meta(), meta()) == 0.0
    assert diff.tolerance(meta(dp=2, dp_type="ddp"), meta(dp=2, dp_type="ddp")) == 0.0
    assert diff.tolerance(meta(), meta(dp=2, dp_type="ddp")) == 1e-5
    assert diff.tolerance(meta(pp=2), meta(cp=2)) == 1e-5
    assert diff.tolerance(meta(tp=2), meta(dp=2, dp_type="fsdp")) == 1e-4
    assert diff.tolerance(meta(), {**meta(), "dtype": "bfloat16"}) == 2.0**-8
    assert diff.tolerance({**meta(), "device": "cuda"}, {**meta(), "device": "cuda"}) == 1e-5


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--compile"], "--trace_step records through module hooks"),
        (
            ["--implementation", "pytorch", "--context_parallel_size", "2"],
            "--trace_step cannot place the sequence shards",
        ),
    ],
)
def test_train_refuses_what_it_cannot_trace_in_one_line(tmp_path, flags, needle):
    data = make_token_bins(str(tmp_path / "data"), n_train=2000, n_val=500)
    args = [
        "--model",
        "tiny",
        "--micro_batch_size",
        "2",
        "--seq_len",
        "32",
        "--total_batch_size",
        "64",
        "--max_steps",
        "2",
        "--trace_step",
        "1",
        "--dataset",
        data,
        *flags,
    ]
    expect_train_error_in_process(unittest.TestCase(), args, needle, str(tmp_path / "out"))
