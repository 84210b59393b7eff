"""One rank's peak memory, predicted: parameters + AdamW state + the largest phase of a step (`peak_parts`).

The phases are the end of forward (the saved activations, the loss's buffers, the gradients a forward runs
beside, autocast's weight copies), full AC's recomputation, a sharding engine's backward as its units complete
(`reduce_phase`: `reduce_transient`, and under a split schedule the flat gradients held for W,
`held_for_w_bytes`), and the optimizer step. Every term is a count of tensors the code keeps, each derived in its
docstring from the module that keeps it; the per-rank parameters, units, state and saved activations come from
plan.predict. An allocator's peak: what torch.cuda.max_memory_allocated and, on the CPU, memory.AllocatedPeak
(under fake tensors memory.LiveStorages) measure.
"""
from __future__ import annotations

import functools

import torch

from loss import loss_chunk_rows
from parallel.flat_param import ZERO_STAGES, shard_numel
from parallel.pipeline_schedule import SPLIT_SCHEDULES, V_SCHEDULES, chunk_of
from plan.counts import (Setup, _layers, block_input_bytes, block_saved_bytes, ends_saved_bytes, is_expert,
                         local_params, micro_saved_bytes, moe_saved_bytes, recomputed_blocks, saved_activation_bytes,
                         stage_blocks, stage_chunks, state_bytes, unit_shard, units)
from plan.theory import reduce_accumulated_held_bytes, reduce_held_bytes


def largest_transient(s: Setup, pp_rank: int = 0) -> int:
    """The buffers alive beside the end of forward's activations, when the loss runs (`loss_transient`), and
    under ZeRO-3 the units gathered then: the root (or the tied unit: the head's weight) and the next,
    prefetched for backward (the largest other unit). An allocator's view: fragmentation and the CUDA context
    are not in it."""
    out = 0
    if s.dp_type == "fsdp":
        padded = _padded(s, pp_rank)
        head = padded.pop("tied", 0) or padded.pop("root")
        blocks = [n + padded.get(f"{u}.experts", 0) for u, n in padded.items() if not u.endswith(".experts")]
        out = (head + max(blocks, default=0)) * s.param_bytes  # a Block gathered with its experts
    if stage_blocks(s, pp_rank)[2]:
        out += loss_transient(s)
    return out


def _padded(s: Setup, pp_rank: int = 0) -> dict[str, int]:
    """Each unit's flat buffer, padded to a multiple of its group's size (`unit_shard`)."""
    return {u: shard_numel(n, unit_shard(s, u)) * unit_shard(s, u) for u, (n, _) in units(s, pp_rank).items()}


def loss_transient(s: Setup) -> int:
    """The most bytes the chunked loss (loss._LinearCrossEntropy, loss.loss_chunk_rows rows a chunk for the run's
    device) holds at once in its forward, beside its gradients' buffers (saved: `ends_saved_bytes`), a = compute
    bytes, n = chunk rows, N = rows, V' = V/p (this rank's columns):
    - under autocast (a != 4) the compute-dtype casts of x and the weight, (N + V') x C x a;
    - whole vocabulary (one process, DP, CP): a chunk's logits, log-softmax and gradient, 3 x n x V x 4 in fp32 (the
      log_softmax kernels); under autocast then the gradient's cast, n x V x a, and one chunk's bf16 g^T x (V x C x a)
      beside the fp32 gradient, n x V x 4;
    - vocab-parallel (tensor_parallel.VocabShard, TP) with loss parallelism: the first pass's last chunk keeps its
      (n, V') logits beside their exponentials, 2 x n x V' x 4; the second pass's chunk (in fp32, turned into its
      gradient in place) with, under autocast, the gradient's cast and g^T x and g W's (n, C): n x V' x (4 + a) +
      (V' + n) x C x a;
    - without loss parallelism: lm_head's weight all-gathered, V x C x a, beside the whole vocabulary's chunk, of
      which the gradient's cast and g^T x are this rank's columns."""
    a, c = s.args, s.config
    N = a.micro_batch_size * a.seq_len // s.dims.cp
    n, C, V = min(loss_chunk_rows(c.vocab_size, a.device.split(":")[0]), N), c.n_embd, c.vocab_size
    cb, Vp = s.compute_bytes, c.vocab_size // s.dims.tp
    mixed = cb != 4
    casts = (N + Vp) * C * cb if mixed else 0
    if not s.dims.tp_enabled:
        return casts + max(3 * n * V * 4, n * V * (4 + cb) + V * C * cb if mixed else 0)
    if a.enable_loss_parallelism:
        return casts + max(2 * n * Vp * 4, n * Vp * (4 + cb) + (Vp + n) * C * cb if mixed else 0)
    return casts + V * C * cb + max(3 * n * V * 4, n * V * 4 + n * Vp * cb + (Vp + n) * C * cb if mixed else 0)


