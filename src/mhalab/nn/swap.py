"""Our attention inside anyone's model: swap every nn.MultiheadAttention for ours (or back), weights copied.

    from mhalab import swap_attention
    swap_attention(model)                    # every nn.MultiheadAttention -> mhalab's MultiHeadAttention
    swap_attention(model, to="official")     # and back (refused, in one line, for what PyTorch cannot express)
    swap_attention(model, parts=lambda mha: {"rotary": RotaryEmbedding(mha.head_dim, 512)})   # a variant

In place, returning the model (the replacement itself when the model is an attention module). Each replacement
carries its original's configuration, layout (batch_first), defaults (averaged weights), train / eval mode and
requires_grad, so the model computes what it computed before, outputs and gradients. Ours is an
nn.MultiheadAttention by type and attributes (see MultiHeadAttention), so code that checks or reads them takes
the same branch, and nn.TransformerEncoderLayer's fused inference path runs on our weights; with a variant
plugged in, that path is declined and ours runs (it could not compute the variant).
A module that appears twice (tied) is replaced by one module, twice.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from mhalab.nn.attention import MultiHeadAttention

TARGETS = ("custom", "official")  # the names of model=custom / model=official


def swap_attention(model: nn.Module, to: str = "custom",
                   parts: Callable[[nn.MultiheadAttention], dict] | None = None) -> nn.Module:
    """Replace every PyTorch nn.MultiheadAttention in `model` with ours (to="custom") or every one of ours with
    PyTorch's (to="official"). `parts(mha)` -> MultiHeadAttention.from_official's keyword arguments (attention,
    rotary, position_bias) plugs a variant into each (to="custom" only). Every conversion is made before any is
    put in, so a refusal leaves the model as it was."""
    if to not in TARGETS:
        raise ValueError(f"to={to!r}: choose 'custom' (ours) or 'official' (PyTorch's nn.MultiheadAttention).")
    if parts is not None and to != "custom":
        raise ValueError("parts=... plugs a variant into ours: it goes with to='custom'.")

    def wanted(m: nn.Module) -> bool:
        ours = isinstance(m, MultiHeadAttention)
        return ours if to == "official" else isinstance(m, nn.MultiheadAttention) and not ours

    def convert(m: nn.Module) -> nn.Module:
        if to == "official":
            return m.to_official()
        return MultiHeadAttention.from_official(m, **(parts(m) if parts is not None else {}))

    if wanted(model):
        return convert(model)
    sites = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if wanted(child)]
    new = {}  # id(original) -> replacement, made before any is set (and once per tied module)
    for _, _, child in sites:
        if id(child) not in new:
            new[id(child)] = convert(child)
    for parent, name, child in sites:
        setattr(parent, name, new[id(child)])
    return model


def official_names(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """The parameters of a model holding our attention, under the names nn.MultiheadAttention gives them: since our
    attention stores its parameters under PyTorch's names (in_proj_weight, in_proj_bias, out_proj.*, ...), that is
    each parameter under its own name, as a one-element list (the form in which names and values compare with the
    model before swap_attention)."""
    return {name: [p] for name, p in model.named_parameters()}
