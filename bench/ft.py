"""What losing a replica group costs: torchft's replica groups (ft/) against torchrun --max-restarts from the last
checkpoint, on the same job, data and checkpoint interval, each measured against its own run without a failure.

    python -m bench.ft --out results/ft [--groups 2] [--steps 80] [--interval 10] [--kill 25] [--heartbeat_ms 5000]

The job: R data-parallel replicas of K ranks (default 2 x 1, the `tiny` model), a checkpoint every --interval steps.
- ft: R replica groups, each its own torchrun job, behind a torchft lighthouse started as the issue starts it (quorum
  of >= 1, 100 ms tick, 2 s join timeout; a group whose heartbeat is --heartbeat_ms old is lost). The last group's
  ranks SIGKILL themselves in the middle of step --kill (trainer/faults.py's GPT_SIGNAL_AT_STEP, after the
  backward); it is relaunched at once with its own command (as scripts/ft_launch.py does), and heals from a live
  peer while the others train on.
- restart: one torchrun job of R x K ranks (DDP over all of them) with --max-restarts 1 and --resume: the same kill,
  once; torchrun restarts every rank and they resume from the newest checkpoint, recomputing the steps since.

Every console line of every process is timestamped as it arrives (PYTHONUNBUFFERED), and the failure's timeline is
read off those lines: for ft, the kill, the survivors' uncommitted step (detection), the new quorum without the
group (torchft's heartbeat timeout), the redone step, the steps run with R - 1 groups while the group restarts, its
heal and the step it rejoins in; for restart, the kill, the resume (torchrun's detection, new processes, the
checkpoint's load) and the recomputed steps. The cost of a failure is the wall time of the run with one against the
same run without (both measured here, back to back).

Outputs in --out: ft.json (the settings, every run's wall time and timeline, the breakdowns), ft.md (the tables).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time

from scripts.ft_launch import Group, Lighthouse, group_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP = re.compile(r"^step (\d+) \| loss .* \| dt (\d+)ms")


def job_args(a: argparse.Namespace, data: str) -> list[str]:
    return [
        "--model", "tiny", "--dataset", data, "--vocab_size", "512", "--micro_batch_size", "4", "--seq_len", "128",
        "--total_batch_size", str(4 * 128 * 4 * a.groups * a.nproc), "--max_steps", str(a.steps), "--warmup_steps",
        "2", "--lr", "1e-3", "--eval_interval", str(a.steps), "--eval_iters", "2", "--checkpoint_interval",
        str(a.interval), "--device", "cpu", "--peak_flops", "1e12",
    ]  # fmt: skip


class Lines:
    """Every console line of the run's processes as (seconds since the epoch, source, line)."""

    def __init__(self):
        self.rows: list[tuple[float, int, str]] = []

    def __call__(self, source: int, at: float, line: str) -> None:
        self.rows.append((at, source, line))

    def first(self, pattern: str, source: int | None = None, after: float = 0.0) -> float | None:
        return next(
            (t for t, s, ln in self.rows if t >= after and (source is None or s == source) and re.search(pattern, ln)),
            None,
        )

    def steps(self, source: int, after: float = 0.0) -> list[tuple[float, int, float]]:
        """(time, step, dt in seconds) of each step line of `source` after `after`."""
        out = []
        for t, s, ln in self.rows:
            m = STEP.match(ln)
            if s == source and t >= after and m:
                out.append((t, int(m.group(1)), int(m.group(2)) / 1000))
        return out


