"""How much a run trained and evaluated against what its config planned: the record's `trained` (written by
mhalab.train.run), read by the end-of-run summary (mhalab.train.console) and the sweep report
(mhalab.analysis.report):

    "trained": {"steps": 10, "planned_steps": 770, "epochs": 1, "max_epochs": 10, "max_steps": -1,
                "steps_per_epoch": 77, "limit_train_batches": 10, "limit_val_batches": 1.0,
                "limit_test_batches": 5, "stopped_early": false,
                "evaluated": {"validation": [546, 546], "test": [320, 500]},
                "split_sizes": {"train": 4906, "validation": 546, "test": 500}}

* planned_steps: the optimizer steps the config asked for over the whole training split: max_epochs times an
  epoch's steps (its batches / accumulate_grad_batches), or max_steps when that is set and smaller (None when
  neither bounds the run). limit_train_batches, max_time or an interrupted attempt make a run stop short of it;
  EarlyStopping (`stopped_early`) does so on purpose: its validation metric had stopped improving.
* evaluated: per split, the examples the record's metrics were computed on against the split's size
  (limit_val_batches / limit_test_batches cut them); split_sizes: every split's examples.
* resolution: one validation example moves accuracy by 1 / its size; under RESOLVING_EXAMPLES (200) that is more
  than half a sweep's 1-point margin, and the summary and the sweep report say so (resolution_note).
"""

from __future__ import annotations

import math
from typing import Any


def train_batches(trainer: Any) -> int | None:
    """The batches of an epoch over the whole training split, read right after fit (Lightning applies
    limit_train_batches later, and forgets the loader at the next validate or test)."""
    loader = trainer.train_dataloader
    return len(loader) if loader is not None else None


def measure(trainer: Any, batches: int | None, split_sizes: dict[str, int], class_reports: dict[str, dict]) -> dict:
    """The `trained` record of a fitted Lightning trainer; batches: train_batches() after fit; split_sizes: examples
    per split ("validation", "test"); class_reports: the module's per-split reports (their support counts the
    examples evaluated)."""
    per_epoch = math.ceil(batches / trainer.accumulate_grad_batches) if batches else None
    bounds = []
    if per_epoch and trainer.max_epochs is not None and trainer.max_epochs >= 0:
        bounds.append(trainer.max_epochs * per_epoch)
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        bounds.append(trainer.max_steps)
    stopper = trainer.early_stopping_callback
    return {
        "steps": trainer.global_step, "planned_steps": min(bounds) if bounds else None,
        "epochs": trainer.current_epoch, "max_epochs": trainer.max_epochs, "max_steps": trainer.max_steps,
        "steps_per_epoch": per_epoch,
        **{f"limit_{s}_batches": getattr(trainer, f"limit_{s}_batches") for s in ("train", "val", "test")},
        "stopped_early": bool(stopper is not None and stopper.stopped_epoch > 0),
        "evaluated": {split: [int(sum(report["support"])), int(split_sizes[split])]
                      for split, report in class_reports.items() if split in split_sizes},
        "split_sizes": {split: int(n) for split, n in split_sizes.items()},
    }


MARGIN_POINTS = 1.0  # a sweep's default margin (mhalab.analysis.report.stats.DEFAULT_MARGIN), in points


def resolving_examples(margin_points: float = MARGIN_POINTS) -> int:
    """The validation examples at which one example moves accuracy by half the margin: 200 for 1 point."""
    return math.ceil(2 * 100 / margin_points)


def resolution_note(n_val: float | None, margin_points: float = MARGIN_POINTS) -> str:
    """'' when one validation example moves accuracy by at most half the margin, else the sentence that says it."""
    if not n_val or n_val >= resolving_examples(margin_points):
        return ""
    return (f"{int(n_val):,} validation examples: one example moves accuracy by {100 / n_val:.2f} points, more than "
            f"half of a ±{margin_points:g}-point margin, so differences near it are one or two examples; "
            f"{resolving_examples(margin_points):,} or more resolve it (a larger data.dev_split, or a validation file)")


def stopped_short(trained: dict) -> bool:
    """Fewer optimizer steps than planned, and not stopped by early stopping (False when not recorded)."""
    planned, steps = trained.get("planned_steps"), trained.get("steps")
    return planned is not None and steps is not None and steps < planned and not trained.get("stopped_early")


def _limit(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def training_line(trained: dict) -> str:
    """What the run trained against its plan, in words: '20 of 770 planned steps (2 of 10 epochs; each cut to
    limit_train_batches=10 of its 77 steps): stopped short of its plan'."""
    steps, planned = trained.get("steps"), trained.get("planned_steps")
    text = f"{steps:,} of {planned:,} planned steps" if planned is not None else f"{steps:,} steps (no planned length)"
    parts = [f"{trained.get('epochs')} of {trained.get('max_epochs')} epochs"]
    limit = trained.get("limit_train_batches")
    if limit is not None and not (isinstance(limit, float) and limit == 1.0) and trained.get("steps_per_epoch"):
        parts.append(f"each cut to limit_train_batches={_limit(limit)} of its {trained['steps_per_epoch']:,} steps")
    if trained.get("stopped_early"):
        parts.append("stopped by early stopping")
    text += f" ({'; '.join(parts)})"
    return text + (": stopped short of its plan" if stopped_short(trained) else "")


def evaluated_fraction(trained: dict, split: str) -> float | None:
    """The share of the split the metrics were computed on (None when not recorded)."""
    n, total = (trained.get("evaluated") or {}).get(split) or (None, None)
    return n / total if n is not None and total else None


def evaluated_note(trained: dict, split: str) -> str:
    """'' for the whole split, else ' (on 320 of 500 examples, 64%: limit_test_batches=5)'."""
    n, total = (trained.get("evaluated") or {}).get(split) or (None, None)
    if n is None or not total or n >= total:
        return ""
    key = {"validation": "val"}.get(split, split)
    return f" (on {n:,} of {total:,} examples, {n / total:.0%}: limit_{key}_batches={_limit(trained.get(f'limit_{key}_batches'))})"
