"""loss_curves.png (mhalab.train.record.curves): every logged training loss visible, an EMA that follows it with its window
in the legend, and each validation marked."""

from __future__ import annotations

import numpy as np
import pandas as pd

from mhalab.train.record.curves import ema, loss_curves, loss_figure

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _log(n_logged: int, every: int = 5, val_every: int = 40, seed: int = 0) -> tuple[pd.DataFrame, np.ndarray]:
    """A Lightning-like CSV log: train/loss every `every` steps (a decaying trend plus batch noise of SD 0.15), and
    a validation row every `val_every` steps; and the trend itself."""
    rng = np.random.default_rng(seed)
    steps = np.arange(1, n_logged + 1) * every - 1
    trend = 0.4 + 0.9 * np.exp(-steps / 300)
    rows = [{"step": s, "train/loss": t + rng.normal(0, 0.15)} for s, t in zip(steps, trend)]
    rows += [{"step": s, "val/loss": 0.5 + 0.5 * np.exp(-s / 300), "val/acc": 0.9 - 0.3 * np.exp(-s / 300)}
             for s in range(val_every - 1, steps[-1] + 1, val_every)]
    return pd.DataFrame(rows).sort_values("step", kind="stable").reset_index(drop=True), trend


def test_the_ema_follows_the_trend_through_the_noise_and_the_legend_states_its_window():
    df, trend = _log(200)
    loss_ax, acc_ax = loss_figure(df).axes
    lines = {line.get_label(): line for line in loss_ax.get_lines()}
    raw = lines["train/loss (each logged step)"]
    smooth = lines["train/loss, EMA over 20 logged points ≈ 100 steps"]  # 10% of 200 points, logged every 5 steps
    assert len(raw.get_ydata()) == 200 and raw.get_alpha() >= 0.4  # every logged step, drawn to be seen
    y = np.asarray(smooth.get_ydata(), float)
    noise = np.asarray(raw.get_ydata(), float) - trend
    # it follows: off the trend by under half the batch noise on average, and by under the noise's SD anywhere
    assert np.abs(y - trend).mean() < 0.5 * noise.std() and np.abs(y - trend).max() < noise.std() * 1.5
    assert np.abs(np.diff(y)).mean() < 0.25 * np.abs(np.diff(raw.get_ydata())).mean()  # and it is smooth
    val = lines["val/loss (each validation)"]
    assert val.get_marker() == "o" and len(val.get_xdata()) == 25  # a marker at each of the 25 validations
    (acc,) = acc_ax.get_lines()
    assert acc.get_marker() == "o" and len(acc.get_xdata()) == 25


def test_a_short_log_marks_each_point_and_draws_no_ema(tmp_path):
    df, _ = _log(6, val_every=10)
    labels = [line.get_label() for line in loss_figure(df).axes[0].get_lines()]
    assert labels == ["train/loss (each logged step)", "val/loss (each validation)"]
    assert loss_curves_png(df, tmp_path).read_bytes()[:8] == PNG_MAGIC


def loss_curves_png(df: pd.DataFrame, tmp_path):
    df.to_csv(tmp_path / "metrics.csv", index=False)
    return loss_curves(tmp_path / "metrics.csv", tmp_path / "loss_curves.png")


def test_ema_starts_at_the_data_not_at_zero():
    values = pd.Series([1.0, 1.0, 1.0, 0.0])
    assert ema(values, 8).tolist()[:3] == [1.0, 1.0, 1.0]  # bias-corrected: the first points are their own average
    assert 0 < ema(values, 8).iloc[-1] < 1
