"""The bench's plots, written beside bench.md (bench/report.py): throughput, memory and communication vs world size
per layout, and with --include_zero the ZeRO memory ladder, with --include_moe the experts' load per step. Each
from bench.json's rows; none if matplotlib does not import."""

from __future__ import annotations

import os

from bench.matrix import Setup, comm_curves

MiB = 2**20


def ring_bytes(by_kind: dict[str, int], n: int) -> float:
    """Bytes a rank sends on a ring for these payloads: 2(N-1)/N per all-reduce, (N-1)/N per gather/scatter."""
    return sum(v * (2 if k == "all_reduce" else 1) * (n - 1) / n for k, v in by_kind.items())


def tick_label(row: dict) -> str:
    """A row's tick label: layout, implementation ("—" for a one-process row), ranks."""
    impl = "—" if row["implementation"] == "none" else row["implementation"]
    return f"{row['layout']}\n{impl}\n{row['nproc']} rk"


def bar_color(row: dict) -> str:
    """A row's bar: gray for one process, blue for our wrappers, orange for PyTorch's."""
    return (
        "tab:gray"
        if row["implementation"] == "none"
        else ("tab:blue" if row["implementation"] == "custom" else "tab:orange")
    )


def write_plots(rows: list[dict], setup: Setup, out: str) -> list[str]:
    """throughput.png, memory.png, comm_vs_world.png, and where their rows ran memory_ladder.png and moe_load.png;
    the names written. [] (and one line saying why) if matplotlib won't import."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"[bench] plots skipped: matplotlib does not import ({e}); pip install -r requirements.txt", flush=True)
        return []
    write_throughput(rows, setup, out, plt)
    write_memory(rows, out, plt)
    write_comm_vs_world(rows, setup, out, plt)
    names = ["throughput", "memory", "comm_vs_world"]
    if write_memory_ladder(rows, setup, out, plt):
        names.append("memory_ladder")
    if write_moe_load(rows, out, plt):
        names.append("moe_load")
    return names


def write_throughput(rows: list[dict], setup: Setup, out: str, plt) -> None:
    """throughput.png: each row's tokens/s (median), its MFU on the bar (or its status where it failed)."""
    x = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    tps = [r["tokens_per_sec"] or 0 for r in rows]
    ax.bar(x, tps, color=[bar_color(r) for r in rows])
    for i, r in enumerate(rows):
        text = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else r["status"].split(":")[0]
        ax.text(i, tps[i], text, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [tick_label(r) for r in rows], fontsize=7)
    ax.set_ylabel("tokens/s (median)")
    ax.set_title(f"Throughput per layout ({setup.model}, {setup.global_batch_tokens} tokens/step; MFU on bars)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "throughput.png"), dpi=120)
    plt.close(fig)


def write_memory(rows: list[dict], out: str, plt) -> None:
    """memory.png: rank 0's peak memory beside its state (params + grads + optimizer state), per row."""
    x = list(range(len(rows)))
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.4 * len(rows)), 4))
    for ax, key, title in (
        (axes[0], "peak_memory_bytes", "peak memory, rank 0"),
        (axes[1], "state_bytes", "params + grads + optimizer state, rank 0"),
    ):
        ax.bar(x, [(r[key] or 0) / MiB for r in rows], color=[bar_color(r) for r in rows])
        ax.set_xticks(x, [tick_label(r) for r in rows], fontsize=7)
        ax.set_ylabel("MiB")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "memory.png"), dpi=120)
    plt.close(fig)


COMM_COLORS = {
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
}  # comm_vs_world.png's colour of each layout


def write_comm_vs_world(rows: list[dict], setup: Setup, out: str, plt) -> None:
    """comm_vs_world.png: each layout's theory (`comm_curves`: the payload, and the ring bytes a rank sends) over
    world sizes 2..16, log scale; our rows measured (x), and the theory of a layout without a curve (o)."""
    world, style = list(range(2, 17)), COMM_COLORS
    fig, ax = plt.subplots(figsize=(7, 4.5))
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
