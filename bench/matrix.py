"""Which layouts the bench runs, what they share, and how many bytes each should communicate.

The communication formulas live beside the code they describe (parallel/data_parallel/ddp.py,
parallel/data_parallel/fsdp.py,
parallel/tensor_parallel/apply.py, parallel/pipeline/runner.py); here they are only applied to a layout's parameter
shard and batch. The one exception is TP on a pipeline's first stage (`tp_first_stage_bytes_per_micro_step`),
a cut of the TP formula that only the bench needs.

With --include_moe: `moe` (the model with an MoE layer of E experts, top-K, each expert's hidden width 4C/K, in
every Block, on one process), `moe-ep` (it under expert parallelism over all ranks: dp = EP = nproc, DDP) and
`dense-active` (the dense preset on one process: a token's MLP multiplies by 2·C·4C weights, its K experts by
K·2·C·(4C/K), the same; the MoE layer adds only its router, C·E, and K-1 more c_proj biases). The MoE layouts
balance their experts with the auxiliary loss (0.01) and the bias rule (1e-3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from model.gpt import GPT, GPTConfig
from model.moe import Experts
from parallel.data_parallel.flat_param import ZERO_STAGES
from parallel.pipeline.partition import layers_for
from plan.theory import (
    ddp_comm_bytes_per_step,
    ep_all_to_all_bytes_per_micro_step,
    fsdp_comm_bytes_per_micro_step,
    p2p_bytes_per_step,
    tp_comm_bytes_per_micro_step,
    zero_comm_bytes_per_step,
)

PP_LAYOUTS = ("pp", "pp-dp", "pp-tp", "3d")  # pp=2 alone, x dp=2 (DDP), x tp=2, x dp=2 x tp=2
ZERO_LAYOUTS = ("zero1", "zero2", "hsdp")  # the ZeRO ladder beside ddp and fsdp (= ZeRO-3); hsdp: fsdp, R=2
MOE_LAYOUTS = ("moe", "moe-ep", "dense-active")  # the MoE model on 1 process, under EP = dp = nproc; the dense one
MOE_EXPERTS = 8  # E of the MoE layouts: with top-2, a quarter of each layer's expert parameters active per token
LAYOUTS = ("single", "ddp", "fsdp", "tp", "2d-ddp", "2d-fsdp", *PP_LAYOUTS, *ZERO_LAYOUTS, *MOE_LAYOUTS)
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "p2p")


@dataclass(frozen=True)
class Layout:
    """One cell of the matrix: a layout name, an implementation and its (pp, dp, tp) degrees."""

    name: str  # one of LAYOUTS
    implementation: str  # "custom" | "pytorch" | "none" (single)
    dp: int = 1
    tp: int = 1
    pp: int = 1
    replicate: int = 1  # HSDP: dp = replicate x shard
    experts: int = 0  # E of every Block's MoE layer (Setup.moe_config); 0: the dense preset
    ep: int = 1  # expert-parallel size (out of dp)

    @property
    def nproc(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def dp_type(self) -> str | None:
        if self.dp == 1:
            return None
        if self.name in ("zero1", "zero2"):
            return self.name
        return "fsdp" if self.name.endswith("fsdp") or self.name == "hsdp" else "ddp"

    @property
    def key(self) -> str:
        return self.name if self.implementation == "none" else f"{self.name}-{self.implementation}"

    @property
    def group(self) -> str:
        """The layouts that run back to back, their order alternating over repeats: a custom/pytorch pair, or the
        MoE layouts (so the MoE / dense ratios compare runs made side by side)."""
        return "moe" if self.name in MOE_LAYOUTS else self.name

    def flags(self) -> list[str]:
        if self.implementation == "none":  # one process: single, moe, dense-active
            return []
        out = ["--implementation", self.implementation]
        if self.dp > 1:
            out += ["--data_parallel_size", str(self.dp), "--data_parallel_type", self.dp_type]
        if self.replicate > 1:
            out += ["--data_parallel_replicate_size", str(self.replicate)]
        if self.pp > 1:  # the default 1f1b schedule
            out += ["--pipeline_parallel_size", str(self.pp)]
        if self.tp > 1:
            out += ["--tensor_parallel_size", str(self.tp)]
            if self.pp == 1:  # under PP the pytorch twin refuses it; both twins run the same layout without
                out.append("--enable_loss_parallelism")
        if self.dp_type in ("zero1", "zero2", "fsdp"):
            out.append("--deferred_init")  # materialise only this rank's shard, as one would at scale
        if self.ep > 1:
            out += ["--expert_parallel_size", str(self.ep)]
        return out


def matrix(
    nproc: int,
    on_gpu: bool,
    include_2d: bool,
    wanted: list[str] | None = None,
    include_pp: bool = False,
    include_zero: bool = False,
    include_moe: bool = False,
    moe_experts: int = MOE_EXPERTS,
) -> list[Layout]:
    """The layouts to run, in order; 2D (tp=2 x dp=N/2) needs >= 4 ranks (on CPU: 4 with --include_2d).
    include_pp: also pp, pp-dp, pp-tp and 3d (pp=2; 2, 4, 4 and 8 ranks), on GPU only those that fit in
    the nproc GPUs present. include_moe: also moe, moe-ep (nproc >= 2 dividing moe_experts) and dense-active,
    last; `wanted` picks among them only if it names one of them (`--layouts single,ddp --include_moe` runs
    single, ddp and the three)."""
    lays = [Layout("single", "none")]
    if nproc >= 2:
        for name, dp, tp in (("ddp", nproc, 1), ("fsdp", nproc, 1), ("tp", 1, nproc)):
            lays += [Layout(name, impl, dp=dp, tp=tp) for impl in ("custom", "pytorch")]
    n2d = nproc if nproc >= 4 else (4 if include_2d and not on_gpu else 0)
    if n2d and n2d % 2 == 0:
        for name in ("2d-ddp", "2d-fsdp"):
            lays += [Layout(name, impl, dp=n2d // 2, tp=2) for impl in ("custom", "pytorch")]
    if include_pp:
        for name, dp, tp in zip(PP_LAYOUTS, (1, 2, 1, 2), (1, 1, 2, 2)):
            if not on_gpu or 2 * dp * tp <= nproc:
                lays += [Layout(name, impl, dp=dp, tp=tp, pp=2) for impl in ("custom", "pytorch")]
    if include_zero and nproc >= 2:  # zero1, zero2 over all ranks; hsdp: 2 replicas of nproc/2 (CPU: 2 x 2)
        for name in ("zero1", "zero2"):
            lays += [Layout(name, impl, dp=nproc) for impl in ("custom", "pytorch")]
        n = nproc if nproc >= 4 else (0 if on_gpu else 4)
        if n and n % 2 == 0:
            lays += [Layout("hsdp", impl, dp=n, replicate=2) for impl in ("custom", "pytorch")]
    if wanted:
        lays = [lay for lay in lays if lay.name in wanted]
    if include_moe:
        moe = [Layout("moe", "none", experts=moe_experts)]
        if nproc >= 2 and moe_experts % nproc == 0:
            moe.append(Layout("moe-ep", "custom", dp=nproc, experts=moe_experts, ep=nproc))
        moe.append(Layout("dense-active", "none"))
        if wanted and set(wanted) & set(MOE_LAYOUTS):
            moe = [lay for lay in moe if lay.name in wanted]
        lays += moe
    return lays


@dataclass(frozen=True)
class Setup:
    """What every layout shares: model, global batch, steps, peak FLOP/s, dtype."""

    model: str
    config: GPTConfig
    seq_len: int
    rows: int  # sequences per global batch (the same for every layout)
    micro_cap: int  # largest micro-batch per rank
    warmup: int
    steps: int  # measured steps
    peak_flops: float
    device: str  # "cpu" | "cuda"
    dataset: str
    timeout: float  # seconds per job
    dtype_bytes: int = 4  # matmul outputs: 2 under bf16/fp16 autocast
    residual_bytes: int = 4  # residual stream, embeddings, LayerNorm outputs: fp32 also under autocast
    moe_top_k: int = 2  # K of the MoE layouts; each expert's hidden width is 4C/K (equal active parameters)
    # balancing, as a training run has it (without, the tiny-batch runs' routers collapse onto K experts in a few
    # steps): Switch's loss coefficient, DeepSeek-V3's bias rate
    moe_aux_loss_coeff: float = 0.01
    moe_bias_update_rate: float = 1e-3
    optimizer: str = "adamw"  # python -m bench --optimizer: another optimizer runs with no checkpoint

    def moe_config(self, experts: int) -> GPTConfig:
        """The config of a layout with `experts` (Layout.experts): every Block's MLP replaced by that many experts,
        top moe_top_k, each C -> 4C/K -> C, so a token's experts hold as many weights as the dense MLP; the
        balancing loss and the bias rule at moe_aux_loss_coeff and moe_bias_update_rate. experts == 0: the dense
        config."""
        if not experts:
            return self.config
        return replace(
            self.config,
            moe_num_experts=experts,
            moe_top_k=self.moe_top_k,
            moe_ffn_hidden=4 * self.config.n_embd // self.moe_top_k,
            moe_aux_loss_coeff=self.moe_aux_loss_coeff,
            moe_bias_update_rate=self.moe_bias_update_rate,
        )

    @property
    def global_batch_tokens(self) -> int:
        return self.rows * self.seq_len

    def micro_batch(self, dp: int, pp: int = 1) -> int:
        """The largest divisor of rows/dp that is <= micro_cap; under PP (pp > 1) also small enough that
        the step has M = rows/(dp*mb) >= 2*pp micro-batches, so the 1F1B bubble (P-1)/(M+P-1) stays
        below 1/3 (1 when rows/dp < 2*pp: as many micro-batches as there are rows)."""
        per_rank = self.rows // dp
        fits = [
            d
            for d in range(1, min(per_rank, self.micro_cap) + 1)
            if per_rank % d == 0 and (pp == 1 or per_rank // d >= 2 * pp)
        ]
        return max(fits, default=1)

    def grad_accum(self, dp: int, pp: int = 1) -> int:
        """Micro-steps per optimizer step; under PP the pipeline's micro-batches M."""
        return self.rows // (dp * self.micro_batch(dp, pp))

    def train_args(self, lay: Layout, out_dir: str) -> list[str]:
        c = self.config
        return [
            "--model",
            self.model,
            "--n_layer",
            str(c.n_layer),
            "--n_head",
            str(c.n_head),
            "--n_embd",
            str(c.n_embd),
            "--vocab_size",
            str(c.vocab_size),
            "--dataset",
            self.dataset,
            "--seq_len",
            str(self.seq_len),
            "--micro_batch_size",
            str(self.micro_batch(lay.dp, lay.pp)),
            "--total_batch_size",
            str(self.global_batch_tokens),
            "--max_steps",
            str(self.warmup + self.steps),
            "--warmup_steps",
            "1",
            "--eval_interval",
            str(self.warmup + self.steps + 1),
            "--eval_iters",
            "1",
            "--peak_flops",
            repr(float(self.peak_flops)),
            "--timeout",
            str(int(self.timeout)),
            "--out_dir",
            out_dir,
            "--overwrite",
            *lay.flags(),
            *self.moe_flags(lay),
            *(["--optimizer", self.optimizer, "--no_checkpoint"] if self.optimizer != "adamw" else []),
        ]

    def moe_flags(self, lay: Layout) -> list[str]:
        """train.py's flags for `moe_config(lay.experts)`; none for a dense layout."""
        if not lay.experts:
            return []
        c = self.moe_config(lay.experts)
        return [
            "--moe_num_experts",
            str(c.moe_num_experts),
            "--moe_top_k",
            str(c.moe_top_k),
            "--moe_ffn_hidden",
            str(c.moe_ffn_hidden),
            "--moe_aux_loss_coeff",
            repr(c.moe_aux_loss_coeff),
            "--moe_bias_update_rate",
            repr(c.moe_bias_update_rate),
        ]


