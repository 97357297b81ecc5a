"""The experiment record: every logger (csv, wandb offline, tensorboard) and metrics.json hold the whole
resolved config, the overrides and the provenance (git commit, dirty flag, versions, device); the config
tree is printed and saved; the wandb extras (a predictions table, attention maps) reach the offline run."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, compose_train
from hydra import compose, initialize_config_dir

from mhalab.train import loggers
from mhalab.train.config import CONF_DIR
from mhalab.train.record import provenance
from mhalab.train.run import run


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory, toy_data_dir):
    """One tiny run with all three loggers (wandb offline) and callbacks=wandb_extras."""
    tmp = tmp_path_factory.mktemp("record")
    mp = pytest.MonkeyPatch()
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_DIR", "WANDB_CONFIG_DIR"):
        mp.delenv(var, raising=False)
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("HOME", str(tmp))  # no netrc or wandb settings of the developer's
    out = tmp / "run"
    cfg = compose_train(["logger=[wandb,tensorboard]", "callbacks=wandb_extras", "max_epochs=1", "seed=3",
                         "tags=[record]"], out, toy_data_dir, tmp / "cache")
    run(cfg)
    mp.undo()
    return out


def test_metrics_json_holds_the_resolved_config_and_the_provenance(recorded_run):
    rec = json.loads((recorded_run / "metrics.json").read_text())
    assert rec["config"]["data"]["name"] == "sst2" and rec["config"]["model"]["dim"] == 32
    assert rec["config"]["seed"] == 3 and rec["config"]["trainer"]["accelerator"] == "cpu"
    assert rec["config"]["optim"]["lr"] == 1e-3 and rec["config"]["tags"] == ["record"]
    prov = rec["provenance"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True, capture_output=True,
                          text=True).stdout
    assert prov["git_commit"] == head.strip() and isinstance(prov["git_dirty"], bool)
    assert prov["versions"]["torch"] == metadata.version("torch")
    assert prov["versions"]["lightning"] == metadata.version("lightning")
    assert prov["versions"]["tokenizers"] == metadata.version("tokenizers")
    assert prov["device"] == "cpu" and prov["cpu_threads"] == torch.get_num_threads()


def test_csv_and_tensorboard_loggers_get_the_whole_config(recorded_run):
    for hparams in (recorded_run / "logs" / "hparams.yaml", recorded_run / "tensorboard" / "hparams.yaml"):
        saved = yaml.safe_load(hparams.read_text())
        assert saved["config"]["data"]["batch_size"] == 32, hparams
        assert saved["config"]["trainer"]["max_epochs"] == 1, hparams
        assert saved["provenance"]["versions"]["hydra-core"] == metadata.version("hydra-core"), hparams
        assert saved["model"]["heads"] == 4, hparams  # the module's own hparams, logged by Lightning, stay


def _wandb_summary(run_dir) -> dict:
    """What the offline wandb run recorded: `wandb leet inspect --summary --json` over its transaction log."""
    [run_path] = (run_dir / "wandb").glob("offline-run-*")
    wandb_cli = Path(sys.executable).with_name("wandb")  # the environment's own wandb command
    done = subprocess.run([str(wandb_cli), "leet", "inspect", "--summary", "--json", str(run_path)], check=True,
                          capture_output=True, text=True, timeout=120)
    return json.loads(done.stdout)


def test_wandb_offline_run_holds_the_config_provenance_predictions_and_attention_maps(recorded_run):
    summary = _wandb_summary(recorded_run)
    config = summary["config"]
    assert config["config"]["data"]["name"] == "sst2" and config["config"]["seed"] == 3
    assert config["provenance"]["git_commit"] == json.loads((recorded_run / "metrics.json").read_text())[
        "provenance"]["git_commit"]
    assert summary["tags"] == ["record"]
    metrics = summary["summary"]
    assert {"test/predictions", "attention_maps/example_0", "val/acc", "train/loss"} <= set(metrics)
    [table] = (recorded_run / "wandb").glob("offline-run-*/files/media/table/test/predictions*.table.json")
    rows = json.loads(table.read_text())
    assert rows["columns"] == ["text", "label", "predicted", "confidence", "correct"]
    assert len(rows["data"]) == 64  # the whole toy test split (max_predictions 1000)
    accuracy = sum(r[4] for r in rows["data"]) / len(rows["data"])
    test_acc = json.loads((recorded_run / "metrics.json").read_text())["best"]["test/acc"]
    assert accuracy == pytest.approx(test_acc, abs=1e-6)  # the table's predictions are the tested model's


def test_config_tree_is_saved_beside_the_run_with_every_group(recorded_run):
    text = (recorded_run / "config_tree.log").read_text()
    for group in ("data", "model", "optim", "trainer", "callbacks", "logger", "extras"):
        assert f"── {group}" in text, group
    assert "heads: 4" in text and "name: sst2" in text
    assert text.index("── data") < text.index("── model") < text.index("── trainer")  # the template's order


def test_wandb_group_is_left_to_the_sweep_not_an_interpolation_that_is_always_null():
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["logger=wandb"])
    assert cfg.logger.wandb.group is None  # prepare_wandb fills in the sweep dir's name in a multirun


def test_a_missing_logger_package_is_one_line_naming_the_extra(monkeypatch):
    real = loggers.importlib.util.find_spec
    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda m: None if m == "wandb" else real(m))
    with pytest.raises(loggers_error(), match=r"^logger=wandb needs the wandb package, which is not installed; "
                                              r"pip install 'mhalab\[wandb\]'"):
        loggers.check_installed({"csv": {"_target_": "mhalab.train.loggers.csv_logger.ContinuedCSVLogger"},
                                 "wandb": {"_target_": "lightning.pytorch.loggers.WandbLogger"}})
    loggers.check_installed({"csv": {"_target_": "mhalab.train.loggers.csv_logger.ContinuedCSVLogger"}})  # no error


def loggers_error():
    from mhalab.errors import ConfigError

    return ConfigError


def test_code_state_outside_a_git_checkout_is_unknown_not_wrong(tmp_path):
    assert provenance.code_state(tmp_path) == {"git_commit": None, "git_dirty": None}
    assert provenance.code_state(None) == {"git_commit": None, "git_dirty": None}


def test_early_stopping_stops_after_patience_validations_without_improvement(tmp_path, toy_data_dir):
    """min_delta=1.0: no epoch can improve val/acc by a whole point of accuracy, so with patience 1 the run
    stops after its second validation, whatever max_epochs says; the record says when and why."""
    out = tmp_path / "run"
    cfg = compose_train(["callbacks=early_stopping", "callbacks.early_stopping.patience=1",
                         "callbacks.early_stopping.min_delta=1.0", "max_epochs=6", "test_after_fit=false",
                         "extras.print_config=false"], out, toy_data_dir, tmp_path / "cache")
    run(cfg)
    rec = json.loads((out / "metrics.json").read_text())
    assert rec["status"] == "finished" and rec["epochs"] == 2  # not 6
    stop = rec["early_stopping"]
    assert (stop["stopped"], stop["stopped_epoch"], stop["patience"], stop["monitor"]) == (True, 1, 1, "val/acc")
    assert stop["best_score"] <= rec["best"]["val/acc"]  # epoch 0's val/acc; the checkpoint keeps the best of both
    assert not (out / "config_tree.log").exists()  # extras.print_config=false


def test_metrics_json_has_label_names_and_per_class_results_of_the_tested_checkpoint(recorded_run):
    from PIL import Image

    rec = json.loads((recorded_run / "metrics.json").read_text())
    assert rec["label_names"] == ["negative", "positive"]  # conf/data/sst2.yaml's names for labels 0 and 1
    test = rec["classes"]["test"]
    assert rec["classes"]["of"] == "best checkpoint" and test["labels"] == rec["label_names"]
    confusion = torch.tensor(test["confusion"])  # (2, 2), rows = true class
    assert int(confusion.sum()) == 64 and test["support"] == confusion.sum(1).tolist()
    assert float(confusion.diagonal().sum()) / 64 == pytest.approx(rec["best"]["test/acc"], abs=1e-6)
    assert test["f1"][1] == pytest.approx(rec["best"]["test/f1_positive"], abs=1e-6)
    for split in ("validation", "test"):
        with Image.open(recorded_run / f"confusion_{split}.png") as png:
            assert png.format == "PNG" and png.width > 200
