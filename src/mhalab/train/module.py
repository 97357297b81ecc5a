"""LightningModule: cross-entropy training of a SequenceClassifier, with per-split and per-class metrics.

Logged by the module: train/loss, train/acc and train/pad_frac (per step, on the steps the loggers write:
mhalab.train.log_steps), train/acc_epoch (the epoch's accuracy), {val,test}/{loss,acc,f1} (per epoch; f1 is the
macro average), and with at most MAX_LOGGED_CLASSES classes {val,test}/f1_<label> per class (per epoch). Throughput (real tokens,
samples, FLOPs, MFU on CUDA) is logged by the callback mhalab.train.callbacks.throughput.RealTokenThroughput from
`flops_per_batch`, set here per training batch; the learning rate by LearningRateMonitor.
After each validation epoch and each test, `class_reports["validation" | "test"]` holds the per-class
report (mhalab.train.record.class_report: precision, recall, f1, support, confusion matrix, macro averages).
"""

from __future__ import annotations

import inspect
import logging
import re

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MetricCollection
from torchmetrics.classification import (
    MulticlassAccuracy,
    MulticlassConfusionMatrix,
    MulticlassF1Score,
    MulticlassPrecision,
    MulticlassRecall,
)

from mhalab.model import ATTENTION_OPTIONS, SequenceClassifier
from mhalab.nn.flops import train_flops
from mhalab.train.callbacks.throughput import batch_tokens
from mhalab.train.common_random import keyed_init_
from mhalab.train.log_steps import loggers_write
from mhalab.train.optimizer import (
    adamw_with_schedule,
    check_label_smoothing,
    check_schedule,
    upgrade_article_keys,
)
from mhalab.train.record.class_report import build_report, default_labels

log = logging.getLogger("mhalab")

MAX_LOGGED_CLASSES = 20  # per-class f1 goes to the loggers up to this many classes (class_reports: always)
SPLITS = {"val": "validation", "test": "test"}  # log prefix -> class_reports key


def _per_class_metrics(num_classes: int) -> MetricCollection:
    """Epoch-level per-class scores and the confusion matrix, counted over the whole split.

    Not synced across DDP ranks, on purpose: the evaluation loaders are not sharded (the datamodule's
    _sampler: every rank sees every example once), so each rank's counts already are the split's, and
    summing them over ranks would count every example world-size times (a 64-example split read 128 on
    2 ranks). An evaluation sharded across ranks would need sync_on_compute=True here.
    """
    kw = {"sync_on_compute": False}
    return MetricCollection({
        "precision": MulticlassPrecision(num_classes, average=None, **kw),
        "recall": MulticlassRecall(num_classes, average=None, **kw),
        "f1": MulticlassF1Score(num_classes, average=None, **kw),
        "confusion": MulticlassConfusionMatrix(num_classes, **kw),
    })


