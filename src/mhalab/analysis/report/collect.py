"""Find a sweep's members and read each into one row of the results table.

A multirun directory holds one member directory per job (``<multirun>/<job_num>/`` or any custom
sub-directory); a member is any directory below it that contains a ``metrics.json`` written by the
training run (searched recursively). Hydra job directories (they hold ``.hydra/config.yaml``) with no
``metrics.json`` anywhere inside are reported as ``missing`` members (the job died before writing it).

A member's *setting* is its overrides minus ``seed`` (seeds are the replicates a setting is averaged
over) and minus the keys that do not change results: Hydra's
``hydra.job.config.override_dirname.exclude_keys``, the same list that keeps them out of member dir
names. It is read from the member's own ``.hydra/hydra.yaml`` (what its run used), else from the
package's ``conf/train.yaml``: one list, in one place.

The record is read through mhalab.train.record (``record.fields``: the flat keys, the best
checkpoint's metrics, the last epoch's); the resolved config (heads, dim, layers, ff_dim, dropout, lr,
batch_size, max_epochs, max_len, seed, model.attention, model.pos, data.name; the model keys are also
looked up under config.model) falls back on ``.hydra/config.yaml``, the overrides on
``.hydra/overrides.yaml``. ``metrics.csv`` (Lightning CSV logger, in the member dir or below it)
provides the val-loss curves, and the best value when ``best`` lacks it.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mhalab.analysis.report import trained
from mhalab.analysis.report.integrity import check_rows
from mhalab.analysis.report.stats import DEFAULT_METRIC, higher_is_better
from mhalab.analysis.report.values import finite, natural_key, parse_value, run_key, to_float
from mhalab.errors import RunDirError
from mhalab.train import record
from mhalab.train.config import CONF_DIR
from mhalab.train.record import extent

log = logging.getLogger(__name__)

RESULTS_CSV = "results.csv"  # a sweep's per-member table (write_report writes it; a continued sweep reads it back)

# results.csv: the columns of the brief first, then extras.
RESULT_COLUMNS = [
    "member", "overrides", "setting", "seed", "params", "best_val_acc", "test_acc", "epochs",
    "wall_time_s", "tokens_per_s", "status", "error",
    "monitored", "best_val_loss", "best_epoch", "final_val_acc", "test_f1", "test_loss", "global_step",
    "padding_fraction", "dim", "heads", "head_dim", "layers", "ff_dim", "ff_ratio", "dropout", "lr",
    "batch_size", "max_epochs", "max_len", "dataset", "data_files", "train_size", "val_size", "test_size",
    "attention", "pos", "init_draw", "dropout_draw", "device",
    "val_majority_acc", "val_classes_predicted", *trained.COLUMNS,
]


class NoMembersError(RunDirError, FileNotFoundError):
    """The directory holds no metrics.json at any depth (or is not a directory)."""


# --------------------------------------------------------------------------------------------------
# overrides -> setting


def _load_yaml(path: Path) -> Any:
    try:
        import yaml

        with open(path) as f:
            return yaml.safe_load(f)
    except Exception:  # noqa: BLE001 -- optional metadata
        return None


def _exclude_keys(hydra_cfg: Any) -> list[str] | None:
    try:
        keys = hydra_cfg["hydra"]["job"]["config"]["override_dirname"]["exclude_keys"]
    except (KeyError, TypeError):
        return None
    return [str(k) for k in keys] if isinstance(keys, list) else None


@functools.cache
def default_non_result_keys() -> tuple[str, ...]:
    """exclude_keys of the package's conf/train.yaml (for members without a .hydra/hydra.yaml)."""
    return tuple(_exclude_keys(_load_yaml(CONF_DIR / "train.yaml")) or ())


def non_result_keys(member_dir: Path) -> tuple[str, ...]:
    """The override keys that do not change results, as the member's run had them."""
    own = _exclude_keys(_load_yaml(member_dir / ".hydra" / "hydra.yaml"))
    return tuple(own) if own is not None else default_non_result_keys()


