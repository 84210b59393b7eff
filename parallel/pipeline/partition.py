"""Which Blocks each pipeline chunk holds: cut by cost, not by Block count.

The n_layer Blocks are cut into C = P·V consecutive chunks, each at least one Block (chunk c runs on rank c mod
P: parallel/pipeline_schedule.chunk_of). Chunk 0 also runs the embedding, chunk C-1 ln_f, lm_head and the
loss. Those extras are not the same size as a Block, so an even count of Blocks leaves one stage slower,
and every other rank waits for it at each micro-batch. For GPT-2 124M at T = 1024, the head costs ~6 Blocks.

Cost model (`stage_costs`): training FLOPs (forward + backward) per token, the FLOPs runtime/metrics.py counts for
MFU (`TRAIN_FLOPS_PER_PARAM` per matmul weight, `attention_flops_per_token`):
- a Block: 6·(its parameters) + 12·C·T (attention), i.e. 72C² + 12CT for GPT-2's Block;
- the head (last chunk): 6·(V·C + ln_f's 2C), what MFU counts: loss.linear_cross_entropy runs lm_head's three
  products (the logits x Wᵀ, then from their gradient G, G W and Gᵀ x) all in its forward, chunk by chunk, and
  recomputes nothing; its backward only scales dx and dW. (Before, it recomputed the logits in backward: 2·V·C
  more. Under tensor parallelism with loss parallelism it still recomputes all but the last chunk's logits, up to
  2·V·C/p more, as its gradient needs the statistics of every rank; the model leaves that out, as it leaves out
  the elementwise work.);
- the embedding (chunk 0): no matmul. Its forward adds wpe to the wte rows (C adds per token), its backward adds
  each token's gradient into a wte row and a wpe row (2C): 3C, next to nothing, but it keeps the model honest.
Not counted: elementwise work (LayerNorm, GELU, softmax, the loss's exponentials), so on a device where that
dominates (a tiny model on a CPU) the model overweights the matmul-heavy head. There `measure_costs` times
the three parts alone (bench.pipeline --balance time), `costs_from_step` reads them off one pipeline step's
per-rank times, under the contention the partition must balance (--balance step), or `--pp_layers_per_stage`
sets the partition by hand.
Tensor and context parallelism divide every term alike and leave the partition unchanged (but for that recompute).

The partition (`balanced_partition`, exact, by dynamic programming over (chunk, first Block)): the most expensive chunk
as cheap as possible; among the partitions that achieve it, the second most expensive as cheap as possible, and so
on (the chunks' costs sorted largest first, smallest lexicographically); remaining ties give the earlier chunk
more Blocks. With every Block alike and no extras that is `pipeline_schedule.even_partition`.
torchtitan's `generate_llm_fqn_per_model_part` weighs the embedding and the head in whole Blocks
(input_weight, output_weight) for the same reason; here they are weighed in FLOPs.

V layouts (`v_shape`: zbv, dualpipev; `balanced_v_partition`): rank r holds chunks r and 2P-1-r
(pipeline_schedule.chunk_of), so rank 0 runs both the embedding and the head, and each rank runs both its
chunks for every micro-batch. What a rank waits for is then the busiest RANK, the sum of its two chunks, not
the busiest chunk: the partition balances per rank (ranks' costs sorted largest first, smallest lexicographically),
then, among those, per chunk (the same rule on the chunks' costs: the warm-up, when a rank runs one chunk
only); remaining ties give the earlier rank more Blocks, and within a rank its first chunk (r). The per-chunk
partition leaves rank 0 both extras on top of its chunks' Blocks: for GPT-2 medium at T = 1024, P = 4, Blocks per
chunk [3, 4, 4, 3, 3, 3, 3, 1] cost rank 0 4 Blocks + head (662M) and the busiest other rank 7 Blocks (617M);
per rank, [2, 4, 4, 4, 3, 3, 3, 1] costs rank 0 3 Blocks + head (574M) and the others at most 617M.

Every rank computes the same partition from the same numbers (integers, so no rounding can tell ranks apart);
nothing is communicated. Checkpoints keep full tensors by name, so a run saved under one partition resumes under
any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from model.gpt import Block, GPTConfig
from model.loss import linear_cross_entropy
from runtime.device import make_timer
from runtime.metrics import TRAIN_FLOPS_PER_PARAM, attention_flops_per_token


@dataclass(frozen=True)
class StageCosts:
    """The cost of one Block, of chunk 0's embedding and of the last chunk's head (ln_f, lm_head and the loss),
    forward + backward, in one unit: training FLOPs per token (`stage_costs`) or nanoseconds per micro-batch
    (`measure_costs`)."""

    block: int
    embed: int
    head: int


def stage_costs(config: GPTConfig, seq_len: int) -> StageCosts:
    """The cost model of the module docstring for `config` at sequence length `seq_len`."""
    with torch.device("meta"):
        block_params = sum(p.numel() for p in Block(config).parameters())
    C, V = config.n_embd, config.vocab_size
    block = TRAIN_FLOPS_PER_PARAM * block_params + attention_flops_per_token(config, seq_len, n_layer=1)
    head = TRAIN_FLOPS_PER_PARAM * (V * C + 2 * C)
    return StageCosts(block=block, embed=3 * C, head=head)


def measure_costs(
    config: GPTConfig, seq_len: int, micro_batch: int, device: torch.device | str = "cpu", repeats: int = 5
) -> StageCosts:
    """StageCosts timed instead of counted: nanoseconds of the forward + backward of one Block, of the
    embedding (wte + wpe lookups) and of the head (ln_f, then lm_head and the loss by linear_cross_entropy, as
    the last stage runs them) on one (micro_batch, seq_len) micro-batch on `device`, each the fastest of
    `repeats` rounds after a warm-up round (other load only adds time). Timings differ between runs and
    machines, so where ranks must agree one rank measures and the others take its numbers."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    C, V, T = config.n_embd, config.vocab_size, seq_len
    block = Block(config).to(device)
    wte, wpe = torch.nn.Embedding(V, C).to(device), torch.nn.Embedding(config.block_size, C).to(device)
    ln_f = torch.nn.LayerNorm(C, bias=config.bias).to(device)
    head = torch.nn.Parameter(0.02 * torch.randn(V, C, generator=g).to(device))
    idx = torch.randint(0, V, (micro_batch, T), generator=g).to(device)
    x = torch.randn(micro_batch, T, C, generator=g).to(device).requires_grad_()
    dy = torch.randn(micro_batch, T, C, generator=g).to(device)
    pos = torch.arange(T, device=device)
    parts = {
        "block": lambda: block(x).backward(dy),
        "embed": lambda: (wte(idx) + wpe(pos)).backward(dy),
        "head": lambda: linear_cross_entropy(ln_f(x), head, idx).backward(),
    }
    timer, best = make_timer(device), dict.fromkeys(parts, float("inf"))
    for i in range(repeats + 1):  # round-robin, so a burst of other load hits every part alike
        for name, fn in parts.items():
            t0 = timer.mark()
            fn()
            t1 = timer.mark()
            start, end = timer.seconds([t0, t1])
            best[name] = min(best[name], end - start) if i else best[name]  # round 0 warms up
    return StageCosts(**{name: max(1, round(t * 1e9)) for name, t in best.items()})


