"""The layout planner's pure predictions (plan/predict.py) against published points and hand counts (the pipeline's
p2p bytes), and `python -m plan`'s bad input. No process group, no run: the whole-run comparison with measured bytes
is test_plan_runs.py."""

from __future__ import annotations

import contextlib
import io
from unittest import mock

import pytest
import torch

from plan import __main__ as cli
from plan import theory
from plan.counts import Setup, block_saved_bytes, state_bytes
from plan.search import candidates, model_flags
from trainer.config import check_layout, train_parser


def setup(flags: list[str], world: int = 1) -> Setup:
    args = train_parser().parse_args([*flags, "--implementation", "custom", "--out_dir", "-"])
    dims, config, dtype, _, accum, pp_layers = check_layout(args, world, torch.device("meta"))
    return Setup(args, dims, config, dtype, accum, pp_layers)


# ----------------------------------------------------------------------------- ZeRO's model states

# Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", section 3.1:
# mixed-precision Adam keeps "2Ψ + 2Ψ + KΨ = 16Ψ bytes" (fp16 parameters and gradients, K = 12: fp32 parameters,
# momentum and variance). Figure 1, Ψ = 7.5B, N_d = 64: baseline (2 + 2 + K)Ψ = 120GB; P_os (2 + 2 + K/N_d)Ψ =
# 31.4GB; P_os+g (2 + (2 + K)/N_d)Ψ = 16.6GB; P_os+g+p (2 + 2 + K)Ψ/N_d = 1.9GB.
PSI, ND = 7_500_000_000, 64


def zero_unit(stage: int, param_bytes: int, reduce_bytes: int) -> int:
    """Our per-rank model state for one unit of Ψ elements sharded over N_d ranks (rank 0), minus AdamW's fp32
    step tensor (4 bytes a piece: no counterpart in the paper)."""
    keeps, at_end = {1: (True, True), 2: (True, False), 3: (False, False)}[stage]
    got = theory.fsdp_unit_state_bytes(PSI, PSI, ND, 0, keeps, at_end, param_bytes, reduce_bytes)
    return sum(got.values()) - 4


def test_zero_paper_baseline_is_16_psi():
    """DDP in fp32 keeps 4 + 4 + 8 bytes per parameter: the paper's 16Ψ total, split differently (fp32
    parameters and gradients, which are the master copy, and AdamW's two moments)."""
    s = setup(["--model", "tiny", "--seq_len", "32", "--total_batch_size", "64", "--micro_batch_size", "2"])
    n = sum(p.numel() for p in _gpt(s).parameters())
    tensors = len(list(_gpt(s).parameters()))
    assert sum(state_bytes(s).values()) == 16 * n + 4 * tensors
    assert 16 * PSI == 120 * 10**9


def test_zero_paper_stage_3_is_16_psi_over_nd():
    """ZeRO-3 (our fsdp): every state 1/N_d, 16Ψ/N_d = 1.875GB (the figure's 1.9GB), with bf16 compute copies too:
    they exist only while a unit is gathered."""
    assert zero_unit(3, 2, 2) == zero_unit(3, 4, 4) == 16 * PSI // ND == 1_875_000_000


def test_zero_paper_stages_1_and_2_differ_by_our_fp32_shard_gradient():
    """With bf16 compute copies (2Ψ) ZeRO-2 is the paper's P_os+g, 2Ψ + 14Ψ/N_d = 16.64GB (16.6GB), plus 2Ψ/N_d:
    our reduced shard gradient is fp32 (4 bytes, the optimizer steps on it), the paper's fp16 (2). ZeRO-1 with
    bf16 reduction keeps the full gradient in bf16 (2Ψ), the paper's P_os 4Ψ + 12Ψ/N_d = 31.41GB (31.4GB), plus
    our fp32 shard gradient 4Ψ/N_d (the paper's fp16 gradients are not sharded at stage 1)."""
    assert zero_unit(2, 2, 2) == 2 * PSI + 14 * PSI // ND + 2 * PSI // ND
    assert zero_unit(1, 2, 2) == 4 * PSI + 12 * PSI // ND + 4 * PSI // ND
    assert round((2 * PSI + 14 * PSI / ND) / 1e9, 1) == 16.6 and round((4 * PSI + 12 * PSI / ND) / 1e9, 1) == 31.4


def _gpt(s: Setup):
    from model.gpt import GPT

    with torch.device("meta"):
        return GPT(s.config)


# ----------------------------------------------------------------------------- Korthikanti et al.'s activations

# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.1, eq. (1):
# "Activations memory per layer = sbh(34 + 5as/h)" bytes, 16-bit activations, no parallelism, where 34sbh =
# attention 11sbh (QKV input 2, Q and K 4, V 2, output projection input 2, its dropout mask 1) + MLP 19sbh (input
# 2, GELU input 8, GELU output 8, dropout mask 1) + 2 LayerNorms' inputs 4sbh, and 5as^2b the softmax (2), its
# dropout mask (1) and the scores (2). Eq. (2), tensor parallelism over t: sbh(10 + 24/t + 5as/(ht)).
# GPT-3 175B: s = 2048, h = 12288, a = 96.
GPT3 = [
    "--model",
    "gpt2",
    "--n_layer",
    "96",
    "--n_head",
    "96",
    "--n_embd",
    "12288",
    "--block_size",
    "2048",
    "--seq_len",
    "2048",
    "--total_batch_size",
    "16384",
    "--micro_batch_size",
    "1",
]


def korthikanti(s: int, b: int, h: int, a: int, t: int = 1) -> float:
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def test_korthikanti_gpt3_layer_without_dropout_or_scores():
    """Ours in 16-bit (bf16 compute copies under FSDP: residual stream and matmuls in bf16): eq. (1) less what
    we do not keep, the two dropout masks (2sbh: dropout 0) and the 5as^2b of materialised scores (the fused
    kernel keeps only its fp32 log-sum-exp, 4abs), plus the LayerNorms' fp32 mean and rstd (16sb), which eq. (1)
    leaves out. For GPT-3 the scores alone would be 5as/h = 80 sbh, 2.4x the rest."""
    st = setup([*GPT3, "--dtype", "bfloat16", "--data_parallel_size", "2", "--data_parallel_type", "fsdp"], 2)
    s_, b, h, a = 2048, 1, 12288, 96
    paper = s_ * b * h * (34 + 5 * a * s_ / h)
    assert block_saved_bytes(st, b, s_) == paper - 2 * s_ * b * h - 5 * a * s_ * s_ * b + 16 * s_ * b + 4 * a * s_ * b


