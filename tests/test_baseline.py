"""mhalab-baseline: TF-IDF + logistic regression on the training runs' own splits, tuned on validation only.
(The command itself: the documented `mhalab-baseline` line in tests/test_doc_commands.py, its mistake in test_cli_errors.)"""

from __future__ import annotations

import csv

import numpy as np
import pytest
from conftest import compose_train
from omegaconf import OmegaConf
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression

from mhalab.analysis.baseline import CS, NGRAMS, SOLVER, run_baseline
from mhalab.data.holdout import stratified_holdout


def _read(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [r["sentence"] for r in rows], np.array([int(r["label"]) for r in rows])


def test_baseline_equals_scikit_learn_on_the_files_read_independently(tmp_path, toy_data_dir):
    """The files read here with csv (not the project's reader), the held-out dev split made by the same seeded rule;
    the chosen (n-grams, C) refitted with plain scikit-learn gives the same accuracies, and no other grid point has
    a better validation accuracy (test is never looked at)."""
    cfg = compose_train(["data.dev_split=0.3", "data.files.validation=null"], tmp_path, toy_data_dir)
    res = run_baseline(OmegaConf.to_container(cfg.data, resolve=True), seeds=[0, 1])
    assert [r["seed"] for r in res["per_seed"]] == [0, 1]  # a held-out dev split: one fit per seed
    texts, labels = _read(toy_data_dir / "sst2" / "train.tsv")
    test_x, test_y = _read(toy_data_dir / "sst2" / "test.tsv")
    for r in res["per_seed"]:
        tr, va = stratified_holdout(labels.tolist(), 0.3, r["seed"])
        assert res["rows"] == {"train": len(tr), "validation": len(va), "test": len(test_y)}
        assert len(r["grid"]) == len(NGRAMS) * len(CS)
        assert max(g["val_acc"] for g in r["grid"]) == r["validation/acc"]
        vec = TfidfVectorizer(ngram_range=tuple(r["ngram"]), sublinear_tf=True)
        train_x = vec.fit_transform([texts[i] for i in tr])
        clf = LogisticRegression(C=r["C"], solver=SOLVER, max_iter=3000).fit(train_x, labels[tr])
        for x, y, key in (([texts[i] for i in va], labels[va], "validation/acc"), (test_x, test_y, "test/acc")):
            assert abs(float((clf.predict(vec.transform(x)) == y).mean()) - r[key]) < 1e-9, key
    assert res["mean"]["test/acc"] == pytest.approx(np.mean([r["test/acc"] for r in res["per_seed"]]))


def test_a_data_set_with_a_dev_file_is_fitted_once_whatever_the_seeds(tmp_path, toy_data_dir):
    cfg = compose_train([], tmp_path, toy_data_dir)
    res = run_baseline(OmegaConf.to_container(cfg.data, resolve=True), seeds=[0, 1, 2])
    assert res["seeds"] == [0] and res["mean"]["test/acc"] > 0.9  # the toy data is learnable by word lookup
