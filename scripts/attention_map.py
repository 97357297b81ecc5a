"""Draw every layer's per-head attention weights for one text, from a training checkpoint.

    python scripts/attention_map.py ckpt_path=outputs/<run>/checkpoints/last.ckpt text="a gripping film" \
        out=attention_map.png

Loads the Classifier and the tokenizer the checkpoint carries, runs the model once with
need_weights=True in every layer, and writes a layers x heads grid of (query, key) heatmaps with token
labels. Works for attention=full and window; linformer and performer have no explicit weights (exit 3).
Optional: max_len=N (default: the model's), device=cpu|cuda, dpi=N (default 110; lower for smaller files).
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from mhalab.analysis.attention_maps import main
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from mhalab.analysis.attention_maps import main

if __name__ == "__main__":
    sys.exit(main())
