"""The registry from a new concept's side: a throwaway concept, registered here and nowhere else, with a flag, its
range, a check, a planner term and a sweep row, is seen by train.py's parser, its validation (one line, exit 2),
the planner (its bytes, its group's time, its state, its FLOPs, its variant of a layout, its planner flag) and the
sweep (its row, its option) without editing any of them. Then the registry's own rules (a name twice, a phase
that does not exist), and that today's concepts are all on it."""

from __future__ import annotations

import contextlib
import io
import tempfile
import unittest
from types import SimpleNamespace

import pytest
import torch

from runtime.registry import (
    AT_LEAST_ZERO,
    Checking,
    Concept,
    Group,
    Sweep,
    SweepOption,
    Terms,
    UsageError,
    register,
    registered,
)
from tests.harness import expect_train_error_in_process
from trainer.concepts import concepts

GAIN = "--throwaway_gain"  # the throwaway concept's one train.py flag: bytes it "sends" per parameter


def check_gain(c: Checking) -> None:
    if c.args.throwaway_gain == 13 and c.dims.dp > 1:
        raise UsageError(f"{GAIN} 13 is unlucky with --data_parallel_size {c.dims.dp}")


def comm(s, pp_rank: int, out: dict) -> None:
    if s.args.throwaway_gain:
        out["throwaway"] = {"all_reduce": s.args.throwaway_gain * sum(n for _, n, _ in s.local_params(pp_rank))}


def calls(s, pp_rank: int, out: dict) -> None:
    if s.args.throwaway_gain:
        out["throwaway"] = {"all_reduce": 1}


def state(s, pp_rank: int, shard_rank: int, expert_shard_rank: int, out: dict) -> None:
    out["optimizer"] += 4 * s.args.throwaway_gain


THROWAWAY = Concept(
    name="throwaway",
    title="a test's throwaway concept",
    flags=lambda a: a(GAIN, type=int, default=0, help="bytes sent per parameter per step"),
    ranges={"throwaway_gain": AT_LEAST_ZERO},
    checks=(("layout", check_gain),),
    terms=Terms(
        comm=comm,
        calls=calls,
        state=state,
        groups=lambda s: {"throwaway": Group(s.dims.dp, ("dp_replicate", "dp_shard"))},
        flops=lambda s: 1e12 * s.args.throwaway_gain,
    ),
    plan_flags=lambda a: a(GAIN, type=int, default=0),
    search=lambda sizes: [("", []), ("gain=2", [GAIN, "2"])] if sizes["dp"] > 1 else [("", [])],
    sweep=Sweep(
        rows=lambda: [dict(dp=2, dp_type="ddp", extra=(GAIN, "1"))],
        option=SweepOption("--throwaway_mode", ("off", "on"), "off", help="every layout with the throwaway on"),
    ),
)

TINY = ["--model", "tiny", "--vocab_size", "512", "--seq_len", "32", "--micro_batch_size", "2"]
TINY += ["--total_batch_size", "128", "--implementation", "custom", "--out_dir", "-"]


@pytest.fixture
def throwaway():
    with registered(THROWAWAY):
        yield THROWAWAY


def setup(flags: list[str], world: int):
    from plan.counts import Setup
    from trainer.config import check_layout, train_parser

    args = train_parser().parse_args([*TINY, *flags])
    dims, config, dtype, _, accum, pp_layers = check_layout(args, world, torch.device("meta"))
    return Setup(args, dims, config, dtype, accum, pp_layers)


def test_the_parser_takes_its_flag_in_its_group(throwaway):
    from trainer.config import train_parser

    p = train_parser()
    assert p.parse_args([GAIN, "3"]).throwaway_gain == 3
    assert "a test's throwaway concept" in p.format_help() and GAIN in p.format_help()


