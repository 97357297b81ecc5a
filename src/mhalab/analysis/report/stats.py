"""Statistics over seeds: which members count, the per-setting summary, and the tests that compare groups.

Selection rule
--------------
The best setting is the one with the best *mean over seeds* of the monitored metric (``best[metric]``
in ``metrics.json``: the best validation value over epochs). The monitored metric must not be a test
metric (ConfigError, a ValueError): the test columns are reported, never used to choose. Only members
with ``status == "finished"`` and a finite monitored value enter any statistic.

Comparing a claimed group with one alternative (``compare``)
------------------------------------------------------------
Each group is reduced to one value per seed: the mean of its members' monitored values at that seed
(a group may pool several settings, e.g. heads 8 and 16; other swept variables are averaged over, so
these are marginal means). ``effect = mean(claimed) - mean(alternative)``, signed so that > 0 means the
claimed group is better (flipped for a loss), in the metric's units.

* **paired** (a t-test on the per-seed differences, n - 1 degrees of freedom) when the two groups share
  at least 2 seeds (a seed in one group only is left out): the runs of one seed share the data order
  and, where the shapes allow, the initial draws, so the seed's luck cancels in the difference;
* **Welch** (unequal variances, Welch-Satterthwaite degrees of freedom) when they do not (other seeds);
* fewer than 2 seeds in either group: no test (the noise cannot be measured).

From the t statistic: the effect's two-sided 95% confidence interval, its two-sided p-value ``p_diff``
(H0: effect = 0; p_diff < 0.05 exactly when the interval excludes 0), and the equivalence test
``p_equivalent`` (TOST: the larger of the two one-sided p-values against -margin and +margin;
equivalence at level alpha is the 90% interval lying inside +-margin). The margin is the smallest difference that matters,
settable: by default 1 point of an accuracy-like metric (0.01), or 0.01 of another metric (a loss).

A claim (``claim_verdict``)
---------------------------
A claim compares its group with each alternative (e.g. "8 or 16 heads" against heads 1, 2, 4). Both
p-values are Holm-corrected across the claim's alternatives, and each comparison is read at ``ALPHA`` =
0.05: **equivalent** if the corrected p_equivalent < alpha (precedence: a difference smaller than the
margin does not matter, even when it is significant), else **claimed better** / **claimed worse** if the
corrected p_diff < alpha with the effect > 0 / < 0 (so a "better" always has a 95% interval above 0),
else **unclear**. The claim is then

* **contradicted** if some alternative is better than the claimed group;
* **supported** if the claimed group is better than every alternative;
* **no practical difference** if it is better than or equivalent to each, and equivalent to one at least;
* **inconclusive** otherwise: some interval crosses the margin (more seeds would settle it).

A false "supported" (or "contradicted") happens in at most alpha / 2 of the tables where the claim makes
no difference, a false "no practical difference" in at most alpha of those where it makes one of the margin.
Power: ``tests/test_verdict_statistics.py`` simulates tables with known effects.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import optimize, special, stats

from mhalab.analysis.report.values import natural_key

DEFAULT_METRIC = "val/acc"  # the monitored metric unless told otherwise
ALPHA = 0.05  # level of the two-sided difference test and of the equivalence test
DEFAULT_MARGIN = 1.0  # the smallest difference that matters, in points of an accuracy-like metric (0.01)
DEFAULT_MARGIN_OTHER = 0.01  # ... and in units of another metric (a loss)
MIN_SEEDS = 2  # fewer distinct seeds in a compared group -> no test
POWER = 0.8  # of the detectable effect stated beside each comparison

SUPPORTED = "supported"
CONTRADICTED = "contradicted"
NO_DIFFERENCE = "no practical difference"
INCONCLUSIVE = "inconclusive"
NOT_COVERED = "not covered"
NOT_DECIDED = "not decided"  # the models did not learn, or every cell is the same: a comparison would say nothing
LEARNED_MARGIN = 0.01  # a member learned if it beats the validation split's majority class by more than this


# one comparison's outcome
BETTER, WORSE, EQUIVALENT, UNCLEAR = "claimed better", "claimed worse", "equivalent", "unclear"


def higher_is_better(metric: str) -> bool:
    m = metric.lower()
    return not any(word in m for word in ("loss", "err", "perplexity", "ppl", "nll"))


def points_scale(metric: str) -> tuple[float, str]:
    """Accuracy-like metrics are shown (and their margin given) in points (x100)."""
    m = metric.lower()
    if any(word in m for word in ("acc", "f1", "precision", "recall", "auc")):
        return 100.0, " pts"
    return 1.0, ""


def margin_units(metric: str, margin: float | None = None) -> float:
    """The margin in the metric's units: `margin` is in points for an accuracy-like metric (points_scale), in
    metric units otherwise; None: the default for the metric."""
    scale = points_scale(metric)[0]
    if margin is None:
        return DEFAULT_MARGIN / scale if scale != 1.0 else DEFAULT_MARGIN_OTHER
    return margin / scale


def not_learned_mask(df: pd.DataFrame) -> pd.Series:
    """Members whose best checkpoint did not learn: validation accuracy within LEARNED_MARGIN of always answering
    the majority class, or one class predicted for every example (from each member's validation confusion
    matrix; a results.csv without those columns, written before them, has every member False: not checked)."""
    if "val_majority_acc" not in df or "val_classes_predicted" not in df:
        return pd.Series(False, index=df.index)
    acc, majority = (pd.to_numeric(df[c], errors="coerce") for c in ("best_val_acc", "val_majority_acc"))
    predicted = pd.to_numeric(df["val_classes_predicted"], errors="coerce")
    return ((acc <= majority + LEARNED_MARGIN) | (predicted < 2)).fillna(False)


def valid_mask(df: pd.DataFrame) -> pd.Series:
    """The members that enter statistics: finished, with a finite monitored value."""
    mon = pd.to_numeric(df["monitored"], errors="coerce")
    return (df["status"] == "finished") & np.isfinite(mon)


# --------------------------------------------------------------------------------------------------
# per-setting summary


def _std(x: pd.Series) -> float:
    x = pd.to_numeric(x, errors="coerce").dropna()
    return float(x.std(ddof=1)) if len(x) >= 2 else math.nan


def top_settings(summary: pd.DataFrame) -> pd.DataFrame:
    """The settings at the top of summarize_settings' ranking: one row, or several that tie (equal means to 1e-12,
    e.g. models that all predict one class): a tie has no best setting."""
    ranked = summary[summary["n"] > 0]
    if ranked.empty:
        return ranked
    top = ranked["monitored_mean"].iloc[0]
    return ranked[np.isclose(ranked["monitored_mean"], top, rtol=0.0, atol=1e-12)]


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
# groups and their comparison


@dataclass
class GroupStats:
    """One group of a sweep: its per-seed means (a seed is one sample); mean, std and n_seeds derive from them."""

    label: str
    n: int  # members with a value
    per_seed: pd.Series  # seed -> mean of the group's members at that seed
    wall_s: float = math.nan  # the members' wall time, summed: what a seed of this group costs, times n_seeds
    rows: tuple = ()  # the members' index in the results table (which runs a sequential sweep extends)

    @property
    def n_seeds(self) -> int:
        return len(self.per_seed)

    @property
    def mean(self) -> float:
        """Over the per-seed means."""
        return float(self.per_seed.mean()) if len(self.per_seed) else math.nan

    @property
    def std(self) -> float:
        """Of the per-seed means (ddof=1)."""
        return float(self.per_seed.std(ddof=1)) if len(self.per_seed) >= 2 else math.nan

    @classmethod
    def of(cls, label: str, sub: pd.DataFrame) -> GroupStats:
        vals = pd.to_numeric(sub["monitored"], errors="coerce")
        per_seed = vals.groupby(sub["seed"]).mean().dropna() if len(sub) else pd.Series(dtype=float)
        wall = pd.to_numeric(sub["wall_time_s"], errors="coerce") if "wall_time_s" in sub else pd.Series(dtype=float)
        return cls(label=label, n=int(vals.notna().sum()), per_seed=per_seed,
                   wall_s=float(wall.sum()) if wall.notna().any() else math.nan, rows=tuple(sub.index))


@dataclass
class Comparison:
    """The claimed group against one alternative; effect and interval in metric units, > 0 = claimed better."""

    alternative: GroupStats
    test: str = "none"  # paired | welch | none (too few seeds)
    n: int = 0  # pairs (paired) or the smaller group's seeds (welch)
    effect: float = math.nan
    se: float = math.nan
    df: float = math.nan
    ci_low: float = math.nan  # two-sided 95%
    ci_high: float = math.nan
    p_diff: float = math.nan  # raw: two-sided t-test, and TOST
    p_equivalent: float = math.nan
    p_diff_holm: float = math.nan  # Holm-corrected across the claim's alternatives
    p_equivalent_holm: float = math.nan
    # the smallest true effect this design finds with 80% power (detectable_effect): at ALPHA for one comparison, at
    # Holm's strictest step ALPHA / m when a claim has m tested alternatives (claim_verdict)
    detectable: float = math.nan
    # the variance of one seed's contribution: of the per-seed differences (paired), or the two groups' variances
    # summed (welch); se**2 = unit_var / n. seeds_needed plans from it
    unit_var: float = math.nan
    seeds_needed: float = math.nan  # seeds per group for 80% power at the margin (seeds_needed), unclear ones only
    outcome: str = UNCLEAR


def compare(claimed: GroupStats, alternative: GroupStats, sign: float, margin: float) -> Comparison:
    """The two-group test of the module docstring (raw p-values; claim_verdict corrects them)."""
    out = Comparison(alternative)
    c, a = sign * claimed.per_seed, sign * alternative.per_seed
    if len(c) < MIN_SEEDS or len(a) < MIN_SEEDS:
        out.effect = float(c.mean() - a.mean()) if len(c) and len(a) else math.nan
        return out
    shared = c.index.intersection(a.index)
    if len(shared) >= MIN_SEEDS:
        d = c.loc[shared] - a.loc[shared]  # per-seed differences
        out.test, out.n, out.effect, out.df = "paired", len(d), float(d.mean()), len(d) - 1.0
        out.se = float(d.std(ddof=1)) / math.sqrt(len(d))
        out.unit_var = float(d.var(ddof=1))
    else:
        vc, va = c.var(ddof=1) / len(c), a.var(ddof=1) / len(a)
        out.test, out.n, out.effect = "welch", min(len(c), len(a)), float(c.mean() - a.mean())
        out.se = math.sqrt(vc + va)
        out.unit_var = float(c.var(ddof=1) + a.var(ddof=1))
        denom = vc ** 2 / (len(c) - 1) + va ** 2 / (len(a) - 1)
        out.df = (vc + va) ** 2 / denom if denom > 0 else len(c) + len(a) - 2.0
    e, se, df = out.effect, out.se, out.df
    if se <= 1e-12 * max(1.0, abs(e)):  # no spread (up to rounding): the data leave no doubt either way
        out.ci_low = out.ci_high = e
        out.p_diff = float(e == 0)
        out.p_equivalent = float(abs(e) >= margin)
        return out
    out.detectable = detectable_effect(se, df)
    half = stats.t.ppf(1 - ALPHA / 2, df) * se  # the 95% interval
    out.ci_low, out.ci_high = e - half, e + half
    out.p_diff = float(2 * stats.t.sf(abs(e) / se, df))
    out.p_equivalent = float(max(stats.t.sf((e + margin) / se, df), stats.t.cdf((e - margin) / se, df)))
    return out


def detectable_effect(se: float, df: float, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true effect that a two-sided t-test at level `alpha`, with this standard error and these degrees
    of freedom, detects with probability `power`: the effect d at which the test statistic, noncentral t with
    noncentrality d / se, falls outside +-t(1 - alpha/2, df) with that probability. With the observed seed
    variance in `se`, an "inconclusive" reads as "no effect larger than this (at 80% power)" only above it.
    Checked against simulated paired designs in tests/test_verdict_statistics.py."""
    if not (se > 0 and df > 0):
        return math.nan
    return se * _detectable_noncentrality(float(df), alpha, power)


