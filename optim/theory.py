"""Muon's formulas and its terms of the planner's prediction (`TERMS`): which elements of each Muon matrix every rank
of a pipeline stage holds (`stage_matrices`: the `Hold`s that optim/build.py reads off a live layout, here from the
layout's rules alone), the LPT owners, the exchange's bytes and calls per rank, Muon's optimizer state and each
rank's Newton-Schulz FLOPs. None of it runs in a training step (optim/build.py and distributed_muon.py never import
it); tests/test_muon_theory.py holds it equal to measured runs, exactly, and sim.verify at scale.

The holds (optim/distributed_muon.py's docstring has the table): DDP and CP whole; TP the row slice (colwise q, k,
v, c_fc) or column slice (rowwise c_proj) of rank t; our flat engine the elements of its shard of each Block's unit
(the unit's >= 2-D weights first, in registration order; shards over dp_shard x cp, an expert unit over edp); EP
experts [e E/ep, (e + 1) E/ep) on the ranks of EP rank e (loss rank % ep); a pipeline stage its own Blocks.

`s` is the planner's view of one rank (plan/counts.Setup; runtime/registry.Terms lists what it answers).
"""

from __future__ import annotations

import functools

from model.gpt import decays
from optim.muon import is_muon
from parallel.data_parallel.flat_param import ZERO_STAGES, shard_numel
from parallel.expert_parallel.theory import is_expert
from parallel.tensor_parallel.apply import SHARD_DIMS, plan_style
from parallel.tensor_parallel.theory import tp_local_shape
from runtime.registry import Group, Terms

Hold = tuple[int, int, int, int, int]  # optim/distributed_muon.Hold's fields: tp_dim, tp_rank, tp_size, lo, hi

# ----------------------------------------------------------------------------- the formulas


def muon_ns_flops(shape: tuple[int, int], ns_steps: int) -> int:
    """Newton-Schulz's matmul FLOPs on one (R, C) matrix, m = min(R, C), n = max: per step the Gram X X^T (m x n
    times n x m: 2 m^2 n), its square A A (2 m^3) and (b A + c A^2) X (2 m^2 n); k steps."""
    m, n = sorted(shape)
    return ns_steps * (4 * m * m * n + 2 * m**3)


def muon_owners(flops: list[int], held: list[list[int]], keys: list[str]) -> list[int]:
    """Each matrix's owner rank, LPT (longest processing time first): matrices in decreasing NS FLOPs (ties by key),
    each to the rank with the least FLOPs so far; ties to the rank holding most of it (least to gather), then the
    lowest. `held[m][r]`: elements rank r holds of matrix m. Graham's bound for this greedy: no rank ends above
    `muon_lpt_bound`."""
    world = len(held[0]) if held else 1
    load, out = [0] * world, [0] * len(flops)
    for m in sorted(range(len(flops)), key=lambda m: (-flops[m], keys[m])):
        out[m] = min(range(world), key=lambda r: (load[r], -held[m][r], r))
        load[out[m]] += flops[m]
    return out


def muon_lpt_bound(flops: list[int], world: int) -> float:
    """The most NS FLOPs LPT can give one rank of `world`: when the last matrix f went to the busiest rank it was
    the least loaded, so its load before was <= (F - f) / world, and the busiest ends at <= F / world +
    (1 - 1/world) f <= F / world + (1 - 1/world) max f (F the total). Graham 1969 (list scheduling)."""
    if not flops:
        return 0.0
    return sum(flops) / world + (1 - 1 / world) * max(flops)


