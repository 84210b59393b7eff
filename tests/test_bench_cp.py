"""bench/cp.py: the command builders' flags, the ratio arithmetic and tables on synthetic rows, the flag checks,
the saved-bytes count of one tiny forward + backward against a hand count, and one tiny C = 1 attention timing
(no training, no processes)."""

from __future__ import annotations

import sys

import pytest
import torch

from bench.cp import (
    comm_theory,
    cp_rows,
    measure_saved,
    memory_command,
    parse_args,
    time_attention,
    train_command,
)
from bench.cp_report import attention_markdown, markdown


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def build(seq_len: int, cp: int, **kw) -> list[str]:
    opts = dict(model="tiny", n_layer=2, rows=4, warmup=2, steps=4, dataset="/d")
    return train_command(seq_len, cp, "/o", **{**opts, **kw})


@pytest.mark.parametrize("seq_len,cp", [(128, 1), (256, 2), (512, 4)])
def test_train_command_rows_of_seq_len_in_one_micro_step(seq_len, cp):
    """total_batch_size = rows x seq_len whatever C, all in one micro-step (micro_batch_size = rows, so
    grad_accum = 1); no checkpoints; eval only after the last of warmup + steps."""
    cmd = build(seq_len, cp)
    assert flag(cmd, "--total_batch_size") == str(4 * seq_len) and flag(cmd, "--seq_len") == str(seq_len)
    assert flag(cmd, "--micro_batch_size") == "4"
    assert flag(cmd, "--max_steps") == "6" and int(flag(cmd, "--eval_interval")) > 6
    assert "--no_checkpoint" in cmd and flag(cmd, "--out_dir") == "/o"


def test_train_command_launcher_by_degree():
    """C = 1: plain python, no cp flag; C > 1: torchrun with C ranks and --context_parallel_size C."""
    one, four = build(128, 1), build(128, 4)
    assert one[0] == sys.executable and one[1].endswith("train.py") and "--context_parallel_size" not in one
    assert four[1:3] == ["-m", "torch.distributed.run"] and "--nproc_per_node=4" in four
    assert flag(four, "--context_parallel_size") == "4"
    assert "--peak_flops" not in one and flag(build(128, 1, peak_flops=1e9), "--peak_flops") == "1000000000.0"


def test_train_command_tp_point():
    """The TP point to compare with: tp ranks, our TP with sequence and loss parallelism, no cp flag."""
    cmd = build(256, 1, tp=2)
    assert "--nproc_per_node=2" in cmd and flag(cmd, "--tensor_parallel_size") == "2"
    assert "--sequence_parallel" in cmd and "--enable_loss_parallelism" in cmd and "--context_parallel_size" not in cmd


def test_memory_command_carries_cp_and_tp_in_the_json():
    cmd = memory_command(2, {"seq_lens": [128]})
    assert "--nproc_per_node=2" in cmd and cmd[-1] == '--worker={"seq_lens": [128], "cp": 2, "tp": 1}'
    assert memory_command(1, {})[:3] == [sys.executable, "-m", "bench.cp"]
    assert "--nproc_per_node=4" in memory_command(1, {}, tp=4)


def test_comm_theory_by_layout():
    """C: the ring's formula plus the gradient all-reduce; TP: the TP formula (SP + loss parallel); 1 rank: 0.
    Hand count for the ring, tiny (n_layer 2, n_embd 64), 4 rows, T = 128, C = 2: A = 4 * 64 * 64 * 4 bytes
    = 65536; per layer 2A forward + 6A backward = 8A; 2 layers: 16A = 1,048,576."""
    from model.gpt import make_config
    from plan.theory import tp_comm_bytes_per_micro_step

    cfg = make_config("tiny")
    assert comm_theory(cfg, 4, 128, 1, 1, 999) == 0
    assert comm_theory(cfg, 4, 128, 2, 1, 1000) == 1_048_576 + 1000
    assert comm_theory(cfg, 4, 128, 1, 2, 1000) == sum(
        tp_comm_bytes_per_micro_step(cfg, 4, 128, 2, True, True).values()
    )


