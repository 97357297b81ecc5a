"""The LRA-style table of a long-sequence sweep: accuracy, time per step and peak memory per attention
kind per task, side by side with the Long Range Arena paper's Table 1.

`write_lra_table(sweep_dir, out)` writes the markdown and its plot (`mhalab-lra-table`, and at the
end of a `sweep=lra` multirun through mhalab.analysis.sweep_callbacks.LRATableCallback). The numbers come
from each member's metrics.json (mhalab.train.record) and perf.json (mhalab.train.callbacks.PerfMonitor:
median time per training step, peak memory over the fit); `retime=True` adds a section re-measured with
the kinds interleaved (mhalab.analysis.lra_timing).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mhalab.analysis.accuracy import ci_text, effect_text
from mhalab.analysis.lra_timing import retime_rows
from mhalab.analysis.options import doc, parse, split_dir
from mhalab.analysis.report.stats import GroupStats
from mhalab.errors import RunDirError, one_line_errors
from mhalab.model import ATTENTIONS
from mhalab.train import record
from mhalab.train.record.curves import masked_lm_finals

log = logging.getLogger(__name__)

# Tay et al. 2020, "Long Range Arena", Table 1 (test accuracy, %; full-size models, 1 TPU run each)
LRA_PAPER = {
    "full": [("Transformer", 36.37, 64.27)],
    "window": [("Local Attention", 15.82, 52.98), ("Longformer", 35.63, 62.85)],
    "linformer": [("Linformer", 35.70, 53.94)],
    "performer": [("Performer", 18.01, 65.40)],
}
TASKS = {"listops": "ListOps", "imdb_bytes": "Text (IMDB bytes)"}
KINDS = ATTENTIONS  # the table's row order
PERF_FILE = "perf.json"  # written by mhalab.train.callbacks.PerfMonitor


def _read_perf(run_dir: Path) -> dict:
    try:
        data = json.loads((run_dir / PERF_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def collect_lra(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One row per member (any dir below sweep_dir with a metrics.json, read by mhalab.train.record)."""
    root = Path(sweep_dir)
    rows = []
    for mpath in sorted(root.rglob(record.FILE)):
        d = mpath.parent
        try:
            m = record.fields(d, record.read(d) or {})
        except ValueError as e:  # cut short or edited: a row that says so
            m = record.fields(d, {"status": "unreadable", "error": str(e)})
        perf = _read_perf(d)
        cfg = m["config"] if isinstance(m["config"], dict) else {}
        model, data = cfg.get("model") or {}, cfg.get("data") or {}
        steps = m["global_step"] or 0
        fit_s = m["fit_time_s"]
        rows.append({
            "dir": str(d.relative_to(root)) if d != root else ".",
            "task": data.get("name"), "attention": model.get("attention"), "status": m["status"],
            "error": m["error"],
            "test_acc": m["best"].get("test/acc"), "val_acc": m["best"].get("val/acc"),
            "step_ms": 1000 * perf["step_time_s"] if perf.get("step_time_s") is not None else None,
            "fit_ms_per_step": 1000 * fit_s / steps if fit_s and steps else None,
            "peak_mem_mb": perf.get("peak_mem_mb", m["peak_mem_mb"]),
            "peak_mem_kind": perf.get("peak_mem_kind", record.FILE),
            "baseline_mem_mb": perf.get("baseline_mem_mb"),
            "tokens_per_s": m["tokens_per_s"], "wall_time_s": m["wall_time_s"], "fit_time_s": fit_s,
            "global_step": steps, "epochs": m["epochs"], "params": m["params"],
            "max_len": data.get("max_len"), "max_examples": data.get("max_examples"),
            "dim": model.get("dim"), "heads": model.get("heads"), "layers": model.get("layers"), "model_cfg": model,
            "attention_options": model.get("attention_options"), "device": perf.get("device_name", m["device"]),
            "batch_size": data.get("batch_size"), "seed": m["seed"],
            **_pretraining(m["pretrain"]),
        })
    return rows


def _pretraining(pre: dict | None) -> dict[str, Any]:
    """A member's self-pretraining (mhalab.train.pretrain's facts in metrics.json), or none. The masked-LM loss and
    accuracy are the last epoch's mean, read from the encoder's own log where it still is (encoders pretrained
    before meta.json recorded that mean kept one batch's value), else meta's."""
    pre = pre if isinstance(pre, dict) else {}
    log_csv = Path(pre["dir"]) / "logs" / "metrics.csv" if pre.get("dir") else None
    finals = masked_lm_finals(log_csv) if log_csv is not None and log_csv.exists() else pre
    return {"pretrained": bool(pre), "pretrain_dir": pre.get("dir"), "pretrain_epochs": (pre.get("pretrain") or {}).get("epochs"),
            "pretrain_min": pre["wall_time_s"] / 60 if pre.get("wall_time_s") is not None else None,
            "pretrain_loss": finals.get("final_loss"), "pretrain_acc": finals.get("final_acc")}


