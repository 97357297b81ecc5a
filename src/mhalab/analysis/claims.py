"""The article's claims x data sets: every committed sweep's verdicts in one table.

    mhalab-claims results/sweeps [out=results/sweeps/README.md] [margin=1]

Reads ``<root>/<data set>/<preset>/results.csv`` (the per-member table mhalab-report writes into each
sweep dir, copied there by ``make sweeps``) and decides each claim with the same code as the reports
(report.verdicts), so the table and the reports agree. Per covered claim and sweep: the verdict, the
effect against the closest alternative with its 95% CI and Holm-corrected p, the seeds, and the scale;
per sweep: its runs, CPU time and best cell.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from mhalab.analysis.options import doc, emit, parse, split_dir
from mhalab.analysis.report import sequential
from mhalab.analysis.report.collect import read_sweep
from mhalab.analysis.report.render import RESULTS_CSV, p_cell
from mhalab.analysis.report.stats import (
    margin_units,
    points_scale,
    summarize_settings,
    top_settings,
    valid_mask,
)
from mhalab.analysis.report.trained import best_withheld
from mhalab.analysis.report.values import finite, fmt_num
from mhalab.analysis.report.verdicts import Verdict, compute_verdicts
from mhalab.errors import ConfigError, one_line_errors

METRIC = "val/acc"
GPU_PRESETS = "`sweep=heads_gpu` (and `head_dim_gpu`, `dim_gpu`, `dropout_gpu`, `ff_ratio_gpu`)"


def find_sweeps(root: Path) -> list[tuple[str, str, Path]]:
    """(data set, preset, results.csv) for every <root>/<data set>/<preset>/results.csv, sorted."""
    found = sorted(root.glob(f"*/*/{RESULTS_CSV}"))
    return [(p.parent.parent.name, p.parent.name, p) for p in found]


def _scale(df: pd.DataFrame) -> str:
    """What the runs were: width, depth, epochs (the values of the sweep, swept ones as a range)."""
    def vals(col):
        v = sorted({float(x) for x in pd.to_numeric(df[col], errors="coerce").dropna()})
        return "/".join(fmt_num(x) for x in v) if v else "?"
    steps = pd.to_numeric(df["global_step"], errors="coerce").dropna()
    return (f"dim {vals('dim')}, {vals('layers')} layers, {vals('max_epochs')} epochs"
            + (f" (~{int(steps.median()):,} steps)" if len(steps) else ""))


def _without_data(setting: str) -> str:
    """A setting's name without its data=... word (the table has a data set column)."""
    return " ".join(w for w in setting.split() if not w.startswith("data=")) or setting


@dataclass
class ClaimRow:
    """One covered claim in one sweep: its Verdict as the report decided it, and where it comes from."""

    order: int  # the claim's place in report.verdicts: rows are grouped by claim
    data: str
    preset: str
    verdict: Verdict
    scale: str
    cpu_h: float  # the sweep's cost: its members' wall time summed
    sequential: dict | None = None  # a sweep run until decided: the claim at its last look (sequential.read_looks)


def regime(data: str) -> str:
    """'' for a data set folder (`sst2`), the label of another regime for `<data set>-<label>` (`sst2-fifth-epoch`:
    sweeps of earlier presets, kept in a section of their own)."""
    return data.split("-", 1)[1] if "-" in data else ""


def sweep_rows(data: str, preset: str, csv: Path, margin: float | None) -> tuple[list[ClaimRow], dict]:
    """(one row per covered claim, the sweep's summary row)."""
    df = read_sweep(csv.parent, METRIC)[0]  # checked as the report checks it (report.integrity)
    ok = valid_mask(df)
    summary = summarize_settings(df, METRIC)
    top = top_settings(summary)
    # none when nothing finished, the top cells tie, or a member was not trained to the end (report.trained)
    withheld = best_withheld(df, METRIC, margin_units(METRIC, margin))
    best = top.iloc[0] if len(top) == 1 and not withheld else None
    wall = pd.to_numeric(df["wall_time_s"], errors="coerce").fillna(0).sum()
    names = df["dataset"].dropna() if "dataset" in df else pd.Series(dtype=object)
    # what every member was run with besides the data set (max_epochs=20): the command that runs it again says it
    also = [w for w in df.attrs.get("common", []) if not w.startswith("data=")]
    info = {"data": data, "preset": preset, "runs": len(df), "finished": int(ok.sum()), "also": also,
            "cpu_h": wall / 3600, "scale": _scale(df), "dataset": names.iloc[0] if len(names) else data,
            "best": None if best is None else (_without_data(best["setting"]), best["best_val_acc_mean"],
                                               best["test_acc_mean"])}
    last = {}
    if record := sequential.read_record(csv.parent):  # seeds until decided: its looks give the verdicts to read
        design = record["design"]
        try:
            sequential.check_reading(design, METRIC, margin)
            reads = sequential.read_looks(df, record["looks"], design)
            last = {k: {**c, "look": reads[-1]["look"], "of": len(sequential.planned_of(design))}
                    for k, c in reads[-1]["claims"].items()}
        except ConfigError:  # another margin than its design's: its looks are not read, and its row says so
            fixed = fmt_num(sequential.margin_of(design.get("margin")))
            last = {v.key: {"not_read": f"run until decided at ±{fixed} point: not read at another margin"}
                    for v in compute_verdicts(df, METRIC, margin) if v.covered}
        info["until_decided"] = f" sweep.until_decided=true sweep.max_seeds={design['max_seeds']}"
    rows = [ClaimRow(order, data, preset, v, info["scale"], info["cpu_h"], last.get(v.key))
            for order, v in enumerate(compute_verdicts(df, METRIC, margin)) if v.covered]
    return rows, info