def test_korthikanti_tensor_parallel_term():
    """Eq. (2) with t = 8: the part that does not shrink with t is 10sbh: the LayerNorms' inputs (4), the
    QKV and MLP inputs (4), the dropout masks (2); ours keeps the first two, 8sbh (+ the fp32 LayerNorm
    statistics), and 24sbh/t of sharded matmul activations, exactly as eq. (2)."""
    t = 8
    st = setup(
        [
            *GPT3,
            "--dtype",
            "bfloat16",
            "--data_parallel_size",
            "2",
            "--data_parallel_type",
            "fsdp",
            "--tensor_parallel_size",
            str(t),
        ],
        2 * t,
    )
    s_, b, h, a = 2048, 1, 12288, 96
    ours = block_saved_bytes(st, b, s_)
    assert (
        ours
        == korthikanti(s_, b, h, a, t) - 2 * s_ * b * h - 5 * a * s_ * s_ * b // t + 16 * s_ * b + 4 * (a // t) * s_ * b
    )


# ----------------------------------------------------------------------------- the search and its CLI


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


SMALL = [
    "--model",
    "tiny",
    "--seq_len",
    "64",
    "--total_batch_size",
    "1024",
    "--gpus",
    "2",
    "--gpus_per_node",
    "2",
    "--micro_batch_size",
    "4",
]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--gpu", "b300"], "--gpu 'b300' is not a known preset"),
        (["--total_batch_size", "1000"], "must be a positive multiple of --seq_len"),
        (["--micro_batch_size", "3"], "is not divisible by --micro_batch_size 3"),
        (["--gpu_memory", "1MB"], "nothing fits in 0 GiB per GPU; the smallest layout"),
        (["--model", "gpt9"], "unknown model preset 'gpt9'; choose one of tiny, small, gpt2,"),  # not "no layout ..."
        (["--n_head", "5"], "n_embd"),  # the model's shape, named, not the batch sizes
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, needle):
    code, out, err = run_cli([*SMALL, *argv])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("python -m plan: error: ") and needle in err, err


def test_nothing_fits_names_a_memory_that_fits():
    """The memory "nothing fits" names is enough: planning again with it finds a layout."""
    _, _, err = run_cli([*SMALL, "--gpu_memory", "1MB"])
    need = err.split("needs ")[1].split(" GiB")[0]
    code, out, _ = run_cli([*SMALL, "--gpu_memory", f"{float(need) + 0.1}GiB"])
    assert code == 0 and len([line for line in out.splitlines() if line.startswith("| ")]) > 2, out


def test_every_candidate_is_accepted_by_the_trainer_and_every_accepted_layout_is_a_candidate():
    """On 4 ranks with the tiny model: the table's layouts are exactly those config.check_layout accepts among
    the (pp, dp type, cp, tp, AC) grid, and refused ones (pp=4 > n_layer=2 Blocks) are absent."""
    a = cli.parser().parse_args(["--model", "tiny", "--seq_len", "64", "--total_batch_size", "2048", "--gpus", "4"])
    from plan.cluster import Cluster

    got = candidates(model_flags(a), Cluster(4, 4, 2**40, 1e15, 1e11, 1e10), [2], {})
    names = {c.name for c in got}
    assert "dp=4(fsdp) ac=none mb=2" in names and "tp=4 ac=full mb=2" in names
    assert not any(n.startswith("pp=4") for n in names), "tiny has 2 Blocks: pp=4 is refused by trainer/config.py"
    assert any(n.startswith("pp=2(interleaved_1f1b,V=2)") for n in names) is False  # 2 Blocks: V=2 x pp=2 > 2


def test_a_search_builds_its_model_a_bounded_number_of_times():
    """The planner's time per layout is formulas, not model builds: step_flops asks metrics.active_params once per
    layout, and each ask built GPT on meta (gpt2-xl on 64 x h100: 8 min 44 s for 5,874 layouts, 56 s once cached).
    A tiny search's constructions do not grow with its layouts."""
    import model
    from plan.cluster import Cluster

    a = cli.parser().parse_args(["--model", "tiny", "--seq_len", "64", "--total_batch_size", "2048", "--gpus", "4"])
    built = []
    real = model.GPT.__init__
    with mock.patch.object(model.GPT, "__init__", lambda self, *a, **k: built.append(1) or real(self, *a, **k)):
        got = candidates(model_flags(a), Cluster(4, 4, 2**40, 1e15, 1e11, 1e10), [2], {})
        for c in got:
            _ = c.seconds  # a property: each ranking reads it
    assert len(got) > 20 and len(built) <= 2, (len(got), len(built))


# ----------------------------------------------------------------------------- the zero-bubble schedules


def test_zero_bubble_schedules_are_candidates_with_their_bubble():
    """On 2 ranks (tiny with 4 Blocks, M = 4 micro-batches of 4 rows): zb_h1, zbv and dualpipev are offered
    beside 1F1B, on the same FLOPs, and each one's compute term (no per-action overhead: the FLOPs' time alone)
    is 1F1B's stretched by its own bubble instead:
    ZB-H1 (P-1)/(3M+P-1) = 1/13 against 1F1B's (P-1)/(M+P-1) = 1/5 (Qi et al. 2023, section 3.1)."""
    from plan.cluster import Cluster

    a = cli.parser().parse_args(
        [
            "--model",
            "tiny",
            "--n_layer",
            "4",
            "--seq_len",
            "64",
            "--total_batch_size",
            "1024",
            "--gpus",
            "2",
            "--micro_batch_size",
            "4",
            "--pp",
            "2",
            "--ac",
            "none",
        ]
    )
    got = {
        c.name: c
        for c in candidates(
            model_flags(a), Cluster(2, 2, 2**40, 1e12, 1e10, 1e10, overhead=0.0), [4], {"pp": 2, "ac": "none"}
        )
    }
    names = [
        "pp=2(1f1b) ac=none mb=4",
        "pp=2(zb_h1) ac=none mb=4",
        "pp=2(zbv,V=2) ac=none mb=4",
        "pp=2(dualpipev,V=2) ac=none mb=4",
    ]
    assert all(n in got for n in names), sorted(got)
    base = got[names[0]].times["compute"] * (1 - 1 / 5)
    assert got[names[1]].times["compute"] == pytest.approx(base / (1 - 1 / 13), rel=1e-12)
    assert got[names[2]].times["compute"] < got[names[1]].times["compute"] < got[names[0]].times["compute"]


