"""Long-sequence benchmark support: time per step and peak memory of a run, and the LRA-style table.

* `PerfMonitor` (a Lightning callback, on in `sweep=lra` / `sweep=lra_gpu`): times every training
  step (forward + backward + optimizer; CUDA-synchronised; the first `warmup` steps are left out) and
  records peak memory over the fit: CUDA `max_memory_allocated`, or on CPU the process's peak resident
  set (VmHWM, reset at fit start through /proc/self/clear_refs, so sweep members that share one
  process are measured separately; where the reset is refused, getrusage's lifetime peak, marked so).
  It logs perf/step_ms and perf/peak_mem_mb and writes `perf.json` into the run's output dir.
* `reset_peak_memory()` / `peak_memory_mb()`: the same two measurements for any code.
* `write_lra_table(sweep_dir, out)`: accuracy, time per step and peak memory per attention kind per
  task, side by side with the LRA paper's Table 1 (`scripts/lra_table.py`, and at the end of a
  `sweep=lra` multirun through `LRATableCallback`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from mhalab.train.memory import current_rss_mb, peak_memory_mb, reset_peak_memory

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------- callback


class PerfMonitor(L.Callback):
    """Median / mean training step time and peak memory of the fit, into perf.json and the loggers."""

    def __init__(self, warmup: int = 3, filename: str = "perf.json"):
        self.warmup, self.filename = warmup, filename
        self._all_times: list[float] = []
        self._t0: float | None = None
        self._reset_ok = False
        self.baseline_mb = math.nan
        self.result: dict[str, Any] = {}

    def _sync(self, pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_fit_start(self, trainer, pl_module):
        self._all_times = []
        self.baseline_mb = (torch.cuda.memory_allocated(pl_module.device) / 2**20 if pl_module.device.type == "cuda"
                            else current_rss_mb())
        self._reset_ok = reset_peak_memory(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._sync(pl_module)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._t0 is None:
            return
        self._sync(pl_module)
        self._all_times.append(time.perf_counter() - self._t0)
        self._t0 = None

    @property
    def step_times(self) -> list[float]:
        """Step times after the warm-up (for a run shorter than that: all but the first, or all)."""
        t = self._all_times
        return t[self.warmup:] if len(t) > self.warmup else (t[1:] or t)

    def summary(self, pl_module) -> dict[str, Any]:
        peak, kind = peak_memory_mb(pl_module.device)
        if not self._reset_ok and kind == "cpu_peak_rss":
            kind = "cpu_lifetime_peak_rss"
        times = self.step_times
        return {
            "step_time_s": statistics.median(times) if times else math.nan,
            "step_time_mean_s": statistics.fmean(times) if times else math.nan,
            "steps_timed": len(times), "warmup_steps": self.warmup,
            "peak_mem_mb": peak, "peak_mem_kind": kind, "baseline_mem_mb": self.baseline_mb,
            "device": str(pl_module.device),
            "device_name": torch.cuda.get_device_name(pl_module.device) if pl_module.device.type == "cuda" else "cpu",
            "torch_threads": torch.get_num_threads(),
        }

    def on_train_epoch_end(self, trainer, pl_module):
        s = self.summary(pl_module)
        if not math.isnan(s["step_time_s"]):
            pl_module.log("perf/step_ms", 1000 * s["step_time_s"])
        pl_module.log("perf/peak_mem_mb", s["peak_mem_mb"])

    def on_fit_end(self, trainer, pl_module):
        self.result = self.summary(pl_module)
        if trainer.is_global_zero:
            path = Path(trainer.default_root_dir) / self.filename
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.result, indent=2))
            os.replace(tmp, path)


# ------------------------------------------------------------------------------ interleaved re-timing


def interleaved_step_times(model_cfg: dict[str, Any], seq_len: int, batch: int, kinds=("full", "window", "linformer",
                           "performer"), reps: int = 5, warmup: int = 1, vocab_size: int = 260, num_classes: int = 10,
                           seed: int = 0) -> dict[str, float]:
    """Median seconds of one training step (forward, backward, AdamW) per attention kind, on a full-length
    random batch (batch, seq_len), the kinds' steps interleaved (full, window, ..., full, window, ...)
    so that load from other processes on a shared machine hits every kind alike."""
    import torch.nn.functional as F

    from mhalab.model import SequenceClassifier

    torch.manual_seed(seed)
    cfg = {k: v for k, v in model_cfg.items() if k != "attention"} | {"max_len": max(seq_len, model_cfg.get("max_len", 0))}
    models = {k: SequenceClassifier(vocab_size, num_classes, attention=k, **cfg) for k in kinds}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    x = torch.randint(4, vocab_size, (batch, seq_len))
    y = torch.randint(0, num_classes, (batch,))
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for rep in range(warmup + reps):
        for k in kinds:
            t0 = time.perf_counter()
            F.cross_entropy(models[k](x), y).backward()
            opts[k].step()
            opts[k].zero_grad(set_to_none=True)
            if rep >= warmup:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def render_retiming(results: dict[int, dict[str, float]], batch: int, reps: int) -> str:
    lengths = sorted(results)
    lines = [f"| attention | {' | '.join(f'L = {n}: ms / step' for n in lengths)} |",
             "|---|" + "---:|" * len(lengths)]
    kinds = list(next(iter(results.values())))
    for k in kinds:
        lines.append(f"| {k} | " + " | ".join(f"{1000 * results[n][k]:.0f} ({results[n][k] / results[n][kinds[0]]:.2f}x)"
                                            for n in lengths) + " |")
    return (f"Median of {reps} training steps on a full-length random batch of {batch}, the kinds interleaved "
            f"(ratio to {kinds[0]} in brackets):\n\n" + "\n".join(lines))


# ---------------------------------------------------------------------------------------------- table

# Tay et al. 2020, "Long Range Arena", Table 1 (test accuracy, %; full-size models, 1 TPU run each)
LRA_PAPER = {
    "full": [("Transformer", 36.37, 64.27)],
    "window": [("Local Attention", 15.82, 52.98), ("Longformer", 35.63, 62.85)],
    "linformer": [("Linformer", 35.70, 53.94)],
    "performer": [("Performer", 18.01, 65.40)],
}
TASKS = {"listops": "ListOps", "imdb_bytes": "Text (IMDB bytes)"}
KINDS = ("full", "window", "linformer", "performer")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def collect_lra(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One row per member (any dir below sweep_dir with a metrics.json)."""
    root = Path(sweep_dir)
    rows = []
    for mpath in sorted(root.rglob("metrics.json")):
        d = mpath.parent
        m = _read_json(mpath)
        perf = _read_json(d / "perf.json")
        cfg = m.get("config") or {}
        model, data = cfg.get("model") or {}, cfg.get("data") or {}
        final, best = m.get("final") or {}, m.get("best") or {}
        steps = m.get("global_step") or 0
        fit_s = m.get("fit_time_s")
        rows.append({
            "dir": str(d.relative_to(root)) if d != root else ".",
            "task": data.get("name"), "attention": model.get("attention"), "status": m.get("status"),
            "error": m.get("error"),
            "test_acc": final.get("test/acc"), "val_acc": best.get("val/acc"),
            "step_ms": 1000 * perf["step_time_s"] if perf.get("step_time_s") is not None else None,
            "fit_ms_per_step": 1000 * fit_s / steps if fit_s and steps else None,
            "peak_mem_mb": perf.get("peak_mem_mb", m.get("peak_mem_mb")),
            "peak_mem_kind": perf.get("peak_mem_kind", "metrics.json"),
            "baseline_mem_mb": perf.get("baseline_mem_mb"),
            "tokens_per_s": m.get("tokens_per_s"), "wall_time_s": m.get("wall_time_s"), "fit_time_s": fit_s,
            "global_step": steps, "epochs": m.get("epochs"), "params": m.get("params"),
            "max_len": data.get("max_len"), "max_examples": data.get("max_examples"),
            "dim": model.get("dim"), "heads": model.get("heads"), "layers": model.get("layers"), "model_cfg": model,
            "attention_options": model.get("attention_options"), "device": perf.get("device_name", m.get("device")),
            "batch_size": data.get("batch_size"), "seed": m.get("seed"),
        })
    return rows


