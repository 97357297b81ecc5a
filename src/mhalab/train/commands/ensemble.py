"""An ensemble of trained runs, scored on one split: mhalab-ensemble.

    mhalab-ensemble runs=multirun/<sweep> [size=3] [split=test] [out=ensemble.json]
    mhalab-ensemble 'runs=[outputs/<run a>,outputs/<run b>]'

The members' class probabilities are averaged, example by example, and the average's arg-max is the
ensemble's answer (the "averaging" ensemble of Dietterich 2000; seeds are the cheapest source of members).
Each member is a run's tested checkpoint (metrics.json's best.checkpoint: the one its test figures are of)
and encodes the texts with its own tokenizer, so members trained on different hold-outs or tokenizers
combine; they must agree on the split's rows and the label names. Needs nothing but the run dirs and
the data files, as mhalab-eval. size=k scores every k consecutive members (in seed order) as one
ensemble and reports the ensembles' mean with a 95% t-interval: 9 seeds give 3 ensembles of 3.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from scipy import stats
from torchmetrics.functional.classification import multiclass_f1_score

from mhalab.errors import CheckpointError, ConfigError
from mhalab.train import checkpoint, record
from mhalab.train.commands.evaluate import datamodule_of
from mhalab.train.commands.predict import probabilities


def members(runs: list[str]) -> tuple[list[Path], list[Path]]:
    """(checkpoints, skipped run dirs). Each entry of `runs`: a .ckpt file, a run dir, or a sweep dir (its
    finished members in seed order; unfinished ones are skipped and returned)."""
    ckpts, skipped = [], []
    for entry in runs:
        p = Path(entry)
        if p.is_file():
            ckpts.append(checkpoint.resolve(p))
        elif (p / record.FILE).is_file():
            ckpts.append(checkpoint.best_checkpoint(p))
        elif p.is_dir() and (found := [d.parent for d in p.glob(f"*/{record.FILE}")]):
            for run_dir in sorted(found, key=lambda d: (_seed(d), d.name)):
                try:
                    ckpts.append(checkpoint.best_checkpoint(run_dir))
                except CheckpointError:
                    skipped.append(run_dir)
        else:
            raise CheckpointError(f"runs: {entry} is not a .ckpt file, a run dir (with {record.FILE}) or a sweep dir "
                                  f"(run dirs inside); pass runs=<sweep dir> or runs=[<run dir>,...].")
    if len(ckpts) < 2:
        raise ConfigError(f"an ensemble needs 2 or more finished runs; {', '.join(map(str, runs))} gave "
                          f"{len(ckpts)}{f' ({len(skipped)} unfinished)' if skipped else ''}.")
    return ckpts, skipped


def _seed(run_dir: Path) -> int:
    try:
        seed = (record.read(run_dir) or {}).get("seed")
    except ValueError:  # unreadable: best_checkpoint says so
        seed = None
    return seed if isinstance(seed, int) else -1


def member_probs(ckpts: list[Path], split: str = "test", data_dir: str | None = None, batch_size: int = 64,
                 device: str = "cpu") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(labels (N,), each member's class probabilities (N, C)) on the split's rows, in the data file's order."""
    rows, names, probs = None, None, []
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
        probs.append(probabilities(loaded, texts, batch_size))
    return torch.tensor(rows[1]), probs


def _scores(probs: torch.Tensor, y: torch.Tensor) -> dict:
    """acc, macro f1 and the negative log-likelihood of (N, C) probabilities."""
    return {"acc": float((probs.argmax(-1) == y).float().mean()),
            "f1": float(multiclass_f1_score(probs, y, probs.shape[-1], average="macro")),
            "loss": float(-probs.gather(1, y[:, None]).clamp_min(1e-12).log().mean())}


def _mean_ci(values: list[float]) -> dict:
    """mean and its two-sided 95% t-interval (none for one value)."""
    mean = float(np.mean(values))
    if len(values) < 2:
        return {"mean": mean, "ci": None}
    low, high = stats.t.interval(0.95, len(values) - 1, loc=mean, scale=stats.sem(values))
    return {"mean": mean, "ci": [float(low), float(high)]}


