"""Time per training step of every attention kind, re-measured side by side.

A sweep's members run one after the other, each under whatever load the shared machine had then; here
the kinds' steps are interleaved (full, window, ..., full, window, ...) so that load hits them alike
(`python scripts/lra_table.py <sweep dir> --retime`, a section of the LRA table).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from mhalab.model import ATTENTIONS, SequenceClassifier

log = logging.getLogger(__name__)


def interleaved_step_times(model_cfg: dict[str, Any], seq_len: int, batch: int, kinds=ATTENTIONS, reps: int = 5,
                           warmup: int = 1, vocab_size: int = 260, num_classes: int = 10,
                           seed: int = 0) -> dict[str, float]:
    """Median seconds of one training step (forward, backward, AdamW) per attention kind, on a full-length
    random batch (batch, seq_len), the kinds' steps interleaved (full, window, ..., full, window, ...)
    so that load from other processes on a shared machine hits every kind alike."""
    torch.manual_seed(seed)
    cfg = {k: v for k, v in model_cfg.items() if k != "attention"} | {"max_len": max(seq_len, model_cfg.get("max_len", 0))}
    models = {k: SequenceClassifier(vocab_size, num_classes, attention=k, **cfg) for k in kinds}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    x = torch.randint(4, vocab_size, (batch, seq_len))  # (B, L): every position real, no padding
    y = torch.randint(0, num_classes, (batch,))  # (B,)
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


def retime_rows(rows: list[dict[str, Any]], reps: int = 5) -> str:
    """Markdown: `interleaved_step_times` at each task's max_len and batch size, with the sweep's model
    (rows: mhalab.analysis.lra.collect_lra's)."""
    root_cfgs = {}
    for r in rows:
        if r["task"] and r["max_len"] and r["batch_size"]:
            root_cfgs.setdefault((int(r["max_len"]), int(r["batch_size"])), r)
    if not root_cfgs:
        return ""
    results, batch = {}, None
    for (seq_len, batch), r in sorted(root_cfgs.items()):
        model_cfg = dict(r["model_cfg"])
        kinds = [k for k in ATTENTIONS if any(x["attention"] == k for x in rows)]
        log.info("re-timing %s at L=%d, batch %d", kinds, seq_len, batch)
        results[seq_len] = interleaved_step_times(model_cfg, seq_len, batch, kinds, reps=reps)
    return render_retiming(results, batch, reps)
