"""One training run: validate the config, build data and model, fit, test the best checkpoint, write results.

Every run writes into its own Hydra output dir, which one live process holds (mhalab.train.record.rundir):
  metrics.json      status, best (the best checkpoint: val/*, test/*) and last_epoch (val/*) metrics, params,
                    wall time, throughput, the resolved config and data source, the provenance (git commit,
                    versions, device), the label names and per-class results (`classes`), and one entry per
                    attempt when the run was interrupted and resumed (the schema: mhalab.train.record)
  logs/metrics.csv  Lightning's CSV log (train/loss, train/acc, train/device/* throughput per logging step;
                    val/* per epoch; lr), continued across attempts; logs/hparams.yaml: the config and provenance
  config_tree.log   the resolved config as printed at start (extras.print_config)
  loss_curves.png   train loss at each logged step and its EMA, val loss and acc at each validation (metrics.csv)
  confusion_{validation,test}.png  the best checkpoint's confusion matrices, by class name
  checkpoints/      best (by val/acc), and last.ckpt (every epoch, every N steps, and on Ctrl-C / SIGTERM)
Re-running a command into the dir of a run that was interrupted or killed resumes it from last.ckpt.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from pathlib import Path

import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf, open_dict

from mhalab.errors import RunDirError, UserError
from mhalab.nn.attention import check_heads
from mhalab.train import checkpoint, pretrain, record
from mhalab.train.callbacks import GracefulStop, LogEveryEpoch, ResumeState
from mhalab.train.callbacks.memory import peak_memory_mb, reset_peak_memory
from mhalab.train.common_random import start_dropout_stream
from mhalab.train.config import datamodule, instantiate, setup_process, validate
from mhalab.train.console import quiet, summary
from mhalab.train.loggers import finish
from mhalab.train.module import Classifier
from mhalab.train.record import experiment, extent, rundir
from mhalab.train.record.provenance import device, provenance
from mhalab.train.record.rundir import RunLock

log = logging.getLogger("mhalab")
RESUMABLE = ("interrupted", "dead")  # statuses whose run continues from last.ckpt when run again


def _is_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def launch_rank() -> int:
    """This process's rank before Lightning starts: Lightning's DDP launcher re-runs train.py for ranks
    1+ (LOCAL_RANK, NODE_RANK); torchrun and SLURM set RANK / SLURM_PROCID."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    if "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return int(os.environ["SLURM_PROCID"])
    return int(os.environ.get("NODE_RANK", "0")) + int(os.environ.get("LOCAL_RANK", "0"))


