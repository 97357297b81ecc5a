"""What the benchmark compares: the variants of each module, built with the same weights, and their inputs."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn

from mhalab.nn.attention import MultiHeadAttention
from mhalab.nn.encoder import TransformerEncoder, TransformerEncoderLayer

VARIANTS = ("weights", "fused", "official")
EXTRA_VARIANTS = ("fused_padded",)  # enc only: our stack with unpad=False (every position computed)
MODULES = ("attn", "layer", "enc")
MODES = ("fwd", "train", "infer")


def padding_mask(batch: int, seq_len: int, pad_frac: float, device: torch.device, seed: int = 0) -> Tensor | None:
    """(B, L) bool, True at padded positions (right padding); pad_frac of all positions on average."""
    if pad_frac <= 0:
        return None
    # lengths evenly spread over [L - 2*pad_frac*L, L]: mean padding = pad_frac * L, as in a batch of
    # sentences of varied length padded to the longest; shuffled so padding is not sorted by row
    u = (torch.arange(batch, dtype=torch.float64) + 0.5) / batch
    lengths = (seq_len - torch.round(2 * pad_frac * seq_len * u)).clamp(min=1).long()
    lengths = lengths[torch.randperm(batch, generator=torch.Generator().manual_seed(seed))]
    return (torch.arange(seq_len)[None, :] >= lengths[:, None]).to(device)


def build(module: str, cfg, device: torch.device) -> dict[str, tuple[nn.Module, Callable]]:
    """{variant: (model, call(model, x, kpm) -> output (B, L, E))}, all with the official weights.

    `weights` inside encoder layers (which call their attention with need_weights=False) is built with
    from_official(explicit=True): its attention still computes through the (B, H, L, L) weights.
    """
    torch.manual_seed(0)
    E, H, Fd, p = cfg.embed_dim, cfg.num_heads, cfg.ff_dim, cfg.dropout
    if module == "attn":
        off = nn.MultiheadAttention(E, H, dropout=p, batch_first=True)
        ours = MultiHeadAttention.from_official(off)
        calls = {
            "weights": lambda m, x, kpm: m(x, key_padding_mask=kpm, need_weights=True)[0],
            "fused": lambda m, x, kpm: m(x, key_padding_mask=kpm, need_weights=False)[0],
            "official": lambda m, x, kpm: m(x, x, x, key_padding_mask=kpm, need_weights=False)[0],
        }
        models = {"weights": ours, "fused": copy.deepcopy(ours), "official": off}
    else:
        layer = nn.TransformerEncoderLayer(E, H, Fd, p, activation=cfg.activation, batch_first=True)
        if module == "layer":
            off = layer
            convert = TransformerEncoderLayer.from_official
        else:
            off = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=True)
            # nn.TransformerEncoder deep-copies one layer; give each layer its own weights
            for lyr in off.layers[1:]:
                for m in lyr.modules():
                    if hasattr(m, "_reset_parameters"):
                        m._reset_parameters()
                    elif isinstance(m, nn.Linear):
                        m.reset_parameters()
            def convert(off, explicit=False):  # ours as the framework runs it: skipping the pads in training too
                return TransformerEncoder.from_official(off, explicit, unpad=True)
        call = lambda m, x, kpm: m(x, src_key_padding_mask=kpm)
        calls = dict.fromkeys(VARIANTS + EXTRA_VARIANTS, call)
        models = {"weights": convert(off, explicit=True), "fused": convert(off), "official": off}
        if module == "enc":
            models["fused_padded"] = TransformerEncoder.from_official(off, unpad=False)
    out = {}
    for v in cfg.variants:
        if v not in models:
            continue
        m = models[v].to(device)
        if cfg.compile and v != "official":
            m = torch.compile(m)
        out[v] = (m, calls[v])
    return out


def flops(module: str, mode: str, x_shape, kpm: Tensor | None, cfg) -> float:
    """Useful matmul FLOPs of one call (see the package docstring)."""
    B, L, E = x_shape
    if kpm is None:
        n_tok, pairs = B * L, B * L * L
    else:
        lengths = (~kpm).sum(1).double()
        n_tok, pairs = float(lengths.sum()), float((lengths**2).sum())
    per_layer = 2 * n_tok * E * 4 * E + 2 * 2 * E * pairs  # projections, QK^T + AV
    if module != "attn":
        per_layer += 2 * 2 * n_tok * E * cfg.ff_dim  # two feed-forward matmuls
    total = per_layer * (cfg.layers if module == "enc" else 1)
    return total * (3 if mode == "train" else 1)
