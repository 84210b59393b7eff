"""torchao's Float8 training as our FP8 linear's twin: `convert_to_float8_training` with the recipe's
`Float8LinearConfig` on the same linears (ours: parallel/fp8/linear.py's `convert_to_fp8`).

One adapter: torchao's Float8Linear.forward casts its input to autocast's dtype behind `torch.is_autocast_enabled()`
with no device, which reads CUDA's autocast only; under CPU autocast it would cast the fp32 input straight to FP8
(not through bf16). A forward pre-hook makes that cast for the input's own device, so torchao runs on CPU the
path it runs on a GPU, where the hook finds the input already cast and changes nothing.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel.fp8.linear import fp8_linear_names


def _autocast_input(module: nn.Module, args: tuple) -> tuple:
    (x,) = args
    kind = x.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return (x.to(torch.get_autocast_dtype(kind)),)
    return args


def convert_to_torchao_fp8(model: nn.Module, recipe: str, names: list[str] | None = None) -> nn.Module:
    """Swap the linears `fp8_linear_names` lists (or `names`) for torchao's Float8Linear with `recipe`'s config
    (tensorwise, rowwise), in place; returns `model`."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = set(fp8_linear_names(model) if names is None else names)
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn in names, config=config)
    for name in names:
        model.get_submodule(name).register_forward_pre_hook(_autocast_input)
    return model


def apply_fp8(model: nn.Module, mesh, cfg, device: torch.device) -> nn.Module:
    """parallelize's FP8 step under --implementation pytorch: torchao's Float8Linear on the Blocks' linears, before
    any wrapper (ours: parallel/parallelize.apply_fp8)."""
    return convert_to_torchao_fp8(model, cfg.fp8)