def held_grad_bytes(s: Setup, pp_rank: int = 0) -> int:
    """The gradient bytes alive while a forward runs: DDP's buckets and ZeRO-1's full-gradient buffers (both kept
    across steps), and every gradient when a step runs more than one backward (M micro-steps, or a pipeline's
    micro-batches: the first backward allocates them beside the next forward's activations). Otherwise none:
    train.py's zero_grad(set_to_none) frees them after the optimizer step, and backward allocates them as it
    frees the activations."""
    grads = state_bytes(s, pp_rank)["grads"]
    if s.dp_type == "ddp" or s.grad_accum > 1 or (s.dp_type in ZERO_STAGES and ZERO_STAGES[s.dp_type] == 1):
        return grads
    return 0


# ----------------------------------------------------------------------------- the sharding engine's backward

EMBEDDINGS = ("transformer.wte.weight", "transformer.wpe.weight")
HEAD = ("lm_head.weight", "transformer.ln_f.weight", "transformer.ln_f.bias")  # lm_head: wte where tied to it


def reduce_transient(s: Setup, pp_rank: int = 0) -> int:
    """The most bytes a sharding engine's chunk backward holds for its gradients beyond the parameters and
    optimizer state, the other micro-batches' activations and ZeRO-3's gathered roots: over each of the rank's
    chunks and the units its backward completes, in order, `theory.reduce_held_bytes` at the unit's flat gradient
    (its parameter gradients and their concatenation; ZeRO-2/3 the previous unit's reduce-scatter in flight and
    the one before's output), plus the shard gradients (every one once a step runs more than one backward, and
    ZeRO-1's full buffers always; in a step's only backward those of the units reduced before), plus ZeRO-3's
    gathered Block and the one `_pre_backward` prefetched below it, plus this micro-batch's activations still
    saved then (the Blocks below; the head's units see all of them). The order, per chunk:
    the head's units (a last stage's tied lm_head copy, then the root's ln_f), the Blocks top down, and the
    embeddings' units: both embedding_dense_backward gradients (whole tables) exist before either unit is
    concatenated, the tied unit (wte) first (`_run` shows it after the root: autograd runs the later node of
    two ready ones first), then the root (wpe). One chunk with both ends (no pipeline) completes its root last,
    so lm_head's and ln_f's gradients wait through the Blocks; a V's rank 0 holds the ends in two chunks, and under
    ZeRO-2/3 keeps the root's full gradient (reduce dtype) from the head's chunk backward, where it completes first,
    through the embeddings' chunk backward, which reduces the sum (`PipelineRunner._hold_roots`).
    0 without a sharding engine."""
    if s.dp_type not in ZERO_STAGES:
        return 0
    a, d, stage = s.args, s.dims, ZERO_STAGES[s.dp_type]
    shard, pb, rb, copies = d.dp_shard * d.cp, s.param_bytes, s.reduce_bytes, s.copies_reduce_input
    sizes = units(s, pp_rank)
    padded = _padded(s, pp_rank)
    params = {n: k for n, k, _ in local_params(s, pp_rank)}
    numel = lambda names: sum(params.get(n, 0) for n in names)  # noqa: E731
    lm_head = "lm_head.weight" if "lm_head.weight" in params else "transformer.wte.weight"
    head = numel((lm_head, *HEAD[1:]))
    B, T = a.micro_batch_size, a.seq_len // d.cp
    X = block_input_bytes(s)
    tied = "tied" in padded
    V, v_shape = a.pp_virtual_stages or 1, a.pp_schedule in V_SCHEDULES
    if d.pp_enabled:
        layers = _layers(s.config, d.pp, V, a.seq_len, s.pp_layers, v_shape)
        chunks = [chunk_of(pp_rank, v, d.pp, v_shape) for v in range(V)]
    else:
        layers, chunks = (range(s.config.n_layer),), [0]
    every, every_held = state_bytes(s, pp_rank)["grads"], stage == 1 or s.grad_accum > 1
    # a V's rank 0 (both ends, two chunks) under ZeRO-2/3: the head's root gradient, held for chunk 0's backward
    kept = padded["root"] * rb if stage > 1 and len(chunks) > 1 and 0 in chunks and len(layers) - 1 in chunks else 0
    most = 0
    for c in chunks:
        blocks, first, last = list(layers[c]), c == 0, c == len(layers) - 1
        ends = ends_saved_bytes(s, B, T, first, False)
        below = [ends + sum(X if recomputed_blocks(s, [i]) else block_saved_bytes(s, B, T, i) for i in blocks[:k])
                 for k in range(len(blocks) + 1)]
        # (gradient elements, padded, gathered elements, activation bytes, the unit's group size)
        order: list[tuple[int, int, int, int, int]] = []
        if last and not first:
            all_saved = below[-1] + ends_saved_bytes(s, B, T, False, True)
            order += [(params[lm_head], padded["tied"], 0, all_saved, shard),
                      (head - params[lm_head], padded["root"], 0, 0, shard)] if tied else [(head, padded["root"], 0, 0,
                                                                                         shard)]
        waiting = head if first and last else 0  # lm_head's and ln_f's gradients, until the root's concatenation
        with_experts = lambda u: padded[u] + padded.get(f"{u}.experts", 0)  # noqa: E731 (gathered together)
        for k in reversed(range(len(blocks))):
            u, lower = f"transformer.h.{blocks[k]}", f"transformer.h.{blocks[k - 1]}" if k else None
            gathered = with_experts(u) + (with_experts(lower) if lower else 0) if stage == 3 else 0
            if f"{u}.experts" in padded:  # its experts' unit completes first, in the MoE's backward, the Block's
                # attention and LayerNorms still saved
                e = f"{u}.experts"
                rest = block_saved_bytes(s, B, T, blocks[k]) - moe_saved_bytes(s, B, T)
                order.append((sizes[e][0], padded[e], gathered, below[k] + rest, unit_shard(s, e)))
            order.append((sizes[u][0] + waiting, padded[u], gathered, below[k], shard))
        if first:
            wpe = numel(EMBEDDINGS[1:])
            order += [(numel(EMBEDDINGS), padded["tied"], 0, 0, shard), (wpe, padded["root"], 0, 0, shard)] \
                if tied and not last else [(numel(EMBEDDINGS) + waiting - (params[lm_head] if last else 0),
                                            padded["root"], 0, 0, shard)]
        for i, (grads, n, gathered, saved, group) in enumerate(order):
            prev, before = (order[i - 1][1] if i >= 1 else 0), (order[i - 2][1] if i >= 2 else 0)
            held = reduce_held_bytes(stage, grads, n, prev, before, group, pb, rb, copies)
            most = max(most, held + gathered * pb + saved + (kept if first or i > 0 else 0) + (
                every if every_held else 4 * sum(u[1] // u[4] for u in order[:max(i - 2, 0)])))
    return most


def reduce_phase(s: Setup, pp_rank: int = 0) -> int:
    """peak_parts' "reduce" (a sharding engine; 0 otherwise): the larger of a backward's moment, the other
    (chunk, micro-batch) pairs the schedule holds (saved_activation_bytes less one pair) + ZeRO-3's roots
    gathered (a forward ran since the last backward: a pipeline's steady state; without one the root is kept
    from forward to backward) + `reduce_transient`, and ZeRO-1's end-of-step reduction, its full buffers +
    `theory.reduce_accumulated_held_bytes` (no activations left then). Each term of the moment is what some
    backward holds; together an upper bound where they do not coincide (GPipe's first backward holds the most
    pairs, but its reduced outputs are the shard gradients, not beside them: +8% measured)."""
    if s.dp_type not in ZERO_STAGES:
        return 0
    padded = _padded(s, pp_rank)
    others = saved_activation_bytes(s, pp_rank) - micro_saved_bytes(s, pp_rank) // (s.args.pp_virtual_stages or 1) \
        if s.dims.pp_enabled else 0
    roots = (padded["root"] + padded.get("tied", 0)) * s.param_bytes if s.dp_type == "fsdp" else 0
    end_of_step = sum(reduce_accumulated_held_bytes([n for u, n in padded.items() if u.endswith(".experts") == e],
                                                    unit_shard(s, "x.experts" if e else "root"), s.reduce_bytes,
                                                    s.copies_reduce_input) for e in (False, True)) \
        if s.dp_type == "zero1" else 0
    moment = max(others, 0) + roots + reduce_transient(s, pp_rank) + held_for_w_bytes(s, pp_rank)
    return max(moment, state_bytes(s, pp_rank)["grads"] + end_of_step)


def held_for_w_bytes(s: Setup, pp_rank: int = 0) -> int:
    """Under a split schedule (ZB-H1, ZB-V, DualPipe-V) and a sharding engine: the flat gradients of the Blocks
    whose B ran and whose W has not (zero_bubble.hold_for_w keeps each unit's flat gradient from B until W adds
    the deferred weight gradients into it), beside the B that makes the next one: the most such (chunk,
    micro-batch) pairs at a B of this rank (`_held_for_w`) x its largest chunk's Blocks' padded flat buffers
    (a V's middle rank in the cool-down: B, B, B, then the three W's, two held), and the running B's own chunk's
    Blocks but the one `reduce_transient` counts (kept for its W too), in the compute copies' dtype."""
    if s.dp_type not in ZERO_STAGES or not s.dims.pp_enabled or s.args.pp_schedule not in SPLIT_SCHEDULES:
        return 0
    held = _held_for_w(s.args.pp_schedule, s.dims.pp, s.grad_accum, s.args.pp_virtual_stages or 1)[pp_rank]
    padded = _padded(s, pp_rank)
    blocks = [[padded.get(f"transformer.h.{i}", 0) for i in layers] for _, layers in stage_chunks(s, pp_rank)]
    largest = max(sum(b) for b in blocks)
    # and the B's own chunk: its Blocks' flat gradients made before the one reduce_transient counts
    return (held * largest + max(sum(b) - max(b, default=0) for b in blocks)) * s.param_bytes


@functools.lru_cache(maxsize=1024)
def _held_for_w(schedule: str, pp: int, micro: int, virtual: int) -> tuple[int, ...]:
    """Each rank of a split schedule: its most (chunk, micro-batch) pairs between their B and their W when it runs
    a B."""
    out = []
    for ops in SPLIT_SCHEDULES[schedule](pp, micro, virtual):
        held, most = set(), 0
        for x in ops:
            if x.kind == "B":
                most = max(most, len(held))
                held.add((x.chunk, x.micro))
            elif x.kind == "W":
                held.discard((x.chunk, x.micro))
        out.append(most)
    return tuple(out)


def peak_parts(s: Setup, pp_rank: int = 0) -> dict[str, int]:
    """The peak's phases, each over parameters + optimizer state (alive all step):
    - "forward": the gradients a forward runs beside (held_grad_bytes) + the saved activations at the end of
      forward + the weights' compute-dtype copies under autocast (weight_cast_bytes) + the largest transient
      (the loss's backward starts on them; under full AC without a pipeline the saved bytes there are the
      checkpointed inputs and the head's, not a recomputed Block's);
    - "recompute" (full AC only): every gradient + the inputs + one recomputed Block (saved_activation_bytes);
    - "reduce" (a sharding engine): the shard gradients and a backward's gradient copies as its units complete
      (`reduce_phase`): under a pipeline the peak of a ZeRO-2/3 stage 0, at the embeddings' gradients, beside
      the other micro-batches;
    - "optimizer": every gradient (AdamW's temporaries: on CPU it runs per tensor, at most a few of the largest
      parameter's size; on GPU foreach kernels allocate lists of them: not modelled)."""
    state = state_bytes(s, pp_rank)
    base, grads = state["params"] + state["optimizer"], state["grads"]
    saved = saved_activation_bytes(s, pp_rank)
    out = {"forward": saved, "recompute": 0, "reduce": reduce_phase(s, pp_rank), "optimizer": grads}
    if s.args.activation_checkpointing == "full" and not s.dims.pp_enabled:
        a = s.args
        B, T = a.micro_batch_size, a.seq_len // s.dims.cp
        blocks, first, last = stage_blocks(s, pp_rank)
        out["forward"] = len(blocks) * block_input_bytes(s) + ends_saved_bytes(s, B, T, first, last)
        out["recompute"] = grads + saved
    out["forward"] += held_grad_bytes(s, pp_rank) + largest_transient(s, pp_rank) + weight_cast_bytes(s, pp_rank)
    return {"base": base, **out}


def weight_cast_bytes(s: Setup, pp_rank: int = 0) -> int:
    """Under autocast with fp32 weights (no data parallelism, DDP, or a sharding engine without bf16 compute
    copies): the compute-dtype copy of every Block linear's weight and bias this rank holds. Autocast's cast cache
    (and the split backward's zero_bubble.cast_once) makes one per weight per step, alive from the weight's first
    forward to the last backward that saved it: at the end of forward, all of them (gpt2-xl's pp=2 stage 0:
    1.5 GB). The experts' casts are counted in moe_saved_bytes; the head's is the loss's transient."""
    weights = s.param_bytes if s.dp_type in ZERO_STAGES else 4
    if s.dtype == torch.float32 or weights == s.compute_bytes:
        return 0
    return s.compute_bytes * sum(n for name, n, _ in local_params(s, pp_rank)
                                 if (".attn.c_" in name or ".mlp.c_" in name) and not is_expert(name))


def peak_memory_bytes(s: Setup, pp_rank: int = 0) -> int:
    """Parameters + optimizer state + the largest of peak_parts' phases (an allocator's peak, not a process's
    resident set): what torch.cuda.max_memory_allocated and, on the CPU, memory.AllocatedPeak measure."""
    parts = peak_parts(s, pp_rank)
    return parts.pop("base") + max(parts.values())