def test_validation_runs_its_range_and_its_check_in_one_line(throwaway):
    from trainer.config import check_layout, train_parser

    args = train_parser().parse_args([*TINY, GAIN, "-1"])
    with pytest.raises(UsageError, match=f"^{GAIN} must be >= 0, got -1$"):
        check_layout(args, 1, torch.device("cpu"))
    dp2 = ["--data_parallel_size", "2", "--data_parallel_type", "ddp", GAIN, "13"]
    with pytest.raises(UsageError, match=f"^{GAIN} 13 is unlucky with --data_parallel_size 2$"):
        check_layout(train_parser().parse_args([*TINY, *dp2]), 2, torch.device("cpu"))
    check_layout(train_parser().parse_args([*TINY, GAIN, "13"]), 1, torch.device("cpu"))  # dp = 1: let through
    with tempfile.TemporaryDirectory() as tmp:  # train.py itself: one line, exit 2, nothing written
        case = unittest.TestCase()
        expect_train_error_in_process(case, [*TINY[:-2], GAIN, "-1"], f"{GAIN} must be >= 0", f"{tmp}/run")


def test_the_planner_adds_its_bytes_calls_state_time_and_flops(throwaway):
    from plan.cluster import PRESETS, Cluster
    from plan.counts import comm_calls_by_group, local_params, state_bytes
    from plan.predict import predict
    from plan.search import step_time

    dp2 = ["--data_parallel_size", "2", "--data_parallel_type", "ddp"]
    off, on = setup(dp2, 2), setup([*dp2, GAIN, "3"], 2)
    n = sum(k for _, k, _ in local_params(on))
    assert predict(on)["comm_bytes"]["all_reduce"] - predict(off)["comm_bytes"]["all_reduce"] == 3 * n
    assert comm_calls_by_group(on)["throwaway"] == {"all_reduce": 1} and "throwaway" not in comm_calls_by_group(off)
    assert state_bytes(on)["optimizer"] - state_bytes(off)["optimizer"] == 12
    p = PRESETS["h100-sxm"]
    cluster = Cluster(2, 2, p["memory"], p["peak_flops"], p["intra_bw"], p["inter_bw"], "h100-sxm")
    t_on, t_off = step_time(on, cluster, 0.5), step_time(off, cluster, 0.5)
    assert "throwaway" in t_on and "throwaway" not in t_off
    assert t_on["compute"] - t_off["compute"] == pytest.approx(3e12 / (p["peak_flops"] * 0.5))


def test_the_search_tries_its_variant_and_passes_its_flag(throwaway):
    from plan import __main__ as cli
    from plan.cluster import PRESETS, Cluster
    from plan.search import candidates, model_flags

    a = cli.parser().parse_args(["--model", "tiny", "--seq_len", "32", "--total_batch_size", "128", GAIN, "1"])
    flags = model_flags(a)
    assert flags[-2:] == [GAIN, "1"]
    p = PRESETS["h100-sxm"]
    cluster = Cluster(2, 2, p["memory"], p["peak_flops"], p["intra_bw"], p["inter_bw"], "h100-sxm")
    pins = {"pp": 1, "tp": 1, "cp": 1, "dp_type": "ddp", "ac": "none"}
    names = [c.name for c in candidates(flags, cluster, [1], pins)]
    assert names == ["dp=2(ddp) ac=none mb=1", "dp=2(ddp) gain=2 ac=none mb=1"]


def test_the_sweep_runs_its_row_and_offers_its_option(throwaway):
    from bench import sweep as S

    rows = [x for x in S.concept_rows("rows") if GAIN in x.extra]  # among the real concepts' (Ulysses's have extra)
    assert [(x.name, x.flags()[-2:]) for x in rows] == [("dp=2(ddp) throwaway_gain=1", [GAIN, "1"])]
    assert rows[0].reference() == S.Layout(blocks=rows[0].n_layer)  # its own flag stays out of one process
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        S.main(["--help"])
    assert "--throwaway_mode {off,on}" in out.getvalue()
    on = S.Layout(dp=2, dp_type="ddp", options=(("--throwaway_mode", "on"),))
    assert on.flags()[-2:] == ["--throwaway_mode", "on"] and on.reference().options == on.options
    assert S.compared(on)["grad_norm"] == slice(0, 1)  # an option holds step 1's grad norm only


