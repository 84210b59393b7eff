"""torch.distributed.pipelining as our pipeline's twin: one torch PipelineStage per local chunk of our cut
(`TorchChunk`), torch's schedules, and the `PipelineRunner` contract (ours: parallel/pipeline/runner.py)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from parallel.mesh import Mesh
from parallel.pipeline.parts import GPT_PARTS
from parallel.pipeline.runner import PipelineRunner, PipelineStage
from parallel.pipeline.schedule import V_SCHEDULES


class TorchChunk(nn.Module):
    """Global chunk `c` of a PipelineStage as the module torch.distributed.pipelining runs: it registers
    only chunk c's modules (the stage's own objects, so gradients land in the stage) and computes
    `stage.forward_chunk(c, x)`: the activation, or the logits on the last chunk (the schedule's loss_fn
    takes them)."""

    def __init__(self, stage: PipelineStage, c: int):
        super().__init__()
        t = stage.transformer
        self.stage_ref, self.c = [stage], c  # in a list: not registered, the stage holds other chunks too
        self.h = nn.ModuleList([t.h[str(i)] for i in stage.layers[c]])
        if c == 0:
            self.wte, self.wpe = t.wte, t.wpe
        if c == stage.n_chunks - 1:
            self.ln_f, self.lm_head = t.ln_f, stage.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage_ref[0].forward_chunk(self.c, x)


class TorchPipelineRunner(PipelineRunner):
    """PipelineRunner's contract on torch.distributed.pipelining: PipelineStage per local chunk (the same
    split), ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B, and for the zero-bubble schedules
    ScheduleInterleavedZeroBubble (zb_h1: one stage per rank), ScheduleZBVZeroBubble and ScheduleDualPipeV (our
    V cut: torch maps stages to ranks in a V itself); they run on gloo in torch 2.13. Shapes are given to torch (no
    shape inference pass); the example tensors must require grad, or torch sends no gradient back
    (pipelining/_utils.py derives the grad metadata from them). loss_fn is CE / M with scale_grads=False:
    torch's default scale_grads=True divides every .grad by M after the step, which would also divide
    gradient accumulated before it. The tied embedding is summed outside the schedule, as ours.
    Evaluation (`forward_only`) is ours: torch's schedules run training steps."""

    SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "dualpipev")
    MULTI = {
        "interleaved_1f1b": "ScheduleInterleaved1F1B",
        "zb_h1": "ScheduleInterleavedZeroBubble",
        "zbv": "ScheduleZBVZeroBubble",
        "dualpipev": "ScheduleDualPipeV",
    }  # take a list of stages

    def __init__(self, stage: PipelineStage, group: dist.ProcessGroup | None = None, *args, **kw):
        super().__init__(stage, group, *args, **kw)
        # the chunk modules torch runs: the stage's own when torch's DDP / FSDP2 wrapped them (parallelize)
        self.chunk_modules = getattr(stage, "chunk_modules", None) or {c: TorchChunk(stage, c) for c in stage.chunks}
        self.forward = self._forward_chunk
        self._built: dict[tuple, object] = {}

    def _forward_chunk(self, c: int, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Through the chunk module, so its wrappers' hooks run (evaluation)."""
        out = self.chunk_modules[c](x)
        return out if targets is None or c != self.stage.n_chunks - 1 else self.stage.loss_fn(out, targets)

    def _schedule(self, name: str, M: int, mb: int, T: int):
        key = (name, M, mb, T, torch.is_autocast_enabled(self.device.type))
        if key not in self._built:
            from torch.distributed.pipelining import PipelineStage as TorchStage
            from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

            st, meta = self.stage, torch.device("meta")
            act = (mb, T // self.seq_shard, st.config.n_embd)
            kind = self.device.type
            logits_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else self.act_dtype
            stages = []
            for c in st.chunks:
                x = (
                    torch.empty((mb, T), dtype=torch.long, device=meta)
                    if c == 0
                    else torch.empty(act, dtype=self.act_dtype, device=meta, requires_grad=True)
                )
                last = c == st.n_chunks - 1  # logits: autocast's dtype where it is on (built inside step)
                out = torch.empty(
                    (mb, T, st.config.vocab_size) if last else act,
                    dtype=logits_dtype if last else self.act_dtype,
                    device=meta,
                    requires_grad=True,
                )
                stages.append(
                    TorchStage(
                        self.chunk_modules[c],
                        c,
                        st.n_chunks,
                        self.device,
                        input_args=x,
                        output_args=out,
                        group=self.group,
                    )
                )
            loss_fn = lambda logits, y: st.loss_fn(logits, y) / M  # noqa: E731
            import torch.distributed.pipelining as pipelining

            cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}.get(name) or getattr(pipelining, self.MULTI[name])
            self._built[key] = cls(
                stages if name in self.MULTI else stages[0], n_microbatches=M, loss_fn=loss_fn, scale_grads=False
            )
        return self._built[key]

    def step(
        self,
        micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
        schedule_name: str = "1f1b",
        scale: Callable | None = None,
    ) -> torch.Tensor:
        """As PipelineRunner.step, by torch's schedule: torch splits the concatenated batch along dim 0 into
        M equal parts, which gives back exactly these micro-batches."""
        if scale is not None:
            raise ValueError("the torch pipelining twin has no loss-scaling hook (fp16 GradScaler); use bf16")
        st, M = self.stage, len(micro_batches)
        mb, T = micro_batches[0][0].shape
        schedule = self._schedule(schedule_name, M, mb, T)
        args = (torch.cat([x for x, _ in micro_batches]).to(self.device),) if st.first else ()
        target = torch.cat([y for _, y in micro_batches]).to(self.device) if st.last else None
        losses: list[torch.Tensor] = []
        schedule.step(*args, target=target, losses=losses if st.last else None)
        return torch.stack([x.detach() for x in losses]).sum() if st.last else torch.zeros((), device=self.device)


def apply_pp(model, mesh: Mesh, cfg, device: torch.device) -> PipelineStage:
    """Our cut (parallel/pipeline/runner.py's PipelineStage), plus one module per local chunk (`TorchChunk`) for
    torch's PipelineStage: torch's DDP and FSDP2 then wrap those chunk modules, as torchtitan wraps its model
    chunks."""
    pp, v_shape = mesh["pp"], cfg.pp_schedule in V_SCHEDULES
    stage = PipelineStage(model, pp.rank, pp.size, cfg.pp_virtual, cfg.pp_layers, v_shape, parts=GPT_PARTS)
    stage.chunk_modules = {c: TorchChunk(stage, c) for c in stage.chunks}
    return stage


def apply_runner(stage: PipelineStage, mesh: Mesh, cfg, **runner_args) -> PipelineRunner:
    """torch.distributed.pipelining's schedules through whatever the steps before made (TorchPipelineRunner;
    `runner_args` hold the device)."""
    return TorchPipelineRunner(stage, **runner_args)
