"""train.py with mixture-of-experts layers under expert parallelism: every EP layout (over DDP, ZeRO-1/2/3 and
HSDP) logs one process's losses, gradient norms, val losses and tokens per expert, takes the same expert-bias
steps, sends the all_to_all bytes the formula says, holds and sends the sharding engine's bytes with the experts
sharded over their expert-data-parallel group, checkpoints into any layout, and refuses bad expert flags in one
line.

Each run is a real train.py on the stand-in corpus, a 2-Block tiny GPT whose both Blocks are MoE layers of 4
experts, top-2, with the balancing loss (0.01) and the bias rule (1e-3) both on, 4 micro-batches of 2 rows of
32 tokens per step, 6 steps. Tolerance 1e-5 relative, the data-parallel bound of the README: EP changes which
rank computes an expert's rows, and the order dense gradients are summed (over dp) and expert gradients (over
the expert-data-parallel copies), nothing else.

Routing is discontinuous. At step 1 every layout holds one process's weights bit for bit, so its tokens per
expert equal one process's exactly. Later a token whose k-th and (k+1)-th scores nearly tie (margin below 1e-4:
`expert_near_ties`) may route otherwise; each such token moves one count from one expert to another, so
sum_e |count_e - one process's| <= 2 x the near ties of both runs, per layer and step.
"""

import os
import unittest

import pytest
import torch

from model.gpt import GPT, decays, make_config
from plan.theory import ep_all_to_all_bytes_per_micro_step, fsdp_unit_state_bytes, zero_comm_bytes_per_step
from tests.harness import (
    WholeRuns,
    check_against,
    check_resume_from,
    checkpoint_params,
    expect_train_error_in_process,
    expect_train_error_on_ranks,
    rank0_only,
    read_jsonl,
    steps_of,
)

