"""Trained to the end? The rule that keeps a best setting and a verdict from models that had not finished learning.

Rule (docs/sweeps.md)
---------------------
A finished member is **not trained to the end** when

* it **stopped short**: fewer optimizer steps than its config planned (max_epochs over the whole training split,
  or max_steps where that is set and smaller: a plan, as the LRA presets make it), cut by `limit_train_batches`,
  `max_time` or an interruption (mhalab.train.record.extent records both), unless early stopping ended it (its validation
  metric had stopped improving: that is an end); or
* it was **still improving**: the best of its last ``WINDOW`` validations beats the best before them by more than
  the margin, the smallest difference that matters (1 point of an accuracy by default): early stopping with
  patience ``WINDOW`` and ``min_delta`` = the margin would not have stopped it. A member with fewer than
  ``WINDOW + 1`` validations is not checked by this part.

A **best setting** is withheld when any member it is ranked on (finished, with a value) is not trained to the end;
a **verdict** ("not decided"), when any member of the groups it compares is. Either way the report says why in one
sentence and gives the command that would decide it: the same sweep without the limits that cut it short, or with
twice the planned length (max_epochs, or max_steps where that was the plan). A results.csv written before these columns (``planned_steps``, ``monitored_gain``) is not
checked, and its report says so.

The results table's columns: ``global_step`` and ``planned_steps`` (``steps_per_epoch`` over the whole training
split), ``stopped_early``, ``limit_*_batches``,
``val_evaluated`` / ``test_evaluated`` (the share of the split the metrics were computed on), ``validations``
and ``monitored_gain`` (best of the last WINDOW validations minus the best before them, > 0 = better, metric units).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from mhalab.analysis.report.stats import points_scale, valid_mask
from mhalab.analysis.report.values import finite, fmt_num, to_float

WINDOW = 3  # the last validations a member must have stopped improving over
# overrides that cut a run (or its evaluation) short: the command that decides a withheld result drops them
CUTTING = ("trainer.limit_train_batches", "trainer.limit_val_batches", "trainer.limit_test_batches",
           "trainer.max_time")
COLUMNS = ("planned_steps", "steps_per_epoch", "stopped_early", "limit_train_batches", "limit_val_batches", "limit_test_batches",
           "val_evaluated", "test_evaluated", "validations", "monitored_gain")


def recent_gain(values: Sequence[float], higher: bool = True) -> float:
    """The best of the last WINDOW values minus the best before them (> 0: improved), NaN with too few values."""
    v = [float(x) for x in values if finite(to_float(x))]
    if len(v) < WINDOW + 1:
        return math.nan
    sign = 1.0 if higher else -1.0
    return sign * ((max if higher else min)(v[-WINDOW:]) - (max if higher else min)(v[:-WINDOW]))


def checked(df: pd.DataFrame) -> bool:
    """Whether the table holds what the rule reads (a results.csv written before it does not)."""
    return "planned_steps" in df and pd.to_numeric(df["planned_steps"], errors="coerce").notna().any()


def stopped_short(df: pd.DataFrame) -> pd.Series:
    """Members that ran fewer optimizer steps than planned, not ended by early stopping (the rule's first part)."""
    steps, planned = (pd.to_numeric(df[c], errors="coerce") for c in ("global_step", "planned_steps"))
    early = df["stopped_early"].map(lambda x: str(x).lower() == "true") if "stopped_early" in df else False
    return ((steps < planned) & ~early).fillna(False).astype(bool)


def still_improving(df: pd.DataFrame, margin: float) -> pd.Series:
    """Members whose metric rose by more than the margin over their last WINDOW validations (its second part)."""
    gain = pd.to_numeric(df["monitored_gain"], errors="coerce") if "monitored_gain" in df else pd.Series(
        math.nan, index=df.index)
    return (gain > margin).fillna(False).astype(bool)


def not_trained_mask(df: pd.DataFrame, margin: float) -> pd.Series:
    """Members not trained to the end (the module's rule); margin in metric units. False where not recorded."""
    if not checked(df):
        return pd.Series(False, index=df.index)
    return stopped_short(df) | still_improving(df, margin)


def limit_values(values: pd.Series) -> list[str]:
    """The distinct limit_*_batches of a column other than the whole split (Lightning's 1.0), as written: 10, 0.25
    (kept as text: the int 1, one batch, is not the float 1.0, every batch)."""
    return sorted({str(v) for v in values.dropna()} - {"1.0", "nan"}, key=lambda v: float(v))


def span(values: pd.Series) -> str:
    """'770' or '10–20' (the smallest and largest), '?' when none."""
    v = pd.to_numeric(values, errors="coerce").dropna()
    if v.empty:
        return "?"
    lo, hi = (f"{int(x):,}" for x in (v.min(), v.max()))
    return lo if lo == hi else f"{lo}–{hi}"


def why(df: pd.DataFrame, metric: str, margin: float) -> str:
    """What the members of df that are not trained to the end did, in words: 'each stopped at step 10 of 770 planned,
    limit_train_batches=10', '2 still improving, val/acc up 3.10 pts at most over the last 3 validations'."""
    short, improving = stopped_short(df), still_improving(df, margin) & ~stopped_short(df)
    parts = []
    if short.any():
        s = df[short]
        limits = limit_values(s["limit_train_batches"])
        who = "each" if short.all() else str(int(short.sum()))
        parts.append(f"{who} stopped at step {span(s['global_step'])} of {span(s['planned_steps'])} planned"
                     + (f", limit_train_batches={', '.join(limits)}" if limits else ""))
    if improving.any():
        scale, unit = points_scale(metric)
        gain = pd.to_numeric(df.loc[improving, "monitored_gain"], errors="coerce")
        who = "each" if improving.all() else str(int(improving.sum()))
        parts.append(f"{who} still improving, {metric} up {gain.max() * scale:.2f}{unit} at most over the last "
                     f"{WINDOW} validations")
    return " and ".join(parts)


def presets(df: pd.DataFrame) -> list[str]:
    """The `sweep=<preset>` words every member was run with (a preset is no part of a setting)."""
    runs = [set(str(o).split()) for o in df["overrides"].dropna()] if "overrides" in df else []
    return sorted(w for w in set.intersection(*runs) if w.startswith("sweep=")) if runs else []


def deciding_command(df: pd.DataFrame, members: pd.DataFrame, margin: float) -> str:
    """The command that would decide it: the sweep again without the overrides that cut it short, and with twice
    the epochs where members were still improving; then mhalab-report on its dir."""
    common = [w for w in df.attrs.get("common", []) if w.lstrip("+~").split("=", 1)[0] not in CUTTING]
    words = presets(df) + [w for w in common if w.lstrip("+~").split("=", 1)[0] not in ("max_epochs",
                                                                                        "trainer.max_epochs")]
    if not presets(df):  # no preset: the swept values and the seeds, as -m takes them
        from mhalab.analysis.report.collect import parse_setting

        swept: dict[str, list[str]] = {}
        for setting in df["setting"].drop_duplicates():
            for k, v in parse_setting(str(setting)).items():
                text = fmt_num(v) if isinstance(v, float) else str(v)
                if text not in swept.setdefault(k, []):
                    swept[k].append(text)
        seeds = sorted({str(int(s)) for s in pd.to_numeric(df["seed"], errors="coerce").dropna()}, key=int)
        words = ["-m", *(f"{k}={','.join(v)}" for k, v in swept.items()), *([f"seed={','.join(seeds)}"] if seeds
                                                                             else []), *words]
    epochs, planned, per_epoch = (pd.to_numeric(df[c], errors="coerce").dropna().max() if c in df else math.nan
                                  for c in ("max_epochs", "planned_steps", "steps_per_epoch"))
    if still_improving(members, margin).any() and finite(planned):  # twice the plan: its epochs, or its max_steps
        by_steps = finite(epochs) and finite(per_epoch) and planned < epochs * per_epoch
        words.append(f"++trainer.max_steps={int(planned) * 2}" if by_steps or not finite(epochs)
                     else f"max_epochs={int(epochs) * 2}")
    else:
        words += [w for w in common if w not in words and w.lstrip("+~").split("=", 1)[0] in
                  ("max_epochs", "trainer.max_epochs")]
    return f"`mhalab-train {' '.join(words)}`, then `mhalab-report` on its sweep dir"


def withheld(df: pd.DataFrame, members: pd.DataFrame, metric: str, margin: float) -> str | None:
    """Why a result resting on `members` (rows of df) is withheld, one sentence with the command that would decide
    it; None when each of them was trained to the end (or the table does not say)."""
    mask = not_trained_mask(members, margin)
    if not mask.any():
        return None
    return (f"{int(mask.sum())} of {len(members)} members were not trained to the end ({why(members, metric, margin)}), "
            f"so more training could change it; to decide it, run {deciding_command(df, members, margin)}.")


def best_withheld(df: pd.DataFrame, metric: str, margin: float) -> str | None:
    """The sentence that withholds the sweep's best setting (ranked on every finished member with a value)."""
    return withheld(df, df[valid_mask(df)], metric, margin)


def evaluated_share(values: pd.Series) -> str:
    """'100%' or '17%' or '17–20%' of the split, '?' when not recorded."""
    v = pd.to_numeric(values, errors="coerce").dropna()
    if v.empty:
        return "?"
    lo, hi = (f"{x:.0%}" for x in (v.min(), v.max()))
    return lo if lo == hi else f"{lo}–{hi}"
