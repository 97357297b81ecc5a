"""An ensemble of trained runs, scored on one split: mhalab-ensemble.

    mhalab-ensemble runs=multirun/<sweep> [split=test] [out=ensemble.json]
    mhalab-ensemble 'runs=[outputs/<run a>,outputs/<run b>]'

The members' class probabilities are averaged, example by example, and the average's arg-max is the
ensemble's answer (the "averaging" ensemble of Dietterich 2000; seeds are the cheapest source of members).
Each member is a run's tested checkpoint (metrics.json's best.checkpoint: the one its test figures are of)
and encodes the texts with its own tokenizer, so members trained on different hold-outs or tokenizers
combine; they must agree on the split's rows and the label names. Needs nothing but the run dirs and
the data files, as mhalab-eval.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torchmetrics.functional.classification import multiclass_f1_score

from mhalab.errors import CheckpointError, ConfigError
from mhalab.train import checkpoint
from mhalab.train.evaluate import datamodule_of
from mhalab.train.predict import probabilities

RECORD = "metrics.json"  # a run dir's record (mhalab.train.record), naming the checkpoint its test used


def tested_checkpoint(run_dir: Path) -> Path:
    """The checkpoint a finished run was tested with; beside the run dir's checkpoints/ if the run was moved."""
    rec = json.loads((run_dir / RECORD).read_text())
    best = (rec.get("best") or {}).get("checkpoint")
    if rec.get("status") != "finished" or not best:
        raise CheckpointError(f"run {run_dir} has not finished (status: {rec.get('status')}); let it finish, or "
                              f"pass one of its .ckpt files to use it as it is.")
    here = run_dir / checkpoint.CHECKPOINT_DIR / Path(best).name
    return here if here.is_file() else checkpoint.resolve(best)


def members(runs: list[str]) -> tuple[list[Path], list[Path]]:
    """(checkpoints, skipped run dirs). Each entry of `runs`: a .ckpt file, a run dir, or a sweep dir (its
    finished members, by name; unfinished ones are skipped and returned)."""
    ckpts, skipped = [], []
    for entry in runs:
        p = Path(entry)
        if p.is_file():
            ckpts.append(checkpoint.resolve(p))
        elif (p / RECORD).is_file():
            ckpts.append(tested_checkpoint(p))
        elif p.is_dir() and (found := sorted(d.parent for d in p.glob(f"*/{RECORD}"))):
            for run_dir in found:
                try:
                    ckpts.append(tested_checkpoint(run_dir))
                except CheckpointError:
                    skipped.append(run_dir)
        else:
            raise CheckpointError(f"runs: {entry} is not a .ckpt file, a run dir (with {RECORD}) or a sweep dir "
                                  f"(run dirs inside); pass runs=<sweep dir> or runs=[<run dir>,...].")
    if len(ckpts) < 2:
        raise ConfigError(f"an ensemble needs 2 or more finished runs; {', '.join(map(str, runs))} gave "
                          f"{len(ckpts)}{f' ({len(skipped)} unfinished)' if skipped else ''}.")
    return ckpts, skipped


def score(ckpts: list[Path], split: str = "test", data_dir: str | None = None, batch_size: int = 64,
          device: str = "cpu") -> dict:
    """{split, examples, members: [{checkpoint, acc}], member_mean_acc, <split>/acc, <split>/f1, <split>/loss}:
    every member's accuracy, and the averaged probabilities' accuracy, macro-F1 and negative log-likelihood."""
    rows, names, probs, accs = None, None, [], []
    read: dict[str, tuple[list[str], list[int]]] = {}  # one read per distinct data config
    for path in ckpts:
        loaded = checkpoint.load_model(path, device)
        key = json.dumps(loaded.data, sort_keys=True, default=str)
        if key not in read:
            read[key] = datamodule_of(loaded, split, data_dir).read_splits()[split]
        texts, labels = read[key]
        if rows is None:
            rows, names, first = (texts, labels), loaded.label_names, path
        elif (texts, labels) != rows:
            raise ConfigError(f"{path} reads another {split} split than {first} ({len(texts)} vs {len(rows[0])} "
                              f"rows, or other texts: a dev hold-out follows data.seed); score the ensemble on a "
                              f"split they share (split=test), or train the members with one data.seed.")
        elif loaded.label_names != names:
            raise ConfigError(f"{path} has the classes {loaded.label_names}, {first} has {names}; an ensemble "
                              f"averages the same classes.")
        p = probabilities(loaded, texts, batch_size)  # (N, C)
        probs.append(p)
        accs.append(float((p.argmax(-1) == torch.tensor(labels)).float().mean()))
    y = torch.tensor(rows[1])
    avg = torch.stack(probs).mean(0)  # (N, C)
    return {
        "split": split, "examples": len(y),
        "members": [{"checkpoint": str(c), "acc": a} for c, a in zip(ckpts, accs)],
        "member_mean_acc": sum(accs) / len(accs),
        f"{split}/acc": float((avg.argmax(-1) == y).float().mean()),
        f"{split}/f1": float(multiclass_f1_score(avg, y, avg.shape[-1], average="macro")),
        f"{split}/loss": float(-avg.gather(1, y[:, None]).clamp_min(1e-12).log().mean()),
    }


def _short_names(names: list[str]) -> list[str]:
    """Run dir names without the key=value parts every member shares (a sweep's seeds: seed=0, seed=1, ...)."""
    parts = [n.split(",") for n in names]
    common = set.intersection(*map(set, parts))
    short = [",".join(p for p in ps if p not in common) for ps in parts]
    return short if all(short) and len(set(short)) == len(short) else names


def command(cfg: DictConfig) -> dict:
    """mhalab-ensemble: each member's accuracy and the ensemble's, as a table (and as JSON to `out`)."""
    from rich.console import Console
    from rich.table import Table

    if OmegaConf.is_missing(cfg, "runs"):
        raise ConfigError("runs is required: mhalab-ensemble runs=<a sweep dir> or 'runs=[<run dir>,<run dir>]'.")
    runs = [str(r) for r in cfg.runs] if isinstance(cfg.runs, ListConfig) else [str(cfg.runs)]
    batch_size = cfg.batch_size
    if isinstance(batch_size, bool) or not str(batch_size).isdigit() or int(batch_size) < 1:
        raise ConfigError(f"batch_size={batch_size!r} must be a positive integer, e.g. 64.")
    ckpts, skipped = members(runs)
    res = score(ckpts, str(cfg.split), cfg.data_dir, int(batch_size), str(cfg.device))
    res["skipped"] = [str(d) for d in skipped]
    split = res["split"]
    table = Table(title=f"ensemble of {len(ckpts)} on {split} ({res['examples']} examples)")
    for col in ("member", "acc"):
        table.add_column(col)
    for name, m in zip(_short_names([Path(m["checkpoint"]).parent.parent.name for m in res["members"]]),
                       res["members"]):
        table.add_row(name, f"{m['acc']:.4f}")
    table.add_row("mean of the members", f"{res['member_mean_acc']:.4f}")
    table.add_row(f"ensemble (f1 {res[f'{split}/f1']:.4f}, loss {res[f'{split}/loss']:.4f})", f"{res[f'{split}/acc']:.4f}")
    Console().print(table)
    for d in skipped:
        Console(stderr=True).print(f"skipped (not finished): {d}")
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(res, indent=2))
    return res