def test_zero_bubble_memory_bound_is_1f1bs_peak():
    """Qi et al. 2023 (Zero Bubble Pipeline Parallelism): ZB-H1's peak memory is 1F1B's, and ZB-V runs "within the
    same memory constraints as 1F1B". The planner's bound, a micro-batch held from its F to its W, counted on
    the action lists: 1F1B's rank r holds P - r micro-batches, so its peak is P (rank 0); ZB-H1 holds P on every
    rank (its W's come late, its bound never above 1F1B's peak); ZB-V 2P (chunk, micro-batch) pairs of half a
    stage each, P stages' worth, on every rank."""
    from plan.counts import _in_flight

    for P, M in ((2, 4), (4, 8)):
        assert _in_flight("1f1b", P, M, 1) == [P - r for r in range(P)]
        assert _in_flight("zb_h1", P, M, 1) == [P] * P
        assert _in_flight("zbv", P, M, 2) == [2 * P] * P


def test_without_overlap_the_data_parallel_traffic_adds_to_compute():
    """A cluster that overlaps (a GPU's) hides FSDP's gathers and scatters behind compute, max(compute, dp);
    one that does not (gloo on CPU ranks, bench.plan_rank's calibrated cluster) pays compute + dp."""
    from dataclasses import replace

    from plan.cluster import Cluster
    from plan.search import step_time

    s = setup(
        [
            "--model",
            "tiny",
            "--seq_len",
            "64",
            "--total_batch_size",
            "1024",
            "--micro_batch_size",
            "8",
            "--data_parallel_size",
            "2",
            "--data_parallel_type",
            "fsdp",
        ],
        2,
    )
    gpu = Cluster(2, 2, 2**40, 1e12, 1e9, 1e9)
    t, t_cpu = step_time(s, gpu, 1.0), step_time(s, replace(gpu, overlap=False), 1.0)
    assert t["dp"] > 0 and t["total"] == max(t["compute"], t["dp"])
    assert t_cpu["total"] == pytest.approx(t_cpu["compute"] + t_cpu["dp"], rel=1e-12)


# ----------------------------------------------------------------------------- the search's shortcuts


@pytest.fixture(scope="module")
def grid():
    """Every candidate of tiny (4 Blocks, so V = 2 pipelines and zbv too) on 2 nodes of 2 ranks (HSDP) at two
    micro-batches."""
    from plan.cluster import Cluster

    a = cli.parser().parse_args(
        ["--model", "tiny", "--n_layer", "4", "--seq_len", "64", "--total_batch_size", "2048", "--gpus", "4"]
    )
    flags = model_flags(a)
    return flags, candidates(flags, Cluster(4, 2, 2**40, 1e15, 1e11, 1e10), [1, 2], {})


def test_layout_args_is_train_parsers_parse_of_the_whole_line(grid):
    """search.layout_args (the model flags parsed once, each layout flag set by its argparse action) gives the
    Namespace train.py's parser gives for the candidate's whole command line, on every candidate: sizes,
    schedules, dp types, HSDP, AC and the TP switches."""
    from plan.search import RUN_FLAGS, layout_args

    flags, got = grid
    assert {"--sequence_parallel", "--pp_virtual_stages", "--data_parallel_replicate_size"} <= {
        f for c in got for f in c.flags
    }, "the grid covers switches, V and HSDP"
    for c in got:
        assert vars(layout_args(flags, c.flags[len(flags) :])) == vars(
            train_parser().parse_args([*c.flags, *RUN_FLAGS])
        )


def test_state_floor_is_a_lower_bound_of_the_predicted_peak(grid):
    """Candidate.state_floor (the most state any stage holds), which rules layouts out before their prediction,
    never exceeds the worst stage's predicted peak, so ruling out by it drops no layout that fits."""
    _, got = grid
    assert any(c.setup.dims.pp > 1 for c in got)
    for c in got:
        assert c.state_floor <= c.predicted["peak_memory_bytes"], c.name


def test_the_v_schedules_bubble_comes_from_the_shared_simulate():
    """search._bubble takes the V schedules' bubble from predict.schedule_facts' simulate (the one the activations
    in flight come from) and equals theory.bubble_fraction on each; the others are its closed forms."""
    from plan.search import _bubble
    from plan.theory import bubble_fraction

    for name, v in (("zbv", 2), ("dualpipev", 2), ("interleaved_1f1b", 2), ("1f1b", 1), ("zb_h1", 1)):
        for P, M in ((2, 4), (4, 8), (4, 12)):
            assert _bubble(name, P, M, v) == bubble_fraction(name, P, M, v), (name, P, M)


# ----------------------------------------------------------------------------- the pipeline's p2p bytes

# The p2p bytes comm_by_group predicts per step for each pipeline rank, counted by hand (test_plan_runs holds the
# same predictions against measured runs, slowly). One activation between chunks is (mb, T, C) = (2, 32, 64) =
# 4096 elements, 16384 bytes in fp32; M = 4 micro-batches; a rank sends each micro-batch's activation forward
# from every chunk whose next chunk is elsewhere, and its input gradient backward from every chunk whose previous
# chunk is elsewhere.
P2P_BASE = [
    "--model",
    "tiny",
    "--n_layer",
    "6",
    "--n_head",
    "4",
    "--n_embd",
    "64",
    "--seq_len",
    "32",
    "--micro_batch_size",
    "2",
]


def _pipeline_p2p(flags: list[str], world: int, pp: int) -> list[int]:
    """comm_by_group's predicted p2p bytes per step of every pipeline rank (global rank 0 of each stage)."""
    from plan.counts import comm_by_group

    s = setup([*P2P_BASE, "--pipeline_parallel_size", str(pp), *flags], world)
    return [comm_by_group(s, r)["pp"]["p2p"] for r in range(pp)]


def test_1f1b_stage_0_sends_m_activations_and_the_last_stage_m_gradients():
    """pp = 2, 1F1B, M = 4: rank 0 sends 4 activations forward, rank 1 the 4 gradients of them back;
    4 x 2 x 32 x 64 x 4 = 65536 bytes each. GPipe sends the same messages in another order."""
    for schedule in ("1f1b", "gpipe"):
        assert _pipeline_p2p(["--total_batch_size", "256", "--pp_schedule", schedule], 2, 2) == [65536, 65536]