def rank_zero_attempt(out: Path, timeout_s: float = 600.0) -> dict | None:
    """For the other ranks: rank 0's attempt at this run (its `resumed_from` is the checkpoint every rank restores),
    or None when rank 0 found the run finished (and does nothing). The processes Lightning starts for a node's other
    devices start after rank 0 has written it; a cluster starts every node's command at once, so those wait for a
    live rank 0 (its lock held) that has written its attempt (a stale record would resume the wrong state)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            rec = record.read(out) or {}
        except ValueError:  # being written (atomically, but a shared file system may show it late)
            rec = {}
        if rec.get("status") == "finished":
            return None
        if rec.get("status") == "running" and rundir.is_live(out):
            return rec["attempts"][-1]
        if time.monotonic() > deadline:
            raise RunDirError(f"rank {launch_rank()}: rank 0 has not started the run in {out} within {timeout_s:.0f} "
                              f"s; start every node with the same command and the same hydra.run.dir (a directory "
                              f"every node sees).")
        time.sleep(0.2)


def run(cfg: DictConfig) -> float:
    """Train and test one configuration. Returns the best val/acc (what sweepers optimise)."""
    out = Path(cfg.paths.output_dir)
    with quiet():  # no third-party tips or warnings a user cannot act on (mhalab.train.console)
        if launch_rank() != 0:  # rank 0 holds the run dir, writes its record and decides whether to resume
            attempt = rank_zero_attempt(out)
            if attempt is not None:
                stop = GracefulStop(checkpoint.last_checkpoint(out).parent)
                try:
                    _fit_and_test(cfg, out, {}, stop, attempt.get("resumed_from"))
                except SIGTERMException as e:  # stopped with rank 0 (which saved): its exit status, not 0
                    raise SystemExit(130 if stop.ctrl_c else 143) from e
            return math.nan
        new = not _is_multirun() and rundir.only_hydra_files(out)
        try:
            with RunLock(out):
                return _run(cfg, out)
        except RunDirError as e:
            if not _is_multirun():
                raise
            log.error("member skipped: %s", e)  # another process runs it; the sweep goes on
            return float("nan")
        except UserError:
            if new and not checkpoint.last_checkpoint(out).parent.exists():  # refused before training began
                rundir.discard(out)
            raise


def _run(cfg: DictConfig, out: Path) -> float:
    previous = record.read_or_set_aside(out)
    status = previous and record.status(out, previous)
    if status == "running":
        status = "dead"  # we hold the run dir's lock, so the process that wrote "running" is gone
    if status == "finished":
        # a sweep re-run into the same dir: this member is done; never overwrite it
        log.info("%s already finished; skipping (delete it to re-run)", out)
        return float(previous.get("best", {}).get("val/acc", float("nan")))
    attempts = list(previous.get("attempts", [])) if previous else []
    if attempts and attempts[-1].get("status") == "running":
        attempts[-1]["status"] = "dead"  # its process is gone (we hold the lock): killed, never recorded
    last = checkpoint.last_checkpoint(out)
    if status in RESUMABLE and last.exists() and not cfg.get("ckpt_path"):
        log.info("%s was %s; resuming from %s", out, status, last)
        with open_dict(cfg):
            cfg.ckpt_path = str(last)
    try:
        validate(cfg)  # cheap, before anything is written: a mistake costs nothing and loses nothing
    except UserError as e:
        if not _is_multirun():
            raise
        _write_failed(out, previous, attempts, cfg, e)  # the sweep goes on; its report names the reason
        log.error("run failed: %s", e)
        return float("nan")

    ckpt_path = str(checkpoint.resolve(str(cfg.ckpt_path))) if cfg.get("ckpt_path") else None
    attempt = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "pid": os.getpid(), "host": socket.gethostname(),
               "resumed_from": ckpt_path, "from_step": checkpoint.meta(ckpt_path)["global_step"] if ckpt_path else 0,
               "status": "running"}
    attempts.append(attempt)
    rec = {
        "status": "running", "error": None, "overrides": _overrides(), "seed": int(cfg.seed),
        "config": experiment.resolved(cfg), "provenance": provenance(), "output_dir": str(out),
        "attempts": attempts,
    }
    if previous and previous.get("pretrain"):  # a resumed run builds no encoder: keep where its encoder came from
        rec["pretrain"] = previous["pretrain"]
    record.write(out, rec)
    t0 = time.time()
    stop = GracefulStop(checkpoint.last_checkpoint(out).parent)
    try:
        with experiment.extras(cfg, out):  # the config tree printed and saved; warnings silenced if asked
            trainer = _fit_and_test(cfg, out, rec, stop, ckpt_path)
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the record must not say "running"
        interrupted = isinstance(e, (KeyboardInterrupt, SystemExit))
        ctrl_c = isinstance(e, KeyboardInterrupt) or stop.ctrl_c or _ctrl_c_seen(e)
        how = "Ctrl-C" if ctrl_c else "SIGTERM" if isinstance(e, SIGTERMException) else type(e).__name__
        reason = (f"interrupted ({how}); to continue it in place, run the same command with hydra.run.dir={out}"
                  if interrupted else f"{type(e).__name__}: {e}".splitlines()[0])
        attempt.update(status="interrupted" if interrupted else "failed", wall_time_s=time.time() - t0)
        rec.update(status="interrupted" if interrupted else "failed", error=reason, **_totals(attempts))
        record.write(out, rec)
        if _is_multirun() and not interrupted:  # one failed member must not end the sweep
            log.error("run failed: %s", rec["error"])
            return float("nan")
        if interrupted:
            log.warning("%s", reason)
            raise SystemExit(130 if ctrl_c else 143) from e  # 128 + the signal, as if it had killed us
        raise
    if trainer.is_global_zero:
        attempt.update(status="finished", wall_time_s=time.time() - t0)
        rec.update(status="finished", **_totals(attempts))
        record.write(out, rec)
        from mhalab.train.record.curves import loss_curves

        if (out / "logs" / "metrics.csv").exists():
            loss_curves(out / "logs" / "metrics.csv", out / "loss_curves.png")
        print(summary(rec, out), flush=True)  # after the progress bars: what the run reached, and where
    return float(rec.get("best", {}).get("val/acc", float("nan")))


def _ctrl_c_seen(e: BaseException) -> bool:
    # Lightning turns a KeyboardInterrupt into sys.exit(1) after its own on_exception hooks
    return isinstance(e, SystemExit) and isinstance(e.__context__, KeyboardInterrupt)


def _totals(attempts: list[dict]) -> dict:
    """Times summed over every attempt of the run (a resumed run's cost is all of it)."""
    return {"wall_time_s": sum(a.get("wall_time_s", 0.0) for a in attempts),
            "fit_time_s": sum(a.get("fit_time_s", 0.0) for a in attempts), "attempts": attempts}


def _write_failed(out: Path, previous: dict | None, attempts: list, cfg: DictConfig, e: Exception) -> None:
    rec = dict(previous or {}, status="failed", error=str(e), overrides=_overrides(), output_dir=str(out),
               attempts=attempts)
    rec.setdefault("config", OmegaConf.to_container(cfg, resolve=False))
    record.write(out, rec)


def build(cfg: DictConfig, encoder: pretrain.Encoder | None = None) -> tuple[L.LightningDataModule, Classifier]:
    """The run's parts, top-down, each from its config group: the datamodule (data read, tokenizer ready), then the
    model inside its LightningModule. A pretrained start (pretrain=mlm, init_from=) is the stage before this one
    (pretrain.stage): it hands in `encoder`, weights already checked against this model and tokenizer."""
    setup_process(cfg)  # cheap checks before any data is read; threads; then the seed of the weights' draws
    L.seed_everything(int(cfg.seed), workers=True)
    dm = datamodule(cfg)
    # the datamodule's state_dict (tokenizer, label names, sampler position) is saved by Lightning
    # under its class name; record where, with the data config, so a checkpoint is self-contained
    # (the data config as the datamodule resolved it: absolute paths, and what data=files inferred, so that
    # mhalab-eval rebuilds the same splits from any directory)
    extras = {"datamodule_key": type(dm).__qualname__, "data": dm.source_config()}
    if encoder:
        extras["pretrain"] = {k: v for k, v in encoder.meta.items() if k not in ("model", "data")}
    keyed = cfg.get("init_draw", "torch") == "keyed"  # common random numbers (mhalab.train.common_random)
    module = Classifier(
        model=OmegaConf.to_container(cfg.model, resolve=True), vocab_size=dm.vocab_size,
        num_classes=dm.num_classes, label_names=dm.label_names, pad_id=dm.pad_id, compile=bool(cfg.compile),
        checkpoint_extras=extras, encoder=encoder.state if encoder else None,
        init_seed=int(cfg.seed) if keyed else None, **OmegaConf.to_container(cfg.optim, resolve=True),
    )
    if keyed:  # the dropout masks start where the seed says, whatever building the model drew
        start_dropout_stream(int(cfg.seed))
    return dm, module


def _fit_and_test(cfg: DictConfig, out: Path, rec: dict, stop: GracefulStop, ckpt_path: str | None = None
                  ) -> L.Trainer:
    if ckpt_path is None and cfg.get("ckpt_path"):
        ckpt_path = str(checkpoint.resolve(str(cfg.ckpt_path)))
    # a resumed run's checkpoint holds its weights: only a new one starts from a pretrained encoder
    dm, module = build(cfg, None if ckpt_path is not None else pretrain.stage(cfg))
    if rec:  # the data set as resolved: absolute paths, the columns and labels data=files found
        rec["data"] = module.checkpoint_extras["data"]
        m = cfg.model  # the attention's shape as built: head_dim is dim / heads unless model.head_dim sets it
        rec["model"] = {"dim": m.dim, "heads": m.heads, "layers": m.layers,
                        "head_dim": check_heads(m.dim, m.heads, ("dim", "heads"), m.get("head_dim")),
                        "head_dim_from": "model.head_dim" if m.get("head_dim") is not None else "dim / heads"}
        if "pretrain" in module.checkpoint_extras:  # where the encoder came from, and what pretraining cost
            rec["pretrain"] = module.checkpoint_extras["pretrain"]

    loggers = _loggers(cfg, ckpt_path)
    callbacks = [instantiate(c) for c in (cfg.get("callbacks") or {}).values() if c is not None]
    if not cfg.trainer.get("enable_progress_bar", True):  # Lightning refuses a bar callback then
        callbacks = [c for c in callbacks if not isinstance(c, ProgressBar)]
    # always on: an interrupted run saves last.ckpt at a batch boundary, and a resumed run continues exactly
    callbacks += [stop, ResumeState(), LogEveryEpoch()]
    trainer = L.Trainer(**OmegaConf.to_container(cfg.trainer, resolve=True), logger=loggers,
                        callbacks=callbacks, default_root_dir=str(out))
    if rec:  # rank 0: every logger gets the whole config and the provenance, as metrics.json does
        rec["provenance"].update(device(trainer.strategy.root_device))  # the device the trainer chose
        experiment.log_hyperparameters(trainer.loggers, experiment.hyperparameters(cfg, rec["provenance"],
                                                                                  rec.get("overrides", [])))
    for lg in loggers:
        if hasattr(lg, "experiment") and type(lg).__name__ == "WandbLogger" and trainer.is_global_zero:
            rec["wandb_id"] = lg.experiment.id
            module.remember(wandb_id=lg.experiment.id)

    try:
        _fit_and_test_best(cfg, trainer, dm, module, rec, ckpt_path)
    except BaseException:
        finish(trainer.loggers, exit_code=1)
        raise
    finish(trainer.loggers)
    return trainer


def _fit_and_test_best(cfg: DictConfig, trainer: L.Trainer, dm, module: Classifier, rec: dict,
                       ckpt_path: str | None) -> None:
    """Fit, then evaluate the best checkpoint on validation and test; the results go into `rec`."""
    params = sum(p.numel() for p in module.parameters())
    reset_peak_memory(trainer.strategy.root_device)
    t_fit = time.time()
    try:
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path, weights_only=True)
    finally:
        if rec.get("attempts"):
            rec["attempts"][-1]["fit_time_s"] = time.time() - t_fit
            rec["attempts"][-1]["global_step"] = trainer.global_step
    fit_s = time.time() - t_fit
    batches = extent.train_batches(trainer)
    peak_mb, peak_kind = peak_memory_mb(trainer.strategy.root_device)
    # counted on the host over every attempt (the counters travel in the checkpoint); read before the best
    # checkpoint is loaded for validate/test below, which would put its own counts back
    real, pads = (int(x) * trainer.world_size for x in module.token_counts)

    # the record's two sets of metrics (mhalab.train.record): the last validation of fit, and the best checkpoint
    last_epoch = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    ckpt_cb = trainer.checkpoint_callback
    best = {"val/acc": float(ckpt_cb.best_model_score) if ckpt_cb and ckpt_cb.best_model_score is not None
            else last_epoch.get("val/acc", float("nan"))}
    best_path = ckpt_cb.best_model_path if ckpt_cb and ckpt_cb.best_model_path else None
    tested = bool(cfg.get("test_after_fit", True) and not trainer.fast_dev_run)
    if tested:
        # the best checkpoint by val/acc, evaluated once on val (for its val/loss) and once on test
        # not to the loggers: on the curves it would be one more validation, at the best epoch's step
        loggers, trainer.loggers = trainer.loggers, []
        try:
            val_res = trainer.validate(module, datamodule=dm, ckpt_path=best_path, verbose=False, weights_only=True)[0]
        finally:
            trainer.loggers = loggers
        best.update({k: float(v) for k, v in val_res.items()})
        if "test" in dm.splits:  # a data=files run may have no test file: its record has val/* only
            test_res = trainer.test(module, datamodule=dm, ckpt_path=best_path, verbose=False, weights_only=True)[0]
            best.update({k: float(v) for k, v in test_res.items()})
    best["checkpoint"] = best_path  # what eval, predict and ensembles of this run dir load (checkpoint.best_checkpoint)
    if best_path:  # when it was saved: Lightning's epoch (0-based, as in its file name) and step
        saved = checkpoint.meta(best_path)
        best.update(epoch=saved["epoch"], step=saved["global_step"])
    _write_class_reports(Path(trainer.default_root_dir), module, rec, tested=tested and best_path is not None)
    fit_total = sum(a.get("fit_time_s", 0.0) for a in rec.get("attempts", [])) or fit_s
    stopper = trainer.early_stopping_callback  # callbacks=early_stopping
    if stopper is not None:
        rec["early_stopping"] = {"stopped": stopper.stopped_epoch > 0, "stopped_epoch": stopper.stopped_epoch,
                                 "patience": stopper.patience, "monitor": stopper.monitor,
                                 "best_score": float(stopper.best_score)}
    rec["trained"] = extent.measure(trainer, batches, {split: len(data) for split, data in dm.splits.items()},
                                    module.class_reports)
    rec.update(
        params=params, epochs=trainer.current_epoch, global_step=trainer.global_step, best=best,
        last_epoch=last_epoch,
        train_tokens=real, peak_mem_mb=peak_mb, peak_mem_kind=peak_kind,
        tokens_per_s=real / fit_total if fit_total > 0 else math.nan,  # real (non-pad) tokens per second of fit()
        padding_fraction=pads / max(1, real + pads),
        device=str(trainer.strategy.root_device),
        device_name=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    )


