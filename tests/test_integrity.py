"""Sweep rows checked before they are averaged (mhalab.analysis.report.integrity): each corruption of a copy of the
committed SST-2 dropout results.csv is refused in one line naming its rows, or normalised and said in the report,
through mhalab-report, mhalab-claims and the table the until_decided sweeper reads (collect.read_sweep)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from mhalab.analysis.report import main as report_main
from mhalab.analysis.report.collect import read_sweep
from mhalab.analysis.report.integrity import SweepDataError, check_rows
from mhalab.analysis.report.verdicts import compute_verdicts

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "results/sweeps/sst2/dropout/results.csv"


def _sweep(tmp_path: Path, change) -> Path:
    """A sweep dir (members gone) holding the committed results.csv changed by change(df) -> df."""
    folder = tmp_path / "sst2" / "dropout"
    folder.mkdir(parents=True)
    change(pd.read_csv(COMMITTED)).to_csv(folder / "results.csv", index=False)
    return folder


def _refused(folder: Path, capsys) -> str:
    before = (folder / "results.csv").read_bytes()
    with pytest.raises(SystemExit) as exit_:
        report_main([str(folder)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert (folder / "results.csv").read_bytes() == before and not (folder / "report.md").exists()  # nothing written
    return err[0]


def test_a_duplicated_setting_and_seed_with_another_value_is_refused_naming_both_lines(tmp_path, capsys):
    # the audit's case: dropout 0.2 seed 3 again, 2 points lower (silently, 0.1 vs 0.2 went from equivalent to unclear)
    def dup(df):
        row = df[(df["dropout"] == 0.2) & (df["seed"] == 3)].assign(best_val_acc=lambda x: x["best_val_acc"] - 0.02)
        return pd.concat([df, row])
    folder = _sweep(tmp_path, dup)
    line = _refused(folder, capsys)
    first = pd.read_csv(COMMITTED).query("dropout == 0.2 and seed == 3").index[0] + 2  # header is line 1
    assert line.startswith("error: setting 'dropout=0.2' seed 3 is in 2 finished rows with different val/acc (")
    assert f"results.csv lines {first}, 66)" in line and line.endswith("keep the row of the run you trust and "
                                                                        "remove the other")
    with pytest.raises(SweepDataError, match="seed 3 is in 2 finished rows"):  # mhalab-claims reads it the same way
        from mhalab.analysis.claims import render

        render(tmp_path, baselines=None)


def test_an_exact_duplicate_row_is_counted_once_and_the_report_says_so(tmp_path):
    folder = _sweep(tmp_path, lambda df: pd.concat([df, df.iloc[[3]]]))
    df = read_sweep(folder)[0]
    assert len(df) == len(pd.read_csv(COMMITTED))
    assert df.attrs["notes"] == [("1 row repeated another row's setting, seed and val/acc exactly (results.csv line "
                                 "66); it is counted once")]
    report_main([str(folder)])
    assert ("Normalised before averaging: 1 row repeated another row's setting, seed and val/acc exactly (results.csv "
            "line 66); it is counted once.") in (folder / "report.md").read_text()


def test_seeds_as_text_in_one_group_are_read_as_numbers_so_the_comparison_stays_paired():
    df = pd.read_csv(COMMITTED).assign(setting=lambda x: "dropout=" + x["dropout"].astype(str))
    df["seed"] = df["seed"].astype(object)
    df.loc[df["dropout"] == 0.2, "seed"] = df.loc[df["dropout"] == 0.2, "seed"].map(str)  # '3' beside 3

    def test_against_02(table):
        v = next(v for v in compute_verdicts(table) if v.key == "dropout_0.1")
        return next(c.test for c in v.comparisons if c.alternative.label == "dropout=0.2")

    assert test_against_02(df) == "welch"  # unchecked: '3' and 3 are other seeds, the pairing is lost
    checked = check_rows(df, "val/acc")
    assert test_against_02(checked) == "paired"
    assert checked.attrs["notes"][0].startswith("19 rows held their seed as text (`'5'`) and the others as numbers")


def test_a_seed_that_is_not_an_integer_is_refused(tmp_path, capsys):
    folder = _sweep(tmp_path, lambda df: df.astype({"seed": object}).assign(
        seed=lambda x: x["seed"].where(x.index != 4, "s5")))
    assert _refused(folder, capsys) == ("error: seed 's5' at results.csv line 6 is not an integer: a seed is the "
                                        "integer a run was started with (seed=3); correct or remove those rows")


def test_an_accuracy_in_percent_is_refused(tmp_path, capsys):
    folder = _sweep(tmp_path, lambda df: df.assign(best_val_acc=lambda x: x["best_val_acc"] * 100))
    line = _refused(folder, capsys)
    assert line.startswith("error: best_val_acc 7") and "is outside [0, 1]: an accuracy is a fraction" in line
    assert line.endswith("divide the column by 100")


def test_a_member_run_with_another_unswept_config_is_refused(tmp_path, capsys):
    folder = _sweep(tmp_path, lambda df: df.assign(max_epochs=lambda x: x["max_epochs"].where(x.index != 7, 6)))
    assert _refused(folder, capsys) == ("error: setting 'dropout=0.0': results.csv line 9 ran with max_epochs=6 where "
                                        "its other seeds ran with max_epochs=3; max_epochs is not swept, so those runs "
                                        "are not replicates of the setting: remove them, or sweep max_epochs")


def test_every_committed_sweep_passes_the_checks_unchanged():
    for csv in sorted((REPO / "results/sweeps").glob("*/*/results.csv")):
        df = read_sweep(csv.parent)[0]
        assert len(df) == len(pd.read_csv(csv)) and df.attrs["notes"] == [], csv


def test_rows_from_before_keyed_draws_pooled_with_keyed_rows_are_refused(tmp_path, capsys):
    """The committed table has no init_draw column (PyTorch's draws); a row with keyed draws added to one of its
    settings (a sweep continued after 2026-12-07) is not a replicate of it."""
    def add_keyed(df):
        new = df.iloc[[7]].assign(seed=97, init_draw="keyed")
        return pd.concat([df.assign(init_draw=float("nan")), new], ignore_index=True)

    folder = _sweep(tmp_path, add_keyed)
    err = _refused(folder, capsys)
    assert err.startswith("error: setting 'dropout=0.0': results.csv line 66 ran with init_draw=keyed where its other "
                          "seeds ran with init_draw=torch"), err