def run_ft(a: argparse.Namespace, data: str, tmp: str, fail: bool) -> dict:
    """The ft job (the module docstring); with `fail`, the last group is lost in step --kill and relaunched."""
    lines, out = Lines(), os.path.join(tmp, f"ft_{'fail' if fail else 'clean'}")
    args, victim = job_args(a, data), a.groups - 1
    with Lighthouse(heartbeat_ms=a.heartbeat_ms, log=os.path.join(tmp, "lighthouse.log")) as lighthouse:
        groups = [
            Group(
                g,
                group_command(args, g, a.groups, a.nproc, lighthouse.url, out),
                os.path.join(out + f"_{g}.log"),
                lines,
            )
            for g in range(a.groups)
        ]
        t0 = time.time()
        for g in groups:
            kill = {"GPT_SIGNAL_AT_STEP": str(a.kill), "GPT_SIGNAL": "KILL", "GPT_SIGNAL_RANK": "all"}
            g.start({"GPT_FT_FULL_AT": "1", **(kill if fail and g.group == victim else {})})
        if fail:
            groups[victim].wait(timeout=1200)
            groups[victim].start()  # its own command, at once, as a supervisor would
        codes = [g.wait(timeout=1200) for g in groups]
        wall = time.time() - t0
    if codes != [0] * a.groups:
        raise RuntimeError(f"ft job exited {codes}: see {out}_*.log")
    return {"wall_s": wall, "t0": t0, "lines": lines, "relaunched_at": groups[victim].starts[-1] if fail else None}


def run_restart(a: argparse.Namespace, data: str, tmp: str, fail: bool) -> dict:
    """The restart job (the module docstring): R x K DDP ranks under torchrun --max-restarts 1."""
    lines, out = Lines(), os.path.join(tmp, f"restart_{'fail' if fail else 'clean'}")
    n = a.groups * a.nproc
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--monitor-interval", "0.2", "--max-restarts",
           "1", f"--nproc_per_node={n}", os.path.join(ROOT, "train.py"), *job_args(a, data), "--data_parallel_size",
           str(n), "--data_parallel_type", "ddp", "--out_dir", out, "--resume"]  # fmt: skip
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # a fresh store per attempt (trainer/faults.py)
    if fail:
        marker = os.path.join(tmp, "killed_once")
        env.update(
            GPT_SIGNAL_AT_STEP=str(a.kill), GPT_SIGNAL="KILL", GPT_SIGNAL_RANK=str(n - 1), GPT_SIGNAL_MARKER=marker
        )
    job = Group(0, cmd, out + ".log", lines)
    t0 = time.time()
    job.start(env)
    code = job.wait(timeout=1200)
    if code != 0:
        raise RuntimeError(f"restart job exited {code}: see {out}.log")
    return {"wall_s": time.time() - t0, "t0": t0, "lines": lines}


def ft_breakdown(a: argparse.Namespace, run: dict) -> dict:
    """The ft failure's timeline, in seconds after the kill (the module docstring), read off group 0's lines (a
    survivor) and the victim's."""
    lines, victim = run["lines"], a.groups - 1
    kill = lines.first(r"^GPT_SIGNAL_AT_STEP=.*sends itself SIGKILL", victim)
    uncommitted = lines.first(r"not committed", 0, kill)
    lost = lines.first(r"lost replica groups", 0, kill)
    healed = lines.first(r"healed with step", victim, kill)
    if healed is None:
        raise RuntimeError("the relaunched group did not heal: the others finished first (raise --steps)")
    joined = lines.first(r"joined: ", 0, run["relaunched_at"])  # the survivor's quorum with it (before its heal ends)
    survivor = lines.steps(0)
    before = [dt for t, s, dt in survivor if 2 < s < a.kill]
    redone = next((t, s, dt) for t, s, dt in survivor if t > kill)
    back = next((t, s, dt) for t, s, dt in survivor if t > joined)
    m = re.search(r"in ([0-9.]+)s \(the quorum took ([0-9.]+)s\)", next(ln for t, s, ln in lines.rows if t == healed))
    return {
        "kill_at": kill - run["t0"],
        "detected_s": uncommitted - kill,
        "new_quorum_s": lost - uncommitted,
        "redone_step_s": redone[0] - lost,
        "step_s": statistics.median(before),
        "degraded_steps": back[1] - redone[1],
        "degraded_step_s": statistics.median([dt for t, s, dt in survivor if redone[1] < s < back[1]] or [0.0]),
        "relaunch_to_heal_s": healed - run["relaunched_at"],
        "heal_transfer_s": float(m.group(1)),
        "heal_quorum_s": float(m.group(2)),
        "rejoin_step_s": back[2],
        "timeline": [
            (round(t - kill, 3), src, ln)
            for t, src, ln in lines.rows
            if t >= kill - 1 and (_near(ln, (a.kill, back[1])) or ln.startswith(("ft: ", "GPT_SIGNAL")))
        ],
    }


