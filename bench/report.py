"""What a bench run writes: bench.json and bench_meta.json, bench.md (tables and notes), the README results snippet,
and the plots (bench/plots.py: throughput, memory, communication vs world size). With --include_pp, bench.md and the
snippet also carry bench.pipeline's idle fraction measured vs theory and link its pipeline/pipeline_timeline.png.
With --include_moe, bench.md gets a mixture-of-experts section (tokens/s and MFU ratios, all_to_all bytes against
the formula, the experts' load per step) and moe_load.png."""

from __future__ import annotations

import json
import os

from bench.matrix import Setup
from bench.plots import write_plots

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
    lines = _moe_speed_table(ratios)
    ep = [x["row"] for x in ratios if x["row"]["moe"]["ep"] > 1]
    if ep:
        lines += _moe_all_to_all_table(ep)
    per = [x["row"] for x in ratios if x["row"]["moe"].get("per_step")]
    if per:
        lines += _moe_load_table(per)
    if heatmap:
        lines += ["![moe_load](moe_load.png)", ""]
    return "\n".join(lines)


def _moe_speed_table(ratios: list[dict]) -> list[str]:
    """Per MoE-section row (`moe_ratios`): its experts, parameters (active), tokens/s, MFU, median max/mean load and
    its tokens/s ratios to the reference rows."""
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
    return lines + [
        "",
        "Ratios: this row's tokens/s ÷ the named row's (medians). MFU counts 6 × the active parameters "
        "(the experts' K/E share, metrics.active_params) + attention, so the MoE and dense-active rows "
        "count nearly the same FLOPs per token.",
        "",
    ]


def _moe_all_to_all_table(ep: list[dict]) -> list[str]:
    """Per expert-parallel row: rank 0's all_to_all bytes per step against the formula, balanced and at the
    measured load, and its all_reduce against DDP's on the dense parameters."""
    lines = [
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
    return lines + [
        "",
        "Bytes are payload bytes (parallel/comm.py counts each all_to_all's input on the sending rank).",
        "",
    ]


def _moe_load_table(per: list[dict]) -> list[str]:
    """Each MoE layer's max/mean tokens per expert, a column per (row, layer), a line per step (warm-up marked)."""
    head, sep = ["| step"], ["|---:"]
    for r in per:
        for layer in r["moe"]["per_step"]["max_over_mean"][0]:
            head.append(f"{r['layout']} layer {layer}")
            sep.append("---:")
    lines = [
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
    return lines + [""]


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
