"""The building blocks, pure torch (no Lightning, no Hydra): masks, unpadding, attention and its kernels,
positions, the encoder layer and stack."""

from mhalab.nn.attention import MultiHeadAttention, ScaledDotProductAttention
from mhalab.nn.encoder import OfficialEncoder, TransformerEncoder, TransformerEncoderLayer
from mhalab.nn.kernels import LinformerAttention, PerformerAttention, WindowAttention
from mhalab.nn.positions import ALiBi, LearnedPosition, RotaryEmbedding, SinusoidalPosition, T5RelativeBias
from mhalab.nn.swap import official_names, swap_attention
from mhalab.nn.unpad import Unpadding

__all__ = [
    "ALiBi", "LearnedPosition", "LinformerAttention", "MultiHeadAttention", "OfficialEncoder", "PerformerAttention",
    "RotaryEmbedding", "ScaledDotProductAttention", "SinusoidalPosition", "T5RelativeBias", "TransformerEncoder",
    "TransformerEncoderLayer", "Unpadding", "WindowAttention", "official_names", "swap_attention",
]
