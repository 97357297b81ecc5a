"""report.md: scale measured, per-setting mean ± std over seeds, best setting, verdicts, failed members, plots."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mhalab.analysis.report import trained
from mhalab.analysis.report.collect import RESULTS_CSV
from mhalab.analysis.report.stats import (
    ALPHA,
    MIN_SEEDS,
    Comparison,
    GroupStats,
    compare,
    fmt_p,
    higher_is_better,
    points_scale,
    top_settings,
    valid_mask,
)
from mhalab.analysis.report.values import finite, fmt_num, to_float
from mhalab.analysis.report.verdicts import Verdict
from mhalab.train.record import extent

REPORT_MD = "report.md"


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _pm(mean: float, std: float, scale: float, digits: int) -> str:
    if not finite(mean):
        return "–"
    s = f"{mean * scale:.{digits}f}"
    return s + (f" ± {std * scale:.{digits}f}" if finite(std) else " ± –")


def _uniq(df: pd.DataFrame, col: str) -> str:
    vals = df[col].dropna().tolist() if col in df.columns else []
    out = []
    for v in vals:
        v = fmt_num(v) if isinstance(v, (int, float, np.integer, np.floating)) else str(v)
        if v not in out:
            out.append(v)
    try:
        out.sort(key=float)
    except ValueError:
        out.sort()
    return ", ".join(out) if out else "?"


def _limits(df: pd.DataFrame) -> str:
    """'limit_train_batches=10, limit_test_batches=5': the limits other than the whole split (Lightning's 1.0)."""
    out = []
    for split in ("train", "val", "test"):
        if vals := trained.limit_values(df[f"limit_{split}_batches"]):
            out.append(f"limit_{split}_batches={', '.join(vals)}")
    return ", ".join(out)


def _resolution(df: pd.DataFrame, metric: str, margin: float) -> str:
    """extent.resolution_note for the smallest validation split a finished member was evaluated on (its size times
    the share limit_val_batches left), at the report's margin in points; '' for a metric that is not an accuracy."""
    scale = points_scale(metric)[0]
    ok = df[valid_mask(df)]
    n = pd.to_numeric(ok["val_size"], errors="coerce") * pd.to_numeric(ok["val_evaluated"], errors="coerce").fillna(1)
    return extent.resolution_note(n.min(), margin * scale) if scale == 100 and n.notna().any() else ""


def _trained_lines(df: pd.DataFrame, metric: str, margin: float) -> list[str]:
    """What the members trained and evaluated against their plan (report.trained's columns), and who was not
    trained to the end."""
    if not trained.checked(df):
        return []
    steps, planned = (pd.to_numeric(df[c], errors="coerce").dropna() for c in ("global_step", "planned_steps"))
    ok = valid_mask(df)
    cut = trained.not_trained_mask(df[ok], margin)
    per_epoch = trained.span(df["steps_per_epoch"])
    lines = [(f"- optimizer steps: run {trained.span(steps)}, planned {trained.span(planned)} (max_epochs "
              f"{_uniq(df, 'max_epochs')} × {per_epoch} steps an epoch over the whole training split, or max_steps)")]
    if limits := _limits(df):
        lines.append(f"- limits: {limits}")
    lines.append(f"- evaluated: validation {trained.evaluated_share(df['val_evaluated'])}, test "
                 f"{trained.evaluated_share(df['test_evaluated'])} of the split")
    early = df["stopped_early"].map(lambda x: str(x).lower() == "true")
    if early.any():
        lines.append(f"- early stopping ended {int(early.sum())} of {len(df)} members")
    if cut.any():
        lines.append(f"- **not trained to the end**: {int(cut.sum())} of {int(ok.sum())} finished members "
                     f"({trained.why(df[ok], metric, margin)}): they are named below")
    else:
        lines.append(f"- trained to the end: every finished member (its planned steps, and not still improving by "
                     f"more than the margin over its last {trained.WINDOW} validations)")
    return lines


def _scale_lines(df: pd.DataFrame, metric: str, margin: float) -> list[str]:
    epochs = pd.to_numeric(df["epochs"], errors="coerce").dropna()
    params = pd.to_numeric(df["params"], errors="coerce").dropna()
    wall = pd.to_numeric(df["wall_time_s"], errors="coerce").dropna()
    sizes = "; ".join(f"{name} {_uniq(df, col)}" for name, col in (("train", "train_size"), ("validation", "val_size"),
                                                                   ("test", "test_size")) if df[col].notna().any())
    files = f" (files: {_uniq(df, 'data_files')})" if df["data_files"].notna().any() else ""
    lines = [
        f"- data set: {_uniq(df, 'dataset')}{files}; max_len: {_uniq(df, 'max_len')}; batch_size: {_uniq(df, 'batch_size')}",
        *([f"- examples per split: {sizes}"] if sizes else []),
        *([f"- resolution: {note}"] if (note := _resolution(df, metric, margin)) else []),
        (f"- embed dim: {_uniq(df, 'dim')}; heads: {_uniq(df, 'heads')}; head_dim: {_uniq(df, 'head_dim')}; "
        f"layers: {_uniq(df, 'layers')}"),
        (f"- ff_dim: {_uniq(df, 'ff_dim')} (ff_dim/dim: {_uniq(df, 'ff_ratio')}); dropout: {_uniq(df, 'dropout')}; "
        f"lr: {_uniq(df, 'lr')}"),
        f"- attention: {_uniq(df, 'attention')}; positions: {_uniq(df, 'pos')}",
        *([(f"- random draws: initial weights {_uniq(df, 'init_draw')} (keyed: common random numbers across "
            f"settings); dropout masks {_uniq(df, 'dropout_draw')}")]
          if "init_draw" in df and df["init_draw"].notna().any() else []),
        f"- epochs: max_epochs {_uniq(df, 'max_epochs')}, run "
        + (f"{int(epochs.min())}–{int(epochs.max())}" if len(epochs) else "?"),
        *_trained_lines(df, metric, margin),
        f"- device: {_uniq(df, 'device')}",
        "- parameters: " + (f"{int(params.min()):,}–{int(params.max()):,}" if len(params) else "?"),
        "- total wall time: " + (f"{wall.sum() / 3600:.2f} h over {len(wall)} members" if len(wall) else "?"),
    ]
    dims = pd.to_numeric(df["dim"], errors="coerce").dropna()
    if len(dims) and dims.max() < 512:
        lines.append(f"- note: the article's advice is for embed_dim 512–1024; this sweep measured dim ≤ "
                     f"{fmt_num(dims.max())}, so the verdicts hold at this (smaller) scale only.")
    return lines


def _ci(c: Comparison, scale: float, digits: int) -> str:
    if not finite(c.ci_low):
        return "[–]"
    return f"[{c.ci_low * scale:+.{digits}f}, {c.ci_high * scale:+.{digits}f}]"


def p_cell(c: Comparison | None) -> str:
    """The p-value that decided the comparison (Holm-corrected): equivalence, better, or worse."""
    if c is None or c.test == "none":
        return "–"
    if c.outcome == "equivalent":
        return f"equiv. {fmt_p(c.p_equivalent_holm)}"
    return fmt_p(c.p_diff_holm)


def render_markdown(df: pd.DataFrame, summary: pd.DataFrame, verdicts: list[Verdict], metric: str,
                    name: str, plots: dict[str, Path], margin: float, sequential: list[str] = ()) -> str:
    """name: the sweep's (write_report's report_name); margin: in metric units (Verdict.margin); sequential: the
    section of a sweep run until decided (sequential.markdown), which comes first."""
    scale, unit = points_scale(metric)
    digits = 2 if scale == 100 else 4
    ok = valid_mask(df)
    n_fail = int((~ok).sum())
    withheld = trained.best_withheld(df, metric, margin)
    L = [f"# Sweep report: `{name}`", ""]
    L += [(f"{len(df)} members, {int(ok.sum())} finished with `{metric}`, {n_fail} failed or incomplete. "
          f"Monitored metric: `{metric}` (best over epochs, "
          f"{'higher' if higher_is_better(metric) else 'lower'} is better); test metrics are reported, "
          "never used for selection."), ""]
    if df.attrs.get("common"):  # left out of the setting labels below
        L += [f"Every member: `{' '.join(df.attrs['common'])}`.", ""]
    csv_rows = df.attrs.get("csv_rows", 0)  # a sweep continued from a results.csv: rows whose member dirs are gone
    if df.attrs.get("from_csv") or csv_rows:
        checks = ("val_majority_acc", "val_classes_predicted", "planned_steps")
        lacking = df.loc[ok, list(checks)].isna()  # finished rows written before these columns existed
        missing = [c for c in checks if lacking[c].any()]
        n, whole = int(lacking.any(axis=1).sum()), int(ok.sum())
        unchecked = " and ".join(x for x, cols in (("learned", ("val_majority_acc", "val_classes_predicted")),
                                                   ("was trained to the end", ("planned_steps",)))
                                 if set(cols) & set(missing))
        which = (f"the file predates {', '.join(missing)}, so whether each model" if n == whole else
                 f"the rows of {n} of {whole} finished members predate {', '.join(missing)}, so whether each of them")
        L += [("Written from this dir's results.csv: its member dirs are gone" if df.attrs.get("from_csv") else
               f"{csv_rows} of {len(df)} members come from this dir's results.csv (their member dirs are gone)")
              + (f"; {which} {unchecked} is not checked" if missing else "") + ".", ""]
    if notes := df.attrs.get("notes"):  # what report.integrity normalised before averaging
        L += ["Normalised before averaging: " + "; ".join(notes) + ".", ""]
    L += list(sequential)
    L += ["## Scale measured", ""] + _scale_lines(df, metric, margin) + [""]

    L += ["## Per-setting results (mean ± std over seeds)", ""]
    acc_s = "(×100)"
    head = ["setting", "n seeds", f"best val acc {acc_s}", f"test acc {acc_s}", "wall time (s)", "params",
            "failed"]
    if metric != "val/acc":
        head.insert(2, f"{metric}{' (×100)' if scale == 100 else ''}")
    L += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    best_one = [] if withheld else top_settings(summary)["setting"].tolist()
    for _, r in summary.iterrows():  # the best setting in bold; none in a tie
        name = f"**{_md(r['setting'])}**" if best_one == [r["setting"]] else _md(r["setting"])
        cells = [name, str(r["n"]), _pm(r["best_val_acc_mean"], r["best_val_acc_std"], 100, 2),
                 _pm(r["test_acc_mean"], r["test_acc_std"], 100, 2),
                 f"{r['wall_time_mean']:.0f}" if finite(r["wall_time_mean"]) else "–",
                 f"{int(r['params']):,}" if finite(r["params"]) else "–", str(r["n_failed"])]
        if metric != "val/acc":
            cells.insert(2, _pm(r["monitored_mean"], r["monitored_std"], scale, digits))
        L.append("| " + " | ".join(cells) + " |")
    L.append("")

    L += ["## Best setting", ""]
    ranked, top = summary[summary["n"] > 0], top_settings(summary)
    if ranked.empty:
        L += ["No finished member: no best setting.", ""]
    elif withheld:
        L += [f"No best setting: {withheld}", ""]
    elif len(top) > 1:
        L += [(f"No best setting: {', '.join(f'**{_md(x)}**' for x in top['setting'])} tie at `{metric}` "
              f"{top['monitored_mean'].iloc[0] * scale:.{digits}f}{unit}."), ""]
    else:
        b = ranked.iloc[0]
        L.append(f"**{_md(b['setting'])}**: `{metric}` {_pm(b['monitored_mean'], b['monitored_std'], scale, digits)}"
                 f"{unit} over {b['n']} seed(s); test acc {_pm(b['test_acc_mean'], b['test_acc_std'], 100, 2)} "
                 "(reported only).")
        if len(ranked) > 1:
            r2 = ranked.iloc[1]
            gap = abs(b["monitored_mean"] - r2["monitored_mean"]) * scale
            line = f"Runner-up **{_md(r2['setting'])}** is {gap:.{digits}f}{unit} behind"
            best_g, second_g = (GroupStats.of(str(x["setting"]), df[ok & (df["setting"] == x["setting"])])
                                for x in (b, r2))
            comp = compare(best_g, second_g, 1.0 if higher_is_better(metric) else -1.0, margin)  # one test: no Holm
            if comp.test == "none":
                line += " (fewer than 2 seeds: noise not measurable)."
            else:
                line += f" (95% CI of the gap {_ci(comp, scale, digits)}{unit}, {comp.test}, p = {fmt_p(comp.p_diff)})."
            L.append(line)
        if b["n"] < 2:
            L.append("Single seed: the ranking is not protected against seed noise.")
        L.append("")

    L += ["## Verdicts on the article's claims", ""]
    L += [(f"Rule (mhalab.analysis.report.stats): each group is one value per seed, the mean `{metric}` of its "
          "members at that seed; the claimed group is compared with each alternative by a paired t-test on the "
          f"per-seed differences when they share seeds (else Welch's), two-sided at {ALPHA:g} for better / "
          f"worse and by TOST for equivalence within ±{margin * scale:g}{unit} (the margin), each "
          "Holm-corrected across the claim's alternatives. **supported**: better than every alternative; "
          "**contradicted**: worse than one; **no practical difference**: better than or within the margin of each; "
          f"**inconclusive**: an interval crosses the margin (or fewer than {MIN_SEEDS} seeds); **not decided**: a "
          "member of a compared group was not trained to the end (it stopped short of its planned steps, or its "
          f"`{metric}` still rose by more than the margin over its last {trained.WINDOW} validations: "
          "mhalab.analysis.report.trained), most members of a compared group did not learn (validation accuracy at "
          "the majority class's level, or one class predicted), or every member has the same value. Effect = claimed − "
          "alternative (> 0: claimed better) with its two-sided 95% CI; detectable = the smallest true effect that "
          f"comparison finds with 80% power at {ALPHA:g} / m for m alternatives, Holm's strictest step (from its seed "
          "variance; an inconclusive verdict rules out "
          "no effect below it; its why gives the seeds per group that would find an effect of the margin with "
          "80% power at that level, and their CPU hours at the members' measured wall time). Other swept variables "
          "are averaged over "
          "(marginal means; 'also varies' flags confounds); a swept lr is tuned per group (its best on "
          "validation)."), ""]
    vh = ["claim", "verdict", "claimed group", "closest alternative", f"effect{unit} [95% CI]",
          f"detectable{unit} (80%)", "test", "p (Holm)", "also varies", "why"]
    L += ["| " + " | ".join(vh) + " |", "|" + "---|" * len(vh)]

    def grp(g: GroupStats | None, v: Verdict) -> str:
        if g is None:
            return "–"
        at = f" at {v.tuned[g.label]}" if g.label in v.tuned else ""
        return f"{_md(g.label)}{at}: {_pm(g.mean, g.std, scale, digits)} (seeds={g.n_seeds})"

    for v in verdicts:
        h = v.headline
        L.append("| " + " | ".join([
            v.claim, f"**{v.verdict}**", grp(v.claimed, v), grp(h.alternative if h else None, v),
            f"{h.effect * scale:+.{digits}f} {_ci(h, scale, digits)}" if h and finite(h.effect) else "–",
            f"{h.detectable * scale:.{digits}f}" if h and finite(h.detectable) else "–",
            h.test if h else "–", p_cell(h),
            ", ".join(f"{x} (confounded)" if x in v.confounded else x for x in v.also_varies) or "–",
            _md(v.reason)]) + " |")
    L.append("")
    many = [v for v in verdicts if v.covered and len(v.comparisons) > 1]
    if many:
        L += ["Every comparison per claim:", ""]
        for v in many:
            parts = [f"{grp(c.alternative, v)}: {c.outcome}, {c.effect * scale:+.{digits}f} {_ci(c, scale, digits)}, "
                     f"{p_cell(c)}" for c in v.comparisons]
            L.append(f"- {v.claim}, claimed {grp(v.claimed, v)}; " + "; ".join(parts))
        L.append("")

    cut = trained.not_trained_mask(df[ok], margin)
    if cut.any():
        L += ["## Not trained to the end", "",
              (f"Finished, but short of their planned steps or with `{metric}` still rising by more than the margin "
               f"over their last {trained.WINDOW} validations (mhalab.analysis.report.trained):"), "",
              "| member | setting | seed | steps run / planned | epochs | last gain |", "|---|---|---|---|---|---|"]
        for _, r in df[ok][cut].iterrows():
            gain = to_float(r["monitored_gain"])
            L.append(f"| {_md(r['member'])} | {_md(r['setting'])} | {r['seed']} | "
                     f"{fmt_num(to_float(r['global_step']))} / {fmt_num(to_float(r['planned_steps']))} | "
                     f"{fmt_num(to_float(r['epochs']))} / {fmt_num(to_float(r['max_epochs']))} | "
                     + (f"{gain * scale:+.{digits}f}{unit} |" if finite(gain) else "– |"))
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

