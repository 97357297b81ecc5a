"""Per-class results of an evaluation: the report dict (JSON-able), its markdown table, and its confusion matrix PNG.

The report, as Classifier.class_reports[split] holds it after each validation epoch and each test:

    {"labels": [name, ...], "support": [int, ...],               # true examples per class
     "precision": [...], "recall": [...], "f1": [...],           # per class, floats
     "confusion": [[int, ...], ...],                             # rows = true class, cols = predicted
     "accuracy": float, "macro": {"precision": ..., "recall": ..., "f1": ...}}

A class that is never predicted has precision 0 (torchmetrics' zero_division=0: 0 / 0 gives 0), and
likewise recall 0 for a class without examples. The macro averages follow torchmetrics' average="macro"
(so macro f1 equals the logged {val,test}/f1): the mean over the classes that occur as a target or a
prediction; a class absent from both is left out rather than counted as 0.

matplotlib is imported inside confusion_png only: importing this module (mhalab.train.module does)
loads no plotting library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import Tensor


def default_labels(num_classes: int) -> list[str]:
    """Class i's name when the data set gives none: "0" .. "K-1"."""
    return [str(i) for i in range(num_classes)]


def build_report(confusion: Tensor, precision: Tensor, recall: Tensor, f1: Tensor,
                 labels: Sequence[str]) -> dict:
    """The report dict from torchmetrics' results: confusion (K, K) counts (rows true), per-class (K,) scores."""
    cm = confusion.detach().to("cpu", torch.long)  # (K, K)
    support = cm.sum(1)  # (K,) true examples of each class
    predicted = cm.sum(0)  # (K,) predictions of each class
    present = (support + predicted) > 0  # torchmetrics' macro: classes with tp + fp + fn > 0
    scores = {name: t.detach().to("cpu", torch.float64) for name, t in
              (("precision", precision), ("recall", recall), ("f1", f1))}
    total = int(support.sum())
    return {
        "labels": [str(x) for x in labels],
        "support": support.tolist(),
        **{name: [float(x) for x in s] for name, s in scores.items()},
        "confusion": cm.tolist(),
        "accuracy": float(cm.diagonal().sum()) / total if total else 0.0,
        "macro": {name: float(s[present].mean()) if present.any() else 0.0 for name, s in scores.items()},
    }


def markdown(report: Mapping) -> str:
    """A per-class markdown table (class, precision, recall, f1, support), then the macro average and accuracy."""
    rows = ["| class | precision | recall | f1 | support |", "|---|---:|---:|---:|---:|"]
    for i, name in enumerate(report["labels"]):
        rows.append(f"| {_cell(name)} | {report['precision'][i]:.4f} | {report['recall'][i]:.4f} | "
                    f"{report['f1'][i]:.4f} | {report['support'][i]} |")
    m, total = report["macro"], sum(report["support"])
    rows.append(f"| macro avg | {m['precision']:.4f} | {m['recall']:.4f} | {m['f1']:.4f} | {total} |")
    rows.append(f"| accuracy | | | {report['accuracy']:.4f} | {total} |")
    return "\n".join(rows) + "\n"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")  # a label with a pipe must not split the row


def confusion_png(report: Mapping, path: str | Path, title: str = "confusion matrix") -> Path:
    """The confusion matrix as a PNG: each cell's count, coloured by its share of the true class's row (so
    a rare class reads as clearly as a common one), class names on both axes. Readable for 2 to ~20 classes."""
    from matplotlib.figure import Figure  # lazy, and no pyplot: no global state, no backend switch (Agg)

    cm = torch.tensor(report["confusion"], dtype=torch.float64)  # (K, K) rows = true class
    labels = list(report["labels"])
    k = len(labels)
    rows = cm / cm.sum(1, keepdim=True).clamp(min=1)  # row-normalised: recall on the diagonal
    side = min(12.0, 2.5 + 0.55 * k)
    fig = Figure(figsize=(side + 1.2, side))
    ax = fig.subplots()
    image = ax.imshow(rows.numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label="share of the true class")
    font = 10 if k <= 8 else 8 if k <= 14 else 6
    for i in range(k):
        for j in range(k):
            ax.text(j, i, f"{int(cm[i, j])}", ha="center", va="center", fontsize=font,
                    color="white" if rows[i, j] > 0.5 else "black")
    tilt = k > 4 or max(map(len, labels)) > 6  # long or many names: slanted, so they do not overlap
    ax.set_xticks(range(k), labels, rotation=45 if tilt else 0, ha="right" if tilt else "center", fontsize=font)
    ax.set_yticks(range(k), labels, fontsize=font)
    ax.set(xlabel="predicted", ylabel="true", title=f"{title} (n = {int(cm.sum())}, acc {report['accuracy']:.3f})")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
