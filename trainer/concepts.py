"""The concepts the trainer knows, one import line each: importing a concept's module registers it
(runtime/registry.py). A new concept is its folder plus one line here, at its place in the order the trainer, the
planner and the sweep consult them: the parser's groups, the checks within a phase, the planner's groups, the
sweep's rows."""

from __future__ import annotations

# the order is the registry's: not sorted
# isort: off
import parallel.tensor_parallel.concept  # noqa: F401
import parallel.context_parallel.concept  # noqa: F401
import parallel.expert_parallel.concept  # noqa: F401
import parallel.pipeline.concept  # noqa: F401
import parallel.data_parallel.concept  # noqa: F401
import parallel.expert_parallel.moe_concept  # noqa: F401
import optim.concept  # noqa: F401
import ft.concept  # noqa: F401
import parallel.fp8.concept  # noqa: F401

# isort: on
from runtime.registry import Concept
from runtime.registry import concepts as registered


def concepts() -> tuple[Concept, ...]:
    """Every registered concept, in order (a concept a test registers later included)."""
    return registered()
