"""Plots drawn from a run's own logs (Lightning's metrics.csv), on matplotlib Figure objects: no pyplot
state and no backend switch, so importing or calling this changes nothing global."""

from __future__ import annotations

from pathlib import Path

import pandas as pd


def read_log(metrics_csv: str | Path) -> pd.DataFrame:
    """Lightning's CSV log: one row per logging call, NaN in the columns not logged that time."""
    return pd.read_csv(metrics_csv)


def last_epoch_means(metrics_csv: str | Path, keys: tuple[str, ...]) -> dict[str, float | None]:
    """The mean of each key over the last epoch's logged steps (every log_every_n_steps-th batch): one batch's
    value, the last, is noise (a ListOps batch predicts ~170 masked tokens); None where the log lacks the key."""
    df = read_log(metrics_csv)
    last = df[df["epoch"] == df["epoch"].max()] if "epoch" in df and len(df) else df
    return {k: float(last[k].mean()) if k in last and last[k].notna().any() else None for k in keys}


def masked_lm_finals(log_csv: str | Path) -> dict[str, float | None]:
    """A pretraining's final_loss / final_acc (its meta.json; mhalab.analysis.lra reads the same from the log of
    encoders pretrained before this rule): masked-LM loss and masked-token accuracy over the last epoch's logged
    steps; None without a log."""
    if not Path(log_csv).exists():
        return {"final_loss": None, "final_acc": None}
    m = last_epoch_means(log_csv, ("pretrain/loss", "pretrain/acc"))
    return {"final_loss": m["pretrain/loss"], "final_acc": m["pretrain/acc"]}


SMOOTH_FRACTION = 0.1   # the EMA's span: this share of the logged points (at least MIN_SPAN): it follows a trend
MIN_SPAN = 8           # that lasts longer than that, and averages the batch-to-batch noise out


def ema_span(n_points: int) -> int:
    """The EMA's span (in logged points) for a curve of n_points: SMOOTH_FRACTION of them, at least MIN_SPAN."""
    return max(MIN_SPAN, round(SMOOTH_FRACTION * n_points))


def ema(values: pd.Series, span: int) -> pd.Series:
    """The exponential moving average with this span (alpha = 2 / (span + 1)), bias-corrected at the start (pandas'
    adjust=True: the first points are averages of what came before, not pulled toward 0)."""
    return values.ewm(span=span, adjust=True).mean()


def _draw_train(ax, df: pd.DataFrame, key: str, color: str) -> None:
    """A train curve: every logged step, visible, and its EMA over a window the legend states."""
    tr = df.dropna(subset=[key])
    if len(tr) < 2 * MIN_SPAN:  # a short run: each point marked, nothing to smooth
        ax.plot(tr["step"], tr[key], "o-", color=color, lw=1.2, ms=3, label=f"{key} (each logged step)")
        return
    span = ema_span(len(tr))
    every = tr["step"].diff().median()
    steps = f" ≈ {span * every:,.0f} steps" if every and every > 1 else ""
    ax.plot(tr["step"], tr[key], color=color, alpha=0.45, lw=0.9, label=f"{key} (each logged step)")
    ax.plot(tr["step"], ema(tr[key], span), color=color, lw=2.2, label=f"{key}, EMA over {span} logged points{steps}")


def loss_curves(metrics_csv: str | Path, out_png: str | Path) -> Path:
    """The run's loss_curves.png from its Lightning CSV log (loss_figure)."""
    loss_figure(read_log(metrics_csv)).savefig(out_png, dpi=110)
    return Path(out_png)


def loss_figure(df: pd.DataFrame):
    """Training loss per logged step and its EMA (the window in the legend), validation loss and accuracy at each
    validation of fit, marked (run.py keeps the best checkpoint's re-validation out of the log); for a pretraining
    log (mhalab.train.pretrain), its masked-LM loss and masked-token accuracy per step. A matplotlib Figure."""
    from matplotlib.figure import Figure  # here: reading a log (last_epoch_means) needs no matplotlib

    fig = Figure(figsize=(11, 4.2))
    ax_loss, ax_acc = fig.subplots(1, 2)
    for key in ("train/loss", "pretrain/loss"):
        if key in df:
            _draw_train(ax_loss, df, key, "tab:blue")
    if "val/loss" in df:
        va = df.dropna(subset=["val/loss"])
        ax_loss.plot(va["step"], va["val/loss"], "o--", color="tab:red", lw=1.2, ms=6, mec="white", zorder=3,
                     label="val/loss (each validation)")
    ax_loss.set(xlabel="optimizer step", ylabel="cross-entropy", title="loss")
    ax_loss.grid(alpha=0.3)
    if ax_loss.get_legend_handles_labels()[0]:  # (a log with no loss rows: no legend to draw)
        ax_loss.legend(fontsize=8)
    title = "validation accuracy"
    if "val/acc" in df:
        va = df.dropna(subset=["val/acc"])
        ax_acc.plot(va["step"], va["val/acc"], "o-", color="tab:green", ms=6, mec="white",
                    label="val/acc (each validation)")
        ax_acc.legend(fontsize=8)
    elif "pretrain/acc" in df:
        _draw_train(ax_acc, df, "pretrain/acc", "tab:green")
        ax_acc.legend(fontsize=8)
        title = "masked-token accuracy"
    ax_acc.set(xlabel="optimizer step", ylabel="accuracy", title=title)
    ax_acc.grid(alpha=0.3)
    fig.tight_layout()
    return fig
