"""No winner and no verdict from models that had not finished learning (mhalab.analysis.report.trained), and what a
run trained said where it ends (mhalab.train.record.extent): on the small result tables committed in tests/data/trained,
on every committed sweep of results/sweeps, and on a real sweep cut short."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest

from mhalab.analysis.report import NOT_DECIDED, SUPPORTED, best_line, write_report
from mhalab.analysis.report.collect import results_from_csv
from mhalab.analysis.report.trained import best_withheld, recent_gain
from mhalab.analysis.report.verdicts import compute_verdicts
from mhalab.train.console import summary

REPO = Path(__file__).resolve().parents[1]
TABLES = REPO / "tests" / "data" / "trained"


def _report(tmp_path: Path, table: str) -> tuple[dict, str]:
    """mhalab-report on a copy of a committed table's dir (the members are gone: the report from results.csv)."""
    sweep = tmp_path / table
    shutil.copytree(TABLES / table, sweep)
    res = write_report(sweep)
    return res, (sweep / "report.md").read_text()


def test_a_sweep_cut_short_by_limit_train_batches_names_no_best_setting_and_says_how_to_decide(tmp_path):
    """The issue's case: heads on TREC with ++trainer.limit_train_batches=10, each member 10 of 770 planned steps,
    heads=4 on top at 32.5% (above the majority class's 23%): before, heads=4 was the best setting in bold."""
    res, report = _report(tmp_path, "cut_short")
    why = ("6 of 6 members were not trained to the end (each stopped at step 10 of 770 planned, "
           "limit_train_batches=10), so more training could change it; to decide it, run "
           "`mhalab-train sweep=heads data=trec`, then `mhalab-report` on its sweep dir.")
    assert res["best_setting"] is None and res["withheld"] == why
    assert best_line(res) == f"no best by val/acc: {why}"  # what mhalab-report and the sweep's log print
    assert f"## Best setting\n\nNo best setting: {why}\n" in report
    assert "**heads=4**" not in report  # nothing bolded in the table
    assert res["verdict_by_claim"]["heads_8_or_16"] == NOT_DECIDED
    assert next(v for v in res["verdicts"] if v["key"] == "heads_8_or_16")["reason"] == why
    scale = report.split("## Scale measured")[1].split("##")[0]
    assert ("- optimizer steps: run 10, planned 770 (max_epochs 10 × 77 steps an epoch over the whole training split, "
            "or max_steps)") in scale
    assert "- limits: limit_train_batches=10, limit_test_batches=5" in scale
    assert "- evaluated: validation 100%, test 64% of the split" in scale
    assert "- **not trained to the end**: 6 of 6 finished members" in scale
    named = report.split("## Not trained to the end")[1].split("##")[0]
    assert "| heads=4,seed=0 | heads=4 | 0 | 10 / 770 | 1 / 10 | – |" in named


def test_members_still_improving_at_their_last_validations_withhold_the_best_and_the_verdict(tmp_path):
    """Every member ran its 770 steps, but heads=8's val/acc rose 3 points over its last 3 validations (more than
    the 1-point margin): the command that decides it trains twice as long."""
    res, report = _report(tmp_path, "still_improving")
    assert res["best_setting"] is None
    assert res["withheld"] == ("2 of 6 members were not trained to the end (2 still improving, val/acc up 3.00 pts at "
                               "most over the last 3 validations), so more training could change it; to decide it, run "
                               "`mhalab-train sweep=heads data=trec max_epochs=20`, then `mhalab-report` on its sweep "
                               "dir.")
    assert res["verdict_by_claim"]["heads_8_or_16"] == NOT_DECIDED
    assert "| heads=8,seed=1 | heads=8 | 1 | 770 / 770 | 10 / 10 | +3.00 pts |" in report


def test_the_deciding_command_doubles_the_plan_members_were_still_improving_on():
    """max_epochs where the epochs were the plan; max_steps where that was (planned below max_epochs' steps)."""
    df = results_from_csv(TABLES / "still_improving" / "results.csv")
    assert "run `mhalab-train sweep=heads data=trec max_epochs=20`" in best_withheld(df, "val/acc", 0.01)
    by_steps = df.assign(planned_steps=500, global_step=500)  # 500 < 10 epochs x 77: max_steps=500 was the plan
    by_steps.attrs = df.attrs
    assert "run `mhalab-train sweep=heads data=trec ++trainer.max_steps=1000`" in best_withheld(by_steps, "val/acc", 0.01)


def test_a_sweep_trained_to_the_end_keeps_its_best_setting_and_verdict(tmp_path):
    res, report = _report(tmp_path, "finished")  # the same accuracies, gains of 0.4 point: below the margin
    assert res["withheld"] is None and res["best_setting"]["setting"] == "heads=8"
    assert res["verdict_by_claim"]["heads_8_or_16"] == SUPPORTED
    assert "- trained to the end: every finished member" in report and "## Not trained to the end" not in report
    # a margin of 0.3 point makes the same 0.4-point gains "still improving"
    assert best_withheld(results_from_csv(TABLES / "finished" / "results.csv"), "val/acc", 0.003) is not None


