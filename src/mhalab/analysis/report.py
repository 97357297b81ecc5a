"""Sweep report: turn a Hydra multirun directory into tables, plots and verdicts.

A multirun directory holds one member directory per job (``<multirun>/<job_num>/`` or any custom
sub-directory); a member is any directory below it that contains a ``metrics.json`` written by the
training run (searched recursively). Hydra job directories (they hold ``.hydra/config.yaml``) with no
``metrics.json`` anywhere inside are reported as ``missing`` members (the job died before writing it).

``write_report(multirun_dir, metric="val/acc")`` writes into the multirun directory:

* ``results.csv`` -- one row per member (member dir, overrides, setting = overrides minus ``seed``,
  seed, params, best val acc, test acc, epochs, wall time, tokens/s, status, error, then extras).
* ``report.md`` -- scale measured, per-setting mean +- std over seeds, best setting, verdicts on the
  article's claims, failed members with reasons, links to the plots.
* ``val_loss_curves.png``, ``acc_vs_swept.png``, ``acc_vs_wall_time.png``.

Selection rule
--------------
The best setting is the one with the best *mean over seeds* of the monitored metric (``best[metric]``
in ``metrics.json``: the best validation value over epochs). The monitored metric must not be a test
metric (ValueError): the test columns are reported, never used to choose. Only members with
``status == "finished"`` and a finite monitored value enter any statistic.

Verdict rule (the same for every claim)
---------------------------------------
For a claim the sweep covers, the finished members are split into the *claimed* group and one group
per *alternative*; each member contributes its own monitored value (one value per seed and setting;
other swept variables are pooled, i.e. these are marginal means).

* ``best alternative`` = the alternative group with the best mean (max for accuracy-like metrics,
  min for losses) -- selecting the best of several alternatives makes the test conservative for the
  claim.
* ``effect = mean(claimed) - mean(best alternative)``, signed so that > 0 means the claimed group is
  better (for a loss metric the sign is flipped). Reported in points (x100) for accuracy-like metrics.
* ``SE = sqrt(s_c^2/n_c + s_a^2/n_a)`` with ``s`` the std over the group's values (ddof=1) and ``n``
  their count: the standard error of the difference of the two means. ``threshold = 2 * SE``.
* **supported** when ``effect > threshold``; **not supported** when ``effect < -threshold``;
  **inconclusive** otherwise (the difference is within seed noise), and always inconclusive when
  either compared group has fewer than 2 distinct seeds (the noise cannot be measured) or is empty.
* ``seed spread`` reported alongside = the pooled within-group std of the two groups.

Claims and their groups (a claim is *covered* only when its variable varies across the sweep):

* ``head_dim not below 64``: head_dim = dim/heads takes values on both sides of 64;
  claimed = members with head_dim >= 64, alternative = members with head_dim < 64 (one pooled group).
* ``8 or 16 heads``: heads varies and includes 8 or 16 and some other value;
  claimed = heads in {8, 16} (pooled), alternatives = each other heads value.
* ``ff_dim = 4 x embed_dim``: the ratio ff_dim/dim varies and includes 4;
  claimed = ratio 4, alternatives = each other ratio.
* ``dropout 0.1``: dropout varies and includes 0.1; claimed = 0.1, alternatives = each other value.
* ``wider embed_dim is better``: dim varies; claimed = the widest dim of the sweep, alternatives = each
  narrower dim (so "supported" means the widest is clearly best, not merely better than the narrowest).

metrics.json keys read (all optional): status, error, overrides, seed, config (heads, dim, layers,
ff_dim, dropout, lr, batch_size, max_epochs, max_len, seed, model.attention, model.pos, data.name; the
model keys are also looked up under config.model), params, epochs, global_step, wall_time_s,
tokens_per_s, padding_fraction, best (the monitored metric, val/acc, val/loss, epoch), final
(val/acc, test/acc, test/f1, test/loss), device. ``metrics.csv`` (Lightning CSV logger, in the member
dir or below it) provides the val-loss curves, and the best value when ``best`` lacks it.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mhalab.train import record

log = logging.getLogger(__name__)

DEFAULT_METRIC = "val/acc"
SIGMA = 2.0  # verdict threshold = SIGMA * standard error of the difference of group means
MIN_SEEDS = 2  # fewer distinct seeds in a compared group -> inconclusive

SUPPORTED = "supported"
NOT_SUPPORTED = "not supported"
INCONCLUSIVE = "inconclusive"
NOT_COVERED = "not covered"

RESULTS_CSV = "results.csv"
REPORT_MD = "report.md"
PLOT_VAL_LOSS = "val_loss_curves.png"
PLOT_ACC_VS_SWEPT = "acc_vs_swept.png"
PLOT_ACC_VS_WALL = "acc_vs_wall_time.png"

# results.csv: the columns of the brief first, then extras.
RESULT_COLUMNS = [
    "member", "overrides", "setting", "seed", "params", "best_val_acc", "test_acc", "epochs",
    "wall_time_s", "tokens_per_s", "status", "error",
    "monitored", "best_val_loss", "best_epoch", "final_val_acc", "test_f1", "test_loss", "global_step",
    "padding_fraction", "dim", "heads", "head_dim", "layers", "ff_dim", "ff_ratio", "dropout", "lr",
    "batch_size", "max_epochs", "max_len", "dataset", "attention", "pos", "device",
]


class NoMembersError(FileNotFoundError):
    """The directory holds no metrics.json at any depth."""


# --------------------------------------------------------------------------------------------------
# small helpers


def higher_is_better(metric: str) -> bool:
    m = metric.lower()
    return not any(word in m for word in ("loss", "err", "perplexity", "ppl", "nll"))


def _points_scale(metric: str) -> tuple[float, str]:
    """Accuracy-like metrics are shown in points (x100)."""
    m = metric.lower()
    if any(word in m for word in ("acc", "f1", "precision", "recall", "auc")):
        return 100.0, " pts"
    return 1.0, ""


def _float(x: Any) -> float:
    if x is None or isinstance(x, bool):
        return math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and math.isfinite(float(x))


def _natural_key(text: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def _parse_value(text: str) -> Any:
    """'4' -> 4, '0.1' -> 0.1, 'full' -> 'full'."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _override_key(override: str) -> str:
    key = override.split("=", 1)[0].strip()
    return key.lstrip("+~")


