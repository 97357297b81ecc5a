"""Checkpoints: the one resolver of `ckpt_path`, safe loading, the checks a resume needs, and the one
loader of a trained model (`load_model`: module, tokenizer, label names, data config).

`ckpt_path` is a .ckpt file, a run dir or `last` (the newest outputs/**/checkpoints/last.ckpt). Of a run dir,
training resumes from its checkpoints/last.ckpt; mhalab-eval, mhalab-predict, the attention maps and the ensembles
take the best checkpoint (by val/acc), the one the run tested and its metrics.json reports (`checkpoint=last` for the other).
All of them resolve and load it here. Files are read with torch.load(weights_only=True), so a downloaded checkpoint
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


def run_dir_of(ckpt: str | Path) -> Path:
    """The run dir a checkpoint file belongs to: <run>/checkpoints/x.ckpt -> <run>; a .ckpt elsewhere -> its folder."""
    ckpt = Path(ckpt)
    return ckpt.parent.parent if ckpt.parent.name == CHECKPOINT_DIR else ckpt.parent


WHICH = ("best", "last")  # of a run dir: its best checkpoint (the one it tested), or where it stopped


def resolve(ckpt_path: str | Path, outputs: Path | None = None, which: str = "last") -> Path:
    """A .ckpt file, a run dir (its `which` checkpoint: last.ckpt, or the best one: best_checkpoint), or
    'last' (newest last.ckpt under outputs/)."""
    if str(ckpt_path) == "last":
        outputs = outputs or Path.cwd() / "outputs"
        found = sorted(outputs.glob(f"**/{CHECKPOINT_DIR}/{LAST}"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise CheckpointError(f"ckpt_path=last but no {CHECKPOINT_DIR}/{LAST} exists under {outputs}; "
                                  f"pass a .ckpt file or a run dir.")
        return found[-1]
    p = Path(ckpt_path)
    if p.is_dir():
        if which not in WHICH:
            raise CheckpointError(f"checkpoint={which} is not one of {', '.join(WHICH)}; use checkpoint=best (the "
                                  f"run's best checkpoint, the one it tested) or checkpoint=last (where it stopped).")
        p = best_checkpoint(p) if which == "best" else last_checkpoint(p)
    if not p.is_file():
        looked = f" (looked for {p})" if str(p) != str(ckpt_path) else ""
        raise CheckpointError(f"ckpt_path={ckpt_path} does not exist{looked}; pass a .ckpt file or a run dir.")
    return p


def best_checkpoint(run_dir: str | Path) -> Path:
    """The best checkpoint (by val/acc) of a finished run, as its metrics.json reports it: the one it tested
    (unless test_after_fit=false); found beside the run dir's checkpoints/ if the run was moved."""
    from mhalab.train import record

    run_dir = Path(run_dir)
    try:
        rec = record.read(run_dir)
    except ValueError as e:  # a record cut short or not JSON: named by record.read
        raise CheckpointError(str(e)) from None
    if rec is None:
        raise CheckpointError(f"ckpt_path={run_dir} has no {record.FILE}: it is not a run dir; pass a run dir or a "
                              f".ckpt file.")
    best = (rec.get("best") or {}).get("checkpoint")
    if rec.get("status") != "finished" or not best:
        raise CheckpointError(f"run {run_dir} has not finished (status: {rec.get('status')}), so it reports no best "
                              f"checkpoint; let it finish, pass checkpoint=last for where it stopped, or pass one of "
                              f"its .ckpt files.")
    here = run_dir / CHECKPOINT_DIR / Path(best).name
    return here if here.is_file() else resolve(best)


def describe(path: str | Path, step: int) -> str:
    """What a resolved checkpoint is (Loaded.path and .step), for the line that says which one a command used."""
    kind = "last" if Path(path).name == LAST else "the best by val/acc"
    return f"{path} ({kind}, step {step:,})"


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
            "global_step": int(ckpt.get("global_step", 0)), "epoch": int(ckpt.get("epoch", 0))}


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
    step: int = 0  # the training step it was saved at

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


def load_model(ckpt_path: str | Path, device: str = "cpu", which: str = "best") -> Loaded:
    """The model of a checkpoint (a .ckpt, a run dir: its `which` checkpoint, or `last`) in eval mode, with its
    tokenizer, label names and data config. The file is read once, safely (weights_only)."""
    from mhalab.data.tokenizer import load_tokenizer
    from mhalab.train.module import Classifier

    if str(device).startswith("cuda") and not torch.cuda.is_available():
        from mhalab.errors import ConfigError

        raise ConfigError(f"device={device} but torch sees no CUDA device here; use device=cpu.")
    path = resolve(ckpt_path, which=which)
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
    return Loaded(path, module, load_tokenizer(tokenizer), names, data, int(max_len), int(ckpt.get("global_step", 0)))
