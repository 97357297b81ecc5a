"""mhalab-accuracy: runs grouped by setting (seed and speed-only keys left out), the test mean's t-interval and
the effect against the default run paired by seed, equal to scipy's; the baseline row from mhalab-baseline's JSON."""

from __future__ import annotations

import json
import math

import numpy as np
from scipy import stats

from mhalab.analysis.accuracy import collect, table
from mhalab.train import record

# (setting's overrides, seed, val, test)
RUNS = [([], 0, 0.80, 0.81), ([], 1, 0.78, 0.80), ([], 2, 0.79, 0.84),
        (["lr=2e-3", "dropout=0.1"], 0, 0.85, 0.86), (["dropout=0.1", "lr=2e-3"], 1, 0.84, 0.83),
        (["lr=2e-3", "dropout=0.1", "num_threads=1"], 2, 0.86, 0.88),
        (["pretrain=mlm"], 0, 0.81, 0.85), (["pretrain=mlm"], 1, 0.80, 0.85), (["pretrain=mlm"], 2, 0.80, 0.86)]


def _write_runs(root):
    for i, (ov, seed, val, test) in enumerate(RUNS):
        (root / f"r{i}").mkdir(parents=True)
        record.write(root / f"r{i}", {
            "status": "finished", "overrides": ["data=trec", f"seed={seed}", "trainer.accelerator=cpu", *ov],
            "seed": seed, "best": {"val/acc": val, "test/acc": test}, "fit_time_s": 60.0 * (i + 1),
            "data": {"name": "trec"}, "config": {"data": {"name": "trec"}}})
    (root / "failed").mkdir()
    record.write(root / "failed", {"status": "failed", "overrides": ["data=trec"], "seed": 0, "best": {},
                                   "config": {"data": {"name": "trec"}}})


def test_settings_group_their_seeds_and_the_effect_is_a_paired_t_interval(tmp_path):
    _write_runs(tmp_path / "runs")
    df = collect(tmp_path / "runs")
    assert sorted(df["setting"].unique()) == ["(default)", "dropout=0.1 lr=2e-3", "pretrain=mlm"] and len(df) == 9
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "trec.json").write_text(json.dumps(
        {"seeds": [0, 1, 2], "mean": {"validation/acc": 0.858, "test/acc": 0.881}, "cpu_seconds": 30.0}))
    md = table(df, tmp_path / "b")
    row = next(line for line in md.splitlines() if line.startswith("| `dropout=0.1 lr=2e-3`"))
    test = np.array([86.0, 83.0, 88.0])
    default = np.array([81.0, 80.0, 84.0])
    half = stats.t.ppf(0.975, 2) * test.std(ddof=1) / math.sqrt(3)
    d = test - default
    res = stats.ttest_rel(test, default)
    ci = res.confidence_interval(0.95)
    assert f"| 0,1,2 | 85.0 | {test.mean():.1f} [{test.mean() - half:.1f}, {test.mean() + half:.1f}] |" in row
    assert f"| {d.mean():+.1f} [{ci.low:+.1f}, {ci.high:+.1f}] |  | 5.0 |" in row  # runs 4-6 took 4-6 minutes
    # a pretrained setting against the best from scratch by validation (dropout=0.1 lr=2e-3), paired by seed
    pre = next(line for line in md.splitlines() if line.startswith("| `pretrain=mlm`"))
    ci = stats.ttest_rel(np.array([85.0, 85.0, 86.0]), test).confidence_interval(0.95)
    assert f"| {85.33333 - test.mean():+.1f} [{ci.low:+.1f}, {ci.high:+.1f}] | 8.0 |" in pre
    assert "| TF-IDF + logistic regression (`mhalab-baseline data=trec`) | 0,1,2 | 85.8 | 88.1 |" in md
    assert "CNN-rand 91.2" in md
    # the best setting by validation first
    assert md.index("`dropout=0.1 lr=2e-3`") < md.index("`(default)`")
    # the per-run CSV gives the same table
    df.to_csv(tmp_path / "runs.csv", index=False)
    assert table(collect(tmp_path / "runs.csv"), tmp_path / "b") == md
