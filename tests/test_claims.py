"""mhalab-claims: the claim x data set table from committed sweeps' results.csv, decided as the reports decide."""

from __future__ import annotations

import pandas as pd
import pytest

from mhalab.analysis.claims import main, render
from mhalab.analysis.report.verdicts import compute_verdicts

NOISE = [0.004, -0.003, 0.001, -0.004, 0.002]  # a seed's luck, shared by its runs


def _sweep(root, data: str, preset: str, column: str, means: dict[float, float], **fixed) -> pd.DataFrame:
    rows = []
    for value, mean in means.items():
        for seed, n in enumerate(NOISE):
            rows.append({"member": f"{column}={value},seed={seed}", "setting": f"{column}={value}", "seed": seed,
                         "status": "finished", "monitored": mean + n, "best_val_acc": mean + n, "test_acc": mean,
                         "wall_time_s": 60.0, "params": 1000, "global_step": 770, "max_epochs": 10, "layers": 2,
                         "tokens_per_s": 1.0, "dim": 128, "heads": 4, "ff_dim": 512, "dropout": 0.2,
                         **fixed, column: value})
    df = pd.DataFrame(rows)
    if column == "ff_ratio":
        df["ff_dim"] = df["ff_ratio"] * df["dim"]
        df = df.drop(columns="ff_ratio")
    (root / data / preset).mkdir(parents=True)
    df.to_csv(root / data / preset / "results.csv", index=False)
    return df


def test_claims_table_has_each_sweeps_verdict_and_effect_as_the_report_decides(tmp_path, capsys):
    drop = _sweep(tmp_path, "trec", "dropout", "dropout", {0.0: 0.80, 0.1: 0.83, 0.3: 0.81})
    _sweep(tmp_path, "sst5", "ff_ratio", "ff_ratio", {1: 0.40, 4: 0.40, 8: 0.40})
    (verdict,) = [v for v in compute_verdicts(drop) if v.covered]
    assert verdict.verdict == "supported" and verdict.headline.alternative.label == "dropout=0.3"
    text = render(tmp_path)
    h = verdict.headline
    assert (f"| dropout 0.1 | trec | [dropout](trec/dropout/report.md) | **supported** | {100 * h.effect:+.1f} "
            f"[{100 * h.ci_low:+.1f}, {100 * h.ci_high:+.1f}] vs dropout=0.3 |") in text
    assert "| ff_dim = 4 x embed_dim | sst5 | [ff_ratio](sst5/ff_ratio/report.md) | **no practical difference** |" in text
    assert ("| trec | dropout | 15 (15) | 0.25 h | dropout=0.1: 83.0 / 83.0 | – | dim 128, 2 layers, 10 epochs (~770 "
            "steps) |") in text
    # the bag-of-words bar beside each sweep of a data set mhalab-baseline has a JSON for
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "trec.json").write_text('{"mean": {"validation/acc": 0.858, "test/acc": 0.881}}')
    assert "| 0.25 h | dropout=0.1: 83.0 / 83.0 | 85.8 / 88.1 | dim 128" in render(tmp_path, baselines=tmp_path / "b")
    assert "steps) | `mhalab-train sweep=dropout data=trec` |" in text  # the command that runs it again
    assert "| dim 128, 2 layers, 10 epochs (~770 steps) | 0.25 |" in text  # each claim row's cost (CPU h)
    out = tmp_path / "table.md"
    assert main([str(tmp_path), f"out={out}", "baselines=null"]) == 0
    assert out.read_text() == text
    assert capsys.readouterr().out.startswith("# The article's claims, tested")


def test_the_command_that_runs_a_sweep_again_names_what_every_member_was_run_with(tmp_path):
    """A sweep run at 20 epochs: its command says max_epochs=20 (without it, it reran the data set's 10 epochs)."""
    df = _sweep(tmp_path, "trec", "dropout", "dropout", {0.0: 0.80, 0.1: 0.83, 0.3: 0.81})
    df["setting"] = df["setting"] + " data=trec max_epochs=20"
    df.to_csv(tmp_path / "trec" / "dropout" / "results.csv", index=False)
    assert "| `mhalab-train sweep=dropout data=trec max_epochs=20` |" in render(tmp_path)


@pytest.mark.parametrize("args,message", [
    (["{tmp}/none"], "is not a folder; give the folder that `make sweeps` fills"),
    (["{tmp}"], "no <data set>/<preset>/results.csv under"),
])
def test_claims_errors_are_one_line(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        main([a.format(tmp=tmp_path) for a in args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_another_regimes_sweeps_get_a_section_of_their_own(tmp_path):
    _sweep(tmp_path, "trec", "dropout", "dropout", {0.0: 0.80, 0.1: 0.83, 0.3: 0.81})
    _sweep(tmp_path, "trec-short", "dropout", "dropout", {0.0: 0.60, 0.1: 0.61, 0.3: 0.62})
    text = render(tmp_path)
    main_table, other = text.split("## Another regime: short")
    assert "| dropout 0.1 | trec | " in main_table and "trec-short" not in main_table.split("## The sweeps")[0]
    assert "| dropout 0.1 | trec-short | " in other.split("## The sweeps")[0]
    assert "| trec-short | dropout | 15 (15) |" in text and text.count("`mhalab-train sweep=dropout") == 1


def test_the_committed_claims_table_is_what_mhalab_claims_makes_of_the_committed_sweeps(monkeypatch):
    """results/sweeps/README.md = `mhalab-claims results/sweeps out=results/sweeps/README.md`, run at the root."""
    from pathlib import Path

    from conftest import REPO

    monkeypatch.chdir(REPO)  # the command's folder argument is written into the table as typed
    committed = Path("results/sweeps/README.md").read_text()
    assert render(Path("results/sweeps"), baselines=Path("results/baselines")) == committed
