"""bench/cp.py's tables and figures: the rows (one per seq_len and layout) as markdown, the sequence-length
figure (tokens/s and saved bytes per rank against seq_len) and ring against Ulysses as C grows (bytes and
tokens/s), and the C = 1 attention timing's table. Nothing here measures."""

from __future__ import annotations

MiB = 2**20


def layout(p: dict) -> str:
    if p.get("tp", 1) > 1:
        return f"TP={p['tp']}"
    return "1 rank" if p["cp"] == 1 else f"C={p['cp']}" + (" Ulysses" if p.get("algorithm") == "ulysses" else "")


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "—" if value is None else format(value / scale, spec)


def markdown(rows: list[dict], config: dict) -> str:
    """The table (one line per (seq_len, C)) and notes: what was run, and oversubscription when max C > cores."""
    lines = [
        "| seq_len | layout | tokens/s | speedup vs 1 rank | peak saved / rank (MiB) | ratio 1 rank / this "
        "| attention saved / rank (MiB) | attn ratio | comm / step / rank (MiB) | measured / formula | status |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['seq_len']} | {layout(r)} | {_fmt(r.get('tokens_per_sec'), ',.0f')} "
            f"| {_fmt(r['speedup'], '.2f')} | {_fmt(r.get('peak_saved_bytes'), '.2f', MiB)} "
            f"| {_fmt(r['saved_ratio'], '.2f')} | {_fmt(r.get('attn_saved_bytes'), '.2f', MiB)} "
            f"| {_fmt(r['attn_ratio'], '.2f')} | {_fmt(r.get('comm_bytes'), '.2f', MiB)} "
            f"| {_fmt(r.get('comm_ratio'), '.3f')} | {r.get('status', 'ok')} |"
        )
    lines += [
        "",
        f"- model {config['model']} (n_layer {config['n_layer']}, n_embd {config['n_embd']}, vocab "
        f"{config['vocab_size']}); every run: {config['rows']} rows x seq_len tokens per step "
        f"(the same for every C at one seq_len, one micro-step), {config['warmup']} warm-up + {config['steps']} "
        "measured steps, median tokens/s (global batch / step time)",
        "- saved: distinct non-parameter storages autograd holds for backward, peak over one forward + "
        "backward of one micro-batch on rank 0 (bench.pipeline.SavedBytes); ratio = bytes(C=1) / bytes(C) "
        "at the same seq_len, expected about C",
        "- attention: the part saved inside the attention modules; the ring saves what SDPA saves, at T/C "
        "tokens, so expect C; Ulysses also keeps its output twice (by heads for SDPA's backward, by tokens for "
        "c_proj), so expect less",
        "- comm formula under Ulysses: its 8 all-to-alls a layer (context_parallel/theory.py) + the gradient "
        "all-reduce",
        "- TP rows: our TP with sequence and loss parallelism on the same rows (each tp rank sees every row); "
        "comm: rank 0's parallel/comm.py count per step (median), against the ring + gradient all-reduce "
        "(C) or TP formula (bench.cp.comm_theory)",
    ]
    cores = config.get("cpu_count")
    if config.get("load_average"):
        start, end = config["load_average"]
        lines.append(f"- load average (1 min) {start:.2f} at the start and {end:.2f} at the end, on {cores} cores")
    big = max((r["cp"] * r.get("tp", 1) for r in rows), default=1)
    if cores is not None and big > cores:
        lines.append(
            f"- {big} ranks on {cores} CPU cores is oversubscribed: the ranks share the cores, so "
            f"tokens/s with more than {cores} ranks measures contention as much as the ring (one thread "
            "per rank)"
        )
    lines += attention_markdown(
        config.get("attention_c1") or [], config["rows"], config.get("n_head", "H"), config.get("head_dim", "D")
    )
    return "\n".join(lines) + "\n"


def attention_markdown(timings: list[dict], rows: int, n_head: int, head_dim: int) -> list[str]:
    """The C = 1 ring-vs-SDPA table's lines (none without timings)."""
    if not timings:
        return []
    lines = ["", "| seq_len | SDPA fwd+bwd (ms) | ring C=1 fwd+bwd (ms) | ring / SDPA |", "|---:|---:|---:|---:|"]
    lines += [f"| {t['seq_len']} | {t['sdpa_ms']:.2f} | {t['ring_ms']:.2f} | {t['ratio']:.2f} |" for t in timings]
    lines += [
        "",
        f"- one attention, q/k/v ({rows}, {n_head}, seq_len, {head_dim}) fp32, forward + backward on one "
        "thread in the bench's process (bench.cp.time_attention): SDPA as a 1-rank run calls it, and "
        "ring_attention with one rank (its fused kernel calls, no communication); medians",
    ]
    return lines


def plot(rows: list[dict], path: str) -> None:
    """Two panels: tokens/s vs seq_len, one line per C; peak saved bytes per rank vs seq_len, log y."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(layout(r) for r in rows):
        rs = [r for r in rows if layout(r) == name]
        style = {"marker": "s", "linestyle": "--"} if name.startswith("TP") else {"marker": "o"}
        pts = [(r["seq_len"], r["tokens_per_sec"]) for r in rs if r.get("tokens_per_sec")]
        if pts:
            ax_t.plot(*zip(*pts), label=name, **style)
        pts = [(r["seq_len"], r["peak_saved_bytes"] / MiB) for r in rs if r.get("peak_saved_bytes")]
        if pts:
            ax_m.plot(*zip(*pts), label=name, **style)
    seq = sorted({r["seq_len"] for r in rows})
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_xticks(seq, [str(s) for s in seq])
        ax.set_xlabel("sequence length (tokens)")
        ax.grid(alpha=0.3)
        ax.legend()
    ax_t.set_ylabel("tokens/s (median, global)")
    ax_t.set_title("throughput, same rows per step")
    ax_m.set_yscale("log")
    ax_m.set_ylabel("peak saved activations per rank (MiB)")
    ax_m.set_title("saved for backward, rank 0")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_algorithms(rows: list[dict], path: str) -> None:
    """Ring against Ulysses as C grows, at the longest seq_len: comm bytes per step per rank (measured) and
    tokens/s (the 1-rank point at C = 1 for both)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = max(r["seq_len"] for r in rows)
    at = [r for r in rows if r["seq_len"] == T and r.get("tp", 1) == 1]
    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    for algorithm, style in (("ring", {"marker": "o"}), ("ulysses", {"marker": "s", "linestyle": "--"})):
        rs = sorted((r for r in at if r["cp"] == 1 or r.get("algorithm") == algorithm), key=lambda r: r["cp"])
        pts = [(r["cp"], r["comm_bytes"] / MiB) for r in rs if r["cp"] > 1 and r.get("comm_bytes")]
        if pts:
            ax_b.plot(*zip(*pts), label=algorithm, **style)
        pts = [(r["cp"], r["tokens_per_sec"]) for r in rs if r.get("tokens_per_sec")]
        if pts:
            ax_t.plot(*zip(*pts), label=algorithm, **style)
    cps = sorted({r["cp"] for r in at})
    for ax in (ax_b, ax_t):
        ax.set_xticks(cps, [str(c) for c in cps])
        ax.set_xlabel("C (context-parallel ranks)")
        ax.grid(alpha=0.3)
        ax.legend()
    ax_b.set_ylabel("comm bytes per step, rank 0 (MiB)")
    ax_b.set_title(f"sent per step at seq_len {T} (+ the gradient all-reduce)")
    ax_t.set_ylabel("tokens/s (median, global)")
    ax_t.set_title(f"throughput at seq_len {T}, same rows per step")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
