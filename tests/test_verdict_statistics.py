"""The verdict statistics (mhalab.analysis.report.stats): each test against scipy's, Holm's correction,
the four verdicts on tables with known answers, and the power and false-positive rates on simulated sweeps.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from mhalab.analysis.report.stats import (
    ALPHA,
    CONTRADICTED,
    INCONCLUSIVE,
    NO_DIFFERENCE,
    SUPPORTED,
    GroupStats,
    claim_verdict,
    compare,
    detectable_effect,
    holm,
)
from mhalab.analysis.report.verdicts import compute_verdicts

MARGIN = 0.01  # 1 point of accuracy, in metric units


def _group(values, seeds=None, label="g") -> GroupStats:
    seeds = list(range(len(values))) if seeds is None else seeds
    return GroupStats.of(label, pd.DataFrame({"monitored": values, "seed": seeds}))


def _fast_group(values: np.ndarray, seeds: pd.Index) -> GroupStats:
    """GroupStats.of's result for one run per seed, without the DataFrame (the simulations build thousands)."""
    return GroupStats("g", len(values), pd.Series(values, index=seeds))


def test_fast_group_equals_group_stats_of():
    g, f = _group(C, [3, 1, 4, 0, 2]), _fast_group(np.array(C), pd.Index([3, 1, 4, 0, 2]))
    assert (g.n, g.n_seeds, g.mean, g.std) == (f.n, f.n_seeds, pytest.approx(f.mean), pytest.approx(f.std))
    assert g.per_seed.sort_index().tolist() == f.per_seed.sort_index().tolist()


C = [0.812, 0.798, 0.825, 0.806, 0.819]
A = [0.801, 0.795, 0.809, 0.800, 0.804]


def test_paired_comparison_equals_scipys_paired_t_test_interval_and_tost():
    comp = compare(_group(C), _group(A), 1.0, MARGIN)
    assert comp.test == "paired" and comp.n == 5 and comp.df == 4
    d = np.subtract(C, A)
    assert comp.effect == pytest.approx(d.mean())
    assert comp.p_diff == pytest.approx(stats.ttest_rel(C, A).pvalue, rel=1e-10)
    ci = stats.ttest_rel(C, A).confidence_interval(0.95)
    assert (comp.ci_low, comp.ci_high) == pytest.approx((ci.low, ci.high), rel=1e-10)
    tost = max(stats.ttest_1samp(d, -MARGIN, alternative="greater").pvalue,
               stats.ttest_1samp(d, MARGIN, alternative="less").pvalue)
    assert comp.p_equivalent == pytest.approx(tost, rel=1e-10)


def test_welch_comparison_when_the_groups_have_other_seeds_equals_scipys():
    comp = compare(_group(C, seeds=[0, 1, 2, 3, 4]), _group(A[:4], seeds=[5, 6, 7, 8]), 1.0, MARGIN)
    assert comp.test == "welch"
    res = stats.ttest_ind(C, A[:4], equal_var=False)
    assert comp.p_diff == pytest.approx(res.pvalue, rel=1e-10)
    assert comp.df == pytest.approx(res.df, rel=1e-10)
    ci = stats.ttest_ind(C, A[:4], equal_var=False).confidence_interval(0.95)
    assert (comp.ci_low, comp.ci_high) == pytest.approx((ci.low, ci.high), rel=1e-10)
    tost = max(stats.ttest_ind(np.add(C, MARGIN), A[:4], equal_var=False, alternative="greater").pvalue,
               stats.ttest_ind(np.subtract(C, MARGIN), A[:4], equal_var=False, alternative="less").pvalue)
    assert comp.p_equivalent == pytest.approx(tost, rel=1e-10)


def test_paired_comparison_uses_only_the_shared_seeds():
    comp = compare(_group(C + [0.9], seeds=[0, 1, 2, 3, 4, 9]), _group(A), 1.0, MARGIN)
    assert comp.test == "paired" and comp.n == 5
    assert comp.p_diff == pytest.approx(stats.ttest_rel(C, A).pvalue, rel=1e-10)


def test_a_loss_metric_flips_the_sign_so_lower_is_better():
    comp = compare(_group(A), _group(C), -1.0, MARGIN)  # A has the lower values: better for a loss
    assert comp.effect == pytest.approx(np.mean(np.subtract(C, A)))
    assert comp.p_diff == pytest.approx(stats.ttest_rel(C, A).pvalue, rel=1e-10)


def test_holm_adjusted_p_values_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> running max 0.02, 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    out = holm([0.01, math.nan])
    assert out[0] == pytest.approx(0.01) and math.isnan(out[1])  # NaN is not a test


