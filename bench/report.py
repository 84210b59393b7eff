"""What a bench run writes: bench.json and bench_meta.json, bench.md (tables and notes), the README
results snippet, and the plots (throughput, memory, communication vs world size). With --include_pp,
bench.md and the snippet also carry bench.pipeline's idle fraction measured vs theory and link its
pipeline/pipeline_timeline.png. With --include_moe, bench.md gets a mixture-of-experts section (tokens/s and MFU
ratios, all_to_all bytes against the formula, the experts' load per step) and moe_load.png."""

from __future__ import annotations

import json
import os

from bench.matrix import Setup, comm_curves

MiB = 2**20
TP_SOURCE = "parallel.tensor_parallel.apply.tp_comm_bytes_per_micro_step"


def _mib(x) -> str:
    return "—" if x is None else f"{x / MiB:,.1f}"


def _num(x, fmt: str = "{:,.0f}") -> str:
    return "—" if x is None else fmt.format(x)


def _impl(row: dict) -> str:
    return "—" if row["implementation"] == "none" else row["implementation"]


def _ranks(row: dict) -> str:
    if (row.get("moe") or {}).get("ep", 1) > 1:
        return f"{row['nproc']} ({row['dp']}×{row['tp']}, EP {row['moe']['ep']})"
    if row.get("pp", 1) > 1:
        return f"{row['nproc']} (pp{row['pp']}×dp{row['dp']}×tp{row['tp']})"
    if row.get("replicate", 1) > 1:
        return f"{row['nproc']} ({row['replicate']}×{row['dp'] // row['replicate']} HSDP×{row['tp']})"
    return f"{row['nproc']} ({row['dp']}×{row['tp']})"


def _kinds(d: dict | None) -> str:
    if not d:
        return "—"
    short = {
        "all_reduce": "AR",
        "all_gather": "AG",
        "reduce_scatter": "RS",
        "broadcast": "BC",
        "p2p": "P2P",
        "all_to_all": "A2A",
    }
    parts = [f"{short.get(k, k)} {v / MiB:,.2f}" for k, v in d.items() if v]
    return " / ".join(parts) or "0"


def results_table(rows: list[dict]) -> str:
    head = (
        "| layout | impl | ranks (dp×tp; PP: pp×dp×tp) | tokens/s | MFU | peak mem/rank (MiB) | state/rank (MiB) "
        "| comm/step measured (MiB) | by kind (MiB) | theory (MiB) | theory by kind (MiB) | measured/theory "
        "| status |\n|---|---|---|---:|---:|---:|---:|---:|---|---:|---|---:|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            " | ".join(
                [
                    f"| {r['layout']}",
                    _impl(r),
                    _ranks(r),
                    _num(r["tokens_per_sec"]),
                    _num(None if r["mfu"] is None else 100 * r["mfu"], "{:.1f}%"),
                    _mib(r["peak_memory_bytes"]),
                    _mib(r["state_bytes"]),
                    _mib(r["comm_bytes"]),
                    _kinds(r["comm_bytes_by_kind"]),
                    _mib(r["comm_theory_bytes"]),
                    _kinds(r["comm_theory_by_kind"]),
                    _num(r["comm_ratio"], "{:.3f}"),
                    r["status"] + " |",
                ]
            )
        )
    return "\n".join(lines)


def pair_ratios(rows: list[dict]) -> list[dict]:
    """custom tokens/s ÷ pytorch tokens/s for each layout that has both."""
    by = {(r["layout"], r["implementation"]): r for r in rows}
    out = []
    for layout in dict.fromkeys(r["layout"] for r in rows):
        c, p = by.get((layout, "custom")), by.get((layout, "pytorch"))
        if c is None or p is None:
            continue
        ratio = c["tokens_per_sec"] / p["tokens_per_sec"] if c["tokens_per_sec"] and p["tokens_per_sec"] else None
        out.append({"layout": layout, "custom": c["tokens_per_sec"], "pytorch": p["tokens_per_sec"], "ratio": ratio})
    return out