def _is_seed_override(override: str) -> bool:
    return _override_key(override) == "seed"


def setting_of(overrides: Iterable[str]) -> str:
    """The swept setting: the overrides minus seed (and hydra.* ones), space-joined."""
    # the preset's own name (sweep=heads) and launch settings say nothing about the setting itself
    skip = ("sweep", "hparams_search", "hydra/launcher", "trainer", "logger", "debug")
    kept = [o for o in overrides if not _is_seed_override(o) and not _override_key(o).startswith("hydra.")
            and _override_key(o).lstrip("+~") not in skip and not _override_key(o).startswith("paths.")]
    return " ".join(kept) if kept else "(default)"


def parse_setting(setting: str) -> dict[str, Any]:
    if setting == "(default)":
        return {}
    out: dict[str, Any] = {}
    for tok in setting.split(" "):
        if "=" in tok:
            k, v = tok.split("=", 1)
            out[k.lstrip("+~")] = _parse_value(v)
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


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


# --------------------------------------------------------------------------------------------------
# discovery and loading


def find_member_dirs(root: str | Path) -> list[Path]:
    """Directories under root (root included) that hold a metrics.json, in natural order."""
    root = Path(root)
    dirs = {p.parent for p in root.rglob("metrics.json") if p.is_file()}
    return sorted(dirs, key=lambda d: _natural_key(str(d.relative_to(root))))


def _find_missing_hydra_jobs(root: Path, members: list[Path]) -> list[Path]:
    """Hydra job dirs (with .hydra/config.yaml) that have no metrics.json at any depth."""
    out = []
    for cfg in root.rglob(".hydra/config.yaml"):
        job = cfg.parent.parent
        if not any(m == job or job in m.parents for m in members):
            out.append(job)
    return sorted(set(out), key=lambda d: _natural_key(str(d.relative_to(root))))


def _load_yaml(path: Path) -> Any:
    try:
        import yaml

        with open(path) as f:
            return yaml.safe_load(f)
    except Exception:  # noqa: BLE001 -- optional metadata
        return None


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
            data = {}
            row["status"] = "unreadable"
            row["error"] = f"cannot parse metrics.json: {exc}"
    else:
        row["status"] = "missing"
        row["error"] = "no metrics.json (the job stopped before the training run wrote it)"

    cfg = data.get("config") if isinstance(data.get("config"), dict) else {}
    if not cfg:  # fall back on Hydra's own record of the job
        hydra_cfg = _load_yaml(member_dir / ".hydra" / "config.yaml")
        cfg = hydra_cfg if isinstance(hydra_cfg, dict) else {}

    overrides = data.get("overrides")
    if not isinstance(overrides, list):
        hydra_ov = _load_yaml(member_dir / ".hydra" / "overrides.yaml")
        overrides = hydra_ov if isinstance(hydra_ov, list) else []
    overrides = [str(o) for o in overrides]
    row["overrides"] = " ".join(overrides)
    row["setting"] = setting_of(overrides)

    seed = data.get("seed", cfg.get("seed"))
    if seed is None:
        for o in overrides:
            if _is_seed_override(o) and "=" in o:
                seed = _parse_value(o.split("=", 1)[1])
    row["seed"] = seed

    if row["status"] is None:
        row["status"] = record.status(member_dir, data)  # "running" with no live process is "dead"
        err = data.get("error")
        row["error"] = None if err is None else str(err).strip().splitlines()[0] if str(err).strip() else None

    best = data.get("best") if isinstance(data.get("best"), dict) else {}
    final = data.get("final") if isinstance(data.get("final"), dict) else {}
    csv_path = find_metrics_csv(member_dir)
    csv = None

    def best_of(name: str) -> float:
        nonlocal csv
        v = _float(best.get(name))
        if math.isnan(v):
            if csv is None:
                csv = read_metrics_csv(csv_path)
            v = _best_from_csv(csv, name)
        return v

    row["monitored"] = best_of(metric)
    row["best_val_acc"] = best_of("val/acc")
    row["best_val_loss"] = best_of("val/loss")
    row["best_epoch"] = best.get("epoch")
    row["final_val_acc"] = _float(final.get("val/acc"))
    row["test_acc"] = _float(final.get("test/acc"))
    row["test_f1"] = _float(final.get("test/f1"))
    row["test_loss"] = _float(final.get("test/loss"))
    for k in ("params", "epochs", "global_step", "wall_time_s", "tokens_per_s", "padding_fraction", "device"):
        row[k] = data.get(k)

    row["dim"] = _float(_cfg_get(cfg, "dim", "embed_dim", "d_model"))
    row["heads"] = _float(_cfg_get(cfg, "heads", "num_heads", "n_heads"))
    row["layers"] = _float(_cfg_get(cfg, "layers", "num_layers", "n_layers"))
    row["ff_dim"] = _float(_cfg_get(cfg, "ff_dim", "dim_feedforward"))
    row["dropout"] = _float(_cfg_get(cfg, "dropout"))
    row["lr"] = _float(_cfg_get(cfg, "lr"))
    row["batch_size"] = _float(_cfg_get(cfg, "batch_size"))
    row["max_epochs"] = _float(_cfg_get(cfg, "max_epochs"))
    row["max_len"] = _float(_cfg_get(cfg, "max_len"))
    row["head_dim"] = row["dim"] / row["heads"] if row["heads"] and row["heads"] > 0 else math.nan
    row["ff_ratio"] = row["ff_dim"] / row["dim"] if row["dim"] and row["dim"] > 0 else math.nan
    data_cfg = cfg.get("data") if isinstance(cfg.get("data"), dict) else {}
    row["dataset"] = data_cfg.get("name")
    row["attention"] = _cfg_get(cfg, "attention")
    row["pos"] = _cfg_get(cfg, "pos")
    row["_csv"] = str(csv_path) if csv_path else None
    return row