def _near(line: str, steps: tuple[int, ...]) -> bool:
    """A step line of a step within 1 of one of `steps`."""
    m = STEP.match(line)
    return m is not None and any(abs(int(m.group(1)) - s) <= 1 for s in steps)


def restart_breakdown(a: argparse.Namespace, run: dict) -> dict:
    lines = run["lines"]
    kill = lines.first(r"^GPT_SIGNAL_AT_STEP=.*sends itself SIGKILL")
    resumed = lines.first(r"^resuming from", after=kill)
    steps = lines.steps(0, kill)
    caught = next(t for t, s, dt in steps if s == a.kill)
    saved = a.kill - 1 - (a.kill - 1) % a.interval
    return {
        "kill_at": kill - run["t0"],
        "restart_s": resumed - kill,
        "recomputed_steps": a.kill - saved,
        "recompute_s": caught - resumed,
        "step_s": statistics.median([dt for t, s, dt in lines.steps(0) if 2 < s < a.kill and t < kill]),
        "timeline": [
            (round(t - kill, 3), src, ln)
            for t, src, ln in lines.rows
            if t >= kill - 1 and (STEP.match(ln) or ln.startswith(("resuming", "GPT_SIGNAL")))
        ][:40],
    }


def summary(res: dict) -> dict:
    """The failure's cost in its parts (seconds). stall: the time the job made no progress (ft: kill -> the step
    it died in done again by the survivors, and the step the group rejoins in, each less a normal step; restart:
    kill -> the killed step done again, the steps since the checkpoint recomputed, less a normal step); degraded:
    what the steps run with R - 1 groups took beyond normal ones (ft only: the survivors do the lost group's share
    while it restarts); wall: the run with a failure less the run without (noisy on a shared machine)."""
    fb, rb = res["ft"]["breakdown"], res["restart"]["breakdown"]
    ft_stall = fb["detected_s"] + fb["new_quorum_s"] + fb["redone_step_s"] - fb["step_s"]
    return {
        "ft_stall_s": ft_stall + fb["rejoin_step_s"] - fb["step_s"],
        "ft_degraded_s": fb["degraded_steps"] * (fb["degraded_step_s"] - fb["step_s"]),
        "ft_wall_s": res["ft"]["fail_s"] - res["ft"]["clean_s"],
        "restart_stall_s": rb["restart_s"] + rb["recompute_s"] - rb["step_s"],
        "restart_wall_s": res["restart"]["fail_s"] - res["restart"]["clean_s"],
    }


