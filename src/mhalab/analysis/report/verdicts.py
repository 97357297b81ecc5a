"""Verdicts on the article's claims, each decided by the rule of stats.py (claim_verdict).

Claims and their groups (a claim is *covered* only when its variable varies across the sweep):

* ``head_dim not below 64``: head_dim (model.head_dim, or dim / heads) takes values on both sides of 64;
  claimed = members with head_dim >= 64 (pooled), alternatives = each head_dim value below 64.
* ``8 or 16 heads``: heads varies and includes 8 or 16 and some other value;
  claimed = heads in {8, 16} (pooled), alternatives = each other heads value.
* ``ff_dim = 4 x embed_dim``: the ratio ff_dim/dim varies and includes 4;
  claimed = ratio 4, alternatives = each other ratio.
* ``dropout 0.1``: dropout varies and includes 0.1; claimed = 0.1, alternatives = each other value.
* ``wider embed_dim is better``: dim varies; claimed = the widest dim of the sweep, alternatives = each
  narrower dim (so "supported" means the widest is better than each narrower one).

Other swept variables are averaged over within a group (marginal means: a factorial design such as
heads x head_dim compares each factor at every level of the other); ``also_varies`` names them, and
``confounded`` those of them that the claim's variable fixes (one value per value of it, e.g. head_dim =
dim / heads in a heads sweep): there the effect is of both together. A swept learning rate (``TUNED``) is not averaged over:
each group is taken at its own best lr on the monitored metric, as a user tuning each width would.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from mhalab.analysis.report import trained
from mhalab.analysis.report.stats import (
    DEFAULT_METRIC,
    INCONCLUSIVE,
    NOT_COVERED,
    NOT_DECIDED,
    UNCLEAR,
    Comparison,
    GroupStats,
    claim_verdict,
    higher_is_better,
    margin_units,
    not_learned_mask,
    points_scale,
    valid_mask,
)
from mhalab.analysis.report.values import finite, fmt_num

CLAIM_VARS = ("dim", "heads", "head_dim", "ff_ratio", "dropout")
TUNED = ("lr",)  # tuned per group (its best value on the monitored metric), never averaged over


@dataclass
class Verdict:
    key: str
    claim: str
    variable: str
    verdict: str
    reason: str
    covered: bool
    claimed: GroupStats | None = None
    comparisons: list[Comparison] = field(default_factory=list)
    margin: float = math.nan  # metric units
    also_varies: list[str] = field(default_factory=list)
    confounded: list[str] = field(default_factory=list)  # of also_varies: fixed by the claim's variable (not averaged)
    tuned: dict[str, str] = field(default_factory=dict)  # group label -> "lr=..." it was taken at
    # an inconclusive claim's plan (plan_seeds): seeds per group for 80% power at the margin in every unclear
    # comparison, how many more than the fewest it has, and what they cost at its members' measured wall time
    seeds_needed: float = math.nan
    extra_seeds: float = math.nan
    cpu_hours_needed: float = math.nan

    @property
    def headline(self) -> Comparison | None:
        """The comparison with the strongest alternative (best mean): the claim's closest call."""
        return min(self.comparisons, key=lambda c: c.effect if finite(c.effect) else math.inf, default=None)

    def to_dict(self) -> dict:
        def group(g: GroupStats | None) -> dict | None:
            if g is None:
                return None
            return {"label": g.label, "n": g.n, "n_seeds": g.n_seeds, "mean": g.mean, "std": g.std,
                    "per_seed": {str(k): float(v) for k, v in g.per_seed.items()}}

        comps = [{**{k: v for k, v in vars(c).items() if k != "alternative"}, "alternative": group(c.alternative)}
                 for c in self.comparisons]
        h = self.headline
        return {"key": self.key, "claim": self.claim, "variable": self.variable, "verdict": self.verdict,
                "reason": self.reason, "covered": self.covered, "claimed": group(self.claimed),
                "comparisons": comps, "headline": None if h is None else h.alternative.label,
                "effect": h.effect if h else math.nan, "ci": [h.ci_low, h.ci_high] if h else None,
                "margin": self.margin, "also_varies": self.also_varies, "confounded": self.confounded,
                "tuned": self.tuned, "seeds_needed": self.seeds_needed, "extra_seeds": self.extra_seeds,
                "cpu_hours_needed": self.cpu_hours_needed}


