"""masks.py: PyTorch's mask convention (bool True = blocked, float = added), shapes, merging, dead rows."""

from __future__ import annotations

import pytest
import torch

from mhalab.nn.masks import dead_rows, merge_masks, to_additive

ONE_THREAD = True  # tiny tensors: see conftest.one_thread

B, H, LQ, LK = 2, 4, 3, 5
NEG = float("-inf")



def dense(m: torch.Tensor) -> torch.Tensor:
    """Materialise a merged mask to (B, H, L_q, L_k)."""
    return m.expand(B, H, LQ, LK)


def merge(attn_mask=None, kpm=None, bias=None, dtype=torch.float32):
    return merge_masks(attn_mask, kpm, batch=B, num_heads=H, L_q=LQ, L_k=LK, dtype=dtype, bias=bias)


# ---------------------------------------------------------------- to_additive


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_bool_mask_becomes_zero_and_minus_inf(dtype):
    mask = torch.tensor([[True, False, True], [False, False, True]])
    out = to_additive(mask, "m", dtype)
    assert out.dtype == dtype
    expected = torch.tensor([[NEG, 0.0, NEG], [0.0, 0.0, NEG]], dtype=dtype)
    assert torch.equal(out, expected)  # -inf is exact in every float dtype (-1e9 overflows float16)


def test_float_mask_is_added_unchanged_and_cast():
    mask = torch.tensor([[0.5, -2.0, NEG]], dtype=torch.float64)
    out = to_additive(mask, "m", torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.tensor([[0.5, -2.0, NEG]]))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_integer_mask_is_refused_with_explanation(dtype):
    mask = torch.tensor([[0, 1, 1]], dtype=dtype)
    with pytest.raises(
        TypeError, match=rf"attn_mask has dtype {dtype}.*bool mask \(True = blocked.*mask\.bool\(\)"
    ):
        to_additive(mask, "attn_mask", torch.float32)


def test_article_minus_1e9_overflows_float16_but_minus_inf_does_not():
    """The article filled with -1e9; in float16 that value does not exist (max is 65504)."""
    scores = torch.randn(3, 3).half()
    blocked = torch.ones(3, 3, dtype=torch.bool).triu(1)
    with pytest.raises(RuntimeError, match="overflow"):
        scores.masked_fill(blocked, -1e9)
    ours = scores + to_additive(blocked, "m", torch.float16)
    w = torch.softmax(ours.float(), dim=-1)
    assert torch.equal(w[blocked], torch.zeros(3))
    assert torch.allclose(w.sum(-1), torch.ones(3))


# ---------------------------------------------------------------- merge_masks: shapes and values


def causal_bool() -> torch.Tensor:
    return torch.ones(LQ, LK, dtype=torch.bool).triu(1)


def test_no_mask_gives_none():
    assert merge() is None
    assert dead_rows(None) is None


@pytest.mark.parametrize(
    "shape, expected_shape",
    [
        ((LQ, LK), (LQ, LK)),
        ((B, LQ, LK), (B, 1, LQ, LK)),
        ((B * H, LQ, LK), (B, H, LQ, LK)),
        ((B, H, LQ, LK), (B, H, LQ, LK)),
        ((1, H, LQ, LK), (1, H, LQ, LK)),
        ((B, 1, LQ, LK), (B, 1, LQ, LK)),
        ((1, 1, LQ, LK), (1, 1, LQ, LK)),
    ],
)
def test_every_accepted_attn_mask_shape_lands_on_the_right_entries(shape, expected_shape):
    torch.manual_seed(0)
    mask = torch.rand(shape) < 0.4
    out = merge(attn_mask=mask)
    assert tuple(out.shape) == expected_shape  # broadcast dims stay size 1
    # reference: the mask placed on (B, H, L_q, L_k) the way nn.MultiheadAttention reads it
    if len(shape) == 2:
        ref = mask.expand(B, H, LQ, LK)
    elif shape == (B, LQ, LK):
        ref = mask[:, None].expand(B, H, LQ, LK)
    elif shape == (B * H, LQ, LK):
        ref = mask.view(B, H, LQ, LK)  # official order: index b * H + h
    else:
        ref = mask.expand(B, H, LQ, LK)
    expected = torch.zeros(B, H, LQ, LK).masked_fill(ref, NEG)
    assert torch.equal(dense(out), expected)


def test_per_head_3d_mask_uses_official_batch_major_order():
    mask = torch.zeros(B * H, LQ, LK, dtype=torch.bool)
    mask[1 * H + 2, 0, 3] = True  # batch 1, head 2
    out = dense(merge(attn_mask=mask))
    assert torch.isneginf(out).sum().item() == 1
    assert torch.isneginf(out[1, 2, 0, 3]).item()