def costs_from_step(blocks: Sequence[int], seconds: Sequence[float], flops: StageCosts) -> StageCosts:
    """StageCosts in nanoseconds per micro-batch from one pipeline step's own timings: `seconds[r]`, the mean F +
    B time per micro-batch of rank r's one chunk holding `blocks[r]` Blocks (a one-chunk schedule; rank 0 runs
    the embedding, rank P-1 the head), measured while every rank runs, so under the contention the partition has to
    balance (`measure_costs` times the parts alone). A Block costs what the ranks without the head spend per
    Block (ranks 0..P-2; rank 0's embedding taken off at the FLOP model's embed/block ratio), the head what the
    last rank spends beyond its Blocks. Nothing is communicated: one rank computes, the others take its numbers."""
    P = len(blocks)
    if P < 2 or len(seconds) != P:
        raise ValueError(f"need one time per rank of a pipeline of >= 2 ranks; got {len(seconds)} for {P}")
    embed_per_block = flops.embed / flops.block
    block = sum(seconds[:-1]) / (sum(blocks[:-1]) + embed_per_block)  # the embedding's share is on rank 0
    head = seconds[-1] - blocks[-1] * block
    if head <= 0:
        raise ValueError(
            f"the last rank's {seconds[-1] * 1e3:.1f} ms per micro-batch leave nothing for the head "
            f"beyond its {blocks[-1]} Blocks at {block * 1e3:.1f} ms each"
        )
    return StageCosts(
        block=max(1, round(block * 1e9)),
        embed=max(1, round(block * embed_per_block * 1e9)),
        head=max(1, round(head * 1e9)),
    )


