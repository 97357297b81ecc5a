"""Per-class metrics and the confusion matrix (class_reports, class_report.py), train accuracy, and the training
throughput in real tokens (RealTokenThroughput), each against a hand computation.

One tiny Trainer run (module fixture `fitted`, ~5 s) serves the end-to-end checks: 2 epochs of 4 batches,
a sanity check, validation after each epoch, then a test, with lr = 0 and dropout = 0 so that a batch's
logits can be recomputed after its step, and a fake clock in the throughput monitor (1 s per reading)
so that its rates are known numbers.
"""

from __future__ import annotations

import subprocess
import sys
import types
import warnings

import lightning as L
import numpy as np
import pytest
import torch
from conftest import compose_train
from lightning.pytorch.callbacks import throughput_monitor
from lightning.pytorch.loggers import Logger
from omegaconf import OmegaConf
from PIL import Image
from torchmetrics.classification import MulticlassF1Score

from mhalab.data import Collate
from mhalab.train.callbacks import MemoryMonitor, throughput
from mhalab.train.callbacks.throughput import RealTokenThroughput, batch_tokens
from mhalab.train.module import Classifier, _per_class_metrics
from mhalab.train.record.class_report import build_report, confusion_png, markdown
from mhalab.train.run import build

ONE_THREAD = True  # conftest.one_thread
LABELS = ["neg", "pos"]


# ---------------------------------------------------------------------------------------------- per class, unit
def _logits_for(preds: list[int], k: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(preds), k).float() * 5.0  # (n, K): argmax = preds


def _hand_report(target: list[int], preds: list[int], k: int) -> dict:
    """Precision, recall, F1 from the confusion matrix by hand (numpy), 0 where a denominator is 0."""
    cm = np.zeros((k, k), dtype=np.int64)
    for t, p in zip(target, preds):
        cm[t, p] += 1
    tp = np.diag(cm).astype(float)
    predicted, support = cm.sum(0), cm.sum(1)
    prec = np.divide(tp, predicted, out=np.zeros(k), where=predicted > 0)
    rec = np.divide(tp, support, out=np.zeros(k), where=support > 0)
    f1 = np.divide(2 * prec * rec, prec + rec, out=np.zeros(k), where=(prec + rec) > 0)
    return {"confusion": cm, "precision": prec, "recall": rec, "f1": f1, "support": support}


def test_per_class_scores_equal_a_hand_computation_and_an_unpredicted_class_has_precision_zero():
    # 4 classes: class 2 has examples but is never predicted (precision 0 / 0 -> 0, torchmetrics' zero_division=0);
    # class 3 is neither a target nor predicted (left out of the macro average, as torchmetrics' macro does)
    target = [0, 0, 0, 1, 1, 2, 2, 0, 1, 2]
    preds = [0, 1, 0, 1, 1, 0, 1, 0, 0, 1]
    k = 4
    metrics = _per_class_metrics(k)
    logits = _logits_for(preds, k)
    metrics.update(logits[:6], torch.tensor(target[:6]))  # two updates: epoch-level counts, not per batch
    metrics.update(logits[6:], torch.tensor(target[6:]))
    v = metrics.compute()
    report = build_report(v["confusion"], v["precision"], v["recall"], v["f1"], list("abcd"))
    hand = _hand_report(target, preds, k)

    assert report["confusion"] == hand["confusion"].tolist()  # rows true, columns predicted
    assert report["support"] == hand["support"].tolist() == [4, 3, 3, 0]
    for key in ("precision", "recall", "f1"):
        np.testing.assert_allclose(report[key], hand[key], atol=1e-6, err_msg=key)
    assert report["precision"][2] == 0.0 and report["recall"][2] == 0.0  # never predicted
    assert report["accuracy"] == pytest.approx(5 / 10)
    np.testing.assert_allclose(report["macro"]["f1"], hand["f1"][:3].mean(), atol=1e-6)  # class 3 left out
    macro = MulticlassF1Score(k, average="macro")(logits, torch.tensor(target))
    assert report["macro"]["f1"] == pytest.approx(float(macro), abs=1e-6)  # the logged {val,test}/f1


def test_label_names_of_the_wrong_length_are_refused_naming_both_counts():
    with pytest.raises(ValueError, match=r"label_names has 3 names .* for num_classes=2"):
        Classifier(model={"dim": 8, "heads": 2, "layers": 1, "ff_dim": 16}, vocab_size=20, num_classes=2,
                   label_names=["a", "b", "c"])


