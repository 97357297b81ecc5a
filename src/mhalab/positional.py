"""Absolute position encodings, added to the token embeddings (B, L, E) -> (B, L, E)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class SinusoidalPosition(nn.Module):
    """Vaswani et al. 2017: PE[p, 2i] = sin(p / 10000^(2i/E)), PE[p, 2i+1] = cos(...)."""

    def __init__(self, embed_dim: int, max_len: int):
        super().__init__()
        pos = torch.arange(max_len).unsqueeze(1)  # (L, 1)
        freq = torch.exp(torch.arange(0, embed_dim, 2) * (-math.log(10000.0) / embed_dim))  # (ceil(E/2),)
        pe = torch.zeros(max_len, embed_dim)
        pe[:, 0::2] = torch.sin(pos * freq)
        pe[:, 1::2] = torch.cos(pos * freq[: embed_dim // 2])
        self.register_buffer("pe", pe, persistent=False)
        self.max_len = max_len

    def forward(self, x: Tensor) -> Tensor:
        L = x.size(1)
        if L > self.max_len:
            raise ValueError(f"sequence length {L} exceeds max_len {self.max_len} of the position encoding.")
        return x + self.pe[:L].to(x.dtype)


class LearnedPosition(nn.Module):
    """One trained vector per position (BERT, GPT-2)."""

    def __init__(self, embed_dim: int, max_len: int):
        super().__init__()
        self.emb = nn.Embedding(max_len, embed_dim)
        nn.init.normal_(self.emb.weight, std=0.02)
        self.max_len = max_len

    def forward(self, x: Tensor) -> Tensor:
        L = x.size(1)
        if L > self.max_len:
            raise ValueError(f"sequence length {L} exceeds max_len {self.max_len} of the position encoding.")
        return x + self.emb.weight[:L].to(x.dtype)
