"""The PyTorch twin of context parallelism (`--implementation pytorch`): what of it can be checked without CUDA.

- **Its tokens are ours.** On 2 and 4 gloo ranks, `parallel.context_parallel.ring.torch_context_parallel` (torch's
  `context_parallel`, head-tail load balance) hands each rank exactly the tokens our zigzag split gives it
  (`shard_sequence`), 1-token chunks included, and the positions our model embeds (`local_positions`). So
  twin and ours see the same tokens at the same positions, and the same losses are expected on a GPU.
- **Why it is refused on CPU.** Inside it, CPU attention raises NotImplementedError: torch rings only the
  flash, memory-efficient and cuDNN kernels. If a torch release lifts that, this test fails and the refusal
  in parallel/context_parallel/concept.check_context should go. The context also puts
  F.scaled_dot_product_attention back on exit.
- **What it composes with.** check_context (fast, in process) refuses the twin off CUDA and with TP, PP, HSDP
or --compile,
  and lets it through on CUDA with data parallelism (checked on a `cuda` device object; no GPU needed).
  Dropout under CP is refused for ours and the twin alike, and SP with CP needs each cp rank's T/C tokens
  divisible by tp.

The twin itself runs in scripts/gpu_check.py (stage "context parallel"), on a one-rank cp mesh.
"""

import unittest

import pytest
import torch
import torch.nn.functional as F

from model.gpt import GPTConfig
from parallel.context_parallel.concept import check_context
from parallel.context_parallel.ring import local_positions, shard_sequence
from parallel.mesh import ParallelDims
from parallel.twins.context_parallel import torch_context_parallel
from runtime.registry import Checking
from tests.harness import run_distributed
from trainer.config import UsageError, run_checks, train_parser


def shards(rank: int, world: int) -> list:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    out = []
    for T in (2 * world, 8 * world):  # the first: chunks of one token
        x = torch.arange(3 * T).reshape(3, T)  # rows of distinct tokens
        y = x + 1000
        full_x, full_y = x.clone(), y.clone()
        with torch_context_parallel(mesh, x, y) as (lx, ly):
            case = {
                "T": T,
                "x": torch.equal(lx, shard_sequence(full_x, rank, world)),
                "y": torch.equal(ly, shard_sequence(full_y, rank, world)),
                "positions": lx[0].tolist() == local_positions(T, rank, world).tolist(),
                "inputs_kept": torch.equal(x, full_x) and torch.equal(y, full_y),
            }
            q = torch.randn(2, 2, T // world, 4)
            try:
                F.scaled_dot_product_attention(q, q, q, is_causal=True)
                case["cpu_attention"] = "ran"
            except NotImplementedError as e:
                case["cpu_attention"] = str(e)
        case["sdpa_restored"] = F.scaled_dot_product_attention is SDPA
        out.append(case)
    return out


SDPA = F.scaled_dot_product_attention


@pytest.mark.slow  # a multi-rank launch: kept out of the fast loop
class TestTorchContextParallelTokens(unittest.TestCase):
    def test_same_tokens_and_positions_as_ours(self):
        for world in (2, 4):
            for rank, cases in enumerate(run_distributed(shards, world)):
                for c in cases:
                    with self.subTest(world=world, rank=rank, T=c["T"]):
                        for key in ("x", "y", "positions", "inputs_kept", "sdpa_restored"):
                            self.assertTrue(c[key], key)
                        self.assertIn("does not have a sharding strategy registered", c["cpu_attention"])
                        self.assertIn("_scaled_dot_product_flash_attention_for_cpu", c["cpu_attention"])


def check(flags: list[str], world: int, device: str, config: GPTConfig | None = None) -> None:
    """check_context on the flags, after the layout checks validate runs before it (every concept's, phase "layout"),
    so a case refused there (dp > 1 without --data_parallel_type, ...) never counts as this check's refusal
    or as let through."""
    args = train_parser().parse_args(["--seq_len", "64", *flags])  # a later --seq_len wins
    dims = ParallelDims(
        args.data_parallel_size,
        args.tensor_parallel_size,
        world,
        args.pipeline_parallel_size,
        args.data_parallel_replicate_size,
        args.context_parallel_size,
    )
    c = Checking(args, dims=dims, dtype=torch.float32, device=torch.device(device), config=config or GPTConfig())
    run_checks("layout", c)
    check_context(c)


class TestContextLayoutChecks(unittest.TestCase):
    """check_context on its own (no processes): the world size is whatever the flags multiply to."""

    TWIN = ["--implementation", "pytorch", "--context_parallel_size", "2"]

    def test_refused_off_cuda(self):
        with self.assertRaisesRegex(
            UsageError,
            "needs CUDA: PyTorch's context_parallel rings only the flash, memory-efficient and cuDNN SDPA kernels",
        ):
            check(self.TWIN, 2, "cpu")

    def test_refused_with_tp_pp_compile_hsdp(self):
        for flags, world in (
            (["--tensor_parallel_size", "2"], 4),
            (["--pipeline_parallel_size", "2"], 4),
            (["--compile"], 2),
            (["--data_parallel_size", "2", "--data_parallel_type", "fsdp", "--data_parallel_replicate_size", "2"], 4),
        ):
            with self.subTest(flags=flags), self.assertRaisesRegex(UsageError, "composes with data parallelism only"):
                check(self.TWIN + flags, world, "cuda")

    def test_sequence_parallel_needs_the_share_divisible_by_tp(self):
        """seq_len 36: divisible by 2C = 4, but each cp rank's 18 tokens do not split over tp = 4 (ours, SP)."""
        flags = ["--context_parallel_size", "2", "--tensor_parallel_size", "4", "--sequence_parallel"]
        with self.assertRaisesRegex(
            UsageError,
            "--sequence_parallel with --context_parallel_size 2 needs each "
            "rank's share of a sequence \\(--seq_len / C = 18\\) divisible by "
            "--tensor_parallel_size \\(4\\)",
        ):
            check([*flags, "--seq_len", "36"], 8, "cpu")
        check(flags, 8, "cpu")  # seq_len 64: shares of 32 split over 4

    def test_dropout_refused_under_cp(self):
        """No flag sets dropout (a config from elsewhere could): the ring has no attention dropout, ours or torch's."""
        for impl, device in (("custom", "cpu"), ("pytorch", "cuda")):
            with self.subTest(impl=impl), self.assertRaisesRegex(UsageError, "needs dropout 0 \\(got 0.1\\)"):
                check(["--context_parallel_size", "2", "--implementation", impl], 2, device, GPTConfig(dropout=0.1))
        check(["--implementation", "custom"], 1, "cpu", GPTConfig(dropout=0.1))  # no CP: dropout is fine

    def test_allowed_on_cuda_with_data_parallelism(self):
        for flags, world in (
            ([], 2),
            (["--data_parallel_size", "2", "--data_parallel_type", "ddp"], 4),
            (["--data_parallel_size", "2", "--data_parallel_type", "fsdp"], 4),
        ):
            with self.subTest(flags=flags):
                check(self.TWIN + flags, world, "cuda")  # raises nothing


if __name__ == "__main__":
    unittest.main()
