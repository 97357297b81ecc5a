"""Draw every layer's per-head attention weights for one text, from a training checkpoint.

    python scripts/attention_map.py ckpt_path=outputs/<run>/checkpoints/last.ckpt text="a gripping film" \
        out=attention_map.png

Loads the model and the tokenizer the checkpoint carries (mhalab.train.checkpoint.load_model), runs the
model once with need_weights=True in every layer, and writes a layers x heads grid of (query, key) heatmaps
with token labels. Works for attention=full and window; linformer and performer have no explicit weights
(exit 3). Optional: max_len=N (default: training's), device=cpu|cuda, dpi=N (default 110; lower for smaller
files). The work is mhalab.analysis.attention_maps.command's.
"""

import sys

from mhalab.analysis.attention_maps.command import main

if __name__ == "__main__":
    sys.exit(main())
