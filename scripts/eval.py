"""Evaluate a checkpoint on any split, with nothing but the checkpoint (and the data files).

    python scripts/eval.py ckpt_path=outputs/.../checkpoints/last.ckpt [split=test] [data_dir=...] [out=m.json]

The checkpoint carries the model config (hyper_parameters), the tokenizer (the datamodule's state)
and the data config (checkpoint["mhalab"]["data"]): the texts are re-read from the data files and
encoded with the checkpoint's own tokenizer, never a retrained one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader

from mhalab.cli import one_line_errors
from mhalab.data import Collate, EncodedSplit, LengthBatchSampler, encode_texts
from mhalab.errors import ConfigError
from mhalab.train import checkpoint
from mhalab.train.config import instantiate
from mhalab.train.module import Classifier

USAGE = "usage: python scripts/eval.py ckpt_path=PATH [split=test|validation|train] [data_dir=DIR] [batch_size=N] [out=FILE]"


def parse(argv: list[str]) -> dict[str, str]:
    args = {}
    for a in argv:
        key, sep, value = a.partition("=")
        if not sep or key not in ("ckpt_path", "split", "data_dir", "batch_size", "out"):
            raise ConfigError(f"unexpected argument '{a}'; {USAGE}")
        args[key] = value
    if "ckpt_path" not in args:
        raise ConfigError(f"ckpt_path is required; {USAGE}")
    if "batch_size" in args and not args["batch_size"].isdigit():
        raise ConfigError(f"batch_size={args['batch_size']!r} must be a positive integer.")
    return args


def evaluate(ckpt_path: str, split: str = "test", data_dir: str | None = None, batch_size: int | None = None) -> dict:
    path = checkpoint.resolve(ckpt_path)  # the one resolver: a .ckpt, a run dir, or `last`
    ckpt = checkpoint.load(path)  # weights_only: a checkpoint cannot run code
    extra = checkpoint.meta(path)["mhalab"]
    tokenizer_json = ckpt[extra["datamodule_key"]]["tokenizer"]
    data_cfg = dict(extra["data"])
    if data_dir:
        data_cfg["data_dir"] = data_dir
    dm = instantiate(data_cfg)
    known = [s for s in ("train", "validation", "test") if s in dm.files or (s == "validation" and dm.dev_split)]
    if split not in known:  # before any file is read
        raise ConfigError(f"split={split} is not a split of this data set; choose one of {', '.join(known)}.")
    dm.validate()
    splits = dm._read_splits()  # checked rows, with the same seeded dev hold-out as in training
    texts, labels = splits[split]
    encoded = EncodedSplit.from_lists(encode_texts(tokenizer_json, texts, dm.max_len), labels)
    loader = DataLoader(encoded, batch_sampler=LengthBatchSampler(encoded.lengths, batch_size or dm.eval_batch_size,
                                                                  shuffle=False, shard=False),
                        collate_fn=Collate(dm.pad_id))

    module = Classifier.load_from_checkpoint(path, map_location="cpu", weights_only=True)
    trainer = L.Trainer(accelerator="auto", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    result = trainer.test(module, dataloaders=loader, verbose=False)[0]
    # the module logs under "test/"; name the split that was really evaluated
    return {"checkpoint": str(path), "split": split, "examples": len(encoded),
            **{k.replace("test/", f"{split}/"): float(v) for k, v in result.items()}}


@one_line_errors
def main() -> None:
    args = parse(sys.argv[1:])
    res = evaluate(args["ckpt_path"], args.get("split", "test"), args.get("data_dir"),
                   int(args["batch_size"]) if "batch_size" in args else None)
    table = Table(title=f"{res['checkpoint']} on {res['split']} ({res['examples']} examples)")
    for k in ("metric", "value"):
        table.add_column(k)
    for k, v in res.items():
        if isinstance(v, float):
            table.add_row(k, f"{v:.4f}")
    Console().print(table)
    if "out" in args:
        Path(args["out"]).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