def test_1f1b_middle_stages_send_both_ways():
    """pp = 3, M = 3: the middle rank sends activations forward and gradients back, 2 x 3 x 16384 = 98304;
    the end ranks 3 x 16384 = 49152 each."""
    assert _pipeline_p2p(["--total_batch_size", "192"], 3, 3) == [49152, 98304, 49152]


def test_interleaved_v2_sends_from_three_of_four_chunk_ends():
    """pp = 2, V = 2: rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3, every neighbour on the other rank.
    Rank 0: 0 -> 1, 2 -> 3 forward and 2 -> 1 back; rank 1: 1 -> 2 forward, 1 -> 0 and 3 -> 2 back: 3 messages
    per micro-batch each, 3 x 4 x 16384 = 196608."""
    got = _pipeline_p2p(
        ["--total_batch_size", "256", "--pp_schedule", "interleaved_1f1b", "--pp_virtual_stages", "2"], 2, 2
    )
    assert got == [196608, 196608]


def test_v_schedule_sends_nothing_between_the_chunks_that_share_a_rank():
    """zbv, pp = 3, V = 2: rank r holds chunks r and 5 - r, so chunks 2 and 3 (P - 1 and P) are both on rank 2
    and pass their activation and gradient in memory. Rank 0: 0 -> 1 forward, 5 -> 4 back (2 per micro-batch);
    rank 1: 1 -> 2 and 4 -> 5 forward, 1 -> 0 and 4 -> 3 back (4); rank 2: 3 -> 4 forward and 2 -> 1 back (2).
    M = 3: 2 x 3 x 16384 = 98304, 196608, 98304. pp = 2 (rank 1 holds chunks 1 and 2): 2 messages each."""
    assert _pipeline_p2p(["--total_batch_size", "192", "--pp_schedule", "zbv", "--pp_virtual_stages", "2"], 3, 3) == [
        98304,
        196608,
        98304,
    ]
    assert _pipeline_p2p(["--total_batch_size", "256", "--pp_schedule", "zbv", "--pp_virtual_stages", "2"], 2, 2) == [
        131072,
        131072,
    ]


def test_sequence_parallel_sends_each_tp_rank_its_share_of_the_tokens():
    """pp = 2 x tp = 2 with sequence parallelism: the residual between chunks is sequence-sharded, (2, 32/2, 64)
    per rank, 8192 bytes; M = 4: 32768 each way. Without SP every tp rank sends the whole (2, 32, 64)."""
    base = ["--total_batch_size", "256", "--tensor_parallel_size", "2"]
    assert _pipeline_p2p([*base, "--sequence_parallel"], 4, 2) == [32768, 32768]
    assert _pipeline_p2p(base, 4, 2) == [65536, 65536]


def test_bf16_compute_copies_under_fsdp_halve_the_activation_bytes():
    """pp = 2 x dp = 2 fsdp, --dtype bfloat16 (param_dtype auto: bf16 compute copies): the embedding's output and so
    the residual stream are bf16, 2 bytes: (2, 32, 64) x 2 = 8192 per message, M = 4 (256 x 2 tokens over dp 2):
    32768. Under DDP the parameters stay fp32 and autocast leaves the residual fp32: 65536."""
    base = ["--total_batch_size", "512", "--data_parallel_size", "2", "--dtype", "bfloat16"]
    assert _pipeline_p2p([*base, "--data_parallel_type", "fsdp"], 4, 2) == [32768, 32768]
    assert _pipeline_p2p([*base, "--data_parallel_type", "ddp"], 4, 2) == [65536, 65536]


# ----------------------------------------------------------------------------- latency and oversubscription


def _two_rank_layouts() -> dict:
    """tiny with 4 Blocks: a TP, CP, pipeline and sharded layout on 2 ranks, by the group each exercises."""
    base = [
        "--model",
        "tiny",
        "--n_layer",
        "4",
        "--seq_len",
        "64",
        "--total_batch_size",
        "1024",
        "--micro_batch_size",
        "4",
    ]
    return {
        "tp": setup([*base, "--tensor_parallel_size", "2", "--sequence_parallel", "--enable_loss_parallelism"], 2),
        "cp": setup([*base, "--context_parallel_size", "2"], 2),
        "pp": setup([*base, "--pipeline_parallel_size", "2"], 2),
        "dp": setup([*base, "--data_parallel_size", "2", "--data_parallel_type", "fsdp"], 2),
    }


def test_latency_is_charged_once_per_call_of_each_group():
    """A group's time grows by Cluster.latency x its calls per step (predict.comm_calls_by_group, held call for call
    against comm.COUNTER in test_plan_runs), and by nothing else: TP's 2L + 1 entries and exits each way, CP's ring
    messages, the pipeline's p2p messages and tied all-reduce, FSDP's per-unit gathers and scatters."""
    from dataclasses import replace

    from plan.cluster import Cluster
    from plan.counts import comm_calls_by_group
    from plan.search import step_time

    base = Cluster(2, 2, 2**40, 1e12, 1e9, 1e9, overlap=False, latency=0.0)
    for group, s in _two_rank_layouts().items():
        calls = sum(comm_calls_by_group(s)[group].values())
        t0, t1 = step_time(s, base, 1.0), step_time(s, replace(base, latency=1e-3), 1.0)
        assert calls > 0, group
        assert t1[group] - t0[group] == pytest.approx(1e-3 * calls, rel=1e-9), group
        assert t1["compute"] == t0["compute"]


def test_gpu_presets_have_a_small_latency_and_a_processor_per_rank():
    """Every preset's Cluster (python -m plan) charges the documented 10 us per call, 20 us per compute action, no
    core sharing and nothing per hop (a call's 10 us holds NCCL's hops)."""
    from plan.cluster import PRESETS

    for gpu in PRESETS:
        c = cli.cluster_of(cli.parser().parse_args(["--gpu", gpu]))
        assert c.latency == 10e-6 and c.cores is None and c.overhead == 20e-6 and c.hop == 0.0


def _hop_delta(s: Setup, group: str) -> float:
    """`group`'s time growth from Cluster.hop 0 to 1 ms (latency 0), with nothing else moving."""
    from dataclasses import replace

    from plan.cluster import Cluster
    from plan.search import step_time

    n = s.dims.world_size
    base = Cluster(n, n, 2**40, 1e12, 1e9, 1e9, overlap=False, latency=0.0)
    t0, t1 = step_time(s, base, 1.0), step_time(s, replace(base, hop=1e-3), 1.0)
    assert t1["compute"] == t0["compute"]
    assert t1["total"] - t0["total"] == pytest.approx(t1[group] - t0[group], rel=1e-9)
    return t1[group] - t0[group]