def _log_name(label: str) -> str:
    return re.sub(r"[^0-9A-Za-z_.-]+", "_", str(label)).strip("_") or "_"


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
        label_smoothing: float = 0.0,
        compile: bool = False,
        checkpoint_extras: dict | None = None,
        label_names: list[str] | None = None,
        encoder: dict | None = None,
        init_seed: int | None = None,
    ):
        super().__init__()
        check_schedule(schedule)
        check_label_smoothing(label_smoothing)
        if label_names is not None and len(label_names) != num_classes:
            raise ValueError(f"label_names has {len(label_names)} names ({list(label_names)}) for "
                             f"num_classes={num_classes}; give one name per class, or none.")
        self.save_hyperparameters(ignore=["checkpoint_extras", "encoder"])  # the extras have their own entry, below
        self.model = SequenceClassifier(vocab_size=vocab_size, num_classes=num_classes, pad_id=pad_id, **model)
        if init_seed is not None:  # init_draw=keyed: each weight keyed by (seed, its name), not by construction order
            keyed_init_(self.model, init_seed)
        if encoder is not None:  # a pretrained start (mhalab.train.pretrain.stage): every weight but the head
            self.model.load_encoder(encoder)
        # one sequence of max_len real tokens: the model summary counts each module's FLOPs on it (its FLOPs column).
        # Not for model=official: in eval PyTorch's layers pass nested tensors, whose shapes Lightning's summary
        # cannot read (it would fail); its FLOPs column reads 0 there.
        if model.get("encoder", "custom") == "custom":
            self.example_input_array = torch.full((1, int(model.get("max_len", 128))), 1 + (pad_id == 1),
                                                  dtype=torch.long)
        if compile:  # in place: state_dict keys (and checkpoints) are the same with and without compile
            if self.model.compile_positionwise():
                log.info("compile=true: each encoder layer's position-wise half compiled; attention runs eager "
                         "(its calls are planned per batch from the lengths)")
            else:
                log.warning("compile=true: nothing compiled (model=official: PyTorch's layers run eager)")
        metrics = MetricCollection({
            "acc": MulticlassAccuracy(num_classes, average="micro"),
            "f1": MulticlassF1Score(num_classes, average="macro"),
        })
        # under one ModuleDict: they move with the model, and the model summary shows them as one group
        # (their states are not persistent: checkpoints hold no metric keys, whatever their attribute names)
        self.metrics = torch.nn.ModuleDict({
            "train_acc": MulticlassAccuracy(num_classes, average="micro"),
            "val": metrics.clone(prefix="val/"), "test": metrics.clone(prefix="test/"),
            "val_classes": _per_class_metrics(num_classes), "test_classes": _per_class_metrics(num_classes),
        })
        self.label_names = [str(x) for x in label_names] if label_names is not None else default_labels(num_classes)
        self.class_reports: dict[str, dict] = {}  # "validation" / "test" -> class_report.build_report(...)
        # what the FLOPs of a batch depend on: the model's config with SequenceClassifier's defaults filled in
        defaults = {k: p.default for k, p in inspect.signature(SequenceClassifier).parameters.items()
                    if p.default is not inspect.Parameter.empty}
        self._flops_cfg = {**defaults, **model, "num_classes": num_classes}
        self._flops_cfg["attention_options"] = {**ATTENTION_OPTIONS, **(model.get("attention_options") or {})}
        # FLOPs of the last training batch (forward + backward), read by Lightning's ThroughputMonitor
        self.flops_per_batch: int | None = None
        self.token_counts = [0, 0]  # (real tokens, pad tokens) trained on: host ints from the batches' shapes
        self._nonfinite = None  # on CUDA: a device flag, set by a non-finite loss, read at the logging interval
        self._step_values = None  # (loss, logits, labels, pad fraction) of the last training batch: on_train_batch_end
        # what makes a checkpoint self-contained beside the weights (where the datamodule's state, with the
        # tokenizer, is saved; the data config; the W&B run id), written as checkpoint["mhalab"]
        self._extras: dict = dict(checkpoint_extras or {})

    def forward(self, input_ids, padding_mask=None, seqlens=None):
        return self.model(input_ids, padding_mask, seqlens=seqlens)

    def _logits(self, batch):
        """A collated batch's logits: padded (Collate) or packed (PackedCollate), with its host-side lengths."""
        return self(batch["input_ids"], batch.get("padding_mask"), seqlens=batch.get("seqlens"))

    def training_step(self, batch, batch_idx):
        logits = self._logits(batch)
        # the training loss only: val/test loss stay the plain cross-entropy, comparable across settings
        loss = F.cross_entropy(logits, batch["labels"], label_smoothing=self.hparams.label_smoothing)
        self._check_finite(loss, batch_idx)
        # host ints only (shapes and the collate's num_tokens): no device sync
        real = batch_tokens(batch)
        pads = batch["input_ids"].numel() - real if batch["input_ids"].dim() == 2 else 0  # packed: none
        self.token_counts = [self.token_counts[0] + real, self.token_counts[1] + pads]
        self.flops_per_batch = self.batch_flops(batch)  # read by the throughput callback
        self.metrics["train_acc"].update(logits.detach(), batch["labels"])  # the epoch's: train/acc_epoch
        self._step_values = (loss.detach(), logits.detach(), batch["labels"], pads / (real + pads))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        """This step's loss, accuracy and padding, logged only on the steps whose values the loggers write
        (mhalab.train.log_steps: every log_every_n_steps, and a step the run stops at), after every callback's hook.
        The progress bar shows the loss from those steps too: on a GPU it reads it as a Python float, a host sync, so
        once per interval is what a GPU step can afford, and on CPU a self.log a step is ~1% of the step."""
        if not loggers_write(self.trainer):
            return
        loss, logits, labels, pad_frac = self._step_values
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", (logits.argmax(-1) == labels).float().mean())  # MulticlassAccuracy(micro)'s value
        self.log("train/pad_frac", pad_frac)

    def on_train_epoch_end(self):
        # the epoch's accuracy over its batches: Lightning computes the metric and resets it after this hook (an
        # epoch that trained no batch here, a run resumed at its very end, has none: nothing is logged, as before)
        if self.metrics["train_acc"].update_called:
            self.log("train/acc_epoch", self.metrics["train_acc"], on_step=False, on_epoch=True)

    def _check_finite(self, loss, batch_idx) -> None:
        """Stop on a NaN / inf loss. On CPU at once (reading a CPU tensor costs nothing); on a GPU a device flag
        gathers every step's verdict and is read once per logging interval, so the step never waits for the
        device (a per-step check would be a host sync). Then the message names the interval, not the step."""
        if loss.device.type == "cpu":
            if not torch.isfinite(loss):
                self._raise_nonfinite(f"loss is {loss.item()} at global step {self.global_step} (epoch "
                                      f"{self.current_epoch}, batch {batch_idx})")
            return
        bad = ~torch.isfinite(loss.detach())
        self._nonfinite = bad if self._nonfinite is None else self._nonfinite | bad
        every = max(1, getattr(self.trainer, "log_every_n_steps", 50))
        if (self.global_step + 1) % every == 0:
            flag, self._nonfinite = self._nonfinite, None
            if bool(flag):  # the one sync per interval
                first = self.global_step + 1 - every
                self._raise_nonfinite(f"loss became NaN or infinite between global steps {first} and "
                                      f"{self.global_step} (epoch {self.current_epoch})")

    def _raise_nonfinite(self, what: str) -> None:
        raise NonFiniteLossError(
            f"{what}. Try a lower lr (now {self.hparams.lr}), gradient clipping, or "
            f"bf16-mixed instead of 16-mixed precision (fp16 overflows where bf16 does not)."
        )

    def batch_flops(self, batch) -> int:
        """FLOPs of one training step (forward + backward) on this collated batch (mhalab.nn.flops.train_flops),
        from host values only: the batch's shape, num_tokens and seqlens."""
        seqlens = batch.get("seqlens")
        if batch["input_ids"].dim() == 1:  # packed: as the batch padded to its longest sequence, unpadded
            B, L = seqlens.batch, seqlens.max_seqlen
        else:
            B, L = batch["input_ids"].shape
        # the SeqLens itself: its call plan, made by the forward, is reused (cached) rather than made again
        return train_flops(batch=B, seq_len=L, num_tokens=batch_tokens(batch), lengths=seqlens, **self._flops_cfg)

    def _eval_step(self, batch, metrics, classes, prefix):
        logits = self._logits(batch)
        loss = F.cross_entropy(logits, batch["labels"])
        metrics.update(logits, batch["labels"])
        classes.update(logits, batch["labels"])
        self.log(f"{prefix}/loss", loss, batch_size=len(batch["labels"]), sync_dist=True)
        self.log_dict(metrics, prog_bar=prefix == "val")

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch, self.metrics["val"], self.metrics["val_classes"], "val")

    def test_step(self, batch, batch_idx):
        self._eval_step(batch, self.metrics["test"], self.metrics["test_classes"], "test")

    def on_validation_epoch_end(self):
        self._class_report(self.metrics["val_classes"], "val")

    def on_test_epoch_end(self):
        self._class_report(self.metrics["test_classes"], "test")

    def _class_report(self, classes: MetricCollection, prefix: str) -> None:
        """The epoch's per-class report into class_reports (and per-class f1 to the loggers, for few classes)."""
        if not classes["confusion"].update_called or self.trainer.sanity_checking:
            classes.reset()  # the sanity check's counts must not leak into the first epoch
            return
        values = classes.compute()  # every rank evaluated the whole split: each has the totals (no sync)
        classes.reset()
        report = build_report(values["confusion"], values["precision"], values["recall"], values["f1"],
                              self.label_names)
        self.class_reports[SPLITS[prefix]] = report
        if len(self.label_names) <= MAX_LOGGED_CLASSES:
            names = [_log_name(x) for x in self.label_names]
            if len(set(names)) < len(names):  # two labels that differ only in odd characters: use indices
                names = default_labels(len(names))
            for name, f1 in zip(names, report["f1"]):
                self.log(f"{prefix}/f1_{name}", f1, sync_dist=True)  # equal on every rank: no warning

    def configure_optimizers(self):
        return adamw_with_schedule(self, self.hparams)

    @property
    def checkpoint_extras(self) -> dict:
        """A copy of what every checkpoint of this module carries under checkpoint["mhalab"]."""
        return dict(self._extras)

    def remember(self, **extras) -> None:
        """Write these entries into every checkpoint from now on (e.g. wandb_id, known once the logger starts)."""
        self._extras.update(extras)

    def on_save_checkpoint(self, checkpoint):
        # the token counters travel too, so a resumed run counts every token once, over all its attempts
        checkpoint["mhalab"] = dict(self._extras, token_counts=list(self.token_counts))

    def on_load_checkpoint(self, checkpoint):
        upgrade_article_keys(checkpoint, self)  # a resume of a run written before PyTorch's parameter names
        saved = dict(checkpoint.get("mhalab", {}))
        counts = saved.pop("token_counts", None)
        self._extras = {**saved, **self._extras}  # what this process was built with wins (a resumed run)
        if counts is not None:
            self.token_counts = [int(x) for x in counts]