@pytest.mark.parametrize("committed", sorted(p.parent.relative_to(REPO).as_posix()
                                             for p in (REPO / "results" / "sweeps").glob("*/*/results.csv")))
def test_committed_sweeps_keep_their_verdicts_and_withhold_the_best_setting_where_their_report_does(committed):
    """Each committed sweep's verdicts.json and report.md say what the rule says of its results.csv today. Sweeps from
    before the columns the rule reads are not checked by it (None); trec/heads (the campaign's) withholds its best
    setting, one member of 55 still improving at 20 epochs, and its report says so in the rule's words."""
    df = results_from_csv(REPO / committed / "results.csv")
    before = json.loads((REPO / committed / "verdicts.json").read_text())
    assert {v.key: v.verdict for v in compute_verdicts(df)} == {v["key"]: v["verdict"] for v in before["verdicts"]}
    withheld = best_withheld(df, "val/acc", 0.01)
    report = (REPO / committed / "report.md").read_text()
    if withheld is None:
        assert "were not trained to the end" not in report
    else:
        assert f"No best setting: {withheld}\n" in report


def test_recent_gain_is_the_last_windows_best_against_the_best_before_it():
    assert recent_gain([0.5, 0.7, 0.72, 0.71, 0.75]) == pytest.approx(0.75 - 0.7)  # the last 3 against the first 2
    assert recent_gain([0.8, 0.7, 0.7, 0.7]) == pytest.approx(-0.1)  # got worse
    assert recent_gain([0.9, 0.7, 0.6, 0.5], higher=False) == pytest.approx(0.4)  # a loss: lower is better
    assert math.isnan(recent_gain([0.5, 0.6, 0.7]))  # three validations cannot say


def test_the_end_of_run_summary_says_what_was_trained_and_what_part_of_test_was_evaluated(tmp_path):
    rec = {"status": "finished", "wall_time_s": 12.0, "fit_time_s": 10.0, "global_step": 10, "epochs": 1,
           "best": {"val/acc": 0.32, "test/acc": 0.4875, "checkpoint": "/x/epoch00-acc0.3200.ckpt", "epoch": 0,
                    "step": 10},
           "trained": {"steps": 10, "planned_steps": 770, "epochs": 1, "max_epochs": 10, "max_steps": -1,
                       "steps_per_epoch": 77, "limit_train_batches": 10, "limit_val_batches": 1.0,
                       "limit_test_batches": 5, "stopped_early": False,
                       "evaluated": {"validation": [546, 546], "test": [320, 500]}}}
    lines = summary(rec, tmp_path).splitlines()
    assert lines[1] == ("  trained 10 of 770 planned steps (1 of 10 epochs; each cut to limit_train_batches=10 of its "
                        "77 steps): stopped short of its plan")
    assert lines[3] == "  val    acc 32.00%"  # the whole validation split: nothing to add
    assert lines[4] == "  test   acc 48.75% (on 320 of 500 examples, 64%: limit_test_batches=5)"


def test_a_real_sweep_cut_short_reports_what_it_trained_and_withholds_its_winner(tmp_path, toy_data_dir, fork_server):
    """The command a user types: a heads x seeds sweep with the limits, then its report and a member's summary."""
    cmd = [sys.executable, str(REPO / "train.py"), "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}",
           f"paths.data_dir={toy_data_dir}", f"paths.cache_dir={tmp_path / 'cache'}", "trainer=cpu",
           "trainer.enable_progress_bar=false", "heads=2,4", "seed=0,1", "layers=1", "batch_size=32", "max_len=32",
           "max_epochs=2", "data.vocab_size=200", "data.min_frequency=1", "++trainer.limit_train_batches=2",
           "++trainer.limit_test_batches=1"]
    proc = fork_server.run(cmd, cwd=tmp_path, env=dict(os.environ, PYTHONHASHSEED="0"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    # 400 training examples in batches of 32: 13 steps an epoch, 26 planned, 4 run; test: 1 batch of 32 of 64
    assert ("  trained 4 of 26 planned steps (2 of 2 epochs; each cut to limit_train_batches=2 of its 13 steps): "
            "stopped short of its plan") in out
    assert "(on 32 of 64 examples, 50%: limit_test_batches=1)" in out
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert report.startswith("# Sweep report: `sweep`\n")  # the dir as given, from where it was given
    assert ("No best setting: 4 of 4 members were not trained to the end (each stopped at step 4 of 26 planned, "
            "limit_train_batches=2), so more training could change it; to decide it, run `mhalab-train -m heads=2,4 "
            "seed=0,1 layers=1 batch_size=32 max_len=32 data.vocab_size=200 data.min_frequency=1 max_epochs=2`") in report
    table = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert table["planned_steps"].tolist() == [26] * 4 and table["global_step"].tolist() == [4] * 4
    assert table["test_evaluated"].tolist() == [0.5] * 4 and table["val_evaluated"].tolist() == [1.0] * 4