def _fmt(x, digits=1, scale=1.0, suffix="") -> str:
    try:
        v = float(x) * scale
    except (TypeError, ValueError):
        return "–"
    return "–" if math.isnan(v) else f"{v:.{digits}f}{suffix}"


def _members(rows, task, kind, pretrained=False):
    """The members of one cell: (finished ones, or every one when none finished)."""
    found = [r for r in rows if r["task"] == task and r["attention"] == kind and r["pretrained"] == pretrained]
    return [r for r in found if r["status"] == "finished"] or found


def _stats(members, key: str = "test_acc") -> GroupStats:
    """Per-seed accuracy (in %) of finished members, for mhalab.analysis.report.stats."""
    done = [r for r in members if r["status"] == "finished" and r[key] is not None]
    df = pd.DataFrame({"seed": [r["seed"] for r in done], "monitored": [100 * float(r[key]) for r in done]})
    return GroupStats.of(_label(members[0]["attention"], members[0]["pretrained"]) if members else "", df)


def _acc_cell(members) -> str:
    """One seed: the accuracy (2 decimals, as the paper prints it); more: mean and its 95% t-interval."""
    g = _stats(members)
    return f"{g.mean:.2f}" if g.n_seeds == 1 else ci_text(g)


def _median(members, key):
    vals = [float(r[key]) for r in members if r["status"] == "finished" and r[key] is not None]
    return float(np.median(vals)) if vals else None


def _variants(rows) -> list[bool]:
    """From scratch first, then self-pretrained, as far as the rows have them."""
    return [p for p in (False, True) if any(r["pretrained"] == p for r in rows)]


def _label(kind: str, pretrained: bool) -> str:
    return f"{kind} + MLM" if pretrained else kind


def render_lra_markdown(rows: list[dict[str, Any]], title: str = "Long-sequence benchmark (LRA-style, CPU scale)",
                        notes: str = "", plot: str | None = None) -> str:
    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)] + sorted(
        {r["task"] for r in rows if r["task"] not in TASKS and r["task"]})
    lines = [f"# {title}", ""]
    if notes:
        lines += [notes.strip(), ""]
    head = "| attention |"
    sep = "|---|"
    for t in tasks:
        name = TASKS.get(t, t)
        head += f" {name}: test acc % | {name}: ms / step | {name}: peak mem MB |"
        sep += "---:|---:|---:|"
    head += " LRA paper (Table 1): ListOps / Text test acc % |"
    sep += "---|"
    lines += ["## Our runs, with the LRA paper's figures alongside", "",
              ("Different scale: our numbers come from tiny models trained for minutes on a CPU (settings "
              "above); the paper's from full-size models trained for thousands of steps on TPUs. Compare "
              "the kinds within a column, not our column with the paper's."), "", head, sep]
    for kind in KINDS + tuple(sorted({r["attention"] for r in rows if r["attention"] not in KINDS and r["attention"]})):
        for pretrained in _variants(rows):
            if not any(r["attention"] == kind and r["pretrained"] == pretrained for r in rows):
                continue
            cells = f"| {_label(kind, pretrained)} |"
            for t in tasks:
                members = _members(rows, t, kind, pretrained)
                if not members:
                    cells += " – | – | – |"
                elif members[0]["status"] != "finished":
                    cells += f" {members[-1]['status']} | – | – |"
                else:
                    cells += (f" {_acc_cell(members)} | {_fmt(_median(members, 'step_ms'), 0)} | "
                              f"{_fmt(max((r['peak_mem_mb'] for r in members if r['peak_mem_mb'] is not None), default=None), 0)} |")
            paper = "; ".join(f"{name} {lo:.2f} / {tx:.2f}" for name, lo, tx in LRA_PAPER.get(kind, []))
            lines.append(cells + f" {paper or '–'} |")
    lines += ["", ("Uniform guessing scores 10% on ListOps and 50% on Text; always answering ListOps' most "
                   "frequent class (0 or 9) scores about 15-17%."), ""]
    if any(len({r["seed"] for r in rows if r["task"] == t and r["attention"] == k}) > 1
           for t in tasks for k in KINDS) or True in _variants(rows):
        lines += _over_seeds(rows, tasks)

    lines += ["## Every member", "",
              ("| task | attention | seed | status | test acc % | best val acc % | ms / step (median) | fit ms / step "
              "| peak mem MB | mem at fit start MB | tokens/s | steps | fit s | params |"),
              "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (str(r["task"]), r["pretrained"],
                                         KINDS.index(r["attention"]) if r["attention"] in KINDS else 9, str(r["seed"]))):
        lines.append(
            f"| {r['task']} | {_label(r['attention'], r['pretrained'])} | {r['seed']} | {r['status']}{': ' + str(r['error']) if r['error'] else ''} | "
            f"{_fmt(r['test_acc'], 2, 100)} | {_fmt(r['val_acc'], 2, 100)} | {_fmt(r['step_ms'], 0)} | "
            f"{_fmt(r['fit_ms_per_step'], 0)} | {_fmt(r['peak_mem_mb'], 0)} | {_fmt(r['baseline_mem_mb'], 0)} | "
            f"{_fmt(r['tokens_per_s'], 0)} | {r['global_step']} | {_fmt(r['fit_time_s'], 0)} | {r['params']} |")
    kinds = sorted({r["peak_mem_kind"] for r in rows if r.get("peak_mem_kind")})
    devices = sorted({str(r["device"]) for r in rows if r.get("device")})
    lines += ["", (f"Columns: *ms / step* = median time of one training step (forward, backward, optimizer; first "
              f"steps left out), from PerfMonitor; *fit ms / step* = the whole fit (validation included) / steps; "
              f"*peak mem* = {', '.join(kinds) or 'n/a'} over the fit (on CPU the process's peak resident memory, "
              f"Python, data and model included: the attention's share is the difference between kinds); "
              f"device: {', '.join(devices) or 'n/a'}.")]
    if plot:
        lines += ["", f"![accuracy, time and memory per attention kind]({plot})"]
    return "\n".join(lines) + "\n"