def _distinct(values: Iterable[float]) -> list[float]:
    out: list[float] = []
    for v in values:
        if finite(v) and not any(math.isclose(v, u, rel_tol=1e-9, abs_tol=1e-12) for u in out):
            out.append(float(v))
    return sorted(out)


def _by_value(valid: pd.DataFrame, var: str, values: list[float]) -> dict[str, pd.DataFrame]:
    col = pd.to_numeric(valid[var], errors="coerce")
    return {f"{var}={fmt_num(v)}": valid[np.isclose(col, v)] for v in values}


def _claim_specs() -> list[dict]:
    """key, claim text, variable, coverage test on distinct values, group builder."""

    def head_dim(vals, valid):
        col = pd.to_numeric(valid["head_dim"], errors="coerce")
        return "head_dim >= 64", valid[col >= 64], _by_value(valid, "head_dim", [v for v in vals if v < 64])

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
         "why": "head_dim does not take values on both sides of 64", "groups": head_dim},
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


def _at_best_tuned(sub: pd.DataFrame, sign: float) -> tuple[pd.DataFrame, str]:
    """The group's members at its best value of each swept TUNED variable (by mean monitored value)."""
    chosen = []
    for var in TUNED:
        col = pd.to_numeric(sub.get(var), errors="coerce") if var in sub else None
        if col is None or col.nunique() < 2:
            continue
        means = (sign * pd.to_numeric(sub["monitored"], errors="coerce")).groupby(col).mean()
        best = means.idxmax()
        sub = sub[np.isclose(col, best)]
        chosen.append(f"{var}={fmt_num(best)}")
    return sub, ", ".join(chosen)


def plan_seeds(claimed: GroupStats, comps: list[Comparison]) -> tuple[float, float, float]:
    """(seeds per group, seeds to add, CPU hours) that would give every unclear comparison 80% power at the margin:
    the largest of their seeds_needed; added to the claimed group and each unclear alternative from the fewest
    seeds any of them has; costed at each group's measured wall time per seed (its members' wall time summed over
    its seeds). NaN when no comparison has a plan (untested ones have none)."""
    unclear = [c for c in comps if c.outcome == UNCLEAR and not math.isnan(c.seeds_needed)]
    if not unclear:
        return math.nan, math.nan, math.nan
    needed = max(c.seeds_needed for c in unclear)
    groups = [claimed, *(c.alternative for c in unclear)]
    extra = max(0.0, needed - min(g.n_seeds for g in groups))
    per_seed = sum(g.wall_s / g.n_seeds for g in groups)  # seconds
    return needed, extra, extra * per_seed / 3600.0


def plan_words(needed: float, extra: float, cpu_h: float, margin_text: str) -> str:
    """The plan in the words of a verdict's "why"."""
    if math.isnan(needed):
        return ""
    if math.isinf(needed):
        return f"no practical number of seeds (over 1,000 per group) finds an effect of {margin_text} with 80% power"
    cost = f", ~{cpu_h:.1f} CPU h at these members' times" if math.isfinite(cpu_h) else ""
    return (f"~{int(needed)} seeds per group would find an effect of {margin_text} with 80% power "
            f"({int(extra)} more{cost})")


def derive_columns(df: pd.DataFrame) -> pd.DataFrame:
    """The claim variables as numbers: head_dim from the config or dim / heads, ff_ratio = ff_dim / dim."""
    df = df.copy()
    for c in ("dim", "heads", "ff_dim", "dropout", "head_dim", "lr"):
        df[c] = pd.to_numeric(df[c], errors="coerce") if c in df.columns else math.nan
    df["head_dim"] = df["head_dim"].fillna(df["dim"] / df["heads"])
    if "ff_ratio" not in df.columns or df["ff_ratio"].isna().all():
        df["ff_ratio"] = df["ff_dim"] / df["dim"]
    return df