def balanced_partition(block_costs: Sequence[int], chunks: int, first: int = 0, last: int = 0) -> list[range]:
    """Block indices of each of `chunks` consecutive chunks, each >= 1 Block, chunk c costing the sum of its
    Blocks' `block_costs` plus `first` (c = 0) and `last` (c = chunks - 1): the partition of the module docstring
    (minimal most expensive chunk, then the next, ...; ties: the earlier chunk takes more). Exact, O(C·L²)."""
    L = len(block_costs)
    if chunks < 1 or L < chunks:
        raise ValueError(f"cannot partition {L} Blocks into {chunks} non-empty chunks")
    prefix = [0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)

    def cost(c: int, a: int, b: int) -> int:
        return prefix[b] - prefix[a] + (first if c == 0 else 0) + (last if c == chunks - 1 else 0)

    # best[a]: for chunks c..C-1 starting at Block a, the key (costs sorted largest first, -sizes) and sizes
    best: dict[int, tuple[tuple, tuple, tuple[int, ...]]] = {
        a: (((cost(chunks - 1, a, L),), (a - L,), (L - a,))) for a in range(chunks - 1, L)
    }
    for c in range(chunks - 2, -1, -1):
        best = {
            a: min(
                (tuple(sorted((cost(c, a, b), *best[b][0]), reverse=True)), (a - b, *best[b][1]), (b - a, *best[b][2]))
                for b in range(a + 1, L - (chunks - c - 1) + 1)
            )
            for a in range(c, L - (chunks - c) + 1)
        }
    bounds = [0]
    for n in best[0][2]:
        bounds.append(bounds[-1] + n)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def balanced_v_partition(n_layer: int, pp: int, block: int, first: int = 0, last: int = 0) -> list[range]:
    """Block indices of the 2P consecutive chunks of a V layout (rank r holds chunks r and 2P-1-r), every Block
    costing `block`, chunk 0 `first` more and chunk 2P-1 `last` more (both on rank 0): the V partition of the module
    docstring (ranks' costs, then chunks' costs, sorted largest first, lexicographically smallest; ties: the
    earlier rank takes more Blocks, then, within a rank, its first chunk r).

    Exact in O(n_layer): only a rank's Block total s_r enters the ranks' costs (rank 0: s_0·block + first + last,
    rank r > 0: s_r·block), and for a given s_0 the other ranks' costs are smallest as a sorted list when their
    totals are as even as possible (the larger ones on the earlier ranks); each rank > 0 then halves its total
    (the extra Block on its first chunk, r), and rank 0 cuts its own by balanced_partition. So try every s_0."""
    if pp < 1 or n_layer < 2 * pp:
        raise ValueError(f"cannot partition {n_layer} Blocks into 2 x {pp} non-empty chunks")
    chunks, best = 2 * pp, None
    for s0 in range(2 if pp > 1 else n_layer, n_layer - 2 * (pp - 1) + 1):  # P = 1: rank 0 holds every Block
        q, e = divmod(n_layer - s0, pp - 1) if pp > 1 else (0, 0)
        sizes = [0] * chunks
        end = balanced_partition([block] * s0, 2, first, last)
        sizes[0], sizes[-1] = len(end[0]), len(end[1])
        for r in range(1, pp):
            s = q + (r - 1 < e)
            sizes[r], sizes[chunks - 1 - r] = (s + 1) // 2, s // 2
        chunk_costs = [n * block + first * (c == 0) + last * (c == chunks - 1) for c, n in enumerate(sizes)]
        rank_costs = [chunk_costs[r] + chunk_costs[chunks - 1 - r] for r in range(pp)]
        key = (
            sorted(rank_costs, reverse=True),
            sorted(chunk_costs, reverse=True),
            [-sizes[r] - sizes[chunks - 1 - r] for r in range(pp)],
            [-n for n in sizes[:pp]],
        )
        if best is None or key < best[0]:
            best = (key, sizes)
    bounds = [0]
    for n in best[1]:
        bounds.append(bounds[-1] + n)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def layers_for(
    config: GPTConfig,
    pp: int,
    virtual: int = 1,
    seq_len: int | None = None,
    counts: Sequence[int] | None = None,
    costs: StageCosts | None = None,
    v_shape: bool = False,
) -> list[range]:
    """The partition a pipeline of `pp` ranks x `virtual` chunks uses: `counts` Blocks per chunk if given (the
    --pp_layers_per_stage override; `check_counts` first), else `balanced_partition` of `costs` (default:
    `stage_costs` at `seq_len`, itself defaulting to config.block_size), or, for a V layout (`v_shape`, virtual
    2: zbv, dualpipev), `balanced_v_partition`, balanced per rank."""
    chunks = pp * virtual
    if counts is not None:
        reason = check_counts(counts, config.n_layer, chunks)
        if reason:
            raise ValueError(reason)
        bounds = [0]
        for n in counts:
            bounds.append(bounds[-1] + n)
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]
    k = costs or stage_costs(config, seq_len or config.block_size)
    if v_shape:
        if virtual != 2:
            raise ValueError(f"a V layout has two chunks per rank; got virtual={virtual}")
        return balanced_v_partition(config.n_layer, pp, k.block, k.embed, k.head)
    return balanced_partition([k.block] * config.n_layer, chunks, k.embed, k.head)