def collect_results(multirun_dir: str | Path, metric: str = DEFAULT_METRIC) -> pd.DataFrame:
    """All members of a multirun dir as a DataFrame (RESULT_COLUMNS plus private '_csv')."""
    root = Path(multirun_dir)
    if not root.is_dir():
        raise NoMembersError(f"{root} is not a directory")
    members = find_member_dirs(root)
    if not members:
        raise NoMembersError(
            f"no metrics.json found under {root} (searched recursively): not a multirun directory of "
            "mhalab training runs, or no job got as far as writing its metrics"
        )
    dirs = sorted(members + _find_missing_hydra_jobs(root, members),
                  key=lambda d: _natural_key(str(d.relative_to(root))))
    df = pd.DataFrame([load_member(d, root, metric) for d in dirs])
    return df[RESULT_COLUMNS + ["_csv"]]


def valid_mask(df: pd.DataFrame) -> pd.Series:
    mon = pd.to_numeric(df["monitored"], errors="coerce")
    return (df["status"] == "finished") & np.isfinite(mon)


# --------------------------------------------------------------------------------------------------
# per-setting summary


def _std(x: pd.Series) -> float:
    x = pd.to_numeric(x, errors="coerce").dropna()
    return float(x.std(ddof=1)) if len(x) >= 2 else math.nan


def summarize_settings(df: pd.DataFrame, metric: str = DEFAULT_METRIC) -> pd.DataFrame:
    """Mean and std (ddof=1) over seeds per setting, best first (by the monitored metric)."""
    ok = valid_mask(df)
    rows = []
    for setting, g in df.groupby("setting", sort=False):
        v = g[ok.loc[g.index]]
        num = {c: pd.to_numeric(v[c], errors="coerce") for c in
               ("monitored", "best_val_acc", "test_acc", "wall_time_s", "tokens_per_s", "params")}
        rows.append({
            "setting": setting,
            "n": len(v),
            "seeds": sorted(v["seed"].dropna().tolist(), key=lambda s: _natural_key(str(s))),
            "n_failed": int((~ok.loc[g.index]).sum()),
            "monitored_mean": float(num["monitored"].mean()) if len(v) else math.nan,
            "monitored_std": _std(num["monitored"]),
            "best_val_acc_mean": float(num["best_val_acc"].mean()) if len(v) else math.nan,
            "best_val_acc_std": _std(num["best_val_acc"]),
            "test_acc_mean": float(num["test_acc"].mean()) if len(v) else math.nan,
            "test_acc_std": _std(num["test_acc"]),
            "wall_time_mean": float(num["wall_time_s"].mean()) if len(v) else math.nan,
            "tokens_per_s_mean": float(num["tokens_per_s"].mean()) if len(v) else math.nan,
            "params": float(pd.to_numeric(g["params"], errors="coerce").dropna().median())
            if pd.to_numeric(g["params"], errors="coerce").notna().any() else math.nan,
        })
    s = pd.DataFrame(rows)
    if s.empty:
        return s
    key = s["monitored_mean"] if higher_is_better(metric) else -s["monitored_mean"]
    s = s.assign(_k=key).sort_values("_k", ascending=False, na_position="last", kind="stable")
    return s.drop(columns="_k").reset_index(drop=True)


# --------------------------------------------------------------------------------------------------
# verdicts


@dataclass
class GroupStats:
    label: str
    n: int
    n_seeds: int
    mean: float
    std: float

    @classmethod
    def of(cls, label: str, sub: pd.DataFrame) -> GroupStats:
        vals = pd.to_numeric(sub["monitored"], errors="coerce").dropna().to_numpy(dtype=float)
        return cls(
            label=label,
            n=len(vals),
            n_seeds=int(sub["seed"].dropna().nunique()) if len(sub) else 0,
            mean=float(vals.mean()) if len(vals) else math.nan,
            std=float(vals.std(ddof=1)) if len(vals) >= 2 else math.nan,
        )


@dataclass
class Verdict:
    key: str
    claim: str
    variable: str
    verdict: str
    reason: str
    covered: bool
    claimed: GroupStats | None = None
    alternative: GroupStats | None = None
    others: list[GroupStats] = field(default_factory=list)
    effect: float = math.nan  # claimed minus best alternative, > 0 = claimed better, metric units
    se: float = math.nan  # standard error of the difference
    threshold: float = math.nan  # SIGMA * se
    spread: float = math.nan  # pooled within-group std of the two compared groups
    also_varies: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _fmt_num(x: float) -> str:
    if not _finite(x):
        return "?"
    return f"{x:g}"


def _group_label(var: str, value: float) -> str:
    return f"{var}={_fmt_num(value)}"


