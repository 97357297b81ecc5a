"""Configs compose, runs train and write their results, resume, and refuse bad configs early."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import CONF, REPO, SHARED_DATA, compose_train
from hydra.utils import instantiate

from mhalab.errors import DataError, UserError
from mhalab.nn.attention import MultiHeadAttention
from mhalab.train.config import validate
from mhalab.train.run import build, run


def test_launcher_and_sweeper_plugins_compose(tmp_path):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for ov, key, want in [
            (["hydra/launcher=joblib"], "_target_", "hydra_plugins.hydra_joblib_launcher"),
            (["hydra/launcher=slurm"], "_target_", "hydra_plugins.hydra_submitit_launcher"),
        ]:
            cfg = compose("train", overrides=ov, return_hydra_config=True)
            assert cfg.hydra.launcher[key].startswith(want)
        cfg = compose("train", overrides=["hparams_search=optuna"], return_hydra_config=True)
        assert "optuna" in cfg.hydra.sweeper._target_
        assert set(cfg.hydra.sweeper.params) == {"heads", "dim", "dropout", "lr"}


def test_heads_16_reaches_every_attention_module(tmp_path, toy_data_dir):
    cfg = compose_train(["model=custom", "heads=16", "dim=64"], tmp_path, toy_data_dir, tmp_path / "cache")
    _, module = build(cfg)
    mhas = [m for m in module.modules() if isinstance(m, MultiHeadAttention)]
    assert len(mhas) == cfg.layers and all(m.num_heads == 16 and m.head_dim == 4 for m in mhas)


def test_official_model_builds_pytorch_encoder(tmp_path, toy_data_dir):
    cfg = compose_train(["model=official", "heads=8"], tmp_path, toy_data_dir, tmp_path / "cache")
    _, module = build(cfg)
    layers = module.model.encoder.encoder.layers
    assert isinstance(layers[0], torch.nn.TransformerEncoderLayer) and layers[0].self_attn.num_heads == 8


def test_ff_dim_defaults_to_four_times_dim(tmp_path):
    cfg = compose_train(["dim=48", "heads=4"], tmp_path)
    assert cfg.model.ff_dim == 192 and compose_train(["ff_ratio=2", "dim=48"], tmp_path).model.ff_dim == 96


@pytest.mark.parametrize("overrides,match", [
    (["dim=100", "heads=16"], r"heads=16 does not divide dim=100"),
    (["max_len=0"], r"max_len=0 is too small: it must be >= 3"),
    (["batch_size=0"], r"batch_size=0 must be >= 1"),
    (["model.attention=sparse"], r"unknown model.attention 'sparse'; choose one of full, window"),
    (["model.pos=relative"], r"unknown model.pos 'relative'; choose one of sinusoidal"),
    (["model=official", "model.pos=rope"], r"model=official supports attention=full"),
    (["lr=0"], r"lr=0(\.0)? must be > 0"),
    (["dropout=1.0"], r"dropout=1.0 must be in \[0, 1\)"),
    (["model.embed_dropout=-0.1"], r"model.embed_dropout=-0.1 must be in \[0, 1\)"),
    (["ckpt_path=/nonexistent/last.ckpt"], r"ckpt_path=/nonexistent/last.ckpt does not exist"),
])
def test_bad_config_fails_before_data_is_read(overrides, match, tmp_path):
    # the data dir does not exist: a config error must come first
    cfg = compose_train(overrides, tmp_path, tmp_path / "no-data-here")
    with pytest.raises(UserError, match=match):
        build(cfg)


def test_missing_data_dir_says_where_it_looked(tmp_path):
    cfg = compose_train([], tmp_path, tmp_path / "no-data-here")
    with pytest.raises(DataError, match="no-data-here"):
        build(cfg)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, toy_data_dir):
    """One short real run on the toy data (2 epochs), shared by the tests that read its outputs."""
    tmp = tmp_path_factory.mktemp("run")
    cfg = compose_train(["max_epochs=2", "seed=3"], tmp / "out", toy_data_dir, tmp / "cache")
    run(cfg)
    return tmp / "out", cfg


def test_run_writes_metrics_curves_and_checkpoints(trained_run):
    out, _ = trained_run
    rec = json.loads((out / "metrics.json").read_text())
    assert rec["status"] == "finished" and rec["epochs"] == 2 and rec["params"] > 0
    assert 0.5 < rec["best"]["val/acc"] <= 1.0 and 0.5 < rec["best"]["test/acc"] <= 1.0
    # the last epoch's val/* apart from the best checkpoint's: no `final` mixing the two any more
    assert "final" not in rec and "val/acc" in rec["last_epoch"]
    assert all(k.startswith("val/") for k in rec["last_epoch"])
    assert rec["tokens_per_s"] > 0 and 0.0 <= rec["padding_fraction"] < 0.5
    assert rec["config"]["model"]["heads"] == 4  # the resolved config is recorded
    log = pd.read_csv(out / "logs" / "metrics.csv")
    assert log["train/loss"].notna().sum() >= 2
    # one validation per epoch of fit, at its last step: the best checkpoint's re-validation is not logged
    val = log.dropna(subset=["val/acc"])
    assert val["epoch"].tolist() == [0, 1] and val["step"].is_monotonic_increasing, val
    assert rec["best"]["epoch"] in (0, 1) and rec["best"]["step"] == val["step"].iloc[rec["best"]["epoch"]] + 1
    png = (out / "loss_curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert (out / "checkpoints" / "last.ckpt").exists()
    ckpt = torch.load(rec["best"]["checkpoint"], map_location="cpu", weights_only=False)
    assert ckpt[ckpt["mhalab"]["datamodule_key"]]["tokenizer"].startswith("{") and ckpt["hyper_parameters"]["model"]["heads"] == 4


def test_finished_run_is_not_overwritten(trained_run):
    out, cfg = trained_run
    before = (out / "metrics.json").read_text()
    assert run(cfg) == json.loads(before)["best"]["val/acc"]
    assert (out / "metrics.json").read_text() == before


def test_resume_continues_the_global_step(trained_run, tmp_path):
    out, cfg = trained_run
    cfg = cfg.copy()
    cfg.paths.output_dir = str(tmp_path / "resumed")
    cfg.max_epochs = 3
    cfg.trainer.max_epochs = 3
    cfg.ckpt_path = str(out)  # a run dir: its checkpoints/last.ckpt
    first = json.loads((out / "metrics.json").read_text())
    run(cfg)
    rec = json.loads((tmp_path / "resumed" / "metrics.json").read_text())
    steps_per_epoch = first["global_step"] // 2
    assert rec["global_step"] == first["global_step"] + steps_per_epoch


def test_resume_with_another_model_shape_is_refused(trained_run, tmp_path):
    out, cfg = trained_run
    cfg = cfg.copy()
    cfg.model.heads = 2
    cfg.ckpt_path = str(out)
    with pytest.raises(UserError, match=r"holds a model with heads=4, but the config has heads=2"):
        validate(cfg)


def test_debug_overfit_drives_the_loss_down(tmp_path, toy_data_dir):
    cfg = compose_train(["debug=overfit", "max_epochs=25", "trainer.check_val_every_n_epoch=25"],
                        tmp_path / "out", toy_data_dir, tmp_path / "cache")
    run(cfg)
    loss = pd.read_csv(tmp_path / "out" / "logs" / "metrics.csv")["train/loss"].dropna().to_numpy()
    assert loss[-3:].mean() < 0.2 * loss[:3].mean(), loss


def test_same_seed_same_numbers_other_seed_different(tmp_path, toy_data_dir):
    results = []
    for i, seed in enumerate([5, 5, 6]):
        cfg = compose_train([f"seed={seed}", "max_epochs=1", "test_after_fit=false"], tmp_path / f"o{i}",
                            toy_data_dir, tmp_path / "cache")
        run(cfg)
        rec = json.loads((tmp_path / f"o{i}" / "metrics.json").read_text())
        results.append((rec["last_epoch"]["val/loss"], rec["last_epoch"]["val/acc"]))
    assert results[0] == results[1]
    assert results[0][0] != results[2][0]


def _train_cmd(tmp: Path, data: Path, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={tmp}", f"paths.data_dir={data}",
            f"paths.cache_dir={tmp.parent / 'cache'}", "trainer=cpu", "trainer.enable_progress_bar=false",
            "callbacks.progress_bar=null", "dim=32", "heads=4", "layers=1", "batch_size=16", "max_len=32",
            "data.vocab_size=200", "data.min_frequency=1", *extra]


def test_ddp_cpu_runs_two_processes_that_fine_tune_one_pretrained_encoder(tmp_path, toy_data_dir, fork_server):
    out = tmp_path / "ddp"
    proc = fork_server.run(_train_cmd(out, toy_data_dir, "trainer=ddp_cpu", "max_epochs=1", "test_after_fit=false",
                                      "pretrain=mlm", "pretrain.epochs=2"),
                           env=dict(os.environ, PYTHONHASHSEED="0"), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stderr + proc.stdout
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in log
    rec = json.loads((out / "metrics.json").read_text())
    # 400 train rows = 25 batches of 16, dealt to 2 ranks: 12 steps each (the odd batch, a different
    # one each epoch, is left out so both ranks step together); one process alone would take 25
    assert rec["status"] == "finished" and rec["global_step"] == 12
    # rank 0 pretrained once, on one device (2 epochs of 25 batches), before the ranks started; rank 1 read it
    assert rec["pretrain"]["cached"] is False and rec["pretrain"]["global_step"] == 50
    assert log.count("starting masked-LM pretraining") == 1 and log.count("pretrained encoder from the cache") == 1


def test_eval_script_reproduces_the_runs_test_metrics_from_the_checkpoint_alone(trained_run):
    out, _ = trained_run
    rec = json.loads((out / "metrics.json").read_text())
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from eval import evaluate
    finally:
        sys.path.pop(0)
    res = evaluate(rec["best"]["checkpoint"], "test")
    assert res["examples"] == 64
    assert abs(res["test/acc"] - rec["best"]["test/acc"]) < 1e-6
    assert abs(res["test/loss"] - rec["best"]["test/loss"]) < 1e-5
    val = evaluate(rec["best"]["checkpoint"], "validation")
    assert abs(val["validation/acc"] - rec["best"]["val/acc"]) < 1e-6


@pytest.mark.parametrize("data, splits_from_files, dev_split", [
    ("sst2", {"train", "validation", "test"}, None),
    ("sst5", {"train", "validation", "test"}, None),
    ("trec", {"train", "test"}, 0.1),
    ("imdb", {"train", "test"}, 0.1),
    ("imdb_bytes", {"train", "test"}, 0.1),
])
def test_real_data_configs_validate_against_shared_data(data, splits_from_files, dev_split, tmp_path):
    # `python train.py data=<name>` as typed, on ../shared/data: the composed config must point at files
    # that exist with the configured columns. trec/imdb extend sst2.yaml, whose dev file must not leak
    # into them (they hold a dev split out of train instead).
    cfg = compose_train([f"data={data}"], tmp_path, SHARED_DATA, small_vocab=False)
    dm = instantiate(cfg.data)
    assert set(dm.files) == splits_from_files and dm.dev_split == dev_split
    assert all(f.startswith(f"{data.split('_')[0]}/") for f in dm.files.values()), dm.files
    dm.validate()  # files exist, columns present (reads headers only)


def test_train_tokens_count_every_epoch_when_the_best_checkpoint_is_an_earlier_one(tmp_path, toy_data_dir):
    # "best" = the lowest epoch: testing it loads the epoch-0 checkpoint, whose own token counts must not
    # replace the run's (they did: 2 epochs reported as 1)
    cfg = compose_train(["max_epochs=2", "seed=3", "callbacks.model_checkpoint.monitor=epoch",
                         "callbacks.model_checkpoint.mode=min"], tmp_path / "out", toy_data_dir, tmp_path / "cache")
    run(cfg)
    rec = json.loads((tmp_path / "out" / "metrics.json").read_text())
    dm = instantiate(cfg.data)
    dm.prepare_data()
    dm.setup("fit")
    per_epoch = int(sum(dm.splits["train"].lengths))
    assert rec["best"]["checkpoint"].split("/")[-1].startswith("epoch00")  # the earlier checkpoint was tested
    assert rec["train_tokens"] == 2 * per_epoch


def test_an_epoch_shorter_than_the_logging_interval_still_logs_its_training_loss(tmp_path, toy_data_dir):
    # 3 batches an epoch against an interval of 50: callbacks.LogEveryEpoch lowers it to 3, one point an epoch
    # (Lightning alone logs none, and the run's loss curve has no training line)
    cfg = compose_train(["max_epochs=2", "++trainer.limit_train_batches=3", "trainer.log_every_n_steps=50",
                         "test_after_fit=false"], tmp_path / "out", toy_data_dir, tmp_path / "cache")
    run(cfg)
    log = pd.read_csv(tmp_path / "out" / "logs" / "metrics.csv")
    train = log.dropna(subset=["train/loss"])
    assert train["step"].tolist() == [2, 5], log


@pytest.mark.parametrize("user", [None, "false"])
def test_data_is_encoded_on_every_core_then_tokenizers_go_single_threaded_before_workers_fork(
        tmp_path, toy_data_dir, monkeypatch, user):
    """tokenizers reads TOKENIZERS_PARALLELISM at each call: unset while the tokenizer is trained and the splits
    encoded (IMDB's cold preparation 37 -> 19 s on 2 cores), "false" once build() returns (a DataLoader worker
    forked after its threads ran would warn and turn them off); a user's own setting is kept throughout."""
    from mhalab.data import datamodule, tokenizer

    seen = []
    real = tokenizer.encode_texts

    def spy(*args, **kwargs):
        seen.append(os.environ.get("TOKENIZERS_PARALLELISM"))
        return real(*args, **kwargs)

    monkeypatch.setattr(datamodule, "encode_texts", spy)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", user or "unset below")  # restored after the test, either way
    if user is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM")
    build(compose_train([], tmp_path, toy_data_dir, tmp_path / "cache"))
    assert seen and set(seen) == {user}
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
