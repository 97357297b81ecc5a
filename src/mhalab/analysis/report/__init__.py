"""Sweep report: turn a Hydra multirun directory into tables, plots and verdicts.

``write_report(multirun_dir, metric="val/acc")`` (or ``mhalab-report <sweep dir> [metric=val/acc]``)
writes into the multirun directory:

* ``results.csv`` -- one row per member (member dir, overrides, setting = overrides minus ``seed``,
  seed, params, best val acc, test acc, epochs, wall time, tokens/s, status, error, then extras).
* ``report.md`` -- scale measured, per-setting mean +- std over seeds, best setting, verdicts on the
  article's claims (effect, 95% CI, test and p of each comparison), failed members with reasons, links to
  the plots.
* ``verdicts.json`` -- the verdicts with every comparison's numbers (mhalab.analysis.claims reads them).
* ``val_loss_curves.png``, ``acc_vs_swept.png``, ``acc_vs_wall_time.png``.

A dir whose members are gone but which holds a results.csv (a copy under results/) is reported again from that
file, under the rules of the code that reads it (the validation curves' plot, which needs the members' logs, is
left as it was).

The rules live with the code that applies them: which directories are members and what a setting is
(collect.py), the selection and verdict rules (stats.py), the claims (verdicts.py).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from mhalab.analysis.options import doc, parse, split_dir
from mhalab.analysis.report import sequential
from mhalab.analysis.report.collect import (
    RESULT_COLUMNS,
    NoMembersError,
    collect_results,
    read_sweep,
    setting_of,
    training_val_rows,
)
from mhalab.analysis.report.plots import (
    PLOT_ACC_VS_SWEPT,
    PLOT_ACC_VS_WALL,
    PLOT_VAL_LOSS,
    plot_acc_vs_swept,
    plot_acc_vs_wall_time,
    plot_val_loss_curves,
)
from mhalab.analysis.report.render import REPORT_MD, RESULTS_CSV, render_markdown
from mhalab.analysis.report.stats import (
    CONTRADICTED,
    DEFAULT_METRIC,
    INCONCLUSIVE,
    NO_DIFFERENCE,
    NOT_COVERED,
    NOT_DECIDED,
    SUPPORTED,
    margin_units,
    points_scale,
    summarize_settings,
    top_settings,
    valid_mask,
)
from mhalab.analysis.report.trained import best_withheld, not_trained_mask, presets
from mhalab.analysis.report.values import fmt_num
from mhalab.analysis.report.verdicts import compute_verdicts, plan_words
from mhalab.errors import ConfigError, one_line_errors

log = logging.getLogger(__name__)

VERDICTS_JSON = "verdicts.json"

__all__ = ["CONTRADICTED", "DEFAULT_METRIC", "INCONCLUSIVE", "NOT_COVERED", "NOT_DECIDED", "NO_DIFFERENCE", "SUPPORTED",
           "NoMembersError",
           "collect_results", "compute_verdicts", "main", "setting_of", "summarize_settings",
           "training_val_rows", "write_report"]

INT_COLUMNS = ("seed", "params", "epochs", "global_step", "best_epoch", "dim", "heads", "layers", "ff_dim",
               "train_size", "val_size", "test_size",
               "batch_size", "max_epochs", "max_len", "planned_steps", "steps_per_epoch", "validations")


def _for_csv(df: pd.DataFrame) -> pd.DataFrame:
    """Integral columns as nullable ints (128, not 128.0)."""
    df = df.copy()
    for c in INT_COLUMNS:
        col = pd.to_numeric(df[c], errors="coerce")
        if col.notna().any() and (col.dropna() % 1 == 0).all() and col.notna().sum() == df[c].notna().sum():
            df[c] = col.astype("Int64")
    return df


def _json_safe(o):
    """NaN -> null (JSON has no NaN), numpy numbers -> Python's."""
    if isinstance(o, dict):
        return {str(k): _json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_json_safe(v) for v in o]
    if hasattr(o, "item"):  # a numpy scalar
        o = o.item()
    return None if isinstance(o, float) and not math.isfinite(o) else o