def _dropout_table(claimed, alternatives: dict[float, list[float]]) -> pd.DataFrame:
    rows = [{"dropout": 0.1, "seed": s, "monitored": v} for s, v in enumerate(claimed)]
    for p, vals in alternatives.items():
        rows += [{"dropout": p, "seed": s, "monitored": v} for s, v in enumerate(vals)]
    return pd.DataFrame(rows).assign(dim=128, heads=4, ff_dim=512, status="finished")


def _dropout_verdict(df: pd.DataFrame, margin: float = 1.0):
    return {v.key: v for v in compute_verdicts(df, margin=margin)}["dropout_0.1"]


NOISE = [0.004, -0.003, 0.001, -0.004, 0.002]  # a seed's luck, shared by its runs


@pytest.mark.parametrize("name,alternatives,expected", [
    # +3 points over both alternatives, seed noise 0.3 points: better than each
    ("supported", {0.0: -0.03, 0.3: -0.03}, SUPPORTED),
    # one alternative 3 points better: contradicted, whatever the other
    ("contradicted", {0.0: 0.03, 0.3: -0.03}, CONTRADICTED),
    # within 0.1 point of one (the interval inside +-1 point), 3 points better than the other
    ("no-practical-difference", {0.0: 0.001, 0.3: -0.03}, NO_DIFFERENCE),
])
def test_verdicts_on_tables_with_known_answers(name, alternatives, expected):
    base = 0.80 + np.array(NOISE)
    wobble = np.array([0.0005, -0.0005, 0.0, 0.0005, -0.0005])  # the setting's own noise on top of the seed's
    df = _dropout_table(base, {p: base + shift + wobble * (i + 1) for i, (p, shift) in enumerate(alternatives.items())})
    v = _dropout_verdict(df)
    assert v.verdict == expected, v.reason
    assert all(c.test == "paired" for c in v.comparisons)


def test_inconclusive_when_the_interval_crosses_the_margin():
    rng = np.random.default_rng(0)
    base = 0.80 + rng.normal(0, 0.02, 5)  # 2-point noise per run, not shared: 5 seeds cannot tell 1 point apart
    df = _dropout_table(base, {0.0: 0.80 + rng.normal(0, 0.02, 5)})
    v = _dropout_verdict(df)
    assert v.verdict == INCONCLUSIVE
    c = v.comparisons[0]
    assert c.ci_low < -0.01 or c.ci_high > 0.01  # the 95% interval reaches past the margin


def test_the_margin_is_configurable_and_decides_no_practical_difference():
    base = 0.80 + np.array(NOISE)
    df = _dropout_table(base, {0.0: base - 0.006 + np.array([0.001, -0.001, 0.0, 0.001, -0.001])})
    assert _dropout_verdict(df, margin=1.0).verdict == NO_DIFFERENCE  # 0.6 points < 1-point margin
    assert _dropout_verdict(df, margin=0.2).verdict == SUPPORTED  # 0.6 points matter at a 0.2-point margin


def test_one_seed_per_group_is_inconclusive_with_the_reason():
    v = _dropout_verdict(_dropout_table([0.9], {0.0: [0.7]}))
    assert v.verdict == INCONCLUSIVE and "fewer than 2 seeds" in v.reason


def test_a_swept_lr_is_tuned_per_width_not_averaged():
    rows = []
    # dim 64 is best at lr 2e-3, dim 256 at 5e-4; averaged over lr the wide model would look worse
    for dim, by_lr in {64: {5e-4: 0.70, 2e-3: 0.78}, 256: {5e-4: 0.82, 2e-3: 0.60}}.items():
        for lr, mean in by_lr.items():
            rows += [{"dim": dim, "lr": lr, "seed": s, "monitored": mean + n} for s, n in enumerate(NOISE)]
    df = pd.DataFrame(rows).assign(heads=4, ff_dim=lambda d: 4 * d["dim"], dropout=0.1, status="finished")
    v = {v.key: v for v in compute_verdicts(df)}["wider_dim"]
    assert v.tuned == {"widest dim=256": "lr=0.0005", "dim=64": "lr=0.002"}
    assert v.claimed.mean == pytest.approx(0.82) and v.comparisons[0].effect == pytest.approx(0.04)
    assert v.verdict == SUPPORTED


# --------------------------------------------------------------------------------------------------
# power and false positives on simulated sweeps: claim vs one alternative, 5 seeds, seed SD 1 point

TABLES = 2000


