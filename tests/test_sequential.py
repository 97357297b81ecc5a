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
    extended_boundaries,
    new_design,
    planned_looks,
    read_looks,
    stop_words,
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
                   "dropout": float(p), "wall_time_s": 10.0, "val_majority_acc": 0.5, "val_classes_predicted": 2,
                   "init_draw": "keyed"}
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
    assert record["design"]["planned"] == [2, 3] and record["stopped"]["why"] == "not decided"  # its new members ran 2 batches
    command = record["command"]  # what continues it: the overrides as typed, into its dir
    assert command.startswith("mhalab-train -m hydra/sweeper=until_decided sweep.until_decided=true ")
    assert "dropout=0.0,0.1 seed=0,1" in command and "hydra.mode" not in command
    assert command.endswith(f" hydra.sweep.dir={sweep}") and command.count("hydra.sweep.dir=") == 1
    assert f"stopped: {stop_words(record['stopped'], [], record['design'], record['command'])}" in proc.stdout
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


def test_a_design_changed_after_looking_errs_more_than_alpha_and_extend_to_keeps_alpha():
    """The audit's case: the SST-2 dropout design (looks at 5, 7, ..., 19, 20 seeds) still undecided at 20 seeds and
    re-run with max_seeds=30. Replaying every look under the new plan errs ~7% for 5%; extended_boundaries (the looks
    taken keep their boundaries, only the alpha not yet spent goes to the new looks) stays at alpha: at 20 seeds the
    plan has spent all of it, and an extension after look 5 (13 seeds) spreads what is left over looks to 30."""
    rng = np.random.default_rng(11)  # other draws than design_alpha's calibration
    draws, alpha = 60_000, 0.05
    d = rng.normal(0.0, 1.7, (draws, 30))  # no effect: any "better" or "worse" is false
    tabs = {n: np.abs(d[:, :n].mean(1)) / (d[:, :n].std(1, ddof=1) / math.sqrt(n)) for n in range(2, 31)}
    level = design_alpha(LOOKS, alpha)

    def false_rate(ns, zs, before=None):
        wrong = np.zeros(draws, bool) if before is None else before.copy()
        for n, z in zip(ns, zs):
            wrong |= tabs[n] >= t_critical(z, n - 1)
        return wrong

    se = math.sqrt(alpha * (1 - alpha) / draws)
    planned = false_rate(LOOKS, boundaries(tuple(n / 20 for n in LOOKS), level))
    assert abs(planned.mean() - alpha) < 2 * se  # the plan as run
    looks30 = planned_looks(5, 2, 30)
    replayed = false_rate(looks30, boundaries(tuple(n / 30 for n in looks30), design_alpha(looks30, alpha)), planned)
    assert replayed.mean() > alpha + 15 * se  # the audit's 7.1-7.4%: changing the design silently
    at_max = (*LOOKS, 22, 24, 26, 28, 30)
    zs = extended_boundaries(at_max, (20,) * len(LOOKS) + (30,) * 5, level)
    assert zs[:len(LOOKS)] == pytest.approx(boundaries(tuple(n / 20 for n in LOOKS), level))
    assert all(math.isinf(z) for z in zs[len(LOOKS):])  # nothing left to spend after the plan's last look
    assert false_rate(at_max, zs).mean() <= alpha + 2 * se
    midway = (*LOOKS[:5], *range(15, 30, 2), 30)
    zs = extended_boundaries(midway, (20,) * 5 + (30,) * (len(midway) - 5), level)
    assert zs[:5] == pytest.approx(boundaries(tuple(n / 20 for n in LOOKS), level)[:5])  # the looks taken, held
    assert false_rate(midway, zs).mean() <= alpha + 2 * se


def _committed_copy(tmp_path: Path, seeds: int | None = None) -> Path:
    folder = tmp_path / "dropout"
    folder.mkdir()
    df = pd.read_csv(REPO / "results/sweeps/sst2/dropout/results.csv")
    (df if seeds is None else df[df["seed"] < seeds]).to_csv(folder / "results.csv", index=False)
    (folder / "sequential.json").write_text((REPO / "results/sweeps/sst2/dropout/sequential.json").read_text())
    return folder


