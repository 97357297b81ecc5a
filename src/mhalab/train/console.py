"""What a run prints: none of the noise a user cannot act on (`quiet`), and at the end a summary of what it
reached, with which checkpoint, and where its files are (`summary`):

    finished in 39 s (fit 35 s, 40 steps): outputs/2026-12-04/23-10-00_123ab
      trained 40 of 40 planned steps (2 of 2 epochs)
      best   epoch01-acc0.5781.ckpt, after epoch 2 of 2 (step 40): what mhalab-eval and mhalab-predict load
      val    acc 57.81%  macro-F1 57.36%  loss 0.6835
      test   acc 57.50%  macro-F1 56.60%  loss 0.6853
      files  metrics.json, loss_curves.png, confusion_test.png, logs/metrics.csv

Every figure is read from the run's record (mhalab.train.record), so the console and metrics.json agree. A run cut
short (limit_train_batches, max_steps, max_time) says so on its `trained` line, and a split evaluated in part
(limit_val_batches, limit_test_batches) on its line: `test   acc 48.75% (on 320 of 500 examples, 64%:
limit_test_batches=5)` (mhalab.train.record.extent).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

from mhalab.train import record
from mhalab.train.record import extent

# Lightning's rank-zero notes that advertise its platform or describe its own defaults
LIGHTNING_NOISE = ("💡 Tip:", "Trainer already configured with model summary callbacks",
                   "Loading `train_dataloader` to estimate number of stepping batches")
WARNING_NOISE = (
    # every mid-epoch resume: ours is resumable, the datamodule's state_dict restores the sampler's position
    "You're resuming from a checkpoint that ended before the epoch",
    # torch 2.13 deprecates a check inside Lightning's own code
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # a small data set: callbacks.LogEveryEpoch lowers the interval to the batches of an epoch
    "The number of training batches .* is smaller than the logging interval",
)


class _DropNoise(logging.Filter):
    def filter(self, rec: logging.LogRecord) -> bool:
        return not str(rec.msg).startswith(LIGHTNING_NOISE)


# Lightning's loggers, which get console handlers of their own at import (lightning: always; lightning.pytorch
# and lightning.fabric: when the root logger has none yet, and then they stop propagating)
LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """For the length of a run: Lightning's tips and notes about its defaults, and the warnings listed above, are
    not shown. Everything else (and every real warning) is.

    Where the root logger has handlers (a Hydra job: the console and the run's cli.log), Lightning's lines go
    through those only: with its own handlers as well, each line was printed twice in a sweep, and a run's cli.log
    missed them."""
    noise, logger = _DropNoise(), logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addFilter(noise)
    routed = [logging.getLogger(n) for n in LIGHTNING_LOGGERS] if logging.getLogger().handlers else []
    saved = [(lg, lg.handlers[:], lg.propagate) for lg in routed]
    for lg in routed:
        lg.handlers.clear()
        lg.propagate = True
    try:
        with warnings.catch_warnings():
            for message in WARNING_NOISE:
                warnings.filterwarnings("ignore", message=message)
            yield
    finally:
        logger.removeFilter(noise)
        for lg, handlers, propagate in saved:
            lg.handlers[:], lg.propagate = handlers, propagate


def duration(seconds: float) -> str:
    """47 s, 2 min 41 s, 1 h 05 min."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _split(best: dict, split: str, trained: dict) -> str | None:
    if f"{split}/acc" not in best:
        return None
    parts = [f"acc {best[f'{split}/acc']:.2%}{extent.evaluated_note(trained, {'val': 'validation'}.get(split, split))}"]
    if f"{split}/f1" in best:
        parts.append(f"macro-F1 {best[f'{split}/f1']:.2%}")
    if f"{split}/loss" in best:
        parts.append(f"loss {best[f'{split}/loss']:.4f}")
    return "  ".join(parts)


def summary(rec: dict, out: Path) -> str:
    """The summary of a finished run's record `rec`, written into the run dir `out`."""
    best = record.best(rec)
    steps = rec.get("global_step")
    took = f"{duration(rec.get('wall_time_s', 0.0))} (fit {duration(rec.get('fit_time_s', 0.0))}"
    took += f", {steps:,} steps)" if steps is not None else ")"
    lines = [f"{rec['status']} in {took}: {out}"]
    trained = rec.get("trained") or {}
    if trained:
        lines.append(f"  trained {extent.training_line(trained)}")
    if model := rec.get("model"):
        implicit = " (dim / heads)" if model.get("head_dim_from") == "dim / heads" else ""
        lines.append(f"  model  dim {model['dim']}, {model['heads']} heads of head_dim {model['head_dim']}{implicit}, "
                     f"{model['layers']} layer{'s' * (model['layers'] != 1)}")
    if best.get("checkpoint"):
        when = ""
        if "epoch" in best:
            when = f", after epoch {best['epoch'] + 1} of {rec.get('epochs')} (step {best['step']:,})"
        lines.append(f"  best   {Path(best['checkpoint']).name}{when}: what mhalab-eval and mhalab-predict load")
    for split in ("val", "test"):
        if (text := _split(best, split, trained)) is not None:
            lines.append(f"  {split:<6} {text}")
    if "test/acc" not in best:
        lines.append("  test   not run (test_after_fit=false, or the data have no test split)")
    if note := extent.resolution_note(((trained.get("evaluated") or {}).get("validation") or [None])[0]):
        lines.append(f"  note   {note}")
    files = [f for f in ("metrics.json", "loss_curves.png", "confusion_test.png", "logs/metrics.csv") if (out / f).exists()]
    lines.append(f"  files  {', '.join(files)}")
    return "\n".join(lines)
