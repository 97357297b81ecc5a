"""The one place where attention masks are checked, converted and merged.

Contract (PyTorch's, see `nn.MultiheadAttention`):

- a bool mask is True where attention is NOT allowed;
- a float mask is ADDED to the scores (use -inf to block).

Everything downstream sees a single additive float mask, broadcastable to the scores
(B, H, L_q, L_k), with -inf where a key is blocked. Broadcast dimensions stay size 1:
a key-padding mask becomes (B, 1, 1, L_k), never a materialised (B, H, L_q, L_k) tensor.

The article used `masked_fill(mask == 0, -1e9)` on masks where True meant "blocked", which
blocks exactly the keys that should be visible; -1e9 also overflows float16. We use -inf,
which is exact in every float dtype, and handle rows whose keys are all blocked explicitly
(see `dead_rows`).
"""

from __future__ import annotations

import torch
from torch import Tensor


class ShapeError(ValueError, AssertionError):
    """An input or mask whose shape does not fit: a ValueError, and an AssertionError as nn.MultiheadAttention raises
    (its checks are asserts), so code written for either catches it; messages start with PyTorch's wording."""


def to_additive(mask: Tensor, name: str, dtype: torch.dtype) -> Tensor:
    """bool (True = blocked) -> 0 / -inf; float -> cast to `dtype`; anything else is refused."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    if mask.is_floating_point():
        return mask.to(dtype)
    raise TypeError(
        f"{name} has dtype {mask.dtype}; use a bool mask (True = blocked, as in nn.MultiheadAttention) "
        f"or a float mask that is added to the scores (-inf blocks). A 0/1 integer mask is ambiguous: "
        f"convert it with `mask.bool()` if 1 means blocked, or `mask == 0` if 1 means visible."
    )


def merge_masks(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    *,
    batch: int,
    num_heads: int,
    L_q: int,
    L_k: int,
    dtype: torch.dtype,
    bias: Tensor | None = None,
) -> Tensor | None:
    """Check shapes and merge every mask into one additive float mask.

    attn_mask:        (L_q, L_k), (B, L_q, L_k), (B*H, L_q, L_k) as nn.MultiheadAttention takes it,
                      or (B or 1, H or 1, L_q, L_k).
    key_padding_mask: (B, L_k).
    bias:             an additive positional bias (H or 1, L_q, L_k) from a position module.
    Returns None when there is nothing to mask, else a tensor broadcastable to (B, H, L_q, L_k).
    """
    merged = None
    if attn_mask is not None:
        m = to_additive(attn_mask, "attn_mask", dtype)
        shape = tuple(m.shape)
        if m.dim() == 2 and shape == (L_q, L_k):
            pass  # (L_q, L_k) broadcasts over batch and heads
        elif m.dim() == 3 and shape == (batch, L_q, L_k):
            m = m.unsqueeze(1)  # (B, 1, L_q, L_k)
        elif m.dim() == 3 and shape == (batch * num_heads, L_q, L_k):
            m = m.view(batch, num_heads, L_q, L_k)
        elif m.dim() == 4 and shape[0] in (1, batch) and shape[1] in (1, num_heads) and shape[2:] == (L_q, L_k):
            pass
        else:
            raise ShapeError(
                f"attn_mask has shape {shape}, which does not fit batch={batch}, heads={num_heads}, "
                f"L_q={L_q}, L_k={L_k}. Expected one of ({L_q}, {L_k}), ({batch}, {L_q}, {L_k}), "
                f"({batch * num_heads}, {L_q}, {L_k}) or ({batch}, {num_heads}, {L_q}, {L_k})."
            )
        merged = m
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (batch, L_k):
            raise ShapeError(
                f"key_padding_mask has shape {tuple(key_padding_mask.shape)}; expected (batch, L_k) = "
                f"({batch}, {L_k}), True at padded keys."
            )
        kp = to_additive(key_padding_mask, "key_padding_mask", dtype).view(batch, 1, 1, L_k)
        merged = kp if merged is None else merged + kp
    if bias is not None:
        b = bias.to(dtype)
        merged = b if merged is None else merged + b
    return merged


def dead_rows(mask: Tensor | None) -> Tensor | None:
    """Query rows whose keys are all blocked, shape like `mask` with L_k -> 1.

    softmax over a row of -inf is 0/0 = NaN (that is what nn.MultiheadAttention returns).
    We define the output of such a row as 0, with zero gradients: the caller un-blocks the row
    (so softmax stays finite) and zeroes its output afterwards.
    """
    if mask is None:
        return None
    return torch.isneginf(mask).all(dim=-1, keepdim=True)