def muon_exchange_bytes_per_step(
    holds: list[list[tuple[int, int] | None]], owners: list[int], rank: int
) -> dict[str, int]:
    """What `Exchange` sends from rank `rank` of a pipeline stage's group per optimizer step (its all_to_all inputs,
    as parallel/comm.COUNTER records them), in bf16 (2 bytes an element). `holds[m][s]`: rank s's piece of matrix
    m, (piece, elements) (ranks with equal `piece` hold the same elements: replicas) or None; `owners[m]`: its owner.
    - gather: the owner assembles m from one holder of each piece, itself for its own piece, else the lowest rank
      holding it; r sends h_r(m) for each m it does not own and is that holder of;
    - return: the owner sends its result's h_s(m) to every other rank s holding a piece: sum_s h_s(m) - h_o(m).
    Per layout (G ranks in the stage, n_m a matrix's elements, O_r those of the matrices r owns):
    - DDP, CP (every rank whole): gather 0, return 2 (G - 1) O_r;
    - TP over t (rows or columns, qkv as three matrices): gather 2 (N - O_r) / t, return 2 (t - 1) O_r / t, N all;
      with D data-parallel replicas the return grows to 2 (tD - 1) O_r / t, and only the lowest replica gathers;
    - ZeRO-1/2/3 over S (flat shards [r S_u, (r + 1) S_u) of each unit's padded buffer, S_u = ceil(numel_u / S)):
      h_r(m) = |[off_m, off_m + n_m) ∩ [r S_u, (r + 1) S_u)|, gather 2 sum_{m not r's} h_r(m), return
      2 sum_{m r's} (n_m - h_r(m));
    - EP: each expert whole on the G/ep ranks of its EP rank; the owner takes it from the lowest of them unless
      it is one, and returns it to each of them but itself;
    - PP: each stage on its own, over its own ranks and matrices."""
    return muon_exchange_bytes_by_rank(holds, owners)[rank]


def muon_exchange_bytes_by_rank(holds: list[list[tuple[int, int] | None]], owners: list[int]) -> list[dict[str, int]]:
    """`muon_exchange_bytes_per_step` of every rank of the group at once, in one pass over the holds (matrices x
    ranks: a 1,024-rank stage asks it whole in sim.verify)."""
    world = len(holds[0]) if holds else 1
    gather, back = [0] * world, [0] * world
    for row, o in zip(holds, owners):
        back[o] += sum(h[1] for s, h in enumerate(row) if h is not None and s != o)
        first: dict = {}
        for s, h in enumerate(row):
            if h is not None and h[1]:
                first.setdefault(h[0], s)
        for piece, s in first.items():
            if s != o and (row[o] is None or row[o][0] != piece):
                gather[s] += row[s][1]
    return [{"gather": 2 * g, "return": 2 * b} for g, b in zip(gather, back)]


def muon_exchange_calls_per_step(holds: list[list[tuple[int, int] | None]], owners: list[int]) -> int:
    """`Exchange`'s all_to_alls per step on every rank of the group (alike on all): the gather unless every owner
    holds its matrices whole, the return unless no rank but the owner holds a piece; none on one rank."""
    if len(holds[0] if holds else ()) <= 1:
        return 0
    whole = all(
        row[o] is not None and row[o][1] == sum(h[1] for h in {h[0]: h for h in row if h}.values())
        for row, o in zip(holds, owners)
    )
    alone = all(all(h is None or s == o for s, h in enumerate(row)) for row, o in zip(holds, owners))
    return (not whole) + (not alone)


def muon_optimizer_state_bytes(muon_elements: int, adamw_elements: int, adamw_tensors: int) -> int:
    """One rank's optimizer state under --optimizer muon: Muon keeps one fp32 momentum per element it steps (no
    step counter), AdamW its two fp32 moments per element and one fp32 step tensor per tensor it steps (on our
    flat engine a tensor is a view of a shard's piece: one per held non-Muon weight slice, and the no-decay piece
    whole). AdamW alone is 8 Ψ + 4 (tensors): Muon saves 4 bytes per element of its matrices."""
    return 4 * muon_elements + 8 * adamw_elements + 4 * adamw_tensors


# ----------------------------------------------------------------------------- over a layout


def muon_on(s) -> bool:
    return getattr(s.args, "optimizer", "adamw") == "muon"


def ns_steps(s) -> int:
    return s.args.muon_ns_steps or 5  # optim/flags.muon_settings' default (torch's)


