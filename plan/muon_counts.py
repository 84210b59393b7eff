"""What --optimizer muon adds to one rank of a layout, counted (plan/theory.py's Muon formulas over the layout):
which elements of each Muon matrix every rank of a pipeline stage holds (`stage_matrices`: the `Hold`s that
optim/build.py reads off a live layout, here from the layout's rules alone), the LPT owners, the exchange's bytes
and calls per rank, Muon's optimizer state and each rank's Newton-Schulz FLOPs.

The holds (optim/distributed_muon.py's docstring has the table): DDP and CP whole; TP the row slice (colwise q, k,
v, c_fc) or column slice (rowwise c_proj) of rank t; our flat engine the elements of its shard of each Block's unit
(the unit's >= 2-D weights first, in registration order; shards over dp_shard x cp, an expert unit over edp); EP
experts [e E/ep, (e + 1) E/ep) on the ranks of EP rank e (loss rank % ep); a pipeline stage its own Blocks.
"""

from __future__ import annotations

import functools

from model.gpt import decays
from optim.muon import is_muon
from parallel.data_parallel.flat_param import ZERO_STAGES, shard_numel
from parallel.pipeline.schedule import V_SCHEDULES
from parallel.tensor_parallel.apply import SHARD_DIMS, plan_style
from plan import counts, theory
from plan.counts import Setup, _meta_gpt, is_expert, local_params, stage_blocks, tp_local_shape

Hold = tuple[int, int, int, int, int]  # optim/distributed_muon.Hold's fields: tp_dim, tp_rank, tp_size, lo, hi


def muon_on(s: Setup) -> bool:
    return getattr(s.args, "optimizer", "adamw") == "muon"


def ns_steps(s: Setup) -> int:
    return s.args.muon_ns_steps or 5  # optim/flags.muon_settings' default (torch's)


def stage_ranks(s: Setup) -> int:
    """G, the ranks of one pipeline stage (the exchange's group)."""
    return s.dims.world_size // s.dims.pp


