"""parallel/pipeline/partition.py: the cost model, the exact partition by cost, the override, and a stage that holds
exactly the Blocks of its partition. No processes; every expected partition below is derived by hand in its test."""

from __future__ import annotations

import itertools
import random
import unittest

import torch

from model.gpt import GPT, make_config
from parallel.pipeline.partition import (
    StageCosts,
    balanced_partition,
    balanced_v_partition,
    check_counts,
    costs_from_step,
    describe_partition,
    layers_for,
    stage_costs,
)
from parallel.pipeline.runner import PipelineStage
from parallel.pipeline.schedule import chunk_of, even_partition
from parallel.twins.pipeline import TorchChunk
from runtime.metrics import flops_per_token


def ranges(*sizes: int) -> list[range]:
    bounds = list(itertools.accumulate(sizes, initial=0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def exhaustive(costs: list[int], chunks: int, first: int, last: int) -> list[range]:
    """The partition's definition, by trying every partition: costs sorted largest first, lexicographically smallest;
    then the sizes, the earlier chunk larger."""
    L, best = len(costs), None
    for cuts in itertools.combinations(range(1, L), chunks - 1):
        bounds = (0, *cuts, L)
        chunk_costs = [
            sum(costs[a:b]) + first * (c == 0) + last * (c == chunks - 1)
            for c, (a, b) in enumerate(zip(bounds, bounds[1:]))
        ]
        key = (sorted(chunk_costs, reverse=True), [a - b for a, b in zip(bounds, bounds[1:])])
        if best is None or key < best[0]:
            best = (key, [range(a, b) for a, b in zip(bounds, bounds[1:])])
    return best[1]


class TestBalancedPartition(unittest.TestCase):
    def test_a_heavy_head_moves_blocks_to_the_front(self):
        # 6 Blocks of cost 1, the head 4 on the last chunk: chunk 0 = a, chunk 1 = 6 - a + 4, equal at a = 5.
        # The even partition [0-2], [3-5] costs 3 and 7.
        self.assertEqual(balanced_partition([1] * 6, 2, last=4), ranges(5, 1))

    def test_the_embedding_moves_blocks_to_the_back(self):
        # 5 Blocks of 1, the embedding 3 on chunk 0: chunk 0 = a + 3, chunk 1 = 5 - a, equal at a = 1
        self.assertEqual(balanced_partition([1] * 5, 2, first=3), ranges(1, 4))

    def test_unequal_blocks(self):
        # [5, 1, 1, 1, 1, 5] in 3 chunks: each 5 alone bounds the most expensive at 5, and [5], [1 1 1 1], [5]
        # (5, 4, 5) reaches it; any other partition puts a 1 next to a 5 (6)
        self.assertEqual(balanced_partition([5, 1, 1, 1, 1, 5], 3), ranges(1, 4, 1))

    def test_ties_below_the_most_expensive_chunk(self):
        # 8 Blocks of 1 in 4 chunks, the head 10: the last chunk costs >= 11 whatever, and takes one Block (two
        # would be 12). Minimising only the most expensive chunk would accept [5, 1, 1, 1]; the next most
        # expensive as cheap as possible spreads the other 7 Blocks as 3, 2, 2, and the earlier chunk takes more.
        self.assertEqual(balanced_partition([1] * 8, 4, last=10), ranges(3, 2, 2, 1))

    def test_equal_blocks_without_extras_is_the_even_partition(self):
        for n in range(1, 13):
            for chunks in range(1, n + 1):
                with self.subTest(n=n, chunks=chunks):
                    self.assertEqual(balanced_partition([7] * n, chunks), even_partition(n, chunks))

    def test_exact_on_random_costs(self):
        rng = random.Random(0)
        for _ in range(300):
            L = rng.randint(1, 8)
            chunks = rng.randint(1, L)
            costs = [rng.randint(1, 6) for _ in range(L)]
            first, last = rng.randint(0, 8), rng.randint(0, 12)
            with self.subTest(costs=costs, chunks=chunks, first=first, last=last):
                self.assertEqual(balanced_partition(costs, chunks, first, last), exhaustive(costs, chunks, first, last))

    def test_needs_a_block_per_chunk(self):
        with self.assertRaises(ValueError):
            balanced_partition([1, 1, 1], 4)


def exhaustive_v(n_layer: int, pp: int, block: int, first: int, last: int) -> list[range]:
    """The V partition's definition, by trying every partition of n_layer Blocks into 2P chunks (rank r holds chunks r
    and 2P-1-r): ranks' costs, then chunks' costs, sorted largest first, lexicographically smallest; then the
    ranks' Block totals, the earlier rank larger; then each rank's first chunk r, the earlier larger."""
    C, best = 2 * pp, None
    for cuts in itertools.combinations(range(1, n_layer), C - 1):
        bounds = (0, *cuts, n_layer)
        n = [b - a for a, b in zip(bounds, bounds[1:])]
        chunk = [k * block + first * (c == 0) + last * (c == C - 1) for c, k in enumerate(n)]
        key = (
            sorted((chunk[r] + chunk[C - 1 - r] for r in range(pp)), reverse=True),
            sorted(chunk, reverse=True),
            [-n[r] - n[C - 1 - r] for r in range(pp)],
            [-k for k in n[:pp]],
        )
        if best is None or key < best[0]:
            best = (key, ranges(*n))
    return best[1]


class TestVPartition(unittest.TestCase):
    """zbv / dualpipev: rank r holds chunks r and 2P-1-r, so the partition balances each rank's two chunks together."""

    def test_exact_against_the_definition(self):
        rng = random.Random(0)
        for _ in range(200):
            pp = rng.randint(1, 3)
            n_layer = rng.randint(2 * pp, 2 * pp + 5)
            block, first, last = rng.randint(1, 6), rng.randint(0, 8), rng.randint(0, 30)
            with self.subTest(n_layer=n_layer, pp=pp, block=block, first=first, last=last):
                self.assertEqual(
                    balanced_v_partition(n_layer, pp, block, first, last), exhaustive_v(n_layer, pp, block, first, last)
                )

    def test_gpt2_p2(self):
        """GPT-2 124M at T = 1024 (TestCostModel.test_gpt2_at_1024: Block b = 51,964,416, head H = 231,810,048,
        embedding 2,304; n_layer 12). Rank 0 runs s_0 Blocks + head + embedding, rank 1 the other 12 - s_0: s_0 = 3
        gives 387.7M | 467.7M, s_0 = 4 439,670,016 | 415,715,328, s_0 = 5 491.6M | 363.8M; so 4. Rank 0's 4: chunk 3
        carries H, so it takes 1 Block (2 would cost 335.7M > the 3 on chunk 0 + embedding's 156M); rank 1's 8: 4 on
        each chunk. The per-chunk partition is the same [3, 4, 4, 1] (the head's chunk, 283.8M, the most expensive)."""
        config = make_config("gpt2")
        self.assertEqual(layers_for(config, 2, 2, 1024, v_shape=True), ranges(3, 4, 4, 1))
        self.assertEqual(layers_for(config, 2, 2, 1024), ranges(3, 4, 4, 1))
        line = describe_partition(ranges(3, 4, 4, 1), stage_costs(config, 1024), v_shape=True)
        self.assertTrue(line.endswith("; per rank: rank 0 (440M), rank 1 (416M)"), line)

    def test_gpt2_medium_p4_per_rank_beats_per_chunk(self):
        """GPT-2 medium at T = 1024, P = 4, V = 2: the per-chunk partition [3, 4, 4, 3, 3, 3, 3, 1] leaves rank 0
        (chunks 0 and 7) 4 Blocks + head + embedding, 662M; per rank, [2, 4, 4, 4, 3, 3, 3, 1] gives it 3 Blocks +
        head, 574M, and no rank more than 617M (4 + 3 Blocks)."""
        config, k = make_config("gpt2-medium"), stage_costs(make_config("gpt2-medium"), 1024)
        self.assertEqual(layers_for(config, 4, 2, 1024), ranges(3, 4, 4, 3, 3, 3, 3, 1))
        self.assertEqual(layers_for(config, 4, 2, 1024, v_shape=True), ranges(2, 4, 4, 4, 3, 3, 3, 1))
        line = describe_partition(ranges(2, 4, 4, 4, 3, 3, 3, 1), k, v_shape=True)
        self.assertTrue(line.endswith("; per rank: rank 0 (574M), rank 1 (617M), rank 2 (617M), rank 3 (617M)"), line)

    def test_small_p2_and_p4(self):
        """small (C = 384, V = 50304) with 24 Blocks at T = 1024: a Block b = 6·(12C² + 13C) + 12·C·T = 15,365,376,
        the head 6·V·C + 12C = 115,905,024 = 7.54 b. P = 2: rank 0 = (s_0 + 7.54) b against (24 - s_0) b, the
        larger smallest at s_0 = 8 (15.54 b | 16 b; s_0 = 9: 16.54 b | 15 b); rank 0 puts 1 Block with the head and
        7 on chunk 0, rank 1 halves 16 as 8 | 8. The per-chunk partition is the same [7, 8, 8, 1] (the head's chunk,
        8.54 b, the most expensive).
        P = 4: rank 0 is the most expensive with its fewest Blocks (s_0 = 2: 9.54 b), ranks 1-3 share 22 as 8, 7,
        7 (chunks 1 | 6 = 4 | 4, 2 | 5 = 4 | 3, 3 | 4 = 4 | 3)."""
        config = make_config("small", n_layer=24)
        k = stage_costs(config, 1024)
        self.assertEqual((k.block, k.head), (15_365_376, 115_905_024))
        self.assertEqual(layers_for(config, 2, 2, 1024, v_shape=True), ranges(7, 8, 8, 1))
        self.assertEqual(layers_for(config, 2, 2, 1024), ranges(7, 8, 8, 1))
        self.assertEqual(layers_for(config, 4, 2, 1024, v_shape=True), ranges(1, 4, 4, 4, 3, 3, 4, 1))

    def test_tiny_p2_and_p4(self):
        """tiny (C = 64) at T = 128: b = 6·(12C² + 13C) + 12·C·T = 398,208, the head 19,317,504 = 48.5 b, so rank 0
        keeps the fewest Blocks, one per chunk. P = 2, 8 Blocks: rank 1's 6 as 3 | 3. P = 4, 12 Blocks: ranks 1-3
        share 10 as 4, 3, 3 (the earlier rank the extra): chunks 1 | 6 = 2 | 2, 2 | 5 = 2 | 1, 3 | 4 = 2 | 1."""
        self.assertEqual(stage_costs(make_config("tiny"), 128).block, 398_208)
        self.assertEqual(layers_for(make_config("tiny", n_layer=8), 2, 2, 128, v_shape=True), ranges(1, 3, 3, 1))
        self.assertEqual(
            layers_for(make_config("tiny", n_layer=12), 4, 2, 128, v_shape=True), ranges(1, 2, 2, 2, 1, 1, 2, 1)
        )

    def test_stage_config_and_planner_use_it(self):
        """config.check_layout (train.py's partition), the PipelineStage it is given and the planner's stage_blocks
        all cut the V layout per rank."""
        from plan.counts import Setup, stage_blocks
        from trainer import config as cfg

        want = ranges(7, 8, 8, 1)
        model = make_config("small", n_layer=24)
        args = cfg.parse_args(
            [
                "--model",
                "small",
                "--n_layer",
                "24",
                "--seq_len",
                "1024",
                "--micro_batch_size",
                "1",
                "--total_batch_size",
                str(4 * 1024),
                "--pipeline_parallel_size",
                "2",
                "--pp_schedule",
                "zbv",
                "--pp_virtual_stages",
                "2",
                "--device",
                "cpu",
            ]
        )
        dims, config, dtype, _, accum, layers = cfg.check_layout(args, 2, torch.device("cpu"))
        self.assertEqual(layers, (7, 8, 8, 1))
        with torch.device("meta"):
            stage = PipelineStage(GPT(model), 0, 2, 2, layers=layers, v_shape=True)
        self.assertEqual(stage.layers, want)
        setup = Setup(args, dims, config, dtype, accum, layers)
        self.assertEqual(
            [stage_blocks(setup, r) for r in range(2)],
            [([*range(0, 7), 23], True, True), ([*range(7, 23)], False, False)],
        )


class TestCostModel(unittest.TestCase):
    def test_gpt2_at_1024(self):
        """GPT-2 124M, T = 1024, C = 768, V = 50304. A Block holds 12C² + 13C = 7,087,872 parameters: 6 x that
        + 12·C·T = 42,527,232 + 9,437,184 = 51,964,416. The head: 6·(V·C + 2C) = 231,810,048, 4.46 Blocks (its
        three products all in forward, nothing recomputed). The embedding: 3C = 2,304. P = 2: chunk 0 = 8 Blocks
        + embedding = 415,717,632 and chunk 1 = 4 Blocks + head = 439,667,712; 9 | 3 leaves chunk 0 at 467,682,048,
        7 | 5 chunk 1 at 491,632,128."""
        config = make_config("gpt2")
        k = stage_costs(config, 1024)
        self.assertEqual((k.block, k.head, k.embed), (51_964_416, 231_810_048, 2_304))
        self.assertEqual(layers_for(config, 2, seq_len=1024), ranges(8, 4))

    def test_the_model_counts_what_mfu_counts(self):
        """n_layer Blocks + head = metrics.flops_per_token (6N + 12·L·C·T, N without wpe: wte's V·C stands for
        lm_head): the head recomputes nothing, so one formula, not two."""
        for preset, T in (("tiny", 128), ("gpt2", 1024), ("gpt2-medium", 512)):
            config = make_config(preset)
            k = stage_costs(config, T)
            with torch.device("meta"):
                n = GPT(config).num_params(non_embedding=True)
            with self.subTest(preset):
                self.assertEqual(config.n_layer * k.block + k.head, flops_per_token(config, n, T))

    def test_describe(self):
        line = describe_partition(ranges(8, 4), stage_costs(make_config("gpt2"), 1024))
        self.assertEqual(
            line,
            "pipeline partition by cost (training FLOPs per token): chunk 0 Blocks 0-7 (416M), "
            "chunk 1 Blocks 8-11 (440M)",
        )


class TestCostsFromStep(unittest.TestCase):
    """costs_from_step: the per-rank times a step would give for known Block, embedding and head times come back
    as those times (to the nanosecond rounding), and they re-partition the model."""

    FLOPS = StageCosts(block=1000, embed=10, head=5000)  # the embedding is 1/100 of a Block

    def test_recovers_the_parts(self):
        b, h = 0.012, 0.0588  # s per micro-batch: the head 4.9 Blocks, where the FLOP model says 5
        for blocks in ((9, 3), (4, 4, 2), (3, 3, 3, 1)):
            seconds = [n * b + 0.01 * b * (r == 0) + h * (r == len(blocks) - 1) for r, n in enumerate(blocks)]
            with self.subTest(blocks=blocks):
                got = costs_from_step(blocks, seconds, self.FLOPS)
                self.assertEqual((got.block, got.embed, got.head), (12_000_000, 120_000, 58_800_000))

    def test_the_measured_head_repartitions(self):
        """12 Blocks at 13.8 ms and a 67.4 ms head (4.88 Blocks; one bench.pipeline run's per-rank times on the
        9 | 3 partition): 8 | 4 costs max(8, 4 + 4.88) = 8.88 Blocks against 9 | 3's max(9, 7.88) = 9."""
        got = costs_from_step((9, 3), (9 * 0.0138 + 0.000138, 3 * 0.0138 + 0.0674), self.FLOPS)
        self.assertEqual(balanced_partition([got.block] * 12, 2, got.embed, got.head), ranges(8, 4))

    def test_a_step_that_leaves_no_head_is_refused(self):
        with self.assertRaisesRegex(ValueError, "nothing for the head"):
            costs_from_step((6, 6), (0.06, 0.05), self.FLOPS)


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
        for virtual, counts, want in ((1, (4, 2), [[0, 1, 2, 3], [4, 5]]), (2, (1, 2, 2, 1), [[0, 3, 4], [1, 2, 5]])):
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

    def test_default_is_the_cost_partition(self):
        """No override: train.py's config cuts by the cost model at --seq_len. tiny with 6 Blocks, V = 50304,
        T = 1024: the head (6·V·C + 12C = 19.32M) outweighs all 6 Blocks (6·(12C² + 13C) + 12·C·T = 1.09M each),
        so the last chunk keeps one Block. A PipelineStage given no counts (the runtime alone, as tests build it)
        cuts evenly."""
        from trainer import config as cfg

        args = cfg.parse_args(
            [
                "--model",
                "tiny",
                "--n_layer",
                "6",
                "--seq_len",
                "1024",
                "--micro_batch_size",
                "1",
                "--total_batch_size",
                str(2 * 1024),
                "--pipeline_parallel_size",
                "2",
                "--device",
                "cpu",
            ]
        )
        layers = cfg.check_layout(args, 2, torch.device("cpu"))[-1]
        self.assertEqual(layers, (5, 1))
        with torch.device("meta"):
            self.assertEqual(
                PipelineStage(GPT(make_config("tiny", n_layer=6)), 0, 2, layers=layers).layers, ranges(5, 1)
            )
            self.assertEqual(PipelineStage(GPT(make_config("tiny", n_layer=6)), 0, 2).layers, ranges(3, 3))


if __name__ == "__main__":
    unittest.main()