def _over_seeds(rows, tasks) -> list[str]:
    """Every (task, kind, pretraining) over its seeds, and the paired effects that rank them."""
    lines = ["## Over seeds: the ranking and self-pretraining's effect", "",
             ("Accuracy in %, mean over seeds and its 95% t-interval; effects paired by seed (the runs of one seed "
              "share the data order), 95% interval (mhalab.analysis.report.stats.compare). *vs full*: against full "
              "attention with the same pretraining; *vs from scratch*: against the same kind without it."), "",
             ("| task | attention | seeds | test acc [95% CI] | val acc | vs full [95% CI] | vs from scratch [95% CI] "
              "| pretraining min | masked-LM loss / acc (last epoch) |"),
             "|---|---|---|---|---:|---|---|---:|---|"]
    for t in tasks:
        for pretrained in _variants(rows):
            full = _stats(_members(rows, t, "full", pretrained))
            for kind in KINDS:
                members = [r for r in _members(rows, t, kind, pretrained) if r["status"] == "finished"]
                if not members:
                    continue
                g = _stats(members)
                vs_full = effect_text(g, full) if kind != "full" and full.n_seeds else ""
                vs_scratch = effect_text(g, _stats(_members(rows, t, kind, False))) if pretrained else ""
                encoders = {r["pretrain_dir"]: r for r in members if r.get("pretrain_dir")}.values()
                pre_min = ", ".join(_fmt(r["pretrain_min"]) for r in encoders)
                mlm = ", ".join(f"{_fmt(r['pretrain_loss'], 2)} / {_fmt(r['pretrain_acc'], 1, 100)}%" for r in encoders)
                seeds = ",".join(str(s) for s in sorted(g.per_seed.index))
                lines.append(f"| {TASKS.get(t, t)} | {_label(kind, pretrained)} | {seeds} | {ci_text(g)} | "
                             f"{_stats(members, 'val_acc').mean:.1f} | {vs_full} | {vs_scratch} | {pre_min} | {mlm} |")
    return lines + [""]


