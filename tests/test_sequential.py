"""Seeds until decided (mhalab.analysis.report.sequential and the until_decided sweeper): the boundaries against the
published values, the false-decision rate under repeated looking by simulation, and the command a user types."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from mhalab.analysis.report.sequential import (
    boundaries,
    decide,
    design_alpha,
    new_design,
    planned_looks,
    read_looks,
    t_critical,
)
from mhalab.analysis.report.stats import BETTER, EQUIVALENT, UNCLEAR, WORSE

REPO = Path(__file__).resolve().parents[1]
LOOKS = planned_looks(5, 2, 20)  # the SST-2 dropout plan: 5, 7, ..., 19, 20 seeds


def test_boundaries_equal_the_published_obrien_fleming_type_lan_demets_values():
    # Lan-DeMets O'Brien-Fleming-type spending, two-sided alpha 0.05, equally spaced looks: the values gsDesign
    # (sfLDOF, test.type=2) and ldbounds print (Jennison & Turnbull 2000, table 7.6's design)
    assert boundaries((0.2, 0.4, 0.6, 0.8, 1.0), 0.05) == pytest.approx((4.877, 3.357, 2.680, 2.290, 2.031), abs=1e-3)
    assert boundaries((0.25, 0.5, 0.75, 1.0), 0.05) == pytest.approx((4.333, 2.963, 2.359, 2.014), abs=1e-3)
    assert boundaries((1.0,), 0.05) == pytest.approx((stats.norm.isf(0.025),), abs=1e-9)  # one look: fixed sample


def _sequential_outcomes(d: np.ndarray, looks: tuple[int, ...], alpha: float, margin: float) -> tuple[np.ndarray, ...]:
    """Each simulated table's first decision (rows: tables, columns: seeds' paired differences), by the repeated
    intervals of read_looks and by a fixed-sample 1 - alpha interval read at every look (naive)."""
    zs = boundaries(tuple(n / looks[-1] for n in looks), design_alpha(looks, alpha))
    seq = np.full(len(d), UNCLEAR, dtype=object)
    naive = seq.copy()
    for n, z in zip(looks, zs):
        mean, se = d[:, :n].mean(1), d[:, :n].std(1, ddof=1) / math.sqrt(n)
        for out, crit in ((seq, t_critical(z, n - 1)), (naive, stats.t.isf(alpha / 2, n - 1))):
            now = decide(mean - crit * se, mean + crit * se, margin)
            out[:] = np.where(out == UNCLEAR, now, out)
    return seq, naive


@pytest.mark.parametrize("alpha", [0.05, 0.05 / 3])
def test_repeated_intervals_hold_the_false_decision_rate_under_every_look_where_naive_looking_does_not(alpha):
    rng = np.random.default_rng(2026)  # other draws than design_alpha's calibration
    draws, sd, margin = 60_000, 1.7, 1.0  # SST-2 dropout 0.1 vs 0: per-seed differences spread by 1.7 points
    tol = 2.5 * math.sqrt(alpha * (1 - alpha) / draws)  # Monte Carlo error
    # no effect: a "better" or "worse" is false
    seq, naive = _sequential_outcomes(rng.normal(0.0, sd, (draws, LOOKS[-1])), LOOKS, alpha, margin)
    false_diff, naive_diff = np.isin(seq, [BETTER, WORSE]).mean(), np.isin(naive, [BETTER, WORSE]).mean()
    assert false_diff <= alpha + tol
    assert naive_diff > 2.5 * alpha  # what looking 9 times at a fixed-sample interval does
    # an effect of the margin itself: an "equivalent" is false
    seq, naive = _sequential_outcomes(rng.normal(margin, sd, (draws, LOOKS[-1])), LOOKS, alpha, margin)
    assert (seq == EQUIVALENT).mean() <= alpha + tol
    assert (naive == EQUIVALENT).mean() > (seq == EQUIVALENT).mean()


def test_a_claim_over_three_alternatives_sharing_the_claimed_group_errs_at_most_alpha():
    """The claim's false verdict (any comparison decided better or worse when no setting matters), with the seeds'
    luck shared by the four groups as in a real sweep, at alpha / 3 per comparison."""
    rng = np.random.default_rng(7)
    draws, alpha = 30_000, 0.05
    seed_luck = rng.normal(0, 1.0, (draws, 1, LOOKS[-1]))
    groups = seed_luck + rng.normal(0, 1.2, (draws, 4, LOOKS[-1]))  # group 0 claimed, 1-3 the alternatives
    wrong = np.zeros(draws, bool)
    for alt in (1, 2, 3):
        seq, _ = _sequential_outcomes(groups[:, 0] - groups[:, alt], LOOKS, alpha / 3, 1.0)
        wrong |= np.isin(seq, [BETTER, WORSE])
    assert wrong.mean() <= alpha + 2.5 * math.sqrt(alpha * (1 - alpha) / draws)


def test_design_alpha_lowers_the_level_so_the_t_version_errs_at_alpha_and_is_deterministic():
    a = design_alpha(LOOKS, 0.05)
    assert 0.040 < a < 0.05  # the t version at the nominal level errs more often (~5.5%)
    design_alpha.cache_clear()
    assert design_alpha(LOOKS, 0.05) == a


def _table(values: dict[tuple[float, int], float]) -> pd.DataFrame:
    rows = [{"member": f"m{p}_{s}", "overrides": f"dropout={p} seed={s}", "setting": f"dropout={p}", "seed": s,
             "status": "finished", "monitored": v, "dim": 128, "heads": 4, "ff_dim": 512, "dropout": p,
             "wall_time_s": 100.0} for (p, s), v in values.items()]
    return pd.DataFrame(rows)


def test_read_looks_keeps_a_decided_comparison_and_extends_only_the_undecided_groups():
    rng = np.random.default_rng(0)
    seeds = range(9)
    luck = rng.normal(0.80, 0.01, 9)
    vals = {}
    for s in seeds:
        vals[(0.1, s)] = luck[s] + 0.10 + rng.normal(0, 0.001)  # far better than 0.0: decided at once
        vals[(0.0, s)] = luck[s] + rng.normal(0, 0.001)
        vals[(0.2, s)] = luck[s] + 0.10 + rng.normal(0, 0.02)  # noisy against 0.1: undecided
    df = _table(vals)
    reads = read_looks(df, [list(range(5)), list(range(7)), list(range(9))], new_design(5, 2, 9, 0.05, None, "val/acc"))
    first, last = reads[0]["claims"]["dropout_0.1"], reads[-1]["claims"]["dropout_0.1"]
    by_alt = {c["alternative"]: c for c in last["comparisons"]}
    assert by_alt["dropout=0"]["outcome"] == BETTER and by_alt["dropout=0"]["decided_at"] == 0
    assert by_alt["dropout=0.2"]["outcome"] == UNCLEAR and last["verdict"] == "inconclusive"
    assert {c["alternative"]: c["outcome"] for c in first["comparisons"]}["dropout=0"] == BETTER
    extended = set(df.loc[reads[-1]["undecided_rows"], "dropout"])
    assert extended == {0.1, 0.2}  # not dropout 0: its comparison is decided
    # the repeated interval is wider than the fixed-sample 95% one at the same look
    fixed = stats.t.isf(0.025, 8) * np.std([vals[(0.1, s)] - vals[(0.2, s)] for s in seeds], ddof=1) / 3
    assert by_alt["dropout=0.2"]["high"] - by_alt["dropout=0.2"]["low"] > 2 * fixed


def test_a_sweep_run_until_decided_adds_seeds_only_where_needed_and_a_rerun_replays_it(tmp_path, toy_data_dir,
                                                                                        fork_server):
    """The command a user types, continuing a sweep whose first seeds are in a results.csv (members gone, as a
    committed copy): look 1 reads them, the round runs seed 2 of each setting, and a re-run launches nothing."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    setting = ["layers=1", "dim=32", "batch_size=32", "max_len=32", "max_epochs=1", "data.vocab_size=200",
               "data.min_frequency=1", "++trainer.limit_train_batches=2", "++trainer.limit_test_batches=1"]
    first = {("0.0", 0): 0.80, ("0.0", 1): 0.84, ("0.1", 0): 0.81, ("0.1", 1): 0.86}  # learned, undecided
    pd.DataFrame([{"member": f"gone/{p}/{s}", "overrides": " ".join([f"dropout={p}", *setting, f"seed={s}"]),
                   "seed": s, "status": "finished", "best_val_acc": v, "dim": 32, "heads": 4, "ff_dim": 128,
                   "dropout": float(p), "wall_time_s": 10.0, "val_majority_acc": 0.5, "val_classes_predicted": 2}
                  for (p, s), v in first.items()]).to_csv(sweep / "results.csv", index=False)
    cmd = [sys.executable, str(REPO / "train.py"), "-m", "hydra/sweeper=until_decided", "sweep.until_decided=true",
           "sweep.max_seeds=3", "sweep.round_seeds=1", f"hydra.sweep.dir={sweep}", f"paths.data_dir={toy_data_dir}",
           f"paths.cache_dir={tmp_path / 'cache'}", "trainer=cpu", "trainer.enable_progress_bar=false",
           "dropout=0.0,0.1", "seed=0,1", *setting]
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = fork_server.run(cmd, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((sweep / "sequential.json").read_text())
    assert [look["seeds"] for look in record["looks"]] == [[0, 1], [0, 1, 2]]
    assert record["looks"][0]["verdicts"] == {"dropout_0.1": "inconclusive"}
    assert record["design"]["planned"] == [2, 3] and record["stopped"] is not None
    members = sorted(p.name.split(",~")[0] for p in sweep.iterdir() if (p / "metrics.json").is_file())
    assert members == ["dropout=0.0,seed=2", "dropout=0.1,seed=2"]  # only the new seed: seeds 0-1 came from the csv
    table = pd.read_csv(sweep / "results.csv")
    assert sorted(table["seed"]) == [0, 0, 1, 1, 2, 2]  # the csv's rows kept beside the new members
    report = (sweep / "report.md").read_text()
    assert "## Seeds until decided: the verdicts to read" in report and "| 2 | 3 (0-2) |" in report
    # the rows read back from results.csv are counted, and the checks their old columns cannot support are named
    assert ("4 of 6 members come from this dir's results.csv (their member dirs are gone); the rows of 4 of 6 "
            "finished members predate planned_steps, so whether each of them was trained to the end is not "
            "checked.") in report
    again = fork_server.run(cmd, cwd=tmp_path, env=env, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Launching" not in again.stdout + again.stderr
    assert json.loads((sweep / "sequential.json").read_text()) == record


OUTSIDE = ("error: sweep.until_decided=true is read by the until_decided sweeper, which this run does not use: run a "
           "sweep preset with -m (sweep=dropout ...), or add -m hydra/sweeper=until_decided.")


@pytest.mark.parametrize("args,line", [
    (["sweep.until_decided=true"], OUTSIDE),  # a single run
    (["-m", "dropout=0.0,0.1", "seed=0,1", "sweep.until_decided=true"], OUTSIDE),  # Hydra's basic sweeper
    (["-m", "hydra/sweeper=until_decided", "sweep.until_decided=true", "dropout=0.0,0.1", "seed=0"],
     ("error: sweep.max_seeds=20, sweep.round_seeds=2, sweep.alpha=0.05 with 1 first seeds: needs at least 2 first "
      "seeds (seed=0,1,...), max_seeds above their number, round_seeds >= 1 and alpha in (0, 1)")),
], ids=["single run", "basic sweeper", "one first seed"])
def test_until_decided_misused_is_refused_in_one_line_before_any_member_runs(args, line, tmp_path, toy_data_dir,
                                                                              fork_server):
    cmd = [sys.executable, str(REPO / "train.py"), *args, f"hydra.run.dir={tmp_path / 'run'}",
           f"hydra.sweep.dir={tmp_path / 'sweep'}", f"paths.data_dir={toy_data_dir}", "trainer=cpu"]
    proc = fork_server.run(cmd, cwd=tmp_path, env=dict(os.environ, PYTHONHASHSEED="0"), timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == line
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("*/**/metrics.json"))  # no member ran


def test_the_claims_table_reads_a_sweep_run_until_decided_from_its_repeated_intervals(tmp_path):
    """mhalab-claims on a sweep folder with a sequential.json: the verdict and interval of its last look, not the
    fixed-sample test of all its seeds (which does not hold its level after looking)."""
    from mhalab.analysis.claims import render

    folder = tmp_path / "sst2" / "dropout"
    folder.mkdir(parents=True)
    first = pd.read_csv(REPO / "results/sweeps/sst2/dropout/results.csv")
    first[first["seed"] < 5].to_csv(folder / "results.csv", index=False)  # the sweep's first look: seeds 0-4
    plain = render(tmp_path, baselines=None)
    assert "| **inconclusive** | +0.8 [+0.1, +1.5] vs dropout=0.2 |" in plain  # the fixed-sample row
    (folder / "sequential.json").write_text(json.dumps(
        {"design": {"first": 5, "round_seeds": 2, "max_seeds": 20, "alpha": 0.05, "planned": list(LOOKS)},
         "looks": [{"seeds": [0, 1, 2, 3, 4]}]}))
    df = pd.read_csv(folder / "results.csv")
    look = read_looks(df, [[0, 1, 2, 3, 4]], new_design(5, 2, 20, 0.05, None, "val/acc"))[0]["claims"]["dropout_0.1"]
    closest = min(look["comparisons"], key=lambda c: c["effect"])
    table = render(tmp_path, baselines=None)
    assert (f"| **inconclusive** (seeds until decided: look 1 of 9) | {closest['effect'] * 100:+.1f} "
            f"[{closest['low'] * 100:+.1f}, {closest['high'] * 100:+.1f}] repeated CI vs dropout=0.2 |") in table
    assert closest["high"] - closest["low"] > 0.1  # 5 of 20 seeds: the first look's interval is wide
