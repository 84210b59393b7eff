"""What one rank of a layout holds and sends, counted from the formulas that sit beside the wrappers.

Nothing here is measured and no formula is restated. `Setup` is the planner's view of one rank, which each
concept's terms read (runtime/registry.Terms): the per-rank parameter shapes from the model on meta cut by
`PipelineStage` and `tp_local_shape` (tensor_parallel.SHARD_DIMS), the sharding engine's units
(`flat_param.unit_key`), the stage's Blocks. State, bytes and calls are the registry's: each concept adds its own
(`state_bytes`, `comm_by_group`, `comm_calls_by_group`); FLOPs from metrics.flops_per_token. What is new here is
the saved-activation count (`block_saved_bytes`, derived in its docstring) and its composition with AC, SP, CP and
the pipeline's in-flight bound; the peak memory built on them is plan/peak.py's.

plan/predict.py assembles these counts and plan/peak.py's peak into the keys train.py measures each step.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass

import torch

from model.gpt import GPT, GPTConfig
from parallel.data_parallel.flat_param import ZERO_STAGES, unit_key
from parallel.expert_parallel.theory import is_expert
from parallel.mesh import ParallelDims
from parallel.parallelize import activation_dtype
from parallel.pipeline.partition import layers_for
from parallel.pipeline.runner import PipelineStage, sharded_units
from parallel.pipeline.schedule import ALL_SCHEDULES, V_SCHEDULES, chunk_of
from parallel.tensor_parallel.theory import tp_local_shape
from plan.theory import pipelined_root_gathers
from plan.timeline import simulate_schedule
from runtime.device import backend_for
from runtime.metrics import active_params, flops_per_token
from trainer.concepts import concepts

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all")


@dataclass(frozen=True)
class Setup:
    """One validated layout, as config.check_layout returns it (the planner's input, and train.py's), with the
    ParallelConfig config.parallel_config resolves from it (dp_type, param_dtype: the trainer's own rules)."""

    args: argparse.Namespace
    dims: ParallelDims
    config: GPTConfig
    dtype: torch.dtype
    grad_accum: int  # M: micro-steps per step (a pipeline's micro-batches)
    pp_layers: tuple[int, ...] | None = None  # the pipeline's Blocks per chunk (parallel/pipeline/partition.py)

    @functools.cached_property
    def parallel(self):
        """config.parallel_config's resolution, once per Setup (every prediction asks it many times)."""
        from trainer.config import parallel_config

        return parallel_config(self.args, self.dims, self.dtype, self.pp_layers)

    @property
    def dp_type(self) -> str | None:
        """What wraps the model for data parallelism: None, "ddp" or a ZeRO stage (CP alone means DDP)."""
        return self.parallel.dp_type

    @property
    def compute_bytes(self) -> int:
        return _size(self.dtype)

    @property
    def param_bytes(self) -> int:
        """Element size of a sharding engine's compute copies (None: fp32)."""
        return _size(self.parallel.param_dtype or torch.float32)

    @property
    def reduce_bytes(self) -> int:
        return _size(self.parallel.reduce_dtype)

    @property
    def copies_reduce_input(self) -> bool:
        """Whether the ranks' reduce-scatter copies its input: gloo's does (CPU ranks, --device cpu), NCCL's does
        not (--device cuda, or auto: the planner's GPUs; `for_run` passes a run's resolved device);
        theory.reduce_held_bytes."""
        device = self.args.device
        return device != "auto" and backend_for(torch.device(device)) == "gloo"

    @property
    def residual_bytes(self) -> int:
        """The residual stream's element size (parallelize.activation_dtype)."""
        return _size(activation_dtype(self.parallel, "fsdp" if self.dp_type in ZERO_STAGES else None))

    # the view of one rank a concept's terms read (runtime/registry.Terms): this module's functions, by name

    def local_params(self, pp_rank: int = 0) -> list[tuple[str, int, int]]:
        return local_params(self, pp_rank)

    def units(self, pp_rank: int = 0) -> dict[str, tuple[int, int]]:
        return units(self, pp_rank)

    def unit_shard(self, unit: str) -> int:
        return unit_shard(self, unit)

    def unit_members(self, pp_rank: int = 0) -> dict[str, list[tuple[str, int, bool]]]:
        return unit_members(self, pp_rank)

    def stage_blocks(self, pp_rank: int = 0) -> tuple[list[int], bool, bool]:
        return stage_blocks(self, pp_rank)

    def moe_blocks(self, pp_rank: int = 0) -> list[int]:
        return moe_blocks(self, pp_rank)

    def recomputed(self, blocks: list[int]) -> int:
        return recomputed_blocks(self, blocks)

    def root_gathers(self, pp_rank: int = 0) -> int:
        """ZeRO-3's gathers of this stage's roots per step under its pipeline schedule (theory.pipelined_root_gathers
        over the rank's actions)."""
        a = self.args
        return _root_gathers(a.pp_schedule, self.dims.pp, self.grad_accum, a.pp_virtual_stages or 1)[pp_rank]

    def meta_gpt(self) -> GPT:
        """The whole model on meta (built once per config)."""
        return _meta_gpt(self.config)


@functools.cache
def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def local_params(s: Setup, pp_rank: int = 0) -> list[tuple[str, int, int]]:
    """(name, elements, dims) of each distinct parameter one rank of pipeline stage `pp_rank` holds (its tp
    shard; its E/ep experts of each MoE layer; the tied matrix once, or on a pipeline's last stage the lm_head
    copy too)."""
    return _local_params(
        s.config,
        s.dims.pp,
        s.args.pp_virtual_stages or 1,
        s.dims.tp,
        pp_rank,
        s.pp_layers,
        s.args.pp_schedule in V_SCHEDULES,
        s.dims.ep,
    )


@functools.lru_cache(maxsize=8)
def _meta_gpt(config: GPTConfig) -> GPT:
    """The model on meta, built once per config (a PipelineStage only takes references to its modules)."""
    with torch.device("meta"):
        return GPT(config)


@functools.lru_cache(maxsize=4096)
def _local_params(
    config: GPTConfig,
    pp: int,
    virtual: int,
    tp: int,
    pp_rank: int,
    layers: tuple[int, ...] | None = None,
    v_shape: bool = False,
    ep: int = 1,
) -> list[tuple[str, int, int]]:
    gpt = _meta_gpt(config)
    with torch.device("meta"):
        module = PipelineStage(gpt, pp_rank, pp, virtual, layers, v_shape) if pp > 1 else gpt
    out = []
    for name, p in module.named_parameters():
        shape = tp_local_shape(name, tuple(p.shape), tp)
        if is_expert(name):  # expert_parallel.apply_expert_parallel: experts [r·E/ep, (r+1)·E/ep) along dim 0
            shape = (shape[0] // ep, *shape[1:])
        out.append((name, int(torch.Size(shape).numel()), len(shape)))
    return out


def units(s: Setup, pp_rank: int = 0) -> dict[str, tuple[int, int]]:
    """The sharding engine's units on this stage: {unit: (elements, elements in >= 2-D weights)} (shared: read it,
    do not change it). Under expert parallelism each Block's experts are a unit of their own,
    "transformer.h.<i>.experts" (parallel/data_parallel/fsdp_extensions.py's own-group units), sharded over the edp
    group
    (`unit_shard`)."""
    return _units(
        s.config,
        s.dims.pp,
        s.args.pp_virtual_stages or 1,
        s.dims.tp,
        pp_rank,
        s.pp_layers,
        s.args.pp_schedule in V_SCHEDULES,
        s.dims.ep,
    )


def unit_shard(s: Setup, unit: str) -> int:
    """The ranks a unit is sharded over: an expert unit's edp group (dp·cp/ep: the ranks holding the same
    experts, HSDP's replicas among them), every other unit's dp_shard·cp."""
    d = s.dims
    return d.dp * d.cp // d.ep if unit.endswith(".experts") else d.dp_shard * d.cp


@functools.lru_cache(maxsize=4096)
def _units(
    config: GPTConfig,
    pp: int,
    virtual: int,
    tp: int,
    pp_rank: int,
    layers: tuple[int, ...] | None,
    v_shape: bool,
    ep: int = 1,
) -> dict[str, tuple[int, int]]:
    params = _local_params(config, pp, virtual, tp, pp_rank, layers, v_shape, ep)
    with torch.device("meta"):  # the engine's own rule (a rank holding both ends has no tied unit: a V's rank 0)
        separate = (
            sharded_units(PipelineStage(_meta_gpt(config), pp_rank, pp, virtual, layers, v_shape)) if pp > 1 else {}
        )
    out: dict[str, list[int]] = {"root": [0, 0]}
    for name, n, ndim in params:
        key = unit_key(name, separate)
        u = out.setdefault(key + (".experts" if ep > 1 and is_expert(name) else ""), [0, 0])
        u[0] += n
        u[1] += n if ndim >= 2 and not name.endswith("bias") else 0  # model.decays
    return {k: (v[0], v[1]) for k, v in out.items()}


def unit_members(s: Setup, pp_rank: int = 0) -> dict[str, list[tuple[str, int, bool]]]:
    """(name, local elements, decays) of each unit's parameters in flatten_unit's order (decayed first), the units
    as `units` cuts them."""
    d = s.dims
    return _members(
        s.config,
        d.pp,
        s.args.pp_virtual_stages or 1,
        d.tp,
        pp_rank,
        s.pp_layers,
        s.args.pp_schedule in V_SCHEDULES,
        d.ep,
    )


@functools.lru_cache(maxsize=256)
def _members(config, pp, virtual, tp, pp_rank, layers, v_shape, ep) -> dict[str, list[tuple[str, int, bool]]]:
    with torch.device("meta"):
        separate = (
            sharded_units(PipelineStage(_meta_gpt(config), pp_rank, pp, virtual, layers, v_shape)) if pp > 1 else {}
        )
    out: dict[str, list] = {}
    for name, n, ndim in _local_params(config, pp, virtual, tp, pp_rank, layers, v_shape, ep):
        key = unit_key(name, separate) + (".experts" if ep > 1 and is_expert(name) else "")
        out.setdefault(key, []).append((name, n, ndim >= 2 and not name.endswith("bias")))
    return {k: sorted(v, key=lambda x: not x[2]) for k, v in out.items()}


def state_bytes(s: Setup, pp_rank: int = 0, shard_rank: int = 0, expert_shard_rank: int = 0) -> dict[str, int]:
    """{"params", "grads", "optimizer"} bytes after an optimizer step, as Parallelized.state_breakdown counts
    them: fp32 parameters and gradients and AdamW's two moments + one fp32 step tensor per parameter, each
    storage once (DDP's gradients are views of its buckets: the same bytes), then each concept's terms in
    registration order (runtime/registry.Terms.state: a ZeRO stage per unit, for the rank `shard_rank` of the
    sharding group and `expert_shard_rank` of an expert unit's; an optimizer's own state)."""
    params = local_params(s, pp_rank)
    n = sum(k for _, k, _ in params)
    out = {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n + 4 * len(params)}
    for c in concepts():
        if c.terms is not None and c.terms.state is not None:
            c.terms.state(s, pp_rank, shard_rank, expert_shard_rank, out)
    return out


def stage_blocks(s: Setup, pp_rank: int = 0) -> tuple[list[int], bool, bool]:
    """(global indices of the Blocks this pp rank runs, whether it holds the embeddings (the first chunk),
    whether it holds the head (the last chunk))."""
    if not s.dims.pp_enabled:
        return list(range(s.config.n_layer)), True, True
    chunks = stage_chunks(s, pp_rank)
    last = s.dims.pp * (s.args.pp_virtual_stages or 1) - 1
    ends = {c for c, _ in chunks}
    return [i for _, blocks in chunks for i in blocks], 0 in ends, last in ends


def stage_chunks(s: Setup, pp_rank: int = 0) -> list[tuple[int, list[int]]]:
    """(chunk, global indices of its Blocks) for each chunk this pp rank runs, in local order (a pipeline's)."""
    V = s.args.pp_virtual_stages or 1
    v_shape = s.args.pp_schedule in V_SCHEDULES
    layers = _layers(s.config, s.dims.pp, V, s.args.seq_len, s.pp_layers, v_shape)
    return [(c, list(layers[c])) for c in (chunk_of(pp_rank, v, s.dims.pp, v_shape) for v in range(V))]


@functools.lru_cache(maxsize=1024)
def _layers(
    config: GPTConfig, pp: int, virtual: int, seq_len: int, counts: tuple[int, ...] | None, v_shape: bool
) -> tuple[range, ...]:
    """pipeline_partition.layers_for, once per (model, pp, V, seq_len, counts): it depends on no other flag."""
    return tuple(layers_for(config, pp, virtual, seq_len, counts, v_shape=v_shape))


def recomputed_blocks(s: Setup, blocks: list[int]) -> int:
    """How many of `blocks` (global indices) activation checkpointing re-runs in backward, per micro-step: the
    Blocks blocks.apply_activation_checkpointing picks (all, or index % ac_every == 0)."""
    ac = s.args.activation_checkpointing
    return sum(ac == "full" or (ac == "selective" and i % s.args.ac_every == 0) for i in blocks)


def moe_blocks(s: Setup, pp_rank: int = 0) -> list[int]:
    """Global indices of the MoE Blocks (model.GPTConfig.is_moe) this pp rank runs."""
    return [i for i in stage_blocks(s, pp_rank)[0] if s.config.is_moe(i)]


def comm_by_group(s: Setup, pp_rank: int = 0) -> dict[str, dict[str, int]]:
    """Payload bytes by group and kind that parallel/comm.COUNTER records on global rank 0 of stage `pp_rank`
    per step (our wrappers only), each concept's groups from its terms (runtime/registry.Terms.comm), in
    registration order: "tp", "cp", under expert parallelism "ep", "pp", the data-parallel groups ("dp",
    "dp_replicate", "edp"), then the optimizer's."""
    out: dict[str, dict[str, int]] = {}
    for c in concepts():
        if c.terms is not None and c.terms.comm is not None:
            c.terms.comm(s, pp_rank, out)
    return out


def comm_calls_by_group(s: Setup, pp_rank: int = 0) -> dict[str, dict[str, int]]:
    """`comm_by_group`'s calls (COUNTER.calls: one per collective or p2p message), group by group and kind, from
    the calls formulas beside the wrappers' bytes formulas: what a per-call latency charges (search.step_time)."""
    out: dict[str, dict[str, int]] = {}
    for c in concepts():
        if c.terms is not None and c.terms.calls is not None:
            c.terms.calls(s, pp_rank, out)
    return out


def _root_gathers(schedule: str, pp: int, micro: int, virtual: int) -> tuple[int, ...]:
    """pipelined_root_gathers over each rank's actions of `schedule`."""
    return schedule_facts(schedule, pp, micro, virtual)[1]


@functools.lru_cache(maxsize=1024)
def schedule_facts(
    schedule: str, pp: int, micro: int, virtual: int
) -> tuple[tuple[int, ...], tuple[int, ...], float, tuple[tuple[int, int, int], ...]]:
    """What the planner reads off a schedule's action lists, from one build and one simulate (the runner's isend:
    "async"; unit times): each rank's most (chunk, micro-batch) activations in flight, each rank's ZeRO-3 root
    gathers (theory.pipelined_root_gathers), the ideal timeline's bubble fraction (for the V schedules what
    theory.bubble_fraction returns: the same simulate), and each rank's count of F, B and W actions
    (plan.search.step_time charges Cluster.overhead per action). The lists are not kept (P x M x V actions)."""
    actions = ALL_SCHEDULES[schedule](pp, micro, virtual)
    sim = simulate_schedule(actions, pp, virtual, micro, p2p="async", v_shape=schedule in V_SCHEDULES)
    gathers = tuple(pipelined_root_gathers([(x.kind, x.chunk) for x in ops], {pp * virtual - 1}) for ops in actions)
    counts = tuple(tuple(sum(x.kind == k for x in ops) for k in ("F", "B", "W")) for ops in actions)
    return tuple(sim.max_in_flight), gathers, sim.bubble_fraction, counts


def comm_bytes(s: Setup, pp_rank: int = 0, by_group=None) -> dict[str, int]:
    """`comm_by_group` summed by kind, as train.py logs comm_bytes (p2p only when there is some); with
    `by_group=comm_calls_by_group` the calls, as train.py logs comm_calls."""
    groups = (by_group or comm_by_group)(s, pp_rank)
    out = dict.fromkeys(KINDS, 0)
    for part in groups.values():
        for k, v in part.items():
            out[k] += v
    return {k: v for k, v in out.items() if v or k not in ("p2p", "all_to_all")}


# ----------------------------------------------------------------------------- saved activations


def block_saved_bytes(s: Setup, B: int, T: int, layer: int | None = None) -> int:
    """Bytes one Block's forward saves for backward on one rank, for B rows of T tokens (T: this rank's share
    under CP), fp32 or autocast, counted tensor by tensor (N = B*T tokens, C = n_embd, p = tp, r = residual
    bytes, a = compute bytes; each storage once):
    - ln_1, ln_2: their inputs (N*C*r; N*C*r/p under SP) and fp32 mean and rstd (2*N*4; /p under SP);
    - q, k, v's Linear input, ln_1's output (N*C*r; gathered whole under SP), likewise c_fc's, ln_2's output;
    - attention: q, k, v and its output (4*N*C*a/p; c_proj's input is a view of the output) and the fp32
      log-sum-exp (B*(H/p)*T*4): the fused kernel keeps no (T, T) scores; under Ulysses (--cp_algorithm) the
      output twice, by heads (the core's, which its backward keeps) and by tokens (the all-to-all's copy,
      c_proj's input): 5*N*C*a/p (the same elements otherwise: (B, H/p/C, T*C) is as big as (B, H/p, T));
    - the MLP: c_fc's output (GELU's input) and GELU's output (c_proj's input), 4*N*C*a/p each.
    In fp32 and without TP that is 16*N*C*4 + 16*N + 4*B*H*T bytes. Korthikanti et al.'s 34*s*b*h (+ 5*a*s^2*b)
    counts fp16 with dropout masks (5*s*b*h) and the materialised attention scores; we have neither.
    Block `layer` an MoE Block (config.is_moe): `moe_saved_bytes` in place of the MLP's (None: a dense Block)."""
    c, p, sp = s.config, s.dims.tp, s.args.sequence_parallel
    N, C, r, a = B * T, c.n_embd, s.residual_bytes, s.compute_bytes
    ln = 2 * ((N * C * r + 2 * N * 4) // (p if sp else 1))
    ln_out = 2 * N * C * r
    outputs = 2 if s.dims.cp > 1 and s.args.cp_algorithm == "ulysses" else 1
    attn = (3 + outputs) * N * C * a // p + B * (c.n_head // p) * T * 4
    mlp = moe_saved_bytes(s, B, T) if layer is not None and c.is_moe(layer) else 8 * N * C * a // p
    return ln + ln_out + attn + mlp


def moe_saved_bytes(s: Setup, B: int, T: int) -> int:
    """Bytes an MoE layer (moe.MoE) saves for backward on one rank beyond its input (ln_2's output, counted
    with the Block's), for B rows of T tokens, N = B*T (under TP every rank runs the layer whole, on the whole
    sequence), k experts a token, E experts, C = n_embd, H = the experts' hidden width, a = compute bytes,
    counted tensor by tensor (each storage once; integers int64) under balanced routing: the rows a rank's
    experts run, R, equal the N*k it routes (without EP always, whatever the routing: all N*k rows run here):
    - the router: softmax's fp32 scores (N*E*4), top-k's sort indices (gather's index: a view of N*E*8), the
      chosen scores and their sum (the renormalisation's, N*k*4 + N*4);
    - the dispatch: the rows' token index (N*k*8) and the combine's order (index_copy's index, N*k*8) and source
      (the experts' outputs, N*k*C*a);
    - the experts on their R rows: c_fc's input (R*C*a), each row's expert (the biases' index, R*8), GELU's input
      and output (2*R*H*a), and torch._grouped_mm's group ends (E/ep int32); under autocast the per-expert loop
      runs instead (moe.grouped_linear), which keeps no ends but, where the weights are not already in the
      compute dtype (fp32 parameters: DDP, or a sharding engine's fp32 compute copies), each expert's two weights
      cast to it (2*(E/ep)*C*H*a);
    - the combine: the outputs (N*k*C*a) and the gates they are weighted by (N*k*a);
    - under EP also the expert-major order of the received rows (R*8) and a second index_copy's source (R*C*a:
      the outputs before the all_to_all back); with the balancing loss its per-row counts and shares (B*(E+1)*4).
    In fp32 without EP that is N*(k*(12*C + 8*H + 32) + 12*E + 4) + 4E; a skewed router changes the expert terms
    by (R - N*k) * (2*C*a + 2*H*a + 8 (+ 8 under EP)) on a rank that receives R rows."""
    c, ep = s.config, s.dims.ep
    N, k, E, C, H, a = B * T, c.moe_top_k, c.moe_num_experts, c.n_embd, c.expert_hidden, s.compute_bytes
    R = N * k
    router = N * E * 4 + N * E * 8 + N * k * 4 + N * 4
    dispatch = 2 * N * k * 8 + N * k * C * a
    autocast = s.dtype != torch.float32  # train.py's: the loop, not the grouped kernel (moe.grouped_mm_runs)
    weights = s.param_bytes if s.dp_type in ZERO_STAGES else 4
    experts = (
        R * C * a
        + R * 8
        + 2 * R * H * a
        + ((2 * E // ep * C * H * a if weights != a else 0) if autocast else E // ep * 4)
    )
    combine = N * k * C * a + N * k * a
    ep_more = R * 8 + R * C * a if ep > 1 else 0
    aux = B * (E + 1) * 4 if c.moe_aux_loss_coeff else 0
    return router + dispatch + experts + combine + ep_more + aux


def ends_saved_bytes(s: Setup, B: int, T: int, first: bool, last: bool) -> int:
    """The embeddings (token ids and positions, int64) and the head: ln_f's input and stats, and the chunked
    loss's gradients, which it makes in forward and holds until backward (loss.HeadGradients: dx (B*T, C) and
    dW (V/p, C), fp32; it keeps no logits, and neither x, the targets nor the weight)."""
    C, r = s.config.n_embd, s.residual_bytes
    out = (B * T * 8 + T * 8) if first else 0
    if last:
        out += B * T * C * r + 2 * B * T * 4 + head_grad_bytes(s, B, T)
    return out


def head_grad_bytes(s: Setup, B: int, T: int) -> int:
    """The chunked loss's gradients, held from its forward to its backward (loss.HeadGradients): dx (B*T, C) and
    this rank's dW (V/p, C), fp32."""
    return (B * T + s.config.vocab_size // s.dims.tp) * s.config.n_embd * 4


def saved_activation_bytes(s: Setup, pp_rank: int = 0) -> int:
    """Peak bytes saved for backward on one rank over a step (what metrics' SavedBytes hooks measure):
    one micro-batch's, or under a pipeline the schedule's most in-flight (chunk, micro-batch) activations
    (plan.timeline.simulate_schedule) times a chunk's. AC keeps a checkpointed Block's input only, and
    re-runs one Block at a time in backward: `full` peaks there (all inputs + one Block's tensors, the head's
    freed by then), `selective` at the end of forward (its recomputations come after the Blocks above freed
    theirs). Zero-bubble schedules hold a (chunk, micro-batch) from F to W (the simulator releases at W): B frees
    the chunk's graph but keeps, per Block, each deferred linear's input and output gradient (x, dy) for W
    (parallel/pipeline/zero_bubble.py): x 7NC and dy 9NC elements in the compute dtype, 16NCa bytes; the Block saves
    16NCa + 4NC(r - a) + its LayerNorm statistics and log-sum-exp, so counting a micro-batch whole until its W is
    an upper bound: within 1% in fp32 (r = a), 4NC(r - a) per Block over under autocast. The loss's gradients
    (`head_grad_bytes`, dW alone V/p x C x 4) belong to the last chunk only: they count once per head micro-batch
    between its F and its B (`_head_in_flight`), not spread over the rank's chunks."""
    micro = micro_saved_bytes(s, pp_rank)
    if not s.dims.pp_enabled:
        return micro
    V = s.args.pp_virtual_stages or 1
    in_flight = _in_flight(s.args.pp_schedule, s.dims.pp, s.grad_accum, V)[pp_rank]
    heads = _head_in_flight(s.args.pp_schedule, s.dims.pp, s.grad_accum, V)[pp_rank]
    head = (
        head_grad_bytes(s, s.args.micro_batch_size, s.args.seq_len // s.dims.cp) if stage_blocks(s, pp_rank)[2] else 0
    )
    # V chunks per rank: a (chunk, micro-batch) pair holds 1/V of the rank's Blocks; the head's gradients count per
    # head micro-batch in flight (GPipe: M; 1F1B and the V's turn: its B follows its F, 1)
    return in_flight * (micro - head) // V + heads * head


def block_input_bytes(s: Setup) -> int:
    """X, a Block's input (all a checkpointed Block keeps): (B, T, C) in the residual dtype, 1/p of it under SP."""
    a = s.args
    return (
        a.micro_batch_size
        * a.seq_len
        // s.dims.cp
        * s.config.n_embd
        * s.residual_bytes
        // (s.dims.tp if a.sequence_parallel else 1)
    )


def micro_saved_bytes(s: Setup, pp_rank: int = 0) -> int:
    """One micro-batch's saved bytes over all of the rank's Blocks and ends (`saved_activation_bytes` without a
    pipeline; under one, a (chunk, micro-batch) pair holds 1/V of it)."""
    a = s.args
    B, T = a.micro_batch_size, a.seq_len // s.dims.cp
    blocks, first, last = stage_blocks(s, pp_rank)
    X = block_input_bytes(s)
    ends = ends_saved_bytes(s, B, T, first, last)
    held = sum(X if recomputed_blocks(s, [i]) else block_saved_bytes(s, B, T, i) for i in blocks)
    if a.activation_checkpointing == "full":  # the largest Block recomputed (an MoE one, if any)
        S = max((block_saved_bytes(s, B, T, i) for i in blocks), default=X)
        return held + max(ends, (S - X) + ends_saved_bytes(s, B, T, first, False))
    return held + ends


@functools.lru_cache(maxsize=1024)
def _head_in_flight(schedule: str, pp: int, micro: int, virtual: int) -> tuple[int, ...]:
    """Each rank's most micro-batches of the last chunk (the head) between their F and their B, from its action list:
    how many copies of the loss's gradients it holds at once (freed at B: a split schedule's W needs none)."""
    last, out = pp * virtual - 1, []
    for ops in ALL_SCHEDULES[schedule](pp, micro, virtual):
        held = most = 0
        for x in ops:
            if x.chunk == last and x.kind in ("F", "B"):
                held += 1 if x.kind == "F" else -1
                most = max(most, held)
        out.append(most)
    return tuple(out)


def _in_flight(schedule: str, pp: int, micro: int, virtual: int) -> list[int]:
    """Most (chunk, micro-batch) activations each rank holds under `schedule` (the runner's isend: "async")."""
    return list(schedule_facts(schedule, pp, micro, virtual)[0])


def step_flops(s: Setup) -> float:
    """Training FLOPs of one step on one rank: metrics.flops_per_token x the step's tokens / ranks (N the active
    parameters: of an MoE layer's E experts the K a token reaches), with a recomputed Block's forward (a third of
    its 6N) added under activation checkpointing."""
    n = active_params(s.config, non_embedding=True)
    per_token = flops_per_token(s.config, n, s.args.seq_len)
    redo = recomputed_blocks(s, list(range(s.config.n_layer))) / s.config.n_layer
    block_share = 12 * s.config.n_layer * s.config.n_embd**2 / max(n, 1)  # the Blocks' part of 6N's N
    per_token *= 1 + redo * block_share / 3
    return per_token * s.args.total_batch_size / s.dims.world_size
