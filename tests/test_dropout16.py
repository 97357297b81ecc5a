"""Dropout16 (mhalab.nn.dropout): dropout's definition with 16-bit draws, checked against that definition; the same
draws at any thread count; masks that nest across rates; the framework's classifier and attention use it, and a
model built from PyTorch's parts does not."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mhalab.errors import ConfigError
from mhalab.model import SequenceClassifier
from mhalab.nn.attention import ScaledDotProductAttention
from mhalab.nn.dropout import LEVELS, Dropout16, drop_level, dropout16, use_dropout16
from mhalab.nn.encoder import TransformerEncoderLayer

N = 1 << 22  # 4M elements: the drop rate's standard error is 2e-4 at p = 0.2


@pytest.mark.parametrize("p", [0.1, 0.2, 0.5])
def test_drop_rate_is_p_rounded_to_a_65536th_and_kept_elements_are_scaled_to_keep_the_mean(p):
    torch.manual_seed(0)
    x = torch.rand(N) + 0.5
    y = dropout16(x, p)
    q = drop_level(p) / LEVELS
    assert abs(q - p) <= 0.5 / LEVELS
    dropped = (y == 0).double().mean().item()
    assert abs(dropped - q) < 5 * math.sqrt(q * (1 - q) / N), (dropped, q)
    kept = y != 0
    assert torch.equal(y[kept], x[kept] * (LEVELS / (LEVELS - drop_level(p))))  # exactly nn.Dropout's scaling
    # E[y] = x: the mean over 4M elements within 5 standard errors
    sd = math.sqrt(((x / (1 - q)) ** 2).mean().item() * q * (1 - q))
    assert abs((y - x).mean().item()) < 5 * sd / math.sqrt(N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_float_mask_gives_the_definitions_numbers_to_the_bit_forward_and_backward(dtype):
    """dropout16 applies its mask in float arithmetic (ATen vectorizes it); its outputs and gradients are those of
    the definition, where(lane >= level - 32768, x, 0) * scale, at every dtype (bf16 keeps the scale in float)."""
    p, n = 0.1, 10_007
    x = torch.randn(n, dtype=dtype, requires_grad=True)
    torch.manual_seed(7)
    y = dropout16(x, p)
    g = torch.randn_like(y)
    y.backward(g)
    torch.manual_seed(7)  # the same draws, read as the module docstring defines them
    lanes = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(1 << 63), None).view(torch.int16)[:n]
    keep = lanes >= drop_level(p) - LEVELS // 2
    scale = LEVELS / (LEVELS - drop_level(p))
    assert y.dtype == dtype and 0.05 < 1 - keep.double().mean().item() < 0.15
    assert torch.equal(y, torch.where(keep, x.detach(), 0.0) * scale)
    assert torch.equal(x.grad, torch.where(keep, g, 0.0) * scale)


def test_the_four_lanes_of_a_draw_drop_independently():
    torch.manual_seed(1)
    q = drop_level(0.5) / LEVELS
    d = (dropout16(torch.ones(N), 0.5) == 0).view(-1, 4).double()  # the 4 lanes of each 64-bit draw
    for a in range(4):
        assert abs(d[:, a].mean().item() - q) < 5 * math.sqrt(q * (1 - q) / (N // 4))
        for b in range(a + 1, 4):  # P(both) = q^2 if independent
            both = (d[:, a] * d[:, b]).mean().item()
            assert abs(both - q * q) < 5 * math.sqrt(q * q * (1 - q * q) / (N // 4)), (a, b, both)


def test_the_same_seed_gives_the_same_mask_at_one_and_two_threads():
    threads = torch.get_num_threads()
    masks = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            torch.manual_seed(3)
            masks.append(dropout16(torch.ones(100_003), 0.2))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(masks[0], masks[1])
    torch.manual_seed(4)
    assert not torch.equal(dropout16(torch.ones(100_003), 0.2), masks[0])


def test_masks_nest_across_rates_under_the_same_seed():
    """An element dropped at 0.1 is dropped at 0.2 too: one threshold moves over the same draws."""
    torch.manual_seed(5)
    low = dropout16(torch.ones(10_000), 0.1) == 0
    torch.manual_seed(5)
    high = dropout16(torch.ones(10_000), 0.2) == 0
    assert low.sum() > 800 and high.sum() > 1800
    assert not (low & ~high).any()


def test_gradient_is_the_mask_times_the_scale_and_eval_and_p0_are_the_identity():
    drop = Dropout16(0.2)
    x = torch.randn(257, 3, requires_grad=True)
    torch.manual_seed(6)
    y = drop(x)
    y.backward(torch.ones_like(y))
    expected = (y != 0).float() * (LEVELS / (LEVELS - drop_level(0.2)))
    assert torch.equal(x.grad, expected)
    x2 = torch.randn(50)
    assert drop.eval()(x2) is x2
    assert Dropout16(0.0).train()(x2) is x2
    assert torch.equal(dropout16(x2, 1.0), torch.zeros(50))


def test_classifier_16bit_swaps_every_dropout_keeps_its_weights_and_its_eval_logits():
    torch.manual_seed(0)
    ours = SequenceClassifier(60, 2, dim=32, heads=4, layers=2, ff_dim=64, dropout=0.2, max_len=16,
                              dropout_draw="16bit")
    torch.manual_seed(0)
    torch_draws = SequenceClassifier(60, 2, dim=32, heads=4, layers=2, ff_dim=64, dropout=0.2, max_len=16)
    drops = [m for m in ours.modules() if isinstance(m, nn.Dropout)]
    assert len(drops) == 10 and all(type(m) is Dropout16 and m.p == 0.2 for m in drops)
    assert not any(type(m) is Dropout16 for m in torch_draws.modules())
    sd, sd2 = ours.state_dict(), torch_draws.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    ids = torch.randint(1, 60, (3, 10))
    with torch.no_grad():
        assert torch.equal(ours.eval()(ids), torch_draws.eval()(ids))


def test_attention_with_dropout16_is_the_explicit_computation_with_its_mask_and_blocks_replay_it():
    torch.manual_seed(7)
    Q, K, V = (torch.randn(1, 1, 64, 8, requires_grad=True) for _ in range(3))
    whole = ScaledDotProductAttention(0.2, block_min_scores=None)
    use_dropout16(whole)
    torch.manual_seed(8)
    out, w = whole(Q, K, V, need_weights=False)
    assert w is None
    torch.manual_seed(8)  # the definition: softmax(Q K^T / sqrt(d)) dropped by the same draws, times V
    expected = dropout16(F.softmax(Q @ K.transpose(-2, -1) / math.sqrt(8), dim=-1), 0.2) @ V
    assert (out - expected).abs().max().item() < 1e-6
    grads = torch.autograd.grad(out.sum(), (Q, K, V))
    # 16 queries a block under checkpointing: each block draws its rows in the same order (64 keys: whole draws),
    # and backward replays them
    blocked = ScaledDotProductAttention(0.2, block_min_scores=1, query_block=16)
    use_dropout16(blocked)
    torch.manual_seed(8)
    out_b, _ = blocked(Q, K, V, need_weights=False)
    assert (out_b - out).abs().max().item() < 1e-6
    for g, gb in zip(grads, torch.autograd.grad(out_b.sum(), (Q, K, V))):
        assert (g - gb).abs().max().item() < 1e-5


def test_compiled_positionwise_half_goes_back_to_pytorchs_dropout():
    layer = TransformerEncoderLayer(embed_dim=16, num_heads=2, ff_dim=32, dropout=0.1)
    use_dropout16(layer)
    layer.compile_positionwise()
    assert type(layer.ffn[2]) is nn.Dropout and type(layer.dropout2) is nn.Dropout
    assert type(layer.dropout1) is Dropout16 and type(layer.self_attn.attention.dropout) is Dropout16


def test_config_refuses_an_unknown_draw_and_official_with_16bit(tmp_path):
    from conftest import compose_train

    from mhalab.train.config import validate

    for overrides, words in ((["model.dropout_draw=8bit"], "unknown model.dropout_draw '8bit'"),
                             (["model=official", "model.dropout_draw=16bit"], "model=official cannot take")):
        with pytest.raises(ConfigError, match=words):
            validate(compose_train(overrides, tmp_path))
    assert compose_train([], tmp_path).model.dropout_draw == "16bit"
    assert compose_train(["model=official"], tmp_path).model.dropout_draw == "torch"
