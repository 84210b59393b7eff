"""The mixture-of-experts model (model/moe.py: a router and E experts in place of a Block's MLP), registered: its
flags, their checks, its fields of the model's config, the flags `python -m plan` takes for it and its rows of the
layout sweep. Its parallelism, expert parallelism, registers beside it (concept.py). docs/moe.md."""

from __future__ import annotations

from runtime.registry import AT_LEAST_ONE, AT_LEAST_ZERO, NON_NEGATIVE, Checking, Concept, Sweep, UsageError, register

FIELDS = ("moe_num_experts", "moe_top_k", "moe_every", "moe_ffn_hidden", "moe_aux_loss_coeff", "moe_bias_update_rate")


def flags(a) -> None:
    a(
        "--moe_num_experts",
        type=int,
        default=0,
        metavar="E",
        help="mixture of experts: E experts per MoE layer (0: the dense GPT-2 MLP)",
    )
    a("--moe_top_k", type=int, default=2, metavar="K", help="experts each token is routed to")
    a("--moe_every", type=int, default=1, metavar="N", help="an MoE layer in every N-th Block (Blocks N-1, 2N-1, ...)")
    a("--moe_ffn_hidden", type=int, default=0, metavar="H", help="each expert's hidden width (0: 4 x n_embd)")
    a("--moe_aux_loss_coeff", type=float, default=0.0, help="Switch/GShard load-balancing loss coefficient")
    a(
        "--moe_bias_update_rate",
        type=float,
        default=0.0,
        help="DeepSeek-V3 auxiliary-loss-free balancing: the expert bias's step per optimizer step",
    )


def plan_flags(a) -> None:
    """python -m plan's: an MoE model (the search then tries EP)."""
    a("--moe_num_experts", type=int, help="a mixture of experts: E experts per MoE layer (layouts then try EP)")
    a("--moe_top_k", type=int)
    a("--moe_every", type=int)
    a("--moe_ffn_hidden", type=int)


def model_fields(args) -> dict:
    """The model config's mixture-of-experts fields from the flags (model.GPTConfig)."""
    return {k: getattr(args, k) for k in FIELDS}


def check_weights(c: Checking) -> None:
    """Before fetching anything: OpenAI's weights have no experts."""
    if c.args.init_from != "scratch" and c.args.moe_num_experts:
        raise UsageError(f"--init_from {c.args.init_from} with --moe_num_experts: OpenAI's GPT-2 has no experts")


def check_moe(c: Checking) -> None:
    """The routing against the experts and Blocks, and torch's pipelining (no balancing loss from a chunk)."""
    config = c.config
    E, K = config.moe_num_experts, config.moe_top_k
    if E == 0:
        return
    if K > E:
        raise UsageError(f"--moe_top_k {K} > --moe_num_experts {E}: a token cannot pick more experts than exist")
    if not any(config.is_moe(i) for i in range(config.n_layer)):
        raise UsageError(
            f"--moe_every {config.moe_every} with {config.n_layer} Blocks gives no Block experts (the "
            f"first MoE Block would be Block {config.moe_every - 1}): use --moe_every <= {config.n_layer}"
        )
    if c.args.implementation == "pytorch" and c.dims.pp_enabled:
        raise UsageError(
            "--implementation pytorch --pipeline_parallel_size with --moe_num_experts: torch's "
            "pipelining takes no balancing loss from a chunk; use --implementation custom"
        )


# ----------------------------------------------------------------------------- its rows of the sweep (bench/sweep.py)

E = 4  # experts per MoE layer in the sweep's rows (top-2, both balancing rules on: bench/sweep.MOE)


def sweep_rows() -> list[dict]:
    """Mixture of experts (4 experts per Block, top-2, both balancing rules on) on one process's MoE model, and
    expert parallelism at 2 and 4 ranks: EP alone (dp = EP), dp > EP, with CP, TP + SP, pipelines (1F1B, and
    ZB-V's split backward), and the sharding engine; in bf16 too. Two pipelines with a stage that holds no MoE
    Block (the first user report: a collective mismatch at step 1): an MoE layer in Block 3 only (the cost
    model's split leaves stage 0 dense), beside dp = EP = 2; and --pp_layers_per_stage 1,3 with MoE Blocks 1
    and 3 (stage 0 is Block 0, dense)."""
    return [
        dict(dp=2, dp_type="ddp", experts=E, ep=2),
        dict(cp=2, experts=E, ep=2),
        dict(pp=2, dp=2, dp_type="ddp", experts=E, ep=2, moe_every=4),
        dict(pp=2, experts=E, moe_every=2, stages="1,3"),
        dict(dp=4, dp_type="ddp", experts=E, ep=2),
        dict(dp=4, dp_type="ddp", experts=E, ep=4),
        dict(dp=2, dp_type="ddp", tp=2, experts=E, ep=2),
        dict(tp=2, experts=E),
        dict(pp=2, dp=2, dp_type="ddp", experts=E, ep=2),
        dict(pp=2, dp=2, dp_type="ddp", schedule="zbv", virtual=2, experts=E, ep=2),
        dict(pp=2, schedule="interleaved_1f1b", virtual=2, experts=E),
        dict(dp=2, dp_type="fsdp", experts=E, ep=2),
        dict(dp=2, dp_type="zero1", experts=E, ep=2),
        dict(dp=2, dp_type="ddp", experts=E, ep=2, dtype="bfloat16"),
    ]


def sweep_large_rows() -> list[dict]:
    """EP at 8 ranks: pp = 2 x dp = 2 x tp = 2 with EP = 2 under ZB-H1, dp = 8 with EP = 4 (each expert on 2
    ranks) over ZeRO-2, and pp = 2 x dp = 4 x EP = 4 over FSDP."""
    return [
        dict(pp=2, dp=2, tp=2, dp_type="ddp", schedule="zb_h1", experts=E, ep=2),
        dict(dp=8, dp_type="zero2", experts=E, ep=4, rows=16),
        dict(pp=2, dp=4, dp_type="fsdp", experts=E, ep=4),
    ]


CONCEPT = register(
    Concept(
        name="moe",
        title="mixture of experts (docs/moe.md)",
        flags=flags,
        ranges={
            "moe_top_k": AT_LEAST_ONE,
            "moe_every": AT_LEAST_ONE,
            "moe_num_experts": AT_LEAST_ZERO,
            "moe_ffn_hidden": AT_LEAST_ZERO,
            "moe_aux_loss_coeff": NON_NEGATIVE,
            "moe_bias_update_rate": NON_NEGATIVE,
        },
        checks=(("layout", check_weights), ("batch", check_moe)),
        model=model_fields,
        plan_flags=plan_flags,
        sweep=Sweep(rows=sweep_rows, large=sweep_large_rows),
    )
)
