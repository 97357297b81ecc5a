"""Unpadding: run the position-wise layers on the real tokens of a padded batch only.

(B, L, E) with a key-padding mask <-> (N, E) packed real tokens, both ways differentiable.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mhalab.nn.varlen import SeqLens, to_device


class Unpadding:
    """Where the real tokens of a padded (B, L) batch are, to run position-wise layers on them only.

    The projections, the feed-forward, the LayerNorms, dropout and residuals treat every position on
    its own, so they can run on the N real tokens packed into (N, E) instead of all B*L positions;
    only attention needs the (B, L) layout. With a quarter of the positions padding, that skips a
    quarter of nearly all the FLOPs. This is "unpadding" from FlashAttention's BERT code, and what
    nn.TransformerEncoder's nested tensors do in eval.

        unpad = Unpadding(key_padding_mask)   # (B, L) bool, True at pads
        h = unpad.pack(x)                     # (B, L, E) -> (N, E)
        x = unpad.unpack(h)                   # (N, E) -> (B, L, E), zeros at the pads

    Both are differentiable, each being the other's backward (see _Gather / _Scatter). The real
    tokens' values are the same as the padded computation's; the padded positions are 0 (PyTorch's
    nested-tensor path gives 0 too).
    """

    def __init__(self, key_padding_mask: Tensor):
        if key_padding_mask.dtype != torch.bool or key_padding_mask.dim() != 2:
            raise ValueError("Unpadding needs a (batch, L) bool key_padding_mask, True at pads.")
        self.key_padding_mask = key_padding_mask  # attention still needs it: the pads are blocked keys
        self.batch, self.seq_len = key_padding_mask.shape
        flat = key_padding_mask.flatten()
        # (N,) flat positions b * L + l of the real tokens, in order, and (B*L - N,) of the pads
        # (a host sync each on CUDA: N depends on the data)
        self.index = (~flat).nonzero().squeeze(1)
        self.pad_index = flat.nonzero().squeeze(1)
        self.num_tokens = self.index.numel()
        # (B*L,) the packed row that fills each padded position: its own for a real token, row 0 for a
        # pad (see unpack(zero_pads=False))
        self.source = torch.zeros_like(flat, dtype=torch.long).index_copy_(
            0, self.index, torch.arange(self.num_tokens, device=flat.device)
        )
        self._seqlens: SeqLens | None | bool = False  # not looked at yet (see seqlens)

    @classmethod
    def from_seqlens(cls, seqlens: SeqLens, device) -> Unpadding:
        """The right-padded (B, longest) layout of sequences of these lengths, built on the host from the lengths
        and moved to `device`: no device sync."""
        lengths = torch.tensor(seqlens.lengths)
        self = cls(torch.arange(seqlens.max_seqlen)[None, :] >= lengths[:, None])  # on the CPU
        for name in ("key_padding_mask", "index", "pad_index", "source"):
            setattr(self, name, to_device(getattr(self, name), device))
        self._seqlens = seqlens
        return self

    @property
    def seqlens(self) -> SeqLens | None:
        """The real tokens' lengths, when every row is right-padded (real tokens first): then attention can run
        per sequence on the packed tokens (nn.varlen). None for other masks. Read from the mask once (on CUDA
        a sync, like index above) unless given (from_seqlens)."""
        if self._seqlens is False:
            self._seqlens = SeqLens.from_padding_mask(self.key_padding_mask)
        return self._seqlens

    def pack(self, x: Tensor) -> Tensor:
        """(B, L, *) -> (N, *): the real tokens only."""
        return _Gather.apply(x.reshape(self.batch * self.seq_len, *x.shape[2:]), self.index, self.pad_index)

    def unpack(self, x: Tensor, zero_pads: bool = True) -> Tensor:
        """(N, *) -> (B, L, *): back to the padded layout, zeros at the pads.

        zero_pads=False: the pads hold a copy of a real token's row instead (one gather, rather than a
        scatter and a fill), and pass no gradient back. Use it only where the pads' values do not
        matter, as for attention's inputs: pads are masked keys (weight 0, so zero gradient) and
        queries whose outputs pack() drops.
        """
        if zero_pads or self.num_tokens == 0:
            out = _Scatter.apply(x, self.index, self.pad_index)  # (B*L, *)
        else:
            out = _Spread.apply(x, self.source, self.index, self.pad_index)  # (B*L, *)
        return out.view(self.batch, self.seq_len, *x.shape[1:])


def _scatter_rows(x: Tensor, index: Tensor, pad_index: Tensor) -> Tensor:
    """(N, *) -> (N + P, *): row i of x to row index[i], zeros at the rows in pad_index."""
    out = x.new_empty(index.numel() + pad_index.numel(), *x.shape[1:]).index_copy_(0, index, x)
    # the pads must hold finite numbers (attention blocks them, but 0 * inf would still be NaN);
    # zeroing only them is cheaper than zero-filling everything first
    return out.index_fill_(0, pad_index, 0.0)


class _Gather(torch.autograd.Function):
    """x[index] along dim 0. Its backward is _Scatter: the indices are distinct, so the gradient is a
    plain copy into place, not the accumulating scatter-add autograd would use for index_select."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, pad_index: Tensor) -> Tensor:
        ctx.save_for_backward(index, pad_index)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        index, pad_index = ctx.saved_tensors
        return _Scatter.apply(grad, index, pad_index), None, None


class _Spread(torch.autograd.Function):
    """x[source] along dim 0, source covering every row of the result; backward: the gradient of the
    rows `index` (where x's rows went), nothing from the other rows (the pads, see Unpadding.unpack)."""

    @staticmethod
    def forward(ctx, x: Tensor, source: Tensor, index: Tensor, pad_index: Tensor) -> Tensor:
        ctx.save_for_backward(index, pad_index)
        return x.index_select(0, source)

    @staticmethod
    def backward(ctx, grad: Tensor):
        index, pad_index = ctx.saved_tensors
        return _Gather.apply(grad, index, pad_index), None, None, None


class _Scatter(torch.autograd.Function):
    """_scatter_rows, whose backward is _Gather (the pads get no gradient: they are constants)."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, pad_index: Tensor) -> Tensor:
        ctx.save_for_backward(index, pad_index)
        return _scatter_rows(x, index, pad_index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        index, pad_index = ctx.saved_tensors
        return _Gather.apply(grad, index, pad_index), None, None
