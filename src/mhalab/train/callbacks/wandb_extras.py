"""WandbExtras: what W&B can show beyond scalars, opt-in (`mhalab-train logger=wandb callbacks=wandb_extras`).

* `watch`: wandb.watch through the WandbLogger: histograms of the gradients (or parameters, or both) every
  `log_freq` steps;
* `predictions`: a table of the test split's predictions (text, true label, predicted label, confidence, correct),
  the first `max_predictions` test examples, logged as `test/predictions` once the test ends;
* attention maps come from AttentionMapLogger, which conf/callbacks/wandb_extras.yaml switches on too.

Without a WandbLogger in the run (logger=csv, say), it logs one warning and does nothing.
"""

from __future__ import annotations

import logging

import lightning as L
import torch

log = logging.getLogger("mhalab")

WATCH = ("gradients", "parameters", "all", None)


class WandbExtras(L.Callback):
    def __init__(self, watch: str | None = "gradients", log_freq: int = 100, predictions: bool = True,
                 max_predictions: int = 1000):
        if watch not in WATCH:
            raise ValueError(f"watch={watch!r}: choose one of gradients, parameters, all, or null.")
        self.watch, self.log_freq = watch, int(log_freq)
        self.predictions, self.max_predictions = bool(predictions), int(max_predictions)
        self._rows: list[list] = []

    @staticmethod
    def _wandb(trainer):
        return next((lg for lg in trainer.loggers if type(lg).__name__ == "WandbLogger"), None)

    def on_fit_start(self, trainer, pl_module):
        logger = self._wandb(trainer)
        if logger is None:
            log.warning("callbacks.wandb_extras is on, but the run has no W&B logger (add logger=wandb); "
                        "nothing extra is logged")
            return
        if self.watch and trainer.is_global_zero:
            logger.watch(pl_module, log=self.watch, log_freq=self.log_freq)

    def on_test_epoch_start(self, trainer, pl_module):
        self._rows = []

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if not self.predictions or len(self._rows) >= self.max_predictions or self._wandb(trainer) is None:
            return
        with torch.no_grad():  # one more forward pass over the logged examples: the table is opt-in
            probs = pl_module(batch["input_ids"], batch["padding_mask"], seqlens=batch["seqlens"]).float().softmax(-1)
        conf, pred = probs.max(-1)
        names = pl_module.label_names  # one name per class (Classifier: the data's, else "0".."K-1")
        tokenizer = getattr(trainer.datamodule, "tokenizer", None) if trainer.datamodule else None
        ids, pad = batch["input_ids"].cpu(), batch["padding_mask"].cpu()
        for i in range(len(ids)):
            if len(self._rows) >= self.max_predictions:
                break
            real = ids[i][~pad[i]].tolist()
            text = tokenizer.decode(real) if tokenizer is not None else " ".join(map(str, real))
            true, guess = int(batch["labels"][i]), int(pred[i])
            self._rows.append([text, names[true], names[guess], float(conf[i]), true == guess])

    def on_test_epoch_end(self, trainer, pl_module):
        logger = self._wandb(trainer)
        if logger is None or not self._rows or not trainer.is_global_zero:
            return
        logger.log_table(key="test/predictions", columns=["text", "label", "predicted", "confidence", "correct"],
                         data=self._rows)