def _simulate(effect: float, shared: float, paired: bool, seed: int) -> float:
    """Share of TABLES simulated tables whose claim is "supported". Each run's value has SD 0.01 (1 point):
    a seed effect shared by the seed's runs (variance share `shared`) plus the run's own noise."""
    rng = np.random.default_rng(seed)
    hits = 0
    seeds_c, seeds_a = pd.RangeIndex(5), (pd.RangeIndex(5) if paired else pd.RangeIndex(5, 10))
    for _ in range(TABLES):
        u = rng.normal(0, 0.01 * math.sqrt(shared), 5)
        own = 0.01 * math.sqrt(1 - shared)
        c = 0.80 + effect + u + rng.normal(0, own, 5)
        a = 0.80 + (u if paired else rng.normal(0, 0.01 * math.sqrt(shared), 5)) + rng.normal(0, own, 5)
        verdict, _, _ = claim_verdict(_fast_group(c, seeds_c), [_fast_group(a, seeds_a)], 1.0, MARGIN)
        hits += verdict == SUPPORTED
    return hits / TABLES


def _noncentral_power(effect: float, se: float, df: float) -> float:
    """P(the two-sided t-test at ALPHA finds the claimed group better) for a true effect: the noncentral t's tail."""
    return float(stats.nct.sf(stats.t.ppf(1 - ALPHA / 2, df), df, effect / se))


MC = 3 * math.sqrt(0.25 / TABLES)  # 3 Monte Carlo standard errors at most


def test_power_with_shared_seeds_is_at_least_90_percent_for_a_2_point_effect():
    # the sweeps' design: the runs of a seed share data order and initial draws (here half the variance)
    rate = _simulate(0.02, shared=0.5, paired=True, seed=1)
    assert rate >= 0.90
    assert rate == pytest.approx(_noncentral_power(0.02, 0.01 / math.sqrt(5), 4), abs=MC)  # 0.909


def test_power_with_independent_seeds_matches_welchs_noncentral_t():
    # other seeds per group: Welch's test, ~8 degrees of freedom; 2 points at SD 1 and 5 seeds gives 0.79
    # (6 seeds: 0.87, 8: 0.95); pairing by seed is what lifts the sweeps' design above 0.9
    rate = _simulate(0.02, shared=0.5, paired=False, seed=2)
    expected = _noncentral_power(0.02, 0.01 * math.sqrt(2 / 5), 8)
    assert expected == pytest.approx(0.79, abs=0.01)
    assert rate == pytest.approx(expected, abs=MC + 0.01)  # Welch's df varies per table


@pytest.mark.parametrize("paired", [True, False], ids=["paired", "welch"])
def test_no_effect_gives_a_false_supported_in_at_most_5_percent(paired):
    rate = _simulate(0.0, shared=0.5, paired=paired, seed=3)
    assert rate <= ALPHA / 2 + MC  # the two-sided test's upper tail: 2.5%


@pytest.mark.parametrize("n, alpha", [(5, 0.05), (3, 0.05), (10, 0.05 / 3)])
def test_detectable_effect_is_found_with_80_percent_power_in_simulated_paired_designs(n, alpha):
    """A true effect equal to detectable_effect(sd / sqrt(n), n - 1) is found by the paired t-test in 80% of
    simulated designs of n seeds (here 40,000 designs: the rate's standard error is 0.2 points)."""
    sd = 1.3
    d = detectable_effect(sd / math.sqrt(n), n - 1, alpha=alpha)
    diffs = np.random.default_rng(0).normal(d, sd, size=(40_000, n))  # per-seed differences, each row a design
    t = diffs.mean(1) / (diffs.std(1, ddof=1) / math.sqrt(n))
    found = np.mean(2 * stats.t.sf(np.abs(t), n - 1) < alpha)
    assert abs(found - 0.80) < 0.01, (d, found)
    # half that effect is found far less often: the figure is a threshold, not a formality
    half = diffs - d / 2
    t_half = half.mean(1) / (half.std(1, ddof=1) / math.sqrt(n))
    assert np.mean(2 * stats.t.sf(np.abs(t_half), n - 1) < alpha) < 0.45


def test_a_comparison_states_its_detectable_effect_from_the_seed_variance():
    claimed = GroupStats.of("a", pd.DataFrame({"monitored": [80.0, 81.0, 79.5, 80.5, 80.2], "seed": range(5)}))
    other = GroupStats.of("b", pd.DataFrame({"monitored": [79.0, 80.8, 79.9, 79.7, 80.0], "seed": range(5)}))
    comp = compare(claimed, other, 1.0, 1.0)
    assert comp.test == "paired" and comp.detectable == pytest.approx(detectable_effect(comp.se, 4))
    assert comp.detectable > comp.ci_high - comp.effect  # above the interval's half-width (95% -> 80% power)