def point(T, cp, tps, saved, attn, tp=1, comm=None, theory=None):
    return {
        "seq_len": T,
        "cp": cp,
        "tp": tp,
        "tokens_per_sec": tps,
        "peak_saved_bytes": saved,
        "attn_saved_bytes": attn,
        "comm_bytes": comm,
        "comm_theory": theory,
        "status": "ok",
    }


def test_ratios_against_c1_of_the_same_seq_len():
    """saved_ratio = bytes(C=1)/bytes(C), speedup = tps(C)/tps(C=1), per seq_len; rows sorted by (T, C)."""
    rows = cp_rows(
        [
            point(256, 2, 300.0, 500, 60),
            point(128, 1, 100.0, 400, 40),
            point(256, 1, 200.0, 1000, 100),
            point(128, 4, 50.0, 100, 10),
        ]
    )
    assert [(r["seq_len"], r["cp"]) for r in rows] == [(128, 1), (128, 4), (256, 1), (256, 2)]
    assert [r["saved_ratio"] for r in rows] == [1.0, 4.0, 1.0, 2.0]
    assert [r["attn_ratio"] for r in rows] == [1.0, 4.0, 1.0, 100 / 60]
    assert [r["speedup"] for r in rows] == [1.0, 0.5, 1.0, 1.5]


def test_tp_rows_after_the_cp_rows_against_the_same_baseline():
    rows = cp_rows(
        [
            point(128, 1, 50.0, 100, 10, tp=2, comm=30, theory=30),
            point(128, 2, 300.0, 500, 60, comm=20, theory=40),
            point(128, 1, 100.0, 1000, 100),
        ]
    )
    assert [(r["cp"], r["tp"]) for r in rows] == [(1, 1), (2, 1), (1, 2)]
    assert rows[2]["saved_ratio"] == 10.0 and rows[2]["speedup"] == 0.5 and rows[2]["comm_ratio"] == 1.0
    assert rows[1]["comm_ratio"] == 0.5 and rows[0]["comm_ratio"] is None


def test_ratios_none_when_a_measurement_is_missing():
    rows = cp_rows([point(128, 1, None, 400, 40), point(128, 2, 80.0, None, 20), point(256, 2, 80.0, 10, 5)])
    assert rows[1]["speedup"] is None and rows[1]["saved_ratio"] is None and rows[1]["attn_ratio"] == 2.0
    assert rows[2]["saved_ratio"] is None  # no C = 1 at 256


CONFIG = {"model": "tiny", "n_layer": 2, "n_embd": 64, "vocab_size": 50304, "rows": 4, "warmup": 2, "steps": 4}


def test_markdown_rows_and_oversubscription_note():
    rows = cp_rows(
        [point(128, 1, 1000.0, 2 * 2**20, 2**20), point(128, 4, 500.0, 2**19, 2**18, comm=2**21, theory=2**21)]
    )
    md = markdown(rows, {**CONFIG, "cpu_count": 2})
    assert "| 128 | 1 rank | 1,000 | 1.00 | 2.00 | 1.00 | 1.00 | 1.00 | — | — | ok |" in md
    assert "| 128 | C=4 | 500 | 0.50 | 0.50 | 4.00 | 0.25 | 4.00 | 2.00 | 1.000 | ok |" in md
    assert "4 ranks on 2 CPU cores is oversubscribed" in md
    assert "oversubscribed" not in markdown(rows, {**CONFIG, "cpu_count": 4})
    assert "ring / SDPA" not in md and "load average" not in md  # neither measured here


def test_markdown_attention_table_and_load_average():
    timed = {
        **CONFIG,
        "cpu_count": 2,
        "n_head": 4,
        "head_dim": 16,
        "load_average": [1.5, 2.25],
        "attention_c1": [{"seq_len": 128, "sdpa_ms": 2.0, "ring_ms": 2.5, "ratio": 1.25}],
    }
    md = markdown(cp_rows([point(128, 1, 1000.0, 2**20, 2**19)]), timed)
    assert "| 128 | 2.00 | 2.50 | 1.25 |" in md
    assert "q/k/v (4, 4, seq_len, 16) fp32" in md
    assert "load average (1 min) 1.50 at the start and 2.25 at the end, on 2 cores" in md
    assert attention_markdown([], 4, 4, 16) == []


