"""train.py with mixture-of-experts layers under expert parallelism: every EP layout logs one process's losses,
gradient norms, val losses and tokens per expert, takes the same expert-bias steps, sends the all_to_all bytes
the formula says, checkpoints into any layout, and refuses bad expert flags in one line.

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

from plan.theory import ep_all_to_all_bytes_per_micro_step
from tests.harness import (WholeRuns, check_against, check_resume_from, checkpoint_params, expect_train_error_in_process,
                           expect_train_error_on_ranks, rank0_only, steps_of)

STEPS, MB, T, C, E, K = 6, 2, 32, 64, 4, 2
M = 4  # micro-batches per step, over all dp ranks
MOE = ["--moe_num_experts", str(E), "--moe_top_k", str(K), "--moe_aux_loss_coeff", "0.01",
       "--moe_bias_update_rate", "1e-3"]
BASE = ["--model", "tiny", "--n_layer", "2", "--micro_batch_size", str(MB), "--seq_len", str(T),
        "--total_batch_size", str(M * MB * T), "--eval_interval", "3", "--eval_iters", "2", "--warmup_steps", "2",
        "--lr", "3e-3", "--gradient_clipping", "--peak_flops", "1e12", *MOE]
LAYOUTS = {"ep2": (["--data_parallel_size", "2", "--data_parallel_type", "ddp", "--expert_parallel_size", "2"], 2),
           "ep2_dp4": (["--data_parallel_size", "4", "--data_parallel_type", "ddp", "--expert_parallel_size", "2"], 4),
           "ep4": (["--data_parallel_size", "4", "--data_parallel_type", "ddp", "--expert_parallel_size", "4"], 4),
           "ep2_cp2": (["--context_parallel_size", "2", "--expert_parallel_size", "2"], 2),
           "ep2_ac": (["--data_parallel_size", "2", "--data_parallel_type", "ddp", "--expert_parallel_size", "2",
                       "--activation_checkpointing", "full"], 2),
           "ep2_deferred": (["--data_parallel_size", "2", "--data_parallel_type", "ddp", "--expert_parallel_size", "2",
                             "--deferred_init"], 2),
           "tp2": (["--tensor_parallel_size", "2"], 2),
           "tp2_sp_ep2": (["--tensor_parallel_size", "2", "--sequence_parallel", "--enable_loss_parallelism",
                           "--data_parallel_size", "2", "--data_parallel_type", "ddp", "--expert_parallel_size", "2"],
                          4)}
TP_RTOL = 1e-4  # the README's tensor-parallel tolerance (the "1e-4 with TP")
FOUR = ["--n_layer", "4"]  # the pipeline rows: 4 MoE Blocks, against one process of 4
PIPELINES = {"pp2_interleaved": (["--pipeline_parallel_size", "2", "--pp_schedule", "interleaved_1f1b",
                                  "--pp_virtual_stages", "2"], 2),
             "pp2_ep2": (["--pipeline_parallel_size", "2", "--data_parallel_size", "2", "--data_parallel_type", "ddp",
                          "--expert_parallel_size", "2"], 4),
             "pp2_zbv_ep2": (["--pipeline_parallel_size", "2", "--pp_schedule", "zbv", "--pp_virtual_stages", "2",
                              "--data_parallel_size", "2", "--data_parallel_type", "ddp", "--expert_parallel_size", "2"], 4)}

RUNS = WholeRuns(BASE)
setUpModule, tearDownModule = RUNS.set_up, RUNS.tear_down


def run(name: str, flags: list[str], nproc: int) -> str:
    """Train once per name; checkpoints at steps 3 and 6 (kept)."""
    return RUNS.run(name, ["--max_steps", str(STEPS), "--checkpoint_interval", "3", "--keep_checkpoints", "2",
                           *flags], nproc)


def final_bias(out: str) -> dict[str, torch.Tensor]:
    """Each MoE layer's expert bias in the run's last checkpoint."""
    import checkpoint
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
        import checkpoint
        from metrics import active_params, flops_per_token
        config = checkpoint.model_config(checkpoint.read_manifest(checkpoint.newest(self.single)))
        self.assertEqual((config.moe_num_experts, config.moe_top_k), (E, K))
        per_token = flops_per_token(config, active_params(config, non_embedding=True), T)
        for out, world in ((self.single, 1), (run("ep2", *LAYOUTS["ep2"]), 2)):
            for s, r in steps_of(out).items():
                self.assertAlmostEqual(r["mfu"], per_token * r["tokens_per_sec"] / (1e12 * world),
                                       delta=1e-12 * r["mfu"], msg=f"world {world} step {s}")

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


@pytest.mark.slow
@unittest.skipUnless(rank0_only(), "whole-job test: rank 0 launches its own ranks")
class TestCheckpointsAcrossLayouts(unittest.TestCase):
    """A checkpoint holds every expert under its full name and position, and the expert bias: EP = 2 -> one process
    and one process -> EP = 4 continue within 1e-5 of the run that saved them (steps 4-6)."""

    def resumed(self, source: str, flags: list[str], nproc: int, name: str) -> None:
        out = RUNS.path(name)
        check_resume_from(self, RUNS[source], 3, [*RUNS.base, "--dataset", RUNS.data, "--max_steps", str(STEPS),
                                                  *flags], nproc, out, STEPS)
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


class TestRefusals(unittest.TestCase):
    """Bad expert flags: one line, exit 2, before any work (in this process where one rank shows it)."""

    def test_one_rank(self):
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out")
            for flags, needle in ((["--moe_num_experts", "2", "--moe_top_k", "3"], "--moe_top_k 3 > --moe_num_experts 2"),
                                  (["--moe_num_experts", "4", "--init_from", "gpt2"], "OpenAI's GPT-2 has no experts"),
                                  (["--expert_parallel_size", "2"], "must divide data_parallel_size"),
                                  (["--moe_num_experts", "-1"], "--moe_num_experts must be >= 0")):
                with self.subTest(flags=flags):
                    expect_train_error_in_process(self, ["--model", "tiny", *flags], needle, out)

    @pytest.mark.slow
    def test_on_ranks(self):
        import tempfile
        dp2 = ["--model", "tiny", "--data_parallel_size", "2", "--data_parallel_type", "ddp"]
        with tempfile.TemporaryDirectory() as tmp:
            for flags, needle in (
                    (["--moe_num_experts", "3", "--expert_parallel_size", "2"], "not divisible by --expert_parallel_size 2"),
                    (["--moe_num_experts", "4", "--expert_parallel_size", "2", "--implementation", "pytorch"],
                     "no expert-parallel wrapper"),
                    (["--expert_parallel_size", "2"], "needs an MoE model")):
                with self.subTest(flags=flags):
                    expect_train_error_on_ranks(self, [*dp2, *flags], needle, 2, os.path.join(tmp, "out"))


if __name__ == "__main__":
    unittest.main()
