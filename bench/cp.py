"""Context parallelism measured: a sequence-length sweep over C ranks, by the ring and by Ulysses, tokens/s and
saved activations per rank.

    python -m bench.cp --out out/cp [--model tiny] [--n_layer 2] [--n_head H] [--seq_lens 128,256,512]
                       [--cps 1,2,4] [--algorithms ring,ulysses] [--tps 2] [--steps 4] [--warmup 2] [--rows 4]
                       [--attn_reps 5]

Each C > 1 runs by each of --algorithms (`--cp_algorithm`: Ulysses needs C to divide the heads, --n_head).

For each (seq_len T, C) two things run, each as its own job (gloo, CPU, OMP_NUM_THREADS=1 per rank). Each
--tps degree runs the same way as a TP point to compare with (our TP with sequence and loss parallelism on
the same rows; tp = 1 turns it off), and every point's comm bytes per step are set against their formula
(`comm_theory`).

- **Throughput.** A real train.py run: `torchrun --nproc_per_node=C train.py --context_parallel_size C`
  (plain `python train.py` for C = 1). Every run trains --rows sequences of T tokens per step, in one
  micro-step (micro_batch_size = rows; each cp rank holds T/C tokens of every row): at one T the global
  batch in tokens is the same for every C, and it grows with T as the sequences do, for --warmup + --steps steps, with
  --no_checkpoint and no
  eval. tokens/s is the median of metrics.jsonl's tokens_per_sec (global batch / step time) over the steps
  after --warmup (bench.runner.summarize). Peak FLOP/s is measured once and passed to every run, so the
  runs spend no time on it.
- **Saved activations.** One small job per layout (all seq_lens in it): every rank builds the same GPT, applies
  apply_context_parallel (the ring) or apply_ulysses when C > 1, takes its zigzag share of one micro-batch
  (the rows above, seeded random tokens), and runs one forward + backward under bench.pipeline.SavedBytes.
  Counted: bytes of distinct non-parameter storages autograd holds for backward, live, so the peak is the
  most held at once (the end of forward); a storage saved by several ops counts once. Not counted:
  parameters, gradients, optimizer state, and temporaries that are never saved (the scores inside ring
  attention, backward's buffers). Per rank we report rank 0's peak (the zigzag split gives all ranks the
  same shapes; the max over ranks is kept in cp.json). "attention" is the part saved inside the attention
  modules (c_q/c_k/c_v's input, q/k/v, the kernel's output and statistics, c_proj's input), summed over
  layers. C = 1 runs in one process with PyTorch's SDPA, as train.py does. Per layer SDPA saves x (the
  ln_1 output), q, k, v, its output and the log-sum-exp; its CPU output is laid out (B, T, H, D), so
  c_proj's input is a view of it. The ring lays its output out the same way and saves the output itself (not
  an fp32 copy), so per layer it saves the same tensors at T/C: the attention ratio should be C.
- **One attention, C = 1.** Before the jobs, for each seq_len, `time_attention` times one attention's
  forward + backward on the rows' q, k, v in this process (one thread): plain SDPA against ring_attention on
  one rank, so the ratio is what the ring's kernel calls cost over SDPA's, communication aside.

Every saved activation is (B, T/C, ...) per rank, the logits included, and neither SDPA nor the ring saves
a T x T matrix, so both the whole peak and the attention part should fall by about C: the ratio column is
bytes(C=1) / bytes(C) at the same T. With more ranks than cores (4 ranks on 2 cores) the ranks share the
cores, so tokens/s there measures contention as much as the ring: cp.md says so.

Ulysses saves what the ring saves plus one output copy a layer (its output by heads for SDPA's backward and by
tokens for c_proj), so its attention ratio is below C.

Outputs in --out: cp.json (config, with the attention timings and the load average; rows), cp.md (the
tables), cp_seq_scaling.png (tokens/s vs T per layout; saved bytes per rank vs T, log scale) and, with Ulysses,
cp_ring_vs_ulysses.png (bytes per step and tokens/s against C at the longest T, bench.cp_report); runs/ holds
each job's log and metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from bench.cp_report import layout, markdown, plot, plot_algorithms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- commands --------------------------------------------------------------------------------------------


def launcher(nproc: int) -> list[str]:
    """How a job of `nproc` ranks starts: plain python for one, torchrun (standalone) for more."""
    if nproc == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def train_command(
    seq_len: int,
    cp: int,
    out_dir: str,
    *,
    model: str,
    n_layer: int | None,
    rows: int,
    warmup: int,
    steps: int,
    dataset: str,
    peak_flops: float | None = None,
    timeout: float = 600,
    tp: int = 1,
    algorithm: str = "ring",
    n_head: int | None = None,
) -> list[str]:
    """train.py for one (seq_len, C) point: the global batch (rows x seq_len tokens) in one micro-step on
    every cp rank, no checkpoints, no eval before the last step; C > 1 by `algorithm` (--cp_algorithm: the
    ring or Ulysses). tp > 1 (with cp = 1): the TP point to compare with, our TP with sequence and loss
    parallelism, each tp rank seeing all rows."""
    total = warmup + steps
    cmd = [
        *launcher(cp * tp),
        os.path.join(ROOT, "train.py"),
        "--model",
        model,
        "--dataset",
        dataset,
        "--seq_len",
        str(seq_len),
        "--block_size",
        str(max(seq_len, 1)),
        "--micro_batch_size",
        str(rows),
        "--total_batch_size",
        str(rows * seq_len),
        "--max_steps",
        str(total),
        "--warmup_steps",
        "1",
        "--eval_interval",
        str(total + 1),
        "--eval_iters",
        "1",
        "--no_checkpoint",
        "--timeout",
        str(int(timeout)),
        "--out_dir",
        out_dir,
        "--overwrite",
    ]
    if n_layer is not None:
        cmd += ["--n_layer", str(n_layer)]
    if n_head is not None:
        cmd += ["--n_head", str(n_head)]
    if peak_flops is not None:
        cmd += ["--peak_flops", repr(float(peak_flops))]
    if cp > 1:
        cmd += ["--context_parallel_size", str(cp)] + (["--cp_algorithm", algorithm] if algorithm != "ring" else [])
    if tp > 1:
        cmd += ["--tensor_parallel_size", str(tp), "--sequence_parallel", "--enable_loss_parallelism"]
    return cmd


def memory_command(cp: int, spec: dict, tp: int = 1, algorithm: str = "ring") -> list[str]:
    """The saved-bytes worker on cp x tp ranks; its flags travel as one JSON value (torchrun's own parser
    would take a prefix of some of them, see bench.pipeline)."""
    spec = {**spec, "cp": cp, "tp": tp} | ({"algorithm": algorithm} if algorithm != "ring" else {})
    return [*launcher(cp * tp), "-m", "bench.cp", f"--worker={json.dumps(spec)}"]


def comm_theory(cfg, rows: int, T: int, cp: int, tp: int, param_bytes: int, algorithm: str = "ring") -> int:
    """Bytes parallel/comm.COUNTER records on rank 0 for one step of a point: C > 1: the ring
    (cp_p2p_bytes_per_micro_step) or Ulysses's all-to-alls (ulysses_all_to_all_bytes_per_micro_step) plus our
    DDP's all-reduce of every gradient over the cp ranks (param_bytes, fp32, the tied matrix once); TP > 1:
    tp_comm_bytes_per_micro_step with SP and loss parallelism (no data parallelism there); one rank: nothing."""
    from plan.theory import (
        cp_p2p_bytes_per_micro_step,
        tp_comm_bytes_per_micro_step,
        ulysses_all_to_all_bytes_per_micro_step,
    )

    if tp > 1:
        return sum(tp_comm_bytes_per_micro_step(cfg, rows, T, tp, True, True).values())
    attention = ulysses_all_to_all_bytes_per_micro_step if algorithm == "ulysses" else cp_p2p_bytes_per_micro_step
    return attention(cfg.n_layer, rows, T, cfg.n_embd, cp) + (param_bytes if cp > 1 else 0)


# ---- from measurements to rows -----------------------------------------------------------------------------


def _order(p: dict) -> tuple:
    """Rows by seq_len, then C (the ring before Ulysses at one C), then the TP points."""
    return p["seq_len"], p.get("tp", 1) > 1, p["cp"], p.get("algorithm") == "ulysses", p.get("tp", 1)


def cp_rows(points: list[dict]) -> list[dict]:
    """Each point ({seq_len, cp, tokens_per_sec, peak_saved_bytes, attn_saved_bytes, ...}) with its ratios to
    the C = 1 point of the same seq_len: saved_ratio = bytes(C=1) / bytes(C) (about C when every activation is
    (B, T/C, ...)), attn_ratio likewise, speedup = tokens/s(C) / tokens/s(C=1). None where either is missing.
    Sorted by (seq_len, cp)."""
    base = {p["seq_len"]: p for p in points if p["cp"] == 1 and p.get("tp", 1) == 1}

    def ratio(num, den):
        return num / den if num is not None and den else None

    rows = []
    for p in sorted(points, key=_order):
        b = base.get(p["seq_len"], {})
        rows.append(
            {
                **p,
                "saved_ratio": ratio(b.get("peak_saved_bytes"), p.get("peak_saved_bytes")),
                "attn_ratio": ratio(b.get("attn_saved_bytes"), p.get("attn_saved_bytes")),
                "speedup": ratio(p.get("tokens_per_sec"), b.get("tokens_per_sec")),
                "comm_ratio": ratio(p.get("comm_bytes"), p.get("comm_theory")),
            }
        )
    return rows


# ---- the saved-bytes worker ----------------------------------------------------------------------------------


def measure_saved(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    """(peak saved bytes, bytes saved inside attention modules) over one forward + backward of (x, y)."""
    from bench.pipeline import SavedBytes
    from model.gpt import CausalSelfAttention

    attn = [0]
    with SavedBytes(exclude=list(model.parameters())) as saved:
        before = {}
        hooks = []
        for m in model.modules():
            if isinstance(m, CausalSelfAttention):
                hooks.append(m.register_forward_pre_hook(lambda mod, _: before.__setitem__(mod, saved.bytes)))
                hooks.append(
                    m.register_forward_hook(lambda mod, _, __: attn.__setitem__(0, attn[0] + saved.bytes - before[mod]))
                )
        _, loss = model(x, y)
        for h in hooks:
            h.remove()
        loss.backward()
    return saved.peak, attn[0]


def worker(spec: dict) -> None:
    """Every rank (or the one process when C = 1): per seq_len, build the model, take this rank's share of one
    micro-batch, measure; rank 0 writes {seq_len: {rank0, max over ranks, attention}} to spec['result']."""
    import torch.distributed as dist

    from model.gpt import GPT, make_config
    from parallel.context_parallel.ring import apply_context_parallel, shard_sequence
    from parallel.context_parallel.ulysses import apply_ulysses
    from parallel.tensor_parallel.apply import apply_tensor_parallel

    torch.set_num_threads(1)
    C, P = spec["cp"], spec.get("tp", 1)
    if C * P > 1:
        dist.init_process_group("gloo")
        assert dist.get_world_size() == C * P, (dist.get_world_size(), C, P)
    rank = dist.get_rank() if C * P > 1 else 0
    result = {}
    for T in spec["seq_lens"]:
        cfg = make_config(spec["model"], n_layer=spec["n_layer"], n_head=spec.get("n_head"), block_size=T)
        torch.manual_seed(0)
        model = GPT(cfg)
        if C > 1:
            cut = apply_ulysses if spec.get("algorithm") == "ulysses" else apply_context_parallel
            cut(model, dist.group.WORLD)
        if P > 1:  # as the TP rows train: sequence and loss parallelism
            apply_tensor_parallel(model, dist.group.WORLD, loss_parallel=True, sequence_parallel=True)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied matrix once
        g = torch.Generator().manual_seed(T)
        tokens = torch.randint(0, cfg.vocab_size, (spec["rows"], T + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        if C > 1:
            x, y = shard_sequence(x, rank, C), shard_sequence(y, rank, C)
        x, y = x.contiguous(), y.contiguous()
        peak, attn = measure_saved(model, x, y)
        peaks = [peak]
        if C * P > 1:
            peaks = [None] * (C * P)
            dist.all_gather_object(peaks, peak)
        result[T] = {
            "peak_saved_bytes": peaks[0],
            "peak_saved_bytes_max": max(peaks),
            "attn_saved_bytes": attn,
            "local_tokens": x.numel(),
            "n_embd": cfg.n_embd,
            "vocab_size": cfg.vocab_size,
            "n_layer": cfg.n_layer,
            "param_bytes": param_bytes,
        }
        del model
    if rank == 0:
        with open(spec["result"], "w") as f:
            json.dump(result, f)
    if C * P > 1:
        dist.destroy_process_group()


# ---- one attention, C = 1 ----------------------------------------------------------------------------------


def time_attention(seq_len: int, rows: int, n_head: int, head_dim: int, reps: int = 5) -> dict:
    """Forward + backward of one causal attention of (rows, n_head, seq_len, head_dim) fp32 q, k, v (views of
    (B, T, H, D) tensors, as the model makes them), on one thread in this process: F.scaled_dot_product_attention
    (model.AttentionCore, what a 1-rank run uses) against ring_attention with no group (C = 1: the ring's kernel
    calls and autograd Function, no communication). Median wall times of `reps` rounds after one warm-up round;
    the two alternate within a round, so load drift hits both."""
    import statistics
    import time

    import torch.nn.functional as F

    from parallel.context_parallel.ring import ring_attention

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        leaves = [torch.randn(rows, seq_len, n_head, head_dim, generator=g).requires_grad_() for _ in range(3)]
        dout = torch.randn(rows, n_head, seq_len, head_dim, generator=g)
        ways = {
            "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "ring": lambda q, k, v: ring_attention(q, k, v, None),
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        for rnd in range(reps + 1):
            for name, attend in ways.items():
                for t in leaves:
                    t.grad = None
                start = time.perf_counter()
                attend(*(t.transpose(1, 2) for t in leaves)).backward(dout)
                if rnd:
                    times[name].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    sdpa, ring = (1e3 * statistics.median(times[name]) for name in ("sdpa", "ring"))
    return {"seq_len": seq_len, "sdpa_ms": sdpa, "ring_ms": ring, "ratio": ring / sdpa}


# ---- the sweep ------------------------------------------------------------------------------------------------


Layout = tuple[int, int, str]  # (C, TP, the cp algorithm)


def tag(lay: Layout) -> str:
    """A layout's file names under runs/: c2, c2-ulysses, c1-tp2."""
    cp, tp, algorithm = lay
    return f"c{cp}" + (f"-tp{tp}" if tp > 1 else "") + ("-ulysses" if algorithm == "ulysses" else "")