def ratio_table(rows: list[dict]) -> str:
    lines = ["| layout | custom tokens/s | pytorch tokens/s | custom / pytorch |", "|---|---:|---:|---:|"]
    for p in pair_ratios(rows):
        lines.append(f"| {p['layout']} | {_num(p['custom'])} | {_num(p['pytorch'])} | {_num(p['ratio'], '{:.2f}')} |")
    return "\n".join(lines)


def flops(x: float) -> str:
    return f"{x / 1e12:.4g} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.4g} GFLOP/s"


def setup_line(rows: list[dict], meta: dict | None) -> str:
    r = rows[0]
    meta = meta or {}
    params = f" ({meta['params'] / 1e6:.1f}M params)" if meta.get("params") else ""
    return (
        f"`{r['model']}`{params}, global batch {r['global_batch_tokens']:,} tokens (seq_len {r['seq_len']}), "
        f"{meta.get('steps', '?')} measured steps after {meta.get('warmup', '?')} warm-up, on "
        f"{meta.get('machine', r['device'])}; peak {flops(r['peak_flops'])} per device"
    )


def render_markdown(rows: list[dict], meta: dict) -> str:
    notes = [
        "- tokens/s: median over the measured steps (median of repeats); MFU against the peak above.",
        "- peak mem: rank 0's peak (CUDA allocator peak on GPU, process peak RSS on CPU); state: rank 0's "
        "parameters + gradients + optimizer state.",
        "- comm: payload bytes rank 0's wrappers sent per optimizer step (parallel/comm.py), median; PyTorch "
        "layouts bypass our counter (—). Theory: DDP Ψ per step; FSDP per micro-step all-gather 2Ψ_blocks + "
        f"Ψ_root and reduce-scatter Ψ; TP per {TP_SOURCE}; 2D: the DP term on this rank's TP shard of Ψ plus "
        "the TP term; PP (rank 0 = stage 0): P2P the M activations it sends forward, AR the tied-embedding "
        "gradient (wte's shard) plus DDP on stage 0's parameters and TP on its Blocks and embedding "
        "(bench.matrix.pp_comm_theory).",
    ]
    if meta.get("notes"):
        notes += [f"- {n}" for n in meta["notes"]]
    plots = "".join(
        f"![{p}]({p}.png)\n"
        for p in ("throughput", "memory", "comm_vs_world", "memory_ladder")
        if p in meta.get("plots", [])
    )
    pipeline = pipeline_markdown(meta["pipeline"]) if meta.get("pipeline") else ""
    if any("moe" in r for r in rows):
        pipeline += moe_markdown(rows, "moe_load" in meta.get("plots", []))
    if any("muon" in r for r in rows):
        pipeline += "\n" + muon_markdown(rows)
    return "\n".join(
        [
            "# Parallel layouts benchmark",
            "",
            setup_line(rows, meta) + ".",
            "",
            f"Command: `{meta.get('command', '')}`",
            "",
            f"Machine: {meta.get('machine', '')}; torch {meta.get('torch', '')}; peak "
            f"{rows[0]['peak_flops']:.4g} FLOP/s per device ({meta.get('peak_source', '')}); "
            f"wall time {meta.get('wall_seconds', 0):.0f} s.",
            "",
            results_table(rows),
            "",
            "Custom / PyTorch throughput:",
            "",
            ratio_table(rows),
            "",
            *notes,
            "",
            plots,
            pipeline,
        ]
    )


def _pipeline_title(info: dict) -> str:
    return (
        f"Pipeline schedules (`python -m bench.pipeline`, P={info['pp']}, M={info['micro']}, "
        f"V={info['virtual']} for interleaved)"
    )


