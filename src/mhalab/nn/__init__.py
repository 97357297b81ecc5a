"""The building blocks, pure torch (no Lightning, no Hydra): masks, unpadding, attention and its kernels,
positions, the encoder layer and stack."""

from mhalab.nn.attention import (
    MultiHeadAttention,
    ScaledDotProductAttention,
    official_state_dict,
    upgrade_state_dict,
)
from mhalab.nn.encoder import OfficialEncoder, TransformerEncoder, TransformerEncoderLayer
from mhalab.nn.kernels import LinformerAttention, PerformerAttention, WindowAttention
from mhalab.nn.masks import ShapeError
from mhalab.nn.positions import ALiBi, LearnedPosition, RotaryEmbedding, SinusoidalPosition, T5RelativeBias
from mhalab.nn.swap import official_names, swap_attention
from mhalab.nn.unpad import Unpadding

__all__ = [
    "ALiBi", "LearnedPosition", "LinformerAttention", "MultiHeadAttention", "OfficialEncoder", "PerformerAttention",
    "RotaryEmbedding", "ScaledDotProductAttention", "ShapeError", "SinusoidalPosition", "T5RelativeBias", "TransformerEncoder",
    "TransformerEncoderLayer", "Unpadding", "WindowAttention", "official_names", "official_state_dict", "swap_attention",
    "upgrade_state_dict",
]