def fit_heads(config: GPTConfig, tp: int) -> GPTConfig:
    """The config with n_head raised to the nearest count that divides by tp and divides n_embd, if needed."""
    if config.n_head % tp == 0:
        return config
    for h in range(config.n_head + 1, config.n_embd + 1):
        if h % tp == 0 and config.n_embd % h == 0:
            return replace(config, n_head=h)
    raise ValueError(f"no head count divides both n_embd={config.n_embd} and tp={tp}")


# ----------------------------------------------------------------------------- theory


def param_count(
    config: GPTConfig, tp: int = 1, root_only: bool = False, first_stage_of: int = 1, seq_len: int | None = None
) -> int:
    """Parameters one rank holds under Megatron TP (tp=1: all of them, the tied weight counted once).

    Split over the tp ranks: the vocab (wte = lm_head), column-parallel weights and biases (c_q, c_k, c_v,
    mlp.c_fc) and row-parallel weights (attn.c_proj, mlp.c_proj). Replicated: LayerNorms, the position
    embedding and the row-parallel biases. root_only: just the parameters outside the Blocks (FSDP's root
    unit: wte = lm_head, wpe, ln_f). first_stage_of=P > 1: just pipeline stage 0's of a P-stage cut
    (wte, wpe and the Blocks of the first chunk of train.py's split at `seq_len`, parallel/pipeline/partition.py;
    ln_f and lm_head's copy live on the last)."""
    with torch.device("meta"):
        model = GPT(config)
    first = layers_for(config, first_stage_of, seq_len=seq_len)[0] if first_stage_of > 1 else None
    total = 0
    for name, p in model.named_parameters():  # named_parameters yields the tied weight once (as wte)
        if root_only and name.startswith("transformer.h."):
            continue
        if first is not None and not (
            name.startswith(("transformer.wte.", "transformer.wpe."))
            or (name.startswith("transformer.h.") and int(name.split(".")[2]) in first)
        ):
            continue
        replicated = ".ln_" in name or "ln_f" in name or "wpe" in name or name.endswith("c_proj.bias")
        total += p.numel() if replicated else p.numel() // tp
    return total