def _baseline(baselines: Path | None, dataset: str) -> str:
    """The TF-IDF + logistic regression bar (mhalab-baseline's JSON for this data set): 'val / test', or '–'."""
    path = baselines / f"{dataset}.json" if baselines else None
    if not path or not path.is_file():
        return "–"
    mean = json.loads(path.read_text())["mean"]
    return f"{100 * mean['validation/acc']:.1f} / {100 * mean['test/acc']:.1f}"


def render(root: Path, margin: float | None = None, baselines: Path | None = None) -> str:
    sweeps = find_sweeps(root)
    if not sweeps:
        raise ConfigError(f"no <data set>/<preset>/{RESULTS_CSV} under {root}: give the folder that `make sweeps` "
                          "fills (results/sweeps)")
    scale = points_scale(METRIC)[0]
    rows, infos = [], []
    for data, preset, csv in sweeps:
        r, info = sweep_rows(data, preset, csv, margin)
        rows += r
        infos.append(info)
    rule = (f"Written by `mhalab-claims {root}` from each sweep's `{RESULTS_CSV}`, with the reports' rule "
            "(mhalab.analysis.report.stats): per-seed means, paired t-test over shared seeds, two-sided at 5%, TOST "
            f"within ±{margin_units(METRIC, margin) * scale:g} point, Holm across a claim's alternatives. Effect = "
            "claimed − the closest alternative (its best competitor), in points of validation accuracy, with its 95% CI. "
            "Detectable = the smallest true effect a two-sided 5% test of that comparison finds with 80% power, from its "
            "observed seed variance (stats.detectable_effect; at 5% / m for a claim with m alternatives, Holm's strictest "
            "step): an inconclusive row rules out no effect smaller than that. To decide = the seeds per group that "
            "would give every unclear comparison 80% power at the margin, and their CPU hours (stats.seeds_needed). "
            "A sweep run until decided (`sweep.until_decided=true`) is read from its repeated confidence intervals "
            "at its last look (mhalab.analysis.report.sequential), which hold the error rate over its looks.")
    L = ["# The article's claims, tested", "", rule, ""]
    for label in sorted({regime(r.data) for r in rows}):  # the data sets' own scale first, then other regimes
        if label:
            L += [f"## Another regime: {label}", "",
                  (f"Sweeps in `<data set>-{label}` folders: their settings differ from the data set's default run "
                   "(each report's first lines say how); read their rows as that regime's, not as the claim's test "
                   "at the default scale."), ""]
        L += claim_table([r for r in rows if regime(r.data) == label], scale)
    L += _sweep_table(infos, baselines)
    return "\n".join(L)