def test_hops_are_the_calls_formulas_calls_times_their_ring_steps():
    """Cluster.hop per hop: tiny with 4 Blocks (bias), 4 micro-steps of 4 rows, SP and loss parallelism. Per
    micro-step and Block, TP enters its region twice and leaves it twice each way: 2L + 1 entries (the head's too)
    and 2L + 1 exits (the embedding's), an all-gather and a reduce-scatter each; the position embeddings' backward
    all-gather; the LayerNorms' weight and bias gradients (2L + 1 norms x 2) and the row-parallel biases (2L)
    all-reduced; the loss's one chunk of 256 rows 2 all-reduces: all-gathers 19, reduce-scatters 18, all-reduces 28.
    Over 2 ranks an all-gather is 1 hop, an all-reduce or reduce-scatter 2 (gloo's reduce-scatter is an
    all-reduce): 19 + 36 + 56 = 111 a micro-step, 444 a step; over 4 ranks 3, 6 and 6: 57 + 108 + 168 = 333, 1332.
    The pipeline's p2p messages are a hop each and its tied all-reduce 2; FSDP's gathers 1 and scatters 2."""
    from plan.counts import comm_calls_by_group

    base = [
        "--model",
        "tiny",
        "--n_layer",
        "4",
        "--seq_len",
        "64",
        "--total_batch_size",
        "1024",
        "--micro_batch_size",
        "4",
    ]
    tp = ["--sequence_parallel", "--enable_loss_parallelism", "--tensor_parallel_size"]
    for n, hops in ((2, 444), (4, 1332)):
        s = setup([*base, *tp, str(n)], n)
        assert comm_calls_by_group(s)["tp"] == {"all_gather": 4 * 19, "reduce_scatter": 4 * 18, "all_reduce": 4 * 28}
        assert _hop_delta(s, "tp") == pytest.approx(hops * 1e-3, rel=1e-9)
    layouts = _two_rank_layouts()
    pp = comm_calls_by_group(layouts["pp"])["pp"]
    assert _hop_delta(layouts["pp"], "pp") == pytest.approx((pp["p2p"] + 2 * pp["all_reduce"]) * 1e-3, rel=1e-9)
    dp = comm_calls_by_group(layouts["dp"])["dp"]
    assert _hop_delta(layouts["dp"], "dp") == pytest.approx(
        (dp["all_gather"] + 2 * dp["reduce_scatter"]) * 1e-3, rel=1e-9
    )


def _pipeline4(micro: int) -> Setup:
    return setup(
        [
            "--model",
            "tiny",
            "--n_layer",
            "4",
            "--seq_len",
            "64",
            "--total_batch_size",
            str(64 * 4 * micro),
            "--micro_batch_size",
            "4",
            "--pipeline_parallel_size",
            "4",
        ],
        4,
    )


def test_with_fewer_cores_than_busy_ranks_the_cores_bound_the_step():
    """4 ranks on 2 cores, pp=4 1F1B with M = 8: bubble 3/11, so 4 x 8/11 = 2.9 ranks busy on average, more than
    the 2 cores. The cores then do the step's whole work, N x the rank's FLOPs, at `peak` each: compute =
    4F / (2 peak), the bubble costing nothing (an idle rank's core runs another rank). Without the term (a core per
    rank) it would be F / peak / (1 - 3/11)."""
    from plan.cluster import Cluster
    from plan.counts import step_flops
    from plan.search import step_time

    s = _pipeline4(8)
    peak = 1e10
    t = step_time(s, Cluster(4, 4, 2**40, peak, 1e9, 1e9, overlap=False, cores=2, overhead=0.0), 1.0)
    assert t["compute"] == pytest.approx(4 * step_flops(s) / (2 * peak), rel=1e-12)
    t_own = step_time(s, Cluster(4, 4, 2**40, peak, 1e9, 1e9, overlap=False, overhead=0.0), 1.0)
    assert t_own["compute"] == pytest.approx(step_flops(s) / peak / (1 - 3 / 11), rel=1e-12)


def test_with_fewer_busy_ranks_than_cores_each_runs_at_peak():
    """pp=4 1F1B with M = 2: bubble 3/5, 4 x 2/5 = 1.6 ranks busy on average, fewer than 2 cores: each busy rank has
    a core, so the step is the bubble-stretched F / peak / (1 - 3/5), as with a core per rank."""
    from plan.cluster import Cluster
    from plan.counts import step_flops
    from plan.search import step_time

    s = _pipeline4(2)
    t = step_time(s, Cluster(4, 4, 2**40, 1e10, 1e9, 1e9, overlap=False, cores=2, overhead=0.0), 1.0)
    assert t["compute"] == pytest.approx(step_flops(s) / 1e10 / (1 - 3 / 5), rel=1e-12)


def test_ddp_calls_are_build_buckets_count_at_every_cap():
    """ddp_comm_calls_per_step on the planner's parameter list (predict.local_params, 4 bytes each) counts the
    buckets DistributedDataParallel builds (ddp.build_buckets on the model's parameters, on meta) at caps from one
    bucket per parameter to one for all, and at each cap that a run of the last (or the first) parameters fills
    exactly, where "past the cap" decides: test_plan_runs holds the one-bucket case against runs."""
    from model.gpt import GPT
    from parallel.data_parallel.ddp import build_buckets
    from plan.counts import local_params
    from plan.theory import ddp_comm_calls_per_step

    s = setup(
        [
            "--model",
            "tiny",
            "--n_layer",
            "4",
            "--seq_len",
            "64",
            "--total_batch_size",
            "1024",
            "--micro_batch_size",
            "4",
        ]
    )
    with torch.device("meta"):
        named = [(n, p) for n, p in GPT(s.config).named_parameters()]
    sizes = [4 * n for _, n, _ in local_params(s)]
    counts = set()
    exact = [sum(part) for k in range(1, len(sizes) + 1) for part in (sizes[-k:], sizes[:k])]
    for cap in (1, 2**12, 2**16, 2**18, 2**20, 25 * 2**20, *exact):
        want = len(build_buckets(named, cap))
        counts.add(want)
        assert ddp_comm_calls_per_step(sizes, 2, cap) == {"all_reduce": want}, cap
    assert len(counts) >= 4 and 1 in counts and len(named) in counts