def compare_groups(claimed: pd.DataFrame, alternatives: dict[str, pd.DataFrame], metric: str,
                   claimed_label: str) -> dict:
    """The verdict rule of the module docstring, on members already restricted to valid ones."""
    sign = 1.0 if higher_is_better(metric) else -1.0
    c = GroupStats.of(claimed_label, claimed)
    alts = [GroupStats.of(label, sub) for label, sub in alternatives.items()]
    out: dict[str, Any] = {"claimed": c, "others": alts}
    with_data = [a for a in alts if a.n > 0]
    if c.n == 0 or not with_data:
        missing = claimed_label if c.n == 0 else "every alternative"
        out.update(verdict=INCONCLUSIVE, reason=f"no finished runs for {missing}")
        return out
    a = max(with_data, key=lambda g: sign * g.mean)
    out["alternative"] = a
    effect = sign * (c.mean - a.mean)
    out["effect"] = effect
    if c.n_seeds < MIN_SEEDS or a.n_seeds < MIN_SEEDS:
        out.update(verdict=INCONCLUSIVE,
                   reason=f"fewer than {MIN_SEEDS} seeds in a compared group ({c.label}: {c.n_seeds}, "
                          f"{a.label}: {a.n_seeds}): seed noise cannot be measured")
        return out
    se = math.sqrt(c.std ** 2 / c.n + a.std ** 2 / a.n)
    pooled = math.sqrt(((c.n - 1) * c.std ** 2 + (a.n - 1) * a.std ** 2) / (c.n + a.n - 2))
    threshold = SIGMA * se
    out.update(se=se, threshold=threshold, spread=pooled)
    if effect > threshold:
        out.update(verdict=SUPPORTED, reason=f"claimed group beats the best alternative by more than {SIGMA:g} SE")
    elif effect < -threshold:
        out.update(verdict=NOT_SUPPORTED,
                   reason=f"the best alternative beats the claimed group by more than {SIGMA:g} SE")
    else:
        out.update(verdict=INCONCLUSIVE, reason=f"difference within {SIGMA:g} SE (seed noise)")
    return out


def _distinct(values: Iterable[float]) -> list[float]:
    out: list[float] = []
    for v in values:
        if _finite(v) and not any(math.isclose(v, u, rel_tol=1e-9, abs_tol=1e-12) for u in out):
            out.append(float(v))
    return sorted(out)


def _by_value(valid: pd.DataFrame, var: str, values: list[float]) -> dict[str, pd.DataFrame]:
    col = pd.to_numeric(valid[var], errors="coerce")
    return {_group_label(var, v): valid[np.isclose(col, v)] for v in values}


CLAIM_VARS = ("dim", "heads", "head_dim", "ff_ratio", "dropout")


def _claim_specs() -> list[dict]:
    """key, claim text, variable, coverage test on distinct values, group builder."""

    def head_dim(vals, valid):
        col = pd.to_numeric(valid["head_dim"], errors="coerce")
        return ("head_dim >= 64", valid[col >= 64],
                {"head_dim < 64": valid[col < 64]})

    def heads(vals, valid):
        col = pd.to_numeric(valid["heads"], errors="coerce")
        claimed = valid[np.isclose(col, 8) | np.isclose(col, 16)]
        others = [v for v in vals if not (math.isclose(v, 8) or math.isclose(v, 16))]
        return "heads in {8,16}", claimed, _by_value(valid, "heads", others)

    def ff(vals, valid):
        col = pd.to_numeric(valid["ff_ratio"], errors="coerce")
        others = [v for v in vals if not math.isclose(v, 4)]
        return "ff_dim/dim=4", valid[np.isclose(col, 4)], _by_value(valid, "ff_ratio", others)

    def dropout(vals, valid):
        col = pd.to_numeric(valid["dropout"], errors="coerce")
        others = [v for v in vals if not math.isclose(v, 0.1)]
        return "dropout=0.1", valid[np.isclose(col, 0.1)], _by_value(valid, "dropout", others)

    def wider(vals, valid):
        widest = max(vals)
        col = pd.to_numeric(valid["dim"], errors="coerce")
        return (f"widest dim={_fmt_num(widest)}", valid[np.isclose(col, widest)],
                _by_value(valid, "dim", [v for v in vals if v < widest]))

    has = lambda vals, x: any(math.isclose(v, x) for v in vals)
    return [
        {"key": "head_dim_min_64", "claim": "head_dim not below 64", "variable": "head_dim",
             "covered": lambda v: len(v) > 1 and min(v) < 64 <= max(v),
             "why": "head_dim = dim/heads does not take values on both sides of 64", "groups": head_dim},
        {"key": "heads_8_or_16", "claim": "8 or 16 heads", "variable": "heads",
             "covered": lambda v: len(v) > 1 and (has(v, 8) or has(v, 16))
             and any(not (math.isclose(x, 8) or math.isclose(x, 16)) for x in v),
             "why": "heads does not vary over 8 or 16 and another value", "groups": heads},
        {"key": "ff_4x", "claim": "ff_dim = 4 x embed_dim", "variable": "ff_ratio",
             "covered": lambda v: len(v) > 1 and has(v, 4),
             "why": "ff_dim/dim does not vary over 4 and another ratio", "groups": ff},
        {"key": "dropout_0.1", "claim": "dropout 0.1", "variable": "dropout",
             "covered": lambda v: len(v) > 1 and has(v, 0.1),
             "why": "dropout does not vary over 0.1 and another value", "groups": dropout},
        {"key": "wider_dim", "claim": "wider embed_dim is better", "variable": "dim",
             "covered": lambda v: len(v) > 1, "why": "dim does not vary", "groups": wider},
    ]


