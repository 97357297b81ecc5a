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


def loss_curves(metrics_csv: str | Path, out_png: str | Path) -> Path:
    """Training loss per step (smoothed too) and validation loss and accuracy per epoch (the validations of fit:
    run.py keeps the best checkpoint's re-validation out of the log); for a pretraining log (mhalab.train.pretrain),
    its masked-LM loss and masked-token accuracy per step."""
    from matplotlib.figure import Figure  # here: reading a log (last_epoch_means) needs no matplotlib

    df = read_log(metrics_csv)
    fig = Figure(figsize=(11, 4))
    ax_loss, ax_acc = fig.subplots(1, 2)
    for key in ("train/loss", "pretrain/loss"):
        if key in df:
            tr = df.dropna(subset=[key])
            if len(tr) < 10:  # a short run (or few logged steps): each point marked, nothing to smooth
                ax_loss.plot(tr["step"], tr[key], "o-", lw=1.2, label=f"{key} (logged steps)")
                continue
            ax_loss.plot(tr["step"], tr[key], alpha=0.35, lw=0.8, label=f"{key} (per step)")
            smooth = tr[key].rolling(max(1, len(tr) // 30), min_periods=1).mean()
            ax_loss.plot(tr["step"], smooth, lw=1.8, label=f"{key} (smoothed)")
    if "val/loss" in df:
        va = df.dropna(subset=["val/loss"])
        ax_loss.plot(va["step"], va["val/loss"], "o-", lw=2, label="val/loss")
    ax_loss.set(xlabel="step", ylabel="cross-entropy", title="loss")
    if ax_loss.get_legend_handles_labels()[0]:  # (a log with no loss rows: no legend to draw)
        ax_loss.legend()
    title = "validation accuracy"
    if "val/acc" in df:
        va = df.dropna(subset=["val/acc"])
        ax_acc.plot(va["step"], va["val/acc"], "o-", color="tab:green", label="val/acc")
        ax_acc.legend()
    elif "pretrain/acc" in df:
        pa = df.dropna(subset=["pretrain/acc"])
        ax_acc.plot(pa["step"], pa["pretrain/acc"].rolling(max(1, len(pa) // 30), min_periods=1).mean(),
                    color="tab:green", label="pretrain/acc (smoothed)")
        ax_acc.legend()
        title = "masked-token accuracy"
    ax_acc.set(xlabel="step", ylabel="accuracy", title=title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    return Path(out_png)