def test_a_simulated_rank_enters_its_seam(throwaway):
    """sim/fake_rank enters every concept's `simulate` around a simulated rank, with the planner's view."""
    from sim.fake_rank import concept_seams

    seen = []

    @contextlib.contextmanager
    def seam(spec, view):
        seen.append((spec.rank, view.dims.dp))
        yield

    s = setup(["--data_parallel_size", "2", "--data_parallel_type", "ddp"], 2)
    spec = SimpleNamespace(rank=1, args=s.args, dims=s.dims, config=s.config, dtype=s.dtype, grad_accum=1)
    spec.parallel = SimpleNamespace(pp_layers=None)
    with registered(Concept(name="seamed", simulate=seam)), concept_seams(spec):
        pass
    assert seen == [(1, 2)]


def test_registering_twice_or_at_an_unknown_phase_is_refused(throwaway):
    with pytest.raises(ValueError, match="registered twice"):
        register(THROWAWAY)
    with pytest.raises(ValueError, match="phase 'later'"):
        register(Concept(name="late", checks=(("later", check_gain),)))
    assert "late" not in [c.name for c in concepts()]


def test_todays_concepts_are_on_the_registry_in_their_order():
    """trainer/concepts.py's order: the planner's groups come out in it (tp, cp, ep, pp, the dp groups, the
    optimizer's), and the sweep's rows (the pipeline's, then the experts')."""
    assert [c.name for c in concepts()] == [
        "tensor_parallel",
        "context_parallel",
        "expert_parallel",
        "pipeline",
        "data_parallel",
        "moe",
        "muon",
        "ft",
        "fp8",
    ]


def registration_readers(graph: dict[str, set[str]]) -> list[str]:
    """Arrows the registry's design forbids: a concept's registration (its concept.py) imported by anything but the
    list (trainer/concepts.py), and a concept's formulas (a theory.py) imported by the runtime (model/, runtime/,
    parallel/, checkpoints/, optim/ outside the concepts' own theory, concept and simulate modules), which keeps a
    learner's reading path through the mechanism free of them."""
    own = (".theory", ".concept", ".moe_concept", ".simulate")
    runtime = ("model.", "runtime.", "parallel.", "checkpoints.", "optim.")
    out = []
    for m, targets in graph.items():
        for t in sorted(targets):
            if t.endswith((".concept", ".moe_concept")) and m != "trainer.concepts":
                out.append(f"{m} -> {t}")
            elif t.endswith(".theory") and m.startswith(runtime) and not m.endswith(own):
                out.append(f"{m} -> {t}")
    return sorted(out)


def test_only_the_list_imports_a_registration_and_the_runtime_no_formulas():
    from tests.test_structure import module_graph

    assert registration_readers(module_graph()) == []


def test_registration_readers_are_found(tmp_path):
    """The reader itself: a wrapper importing its concept's formulas, and the planner importing a registration."""
    from tests.test_structure import module_graph

    for path, text in {
        "parallel/__init__.py": "",
        "parallel/ring.py": "from parallel.theory import f\n",
        "parallel/theory.py": "def f():\n    pass\n",
        "parallel/concept.py": "from parallel import theory\n",
        "plan/__init__.py": "",
        "plan/search.py": "import parallel.concept\nfrom parallel.theory import f\n",
        "trainer/__init__.py": "",
        "trainer/concepts.py": "import parallel.concept\n",
    }.items():
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text(text)
    assert registration_readers(module_graph(str(tmp_path))) == [
        "parallel.ring -> parallel.theory",
        "plan.search -> parallel.concept",
    ]
