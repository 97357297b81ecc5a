"""mhalab: Multi-Head Attention from scratch, and a framework to train and sweep encoders built on it.

    from mhalab import MultiHeadAttention, SequenceClassifier, swap_attention

Importing mhalab loads torch only (no Lightning, Hydra, datasets or matplotlib) and changes no global state; the
names below load on first use (PEP 562), so the commands (mhalab.cli) start before torch is imported: mhalab-train
restarts itself with its allocator first (mhalab.train.allocator).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
__all__ = ["MultiHeadAttention", "ScaledDotProductAttention", "SequenceClassifier", "TransformerEncoder",
           "TransformerEncoderLayer", "swap_attention"]
_HOME = {"SequenceClassifier": "mhalab.model"} | {name: "mhalab.nn" for name in __all__ if name != "SequenceClassifier"}


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'mhalab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
