"""Checkpoints: the one resolver of `ckpt_path`, safe loading, and the checks a resume needs.

`ckpt_path` is a .ckpt file, a run dir (its checkpoints/last.ckpt) or `last` (the newest
outputs/**/checkpoints/last.ckpt). train.py, scripts/eval.py and the attention maps all resolve it
here. Files are read with torch.load(weights_only=True), so a downloaded checkpoint cannot run code:
ours hold only tensors, numbers, strings and containers (callbacks.ResumeState stores numpy's RNG
state as a tensor for this reason).
"""

from __future__ import annotations

import functools
import pickle
import re
import zipfile
from pathlib import Path

import torch

from mhalab.errors import CheckpointError

LAST = "last.ckpt"
CHECKPOINT_DIR = "checkpoints"
# model settings that change the shapes or the meaning of the weights: a resume must keep them
SHAPE_KEYS = ("encoder", "dim", "heads", "layers", "ff_dim", "pos", "attention", "pooling", "max_len")
# data settings that make the tokenizer (and so the embedding rows) another one
DATA_KEYS = ("name", "tokenizer_kind", "vocab_size")


def last_checkpoint(run_dir: str | Path) -> Path:
    """Where a run dir keeps its newest state (written on interrupt, every N steps and each epoch)."""
    return Path(run_dir) / CHECKPOINT_DIR / LAST


def resolve(ckpt_path: str | Path, outputs: Path | None = None) -> Path:
    """A .ckpt file, a run dir (its checkpoints/last.ckpt), or 'last' (newest last.ckpt under outputs/)."""
    if str(ckpt_path) == "last":
        outputs = outputs or Path.cwd() / "outputs"
        found = sorted(outputs.glob(f"**/{CHECKPOINT_DIR}/{LAST}"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise CheckpointError(f"ckpt_path=last but no {CHECKPOINT_DIR}/{LAST} exists under {outputs}; "
                                  f"pass a .ckpt file or a run dir.")
        return found[-1]
    p = Path(ckpt_path)
    if p.is_dir():
        p = last_checkpoint(p)
    if not p.is_file():
        looked = f" (looked for {p})" if str(p) != str(ckpt_path) else ""
        raise CheckpointError(f"ckpt_path={ckpt_path} does not exist{looked}; pass a .ckpt file or a run dir.")
    return p


def _first_sentence(e: BaseException) -> str:
    return str(e).splitlines()[0].split(". ")[0][:160] if str(e) else type(e).__name__


def load(path: str | Path) -> dict:
    """The whole checkpoint, on the CPU, without running any code stored in it."""
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive (PyTorch >= 1.6)
        raise CheckpointError(f"ckpt_path={path} is not a PyTorch checkpoint (not a zip archive, or cut short); "
                              f"pass a .ckpt from a run's {CHECKPOINT_DIR}/ dir, or the run dir.")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refused a type: not one of ours
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"code: {found.group(1)}" if found else _first_sentence(e)
        raise CheckpointError(f"ckpt_path={path} holds objects a safe load refuses ({what}); it was not written "
                              f"by mhalab's train.py, and is not loaded: pass a checkpoint from a run's "
                              f"{CHECKPOINT_DIR}/ dir.") from e
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, KeyError, ValueError) as e:
        raise CheckpointError(f"ckpt_path={path} is not a readable checkpoint (truncated or corrupt: "
                              f"{_first_sentence(e)}); pass another .ckpt or a run dir.") from e


def meta(path: str | Path) -> dict:
    """A checkpoint's small parts (hyper-parameters, mhalab's extras, step), read once for every check."""
    return _meta(str(path), Path(path).stat().st_mtime_ns)  # a rewritten file is read again


@functools.lru_cache(maxsize=4)
def _meta(path: str, mtime_ns: int) -> dict:
    ckpt = load(path)
    if not isinstance(ckpt, dict) or "mhalab" not in ckpt or "hyper_parameters" not in ckpt:
        raise CheckpointError(f"ckpt_path={path} was not written by mhalab's train.py (no 'mhalab' entry); "
                              f"pass a checkpoint from a run's {CHECKPOINT_DIR}/ dir.")
    return {"hyper_parameters": ckpt["hyper_parameters"], "mhalab": ckpt["mhalab"],
            "global_step": int(ckpt.get("global_step", 0))}


def check_fits(path: str | Path, model: dict, data: dict) -> None:
    """Resuming `path` with this model and data config must work: same shapes, classes and tokenizer."""
    m = meta(path)
    saved = m["hyper_parameters"].get("model", {})
    for key in SHAPE_KEYS:
        if key in saved and saved[key] != model.get(key):
            raise CheckpointError(
                f"ckpt_path={path} holds a model with {key}={saved[key]}, but the config has "
                f"{key}={model.get(key)}; resume with the same model settings (e.g. {key}={saved[key]})."
            )
    classes = data.get("num_classes") or (len(data["label_names"]) if data.get("label_names") else None)
    saved_classes = m["hyper_parameters"].get("num_classes")
    if classes is not None and saved_classes is not None and int(classes) != int(saved_classes):
        trained_on = m["mhalab"].get("data", {}).get("name")
        raise CheckpointError(
            f"ckpt_path={path} holds a {saved_classes}-class model (trained on {trained_on}), but the config has "
            f"{classes} classes (data={data.get('name')}); resume on {trained_on} with data.num_classes={saved_classes}."
        )
    saved_data = m["mhalab"].get("data", {})
    for key in DATA_KEYS:
        if key in saved_data and key in data and saved_data[key] != data[key]:
            raise CheckpointError(
                f"ckpt_path={path} was trained with data.{key}={saved_data[key]}, but the config has "
                f"data.{key}={data[key]}: its embeddings belong to another tokenizer; resume with "
                f"data.{key}={saved_data[key]}."
            )
