"""Every layout the trainer accepts for a model on a cluster, each with its predicted bytes and step time.

A candidate is a list of train.py flags; config.check_layout (the trainer's own validation, before any process
group) decides whether it is accepted, so the planner never offers a layout train.py would refuse.

The step-time model (simple on purpose; it ranks layouts, it does not promise seconds):
- compute: the rank's FLOPs (predict.step_flops: 6N + 12LHT per token, plus AC's recomputed forwards) at
  `efficiency` x the GPU's peak, stretched by the pipeline's bubble: / (1 - bubble_fraction);
- overhead: Cluster.overhead x the rank's compute actions per step (`compute_actions`: F and B per micro-step
  without a pipeline, the schedule's F, B and W under one, plus a recomputed forward per B under AC), added to
  the FLOPs' time before the bubble's stretch and the core share (it runs on the rank's core too): what makes
  many small micro-batches and split backwards slower than their FLOPs say;
- communication: each group's payload (predict.comm_by_group) over its link (cluster.link_of: NVLink inside a
  node, the network across), times the ring factor of its kind (all-reduce 2(n-1)/n, all-gather and
  reduce-scatter (n-1)/n, p2p 1);
- latency: each group's calls per step (predict.comm_calls_by_group: the calls formulas beside the wrappers' bytes
  formulas, held call for call against parallel/comm.COUNTER) x Cluster.latency, added to that group's time:
  TP's many small collectives per Block cost this, not bandwidth;
- hops: the same calls x their hops over the group's n ranks (`HOPS`: the sequential messages of the algorithm, 2(n-1)
  for a ring all-reduce) x Cluster.hop, added to that group's time. 0 on the GPU presets (a call's latency holds
  NCCL's few-us hops); gloo on CPU ranks pays ~0.5 to 1.2 ms a hop (plan/cluster.py), so there an all-reduce
  over 4 ranks costs 3x one over 2 at the same hop, and TP's per-Block collectives dominate its step;
- oversubscription (Cluster.cores < ranks: CPU ranks sharing a machine): a rank runs at peak x min(1, cores /
  busy), busy = N(1 - bubble) the mean number of ranks computing, since a rank idle in the pipeline bubble
  frees its core for the others; `peak_flops` is then one rank's rate on a core of its own. With a processor
  per rank (GPUs, cores None) the share is 1;
- overlap: DDP's and ZeRO-2/3's gradient traffic and ZeRO-3's gathers run behind compute (the wrappers issue
  them asynchronously, bucket by bucket / unit by unit), so they cost only what exceeds the compute; TP's
  collectives (on the critical path between matmuls), CP's ring (not overlapped with its own block's kernel
  here), pipeline p2p and ZeRO-1's end-of-step reduce-scatter are added; on a cluster without overlap
  (Cluster.overlap False: gloo on CPU ranks) everything is added.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from dataclasses import dataclass

import torch

from parallel.pipeline.schedule import V_SCHEDULES
from plan.cluster import Cluster, link_of
from plan.counts import (
    Setup,
    comm_by_group,
    comm_calls_by_group,
    recomputed_blocks,
    schedule_facts,
    state_bytes,
    step_flops,
)
from plan.predict import worst_rank
from plan.theory import bubble_fraction
from runtime import registry
from trainer.concepts import concepts
from trainer.config import UsageError, check_layout, train_parser

RING = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "p2p": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,
}  # all_to_all: its input counted, 1/n of it stays on the rank
# Hops (sequential messages) of one call over n ranks, each charged Cluster.hop: gloo's ring all-reduce is a
# reduce-scatter then an all-gather round the ring, 2(n - 1); its all-gather n - 1; its reduce-scatter takes about
# as long as an all-reduce of the same input (bench/plan_rank.py's probes over 4 ranks on 2 cores: 5.55 against
# 5.66 ms, the all-gather 3.58), so 2(n - 1); a broadcast n - 1 (no calls formula issues one per step); p2p 1
HOPS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: 2 * (n - 1),
    "broadcast": lambda n: n - 1,
    "p2p": lambda n: 1,
    "all_to_all": lambda n: n - 1,
}  # a2a: a message a peer
# (schedule, chunks per rank) the search tries under a pipeline: every schedule train.py runs, V = 2 for
# interleaving and the V schedules; config.check_layout refuses what a composition does not support (the
# zero-bubble schedules with a sharding engine, TP or CP)
PP_SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2), ("dualpipev", 2)]


@dataclass
class Candidate:
    """One accepted layout. Its prediction and step time are computed when first asked (most layouts of a big
    cluster are ruled out by `state_floor` alone and never need them); `cluster` and `efficiency` price it."""

    name: str
    flags: list[str]
    setup: Setup
    cluster: Cluster
    efficiency: float

    @functools.cached_property
    def predicted(self) -> dict:
        """predict.worst_rank: the pipeline stage with the highest peak."""
        return worst_rank(self.setup)

    @functools.cached_property
    def times(self) -> dict:
        return step_time(self.setup, self.cluster, self.efficiency)

    @property
    def seconds(self) -> float:
        return self.times["total"]

    @functools.cached_property
    def state_floor(self) -> int:
        """The most state bytes any stage holds: a lower bound of predicted["peak_memory_bytes"] (the worst
        stage's peak is at least any stage's peak, each its state plus non-negative terms), so a layout whose
        floor exceeds the memory cannot fit, and nothing else of it need be computed."""
        return max(sum(state_bytes(self.setup, r).values()) for r in range(self.setup.dims.pp))

    def torchrun(self, extra: str = "") -> str:
        n = self.setup.dims.world_size
        launch = (
            "python" if n == 1 else f"torchrun --nproc_per_node={min(n, 8)}" + (f" --nnodes={n // 8}" if n > 8 else "")
        )
        return f"{launch} train.py {' '.join(self.flags)}{extra}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_name(
    pp: int,
    schedule: str,
    virtual: int,
    dp: int,
    dp_type: str | None,
    replicate: int,
    cp: int,
    tp: int,
    ac: str,
    mb: int,
    ep: int = 1,
    extra: str = "",
) -> str:
    """e.g. `pp=2(1f1b) dp=4(fsdp,R=2) cp=2 tp=2 ep=2 ac=full mb=4`: the dims > 1, a concept's variant (`extra`),
    then AC and the micro-batch."""
    parts = []
    if pp > 1:
        parts.append(f"pp={pp}({schedule}{f',V={virtual}' if virtual > 1 else ''})")
    if dp_type:
        parts.append(f"dp={dp}({dp_type}{f',R={replicate}' if replicate > 1 else ''})")
    if cp > 1:
        parts.append(f"cp={cp}")
    if tp > 1:
        parts.append(f"tp={tp}")
    if ep > 1:
        parts.append(f"ep={ep}")
    return " ".join(parts + ([extra] if extra else []) + [f"ac={ac}", f"mb={mb}"])


def flags_for(
    model_flags: list[str],
    pp: int,
    schedule: str,
    virtual: int,
    dp: int,
    dp_type: str | None,
    replicate: int,
    cp: int,
    tp: int,
    ac: str,
    mb: int,
    ep: int = 1,
) -> list[str]:
    f = [*model_flags, "--micro_batch_size", str(mb)]
    if pp > 1:
        f += ["--pipeline_parallel_size", str(pp), "--pp_schedule", schedule]
        f += ["--pp_virtual_stages", str(virtual)] if virtual > 1 else []
    if dp > 1:
        f += ["--data_parallel_size", str(dp)]
    if dp_type and (dp > 1 or dp_type != "ddp"):
        f += ["--data_parallel_type", dp_type]
    if replicate > 1:
        f += ["--data_parallel_replicate_size", str(replicate)]
    if cp > 1:
        f += ["--context_parallel_size", str(cp)]
    if tp > 1:
        f += ["--tensor_parallel_size", str(tp), "--sequence_parallel", "--enable_loss_parallelism"]
    if ep > 1:
        f += ["--expert_parallel_size", str(ep)]
    if ac != "none":
        f += ["--activation_checkpointing", ac]
    return f


RUN_FLAGS = ("--implementation", "custom", "--out_dir", "-")  # what every candidate is checked with


def _train_parser() -> argparse.ArgumentParser:
    return _parser_of(registry.version())


@functools.cache
def _parser_of(version: int) -> argparse.ArgumentParser:
    """train.py's parser, once per state of the registry (a concept registered later adds its flags)."""
    return train_parser()


