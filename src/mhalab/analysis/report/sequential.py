"""Seeds until decided: reading a sweep's claims again after each round of seeds without inflating the error rate.

Looking at a fixed-sample 95% interval after every round of seeds and stopping at the first one that decides
makes a false decision far more often than 5% (tests/test_sequential.py measures it). This module keeps the rate
with **repeated confidence intervals** (Jennison & Turnbull 1989; *Group Sequential Methods*, 2000, ch. 9): at
look k the interval is ``effect +- c_k * se``, with boundaries c_1 > c_2 > ... chosen so that, under the normal
model, all the looks' intervals cover the true effect together with probability 1 - alpha. Seeds are few, so the
intervals use Student's t and the level is calibrated by simulation of the planned looks (design_alpha): the false-
decision rate is about alpha on the plan, not a bound. The design (first seeds, round_seeds, max_seeds, alpha,
margin, metric) is fixed at the first look and recorded (new_design, check_design); sweep.extend_to changes it
only by spending the alpha not yet spent (extended_boundaries).

* Boundaries: Lan & DeMets (1983) alpha spending with the O'Brien-Fleming-type function, alpha / 2 a side,
  ``alpha_side(t) = 2 - 2 Phi(z_{1-alpha/4} / sqrt(t))`` at information fraction ``t = seeds / max_seeds`` (a seed's
  information is constant, so seeds measure it). Each c_k solves "the first exit at look k has probability
  alpha(t_k) - alpha(t_{k-1}) under no effect" by recursive numerical integration of the score's density over
  the looks' continuation regions (Armitage, McPherson & Rowe 1969): deterministic, unlike a Monte Carlo
  multivariate normal.
* Seeds are few, so the variance is estimated: c_k is taken at its nominal tail level on Student's t with the
  look's degrees of freedom (Jennison & Turnbull 2000, sec. 3.8 and 9.3). The simulation test checks the rate.
* A claim's m compared alternatives share alpha by Bonferroni (alpha / m each): the claim's false-decision rate is
  then about alpha or less. A comparison is decided at the first look whose interval lies within +-margin (equivalent) or
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
from scipy import optimize, special, stats

from mhalab.analysis.report.stats import (
    BETTER,
    DEFAULT_MARGIN,
    DEFAULT_METRIC,
    EQUIVALENT,
    INCONCLUSIVE,
    NOT_DECIDED,
    UNCLEAR,
    WORSE,
    verdict_of,
)
from mhalab.analysis.report.values import fmt_num
from mhalab.analysis.report.verdicts import compute_verdicts
from mhalab.errors import ConfigError

GRID = 1201  # points of the score's density on a look's continuation interval (odd: Simpson's rule)


def _simpson_weights(xs: np.ndarray) -> np.ndarray:
    """Weights w with w @ f equal to composite Simpson's rule for f on this evenly spaced grid of an odd number of
    points (what scipy's simpson computes there): the integrals below become matrix products."""
    w = np.full(len(xs), 2.0)
    w[1::2], w[0], w[-1] = 4.0, 1.0, 1.0
    return w * (xs[1] - xs[0]) / 3


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
    return _solve(fractions, tuple(spent(t, alpha) for t in fractions))


CAP = 8.0  # a boundary with nothing left to spend is infinite; the density goes on through +-CAP (P ~ 1e-15 outside)


def _solve(fractions: tuple[float, ...], cumulative: tuple[float, ...], fixed: tuple[float, ...] = ()) -> tuple:
    """c_k for looks at these fractions: the first len(fixed) as given (looks already taken), each later one such
    that the chance of a first exit there under no effect is cumulative[k] - cumulative[k - 1]."""
    if any(b <= a for a, b in itertools.pairwise(fractions)) or not 0 < fractions[0] or fractions[-1] > 1:
        raise ValueError(f"information fractions must increase within (0, 1]: {fractions}")
    out: list[float] = []
    xs = mass = None  # the score S_k = Z_k sqrt(t_k) (variance t_k) on the continuation region: grid, and its
    # density times Simpson's weights (integrating against it is a dot product)
    t_prev, cum_prev = 0.0, 0.0
    for k, t in enumerate(fractions):
        target = cumulative[k] - cum_prev
        sd = math.sqrt(t - t_prev)  # S_k = S_{k-1} + an independent N(0, t_k - t_{k-1})
        if k < len(fixed):
            c = fixed[k]
        elif target <= 1e-12:
            c = math.inf  # nothing left to spend at this look
        elif xs is None:
            c = float(stats.norm.isf(target / 2))
        else:
            c = float(optimize.brentq(_first_exit, 1e-6, 40.0, args=(t, sd, xs, mass, target), xtol=1e-10))
        b = min(c, CAP) * math.sqrt(t)
        grid = np.linspace(-b, b, GRID)
        if xs is None:
            dens = stats.norm.pdf(grid, scale=math.sqrt(t))
        else:
            scale = sd * math.sqrt(2)
            kernel = np.subtract.outer(grid / scale, xs / scale)  # (GRID new, GRID old), in place below: 1.4M each
            np.exp(np.negative(np.square(kernel, out=kernel), out=kernel), out=kernel)  # the normal pdf, unscaled
            dens = (kernel @ mass) / (sd * math.sqrt(2 * math.pi))  # (GRID,): the density carried one look on
        xs, mass, t_prev, cum_prev = grid, dens * _simpson_weights(grid), t, cumulative[k]
        out.append(c)
    return tuple(out)


@functools.lru_cache(maxsize=256)
def extended_boundaries(ns: tuple[int, ...], maxes: tuple[int, ...], alpha: float) -> tuple[float, ...]:
    """c_k for one comparison's looks at ns seeds, each taken under the max_seeds in force then (maxes: one design,
    or one extended by sweep.extend_to). Under the first max_seeds they are the plan's (boundaries at n / max). After
    an extension to N the looks already taken keep their boundaries and the level they spent; the level not yet
    spent is spent over the new looks (fractions n / N) in the O'Brien-Fleming shape, rescaled to end at alpha when
    N seeds are reached: the total chance of a false exit stays alpha (the looks and spending still to come may
    change while those taken are held fixed: Lan & DeMets 1989, *Biometrics* 45:1017; Proschan, Lan & Wittes 2006,
    *Statistical Monitoring of Clinical Trials*, ch. 5). This holds when the choice to extend does not depend on how
    near an interval came to deciding (a budget decision); an extension chosen for that reason needs the conditional
    error principle (Mueller & Schaefer 2001, *Biometrics* 57:886), which is not built. A design that reached its
    max_seeds has spent all of alpha: later looks get infinite boundaries."""
    cs: tuple[float, ...] = ()
    cumulative: tuple[float, ...] = ()  # the level spent up to each look
    start = 0
    while start < len(ns):
        end = next((j for j in range(start, len(ns)) if maxes[j] != maxes[start]), len(ns))
        fractions = tuple(min(n / maxes[start], 1.0) for n in ns[:end])
        if start == 0:
            cumulative = tuple(spent(t, alpha) for t in fractions)
        else:
            base, before = spent(fractions[start - 1], alpha), cumulative[-1]  # the shape: 0 at the last look taken
            cumulative = (*cumulative, *(before + (alpha - before) * (spent(t, alpha) - base) / (alpha - base)
                                         for t in fractions[start:]))
        cs = _solve(fractions, cumulative, fixed=cs)
        start = end
    return cs


def _first_exit(c: float, t: float, sd: float, xs: np.ndarray, mass: np.ndarray, target: float = 0.0) -> float:
    """P(no earlier exit, |Z_k| >= c) - target: the density still going at the last look (on grid xs, times Simpson's
    weights: mass) times the chance of crossing now."""
    b = c * math.sqrt(t)
    p = special.ndtr((xs - b) / sd) + special.ndtr((-b - xs) / sd)  # P(cross above) + P(cross below)
    return float(mass @ p) - target


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


def new_design(first: int, round_seeds: int, max_seeds: int, alpha: float, margin: float | None,
               metric: str) -> dict:
    """A sweep's sequential design, fixed at its first look and recorded in sequential.json: every later look,
    re-run and report reads it (check_design refuses another). margin: as mhalab-report takes it (points of an
    accuracy; None: the default, 1 point)."""
    return {"first": first, "round_seeds": round_seeds, "max_seeds": max_seeds, "alpha": alpha, "margin": margin,
            "metric": metric, "planned": list(planned_looks(first, round_seeds, max_seeds)), "extensions": []}


def margin_of(margin: float | None) -> float:
    """A design's margin in points (None: the default, DEFAULT_MARGIN): the one place that reads None so."""
    return DEFAULT_MARGIN if margin is None else float(margin)


def max_at(design: dict, k: int) -> int:
    """The max_seeds in force at look k (0-based): the design's, or an extension's from its look on."""
    return max([design["max_seeds"], *(e["max_seeds"] for e in design.get("extensions", []) if k >= e["at_look"])])


def planned_of(design: dict) -> list[int]:
    """Seeds at each planned look, as the last extension left the plan."""
    return list((design.get("extensions") or [design])[-1]["planned"])


# the keys of a design a user sets, and the option that sets each (check_design names them)
DESIGN_KEYS = {"first": "the first look's seeds", "round_seeds": "sweep.round_seeds", "max_seeds": "sweep.max_seeds",
               "alpha": "sweep.alpha", "margin": "sweep.margin", "metric": "metric"}


def check_design(recorded: dict, asked: dict, extend_to: int | None = None) -> None:
    """ConfigError (one line naming the recorded value) unless a re-run asks for the design its sequential.json
    recorded: a design changed after looking no longer holds its error rate (7% for 5%, continuing a 20-seed design
    to 30: tests/test_sequential.py). Only sweep.extend_to changes it, as the record says it was extended."""
    for key, option in DESIGN_KEYS.items():
        was, now = recorded.get(key), asked.get(key)
        if key == "margin":  # None is the default margin
            was, now = margin_of(was), margin_of(now)
        if was != now:
            fix = f"give {option}={was}" if key != "first" else f"give the seeds {recorded['planned'][0]} first"
            extend = (f", or extend it on purpose with sweep.extend_to={now}" if key == "max_seeds" and now > was
                      else "")
            raise ConfigError(f"{option}={now}: this sweep ran until decided with {option}={was} (its "
                              f"{RECORD}, fixed at its first look); a design changed after looking no longer holds "
                              f"its error rate: {fix}{extend} (docs/sweeps.md)")
    extended = recorded.get("extensions") or []
    last = extended[-1]["max_seeds"] if extended else None
    if extend_to != last and not (extend_to is not None and extend_to > max_at(recorded, 10**9)):
        raise ConfigError(f"sweep.extend_to={extend_to}: this sweep was extended to "
                          f"{last} seeds at look {extended[-1]['at_look'] + 1} ({RECORD}): give sweep.extend_to={last}"
                          if last is not None else
                          f"sweep.extend_to={extend_to}: this sweep's design allows {max_at(recorded, 10**9)} seeds "
                          "already; extend_to must be larger")


def extend(design: dict, looks: list[list[int]], to: int) -> dict:
    """The design extended to `to` seeds after the looks taken (extended_boundaries says how the level is kept);
    ConfigError where nothing is left to spend: a design that reached its max_seeds spent all of alpha there."""
    k, n = len(looks), len(looks[-1])
    if n >= max_at(design, k - 1):
        raise ConfigError(f"sweep.extend_to={to}: this sweep reached its max_seeds={max_at(design, k - 1)} at look "
                          f"{k} and spent all of alpha={design['alpha']} there, so no seed added now can decide a claim "
                          f"at that level (docs/sweeps.md): to test it again, run a new sweep with other seeds "
                          f"(seed={n},{n + 1},...) in a new hydra.sweep.dir")
    planned = [*planned_of(design)[:k], *planned_looks(n, design["round_seeds"], to)[1:]]
    return {**design, "extensions": [*design.get("extensions", []), {"at_look": k, "max_seeds": to,
                                                                      "planned": planned}]}


def read_looks(df: pd.DataFrame, looks: list[list[int]], design: dict) -> list[dict]:
    """Each look of a sequential sweep read in turn: look k sees the members whose seed is in looks[k]. For every
    covered claim: its comparisons' repeated intervals at alpha / m (Bonferroni over the m alternatives, each
    calibrated over the planned looks by design_alpha), their outcomes (sticky once decided) and the claim's
    verdict. A look also lists `undecided_rows`: df's index of the members in the groups of claims still
    inconclusive (claimed group and undecided alternatives), which the next round extends. design: new_design's,
    as recorded (its metric and margin, and the max_seeds in force at each look)."""
    alpha, metric, margin = design["alpha"], design.get("metric", DEFAULT_METRIC), design.get("margin")
    state: dict[tuple[str, str], dict] = {}  # (claim key, alternative) -> seeds and max_seeds at its looks, decision
    out = []
    for k, seeds in enumerate(looks):
        sub = df[pd.to_numeric(df["seed"], errors="coerce").isin(seeds)]
        max_seeds = max_at(design, k)
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
                st = state.setdefault((v.key, comp.alternative.label), {"ns": (), "maxes": (), "outcome": UNCLEAR})
                row = {"alternative": comp.alternative.label, "test": comp.test, "n": comp.n,
                       "effect": comp.effect, "low": math.nan, "high": math.nan, "z": math.nan,
                       "outcome": st["outcome"], "decided_at": st.get("decided_at")}
                n = min(comp.n, max_seeds)
                if comp.test != "none" and comp.se > 0 and (not st["ns"] or n > st["ns"][-1]):
                    st["ns"], st["maxes"] = (*st["ns"], n), (*st["maxes"], max_seeds)
                    z = extended_boundaries(st["ns"], st["maxes"], design_alpha(tuple(design["planned"]), alpha / m))[-1]
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


def read_record(root: Path) -> dict | None:
    """A sweep dir's sequential.json ({"design", "looks": each look's seeds, "command" that runs it}), or None."""
    path = Path(root) / RECORD
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    design = {"margin": None, "metric": DEFAULT_METRIC, "extensions": [], **rec["design"]}
    return {"design": design, "looks": [look["seeds"] for look in rec["looks"]], "command": rec.get("command")}


def check_reading(design: dict, metric: str, margin: float | None) -> None:
    """A report's metric and margin against the design's (ConfigError naming the recorded value): the looks' verdicts
    hold only under the design they were taken with."""
    recorded = design.get("margin")
    if metric != design.get("metric", DEFAULT_METRIC):
        raise ConfigError(f"metric={metric}: this sweep ran until decided on metric={design['metric']} (its {RECORD}); "
                          "its looks hold only under that design: drop metric=")
    if margin is not None and float(margin) != margin_of(recorded):
        raise ConfigError(f"margin={fmt_num(margin)}: this sweep ran until decided with margin "
                          f"{fmt_num(margin_of(recorded))} (its {RECORD}, fixed at its "
                          "first look); its looks hold only under that design: drop margin=")


def stop_reason(reads: list[dict], design: dict, df: pd.DataFrame) -> dict | None:
    """Why a sweep stops after its last look read (None: it goes on). `why`: "decided" (every covered claim decided),
    "max_seeds" (a claim still inconclusive at the budget: the design has spent all of alpha), "not decided" (no
    claim inconclusive, but one withheld: members not trained to the end, or models that did not learn; more seeds
    do not help), or "no claim" (the sweep covers none)."""
    last, k = reads[-1], len(reads) - 1
    verdicts = {key: c["verdict"] for key, c in last["claims"].items()}
    n, max_seeds = len(last["seeds"]), max_at(design, k)
    if INCONCLUSIVE in verdicts.values() and n < max_seeds:
        return None
    why = ("no claim" if not verdicts else "max_seeds" if INCONCLUSIVE in verdicts.values()
           else "not decided" if NOT_DECIDED in verdicts.values() else "decided")
    per_setting = df[pd.to_numeric(df["seed"], errors="coerce").isin(last["seeds"])].groupby("setting")["seed"].nunique()
    return {"why": why, "look": k + 1, "seeds": n, "max_seeds": max_seeds, "budget": max_seeds * len(per_setting),
            "unused": int((max_seeds - per_setting).clip(lower=0).sum()),
            "reasons": {c["claim"]: c["reason"] for c in last["claims"].values() if c["verdict"] == NOT_DECIDED}}


def stop_words(stop: dict | None, reads: list[dict], design: dict, command: str | None) -> str:
    """stop_reason in a sentence: what decided it, the seeds of the budget left unused, and what continues it."""
    again = f" (`{command}`)" if command else ""
    if stop is None:
        last = reads[-1]
        return (f"it has not stopped: look {last['look']} of {len(planned_of(design))} planned, "
                f"{len(last['seeds'])} of {max_at(design, len(reads) - 1)} seeds; the same command continues it{again}.")
    head = f"look {stop['look']}, {stop['seeds']} seeds of the {stop['max_seeds']} the design allows"
    unused = f"{stop['unused']} of the budget's {stop['budget']} members left unused"
    if stop["why"] == "decided":
        return f"every claim decided ({head}); {unused}."
    if stop["why"] == "max_seeds":
        return (f"max_seeds reached ({head}) with a claim still inconclusive. The design has spent all of its alpha, "
                "so no seed added to it can decide at that level: a new sweep with other seeds (and its own design) "
                "tests the claim again.")
    if stop["why"] == "not decided":
        why = "; ".join(f"{claim}: {reason.rstrip('.')}" for claim, reason in stop["reasons"].items())
        return (f"not decided ({head}; {unused}): {why}. More seeds do not help; the sweep that can decide it is "
                "another design, in a new hydra.sweep.dir.")
    return f"the sweep covers no claim of the article ({head})."


def markdown(reads: list[dict], design: dict, command: str | None, df: pd.DataFrame, scale: float,
             unit: str) -> list[str]:
    """The report's section on a sweep run until decided: why it stopped, each look's verdicts, then each
    comparison's repeated interval at the last look it gained seeds, and the look that decided it."""
    last = reads[-1]
    margin = margin_of(design.get("margin"))
    extended = "".join(f"; extended to {e['max_seeds']} seeds after look {e['at_look']} (sweep.extend_to: the looks "
                       "taken keep their boundaries, the level not yet spent goes to the new looks)"
                       for e in design.get("extensions", []))
    L = ["## Seeds until decided: the verdicts to read", "",
         (f"This sweep added seeds after looking (`sweep.until_decided=true`: first look at {design['first']} seeds, "
          f"then {design['round_seeds']} a round, at most {design['max_seeds']}{extended}; margin ±{fmt_num(margin)}"
          f"{unit}, metric `{design.get('metric', DEFAULT_METRIC)}`, fixed at its first look). Its verdicts are read "
          f"from repeated {100 * (1 - design['alpha']):.0f}% confidence intervals with O'Brien-Fleming-type alpha "
          "spending (Jennison & Turnbull 1989; Lan & DeMets 1983), calibrated so that a false decision comes about "
          f"{100 * design['alpha']:g}% of the time over all its planned looks; the fixed-sample verdicts further "
          "down do not hold their level after looking. docs/sweeps.md says how."), ""]
    stop = stop_reason(reads, design, df)
    L += [f"**{'Why it stopped' if stop else 'Where it stands'}:** {stop_words(stop, reads, design, command)}", ""]
    L += ["| look | seeds | " + " | ".join(c["claim"] for c in last["claims"].values()) + " |",
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
