"""Seeds until decided: reading a sweep's claims again after each round of seeds without inflating the error rate.

Looking at a fixed-sample 95% interval after every round of seeds and stopping at the first one that decides
makes a false decision far more often than 5% (tests/test_sequential.py measures it). This module keeps the rate
with **repeated confidence intervals** (Jennison & Turnbull 1989; *Group Sequential Methods*, 2000, ch. 9): at
look k the interval is ``effect +- c_k * se``, with boundaries c_1 > c_2 > ... chosen so that, when the true effect
is anywhere, all the looks' intervals cover it together with probability >= 1 - alpha. A decision taken from any
look's interval is therefore wrong with probability <= alpha, whenever the sweep stops, for whatever reason.

* Boundaries: Lan & DeMets (1983) alpha spending with the O'Brien-Fleming-type function, alpha / 2 a side,
  ``alpha_side(t) = 2 - 2 Phi(z_{1-alpha/4} / sqrt(t))`` at information fraction ``t = seeds / max_seeds`` (a seed's
  information is constant, so seeds measure it). Each c_k solves "the first exit at look k has probability
  alpha(t_k) - alpha(t_{k-1}) under no effect" by recursive numerical integration of the score's density over
  the looks' continuation regions (Armitage, McPherson & Rowe 1969): deterministic, unlike a Monte Carlo
  multivariate normal.
* Seeds are few, so the variance is estimated: c_k is taken at its nominal tail level on Student's t with the
  look's degrees of freedom (Jennison & Turnbull 2000, sec. 3.8 and 9.3). The simulation test checks the rate.
* A claim's m compared alternatives share alpha by Bonferroni (alpha / m each): the claim's false-decision rate is
  then <= alpha. A comparison is decided at the first look whose interval lies within +-margin (equivalent) or
  excludes 0 (better / worse), and stays decided (the coverage is simultaneous); the claim's verdict follows from
  its comparisons by the fixed-sample rule (stats.verdict_of).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import integrate, optimize, stats

from mhalab.analysis.report.stats import BETTER, EQUIVALENT, INCONCLUSIVE, UNCLEAR, WORSE, verdict_of
from mhalab.analysis.report.verdicts import compute_verdicts

GRID = 1201  # points of the score's density on a look's continuation interval


def spent(t: float, alpha: float) -> float:
    """Lan-DeMets O'Brien-Fleming-type spending: the two-sided error allowed up to information fraction t, alpha / 2
    on each side, each spent as ``2 - 2 Phi(z_{1 - alpha/4} / sqrt(t))`` (as gsDesign's sfLDOF and ldbounds do)."""
    if t <= 0:
        return 0.0
    return float(4.0 * stats.norm.sf(stats.norm.isf(alpha / 4) / math.sqrt(min(t, 1.0))))


@functools.lru_cache(maxsize=256)
def boundaries(fractions: tuple[float, ...], alpha: float) -> tuple[float, ...]:
    """Two-sided critical values c_k on the standard normal scale for looks at these increasing information
    fractions (0 < t_1 < ... <= 1): under no effect, P(|Z_j| < c_j for j < k and |Z_k| >= c_k) is the spending
    function's increment at look k."""
    if any(b <= a for a, b in itertools.pairwise(fractions)) or not 0 < fractions[0] or fractions[-1] > 1:
        raise ValueError(f"information fractions must increase within (0, 1]: {fractions}")
    out: list[float] = []
    xs = dens = None  # the score S_k = Z_k sqrt(t_k) (variance t_k) on the continuation region: grid and density
    t_prev = 0.0
    for t in fractions:
        target = spent(t, alpha) - spent(t_prev, alpha)
        if xs is None:
            c = float(stats.norm.isf(target / 2))
        else:
            sd = math.sqrt(t - t_prev)  # S_k = S_{k-1} + an independent N(0, t_k - t_{k-1})
            c = float(optimize.brentq(_first_exit, 1e-6, 40.0, args=(t, sd, xs, dens, target), xtol=1e-10))
        b = c * math.sqrt(t)
        grid = np.linspace(-b, b, GRID)
        if xs is None:
            dens = stats.norm.pdf(grid, scale=math.sqrt(t))
        else:
            kernel = stats.norm.pdf((grid[:, None] - xs[None, :]) / sd) / sd  # (GRID new, GRID old)
            dens = integrate.simpson(kernel * dens[None, :], x=xs, axis=1)
        xs, t_prev = grid, t
        out.append(c)
    return tuple(out)


def _first_exit(c: float, t: float, sd: float, xs: np.ndarray, dens: np.ndarray, target: float = 0.0) -> float:
    """P(no earlier exit, |Z_k| >= c) - target: the density still going at the last look (xs, dens) times the chance
    of crossing now."""
    b = c * math.sqrt(t)
    p = stats.norm.sf((b - xs) / sd) + stats.norm.cdf((-b - xs) / sd)
    return float(integrate.simpson(dens * p, x=xs)) - target


def t_critical(z: float | np.ndarray, df: float | np.ndarray) -> np.ndarray:
    """A normal-scale boundary at its nominal tail level on Student's t with df degrees of freedom."""
    return stats.t.isf(stats.norm.sf(z), df)


def planned_looks(first: int, round_seeds: int, max_seeds: int) -> tuple[int, ...]:
    """Seeds at each planned look: the first look, then one per round, and max_seeds last."""
    return (*range(first, max_seeds, round_seeds), max_seeds)


@functools.lru_cache(maxsize=64)
def design_alpha(planned: tuple[int, ...], alpha: float, draws: int = 100_000) -> float:
    """The spending level at which the t version of the procedure (paired differences, df = n - 1) makes a false
    decision with probability alpha over these planned looks. At its nominal level the t version errs a little more
    often than the normal theory says (5.5% for 5% at looks of 5, 7, ..., 19, 20 seeds: the looks' variance
    estimates are correlated), so the level is lowered until a simulation of the whole schedule under no effect
    gives alpha: Monte Carlo in place of Jennison & Turnbull's (1991) exact sequential t computation, with a fixed
    seed (the same answer on every call; its standard error is ~0.1% of alpha's scale at 100,000 draws). The rate
    does not depend on the seed variance (a t statistic is scale-free), so one calibration serves every sweep."""
    rng = np.random.default_rng(0)
    d = rng.standard_normal((draws, planned[-1]))  # per-seed differences under no effect
    tabs = [np.abs(d[:, :n].mean(1)) / (d[:, :n].std(1, ddof=1) / math.sqrt(n)) for n in planned]
    fractions = tuple(n / planned[-1] for n in planned)

    def excess(a: float) -> float:
        crossed = np.zeros(draws, bool)
        for n, z, tab in zip(planned, boundaries(fractions, a), tabs):
            crossed |= tab >= t_critical(z, n - 1)
        return float(crossed.mean()) - alpha

    if excess(alpha) <= 0:
        return alpha
    return float(optimize.brentq(excess, alpha / 4, alpha, xtol=alpha * 1e-4))


def decide(low: np.ndarray, high: np.ndarray, margin: float) -> np.ndarray:
    """One comparison's outcome from an interval, as stats.claim_verdict reads one: within +-margin -> equivalent
    (precedence), above 0 -> better, below 0 -> worse, else unclear."""
    low, high = np.asarray(low, float), np.asarray(high, float)
    return np.where((low > -margin) & (high < margin), EQUIVALENT,
                    np.where(low > 0, BETTER, np.where(high < 0, WORSE, UNCLEAR)))


def read_looks(df: pd.DataFrame, looks: list[list[int]], planned: tuple[int, ...], alpha: float, metric: str,
               margin: float | None = None) -> list[dict]:
    """Each look of a sequential sweep read in turn: look k sees the members whose seed is in looks[k]. For every
    covered claim: its comparisons' repeated intervals at alpha / m (Bonferroni over the m alternatives, each
    calibrated over the planned looks by design_alpha), their outcomes (sticky once decided) and the claim's
    verdict. A look also lists `undecided_rows`: df's index of the members in the groups of claims still
    inconclusive (claimed group and undecided alternatives), which the next round extends. planned: seeds at each
    planned look (planned_looks), the last being max_seeds. margin: as compute_verdicts takes it."""
    max_seeds = planned[-1]
    state: dict[tuple[str, str], dict] = {}  # (claim key, alternative) -> fractions so far, decision
    out = []
    for k, seeds in enumerate(looks):
        sub = df[pd.to_numeric(df["seed"], errors="coerce").isin(seeds)]
        claims, undecided_rows = {}, set()
        for v in compute_verdicts(sub, metric, margin):
            if not v.covered:
                continue
            if not v.comparisons:  # not decided (the models did not learn, ...) or no runs: no interval to read
                claims[v.key] = {"claim": v.claim, "verdict": v.verdict, "reason": v.reason, "comparisons": []}
                continue
            m = len(v.comparisons)
            rows = []
            for comp in v.comparisons:
                st = state.setdefault((v.key, comp.alternative.label), {"fractions": (), "outcome": UNCLEAR})
                row = {"alternative": comp.alternative.label, "test": comp.test, "n": comp.n,
                       "effect": comp.effect, "low": math.nan, "high": math.nan, "z": math.nan,
                       "outcome": st["outcome"], "decided_at": st.get("decided_at")}
                t = min(comp.n / max_seeds, 1.0)
                if comp.test != "none" and comp.se > 0 and (not st["fractions"] or t > st["fractions"][-1]):
                    st["fractions"] = (*st["fractions"], t)
                    z = boundaries(st["fractions"], design_alpha(planned, alpha / m))[-1]
                    half = float(t_critical(z, comp.df)) * comp.se
                    row.update(low=comp.effect - half, high=comp.effect + half, z=z)
                    st["interval"] = (row["low"], row["high"], z)
                    if st["outcome"] == UNCLEAR:
                        st["outcome"] = str(decide(row["low"], row["high"], v.margin))
                        if st["outcome"] != UNCLEAR:
                            st["decided_at"] = k
                elif "interval" in st:  # no new seeds for this comparison: its last interval stands
                    row["low"], row["high"], row["z"] = st["interval"]
                row.update(outcome=st["outcome"], decided_at=st.get("decided_at"))
                rows.append(row)
            verdict = verdict_of([r["outcome"] for r in rows])
            claims[v.key] = {"claim": v.claim, "verdict": verdict, "comparisons": rows, "margin": v.margin,
                             "claimed": v.claimed.label, "reason": ""}
            if verdict == INCONCLUSIVE:
                undecided_rows |= set(v.claimed.rows)
                for comp, r in zip(v.comparisons, rows):
                    if r["outcome"] == UNCLEAR:
                        undecided_rows |= set(comp.alternative.rows)
        out.append({"look": k + 1, "seeds": sorted(int(s) for s in seeds), "claims": claims,
                    "undecided_rows": sorted(undecided_rows)})
    return out


RECORD = "sequential.json"  # a sweep run until decided: its design and looks (the until_decided sweeper writes it)


def read_record(root: Path) -> tuple[dict, list[list[int]]] | None:
    """(design, each look's seeds) of a sweep dir run until decided, or None."""
    path = Path(root) / RECORD
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    return rec["design"], [look["seeds"] for look in rec["looks"]]


def markdown(reads: list[dict], design: dict, scale: float, unit: str) -> list[str]:
    """The report's section on a sweep run until decided: each look's verdicts, then each comparison's repeated
    interval at the last look it gained seeds, and the look that decided it."""
    last = reads[-1]
    L = ["## Seeds until decided: the verdicts to read", "",
         (f"This sweep added seeds after looking (`sweep.until_decided=true`: first look at {design['first']} seeds, "
          f"then {design['round_seeds']} a round, at most {design['max_seeds']}). Its verdicts are read from repeated "
          f"{100 * (1 - design['alpha']):.0f}% confidence intervals with O'Brien-Fleming-type alpha spending "
          "(Jennison & Turnbull 1989; Lan & DeMets 1983), which hold the false-decision rate over every look; the "
          "fixed-sample verdicts further down do not, after looking. docs/sweeps.md says how."), "",
         "| look | seeds | " + " | ".join(c["claim"] for c in last["claims"].values()) + " |",
         "|---|---|" + "---|" * len(last["claims"])]
    for r in reads:
        L.append(f"| {r['look']} | {len(r['seeds'])} ({r['seeds'][0]}-{r['seeds'][-1]}) | "
                 + " | ".join(r["claims"].get(k, {}).get("verdict", "–") for k in last["claims"]) + " |")
    L += ["", f"| claim | vs | pairs | effect ({unit.strip() or 'units'}) | repeated interval | outcome | decided at |",
          "|---|---|---|---|---|---|---|"]
    for c in last["claims"].values():
        if not c["comparisons"]:
            L.append(f"| {c['claim']} | – | – | – | – | {c['verdict']}: {c['reason']} | – |")
        for x in c["comparisons"]:
            ci = (f"[{x['low'] * scale:+.2f}, {x['high'] * scale:+.2f}]" if math.isfinite(x["low"]) else "–")
            at = f"look {x['decided_at'] + 1}" if x["decided_at"] is not None else "–"
            L.append(f"| {c['claim']} | {x['alternative']} | {x['n']} | {x['effect'] * scale:+.2f} | {ci} | "
                     f"{x['outcome']} | {at} |")
    return L + [""]