def _model_args(model_flags: tuple[str, ...]) -> argparse.Namespace:
    return _model_args_of(model_flags, registry.version())


@functools.lru_cache(maxsize=8)
def _model_args_of(model_flags: tuple[str, ...], version: int) -> argparse.Namespace:
    return _train_parser().parse_args([*model_flags, *RUN_FLAGS])


def layout_args(model_flags: list[str], layout: list[str]) -> argparse.Namespace:
    """train.py's parse of [*model_flags, *layout, *RUN_FLAGS] without parsing it again per layout: the model
    flags parsed once, then each of `layout`'s flags (`--flag value` or a switch, as flags_for writes them) set
    by its own argparse action's dest, type and choices. UsageError on a flag or value train.py refuses."""
    args = argparse.Namespace(**vars(_model_args(tuple(model_flags))))
    actions = _train_parser()._option_string_actions
    tokens = iter(layout)
    for flag in tokens:
        act = actions.get(flag)
        if act is None:
            raise UsageError(f"unrecognized arguments: {flag}")
        if act.nargs == 0:  # store_true
            setattr(args, act.dest, act.const)
            continue
        value = next(tokens)
        value = act.type(value) if act.type else value
        if act.choices is not None and value not in act.choices:
            raise UsageError(f"argument {flag}: invalid choice: {value!r}")
        setattr(args, act.dest, value)
    return args


