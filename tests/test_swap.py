"""swap_attention on a model nobody here wrote: PyTorch's nn.Transformer with its defaults.

Sequence-first, dropout 0.1, encoder self-attention, decoder causal self-attention (tgt_is_causal), cross-attention
on the memory, padding masks everywhere. After the swap the model's outputs and gradients (input and every
parameter, under PyTorch's names) equal the original's to 1e-5 in float32: in train mode (the same seed gives
the same dropout draws), in eval mode, and in eval under torch.no_grad, where nn.TransformerEncoderLayer runs its
fused kernel on our weights. Hooks, the attention-map weight capture and a plugged-in variant work on it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import close
from torch import nn

from mhalab import MultiHeadAttention, swap_attention
from mhalab.analysis.attention_maps.weights import capture_weights
from mhalab.nn import RotaryEmbedding, WindowAttention, official_names

ONE_THREAD = True  # tiny tensors: see conftest.one_thread

E, H, B, S, T = 16, 4, 3, 7, 5
TOL = 1e-5
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning",
                                        "ignore:The PyTorch API of nested tensors:UserWarning",
                                        "ignore:Support for mismatched key_padding_mask:UserWarning")


def transformer() -> nn.Transformer:
    torch.manual_seed(0)
    return nn.Transformer(E, H, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32)  # dropout 0.1


def batch(padded: bool = True) -> tuple[tuple[torch.Tensor, torch.Tensor], dict]:
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randn(S, B, E, generator=g), torch.randn(T, B, E, generator=g)  # sequence-first
    masks = {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(T), "tgt_is_causal": True}
    if padded:
        src_pad = torch.zeros(B, S, dtype=torch.bool)
        src_pad[1, 5:], src_pad[2, 3:] = True, True
        tgt_pad = torch.zeros(B, T, dtype=torch.bool)
        tgt_pad[2, 4:] = True
        masks.update(src_key_padding_mask=src_pad, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
    return (src, tgt), masks


def run(model: nn.Module, inputs, masks, mode: str):
    """(output, input grads, {PyTorch's parameter name: grad}); mode train | eval | no_grad (eval)."""
    model.train(mode == "train")
    model.zero_grad()
    xs = [x.clone().requires_grad_(mode != "no_grad") for x in inputs]
    torch.manual_seed(5)
    with torch.set_grad_enabled(mode != "no_grad"):
        out = model(*xs, **masks)
    if mode == "no_grad":
        return out, [], {}
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    grads = {n: torch.cat([p.grad for p in ps]) for n, ps in official_names(model).items()}
    return out.detach(), [x.grad for x in xs], grads


@pytest.mark.parametrize("padded", [True, False], ids=["padding_masks", "causal_only"])
@pytest.mark.parametrize("mode", ["train", "eval", "no_grad"])
def test_swapped_nn_transformer_equals_the_original(mode, padded):
    original = transformer()
    swapped = swap_attention(copy.deepcopy(original))
    assert sum(isinstance(m, MultiHeadAttention) for m in swapped.modules()) == 6  # 2 + 2 self, 2 cross
    assert not any(type(m) is nn.MultiheadAttention for m in swapped.modules())
    inputs, masks = batch(padded)
    (a, ga, pa), (b, gb, pb) = run(original, inputs, masks, mode), run(swapped, inputs, masks, mode)
    if padded and mode == "no_grad":  # PyTorch's nested-tensor path: the memory is 0 at padded positions
        assert a.is_nested == b.is_nested
    close(b, a, TOL, f"output ({mode})")
    for x, y in zip(ga, gb):
        close(y, x, TOL, "input grad")
    assert pa.keys() == pb.keys()
    for name in pa:
        close(pb[name], pa[name], TOL, name)


def test_inference_runs_pytorchs_fused_layer_on_our_weights():
    """A batch-first nn.TransformerEncoder in eval under no_grad takes PyTorch's fused path (nested tensors, then
    torch._transformer_encoder_layer_fwd), which reads in_proj_weight / out_proj from ours and never calls its
    self_attn: counted by wrapping the instance's forward (a hook would turn the fast path off). (nn.Transformer's
    defaults are sequence-first, where PyTorch has no fused path.)"""
    torch.manual_seed(0)
    original = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 32, batch_first=True), 2).eval()
    swapped = swap_attention(copy.deepcopy(original))
    calls = []
    for layer in swapped.layers:
        inner = layer.self_attn.forward
        layer.self_attn.forward = lambda *a, inner=inner, **k: calls.append(1) or inner(*a, **k)
    (src, _), masks = batch()
    src, pad = src.transpose(0, 1), masks["src_key_padding_mask"]
    with torch.no_grad():
        close(swapped(src, src_key_padding_mask=pad), original(src, src_key_padding_mask=pad), TOL, "fused path")
    assert calls == []
    close(swapped(src, src_key_padding_mask=pad), original(src, src_key_padding_mask=pad), TOL, "autograd path")
    assert len(calls) == 2  # with autograd the layers call their attention


