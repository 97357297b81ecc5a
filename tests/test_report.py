"""Sweep report (mhalab.analysis.report, mhalab-report / scripts/report.py, mhalab.analysis.sweep_callbacks) on
synthetic multirun dirs."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from mhalab.analysis.report import (
    CONTRADICTED,
    INCONCLUSIVE,
    NOT_COVERED,
    NOT_DECIDED,
    SUPPORTED,
    NoMembersError,
    best_line,
    collect_results,
    compute_verdicts,
    main,
    setting_of,
    summarize_settings,
    training_val_rows,
    write_report,
)
from mhalab.analysis.report.stats import detectable_effect, not_learned_mask
from mhalab.analysis.sweep_callbacks import ReportCallback
from mhalab.train import record
from mhalab.train.config import CONF_DIR

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _config(heads: int, dim: int = 128, seed: int = 0, ff_ratio: int = 4, dropout: float = 0.1) -> dict:
    return {
        "heads": heads, "dim": dim, "layers": 2, "ff_dim": ff_ratio * dim, "dropout": dropout, "lr": 1e-3,
        "batch_size": 64, "max_epochs": 3, "max_len": 64, "seed": seed,
        "model": {"name": "custom", "attention": "full", "pos": "sinusoidal"}, "data": {"name": "sst2"},
    }


def _lightning_csv(path: Path, val_acc: float, epochs: int = 3, steps_per_epoch: int = 10) -> None:
    """A sparse Lightning CSV log: train rows, one val row per epoch, then the post-fit validate/test rows."""
    rows = []
    for ep in range(epochs):
        for i in range(steps_per_epoch):
            step = ep * steps_per_epoch + i
            rows.append({"epoch": ep, "step": step, "train/loss": 0.7 - 0.01 * step})
        rows.append({"epoch": ep, "step": (ep + 1) * steps_per_epoch - 1, "val/loss": 0.6 - 0.05 * ep,
                     "val/acc": val_acc - 0.01 * (epochs - 1 - ep)})
    last = epochs * steps_per_epoch - 1
    rows.append({"epoch": epochs, "step": last, "val/loss": 0.1, "val/acc": val_acc})  # trainer.validate(best)
    rows.append({"epoch": epochs, "step": last, "test/acc": 0.5, "test/loss": 0.9})
    pd.DataFrame(rows, columns=["epoch", "step", "train/loss", "val/loss", "val/acc", "test/acc",
                                "test/loss"]).to_csv(path, index=False)


def _member(root: Path, name: str, heads: int, seed: int, val_acc: float, test_acc: float,
            wall: float = 100.0, old_record: bool = False, confusion: list | None = None) -> Path:
    """A finished member; old_record: metrics.json as written before `last_epoch` (test/* under `final`);
    confusion: its best checkpoint's validation confusion matrix (rows true, columns predicted)."""
    d = root / name
    d.mkdir(parents=True)
    test = {"test/acc": test_acc, "test/f1": 0.7, "test/loss": 0.47}
    last_epoch = {"val/acc": val_acc - 0.01, "val/loss": 0.46}
    metrics = ({"best": {"val/acc": val_acc, "val/loss": 0.45}, "final": last_epoch | test} if old_record else
               {"best": {"val/acc": val_acc, "val/loss": 0.45} | test, "last_epoch": last_epoch})
    rec = {
        "status": "finished", "error": None, "overrides": [f"heads={heads}", f"seed={seed}"], "seed": seed,
        "config": _config(heads, seed=seed), "params": 1000 * heads, "epochs": 3, "global_step": 30,
        "wall_time_s": wall, "tokens_per_s": 2000.0 * heads, "padding_fraction": 0.05, **metrics,
        "device": "cpu", "output_dir": str(d),
    }
    if confusion is not None:
        rec["classes"] = {"of": "best", "validation": {"labels": ["negative", "positive"], "confusion": confusion}}
    (d / "metrics.json").write_text(json.dumps(rec))
    _lightning_csv(d / "metrics.csv", val_acc)
    return d


HEADS2_VAL = [0.70, 0.72, 0.74]  # mean 0.72, std 0.02
HEADS2_TEST = [0.90, 0.91, 0.92]  # better on test: must not make heads=2 the best
HEADS8_VAL = [0.80, 0.81, 0.82]  # mean 0.81, std 0.01
HEADS8_TEST = [0.60, 0.61, 0.62]


def _build_sweep(root: Path) -> Path:
    """heads=2 and heads=8 x seeds 0-2 (finished; heads=8 one level deeper), plus three heads=16 members:
    failed, still running, and a Hydra job dir that never wrote metrics.json."""
    for s in range(3):
        _member(root, f"heads=2,seed={s}", 2, s, HEADS2_VAL[s], HEADS2_TEST[s], wall=100 + s)
        _member(root / "grp", f"heads=8,seed={s}", 8, s, HEADS8_VAL[s], HEADS8_TEST[s], wall=200 + s)
    failed = root / "heads=16,seed=0"
    failed.mkdir()
    (failed / "metrics.json").write_text(json.dumps({
        "status": "failed", "error": "RuntimeError: CUDA out of memory", "overrides": ["heads=16", "seed=0"],
        "seed": 0}))
    running = root / "heads=16,seed=1"
    running.mkdir()
    (running / "metrics.json").write_text(json.dumps({
        "status": "running", "error": None, "overrides": ["heads=16", "seed=1"], "seed": 1,
        "config": _config(16, seed=1)}))
    crashed = root / "heads=16,seed=2" / ".hydra"
    crashed.mkdir(parents=True)
    (crashed / "config.yaml").write_text("heads: 16\ndim: 128\nseed: 2\n")
    (crashed / "overrides.yaml").write_text("- heads=16\n- seed=2\n")
    return root


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    return _build_sweep(tmp_path / "multirun")


@pytest.fixture(scope="module")
def reported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One write_report on the sweep, shared by the read-only tests (plots are the slow part)."""
    root = _build_sweep(tmp_path_factory.mktemp("shared") / "multirun")
    return root, write_report(root)


# --------------------------------------------------------------------------------------------------
# results.csv, per-setting statistics, failures


def test_results_csv_rows_and_values(reported: tuple[Path, dict]) -> None:
    res = reported[1]
    df = pd.read_csv(res["results_csv"])
    assert len(df) == 9
    assert list(df.columns[:12]) == ["member", "overrides", "setting", "seed", "params", "best_val_acc",
                                     "test_acc", "epochs", "wall_time_s", "tokens_per_s", "status", "error"]
    row = df[df["member"] == "grp/heads=8,seed=1"].iloc[0]
    assert row["overrides"] == "heads=8 seed=1"
    assert row["setting"] == "heads=8"
    assert row["seed"] == 1
    assert row["params"] == 8000
    assert row["best_val_acc"] == pytest.approx(0.81)
    assert row["test_acc"] == pytest.approx(0.61)
    assert row["epochs"] == 3
    assert row["wall_time_s"] == pytest.approx(201.0)
    assert row["tokens_per_s"] == pytest.approx(16000.0)
    assert row["status"] == "finished"
    assert row["head_dim"] == pytest.approx(16.0)
    assert row["ff_ratio"] == pytest.approx(4.0)
    by_member = df.set_index("member")
    assert by_member.loc["heads=16,seed=0", "status"] == "failed"
    assert by_member.loc["heads=16,seed=0", "error"] == "RuntimeError: CUDA out of memory"
    assert by_member.loc["heads=16,seed=1", "status"] == "dead"  # says "running", but no process holds its dir
    assert by_member.loc["heads=16,seed=2", "status"] == "missing"  # from .hydra/, no metrics.json
    assert by_member.loc["heads=16,seed=2", "setting"] == "heads=16"
    assert by_member.loc["heads=16,seed=2", "seed"] == 2
    assert (df["setting"] == "heads=2").sum() == 3


def test_summary_mean_std_over_seeds(sweep: Path) -> None:
    df = collect_results(sweep)
    s = summarize_settings(df).set_index("setting")
    assert s.loc["heads=2", "n"] == 3
    assert s.loc["heads=2", "best_val_acc_mean"] == pytest.approx(0.72)
    assert s.loc["heads=2", "best_val_acc_std"] == pytest.approx(0.02)  # ddof=1
    assert s.loc["heads=2", "test_acc_mean"] == pytest.approx(0.91)
    assert s.loc["heads=2", "test_acc_std"] == pytest.approx(0.01)
    assert s.loc["heads=8", "best_val_acc_mean"] == pytest.approx(0.81)
    assert s.loc["heads=8", "best_val_acc_std"] == pytest.approx(0.01)
    assert s.loc["heads=8", "wall_time_mean"] == pytest.approx(201.0)
    assert s.loc["heads=16", "n"] == 0
    assert s.loc["heads=16", "n_failed"] == 3
    assert math.isnan(s.loc["heads=16", "best_val_acc_mean"])


def test_best_setting_by_val_never_by_test(reported: tuple[Path, dict]) -> None:
    sweep, res = reported
    assert res["best_setting"]["setting"] == "heads=8"  # heads=2 has the better test acc
    assert res["best_setting"]["mean"] == pytest.approx(0.81)
    assert res["best_setting"]["n"] == 3
    md = res["report_md"].read_text()
    assert "| **heads=8** | 3 | 81.00 ± 1.00 | 61.00 ± 1.00 | 201 | 8,000 | 0 |" in md
    assert "| heads=2 | 3 | 72.00 ± 2.00 | 91.00 ± 1.00 | 101 | 2,000 | 0 |" in md
    with pytest.raises(ValueError, match="test metric"):
        write_report(sweep, metric="test/acc")


def test_monitored_loss_metric_is_minimised(sweep: Path) -> None:
    # val/loss: best from metrics.json is 0.45 everywhere, so override it in two members' best
    for s, loss in ((0, 0.30), (1, 0.32), (2, 0.34)):
        p = sweep / f"heads=2,seed={s}" / "metrics.json"
        rec = json.loads(p.read_text())
        rec["best"]["val/loss"] = loss
        p.write_text(json.dumps(rec))
    res = write_report(sweep, metric="val/loss")
    assert res["best_setting"]["setting"] == "heads=2"
    assert res["best_setting"]["mean"] == pytest.approx(0.32)


def test_failed_members_listed_with_reasons(reported: tuple[Path, dict]) -> None:
    res = reported[1]
    assert res["n_members"] == 9
    assert res["n_finished"] == 6
    assert {f["member"]: f["status"] for f in res["failed"]} == {
        "heads=16,seed=0": "failed", "heads=16,seed=1": "dead", "heads=16,seed=2": "missing"}
    md = res["report_md"].read_text()
    failed = md.split("## Failed members")[1].split("## Plots")[0]
    assert "| heads=16,seed=0 | heads=16 | 0 | failed | RuntimeError: CUDA out of memory |" in failed
    assert "| heads=16,seed=1 | heads=16 | 1 | dead | killed (its process is gone; re-run the sweep to resume it) |" in failed
    assert "heads=16,seed=2" in failed and "no metrics.json" in failed
    assert "heads=2,seed" not in failed


def test_report_states_scale_and_links_plots(reported: tuple[Path, dict]) -> None:
    md = reported[1]["report_md"].read_text()
    scale = md.split("## Scale measured")[1].split("##")[0]
    assert "data set: sst2" in scale
    assert "embed dim: 128;" in scale
    assert "heads: 2, 8, 16" in scale
    assert "layers: 2" in scale
    assert "run 3–3" in scale
    assert "device: cpu" in scale
    for name in ("val_loss_curves.png", "acc_vs_swept.png", "acc_vs_wall_time.png"):
        assert f"]({name})" in md


def test_plots_are_real_pngs(reported: tuple[Path, dict]) -> None:
    sweep, res = reported
    assert set(res["plots"]) == {"val_loss", "acc_vs_swept", "acc_vs_wall_time"}
    for path in res["plots"].values():
        assert path.parent == sweep.resolve()
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC
        assert len(data) > 5000


def test_val_curve_drops_post_fit_evaluation_rows(tmp_path: Path) -> None:
    _lightning_csv(tmp_path / "m.csv", 0.8, epochs=3)
    v = training_val_rows(pd.read_csv(tmp_path / "m.csv"), epochs=3)
    assert v["epoch"].tolist() == [0, 1, 2]
    assert v["val/loss"].tolist() == pytest.approx([0.6, 0.55, 0.5])


def test_best_falls_back_on_metrics_csv(tmp_path: Path) -> None:
    d = _member(tmp_path / "mr", "0", 4, 0, 0.77, 0.7)
    rec = json.loads((d / "metrics.json").read_text())
    del rec["best"]
    (d / "metrics.json").write_text(json.dumps(rec))
    df = collect_results(tmp_path / "mr")
    assert df.loc[0, "best_val_acc"] == pytest.approx(0.77)  # max of val/acc in metrics.csv


def test_broken_members_do_not_break_the_report(tmp_path: Path) -> None:
    root = tmp_path / "mr"
    for name, text in (("0", '{"status": "fini'), ("1", json.dumps({"status": "failed", "error": "ValueError: x\ny"})),
                       ("2", "{}")):
        (root / name).mkdir(parents=True)
        (root / name / "metrics.json").write_text(text)
    res = write_report(root)
    assert res["best_setting"] is None
    assert res["n_finished"] == 0
    assert [(f["member"], f["status"]) for f in res["failed"]] == [("0", "unreadable"), ("1", "failed"),
                                                                   ("2", "unknown")]
    assert res["failed"][0]["error"].startswith("cannot parse metrics.json")
    assert res["failed"][1]["error"] == "ValueError: x"  # one line
    assert res["failed"][2]["error"] is None
    assert "No finished member" in res["report_md"].read_text()
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in res["plots"].values())


# --------------------------------------------------------------------------------------------------
# verdict logic on synthetic tables

# per claim: the config columns of the claimed group and of one alternative
CLAIMS = {
    "head_dim_min_64": ({"dim": 128, "heads": 2}, {"dim": 128, "heads": 8}),  # head_dim 64 vs 16
    "heads_8_or_16": ({"dim": 512, "heads": 8}, {"dim": 512, "heads": 4}),  # head_dim 64 vs 128
    "ff_4x": ({"ff_dim": 4 * 128}, {"ff_dim": 2 * 128}),
    "dropout_0.1": ({"dropout": 0.1}, {"dropout": 0.3}),
    "wider_dim": ({"dim": 256, "heads": 2, "ff_dim": 1024}, {"dim": 128, "heads": 2, "ff_dim": 512}),
}
BASE = {"dim": 128, "heads": 2, "ff_dim": 512, "dropout": 0.1}


def _table(groups: list[tuple[dict, list[float]]], statuses: dict[int, str] | None = None) -> pd.DataFrame:
    rows = []
    for cfg, values in groups:
        for seed, v in enumerate(values):
            rows.append({**BASE, **cfg, "seed": seed, "monitored": v, "status": "finished"})
    df = pd.DataFrame(rows)
    for i, st in (statuses or {}).items():
        df.loc[i, "status"] = st
    return df


def _verdict(df: pd.DataFrame, key: str, metric: str = "val/acc"):
    return {v.key: v for v in compute_verdicts(df, metric)}[key]


SCENARIOS = {
    # name: (claimed values, alternative values, verdict, effect); seed i of both groups shares its luck
    "clearly_supported": ([0.85, 0.86, 0.84], [0.80, 0.81, 0.79], SUPPORTED, 0.05),
    "clearly_contradicted": ([0.80, 0.81, 0.79], [0.85, 0.86, 0.84], CONTRADICTED, -0.05),
    "within_noise": ([0.85, 0.80, 0.90], [0.84, 0.81, 0.87], INCONCLUSIVE, 0.01),
    "single_seed": ([0.90], [0.80], INCONCLUSIVE, 0.10),
}


@pytest.mark.parametrize("claim", list(CLAIMS))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_verdicts_known_answers(claim: str, scenario: str) -> None:
    claimed_cfg, alt_cfg = CLAIMS[claim]
    c_vals, a_vals, expected, effect = SCENARIOS[scenario]
    v = _verdict(_table([(claimed_cfg, c_vals), (alt_cfg, a_vals)]), claim)
    assert v.covered
    assert v.verdict == expected, v.reason
    assert v.headline.effect == pytest.approx(effect)
    if scenario == "single_seed":
        assert "fewer than 2 seeds" in v.reason and v.headline.test == "none"
    else:
        assert v.headline.test == "paired" and v.claimed.n == 3 and v.headline.alternative.n == 3
        assert v.headline.ci_low - 1e-12 <= effect <= v.headline.ci_high + 1e-12


def test_an_alternative_whose_members_all_failed_is_named_in_the_verdict() -> None:
    df = _table([({"heads": 8}, [0.85, 0.86, 0.84]), ({"heads": 2}, [0.80, 0.81, 0.79]),
                 ({"heads": 1}, [0.90, 0.91, 0.92])], statuses={6: "failed", 7: "failed", 8: "failed"})
    v = _verdict(df, "heads_8_or_16")
    assert [c.alternative.label for c in v.comparisons] == ["heads=2"]  # heads=1 has no finished member
    assert v.verdict == SUPPORTED and v.reason.endswith("; not compared: heads=1 (no finished runs)"), v.reason


def test_models_that_predict_one_class_get_no_verdict_and_no_best_setting(tmp_path: Path) -> None:
    """The issue's case: every member answers one class (one class's F1 = 0), at the majority class's level, and the
    cells tie. Before: "no practical difference (equiv. p < 0.001)" and a bolded best setting out of the tie."""
    root = tmp_path / "multirun"
    for seed, cm in enumerate(([[0, 52], [0, 48]], [[0, 45], [0, 55]])):  # each seed's validation: one class predicted
        acc = cm[1][1] / 100
        for heads in (2, 8):
            _member(root, f"heads={heads},seed={seed}", heads, seed, acc, acc, confusion=cm)
    res = write_report(root)
    assert res["verdict_by_claim"]["heads_8_or_16"] == NOT_DECIDED
    verdict = next(v for v in json.loads((root / "verdicts.json").read_text())["verdicts"] if v["key"] == "heads_8_or_16")
    assert verdict["reason"].startswith("the models did not learn in heads in {8,16}, heads=2"), verdict["reason"]
    report = (root / "report.md").read_text()
    assert "No best setting: **heads=2**, **heads=8** tie at `val/acc` 51.50" in report
    assert res["best_setting"] is None and res["tied"] == ["heads=2", "heads=8"]  # what the command prints, too
    assert best_line(res) == "no best by val/acc: heads=2, heads=8 tie"  # the command's and the sweep log's line
    assert "| heads=2 | 2 |" in report and "| heads=8 | 2 |" in report  # neither bolded in the table
    assert "Best setting" not in report.split("## Best setting")[1].split("##")[0].replace("No best setting", "")


def test_a_member_that_learned_is_not_flagged() -> None:
    df = pd.DataFrame({"best_val_acc": [0.80, 0.53, 0.70], "val_majority_acc": [0.52, 0.52, 0.52],
                       "val_classes_predicted": [2, 2, 1]})
    assert not_learned_mask(df).tolist() == [False, True, True]  # learned; at the majority's level; one class
    assert not not_learned_mask(df.drop(columns="val_majority_acc")).any()  # an old results.csv: not checked


def test_verdict_compares_with_each_alternative_and_pools_8_16() -> None:
    df = _table([({"heads": 1}, [0.70, 0.71, 0.72]), ({"heads": 4}, [0.84, 0.85, 0.86]),
                 ({"heads": 8}, [0.80, 0.81, 0.82]), ({"heads": 16}, [0.82, 0.83, 0.84])])
    v = _verdict(df, "heads_8_or_16")
    assert v.claimed.n == 6 and v.claimed.n_seeds == 3 and v.claimed.mean == pytest.approx(0.82)
    assert [c.alternative.label for c in v.comparisons] == ["heads=1", "heads=4"]
    assert v.headline.alternative.label == "heads=4"
    assert v.headline.effect == pytest.approx(0.82 - 0.85)
    assert v.verdict == CONTRADICTED and v.reason == "worse than heads=4"
    assert [c.outcome for c in v.comparisons] == ["claimed better", "claimed worse"]


def test_verdict_ignores_unfinished_members() -> None:
    # the two 0.99 values belong to failed/running members and must not count
    df = _table([({"dropout": 0.1}, [0.80, 0.81, 0.79, 0.99]), ({"dropout": 0.3}, [0.85, 0.86, 0.84, 0.99])],
                statuses={3: "failed", 7: "running"})
    v = _verdict(df, "dropout_0.1")
    assert v.claimed.n == 3 and v.headline.alternative.n == 3
    assert v.headline.effect == pytest.approx(-0.05)
    assert v.verdict == CONTRADICTED


def test_verdict_for_loss_metric_flips_sign() -> None:
    df = _table([({"dropout": 0.1}, [0.30, 0.31, 0.29]), ({"dropout": 0.0}, [0.40, 0.41, 0.39])])
    v = _verdict(df, "dropout_0.1", metric="val/loss")
    assert v.headline.effect == pytest.approx(0.10)  # lower loss for the claimed group = better
    assert v.verdict == SUPPORTED


def test_wider_compares_widest_with_each_narrower() -> None:
    df = _table([({"dim": 128}, [0.70, 0.71, 0.72]), ({"dim": 256}, [0.80, 0.81, 0.82]),
                 ({"dim": 512, "ff_dim": 2048}, [0.80, 0.82, 0.81])])
    v = _verdict(df, "wider_dim")
    assert v.claimed.label == "widest dim=512"
    assert v.headline.alternative.label == "dim=256"
    assert v.headline.effect == pytest.approx(0.0)
    assert v.verdict == INCONCLUSIVE  # 0 +- a 4-point interval (3 seeds) crosses the 1-point margin


def test_head_dim_claim_reads_model_head_dim_at_fixed_dim_and_heads() -> None:
    # heads x model.head_dim at dim 128: head_dim is a column of its own, not dim / heads
    df = _table([({"heads": h, "head_dim": d}, [0.80 + (d >= 64) * 0.05 + 0.01 * s for s in range(3)])
                 for h in (2, 8) for d in (16, 32, 64)])
    v = _verdict(df, "head_dim_min_64")
    assert [c.alternative.label for c in v.comparisons] == ["head_dim=16", "head_dim=32"]
    assert v.claimed.n == 6 and v.verdict == SUPPORTED
    assert v.also_varies == ["heads"]  # averaged over: both levels of heads at every head_dim


def test_coverage_rules() -> None:
    # one setting only: nothing covered
    vs = compute_verdicts(_table([({}, [0.8, 0.81])]))
    assert {v.verdict for v in vs} == {NOT_COVERED}
    # heads 1, 2, 4 at dim 128: head_dim 128/64/32 covered; no 8 or 16 -> heads claim not covered
    df = _table([({"heads": 1}, [0.8, 0.8]), ({"heads": 2}, [0.8, 0.8]), ({"heads": 4}, [0.8, 0.8])])
    by = {v.key: v for v in compute_verdicts(df)}
    assert by["head_dim_min_64"].covered and not by["heads_8_or_16"].covered
    assert by["heads_8_or_16"].verdict == NOT_COVERED
    assert by["head_dim_min_64"].also_varies == ["heads"]
    # heads 8 and 16 only: no alternative to the claim -> not covered
    df = _table([({"heads": 8}, [0.8, 0.8]), ({"heads": 16}, [0.8, 0.8])])
    assert _verdict(df, "heads_8_or_16").verdict == NOT_COVERED
    # dropout varies but never 0.1 -> not covered
    df = _table([({"dropout": 0.0}, [0.8, 0.8]), ({"dropout": 0.3}, [0.8, 0.8])])
    assert _verdict(df, "dropout_0.1").verdict == NOT_COVERED
    # claimed group covered by the sweep but every member of it failed -> inconclusive
    df = _table([({"dropout": 0.1}, [0.8, 0.8]), ({"dropout": 0.3}, [0.8, 0.8])], statuses={0: "failed", 1: "failed"})
    v = _verdict(df, "dropout_0.1")
    assert v.verdict == INCONCLUSIVE and "no finished runs" in v.reason


def test_verdicts_end_to_end(reported: tuple[Path, dict]) -> None:
    res = reported[1]
    by = {v["key"]: v for v in res["verdicts"]}
    assert res["verdict_by_claim"] == {"head_dim_min_64": CONTRADICTED, "heads_8_or_16": SUPPORTED,
                                       "ff_4x": NOT_COVERED, "dropout_0.1": NOT_COVERED,
                                       "wider_dim": NOT_COVERED}
    assert by["heads_8_or_16"]["effect"] == pytest.approx(0.09)
    assert by["head_dim_min_64"]["effect"] == pytest.approx(-0.09)
    # paired differences 0.10, 0.09, 0.08: mean 0.09, SE 0.01 / sqrt(3), t(2) interval
    half = 4.302652729749464 * 0.01 / math.sqrt(3)
    assert by["heads_8_or_16"]["ci"] == pytest.approx([0.09 - half, 0.09 + half])
    md = res["report_md"].read_text()
    detectable = detectable_effect(0.01 / math.sqrt(3), 2)  # the same design's 80%-power effect
    assert ("| 8 or 16 heads | **supported** | heads in {8,16}: 81.00 ± 1.00 (seeds=3) | heads=2: 72.00 ± 2.00 "
            f"(seeds=3) | +9.00 [{100 * (0.09 - half):+.2f}, {100 * (0.09 + half):+.2f}] | {100 * detectable:.2f} | "
            "paired | 0.004 |") in md
    assert "paired t-test" in md and "Holm" in md and "TOST" in md  # the rule is stated
    saved = json.loads(res["verdicts_json"].read_text())
    assert saved["margin"] == 0.01 and [v["verdict"] for v in saved["verdicts"]] == list(res["verdict_by_claim"].values())


def test_a_sweep_whose_members_are_gone_is_reported_again_from_its_results_csv(reported, tmp_path) -> None:
    root, res = reported
    copy = tmp_path / "copy"  # what results/ keeps of a sweep: its report's files, not its member dirs
    copy.mkdir()
    for name in ("results.csv", "val_loss_curves.png"):
        shutil.copy(root / name, copy / name)
    again = write_report(copy)
    assert again["verdicts"] == res["verdicts"] and again["verdict_by_claim"] == res["verdict_by_claim"]
    pd.testing.assert_frame_equal(again["summary"], res["summary"])
    assert again["from_csv"] and again["plots"]["val_loss"].read_bytes() == (root / "val_loss_curves.png").read_bytes()
    md = again["report_md"].read_text()
    assert "Written from this dir's results.csv: its member dirs are gone" in md
    # the same table rows as the report from the members
    rows = [line for line in res["report_md"].read_text().splitlines() if line.startswith("| ")]
    assert rows == [line for line in md.splitlines() if line.startswith("| ")]
    with pytest.raises(NoMembersError, match="metric=val/f1 needs the members' metrics"):
        write_report(copy, metric="val/f1")


# --------------------------------------------------------------------------------------------------
# Hydra callback


def test_callback_writes_report_into_sweep_dir(sweep: Path) -> None:
    cb = ReportCallback()
    cb.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    assert (sweep / "report.md").is_file()
    assert (sweep / "results.csv").is_file()
    assert cb.last_result["best_setting"]["setting"] == "heads=8"


def test_callback_swallows_errors(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cb = ReportCallback()
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with caplog.at_level(logging.ERROR, logger="mhalab.analysis.sweep_callbacks"):
        cb.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(empty)}}}))
        cb.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "missing")}}}))
        cb.on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(a_file)}}}))
        cb.on_multirun_end(OmegaConf.create({}))  # no hydra.sweep.dir at all
    assert cb.last_result is None
    assert len([r for r in caplog.records if "sweep report" in r.getMessage()]) == 4
    assert not (empty / "report.md").exists()


def test_callback_in_a_real_hydra_multirun(tmp_path: Path) -> None:
    """-m with ReportCallback in hydra.callbacks: the report lands in the (timestamped) sweep dir."""
    (tmp_path / "conf.yaml").write_text(
        "heads: 4\nseed: 0\n"
        "hydra:\n"
        "  sweep:\n"
        "    dir: multirun/${now:%Y-%m-%d_%H-%M-%S-%f}\n"
        "    subdir: ${hydra.job.override_dirname}\n"
        "  callbacks:\n"
        "    report:\n"
        "      _target_: mhalab.analysis.sweep_callbacks.ReportCallback\n")
    (tmp_path / "app.py").write_text(
        "import json, hydra\n"
        "from pathlib import Path\n"
        "from hydra.core.hydra_config import HydraConfig\n"
        "from omegaconf import OmegaConf\n"
        "@hydra.main(version_base='1.3', config_path='.', config_name='conf')\n"
        "def main(cfg):\n"
        "    out = Path(HydraConfig.get().runtime.output_dir)\n"
        "    acc = 0.7 + 0.01 * cfg.heads + 0.001 * cfg.seed\n"
        "    rec = {'status': 'finished', 'overrides': list(HydraConfig.get().overrides.task),\n"
        "           'seed': cfg.seed, 'config': {'heads': cfg.heads, 'dim': 128}, 'wall_time_s': 1.0,\n"
        "           'best': {'val/acc': acc, 'test/acc': acc}, 'last_epoch': {'val/acc': acc}}\n"
        "    (out / 'metrics.json').write_text(json.dumps(rec))\n"
        "if __name__ == '__main__':\n"
        "    main()\n")
    env = {**os.environ, "MPLBACKEND": "Agg"}
    p = subprocess.run([sys.executable, "app.py", "-m", "heads=2,8", "seed=0,1"], check=False, cwd=tmp_path,
                       env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    reports = list((tmp_path / "multirun").glob("*/report.md"))
    assert len(reports) == 1, p.stderr
    df = pd.read_csv(reports[0].parent / "results.csv")
    assert len(df) == 4
    assert sorted(df["setting"].unique()) == ["heads=2", "heads=8"]
    assert "sweep report:" in p.stderr + p.stdout
    assert "members, 4 finished; best by val/acc: heads=8 (mean 0.7805 over 2 seed(s))" in p.stderr + p.stdout


# --------------------------------------------------------------------------------------------------
# CLI


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "report.py"), *args], check=False,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "MPLBACKEND": "Agg"})


