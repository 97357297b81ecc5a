"""The sequence classifier: embed -> position -> dropout -> encoder stack -> pool -> dropout -> linear head.

`encoder="custom"` stacks our TransformerEncoderLayer; `encoder="official"` wraps nn.TransformerEncoder.
With the same weights the two give the same logits (see `with_encoder` and tests/test_model.py).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from mhalab.attention import MultiHeadAttention
from mhalab.encoder import OfficialEncoder, TransformerEncoder, TransformerEncoderLayer
from mhalab.positional import LearnedPosition, SinusoidalPosition

POOLINGS = ("mean", "cls")
ENCODERS = ("custom", "official")


def check_model(encoder: str, pooling: str, attention: str, pos: str) -> None:
    """The classifier's own rules (the config validation runs them too): known encoder and pooling, and
    PyTorch's encoder only with full attention and absolute positions. ValueError naming the fix."""
    from mhalab.variants import ABSOLUTE_POSITIONS  # variants import attention, which imports nothing here

    if encoder not in ENCODERS:
        raise ValueError(f"unknown model.encoder '{encoder}'; choose one of {', '.join(ENCODERS)}.")
    if pooling not in POOLINGS:
        raise ValueError(f"unknown model.pooling '{pooling}'; choose one of {', '.join(POOLINGS)}.")
    if encoder == "official" and (attention != "full" or pos not in ABSOLUTE_POSITIONS):
        raise ValueError(
            f"model=official supports attention=full with pos={'|'.join(ABSOLUTE_POSITIONS)} only (got "
            f"attention={attention}, pos={pos}); use model=custom for the variants."
        )


class SequenceClassifier(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        encoder: str = "custom",
        dim: int = 128,
        heads: int = 4,
        layers: int = 2,
        ff_dim: int = 512,
        dropout: float = 0.1,
        activation: str = "gelu",
        norm_first: bool = False,
        pos: str = "sinusoidal",
        attention: str = "full",
        pooling: str = "mean",
        max_len: int = 128,
        pad_id: int = 0,
        attention_options: dict | None = None,
        embed_dropout: float | None = None,
    ):
        super().__init__()
        check_model(encoder, pooling, attention, pos)
        from mhalab.variants import attention_parts  # variants import attention

        self.pooling, self.pad_id = pooling, pad_id
        n_pos = max_len + (pooling == "cls")  # the CLS vector takes position 0
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=pad_id)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02) if pooling == "cls" else None
        self.pos = None
        if pos == "sinusoidal":
            self.pos = SinusoidalPosition(dim, n_pos)
        elif pos == "learned":
            self.pos = LearnedPosition(dim, n_pos)
        # relative positions (rope/alibi/t5) and attention kinds live inside each attention layer
        parts = attention_parts(
            attention, pos, embed_dim=dim, num_heads=heads, max_len=n_pos, dropout=dropout,
            **(attention_options or {}),
        )
        stack = {"num_layers": layers, "embed_dim": dim, "num_heads": heads, "ff_dim": ff_dim, "dropout": dropout,
                 "activation": activation, "norm_first": norm_first, "final_norm": norm_first}
        if encoder == "custom":
            mha = MultiHeadAttention(dim, heads, dropout, **parts)
            layer = TransformerEncoderLayer(dim, heads, ff_dim, dropout, activation, norm_first, self_attn=mha)
            self.encoder = TransformerEncoder(**stack, layer=layer)
        else:
            self.encoder = OfficialEncoder(**stack)
        # dropout on embedding + position, as in Vaswani et al. (None: the same p as everywhere else)
        self.embed_drop = nn.Dropout(dropout if embed_dropout is None else embed_dropout)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, input_ids: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        # input_ids: (B, L) token ids; padding_mask: (B, L) True at pads
        if padding_mask is None:
            padding_mask = input_ids == self.pad_id
        x = self.embed(input_ids)  # (B, L, E)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.size(0), -1, -1).to(x.dtype), x], dim=1)  # (B, 1+L, E)
            padding_mask = torch.cat([padding_mask.new_zeros(x.size(0), 1), padding_mask], dim=1)
        if self.pos is not None:
            x = self.pos(x)
        x = self.encoder(self.embed_drop(x), src_key_padding_mask=padding_mask)  # (B, L, E)
        if self.pooling == "cls":
            pooled = x[:, 0]  # (B, E)
        else:
            keep = (~padding_mask).unsqueeze(-1).to(x.dtype)  # (B, L, 1)
            pooled = (x * keep).sum(1) / keep.sum(1).clamp(min=1.0)  # mean over real tokens
        return self.head(self.drop(pooled))  # (B, C)

    def with_encoder(self, kind: str) -> SequenceClassifier:
        """The same model with the other encoder implementation, weights copied exactly."""
        other = copy.deepcopy(self)
        enc = self.encoder
        if kind == "official" and isinstance(enc, TransformerEncoder):
            other.encoder = OfficialEncoder.wrap(enc.to_official())
        elif kind == "custom" and isinstance(enc, OfficialEncoder):
            other.encoder = TransformerEncoder.from_official(enc.encoder)
        elif not isinstance(enc, TransformerEncoder if kind == "custom" else OfficialEncoder):
            raise ValueError(f"unknown encoder kind '{kind}'; choose one of {', '.join(ENCODERS)}.")
        return other