# ----------------------------------------------------------------------------- the CPU's allocated peak


class TestAllocatedPeak:
    """memory.AllocatedPeak, the CPU number the predicted peak is held against (test_plan_runs), on allocations
    whose peak is known: counted from the CPU allocator's reports, exactly, with what was alive before."""

    MB = 1 << 20

    def window(self, body) -> int:
        from runtime.memory import AllocatedPeak

        with AllocatedPeak(True) as peak:
            body()
        return peak.bytes

    def test_profiler_chatter_is_dropped_and_the_rest_kept(self, capfd):
        """The window's stderr is replayed without the profiler's own lines (kineto's start/stop, the allocator's
        warning about blocks from before the window): what every CPU run would otherwise print at its peak step."""
        import os

        from runtime.memory import PROFILER_CHATTER, _stderr_without

        with _stderr_without(PROFILER_CHATTER):
            os.write(2, b"USDT:x SyncActivityProfilerHandler.cpp:52] profiler_start\n")
            os.write(2, b"a real warning\n")
            os.write(2, b"[W CPUAllocator.cpp:245] Memory block of unknown size was allocated before\n")
        assert capfd.readouterr().err == "a real warning\n"

    def test_peak_of_allocations_and_frees(self):
        def body():
            a = torch.empty(4 * self.MB, dtype=torch.uint8)
            b = torch.empty(8 * self.MB, dtype=torch.uint8)  # peak: a + b
            del a
            c = torch.empty(2 * self.MB, dtype=torch.uint8)  # b + c, under the peak
            del b, c

        empty = self.window(lambda: None)
        assert self.window(body) - empty == 12 * self.MB

    def test_counts_what_was_alive_before(self):
        empty = self.window(lambda: None)
        kept = torch.empty(3 * self.MB, dtype=torch.uint8)
        assert self.window(lambda: None) - empty == 3 * self.MB
        del kept

    def test_off_when_not_enabled(self):
        from runtime.memory import AllocatedPeak

        with AllocatedPeak(False) as peak:
            torch.empty(self.MB)
        assert peak.bytes is None


# ----------------------------------------------------------------------------- the sharding engine's backward


def test_reduce_phase_is_the_profiled_live_set_of_a_zero3_stage_0():
    """pp=2 dp=2 fsdp (test_plan_runs' layout, bench.sweep's tiny GPT), rank 0: memory.AllocatedPeak's live set at
    step 2's peak, by the op that allocated each block (its `timeline`), is 1F1B's second backward at the
    embeddings: beside parameters + AdamW state, every fp32 shard gradient (396544), the roots gathered by the
    forward before (wpe 262144 + wte 131072, `_FlatUnit.gather`), the next micro-batch's chunk (264704 saved), and
    the gradient copies `plan.peak.reduce_transient` counts: embedding_dense_backward's whole tables (262144 +
    131072), the tied unit's flat gradient (aten::cat 131072), Block 0's reduction in flight (its flat gradient
    199936, gloo's aten::clone of it 199936, the reduce-scatter's output 99968) and Block 1's output awaiting its
    add (99968). NCCL, which reduces in place, holds no clone (there the first Block's moment, with Block 0
    prefetched, is a little larger than the embeddings' without it)."""
    from bench import sweep as S
    from plan.peak import peak_parts, reduce_transient

    def at(device: str) -> Setup:
        x = S.Layout(pp=2, dp=2, dp_type="fsdp")
        return setup([*S.BASE, "--dataset", "-", *x.flags(), "--device", device], x.nproc)

    s = at("cpu")
    shards, roots, others = 396544, 262144 + 131072, 264704
    copies = 262144 + 131072 + 131072 + 199936 + 199936 + 99968 + 99968
    assert reduce_transient(s) == shards + copies
    parts = peak_parts(s)
    assert parts["reduce"] == others + roots + shards + copies == max(v for k, v in parts.items() if k != "base")
    assert shards + copies - 199936 <= reduce_transient(at("cuda")) < shards + copies


# ----------------------------------------------------------------------------- per-action overhead


def _overhead_delta(s: Setup, cluster) -> float:
    """The compute term's growth from Cluster.overhead 0 to 1 ms on `cluster`."""
    from dataclasses import replace

    from plan.search import step_time

    t0, t1 = step_time(s, replace(cluster, overhead=0.0), 1.0), step_time(s, replace(cluster, overhead=1e-3), 1.0)
    assert t1["total"] - t0["total"] == pytest.approx(t1["compute"] - t0["compute"], rel=1e-9)
    return t1["compute"] - t0["compute"]


def test_overhead_is_charged_per_compute_action():
    """Cluster.overhead per F, B and W of a chunk on a micro-batch. Without a pipeline, 16 rows in micro-batches of
    4 are 4 micro-steps of one F and one B: 8 actions; full AC re-runs every Block's forward in each B: 4 more.
    Under pp=2 with M = 4 each rank runs every micro-batch's F and B of its chunk (1F1B: 8) or F, B and W (ZB-H1,
    the backward split: 12), stretched by the schedule's bubble, 1/5 and 1/13 (Qi et al. 2023, section 3.1)."""
    from plan.cluster import Cluster

    c = Cluster(2, 2, 2**40, 1e12, 1e9, 1e9, overlap=False)
    base = [
        "--model",
        "tiny",
        "--n_layer",
        "4",
        "--seq_len",
        "64",
        "--total_batch_size",
        "1024",
        "--micro_batch_size",
        "4",
    ]
    assert _overhead_delta(setup(base, 1), replace_gpus(c, 1)) == pytest.approx(8e-3, rel=1e-12)
    full = setup([*base, "--activation_checkpointing", "full"], 1)
    assert _overhead_delta(full, replace_gpus(c, 1)) == pytest.approx(12e-3, rel=1e-12)
    pp = [*base, "--pipeline_parallel_size", "2", "--pp_schedule"]
    assert _overhead_delta(setup([*pp, "1f1b"], 2), c) == pytest.approx(8e-3 / (1 - 1 / 5), rel=1e-12)
    assert _overhead_delta(setup([*pp, "zb_h1"], 2), c) == pytest.approx(12e-3 / (1 - 1 / 13), rel=1e-12)