def plot_lra(rows: list[dict[str, Any]], path: str | Path) -> Path:
    from matplotlib.figure import Figure  # drawn on a Figure of its own: no pyplot state, no backend switch

    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    kinds = [k for k in KINDS if any(r["attention"] == k for r in rows)]
    groups = [(t, p) for t in tasks for p in _variants(rows)]
    metrics = [("test_acc", "test accuracy (%)", 100.0), ("step_ms", "ms per training step", 1.0),
               ("peak_mem_mb", "peak memory (MB)", 1.0)]
    fig = Figure(figsize=(13, 3.8))
    axes = fig.subplots(1, 3)
    width = 0.8 / max(len(kinds), 1)
    x = np.arange(len(groups))
    for ax, (key, label, scale) in zip(axes, metrics):
        for i, k in enumerate(kinds):
            vals, errs = [], []
            for t, p in groups:
                done = [float(r[key]) * scale for r in _members(rows, t, k, p)
                        if r["status"] == "finished" and r[key] is not None]
                vals.append(np.mean(done) if done else np.nan)
                # the spread over seeds where there are several (1.96 standard errors: about the 95% interval)
                errs.append(1.96 * np.std(done, ddof=1) / np.sqrt(len(done)) if len(done) > 1 else 0.0)
            ax.bar(x + (i - (len(kinds) - 1) / 2) * width, vals, width, yerr=errs, label=k)
        ax.set_xticks(x)
        ax.set_xticklabels([TASKS.get(t, t) + (" + MLM" if p else "") for t, p in groups], fontsize=8)
        ax.set_title(label, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def settings_notes(rows: list[dict[str, Any]]) -> str:
    """A short description of the scale, from the members' configs."""
    if not rows:
        return ""
    parts = []
    for t in [t for t in TASKS if any(r["task"] == t for r in rows)]:
        r = next(r for r in rows if r["task"] == t)
        parts.append(f"{TASKS[t]}: max_len {r['max_len']}, batch {r['batch_size']}")
    r = rows[0]
    return (f"Scale: dim {r['dim']}, {r['heads']} heads, {r['layers']} layers; attention options "
            f"{r['attention_options'] or {}}; " + "; ".join(parts) + ".")


def write_lra_table(sweep_dir: str | Path, out: str | Path | None = None, title: str | None = None,
                    notes: str = "", plot_name: str = "lra_results.png", retime: bool = False,
                    retime_reps: int = 5) -> dict[str, Any]:
    """Write the table (markdown) and its plot next to it; returns {markdown, plot, rows}.
    retime: also re-measure the step time of every kind, interleaved, at each task's length."""
    rows = collect_lra(sweep_dir)
    if not rows:
        raise RunDirError(f"no metrics.json under {sweep_dir}: not a sweep dir of training runs "
                          f"(e.g. multirun/lra after mhalab-train sweep=lra hydra.sweep.dir=multirun/lra).")
    if retime:
        notes = notes + "\n\n## Step time re-measured side by side\n\n" + retime_rows(rows, retime_reps) + (
            "\n\nThe sweep's own ms / step come from runs made one after the other, each under whatever load "
            "the shared machine had then; these re-timings interleave the kinds so the load hits them alike.")
    out = Path(out) if out else Path(sweep_dir) / "lra_table.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    plot = plot_lra(rows, out.parent / plot_name)
    text = render_lra_markdown(rows, title or "Long-sequence benchmark (LRA-style)",
                               "\n\n".join(x for x in (settings_notes(rows), notes) if x), plot.name)
    out.write_text(text)
    return {"markdown": str(out), "plot": str(plot), "rows": rows}


@dataclass
class TableOptions:
    """mhalab-lra-table's key=value options (after the sweep dir)."""

    out: str | None = field(default=None, metadata=doc("markdown path (default <sweep dir>/lra_table.md)"))
    title: str | None = field(default=None, metadata=doc("the table's title"))
    notes: str = field(default="", metadata=doc("markdown put under the title (how the runs were made)"))
    notes_file: str | None = field(default=None, metadata=doc("read the notes from this file"))
    plot: str = field(default="lra_results.png", metadata=doc("the plot's file name, next to the table"))
    retime: bool = field(default=False, metadata=doc("also re-time a step of every kind, interleaved (minutes)"))
    retime_reps: int = field(default=5, metadata=doc("repetitions of each re-timing"))


USAGE = ("mhalab-lra-table <sweep dir> [out=results/lra/README.md] [plot=lra_results.png] [retime=true] "
         "[notes_file=notes.md]")


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    """mhalab-lra-table: the table of a long-sequence sweep; `error: ...` and exit 2 for a dir with no runs."""
    sweep_dir, words = split_dir(sys.argv[1:] if argv is None else argv, USAGE)
    o = parse(TableOptions, words, "mhalab-lra-table", __doc__.splitlines()[0] + "\n\n    " + USAGE)
    notes = Path(o.notes_file).read_text() if o.notes_file else o.notes
    res = write_lra_table(sweep_dir, o.out, o.title, notes, plot_name=o.plot, retime=o.retime,
                          retime_reps=o.retime_reps)
    print(f"{len(res['rows'])} runs; wrote {res['markdown']} and {res['plot']}")
    return 0
