"""LightningModule: cross-entropy training of a SequenceClassifier, with per-split metrics.

Logged: train/loss (per step), train/pad_frac, train/tokens_per_s (real, non-pad tokens),
{val,test}/{loss,acc,f1} (per epoch), and the learning rate (LearningRateMonitor).
"""

from __future__ import annotations

import math
import time

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

from mhalab.model import SequenceClassifier

SCHEDULES = ("cosine", "linear", "constant")  # the lr after warmup (configure_optimizers)


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the run stops instead of training on garbage."""


class Classifier(L.LightningModule):
    def __init__(
        self,
        model: dict,
        vocab_size: int,
        num_classes: int,
        pad_id: int = 0,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.98),
        warmup_ratio: float = 0.06,
        schedule: str = "cosine",
        compile: bool = False,
        checkpoint_extras: dict | None = None,
    ):
        super().__init__()
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown optim.schedule '{schedule}'; choose one of {', '.join(SCHEDULES)}.")
        self.save_hyperparameters(ignore=["checkpoint_extras"])  # the extras have their own entry, below
        self.model = SequenceClassifier(vocab_size=vocab_size, num_classes=num_classes, pad_id=pad_id, **model)
        if compile:
            # in place, so state_dict keys (and checkpoints) are the same with and without compile
            self.model.compile(dynamic=True)  # dynamic: bucketed batches vary in length
        metrics = MetricCollection({
            "acc": MulticlassAccuracy(num_classes, average="micro"),
            "f1": MulticlassF1Score(num_classes, average="macro"),
        })
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")
        self._t_last: float | None = None
        self.token_counts = torch.zeros(2, dtype=torch.long)  # (real tokens, pad tokens) trained on
        # what makes a checkpoint self-contained beside the weights (where the datamodule's state, with the
        # tokenizer, is saved; the data config; the W&B run id), written as checkpoint["mhalab"]
        self._extras: dict = dict(checkpoint_extras or {})

    def forward(self, input_ids, padding_mask=None):
        return self.model(input_ids, padding_mask)

    def training_step(self, batch, batch_idx):
        logits = self(batch["input_ids"], batch["padding_mask"])
        loss = F.cross_entropy(logits, batch["labels"])
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"loss is {loss.item()} at global step {self.global_step} (epoch {self.current_epoch}, "
                f"batch {batch_idx}). Try a lower lr (now {self.hparams.lr}), gradient clipping, or "
                f"bf16-mixed instead of 16-mixed precision (fp16 overflows where bf16 does not)."
            )
        pad = batch["padding_mask"]
        real = (~pad).sum()
        if self.token_counts.device != pad.device:
            self.token_counts = self.token_counts.to(pad.device)
        self.token_counts += torch.stack([real, pad.sum()])  # stays on device: no sync per step
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/pad_frac", pad.float().mean())
        now = time.perf_counter()
        if self._t_last is not None:  # tokens/s over the whole step, data loading included
            self.log("train/tokens_per_s", real.float() * self.trainer.world_size / (now - self._t_last))
        self._t_last = now
        return loss

    def on_train_epoch_start(self):
        self._t_last = None  # do not count the validation pause as a slow training step

    def _eval_step(self, batch, metrics, prefix):
        logits = self(batch["input_ids"], batch["padding_mask"])
        loss = F.cross_entropy(logits, batch["labels"])
        metrics.update(logits, batch["labels"])
        self.log(f"{prefix}/loss", loss, batch_size=len(batch["labels"]), sync_dist=True)
        self.log_dict(metrics, prog_bar=prefix == "val")

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch, self.val_metrics, "val")

    def test_step(self, batch, batch_idx):
        self._eval_step(batch, self.test_metrics, "test")

    def configure_optimizers(self):
        hp = self.hparams
        # no weight decay on biases, norms and embeddings (standard for Transformers)
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2 and "embed" not in n]
        no_decay = [p for n, p in self.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr, betas=tuple(hp.betas), fused=self.device.type == "cuda",
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
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

    @property
    def checkpoint_extras(self) -> dict:
        """A copy of what every checkpoint of this module carries under checkpoint["mhalab"]."""
        return dict(self._extras)

    def remember(self, **extras) -> None:
        """Write these entries into every checkpoint from now on (e.g. wandb_id, known once the logger starts)."""
        self._extras.update(extras)

    def on_save_checkpoint(self, checkpoint):
        # the token counters travel too, so a resumed run counts every token once, over all its attempts
        checkpoint["mhalab"] = dict(self._extras, token_counts=self.token_counts.tolist())

    def on_load_checkpoint(self, checkpoint):
        saved = dict(checkpoint.get("mhalab", {}))
        counts = saved.pop("token_counts", None)
        self._extras = {**saved, **self._extras}  # what this process was built with wins (a resumed run)
        if counts is not None:
            self.token_counts = torch.tensor(counts, dtype=torch.long, device=self.token_counts.device)