def _add(out: dict[str, int], by_kind: dict[str, int], times: int = 1) -> dict[str, int]:
    for k, v in by_kind.items():
        out[k] = out.get(k, 0) + v * times
    return out


def comm_theory(lay: Layout, setup: Setup) -> dict[str, int]:
    """Payload bytes per rank (global rank 0) per optimizer step for this layout, by kind: the DP formula
    on this rank's TP shard of the parameters (Ψ/tp, roughly) plus the TP formula, per micro-step terms
    times grad_accum. Under PP rank 0 is pipeline stage 0: see `pp_comm_theory`."""
    if lay.pp > 1:
        return pp_comm_theory(lay, setup)
    if lay.experts:
        return moe_comm_theory(lay, setup)
    out = dict.fromkeys(KINDS, 0)
    A = setup.grad_accum(lay.dp)
    psi = param_count(setup.config, lay.tp)
    if lay.dp_type == "ddp":
        _add(out, ddp_comm_bytes_per_step(psi, lay.dp))
    elif lay.dp_type == "fsdp" and lay.replicate == 1:
        root = param_count(setup.config, lay.tp, root_only=True)
        _add(out, fsdp_comm_bytes_per_micro_step(root, psi - root, lay.dp), A)
    elif lay.dp_type is not None:  # zero1, zero2, hsdp
        root = param_count(setup.config, lay.tp, root_only=True)
        _add(
            out,
            zero_comm_bytes_per_step(
                ZERO_STAGES[lay.dp_type], root, psi - root, lay.dp // lay.replicate, lay.replicate, A
            ),
        )
    if lay.tp > 1:
        _add(
            out,
            tp_comm_bytes_per_micro_step(
                setup.config,
                setup.micro_batch(lay.dp),
                setup.seq_len,
                lay.tp,
                loss_parallel=True,
                sequence_parallel=False,
                dtype_bytes=setup.dtype_bytes,
                residual_bytes=setup.residual_bytes,
            ),
            A,
        )
    return out