def test_time_attention_times_both_one_thread():
    """A tiny timing: both medians positive, their ratio, and the thread count restored."""
    threads = torch.get_num_threads()
    t = time_attention(16, 2, 2, 8, reps=2)
    assert t["seq_len"] == 16 and t["sdpa_ms"] > 0 and t["ring_ms"] > 0
    assert t["ratio"] == pytest.approx(t["ring_ms"] / t["sdpa_ms"])
    assert torch.get_num_threads() == threads


def test_parse_args_checks_the_sweep():
    assert parse_args(["--out", "x"]).seq_lens == [128, 256, 512]
    assert parse_args(["--out", "x", "--cps", "1,2"]).cps == [1, 2]
    assert parse_args(["--out", "x"]).attn_reps == 5 and parse_args(["--out", "x", "--attn_reps", "0"]).attn_reps == 0
    for bad in (["--cps", "2,4"], ["--seq_lens", "20"], ["--seq_lens", "6", "--cps", "1,2"]):
        with pytest.raises(SystemExit):
            parse_args(["--out", "x", *bad])  # no C=1; 20 % (2 x 4) = 4; 6 % (2 x 2) = 2


def test_measure_saved_hand_count_one_process():
    """tiny GPT, vocab 64, 1 layer, B=2, T=8, fp32: U = B*T*n_embd*4 = 4096 bytes. The attention module saves
    ln_1's output, q, k, v, SDPA's output (c_proj's input is a view of it) = 5U, plus the log-sum-exp
    B*H*T*4 = 256. The whole peak is at least that plus the MLP's c_fc input (U), GELU's input (4U) and c_proj's
    input (4U), and the loss's targets B*T*8 = 128 (lm_head + loss are chunked: no logits are kept)."""
    from model.gpt import GPT, make_config

    torch.manual_seed(0)
    model = GPT(make_config("tiny", n_layer=1, vocab_size=64, block_size=8))
    x = torch.randint(0, 64, (2, 8))
    peak, attn = measure_saved(model, x, x)
    assert attn == 5 * 4096 + 256
    assert peak >= attn + 9 * 4096 + 2 * 8 * 8
    assert all(p.grad is not None for p in model.parameters())


def test_ulysses_points():
    """C > 1 by Ulysses: --cp_algorithm ulysses on train.py and in the worker's spec (the ring adds neither), and
    its formula: tiny, 4 rows, T = 128, C = 2: A = 4 x 64 x 64 x 4 bytes = 65,536, 8A a layer, 2 layers = 16A =
    1,048,576, the ring's at C = 2; at C = 4, A halves (32,768): Ulysses 16A = 524,288, the ring 2 x 20A = 1,310,720."""
    from model.gpt import make_config

    assert flag(build(128, 2, algorithm="ulysses"), "--cp_algorithm") == "ulysses"
    assert "--cp_algorithm" not in build(128, 2) and "--cp_algorithm" not in build(128, 1, algorithm="ulysses")
    assert '"algorithm": "ulysses"' in memory_command(2, {}, algorithm="ulysses")[-1]
    assert "algorithm" not in memory_command(2, {})[-1]
    cfg = make_config("tiny")
    assert comm_theory(cfg, 4, 128, 2, 1, 1000, "ulysses") == 1_048_576 + 1000
    assert comm_theory(cfg, 4, 128, 4, 1, 0, "ulysses") == 524_288
    assert comm_theory(cfg, 4, 128, 4, 1, 0) == 2 * 20 * 32_768


def test_ulysses_needs_c_to_divide_the_heads(capsys):
    """small has 6 heads: Ulysses at C = 4 is refused before any job, unless --n_head makes it whole."""
    with pytest.raises(SystemExit):
        parse_args(["--out", "/o", "--model", "small", "--cps", "1,2,4"])
    assert "Ulysses needs C to divide the heads (6): not C in [4]" in capsys.readouterr().err
    assert parse_args(["--out", "/o", "--model", "small", "--cps", "1,2,4", "--n_head", "8"]).n_head == 8
    assert parse_args(["--out", "/o", "--model", "small", "--cps", "1,2,4", "--algorithms", "ring"]).algorithms == (
        "ring",
    )
