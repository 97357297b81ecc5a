"""mhalab: Multi-Head Attention from scratch, and a framework to train and sweep encoders built on it.

    from mhalab import MultiHeadAttention, SequenceClassifier, swap_attention

Importing mhalab loads torch only (no Lightning, Hydra, datasets or matplotlib) and changes no global state.
"""

from mhalab.model import SequenceClassifier
from mhalab.nn import (
           MultiHeadAttention,
           ScaledDotProductAttention,
           TransformerEncoder,
           TransformerEncoderLayer,
           swap_attention,
)

__version__ = "0.1.0"
__all__ = ["MultiHeadAttention", "ScaledDotProductAttention", "SequenceClassifier", "TransformerEncoder",
           "TransformerEncoderLayer", "swap_attention"]
