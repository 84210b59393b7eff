"""`python -m bench --optimizer muon`: the flags it gives train.py, the per-step summary of Newton-Schulz's time and
the exchange's bytes, and one real DDP x2 job whose reported Muon bytes equal comm's count and a hand count (no
timing is asserted: only that the fields are the step's own)."""

import os

import bench.__main__ as cli
from bench import report, runner
from bench.matrix import Layout, Setup, comm_theory
from model.gpt import GPTConfig

# Small enough to run for real: V=128, block 32, L=2, C=16 (2 heads)
CFG = GPTConfig(block_size=32, vocab_size=128, n_layer=2, n_head=2, n_embd=16)


def make_setup(**kw) -> Setup:
    base = dict(
        model="tiny",
        config=CFG,
        seq_len=8,
        rows=8,
        micro_cap=8,
        warmup=1,
        steps=2,
        peak_flops=1e9,
        device="cpu",
        dataset="unused",
        timeout=120,
        optimizer="muon",
    )
    return Setup(**{**base, **kw})


def test_train_args_run_muon_without_a_checkpoint():
    lay = Layout("ddp", "custom", dp=2)
    args = make_setup().train_args(lay, "/x")
    assert args[args.index("--optimizer") + 1] == "muon" and "--no_checkpoint" in args
    plain = make_setup(optimizer="adamw").train_args(lay, "/x")
    assert "--optimizer" not in plain and "--no_checkpoint" not in plain


def record(step: int, ns: float, dt: float, a2a: int) -> dict:
    return {
        "step": step,
        "loss": 1.0,
        "tokens_per_sec": 1.0,
        "mfu": 0.1,
        "step_time_ms": dt,
        "muon_ns_ms": ns,
        "muon_orthogonalized": 6,
        "muon_sent_bytes": 6144,
        "comm_bytes": {"all_reduce": 100, "all_to_all": a2a},
    }


def test_summary_medians_and_the_exchange_in_theory():
    lay, setup = Layout("ddp", "custom", dp=2), make_setup(warmup=1)
    # step 1 is warm-up (dropped); the share is the median of each step's ratio, not a ratio of medians
    records = [
        record(1, 90.0, 100.0, 0),
        record(2, 10.0, 100.0, 6144),
        record(3, 30.0, 50.0, 6144),
        record(4, 20.0, 200.0, 6144),
    ]
    s = runner.summarize(records, setup.warmup)
    assert s["muon"] == {"ns_ms": 20.0, "ns_share": 0.1, "orthogonalized": 6, "sent_bytes": 6144, "all_to_all": 6144}
    row = runner.make_row(lay, [{"status": "ok", "summary": s, "seconds": 1.0, "out_dir": "/x"}], setup)
    plain = comm_theory(lay, setup)
    assert row["comm_theory_by_kind"]["all_to_all"] == plain.get("all_to_all", 0) + 6144
    assert row["comm_theory_bytes"] == sum(plain.values()) + 6144
    md = report.muon_markdown([row])
    assert "| ddp | 2 (2×1) | 100.0 | 20.0 | 10.0% | 6 | 6,144 | 6,144 | ok |" in md
    assert "6,144" in report.render_section([row])


def test_an_adamw_run_has_no_muon_numbers():
    s = runner.summarize([{k: v for k, v in record(2, 1.0, 1.0, 0).items() if not k.startswith("muon")}], 1)
    assert "muon" not in s
    assert "muon" not in runner.make_row(
        Layout("ddp", "custom", dp=2), [{"status": "ok", "summary": s, "seconds": 1.0, "out_dir": "/x"}], make_setup()
    )


