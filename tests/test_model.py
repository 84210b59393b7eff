"""The model: HF GPT-2 parity, and init as a pure function of (seed, parameter name)."""

import math
import random
import unittest

import torch

from model.gpt import (
    GPT,
    INIT_ROW_BLOCK,
    PRESETS,
    GPTConfig,
    init_parameter,
    make_config,
    materialize_module,
    parameter_seed,
)

SMALL = GPTConfig(block_size=64, vocab_size=512, n_layer=2, n_head=4, n_embd=64)


def eager(config: GPTConfig, seed: int = 1337) -> GPT:
    model = GPT(config)
    model.init_weights(seed)
    return model


class TestInit(unittest.TestCase):
    def test_meta_then_materialise_equals_eager(self):
        ref = eager(SMALL)
        with torch.device("meta"):
            lazy = GPT(SMALL)
        lazy.init_weights(1337)
        self.assertIs(lazy.lm_head.weight, lazy.transformer.wte.weight)
        ref_sd, lazy_sd = ref.state_dict(), lazy.state_dict()
        self.assertEqual(ref_sd.keys(), lazy_sd.keys())
        for k in ref_sd:
            self.assertTrue(torch.equal(ref_sd[k], lazy_sd[k]), k)

    def test_one_module_alone_equals_its_eager_self(self):
        """Materialising only Block 1 of a meta model (nothing else allocated) gives eager Block 1."""
        ref = eager(SMALL)
        with torch.device("meta"):
            lazy = GPT(SMALL)
        materialize_module(lazy.transformer.h[1], "transformer.h.1", SMALL, 1337, "cpu")
        self.assertTrue(all(p.is_meta for p in lazy.transformer.h[0].parameters()))
        for (n, a), (_, b) in zip(ref.transformer.h[1].named_parameters(), lazy.transformer.h[1].named_parameters()):
            self.assertTrue(torch.equal(a, b), n)

    def test_independent_of_global_rng_and_build_order(self):
        """The same parameters whatever the global RNG state and whatever order the modules are materialised
        in (reversed, shuffled), with global draws between modules; another seed gives other values."""
        torch.manual_seed(0)
        a = eager(SMALL)
        for order in ("reversed", "shuffled"):
            torch.manual_seed(12345)
            torch.rand(1000)
            with torch.device("meta"):
                b = GPT(SMALL)
            units = b.init_units()
            units = units[::-1] if order == "reversed" else random.Random(3).sample(units, len(units))
            self.assertNotEqual([n for n, _ in units], [n for n, _ in b.init_units()])
            for prefix, module in units:
                torch.rand(17)  # the global generator moves between modules
                materialize_module(module, prefix, SMALL, 1337, "cpu")
            b.lm_head.weight = b.transformer.wte.weight
            named_b = dict(b.named_parameters())
            self.assertEqual(named_b.keys(), dict(a.named_parameters()).keys())
            for n, p in a.named_parameters():
                self.assertTrue(torch.equal(p, named_b[n]), f"{order}: {n}")
        c = eager(SMALL, seed=7)
        self.assertFalse(torch.equal(a.transformer.wte.weight, c.transformer.wte.weight))

    def test_any_slice_equals_slice_of_full(self):
        """A TP rank can make just its rows or columns of a weight, equal to the slice of the full one."""
        cfg = make_config("tiny")
        name, shape = "transformer.h.0.mlp.c_proj.weight", (64, 256)
        full = init_parameter(name, shape, cfg, 3)
        for rows, cols in (
            (slice(0, 32), None),
            (slice(32, 64), None),
            (None, slice(128, 256)),
            (slice(50, 70), slice(3, 9)),
            (slice(63, 65), None),
        ):
            got = init_parameter(name, shape, cfg, 3, rows, cols)
            self.assertTrue(torch.equal(got, full[rows or slice(None), cols or slice(None)]), (rows, cols))

    def test_init_rule(self):
        """N(0, 0.02) weights, 0.02/sqrt(2L) on residual projections, zero biases, unit LayerNorm.

        Exact: each block of INIT_ROW_BLOCK rows is N(0, std) from a generator seeded by (seed, name#block),
        with std derived here from the rule. Statistically too: the sample std of n normal draws has
        standard error std/sqrt(2n) (~0.03% here), so 6 standard errors tell 2L = 24 from 22 or 26 (+-4%)."""
        for preset, n_layer in (("gpt2", 12), ("tiny", 3)):
            cfg = make_config(preset, n_layer=n_layer)
            d = cfg.n_embd
            resid = 0.02 / math.sqrt(2 * n_layer)
            for name, shape, std in (
                ("transformer.h.1.mlp.c_fc.weight", (4 * d, d), 0.02),
                ("transformer.h.1.mlp.c_proj.weight", (d, 4 * d), resid),
                ("transformer.h.0.attn.c_proj.weight", (d, d), resid),
                ("transformer.wpe.weight", (cfg.block_size, d), 0.02),
            ):
                got = init_parameter(name, shape, cfg, 1)
                want = torch.cat(
                    [
                        torch.empty(min(INIT_ROW_BLOCK, shape[0] - lo), shape[1]).normal_(
                            0.0,
                            std,
                            generator=torch.Generator().manual_seed(
                                parameter_seed(1, f"{name}#{lo // INIT_ROW_BLOCK}")
                            ),
                        )
                        for lo in range(0, shape[0], INIT_ROW_BLOCK)
                    ]
                )
                self.assertTrue(torch.equal(got, want), f"{preset} {name}")
            n = 4 * cfg.n_embd**2
            proj = init_parameter("transformer.h.3.mlp.c_proj.weight", (d, 4 * d), cfg, 1).double()
            tol = 6 * resid / math.sqrt(2 * n)
            for layers in (n_layer - 1, n_layer + 1):  # the check can see a wrong L
                self.assertGreater(abs(0.02 / math.sqrt(2 * layers) - resid), 2 * tol)
            self.assertLess(abs(proj.std().item() - resid), tol, preset)
        cfg = make_config("gpt2")
        self.assertTrue(torch.equal(init_parameter("transformer.h.0.ln_1.weight", (768,), cfg, 1), torch.ones(768)))
        self.assertTrue(torch.equal(init_parameter("transformer.ln_f.bias", (768,), cfg, 1), torch.zeros(768)))
        self.assertTrue(torch.equal(init_parameter("transformer.h.0.attn.c_q.bias", (768,), cfg, 1), torch.zeros(768)))

    def test_presets(self):
        """Parameter counts of the published sizes (padded vocab, tied head counted once)."""
        expected = {"gpt2": 124_475_904, "gpt2-medium": 354_871_296}
        for name, n in expected.items():
            with torch.device("meta"):
                self.assertEqual(GPT(PRESETS[name]).num_params(), n)
        self.assertEqual(make_config("tiny", n_layer=3).n_layer, 3)
        with self.assertRaises(ValueError):
            make_config("gpt3")