def _fmt(x, digits=1, scale=1.0, suffix="") -> str:
    try:
        v = float(x) * scale
    except (TypeError, ValueError):
        return "–"
    return "–" if math.isnan(v) else f"{v:.{digits}f}{suffix}"


def _row_for(rows, task, kind):
    found = [r for r in rows if r["task"] == task and r["attention"] == kind]
    done = [r for r in found if r["status"] == "finished"]
    return (done or found or [None])[-1]


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
        if not any(r["attention"] == kind for r in rows):
            continue
        cells = f"| {kind} |"
        for t in tasks:
            r = _row_for(rows, t, kind)
            if r is None:
                cells += " – | – | – |"
            elif r["status"] != "finished":
                cells += f" {r['status']} | – | – |"
            else:
                cells += (f" {_fmt(r['test_acc'], 2, 100)} | {_fmt(r['step_ms'], 0)} | {_fmt(r['peak_mem_mb'], 0)} |")
        paper = "; ".join(f"{name} {lo:.2f} / {tx:.2f}" for name, lo, tx in LRA_PAPER.get(kind, []))
        lines.append(cells + f" {paper or '–'} |")
    lines += ["", ("Uniform guessing scores 10% on ListOps and 50% on Text; always answering ListOps' most "
                   "frequent class (0 or 9) scores about 15-17%."), ""]

    lines += ["## Every member", "",
              ("| task | attention | status | test acc % | best val acc % | ms / step (median) | fit ms / step "
              "| peak mem MB | mem at fit start MB | tokens/s | steps | fit s | params |"),
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (str(r["task"]), KINDS.index(r["attention"]) if r["attention"] in KINDS else 9)):
        lines.append(
            f"| {r['task']} | {r['attention']} | {r['status']}{': ' + str(r['error']) if r['error'] else ''} | "
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


def plot_lra(rows: list[dict[str, Any]], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np

    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    kinds = [k for k in KINDS if any(r["attention"] == k for r in rows)]
    metrics = [("test_acc", "test accuracy (%)", 100.0), ("step_ms", "ms per training step", 1.0),
               ("peak_mem_mb", "peak memory (MB)", 1.0)]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    width = 0.8 / max(len(kinds), 1)
    x = np.arange(len(tasks))
    for ax, (key, label, scale) in zip(axes, metrics):
        for i, k in enumerate(kinds):
            vals = []
            for t in tasks:
                r = _row_for(rows, t, k)
                try:
                    vals.append(float(r[key]) * scale if r and r["status"] == "finished" else np.nan)
                except (TypeError, ValueError):
                    vals.append(np.nan)
            ax.bar(x + (i - (len(kinds) - 1) / 2) * width, vals, width, label=k)
        ax.set_xticks(x)
        ax.set_xticklabels([TASKS.get(t, t) for t in tasks], fontsize=8)
        ax.set_title(label, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
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


def retime_rows(rows: list[dict[str, Any]], reps: int = 5) -> str:
    """Markdown: `interleaved_step_times` at each task's max_len and batch size, with the sweep's model."""
    root_cfgs = {}
    for r in rows:
        if r["task"] and r["max_len"] and r["batch_size"]:
            root_cfgs.setdefault((int(r["max_len"]), int(r["batch_size"])), r)
    if not root_cfgs:
        return ""
    results, batch = {}, None
    for (seq_len, batch), r in sorted(root_cfgs.items()):
        model_cfg = dict(r["model_cfg"])
        kinds = [k for k in KINDS if any(x["attention"] == k for x in rows)]
        log.info("re-timing %s at L=%d, batch %d", kinds, seq_len, batch)
        results[seq_len] = interleaved_step_times(model_cfg, seq_len, batch, kinds, reps=reps)
    return render_retiming(results, batch, reps)


def write_lra_table(sweep_dir: str | Path, out: str | Path | None = None, title: str | None = None,
                    notes: str = "", plot_name: str = "lra_results.png", retime: bool = False,
                    retime_reps: int = 5) -> dict[str, Any]:
    """Write the table (markdown) and its plot next to it; returns {markdown, plot, rows}.
    retime: also re-measure the step time of every kind, interleaved, at each task's length."""
    rows = collect_lra(sweep_dir)
    if not rows:
        raise FileNotFoundError(f"no metrics.json under {sweep_dir}: not a sweep dir of training runs.")
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


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover
    _HydraCallback = object


class LRATableCallback(_HydraCallback):
    """Hydra callback: write <sweep dir>/lra_table.md at the end of a multirun (never raises)."""

    def on_multirun_end(self, config, **kwargs) -> None:
        try:
            from mhalab.train.hydra_callbacks import _sweep_dir

            res = write_lra_table(_sweep_dir(config))
            log.info("LRA table: %s", res["markdown"])
        except Exception:
            log.exception("LRA table failed (re-run: python scripts/lra_table.py <sweep dir>)")
