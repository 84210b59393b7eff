"""parallel/pipeline_split.py: the cost model, the exact split by cost, the override, and a stage that holds
exactly the Blocks of its split. No processes; every expected split below is derived by hand in its test."""
from __future__ import annotations

import itertools
import random
import unittest

import torch

from metrics import flops_per_token
from model import GPT, make_config
from parallel.pipeline import PipelineStage, TorchChunk
from parallel.pipeline_schedule import chunk_of, split_layers
from parallel.pipeline_split import balanced_split, check_counts, describe_split, layers_for, stage_costs


def ranges(*sizes: int) -> list[range]:
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def exhaustive(costs: list[int], chunks: int, first: int, last: int) -> list[range]:
    """The split's definition, by trying every split: costs sorted largest first, lexicographically smallest;
    then the sizes, the earlier chunk larger."""
    L, best = len(costs), None
    for cuts in itertools.combinations(range(1, L), chunks - 1):
        bounds = (0, *cuts, L)
        chunk_costs = [sum(costs[a:b]) + first * (c == 0) + last * (c == chunks - 1)
                       for c, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        key = (sorted(chunk_costs, reverse=True), [a - b for a, b in zip(bounds, bounds[1:])])
        if best is None or key < best[0]:
            best = (key, [range(a, b) for a, b in zip(bounds, bounds[1:])])
    return best[1]


class TestBalancedSplit(unittest.TestCase):
    def test_a_heavy_head_moves_blocks_to_the_front(self):
        # 6 Blocks of cost 1, the head 4 on the last chunk: chunk 0 = a, chunk 1 = 6 - a + 4, equal at a = 5.
        # The count split [0-2], [3-5] costs 3 and 7.
        self.assertEqual(balanced_split([1] * 6, 2, last=4), ranges(5, 1))

    def test_the_embedding_moves_blocks_to_the_back(self):
        # 5 Blocks of 1, the embedding 3 on chunk 0: chunk 0 = a + 3, chunk 1 = 5 - a, equal at a = 1
        self.assertEqual(balanced_split([1] * 5, 2, first=3), ranges(1, 4))

    def test_unequal_blocks(self):
        # [5, 1, 1, 1, 1, 5] in 3 chunks: each 5 alone bounds the most expensive at 5, and [5], [1 1 1 1], [5]
        # (5, 4, 5) reaches it; any other split puts a 1 next to a 5 (6)
        self.assertEqual(balanced_split([5, 1, 1, 1, 1, 5], 3), ranges(1, 4, 1))

    def test_ties_below_the_most_expensive_chunk(self):
        # 8 Blocks of 1 in 4 chunks, the head 10: the last chunk costs >= 11 whatever, and takes one Block (two
        # would be 12). Minimising only the most expensive chunk would accept [5, 1, 1, 1]; the next most
        # expensive as cheap as possible spreads the other 7 Blocks as 3, 2, 2, and the earlier chunk takes more.
        self.assertEqual(balanced_split([1] * 8, 4, last=10), ranges(3, 2, 2, 1))

    def test_equal_blocks_without_extras_is_the_count_split(self):
        for n in range(1, 13):
            for chunks in range(1, n + 1):
                with self.subTest(n=n, chunks=chunks):
                    self.assertEqual(balanced_split([7] * n, chunks), split_layers(n, chunks))

    def test_exact_on_random_costs(self):
        rng = random.Random(0)
        for _ in range(300):
            L = rng.randint(1, 8)
            chunks = rng.randint(1, L)
            costs = [rng.randint(1, 6) for _ in range(L)]
            first, last = rng.randint(0, 8), rng.randint(0, 12)
            with self.subTest(costs=costs, chunks=chunks, first=first, last=last):
                self.assertEqual(balanced_split(costs, chunks, first, last), exhaustive(costs, chunks, first, last))

    def test_needs_a_block_per_chunk(self):
        with self.assertRaises(ValueError):
            balanced_split([1, 1, 1], 4)


class TestCostModel(unittest.TestCase):
    def test_gpt2_at_1024(self):
        """GPT-2 124M, T = 1024, C = 768, V = 50304. A Block holds 12C² + 13C = 7,087,872 parameters: 6 x that
        + 12·C·T = 42,527,232 + 9,437,184 = 51,964,416. The head: 6·(V·C + 2C) + 2·V·C (the recompute) =
        231,810,048 + 77,266,944 = 309,076,992, 5.95 Blocks. The embedding: 3C = 2,304. P = 2: chunk 0 = 9 Blocks
        + embedding = 467,682,048 and chunk 1 = 3 Blocks + head = 464,970,240; 8 | 4 leaves chunk 1 at 516,934,656,
        10 | 2 chunk 0 at 519,646,464."""
        config = make_config("gpt2")
        k = stage_costs(config, 1024)
        self.assertEqual((k.block, k.head, k.embed), (51_964_416, 309_076_992, 2_304))
        self.assertEqual(layers_for(config, 2, seq_len=1024), ranges(9, 3))

    def test_the_model_counts_what_mfu_counts_plus_the_recompute(self):
        """n_layer Blocks + head = metrics.flops_per_token (6N + 12·L·C·T, N without wpe: wte's V·C stands for
        lm_head) + the 2·V·C of lm_head's recompute: one formula, not two."""
        for preset, T in (("tiny", 128), ("gpt2", 1024), ("gpt2-medium", 512)):
            config = make_config(preset)
            k = stage_costs(config, T)
            with torch.device("meta"):
                n = GPT(config).num_params(non_embedding=True)
            with self.subTest(preset):
                self.assertEqual(config.n_layer * k.block + k.head,
                                 flops_per_token(config, n, T) + 2 * config.vocab_size * config.n_embd)

    def test_describe(self):
        line = describe_split(ranges(9, 3), stage_costs(make_config("gpt2"), 1024))
        self.assertEqual(line, "pipeline split by cost (training FLOPs per token): chunk 0 Blocks 0-8 (468M), "
                               "chunk 1 Blocks 9-11 (465M)")


class TestOverride(unittest.TestCase):
    def test_counts_checked(self):
        self.assertIsNone(check_counts((3, 1), 4, 2))
        self.assertIn("gives 3 counts; the pipeline has P x V = 2 chunks", check_counts((1, 1, 2), 4, 2))
        self.assertIn("gives chunk 1 no Block (0)", check_counts((4, 0), 4, 2))
        self.assertIn("sums to 5, not n_layer (4)", check_counts((3, 2), 4, 2))
        with self.assertRaises(ValueError):
            layers_for(make_config("tiny", n_layer=4), 2, counts=(3, 2))

    def test_a_stage_holds_exactly_the_given_blocks(self):
        """With --pp_layers_per_stage 4,2 (P = 2) and 1,2,2,1 (P = 2, V = 2: rank 0 holds chunks 0 and 2, rank 1
        chunks 1 and 3): each rank's Blocks, and each chunk's for torch's pipelining (TorchChunk)."""
        config = make_config("tiny", n_layer=6, vocab_size=256)
        for virtual, counts, want in ((1, (4, 2), [[0, 1, 2, 3], [4, 5]]),
                                      (2, (1, 2, 2, 1), [[0, 3, 4], [1, 2, 5]])):
            for rank in range(2):
                with torch.device("meta"):
                    stage = PipelineStage(GPT(config), rank, 2, virtual, layers=counts)
                with self.subTest(virtual=virtual, rank=rank):
                    self.assertEqual(sorted(int(i) for i in stage.transformer.h), want[rank])
                    for v in range(virtual):
                        c = chunk_of(rank, v, 2)
                        chunk = TorchChunk(stage, c)
                        self.assertEqual([b for b in chunk.h], [stage.transformer.h[str(i)] for i in stage.layers[c]])
                        self.assertEqual(len(chunk.h), counts[c])

    def test_default_is_the_cost_split(self):
        """No override: the cost model at T = block_size. tiny with 6 Blocks, V = 50304, T = 1024: the head
        (8·V·C + 12C = 25.76M) outweighs all 6 Blocks (6·(12C² + 13C) + 12·C·T = 1.09M each), so the last chunk
        keeps one Block."""
        config = make_config("tiny", n_layer=6)
        with torch.device("meta"):
            stage = PipelineStage(GPT(config), 0, 2)
        self.assertEqual(stage.layers, ranges(5, 1))


if __name__ == "__main__":
    unittest.main()
