"""The accuracy table: training runs grouped by setting, beside the TF-IDF baseline and the papers' anchors.

    mhalab-accuracy <runs dir> [baselines=results/baselines] [out=results/pretraining/README.md] [csv=runs.csv]
    mhalab-accuracy results/pretraining/runs.csv        # the same table from the per-run CSV it wrote

<runs dir> holds run dirs (any depth) with a metrics.json each. A run's setting is its command-line overrides
less the seed and the keys that do not change results (conf/train.yaml's exclude_keys, num_threads, the
accelerator). Per data set and setting: the seeds, validation and test accuracy (mean, and the test mean's 95%
t-interval over seeds), the CPU minutes of a run (its fit, and its pretraining counted once per pretrained
encoder), each setting's effect against the data set's default run (no overrides), and a pretrained setting's
effect against the best setting (by validation) trained from scratch, both on test accuracy, paired by seed
(mhalab.analysis.report.stats.compare). Then the data set's TF-IDF + logistic regression (mhalab-baseline's JSON
in `baselines`) and the from-scratch anchors the papers report.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from scipy import stats as sps

from mhalab.analysis.options import doc, emit, parse, split_dir
from mhalab.analysis.report.collect import default_non_result_keys, find_member_dirs, setting_of
from mhalab.analysis.report.stats import GroupStats, compare
from mhalab.errors import ConfigError, one_line_errors
from mhalab.train import record

DEFAULT = "(default)"
HEADER = ("| setting | seeds | val acc | test acc [95% CI] | {m} vs default [95% CI] | {m} vs best unpretrained "
          "[95% CI] | fit min / run | pretraining min (encoders) |")
PRETRAINED = ("pretrain=", "init_from=")  # a setting with one of these starts from a pretrained encoder
SKIP = ("num_threads", "trainer.accelerator")  # beside conf/train.yaml's exclude_keys: speed, not results
# from-scratch results in the papers (no external data, embeddings or weights), test accuracy in %
ANCHORS = {
    "sst2": "CNN-rand 82.7 (Kim 2014)",
    "sst5": "CNN-rand 45.0 (Kim 2014)",
    "trec": "CNN-rand 91.2 (Kim 2014)",
    "imdb": "LSTM, random init 86.5 (Dai & Le 2015); NBSVM 91.2 (Wang & Manning 2012)",
}


@dataclass
class Options:
    baselines: str | None = field(default="results/baselines",
                                  metadata=doc("dir of mhalab-baseline's <data set>.json (null: no baseline row)"))
    out: str | None = field(default=None, metadata=doc("also write the markdown table to this file"))
    csv: str | None = field(default=None, metadata=doc("write the per-run rows to this CSV (a table's source)"))
    effects_on: str = field(default="test", metadata=doc("the effect columns' split: test | val"))


def collect(root: str | Path) -> pd.DataFrame:
    """One row per finished run: data, setting, seed, val, test, fit_min, pretrain_min, pretrain_dir (the encoder's
    cache dir), run. `root`: a dir of run dirs, or a CSV of these rows (as `csv=` writes it)."""
    if Path(root).is_file():
        return pd.read_csv(root)
    skip = set(default_non_result_keys()) | set(SKIP) | {"data"}
    rows = []
    for d in find_member_dirs(root):
        rec = record.read(d) or {}
        if rec.get("status") != "finished":
            continue
        best, pre = rec.get("best", {}), rec.get("pretrain") or {}
        rows.append({
            "data": (rec.get("data") or {}).get("name") or rec["config"]["data"]["name"],
            "setting": " ".join(sorted(setting_of(rec.get("overrides", []), skip).split())),
            "seed": rec["seed"], "val": 100 * best["val/acc"], "test": 100 * best.get("test/acc", math.nan),
            "fit_min": rec.get("fit_time_s", math.nan) / 60,
            "pretrain_min": pre.get("wall_time_s", 0.0) / 60, "pretrain_dir": pre.get("dir"), "run": str(d),
        })
    if not rows:
        raise ConfigError(f"no finished run (metrics.json with status finished) under {root}; give the dir that "
                          f"holds the run dirs.")
    return pd.DataFrame(rows)


def _pretrained(setting: str) -> bool:
    return any(w.startswith(PRETRAINED) for w in setting.split())


def _group(sub: pd.DataFrame, metric: str) -> GroupStats:
    return GroupStats.of(sub["setting"].iloc[0], sub.assign(monitored=sub[metric]))


def ci_text(g: GroupStats) -> str:
    if g.n_seeds < 2:
        return f"{g.mean:.1f}"
    half = sps.t.ppf(0.975, g.n_seeds - 1) * g.std / math.sqrt(g.n_seeds)
    return f"{g.mean:.1f} [{g.mean - half:.1f}, {g.mean + half:.1f}]"


def effect_text(claimed: GroupStats, ref: GroupStats | None) -> str:
    if ref is None or claimed.label == ref.label:
        return ""
    c = compare(claimed, ref, sign=1.0, margin=1.0)
    if c.test == "none":
        return f"{c.effect:+.1f} (too few seeds)"
    return f"{c.effect:+.1f} [{c.ci_low:+.1f}, {c.ci_high:+.1f}]"


def table(df: pd.DataFrame, baselines: Path | None, effects_on: str = "test") -> str:
    """The markdown: a table per data set, its settings ordered by mean validation accuracy; the effects on
    `effects_on` (test | val) accuracy."""
    if effects_on not in ("test", "val"):
        raise ConfigError(f"effects_on={effects_on} is not a split of the table; choose test or val.")
    out = []
    for data, sub in df.groupby("data", sort=True):
        groups = {s: g for s, g in sub.groupby("setting")}
        ref = {m: _group(groups[DEFAULT], m) for m in ("val", "test")} if DEFAULT in groups else {}
        out += [f"### {data}", "", HEADER.format(m=effects_on), "|---|---|---|---|---|---|---|---|"]
        order = sorted(groups, key=lambda s: -groups[s]["val"].mean())
        # the best setting by validation that starts from scratch: what pretraining has to beat
        scratch = next((s for s in order if not _pretrained(s)), None)
        best_scratch = _group(groups[scratch], effects_on) if scratch else None
        for s in order:
            g = groups[s]
            val, test = _group(g, "val"), _group(g, "test")
            encoders = g.dropna(subset=["pretrain_dir"]).drop_duplicates("pretrain_dir")
            pre = (f"{encoders['pretrain_min'].mean():.1f} ({len(encoders)})" if len(encoders) else "")
            on = val if effects_on == "val" else test
            vs_scratch = effect_text(on, best_scratch) if _pretrained(s) else ""
            out.append(f"| `{s}` | {','.join(str(x) for x in sorted(g['seed']))} | {val.mean:.1f} | {ci_text(test)} | "
                       f"{effect_text(on, ref.get(effects_on))} | {vs_scratch} | {g['fit_min'].mean():.1f} | {pre} |")
        base = baselines / f"{data}.json" if baselines else None
        if base and base.is_file():
            b = json.loads(base.read_text())
            out.append(f"| TF-IDF + logistic regression (`mhalab-baseline data={data}`) | "
                       f"{','.join(map(str, b['seeds']))} | {100 * b['mean']['validation/acc']:.1f} | "
                       f"{100 * b['mean']['test/acc']:.1f} | | | {b['cpu_seconds'] / 60 / len(b['seeds']):.1f} | |")
        if data in ANCHORS:
            out.append(f"| from scratch, papers: {ANCHORS[data]} | | | | | | | |")
        out.append("")
    return "\n".join(out)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    usage = "mhalab-accuracy <runs dir or runs.csv> [baselines=DIR] [out=FILE] [csv=FILE]"
    root, rest = split_dir(sys.argv[1:] if argv is None else argv, usage)
    opts = parse(Options, rest, "mhalab-accuracy", __doc__.splitlines()[0])
    if not root.exists():
        raise ConfigError(f"{root} does not exist; give the folder that holds the run dirs (or a runs CSV)")
    df = collect(root)
    if opts.csv:
        df.to_csv(opts.csv, index=False)
    emit(table(df, Path(opts.baselines) if opts.baselines else None, opts.effects_on), opts.out)
    return 0


__all__ = ["ANCHORS", "ci_text", "collect", "effect_text", "main", "table"]