def stage_ranks(s) -> int:
    """G, the ranks of one pipeline stage (the exchange's group)."""
    return s.dims.world_size // s.dims.pp


def coords(d, g: int) -> dict[str, int]:
    """Group rank g's place (parallel/mesh.py: tp fastest, then cp, dp_shard, dp_replicate) on dims `d`: `loss`
    the dp x cp index, EP rank `ep` = loss % ep, `edp` = loss // ep (mesh.expert_dims)."""
    tp, cp, dp = g % d.tp, g // d.tp % d.cp, g // (d.tp * d.cp) % d.dp
    loss = dp * d.cp + cp
    return {"tp": tp, "cp": cp, "shard": dp % d.dp_shard, "loss": loss, "ep": loss % d.ep, "edp": loss // d.ep}


def stage_matrices(s, pp_rank: int = 0) -> list[tuple[str, tuple[int, int], tuple[Hold | None, ...]]]:
    """Every Muon matrix of stage `pp_rank`, sorted by key as optim/build.matrices_of lists them: (key, whole
    shape, what each of the G group ranks holds, None for nothing)."""
    return _stage_matrices(s.meta_gpt(), s.dims, s.dp_type in ZERO_STAGES, tuple(s.stage_blocks(pp_rank)[0]))


@functools.lru_cache(maxsize=64)
def _stage_matrices(gpt, d, flat: bool, blocks: tuple[int, ...]):
    G, tp, cp, ep = d.world_size // d.pp, d.tp, d.cp, d.ep
    cs = [coords(d, g) for g in range(G)]
    out: dict[str, tuple[tuple[int, int], list]] = {}
    for i in blocks:
        named = [(f"transformer.h.{i}.{n}", p) for n, p in gpt.transformer.h[i].named_parameters()]
        for expert_unit in (False, True):  # the Block's unit, and under EP its experts' own
            local = [
                (n, p, _local_shape(n, tuple(p.shape), tp, ep))
                for n, p in named
                if (ep > 1 and is_expert(n)) == expert_unit
            ]
            offsets, at = {}, 0
            for n, _, shape in sorted(local, key=lambda x: not decays(x[0], x[1])):  # flatten_unit's order
                offsets[n], at = at, at + _numel(shape)
            S = shard_numel(at, d.dp * cp // ep if expert_unit else d.dp_shard * cp)
            for n, p, shape in local:
                if not is_muon(n):
                    continue
                dim = SHARD_DIMS.get(plan_style(n.rpartition(".")[0]) or "", {}).get("weight") if tp > 1 else None
                for g, c in enumerate(cs):
                    r = c["edp"] if expert_unit else c["shard"] * cp + c["cp"]
                    lo, hi = (r * S - offsets[n], (r + 1) * S - offsets[n]) if flat else (0, _numel(shape))
                    if p.dim() == 2:
                        a, b = max(lo, 0), min(hi, _numel(shape))
                        hold = (dim, c["tp"], tp, a, b) if dim is not None else (-1, 0, 1, a, b)
                        out.setdefault(n, (tuple(p.shape), [None] * G))[1][g] = hold if b > a else None
                        continue
                    E, m = shape[0], shape[1] * shape[2]  # this rank's E/ep experts, (in, out) each
                    for e in range(p.shape[0]):
                        row = out.setdefault(f"{n}[{e}]", (tuple(p.shape[1:]), [None] * G))[1]
                        a, b = max(lo, e % E * m), min(hi, (e % E + 1) * m)
                        if e // E == c["ep"] and b > a:
                            row[g] = (-1, 0, 1, a - e % E * m, b - e % E * m)
    return [(k, out[k][0], tuple(out[k][1])) for k in sorted(out)]


def _local_shape(name: str, shape: tuple[int, ...], tp: int, ep: int) -> tuple[int, ...]:
    shape = tp_local_shape(name, shape, tp)
    return (shape[0] // ep, *shape[1:]) if is_expert(name) else shape


def _numel(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def pieces(matrices) -> tuple[list[list[tuple | None]], list[str], list[list[int]]]:
    """theory's view of `stage_matrices`: each rank's (piece, elements) (a piece: the hold's tp slice and range;
    ranks holding equal ones are replicas), the keys, NS FLOPs and elements held (for the owners' ties)."""
    holds = [[None if h is None else ((h[1], h[3], h[4]), h[4] - h[3]) for h in row] for _, _, row in matrices]
    held = [[0 if h is None else h[1] for h in row] for row in holds]
    return holds, [k for k, _, _ in matrices], held


def exchange(s, pp_rank: int = 0) -> tuple[list, list[int], list[int]]:
    """(theory holds, LPT owners, NS FLOPs per matrix) of stage `pp_rank`."""
    return _exchange(s.meta_gpt(), s.dims, s.dp_type in ZERO_STAGES, tuple(s.stage_blocks(pp_rank)[0]), ns_steps(s))[:3]


def sent_by_rank(s, pp_rank: int = 0) -> list[dict[str, int]]:
    """`muon_exchange_bytes_by_rank` of stage `pp_rank`: each group rank's gather and return bytes."""
    return _exchange(s.meta_gpt(), s.dims, s.dp_type in ZERO_STAGES, tuple(s.stage_blocks(pp_rank)[0]), ns_steps(s))[3]


@functools.lru_cache(maxsize=64)
def _exchange(gpt, d, flat: bool, blocks: tuple[int, ...], steps: int):
    ms = _stage_matrices(gpt, d, flat, blocks)
    holds, keys, held = pieces(ms)
    flops = [muon_ns_flops(shape, steps) for _, shape, _ in ms]
    owners = muon_owners(flops, held, keys)
    return holds, owners, flops, muon_exchange_bytes_by_rank(holds, owners)


def exchange_bytes(s, pp_rank: int = 0, g: int = 0) -> dict[str, int]:
    """{"all_to_all": bytes} group rank g of stage `pp_rank` sends per step (`muon_exchange_bytes_per_step`)."""
    if not muon_on(s) or stage_ranks(s) == 1:
        return {}
    return {"all_to_all": sum(sent_by_rank(s, pp_rank)[g].values())}


def exchange_calls(s, pp_rank: int = 0) -> dict[str, int]:
    if not muon_on(s) or stage_ranks(s) == 1:
        return {}
    holds, owners, _ = exchange(s, pp_rank)
    return {"all_to_all": muon_exchange_calls_per_step(holds, owners)}


def ns_flops_by_rank(s, pp_rank: int = 0) -> list[int]:
    """Each group rank's Newton-Schulz FLOPs per step (the matrices LPT gives it; all of them on one rank)."""
    if stage_ranks(s) == 1:
        return [sum(muon_ns_flops(shape, ns_steps(s)) for _, shape, _ in stage_matrices(s, pp_rank))]
    _, owners, flops = exchange(s, pp_rank)
    out = [0] * stage_ranks(s)
    for o, f in zip(owners, flops):
        out[o] += f
    return out


def optimizer_state_bytes(s, pp_rank: int = 0, shard_rank: int = 0, expert_shard_rank: int = 0) -> int:
    """`muon_optimizer_state_bytes` of a rank of stage `pp_rank`: without a sharding engine its whole
    tensors (Muon's momentum per Muon parameter, AdamW's moments and step per other); on our flat engine per unit
    the elements of its shard (`shard_rank` of dp_shard x cp, an expert unit's `expert_shard_rank` of edp): the
    Muon ones, each non-Muon decay slice (an AdamW view: its moments and step) and the no-decay piece."""
    if s.dp_type not in ZERO_STAGES:
        params = s.local_params(pp_rank)
        muon = sum(k for n, k, _ in params if is_muon(n))
        rest = [k for n, k, _ in params if not is_muon(n)]
        return muon_optimizer_state_bytes(muon, sum(rest), len(rest))
    muon = adamw = tensors = 0
    for unit, (numel, n_decay) in s.units(pp_rank).items():
        S = shard_numel(numel, s.unit_shard(unit))
        r = expert_shard_rank if unit.endswith(".experts") else shard_rank
        lo, hi = r * S, min(numel, (r + 1) * S)
        spans = list(_spans(s, pp_rank, unit))
        held_muon = sum(max(0, min(b, hi) - max(a, lo)) for n, a, b, _ in spans if is_muon(n))
        held_rest = max(0, hi - max(n_decay, lo))
        muon += held_muon
        adamw += max(0, min(n_decay, hi) - lo) - held_muon + held_rest
        views = sum(min(b, hi) > max(a, lo) for n, a, b, decay in spans if decay and not is_muon(n))
        tensors += views + (held_rest > 0)
    return muon_optimizer_state_bytes(muon, adamw, tensors)


def group_rank(d, coords: tuple[int, ...]) -> int:
    """The rank in its stage's group of the rank at mesh `coords` (pp, dp_replicate, dp_shard, cp, tp)."""
    _, rep, shard, cp, tp = coords
    return ((rep * d.dp_shard + shard) * d.cp + cp) * d.tp + tp


def _spans(s, pp_rank: int, unit: str):
    at = 0
    for name, n, decay in s.unit_members(pp_rank).get(unit, []):
        yield name, at, at + n, decay
        at += n


def for_rank(s, coords_: tuple[int, ...], out: dict) -> None:
    """plan.predict's `out` (group rank 0's exchange, shard rank's state) made the rank at mesh `coords_`'s: its
    own exchange bytes and, on our flat engine, the state of its expert shard too."""
    pp, g = coords_[0], group_rank(s.dims, coords_)
    if "comm_bytes" in out and stage_ranks(s) > 1:
        mine, zero = exchange_bytes(s, pp, g)["all_to_all"], exchange_bytes(s, pp, 0)["all_to_all"]
        out["comm_bytes"]["all_to_all"] += mine - zero
    c = coords(s.dims, g)
    out["state_bytes_by_kind"]["optimizer"] = optimizer_state_bytes(s, pp, c["shard"] * s.dims.cp + c["cp"], c["edp"])
    out["state_bytes"] = sum(out["state_bytes_by_kind"].values())


# ----------------------------------------------------------------------------- the planner's terms


def state(s, pp_rank: int, shard_rank: int, expert_shard_rank: int, out: dict) -> None:
    """Under --optimizer muon the optimizer state is `optimizer_state_bytes`' (params and grads as the layout's)."""
    if muon_on(s):
        out["optimizer"] = optimizer_state_bytes(s, pp_rank, shard_rank, expert_shard_rank)


def comm(s, pp_rank: int, out: dict) -> None:
    """Group "muon" (the stage's ranks): group rank 0's exchange."""
    if muon_on(s):
        out["muon"] = exchange_bytes(s, pp_rank)


def calls(s, pp_rank: int, out: dict) -> None:
    if muon_on(s):
        out["muon"] = exchange_calls(s, pp_rank)


def groups(s) -> dict[str, Group]:
    """The exchange spans the stage: its batch ranks and its tp ranks."""
    return {"muon": Group(s.dims.world_size // s.dims.pp, ("dp_replicate", "dp_shard", "cp", "tp"))}


def flops(s) -> int:
    """Newton-Schulz after the step's backward, on the busiest owner of the busiest stage: added, never hidden."""
    if not muon_on(s):
        return 0
    return max(max(ns_flops_by_rank(s, r)) for r in range(s.dims.pp))


def rank_prediction(s, coords_: tuple[int, ...], out: dict) -> None:
    """`for_rank` under --optimizer muon: its exchange sends what this rank's owners say."""
    if muon_on(s):
        for_rank(s, coords_, out)


TERMS = Terms(comm=comm, calls=calls, state=state, groups=groups, flops=flops, for_rank=rank_prediction)
