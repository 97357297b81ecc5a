"""The optimizer every run uses, and the values its settings take.

AdamW (no weight decay on biases, norms and embeddings) with a linear warmup, then a cosine, linear or constant lr
(`optim.*`, and `pretrain.*` for the masked-LM stage); the loss's label smoothing (`optim.label_smoothing`); the
decay of the weights' moving average (`callbacks=ema`, mhalab.train.callbacks.ema). torch only: mhalab.train.config checks a
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
    """The EMA's decay (mhalab.train.callbacks.ema)."""
    if decay is None or not 0.0 < decay < 1.0:
        raise ValueError(f"callbacks.ema.decay={decay} must be in (0, 1), e.g. 0.99 (an average over ~100 steps).")


def decays(name: str, p: torch.Tensor) -> bool:
    """Whether AdamW decays this parameter: matrices, but not embeddings (nor biases and norms, which are 1-D)."""
    return p.ndim >= 2 and "embed" not in name


def adamw_with_schedule(module, hp) -> dict:
    """AdamW (no weight decay on biases, norms and embeddings, as is standard for Transformers) and a per-step
    lr schedule: linear warmup over hp.warmup_ratio of the run, then cosine / linear decay to 0, or constant.
    module: a LightningModule in a trainer (its length sets the schedule's); hp: lr, weight_decay, betas,
    warmup_ratio, schedule. The classifier and the masked-LM pretraining share it; configure_optimizers returns it."""
    decay = [p for n, p in module.named_parameters() if decays(n, p)]
    no_decay = [p for n, p in module.named_parameters() if not decays(n, p)]
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


def upgrade_article_keys(checkpoint: dict, module) -> None:
    """A checkpoint written while our attention kept W_Q, W_K, W_V, W_O as parameters of their own (mhalab before
    2026-12-05), made resumable in place: its AdamW state per parameter moves to the parameters that hold those
    weights now (in_proj_weight = [W_Q; W_K; W_V], in_proj_bias, out_proj.*), each moment concatenated as the weights
    are, in adamw_with_schedule's groups. (The weights themselves are mapped by MultiHeadAttention's
    load_state_dict.) Anything else is left as it is; a checkpoint that does not have the expected layout then fails
    to load its optimizer as it did before."""
    from mhalab.nn import MultiHeadAttention

    state = checkpoint.get("state_dict", {})
    if not any(k.endswith(".W_Q.weight") for k in state) or len(checkpoint.get("optimizer_states", [])) != 1:
        return
    parts = {}  # new parameter name -> the old names whose concatenation (dim 0) it is
    for prefix, m in module.named_modules():
        if isinstance(m, MultiHeadAttention):
            at = f"{prefix}." if prefix else ""
            for leaf in ("weight", "bias"):
                if f"{at}W_Q.{leaf}" in state:
                    packed = leaf == "bias" or m.in_proj_weight is not None
                    names = [f"{at}in_proj_{leaf}"] if packed else [f"{at}{x}_proj_weight" for x in "qkv"]
                    olds = [f"{at}W_{x}.{leaf}" for x in "QKV"]
                    parts |= {names[0]: olds} if packed else dict(zip(names, ([o] for o in olds)))
                if f"{at}W_O.{leaf}" in state:
                    parts[f"{at}out_proj.{leaf}"] = [f"{at}W_O.{leaf}"]
    new = list(module.named_parameters())
    old_params = {o for olds in parts.values() for o in olds} | {n for n, _ in new if n not in parts}
    old = [n for n in state if n in old_params]  # the state dict's order is named_parameters' (buffers aside)
    old_order = [n for n in old if decays(n, state[n])] + [n for n in old if not decays(n, state[n])]
    new_order = [n for n, p in new if decays(n, p)] + [n for n, p in new if not decays(n, p)]
    opt = checkpoint["optimizer_states"][0]
    groups = opt.get("param_groups", [])
    if len(groups) != 2 or sum(len(g["params"]) for g in groups) != len(old_order):
        return
    index = {n: i for i, n in enumerate(old_order)}
    moved = {}
    for i, name in enumerate(new_order):
        olds = [opt["state"].get(index[o]) for o in parts.get(name, [name])]
        if any(s is None for s in olds):
            continue  # no state yet (never stepped): none
        moved[i] = {k: (torch.cat([s[k] for s in olds]) if isinstance(v, torch.Tensor) and v.ndim >= 1 else v)
                    for k, v in olds[0].items()}
    n_decay = sum(1 for n, p in new if decays(n, p))
    groups[0]["params"], groups[1]["params"] = list(range(n_decay)), list(range(n_decay, len(new_order)))
    opt["state"] = moved