def compute_verdicts(df: pd.DataFrame, metric: str = DEFAULT_METRIC, margin: float | None = None) -> list[Verdict]:
    """Verdicts on the article's claims. df needs: status, seed, monitored and the config columns
    dim, heads, ff_dim, dropout (head_dim and ff_ratio are derived when absent). margin: the smallest
    difference that matters, in points for an accuracy-like metric, else metric units (stats.margin_units)."""
    df = derive_columns(df)
    sign = 1.0 if higher_is_better(metric) else -1.0
    margin = margin_units(metric, margin)
    valid = df[valid_mask(df)]
    idle = not_learned_mask(valid)
    monitored = pd.to_numeric(valid["monitored"], errors="coerce")
    same = len(valid) > 1 and monitored.nunique() == 1  # every member the same value: nothing to compare
    varying = {v: _distinct(df[v]) for v in CLAIM_VARS}
    tuned_varies = [v for v in TUNED if v in df and len(_distinct(df[v])) > 1]
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
        # a variable that takes one value per value of the claim's is confounded with it, not averaged over
        confounded = [o for o in also if df.groupby(df[var].round(9))[o].nunique().max() <= 1]
        label, claimed_sub, alt_subs = spec["groups"](vals, valid)
        tuned, groups, subs = {}, {}, {}
        for name, sub in [(label, claimed_sub), *alt_subs.items()]:
            sub, at = _at_best_tuned(sub, sign) if tuned_varies else (sub, "")
            if at:
                tuned[name] = at
            groups[name], subs[name] = GroupStats.of(name, sub), sub
        # a group most of whose members did not learn (chance or majority-class level): its comparison says nothing
        stuck = [name for name, sub in subs.items() if len(sub) and idle.loc[sub.index].mean() > 0.5]
        claimed = groups.pop(label)
        if claimed.n == 0 or not any(g.n for g in groups.values()):
            missing = label if claimed.n == 0 else "every alternative"
            out.append(Verdict(key=spec["key"], claim=spec["claim"], variable=var, verdict=INCONCLUSIVE,
                               reason=f"no finished runs for {missing}", covered=True, claimed=claimed,
                               margin=margin, also_varies=also, confounded=confounded, tuned=tuned))
            continue
        if cut := trained.withheld(df, pd.concat(list(subs.values())), metric, margin):
            out.append(Verdict(key=spec["key"], claim=spec["claim"], variable=var, verdict=NOT_DECIDED, reason=cut,
                               covered=True, claimed=claimed, margin=margin, also_varies=also,
                               confounded=confounded, tuned=tuned))
            continue
        if same or stuck:
            why = (f"every member has the same {metric} ({fmt_num(monitored.iloc[0])}): nothing to compare" if same
                   else f"the models did not learn in {', '.join(stuck)} (validation accuracy at the majority "
                        f"class's level, or one class predicted): a comparison of them says nothing about the claim")
            out.append(Verdict(key=spec["key"], claim=spec["claim"], variable=var, verdict=NOT_DECIDED, reason=why,
                               covered=True, claimed=claimed, margin=margin, also_varies=also,
                               confounded=confounded, tuned=tuned))
            continue
        verdict, reason, comps = claim_verdict(claimed, [g for g in groups.values() if g.n], sign, margin)
        needed = extra = cpu_h = math.nan
        if verdict == INCONCLUSIVE:
            needed, extra, cpu_h = plan_seeds(claimed, comps)
            scale, unit = points_scale(metric)
            if words := plan_words(needed, extra, cpu_h, f"{fmt_num(margin * scale)}{unit}"):
                reason += f"; {words}"
        if failed := [name for name, g in groups.items() if not g.n]:  # the verdict is over the others: say so
            reason += f"; not compared: {', '.join(failed)} (no finished runs)"
        out.append(Verdict(key=spec["key"], claim=spec["claim"], variable=var, verdict=verdict, reason=reason,
                           covered=True, claimed=claimed, comparisons=comps, margin=margin,
                           also_varies=also, confounded=confounded, tuned=tuned, seeds_needed=needed,
                           extra_seeds=extra, cpu_hours_needed=cpu_h))
    return out