def _override_key(override: str) -> str:
    """Hydra's key of an override: '+model@x=y' -> 'model' (what exclude_keys is matched against)."""
    return override.split("=", 1)[0].strip().lstrip("+~").split("@", 1)[0]


def setting_of(overrides: Iterable[str], skip: Iterable[str] | None = None) -> str:
    """The swept setting: the overrides minus seed and the keys in skip (default: conf/train.yaml's)."""
    skip = set(default_non_result_keys() if skip is None else skip) | {"seed"}
    kept = [o for o in overrides if _override_key(o) not in skip]
    return " ".join(kept) if kept else "(default)"


def parse_setting(setting: str) -> dict[str, Any]:
    if setting == "(default)":
        return {}
    out: dict[str, Any] = {}
    for tok in setting.split(" "):
        if "=" in tok:
            k, v = tok.split("=", 1)
            out[k.lstrip("+~")] = parse_value(v)
    return out


def _cfg_get(cfg: dict, *names: str) -> Any:
    """Look a key up at the top of the config, then under config.model."""
    if not isinstance(cfg, dict):
        return None
    model = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
    for scope in (cfg, model):
        for n in names:
            if scope.get(n) is not None:
                return scope[n]
    return None


# --------------------------------------------------------------------------------------------------
# discovery and loading


def find_member_dirs(root: str | Path) -> list[Path]:
    """Directories under root (root included) that hold a metrics.json, in natural order."""
    root = Path(root)
    dirs = {p.parent for p in root.rglob(record.FILE) if p.is_file()}
    return sorted(dirs, key=lambda d: natural_key(str(d.relative_to(root))))


def _find_missing_hydra_jobs(root: Path, members: list[Path]) -> list[Path]:
    """Hydra job dirs (with .hydra/config.yaml) that have no metrics.json at any depth."""
    out = []
    for cfg in root.rglob(".hydra/config.yaml"):
        job = cfg.parent.parent
        if not any(m == job or job in m.parents for m in members):
            out.append(job)
    return sorted(set(out), key=lambda d: natural_key(str(d.relative_to(root))))


def find_metrics_csv(member_dir: Path) -> Path | None:
    direct = member_dir / "metrics.csv"
    if direct.is_file():
        return direct
    found = [p for p in member_dir.rglob("metrics.csv") if p.is_file()]
    if not found:
        return None
    return max(found, key=lambda p: p.stat().st_mtime)


def read_metrics_csv(path: Path | None) -> pd.DataFrame | None:
    if path is None:
        return None
    try:
        return pd.read_csv(path)
    except Exception as exc:  # noqa: BLE001 -- a broken log must not break the report
        log.warning("cannot read %s: %s", path, exc)
        return None


def training_val_rows(csv: pd.DataFrame, epochs: float = math.nan) -> pd.DataFrame:
    """The rows of a Lightning CSV log with a val/loss logged during fit.

    The evaluation of the best checkpoint after fit (trainer.validate) is logged too, at the last
    step again and at epoch = current_epoch (= epochs completed): such rows are dropped (a repeated
    step keeps its first row; epoch >= epochs is dropped when the number of epochs is known).
    """
    v = csv[pd.to_numeric(csv["val/loss"], errors="coerce").notna()]
    if "step" in v.columns:
        v = v[~(v["step"].duplicated(keep="first") & v["step"].notna())]
    if finite(epochs) and "epoch" in v.columns:
        kept = v[~(pd.to_numeric(v["epoch"], errors="coerce") >= epochs)]
        if not kept.empty:
            v = kept
    return v


def _best_from_csv(csv: pd.DataFrame | None, metric: str) -> float:
    if csv is None or metric not in csv.columns:
        return math.nan
    col = pd.to_numeric(csv[metric], errors="coerce").dropna()
    if col.empty:
        return math.nan
    return float(col.max() if higher_is_better(metric) else col.min())


