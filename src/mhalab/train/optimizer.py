"""The optimizer every run uses, and the values its settings take.

AdamW (no weight decay on biases, norms and embeddings) with a linear warmup, then a cosine, linear or constant lr
(`optim.*`, and `pretrain.*` for the masked-LM stage); the loss's label smoothing (`optim.label_smoothing`); the
decay of the weights' moving average (`callbacks=ema`, mhalab.train.ema). torch only: mhalab.train.config checks a
run's values with these rules before Lightning loads (~3 s), and the module and the callback check them again.
"""

from __future__ import annotations

import math

import torch

SCHEDULES = ("cosine", "linear", "constant")  # the lr after warmup

# devices where AdamW runs fused: one kernel per step instead of ~10 ops per parameter (PyTorch's default on CPU is
# the per-parameter loop): on this project's 2-core CPU the loop's SST-2 steps run at 0.95x the fused ones
# (`python scripts/throughput.py adamw_loop=true`, results/bench/compile.md). Same numbers to float rounding.
FUSED_ADAMW = ("cpu", "cuda")


def check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown optim.schedule '{schedule}'; choose one of {', '.join(SCHEDULES)}.")


def check_label_smoothing(eps: float) -> None:
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"optim.label_smoothing={eps} must be in [0, 1), e.g. 0.1.")


def check_decay(decay: float | None) -> None:
    """The EMA's decay (mhalab.train.ema)."""
    if decay is None or not 0.0 < decay < 1.0:
        raise ValueError(f"callbacks.ema.decay={decay} must be in (0, 1), e.g. 0.99 (an average over ~100 steps).")


def adamw_with_schedule(module, hp) -> dict:
    """AdamW (no weight decay on biases, norms and embeddings, as is standard for Transformers) and a per-step
    lr schedule: linear warmup over hp.warmup_ratio of the run, then cosine / linear decay to 0, or constant.
    module: a LightningModule in a trainer (its length sets the schedule's); hp: lr, weight_decay, betas,
    warmup_ratio, schedule. The classifier and the masked-LM pretraining share it; configure_optimizers returns it."""
    decay = [p for n, p in module.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in module.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=hp.lr, betas=tuple(hp.betas), fused=module.device.type in FUSED_ADAMW,
    )
    total = max(1, int(module.trainer.estimated_stepping_batches))
    warmup = int(hp.warmup_ratio * total)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if hp.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress)) if hp.schedule == "cosine" else 1.0 - progress

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
