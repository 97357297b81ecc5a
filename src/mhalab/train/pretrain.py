"""Self-pretraining: masked-LM on the task's own train texts, then fine-tuning on its labels (`pretrain=mlm`).

    python train.py data=trec pretrain=mlm                       # pretrain (or reuse), then fine-tune
    python train.py data=trec init_from=<pretrain dir or .pt>    # fine-tune from a saved encoder

Amos et al., "Never Train from Scratch" (ICLR 2024) and Krishna et al., "Downstream Datasets Make Surprisingly
Good Pretraining Corpora" (ACL 2023): no external data, only the downstream training set.

Only the train split's texts are pretrained on (the datamodule's train loader: with a held-out dev split,
train without the hold-out); never validation or test (tests/test_pretrain.py checks the ids seen).

The pretrained encoder is cached under <paths.cache_dir>/pretrain/<data set>/mlm-<digest>/, the digest of
everything its weights depend on: the encoded train split (data files, tokenizer, max_len, and the seed's dev
hold-out where the data set has one), the model's shape and dropout, the pretraining settings, batch size,
batching, precision, and the trainer's debugging cuts (limit_train_batches, fast_dev_run, overfit_batches),
which pretraining obeys too. A sweep over fine-tuning settings (seed, lr, epochs, ...) pretrains once per model
shape; a second process waits on the dir's lock and reuses the result.
The dir holds encoder.pt (the weights and meta.json's facts), logs/metrics.csv and loss_curves.png (the
masked-LM loss and accuracy per step), and checkpoints/last.ckpt while it runs: an interrupted pretraining
continues from there when the run is started again.

Pretraining runs on one device, before the fine-tuning trainer starts: under DDP the other ranks start with
the fine-tuning and load the cached encoder (torchrun / SLURM ranks wait on the lock).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from mhalab.data.cache import digest, locked, write_atomic
from mhalab.data.tokenizer import CLS_ID, PAD_ID, SEP_ID, SPECIALS
from mhalab.errors import CheckpointError
from mhalab.mlm import MaskedLanguageModel
from mhalab.model import SequenceClassifier
from mhalab.train.callbacks import GracefulStop, ResumeState
from mhalab.train.checkpoint import SHAPE_KEYS
from mhalab.train.config import datamodule, setup_process
from mhalab.train.loggers.csv_logger import ContinuedCSVLogger
from mhalab.train.optimizer import adamw_with_schedule, upgrade_article_keys
from mhalab.train.record.curves import loss_curves, masked_lm_finals

log = logging.getLogger("mhalab")

OBJECTIVES = ("mlm",)
WEIGHTS = "encoder.pt"
CACHE_VERSION = 2  # bump when the pretraining recipe changes what the same settings produce (2: batch order by pretrain.seed)
NOT_WEIGHTS = ("block_min_scores", "query_block")  # model settings that change speed, never the weights
DEBUG_CUTS = {"limit_train_batches": 1.0, "fast_dev_run": False, "overfit_batches": 0.0}  # trainer keys: defaults


class MaskedLMModule(L.LightningModule):
    """Lightning's side of MaskedLanguageModel: a classifier-shaped backbone, masked-LM loss, AdamW + schedule."""

    def __init__(self, model: dict, vocab_size: int, num_classes: int, pad_id: int = PAD_ID, mask_prob: float = 0.15,
                 lr: float = 1e-3, weight_decay: float = 0.01, betas: tuple[float, float] = (0.9, 0.98),
                 warmup_ratio: float = 0.06, schedule: str = "cosine"):
        super().__init__()
        self.save_hyperparameters()
        backbone = SequenceClassifier(vocab_size=vocab_size, num_classes=num_classes, pad_id=pad_id, **model)
        self.mlm = MaskedLanguageModel(backbone, special_ids=(PAD_ID, CLS_ID, SEP_ID),
                                       first_normal_id=len(SPECIALS), mask_prob=mask_prob)
        self.tokens_seen = 0  # real tokens trained on, over every attempt (saved in checkpoints): host ints

    def on_save_checkpoint(self, checkpoint):
        checkpoint["tokens_seen"] = self.tokens_seen

    def on_load_checkpoint(self, checkpoint):
        upgrade_article_keys(checkpoint, self)  # a resume of a pretraining written before PyTorch's parameter names
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))

    def training_step(self, batch, batch_idx):
        ids, seqlens = batch["input_ids"], batch["seqlens"]
        if ids.dim() == 2:  # (B, L) right-padded -> (N,) real tokens
            ids = ids.flatten().index_select(0, seqlens.padded_index(ids.size(1), ids.device))
        loss, n, correct = self.mlm(ids, seqlens)
        self.tokens_seen += seqlens.num_tokens
        self.log("pretrain/loss", loss, prog_bar=True, batch_size=seqlens.batch)
        self.log("pretrain/acc", correct.float() / n, batch_size=seqlens.batch)  # of the masked tokens
        return loss

    def configure_optimizers(self):
        return adamw_with_schedule(self, self.hparams)