def accepted(model_flags: list[str], layout: list[str], world: int, device: torch.device) -> Setup | None:
    """The layout as train.py would validate it (config.check_layout), or None if train.py refuses it."""
    try:
        args = layout_args(model_flags, layout)
        dims, config, dtype, _, accum, pp_layers = check_layout(args, world, device)
    except UsageError:
        return None
    return Setup(args, dims, config, dtype, accum, pp_layers)


def model_refusal(model_flags: list[str], micro_batch: int) -> str | None:
    """What train.py says of the model and batch flags on one rank (an unknown preset, a shape it refuses), or None
    when it accepts them there: then only the layouts are refused, and the search says so."""
    try:
        check_layout(layout_args(model_flags, ["--micro_batch_size", str(micro_batch)]), 1, torch.device("meta"))
    except UsageError as e:
        return str(e)
    return None


@functools.lru_cache(maxsize=1024)
def _bubble(schedule: str, pp: int, micro: int, virtual: int) -> float:
    """theory.bubble_fraction, once per (schedule, P, M, V); for the V schedules, which simulate their
    list for it, the simulate predict.schedule_facts already ran for the activations in flight."""
    if schedule in V_SCHEDULES and virtual == 2:
        return schedule_facts(schedule, pp, micro, virtual)[2]
    return bubble_fraction(schedule, pp, micro, virtual)


def core_share(cluster: Cluster, bubble: float) -> float:
    """The share of a core a busy rank gets: min(1, cores / busy) with busy = N(1 - bubble) ranks computing on
    average (the module docstring's oversubscription term); 1 with a processor per rank (cores None)."""
    if cluster.cores is None:
        return 1.0
    return min(1.0, cluster.cores / (cluster.gpus * (1 - bubble)))


