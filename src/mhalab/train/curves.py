"""Plots drawn from a run's own logs (Lightning's metrics.csv), on matplotlib Figure objects: no pyplot
state and no backend switch, so importing or calling this changes nothing global."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure


def read_log(metrics_csv: str | Path) -> pd.DataFrame:
    """Lightning's CSV log: one row per logging call, NaN in the columns not logged that time."""
    return pd.read_csv(metrics_csv)


def loss_curves(metrics_csv: str | Path, out_png: str | Path) -> Path:
    df = read_log(metrics_csv)
    fig = Figure(figsize=(11, 4))
    ax_loss, ax_acc = fig.subplots(1, 2)
    if "train/loss" in df:
        tr = df.dropna(subset=["train/loss"])
        ax_loss.plot(tr["step"], tr["train/loss"], alpha=0.35, lw=0.8, label="train/loss (per step)")
        smooth = tr["train/loss"].rolling(max(1, len(tr) // 30), min_periods=1).mean()
        ax_loss.plot(tr["step"], smooth, lw=1.8, label="train/loss (smoothed)")
    if "val/loss" in df:
        va = df.dropna(subset=["val/loss"])
        ax_loss.plot(va["step"], va["val/loss"], "o-", lw=2, label="val/loss")
    ax_loss.set(xlabel="step", ylabel="cross-entropy", title="loss")
    ax_loss.legend()
    if "val/acc" in df:
        va = df.dropna(subset=["val/acc"])
        ax_acc.plot(va["step"], va["val/acc"], "o-", color="tab:green", label="val/acc")
        ax_acc.legend()
    ax_acc.set(xlabel="step", ylabel="accuracy", title="validation accuracy")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    return Path(out_png)
