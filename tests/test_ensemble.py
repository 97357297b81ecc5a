"""mhalab-ensemble: the average of the members' probabilities, scored as mhalab-eval and scikit-learn score it.

One tiny real run (toy SST-2, ~10 s); a second member is its tested checkpoint with the classifier head's
weights perturbed (a different model without a second training run).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_train
from scipy import stats
from sklearn.metrics import accuracy_score, f1_score

from mhalab.errors import ConfigError
from mhalab.train import checkpoint
from mhalab.train.commands.ensemble import member_names, members, score
from mhalab.train.commands.evaluate import evaluate
from mhalab.train.commands.predict import probabilities
from mhalab.train.run import run


@pytest.fixture(scope="module")
def runs(tmp_path_factory, toy_data_dir):
    tmp = tmp_path_factory.mktemp("ensemble")
    cfg = compose_train(["max_epochs=2", "seed=1"], tmp / "sweep" / "s1", toy_data_dir, tmp / "cache")
    run(cfg)
    rec = json.loads((tmp / "sweep" / "s1" / "metrics.json").read_text())
    ckpt = torch.load(rec["best"]["checkpoint"], map_location="cpu", weights_only=True)
    head = ckpt["state_dict"]["model.head.weight"]
    ckpt["state_dict"]["model.head.weight"] = head + torch.randn(head.shape, generator=torch.Generator().manual_seed(0))
    torch.save(ckpt, tmp / "perturbed.ckpt")
    return tmp, rec


def test_an_ensemble_of_one_run_twice_scores_what_mhalab_eval_scores(runs):
    _, rec = runs
    res = score([checkpoint.resolve(rec["best"]["checkpoint"])] * 2, "test")
    ref = evaluate(rec["best"]["checkpoint"], "test")
    assert res["examples"] == ref["examples"] == 64
    assert res["test/acc"] == pytest.approx(ref["test/acc"], abs=1e-6) == res["member_mean_acc"]
    assert res["test/acc"] == pytest.approx(rec["best"]["test/acc"], abs=1e-6)  # what the run itself reported
    assert res["test/loss"] == pytest.approx(ref["test/loss"], abs=1e-5)  # NLL of the average = cross-entropy
    assert res["test/f1"] == pytest.approx(ref["test/f1"], abs=1e-6)


def test_ensemble_scores_the_mean_of_the_members_probabilities_as_sklearn_does(runs):
    tmp, rec = runs
    ckpts = [checkpoint.resolve(rec["best"]["checkpoint"]), tmp / "perturbed.ckpt"]
    res = score(ckpts, "test")
    loaded = [checkpoint.load_model(c) for c in ckpts]
    rows = [line.split("\t") for line in
            (Path(loaded[0].data["data_dir"]) / "sst2" / "test.tsv").read_text().splitlines()[1:]]
    texts, y = [t for t, _ in rows], np.array([int(label) for _, label in rows])
    probs = [probabilities(m, texts).numpy() for m in loaded]
    accs = [accuracy_score(y, p.argmax(1)) for p in probs]
    assert abs(accs[0] - accs[1]) > 0.01 or np.abs(probs[0] - probs[1]).max() > 0.1  # two different members
    avg = (probs[0] + probs[1]) / 2
    assert [m["acc"] for m in res["members"]] == pytest.approx(accs, abs=1e-6)
    assert res["test/acc"] == pytest.approx(accuracy_score(y, avg.argmax(1)), abs=1e-6)
    assert res["test/f1"] == pytest.approx(f1_score(y, avg.argmax(1), average="macro"), abs=1e-5)
    assert res["test/loss"] == pytest.approx(-np.log(avg[np.arange(len(y)), y]).mean(), abs=1e-5)


def test_a_sweep_dir_gives_its_finished_members_and_skips_unfinished_or_unreadable_ones(runs):
    tmp, _ = runs
    sweep = tmp / "sweep"
    shutil.copytree(sweep / "s1", sweep / "s2", dirs_exist_ok=True)  # a moved copy: its own checkpoint
    for name, seed in (("s1", 1), ("s2", 0)):  # the overrides a sweep records; s2 as seed 0: first, named by it
        rec_n = json.loads((sweep / name / "metrics.json").read_text())
        rec_n["seed"], rec_n["overrides"] = seed, ["data=sst2", "max_epochs=2", f"seed={seed}"]
        (sweep / name / "metrics.json").write_text(json.dumps(rec_n))
    (sweep / "s3").mkdir(exist_ok=True)
    (sweep / "s3" / "metrics.json").write_text(json.dumps({"status": "running"}))
    (sweep / "s4").mkdir(exist_ok=True)
    (sweep / "s4" / "metrics.json").write_text('{"status": "fini')  # cut short by a killed process
    ckpts, skipped = members([str(sweep)])
    assert [c.parent.parent.name for c in ckpts] == ["s2", "s1"]  # in seed order
    assert ckpts[0].is_file() and ckpts[0].parent.parent == sweep / "s2"
    assert member_names(ckpts) == ["seed=0", "seed=1"]  # the overrides that differ, from the records
    assert member_names([ckpts[1], tmp / "perturbed.ckpt"])[1] == str(tmp / "perturbed.ckpt")  # no record: the path
    assert skipped == [sweep / "s3", sweep / "s4"]


def test_members_that_read_different_rows_of_the_split_are_refused_naming_the_fix(runs, toy_data_dir):
    tmp, rec = runs
    other = tmp / "other-data"
    shutil.copytree(toy_data_dir, other, dirs_exist_ok=True)
    test = other / "sst2" / "test.tsv"
    test.write_text("\n".join(test.read_text().splitlines()[:-1]) + "\n")  # one test row fewer
    ckpt = torch.load(tmp / "perturbed.ckpt", map_location="cpu", weights_only=True)
    ckpt["mhalab"]["data"]["data_dir"] = str(other)
    torch.save(ckpt, tmp / "other.ckpt")
    with pytest.raises(ConfigError, match=r"reads another test split than .* \(63 vs 64 rows"):
        score([checkpoint.resolve(rec["best"]["checkpoint"]), tmp / "other.ckpt"], "test")


def test_size_groups_consecutive_members_and_reports_each_ensembles_gain_over_its_members(runs):
    tmp, rec = runs
    a, b = checkpoint.resolve(rec["best"]["checkpoint"]), tmp / "perturbed.ckpt"
    res = score([a, a, b, b, a], "test", size=2)  # ensembles {a, a} and {b, b}: each is one model; the 5th is left out
    single = score([a, b], "test")["members"]
    assert [e["members"] for e in res["ensembles"]] == [[0, 1], [2, 3]] and res["left_out"] == [4]
    assert [e["acc"] for e in res["ensembles"]] == pytest.approx([m["acc"] for m in single], abs=1e-6)
    assert [e["gain"] for e in res["ensembles"]] == pytest.approx([0.0, 0.0], abs=1e-6)
    accs = [e["acc"] for e in res["ensembles"]]
    half = stats.t.ppf(0.975, 1) * np.std(accs, ddof=1) / np.sqrt(2)
    assert res["ensemble_acc"]["mean"] == pytest.approx(np.mean(accs))
    assert res["ensemble_acc"]["ci"] == pytest.approx([np.mean(accs) - half, np.mean(accs) + half])
    assert res["test/acc"] == pytest.approx(np.mean(accs))
    assert len(res["members"]) == 5 and res["member_mean_acc"] == pytest.approx(np.mean([m["acc"] for m in res["members"]]))


def test_size_also_scores_the_ensemble_of_every_member_as_a_call_without_size_does(runs):
    tmp, rec = runs
    a, b = checkpoint.resolve(rec["best"]["checkpoint"]), tmp / "perturbed.ckpt"
    grouped, whole = score([a, b, b], "test", size=2), score([a, b, b], "test")  # {a, b} left {b}; all: {a, b, b}
    assert grouped["all"]["acc"] == pytest.approx(whole["test/acc"], abs=1e-6)
    assert grouped["all"]["loss"] == pytest.approx(whole["test/loss"], abs=1e-6)
    assert grouped["all"]["gain"] == pytest.approx(whole["gain"]["mean"], abs=1e-6)
    assert grouped["all"]["loss"] != pytest.approx(grouped["test/loss"], abs=1e-4)  # {a, b, b} is not {a, b}
