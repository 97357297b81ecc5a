"""Checkpoints: the one resolver of `ckpt_path`, safe loading, the checks a resume needs, and the one
loader of a trained model (`load_model`: module, tokenizer, label names, data config).

`ckpt_path` is a .ckpt file, a run dir (its checkpoints/last.ckpt) or `last` (the newest
outputs/**/checkpoints/last.ckpt). Training, mhalab-eval, mhalab-predict and the attention maps all
resolve and load it here. Files are read with torch.load(weights_only=True), so a downloaded checkpoint
cannot run code: ours hold only tensors, numbers, strings and containers (callbacks.ResumeState stores
numpy's RNG state as a tensor for this reason).
"""

from __future__ import annotations

import functools
import inspect
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mhalab.errors import CheckpointError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from mhalab.train.module import Classifier

LAST = "last.ckpt"
CHECKPOINT_DIR = "checkpoints"
# model settings that change the shapes or the meaning of the weights: a resume must keep them
SHAPE_KEYS = ("encoder", "dim", "heads", "head_dim", "layers", "ff_dim", "pos", "attention", "pooling", "max_len")
SHAPE_DEFAULTS = {"head_dim": None}  # shape keys older checkpoints lack, with the value they had
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


def _check_ours(ckpt, path) -> None:
    if not isinstance(ckpt, dict) or "mhalab" not in ckpt or "hyper_parameters" not in ckpt:
        raise CheckpointError(f"ckpt_path={path} was not written by mhalab's train.py (no 'mhalab' entry); "
                              f"pass a checkpoint from a run's {CHECKPOINT_DIR}/ dir.")


@functools.lru_cache(maxsize=4)
def _meta(path: str, mtime_ns: int) -> dict:
    ckpt = load(path)
    _check_ours(ckpt, path)
    return {"hyper_parameters": ckpt["hyper_parameters"], "mhalab": ckpt["mhalab"],
            "global_step": int(ckpt.get("global_step", 0))}


def check_fits(path: str | Path, model: dict, data: dict) -> None:
    """Resuming `path` with this model and data config must work: same shapes, classes and tokenizer."""
    m = meta(path)
    saved = m["hyper_parameters"].get("model", {})
    for key in SHAPE_KEYS:
        if key not in saved and key not in SHAPE_DEFAULTS:
            continue
        was, now = saved.get(key, SHAPE_DEFAULTS.get(key)), model.get(key)
        if was != now:
            show = lambda v: "null" if v is None else v
            raise CheckpointError(
                f"ckpt_path={path} holds a model with {key}={show(was)}, but the config has "
                f"{key}={show(now)}; resume with the same model settings (e.g. {key}={show(was)})."
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
        # null in the config: found from the files (data=files infers the name), so nothing to compare
        if key in saved_data and data.get(key) is not None and saved_data[key] != data[key]:
            raise CheckpointError(
                f"ckpt_path={path} was trained with data.{key}={saved_data[key]}, but the config has "
                f"data.{key}={data[key]}: its embeddings belong to another tokenizer; resume with "
                f"data.{key}={saved_data[key]}."
            )


# ------------------------------------------------------------------------------- a trained model, loaded

@dataclass
class Loaded:
    """What a checkpoint holds for using its model: nothing else is needed to evaluate or predict."""

    path: Path  # the resolved .ckpt file
    module: Classifier  # in eval mode; module.model is the plain SequenceClassifier
    tokenizer: Tokenizer
    label_names: list[str] | None  # class i's name, or None when the checkpoint has none
    data: dict  # the data config the model was trained with (checkpoint["mhalab"]["data"])
    max_len: int  # texts are truncated to this many ids, as in training

    def label(self, i: int) -> str:
        return self.label_names[i] if self.label_names and i < len(self.label_names) else str(i)


def tokenizer_and_labels(ckpt: dict) -> tuple[str | None, list[str] | None, dict]:
    """(tokenizer JSON, label names, the datamodule's state) from a train.py checkpoint.

    Lightning saves the datamodule's state under its class name, which checkpoint["mhalab"]["datamodule_key"]
    names; earlier versions wrote the tokenizer into checkpoint["mhalab"] itself; else any saved state
    that holds a tokenizer."""
    extra = ckpt.get("mhalab") or {}
    places = [ckpt.get(extra.get("datamodule_key"), {}), extra]
    places += [v for v in ckpt.values() if isinstance(v, dict) and "tokenizer" in v]
    for place in places:
        if isinstance(place, dict) and place.get("tokenizer"):
            names = place.get("label_names") or extra.get("label_names")
            return place["tokenizer"], [str(n) for n in names] if names else None, place
    return None, None, {}


def load_model(ckpt_path: str | Path, device: str = "cpu") -> Loaded:
    """The model of a checkpoint (a .ckpt, a run dir or `last`) in eval mode, with its tokenizer, label names
    and data config. The file is read once, safely (weights_only)."""
    from mhalab.data.tokenizer import load_tokenizer
    from mhalab.train.module import Classifier

    if str(device).startswith("cuda") and not torch.cuda.is_available():
        from mhalab.errors import ConfigError

        raise ConfigError(f"device={device} but torch sees no CUDA device here; use device=cpu.")
    path = resolve(ckpt_path)
    ckpt = load(path)
    _check_ours(ckpt, path)
    tokenizer, names, dm_state = tokenizer_and_labels(ckpt)
    if not tokenizer:
        raise CheckpointError(f"ckpt_path={path} carries no tokenizer (neither the datamodule's state nor "
                              f"checkpoint['mhalab']); it was not written by train.py, so text cannot be turned "
                              f"into the model's ids: pass a checkpoint from a run's {CHECKPOINT_DIR}/ dir.")
    accepted = inspect.signature(Classifier).parameters
    hparams = {k: v for k, v in ckpt["hyper_parameters"].items() if k in accepted}
    module = Classifier(**dict(hparams, compile=False))  # compiling pays off in training, not for one pass
    module.load_state_dict(ckpt["state_dict"])
    module.on_load_checkpoint(ckpt)  # its extras and token counts, as Lightning's own loading does
    module.to(device).eval()
    extra = ckpt["mhalab"]
    data = dict(extra.get("data") or {})
    if "bucketing" in data:  # written before data.batching replaced the bool (2026-12)
        data["batching"] = "bucketed" if data.pop("bucketing") else "shuffled"
    max_len = dm_state.get("max_len") or data.get("max_len") or hparams.get("model", {}).get("max_len")
    if not max_len:
        raise CheckpointError(f"ckpt_path={path} records no max_len (no data config, no model.max_len); pass a "
                              f"checkpoint from a run's {CHECKPOINT_DIR}/ dir.")
    return Loaded(path, module, load_tokenizer(tokenizer), names, data, int(max_len))
