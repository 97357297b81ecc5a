"""Attention maps: every layer's per-head weights for a text, drawn as a layers x heads grid.

    weights.py   the weights a model really applies (hooks on one ordinary forward pass)
    tokens.py    a text as the model's positions, with a readable label each
    plot.py      the layers x heads grid of (query, key) heatmaps, as a palette PNG
    command.py   maps of one text from a checkpoint (scripts/attention_map.py)
    callback.py  AttentionMapLogger, the opt-in Lightning callback (callbacks=attention_maps)
"""

from mhalab.analysis.attention_maps.callback import AttentionMapLogger
from mhalab.analysis.attention_maps.command import draw_text, main
from mhalab.analysis.attention_maps.plot import figure_rgb, plot_attention_maps, save_png
from mhalab.analysis.attention_maps.tokens import encode_text, position_labels, token_labels
from mhalab.analysis.attention_maps.weights import (
    NoAttentionWeights,
    attention_modules,
    attention_weights,
    check_has_weights,
)

__all__ = [
    "AttentionMapLogger", "NoAttentionWeights", "attention_modules", "attention_weights", "check_has_weights",
    "draw_text", "encode_text", "figure_rgb", "main", "plot_attention_maps", "position_labels", "save_png",
    "token_labels",
]
