"""EMA: an exponential moving average of the weights, validated, checkpointed and tested in their place.

`mhalab-train callbacks=ema` (conf/callbacks/ema.yaml). After every optimizer step

    ema = d_t * ema + (1 - d_t) * w,    d_t = min(decay, (1 + t) / (10 + t))    (t: updates so far)

the warm-up of d_t (timm's ModelEmaV2/V3) keeps the first steps' weights, still near the random init, from
dominating the average. Lightning's WeightAveraging does the bookkeeping: validation (and so the choice of
the best checkpoint) sees the averaged weights, and every checkpoint's `state_dict` holds them (the raw weights
ride along as `current_model_state`, for a resume). So the evaluation after fit (run.py loads the best
checkpoint), `mhalab-eval`, `mhalab-predict` and `mhalab-ensemble`, which read `state_dict`, use the averaged
weights.

Three changes to WeightAveraging. Fit ends with the raw weights in the model: WeightAveraging copies the
average over them at the end of fit, before the step checkpoint's final last.ckpt is written (Lightning runs
checkpoint callbacks last), and that checkpoint's `current_model_state` would be the average, so a run resumed
from it for more epochs would go on from the average. Loading a checkpoint outside fit keeps its `state_dict`
(WeightAveraging would load the raw `current_model_state` over it). Only fit's validation swaps the weights
(WeightAveraging would swap in the average it kept from fit on `trainer.validate` but not on `trainer.test`,
so val and test would score different weights). Only parameters are averaged: the model's buffers are
constants.

Fine-tuning only: `pretrain=mlm` pretrains without it.
"""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import WeightAveraging

from mhalab.train.optimizer import check_decay


def ema_with_warmup(decay: float):
    """AveragedModel's multi_avg_fn: lerp each averaged tensor towards the current one by 1 - d_t."""

    def update(averaged: list[torch.Tensor], current: list[torch.Tensor], num_averaged: torch.Tensor) -> None:
        t = int(num_averaged)  # updates before this one (AveragedModel copies the weights at the first)
        d = min(decay, (1 + t) / (10 + t))
        torch._foreach_lerp_(averaged, current, 1.0 - d)

    return update


class EMA(WeightAveraging):
    def __init__(self, decay: float = 0.99):
        check_decay(decay)
        super().__init__(use_buffers=False, multi_avg_fn=ema_with_warmup(decay))

    def on_train_end(self, trainer, pl_module):
        pass  # the raw weights stay (see the module's docstring)

    def on_validation_epoch_start(self, trainer, pl_module):
        if trainer.state.fn == "fit":
            super().on_validation_epoch_start(trainer, pl_module)

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.state.fn == "fit":
            super().on_validation_epoch_end(trainer, pl_module)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.state.fn == "fit":  # a resume: the average and the raw weights both come back
            super().on_load_checkpoint(trainer, pl_module, checkpoint)
