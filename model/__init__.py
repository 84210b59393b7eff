"""GPT-2, dense or mixture-of-experts, with no process group anywhere: `gpt.py` (the model, its presets, init as
a pure function of (seed, parameter name)), `moe.py` (router, experts), `loss.py` (the head and a chunked
cross-entropy), `attention.py` (the attention kernels). Parallelism swaps modules in from outside (parallel/).

The model's names are re-exported here, so `from model import GPT` keeps working for user code; the repository
imports them from `model.gpt`, so a reader's path shows the module it opens.
"""

from model.gpt import (
    GPT,
    MLP,
    PRESETS,
    AttentionCore,
    Block,
    CausalSelfAttention,
    GPTConfig,
    decays,
    init_parameter,
    make_config,
    param_groups,
    parameter_seed,
)

__all__ = [
    "GPT",
    "MLP",
    "PRESETS",
    "AttentionCore",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "decays",
    "init_parameter",
    "make_config",
    "param_groups",
    "parameter_seed",
]