def check_counts(counts: Sequence[int], n_layer: int, chunks: int) -> str | None:
    """Why `counts` (Blocks per chunk) is not a partition of n_layer Blocks into `chunks` chunks, or None."""
    if len(counts) != chunks:
        return f"gives {len(counts)} counts; the pipeline has P x V = {chunks} chunks, one count each"
    if min(counts) < 1:
        return f"gives chunk {list(counts).index(min(counts))} no Block ({min(counts)}); every chunk needs >= 1"
    if sum(counts) != n_layer:
        return f"sums to {sum(counts)}, not n_layer ({n_layer})"
    return None


def describe_partition(
    layers: list[range],
    costs: StageCosts,
    by: str = "cost",
    unit: str = "training FLOPs per token",
    v_shape: bool = False,
) -> str:
    """One line: each chunk's Blocks and its cost in `unit` (M = 1e6); for a V layout (`v_shape`) also each
    rank's cost, the sum of its chunks r and 2P-1-r, which its partition balances."""
    parts, chunk_costs = [], []
    for c, r in enumerate(layers):
        chunk_costs.append(len(r) * costs.block + costs.embed * (c == 0) + costs.head * (c == len(layers) - 1))
        blocks = f"Block {r.start}" if len(r) == 1 else f"Blocks {r.start}-{r.stop - 1}"
        parts.append(f"chunk {c} {blocks} ({chunk_costs[-1] / 1e6:.3g}M)")
    line = f"pipeline partition by {by} ({unit}): " + ", ".join(parts)
    if v_shape:
        n = len(layers)
        line += "; per rank: " + ", ".join(
            f"rank {r} ({(chunk_costs[r] + chunk_costs[n - 1 - r]) / 1e6:.3g}M)" for r in range(n // 2)
        )
    return line
