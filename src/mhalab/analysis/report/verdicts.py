"""Verdicts on the article's claims, each decided by the verdict rule of stats.py.

Claims and their groups (a claim is *covered* only when its variable varies across the sweep):

* ``head_dim not below 64``: head_dim = dim/heads takes values on both sides of 64;
  claimed = members with head_dim >= 64, alternative = members with head_dim < 64 (one pooled group).
* ``8 or 16 heads``: heads varies and includes 8 or 16 and some other value;
  claimed = heads in {8, 16} (pooled), alternatives = each other heads value.
* ``ff_dim = 4 x embed_dim``: the ratio ff_dim/dim varies and includes 4;
  claimed = ratio 4, alternatives = each other ratio.
* ``dropout 0.1``: dropout varies and includes 0.1; claimed = 0.1, alternatives = each other value.
* ``wider embed_dim is better``: dim varies; claimed = the widest dim of the sweep, alternatives = each
  narrower dim (so "supported" means the widest is clearly best, not merely better than the narrowest).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

from mhalab.analysis.report.stats import DEFAULT_METRIC, NOT_COVERED, GroupStats, compare_groups, valid_mask
from mhalab.analysis.report.values import finite, fmt_num

CLAIM_VARS = ("dim", "heads", "head_dim", "ff_ratio", "dropout")


@dataclass
class Verdict:
    key: str
    claim: str
    variable: str
    verdict: str
    reason: str
    covered: bool
    claimed: GroupStats | None = None
    alternative: GroupStats | None = None
    others: list[GroupStats] = field(default_factory=list)
    effect: float = math.nan  # claimed minus best alternative, > 0 = claimed better, metric units
    se: float = math.nan  # standard error of the difference
    threshold: float = math.nan  # SIGMA * se
    spread: float = math.nan  # pooled within-group std of the two compared groups
    also_varies: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _group_label(var: str, value: float) -> str:
    return f"{var}={fmt_num(value)}"


def _distinct(values: Iterable[float]) -> list[float]:
    out: list[float] = []
    for v in values:
        if finite(v) and not any(math.isclose(v, u, rel_tol=1e-9, abs_tol=1e-12) for u in out):
            out.append(float(v))
    return sorted(out)


def _by_value(valid: pd.DataFrame, var: str, values: list[float]) -> dict[str, pd.DataFrame]:
    col = pd.to_numeric(valid[var], errors="coerce")
    return {_group_label(var, v): valid[np.isclose(col, v)] for v in values}


def _claim_specs() -> list[dict]:
    """key, claim text, variable, coverage test on distinct values, group builder."""

    def head_dim(vals, valid):
        col = pd.to_numeric(valid["head_dim"], errors="coerce")
        return ("head_dim >= 64", valid[col >= 64],
                {"head_dim < 64": valid[col < 64]})

    def heads(vals, valid):
        col = pd.to_numeric(valid["heads"], errors="coerce")
        claimed = valid[np.isclose(col, 8) | np.isclose(col, 16)]
        others = [v for v in vals if not (math.isclose(v, 8) or math.isclose(v, 16))]
        return "heads in {8,16}", claimed, _by_value(valid, "heads", others)

    def ff(vals, valid):
        col = pd.to_numeric(valid["ff_ratio"], errors="coerce")
        others = [v for v in vals if not math.isclose(v, 4)]
        return "ff_dim/dim=4", valid[np.isclose(col, 4)], _by_value(valid, "ff_ratio", others)

    def dropout(vals, valid):
        col = pd.to_numeric(valid["dropout"], errors="coerce")
        others = [v for v in vals if not math.isclose(v, 0.1)]
        return "dropout=0.1", valid[np.isclose(col, 0.1)], _by_value(valid, "dropout", others)

    def wider(vals, valid):
        widest = max(vals)
        col = pd.to_numeric(valid["dim"], errors="coerce")
        return (f"widest dim={fmt_num(widest)}", valid[np.isclose(col, widest)],
                _by_value(valid, "dim", [v for v in vals if v < widest]))

    has = lambda vals, x: any(math.isclose(v, x) for v in vals)
    return [
        {"key": "head_dim_min_64", "claim": "head_dim not below 64", "variable": "head_dim",
             "covered": lambda v: len(v) > 1 and min(v) < 64 <= max(v),
             "why": "head_dim = dim/heads does not take values on both sides of 64", "groups": head_dim},
        {"key": "heads_8_or_16", "claim": "8 or 16 heads", "variable": "heads",
             "covered": lambda v: len(v) > 1 and (has(v, 8) or has(v, 16))
             and any(not (math.isclose(x, 8) or math.isclose(x, 16)) for x in v),
             "why": "heads does not vary over 8 or 16 and another value", "groups": heads},
        {"key": "ff_4x", "claim": "ff_dim = 4 x embed_dim", "variable": "ff_ratio",
             "covered": lambda v: len(v) > 1 and has(v, 4),
             "why": "ff_dim/dim does not vary over 4 and another ratio", "groups": ff},
        {"key": "dropout_0.1", "claim": "dropout 0.1", "variable": "dropout",
             "covered": lambda v: len(v) > 1 and has(v, 0.1),
             "why": "dropout does not vary over 0.1 and another value", "groups": dropout},
        {"key": "wider_dim", "claim": "wider embed_dim is better", "variable": "dim",
             "covered": lambda v: len(v) > 1, "why": "dim does not vary", "groups": wider},
    ]


def compute_verdicts(df: pd.DataFrame, metric: str = DEFAULT_METRIC) -> list[Verdict]:
    """Verdicts on the article's claims. df needs: status, seed, monitored and the config columns
    dim, heads, ff_dim, dropout (head_dim and ff_ratio are derived when absent)."""
    df = df.copy()
    for c in ("dim", "heads", "ff_dim", "dropout"):
        if c not in df.columns:
            df[c] = math.nan
        df[c] = pd.to_numeric(df[c], errors="coerce")
    if "head_dim" not in df.columns or df["head_dim"].isna().all():
        df["head_dim"] = df["dim"] / df["heads"]
    if "ff_ratio" not in df.columns or df["ff_ratio"].isna().all():
        df["ff_ratio"] = df["ff_dim"] / df["dim"]
    valid = df[valid_mask(df)]
    varying = {v: _distinct(df[v]) for v in CLAIM_VARS}
    out = []
    for spec in _claim_specs():
        var = spec["variable"]
        vals = varying[var]
        also = [v for v in CLAIM_VARS if v != var and len(varying[v]) > 1]
        if not spec["covered"](vals):
            out.append(Verdict(key=spec["key"], claim=spec["claim"], variable=var, verdict=NOT_COVERED,
                               reason=spec["why"] + f" (values: {', '.join(map(fmt_num, vals)) or 'none'})",
                               covered=False, also_varies=also))
            continue
        label, claimed, alts = spec["groups"](vals, valid)
        res = compare_groups(claimed, alts, metric, label)
        out.append(Verdict(key=spec["key"], claim=spec["claim"], variable=var, covered=True,
                           also_varies=also, **res))
    return out