def load_member(member_dir: Path, root: Path, metric: str = DEFAULT_METRIC) -> dict:
    """One results row (plus the private '_csv' path) for a member directory."""
    rel = str(member_dir.relative_to(root)) if member_dir != root else "."
    row: dict[str, Any] = {c: None for c in RESULT_COLUMNS}
    row["member"] = rel
    data: dict = {}
    if record.path(member_dir).is_file():
        try:
            data = record.read(member_dir)
        except ValueError as exc:
            row["status"] = "unreadable"
            row["error"] = f"cannot parse metrics.json: {exc}"
    else:
        row["status"] = "missing"
        row["error"] = "no metrics.json (the job stopped before the training run wrote it)"
    rec = record.fields(member_dir, data)

    cfg = rec["config"] if isinstance(rec["config"], dict) else {}
    if not cfg:  # fall back on Hydra's own record of the job
        hydra_cfg = _load_yaml(member_dir / ".hydra" / "config.yaml")
        cfg = hydra_cfg if isinstance(hydra_cfg, dict) else {}

    overrides = rec["overrides"]
    if not isinstance(overrides, list):
        hydra_ov = _load_yaml(member_dir / ".hydra" / "overrides.yaml")
        overrides = hydra_ov if isinstance(hydra_ov, list) else []
    overrides = [str(o) for o in overrides]
    row["overrides"] = " ".join(overrides)
    row["setting"] = setting_of(overrides, non_result_keys(member_dir))

    seed = rec["seed"] if rec["seed"] is not None else cfg.get("seed")
    if seed is None:
        for o in overrides:
            if _override_key(o) == "seed" and "=" in o:
                seed = parse_value(o.split("=", 1)[1])
    row["seed"] = seed

    if row["status"] is None:
        row["status"] = rec["status"]  # "running" with no live process is "dead"
        err = str(rec["error"]).strip() if rec["error"] is not None else ""
        row["error"] = err.splitlines()[0] if err else None

    best, last = rec["best"], rec["last_epoch"]
    csv_path = find_metrics_csv(member_dir)
    csv = None

    def best_of(name: str) -> float:
        nonlocal csv
        v = to_float(best.get(name))
        if math.isnan(v):
            if csv is None:
                csv = read_metrics_csv(csv_path)
            v = _best_from_csv(csv, name)
        return v

    row["monitored"] = best_of(metric)
    row["best_val_acc"] = best_of("val/acc")
    row["best_val_loss"] = best_of("val/loss")
    row["best_epoch"] = best.get("epoch")
    row["final_val_acc"] = to_float(last.get("val/acc"))  # the last epoch's
    row["test_acc"] = to_float(best.get("test/acc"))
    row["test_f1"] = to_float(best.get("test/f1"))
    row["test_loss"] = to_float(best.get("test/loss"))
    for k in ("params", "epochs", "global_step", "wall_time_s", "tokens_per_s", "padding_fraction", "device"):
        row[k] = rec[k]

    row["dim"] = to_float(_cfg_get(cfg, "dim", "embed_dim", "d_model"))
    row["heads"] = to_float(_cfg_get(cfg, "heads", "num_heads", "n_heads"))
    row["layers"] = to_float(_cfg_get(cfg, "layers", "num_layers", "n_layers"))
    row["ff_dim"] = to_float(_cfg_get(cfg, "ff_dim", "dim_feedforward"))
    row["dropout"] = to_float(_cfg_get(cfg, "dropout"))
    row["lr"] = to_float(_cfg_get(cfg, "lr"))
    row["batch_size"] = to_float(_cfg_get(cfg, "batch_size"))
    row["max_epochs"] = to_float(_cfg_get(cfg, "max_epochs"))
    row["max_len"] = to_float(_cfg_get(cfg, "max_len"))
    built = rec["model"] if isinstance(rec["model"], dict) else {}  # the shape as built (records since head_dim)
    head_dim = to_float(built.get("head_dim", _cfg_get(cfg, "head_dim")))  # model.head_dim; null: dim / heads
    row["head_dim"] = head_dim if finite(head_dim) else (row["dim"] / row["heads"] if row["heads"] and row["heads"] > 0
                                                         else math.nan)
    row["ff_ratio"] = row["ff_dim"] / row["dim"] if row["dim"] and row["dim"] > 0 else math.nan
    data_cfg = cfg.get("data") if isinstance(cfg.get("data"), dict) else {}
    resolved = rec["data"] if isinstance(rec["data"], dict) else {}  # data=files: the name and files it found
    row["dataset"] = resolved.get("name") or data_cfg.get("name")
    if isinstance(files := resolved.get("files"), dict):  # the files' names only: a report names no machine's path
        row["data_files"] = " ".join(f"{k}={Path(str(v)).name}" for k, v in files.items() if v)
    sizes = ((rec["trained"] or {}) if isinstance(rec["trained"], dict) else {}).get("split_sizes") or {}
    row["train_size"], row["val_size"], row["test_size"] = (sizes.get(s) for s in ("train", "validation", "test"))
    row["attention"] = _cfg_get(cfg, "attention")
    row["pos"] = _cfg_get(cfg, "pos")
    # how its random numbers were drawn (a run recorded before these keys drew PyTorch's way)
    row["init_draw"] = _cfg_get(cfg, "init_draw") or "torch"
    row["dropout_draw"] = _cfg_get(cfg, "dropout_draw") or "torch"
    # did it learn? the validation split's majority-class share, and how many classes the best checkpoint predicts
    confusion = ((data.get("classes") or {}).get("validation") or {}).get("confusion")
    if confusion:
        cm = np.asarray(confusion, dtype=float)  # rows: true class, columns: predicted
        row["val_majority_acc"] = float(cm.sum(1).max() / max(cm.sum(), 1.0))
        row["val_classes_predicted"] = int((cm.sum(0) > 0).sum())
    # what it trained and evaluated against its plan (mhalab.train.record.extent), for the rule of report.trained
    ran = rec["trained"] if isinstance(rec["trained"], dict) else {}
    if ran:
        row["planned_steps"], row["stopped_early"] = ran.get("planned_steps"), bool(ran.get("stopped_early"))
        row["steps_per_epoch"] = ran.get("steps_per_epoch")
        for split in ("train", "val", "test"):
            limit = ran.get(f"limit_{split}_batches")  # as text: the int 1 (a batch) is not the float 1.0 (all)
            row[f"limit_{split}_batches"] = None if limit is None else str(limit)
        row["val_evaluated"] = extent.evaluated_fraction(ran, "validation")
        row["test_evaluated"] = extent.evaluated_fraction(ran, "test")
    if csv is None:
        csv = read_metrics_csv(csv_path)
    if csv is not None and metric in csv.columns and "val/loss" in csv.columns:
        values = pd.to_numeric(training_val_rows(csv, to_float(row["epochs"]))[metric], errors="coerce").dropna()
        row["validations"] = len(values)
        row["monitored_gain"] = trained.recent_gain(values.tolist(), higher_is_better(metric))
    row["_csv"] = str(csv_path) if csv_path else None
    return row


