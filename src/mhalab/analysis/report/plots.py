"""The report's three plots, drawn on matplotlib Figure objects (no pyplot state, no backend switch):
val-loss curves of every member, accuracy against the swept value, accuracy against wall time."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from mhalab.analysis.report.collect import parse_setting, read_metrics_csv, training_val_rows
from mhalab.analysis.report.stats import valid_mask
from mhalab.analysis.report.values import fmt_num, to_float

PLOT_VAL_LOSS = "val_loss_curves.png"
PLOT_ACC_VS_SWEPT = "acc_vs_swept.png"
PLOT_ACC_VS_WALL = "acc_vs_wall_time.png"


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


UNFINISHED = "not trained to the end"  # the members the plots mark (report.trained says which)


def _mark_unfinished(ax, x: pd.Series, y: pd.Series, unfinished: pd.Series) -> None:
    """A red ring around each member not trained to the end: its point is not a finished model's."""
    if unfinished.any():
        ax.scatter(x[unfinished], y[unfinished], s=140, facecolors="none", edgecolors="red", linewidths=1.5,
                   label=f"{int(unfinished.sum())} {UNFINISHED} (ringed, each at its value)", zorder=5)


def plot_val_loss_curves(df: pd.DataFrame, path: Path, unfinished: pd.Series | None = None) -> Path:
    curves = []
    for _, r in df.iterrows():
        csv = read_metrics_csv(Path(r["_csv"])) if isinstance(r.get("_csv"), str) else None
        if csv is None or "val/loss" not in csv.columns:
            continue
        v = training_val_rows(csv, to_float(r.get("epochs")))
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
        cut = unfinished is not None and bool(unfinished.get(r.name, False))  # dotted: not trained to the end
        ax.plot(x, pd.to_numeric(v["val/loss"]), marker="o", ms=3, lw=1.3, alpha=0.85, color=colors[s],
                ls=":" if cut else "-", label=None if s in labelled else short[s])
        labelled.add(s)
    if unfinished is not None and any(bool(unfinished.get(r.name, False)) for r, _ in curves):
        ax.plot([], [], ls=":", color="k", label=f"dotted: {UNFINISHED}")
        labelled.add(UNFINISHED)
    if curves:
        _legend(ax, len(labelled))
    else:
        _empty(ax, "no val/loss in any metrics.csv")
    ax.set_xlabel("epoch" if use_epoch else "step")
    if use_epoch:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("val/loss")
    # a sweep continued from a results.csv has members whose logs are gone: the title says how many are drawn
    shown = "all members" if len(curves) == len(df) else f"{len(curves)} of {len(df)} members (the others have no validation log here)"
    ax.set_title(f"Validation loss, {shown}\n(one colour per setting; seeds share it)")
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


def plot_acc_vs_swept(df: pd.DataFrame, summary: pd.DataFrame, path: Path, unfinished: pd.Series | None = None
                      ) -> Path:
    """Mean +- std over seeds per setting; each member not trained to the end (`unfinished`, a mask of df) ringed
    at its own value."""
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
        if unfinished is not None:
            cut = v[unfinished.loc[v.index] & v["setting"].isin(list(xs))]
            _mark_unfinished(ax, cut["setting"].map(xs), pd.to_numeric(cut["best_val_acc"], errors="coerce"),
                             pd.Series(True, index=cut.index))
        _legend(ax, 2 * len(groups) + 1)
        if xkey is not None:
            xvals = sorted(set(xs.values()))
            if len(xvals) > 1 and all(_is_pow2(x) for x in xvals):
                ax.set_xscale("log", base=2)  # heads, dims: powers of 2 evenly spaced
            elif len(xvals) > 1 and xvals[0] > 0 and xvals[-1] / xvals[0] >= 100:
                ax.set_xscale("log")  # e.g. a learning rate
            if (len(xvals) <= 8 and ax.get_xscale() != "log") or all(_is_pow2(x) for x in xvals):
                ax.set_xticks(xvals)
                ax.set_xticklabels([fmt_num(x) for x in xvals])
                ax.minorticks_off()
    ax.set_xlabel(xkey if xkey else "setting")
    ax.set_ylabel("accuracy (mean ± std over seeds)")
    ax.set_title(f"Accuracy vs {xkey or 'setting'}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_acc_vs_wall_time(df: pd.DataFrame, path: Path, unfinished: pd.Series | None = None) -> Path:
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
        if unfinished is not None:
            _mark_unfinished(ax, t[keep], a[keep], unfinished.loc[keep[keep].index])
        _legend(ax, v[keep]["setting"].nunique() + 1)
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

