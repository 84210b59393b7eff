"""What the flight recorder (debug/flight_recorder.py) costs: per op, and on a DDP step.

    nice -n 10 python -m bench.recorder --out results/recorder        # small preset, 2 gloo ranks, CPU

1. Per op: `RECORDER.post` + `done` (what every comm op pays) timed in a loop on a one-rank gloo group, in
   CPU microseconds (median of 5 repeats of 20,000 ops).
2. Per step: train.py, custom DDP x 2 on the `small` preset (2 micro-batches of 2 x 128 tokens per rank), run
   alternately with the recorder on (the default, K = 2000) and off (GPT_FLIGHT_RECORDER_SIZE=0), `--pairs`
   times each (on-off, off-on, ...); the median step time of steps after the first of each run, and the ops
   recorded per step (rank 0's ring).
The overhead bound is ops per step x per-op cost / median step time; the measured step times are reported
beside it (on a shared machine their noise is larger than the bound).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def per_op_us(repeats: int = 5, n: int = 20_000) -> float:
    """Median microseconds of one post + done on a 4 MiB float32 tensor (the cost does not depend on its size)."""
    import torch
    import torch.distributed as dist

    from debug.flight_recorder import FlightRecorder
    from tests.harness import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    rec, t = FlightRecorder(2000), torch.zeros(1 << 20)
    times = []
    for _ in range(repeats):
        t0 = time.process_time()  # CPU time: on a shared machine wall time counts the neighbours' work too
        for _ in range(n):
            rec.done(rec.post("all_reduce", t, None))
        times.append((time.process_time() - t0) / n * 1e6)
    dist.destroy_process_group()
    return statistics.median(times)


def step_times(pairs: int, steps: int, out: str) -> dict:
    from bench.forkserver import ForkServer
    from debug.flight_recorder import decode
    from runtime.metrics import read_jsonl
    from tests.harness import make_token_bins

    data = make_token_bins(os.path.join(out, "data"), vocab=50257)
    args = [
        "--model",
        "small",
        "--implementation",
        "custom",
        "--data_parallel_size",
        "2",
        "--data_parallel_type",
        "ddp",
        "--micro_batch_size",
        "2",
        "--seq_len",
        "128",
        "--total_batch_size",
        str(2 * 128 * 2 * 2),
        "--max_steps",
        str(steps),
        "--eval_interval",
        "1000",
        "--eval_iters",
        "1",
        "--no_checkpoint",
        "--dataset",
        data,
        "--device",
        "cpu",
    ]
    got: dict[str, list[float]] = {"on": [], "off": []}
    ops_per_step = None
    with ForkServer() as server:
        for i in range(pairs):
            for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):  # ABBA: a drifting load cancels
                run_dir = os.path.join(out, f"{mode}-{i}")
                env = {"GPT_FLIGHT_RECORDER_SIZE": "0"} if mode == "off" else {}
                r = server.run([*args, "--out_dir", run_dir, "--overwrite"], 2, env=env, timeout=1800)
                if r.returncode != 0:
                    raise RuntimeError(f"{mode} run failed: {r.stderr}")
                got[mode] += [m["step_time_ms"] for m in read_jsonl(run_dir) if "step_time_ms" in m][1:]
                if mode == "on":
                    with open(os.path.join(run_dir, "flight_recorder", "rank_0.bin"), "rb") as f:
                        ring = decode(f.read())
                    ops_per_step = sum(1 for o in ring["ops"] if o["step"] == steps)
    return {
        "median_step_ms": {k: statistics.median(v) for k, v in got.items()},
        "steps_ms": got,
        "ops_per_step": ops_per_step,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.recorder", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="folder for recorder.json (and the runs, deleted after)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    us = per_op_us()
    with tempfile.TemporaryDirectory() as tmp:
        res = step_times(a.pairs, a.steps, tmp)
    step_ms = res["median_step_ms"]["off"]
    res.update(
        per_op_us=us,
        bound_fraction=res["ops_per_step"] * us / 1000 / step_ms,
        measured_fraction=res["median_step_ms"]["on"] / step_ms - 1,
    )
    print(
        f"per op {us:.2f} us; {res['ops_per_step']} ops per step; median step {res['median_step_ms']['on']:.1f} ms "
        f"on, {step_ms:.1f} ms off; bound {100 * res['bound_fraction']:.4f}% of a step, measured "
        f"{100 * res['measured_fraction']:+.2f}%"
    )
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "recorder.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
