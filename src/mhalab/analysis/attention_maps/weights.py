"""The attention weights a model really applies: one ordinary forward pass with hooks on each layer's
self-attention.

A pre-hook switches each self_attn call to `need_weights=True` (and, for PyTorch's nn.MultiheadAttention,
`average_attn_weights=False`), a post-hook keeps the returned (B, H, L_q, L_k) weights. So the maps are
the weights of that pass, layer inputs included (no re-implementation of the layer). Attention kinds with
explicit weights: full and window (with any position scheme). Linformer and Performer never form a
(query, key) weight matrix (Linformer attends over k learned projections of the keys, Performer over
random features), so they raise `NoAttentionWeights` saying so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack

import torch
from torch import Tensor, nn

NO_WEIGHTS = {
    "LinformerAttention": "Linformer attends over k learned projections of the keys along the sequence "
                          "(softmax over k rows, not over tokens)",
    "PerformerAttention": "Performer (FAVOR+) estimates softmax attention with random features and never "
                          "forms the (query, key) score matrix",
}


class NoAttentionWeights(ValueError):
    """The model's attention kind has no explicit per-(query, key) weights to draw."""


def inner(model: nn.Module) -> nn.Module:
    """The SequenceClassifier, from itself or from a Classifier (LightningModule) that holds it."""
    return getattr(model, "model", model)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Each encoder layer's self-attention, in order: our MultiHeadAttention or nn.MultiheadAttention."""
    enc = inner(model).encoder
    layers = enc.layers if hasattr(enc, "layers") else enc.encoder.layers  # custom | OfficialEncoder
    return [layer.self_attn for layer in layers]


def _kernel_name(attn: nn.Module) -> str:
    return type(getattr(attn, "attention", None)).__name__


def check_has_weights(model: nn.Module) -> None:
    """Raise NoAttentionWeights, naming the kind and why, for Linformer / Performer models."""
    for attn in attention_modules(model):
        why = NO_WEIGHTS.get(_kernel_name(attn))
        if why:
            kind = _kernel_name(attn).replace("Attention", "").lower()
            raise NoAttentionWeights(
                f"model.attention={kind} has no explicit attention weights to draw: {why}. Attention maps exist "
                f"for attention=full and attention=window (with any pos)."
            )


def capture_weights(run: Callable[[], Tensor], attns: Sequence[nn.Module]) -> tuple[Tensor, list[Tensor | None]]:
    """(run()'s output, detached, and each module's weights of that call: (B, H, L_q, L_k), or None if it was not
    called or gave none). Works on any model whose attention is nn.MultiheadAttention or ours (e.g. after
    mhalab.swap_attention): a pre-hook turns each call to need_weights=True, average_attn_weights=False, a
    post-hook keeps the weights. Run with autograd on, where PyTorch's fused layers (which skip their attention
    module) stand down; the output is detached. A module called twice keeps its last call's weights. Inputs made
    under a caller's torch.inference_mode cannot enter that graph: run() copies them (clone) when it is called."""
    captured: list[Tensor | None] = [None] * len(attns)

    def pre_hook(module, args, kwargs):
        return args, dict(kwargs, need_weights=True, average_attn_weights=False)

    def post_hook(i):
        def hook(module, args, kwargs, output):
            captured[i] = output[1]
        return hook

    with ExitStack() as stack:
        for i, attn in enumerate(attns):
            stack.callback(attn.register_forward_pre_hook(pre_hook, with_kwargs=True).remove)
            stack.callback(attn.register_forward_hook(post_hook(i), with_kwargs=True).remove)
        # nn.TransformerEncoderLayer skips self_attn (its fused "fast path") when no gradient is needed, and
        # nn.TransformerEncoder hands its layers nested tensors; with grad enabled neither happens
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        out = run().detach()
    return out, [None if w is None else w.detach() for w in captured]


def attention_weights(model: nn.Module, input_ids: Tensor, padding_mask: Tensor | None = None
                      ) -> tuple[Tensor, list[Tensor]]:
    """(logits (B, C), [per layer (B, H, L, L) weights]) from one forward pass in eval mode.

    With pooling=cls, L counts the model's own CLS vector at position 0 (L = 1 + tokens).
    """
    check_has_weights(model)
    attns = attention_modules(model)
    was_training = model.training
    model.eval()  # no dropout on the weights
    encoder = inner(model).encoder
    with ExitStack() as stack:
        if getattr(encoder, "unpad", False):
            # our encoder runs a padded batch on its packed real tokens ("unpadding"), so self_attn is
            # called with (N, E) tokens; the hooks here read the padded (B, L, E) call, and the padded
            # path gives the same weights
            encoder.unpad = False
            stack.callback(setattr, encoder, "unpad", True)
        # cloned inside capture_weights' grad-enabled pass: a copy made outside it, under a caller's
        # inference_mode (Lightning's test and predict loops), would still be an inference tensor
        logits, captured = capture_weights(
            lambda: model(input_ids.clone(), None if padding_mask is None else padding_mask.clone()), attns)
    model.train(was_training)
    missing = [i for i, w in enumerate(captured) if w is None]
    if missing:
        raise NoAttentionWeights(f"layers {missing} returned no attention weights (kernel "
                                 f"{_kernel_name(attns[missing[0]])}); maps need attention=full or window.")
    return logits, [w.float() for w in captured]
