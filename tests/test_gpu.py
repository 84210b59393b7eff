"""bf16 and fp16 training steps, fused AdamW, per-step memory peaks, and where build() puts the model state, on
each device: every body runs once on the CPU (`OnCpu`, in the quick suite, so a body that no longer runs fails in
CI) and once on the accelerator (`OnAccelerator`, marked `gpu` and skipped without a CUDA device):

    pytest -m gpu tests/test_gpu.py        (the accelerator's rows; scripts/gpu_check.sh runs it too)

bf16 tolerance, derived rather than tuned. bf16 keeps 8 significant bits: unit roundoff u = 2^-8. Under
autocast a matmul rounds both inputs to bf16 and accumulates in fp32, so each product is off by at most
~2u relative. A logit passes through 2L+1 such matmuls on its way (attention and MLP of each of L blocks, then
lm_head), so |z_bf16 - z_fp32| <= (2L+1)·2u·max|z|; cross-entropy moves by at most twice the largest logit
change (its gradient in the logits has L1 norm <= 2), so |loss_bf16 - loss_fp32| <= 2·(2L+1)·2u·max|z|.
The gradient goes back through the same chains again: ||g_bf16 - g_fp32|| <= (4L+2)·2u·||g_fp32||.
(On CPU bf16 autocast, measured: logits ~1u, gradients ~1.5u: the bounds hold with 10x margin.)
"""

import math
import os
import tempfile
import unittest

import pytest
import torch

import train
from parallel.grads import AgreeingGradScaler
from runtime import metrics
from runtime.device import pick_device
from tests.harness import make_token_bins
from trainer.config import parse_args, validate

U_BF16 = 2.0**-8
SMALL = [
    "--model",
    "tiny",
    "--vocab_size",
    "512",
    "--micro_batch_size",
    "4",
    "--seq_len",
    "64",
    "--total_batch_size",
    "512",
    "--max_steps",
    "10",
    "--warmup_steps",
    "2",
    "--lr",
    "3e-3",
    "--eval_iters",
    "1",
]