def coords(d, g: int) -> dict[str, int]:
    """Group rank g's place (parallel/mesh.py: tp fastest, then cp, dp_shard, dp_replicate) on dims `d`: `loss`
    the dp x cp index, EP rank `ep` = loss % ep, `edp` = loss // ep (mesh.expert_dims)."""
    tp, cp, dp = g % d.tp, g // d.tp % d.cp, g // (d.tp * d.cp) % d.dp
    loss = dp * d.cp + cp
    return {"tp": tp, "cp": cp, "shard": dp % d.dp_shard, "loss": loss, "ep": loss % d.ep, "edp": loss // d.ep}


def stage_matrices(s: Setup, pp_rank: int = 0) -> list[tuple[str, tuple[int, int], tuple[Hold | None, ...]]]:
    """Every Muon matrix of stage `pp_rank`, sorted by key as optim/build.matrices_of lists them: (key, whole
    shape, what each of the G group ranks holds, None for nothing)."""
    return _stage_matrices(s.config, s.dims, s.dp_type in ZERO_STAGES, tuple(stage_blocks(s, pp_rank)[0]))


@functools.lru_cache(maxsize=64)
def _stage_matrices(config, d, flat: bool, blocks: tuple[int, ...]):
    gpt, G, tp, cp, ep = _meta_gpt(config), d.world_size // d.pp, d.tp, d.cp, d.ep
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


def exchange(s: Setup, pp_rank: int = 0) -> tuple[list, list[int], list[int]]:
    """(theory holds, LPT owners, NS FLOPs per matrix) of stage `pp_rank`."""
    return _exchange(s.config, s.dims, s.dp_type in ZERO_STAGES, tuple(stage_blocks(s, pp_rank)[0]), ns_steps(s))[:3]


def sent_by_rank(s: Setup, pp_rank: int = 0) -> list[dict[str, int]]:
    """`theory.muon_exchange_bytes_by_rank` of stage `pp_rank`: each group rank's gather and return bytes."""
    return _exchange(s.config, s.dims, s.dp_type in ZERO_STAGES, tuple(stage_blocks(s, pp_rank)[0]), ns_steps(s))[3]


@functools.lru_cache(maxsize=64)
def _exchange(config, d, flat: bool, blocks: tuple[int, ...], steps: int):
    ms = _stage_matrices(config, d, flat, blocks)
    holds, keys, held = pieces(ms)
    flops = [theory.muon_ns_flops(shape, steps) for _, shape, _ in ms]
    owners = theory.muon_owners(flops, held, keys)
    return holds, owners, flops, theory.muon_exchange_bytes_by_rank(holds, owners)


def exchange_bytes(s: Setup, pp_rank: int = 0, g: int = 0) -> dict[str, int]:
    """{"all_to_all": bytes} group rank g of stage `pp_rank` sends per step (`theory.muon_exchange_bytes_per_step`)."""
    if not muon_on(s) or stage_ranks(s) == 1:
        return {}
    return {"all_to_all": sum(sent_by_rank(s, pp_rank)[g].values())}


def exchange_calls(s: Setup, pp_rank: int = 0) -> dict[str, int]:
    if not muon_on(s) or stage_ranks(s) == 1:
        return {}
    holds, owners, _ = exchange(s, pp_rank)
    return {"all_to_all": theory.muon_exchange_calls_per_step(holds, owners)}


def ns_flops_by_rank(s: Setup, pp_rank: int = 0) -> list[int]:
    """Each group rank's Newton-Schulz FLOPs per step (the matrices LPT gives it; all of them on one rank)."""
    if stage_ranks(s) == 1:
        return [sum(theory.muon_ns_flops(shape, ns_steps(s)) for _, shape, _ in stage_matrices(s, pp_rank))]
    _, owners, flops = exchange(s, pp_rank)
    out = [0] * stage_ranks(s)
    for o, f in zip(owners, flops):
        out[o] += f
    return out


def optimizer_state_bytes(s: Setup, pp_rank: int = 0, shard_rank: int = 0, expert_shard_rank: int = 0) -> int:
    """`theory.muon_optimizer_state_bytes` of a rank of stage `pp_rank`: without a sharding engine its whole
    tensors (Muon's momentum per Muon parameter, AdamW's moments and step per other); on our flat engine per unit
    the elements of its shard (`shard_rank` of dp_shard x cp, an expert unit's `expert_shard_rank` of edp): the
    Muon ones, each non-Muon decay slice (an AdamW view: its moments and step) and the no-decay piece."""
    if s.dp_type not in ZERO_STAGES:
        params = local_params(s, pp_rank)
        muon = sum(k for n, k, _ in params if is_muon(n))
        rest = [k for n, k, _ in params if not is_muon(n)]
        return theory.muon_optimizer_state_bytes(muon, sum(rest), len(rest))
    from plan.counts import unit_shard, units

    muon = adamw = tensors = 0
    for unit, (numel, n_decay) in units(s, pp_rank).items():
        S = shard_numel(numel, unit_shard(s, unit))
        r = expert_shard_rank if unit.endswith(".experts") else shard_rank
        lo, hi = r * S, min(numel, (r + 1) * S)
        spans = list(_spans(s, pp_rank, unit))
        held_muon = sum(max(0, min(b, hi) - max(a, lo)) for n, a, b, _ in spans if is_muon(n))
        held_rest = max(0, hi - max(n_decay, lo))
        muon += held_muon
        adamw += max(0, min(n_decay, hi) - lo) - held_muon + held_rest
        views = sum(min(b, hi) > max(a, lo) for n, a, b, decay in spans if decay and not is_muon(n))
        tensors += views + (held_rest > 0)
    return theory.muon_optimizer_state_bytes(muon, adamw, tensors)


def group_rank(d, coords: tuple[int, ...]) -> int:
    """The rank in its stage's group of the rank at mesh `coords` (pp, dp_replicate, dp_shard, cp, tp)."""
    _, rep, shard, cp, tp = coords
    return ((rep * d.dp_shard + shard) * d.cp + cp) * d.tp + tp


def _unit_specs(s: Setup, pp_rank: int, unit: str) -> list[tuple[str, int, bool]]:
    """(name, local elements, decays) of a unit's parameters in flatten_unit's order (decayed first), the units
    as plan.counts.units cuts them."""
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
    ).get(unit, [])


