"""model.head_dim: each head's width apart from dim (W_Q, W_K, W_V: dim -> heads x head_dim, W_O back).

The reference is Vaswani et al.'s definition, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V) with
W_i^Q in R^{d_model x d_k}, MultiHead = Concat(head_1..h) W^O, where d_k need not be d_model / h, written
out per head in float64. With the default (null) the module is the article's, still PyTorch's.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import close

from mhalab.model import SequenceClassifier, check_model
from mhalab.nn.attention import MultiHeadAttention
from mhalab.nn.varlen import SeqLens

ONE_THREAD = True  # conftest.one_thread
E, H, D = 32, 2, 24  # 2 heads of 24 on a 32-wide model: 48-wide attention
LENGTHS = [7, 4, 6]


def _pad_mask(lengths, width):
    return torch.arange(width)[None, :] >= torch.tensor(lengths)[:, None]  # (B, L) True at pads


def _paper(mha: MultiHeadAttention, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """The paper's multi-head attention, one head at a time: (B, L, E) -> (B, L, E)."""
    d = mha.head_dim
    heads = []
    for i in range(mha.num_heads):
        rows = slice(i * d, (i + 1) * d)  # head i's rows of the stacked projections
        q, k, v = (x @ lin.weight[rows].T + lin.bias[rows] for lin in (mha.W_Q, mha.W_K, mha.W_V))  # (B, L, d)
        scores = q @ k.transpose(1, 2) / math.sqrt(d)  # (B, L, L)
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v)  # (B, L, d)
    return mha.W_O(torch.cat(heads, dim=-1))  # (B, L, H*d) -> (B, L, E)


@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "weights"])
def test_head_dim_equals_the_papers_per_head_definition_outputs_and_gradients(need_weights):
    torch.manual_seed(0)
    mha = MultiHeadAttention(E, H, head_dim=D).double()
    assert (mha.W_Q.weight.shape, mha.W_O.weight.shape) == ((H * D, E), (E, H * D))
    x = torch.randn(3, 7, E, dtype=torch.float64, requires_grad=True)
    pad = _pad_mask(LENGTHS, 7)
    ours, weights = mha(x, key_padding_mask=pad, need_weights=need_weights)
    ref = _paper(mha, x, pad)
    keep = ~pad  # real queries (a padded query's row is not part of the contract)
    close(ours[keep], ref[keep], 1e-12, "outputs")
    if need_weights:
        assert weights.shape == (3, H, 7, 7)
        close(weights.sum(-1), torch.ones(3, H, 7, dtype=torch.float64), 1e-12, "weight rows sum to 1")
    g = torch.randn_like(ref)[keep]
    got = torch.autograd.grad(ours[keep], [x, mha.in_proj_weight, mha.out_proj.weight], g)
    want = torch.autograd.grad(ref[keep], [x, mha.in_proj_weight, mha.out_proj.weight], g)
    for name, a, b in zip(("x", "in_proj_weight (W_Q; W_K; W_V)", "out_proj (W_O)"), got, want):
        close(a, b, 1e-12, f"grad {name}")


def test_head_dim_equal_to_dim_over_heads_is_the_articles_module_and_converts():
    torch.manual_seed(0)
    default = MultiHeadAttention(E, 4)
    torch.manual_seed(0)
    given = MultiHeadAttention(E, 4, head_dim=E // 4)
    for (name, a), (_, b) in zip(default.state_dict().items(), given.state_dict().items()):
        assert torch.equal(a, b), name  # same shapes, same init draws
    official = given.to_official()
    x = torch.randn(2, 5, E)
    close(given(x)[0], official(x, x, x)[0], what="vs nn.MultiheadAttention")


def test_to_official_refuses_a_head_dim_pytorch_cannot_express():
    with pytest.raises(ValueError, match=r"cannot express num_heads=2 x head_dim=24 = 48"):
        MultiHeadAttention(E, H, head_dim=D).to_official()
    with pytest.raises(ValueError, match="model=official cannot take model.head_dim=24"):
        check_model("official", "mean", "full", "sinusoidal", head_dim=24)
    with pytest.raises(ValueError, match=r"head_dim=0 must be an integer >= 1"):
        MultiHeadAttention(E, H, head_dim=0)


def test_a_model_with_head_dim_refuses_pytorchs_encoder_naming_the_head_dim():
    model = SequenceClassifier(vocab_size=40, num_classes=3, dim=E, heads=H, head_dim=D, layers=1, ff_dim=64)
    with pytest.raises(ValueError, match=r"cannot express num_heads=2 x head_dim=24"):
        model.with_encoder("official")  # through TransformerEncoder -> layer -> attention .to_official()


def test_head_dim_lets_heads_not_divide_dim():
    mha = MultiHeadAttention(30, 4, head_dim=8)  # 30 / 4 is not an integer; 4 x 8 = 32 is fine
    assert mha(torch.randn(1, 3, 30))[0].shape == (1, 3, 30)


@pytest.mark.parametrize("pos", ["sinusoidal", "rope", "t5"])
def test_packed_logits_and_gradients_equal_the_padded_forward_with_head_dim(pos):
    torch.manual_seed(0)
    model = SequenceClassifier(vocab_size=40, num_classes=3, dim=E, heads=H, head_dim=D, layers=2, ff_dim=64,
                               dropout=0.0, pos=pos, max_len=8).eval()
    ids = torch.randint(1, 40, (3, 7)).masked_fill(_pad_mask(LENGTHS, 7), 0)
    padded = model(ids, _pad_mask(LENGTHS, 7))
    packed = model(ids, seqlens=SeqLens(LENGTHS))  # the varlen path: heads x head_dim per sequence
    close(packed, padded, what="logits")
    ga = torch.autograd.grad(padded.sum(), list(model.parameters()), allow_unused=True)
    gb = torch.autograd.grad(model(ids, seqlens=SeqLens(LENGTHS)).sum(), list(model.parameters()), allow_unused=True)
    for (name, _), a, b in zip(model.named_parameters(), ga, gb):
        if a is not None:
            close(a, b, what=f"grad {name}")
