"""The drawing: a layers x heads grid of (query, key) heatmaps, on a matplotlib Figure of its own (no
pyplot, so no backend is picked and no global figure list grows), saved as a small palette PNG."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor


def plot_attention_maps(weights: Sequence[Tensor], labels: Sequence[str], path: str | Path | None = None,
                        title: str = "", max_label_ticks: int = 40, dpi: int = 110):
    """Grid of layers (rows) x heads (columns), each a (query, key) heatmap of one example.

    weights: per layer (H, L, L) (or (1, H, L, L)); labels: L token labels. Each panel has its own color
    scale (0 to its max weight), printed in its title. Returns the matplotlib Figure (saved to `path`).
    """
    from matplotlib.figure import Figure

    mats = [w[0] if w.dim() == 4 else w for w in weights]
    n_layers, n_heads, L = len(mats), mats[0].size(0), mats[0].size(-1)
    if len(labels) != L:
        raise ValueError(f"{len(labels)} labels for {L} positions.")
    cell = min(6.0, max(2.6, 0.16 * L))
    fig = Figure(figsize=(cell * n_heads + 0.6, cell * n_layers + 0.8))
    axes = fig.subplots(n_layers, n_heads, squeeze=False)
    step = max(1, -(-L // max_label_ticks))  # at most max_label_ticks labels per axis
    ticks = list(range(0, L, step))
    fs = max(4, min(8, int(220 / max(len(ticks), 1))))
    for li, mat in enumerate(mats):
        for h in range(n_heads):
            ax = axes[li][h]
            w = mat[h].cpu().numpy()  # (L_q, L_k)
            vmax = float(w.max()) or 1.0
            ax.imshow(w, cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto", interpolation="nearest")
            ax.set_title(f"layer {li} head {h} (max {vmax:.2g})", fontsize=8)
            ax.set_xticks(ticks)
            ax.set_yticks(ticks)
            ax.set_xticklabels([labels[t] for t in ticks], rotation=90, fontsize=fs)
            ax.set_yticklabels([labels[t] for t in ticks], fontsize=fs)
            if li == n_layers - 1:
                ax.set_xlabel("key", fontsize=8)
            if h == 0:
                ax.set_ylabel("query", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if path is not None:
        save_png(fig, path, dpi)
    return fig


def save_png(fig, path: str | Path, dpi: int = 110) -> Path:
    """Save a figure as a 256-colour palette PNG: heatmaps have few distinct colours to begin with,
    and the file is several times smaller than matplotlib's RGBA PNG."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=256).save(path, optimize=True)
    return path


def figure_rgb(fig):
    """The figure as an (H, W, 3) uint8 array (what image loggers take)."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
