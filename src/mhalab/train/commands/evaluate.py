"""Evaluate a checkpoint on any split, with nothing but the checkpoint (and the data files): mhalab-eval.

    mhalab-eval ckpt_path=outputs/<run> [split=test] [data_dir=DIR] [batch_size=N] [out=metrics.json]

The checkpoint carries the model config (hyper_parameters), the tokenizer (the datamodule's state)
and the data config (checkpoint["mhalab"]["data"]): the texts are re-read from the data files and
encoded with the checkpoint's own tokenizer, never a retrained one.
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from mhalab.data import Collate, EncodedSplit, LengthBatchSampler, encode_texts
from mhalab.errors import ConfigError
from mhalab.train import checkpoint
from mhalab.train.config import instantiate
from mhalab.train.console import quiet

SPLITS = ("train", "validation", "test")


def evaluate(ckpt_path: str | Path, split: str = "test", data_dir: str | None = None,
             batch_size: int | None = None, which: str = "best") -> dict:
    """{checkpoint, split, examples, <split>/loss, <split>/acc, <split>/f1, <split>/f1_<class>, classes} of a
    checkpoint on one split; `classes`: per-class precision / recall / F1, support and the confusion matrix
    (mhalab.train.record.class_report), by the label names the checkpoint carries."""
    loaded = checkpoint.load_model(ckpt_path, which=which)  # the one loader: a .ckpt, a run dir, or `last`
    dm = datamodule_of(loaded, split, data_dir)
    texts, labels = dm.read_splits()[split]  # checked rows, with the same seeded dev hold-out as in training
    encoded = EncodedSplit.from_lists(encode_texts(loaded.tokenizer, texts, loaded.max_len), labels)
    sampler = LengthBatchSampler(encoded.lengths, batch_size or dm.eval_batch_size, shuffle=False, shard=False)
    loader = DataLoader(encoded, batch_sampler=sampler, collate_fn=Collate(dm.pad_id))
    with quiet():  # no third-party tips (mhalab.train.console)
        trainer = L.Trainer(accelerator="auto", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False)
        result = trainer.test(loaded.module, dataloaders=loader, verbose=False)[0]
    # the module logs under "test/"; name the split that was really evaluated
    return {"checkpoint": str(loaded.path), "step": loaded.step, "split": split, "examples": len(encoded),
            **{k.replace("test/", f"{split}/"): float(v) for k, v in result.items()},
            "classes": loaded.module.class_reports["test"]}  # per class, by the checkpoint's label names


def datamodule_of(loaded: checkpoint.Loaded, split: str, data_dir: str | None = None):
    """The datamodule a checkpoint was trained with (its data files now under `data_dir`, if given), checked, and
    checked to have `split`: read_splits() then gives that split's rows as training saw them."""
    data_cfg = dict(loaded.data)
    if data_dir:
        data_cfg["data_dir"] = str(data_dir)
    dm = instantiate(data_cfg)
    known = [s for s in SPLITS if s in dm.files or (s == "validation" and dm.dev_split)]
    if split not in known:  # before any file is read
        raise ConfigError(f"split={split} is not a split of this data set; choose one of {', '.join(known)}.")
    dm.validate()
    return dm


def _class_table(report: dict):
    """The per-class precision / recall / F1 / support, and the confusion counts, as a rich table."""
    from rich.table import Table

    table = Table(title="per class (rows: true class; predicted counts on the right)")
    for col in ("class", "precision", "recall", "f1", "support", *report["labels"]):
        table.add_column(col, justify="left" if col == "class" else "right")
    for i, name in enumerate(report["labels"]):
        table.add_row(name, *(f"{report[k][i]:.4f}" for k in ("precision", "recall", "f1")),
                      str(report["support"][i]), *map(str, report["confusion"][i]))
    return table


def command(cfg: DictConfig) -> dict:
    """mhalab-eval: print the metrics as a table (and write them as JSON to `out`)."""
    from rich.console import Console
    from rich.table import Table

    if OmegaConf.is_missing(cfg, "ckpt_path"):
        raise ConfigError("ckpt_path is required: pass ckpt_path=<a .ckpt file, a run dir, or last>, "
                          "e.g. ckpt_path=outputs/<run> split=test.")
    batch_size = cfg.batch_size
    if batch_size is not None and (isinstance(batch_size, bool) or not str(batch_size).isdigit()
                                   or int(batch_size) < 1):
        raise ConfigError(f"batch_size={batch_size!r} must be a positive integer.")
    res = evaluate(str(cfg.ckpt_path), str(cfg.split), cfg.data_dir, int(batch_size) if batch_size else None,
                   str(cfg.checkpoint))
    print(f"checkpoint: {checkpoint.describe(res['checkpoint'], res['step'])}")
    table = Table(title=f"{res['split']} ({res['examples']} examples)")
    table.add_column("metric")
    table.add_column("value")
    for k, v in res.items():
        if isinstance(v, float):
            table.add_row(k, f"{v:.4f}")
    Console().print(table)
    Console().print(_class_table(res["classes"]))
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(res, indent=2))
    return res