class DeviceSteps:
    """The bodies; a subclass names its `device` (torch.device)."""

    device: torch.device

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.data = make_token_bins(os.path.join(cls.tmp.name, "data"))

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def trainer(self, dtype: str, *flags: str) -> train.Trainer:
        out = tempfile.mkdtemp(dir=self.tmp.name)
        return train.build(
            validate(
                parse_args(
                    [
                        *SMALL,
                        *flags,
                        "--dataset",
                        self.data,
                        "--device",
                        self.device.type,
                        "--dtype",
                        dtype,
                        "--out_dir",
                        out,
                    ]
                )
            )
        )

    def test_bf16_autocast_step_matches_fp32(self):
        """One forward + backward in bf16 autocast is within the derived bound (module docstring) of fp32. With
        targets the model returns (None, loss) (its head never holds the whole logits), so the logits come from a
        second forward without them."""
        trainer = self.trainer("float32")
        x, y = (
            v.to(trainer.spec.device)
            for v in trainer.data.get("train", 1, trainer.spec.rows, 0, trainer.spec.args.micro_batch_size)
        )
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            trainer.model.zero_grad(set_to_none=True)
            with torch.autocast(trainer.spec.device.type, dtype=dtype, enabled=dtype != torch.float32):
                _, loss = trainer.model(x, y)
                with torch.no_grad():
                    logits, _ = trainer.model(x)
            loss.backward()
            out[dtype] = (
                loss.item(),
                logits.detach().float(),
                torch.cat([p.grad.flatten().float() for p in trainer.model.parameters()]),
            )
        (loss32, z32, g32), (loss16, z16, g16) = out[torch.float32], out[torch.bfloat16]
        L = trainer.spec.config.n_layer
        z_tol = (2 * L + 1) * 2 * U_BF16 * z32.abs().max().item()
        self.assertLessEqual((z16 - z32).abs().max().item(), z_tol)
        self.assertLessEqual(abs(loss16 - loss32), 2 * z_tol)
        self.assertLessEqual(((g16 - g32).norm() / g32.norm()).item(), (4 * L + 2) * 2 * U_BF16)

    def test_fp16_grad_scaler_trains_and_skips_an_inf_step(self):
        """fp16 + AgreeingGradScaler: finite, falling losses; a step whose gradient holds an inf changes no
        parameter and halves the loss scale; the next step trains again."""
        trainer = self.trainer("float16")
        self.assertIsInstance(trainer.scaler, AgreeingGradScaler)
        losses = [train.train_step(trainer, step)["loss"] for step in range(1, 5)]
        self.assertTrue(all(map(math.isfinite, losses)), losses)
        self.assertLess(losses[-1], losses[0])

        p = trainer.model.transformer.h[0].mlp.c_fc.weight
        hook = p.register_hook(lambda g: g.index_fill(0, torch.tensor([0], device=g.device), float("inf")))
        before = [q.detach().clone() for q in trainer.model.parameters()]
        scale = trainer.scaler.get_scale()
        m = train.train_step(trainer, 5)
        hook.remove()
        self.assertTrue(math.isfinite(m["loss"]))
        self.assertEqual(m["loss_scale"], scale * trainer.scaler.get_backoff_factor())
        for q, b in zip(trainer.model.parameters(), before):
            self.assertTrue(torch.equal(q, b), "a step with an inf gradient changed a parameter")

        m = train.train_step(trainer, 6)
        self.assertTrue(math.isfinite(m["loss"]))
        self.assertFalse(torch.equal(p, before[[id(q) for q in trainer.model.parameters()].index(id(p))]))

    def test_fused_adamw(self):
        t = self.trainer("bfloat16")
        self.assertIs(t.optimizer.defaults["fused"], True)

    def test_peak_memory_is_per_step(self):
        """A step's peak covers what the step holds (parameters, gradients, AdamW moments), and a big
        allocation between steps does not show in the next step's peak: the window is reset. Right after a reset
        the peak is what is in use now (CUDA: allocated bytes; CPU: resident bytes), so `in_use` reads that; the
        big block is written (`fill_`), since untouched CPU pages are not resident.

        Resident bytes are read short by up to `slack`: Linux counts a process's resident pages per CPU and folds
        a CPU's count into the total /proc reads only once it passes the batch max(32, 2 x CPUs) pages
        (percpu_counter), so each CPU may hold up to a batch unread. CUDA's allocated bytes are exact."""
        device, big_bytes = self.device, 256 * 2**20  # far more than a tiny step
        cpus = os.cpu_count() or 1
        slack = cpus * max(32, 2 * cpus) * os.sysconf("SC_PAGE_SIZE") if device.type == "cpu" else 0

        def in_use() -> int:
            metrics.reset_peak_memory(device)
            return metrics.peak_memory_bytes(device)

        base = in_use()
        big = torch.empty(big_bytes, dtype=torch.uint8, device=device).fill_(1)
        self.assertGreaterEqual(metrics.peak_memory_bytes(device), base + big_bytes - slack)
        del big
        self.assertLess(in_use(), base + big_bytes)

        t = self.trainer("bfloat16")
        first = train.train_step(t, 1)
        self.assertGreaterEqual(first["peak_memory_bytes"], first["state_bytes"])
        base = in_use()
        big = torch.empty(big_bytes, dtype=torch.uint8, device=device).fill_(1)
        del big
        second = train.train_step(t, 2)
        self.assertGreaterEqual(second["peak_memory_bytes"], second["state_bytes"])
        self.assertLess(second["peak_memory_bytes"], base + big_bytes)

    def test_build_puts_all_state_on_the_device(self):
        trainer = self.trainer("bfloat16")
        train.train_step(trainer, 1)  # AdamW's state exists after the first step
        for name, p in trainer.model.named_parameters():
            self.assertEqual(p.device, trainer.spec.device, name)
        states = [v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        self.assertTrue(states)
        for v in states:  # fused AdamW keeps even its step counters on the device
            self.assertEqual(v.device, trainer.spec.device)


class OnCpu(DeviceSteps, unittest.TestCase):
    device = torch.device("cpu")


@pytest.mark.gpu
@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA device")
class OnAccelerator(DeviceSteps, unittest.TestCase):
    device = pick_device("auto")  # the accelerator when there is one (runtime/device.py), else the CPU


if __name__ == "__main__":
    unittest.main()