def compute_verdicts(df: pd.DataFrame, metric: str = DEFAULT_METRIC) -> list[Verdict]:
    """Verdicts on the article's claims. df needs: status, seed, monitored and the config columns
    dim, heads, ff_dim, dropout (head_dim and ff_ratio are derived when absent)."""
    df = df.copy()
    for c in ("dim", "heads", "ff_dim", "dropout"):
        if c not in df.columns:
            df[c] = math.nan
        df[c] = pd.to_numeric(df[c], errors="coerce")
    if "head_dim" not in df.columns or df["head_dim"].isna().all():
        df["head_dim"] = df["dim"] / df["heads"]
    if "ff_ratio" not in df.columns or df["ff_ratio"].isna().all():
        df["ff_ratio"] = df["ff_dim"] / df["dim"]
    valid = df[valid_mask(df)]
    varying = {v: _distinct(df[v]) for v in CLAIM_VARS}
    out = []
    for spec in _claim_specs():
        var = spec["variable"]
        vals = varying[var]
        also = [v for v in CLAIM_VARS if v != var and len(varying[v]) > 1]
        if not spec["covered"](vals):
            out.append(Verdict(key=spec["key"], claim=spec["claim"], variable=var, verdict=NOT_COVERED,
                               reason=spec["why"] + f" (values: {', '.join(map(_fmt_num, vals)) or 'none'})",
                               covered=False, also_varies=also))
            continue
        label, claimed, alts = spec["groups"](vals, valid)
        res = compare_groups(claimed, alts, metric, label)
        out.append(Verdict(key=spec["key"], claim=spec["claim"], variable=var, covered=True,
                           also_varies=also, **res))
    return out


# --------------------------------------------------------------------------------------------------
# plots (matplotlib object API on the Agg canvas: no pyplot, no global backend switch)


def _colors(n: int) -> list:
    from matplotlib import colormaps

    if n <= 10:
        cmap = colormaps["tab10"]
        return [cmap(i) for i in range(n)]
    if n <= 20:
        cmap = colormaps["tab20"]
        return [cmap(i) for i in range(n)]
    cmap = colormaps["viridis"]
    return [cmap(i / max(n - 1, 1)) for i in range(n)]