def test_swap_back_restores_pytorchs_modules_exactly():
    original = transformer()
    back = swap_attention(swap_attention(copy.deepcopy(original)), to="official")
    assert [type(m) for m in back.modules()] == [type(m) for m in original.modules()]
    sd, sd2 = original.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)


def test_code_that_reads_pytorchs_attributes_takes_the_same_branch():
    """nn.TransformerEncoder decides its nested-tensor path from its layer's self_attn attributes at construction."""
    theirs = nn.TransformerEncoderLayer(E, H, 32, batch_first=True)
    ours = swap_attention(copy.deepcopy(theirs))
    for attr in ("batch_first", "_qkv_same_embed_dim", "embed_dim", "num_heads", "head_dim", "dropout", "kdim"):
        assert getattr(ours.self_attn, attr) == getattr(theirs.self_attn, attr), attr
    assert torch.equal(ours.self_attn.in_proj_weight, theirs.self_attn.in_proj_weight)
    assert nn.TransformerEncoder(ours, 2).use_nested_tensor == nn.TransformerEncoder(theirs, 2).use_nested_tensor


def test_hooks_and_the_weight_capture_see_every_swapped_attention():
    original = transformer().eval()
    swapped = swap_attention(copy.deepcopy(original))
    inputs, masks = batch()

    def attns(m):
        return [a for a in m.modules() if isinstance(a, nn.MultiheadAttention)]

    out_a, w_a = capture_weights(lambda: original(*inputs, **masks), attns(original))
    out_b, w_b = capture_weights(lambda: swapped(*inputs, **masks), attns(swapped))
    close(out_b, out_a, TOL, "output")
    assert len(w_b) == 6 and all(w is not None and w.shape[1] == H for w in w_b)
    for x, y in zip(w_a, w_b):
        close(y, x, TOL, "per-head weights")
    seen = []
    swapped.decoder.layers[0].multihead_attn.register_forward_hook(lambda m, a, o: seen.append(o[0].shape))
    with torch.no_grad():
        swapped(*inputs, **masks)
    assert seen == [(T, B, E)]


@pytest.mark.parametrize("variant", ["rope", "window"])
def test_a_variant_plugged_in_runs_in_every_path(variant):
    """With a variant PyTorch's fused layer declines (it could not compute it) and ours runs, also on the nested
    tensors nn.TransformerEncoder builds in inference: no path silently computes plain attention."""
    def parts(mha):
        if variant == "rope":
            return {"rotary": RotaryEmbedding(mha.head_dim, 16)}
        return {"attention": WindowAttention(2)}

    original = transformer().eval()
    swapped = swap_attention(copy.deepcopy(original), parts=parts)
    assert not swapped.encoder.layers[0].self_attn._qkv_same_embed_dim
    inputs, masks = batch()
    plain = original(*inputs, **masks)
    with_grad = swapped(*inputs, **masks)
    with torch.no_grad():
        inference = swapped(*inputs, **masks)  # the encoder hands its layers nested tensors here
    close(inference, with_grad, TOL, "no_grad (nested) vs autograd path")
    assert (with_grad - plain).abs().max().item() > 1e-3  # the variant changed the numbers
    with pytest.raises(ValueError, match="to_official: nn.MultiheadAttention cannot express"):
        swap_attention(swapped, to="official")
    assert all(isinstance(m, MultiHeadAttention) for m in swapped.modules() if isinstance(m, nn.MultiheadAttention))


def test_tied_attention_stays_tied_and_a_bare_module_is_returned():
    mha = nn.MultiheadAttention(E, H)
    model = nn.ModuleDict({"a": mha, "b": nn.Sequential(mha)})
    swap_attention(model)
    assert model["a"] is model["b"][0] and isinstance(model["a"], MultiHeadAttention)
    assert isinstance(swap_attention(nn.MultiheadAttention(E, H)), MultiHeadAttention)
    with pytest.raises(ValueError, match=r"to='ours': choose 'custom' \(ours\) or 'official'"):
        swap_attention(model, to="ours")


def test_a_variant_in_a_batch_first_encoder_attends_the_nested_tensors():
    """nn.TransformerEncoder (batch-first, eval, no_grad, padding) turns the batch into nested tensors before
    asking its layers; with a variant the layers decline their fused path and hand ours the nested tensor."""
    torch.manual_seed(0)
    original = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 32, batch_first=True), 2).eval()
    swapped = swap_attention(copy.deepcopy(original), parts=lambda m: {"rotary": RotaryEmbedding(m.head_dim, 16)})
    nested = []
    for layer in swapped.layers:
        inner = layer.self_attn.forward
        layer.self_attn.forward = lambda q, *a, inner=inner, **k: nested.append(q.is_nested) or inner(q, *a, **k)
    (src, _), masks = batch()
    src, pad = src.transpose(0, 1), masks["src_key_padding_mask"]
    with torch.no_grad():
        inference = swapped(src, src_key_padding_mask=pad)
    assert nested == [True, True]
    with_grad = swapped(src, src_key_padding_mask=pad)
    close(inference[~pad], with_grad[~pad], TOL, "real tokens, nested vs padded")
    assert torch.equal(inference[pad], torch.zeros_like(inference[pad]))  # as PyTorch's nested path gives
