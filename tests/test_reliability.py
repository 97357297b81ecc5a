"""Numerical faults, failed sweep members, re-runs that lose nothing (wandb: tests/test_loggers.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import lightning as L
import pandas as pd
import pytest
import torch
from conftest import REPO, compose_train

from mhalab.model import SequenceClassifier
from mhalab.train.module import NonFiniteLossError
from mhalab.train.run import run


class PoisonWeights(L.Callback):
    """Turn one weight into NaN before global step `at_step`: the next loss is NaN."""

    def __init__(self, at_step: int):
        self.at_step = at_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at_step:
            with torch.no_grad():
                pl_module.model.head.weight[0, 0] = float("nan")


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, toy_data_dir):
    out = tmp_path / "out"
    # 13 steps per epoch: epoch 0 ends with a good last.ckpt, the weights turn NaN at step 20
    cfg = compose_train(["max_epochs=3", "+callbacks.poison._target_=test_reliability.PoisonWeights",
                         "+callbacks.poison.at_step=20"], out, toy_data_dir, tmp_path / "cache")
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at global step 20 .* Try a lower lr .*bf16-mixed"):
        run(cfg)
    rec = json.loads((out / "metrics.json").read_text())
    assert rec["status"] == "failed" and "global step 20" in rec["error"]
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 13  # saved at the end of epoch 0, not overwritten by the NaN
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("attention", ["full", "window"])
def test_autocast_with_fully_padded_sequences_gives_finite_logits_and_grads(dtype, attention):
    torch.manual_seed(0)
    m = SequenceClassifier(50, 3, dim=32, heads=4, layers=2, ff_dim=64, max_len=16, attention=attention,
                           attention_options={"window": 4} if attention == "window" else None)
    ids = torch.randint(1, 50, (3, 10))
    pad = torch.zeros(3, 10, dtype=torch.bool)
    pad[1, 4:] = True
    pad[2] = True  # every key of this sequence is padding: a fully masked row in every layer
    with torch.autocast("cpu", dtype=dtype):
        logits = m(ids, pad)
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    logits.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def _sweep(server, tmp_path, data, *overrides) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "train.py"), "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}",
           f"paths.data_dir={data}", f"paths.cache_dir={tmp_path / 'cache'}", "trainer=cpu",
           "trainer.enable_progress_bar=false", "heads=4", "layers=1", "batch_size=32", "max_len=32",
           "max_epochs=1", "data.vocab_size=200", "data.min_frequency=1", *overrides]
    return server.run(cmd, env=dict(os.environ, PYTHONHASHSEED="0"), timeout=900)


@pytest.mark.parametrize("shared, expected", [
    (["data=trec"], "heads=2,seed=0,data=trec"),  # Hydra's own name, sorted, would be data=trec,heads=2,seed=0
    ([f"++trainer.limit_{s}_batches=20" for s in ("train", "val", "test")] + ["dropout=0.25", "lr=0.002"],
     "heads=2,seed=0,~"),  # too long: the shared part goes into a hash
], ids=["short", "long"])
def test_a_member_dir_name_starts_with_the_swept_values(tmp_path, shared, expected):
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from mhalab.train.config import CONF_DIR, MEMBER_DIR_MAX, _member_dir

    sweep = tmp_path / "sweep"
    sweep.mkdir()  # what Hydra writes before the first member starts: the command line's overrides
    (sweep / "multirun.yaml").write_text(json.dumps({"hydra": {"overrides": {"task": ["heads=1,2", "seed=0,1",
                                                                                    *shared]}}}))
    member = ["heads=2", "seed=0", *shared]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*member, f"hydra.sweep.dir={sweep}"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        name = _member_dir(",".join(sorted(member)))  # Hydra's override_dirname
    finally:
        HydraConfig.instance().cfg = None  # as outside a Hydra job, for the tests after this one
    assert name.startswith(expected) and len(name) <= MEMBER_DIR_MAX, name
    assert len(name) == len(expected) + (8 if expected.endswith("~") else 0)


def test_sweep_with_an_invalid_member_finishes_the_rest_reports_and_reruns_skip_finished(tmp_path, toy_data_dir,
                                                                                           fork_server):
    # the limits make every member's overrides longer than a dir name may be: the names keep the swept value whole,
    # first, and stand for the overrides all members share by one hash
    limits = ["++trainer.limit_train_batches=3", "++trainer.limit_val_batches=2", "++trainer.limit_test_batches=2"]
    proc = _sweep(fork_server, tmp_path, toy_data_dir, "dim=32,30", *limits)  # 30 is not divisible by 4 heads
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = tmp_path / "sweep"
    (good,), (bad,) = sweep.glob("dim=32,~*"), sweep.glob("dim=30,~*")
    assert good.name.split(",~")[1] == bad.name.split(",~")[1] and len(good.name) == len("dim=32,~") + 8
    assert json.loads((good / "metrics.json").read_text())["status"] == "finished"
    failed = json.loads((bad / "metrics.json").read_text())
    assert failed["status"] == "failed" and "heads=4 does not divide dim=30" in failed["error"]
    table = pd.read_csv(sweep / "results.csv")
    assert len(table) == 2 and sorted(table["status"]) == ["failed", "finished"]
    assert sorted(table["setting"]) == ["dim=30", "dim=32"]  # the shared overrides are said once, not per label
    report = (sweep / "report.md").read_text()
    assert "heads=4 does not divide dim=30" in report and "Every member: `" in report
    assert "++trainer.limit_train_batches=3" in report.split("Every member: `")[1].split("`")[0]
    # Lightning's lines: once each on the console (not also through its own handler), and in the run's cli.log
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "GPU available: " in line]
    assert len(said) == 1 and said[0].startswith("[") and "GPU available: " in (good / "cli.log").read_text(), said

    finished_before = (good / "metrics.json").read_text()
    ckpts_before = sorted(p.name for p in (good / "checkpoints").iterdir())
    proc = _sweep(fork_server, tmp_path, toy_data_dir, "dim=32,30", *limits)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "already finished; skipping" in proc.stdout + proc.stderr
    assert (good / "metrics.json").read_text() == finished_before  # untouched, not re-trained
    assert sorted(p.name for p in (good / "checkpoints").iterdir()) == ckpts_before