def score(ckpts: list[Path], split: str = "test", data_dir: str | None = None, batch_size: int = 64,
          device: str = "cpu", size: int | None = None) -> dict:
    """Each member's accuracy; the ensemble of them all, or (size=k) of each k consecutive members (a sweep's
    seeds 0..k-1, k..2k-1, ...; a remainder under k is left out). Per ensemble: acc, f1, loss (the averaged
    probabilities' NLL), the mean accuracy of its members and the gain over it; over the ensembles: the means,
    with 95% t-intervals (`<split>/acc`, `<split>/f1`, `<split>/loss`: the ensembles' means); `all`: the ensemble
    of every member, from the same probabilities (with size=k, what a second call without size would score)."""
    y, probs = member_probs(ckpts, split, data_dir, batch_size, device)
    accs = [_scores(p, y)["acc"] for p in probs]
    k = size or len(ckpts)
    groups = [list(range(i, i + k)) for i in range(0, len(ckpts) - k + 1, k)]
    ensembles = []
    for g in groups:
        e = _scores(torch.stack([probs[i] for i in g]).mean(0), y)  # the average of (N, C): (N, C)
        mean_members = sum(accs[i] for i in g) / len(g)
        ensembles.append({"members": g, **e, "member_mean_acc": mean_members, "gain": e["acc"] - mean_members})
    everyone, mean_acc = _scores(torch.stack(probs).mean(0), y), sum(accs) / len(accs)  # (M, N, C) -> (N, C)
    return {
        "split": split, "examples": len(y), "size": k,
        "members": [{"checkpoint": str(c), "acc": a} for c, a in zip(ckpts, accs)],
        "left_out": list(range(len(groups) * k, len(ckpts))),
        "ensembles": ensembles,
        "member_acc": _mean_ci(accs), "member_mean_acc": mean_acc,
        "ensemble_acc": _mean_ci([e["acc"] for e in ensembles]),
        "gain": _mean_ci([e["gain"] for e in ensembles]),
        "all": {**everyone, "member_mean_acc": mean_acc, "gain": everyone["acc"] - mean_acc},
        **{f"{split}/{m}": float(np.mean([e[m] for e in ensembles])) for m in ("acc", "f1", "loss")},
    }


def member_names(ckpts: list[Path]) -> list[str]:
    """A label per member: its run's overrides (from the run record: a long run dir name is cut and hashed) less
    those every member shares, e.g. seed=0, seed=1, ...; the checkpoint's path where that does not tell them apart."""
    def overrides(ckpt: Path) -> list[str]:
        try:
            rec = record.read(ckpt.parent.parent) or {}
        except ValueError:
            rec = {}
        return [str(o) for o in rec.get("overrides") or []] or [str(ckpt)]

    parts = [overrides(Path(c)) for c in ckpts]
    common = set.intersection(*map(set, parts))
    short = [",".join(p for p in ps if p not in common) for ps in parts]
    return short if all(short) and len(set(short)) == len(short) else [str(c) for c in ckpts]


def _pct(stat: dict, sign: str = "") -> str:
    ci = f" [{100 * stat['ci'][0]:{sign}.1f}, {100 * stat['ci'][1]:{sign}.1f}]" if stat["ci"] else ""
    return f"{100 * stat['mean']:{sign}.1f}{ci}"


def command(cfg: DictConfig) -> dict:
    """mhalab-ensemble: each member's accuracy and each ensemble's, as tables (and as JSON to `out`)."""
    from rich.console import Console
    from rich.table import Table

    if OmegaConf.is_missing(cfg, "runs"):
        raise ConfigError("runs is required: mhalab-ensemble runs=<a sweep dir> or 'runs=[<run dir>,<run dir>]'.")
    runs = [str(r) for r in cfg.runs] if isinstance(cfg.runs, ListConfig) else [str(cfg.runs)]
    batch_size = cfg.batch_size
    if isinstance(batch_size, bool) or not str(batch_size).isdigit() or int(batch_size) < 1:
        raise ConfigError(f"batch_size={batch_size!r} must be a positive integer, e.g. 64.")
    ckpts, skipped = members(runs)
    size = cfg.size
    if size is not None and (isinstance(size, bool) or not str(size).isdigit() or not 2 <= int(size) <= len(ckpts)):
        raise ConfigError(f"size={size!r} must be an integer from 2 to the {len(ckpts)} finished members "
                          f"(or null: one ensemble of them all).")
    res = score(ckpts, str(cfg.split), cfg.data_dir, int(batch_size), str(cfg.device), int(size) if size else None)
    res["skipped"] = [str(d) for d in skipped]
    split, names = res["split"], member_names(ckpts)
    console = Console()
    members_table = Table(title=f"{len(ckpts)} members on {split} ({res['examples']} examples)")
    for col in ("member", "acc"):
        members_table.add_column(col)
    for name, m in zip(names, res["members"]):
        members_table.add_row(name, f"{100 * m['acc']:.1f}")
    console.print(members_table)
    table = Table(title=f"ensembles of {res['size']} (averaged class probabilities)")
    for col in ("members", "acc", "f1", "loss", "members' mean acc", "gain"):
        table.add_column(col)
    for e in res["ensembles"]:
        table.add_row(" ".join(names[i] for i in e["members"]), f"{100 * e['acc']:.1f}", f"{100 * e['f1']:.1f}",
                      f"{e['loss']:.4f}", f"{100 * e['member_mean_acc']:.1f}", f"{100 * e['gain']:+.1f}")
    console.print(table)
    console.print(f"{split} accuracy, mean [95% t-interval]: ensembles {_pct(res['ensemble_acc'])} "
                  f"({len(res['ensembles'])}), single members {_pct(res['member_acc'])} ({len(ckpts)}), gain "
                  f"{_pct(res['gain'], '+')} points" + (f"; members left out: {res['left_out']}" if res["left_out"] else ""))
    if len(res["ensembles"]) > 1 or res["left_out"]:
        console.print(f"one ensemble of all {len(ckpts)} members: {split} acc {100 * res['all']['acc']:.1f}, gain "
                      f"{100 * res['all']['gain']:+.1f} points over their mean")
    for d in skipped:
        Console(stderr=True).print(f"skipped (not finished): {d}")
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(res, indent=2))
    return res