def report_name(given: str | Path, df: pd.DataFrame) -> str:
    """How a report names its sweep: by its preset and what every member shared (`sweep=heads data=trec`), else by
    the dir it was given, relative to the working directory (never an absolute path of the machine that ran it:
    outside the working directory, its last two parts)."""
    if preset := presets(df):
        return " ".join(preset + [w for w in df.attrs.get("common") or [] if w.startswith("data=")])
    path = Path(given)
    if not path.is_absolute():
        return str(path) if path.parts else Path.cwd().name  # `mhalab-report .`: the folder's own name
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(Path(*path.parts[-2:]))


def write_report(multirun_dir: str | Path, metric: str = DEFAULT_METRIC, margin: float | None = None) -> dict:
    """Write results.csv, report.md, verdicts.json and the plots into multirun_dir; return paths and verdicts.
    margin: the smallest difference that matters, in points for an accuracy-like metric (else metric units;
    None: 1 point, or 0.01 of another metric). A best setting resting on members that were not trained to the end
    is withheld (report.trained: `withheld` says why).

    Raises NoMembersError when no metrics.json is found, ConfigError (a ValueError) for a test metric.
    """
    if metric.startswith(("test/", "test_")):
        raise ConfigError(f"metric={metric} is a test metric, and selecting by one would leak the test set "
                          "into the choice: give a validation metric (metric=val/acc or metric=val/loss)")
    root = Path(multirun_dir).resolve()
    if margin is not None and not margin > 0:
        raise ConfigError(f"margin={margin} must be > 0: the smallest difference that matters (default 1 point of "
                          "an accuracy, 0.01 of a loss)")
    record = sequential.read_record(root)  # a sweep run until decided: its design is fixed, its looks give the verdicts
    if record:  # before anything is read or written
        sequential.check_reading(record["design"], metric, margin)
        margin = record["design"]["margin"]
    # members gone (a copy under results/): the report again from its results.csv, under today's rules; the
    # validation curves need the members' logs, so their plot stays as it was
    df, from_csv = read_sweep(root, metric)
    summary = summarize_settings(df, metric)
    verdicts = compute_verdicts(df, metric, margin)
    seq = None
    if record:
        seq = {"design": record["design"], "looks": sequential.read_looks(df, record["looks"], record["design"]),
               "command": record["command"]}
        seq["stopped"] = sequential.stop_reason(seq["looks"], seq["design"], df)

    results_csv = root / RESULTS_CSV
    _for_csv(df[RESULT_COLUMNS]).to_csv(results_csv, index=False)

    plots: dict[str, Path] = {}
    unfinished = not_trained_mask(df, margin_units(metric, margin))  # the plots mark them
    if from_csv and (root / PLOT_VAL_LOSS).is_file():
        plots["val_loss"] = root / PLOT_VAL_LOSS
    for key, fname, fn in (
        *((("val_loss", PLOT_VAL_LOSS, lambda p: plot_val_loss_curves(df, p, unfinished)),) if not from_csv else ()),
        ("acc_vs_swept", PLOT_ACC_VS_SWEPT, lambda p: plot_acc_vs_swept(df, summary, p, unfinished)),
        ("acc_vs_wall_time", PLOT_ACC_VS_WALL, lambda p: plot_acc_vs_wall_time(df, p, unfinished)),
    ):
        try:
            plots[key] = fn(root / fname)
        except Exception:
            log.exception("plot %s failed", fname)

    report_md = root / REPORT_MD
    name = report_name(multirun_dir, df)
    scale, unit = points_scale(metric)
    report_md.write_text(render_markdown(df, summary, verdicts, metric, name, plots, margin_units(metric, margin),
                                         sequential.markdown(seq["looks"], seq["design"], seq["command"], df, scale, unit) if seq
                                         else []))
    verdicts_json = root / VERDICTS_JSON
    verdicts_json.write_text(json.dumps(_json_safe({"metric": metric, "margin": margin_units(metric, margin),
                                                    "verdicts": [v.to_dict() for v in verdicts],
                                                    **({"sequential": seq} if seq else {})}), indent=1) + "\n")

    top = top_settings(summary) if not summary.empty else summary  # the report's rule: a tie has no best setting
    withheld = best_withheld(df, metric, margin_units(metric, margin))
    best = None
    if len(top) == 1 and not withheld:
        b = top.iloc[0]
        best = {"setting": b["setting"], "n": int(b["n"]), "mean": float(b["monitored_mean"]),
                "std": float(b["monitored_std"]), "test_acc_mean": float(b["test_acc_mean"])}
    ok = valid_mask(df)
    return {
        "multirun_dir": root,
        "metric": metric,
        "results_csv": results_csv,
        "report_md": report_md,
        "verdicts_json": verdicts_json,
        "plots": plots,
        "from_csv": from_csv,
        "n_members": len(df),
        "n_finished": int(ok.sum()),
        "failed": [{k: (v if isinstance(v, str) else None) for k, v in rec.items()}
                   for rec in df.loc[~ok, ["member", "status", "error"]].to_dict("records")],
        "best_setting": best,
        "tied": top["setting"].tolist() if len(top) > 1 and not withheld else [],
        "withheld": withheld,
        "summary": summary,
        "verdicts": [v.to_dict() for v in verdicts],
        "verdict_by_claim": {v.key: v.verdict for v in verdicts},
        "sequential": seq,
        "notes": df.attrs.get("notes", []),
    }


