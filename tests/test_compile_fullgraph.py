"""torch.compile(fullgraph=True) of our attention, encoder layer and stack, and of PyTorch's nn.Transformer /
nn.TransformerEncoder with ours swapped in: no graph break (fullgraph raises on one), in train and eval, with no
mask, a bool and a float key-padding mask; outputs and parameter gradients equal to eager to 1e-5, dropout included
(the same seed draws the same masks). Dynamo decides graph breaks before any backend runs, so the tests compile
with aot_eager (Dynamo and AOTAutograd's tracing of forward and backward, without Inductor's C++ build); the
masks' dead-row handling has no data-dependent branch and our stack does not unpad under compile (its token count
would be data-dependent), zeroing the pads as the unpadded path leaves them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mhalab import MultiHeadAttention, TransformerEncoder, TransformerEncoderLayer, swap_attention

ONE_THREAD = True  # tiny tensors: see conftest.one_thread
E, H, B, L, TOL = 16, 4, 3, 6, 1e-5
X = torch.randn(B, L, E, generator=torch.Generator().manual_seed(0))
PAD = torch.zeros(B, L, dtype=torch.bool)
PAD[0, 4:] = True
PAD[2, 2:] = True
MASKS = {"no mask": None, "bool": PAD, "float": torch.zeros(B, L).masked_fill(PAD, float("-inf"))}
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning",
                                        "ignore:The PyTorch API of nested tensors:UserWarning")


def _official_encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.1, batch_first=True)
    return swap_attention(nn.TransformerEncoder(layer, 2))  # enable_nested_tensor: PyTorch's default (True)


def _zero_pads(out: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The stack's outputs with padded positions 0, as its unpadded path leaves them."""
    return out if mask is None or mask.dtype != torch.bool else out.masked_fill(mask.unsqueeze(-1), 0.0)


MODELS = {  # name -> (build, call(model, mask) -> output)
    "MultiHeadAttention": (lambda: MultiHeadAttention(E, H, dropout=0.1),
                           lambda m, k: m(X, X, X, key_padding_mask=k, need_weights=False)[0]),
    "MultiHeadAttention, weights": (lambda: MultiHeadAttention(E, H, dropout=0.1),
                                    lambda m, k: m(X, X, X, key_padding_mask=k)[0]),
    "TransformerEncoderLayer": (lambda: TransformerEncoderLayer(E, H, 32, dropout=0.1, batch_first=True),
                                lambda m, k: m(X, src_key_padding_mask=k)),
    "TransformerEncoder (unpads in eager)": (
        lambda: TransformerEncoder(num_layers=2, embed_dim=E, num_heads=H, ff_dim=32, dropout=0.1, unpad=True),
        lambda m, k: _zero_pads(m(X, src_key_padding_mask=k), k)),
    "TransformerEncoder(layer, 2), PyTorch's numbers at the pads": (
        lambda: TransformerEncoder(TransformerEncoderLayer(E, H, 32, dropout=0.1, batch_first=True), 2),
        lambda m, k: m(X, src_key_padding_mask=k)),
    "swapped nn.TransformerEncoder": (_official_encoder, lambda m, k: m(X, src_key_padding_mask=k)),
    "swapped nn.Transformer": (lambda: swap_attention(nn.Transformer(E, H, 1, 1, 32, dropout=0.1, batch_first=True)),
                               lambda m, k: m(X, X[:, :4], src_key_padding_mask=k, memory_key_padding_mask=k)),
}


def _run(model: nn.Module, call, mask, train: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output, and in train mode every parameter's gradient of a fixed function of it; the same dropout draws."""
    model.zero_grad()
    torch.manual_seed(1)
    out = call(model, mask)
    if not train:
        return out.detach(), []
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("mask", list(MASKS))
# PyTorch's stacks with our attention swapped in (the slowest to trace) run with make test-slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.startswith("swapped") else n
                                  for n in MODELS])
def test_fullgraph_compile_has_no_graph_break_and_gives_the_eager_numbers(name, mask, mode):
    build, call = MODELS[name]
    torch.manual_seed(0)
    model = build().train(mode == "train")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # a graph break raises here
    eager = model
    if isinstance(model, TransformerEncoder) and model.unpad and mode == "train":
        # compiled, the stack computes the padded layout (no unpadding: its token count is data-dependent), so its
        # dropout masks are drawn over (B, L, E) where the unpadded stack draws them over the (N, E) real tokens:
        # the eager twin with the same draws is the padded computation, unpad=False
        eager = copy.deepcopy(model)
        eager.unpad = False
    want, want_grads = _run(eager, call, MASKS[mask], mode == "train")
    got, got_grads = _run(compiled, call, MASKS[mask], mode == "train")
    assert (got - want).abs().max() <= TOL
    assert len(got_grads) == len(want_grads) == (len(list(model.parameters())) if mode == "train" else 0)
    assert all((a - b).abs().max() <= TOL for a, b in zip(got_grads, want_grads))
    if mode == "train":  # dropout drew masks: a different seed gives other numbers (the comparison is not vacuous)
        torch.manual_seed(2)
        assert (call(model, MASKS[mask]) - want).abs().max() > 1e-3