# ------------------------------------------------------------------------------------------ the cache


def weight_settings(model: dict) -> dict:
    """The model settings the weights depend on (the cache key's model part)."""
    return {k: v for k, v in model.items() if k not in NOT_WEIGHTS}


def cache_dir(cfg: DictConfig, dm) -> Path:
    """<cache>/pretrain/<data set>/mlm-<digest>: one dir per encoded train split, model and pretraining setting."""
    p = OmegaConf.to_container(cfg.pretrain, resolve=True)
    key = {"version": CACHE_VERSION, "tokens": dm.encoded_dir.name,
           "model": weight_settings(OmegaConf.to_container(cfg.model, resolve=True)), "pretrain": p,
           "batch_size": dm.batch_size, "batching": dm.batching, "tokens_per_batch": dm.tokens_per_batch}
    if str(cfg.trainer.precision) != "32-true":  # (absent for float32: the encoders cached before it stay valid)
        key["precision"] = str(cfg.trainer.precision)
    key.update(_debug_cuts(cfg))  # a debugging cut (debug=fast, the README test's 2 batches) is another encoder
    return dm.cache_root / "pretrain" / dm.name / f"{p['objective']}-{digest(key)}"


def _debug_cuts(cfg: DictConfig) -> dict:
    """The trainer's debugging cuts in force (DEBUG_CUTS away from their defaults): pretraining obeys them too."""
    return {k: cfg.trainer.get(k) for k, default in DEBUG_CUTS.items() if cfg.trainer.get(k, default) != default}


def pretrained_encoder(cfg: DictConfig, dm, callbacks: tuple = ()) -> tuple[dict, dict]:
    """(the encoder's state dict, its meta) for this config: read from the cache, or pretrained now (with these
    Lightning callbacks added, e.g. SimulateSignal to rehearse an interruption)."""
    d = cache_dir(cfg, dm)
    if not (d / WEIGHTS).exists():
        with locked(d.with_suffix(".lock")):
            if not (d / WEIGHTS).exists():  # another process may have finished it while we waited
                _pretrain(cfg, dm, d, callbacks)
                state, meta = read_encoder(d / WEIGHTS)
                return state, dict(meta, cached=False)
    state, meta = read_encoder(d / WEIGHTS)
    log.info("pretrained encoder from the cache: %s (%s, %d steps)", d, meta["objective"], meta["global_step"])
    return state, dict(meta, cached=True)


def _pretrain(cfg: DictConfig, dm, d: Path, extra_callbacks: tuple = ()) -> None:
    """Masked-LM on the train split, on one device; encoder.pt written last (it marks the dir complete).

    The datamodule's train loader is the only data (no validation: limit_val_batches=0), so the datamodule's
    state (the sampler's position) is saved in last.ckpt and a resumed pretraining continues mid-epoch exactly."""
    p = OmegaConf.to_container(cfg.pretrain, resolve=True)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    t = cfg.trainer
    last = d / "checkpoints" / "last.ckpt"
    resume = str(last) if last.exists() else None
    log.info("%s masked-LM pretraining: %d epochs over the train split's %d texts -> %s", "resuming" if resume
             else "starting", p["epochs"], len(dm.splits["train"]), d)
    L.seed_everything(int(p["seed"]), workers=True)
    module = MaskedLMModule(model_cfg, dm.vocab_size, dm.num_classes, dm.pad_id, mask_prob=p["mask_prob"],
                            lr=p["lr"], weight_decay=p["weight_decay"], betas=tuple(p["betas"]),
                            warmup_ratio=p["warmup_ratio"], schedule=p["schedule"])
    logger = ContinuedCSVLogger(str(d), name="logs", version="", flush_logs_every_n_steps=1,
                                resume_step=torch.load(last, map_location="cpu", weights_only=True)["global_step"]
                                if resume else 0)
    callbacks = [ModelCheckpoint(dirpath=d / "checkpoints", every_n_train_steps=200, save_top_k=0, save_last=True,
                                 enable_version_counter=False),
                 GracefulStop(d / "checkpoints"), ResumeState(), *extra_callbacks]
    trainer = L.Trainer(accelerator=t.accelerator, devices=1, precision=t.precision, max_epochs=int(p["epochs"]),
                        gradient_clip_val=t.get("gradient_clip_val"), log_every_n_steps=t.log_every_n_steps,
                        limit_val_batches=0, num_sanity_val_steps=0, use_distributed_sampler=False,
                        **_debug_cuts(cfg), enable_progress_bar=t.enable_progress_bar, enable_model_summary=False, logger=logger,
                        callbacks=callbacks, default_root_dir=str(d))
    t0 = time.time()
    # train_dataloader(): the train split only, in pretrain.seed's order (as the masks and the init): an encoder
    # never depends on which fine-tuning seed happened to pretrain it
    trainer.fit(module, datamodule=dm.shuffled_by(int(p["seed"])), ckpt_path=resume, weights_only=True)
    seconds = time.time() - t0
    previous = json.loads((d / "meta.json").read_text()) if resume and (d / "meta.json").exists() else {}
    meta = {"objective": p["objective"], "dir": str(d), "pretrain": p, "model": weight_settings(model_cfg),
            "data": dm.name, "tokenizer": dm.tokenizer_path.name, "train_texts": len(dm.splits["train"]),
            "train_tokens": sum(dm.splits["train"].lengths), "tokens_seen": module.tokens_seen,
            "epochs": trainer.current_epoch,
            "global_step": trainer.global_step, **masked_lm_finals(d / "logs" / "metrics.csv"),
            "wall_time_s": seconds + previous.get("wall_time_s", 0.0)}
    write_atomic(d / "meta.json", lambda f: f.write_text(json.dumps(meta, indent=2)))
    if (d / "logs" / "metrics.csv").exists():
        loss_curves(d / "logs" / "metrics.csv", d / "loss_curves.png")
    write_atomic(d / WEIGHTS, lambda f: torch.save({"state_dict": module.mlm.backbone_state(), "meta": meta}, f))
    last.unlink(missing_ok=True)  # done: the weights are in encoder.pt