def test_main_drops_the_twins_under_muon(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(runner, "probe_machine", lambda measure: {"device": "cpu", "count": 2, "name": "cpu"})
    monkeypatch.setattr(runner, "run_matrix", lambda lays, setup, *a, **k: seen.append((lays, setup)) or [])
    monkeypatch.setattr(cli.report, "write_outputs", lambda *a: None)
    cli.main(
        [
            "--quick",
            "--optimizer",
            "muon",
            "--layouts",
            "single,ddp,tp",
            "--peak_flops",
            "1e9",
            "--out",
            str(tmp_path),
            "--dataset",
            "unused",
        ]
    )
    lays, setup = seen[0]
    assert [(lay.name, lay.implementation) for lay in lays] == [("single", "none"), ("ddp", "custom"), ("tp", "custom")]
    assert setup.optimizer == "muon"


def owned_elements_by_hand(c: GPTConfig) -> int:
    """DDP x2, rank 0's Muon matrices: per Block q, k, v, attn.c_proj (C x C: NS FLOPs 5 (4C^3 + 2C^3)) and c_fc,
    mlp.c_proj (4C x C: 5 (16C^3 + 2C^3)). Owners by LPT over decreasing FLOPs: the 2L MLP matrices alternate
    between the two ranks, then the 4L attention ones: each rank owns L MLP and 2L attention matrices."""
    C, L = c.n_embd, c.n_layer
    return L * 4 * C * C + 2 * L * C * C


def test_ddp2_muon_bytes_equal_comm_and_the_hand_count(tmp_path):
    """A real 2-rank job: rank 0 sends each result it owns to the other rank, in bf16 (DDP needs no gather):
    2 (N - 1) x its owned elements, what comm counts of all_to_all, what the row reports."""
    data = cli.ensure_dataset("", str(tmp_path), CFG.vocab_size)
    setup = make_setup(dataset=data)
    row = runner.make_row(
        Layout("ddp", "custom", dp=2),
        [runner.run_layout(Layout("ddp", "custom", dp=2), setup, str(tmp_path), 0)],
        setup,
    )
    assert row["status"] == "ok", row["status"]
    m = row["muon"]
    expected = 2 * (2 - 1) * owned_elements_by_hand(CFG)
    assert (m["all_to_all"], m["sent_bytes"]) == (expected, expected)
    assert m["orthogonalized"] == 3 * CFG.n_layer  # half of the 6L matrices
    assert m["ns_ms"] > 0 and 0 < m["ns_share"] < 1
    assert os.path.exists(os.path.join(row["out_dirs"][0], "metrics.jsonl"))


# ----------------------------------------------------------------------------- bench.muon_vs_adamw


def test_sweep_flags_change_only_the_optimizer_and_its_lr():
    from bench import muon_vs_adamw as mva

    sweep = {r["name"]: r for r in mva.runs(adamw_lrs=(3e-3,), muon_lrs=(1e-2,), original_lrs=(0.02,))}
    assert sweep["adamw-lr0.003"]["flags"] == ["--lr", "0.003"]
    assert sweep["muon-match_rms_adamw-lr0.01"]["flags"] == [
        "--lr",
        "0.001",
        "--optimizer",
        "muon",
        "--muon_lr",
        "0.01",
        "--muon_adjust_lr_fn",
        "match_rms_adamw",
    ]
    cmd = mva.command(sweep["muon-original-lr0.02"], 600, 100, "/x")
    assert cmd[cmd.index("--max_steps") + 1] == "600" and "--no_checkpoint" in cmd
    assert cmd[cmd.index("--data_parallel_size") + 1] == "1" and cmd[-1] == "original"


def test_sweep_best_lr_per_optimizer_and_step_medians():
    from bench import muon_vs_adamw as mva

    rows = [
        {"optimizer": "adamw", "lr": lr, "status": "ok", "final": f, "val_loss": {0: 4.8, 600: f}, "seconds": 1.0}
        for lr, f in ((1e-3, 2.3), (3e-3, 2.1), (1e-2, 2.6))
    ]
    rows.append(
        {
            "optimizer": "adamw",
            "lr": 3e-2,
            "status": "failed (rc 3): nan",
            "final": None,
            "val_loss": {},
            "seconds": 1.0,
        }
    )
    assert mva.best(rows)["adamw"]["lr"] == 3e-3
    md = mva.render(rows, {"eval_iters": 20, "steps": 600, "command": "c", "machine": "m"})
    assert "| adamw | 0.003 | **4.8000** | **2.1000** |" in md and "| adamw | 0.001 | 4.8000 | 2.3000 |" in md
    records = [
        {"step": s, "loss": 1.0, "step_time_ms": t, "muon_ns_ms": n}
        for s, t, n in ((5, 1000.0, 900.0), (11, 100.0, 10.0), (12, 40.0, 20.0), (13, 200.0, 60.0))
    ]
    assert mva.step_times(records) == {"ms_per_step": 100.0, "ns_ms": 20.0, "ns_share": 0.3}