def claim_table(rows: list[ClaimRow], scale: float) -> list[str]:
    """The claim x sweep rows, grouped by claim."""
    L = [("| claim | data set | preset | verdict | effect [95% CI] vs closest alternative | detectable (80%) | "
          "p (Holm) | seeds | to decide (80% power) | design | scale | cost (CPU h) |"),
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda x: x.order):  # stable: data sets and presets stay sorted within a claim
        v, h = r.verdict, r.verdict.headline
        eff, verdict, plan = "–", f"**{v.verdict}**", "–"
        if h is not None and finite(h.effect):
            ci = (f" [{h.ci_low * scale:+.1f}, {h.ci_high * scale:+.1f}]" if finite(h.ci_low) else "")
            at = f" at {v.tuned[h.alternative.label]}" if h.alternative.label in v.tuned else ""
            eff = f"{h.effect * scale:+.1f}{ci} vs {h.alternative.label}{at}"
        if finite(v.seeds_needed):
            plan = f"~{int(v.seeds_needed)} seeds" + (f", {v.cpu_hours_needed:.1f} h" if finite(v.cpu_hours_needed)
                                                       else "")
        if (seq := r.sequential) and "not_read" in seq:
            verdict, eff, h, plan = f"**not read** ({seq['not_read']})", "–", None, "–"
        elif (seq := r.sequential) and seq["comparisons"]:  # the repeated interval, at the look the sweep stopped
            c = min(seq["comparisons"], key=lambda x: x["effect"])
            verdict = f"**{seq['verdict']}** (seeds until decided: look {seq['look']} of {seq['of']})"
            eff = (f"{c['effect'] * scale:+.1f} [{c['low'] * scale:+.1f}, {c['high'] * scale:+.1f}] repeated CI "
                   f"vs {c['alternative']}")
            h, plan = None, "–"  # no fixed-sample p or power after looking
        averaged = [x for x in v.also_varies if x not in v.confounded]
        design = "; ".join([*(["confounded with " + ", ".join(v.confounded)] if v.confounded else []),
                            *(["averaged over " + ", ".join(averaged)] if averaged else [])]) or "one factor"
        if v.tuned:
            design += "; lr tuned per group"
        detectable = f"{h.detectable * scale:.1f}" if h is not None and finite(h.detectable) else "–"
        seeds = v.claimed.n_seeds if v.claimed else 0
        L.append(f"| {v.claim} | {r.data} | [{r.preset}]({r.data}/{r.preset}/report.md) | "
                 f"{verdict} | {eff} | {detectable} | {p_cell(h)} | {seeds} | {plan} | {design} | {r.scale} | "
                 f"{r.cpu_h:.2f} |")
    return L + [""]


def _sweep_table(infos: list[dict], baselines: Path | None) -> list[str]:
    """Per sweep: its cost, its best cell beside the bag-of-words bar, and the command that runs it again."""
    L = ["## The sweeps", "",
         ("Per sweep: runs, CPU time (the members' wall time summed; two ran at a time on 2 cores), the best "
          "cell (mean over seeds; none where the top cells tie), the bar a bag of words sets on the same splits "
          "(TF-IDF + logistic regression, `mhalab-baseline data=<set>`), and the command that runs it again (into "
          "`multirun/<data set>/<preset>`; `make sweeps DATA=<set>` runs a data set's five and copies the reports "
          "here; another regime's command is in its reports):"), "",
         ("| data set | preset | runs (finished) | CPU time | best cell: val / test acc | TF-IDF + LR: val / test | "
         "scale | command |"),
         "|---|---|---|---|---|---|---|---|"]
    for i in infos:
        best = "–" if i["best"] is None else f"{i['best'][0]}: {i['best'][1] * 100:.1f} / {i['best'][2] * 100:.1f}"
        words = ["mhalab-train", f"sweep={i['preset']}", f"data={i['data']}", *i["also"]]
        command = "–" if regime(i["data"]) else f"`{' '.join(words)}{i.get('until_decided', '')}`"
        L.append(f"| {i['data']} | {i['preset']} | {i['runs']} ({i['finished']}) | {i['cpu_h']:.2f} h | {best} | "
                 f"{_baseline(baselines, i['dataset'])} | {i['scale']} | {command} |")
    return L + ["", f"At the article's width on a GPU: {GPU_PRESETS}, then `mhalab-report` on the sweep dir.", ""]


@dataclass
class ClaimsOptions:
    """mhalab-claims' key=value options (after the results folder)."""

    out: str | None = field(default=None, metadata=doc("also write the table to this file"))
    margin: float | None = field(default=None, metadata=doc("the equivalence margin in points (null: 1)"))
    baselines: str | None = field(default="results/baselines",
                                  metadata=doc("dir of mhalab-baseline's <data set>.json, the bar beside each sweep"))


USAGE = "mhalab-claims <results folder> [out=results/sweeps/README.md] [margin=1]"


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    root, words = split_dir(sys.argv[1:] if argv is None else argv, USAGE)
    opts = parse(ClaimsOptions, words, "mhalab-claims", __doc__.splitlines()[0])
    if not root.is_dir():
        raise ConfigError(f"{root} is not a folder; give the folder that `make sweeps` fills (results/sweeps)")
    emit(render(root, opts.margin, Path(opts.baselines) if opts.baselines else None), opts.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
