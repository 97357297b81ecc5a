"""Dropout whose mask costs a quarter of PyTorch's draws on CPU: 16 random bits per element, four to a 64-bit draw.

On CPU, PyTorch's dropout draws its mask with `bernoulli_`, one call of the serial generator per element: in the
default SST-2 training step that is a quarter of the step, on IMDB (the attention weights' (L, L) masks) over a third
(scripts/profile_step.py). Dropout16 takes four 16-bit lanes from each 64-bit draw of the same generator and drops
an element where its lane is below the threshold, so

    P(drop) = round(p * 65536) / 65536     (p = 0.1: 0.1000061; p = 0.2: 0.1999969; within 2^-17 of p)

and the kept elements are scaled by 1 / (1 - P(drop)), which keeps every element's expectation exactly. Everything
else is nn.Dropout's: `p`, `inplace` (ignored: the result is a new tensor), train / eval, and the state dict (none).
Draws come from torch's default generator, so torch.manual_seed fixes them and activation checkpointing replays
them, and they are the same at any thread count. On other devices it is nn.Dropout (their kernels are not serial).
Dynamo cannot trace its in-place draw: a layer's compiled position-wise half (compile=true) swaps its own back to
nn.Dropout (TransformerEncoderLayer.compile_positionwise).

A model built from PyTorch's parts keeps PyTorch's draws; the framework's classifier swaps these in
(SequenceClassifier(dropout_draw="16bit"), the model config's `dropout_draw`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LANES = 4  # 16-bit lanes per 64-bit draw
LEVELS = 1 << 16
DRAWS = ("torch", "16bit")  # SequenceClassifier's dropout_draw: PyTorch's nn.Dropout, or Dropout16


def drop_level(p: float) -> int:
    """How many of the 65,536 lane values drop an element: round(p * 65536)."""
    return round(p * LEVELS)


def dropout16(x: Tensor, p: float) -> Tensor:
    """x with each element zeroed with probability drop_level(p) / 65536, the rest scaled to keep the mean."""
    level = drop_level(p)
    if level == 0:
        return x
    if level >= LEVELS:
        return x * 0.0
    n = x.numel()
    draws = torch.empty((n + LANES - 1) // LANES, dtype=torch.int64, device=x.device).random_(-(1 << 63), None)
    lanes = draws.view(torch.int16)[:n].view(x.shape)  # uniform on [-32768, 32767]
    # keep where lane >= level - 32768 (P(keep) = 1 - level / 65536), written in float arithmetic: lane - (that - 1)
    # is >= 1 where kept and <= 0 where dropped, so clamped to [0, 1] it is the keep mask. ATen vectorizes these
    # float passes and not a bool mask's `where` (3x slower a pass on CPU, twice a step: forward and backward).
    # As in nn.Dropout, a dropped inf or NaN gives NaN (x * 0), and a dropped negative -0.0.
    keep = lanes.to(torch.float32).sub_(level - LEVELS // 2 - 1).clamp_(0, 1)  # (x.shape): 1.0 kept, 0.0 dropped
    scale = LEVELS / (LEVELS - level)
    if x.dtype == torch.float32:  # the scale in the mask: x * (scale or 0), the where's numbers to the bit
        return x * keep.mul_(scale)
    return (x * keep.to(x.dtype)).mul_(scale)  # the scale at x's precision (bf16 would round scale itself)


def draws_own_mask(drop: nn.Module, x: Tensor) -> bool:
    """Whether `drop`, applied to x, draws its mask with dropout16 (and a fused kernel's dropout_p would not)."""
    return isinstance(drop, Dropout16) and drop.training and drop.p > 0 and x.device.type == "cpu"


class Dropout16(nn.Dropout):
    """nn.Dropout with its CPU mask drawn 16 bits per element (see the module docstring)."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self.p, True)
        return dropout16(x, self.p)


def use_dropout16(model: nn.Module, back: bool = False) -> int:
    """Swap every nn.Dropout in model (its own modules, at any depth) for a Dropout16 of the same p, in place, or
    with back=True every Dropout16 for an nn.Dropout; returns how many. No weight changes: a model's state dict loads
    the same before and after."""
    old, new = (Dropout16, nn.Dropout) if back else (nn.Dropout, Dropout16)
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is old:
                swap = new(child.p)
                swap.train(child.training)
                setattr(parent, name, swap)
                swapped += 1
    return swapped