def expert_param_count(config: GPTConfig) -> int:
    """Parameters of the experts of every MoE layer (all E of each: weights and biases), 0 for a dense config."""
    with torch.device("meta"):
        model = GPT(config)
    return sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())


def moe_comm_theory(lay: Layout, setup: Setup) -> dict[str, int]:
    """Payload bytes global rank 0 sends per optimizer step for an MoE layout (dp ranks, DDP, experts split over
    ep of them; one process: nothing), A = grad_accum micro-steps of mb rows of T tokens:
    - all_reduce: DDP's Ψ on the dense parameters (all but the experts; the routers included) over dp, plus
      this rank's experts (E/ep of each layer) over their copies, the dp/ep ranks of its edp group (with
      ep = dp none: an expert on one rank already holds every rank's tokens' gradient, parallel/data_parallel/ddp.py);
    - all_to_all: A x plan.theory.ep_all_to_all_bytes_per_micro_step at balanced routing (R = N·k rows in,
      N = mb·T tokens), the compute dtype's bytes (setup.dtype_bytes) a row element, rows and outputs alike.
      `ep_all_to_all_at_load` is the same at the load a step measured."""
    out = {**dict.fromkeys(KINDS, 0), "all_to_all": 0}
    if lay.nproc == 1:
        return out
    if lay.dp_type != "ddp" or lay.tp > 1 or lay.pp > 1:
        raise ValueError(f"no MoE theory for {lay}")
    config = setup.moe_config(lay.experts)
    experts = expert_param_count(config)
    _add(out, ddp_comm_bytes_per_step(param_count(config) - experts, lay.dp))
    _add(out, ddp_comm_bytes_per_step(experts // lay.ep, lay.dp // lay.ep))
    A, mb = setup.grad_accum(lay.dp), setup.micro_batch(lay.dp)
    moe_layers = sum(config.is_moe(i) for i in range(config.n_layer))
    out["all_to_all"] = A * ep_all_to_all_bytes_per_micro_step(
        mb * setup.seq_len, config.moe_top_k, config.n_embd, lay.experts, moe_layers, lay.ep, setup.dtype_bytes
    )
    return out


def ep_all_to_all_at_load(lay: Layout, setup: Setup, expert_tokens: dict[str, list[int]]) -> int | None:
    """The all_to_all bytes global rank 0 sends in a step whose tokens per expert over the whole batch were
    `expert_tokens` ({MoE layer: [tokens of expert e]}, metrics.jsonl's), or None unless ep == dp > 1 (then the
    one EP group holds every rank's tokens, and rank 0's experts [0, E/ep) received all the step's rows for them).
    The formula is linear in R: A micro-steps of it at R = 0, plus 2·R·C·b for the R rows that reached rank 0's
    experts over the step (each arrives forward, its gradient leaves backward)."""
    if lay.ep < 2 or lay.ep != lay.dp or lay.nproc != lay.dp:
        return None
    config = setup.moe_config(lay.experts)
    A, mb = setup.grad_accum(lay.dp), setup.micro_batch(lay.dp)
    mine = lay.experts // lay.ep
    received = sum(sum(tokens[:mine]) for tokens in expert_tokens.values())
    zero = ep_all_to_all_bytes_per_micro_step(
        mb * setup.seq_len,
        config.moe_top_k,
        config.n_embd,
        lay.experts,
        len(expert_tokens),
        lay.ep,
        setup.dtype_bytes,
        received=0,
    )
    return A * zero + 2 * received * config.n_embd * setup.dtype_bytes


def pp_comm_theory(lay: Layout, setup: Setup) -> dict[str, int]:
    """Payload bytes global rank 0 (pipeline stage 0 of P, dp rank 0, tp rank 0) sends per optimizer step
    under the 1F1B pipeline with M micro-batches of mb rows (the step's micro-steps):
    - p2p: stage 0 sends each micro-batch's output activation (mb, T, C) forward and receives (uncounted)
      its gradient: parallel.pipeline.runner.p2p_bytes_per_step; the residual stream, so residual_bytes each;
    - all-reduce of the tied embedding's gradient over [first stage, last stage]: this rank's wte shard
      (V/tp x C), fp32, once per step;
    - DDP: one all-reduce of stage 0's parameters (its TP shard) per step, after the last micro-batch;
    - TP: `tp_first_stage_bytes_per_micro_step` times M."""
    c, T = setup.config, setup.seq_len
    mb, M = setup.micro_batch(lay.dp, lay.pp), setup.grad_accum(lay.dp, lay.pp)
    out = dict.fromkeys(KINDS, 0)
    out["p2p"] = p2p_bytes_per_step(lay.pp, 1, 0, M, (mb, T, c.n_embd), setup.residual_bytes)
    out["all_reduce"] += c.vocab_size // lay.tp * c.n_embd * 4
    if lay.dp_type == "ddp":
        _add(out, ddp_comm_bytes_per_step(param_count(c, lay.tp, first_stage_of=lay.pp, seq_len=T), lay.dp))
    elif lay.dp_type is not None:
        raise ValueError(f"no PP theory for dp_type {lay.dp_type!r}")
    if lay.tp > 1:
        blocks = len(layers_for(c, lay.pp, seq_len=T)[0])
        _add(
            out,
            tp_first_stage_bytes_per_micro_step(c, blocks, mb, T, lay.tp, setup.dtype_bytes, setup.residual_bytes),
            M,
        )
    return out


def tp_first_stage_bytes_per_micro_step(
    config: GPTConfig, blocks: int, B: int, T: int, tp: int, dtype_bytes: int = 4, residual_bytes: int = 4
) -> dict[str, int]:
    """TP bytes one rank of pipeline stage 0 (wte, wpe and `blocks` Blocks) records per micro-batch,
    without sequence parallelism.

    tp_comm_bytes_per_micro_step counts, for the whole model, the f of 2L+1 region entries, the g of 2L
    exits plus the embedding's, and the loss. Stage 0 runs only some of those modules, and each costs the
    same there as in the whole model (its input is the full (B, T, C) activation on every tp rank):
    - entries: ln_1 and ln_2 of each of its Blocks, f's backward all-reduce of A(residual): 2·L0 of them.
      ln_f is on the last stage;
    - exits: attn.c_proj and mlp.c_proj of each Block, g's forward all-reduce of A(dtype): 2·L0; and the
      vocab-parallel embedding's g, A(residual);
    - no loss term: the loss (vocab-parallel or not) is computed on the last stage.
    With A(b) = B·T·C·b. tp == 1: nothing."""
    if tp == 1:
        return {"all_reduce": 0}
    A = B * T * config.n_embd
    return {"all_reduce": 2 * blocks * A * residual_bytes + 2 * blocks * A * dtype_bytes + A * residual_bytes}


def comm_curves(setup: Setup, world: list[int]) -> dict[str, list[dict[str, int]]]:
    """Theory payload by kind per rank per optimizer step vs world size N, for DDP, FSDP and TP alone on
    the bench model and global batch (micro-batch rows/N capped as in the runs; N = 1 moves nothing)."""
    psi, root = param_count(setup.config), param_count(setup.config, root_only=True)
    B1, A1 = setup.micro_batch(1), setup.grad_accum(1)
    curves: dict[str, list[dict[str, int]]] = {"ddp": [], "fsdp": [], "tp": []}
    for n in world:
        accum = max(1, math.ceil(setup.rows / (n * setup.micro_cap)))
        tp = tp_comm_bytes_per_micro_step(
            setup.config,
            B1,
            setup.seq_len,
            n,
            loss_parallel=True,
            sequence_parallel=False,
            dtype_bytes=setup.dtype_bytes,
            residual_bytes=setup.residual_bytes,
        )
        curves["ddp"].append(ddp_comm_bytes_per_step(psi, n))
        curves["fsdp"].append(_add({}, fsdp_comm_bytes_per_micro_step(root, psi - root, n), accum))
        curves["tp"].append(_add({}, tp, A1))
    return curves
