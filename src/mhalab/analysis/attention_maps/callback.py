"""AttentionMapLogger: an opt-in Lightning callback (`python train.py callbacks=attention_maps`) that draws
the attention maps of the first validation examples after validation epochs."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
from torch import Tensor

from mhalab.analysis.attention_maps.plot import figure_rgb, plot_attention_maps, save_png
from mhalab.analysis.attention_maps.tokens import position_labels, token_labels
from mhalab.analysis.attention_maps.weights import NoAttentionWeights, attention_weights, check_has_weights

log = logging.getLogger(__name__)


class AttentionMapLogger(L.Callback):
    """Draw the attention maps of the first `num_examples` validation examples after each
    `every_n_epochs`-th validation epoch; log them to TensorBoard / W&B loggers (others: PNG only) and
    save them as <run dir>/attention_maps/epoch<E>_ex<i>.png. Long examples are drawn over their first
    `max_tokens` queries and keys (the weights come from the full example). Models without explicit
    weights (linformer, performer) get one warning and no maps."""

    def __init__(self, num_examples: int = 2, every_n_epochs: int = 1, max_tokens: int = 64, save_png: bool = True):
        if num_examples < 1 or every_n_epochs < 1 or max_tokens < 2:
            raise ValueError("num_examples and every_n_epochs must be >= 1 and max_tokens >= 2.")
        self.num_examples, self.every_n_epochs, self.max_tokens = num_examples, every_n_epochs, max_tokens
        self.save_png = save_png
        self._examples: list[Tensor] | None = None  # each (T,): the real tokens of one validation example
        self._disabled = False
        self.saved: list[Path] = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if self._examples is not None or self._disabled or trainer.sanity_checking:
            return
        ids, pad = batch["input_ids"], batch["padding_mask"]
        self._examples = [ids[i][~pad[i]].detach().clone().cpu() for i in range(min(self.num_examples, len(ids)))]

    def on_validation_epoch_end(self, trainer, pl_module):
        if (self._disabled or not self._examples or trainer.sanity_checking or not trainer.is_global_zero
                or (trainer.current_epoch + 1) % self.every_n_epochs):
            return
        try:
            check_has_weights(pl_module)
        except NoAttentionWeights as e:
            log.warning("AttentionMapLogger: %s; no maps will be logged.", e)
            self._disabled = True
            return
        tokenizer = getattr(getattr(trainer, "datamodule", None), "tokenizer", None)
        for i, ids in enumerate(self._examples):
            _, weights = attention_weights(pl_module, ids.unsqueeze(0).to(pl_module.device))  # (1, H, L, L) each
            tokens = token_labels(tokenizer, ids.tolist()) if tokenizer is not None else [str(t) for t in ids.tolist()]
            labels = position_labels(pl_module, tokens)
            n = min(self.max_tokens, len(labels))
            crop = [w[0, :, :n, :n] for w in weights]
            title = (f"epoch {trainer.current_epoch}, validation example {i}"
                     f"{f' (first {n} of {len(labels)} positions)' if n < len(labels) else ''}")
            fig = plot_attention_maps(crop, labels[:n], None, title)
            self._log_figure(trainer, fig, f"attention_maps/example_{i}")
            if self.save_png:
                path = Path(trainer.default_root_dir) / "attention_maps" / f"epoch{trainer.current_epoch:03d}_ex{i}.png"
                self.saved.append(save_png(fig, path, dpi=100))

    @staticmethod
    def _log_figure(trainer, fig, tag: str) -> None:
        for lg in trainer.loggers:
            name = type(lg).__name__
            try:
                if name == "TensorBoardLogger":
                    lg.experiment.add_figure(tag, fig, global_step=trainer.global_step, close=False)
                elif name == "WandbLogger":
                    lg.log_image(key=tag, images=[figure_rgb(fig)])
            except Exception as e:  # noqa: BLE001 -- a logging problem must never stop training
                log.warning("AttentionMapLogger: could not log %s to %s: %s", tag, name, e)