def time_attentions(seq_lens: list[int], rows: int, cfg, reps: int, log=print) -> list[dict]:
    """`time_attention` at each seq_len (`reps` rounds; 0: none), logged."""
    out = [time_attention(T, rows, cfg.n_head, cfg.n_embd // cfg.n_head, reps) for T in seq_lens] if reps else []
    for t in out:
        log(
            f"[bench.cp] T={t['seq_len']:<5} one attention fwd+bwd, C=1: SDPA {t['sdpa_ms']:.1f} ms, ring "
            f"{t['ring_ms']:.1f} ms ({t['ratio']:.2f}x)"
        )
    return out


def measure_layouts(out: str, layouts: list[Layout], spec: dict, timeout: float, log=print) -> dict:
    """The saved-bytes worker, one job per layout (all seq_lens in it): {layout: {seq_len: its result}}."""
    from bench.runner import classify, run_job

    memory: dict[Layout, dict] = {}
    for lay in layouts:
        cp, tp, algorithm = lay
        result = os.path.join(out, "runs", f"saved-{tag(lay)}.json")
        cmd = memory_command(cp, {**spec, "result": result}, tp, algorithm)
        job = run_job(cmd, os.path.join(out, "runs", f"saved-{tag(lay)}.log"), timeout)
        if job.returncode == 0 and os.path.exists(result):
            with open(result) as f:
                memory[lay] = {int(k): v for k, v in json.load(f).items()}
        name = layout({"cp": cp, "tp": tp, "algorithm": algorithm})
        log(f"[bench.cp] saved bytes, {name}: {classify(job, {}, timeout)} ({job.seconds:.0f} s)")
    return memory


def train_point(out: str, T: int, lay: Layout, cfg, memory: dict, job: dict, log=print) -> dict:
    """One real train.py run of a (seq_len, layout) point (`job`: train_command's shared keywords), summarized,
    with its comm formula and the layout's saved bytes at T."""
    from bench.runner import classify, run_job, summarize
    from runtime.metrics import read_jsonl

    cp, tp, algorithm = lay
    run_dir = os.path.join(out, "runs", f"T{T}-{tag(lay)}")
    os.makedirs(run_dir, exist_ok=True)
    cmd = train_command(T, cp, run_dir, tp=tp, algorithm=algorithm, **job)
    ran = run_job(cmd, os.path.join(run_dir, "bench.log"), job["timeout"])
    wrote = os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
    s = summarize(read_jsonl(run_dir), job["warmup"]) if ran.returncode == 0 and wrote else None
    status = classify(ran, s, job["timeout"])
    mem = memory.get(lay, {}).get(T, {})
    full_params = memory.get((1, 1, "ring"), {}).get(T, {}).get("param_bytes")
    known = full_params or tp > 1 or cp == 1
    theory = comm_theory(cfg, job["rows"], T, cp, tp, full_params or 0, algorithm) if known else None
    point = {
        "seq_len": T,
        "cp": cp,
        "tp": tp,
        "algorithm": algorithm,
        "status": status,
        "comm_theory": theory,
        "tokens_per_sec": s and s["tokens_per_sec"],
        "step_time_ms": s and s["step_time_ms"],
        "mfu": s and s["mfu"],
        "comm_bytes": s and s["comm_bytes"],
        "peak_saved_bytes": mem.get("peak_saved_bytes"),
        "peak_saved_bytes_max": mem.get("peak_saved_bytes_max"),
        "attn_saved_bytes": mem.get("attn_saved_bytes"),
        "seconds": round(ran.seconds, 1),
    }
    rate = point["tokens_per_sec"]
    log(
        f"[bench.cp] T={T:<5} {layout(point)}: {status}"
        + (f", {rate:,.0f} tok/s" if rate else "")
        + f" ({ran.seconds:.0f} s)"
    )
    return point


def write_outputs(out: str, table: list[dict], config: dict) -> None:
    """cp.json, cp.md, cp_seq_scaling.png and (with Ulysses rows) cp_ring_vs_ulysses.png into `out`."""
    with open(os.path.join(out, "cp.json"), "w") as f:
        json.dump({"config": config, "rows": table}, f, indent=1)
    with open(os.path.join(out, "cp.md"), "w") as f:
        f.write(markdown(table, config))
    plot(table, os.path.join(out, "cp_seq_scaling.png"))
    if any(r.get("algorithm") == "ulysses" for r in table):
        plot_algorithms(table, os.path.join(out, "cp_ring_vs_ulysses.png"))


def run(
    out: str,
    seq_lens: list[int],
    cps: list[int],
    model: str = "tiny",
    n_layer: int | None = 2,
    rows: int = 4,
    warmup: int = 2,
    steps: int = 4,
    timeout: float = 600,
    tps: list[int] = (),
    log=print,
    attn_reps: int = 5,
    algorithms: tuple[str, ...] = ("ring", "ulysses"),
    n_head: int | None = None,
) -> list[dict]:
    """Time one attention at C = 1, ring against SDPA (`time_attention`, `attn_reps` rounds; 0: not timed),
    measure saved bytes (one job per layout: each C by each of `algorithms`, and each TP degree in `tps` to
    compare with), then train every (seq_len, layout); write cp.json, cp.md and the figures into `out`; return
    the rows."""
    from bench.__main__ import ensure_dataset
    from bench.runner import probe_machine
    from model.gpt import make_config

    out = os.path.abspath(out)
    os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    cfg = make_config(model, n_layer=n_layer, n_head=n_head)
    dataset = ensure_dataset("", out, cfg.vocab_size)
    machine = probe_machine(measure=True)
    log(
        f"[bench.cp] {machine['name']}, {os.cpu_count()} cores; {model} n_layer {cfg.n_layer}; seq_lens {seq_lens}, "
        f"C in {cps} by {list(algorithms)}, TP in {list(tps)}; {rows} rows x seq_len tokens/step, "
        f"{warmup}+{steps} steps"
    )
    load_start = os.getloadavg()[0]
    attention = time_attentions(seq_lens, rows, cfg, attn_reps, log)
    layouts = [(cp, 1, a) for cp in cps for a in (algorithms if cp > 1 else ("ring",))]
    layouts += [(1, tp, "ring") for tp in tps]
    spec = {"model": model, "n_layer": n_layer, "n_head": n_head, "seq_lens": seq_lens, "rows": rows}
    memory = measure_layouts(out, layouts, spec, timeout, log)
    job = dict(model=model, n_layer=n_layer, n_head=n_head, rows=rows, warmup=warmup, steps=steps)
    job.update(dataset=dataset, peak_flops=machine["peak_flops"], timeout=timeout)
    table = cp_rows([train_point(out, T, lay, cfg, memory, job, log) for T in seq_lens for lay in layouts])
    config = {
        "model": model,
        "n_layer": cfg.n_layer,
        "n_embd": cfg.n_embd,
        "n_head": cfg.n_head,
        "head_dim": cfg.n_embd // cfg.n_head,
        "vocab_size": cfg.vocab_size,
        "seq_lens": seq_lens,
        "cps": cps,
        "algorithms": list(algorithms),
        "tps": list(tps),
        "rows": rows,
        "warmup": warmup,
        "steps": steps,
        "cpu_count": os.cpu_count(),
        "machine": machine,
        "dataset": dataset,
        "attention_c1": attention,
        "load_average": [load_start, os.getloadavg()[0]],
    }
    write_outputs(out, table, config)
    return table


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cp", description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--out", default=None, help="output directory (required)")
    a("--model", default="tiny")
    a("--n_layer", type=int, default=2, help="override the preset's layer count (0: the preset's)")
    a("--seq_lens", type=_ints, default=[128, 256, 512])
    a("--cps", type=_ints, default=[1, 2, 4], help="context-parallel degrees; 1 is the baseline of the ratios")
    a("--tps", type=_ints, default=[2], help="tensor-parallel degrees (SP + loss parallel) to compare with")
    a("--algorithms", default="ring,ulysses", help="the cp algorithms each C > 1 runs by (--cp_algorithm)")
    a("--n_head", type=int, default=None, help="override the preset's heads (Ulysses: C must divide them)")
    a("--rows", type=int, default=4, help="sequences per step: the global batch is rows x seq_len tokens")
    a("--warmup", type=int, default=2)
    a("--steps", type=int, default=4, help="measured steps after --warmup")
    a("--timeout", type=float, default=600, help="seconds per job")
    a("--attn_reps", type=int, default=5, help="rounds of the C = 1 ring-vs-SDPA attention timing (0: none)")
    a("--worker", default=None, help=argparse.SUPPRESS)  # JSON spec: run the saved-bytes worker
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.out is None:
        p.error("--out is required")
    if 1 not in args.cps:
        p.error("--cps needs 1: the ratios are against C=1")
    args.algorithms = tuple(a for a in args.algorithms.split(",") if a)
    if not set(args.algorithms) <= {"ring", "ulysses"}:
        p.error(f"--algorithms {','.join(args.algorithms)}: each one of ring, ulysses")
    if "ulysses" in args.algorithms:
        from model.gpt import make_config

        heads = make_config(args.model, n_head=args.n_head).n_head
        bad = [c for c in args.cps if heads % c]
        if bad:
            p.error(f"Ulysses needs C to divide the heads ({heads}): not C in {bad} (try --n_head)")
    for T in args.seq_lens:
        bad = [c for c in args.cps if T % (2 * c)]
        if bad:
            p.error(f"seq_len {T} is not divisible by 2 x C for C in {bad} (the zigzag split)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        from runtime.launch import exit_process

        worker(json.loads(args.worker))
        exit_process(0)  # the group is destroyed: skip finalization (launch.exit_process)
    rows = run(
        args.out,
        args.seq_lens,
        args.cps,
        args.model,
        args.n_layer or None,
        args.rows,
        args.warmup,
        args.steps,
        args.timeout,
        [t for t in args.tps if t > 1],
        attn_reps=args.attn_reps,
        algorithms=args.algorithms,
        n_head=args.n_head,
    )
    config = json.load(open(os.path.join(args.out, "cp.json")))["config"]
    print(markdown(rows, config), end="")
    print(f"[bench.cp] wrote {os.path.abspath(args.out)}/cp.json, cp.md, cp_seq_scaling.png")
    return 0 if any(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