def test_key_padding_stays_broadcast_and_blocks_whole_key_columns():
    kpm = torch.zeros(B, LK, dtype=torch.bool)
    kpm[1, 3:] = True
    out = merge(kpm=kpm)
    assert tuple(out.shape) == (B, 1, 1, LK)  # never a materialised (B, H, L_q, L_k)
    full = dense(out)
    assert torch.isneginf(full[1, :, :, 3:]).all()
    assert torch.equal(full[1, :, :, :3], torch.zeros(H, LQ, 3))
    assert torch.equal(full[0], torch.zeros(H, LQ, LK))


def test_causal_plus_padding_blocks_the_union():
    kpm = torch.zeros(B, LK, dtype=torch.bool)
    kpm[0, -1] = True
    out = dense(merge(attn_mask=causal_bool(), kpm=kpm))
    union = causal_bool().expand(B, H, LQ, LK) | kpm[:, None, None, :]
    assert torch.equal(torch.isneginf(out), union)
    assert torch.equal(out[~union], torch.zeros(int((~union).sum())))


def test_float_mask_plus_bool_padding_plus_bias_add_up():
    torch.manual_seed(1)
    fmask = torch.randn(LQ, LK)
    kpm = torch.zeros(B, LK, dtype=torch.bool)
    kpm[1, 0] = True
    bias = torch.randn(H, LQ, LK)
    out = dense(merge(attn_mask=fmask, kpm=kpm, bias=bias))
    expected = fmask + bias + torch.zeros(B, 1, 1, LK).masked_fill(kpm[:, None, None, :], NEG)
    assert torch.equal(out, expected)


def test_merged_mask_takes_the_requested_dtype():
    kpm = torch.zeros(B, LK, dtype=torch.bool)
    kpm[0, 0] = True
    out = merge(attn_mask=torch.randn(LQ, LK, dtype=torch.float64), kpm=kpm, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.isneginf(out[0, 0, 0, 0]).item()


@pytest.mark.parametrize(
    "shape", [(LK, LQ), (B + 1, LQ, LK), (B, H + 1, LQ, LK), (B, H, LQ), (B, H, LQ, LK, 1)]
)
def test_attn_mask_of_wrong_shape_names_the_expected_shapes(shape):
    msg = (
        rf"attn_mask has shape \({', '.join(map(str, shape))},?\).*Expected one of \({LQ}, {LK}\), "
        rf"\({B}, {LQ}, {LK}\), \({B * H}, {LQ}, {LK}\) or \({B}, {H}, {LQ}, {LK}\)"
    )
    with pytest.raises(ValueError, match=msg):
        merge(attn_mask=torch.zeros(shape, dtype=torch.bool))


@pytest.mark.parametrize("shape", [(B, LQ), (LK,), (B, 1, LK), (B + 1, LK)])
def test_key_padding_mask_of_wrong_shape_names_the_expected_shape(shape):
    msg = rf"key_padding_mask has shape .*expected \(batch, L_k\) = \({B}, {LK}\)"
    with pytest.raises(ValueError, match=msg):
        merge(kpm=torch.zeros(shape, dtype=torch.bool))


def test_integer_masks_are_refused_through_merge():
    with pytest.raises(TypeError, match=r"attn_mask has dtype torch\.int64"):
        merge(attn_mask=torch.zeros(LQ, LK, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"key_padding_mask has dtype torch\.int64"):
        merge(kpm=torch.zeros(B, LK, dtype=torch.int64))


# ---------------------------------------------------------------- dead rows


def test_dead_rows_flags_exactly_the_fully_blocked_query_rows():
    am = torch.zeros(LQ, LK, dtype=torch.bool)
    am[1] = True  # query 1 sees nothing, in every batch
    kpm = torch.zeros(B, LK, dtype=torch.bool)
    kpm[0] = True  # batch 0 has no visible key at all
    merged = merge(attn_mask=am, kpm=kpm)
    dead = dead_rows(merged)
    assert tuple(dead.shape) == (B, 1, LQ, 1)
    expected = torch.zeros(B, 1, LQ, 1, dtype=torch.bool)
    expected[0] = True
    expected[:, :, 1] = True
    assert torch.equal(dead, expected)


def test_large_finite_negative_is_not_a_dead_row():
    """Only -inf blocks; a float mask of -1e9 is a (huge) additive bias, as in PyTorch."""
    m = torch.full((1, 1, 2, 3), -1e9)
    m[0, 0, 1] = NEG
    assert torch.equal(dead_rows(m).flatten(), torch.tensor([False, True]))