def test_overhead_runs_on_the_shared_cores_as_the_flops_do():
    """4 ranks on 2 cores, pp=4 1F1B with M = 8 (16 actions a rank): 2.9 ranks busy on average bound by the 2
    cores, so the cores run all 4 ranks' actions, 4 x 16 x overhead / 2, as they run the FLOPs
    (test_with_fewer_cores_than_busy_ranks_the_cores_bound_the_step)."""
    from plan.cluster import Cluster

    c = Cluster(4, 4, 2**40, 1e10, 1e9, 1e9, overlap=False, cores=2)
    assert _overhead_delta(_pipeline4(8), c) == pytest.approx(4 * 16 * 1e-3 / 2, rel=1e-12)


def replace_gpus(c, gpus: int):
    from dataclasses import replace

    return replace(c, gpus=gpus, gpus_per_node=gpus)


# ----------------------------------------------------------------------------- mixture of experts, expert parallelism

E, K, C, H = 4, 2, 64, 256  # the tiny GPT's width; each expert a GPT-2 MLP of 4C
MOE = [
    "--model",
    "tiny",
    "--n_layer",
    "2",
    "--vocab_size",
    "512",
    "--moe_num_experts",
    str(E),
    "--moe_top_k",
    str(K),
    "--seq_len",
    "32",
    "--micro_batch_size",
    "2",
]
EXPERTS_PER_LAYER = E * (C * H + H + H * C + C)  # c_fc's and c_proj's stacked weights and biases, all E experts


def moe_setup(dp: int, ep: int, dp_type: str = "ddp", extra: tuple[str, ...] = ()) -> Setup:
    """2 MoE Blocks, 2 micro-steps of 2 rows of 32 tokens per dp rank."""
    return setup(
        [
            *MOE,
            "--total_batch_size",
            str(dp * 2 * 2 * 32),
            "--data_parallel_size",
            str(dp),
            "--data_parallel_type",
            dp_type,
            "--expert_parallel_size",
            str(ep),
            *extra,
        ],
        dp,
    )


def test_ep_all_to_all_by_hand():
    """EP = dp = 2, fp32, balanced routing: per MoE layer and micro-step the counts (E int64), then N·k rows of C
    out and N·k back, and the same two the other way in backward: 8E + 4·(N·k·C·4), N = 64 tokens; 5 calls
    (counts, 2 forward, 2 backward). 2 layers x 2 micro-steps. Without EP: none."""
    from plan.predict import predict

    N, M = 2 * 32, 2
    got = predict(moe_setup(2, 2))
    assert got["comm_bytes"]["all_to_all"] == M * 2 * (8 * E + 4 * N * K * C * 4) == 524_416
    assert got["comm_calls"]["all_to_all"] == M * 2 * 5
    assert "all_to_all" not in predict(moe_setup(2, 1))["comm_bytes"]
    ac = predict(moe_setup(2, 2, extra=("--activation_checkpointing", "full")))  # each layer's forward again
    assert ac["comm_bytes"]["all_to_all"] == 524_416 + M * 2 * (8 * E + 2 * N * K * C * 4)


