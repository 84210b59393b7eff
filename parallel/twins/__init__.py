"""PyTorch's own wrappers on the same mesh as ours (`--implementation pytorch`), one file per dimension, each a
step of parallel/parallelize.py's composition with the thin adapter that makes it answer parallel/protocol.py.
They sit beside our mechanisms, not inside them, so a reader can diff the two:

    pipeline.py          torch.distributed.pipelining's PipelineStage per local chunk and its schedules
                         (ours: parallel/pipeline/runner.py, parallel/pipeline/schedule.py)
    context_parallel.py  torch's context_parallel (CUDA only): the SDPA ring opened around each micro-step
                         (ours: parallel/context_parallel/ring.py)
    tensor_parallel.py   DTensor `parallelize_module` with our sharding; loss parallel as a context
                         (ours: parallel/tensor_parallel/apply.py)
    data_parallel.py     FSDP2 `fully_shard`, `DistributedDataParallel` (+ `ZeroRedundancyOptimizer` for zero1)
                         (ours: parallel/data_parallel/fsdp.py, parallel/data_parallel/ddp.py)
    fp8.py               torchao's convert_to_float8_training on the Blocks' linears
                         (ours: parallel/fp8/linear.py)
"""

from __future__ import annotations

from typing import Callable

from parallel.twins import context_parallel, data_parallel, fp8, pipeline, tensor_parallel

# each step of parallelize's composition that PyTorch has a wrapper for (none for expert parallelism), by what it
# makes: the one table through which the composition reaches the twins
STEPS: dict[str, Callable] = {
    "fp8": fp8.apply_fp8,
    "pp": pipeline.apply_pp,
    "cp": context_parallel.apply_cp,
    "tp": tensor_parallel.apply_tp,
    "fsdp": data_parallel.apply_fsdp,
    "ddp": data_parallel.apply_ddp,
    "protocol": data_parallel.protocol,
    "runner": pipeline.apply_runner,
}