def compute_actions(s: Setup) -> float:
    """Compute actions per step on the busiest rank, each charged Cluster.overhead: F and B per micro-step
    without a pipeline (the whole model is one chunk), under one each rank's F, B and W actions from its schedule's
    list (predict.schedule_facts), the most of any rank; AC adds a recomputed forward per B, times the share of
    Blocks it re-runs (predict.recomputed_blocks over all n_layer, as predict.step_flops counts its FLOPs)."""
    d = s.dims
    if d.pp > 1:
        counts = schedule_facts(s.args.pp_schedule, d.pp, s.grad_accum, s.args.pp_virtual_stages or 1)[3]
        f, b, w = max(counts, key=sum)
    else:
        f, b, w = s.grad_accum, s.grad_accum, 0
    redo = recomputed_blocks(s, list(range(s.config.n_layer))) / s.config.n_layer
    return f + b + w + redo * b


def hops(calls: dict[str, int], n: int) -> int:
    """One group's hops per step: each kind's calls (predict.comm_calls_by_group) x `HOPS` of that kind over the
    group's n ranks; Cluster.hop charges each."""
    return sum(k * HOPS[kind](n) for kind, k in calls.items())


def groups_of(s: Setup) -> dict[str, registry.Group]:
    """Every group a concept's terms price (runtime/registry.Terms.groups): its ranks, link dims, overlap."""
    out: dict[str, registry.Group] = {}
    for c in concepts():
        if c.terms is not None and c.terms.groups is not None:
            out.update(c.terms.groups(s))
    return out