# ------------------------------------------------------------------------------------------ markdown and PNG
REPORT3 = {
    "labels": ["negative", "neutral", "positive"], "support": [5, 3, 4],
    "precision": [0.8, 0.0, 0.5], "recall": [0.8, 0.0, 0.75], "f1": [0.8, 0.0, 0.6],
    "confusion": [[4, 0, 1], [1, 0, 2], [0, 1, 3]], "accuracy": 7 / 12,
    "macro": {"precision": 0.4333, "recall": 0.5167, "f1": 0.4667},
}


def test_markdown_table_rows_hold_the_reports_values():
    lines = markdown(REPORT3).strip().splitlines()
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [r[0] for r in rows] == [*REPORT3["labels"], "macro avg", "accuracy"]
    for i, r in enumerate(rows[:3]):
        assert [float(x) for x in r[1:4]] == pytest.approx(
            [REPORT3["precision"][i], REPORT3["recall"][i], REPORT3["f1"][i]], abs=5e-5)
        assert int(r[4]) == REPORT3["support"][i]
    assert [float(x) for x in rows[3][1:4]] == pytest.approx(list(REPORT3["macro"].values()), abs=5e-5)
    assert int(rows[3][4]) == 12 and float(rows[4][3]) == pytest.approx(7 / 12, abs=5e-5)


def test_confusion_png_is_a_valid_png_that_grows_with_the_class_count(tmp_path):
    small = confusion_png(REPORT3, tmp_path / "sub" / "three.png", title="validation")
    k = 20
    cm = (torch.eye(k, dtype=torch.long) * 7 + 1).tolist()
    many = {**REPORT3, "labels": [f"class_{i}" for i in range(k)], "confusion": cm, "accuracy": 0.5}
    big = confusion_png(many, tmp_path / "twenty.png")
    with Image.open(small) as a, Image.open(big) as b:
        assert a.format == b.format == "PNG"
        a.verify()
        assert 300 < a.size[0] < b.size[0] <= 1500 and 300 < a.size[1] < b.size[1] <= 1400
    with Image.open(small) as a:
        px = np.asarray(a.convert("RGB")).reshape(-1, 3).astype(int)
    assert ((px[:, 2] - px[:, 0]) > 80).any()  # the colour scale is drawn (dark blue cells), not a blank canvas


def test_importing_class_report_loads_no_matplotlib():
    code = "import sys, mhalab.train.record.class_report; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# -------------------------------------------------------------------------------------- the tiny Trainer run
class _Capture(Logger):
    """Every logged row, as (step, metrics)."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    name, version = "capture", 0

    def log_hyperparams(self, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def values(self, key: str) -> list[float]:
        return [m[key] for _, m in self.rows if key in m]


class _Recorder(L.Callback):
    """Per training batch: what the batch held, the module's flops_per_batch, and the batch's accuracy
    recomputed after its step (lr = 0, dropout = 0: the same weights and logits). Per validation of fit:
    the class report it left."""

    def __init__(self):
        self.batches: list[dict] = []
        self.val_reports: list[dict] = []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.val_reports.append(pl_module.class_reports["validation"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            logits = pl_module(batch["input_ids"], batch["padding_mask"])
        self.batches.append({
            "num_tokens": batch["num_tokens"], "lengths_sum": int(batch["lengths"].sum()),
            "samples": len(batch["labels"]), "flops": pl_module.flops_per_batch,
            "padded": batch["input_ids"].numel(),
            "correct": int((logits.argmax(-1) == batch["labels"]).sum()),
        })


class _Clock:
    """perf_counter that advances exactly 1 s per reading."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture(scope="module")
def fitted(tmp_path_factory, toy_data_dir):
    tmp = tmp_path_factory.mktemp("metrics")
    cfg = compose_train(["dropout=0.0"], tmp / "out", toy_data_dir, tmp / "cache")
    dm, _ = build(cfg)
    module = Classifier(model=OmegaConf.to_container(cfg.model, resolve=True), vocab_size=dm.vocab_size,
                        num_classes=dm.num_classes, pad_id=dm.pad_id, lr=0.0, label_names=LABELS)
    clock = _Clock()
    fake_time = types.SimpleNamespace(perf_counter=clock.perf_counter)
    mp = pytest.MonkeyPatch()
    mp.setattr(throughput_monitor, "time", fake_time)  # Lightning's _start / _update readings
    mp.setattr(throughput, "time", fake_time)  # ours, around validation
    logger, recorder = _Capture(), _Recorder()
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=4, num_sanity_val_steps=1,
                        log_every_n_steps=1, logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[RealTokenThroughput(window_size=2), recorder])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, datamodule=dm)
        val_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        val_report = module.class_reports["validation"]
        test_res = trainer.test(module, datamodule=dm, verbose=False)[0]
    finally:
        mp.undo()
    return types.SimpleNamespace(module=module, logger=logger, batches=recorder.batches, val=val_metrics,
                                 val_report=val_report, val_reports=recorder.val_reports, test=test_res, dm=dm,
                                 warned=[str(w.message) for w in caught])