def test_cli_writes_report(sweep: Path) -> None:
    p = _cli(str(sweep))
    assert p.returncode == 0, p.stderr
    assert "best by val/acc: heads=8" in p.stdout
    assert "8 or 16 heads: supported" in p.stdout
    for name in ("results.csv", "report.md", "val_loss_curves.png", "acc_vs_swept.png", "acc_vs_wall_time.png"):
        assert (sweep / name).is_file()


def test_cli_fails_clearly_without_metrics(tmp_path: Path) -> None:
    (tmp_path / "0").mkdir()
    p = _cli(str(tmp_path))
    assert p.returncode == 2
    assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1  # one line, no traceback
    assert "no metrics.json found" in p.stderr
    assert not (tmp_path / "report.md").exists()
    with pytest.raises(NoMembersError):
        write_report(tmp_path)


def _main_error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    """mhalab-report's one `error:` line for argv (it must exit 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_main_reads_key_value_options(sweep: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(sweep), "metric=val/loss"]) == 0
    assert "best by val/loss:" in capsys.readouterr().out
    assert "is a test metric" in _main_error(capsys, str(sweep), "metric=test/acc")
    assert "options are key=value, e.g. metric=" in _main_error(capsys, str(sweep), "--metric=val/loss")
    assert "unknown option 'metrc=val/loss'" in _main_error(capsys, str(sweep), "metrc=val/loss")
    assert "give one sweep dir, not 0" in _main_error(capsys, "metric=val/acc")
    assert "give one sweep dir, not 2" in _main_error(capsys, str(sweep), "val/loss")  # metric without metric=
    assert "is not a directory" in _main_error(capsys, str(sweep / "nowhere"))


# --------------------------------------------------------------------------------------------------
# metrics.json read through mhalab.train.record; the keys that do not change results


def test_old_final_records_give_the_same_rows_as_new_ones(tmp_path: Path) -> None:
    """Records from before `last_epoch` (the committed results were made with them) read the same."""
    new = _member(tmp_path / "new", "0", 4, 0, val_acc=0.8, test_acc=0.7)
    old = _member(tmp_path / "old", "0", 4, 0, val_acc=0.8, test_acc=0.7, old_record=True)
    assert record.best(record.read(old)) == record.best(record.read(new)) == {
        "val/acc": 0.8, "val/loss": 0.45, "test/acc": 0.7, "test/f1": 0.7, "test/loss": 0.47}
    assert record.last_epoch(record.read(old)) == record.last_epoch(record.read(new)) == {
        "val/acc": pytest.approx(0.79), "val/loss": 0.46}
    rows = [collect_results(tmp_path / which).drop(columns="_csv") for which in ("new", "old")]
    pd.testing.assert_frame_equal(rows[0], rows[1])
    assert rows[0].loc[0, "test_acc"] == pytest.approx(0.7)  # the best checkpoint's
    assert rows[0].loc[0, "final_val_acc"] == pytest.approx(0.79)  # the last epoch's


def _conf_exclude_keys() -> list[str]:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", return_hydra_config=True)
    return list(cfg.hydra.job.config.override_dirname.exclude_keys)


def test_setting_leaves_out_exactly_what_member_dir_names_leave_out() -> None:
    """One list of the keys that do not change results: Hydra's override_dirname (the member dir names)
    and the report's setting drop the same overrides (the setting drops the seed too)."""
    from hydra._internal.config_loader_impl import get_overrides_dirname
    from hydra.core.override_parser.overrides_parser import OverridesParser

    exclude = _conf_exclude_keys()
    assert {"sweep", "trainer", "logger", "paths.data_dir"} <= set(exclude)
    overrides = [f"{k}=x" for k in exclude] + ["heads=8", "+model.pooling=cls", "trainer.max_steps=10", "seed=1"]
    dirname = get_overrides_dirname(OverridesParser.create().parse_overrides(overrides), exclude, ",", "=")
    kept = sorted(w for w in dirname.split(",") if w != "seed=1")
    assert kept == ["+model.pooling=cls", "heads=8", "trainer.max_steps=10"]
    assert sorted(setting_of(overrides).split(" ")) == kept