def test_a_claim_with_several_alternatives_states_the_detectable_effect_at_holms_strictest_step():
    rng = np.random.default_rng(5)
    seeds = pd.RangeIndex(5)
    claimed = _fast_group(0.80 + rng.normal(0, 0.01, 5), seeds)
    alts = [_fast_group(0.79 + rng.normal(0, 0.01, 5), seeds) for _ in range(3)]
    _, _, comps = claim_verdict(claimed, alts, 1.0, MARGIN)
    for comp in comps:  # found at 0.05 / 3, whatever the other comparisons do: larger than a lone test's
        assert comp.detectable == pytest.approx(detectable_effect(comp.se, comp.df, alpha=0.05 / 3))
        assert comp.detectable > detectable_effect(comp.se, comp.df)
    (alone,) = claim_verdict(claimed, alts[:1], 1.0, MARGIN)[2]
    assert alone.detectable == pytest.approx(detectable_effect(alone.se, alone.df))  # one alternative: at 0.05


def _power(n: int, effect: float, sd: float, alpha: float, designs: int = 40_000) -> float:
    """The paired t-test's rejection rate over simulated designs of n seeds with this true effect."""
    diffs = np.random.default_rng(n).normal(effect, sd, size=(designs, n))
    t = diffs.mean(1) / (diffs.std(1, ddof=1) / math.sqrt(n))
    return float(np.mean(2 * stats.t.sf(np.abs(t), n - 1) < alpha))


@pytest.mark.parametrize("sd, alpha", [(1.3, 0.05), (0.6, 0.05), (1.8, 0.05 / 3)])
def test_seeds_needed_give_80_percent_power_at_the_margin_in_simulated_paired_designs(sd, alpha):
    """seeds_needed's n, planned from a design whose seed spread is sd: a true effect of the margin (1 point) is found
    in >= 80% of simulated designs of n seeds and in < 80% with n - 1 (40,000 designs each: standard error 0.2
    points, so the bounds allow 1 point)."""
    from mhalab.analysis.report.stats import seeds_needed

    observed = compare(_group([0.0, 0.0], label="a"), _group([0.0, 0.0], label="b"), 1.0, 1.0)
    observed.test, observed.unit_var = "paired", sd ** 2  # a paired design whose differences spread by sd
    n = int(seeds_needed(observed, margin=1.0, alpha=alpha))
    assert _power(n, 1.0, sd, alpha) >= 0.79
    assert _power(n - 1, 1.0, sd, alpha) < 0.81
    assert n > (sd * (stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(0.8))) ** 2  # t needs more than z's count


def test_an_inconclusive_claim_states_the_seeds_and_cpu_hours_that_would_decide_it():
    """From its comparisons' seed variance and its members' wall time: the seeds per group, how many to add, and the
    CPU hours they cost (one member per group and seed, 360 s each: 720 s per added seed)."""
    rng = np.random.default_rng(11)
    rows = [{"status": "finished", "seed": s, "monitored": 0.80 + (0.004 if d == 0.1 else 0.0) + rng.normal(0, 0.01),
             "dim": 128, "heads": 4, "ff_dim": 512, "dropout": d, "wall_time_s": 360.0}
            for d in (0.1, 0.2) for s in range(5)]
    (v,) = [v for v in compute_verdicts(pd.DataFrame(rows)) if v.key == "dropout_0.1"]
    assert v.verdict == INCONCLUSIVE
    (comp,) = v.comparisons
    from mhalab.analysis.report.stats import seeds_needed

    assert v.seeds_needed == seeds_needed(comp, MARGIN) > 5
    assert v.extra_seeds == v.seeds_needed - 5
    assert v.cpu_hours_needed == pytest.approx(v.extra_seeds * 2 * 360 / 3600)
    assert f"~{int(v.seeds_needed)} seeds per group" in v.reason and f"{int(v.extra_seeds)} more" in v.reason


def test_mhalab_report_prints_what_would_decide_the_committed_sst2_dropout_claim(tmp_path, capsys):
    """The summary a user reads: on the committed SST-2 dropout sweep's first 5 seeds (the sweep as it stood before
    seeds were added until decided), the plan in seeds and CPU hours."""
    from pathlib import Path

    import pandas as pd

    from mhalab.analysis.report import main

    table = pd.read_csv(Path(__file__).parents[1] / "results/sweeps/sst2/dropout/results.csv")
    table[table["seed"] < 5].to_csv(tmp_path / "results.csv", index=False)
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert ("dropout 0.1: inconclusive" in out and "to decide it: ~36 seeds per group would find an effect of 1 pts "
            "with 80% power (31 more, ~12.1 CPU h at these members' times)" in out), out