def test_class_report_after_validation_covers_the_whole_split_once_and_matches_the_logged_acc_and_f1(fitted):
    rep = fitted.val_report
    assert rep["labels"] == LABELS
    n_val = len(fitted.dm.val_dataloader().dataset)
    # each validation's report counts that epoch's examples once: not the sanity check's batch (before
    # epoch 1), nor the epoch before
    assert len(fitted.val_reports) == 2 and fitted.val_reports[-1] is rep
    assert [sum(map(sum, r["confusion"])) for r in fitted.val_reports] == [n_val, n_val]
    assert rep["support"] == [sum(row) for row in rep["confusion"]]
    assert rep["accuracy"] == pytest.approx(fitted.val["val/acc"], abs=1e-6)
    assert rep["macro"]["f1"] == pytest.approx(fitted.val["val/f1"], abs=1e-6)
    for i, name in enumerate(LABELS):  # two classes (<= 20): the per-class f1 is logged too
        assert fitted.val[f"val/f1_{name}"] == pytest.approx(rep["f1"][i], abs=1e-6)


def test_class_report_after_test_matches_the_test_results(fitted):
    rep = fitted.module.class_reports["test"]
    assert sum(rep["support"]) == len(fitted.dm.test_dataloader().dataset)
    assert rep["accuracy"] == pytest.approx(fitted.test["test/acc"], abs=1e-6)
    assert rep["macro"]["f1"] == pytest.approx(fitted.test["test/f1"], abs=1e-6)
    assert [fitted.test[f"test/f1_{n}"] for n in LABELS] == pytest.approx(rep["f1"], abs=1e-6)


def test_train_acc_is_each_batchs_accuracy_and_train_acc_epoch_the_epochs(fitted):
    b = fitted.batches
    assert len(b) == 8
    per_step = fitted.logger.values("train/acc")
    assert per_step == pytest.approx([x["correct"] / x["samples"] for x in b], abs=1e-6)
    epochs = fitted.logger.values("train/acc_epoch")
    expected = [sum(x["correct"] for x in e) / sum(x["samples"] for x in e) for e in (b[:4], b[4:])]
    assert epochs == pytest.approx(expected, abs=1e-6)


class _StopAt(L.Callback):
    """Asks the run to stop after batch `at` (as Lightning's Timer does with max_time): the loggers write that step."""

    def __init__(self, at: int):
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == self.at:
            trainer.should_stop = True


def test_per_step_values_are_written_every_log_interval_and_at_a_stop_each_from_its_own_step(tmp_path, toy_data_dir):
    """log_every_n_steps=3 over 5 batches, a callback after the others stopping the run at batch 5 (index 4): the
    loggers write steps 3 and 5 (indices 2 and 4), and each written train/acc, train/pad_frac and perf/rss_mb is
    that batch's, not one left from an earlier step (the module logs them only on those steps, after every
    callback has run)."""
    cfg = compose_train(["dropout=0.0"], tmp_path / "out", toy_data_dir, tmp_path / "cache")
    dm, _ = build(cfg)
    module = Classifier(model=OmegaConf.to_container(cfg.model, resolve=True), vocab_size=dm.vocab_size,
                        num_classes=dm.num_classes, pad_id=dm.pad_id, lr=0.0)
    logger, recorder = _Capture(), _Recorder()
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=8, limit_val_batches=0,
                        log_every_n_steps=3, logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[recorder, MemoryMonitor(), _StopAt(4)])
    trainer.fit(module, datamodule=dm)
    b = recorder.batches
    assert len(b) == 5
    acc = [(step, m["train/acc"]) for step, m in logger.rows if "train/acc" in m]
    assert acc == [(2, pytest.approx(b[2]["correct"] / b[2]["samples"], abs=1e-6)),
                   (4, pytest.approx(b[4]["correct"] / b[4]["samples"], abs=1e-6))]
    pads = [(step, m["train/pad_frac"]) for step, m in logger.rows if "train/pad_frac" in m]
    assert pads == [(i, pytest.approx(1 - b[i]["num_tokens"] / b[i]["padded"])) for i in (2, 4)]
    # MemoryMonitor runs before the stop was asked for: the stopped step has no memory row, not an older one
    assert [step for step, m in logger.rows if "perf/rss_mb" in m] == [2]
    assert all(m["perf/rss_mb"] > 0 for _, m in logger.rows if "perf/rss_mb" in m)
    epoch = logger.values("train/acc_epoch")  # the epoch's five batches
    assert epoch == pytest.approx([sum(x["correct"] for x in b) / sum(x["samples"] for x in b)], abs=1e-6)