def collect_results(multirun_dir: str | Path, metric: str = DEFAULT_METRIC) -> pd.DataFrame:
    """All members of a multirun dir as a DataFrame (RESULT_COLUMNS plus private '_csv')."""
    root = Path(multirun_dir)
    if not root.is_dir():
        raise NoMembersError(f"{root} is not a directory: give the sweep dir (hydra.sweep.dir of a multirun)")
    members = find_member_dirs(root)
    if not members:
        raise NoMembersError(
            f"no metrics.json found under {root} (searched recursively): not a multirun directory of "
            "mhalab training runs, or no job got as far as writing its metrics"
        )
    dirs = sorted(members + _find_missing_hydra_jobs(root, members),
                  key=lambda d: natural_key(str(d.relative_to(root))))
    df = pd.DataFrame([load_member(d, root, metric) for d in dirs])
    if (root / RESULTS_CSV).is_file():  # a sweep continued from a copy: members whose dirs are gone count too
        gone = _csv_rows(root / RESULTS_CSV, metric)
        have = {run_key(s, seed) for s, seed in zip(df["setting"], df["seed"])}
        gone = gone[[not (root / str(m)).is_dir() and run_key(s, seed) not in have
                     for m, s, seed in zip(gone["member"], gone["setting"], gone["seed"])]]
        if len(gone):
            df = pd.concat([df, gone.assign(_csv=None)], ignore_index=True)
    csv_rows = len(df) - len(dirs)
    df["setting"], common = without_common(df["setting"])
    df = df.reindex(columns=RESULT_COLUMNS + ["_csv", "_line"])
    df.attrs["common"] = common  # what every member was run with: the report says it once
    df.attrs["csv_rows"] = csv_rows  # rows read from results.csv: the report says how many
    return df