@dataclass
class ReportOptions:
    """mhalab-report's key=value options (after the sweep dir)."""

    metric: str = field(default=DEFAULT_METRIC, metadata=doc("the validation metric that ranks settings and "
                                                             "decides verdicts (never a test metric)"))
    margin: float | None = field(default=None, metadata=doc("the smallest difference that matters, for the equivalence "
                                                            "test: points of an accuracy (null: 1), or loss units "
                                                            "(null: 0.01)"))


USAGE = __doc__.splitlines()[0] + "\n\n    mhalab-report <sweep dir> [metric=val/acc] [margin=1]"


def best_line(res: dict) -> str:
    """write_report's best setting in words: the best by the metric, or the settings that tie at the top."""
    best = res["best_setting"]
    if best:
        return f"best by {res['metric']}: {best['setting']} (mean {best['mean']:.4f} over {best['n']} seed(s))"
    if res["tied"]:
        return f"no best by {res['metric']}: {', '.join(res['tied'])} tie"
    if res.get("withheld"):
        return f"no best by {res['metric']}: {res['withheld']}"
    return f"no best by {res['metric']}: no finished member"


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    """mhalab-report: write the report of a sweep dir; `error: ...` and exit 2 for a missing or empty dir."""
    sweep_dir, words = split_dir(sys.argv[1:] if argv is None else argv,
                                 "mhalab-report <sweep dir> [metric=val/acc] [margin=1]")
    opts = parse(ReportOptions, words, "mhalab-report", USAGE)
    res = write_report(sweep_dir, metric=opts.metric, margin=opts.margin)
    print(f"members: {res['n_members']} ({res['n_finished']} finished, {len(res['failed'])} failed or incomplete)")
    for note in res["notes"]:  # what report.integrity normalised before averaging
        print(f"note: {note}")
    if res["best_setting"] or res["tied"] or res["withheld"]:
        print(best_line(res))
    scale, unit = points_scale(res["metric"])
    for v in res["verdicts"]:
        ci = v["ci"]
        effect = (f" ({v['effect'] * scale:+.2f}{unit} vs {v['headline']}, 95% CI {ci[0] * scale:+.2f} to "
                  f"{ci[1] * scale:+.2f})" if ci and all(map(math.isfinite, ci)) else "")
        print(f"  {v['claim']}: {v['verdict']}{effect}")
        if words := plan_words(v["seeds_needed"], v["extra_seeds"], v["cpu_hours_needed"],
                               f"{fmt_num(v['margin'] * scale)}{unit}"):
            print(f"    to decide it: {words}")
    if seq := res["sequential"]:
        last = seq["looks"][-1]
        print(f"seeds until decided (look {last['look']}, {len(last['seeds'])} seeds; the verdicts to read):")
        for c in last["claims"].values():
            cis = ", ".join(f"vs {x['alternative']} [{x['low'] * scale:+.2f}, {x['high'] * scale:+.2f}] {x['outcome']}"
                            for x in c["comparisons"] if math.isfinite(x["low"]))
            print(f"  {c['claim']}: {c['verdict']}" + (f" ({cis})" if cis else ""))
        stop = seq["stopped"]
        print(f"  {'stopped' if stop else 'not stopped'}: "
              f"{sequential.stop_words(stop, seq['looks'], seq['design'], seq['command'])}")
    print(f"wrote {res['results_csv']}")
    print(f"wrote {res['verdicts_json']}")
    print(f"wrote {res['report_md']}")
    for key, path in res["plots"].items():
        print(f"{'kept' if key == 'val_loss' and res['from_csv'] else 'wrote'} {path}")
    return 0