def test_collated_num_tokens_is_a_python_int_equal_to_the_sum_of_lengths(fitted):
    assert all(type(x["num_tokens"]) is int and x["num_tokens"] == x["lengths_sum"] for x in fitted.batches)
    batch = Collate(pad_id=0)([(torch.tensor([5, 6, 7]), 1), (torch.tensor([8]), 0)])
    assert type(batch["num_tokens"]) is int and batch["num_tokens"] == 4 == batch_tokens(batch)
    del batch["num_tokens"]  # another collate's batch: counted from the padding mask
    assert batch_tokens(batch) == 4


def test_throughput_logs_real_tokens_samples_and_flops_per_second_of_each_window(fitted):
    """Fake clock, 1 s per training batch, window of 2 batches: each rate is the latest batch's count, the
    totals the running sums. The first batch of epoch 2 comes after a validation (the clock read 2 more
    times there): its interval is 1 s too only because the validation's time is taken out."""
    b = fitted.batches
    rows = [m for _, m in fitted.logger.rows if "train/lengths" in m]
    assert len(rows) == 8  # one per training batch (log_every_n_steps=1), none for validation or test
    assert [r["train/lengths"] for r in rows] == np.cumsum([x["num_tokens"] for x in b]).tolist()
    assert [r["train/samples"] for r in rows] == np.cumsum([x["samples"] for x in b]).tolist()
    rated = rows[1:]  # the window is full from the second batch on
    assert [r["train/device/items_per_sec"] for r in rated] == pytest.approx([x["num_tokens"] for x in b[1:]])
    assert [r["train/device/samples_per_sec"] for r in rated] == pytest.approx([x["samples"] for x in b[1:]])
    assert [r["train/device/flops_per_sec"] for r in rated] == pytest.approx([x["flops"] for x in b[1:]])
    assert "train/device/items_per_sec" not in rows[0]
    logged = {k for _, m in fitted.logger.rows for k in m}
    assert not any("mfu" in k or k.startswith(("validate/", "test/device", "train/tokens_per_s")) for k in logged)
    assert not [w for w in fitted.warned if "flops" in w.lower()]  # CPU: no peak, no MFU, and no warning about it


class _Losses(L.Callback):
    """Per training batch and per validation batch: the loss by the definition, from the logits (lr = 0,
    dropout = 0: the logits the step saw). Smoothed (Szegedy et al. 2016): the target is 1 - eps on the
    label plus eps / K on every class, so loss = (1 - eps) * NLL(label) + eps * mean over classes of -log p."""

    def __init__(self, eps: float):
        self.eps, self.train, self.train_plain, self.val = eps, [], [], []

    @staticmethod
    def _parts(pl_module, batch):
        with torch.no_grad():
            logp = pl_module(batch["input_ids"], batch["padding_mask"]).double().log_softmax(-1)
        return -logp.gather(1, batch["labels"][:, None]).squeeze(1), -logp.mean(-1)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        nll, uniform = self._parts(pl_module, batch)
        self.train.append(float(((1 - self.eps) * nll + self.eps * uniform).mean()))
        self.train_plain.append(float(nll.mean()))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self.val.append((float(self._parts(pl_module, batch)[0].sum()), len(batch["labels"])))


def test_label_smoothing_changes_the_training_loss_by_its_definition_and_leaves_val_loss_plain(tmp_path, toy_data_dir):
    cfg = compose_train(["dropout=0.0"], tmp_path / "out", toy_data_dir, tmp_path / "cache")
    dm, _ = build(cfg)
    module = Classifier(model=OmegaConf.to_container(cfg.model, resolve=True), vocab_size=dm.vocab_size,
                        num_classes=dm.num_classes, pad_id=dm.pad_id, lr=0.0, label_smoothing=0.3)
    logger, losses = _Capture(), _Losses(eps=0.3)
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=3, num_sanity_val_steps=0,
                        log_every_n_steps=1, logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[losses])
    trainer.fit(module, datamodule=dm)
    logged = logger.values("train/loss")
    assert len(logged) == 3
    np.testing.assert_allclose(logged, losses.train, rtol=1e-5)
    # and not the plain cross-entropy, which the same rule would miss if the logits were exactly uniform
    assert min(abs(a - b) for a, b in zip(losses.train, losses.train_plain)) > 1e-4
    val = sum(s for s, _ in losses.val) / sum(n for _, n in losses.val)  # the plain NLL, example-weighted
    np.testing.assert_allclose(logger.values("val/loss")[-1], val, rtol=1e-5)