def _write_class_reports(out: Path, module: Classifier, rec: dict, tested: bool) -> None:
    """Per-class precision / recall / F1 and the confusion matrix of validation and test into the record
    (`classes`, with the label names) and as confusion_<split>.png. After test_after_fit: the best checkpoint's;
    else the last validation's."""
    if not rec:  # ranks other than 0 write nothing
        return
    from mhalab.train.record.class_report import confusion_png

    rec["label_names"] = list(module.label_names)
    rec["classes"] = {"of": "best checkpoint" if tested else "last validation", **module.class_reports}
    for split, report in module.class_reports.items():
        confusion_png(report, out / f"confusion_{split}.png", f"{split}, {rec['classes']['of']}")


def _loggers(cfg: DictConfig, ckpt_path: str | None) -> list:
    lcfg = OmegaConf.to_container(cfg.get("logger") or {}, resolve=True)
    for c in lcfg.values():  # the CSV log keeps the rows before the step this attempt resumes from
        if c and c.get("_target_", "").endswith("ContinuedCSVLogger"):
            c["resume_step"] = checkpoint.meta(ckpt_path)["global_step"] if ckpt_path else 0
    if "wandb" in lcfg:
        from mhalab.train.loggers import prepare_wandb

        lcfg["wandb"] = prepare_wandb(lcfg["wandb"], ckpt_path, _is_multirun())
    return [instantiate(c) for c in lcfg.values() if c is not None]


__all__ = ["UserError", "build", "launch_rank", "run"]
