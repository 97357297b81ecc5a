"""The article's "next steps" as small pieces that plug into `MultiHeadAttention`'s hooks.

    parts = attention_parts("window", "rope", embed_dim=256, num_heads=8, max_len=512, dropout=0.1)
    mha = MultiHeadAttention(256, 8, 0.1, **parts)   # parts = {"attention", "rotary", "position_bias"}

model.pos:        sinusoidal | learned (absolute, added to the embeddings by the model: no part here)
                  rope (rotary hook) | alibi | t5 (position_bias hook)
model.attention:  full (the default softmax kernel) | window | linformer | performer (attention hook)
Any position composes with full and window. linformer and performer never form the (L_q, L_k)
score matrix, so they cannot add the alibi / t5 bias: those pairs raise ValueError (see
`check_combination`); rope and the absolute positions work with every kernel.
"""

from __future__ import annotations

from torch import nn

from mhalab.variants.kernels import LinformerAttention, PerformerAttention, WindowAttention
from mhalab.variants.positions import (
    ALiBi,
    RotaryEmbedding,
    T5RelativeBias,
    alibi_slopes,
    relative_position_bucket,
)

ATTENTIONS = ("full", "window", "linformer", "performer")
POSITIONS = ("sinusoidal", "learned", "rope", "alibi", "t5")
ABSOLUTE_POSITIONS = ("sinusoidal", "learned")
BIAS_POSITIONS = ("alibi", "t5")  # need the (L_q, L_k) score matrix
LINEAR_ATTENTIONS = ("linformer", "performer")  # never form it

__all__ = [
    "ABSOLUTE_POSITIONS", "ATTENTIONS", "POSITIONS", "ALiBi", "LinformerAttention", "PerformerAttention",
    "RotaryEmbedding", "T5RelativeBias", "WindowAttention", "alibi_slopes", "attention_parts",
    "check_combination", "relative_position_bucket",
]


def check_combination(attention: str, pos: str) -> None:
    """Raise ValueError for an unknown name or a pair that cannot work; cheap, builds nothing."""
    if attention not in ATTENTIONS:
        raise ValueError(f"unknown model.attention '{attention}'; choose one of {', '.join(ATTENTIONS)}")
    if pos not in POSITIONS:
        raise ValueError(f"unknown model.pos '{pos}'; choose one of {', '.join(POSITIONS)}")
    if attention in LINEAR_ATTENTIONS and pos in BIAS_POSITIONS:
        raise ValueError(
            f"model.attention={attention} cannot use model.pos={pos}: {pos} adds a bias to every "
            f"(query, key) score and {attention} never forms the score matrix. Use model.pos=rope, "
            f"sinusoidal or learned with {attention}, or model.attention=full / window with {pos}."
        )


def attention_parts(
    attention: str = "full",
    pos: str = "sinusoidal",
    *,
    embed_dim: int,
    num_heads: int,
    max_len: int,
    dropout: float,
    window: int = 128,
    global_tokens: int = 1,
    linformer_k: int = 64,
    performer_features: int = 64,
) -> dict[str, nn.Module | None]:
    """Modules for MultiHeadAttention(embed_dim, num_heads, dropout, **parts).

    Returns {"attention": kernel or None (None = the default softmax kernel),
             "rotary": RotaryEmbedding or None, "position_bias": ALiBi / T5RelativeBias or None}.
    window: Longformer window (each query sees window // 2 keys on each side);
    global_tokens: the first positions (e.g. CLS) that attend to and are attended by all;
    linformer_k: projected length k; performer_features: number of random features m.
    """
    check_combination(attention, pos)
    if embed_dim % num_heads:
        raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}).")
    head_dim = embed_dim // num_heads

    kernel: nn.Module | None = None
    if attention == "window":
        kernel = WindowAttention(window, global_tokens, dropout)
    elif attention == "linformer":
        kernel = LinformerAttention(max_len, linformer_k, dropout)
    elif attention == "performer":
        kernel = PerformerAttention(head_dim, performer_features)

    rotary = RotaryEmbedding(head_dim, max_len) if pos == "rope" else None
    bias: nn.Module | None = None
    if pos == "alibi":
        bias = ALiBi(num_heads)
    elif pos == "t5":
        bias = T5RelativeBias(num_heads)
    return {"attention": kernel, "rotary": rotary, "position_bias": bias}
