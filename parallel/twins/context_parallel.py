"""torch's context parallelism as our ring attention's twin (CUDA only; ours: parallel/context_parallel/ring.py)."""

from __future__ import annotations

import contextlib
from functools import partial

import torch

from parallel.context_parallel.ring import positions_for
from parallel.mesh import Mesh
from parallel.protocol import Cut

# torch 2.13's context_parallel rings these SDPA kernels and no others (_context_parallel/_attention.py,
# `_sdpa_handler`); on CPU, SDPA runs aten._scaled_dot_product_flash_attention_for_cpu, for which it raises
# "NotImplementedError: ... does not have a sharding strategy registered" (tried on gloo ranks)
TORCH_CP_KERNELS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


@contextlib.contextmanager
def torch_context_parallel(cp_mesh, x: torch.Tensor, y: torch.Tensor):
    """PyTorch's context parallelism around one micro-step's forward + backward, as torchtitan uses it:
    `context_parallel` shards copies of the full rows x and y along time in place (head-tail), and while it
    is open every F.scaled_dot_product_attention is a ring over cp_mesh (k/v all-gathered by default:
    torch's "allgather" rotater). Yields this rank's (x, y)."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x, y = x.clone(), y.clone()  # sharded in place: x and y may be views of one token buffer
    with (
        sdpa_kernel([getattr(SDPBackend, k) for k in TORCH_CP_KERNELS]),
        context_parallel(cp_mesh, buffers=[x, y], buffer_seq_dims=[1, 1], no_restore_buffers={x, y}),
    ):
        yield x, y


def apply_cp(model, mesh: Mesh, cfg, device: torch.device) -> Cut:
    """torch's context_parallel (CUDA only): zigzag positions now (torch's head-tail load balancer gives rank r
    chunks r and 2C-1-r, our split), the SDPA ring per micro-step; it takes the full rows and shards them."""
    cp = mesh["cp"]
    model.positions = positions_for(cp.rank, cp.size)
    return Cut(model, context=partial(torch_context_parallel, cp.device_mesh))