class TestHF(unittest.TestCase):
    def hf_model(self):
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        cfg = GPT2Config(
            vocab_size=SMALL.vocab_size,
            n_positions=SMALL.block_size,
            n_embd=SMALL.n_embd,
            n_layer=SMALL.n_layer,
            n_head=SMALL.n_head,
            resid_pdrop=0,
            embd_pdrop=0,
            attn_pdrop=0,
        )
        hf = GPT2LMHeadModel(cfg).eval()
        with torch.no_grad():  # HF zero-inits biases; make them non-trivial so the mapping is tested
            for n, p in hf.named_parameters():
                if n.endswith("bias"):
                    p.normal_(0, 0.02)
        return hf

    def test_logits_equal_transformers(self):
        hf = self.hf_model()
        ours = GPT.from_hf_state_dict(hf.state_dict(), n_head=SMALL.n_head).eval()
        self.assertEqual(ours.config, SMALL)
        idx = torch.randint(0, SMALL.vocab_size, (2, 40))
        with torch.no_grad():
            ref = hf(idx).logits
            got, _ = ours(idx)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)

    def test_round_trip(self):
        hf = self.hf_model()
        ours = GPT.from_hf_state_dict(hf.state_dict(), n_head=SMALL.n_head)
        back = ours.to_hf_state_dict(hf_vocab=SMALL.vocab_size)
        ref = hf.state_dict()
        for k, v in back.items():
            self.assertTrue(torch.equal(v, ref[k]), k)
        missing = [k for k in ref if k not in back and not k.endswith((".attn.bias", ".attn.masked_bias"))]
        self.assertEqual(missing, [])

    def test_gpt2_vocab_is_padded(self):
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_positions=32, n_embd=64, n_layer=1, n_head=1)
        ours = GPT.from_hf_state_dict(GPT2LMHeadModel(cfg).state_dict())
        self.assertEqual(ours.config.vocab_size, 50304)
        self.assertTrue(torch.equal(ours.transformer.wte.weight[50257:], torch.zeros(47, 64)))


if __name__ == "__main__":
    unittest.main()
