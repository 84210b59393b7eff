"""CPU guards for the GPU path: each test pins a defect that would meet a GPU user, without a GPU.

- A model built on one device ends on the requested one (asked for `meta`, which differs from where the
  model is built, as a GPU would).
- fp16: every rank agrees on skipping a step (AgreeingGradScaler), and FSDP's fp16 reduce-scatter
  divides before it sums.
- --dtype auto, the fp16 flags, FSDP's param_dtype default, datasheet peaks, per-step peak memory.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import unittest
from unittest import mock

import pytest
import torch

from model.gpt import GPT, make_config
from runtime import metrics
from tests.harness import make_token_bins, spawn
from trainer import config

TINY = make_config("tiny")


def _tiny_args(data: str, out: str, *extra: str):
    return config.parse_args(
        [
            "--model",
            "tiny",
            "--micro_batch_size",
            "2",
            "--seq_len",
            "64",
            "--total_batch_size",
            "128",
            "--dataset",
            data,
            "--out_dir",
            out,
            "--device",
            "cpu",
            "--peak_flops",
            "1e12",
            *extra,
        ]
    )


class TestDevicePlacement(unittest.TestCase):
    def test_init_weights_moves_a_model_built_elsewhere(self):
        model = GPT(TINY)  # built on the CPU, as build() does without --deferred_init
        model.init_weights(0, torch.device("meta"))
        self.assertEqual({p.device.type for p in model.parameters()}, {"meta"})
        self.assertIs(model.lm_head.weight, model.transformer.wte.weight)

    def test_build_puts_parameters_and_optimizer_state_on_the_plan_device(self):
        import train

        with tempfile.TemporaryDirectory() as d, mock.patch.dict(os.environ):
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
                os.environ.pop(k, None)
            data = make_token_bins(os.path.join(d, "data"), n_train=4000, n_val=1000)
            plan = config.validate(_tiny_args(data, os.path.join(d, "run")))
            trainer = train.build(dataclasses.replace(plan, device=torch.device("meta")))
            self.assertEqual({p.device.type for p in trainer.model.parameters()}, {"meta"})
            for p in trainer.model.parameters():
                p.grad = torch.zeros_like(p)
            trainer.optimizer.step()
            moments = [
                v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()
            ]
            self.assertEqual(len(moments), 2 * len(list(trainer.model.parameters())))
            self.assertEqual({v.device.type for v in moments}, {"meta"})

    def test_adamw_is_fused_where_torch_fuses(self):
        """train.build asks for torch's fused AdamW on every device torch 2.13 fuses on, the CPU included (the
        meta device above is not one); the DTensor twins too (the sweep holds their losses to one process)."""
        import train
        from runtime.device import fused_optimizer

        self.assertEqual([fused_optimizer(torch.device(d)) for d in ("cpu", "cuda", "meta")], [True, True, False])
        from torch.distributed.tensor import DTensor

        fake = mock.MagicMock(spec=DTensor)  # only its type is read (isinstance)
        self.assertTrue(fused_optimizer(torch.device("cpu"), [fake, fake]))  # FSDP2: every parameter a DTensor
        self.assertFalse(fused_optimizer(torch.device("cpu"), [fake, torch.zeros(1)]))  # DTensor TP: mixed
        with tempfile.TemporaryDirectory() as d, mock.patch.dict(os.environ):
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
                os.environ.pop(k, None)
            data = make_token_bins(os.path.join(d, "data"), n_train=4000, n_val=1000)
            trainer = train.build(config.validate(_tiny_args(data, os.path.join(d, "run"))))
            self.assertIs(trainer.optimizer.defaults["fused"], True)
            train.train_step(trainer, 1)
            steps = {s["step"].dtype for s in trainer.optimizer.state.values()}
            self.assertEqual(steps, {torch.float32})  # fused AdamW keeps its step count as an fp32 tensor


class TestMoreRanksThanGpus(unittest.TestCase):
    """The README's quick start (2 ranks, --device auto) on a machine with one GPU: every rank refuses in one
    line and exit 2 before any process group forms, naming --device cpu and --nproc_per_node (runtime/device.py
    pick_device), instead of rank 1 dying in set_device on `cuda:1` with "invalid device ordinal"."""

    def _quick_start_as(self, local_rank: int, gpus: int) -> tuple[int, list[str]]:
        import contextlib
        import io

        import torch.distributed as dist

        import train

        env = {"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
        err = io.StringIO()
        with (
            tempfile.TemporaryDirectory() as d,
            mock.patch.dict(os.environ, env),
            mock.patch.object(torch.cuda, "is_available", lambda: True),
            mock.patch.object(torch.cuda, "device_count", lambda: gpus),
            mock.patch.object(torch.cuda, "set_device", side_effect=AssertionError("set_device reached")),
            mock.patch.object(dist, "init_process_group", side_effect=AssertionError("a group formed")),
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            out = os.path.join(d, "run")
            code = train.main(["--config", "configs/quickstart.toml", "--overwrite", "--out_dir", out])
            self.assertFalse(os.path.exists(out))
        return code, err.getvalue().splitlines()

    def test_every_rank_refuses_in_one_line_on_one_gpu(self):
        for local_rank in (0, 1):
            code, lines = self._quick_start_as(local_rank, gpus=1)
            self.assertEqual(code, 2, lines)
            self.assertEqual(len(lines), 1, lines)
            self.assertTrue(lines[0].startswith("train.py: error: "), lines[0])
            self.assertIn("--device cpu", lines[0])
            self.assertIn("--nproc_per_node=1", lines[0])

    def test_each_rank_takes_its_own_gpu_when_there_are_enough(self):
        from runtime.device import pick_device

        for local_rank in (0, 1):
            env = {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "2"}
            with (
                mock.patch.dict(os.environ, env),
                mock.patch.object(torch.cuda, "is_available", lambda: True),
                mock.patch.object(torch.cuda, "device_count", lambda: 2),
            ):
                self.assertEqual(pick_device("auto"), torch.device("cuda", local_rank))
                self.assertEqual(pick_device("cpu"), torch.device("cpu"))
        with (
            mock.patch.dict(os.environ, {"LOCAL_RANK": "3"}),
            mock.patch.object(torch.cuda, "is_available", lambda: True),
        ):
            with (
                mock.patch.object(torch.cuda, "device_count", lambda: 2),
                self.assertRaisesRegex(ValueError, "4 ranks"),
            ):
                pick_device("cuda")  # no LOCAL_WORLD_SIZE: LOCAL_RANK + 1 ranks at least


# ----------------------------------------------------------------------------- fp16 across ranks


def _skip_body(rank: int, world: int, agreeing: bool) -> dict:
    """Custom FSDP over 2 ranks, fp16 GradScaler; rank 1 alone finds an inf in its shard gradient."""
    import torch.distributed as dist

    from parallel.data_parallel.fsdp import FullyShardedDataParallel
    from parallel.grads import AgreeingGradScaler

    torch.manual_seed(0)
    model = GPT(TINY)
    model.init_weights(0, "cpu")
    fsdp = FullyShardedDataParallel(model, process_group=dist.group.WORLD)
    opt = torch.optim.AdamW(fsdp.param_groups(0.0), lr=1e-3)
    scaler = AgreeingGradScaler("cpu") if agreeing else torch.amp.GradScaler("cpu")
    x = torch.randint(0, 256, (2, 16))
    _, loss = fsdp(x, x)
    scaler.scale(loss).backward()
    if rank == 1:
        fsdp.flat_params[0].grad[0] = float("inf")
    before = [p.detach().clone() for p in fsdp.flat_params]
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    stepped = any(not torch.equal(a, p) for a, p in zip(before, fsdp.flat_params))
    return {"stepped": stepped, "scale": scaler.get_scale()}


@pytest.mark.slow  # a multi-rank launch: kept out of the fast loop
class TestFP16Agreement(unittest.TestCase):
    def test_every_rank_skips_and_keeps_the_same_scale(self):
        results = spawn(_skip_body, 2, True)
        self.assertEqual([r["stepped"] for r in results], [False, False])
        self.assertEqual(results[0]["scale"], results[1]["scale"])
        self.assertEqual(results[0]["scale"], 65536.0 * 0.5)  # GradScaler's init_scale x backoff_factor

    def test_torch_gradscaler_alone_lets_the_ranks_disagree(self):
        """The control: without agreement rank 0 steps and rank 1 skips (what the fix prevents)."""
        results = spawn(_skip_body, 2, False)
        self.assertEqual([r["stepped"] for r in results], [True, False])
        self.assertNotEqual(results[0]["scale"], results[1]["scale"])


def _fp16_reduce_body(rank: int, world: int, scale: float) -> dict:
    """Both ranks back-propagate the same batch times `scale`; FSDP reduce-scatters in fp16. Returns whether
    every shard gradient is finite, the reduce-scatter bytes parallel/comm.py counted (the elements' own
    size: 2 each in fp16) and the padded elements of all units."""
    import torch.distributed as dist

    from parallel import comm
    from parallel.data_parallel.fsdp import FullyShardedDataParallel

    model = GPT(TINY)
    model.init_weights(0, "cpu")
    fsdp = FullyShardedDataParallel(model, process_group=dist.group.WORLD, reduce_dtype=torch.float16)
    x = torch.arange(32).view(2, 16) % 256
    comm.COUNTER.reset()
    _, loss = fsdp(x, x)
    (loss * scale).backward()
    return {
        "finite": all(torch.isfinite(p.grad).all().item() for p in fsdp.flat_params),
        "reduce_scatter_bytes": comm.COUNTER.snapshot()["reduce_scatter"],
        "padded": sum(u.padded for u in fsdp.units),
    }


@pytest.mark.slow  # a multi-rank launch: kept out of the fast loop
class TestFP16ReduceScatter(unittest.TestCase):
    def test_mean_that_fits_in_fp16_stays_finite(self):
        model = GPT(TINY)
        model.init_weights(0, "cpu")
        x = torch.arange(32).view(2, 16) % 256
        _, loss = model(x, x)
        loss.backward()
        g_max = max(p.grad.abs().max().item() for p in model.parameters())
        scale = 40000.0 / g_max  # largest gradient 40000: fits fp16 (65504), the sum of 2 ranks does not
        self.assertGreater(2 * 40000.0, torch.finfo(torch.float16).max)
        for r in spawn(_fp16_reduce_body, 2, scale):
            self.assertTrue(r["finite"])
            self.assertEqual(r["reduce_scatter_bytes"], 2 * r["padded"])  # fp16 on the wire, every unit once


# ----------------------------------------------------------------------------- dtypes and flags


class TestDtypes(unittest.TestCase):
    def test_auto_dtype_uses_native_bf16_only(self):
        cuda = torch.device("cuda", 0)
        with mock.patch("torch.cuda.is_bf16_supported", side_effect=AssertionError("must not be asked")):
            with mock.patch("torch.cuda.get_device_capability", return_value=(7, 0)):  # V100: emulated bf16
                self.assertEqual(config.resolve_dtype("auto", cuda), torch.float16)
            with mock.patch("torch.cuda.get_device_capability", return_value=(8, 0)):  # A100
                self.assertEqual(config.resolve_dtype("auto", cuda), torch.bfloat16)
        self.assertEqual(config.resolve_dtype("auto", torch.device("cpu")), torch.float32)

    def test_tf32_only_for_fp32_on_cuda_unless_refused(self):
        """config.use_tf32: TF32 changes fp32 matmuls only; CPU runs and autocast runs keep their math."""
        from trainer.config import use_tf32

        cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
        self.assertTrue(use_tf32(cuda, torch.float32))
        self.assertFalse(use_tf32(cuda, torch.float32, no_tf32=True))
        self.assertFalse(use_tf32(cuda, torch.bfloat16))
        self.assertFalse(use_tf32(cpu, torch.float32))

    def test_fp16_fsdp_dtypes_need_the_grad_scaler(self):
        for flag in ("--param_dtype", "--reduce_dtype"):
            args = _tiny_args("unused", "unused", flag, "float16", "--dtype", "bfloat16")
            with self.assertRaisesRegex(config.UsageError, f"{flag} float16 need --dtype float16"):
                config.validate(args)

    def test_param_dtype_follows_the_compute_dtype(self):
        from parallel.mesh import ParallelDims

        dims = ParallelDims(2, 1, 2)
        args = _tiny_args("unused", "unused", "--data_parallel_size", "2", "--data_parallel_type", "fsdp")
        self.assertEqual(config.parallel_config(args, dims, torch.bfloat16).param_dtype, torch.bfloat16)
        self.assertEqual(config.parallel_config(args, dims, torch.float16).param_dtype, torch.float16)
        self.assertIsNone(config.parallel_config(args, dims, torch.float32).param_dtype)  # fp32: no cast
        args.param_dtype = "float32"
        self.assertIsNone(config.parallel_config(args, dims, torch.bfloat16).param_dtype)


class TestNumbers(unittest.TestCase):
    def test_datasheet_peak_tells_h100_variants_apart(self):
        cuda = torch.device("cuda", 0)
        for name, peak in (
            ("NVIDIA H100 80GB HBM3", 989e12),
            ("NVIDIA H100 PCIe", 756e12),
            ("NVIDIA H100 NVL", 835e12),
            ("NVIDIA H200", 989e12),
            ("NVIDIA A100-SXM4-80GB", 312e12),
        ):
            with mock.patch("torch.cuda.get_device_name", return_value=name):
                self.assertEqual(metrics.peak_flops(cuda, torch.bfloat16), peak, name)

    def test_peak_memory_is_per_window(self):
        cpu = torch.device("cpu")
        metrics.reset_peak_memory(cpu)
        base = metrics.peak_memory_bytes(cpu)
        big = torch.ones(64 << 20, dtype=torch.float32)  # 256 MiB, touched
        del big
        high = metrics.peak_memory_bytes(cpu)
        self.assertGreaterEqual(high - base, 250 << 20)
        metrics.reset_peak_memory(cpu)
        self.assertLess(metrics.peak_memory_bytes(cpu), high - (200 << 20))


if __name__ == "__main__":
    unittest.main()