@functools.lru_cache(maxsize=256)
def _members(config, pp, virtual, tp, pp_rank, layers, v_shape, ep) -> dict[str, list[tuple[str, int, bool]]]:
    import torch

    from parallel.data_parallel.flat_param import unit_key
    from parallel.pipeline.runner import PipelineStage, sharded_units
    from plan.counts import _local_params

    with torch.device("meta"):
        separate = (
            sharded_units(PipelineStage(_meta_gpt(config), pp_rank, pp, virtual, layers, v_shape)) if pp > 1 else {}
        )
    out: dict[str, list] = {}
    for name, n, ndim in _local_params(config, pp, virtual, tp, pp_rank, layers, v_shape, ep):
        key = unit_key(name, separate) + (".experts" if ep > 1 and is_expert(name) else "")
        out.setdefault(key, []).append((name, n, ndim >= 2 and not name.endswith("bias")))
    return {k: sorted(v, key=lambda x: not x[2]) for k, v in out.items()}


def _spans(s: Setup, pp_rank: int, unit: str):
    at = 0
    for name, n, decay in _unit_specs(s, pp_rank, unit):
        yield name, at, at + n, decay
        at += n


def for_rank(s: Setup, coords_: tuple[int, ...], out: dict) -> None:
    """plan.predict's `out` (group rank 0's exchange, shard rank's state) made the rank at mesh `coords_`'s: its
    own exchange bytes and, on our flat engine, the state of its expert shard too."""
    pp, g = coords_[0], group_rank(s.dims, coords_)
    if "comm_bytes" in out and stage_ranks(s) > 1:
        mine, zero = exchange_bytes(s, pp, g)["all_to_all"], exchange_bytes(s, pp, 0)["all_to_all"]
        out["comm_bytes"]["all_to_all"] += mine - zero
    c = coords(s.dims, g)
    out["state_bytes_by_kind"]["optimizer"] = optimizer_state_bytes(s, pp, c["shard"] * s.dims.cp + c["cp"], c["edp"])
    out["state_bytes"] = sum(out["state_bytes_by_kind"].values())


# ----------------------------------------------------------------------------- plan.counts's, with the optimizer's part


def state_bytes(s: Setup, pp_rank: int = 0, shard_rank: int = 0, expert_shard_rank: int = 0) -> dict[str, int]:
    """plan.counts.state_bytes with --optimizer muon's optimizer state (`optimizer_state_bytes`)."""
    out = counts.state_bytes(s, pp_rank, shard_rank, expert_shard_rank)
    if muon_on(s):
        out["optimizer"] = optimizer_state_bytes(s, pp_rank, shard_rank, expert_shard_rank)
    return out


def comm_by_group(s: Setup, pp_rank: int = 0) -> dict[str, dict[str, int]]:
    """plan.counts.comm_by_group with --optimizer muon's group "muon" (the stage's ranks): rank 0's exchange."""
    out = counts.comm_by_group(s, pp_rank)
    if muon_on(s):
        out["muon"] = exchange_bytes(s, pp_rank)
    return out


def comm_calls_by_group(s: Setup, pp_rank: int = 0) -> dict[str, dict[str, int]]:
    """plan.counts.comm_calls_by_group with --optimizer muon's group "muon"."""
    out = counts.comm_calls_by_group(s, pp_rank)
    if muon_on(s):
        out["muon"] = exchange_calls(s, pp_rank)
    return out
