"""A training run's checkpoint: what train.py's Trainer saves after a step (model, optimizer, scaler, the run's
config and layout, through checkpoints/checkpoint.py's sharded format) and how a resume in any layout loads it back.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from checkpoints.checkpoint import load, snapshot, write
from checkpoints.entries import entries
from trainer.concepts import concepts

MATH_ARGS = (
    "seed",
    "lr",
    "warmup_steps",
    "max_steps",
    "weight_decay",
    "total_batch_size",
    "seq_len",
    "gradient_clipping",
    "grad_compression",
    "param_dtype",
    "reduce_dtype",
    "init_from",
    "dataset",
)  # stored with each checkpoint, then each concept's (Concept.math_flags); a resume with other values says so


def math_args() -> tuple[str, ...]:
    """MATH_ARGS and every registered concept's flags that change the math (the optimizer's)."""
    return MATH_ARGS + tuple(f for c in concepts() for f in c.math_flags)


def save_trainer(trainer, step: int, wait: bool = False) -> tuple[str, float]:
    """Collective: every rank writes its elements of train.py's Trainer `t` (model, optimizer, scaler) after
    `step`, with the run's config, MATH_ARGS and layout in the manifest. Returns (directory, milliseconds
    training was blocked). With --async_checkpoint (`trainer.saver`) only staging the copies blocks and a
    background thread writes it, unless `wait` (the final save, a preemption)."""
    spec, a, d = trainer.spec, trainer.spec.args, trainer.spec.dims
    extra = {
        "config": {
            "model": asdict(spec.config),
            "train": {
                **{k: getattr(a, k, None) for k in math_args()},
                "dtype": str(spec.dtype).removeprefix("torch."),
                "optimizer": a.optimizer,
            },
        },  # a resume with the other is refused
        "layout": {
            "world_size": d.world_size,
            **d.sizes(),
            "implementation": spec.parallel.implementation,
            "dp_type": spec.parallel.dp_type,
        },
    }
    if trainer.scaler is not None:
        extra["scaler"] = trainer.scaler.state_dict()
    t0 = time.perf_counter()
    snap = snapshot(
        a.out_dir,
        step,
        entries(trainer.parallelized, trainer.optimizer),
        trainer.parallelized.checkpoint_optimizer(trainer.optimizer),
        extra,
        rank=spec.rank,
        world_size=d.world_size,
        keep=a.keep_checkpoints,
        device=spec.device,
    )
    if trainer.saver is None:
        path = write(snap)
    else:
        trainer.saver.save(snap)
        path = trainer.saver.path
        if wait:
            trainer.saver.wait()
    return path, (time.perf_counter() - t0) * 1000


def restore_trainer(trainer) -> int:
    """Load --resume's checkpoint (saved in any layout) into train.py's Trainer `t`, in its own layout;
    returns its step. The data position is the step itself: batches are a pure function of (seed, step).
    Rank 0 says what it resumes from and which MATH_ARGS differ from the saved run's."""
    from parallel.mesh import OPTIONAL_DIMS

    spec, args = trainer.spec, trainer.spec.args
    m = load(
        spec.resume_from,
        entries(trainer.parallelized, trainer.optimizer),
        trainer.parallelized.checkpoint_optimizer(trainer.optimizer),
        rank=spec.rank,
        world_size=spec.dims.world_size,
        device=spec.device,
    )
    if trainer.scaler is not None and "scaler" in m:
        trainer.scaler.load_state_dict(m["scaler"])
    if spec.rank == 0:
        lay = m["layout"]
        cp = "".join(f" {k}={lay[k]}" for k in OPTIONAL_DIMS if lay.get(k, 1) > 1)
        print(
            f"resuming from {spec.resume_from} (saved by {lay['implementation']} pp={lay.get('pp', 1)}{cp} "
            f"dp={lay['dp']}"
            f"{' (' + lay['dp_type'] + ')' if lay['dp_type'] else ''} tp={lay['tp']}): continuing at step "
            f"{m['step'] + 1}"
            + (f" (nothing left: --max_steps {args.max_steps})" if m["step"] >= args.max_steps else ""),
            flush=True,
        )
        saved = m["config"]["train"]
        changed = [
            f"--{k} {saved.get(k)!r} -> {getattr(args, k, None)!r}"
            for k in math_args()
            if saved.get(k) != getattr(args, k, None)
        ]
        if changed:
            print(
                f"note: arguments differ from the checkpoint's run, so losses will differ from an "
                f"uninterrupted run: {', '.join(changed)}",
                flush=True,
            )
    return int(m["step"])