def test_ep_expert_state_and_gradients_by_hand():
    """Each rank holds E/ep of every MoE layer's experts: EP = 2 over DDP holds X/2 fewer elements than EP = 1 (X:
    both layers' experts), 16 bytes each (parameter, gradient, two moments), the tensors unchanged. dp = 4: the
    dense gradients all-reduced over dp (4·(Ψ - X)), the experts' over their edp group of 2 (4·X/2). ZeRO-3 on
    dp = 4: every expert unit (E/2 experts of a Block) sharded 1/2 over edp, the dense units 1/4."""
    from plan.counts import comm_by_group, units

    X = 2 * EXPERTS_PER_LAYER
    one, two = state_bytes(moe_setup(2, 1)), state_bytes(moe_setup(2, 2))
    assert {k: one[k] - two[k] for k in one} == {"params": 4 * X // 2, "grads": 4 * X // 2, "optimizer": 8 * X // 2}
    s = moe_setup(4, 2)
    psi = one["params"] // 4
    groups = comm_by_group(s)
    assert groups["dp"]["all_reduce"] == 4 * (psi - X) and groups["edp"]["all_reduce"] == 4 * X // 2
    fsdp = moe_setup(4, 2, "fsdp")
    u = units(fsdp)
    assert {k: n for k, (n, _) in u.items() if k.endswith(".experts")} == {
        f"transformer.h.{i}.experts": EXPERTS_PER_LAYER // 2 for i in range(2)
    }
    dense = sum(-(-n // 4) for k, (n, _) in u.items() if not k.endswith(".experts"))
    assert state_bytes(fsdp)["params"] == 4 * (dense + 2 * EXPERTS_PER_LAYER // 2 // 2)


def test_ddp_calls_close_a_bucket_where_the_reduce_group_changes():
    """build_buckets starts a bucket where a parameter's replica group differs (EP's experts: their edp group), so
    the dense gradients of a 2-Block MoE GPT fill one bucket per stretch between expert runs: ddp_comm_calls_per_step
    with each parameter's group counts build_buckets' buckets of each group, at every cap."""
    from model.gpt import GPT
    from parallel.data_parallel.ddp import build_buckets
    from parallel.marks import mark_replicas
    from plan.counts import is_expert, local_params
    from plan.theory import ddp_comm_calls_per_step

    s = moe_setup(4, 2)
    with torch.device("meta"):
        named = list(GPT(s.config).named_parameters())
    edp = object()  # a stand-in process group: build_buckets keys on its identity
    for n, p in named:
        if is_expert(n):
            mark_replicas(p, edp, 0)
    params = local_params(s)
    sizes, groups = [4 * n for _, n, _ in params], [2 if is_expert(n) else 4 for n, _, _ in params]
    for cap in (1, 2**16, 2**20, 25 * 2**20):
        buckets = build_buckets(named, cap)
        assert ddp_comm_calls_per_step(sizes, 4, cap, groups)["all_reduce"] == sum(b.group is None for b in buckets)
        assert ddp_comm_calls_per_step(sizes, 2, cap, groups)["all_reduce"] == sum(b.group is edp for b in buckets)
    assert sum(b.group is None for b in build_buckets(named, 25 * 2**20)) == 3  # ln_f; Block 1; Block 0 + root


def test_moe_saved_bytes_by_hand():
    """One MoE layer in fp32 without EP, N = 64 tokens, counted tensor by tensor (plan.counts.moe_saved_bytes):
    N·(k·(12C + 8H + 32) + 12E + 4) + 4E bytes in place of the dense MLP's 8·N·C·4; EP adds the received rows'
    order and a second index_copy's source, N·k·(8 + 4C) at balance."""
    from plan.counts import moe_saved_bytes

    N = 64
    one = moe_saved_bytes(moe_setup(2, 1), 2, 32)
    assert one == N * (K * (12 * C + 8 * H + 32) + 12 * E + 4) + 4 * E
    assert moe_saved_bytes(moe_setup(2, 2), 2, 32) == one + N * K * (8 + 4 * C) - 4 * E // 2
    s = moe_setup(2, 1)
    assert block_saved_bytes(s, 2, 32, 0) - block_saved_bytes(s, 2, 32) == one - 8 * N * C * 4


def test_tp_moe_block_by_hand():
    """Under TP + SP an MoE Block (replicated, run whole) reduce-scatters neither its ln_2 entry (A(r)) nor its exit
    (A(a)), and has no c_proj bias; its all-gathers (input forward, output gradient backward) match the dense
    Block's. Without SP: neither all-reduce."""
    from model.gpt import make_config

    dense = make_config("tiny", n_layer=2, vocab_size=512)
    B, T, A = 2, 32, 2 * 32 * C * 4
    for sp in (True, False):
        d = theory.tp_comm_bytes_per_micro_step(dense, B, T, 2, True, sp)
        m = theory.tp_comm_bytes_per_micro_step(dense, B, T, 2, True, sp, moe_blocks=2)
        dc = theory.tp_comm_calls_per_micro_step(dense, B, T, 2, True, sp)
        mc = theory.tp_comm_calls_per_micro_step(dense, B, T, 2, True, sp, moe_blocks=2)
        if sp:
            assert {k: d[k] - m[k] for k in d} == {
                "all_reduce": 2 * C * 4,
                "all_gather": 0,
                "reduce_scatter": 2 * 2 * A,
            }
            assert {k: dc[k] - mc[k] for k in dc} == {"all_reduce": 2, "all_gather": 0, "reduce_scatter": 4}
        else:
            assert {k: d[k] - m[k] for k in d} == {"all_reduce": 2 * 2 * A, "all_gather": 0, "reduce_scatter": 0}
            assert {k: dc[k] - mc[k] for k in dc} == {"all_reduce": 4, "all_gather": 0, "reduce_scatter": 0}


def test_plan_enumerates_ep_for_moe_models():
    """`python -m plan --moe_num_experts 4` offers EP at each divisor of E that divides dp x cp (names and flags
    carry it), and a dense model none."""
    from plan.cluster import Cluster

    flags = [
        "--model",
        "tiny",
        "--n_layer",
        "2",
        "--seq_len",
        "64",
        "--total_batch_size",
        "1024",
        "--dtype",
        "float32",
        "--moe_num_experts",
        "4",
    ]
    cl = Cluster(4, 4, 2**40, 1e12, 1e10, 1e10)
    got = candidates(flags, cl, [2], {"pp": 1, "tp": 1, "cp": 1, "ac": "none", "dp_type": "ddp"})
    assert sorted(c.name for c in got) == [
        "dp=4(ddp) ac=none mb=2",
        "dp=4(ddp) ep=2 ac=none mb=2",
        "dp=4(ddp) ep=4 ac=none mb=2",
    ]
    assert all(
        c.setup.dims.ep == int(c.flags[c.flags.index("--expert_parallel_size") + 1]) for c in got if "ep=" in c.name
    )
    assert "ep" in next(c for c in got if "ep=4" in c.name).times
    dense = candidates(flags[:-2], cl, [2], {"pp": 1, "tp": 1, "cp": 1, "ac": "none", "dp_type": "ddp"})
    assert [c.name for c in dense] == ["dp=4(ddp) ac=none mb=2"]


def test_plan_cli_passes_the_expert_flags():
    a = cli.parser().parse_args(["--model", "tiny", "--moe_num_experts", "8", "--moe_top_k", "1", "--moe_every", "2"])
    f = model_flags(a)
    assert f[f.index("--moe_num_experts") + 1] == "8" and f[f.index("--moe_top_k") + 1] == "1"
    assert f[f.index("--moe_every") + 1] == "2" and "--moe_ffn_hidden" not in f


def test_ring_against_ulysses_at_seq_len_8192():
    """gpt2 at seq_len 8,192 on 8 H100s (the issue's long-context case; python -m plan --seq_len 8192 --block_size
    8192): the planner tries both algorithms at every C > 1 (the CP concept's `search`) and C = 8 only by the ring
    (12 heads: C must divide them). Per step Ulysses counts 2/3 of the ring's bytes at C = 2 in bf16 (16 A-bytes a
    layer against 2A x 2 + 2A x 2 + 4A x 4 = 24: the ring's dK, dV travel in fp32), and 2/7 at C = 4 (16 against
    6A x 2 + 6A x 2 + 8A x 4 = 56), so it is predicted faster; it saves one more A a layer (its output by heads
    and by tokens), so its peak is higher."""
    a = cli.parser().parse_args(["--seq_len", "8192", "--block_size", "8192"])
    cl = cli.cluster_of(a)
    fixed = {"pp": 1, "tp": 1, "ac": "none", "dp_type": "ddp"}
    got = {c.name: c for cp in (2, 4, 8) for c in candidates(model_flags(a), cl, [16], {**fixed, "cp": cp})}
    assert sorted(got) == sorted(
        [
            "dp=4(ddp) cp=2 ac=none mb=16",
            "dp=4(ddp) cp=2 ulysses ac=none mb=16",
            "dp=2(ddp) cp=4 ac=none mb=16",
            "dp=2(ddp) cp=4 ulysses ac=none mb=16",
            "dp=1(ddp) cp=8 ac=none mb=16",
        ]
    )
    for cp, third in ((2, 2 / 3), (4, 2 / 7)):
        ring, ulysses = (got[f"dp={8 // cp}(ddp) cp={cp}{v} ac=none mb=16"] for v in ("", " ulysses"))
        sent = ulysses.predicted["comm_bytes"]["all_to_all"]
        assert sent == pytest.approx(third * ring.predicted["comm_bytes"]["p2p"], rel=1e-12)
        assert "p2p" not in ulysses.predicted["comm_bytes"] and ulysses.times["cp"] < ring.times["cp"]
        assert ulysses.seconds < ring.seconds
        assert ulysses.predicted["peak_memory_bytes"] > ring.predicted["peak_memory_bytes"]