@functools.lru_cache(maxsize=4096)
def _detectable_noncentrality(df: float, alpha: float, power: float) -> float:
    """detectable_effect in standard errors: the power depends on the effect only through d / se (the noncentrality),
    so one root per (df, alpha, power) serves every se (a sweep's paired comparisons share df)."""
    crit = special.stdtrit(df, 1 - alpha / 2)  # t's quantile: what stats.t.ppf calls, without its ~60 us of wrapping

    def shortfall(nc: float) -> float:
        lower = special.nctdtr(df, nc, -crit)  # the noncentral t's cdf: wrong-sign rejections, ~0 (NaN far out)
        return 1.0 - special.nctdtr(df, nc, crit) + (0.0 if math.isnan(lower) else lower) - power

    high = crit + special.ndtri(power)  # the normal approximation; few seeds need more
    while shortfall(high) < 0:
        high *= 1.5
    return float(optimize.brentq(shortfall, 0.0, high))


def seeds_needed(comp: Comparison, margin: float, alpha: float = ALPHA, power: float = POWER,
                 most: int = 1000) -> float:
    """Seeds per group at which this comparison's design finds a true effect of `margin` with probability `power`
    (a two-sided t-test at `alpha`): the smallest n with detectable_effect(sqrt(unit_var / n), df(n)) <= margin,
    df = n - 1 (paired) or 2n - 2 (welch, equal seeds from here on), from the observed seed variance (unit_var).
    NaN when the comparison was not tested, inf beyond `most`. Checked against simulated designs in
    tests/test_verdict_statistics.py."""
    if comp.test == "none" or not (comp.unit_var > 0 and margin > 0):
        return math.nan
    df = (lambda n: n - 1.0) if comp.test == "paired" else (lambda n: 2.0 * n - 2.0)
    found = lambda n: detectable_effect(math.sqrt(comp.unit_var / n), df(n), alpha, power) <= margin
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    n = max(2, math.ceil(comp.unit_var * (z / margin) ** 2))  # the normal approximation: t needs a few more
    if n > most:
        return math.inf
    while n > 2 and found(n - 1):
        n -= 1
    while not found(n):
        n += 1
        if n > most:
            return math.inf
    return float(n)