def test_setting_uses_the_members_own_exclude_keys(tmp_path: Path) -> None:
    """A member's .hydra/hydra.yaml (what its run used) decides; without one, conf/train.yaml's list."""
    own = _member(tmp_path / "mr", "a", 4, 0, 0.8, 0.7)
    (own / ".hydra").mkdir()
    (own / ".hydra" / "hydra.yaml").write_text(
        "hydra:\n  job:\n    config:\n      override_dirname:\n        exclude_keys: [heads]\n")
    _member(tmp_path / "mr", "b", 4, 0, 0.8, 0.7)
    df = collect_results(tmp_path / "mr").set_index("member")
    assert df.loc["a", "setting"] == "(default)"  # heads=4 left out by its own list, seed always
    assert df.loc["b", "setting"] == "heads=4"


def test_analysis_leaves_matplotlib_global_state_alone(tmp_path: Path) -> None:
    """Importing the analysis modules and drawing with them picks no backend and starts no pyplot."""
    _build_sweep(tmp_path / "mr")
    _lightning_csv(tmp_path / "metrics.csv", 0.8)
    code = (
        "import sys, matplotlib\n"
        "from mhalab.analysis import lra, report\n"
        "from mhalab.train.record import curves\n"
        f"report.write_report({str(tmp_path / 'mr')!r})\n"
        f"curves.loss_curves({str(tmp_path / 'metrics.csv')!r}, {str(tmp_path / 'curves.png')!r})\n"
        f"lra.plot_lra([], {str(tmp_path / 'lra.png')!r})\n"
        "print(matplotlib.rcParams._get_backend_or_none(), 'matplotlib.pyplot' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                       env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["None", "False"]
    assert (tmp_path / "curves.png").read_bytes()[:8] == PNG_MAGIC
    assert (tmp_path / "lra.png").read_bytes()[:8] == PNG_MAGIC


def test_a_report_names_its_sweep_by_its_preset_or_the_dir_given_never_an_absolute_path(tmp_path, monkeypatch):
    from mhalab.analysis.report import report_name

    monkeypatch.chdir(tmp_path)
    preset = pd.DataFrame({"overrides": ["seed=0 heads=2 sweep=heads data=trec", "seed=0 heads=8 sweep=heads data=trec"]})
    preset.attrs["common"] = ["data=trec"]
    assert report_name("/elsewhere/x/heads", preset) == "sweep=heads data=trec"
    plain = pd.DataFrame({"overrides": ["heads=2 seed=0", "heads=8 seed=0"]})
    assert report_name("multirun/x", plain) == "multirun/x"  # as given
    assert report_name(tmp_path / "multirun" / "x", plain) == "multirun/x"  # inside the working dir: relative
    assert report_name("/work/main/results/sweeps/trec/heads", plain) == "trec/heads"  # outside: its last two parts
    assert report_name(".", plain) == tmp_path.name


def _own_data_member(root: Path, name: str, heads: int, seed: int, val_acc: float, planned: int = 30) -> Path:
    """A member of a sweep on the user's own CSV (data=files), as metrics.json records it since split sizes."""
    d = _member(root, name, heads, seed, val_acc, 0.5)
    rec = json.loads((d / "metrics.json").read_text())
    rec["data"] = {"name": "questions", "files": {"train": "/home/someone/private/questions.csv"}}
    rec["model"] = {"dim": 128, "heads": heads, "layers": 2, "head_dim": 128 // heads, "head_dim_from": "dim / heads"}
    rec["trained"] = {"steps": 30, "planned_steps": planned, "epochs": 3, "max_epochs": 3, "steps_per_epoch": 10,
                      "evaluated": {"validation": [49, 49]}, "split_sizes": {"train": 431, "validation": 49}}
    (d / "metrics.json").write_text(json.dumps(rec))
    return d


def test_an_own_data_sweep_report_names_its_files_split_sizes_and_a_dev_set_too_small_for_the_margin(tmp_path):
    for heads in (2, 16):
        for seed in range(2):
            _own_data_member(tmp_path, f"heads={heads},seed={seed}", heads, seed, 0.70 + 0.02 * seed)
    res = write_report(tmp_path)
    text = res["report_md"].read_text()
    assert "- data set: questions (files: train=questions.csv); max_len: " in text  # was "data set: ?"
    assert "- examples per split: train 431; validation 49" in text
    assert ("- resolution: 49 validation examples: one example moves accuracy by 2.04 points, more than half of a "
            "±1-point margin") in text
    assert "/home/someone" not in text  # the files' names, never a machine's path
    assert sorted(pd.read_csv(res["results_csv"])["head_dim"].unique()) == [8, 64]  # from the model as built


def _red_pixels(png: Path) -> int:
    from matplotlib.image import imread

    img = imread(png)[..., :3]
    return int(((img[..., 0] > 0.9) & (img[..., 1] < 0.2) & (img[..., 2] < 0.2)).sum())


def test_the_plots_ring_the_members_not_trained_to_the_end(tmp_path):
    for heads in (2, 8):
        for seed in range(2):
            _own_data_member(tmp_path / "cut", f"heads={heads},seed={seed}", heads, seed, 0.7 + 0.01 * seed,
                             planned=60 if (heads, seed) == (8, 1) else 30)  # one member ran 30 of 60 steps
            _own_data_member(tmp_path / "whole", f"heads={heads},seed={seed}", heads, seed, 0.7 + 0.01 * seed)
    for plot in ("acc_vs_swept", "acc_vs_wall_time"):
        cut, whole = (write_report(tmp_path / d)["plots"][plot] for d in ("cut", "whole"))
        assert _red_pixels(cut) > 100 and _red_pixels(whole) == 0, plot