def _new_fig(width: float = 8.0, height: float = 5.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def _legend(ax, n_entries: int) -> None:
    if n_entries == 0:
        return
    if n_entries <= 20:
        ax.legend(fontsize=7, loc="best", ncols=1 if n_entries <= 10 else 2)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


def short_labels(settings: Iterable[str]) -> dict[str, str]:
    """Setting -> its overrides that are not common to every setting (for legends)."""
    settings = list(dict.fromkeys(settings))
    toks = {s: s.split(" ") for s in settings}
    common = set.intersection(*(set(t) for t in toks.values())) if len(settings) > 1 else set()
    out = {}
    for s, t in toks.items():
        kept = [x for x in t if x not in common]
        out[s] = " ".join(kept) if kept else s
    return out


def _setting_colors(df: pd.DataFrame) -> dict[str, Any]:
    settings = list(dict.fromkeys(df["setting"]))
    return dict(zip(settings, _colors(len(settings))))


def training_val_rows(csv: pd.DataFrame, epochs: float = math.nan) -> pd.DataFrame:
    """The rows of a Lightning CSV log with a val/loss logged during fit.

    The evaluation of the best checkpoint after fit (trainer.validate) is logged too, at the last
    step again and at epoch = current_epoch (= epochs completed): such rows are dropped (a repeated
    step keeps its first row; epoch >= epochs is dropped when the number of epochs is known).
    """
    v = csv[pd.to_numeric(csv["val/loss"], errors="coerce").notna()]
    if "step" in v.columns:
        v = v[~(v["step"].duplicated(keep="first") & v["step"].notna())]
    if _finite(epochs) and "epoch" in v.columns:
        kept = v[~(pd.to_numeric(v["epoch"], errors="coerce") >= epochs)]
        if not kept.empty:
            v = kept
    return v


def plot_val_loss_curves(df: pd.DataFrame, path: Path) -> Path:
    curves = []
    for _, r in df.iterrows():
        csv = read_metrics_csv(Path(r["_csv"])) if isinstance(r.get("_csv"), str) else None
        if csv is None or "val/loss" not in csv.columns:
            continue
        v = training_val_rows(csv, _float(r.get("epochs")))
        if v.empty:
            continue
        curves.append((r, v))
    use_epoch = bool(curves) and all(
        "epoch" in v.columns and v["epoch"].notna().all() and v["epoch"].is_unique for _, v in curves)
    colors = _setting_colors(df)
    short = short_labels(df["setting"])
    fig, ax = _new_fig()
    labelled = set()
    for r, v in curves:
        x = v["epoch"] if use_epoch else v.get("step", pd.Series(range(len(v)), index=v.index))
        s = r["setting"]
        ax.plot(x, pd.to_numeric(v["val/loss"]), marker="o", ms=3, lw=1.3, alpha=0.85, color=colors[s],
                label=None if s in labelled else short[s])
        labelled.add(s)
    if curves:
        _legend(ax, len(labelled))
    else:
        _empty(ax, "no val/loss in any metrics.csv")
    ax.set_xlabel("epoch" if use_epoch else "step")
    if use_epoch:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("val/loss")
    ax.set_title("Validation loss, all members (one colour per setting; seeds share it)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _is_pow2(v: float) -> bool:
    return v > 0 and float(v).is_integer() and (int(v) & (int(v) - 1)) == 0


def swept_axes(settings: Iterable[str]) -> tuple[str | None, list[str]]:
    """(x key, series keys): x = first varied override with all-numeric values, else None."""
    parsed = [parse_setting(s) for s in settings]
    keys = list(dict.fromkeys(k for p in parsed for k in p))
    varied = [k for k in keys if len({repr(p.get(k)) for p in parsed}) > 1]
    numeric = [k for k in varied
               if all(isinstance(p.get(k), (int, float)) for p in parsed if k in p)]
    if not numeric:
        return None, varied
    x = numeric[0]
    return x, [k for k in varied if k != x]


def plot_acc_vs_swept(df: pd.DataFrame, summary: pd.DataFrame, path: Path) -> Path:
    fig, ax = _new_fig()
    ok = valid_mask(df)
    v = df[ok]
    settings = list(dict.fromkeys(df["setting"]))
    xkey, series_keys = swept_axes(settings)
    if v.empty:
        _empty(ax, "no finished members")
    else:
        parsed = {s: parse_setting(s) for s in settings}
        if xkey is None:
            xs = {s: i for i, s in enumerate(settings)}
            ax.set_xticks(range(len(settings)))
            short = short_labels(settings)
            ax.set_xticklabels([short[s] for s in settings], rotation=30, ha="right", fontsize=7)
        else:
            xs = {s: float(parsed[s][xkey]) for s in settings if xkey in parsed[s]}
        groups: dict[str, list[str]] = {}
        for s in settings:
            if s in xs:
                name = " ".join(f"{k}={parsed[s].get(k)}" for k in series_keys) if xkey else ""
                groups.setdefault(name, []).append(s)
        colors = _colors(max(len(groups), 1))
        for (name, members), color in zip(groups.items(), colors):
            members = sorted(members, key=lambda s: xs[s])
            for col, style, what in (("best_val_acc", "-", "best val acc"), ("test_acc", "--", "test acc")):
                x, y, e = [], [], []
                for s in members:
                    vals = pd.to_numeric(v.loc[v["setting"] == s, col], errors="coerce").dropna()
                    if len(vals):
                        x.append(xs[s])
                        y.append(vals.mean())
                        e.append(vals.std(ddof=1) if len(vals) > 1 else 0.0)
                if x:
                    label = f"{what}{' (' + name + ')' if name else ''}"
                    ax.errorbar(x, y, yerr=e, fmt="o" if style == "-" else "s", ls=style, color=color,
                                capsize=4, ms=5, lw=1.4, label=label, alpha=0.9 if style == "-" else 0.6)
        _legend(ax, 2 * len(groups))
        if xkey is not None:
            xvals = sorted(set(xs.values()))
            if len(xvals) > 1 and all(_is_pow2(x) for x in xvals):
                ax.set_xscale("log", base=2)  # heads, dims: powers of 2 evenly spaced
            elif len(xvals) > 1 and xvals[0] > 0 and xvals[-1] / xvals[0] >= 100:
                ax.set_xscale("log")  # e.g. a learning rate
            if (len(xvals) <= 8 and ax.get_xscale() != "log") or all(_is_pow2(x) for x in xvals):
                ax.set_xticks(xvals)
                ax.set_xticklabels([_fmt_num(x) for x in xvals])
                ax.minorticks_off()
    ax.set_xlabel(xkey if xkey else "setting")
    ax.set_ylabel("accuracy (mean ± std over seeds)")
    ax.set_title(f"Accuracy vs {xkey or 'setting'}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_acc_vs_wall_time(df: pd.DataFrame, path: Path) -> Path:
    fig, ax = _new_fig()
    v = df[valid_mask(df)]
    t = pd.to_numeric(v["wall_time_s"], errors="coerce")
    a = pd.to_numeric(v["best_val_acc"], errors="coerce")
    keep = t.notna() & a.notna()
    colors = _setting_colors(df)
    short = short_labels(df["setting"])
    if not keep.any():
        _empty(ax, "no finished members with wall time and val acc")
    else:
        for s, g in v[keep].groupby("setting", sort=False):
            ax.scatter(pd.to_numeric(g["wall_time_s"]), pd.to_numeric(g["best_val_acc"]), s=40,
                       color=colors[s], label=short[s], alpha=0.85, edgecolors="k", linewidths=0.4)
        _legend(ax, v[keep]["setting"].nunique())
        tv = t[keep]
        if tv.min() > 0 and tv.max() / tv.min() > 10:
            ax.set_xscale("log")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("best val acc")
    ax.set_title("Best val accuracy vs wall time (one point per member)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


# --------------------------------------------------------------------------------------------------
# markdown


def _pm(mean: float, std: float, scale: float, digits: int) -> str:
    if not _finite(mean):
        return "–"
    s = f"{mean * scale:.{digits}f}"
    return s + (f" ± {std * scale:.{digits}f}" if _finite(std) else " ± –")


def _uniq(df: pd.DataFrame, col: str) -> str:
    vals = df[col].dropna().tolist() if col in df.columns else []
    out = []
    for v in vals:
        v = _fmt_num(v) if isinstance(v, (int, float, np.integer, np.floating)) else str(v)
        if v not in out:
            out.append(v)
    try:
        out.sort(key=float)
    except ValueError:
        out.sort()
    return ", ".join(out) if out else "?"


def _scale_lines(df: pd.DataFrame) -> list[str]:
    epochs = pd.to_numeric(df["epochs"], errors="coerce").dropna()
    params = pd.to_numeric(df["params"], errors="coerce").dropna()
    wall = pd.to_numeric(df["wall_time_s"], errors="coerce").dropna()
    lines = [
        f"- data set: {_uniq(df, 'dataset')}; max_len: {_uniq(df, 'max_len')}; batch_size: {_uniq(df, 'batch_size')}",
        (f"- embed dim: {_uniq(df, 'dim')}; heads: {_uniq(df, 'heads')}; head_dim: {_uniq(df, 'head_dim')}; "
        f"layers: {_uniq(df, 'layers')}"),
        (f"- ff_dim: {_uniq(df, 'ff_dim')} (ff_dim/dim: {_uniq(df, 'ff_ratio')}); dropout: {_uniq(df, 'dropout')}; "
        f"lr: {_uniq(df, 'lr')}"),
        f"- attention: {_uniq(df, 'attention')}; positions: {_uniq(df, 'pos')}",
        f"- epochs: max_epochs {_uniq(df, 'max_epochs')}, run "
        + (f"{int(epochs.min())}–{int(epochs.max())}" if len(epochs) else "?"),
        f"- device: {_uniq(df, 'device')}",
        "- parameters: " + (f"{int(params.min()):,}–{int(params.max()):,}" if len(params) else "?"),
        "- total wall time: " + (f"{wall.sum() / 3600:.2f} h over {len(wall)} members" if len(wall) else "?"),
    ]
    dims = pd.to_numeric(df["dim"], errors="coerce").dropna()
    if len(dims) and dims.max() < 512:
        lines.append(f"- note: the article's advice is for embed_dim 512–1024; this sweep measured dim ≤ "
                     f"{_fmt_num(dims.max())}, so the verdicts hold at this (smaller) scale only.")
    return lines


def render_markdown(df: pd.DataFrame, summary: pd.DataFrame, verdicts: list[Verdict], metric: str,
                    multirun_dir: Path, plots: dict[str, Path]) -> str:
    scale, unit = _points_scale(metric)
    digits = 2 if scale == 100 else 4
    ok = valid_mask(df)
    n_fail = int((~ok).sum())
    L = [f"# Sweep report: `{multirun_dir}`", ""]
    L += [(f"{len(df)} members, {int(ok.sum())} finished with `{metric}`, {n_fail} failed or incomplete. "
          f"Monitored metric: `{metric}` (best over epochs, "
          f"{'higher' if higher_is_better(metric) else 'lower'} is better); test metrics are reported, "
          "never used for selection."), ""]
    L += ["## Scale measured", ""] + _scale_lines(df) + [""]

    L += ["## Per-setting results (mean ± std over seeds)", ""]
    acc_s = "(×100)"
    head = ["setting", "n seeds", f"best val acc {acc_s}", f"test acc {acc_s}", "wall time (s)", "params",
            "failed"]
    if metric != "val/acc":
        head.insert(2, f"{metric}{' (×100)' if scale == 100 else ''}")
    L += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in summary.iterrows():
        name = f"**{_md(r['setting'])}**" if i == 0 and r["n"] > 0 else _md(r["setting"])
        cells = [name, str(r["n"]), _pm(r["best_val_acc_mean"], r["best_val_acc_std"], 100, 2),
                 _pm(r["test_acc_mean"], r["test_acc_std"], 100, 2),
                 f"{r['wall_time_mean']:.0f}" if _finite(r["wall_time_mean"]) else "–",
                 f"{int(r['params']):,}" if _finite(r["params"]) else "–", str(r["n_failed"])]
        if metric != "val/acc":
            cells.insert(2, _pm(r["monitored_mean"], r["monitored_std"], scale, digits))
        L.append("| " + " | ".join(cells) + " |")
    L.append("")

    L += ["## Best setting", ""]
    ranked = summary[summary["n"] > 0]
    if ranked.empty:
        L += ["No finished member: no best setting.", ""]
    else:
        b = ranked.iloc[0]
        L.append(f"**{_md(b['setting'])}**: `{metric}` {_pm(b['monitored_mean'], b['monitored_std'], scale, digits)}"
                 f"{unit} over {b['n']} seed(s); test acc {_pm(b['test_acc_mean'], b['test_acc_std'], 100, 2)} "
                 "(reported only).")
        if len(ranked) > 1:
            r2 = ranked.iloc[1]
            gap = abs(b["monitored_mean"] - r2["monitored_mean"]) * scale
            if b["n"] >= 2 and r2["n"] >= 2:
                se = math.sqrt(b["monitored_std"] ** 2 / b["n"] + r2["monitored_std"] ** 2 / r2["n"]) * scale
                clear = "clear" if gap > SIGMA * se else "within seed noise"
                L.append(f"Runner-up **{_md(r2['setting'])}** is {gap:.{digits}f}{unit} behind "
                         f"({SIGMA:g}·SE = {SIGMA * se:.{digits}f}{unit}: {clear}).")
            else:
                L.append(f"Runner-up **{_md(r2['setting'])}** is {gap:.{digits}f}{unit} behind "
                         "(fewer than 2 seeds: noise not measurable).")
        if b["n"] < 2:
            L.append("Single seed: the ranking is not protected against seed noise.")
        L.append("")

    L += ["## Verdicts on the article's claims", ""]
    L += [(f"Rule: per claim, the finished members are split into the claimed group and one group per "
          f"alternative; each member contributes its best `{metric}`. effect = mean(claimed) − mean(best "
          f"alternative) (> 0 = claimed better), SE = √(s_c²/n_c + s_a²/n_a) with s the std over the group's "
          f"values. **supported** if effect > {SIGMA:g}·SE, **not supported** if effect < −{SIGMA:g}·SE, "
          f"**inconclusive** otherwise or when a compared group has fewer than {MIN_SEEDS} seeds. "
          "Other swept variables are pooled (marginal means); 'also varies' flags confounds. "
          "'wider' compares the widest dim against the best narrower dim; 'head_dim' pools head_dim ≥ 64 "
          "against head_dim < 64. Seed spread = pooled within-group std."), ""]
    vh = ["claim", "verdict", "claimed group", "best alternative", f"effect{unit}", f"{SIGMA:g}·SE{unit}",
          f"seed spread{unit}", "also varies", "why"]
    L += ["| " + " | ".join(vh) + " |", "|" + "---|" * len(vh)]

    def grp(g: GroupStats | None) -> str:
        if g is None:
            return "–"
        return f"{_md(g.label)}: {_pm(g.mean, g.std, scale, digits)} (n={g.n}, seeds={g.n_seeds})"

    def num(x: float) -> str:
        return f"{x * scale:+.{digits}f}" if _finite(x) else "–"

    for v in verdicts:
        L.append("| " + " | ".join([
            v.claim, f"**{v.verdict}**", grp(v.claimed), grp(v.alternative), num(v.effect),
            f"{v.threshold * scale:.{digits}f}" if _finite(v.threshold) else "–",
            f"{v.spread * scale:.{digits}f}" if _finite(v.spread) else "–",
            ", ".join(v.also_varies) or "–", _md(v.reason)]) + " |")
    L.append("")
    others = [v for v in verdicts if v.covered and len(v.others) > 1]
    if others:
        L.append("All groups per covered claim (mean over members):")
        L.append("")
        for v in others:
            parts = [f"{g.label}: {_pm(g.mean, g.std, scale, digits)} (n={g.n})" for g in v.others]
            L.append(f"- {v.claim}: claimed {grp(v.claimed)}; alternatives " + "; ".join(parts))
        L.append("")

    L += ["## Failed members", ""]
    bad = df[~ok]
    if bad.empty:
        L += ["None.", ""]
    else:
        L += ["| member | setting | seed | status | reason |", "|---|---|---|---|---|"]
        for _, r in bad.iterrows():
            if isinstance(r["error"], str) and r["error"]:
                reason = r["error"]
            elif r["status"] == "finished":
                reason = f"finished but no `{metric}` recorded"
            elif r["status"] == "running":
                reason = "still running"
            elif r["status"] == "dead":
                reason = "killed (its process is gone; re-run the sweep to resume it)"
            else:
                reason = "(no reason recorded)"
            seed = "–" if r["seed"] is None or (isinstance(r["seed"], float) and math.isnan(r["seed"])) else r["seed"]
            L.append(f"| {_md(r['member'])} | {_md(r['setting'])} | {seed} | {_md(r['status'])} | {_md(reason)} |")
        L.append("")

    L += ["## Plots", ""]
    titles = {"val_loss": "Validation loss curves", "acc_vs_swept": "Accuracy vs swept value",
              "acc_vs_wall_time": "Accuracy vs wall time"}
    for key, p in plots.items():
        L += [f"- [{titles.get(key, key)}]({p.name})", "", f"![{titles.get(key, key)}]({p.name})", ""]
    L += [f"Per-member table: [{RESULTS_CSV}]({RESULTS_CSV})", ""]
    return "\n".join(L)


# --------------------------------------------------------------------------------------------------
# entry point


INT_COLUMNS = ("seed", "params", "epochs", "global_step", "best_epoch", "dim", "heads", "layers", "ff_dim",
               "batch_size", "max_epochs", "max_len")


def _for_csv(df: pd.DataFrame) -> pd.DataFrame:
    """Integral columns as nullable ints (128, not 128.0)."""
    df = df.copy()
    for c in INT_COLUMNS:
        col = pd.to_numeric(df[c], errors="coerce")
        if col.notna().any() and (col.dropna() % 1 == 0).all() and col.notna().sum() == df[c].notna().sum():
            df[c] = col.astype("Int64")
    return df


def write_report(multirun_dir: str | Path, metric: str = DEFAULT_METRIC) -> dict:
    """Write results.csv, report.md and the plots into multirun_dir; return paths and verdicts.

    Raises NoMembersError when no metrics.json is found, ValueError for a test metric.
    """
    if metric.startswith(("test/", "test_")):
        raise ValueError(f"refusing to select by a test metric ({metric!r}): monitor a validation metric")
    root = Path(multirun_dir).resolve()
    df = collect_results(root, metric)
    summary = summarize_settings(df, metric)
    verdicts = compute_verdicts(df, metric)

    results_csv = root / RESULTS_CSV
    _for_csv(df[RESULT_COLUMNS]).to_csv(results_csv, index=False)

    plots: dict[str, Path] = {}
    for key, fname, fn in (
        ("val_loss", PLOT_VAL_LOSS, lambda p: plot_val_loss_curves(df, p)),
        ("acc_vs_swept", PLOT_ACC_VS_SWEPT, lambda p: plot_acc_vs_swept(df, summary, p)),
        ("acc_vs_wall_time", PLOT_ACC_VS_WALL, lambda p: plot_acc_vs_wall_time(df, p)),
    ):
        try:
            plots[key] = fn(root / fname)
        except Exception:
            log.exception("plot %s failed", fname)

    report_md = root / REPORT_MD
    report_md.write_text(render_markdown(df, summary, verdicts, metric, root, plots))

    ranked = summary[summary["n"] > 0] if not summary.empty else summary
    best = None
    if not ranked.empty:
        b = ranked.iloc[0]
        best = {"setting": b["setting"], "n": int(b["n"]), "mean": float(b["monitored_mean"]),
                "std": float(b["monitored_std"]), "test_acc_mean": float(b["test_acc_mean"])}
    ok = valid_mask(df)
    return {
        "multirun_dir": root,
        "metric": metric,
        "results_csv": results_csv,
        "report_md": report_md,
        "plots": plots,
        "n_members": len(df),
        "n_finished": int(ok.sum()),
        "failed": [{k: (v if isinstance(v, str) else None) for k, v in rec.items()}
                   for rec in df.loc[~ok, ["member", "status", "error"]].to_dict("records")],
        "best_setting": best,
        "summary": summary,
        "verdicts": [v.to_dict() for v in verdicts],
        "verdict_by_claim": {v.key: v.verdict for v in verdicts},
    }

