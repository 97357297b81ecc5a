"""One training run: validate the config, build data and model, fit, test the best checkpoint, write results.

Every run writes into its own Hydra output dir:
  metrics.json      status, final and best metrics, params, wall time, throughput, the resolved config
  logs/metrics.csv  Lightning's CSV log (train/loss per step, val/* per epoch, lr)
  loss_curves.png   train and val loss and val acc, drawn from metrics.csv
  checkpoints/      best (by val/acc) and last
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf, open_dict

from mhalab.callbacks import ResumeState, SaveOnInterrupt
from mhalab.config import resolve_ckpt_path, validate
from mhalab.lra import peak_memory_mb, reset_peak_memory
from mhalab.module import Classifier

log = logging.getLogger("mhalab")
# Lightning warns on every mid-epoch resume that the dataloader is "not resumable": ours is restored by
# the datamodule's state_dict (the sampler skips the batches already trained on; tests/test_data.py)
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # tokenizers' threads + DataLoader workers: warnings


def _is_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")  # write then rename: a crash never leaves half a file
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


def _overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def run(cfg: DictConfig) -> float:
    """Train and test one configuration. Returns the best val/acc (what sweepers optimise)."""
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.json"
    if metrics_path.exists():
        previous = json.loads(metrics_path.read_text())
        if previous.get("status") == "finished":
            # a sweep re-run into the same dir: this member is done; never overwrite it
            log.info("%s already finished; skipping (delete it to re-run)", out)
            return float(previous.get("best", {}).get("val/acc", float("nan")))
        last = out / "checkpoints" / "last.ckpt"
        if previous.get("status") in ("interrupted", "running") and last.exists() and not cfg.get("ckpt_path"):
            # stopped (pre-empted, killed) in an earlier attempt: continue it rather than start over
            log.info("%s was %s; resuming from %s", out, previous["status"], last)
            with open_dict(cfg):
                cfg.ckpt_path = str(last)
    record = {
        "status": "running", "error": None, "overrides": _overrides(), "seed": int(cfg.seed),
        "config": OmegaConf.to_container(cfg, resolve=True), "output_dir": str(out),
    }
    _write_json(metrics_path, record)
    t0 = time.time()
    try:
        trainer, _ = _fit_and_test(cfg, out, record)
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the record must not say "running"
        interrupted = isinstance(e, (KeyboardInterrupt, SystemExit))
        reason = (f"interrupted ({type(e).__name__}); resume with ckpt_path={out}" if interrupted
                  else f"{type(e).__name__}: {e}".splitlines()[0])
        record.update(status="interrupted" if interrupted else "failed", error=reason,
                      wall_time_s=time.time() - t0)
        _write_json(metrics_path, record)
        if _is_multirun() and not interrupted:  # one failed member must not end the sweep
            log.error("run failed: %s", record["error"])
            return float("nan")
        if isinstance(e, SIGTERMException):
            raise SystemExit(143) from e  # 128 + SIGTERM, as if the signal had killed us (schedulers requeue)
        raise
    if trainer.is_global_zero:
        record.update(status="finished", wall_time_s=time.time() - t0)
        _write_json(metrics_path, record)
        from mhalab.plots import loss_curves

        if (out / "logs" / "metrics.csv").exists():
            loss_curves(out / "logs" / "metrics.csv", out / "loss_curves.png")
    return float(record.get("best", {}).get("val/acc", float("nan")))


def build(cfg: DictConfig) -> tuple[L.LightningDataModule, Classifier]:
    """Validate the config, then make the datamodule (data read, tokenizer ready) and the model."""
    validate(cfg)  # cheap checks before any data is read
    if cfg.get("num_threads"):
        torch.set_num_threads(int(cfg.num_threads))
    L.seed_everything(int(cfg.seed), workers=True)
    dm = instantiate(cfg.data)
    dm.prepare_data()
    dm.setup("fit")
    module = Classifier(
        model=OmegaConf.to_container(cfg.model, resolve=True), vocab_size=dm.vocab_size,
        num_classes=dm.num_classes, pad_id=dm.pad_id, compile=bool(cfg.compile),
        **OmegaConf.to_container(cfg.optim, resolve=True),
    )
    # the datamodule's state_dict (tokenizer, label names, sampler position) is saved by Lightning
    # under its class name; record where, with the data config, so a checkpoint is self-contained
    module.extra_checkpoint = {
        "datamodule_key": type(dm).__qualname__, "data": OmegaConf.to_container(cfg.data, resolve=True),
    }
    return dm, module


def _fit_and_test(cfg: DictConfig, out: Path, record: dict) -> tuple[L.Trainer, Classifier]:
    ckpt_path = str(resolve_ckpt_path(str(cfg.ckpt_path))) if cfg.get("ckpt_path") else None
    dm, module = build(cfg)
    params = sum(p.numel() for p in module.parameters())

    loggers = _loggers(cfg, ckpt_path)
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    if not cfg.trainer.get("enable_progress_bar", True):  # Lightning refuses a bar callback then
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    # always on: an interrupted run saves last.ckpt, and a resumed run continues exactly
    callbacks += [SaveOnInterrupt(out / "checkpoints"), ResumeState()]
    trainer = L.Trainer(**OmegaConf.to_container(cfg.trainer, resolve=True), logger=loggers,
                        callbacks=callbacks, default_root_dir=str(out))
    for lg in loggers:
        if hasattr(lg, "experiment") and type(lg).__name__ == "WandbLogger" and trainer.is_global_zero:
            module.extra_checkpoint["wandb_id"] = record["wandb_id"] = lg.experiment.id

    reset_peak_memory(trainer.strategy.root_device)
    t_fit = time.time()
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    fit_s = time.time() - t_fit
    peak_mb, peak_kind = peak_memory_mb(trainer.strategy.root_device)
    if trainer.interrupted:
        raise KeyboardInterrupt(f"run interrupted at global step {trainer.global_step}; "
                                f"resume with ckpt_path={out}")

    final = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    ckpt_cb = trainer.checkpoint_callback
    best = {"val/acc": float(ckpt_cb.best_model_score) if ckpt_cb and ckpt_cb.best_model_score is not None
            else final.get("val/acc", float("nan"))}
    if cfg.get("test_after_fit", True) and not trainer.fast_dev_run:
        best_path = ckpt_cb.best_model_path if ckpt_cb and ckpt_cb.best_model_path else None
        # the best checkpoint by val/acc, evaluated once on val (for its val/loss) and once on test
        val_res = trainer.validate(module, datamodule=dm, ckpt_path=best_path, verbose=False)[0]
        best.update({k: float(v) for k, v in val_res.items()})
        test_res = trainer.test(module, datamodule=dm, ckpt_path=best_path, verbose=False)[0]
        final.update({k: float(v) for k, v in test_res.items()})
        best["checkpoint"] = best_path
    real, pads = (int(x) for x in module.token_counts.cpu() * trainer.world_size)
    record.update(
        params=params, epochs=trainer.current_epoch, global_step=trainer.global_step, best=best, final=final,
        fit_time_s=fit_s, train_tokens=real, peak_mem_mb=peak_mb, peak_mem_kind=peak_kind,
        tokens_per_s=real / fit_s if fit_s > 0 else math.nan,  # real (non-pad) tokens per second of fit()
        padding_fraction=pads / max(1, real + pads),
        device=str(trainer.strategy.root_device),
        device_name=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    )
    return trainer, module


def _loggers(cfg: DictConfig, ckpt_path: str | None) -> list:
    lcfg = OmegaConf.to_container(cfg.get("logger") or {}, resolve=True)
    if "wandb" in lcfg:
        from mhalab.loggers import prepare_wandb

        lcfg["wandb"] = prepare_wandb(lcfg["wandb"], ckpt_path, _is_multirun())
    return [instantiate(c) for c in lcfg.values() if c is not None]