def test_a_report_with_another_margin_or_metric_than_the_design_is_refused_in_one_line(tmp_path, capsys):
    """The audit's `mhalab-report <dir> margin=2` read the committed SST-2 dropout sweep as "no practical difference"
    at look 7 (it ran to look 8 under +-1): now one line naming the recorded margin, and nothing written."""
    from mhalab.analysis.report import main

    folder = _committed_copy(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    for words, line in ((["margin=2"], ("error: margin=2: this sweep ran until decided with margin 1 (its "
                                       "sequential.json, fixed at its first look); its looks hold only under that "
                                       "design: drop margin=")),
                        (["metric=val/loss"], ("error: metric=val/loss: this sweep ran until decided on metric=val/acc "
                                              "(its sequential.json); its looks hold only under that design: drop "
                                              "metric="))):
        with pytest.raises(SystemExit) as exit_:
            main([str(folder), *words])
        assert exit_.value.code == 2
        assert capsys.readouterr().err.strip() == line
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert main([str(folder), "margin=1"]) == 0  # the recorded margin, given: read as recorded


def test_why_an_until_decided_sweep_stopped_is_said_with_the_budget_left(tmp_path):
    """The committed SST-2 dropout sweep: decided at look 8 with 16 of its 80 members unused. Its first 7 seeds read
    under a 7-seed design: the budget is reached with the claim still inconclusive, and the design has nothing left."""
    from mhalab.analysis.report.collect import read_sweep
    from mhalab.analysis.report.sequential import read_record, stop_reason, stop_words

    folder = _committed_copy(tmp_path)
    record = read_record(folder)
    df = read_sweep(folder)[0]
    reads = read_looks(df, record["looks"], record["design"])
    stop = stop_reason(reads, record["design"], df)
    assert (stop["why"], stop["look"], stop["seeds"], stop["unused"], stop["budget"]) == ("decided", 8, 19, 16, 80)
    assert stop_reason(reads[:7], record["design"], df) is None  # look 7 of 9: it goes on
    small = new_design(5, 2, 7, 0.05, None, "val/acc")
    reads = read_looks(df, [list(range(5)), list(range(7))], small)
    stop = stop_reason(reads, small, df)
    assert stop["why"] == "max_seeds" and stop["unused"] == 0
    assert "spent all of its alpha" in stop_words(stop, reads, small, None)
    report = (folder / "report.md")
    from mhalab.analysis.report import write_report

    write_report(folder)
    assert ("**Why it stopped:** every claim decided (look 8, 19 seeds of the 20 the design allows); 16 of the "
            "budget's 80 members left unused.") in report.read_text()


def _run_refused(args: list[str], sweep: Path, tmp_path: Path, toy_data_dir: Path, fork_server) -> str:
    cmd = [sys.executable, str(REPO / "train.py"), "-m", "hydra/sweeper=until_decided", "sweep.until_decided=true",
           "sweep.round_seeds=1", f"hydra.sweep.dir={sweep}", f"paths.data_dir={toy_data_dir}", "trainer=cpu",
           "dropout=0.0,0.1", "seed=0,1", *args]
    proc = fork_server.run(cmd, cwd=tmp_path, env=dict(os.environ, PYTHONHASHSEED="0"), timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not list(sweep.glob("*/metrics.json"))  # no member ran
    return proc.stderr.strip().splitlines()[-1]


def test_a_rerun_with_another_design_is_refused_and_a_spent_design_cannot_be_extended(tmp_path, toy_data_dir,
                                                                                      fork_server):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    design = new_design(2, 1, 3, 0.05, None, "val/acc")
    record = {"design": design, "looks": [{"seeds": [0, 1]}, {"seeds": [0, 1, 2]}]}  # reached its max_seeds
    (sweep / "sequential.json").write_text(json.dumps(record))
    assert _run_refused(["sweep.max_seeds=4"], sweep, tmp_path, toy_data_dir, fork_server) == (
        "error: sweep.max_seeds=4: this sweep ran until decided with sweep.max_seeds=3 (its sequential.json, fixed at "
        "its first look); a design changed after looking no longer holds its error rate: give sweep.max_seeds=3, or "
        "extend it on purpose with sweep.extend_to=4 (docs/sweeps.md)")
    assert _run_refused(["sweep.max_seeds=3", "sweep.margin=2"], sweep, tmp_path, toy_data_dir, fork_server) == (
        "error: sweep.margin=2.0: this sweep ran until decided with sweep.margin=1.0 (its sequential.json, fixed at "
        "its first look); a design changed after looking no longer holds its error rate: give sweep.margin=1.0 "
        "(docs/sweeps.md)")
    assert _run_refused(["sweep.max_seeds=3", "sweep.extend_to=5"], sweep, tmp_path, toy_data_dir, fork_server) == (
        "error: sweep.extend_to=5: this sweep reached its max_seeds=3 at look 2 and spent all of alpha=0.05 there, so "
        "no seed added now can decide a claim at that level (docs/sweeps.md): to test it again, run a new sweep with "
        "other seeds (seed=3,4,...) in a new hydra.sweep.dir")


def test_extend_to_adds_looks_after_those_taken_and_records_them():
    from mhalab.analysis.report.sequential import check_design, extend, max_at, planned_of

    design = new_design(5, 2, 20, 0.05, None, "val/acc")
    taken = [list(range(n)) for n in (5, 7, 9)]  # interrupted after look 3
    longer = extend(design, taken, 30)
    assert planned_of(longer) == [5, 7, 9, *range(11, 30, 2), 30]
    assert [max_at(longer, k) for k in (0, 2, 3)] == [20, 20, 30]
    check_design(longer, design, extend_to=30)  # the same command, extend_to kept: accepted
    with pytest.raises(ValueError, match="was extended to 30 seeds at look 4 .* give sweep.extend_to=30"):
        check_design(longer, design)


def test_the_claims_table_at_another_margin_does_not_read_a_sequential_sweeps_looks(tmp_path):
    """mhalab-claims margin=0.5 over the committed sweeps: the SST-2 dropout sweep ran until decided at +-1 point, so
    its row says it is not read there (its looks hold under its own design only); the other rows are read."""
    from mhalab.analysis.claims import render

    folder = tmp_path / "sst2"
    folder.mkdir()
    _committed_copy(folder)
    text = render(tmp_path, margin=0.5, baselines=None)
    assert "| **not read** (run until decided at ±1 point: not read at another margin) |" in text
    assert "(seeds until decided: look 8 of 9)" in render(tmp_path, baselines=None)


def test_continuing_a_sweep_drawn_pytorchs_way_with_keyed_draws_is_refused_in_one_line_before_any_member_runs(
        tmp_path, toy_data_dir, fork_server):
    """A committed results.csv from before 2026-12-07 (no init_draw column: PyTorch's draws) copied into a sweep dir
    and continued with the default init_draw=keyed: the new members would not be replicates of the old."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    pd.DataFrame([{"member": f"gone/{p}/{s}", "overrides": f"dropout={p} seed={s}", "seed": s, "status": "finished",
                   "best_val_acc": 0.8 + 0.01 * s, "dim": 32, "heads": 4, "ff_dim": 128, "dropout": float(p),
                   "val_majority_acc": 0.5, "val_classes_predicted": 2}
                  for p in ("0.0", "0.1") for s in (0, 1)]).to_csv(sweep / "results.csv", index=False)
    cmd = [sys.executable, str(REPO / "train.py"), "-m", "hydra/sweeper=until_decided", "sweep.until_decided=true",
           "sweep.max_seeds=3", "sweep.round_seeds=1", f"hydra.sweep.dir={sweep}", f"paths.data_dir={toy_data_dir}",
           "trainer=cpu", "dropout=0.0,0.1", "seed=0,1"]
    proc = fork_server.run(cmd, cwd=tmp_path, env=dict(os.environ, PYTHONHASHSEED="0"), timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {sweep} holds members with init_draw=torch and this sweep would add members with init_draw=keyed: "
        f"they would not be replicates. Continue it with init_draw=torch, or give a new hydra.sweep.dir.")
    assert not list(sweep.glob("*/metrics.json"))  # no member ran


COMMITTED = sorted((REPO / "results" / "sweeps").glob("*/*/sequential.json"))


@pytest.mark.parametrize("path", COMMITTED, ids=[p.parent.relative_to(REPO / "results" / "sweeps").as_posix()
                                                 for p in COMMITTED])
def test_a_committed_sweep_read_again_stops_where_its_record_says_and_its_command_asks_its_design(path):
    """Each committed sweep run until decided (the campaign's six, SST-2 dropout): its results.csv read again under
    its recorded looks gives the stop its sequential.json recorded (why, look, seeds, members unused), and the command
    it recorded (the one CAMPAIGN.md and README give) composes to the recorded design, so re-running it continues the
    sweep instead of being refused."""
    import shlex

    from hydra import compose, initialize_config_dir

    from mhalab.analysis.report.collect import read_sweep
    from mhalab.analysis.report.sequential import check_design, read_record, stop_reason

    record, saved = read_record(path.parent), json.loads(path.read_text())
    df = read_sweep(path.parent)[0]
    stop = stop_reason(read_looks(df, record["looks"], record["design"]), record["design"], df)
    keys = ("why", "look", "seeds", "max_seeds", "budget", "unused")
    assert {k: stop[k] for k in keys} == {k: saved["stopped"][k] for k in keys}

    words = [w for w in shlex.split(record["command"])[1:] if w != "-m" and not w.startswith("hydra.sweep.dir=")]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=words, return_hydra_config=True)
    first = str(cfg.hydra.sweeper.params.seed).split(",")
    opts = cfg.sweep
    asked = new_design(len(first), opts.round_seeds, opts.max_seeds, opts.alpha, opts.margin, "val/acc")
    assert opts.until_decided and [int(s) for s in first] == record["looks"][0]
    check_design(record["design"], asked)  # raises ConfigError naming the recorded value where they differ