STEPS, MB, T, C, E, K = 6, 2, 32, 64, 4, 2
M = 4  # micro-batches per step, over all dp ranks
MOE = [
    "--moe_num_experts",
    str(E),
    "--moe_top_k",
    str(K),
    "--moe_aux_loss_coeff",
    "0.01",
    "--moe_bias_update_rate",
    "1e-3",
]
BASE = [
    "--model",
    "tiny",
    "--n_layer",
    "2",
    "--micro_batch_size",
    str(MB),
    "--seq_len",
    str(T),
    "--total_batch_size",
    str(M * MB * T),
    "--eval_interval",
    "3",
    "--eval_iters",
    "2",
    "--warmup_steps",
    "2",
    "--lr",
    "3e-3",
    "--gradient_clipping",
    "--peak_flops",
    "1e12",
    *MOE,
]
LAYOUTS = {
    "ep2": (["--data_parallel_size", "2", "--data_parallel_type", "ddp", "--expert_parallel_size", "2"], 2),
    "ep2_dp4": (["--data_parallel_size", "4", "--data_parallel_type", "ddp", "--expert_parallel_size", "2"], 4),
    "ep4": (["--data_parallel_size", "4", "--data_parallel_type", "ddp", "--expert_parallel_size", "4"], 4),
    "ep2_cp2": (["--context_parallel_size", "2", "--expert_parallel_size", "2"], 2),
    "ep2_ac": (
        [
            "--data_parallel_size",
            "2",
            "--data_parallel_type",
            "ddp",
            "--expert_parallel_size",
            "2",
            "--activation_checkpointing",
            "full",
        ],
        2,
    ),
    "ep2_fsdp_ac": (
        [
            "--data_parallel_size",
            "2",
            "--data_parallel_type",
            "fsdp",
            "--expert_parallel_size",
            "2",
            "--activation_checkpointing",
            "selective",
        ],
        2,
    ),
    "ep2_deferred": (
        ["--data_parallel_size", "2", "--data_parallel_type", "ddp", "--expert_parallel_size", "2", "--deferred_init"],
        2,
    ),
    "tp2": (["--tensor_parallel_size", "2"], 2),
    "tp2_sp_ep2": (
        [
            "--tensor_parallel_size",
            "2",
            "--sequence_parallel",
            "--enable_loss_parallelism",
            "--data_parallel_size",
            "2",
            "--data_parallel_type",
            "ddp",
            "--expert_parallel_size",
            "2",
        ],
        4,
    ),
}
TP_RTOL = 1e-4  # the README's tensor-parallel tolerance (the "1e-4 with TP")
FOUR = ["--n_layer", "4"]  # the pipeline rows: 4 MoE Blocks, against one process of 4
PIPELINES = {
    "pp2_interleaved": (
        ["--pipeline_parallel_size", "2", "--pp_schedule", "interleaved_1f1b", "--pp_virtual_stages", "2"],
        2,
    ),
    "pp2_ep2": (
        [
            "--pipeline_parallel_size",
            "2",
            "--data_parallel_size",
            "2",
            "--data_parallel_type",
            "ddp",
            "--expert_parallel_size",
            "2",
        ],
        4,
    ),
    "pp2_zbv_ep2": (
        [
            "--pipeline_parallel_size",
            "2",
            "--pp_schedule",
            "zbv",
            "--pp_virtual_stages",
            "2",
            "--data_parallel_size",
            "2",
            "--data_parallel_type",
            "ddp",
            "--expert_parallel_size",
            "2",
        ],
        4,
    ),
}
# over the sharding engine: (flags, ranks); SHARDED[name] = (ZeRO stage, dp, HSDP replicas)
SHARDED = {
    "ep2_fsdp": (3, 2, 1),
    "ep2_zero1": (1, 2, 1),
    "ep2_zero2": (2, 2, 1),
    "ep2_dp4_fsdp": (3, 4, 1),
    "ep2_hsdp_zero1": (1, 4, 2),
}
for _name, (_stage, _dp, _rep) in SHARDED.items():
    LAYOUTS[_name] = (
        [
            "--data_parallel_size",
            str(_dp),
            "--data_parallel_replicate_size",
            str(_rep),
            "--data_parallel_type",
            {1: "zero1", 2: "zero2", 3: "fsdp"}[_stage],
            "--expert_parallel_size",
            "2",
        ],
        _dp,
    )
LAYOUTS["ep2_dp4_fsdp"][0].append("--deferred_init")  # built on meta: EP draws its experts, FSDP the rest

RUNS = WholeRuns(BASE)
setUpModule, tearDownModule = RUNS.set_up, RUNS.tear_down


def run(name: str, flags: list[str], nproc: int) -> str:
    """Train once per name; checkpoints at steps 3 and 6 (kept)."""
    return RUNS.run(
        name, ["--max_steps", str(STEPS), "--checkpoint_interval", "3", "--keep_checkpoints", "2", *flags], nproc
    )