# the results.csv column that holds each metric a report can be re-written for from it alone
CSV_MONITORED = {"val/acc": "best_val_acc", "val/loss": "best_val_loss"}


def read_sweep(root: Path, metric: str = DEFAULT_METRIC) -> tuple[pd.DataFrame, bool]:
    """(the results table, whether it came from results.csv alone): collect_results, or, for a dir whose members are
    all gone (a copy under results/, or a sweep to be continued from one), its results.csv; checked and normalised
    by integrity.check_rows before anything reads it (what it normalised: the table's attrs["notes"])."""
    try:
        df, from_csv = collect_results(root, metric), False
    except NoMembersError:
        if not (root / RESULTS_CSV).is_file():
            raise
        df, from_csv = results_from_csv(root / RESULTS_CSV, metric), True
    return check_rows(df, metric), from_csv


def results_from_csv(path: Path, metric: str = DEFAULT_METRIC) -> pd.DataFrame:
    """A results.csv (what write_report wrote) as collect_results gives it, for a sweep whose member dirs are gone
    (a copy under results/): settings recomputed from each row's overrides with conf/train.yaml's keys that do not
    change results, columns added since it was written left empty. metric: one the file holds (CSV_MONITORED)."""
    df = _csv_rows(path, metric)
    df["setting"], common = without_common(df["setting"])
    df = df[RESULT_COLUMNS + ["_line"]].assign(_csv=None)
    df.attrs.update(common=common, from_csv=True)
    return df


def _csv_rows(path: Path, metric: str) -> pd.DataFrame:
    """results_from_csv's rows, each setting whole (shared overrides not yet taken out)."""
    if metric not in CSV_MONITORED:
        raise NoMembersError(f"{path.parent} has no member dirs, and its {path.name} holds only "
                             f"{', '.join(CSV_MONITORED)}: metric={metric} needs the members' metrics")
    df = pd.read_csv(path, dtype={"member": str, "overrides": str, "setting": str, "status": str, "error": str,
                                  **{f"limit_{s}_batches": str for s in ("train", "val", "test")}})
    for c in RESULT_COLUMNS:
        if c not in df:
            df[c] = np.nan
    # every row written before the column drew its initial weights PyTorch's way: said, so that integrity refuses a
    # setting that pools them with keyed rows (dropout_draw stays empty: rows of 2026-12-07 drew 16-bit masks unsaid)
    df["init_draw"] = df["init_draw"].fillna("torch")
    if not np.allclose(pd.to_numeric(df["monitored"], errors="coerce"),
                       pd.to_numeric(df[CSV_MONITORED[metric]], errors="coerce"), equal_nan=True):
        df["monitored_gain"] = np.nan  # written for another metric: its gains are that metric's
    df["monitored"] = pd.to_numeric(df[CSV_MONITORED[metric]], errors="coerce")
    df["setting"] = [setting_of(str(o).split(" ")) if isinstance(o, str) and o else s
                     for o, s in zip(df["overrides"], df["setting"])]
    df["_line"] = df.index + 2  # the row's line in the file (the header is line 1): what an error names
    return df[RESULT_COLUMNS + ["_line"]]


def without_common(settings: pd.Series) -> tuple[pd.Series, list[str]]:
    """Settings without the overrides every member shares (`heads=2`, not `++trainer.limit_train_batches=20 ...
    heads=2`), and those shared overrides. A sweep of one setting keeps its label whole."""
    words = [[] if s == "(default)" else str(s).split(" ") for s in settings]
    if len(set(settings)) < 2:
        return settings, []
    common = [w for w in words[0] if all(w in ws for ws in words[1:])]
    kept = [" ".join(w for w in ws if w not in common) or "(default)" for ws in words]
    return pd.Series(kept, index=settings.index), common