def pipeline_markdown(info: dict) -> str:
    """bench.md's pipeline section: per schedule idle measured vs theory, span and saved activations, and
    the timeline plot; or why bench.pipeline failed."""
    lines = [f"## {_pipeline_title(info)}", ""]
    if "error" in info:
        return "\n".join(lines + [f"failed: {info['error']}", ""])
    lines += [
        "| schedule | idle measured (all ranks) | idle theory | span (ms) | peak saved/rank (MiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, s in info["summary"].items():
        lines.append(
            f"| {name} | {s['idle_fraction']:.3f} | {s['idle_theory']:.3f} | {1e3 * s['span_s']:.1f} "
            f"| {s['peak_saved_bytes_max'] / MiB:.2f} |"
        )
    lines += [
        "",
        "Idle theory is the bubble (P-1)/(M+P-1), interleaved (P-1)/(V·M+P-1), for equal stages and free messages; "
        "measured idle "
        "also holds stage imbalance, p2p latency and core contention. Per-rank table: "
        f"[{info['dir']}/pipeline.md]({info['dir']}/pipeline.md).",
        "",
        f"![pipeline_timeline]({info['dir']}/pipeline_timeline.png)",
        "",
    ]
    return "\n".join(lines)


MOE_REFS = (("moe", "moe", "none"), ("dense-active", "dense-active", "none"), ("ddp custom", "ddp", "custom"))


def moe_ratios(rows: list[dict]) -> list[dict]:
    """For each MoE-section row (moe, moe-ep, dense-active): its tokens/s ÷ that of moe (the MoE model on one
    process), of dense-active (the dense model of equal active parameters, one process) and of ddp custom (the
    dense model on the same ranks, when it ran and has as many ranks); None where either is missing."""
    by = {(r["layout"], r["implementation"]): r for r in rows}
    out = []
    for r in rows:
        if "moe" not in r:
            continue
        ratios = {}
        for label, layout, impl in MOE_REFS:
            ref = by.get((layout, impl))
            ok = (
                ref is not None
                and r["tokens_per_sec"]
                and ref["tokens_per_sec"]
                and (layout != "ddp" or ref["nproc"] == r["nproc"] > 1)
            )
            ratios[label] = r["tokens_per_sec"] / ref["tokens_per_sec"] if ok else None
        out.append({"row": r, "ratios": ratios})
    return out


def _loads(d: dict | None, fmt: str = "{:.2f}") -> str:
    return "—" if not d else " / ".join(fmt.format(v) for v in d.values())


def moe_markdown(rows: list[dict], heatmap: bool) -> str:
    """bench.md's mixture-of-experts section: per MoE layout tokens/s, MFU (active parameters) and their ratios;
    rank 0's all_to_all bytes per step against the formula at balanced routing and at the step's measured load;
    each MoE layer's max/mean tokens per expert per step; the heatmap."""
    ratios = moe_ratios(rows)
    lines = [
        "## Mixture of experts (`--include_moe`)",
        "",
        "| layout | ranks | experts (E, top-K, hidden) | params (active) | tokens/s | MFU (active) "
        "| max/mean load per layer (median) | ÷ moe | ÷ dense-active | ÷ ddp custom (dense, same ranks) | status |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for x in ratios:
        r, m = x["row"], x["row"]["moe"]
        model = f"{m['experts']}, {m['top_k']}, {m['expert_hidden']}" if m["experts"] else "dense"
        lines.append(
            " | ".join(
                [
                    f"| {r['layout']}",
                    _ranks(r),
                    model,
                    f"{m['params']:,} ({m['params_active']:,})",
                    _num(r["tokens_per_sec"]),
                    _num(None if r["mfu"] is None else 100 * r["mfu"], "{:.1f}%"),
                    _loads(m["max_over_mean"]),
                    *(_num(x["ratios"][label], "{:.2f}") for label, _, _ in MOE_REFS),
                    r["status"] + " |",
                ]
            )
        )
    lines += [
        "",
        "Ratios: this row's tokens/s ÷ the named row's (medians). MFU counts 6 × the active parameters "
        "(the experts' K/E share, metrics.active_params) + attention, so the MoE and dense-active rows "
        "count nearly the same FLOPs per token.",
        "",
    ]
    ep = [x["row"] for x in ratios if x["row"]["moe"]["ep"] > 1]
    if ep:
        lines += [
            "Rank 0's all_to_all bytes per optimizer step (median over the measured steps of every repeat) "
            "against plan.theory.ep_all_to_all_bytes_per_micro_step, at balanced routing (R = N·k rows "
            "received per rank) and at each step's measured load (the rows that reached rank 0's experts, "
            "from expert_tokens: bench.matrix.ep_all_to_all_at_load); all_reduce against DDP on the dense "
            "parameters:",
            "",
            "| layout | all_to_all measured | theory, balanced | measured / balanced | theory, measured load "
            "| measured / at load | steps exactly at load | all_reduce measured | all_reduce theory |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in ep:
            m, by, th = r["moe"], r["comm_bytes_by_kind"] or {}, r["comm_theory_by_kind"]
            a2a, bal, load = m["all_to_all"], th.get("all_to_all"), m["all_to_all_at_load"]
            exact = "—" if not m["all_to_all_exact_steps"] else "{} of {}".format(*m["all_to_all_exact_steps"])
            lines.append(
                " | ".join(
                    [
                        f"| {r['layout']}",
                        _num(a2a),
                        _num(bal),
                        _num(a2a / bal if a2a is not None and bal else None, "{:.4f}"),
                        _num(load),
                        _num(a2a / load if a2a is not None and load else None, "{:.4f}"),
                        exact,
                        _num(by.get("all_reduce")),
                        _num(th.get("all_reduce")) + " |",
                    ]
                )
            )
        lines += [
            "",
            "Bytes are payload bytes (parallel/comm.py counts each all_to_all's input on the sending rank).",
            "",
        ]
    per = [x["row"] for x in ratios if x["row"]["moe"].get("per_step")]
    if per:
        head, sep = ["| step"], ["|---:"]
        for r in per:
            for layer in r["moe"]["per_step"]["max_over_mean"][0]:
                head.append(f"{r['layout']} layer {layer}")
                sep.append("---:")
        lines += [
            "Each MoE layer's max/mean tokens per expert, per step (the first ok repeat; steps up to the "
            "warm-up marked w; 1.00 is perfectly balanced, E/K = "
            f"{per[0]['moe']['experts'] / per[0]['moe']['top_k']:.0f} the most possible):",
            "",
            " | ".join(head) + " |",
            "|".join(sep) + "|",
        ]
        steps = sorted({s for r in per for s in r["moe"]["per_step"]["steps"]})
        warm = per[0]["moe"].get("warmup")
        for step in steps:
            cells = [f"| {step}" + (" w" if warm is not None and step <= warm else "")]
            for r in per:
                ps = r["moe"]["per_step"]
                values = ps["max_over_mean"][ps["steps"].index(step)] if step in ps["steps"] else None
                cells += [f"{v:.2f}" for v in values.values()] if values else ["—"] * len(ps["max_over_mean"][0])
            lines.append(" | ".join(cells) + " |")
        lines.append("")
    if heatmap:
        lines += ["![moe_load](moe_load.png)", ""]
    return "\n".join(lines)


def render_section(rows: list[dict], meta: dict | None = None) -> str:
    """The README "Results" snippet: setup, the table (tokens/s, MFU, memory, comm vs theory), the ratios."""
    lines = [
        "### Parallel layouts (`python -m bench`)",
        "",
        setup_line(rows, meta) + ".",
        "",
        "| layout | impl | ranks | tokens/s | MFU | peak mem/rank | state/rank | comm/step (theory) |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['layout']} | {_impl(r)} | {_ranks(r)} | {r['status']} | | | | |")
            continue
        comm = _mib(r["comm_bytes"])
        comm = (
            f"{comm} MiB ({_mib(r['comm_theory_bytes'])})"
            if r["comm_bytes"] is not None
            else f"— ({_mib(r['comm_theory_bytes'])} MiB)"
        )
        lines.append(
            f"| {r['layout']} | {_impl(r)} | {_ranks(r)} | {_num(r['tokens_per_sec'])} | "
            f"{100 * r['mfu']:.1f}% | {_mib(r['peak_memory_bytes'])} MiB | {_mib(r['state_bytes'])} MiB | "
            f"{comm} |"
        )
    pairs = [p for p in pair_ratios(rows) if p["ratio"] is not None]
    if pairs:
        lines += ["", "Custom / PyTorch tokens/s: " + ", ".join(f"{p['layout']} {p['ratio']:.2f}" for p in pairs) + "."]
    lines += [
        "",
        "Comm is the payload our wrappers sent per optimizer step on rank 0 (parallel/comm.py) against "
        "theory (DDP Ψ, FSDP 2Ψ_blocks + Ψ_root all-gather and Ψ reduce-scatter per micro-step, TP per the "
        "Megatron formula, PP: stage 0's activations sent, tied-embedding all-reduce, and DDP/TP on stage 0 "
        "alone); PyTorch's collectives are not counted.",
    ]
    moe = [x for x in moe_ratios(rows) if x["row"]["moe"]["ep"] > 1 and x["row"]["tokens_per_sec"]]
    for x in moe:
        r = x["row"]
        named = ", ".join(f"{v:.2f}× {label}" for label, v in x["ratios"].items() if v is not None)
        lines += [
            "",
            f"Mixture of experts (E = {r['moe']['experts']}, top-{r['moe']['top_k']}): {r['layout']} on "
            f"{r['nproc']} ranks runs {named} (tokens/s).",
        ]
    if any("muon" in r for r in rows):
        lines += ["", muon_markdown(rows)]
    info = (meta or {}).get("pipeline")
    if info and "summary" in info:
        idle = ", ".join(
            f"{name} {s['idle_fraction']:.2f} ({s['idle_theory']:.2f})" for name, s in info["summary"].items()
        )
        lines += [
            "",
            f"{_pipeline_title(info)}: idle fraction measured (theory) {idle}; timelines in "
            f"{info['dir']}/pipeline_timeline.png.",
        ]
    return "\n".join(lines) + "\n"


def muon_markdown(rows: list[dict]) -> str:
    """The Muon table: per layout, rank 0's step time, its Newton-Schulz time and share of the step (medians over
    the measured steps), the matrices it orthogonalised, and the exchange's bytes it sent per step, counted by
    parallel/comm against Exchange.sent_bytes."""
    lines = [
        "Muon (`--optimizer muon`; rank 0, medians over the measured steps): Newton-Schulz (NS) time and its "
        "share of the step; the extra bytes Muon's exchange sends per step (all_to_all counted by parallel/comm "
        "against Exchange.sent_bytes, planned from what each rank holds; one process sends none).",
        "",
        "| layout | ranks | step (ms) | NS (ms) | NS share | matrices orthogonalised | Muon all_to_all "
        "(bytes/step) | planned | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        m = r.get("muon")
        if m is None:
            lines.append(f"| {r['layout']} | {_ranks(r)} | | | | | | | {r['status']} |")
            continue
        lines.append(
            f"| {r['layout']} | {_ranks(r)} | {_num(r['step_time_ms'], '{:.1f}')} | {m['ns_ms']:.1f} | "
            f"{100 * m['ns_share']:.1f}% | {m['orthogonalized']:g} | {_num(m['all_to_all'])} | "
            f"{m['sent_bytes']:,} | {r['status']} |"
        )
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- plots


def ring_bytes(by_kind: dict[str, int], n: int) -> float:
    """Bytes a rank sends on a ring for these payloads: 2(N-1)/N per all-reduce, (N-1)/N per gather/scatter."""
    return sum(v * (2 if k == "all_reduce" else 1) * (n - 1) / n for k, v in by_kind.items())


def write_plots(rows: list[dict], setup: Setup, out: str) -> list[str]:
    """throughput.png, memory.png, comm_vs_world.png; [] (and one line saying why) if matplotlib won't import."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"[bench] plots skipped: matplotlib does not import ({e}); pip install -r requirements.txt", flush=True)
        return []
    labels = [f"{r['layout']}\n{_impl(r)}\n{r['nproc']} rk" for r in rows]
    colors = [
        "tab:gray"
        if r["implementation"] == "none"
        else ("tab:blue" if r["implementation"] == "custom" else "tab:orange")
        for r in rows
    ]
    x = list(range(len(rows)))

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    tps = [r["tokens_per_sec"] or 0 for r in rows]
    ax.bar(x, tps, color=colors)
    for i, r in enumerate(rows):
        text = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else r["status"].split(":")[0]
        ax.text(i, tps[i], text, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("tokens/s (median)")
    ax.set_title(f"Throughput per layout ({setup.model}, {setup.global_batch_tokens} tokens/step; MFU on bars)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "throughput.png"), dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.4 * len(rows)), 4))
    for ax, key, title in (
        (axes[0], "peak_memory_bytes", "peak memory, rank 0"),
        (axes[1], "state_bytes", "params + grads + optimizer state, rank 0"),
    ):
        ax.bar(x, [(r[key] or 0) / MiB for r in rows], color=colors)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel("MiB")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "memory.png"), dpi=120)
    plt.close(fig)

    world = list(range(2, 17))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    style = {
        "ddp": "tab:blue",
        "fsdp": "tab:green",
        "tp": "tab:red",
        "2d-ddp": "tab:purple",
        "2d-fsdp": "tab:brown",
        "pp": "tab:olive",
        "pp-dp": "tab:cyan",
        "pp-tp": "tab:pink",
        "3d": "black",
        "zero1": "gold",
        "zero2": "darkorange",
        "hsdp": "darkgreen",
    }
    curves = comm_curves(setup, world)
    for name, ds in curves.items():
        ax.plot(world, [sum(d.values()) / MiB for d in ds], color=style[name], label=f"{name} theory (payload)")
        ax.plot(
            world,
            [ring_bytes(d, n) / MiB for d, n in zip(ds, world)],
            color=style[name],
            ls="--",
            lw=0.8,
            label=f"{name} theory (ring bytes sent)",
        )
    for r in rows:
        if r["implementation"] == "custom" and r["layout"] in style:
            if r["layout"] not in curves:  # a point of its own, no curve: 2D and the PP layouts
                ax.scatter(
                    [r["nproc"]],
                    [r["comm_theory_bytes"] / MiB],
                    facecolors="none",
                    edgecolors=style[r["layout"]],
                    s=60,
                    label=f"{r['layout']} theory",
                )
            if r["comm_bytes"] is not None:
                ax.scatter(
                    [r["nproc"]],
                    [r["comm_bytes"] / MiB],
                    color=style[r["layout"]],
                    marker="x",
                    s=60,
                    zorder=5,
                    label=f"{r['layout']} measured",
                )
    ax.set_yscale("log")
    ax.set_xlabel("world size N (N = 1: no communication)")
    ax.set_ylabel("MiB per rank per optimizer step")
    ax.set_title(f"Communication vs world size ({setup.model}, {setup.global_batch_tokens} tokens/step)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "comm_vs_world.png"), dpi=120)
    plt.close(fig)
    names = ["throughput", "memory", "comm_vs_world"]
    if write_memory_ladder(rows, setup, out, plt):
        names.append("memory_ladder")
    if write_moe_load(rows, out, plt):
        names.append("moe_load")
    return names


LADDER = ("ddp", "zero1", "zero2", "fsdp", "hsdp")  # the ZeRO paper's Figure 1 order, then HSDP


def ladder_formula(layout: str, psi: float, n: int, s: int) -> dict[str, float]:
    """The ZeRO paper's bytes per rank (fp32 Adam, Ψ = parameter bytes), params / grads / optimizer state."""
    return {
        "ddp": {"params": psi, "grads": psi, "optimizer": 2 * psi},
        "zero1": {"params": psi, "grads": psi, "optimizer": 2 * psi / n},
        "zero2": {"params": psi, "grads": psi / n, "optimizer": 2 * psi / n},
        "fsdp": {"params": psi / n, "grads": psi / n, "optimizer": 2 * psi / n},
        "hsdp": {"params": psi / s, "grads": psi / s, "optimizer": 2 * psi / s},
    }[layout]


def write_memory_ladder(rows: list[dict], setup: Setup, out: str, plt) -> bool:
    """memory_ladder.png: measured params / grads / optimizer state per rank (rank 0) of our DDP, ZeRO-1,
    ZeRO-2, ZeRO-3 and HSDP, stacked, next to the ZeRO paper's formula (outlined). False if no row has it."""
    from bench.matrix import param_count

    picked = [
        r
        for name in LADDER
        for r in rows
        if r["layout"] == name
        and r["implementation"] == "custom"
        and r["status"] == "ok"
        and r.get("state_bytes_by_kind")
    ]
    if not picked:
        return False
    psi = 4 * param_count(setup.config)
    fig, ax = plt.subplots(figsize=(1.6 * len(picked) + 2, 4.5))
    colors = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green"}
    for i, r in enumerate(picked):
        bottom, fbottom = 0.0, 0.0
        formula = ladder_formula(r["layout"], psi, r["dp"], r["dp"] // r.get("replicate", 1))
        for kind, color in colors.items():
            v = r["state_bytes_by_kind"][kind] / MiB
            ax.bar(i - 0.18, v, 0.34, bottom=bottom, color=color, label=kind if i == 0 else None)
            ax.bar(
                i + 0.18,
                formula[kind] / MiB,
                0.34,
                bottom=fbottom,
                fill=False,
                edgecolor=color,
                hatch="//",
                label=f"{kind} (formula)" if i == 0 else None,
            )
            bottom += v
            fbottom += formula[kind] / MiB
        ax.text(i - 0.18, bottom, f"{bottom:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(
        range(len(picked)),
        [
            f"{r['layout']}\nN={r['dp']}" + (f", R={r['replicate']}" if r.get("replicate", 1) > 1 else "")
            for r in picked
        ],
        fontsize=8,
    )
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"State per rank: measured (solid) vs the ZeRO formulas (hatched), Ψ = {psi / MiB:.1f} MiB")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "memory_ladder.png"), dpi=120)
    plt.close(fig)
    return True


def load_matrix(per_step: dict, ep: int = 1) -> tuple[list[str], list[int], list[list[float]]]:
    """A run's tokens per expert as (row labels "layer i, expert e" (+ ", rank r" that holds it under EP), steps,
    [row][step] tokens ÷ that layer's mean over its experts that step)."""
    layers = list(per_step["expert_tokens"][0])
    labels, grid = [], []
    for layer in layers:
        E = len(per_step["expert_tokens"][0][layer])
        for e in range(E):
            labels.append(f"layer {layer}, expert {e}" + (f", rank {e // (E // ep)}" if ep > 1 else ""))
            grid.append([tokens[layer][e] * E / max(1, sum(tokens[layer])) for tokens in per_step["expert_tokens"]])
    return labels, list(per_step["steps"]), grid


def write_moe_load(rows: list[dict], out: str, plt) -> bool:
    """moe_load.png: x = step, y = (MoE layer, expert), colour = the expert's tokens ÷ the layer's mean that step,
    for the moe-ep run (the first ok repeat; the one-process moe run if there is none). False if no row has it."""
    pick = [
        r
        for name in ("moe-ep", "moe")
        for r in rows
        if r["layout"] == name and r.get("moe") and r["moe"].get("per_step")
    ]
    if not pick:
        return False
    from matplotlib.colors import TwoSlopeNorm

    r = pick[0]
    labels, steps, grid = load_matrix(r["moe"]["per_step"], r["moe"]["ep"])
    flat = [v for row in grid for v in row]
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(min(flat), 0.9), vmax=max(max(flat), 1.1))
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(steps) + 3), max(3, 0.28 * len(labels) + 1.5)))
    im = ax.imshow(grid, aspect="auto", cmap="coolwarm", norm=norm, interpolation="nearest")
    if len(steps) * len(labels) <= 600:
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6)
    warm = r["moe"].get("warmup")
    if warm and any(s > warm for s in steps):
        ax.axvline(sum(s <= warm for s in steps) - 0.5, color="black", ls="--", lw=1)
    E = r["moe"]["experts"]
    for b in range(E, len(labels), E):
        ax.axhline(b - 0.5, color="black", lw=1)
    ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_xlabel("step (dashed: end of warm-up)")
    fig.colorbar(im, ax=ax, label="tokens / mean tokens per expert")
    ax.set_title(
        f"Tokens per expert ÷ mean, {r['layout']} ({r['nproc']} rank{'s' * (r['nproc'] > 1)}, E = {E}, "
        f"top-{r['moe']['top_k']})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(os.path.join(out, "moe_load.png"), dpi=120)
    plt.close(fig)
    return True


def write_outputs(rows: list[dict], meta: dict, setup: Setup, out: str) -> None:
    meta["plots"] = write_plots(rows, setup, out)
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out, "bench_meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(render_markdown(rows, meta))
    with open(os.path.join(out, "results_section.md"), "w") as f:
        f.write(render_section(rows, meta))