def final_bias(out: str) -> dict[str, torch.Tensor]:
    """Each MoE layer's expert bias in the run's last checkpoint."""
    from checkpoints import checkpoint

    params = checkpoint_params(checkpoint.newest(out))
    return {n: t for n, t in params.items() if n.endswith("expert_bias")}


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestExpertParallelAgreesWithOneProcess(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.single = run("single", [], 1)
        cls.ref = steps_of(cls.single)

    def test_reference_learns_and_routes(self):
        self.assertLess(self.ref[STEPS]["loss"], self.ref[1]["loss"] - 0.1)
        tokens = self.ref[1]["expert_tokens"]
        self.assertEqual(sorted(tokens), ["0", "1"])
        self.assertTrue(all(sum(c) == M * MB * T * K for c in tokens.values()))  # every token reaches k experts
        self.assertGreater(self.ref[1]["moe_aux_loss"], 0.0)

    def test_mfu_counts_the_active_parameters(self):
        """MFU's 6N counts K of each layer's E experts (metrics.active_params), not all of them: one process and
        EP = 2 (each rank holding half the experts) alike. The logged MFU against tokens/s and --peak_flops 1e12:
        equal within float64 rounding of the one product."""
        from checkpoints import checkpoint
        from runtime.metrics import active_params, flops_per_token

        config = checkpoint.model_config(checkpoint.read_manifest(checkpoint.newest(self.single)))
        self.assertEqual((config.moe_num_experts, config.moe_top_k), (E, K))
        per_token = flops_per_token(config, active_params(config, non_embedding=True), T)
        for out, world in ((self.single, 1), (run("ep2", *LAYOUTS["ep2"]), 2)):
            for s, r in steps_of(out).items():
                self.assertAlmostEqual(
                    r["mfu"],
                    per_token * r["tokens_per_sec"] / (1e12 * world),
                    delta=1e-12 * r["mfu"],
                    msg=f"world {world} step {s}",
                )

    def check_layout(self, name: str, four: bool = False) -> None:
        flags, nproc = (PIPELINES if four else LAYOUTS)[name]
        single = run("single4", FOUR, 1) if four else self.single
        ref = steps_of(single)
        out = run(name, [*FOUR, *flags] if four else flags, nproc)
        got = check_against(self, out, single, STEPS, [0, 3, STEPS], TP_RTOL if name.startswith("tp") else 1e-5)
        self.assertEqual(got[1]["expert_tokens"], ref[1]["expert_tokens"])  # step 1: exactly
        flipped = 0
        for s in range(2, STEPS + 1):
            for layer, counts in got[s]["expert_tokens"].items():
                diff = sum(abs(a - b) for a, b in zip(counts, ref[s]["expert_tokens"][layer]))
                ties = got[s]["expert_near_ties"][layer] + ref[s]["expert_near_ties"][layer]
                self.assertLessEqual(diff, 2 * ties, f"{name}: step {s} layer {layer}")
                flipped += diff // 2
        if all(got[s]["expert_tokens"] == ref[s]["expert_tokens"] for s in got):
            for layer, bias in final_bias(out).items():  # the same loads every step: the same bias steps
                self.assertTrue(torch.equal(bias, final_bias(single)[layer]), f"{name}: {layer}")
        print(f"{name}: {flipped} token(s) routed otherwise than one process in steps 2-{STEPS}")

    def test_ep2_dp2(self):
        self.check_layout("ep2")

    def test_ep2_dp4(self):
        """dp > EP: two EP groups of 2, each expert on 2 ranks (its edp group)."""
        self.check_layout("ep2_dp4")

    def test_ep4_dp4(self):
        self.check_layout("ep4")

    def test_ep2_cp2(self):
        """EP borrows the context-parallel ranks: each routes its share of every row's tokens; the balancing
        loss counts the micro-batch's tokens over cp."""
        self.check_layout("ep2_cp2")

    def test_ep2_activation_checkpointing(self):
        """A checkpointed Block recomputes its MoE layer, all_to_alls included, inside backward."""
        self.check_layout("ep2_ac")

    def test_ep2_fsdp_activation_checkpointing(self):
        """Over the sharding engine, the recomputation runs on the views a backward hook showed (grad mode off
        there): they must lead to the unit's flat gradient as the forward's did (before, the experts' views were
        leaves of their own and checkpoint refused: fewer tensors saved in recomputation)."""
        self.check_layout("ep2_fsdp_ac")

    def test_deferred_init_is_bit_equal(self):
        """Built on meta, each EP rank draws only its own experts, by name: step 1's loss and grad norm are the eager
        EP run's bits."""
        self.check_layout("ep2_deferred")
        eager, deferred = steps_of(run("ep2", *LAYOUTS["ep2"])), steps_of(RUNS["ep2_deferred"])
        self.assertEqual((deferred[1]["loss"], deferred[1]["grad_norm"]), (eager[1]["loss"], eager[1]["grad_norm"]))

    def test_tensor_parallel(self):
        """The MoE layers replicated over TP, each tp rank running them whole: plain TP, and TP with sequence and
        loss parallelism x EP = 2 over dp = 2 (each tp coordinate its own EP group)."""
        for name in ("tp2", "tp2_sp_ep2"):
            with self.subTest(name=name):
                self.check_layout(name)

    def test_pipelines(self):
        """Each chunk's balancing loss goes into its own backward: interleaved 1F1B alone, and pp=2 x EP=2 under
        1F1B and ZB-V (the split backward)."""
        for name in PIPELINES:
            with self.subTest(name=name):
                self.check_layout(name, four=True)

    def test_ep2_fsdp(self):
        """EP = dp = 2 over ZeRO-3: the dense units sharded over dp, each rank's experts a unit of their own over
        their expert-data-parallel group (one rank here: kept whole)."""
        self.check_layout("ep2_fsdp")

    def test_ep2_zero1(self):
        self.check_layout("ep2_zero1")

    def test_ep2_zero2(self):
        self.check_layout("ep2_zero2")

    def test_ep2_dp4_fsdp(self):
        """dp = 4, EP = 2: each expert unit sharded 1/2 over its edp group (loss ranks r, r + 2). Built on meta
        (--deferred_init): EP draws its ranks' experts, then the engine materialises each unit around them."""
        self.check_layout("ep2_dp4_fsdp")

    def test_ep2_hsdp_zero1(self):
        """HSDP (2 replicas of 2 shards) x EP = 2 on ZeRO-1: the dense units sharded within a replica and all-reduced
        over the replicas; the expert units sharded over their edp group (which spans the replicas: loss rank 2 is
        shard 0 of its replica but edp rank 1), never all-reduced; ZeRO-1's full gradients kept over the step's
        micro-steps and reduce-scattered once, for both kinds of unit."""
        self.check_layout("ep2_hsdp_zero1")

    def test_compiled(self):
        """--compile (each Block through inductor; the MoE layer's all_to_alls and its host read of the split sizes
        break the graph, its experts run the per-expert loop, torch._grouped_mm's traced kernel taking bf16 only):
        EP = 2 against the compiled one process, 1e-5, and the tokens per expert equal."""
        single = steps_of(run("compiled_single", ["--compile"], 1))
        got = steps_of(run("compiled_ep2", ["--compile", *LAYOUTS["ep2"][0]], 2))
        for s in single:
            for key in ("loss", "grad_norm"):
                self.assertLessEqual(abs(got[s][key] - single[s][key]), 1e-5 * abs(single[s][key]), f"{s} {key}")
            self.assertEqual(got[s]["expert_tokens"], single[s]["expert_tokens"])
            self.assertGreater(got[s]["compiled_graphs"], 0)

    def test_debug_diff_reads_expert_runs(self):
        """`python -m debug diff` over --trace_step runs of one process and EP = 2: every module output (the MoE
        layer's, by token; not its expert-grouped insides) and gradient (each EP rank's experts at their places in
        the full tensors) within the EP tolerance; the expert bias, a buffer, has no gradient to trace."""
        import contextlib
        import io

        from debug import diff

        a = run("traced_single", ["--trace_step", "2"], 1)
        b = run("traced_ep2", ["--trace_step", "2", *LAYOUTS["ep2"][0]], 2)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = diff.diff(a, b)
        self.assertEqual(code, 0, out.getvalue())
        self.assertIn("agree:", out.getvalue())
        self.assertIn("dp=2 ep=2", out.getvalue())

    def test_all_to_all_bytes_equal_the_formula(self):
        """Rank 0 of EP = dp = 2 holds experts 0 and 1; each of its 2 micro-steps moves its own N·k rows and the
        rows that reached experts 0 and 1 (of both ranks' tokens: the step's tokens for them, logged), so per step
        M/dp x the formula at their mean, summed: 2·(8E + 2·N·k·C·4)·layers + 2·R·C·4, R the step's rows for experts
        0 and 1 over both layers and micro-steps."""
        got = steps_of(run("ep2", *LAYOUTS["ep2"]))
        N = MB * T
        for s, r in got.items():
            received = sum(c[0] + c[1] for c in r["expert_tokens"].values())
            want = (M // 2) * ep_all_to_all_bytes_per_micro_step(N, K, C, E, 2, received=0) + 2 * received * C * 4
            self.assertEqual(r["comm_bytes"]["all_to_all"], want, f"step {s}")
            self.assertEqual(r["comm_calls"]["all_to_all"], (M // 2) * 5 * 2)

    def test_all_to_all_bytes_in_bf16(self):
        """The same layout under bf16 autocast: rows and outputs move in bf16 (the rows cast before they are sent,
        moe.expert_rows; ln_2's output is fp32), so 2·(8E + 2·N·k·C·2)·layers + 2·R·C·2 per step, half of fp32's
        row bytes (fp32 rows made it 2·(8E + N·k·C·(4 + 2))·layers + R·C·(2 + 4)). The run's own prediction
        (plan.predict, logged) assumes balanced routing: measured minus predicted is exactly 2·C·2·(R - R_balanced),
        R_balanced = N·k per layer and micro-step."""
        out = run("ep2_bf16", [*LAYOUTS["ep2"][0], "--dtype", "bfloat16"], 2)
        got = steps_of(out)
        predicted = next(r["predicted"] for r in read_jsonl(out) if "predicted" in r)["comm_bytes"]["all_to_all"]
        N = MB * T
        for s, r in got.items():
            received = sum(c[0] + c[1] for c in r["expert_tokens"].values())
            want = (M // 2) * ep_all_to_all_bytes_per_micro_step(
                N, K, C, E, 2, dtype_bytes=2, received=0
            ) + 2 * received * C * 2
            self.assertEqual(r["comm_bytes"]["all_to_all"], want, f"step {s}")
            self.assertEqual(want - predicted, 2 * C * 2 * (received - (M // 2) * 2 * N * K), f"step {s}")


def engine_units(ep: int) -> dict[str, tuple[int, int, bool]]:
    """The sharding engine's units on one EP rank, from first principles: {unit: (elements, elements that get weight
    decay, expert unit)}; the root (wte = lm_head, wpe, ln_f), each Block's dense parameters (the router among them)
    and, in a unit of its own, each Block's E/ep experts (their stacked weights and biases)."""
    with torch.device("meta"):
        gpt = GPT(make_config("tiny", n_layer=2, moe_num_experts=E, moe_top_k=K))
    units: dict[str, list] = {}
    for name, p in gpt.named_parameters():
        expert = ".experts." in name
        unit = ".".join(name.split(".")[:3]) if name.startswith("transformer.h.") else "root"
        n = p.numel() // ep if expert else p.numel()
        u = units.setdefault(unit + (".experts" if expert else ""), [0, 0, expert])
        u[0] += n
        u[1] += n if decays(name, p) else 0
    return {k: tuple(v) for k, v in units.items()}


def padded(group: int, kind: str) -> int:
    """Elements of the root's, the Blocks' dense or the expert units' ("root", "blocks", "experts") flat buffers at
    EP = 2, each padded to a multiple of its group's size."""
    units = engine_units(2)
    of = {name: "experts" if e else "root" if name == "root" else "blocks" for name, (_, _, e) in units.items()}
    return sum(-(-n // group) * group for name, (n, _, _) in units.items() if of[name] == kind)


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestShardedBytes(unittest.TestCase):
    """Rank 0's state and sharding traffic under EP over the sharding engine (dp ranks, R HSDP replicas, S = dp / R
    ranks per dense shard group, D = dp / EP ranks per expert-data-parallel group, k = M / dp micro-steps per rank).

    State: every dense unit is 1/S per rank and every expert unit (E/EP experts of one Block) 1/D:
    `plan.theory.fsdp_unit_state_bytes` per unit, with world S for the dense units and D for the expert units.
    Sent: the ZeRO formulas (`plan.theory.zero_comm_bytes_per_step`) of the dense units over S with R replicas,
    plus the same formula of the expert units as Blocks sharded over D with no replicas (the planner's own unit
    model, plan/predict.py, does not know expert units yet: this is the hand count). The experts' units are
    never all-reduced over HSDP's replicas: their edp group already spans them."""

    def records(self, name: str) -> dict[int, dict]:
        run(name, *LAYOUTS[name])
        return steps_of(RUNS[name])

    def test_state_bytes(self):
        for name, (stage, dp, rep) in SHARDED.items():
            S, D = dp // rep, dp // 2
            policy = {1: (True, True), 2: (True, False), 3: (False, False)}[stage]
            want = dict.fromkeys(("params", "grads", "optimizer"), 0)
            for n, n_decay, expert in engine_units(2).values():
                for k, v in fsdp_unit_state_bytes(n, n_decay, D if expert else S, 0, *policy).items():
                    want[k] += v
            for s, r in self.records(name).items():
                self.assertEqual(r["state_bytes_by_kind"], want, f"{name}: step {s}")

    def test_fsdp_state_by_hand(self):
        """EP = dp = 2, ZeRO-3: the dense Ψ_d halved, the experts whole (D = 1): params = grads = 4·(Ψ_d/2 + X/2),
        X the elements of all experts; AdamW twice that and a step counter per shard piece (rank 0: the root's
        and each Block's decayed part, each expert unit's two). EP = 2 over DDP holds 4·(Ψ_d + X/2) of each: the
        difference is the dense half alone. dp = 4: the dense part 1/4 and each expert unit 1/2."""
        units = engine_units(1)
        dense = sum(n for n, _, e in units.values() if not e)
        experts = sum(n for n, _, e in units.values() if e)
        root = 50304 * C + 1024 * C + 2 * C  # wte (= lm_head), wpe, ln_f
        block = 2 * 2 * C + 4 * (C * C + C) + E * C  # ln_1, ln_2, q k v proj, the router
        self.assertEqual((dense, experts), (root + 2 * block, 2 * E * (2 * C * 4 * C + 4 * C + C)))
        got = self.records("ep2_fsdp")[1]["state_bytes_by_kind"]
        self.assertEqual(
            got,
            {
                "params": 4 * (dense // 2 + experts // 2),
                "grads": 4 * (dense // 2 + experts // 2),
                "optimizer": 8 * (dense // 2 + experts // 2) + 4 * (1 + 2 + 2 * 2),
            },
        )
        ddp = steps_of(run("ep2", *LAYOUTS["ep2"]))[1]["state_bytes_by_kind"]
        self.assertEqual(ddp["params"] - got["params"], 4 * dense // 2)
        got4 = self.records("ep2_dp4_fsdp")[1]["state_bytes_by_kind"]
        self.assertEqual(got4["params"], 4 * (dense // 4 + experts // 4))

    def test_sharding_bytes(self):
        """all_reduce, all_gather and reduce_scatter of rank 0 each step (the all_to_alls are EP's own: above). ZeRO-1/2
        all-gather the updated shards at the step's first forward after the optimizer step, which is the evaluation
        when one follows a step (steps 0 and 3): steps 1 and 4 count none (tests/test_zero.py)."""
        for name, (stage, dp, rep) in SHARDED.items():
            S, D, k = dp // rep, dp // 2, M // dp
            dense = zero_comm_bytes_per_step(stage, padded(S, "root"), padded(S, "blocks"), S, rep, k)
            expert = zero_comm_bytes_per_step(stage, 0, padded(D, "experts"), D, 1, k)
            for s, r in self.records(name).items():
                want = {kind: dense[kind] + expert[kind] for kind in dense}
                if stage < 3 and (s - 1) % 3 == 0:
                    want["all_gather"] = 0
                got = {kind: r["comm_bytes"][kind] for kind in want}
                self.assertEqual(got, want, f"{name}: step {s}")


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestCheckpointsAcrossLayouts(unittest.TestCase):
    """A checkpoint holds every expert under its full name and position, and the expert bias: EP = 2 -> one process
    and one process -> EP = 4 continue within 1e-5 of the run that saved them (steps 4-6)."""

    def resumed(self, source: str, flags: list[str], nproc: int, name: str) -> None:
        out = RUNS.path(name)
        check_resume_from(
            self,
            RUNS[source],
            3,
            [*RUNS.base, "--dataset", RUNS.data, "--max_steps", str(STEPS), *flags],
            nproc,
            out,
            STEPS,
        )
        got, ref = steps_of(out), steps_of(RUNS[source])
        for s in range(4, STEPS + 1):
            for key in ("loss", "grad_norm"):
                self.assertLessEqual(abs(got[s][key] - ref[s][key]), 1e-5 * abs(ref[s][key]), f"{name} {s} {key}")

    def test_ep2_to_one_process(self):
        run("ep2", *LAYOUTS["ep2"])
        self.resumed("ep2", [], 1, "ep2_to_single")

    def test_one_process_to_ep4(self):
        run("single", [], 1)
        self.resumed("single", LAYOUTS["ep4"][0], 4, "single_to_ep4")

    def test_ep2_fsdp_to_one_process(self):
        """Saved by EP = 2 over ZeRO-3 on dp = 4: each rank writes its shard of its edp group's experts, at their
        positions in the full tensors; the buffers (expert bias) once."""
        run("ep2_dp4_fsdp", *LAYOUTS["ep2_dp4_fsdp"])
        self.resumed("ep2_dp4_fsdp", [], 1, "ep2_dp4_fsdp_to_single")

    def test_ep2_hsdp_to_one_process(self):
        """Saved by HSDP x EP = 2: the dense shards by replica 0, the experts by every rank (no replica of them)."""
        run("ep2_hsdp_zero1", *LAYOUTS["ep2_hsdp_zero1"])
        self.resumed("ep2_hsdp_zero1", [], 1, "ep2_hsdp_zero1_to_single")

    def test_one_process_to_ep2_zero2(self):
        run("single", [], 1)
        self.resumed("single", LAYOUTS["ep2_zero2"][0], 2, "single_to_ep2_zero2")


class TestRefusals(unittest.TestCase):
    """Bad expert flags: one line, exit 2, before any work (in this process where one rank shows it)."""

    def test_one_rank(self):
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out")
            for flags, needle in (
                (["--moe_num_experts", "2", "--moe_top_k", "3"], "--moe_top_k 3 > --moe_num_experts 2"),
                (["--moe_num_experts", "4", "--init_from", "gpt2"], "OpenAI's GPT-2 has no experts"),
                (["--expert_parallel_size", "2"], "must divide data_parallel_size"),
                (["--moe_num_experts", "-1"], "--moe_num_experts must be >= 0"),
                (
                    [
                        "--moe_num_experts",
                        "4",
                        "--n_layer",
                        "2",
                        "--moe_every",
                        "5",  # a dense model
                        "--max_steps",
                        "1",
                    ],
                    "--moe_every 5 with 2 Blocks gives no Block experts",
                ),
            ):
                with self.subTest(flags=flags):
                    expect_train_error_in_process(self, ["--model", "tiny", *flags], needle, out)

    @pytest.mark.slow
    def test_on_ranks(self):
        import tempfile

        dp2 = ["--model", "tiny", "--data_parallel_size", "2", "--data_parallel_type", "ddp"]
        with tempfile.TemporaryDirectory() as tmp:
            for flags, needle in (
                (
                    ["--moe_num_experts", "3", "--expert_parallel_size", "2"],
                    "not divisible by --expert_parallel_size 2",
                ),
                (
                    ["--moe_num_experts", "4", "--expert_parallel_size", "2", "--implementation", "pytorch"],
                    "no expert-parallel wrapper",
                ),
                (["--expert_parallel_size", "2"], "needs an MoE model"),
            ):
                with self.subTest(flags=flags):
                    expect_train_error_on_ranks(self, [*dp2, *flags], needle, 2, os.path.join(tmp, "out"))


if __name__ == "__main__":
    unittest.main()
