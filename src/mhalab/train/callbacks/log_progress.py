"""LogProgress: a line every `every_s` seconds while a run trains with no terminal to draw a progress bar on.

A run in a batch job or under `nohup ... > log` has no terminal, so Lightning's progress bar is off or silent, and
nothing appeared for ~10 minutes an epoch: a run could not be told from a hung one. Then this callback logs

    step 200 / 400 (50%)  epoch 1 / 3  loss 0.5897  16,610 tok/s  ETA 10 s

where the counts are optimizer steps against the run's plan (trainer.estimated_stepping_batches), tok/s the real
(non-pad) tokens trained per second since the last line, and ETA the steps left at the rate since training started.
With a terminal (stdout a tty) it stays quiet: the progress bar shows the same.
"""

from __future__ import annotations

import logging
import math
import sys
import time

import lightning as L

from mhalab.train.callbacks.throughput import batch_tokens

log = logging.getLogger("mhalab")


def eta_text(seconds: float) -> str:
    """'1 min 42 s', '2 h 05 min', '8 s'."""
    seconds = max(0, round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
    if seconds >= 60:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds} s"


class LogProgress(L.Callback):
    """Log step / planned, loss, tok/s and ETA every `every_s` seconds of training when stdout is not a terminal
    (`always=True`: with a terminal too)."""

    def __init__(self, every_s: float = 30.0, always: bool = False):
        self.every_s, self.always = every_s, always
        self.lines: list[str] = []  # what it logged, for the tests
        self._start = self._last = 0.0
        self._start_step = 0
        self._tokens = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.active = self.always or not sys.stdout.isatty()
        self._start = self._last = time.monotonic()
        self._start_step, self._tokens = trainer.global_step, 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if not getattr(self, "active", False) or not trainer.is_global_zero:
            return
        self._tokens += batch_tokens(batch)
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        step, planned = trainer.global_step, trainer.estimated_stepping_batches
        rate = (step - self._start_step) / max(now - self._start, 1e-9)  # steps a second since training started
        loss = trainer.callback_metrics.get("train/loss")
        parts = [f"step {step:,}" + (f" / {int(planned):,} ({step / planned:.0%})" if math.isfinite(planned) else ""),
                 f"epoch {trainer.current_epoch + 1} / {trainer.max_epochs}" if (trainer.max_epochs or 0) > 0 else "",
                 f"loss {float(loss):.4f}" if loss is not None else "",
                 f"{self._tokens / (now - self._last):,.0f} tok/s",
                 f"ETA {eta_text((planned - step) / rate)}" if math.isfinite(planned) and rate > 0 else ""]
        line = "  ".join(p for p in parts if p)
        self.lines.append(line)
        log.info(line)
        self._last, self._tokens = now, 0