def step_time(s: Setup, cluster: Cluster, efficiency: float) -> dict:
    """Seconds per step by part (the module docstring's model): compute (FLOPs and per-action overhead, and what a
    concept's terms add after the backward: an optimizer's own work, never hidden), each group's communication over
    its link (a group of a concept's terms: runtime/registry.Group), total. Gradient traffic a group marks
    overlapped hides behind compute on a cluster that overlaps."""
    d = s.dims
    sizes = {"pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "cp": d.cp, "tp": d.tp}
    bubble = _bubble(s.args.pp_schedule, d.pp, s.grad_accum, s.args.pp_virtual_stages or 1) if d.pp > 1 else 0
    work = step_flops(s) / (cluster.peak_flops * efficiency) + cluster.overhead * compute_actions(s)
    compute = work / core_share(cluster, bubble) / (1 - bubble)
    groups, calls, by_name = comm_by_group(s), comm_calls_by_group(s), groups_of(s)
    for c in concepts():
        if c.terms is not None and c.terms.flops is not None and (f := c.terms.flops(s)):
            compute += f / (cluster.peak_flops * efficiency)
    times = {"compute": compute}
    for g, kinds in groups.items():
        n = by_name[g].size
        if n <= 1:
            continue
        inter = any(link_of(dim, sizes, cluster.gpus_per_node) == "inter" for dim in by_name[g].dims if sizes[dim] > 1)
        bw = cluster.inter_bw if inter else cluster.intra_bw
        times[g] = (
            sum(v * RING[k](n) for k, v in kinds.items()) / bw
            + cluster.latency * sum(calls[g].values())
            + cluster.hop * hops(calls[g], n)
        )
    hidden = sum(v for g, v in times.items() if g in by_name and by_name[g].overlapped) if cluster.overlap else 0
    exposed = sum(v for g, v in times.items() if g != "compute") - hidden
    times["total"] = max(compute, hidden) + exposed
    return times


def candidates(
    model_flags: list[str], cluster: Cluster, micro_batches: list[int], constraints: dict, efficiency: float = 0.5
) -> list[Candidate]:
    """Every accepted layout on `cluster.gpus` ranks: pp x schedule x dp type (HSDP with a node's worth of
    shards) x cp x tp (within a node) x, for an MoE model of E experts, ep (the divisors of E that divide dp x cp:
    EP borrows the batch ranks) x AC x micro-batch, each with its worst stage's prediction and step time.
    `constraints` pins any of pp, tp, cp, ep, dp_type, ac."""
    N, G = cluster.gpus, cluster.gpus_per_node
    device = torch.device("meta")  # check_layout only asks its type (CPU-only refusals); the dtype is explicit
    E = _model_args(tuple(model_flags)).moe_num_experts
    out = []
    for pp, cp, tp in itertools.product(divisors(N), divisors(N), divisors(min(N, G))):
        if N % (pp * cp * tp) or any(
            constraints.get(k) not in (None, v) for k, v in (("pp", pp), ("cp", cp), ("tp", tp))
        ):
            continue
        dp = N // (pp * cp * tp)
        schedules = PP_SCHEDULES if pp > 1 else [("1f1b", 1)]
        dp_types = [("ddp", 1), ("zero1", 1), ("zero2", 1), ("fsdp", 1)] if dp * cp > 1 else [(None, 1)]
        shards_in_node = G // (cp * tp)
        if dp > shards_in_node > 1 and dp % shards_in_node == 0:
            dp_types += [(t, dp // shards_in_node) for t in ("zero2", "fsdp")]
        eps = [e for e in divisors(dp * cp) if E % e == 0 and constraints.get("ep") in (None, e)] if E else [1]
        for (schedule, v), (dp_type, r), ep, ac, mb in itertools.product(
            schedules, dp_types, eps, ("none", "selective", "full"), micro_batches
        ):
            if constraints.get("dp_type") not in (None, dp_type) or constraints.get("ac") not in (None, ac):
                continue
            sizes = {"pp": pp, "dp": dp, "dp_type": dp_type, "replicate": r, "cp": cp, "tp": tp, "ep": ep}
            for part, extra in variants(sizes):
                flags = flags_for(model_flags, pp, schedule, v, dp, dp_type, r, cp, tp, ac, mb, ep) + extra
                s = accepted(model_flags, flags[len(model_flags) :], N, device)
                if s is None:
                    continue
                name = layout_name(pp, schedule, v, dp, dp_type, r, cp, tp, ac, mb, ep, part)
                out.append(Candidate(name, flags, s, cluster, efficiency))
    return out


def model_flags(a: argparse.Namespace) -> list[str]:
    """train.py's model and batch flags from the planner's arguments: its own, then each concept's (`plan_flags`,
    runtime/registry.Concept) where it is not the default."""
    f = [
        "--model",
        a.model,
        "--seq_len",
        str(a.seq_len),
        "--total_batch_size",
        str(a.total_batch_size),
        "--dtype",
        a.dtype,
    ]
    for k in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
        if getattr(a, k, None) is not None:
            f += [f"--{k}", str(getattr(a, k))]
    for act in concept_plan_actions():
        value = getattr(a, act.dest, act.default)
        if value != act.default:
            f += [act.option_strings[0]] + ([] if act.nargs == 0 else [str(value)])
    return f


def concept_plan_actions() -> list[argparse.Action]:
    """The argparse actions of every concept's planner flags (runtime/registry.Concept.plan_flags), in order."""
    p = argparse.ArgumentParser(add_help=False)
    for c in concepts():
        if c.plan_flags is not None:
            c.plan_flags(p.add_argument)
    return list(p._actions)


def variants(sizes: dict) -> list[tuple[str, list[str]]]:
    """(name part, flags) of each combination of the variants the concepts try for a layout of these `sizes`
    (runtime/registry.Concept.search, e.g. an algorithm a dimension runs by); one empty one when none does."""
    out: list[tuple[str, list[str]]] = [("", [])]
    for c in concepts():
        if c.search is not None:
            out = [(f"{n} {m}".strip(), [*f, *g]) for n, f in out for m, g in c.search(sizes)]
    return out
