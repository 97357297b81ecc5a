"""Statistics over seeds: which members count, the per-setting summary, and the rule that compares two groups.

Selection rule
--------------
The best setting is the one with the best *mean over seeds* of the monitored metric (``best[metric]``
in ``metrics.json``: the best validation value over epochs). The monitored metric must not be a test
metric (ConfigError, a ValueError): the test columns are reported, never used to choose. Only members
with ``status == "finished"`` and a finite monitored value enter any statistic.

Verdict rule (the same for every claim; the claims and their groups: verdicts.py)
---------------------------------------------------------------------------------
For a claim the sweep covers, the finished members are split into the *claimed* group and one group
per *alternative*; each member contributes its own monitored value (one value per seed and setting;
other swept variables are pooled, i.e. these are marginal means).

* ``best alternative`` = the alternative group with the best mean (max for accuracy-like metrics,
  min for losses) -- selecting the best of several alternatives makes the test conservative for the
  claim.
* ``effect = mean(claimed) - mean(best alternative)``, signed so that > 0 means the claimed group is
  better (for a loss metric the sign is flipped). Reported in points (x100) for accuracy-like metrics.
* ``SE = sqrt(s_c^2/n_c + s_a^2/n_a)`` with ``s`` the std over the group's values (ddof=1) and ``n``
  their count: the standard error of the difference of the two means. ``threshold = 2 * SE``.
* **supported** when ``effect > threshold``; **not supported** when ``effect < -threshold``;
  **inconclusive** otherwise (the difference is within seed noise), and always inconclusive when
  either compared group has fewer than 2 distinct seeds (the noise cannot be measured) or is empty.
* ``seed spread`` reported alongside = the pooled within-group std of the two groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from mhalab.analysis.report.values import natural_key

DEFAULT_METRIC = "val/acc"  # the monitored metric unless told otherwise
SIGMA = 2.0  # verdict threshold = SIGMA * standard error of the difference of group means
MIN_SEEDS = 2  # fewer distinct seeds in a compared group -> inconclusive

SUPPORTED = "supported"
NOT_SUPPORTED = "not supported"
INCONCLUSIVE = "inconclusive"
NOT_COVERED = "not covered"


def higher_is_better(metric: str) -> bool:
    m = metric.lower()
    return not any(word in m for word in ("loss", "err", "perplexity", "ppl", "nll"))


def valid_mask(df: pd.DataFrame) -> pd.Series:
    """The members that enter statistics: finished, with a finite monitored value."""
    mon = pd.to_numeric(df["monitored"], errors="coerce")
    return (df["status"] == "finished") & np.isfinite(mon)


# --------------------------------------------------------------------------------------------------
# per-setting summary


def _std(x: pd.Series) -> float:
    x = pd.to_numeric(x, errors="coerce").dropna()
    return float(x.std(ddof=1)) if len(x) >= 2 else math.nan


def summarize_settings(df: pd.DataFrame, metric: str = DEFAULT_METRIC) -> pd.DataFrame:
    """Mean and std (ddof=1) over seeds per setting, best first (by the monitored metric)."""
    ok = valid_mask(df)
    rows = []
    for setting, g in df.groupby("setting", sort=False):
        v = g[ok.loc[g.index]]
        num = {c: pd.to_numeric(v[c], errors="coerce") for c in
               ("monitored", "best_val_acc", "test_acc", "wall_time_s", "tokens_per_s", "params")}
        rows.append({
            "setting": setting,
            "n": len(v),
            "seeds": sorted(v["seed"].dropna().tolist(), key=lambda s: natural_key(str(s))),
            "n_failed": int((~ok.loc[g.index]).sum()),
            "monitored_mean": float(num["monitored"].mean()) if len(v) else math.nan,
            "monitored_std": _std(num["monitored"]),
            "best_val_acc_mean": float(num["best_val_acc"].mean()) if len(v) else math.nan,
            "best_val_acc_std": _std(num["best_val_acc"]),
            "test_acc_mean": float(num["test_acc"].mean()) if len(v) else math.nan,
            "test_acc_std": _std(num["test_acc"]),
            "wall_time_mean": float(num["wall_time_s"].mean()) if len(v) else math.nan,
            "tokens_per_s_mean": float(num["tokens_per_s"].mean()) if len(v) else math.nan,
            "params": float(pd.to_numeric(g["params"], errors="coerce").dropna().median())
            if pd.to_numeric(g["params"], errors="coerce").notna().any() else math.nan,
        })
    s = pd.DataFrame(rows)
    if s.empty:
        return s
    key = s["monitored_mean"] if higher_is_better(metric) else -s["monitored_mean"]
    s = s.assign(_k=key).sort_values("_k", ascending=False, na_position="last", kind="stable")
    return s.drop(columns="_k").reset_index(drop=True)


# --------------------------------------------------------------------------------------------------
# two groups compared


@dataclass
class GroupStats:
    label: str
    n: int
    n_seeds: int
    mean: float
    std: float

    @classmethod
    def of(cls, label: str, sub: pd.DataFrame) -> GroupStats:
        vals = pd.to_numeric(sub["monitored"], errors="coerce").dropna().to_numpy(dtype=float)
        return cls(
            label=label,
            n=len(vals),
            n_seeds=int(sub["seed"].dropna().nunique()) if len(sub) else 0,
            mean=float(vals.mean()) if len(vals) else math.nan,
            std=float(vals.std(ddof=1)) if len(vals) >= 2 else math.nan,
        )


def compare_groups(claimed: pd.DataFrame, alternatives: dict[str, pd.DataFrame], metric: str,
                   claimed_label: str) -> dict:
    """The verdict rule of the module docstring, on members already restricted to valid ones."""
    sign = 1.0 if higher_is_better(metric) else -1.0
    c = GroupStats.of(claimed_label, claimed)
    alts = [GroupStats.of(label, sub) for label, sub in alternatives.items()]
    out: dict[str, Any] = {"claimed": c, "others": alts}
    with_data = [a for a in alts if a.n > 0]
    if c.n == 0 or not with_data:
        missing = claimed_label if c.n == 0 else "every alternative"
        out.update(verdict=INCONCLUSIVE, reason=f"no finished runs for {missing}")
        return out
    a = max(with_data, key=lambda g: sign * g.mean)
    out["alternative"] = a
    effect = sign * (c.mean - a.mean)
    out["effect"] = effect
    if c.n_seeds < MIN_SEEDS or a.n_seeds < MIN_SEEDS:
        out.update(verdict=INCONCLUSIVE,
                   reason=f"fewer than {MIN_SEEDS} seeds in a compared group ({c.label}: {c.n_seeds}, "
                          f"{a.label}: {a.n_seeds}): seed noise cannot be measured")
        return out
    se = math.sqrt(c.std ** 2 / c.n + a.std ** 2 / a.n)
    pooled = math.sqrt(((c.n - 1) * c.std ** 2 + (a.n - 1) * a.std ** 2) / (c.n + a.n - 2))
    threshold = SIGMA * se
    out.update(se=se, threshold=threshold, spread=pooled)
    if effect > threshold:
        out.update(verdict=SUPPORTED, reason=f"claimed group beats the best alternative by more than {SIGMA:g} SE")
    elif effect < -threshold:
        out.update(verdict=NOT_SUPPORTED,
                   reason=f"the best alternative beats the claimed group by more than {SIGMA:g} SE")
    else:
        out.update(verdict=INCONCLUSIVE, reason=f"difference within {SIGMA:g} SE (seed noise)")
    return out
