"""The GPT's parts a pipeline stage runs besides its modules (runner.ModelParts), named once: the composition
(parallel/parallelize.py) and PyTorch's twin (parallel/twins/pipeline.py) hand them to every stage they cut, so the
runner itself imports nothing of model/."""

from __future__ import annotations

from model.gpt import materialize_module
from model.loss import head_output, loss_share
from model.moe import SideLosses
from parallel.pipeline.runner import ModelParts

GPT_PARTS = ModelParts(head=head_output, side_losses=SideLosses, loss_share=loss_share, materialize=materialize_module)