# --------------------------------------------------------------------------- into the classifier


def resolve_init(path: str | Path) -> Path:
    """init_from: a pretraining dir (its encoder.pt) or an encoder.pt file."""
    p = Path(path)
    if p.is_dir():
        p = p / WEIGHTS
    if not p.is_file():
        looked = f" (looked for {p})" if p != Path(path) else ""
        raise CheckpointError(f"init_from={path} does not exist{looked}; pass a pretraining dir "
                              f"(<cache>/pretrain/<data>/mlm-...) or its {WEIGHTS}.")
    return p


def read_encoder(path: str | Path) -> tuple[dict, dict]:
    """(state dict, meta) of an encoder.pt, read safely."""
    from mhalab.train.checkpoint import load

    saved = load(path)
    if not isinstance(saved, dict) or "state_dict" not in saved or "meta" not in saved:
        raise CheckpointError(f"init_from={path} is not a pretrained encoder written by mhalab (no state_dict and "
                              f"meta); pass a pretraining dir or its {WEIGHTS}.")
    return saved["state_dict"], saved["meta"]


def check_encoder_fits(meta: dict, model: dict, tokenizer: str, where: str) -> None:
    """A pretrained encoder must have this model's shape and this data set's tokenizer (its embedding rows)."""
    for key in SHAPE_KEYS:
        was, now = meta["model"].get(key), model.get(key)
        if was != now:
            raise CheckpointError(f"init_from={where} holds an encoder with model.{key}={was}, but the config has "
                                  f"model.{key}={now}; fine-tune with the same model settings.")
    if meta["tokenizer"] != tokenizer:
        raise CheckpointError(f"init_from={where} was pretrained with the tokenizer {meta['tokenizer']}, but this "
                              f"data config builds {tokenizer}: its embeddings belong to other token ids; use the "
                              f"data settings it was pretrained with (data={meta['data']}).")


@dataclass(frozen=True)
class Encoder:
    """What a pretrained start hands the run's build: an encoder's weights (every classifier weight but the head),
    already checked against the run's model and tokenizer, and their record (objective, steps, dir, cached)."""

    state: dict
    meta: dict


def stage(cfg: DictConfig) -> Encoder | None:
    """The stage before a run's build: with pretrain=mlm, the encoder pretrained now on the train split or read from
    its cache; with init_from=, the encoder.pt given, checked against this model and this data's tokenizer; None
    when the run starts from scratch."""
    if not (cfg.get("pretrain") or cfg.get("init_from")):
        return None
    setup_process(cfg)  # the checks, before any data is read
    dm = datamodule(cfg)  # the train split it pretrains on, and the tokenizer an encoder must share
    if cfg.get("pretrain"):
        state, meta = pretrained_encoder(cfg, dm)
        return Encoder(state, meta)
    path = resolve_init(cfg.init_from)
    state, meta = read_encoder(path)
    check_encoder_fits(meta, OmegaConf.to_container(cfg.model, resolve=True), dm.tokenizer_path.name,
                       str(cfg.init_from))
    return Encoder(state, dict(meta, cached=True))


__all__ = [
    "OBJECTIVES",
    "Encoder",
    "MaskedLMModule",
    "cache_dir",
    "check_encoder_fits",
    "pretrained_encoder",
    "read_encoder",
    "resolve_init",
    "stage",
]