def holm(p: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (NaN stays NaN and does not count as a test)."""
    idx = [i for i, x in enumerate(p) if not math.isnan(x)]
    m, out, running = len(idx), [math.nan] * len(p), 0.0
    for rank, i in enumerate(sorted(idx, key=lambda i: p[i])):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out


def verdict_of(outcomes: list[str]) -> str:
    """A claim's verdict from its comparisons' outcomes (the rule of the module docstring)."""
    if WORSE in outcomes:
        return CONTRADICTED
    if outcomes and all(o == BETTER for o in outcomes):
        return SUPPORTED
    if outcomes and all(o in (BETTER, EQUIVALENT) for o in outcomes):
        return NO_DIFFERENCE
    return INCONCLUSIVE


def claim_verdict(claimed: GroupStats, alternatives: list[GroupStats], sign: float,
                  margin: float) -> tuple[str, str, list[Comparison]]:
    """(verdict, reason, comparisons) for a claim: the rule of the module docstring. margin in metric units."""
    comps = [compare(claimed, a, sign, margin) for a in alternatives]
    for key in ("p_diff", "p_equivalent"):
        for comp, p in zip(comps, holm([getattr(x, key) for x in comps])):
            setattr(comp, f"{key}_holm", p)
    tested = sum(math.isfinite(c.p_diff) for c in comps)
    if tested > 1:  # Holm's strictest step, ALPHA / m: an effect this large is found whatever the others' order
        for comp in comps:
            if math.isfinite(comp.detectable):
                comp.detectable = detectable_effect(comp.se, comp.df, alpha=ALPHA / tested)
    for comp in comps:
        if comp.p_equivalent_holm < ALPHA:
            comp.outcome = EQUIVALENT
        elif comp.p_diff_holm < ALPHA:
            comp.outcome = BETTER if comp.effect > 0 else WORSE
        else:  # unclear: what it would take (at the level detectable is stated at)
            comp.seeds_needed = seeds_needed(comp, margin, alpha=ALPHA / max(tested, 1))
    untested = [c.alternative.label for c in comps if c.test == "none"]
    outcomes = [c.outcome for c in comps]
    if untested and len(untested) == len(comps):
        return INCONCLUSIVE, (f"fewer than {MIN_SEEDS} seeds in a compared group ({claimed.label}: "
                              f"{claimed.n_seeds}; {', '.join(untested)}): seed noise cannot be measured"), comps
    names = lambda outcome: ", ".join(c.alternative.label for c in comps if c.outcome == outcome)
    verdict = verdict_of(outcomes)
    if verdict == CONTRADICTED:
        return verdict, f"worse than {names(WORSE)}", comps
    if verdict == SUPPORTED:
        return verdict, f"better than every alternative ({names(BETTER)})", comps
    if verdict == NO_DIFFERENCE:
        better = f"; better than {names(BETTER)}" if BETTER in outcomes else ""
        return verdict, f"within the margin of {names(EQUIVALENT)}{better}", comps
    crossing = ", ".join(c.alternative.label for c in comps if c.outcome == UNCLEAR and c.test != "none")
    few = f"fewer than {MIN_SEEDS} seeds for {', '.join(untested)}" if untested else ""
    return INCONCLUSIVE, "; ".join(x for x in (crossing and f"the interval crosses the margin against {crossing}",
                                               few) if x), comps


def fmt_p(p: float) -> str:
    if not math.isfinite(p):
        return "–"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"