def markdown(a: argparse.Namespace, res: dict) -> str:
    ft, rs, cost = res["ft"], res["restart"], res["summary"]
    fb, rb = ft["breakdown"], rs["breakdown"]
    rows = [
        "| seconds | ft (torchft replica groups) | restart (torchrun --max-restarts, --resume) |",
        "|---|---:|---:|",
        f"| a normal step | {fb['step_s']:.2f} | {rb['step_s']:.2f} |",
        f"| detection: kill -> the survivors' step fails | {fb['detected_s']:.2f} | - |",
        f"| a quorum without the group (the lighthouse's heartbeat timeout) | {fb['new_quorum_s']:.2f} | - |",
        f"| the redone step | {fb['redone_step_s']:.2f} | - |",
        f"| kill -> resumed (torchrun's detection, new processes, build, the checkpoint's load) | - | "
        f"{rb['restart_s']:.2f} |",
        f"| recomputing the {rb['recomputed_steps']} steps since the checkpoint | - | {rb['recompute_s']:.2f} |",
        f"| the relaunched group: start -> healed | {fb['relaunch_to_heal_s']:.1f} (transfer "
        f"{fb['heal_transfer_s']:.2f}, its quorum {fb['heal_quorum_s']:.2f}) | - |",
        f"| the step it rejoins in | {fb['rejoin_step_s']:.2f} | - |",
        f"| **stall: no progress** | **{cost['ft_stall_s']:.1f}** | **{cost['restart_stall_s']:.1f}** |",
        f"| degraded: {fb['degraded_steps']} steps with {a.groups - 1} of {a.groups} groups at "
        f"{fb['degraded_step_s']:.2f} | {cost['ft_degraded_s']:.1f} | - |",
        f"| wall: with a failure - without ({ft['fail_s']:.0f} - {ft['clean_s']:.0f}; {rs['fail_s']:.0f} - "
        f"{rs['clean_s']:.0f}) | {cost['ft_wall_s']:.1f} | {cost['restart_wall_s']:.1f} |",
    ]
    head = (
        f"# A lost replica group: torchft against a checkpoint restart\n\n`python -m bench.ft {' '.join(res['argv'])}`"
        f"\n\n{a.groups} data-parallel replicas of {a.nproc} rank(s), `tiny`, {a.steps} steps, a checkpoint every "
        f"{a.interval}; one replica's ranks SIGKILLed in the middle of step {a.kill} and relaunched at once; torchft "
        f"lighthouse heartbeat timeout {a.heartbeat_ms} ms. {res['machine']}.\n\n"
    )
    notes = (
        "\n\nstall: the time the job made no progress (ft: kill -> the survivors' redone step, and the step the group "
        "rejoins in, each less a normal step; restart: kill -> resumed, and the recomputed steps, less a normal step). "
        "degraded: the extra time of the steps the survivors ran without the group (its share done by them) while it "
        "restarted: it falls as 1/R. wall: each run once, on a shared machine.\n"
    )
    timeline = "\n".join(f"| {t:+.2f} | {'group ' + str(s)} | `{ln[:110]}` |" for t, s, ln in fb["timeline"])
    return (
        head
        + "\n".join(rows)
        + notes
        + "\nThe ft run's timeline (seconds after the kill; every group's steps and events):\n\n"
        + "| s | from | line |\n|---:|---|---|\n"
        + timeline
        + "\n"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ft", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/ft")
    p.add_argument("--groups", type=int, default=2, metavar="R")
    p.add_argument("--nproc", type=int, default=1, metavar="K", help="ranks per replica")
    p.add_argument("--steps", type=int, default=80, help="enough for a relaunched group to rejoin before the end")
    p.add_argument("--interval", type=int, default=10, help="--checkpoint_interval of both jobs")
    p.add_argument("--kill", type=int, default=25, help="the step a replica dies in (--interval / 2 after a save)")
    p.add_argument("--jobs", default="ft,restart", help="which of the two to run (the table needs both)")
    p.add_argument("--work", default=None, help="keep the runs and their logs here (default: a temporary folder)")
    p.add_argument("--heartbeat_ms", type=int, default=5000, help="the lighthouse's (its default)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from tests.harness import make_token_bins

    os.makedirs(a.out, exist_ok=True)
    load = [os.getloadavg()[0]]
    res = {"argv": sys.argv[1:] if argv is None else argv, "settings": vars(a)}
    with tempfile.TemporaryDirectory() if a.work is None else open(os.devnull) as tmp:
        tmp = tmp if a.work is None else a.work
        data = make_token_bins(os.path.join(tmp, "data"))
        for name, run, breakdown in (("ft", run_ft, ft_breakdown), ("restart", run_restart, restart_breakdown)):
            if name not in a.jobs.split(","):
                continue
            clean = run(a, data, tmp, False)
            fail = run(a, data, tmp, True)
            res[name] = {"clean_s": clean["wall_s"], "fail_s": fail["wall_s"], "breakdown": breakdown(a, fail)}
            print(f"{name}: {clean['wall_s']:.1f} s clean, {fail['wall_s']:.1f} s with a failure", flush=True)
            load.append(os.getloadavg()[0])
    if "restart" not in res or "ft" not in res:
        with open(os.path.join(a.out, "ft.json"), "w") as f:
            json.dump(res, f, indent=1)
        return 0
    res["summary"] = summary(res)
    cores = os.cpu_count()
    res["machine"] = (
        f"{platform.processor() or platform.machine()}, {cores} cores, 1-minute load average "
        f"{' -> '.join(f'{x:.1f}' for x in load)} (above {cores}: other work shared the cores; the seconds are noisy)"
    )
    with open(os.path.join(a.out, "ft.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(a.out, "ft.md"), "w") as f:
        f.write(markdown(a, res))
    print(open(os.path.join(a.out, "ft.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
