"""Numbers for the variants (mhalab.nn.positions, mhalab.nn.kernels, built by mhalab.model): RoPE, ALiBi, T5 bias, window / Linformer / Performer kernels, factory."""

from __future__ import annotations

import pytest
import torch

from mhalab.model import (
    ABSOLUTE_POSITIONS,
    ATTENTION_OPTIONS,
    ATTENTIONS,
    POSITIONS,
    attention_parts,
    check_attention,
)
from mhalab.nn.attention import MultiHeadAttention, ScaledDotProductAttention
from mhalab.nn.kernels import LinformerAttention, PerformerAttention, WindowAttention
from mhalab.nn.masks import merge_masks, to_additive
from mhalab.nn.positions import ALiBi, RotaryEmbedding, T5RelativeBias, alibi_slopes, relative_position_bucket

close = {"atol": 1e-6, "rtol": 1e-6}


def qkv(B=2, H=3, L=10, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, d, generator=g, dtype=dtype) for _ in range(3)]


def padding(lengths, L):
    return torch.arange(L).unsqueeze(0) >= torch.tensor(lengths).unsqueeze(1)  # (B, L) True at pads


def kp_additive(kpm, dtype=torch.float64):
    return to_additive(kpm, "kpm", dtype).view(kpm.size(0), 1, 1, -1)  # as merge_masks builds it


# ---------------------------------------------------------------------------------------- RoPE
def test_rope_scores_depend_only_on_relative_offset_and_norms_are_kept():
    rope = RotaryEmbedding(head_dim=16, max_len=512)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 16, generator=g), torch.randn(1, 16, generator=g)
    for m, n, s in [(3, 7, 11), (0, 40, 300), (100, 5, 200), (9, 9, 450)]:
        a = rope.rotate(q, torch.tensor([m])) @ rope.rotate(k, torch.tensor([n])).T
        b = rope.rotate(q, torch.tensor([m + s])) @ rope.rotate(k, torch.tensor([n + s])).T
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    x = torch.randn(2, 4, 50, 16, generator=g)
    rx, _ = rope(x, x)
    torch.testing.assert_close(rx.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-6)
    # position 0 is the identity rotation, and a different offset changes the score
    torch.testing.assert_close(rx[..., 0, :], x[..., 0, :])
    a = rope.rotate(q, torch.tensor([0])) @ rope.rotate(k, torch.tensor([5])).T
    b = rope.rotate(q, torch.tensor([0])) @ rope.rotate(k, torch.tensor([6])).T
    assert (a - b).abs().item() > 1e-3


def test_rope_equals_complex_multiplication():
    d, L = 8, 20
    rope = RotaryEmbedding(d, max_len=64)
    q, k, _ = qkv(B=2, H=2, L=L, d=d, dtype=torch.float32)
    rq, rk = rope(q, k)
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    angle = torch.arange(L, dtype=torch.float64).unsqueeze(1) * theta  # (L, d/2)
    rot = torch.polar(torch.ones_like(angle), angle)  # e^{i p theta}
    for x, rx in ((q, rq), (k, rk)):
        z = torch.view_as_complex(x.double().reshape(2, 2, L, d // 2, 2).contiguous())  # x_2i + i x_2i+1
        expected = torch.view_as_real(z * rot).reshape(2, 2, L, d).float()
        torch.testing.assert_close(rx, expected, atol=1e-5, rtol=1e-5)


def test_rope_rejects_odd_head_dim_and_long_sequences():
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7, 10)
    q = torch.randn(1, 1, 11, 4)
    with pytest.raises(ValueError, match="max_len 10"):
        RotaryEmbedding(4, 10)(q, q)


# ---------------------------------------------------------------------------------------- ALiBi
def test_rope_modules_move_and_cast_like_any_module():
    # regression: a static `_apply` on RotaryEmbedding once shadowed nn.Module._apply, so .to(),
    # .double() and load_from_checkpoint(map_location=...) raised TypeError for pos=rope models
    mha = MultiHeadAttention(16, 2, **attention_parts("full", "rope", embed_dim=16, num_heads=2, max_len=8,
                                                      dropout=0.0))
    x = torch.randn(1, 5, 16)
    out = mha(x)[0]
    moved = mha.to("cpu").double()
    assert moved(x.double())[0].dtype == torch.float64
    torch.testing.assert_close(moved(x.double())[0].float(), out, atol=1e-5, rtol=1e-5)


def test_alibi_slopes_match_the_paper():
    assert alibi_slopes(8) == pytest.approx([1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256])
    expected_12 = [
        2 ** -1, 2 ** -2, 2 ** -3, 2 ** -4, 2 ** -5, 2 ** -6, 2 ** -7, 2 ** -8,  # the 8-head slopes
        2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5,  # slopes 0, 2, 4, 6 of the 16-head sequence
    ]
    assert alibi_slopes(12) == pytest.approx(expected_12, rel=1e-12)
    assert alibi_slopes(4) == pytest.approx([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8])
    assert alibi_slopes(1) == pytest.approx([2 ** -8])


def test_alibi_bias_is_minus_slope_times_distance():
    bias = ALiBi(4)(3, 5)  # (H, L_q, L_k)
    assert bias.shape == (4, 3, 5)
    dist = torch.tensor([[0, 1, 2, 3, 4], [1, 0, 1, 2, 3], [2, 1, 0, 1, 2]], dtype=torch.float32)
    for h, m in enumerate([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]):
        torch.testing.assert_close(bias[h], -m * dist)
    causal = ALiBi(4, causal=True)(3, 3)
    assert torch.isneginf(causal[:, 0, 1:]).all() and causal[0, 2, 0].item() == -0.25 * 2


# ---------------------------------------------------------------------------------------- T5
def test_t5_buckets_match_hf_formula():
    offsets = torch.tensor([-200, -128, -20, -8, -1, 0, 1, 7, 8, 20, 127, 128, 500])
    # bidirectional, 32 buckets, max_distance 128: 16 per direction, exact below 8, j > i offset by 16.
    # e.g. -20: 8 + floor(log(20/8) / log(128/8) * 8) = 8 + floor(2.64) = 10; 127: 16 + 8 + floor(7.98) = 31
    expected = torch.tensor([15, 15, 10, 8, 1, 0, 17, 23, 24, 26, 31, 31, 31])
    assert torch.equal(relative_position_bucket(offsets), expected)
    # unidirectional (causal): only j <= i distinguished, 32 buckets, exact below 16
    # -20: 16 + floor(log(20/16) / log(8) * 16) = 16 + 1 = 17; -200: capped at 31
    uni = relative_position_bucket(offsets, bidirectional=False)
    assert torch.equal(uni, torch.tensor([31, 31, 17, 8, 1, 0, 0, 0, 0, 0, 0, 0, 0]))


def test_t5_bias_reads_the_bucket_embedding():
    t5 = T5RelativeBias(num_heads=3)
    bias = t5(4, 6)  # (H, L_q, L_k)
    assert bias.shape == (3, 4, 6)
    rel = torch.arange(6).unsqueeze(0) - torch.arange(4).unsqueeze(1)
    for i in range(4):
        for j in range(6):
            torch.testing.assert_close(bias[:, i, j], t5.emb.weight[relative_position_bucket(rel[i, j])])


def test_merge_masks_broadcasts_head_bias_with_padding():
    bias = ALiBi(4)(5, 5)  # (H, L, L)
    kpm = padding([5, 3], 5)
    m = merge_masks(None, kpm, batch=2, num_heads=4, L_q=5, L_k=5, dtype=torch.float32, bias=bias)
    m = m.expand(2, 4, 5, 5)
    torch.testing.assert_close(m[0], bias)
    torch.testing.assert_close(m[1, :, :, :3], bias[:, :, :3])
    assert torch.isneginf(m[1, :, :, 3:]).all()


# ---------------------------------------------------------------------------------------- window
def band_reference(L, half, g):
    blocked = torch.ones(L, L, dtype=torch.bool)
    for i in range(L):
        for j in range(L):
            if abs(i - j) <= half or i < g or j < g:
                blocked[i, j] = False
    return blocked


@pytest.mark.parametrize("window,g", [(4, 0), (4, 1), (6, 2), (0, 0), (100, 1)])
def test_window_equals_full_attention_with_band_and_padding(window, g):
    q, k, v = qkv(L=12)
    kpm = padding([12, 7], 12)
    mask = kp_additive(kpm)
    full = ScaledDotProductAttention()
    ref_mask = mask + to_additive(band_reference(12, window // 2, g), "band", torch.float64)
    ref_out, ref_w = full(q, k, v, mask=ref_mask, need_weights=True)
    win = WindowAttention(window, g, chunked=False)
    out, w = win(q, k, v, mask=mask, need_weights=True)
    torch.testing.assert_close(out, ref_out, **close)
    torch.testing.assert_close(w, ref_w, **close)
    assert w.shape == (2, 3, 12, 12) and (w[..., ~(ref_mask.isfinite()[0, 0])] == 0).all()
    out2, w2 = win(q, k, v, mask=mask, need_weights=False)
    assert w2 is None
    torch.testing.assert_close(out2, ref_out, **close)


@pytest.mark.parametrize("window,g,block", [(4, 0, 3), (4, 1, 4), (6, 2, 5), (2, 1, 1), (8, 3, 16), (0, 0, 2)])
def test_chunked_window_equals_band_mask(window, g, block):
    L = 23
    q, k, v = qkv(L=L, seed=3)
    kpm = padding([23, 14], L)
    kpm[0, 5] = True  # a hole, and (batch 1) a tail of pads: query rows far inside it see no key
    mask = kp_additive(kpm)
    dense = WindowAttention(window, g, chunked=False)
    chunked = WindowAttention(window, g, chunked=True, block=block)
    for m in (mask, None):
        ref, _ = dense(q, k, v, mask=m, need_weights=False)
        out, _ = chunked(q, k, v, mask=m, need_weights=False)
        torch.testing.assert_close(out, ref, **close)
    # rows whose keys are all padding give 0 in both paths
    dead = WindowAttention(2, 0, chunked=True, block=4)
    out, _ = dead(q, k, v, mask=mask, need_weights=False)
    assert torch.isfinite(out).all() and (out[1, :, 17:] == 0).all()


def test_chunked_window_gradients_match_and_bf16_is_finite():
    torch.manual_seed(0)
    E, H, L = 16, 2, 40
    band = MultiHeadAttention(E, H, attention=WindowAttention(6, 1, chunked=False)).double()
    chunked = MultiHeadAttention(E, H, attention=WindowAttention(6, 1, chunked=True, block=8)).double()
    chunked.load_state_dict(band.state_dict())
    x = torch.randn(2, L, E, dtype=torch.float64)
    kpm = padding([40, 23], L)
    grads = []
    for mha in (band, chunked):
        xi = x.clone().requires_grad_()
        out, _ = mha(xi, key_padding_mask=kpm, need_weights=False)
        out.square().sum().backward()
        grads.append((out, xi.grad, mha.W_Q.weight.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **close)
    chunked.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = chunked(x.float().requires_grad_(), key_padding_mask=kpm, need_weights=False)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in chunked.parameters())


def test_window_auto_chooses_chunked_only_when_it_can():
    win = WindowAttention(4, 1, block=4)  # auto: L > 2 * (4 + 4)
    q, k, v = qkv(L=20)
    assert win._use_chunked(q, k, None, need_weights=False)
    assert not win._use_chunked(q, k, None, need_weights=True)
    assert not win._use_chunked(q[..., :10, :], k[..., :10, :], None, need_weights=False)
    assert not win._use_chunked(q, k, torch.zeros(20, 20, dtype=torch.float64), need_weights=False)
    with pytest.raises(ValueError, match="chunked"):
        WindowAttention(4, 1, chunked=True)(q, k, v, need_weights=True)


# ---------------------------------------------------------------------------------------- Linformer
def test_linformer_identity_projection_equals_full_attention():
    q, k, v = qkv(L=9)
    lin = LinformerAttention(max_len=9, k=9).double()
    with torch.no_grad():
        lin.E.copy_(torch.eye(9))
        lin.F.copy_(torch.eye(9))
    out, w = lin(q, k, v, need_weights=True)
    ref, _ = ScaledDotProductAttention()(q, k, v, need_weights=False)
    assert w is None and out.shape == (2, 3, 9, 8)
    torch.testing.assert_close(out, ref, **close)


def test_linformer_approximates_and_ignores_padding():
    torch.manual_seed(0)
    L = 16
    q, k, v = qkv(L=L)
    lin = LinformerAttention(max_len=32, k=4).double()
    out, _ = lin(q, k, v)
    ref, _ = ScaledDotProductAttention()(q, k, v)
    assert out.shape == (2, 3, L, 8)
    assert (out - ref).abs().max() > 1e-2  # an approximation, not softmax attention
    kpm = padding([16, 10], L)
    mask = kp_additive(kpm)
    a, _ = lin(q, k, v, mask=mask)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 10:] = 1e3 * torch.randn_like(k2[1, :, 10:])
    v2[1, :, 10:] = -7.0
    b, _ = lin(q, k2, v2, mask=mask)
    torch.testing.assert_close(a, b, **close)
    # and padding does change the result vs. no mask (the padded keys really are dropped)
    c, _ = lin(q, k2, v2)
    assert (c[1] - b[1]).abs().max() > 1e-2
    # all keys padded: output 0, finite
    z, _ = lin(q, k, v, mask=kp_additive(padding([0, 3], L)))
    assert (z[0] == 0).all() and torch.isfinite(z).all()


def test_linformer_refuses_query_masks_and_long_inputs():
    q, k, v = qkv(L=6)
    lin = LinformerAttention(max_len=5, k=2).double()
    with pytest.raises(ValueError, match="exceeds linformer max_len 5"):
        lin(q, k, v)
    lin = LinformerAttention(max_len=8, k=2).double()
    with pytest.raises(ValueError, match="only key masks"):
        lin(q, k, v, mask=torch.zeros(6, 6, dtype=torch.float64))


# ---------------------------------------------------------------------------------------- Performer
def test_performer_converges_to_softmax_attention():
    q, k, v = qkv(B=2, H=2, L=32, d=16, dtype=torch.float32, seed=5)
    q, k = 0.5 * q, 0.5 * k  # moderate logits, as after training with LayerNorm'd inputs
    ref, _ = ScaledDotProductAttention()(q.double(), k.double(), v.double())
    errs = {}
    for m in (16, 64, 256, 1024):
        trials = []
        for seed in range(4):
            perf = PerformerAttention(16, m)
            perf.redraw(torch.Generator().manual_seed(seed))
            out, w = perf(q, k, v)
            assert w is None
            trials.append((out.double() - ref).abs().mean().item())
        errs[m] = sum(trials) / len(trials)
    # measured: 0.048, 0.032, 0.019, 0.011. Monte Carlo error ~ 1/sqrt(m) once m is large (256 -> 1024
    # halves it); at m = 16 it is capped because outputs are convex combinations of the values.
    assert errs[16] > errs[64] > errs[256] > errs[1024], errs
    assert errs[1024] < errs[16] / 3, errs
    assert errs[1024] < 0.015, errs


def test_performer_padding_invariance_and_dead_rows():
    torch.manual_seed(0)
    q, k, v = qkv(L=12, d=8, dtype=torch.float32)
    perf = PerformerAttention(8, 32)
    mask = kp_additive(padding([12, 5], 12), torch.float32)
    a, _ = perf(q, k, v, mask=mask)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 5:] = 50 * torch.randn_like(k2[1, :, 5:])  # would dominate the stabiliser if not excluded
    v2[1, :, 5:] = 3.0
    b, _ = perf(q, k2, v2, mask=mask)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    c, _ = perf(q, k, v2)  # without the mask the padded values do count
    assert (c[1] - b[1]).abs().max() > 1e-2
    z, _ = perf(q, k, v, mask=kp_additive(padding([0, 12], 12), torch.float32))
    assert (z[0] == 0).all() and torch.isfinite(z).all()
    with pytest.raises(ValueError, match="only key masks"):
        perf(q, k, v, mask=torch.zeros(12, 12))


def test_performer_redraw_interval():
    perf = PerformerAttention(8, 16, redraw_interval=2).train()
    q, k, v = qkv(L=4, d=8, dtype=torch.float32)
    w0 = perf.features.clone()
    perf(q, k, v)
    perf(q, k, v)
    assert torch.equal(perf.features, w0)
    perf(q, k, v)  # third call: redrawn
    assert not torch.equal(perf.features, w0)
    # orthogonal within a block of d rows
    W = perf.features[:8]
    gram = W @ W.T
    torch.testing.assert_close(gram - torch.diag(gram.diag()), torch.zeros(8, 8), atol=1e-4, rtol=0)
    perf.eval()
    w1 = perf.features.clone()
    for _ in range(3):
        perf(q, k, v)
    assert torch.equal(perf.features, w1)


# ---------------------------------------------------------------------------------------- factory
def test_factory_names_and_errors():
    assert ATTENTIONS == ("full", "window", "linformer", "performer")
    assert POSITIONS == ("sinusoidal", "learned", "rope", "alibi", "t5")
    assert ABSOLUTE_POSITIONS == ("sinusoidal", "learned")
    kw = {"embed_dim": 16, "num_heads": 4, "max_len": 20, "dropout": 0.0}
    with pytest.raises(ValueError) as e:
        attention_parts("foo", "rope", **kw)
    assert str(e.value) == "unknown model.attention 'foo'; choose one of full, window, linformer, performer."
    with pytest.raises(ValueError) as e:
        attention_parts("full", "bar", **kw)
    assert str(e.value) == "unknown model.pos 'bar'; choose one of sinusoidal, learned, rope, alibi, t5."
    for att in ("linformer", "performer"):
        for pos in ("alibi", "t5"):
            with pytest.raises(ValueError, match="never forms the score matrix"):
                attention_parts(att, pos, **kw)
    parts = attention_parts("window", "rope", **kw, window=6, global_tokens=2)
    assert isinstance(parts["attention"], WindowAttention) and parts["attention"].half == 3
    assert isinstance(parts["rotary"], RotaryEmbedding) and parts["position_bias"] is None
    assert attention_parts(**kw) == {"attention": None, "rotary": None, "position_bias": None}
    assert isinstance(attention_parts("full", "t5", **kw)["position_bias"], T5RelativeBias)
    assert attention_parts("performer", "learned", **kw, performer_features=7)["attention"].num_features == 7
    assert attention_parts("linformer", "sinusoidal", **kw, linformer_k=5)["attention"].E.shape == (5, 20)


COMBOS = [(a, p) for a in ATTENTIONS for p in POSITIONS if not (a in ("linformer", "performer") and p in ("alibi", "t5"))]


@pytest.mark.parametrize("attention,pos", COMBOS)
def test_every_combination_trains_under_bf16_and_ignores_padding(attention, pos):
    torch.manual_seed(0)
    E, H, L = 32, 4, 12
    parts = attention_parts(attention, pos, embed_dim=E, num_heads=H, max_len=16, dropout=0.0,
                            window=4, global_tokens=1, linformer_k=6, performer_features=16)
    mha = MultiHeadAttention(E, H, 0.0, **parts)
    x = torch.randn(3, L, E)
    kpm = padding([12, 7, 0], L)  # full, padded, and all-padding sequences
    x2 = x.clone()
    x2[1, 7:] = 5 * torch.randn(L - 7, E)

    for need_weights in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, w = mha(x.requires_grad_(), key_padding_mask=kpm, need_weights=need_weights)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
        mha.zero_grad()
        x.grad = None
        keep = (~kpm).unsqueeze(-1).float()  # loss over real tokens only
        (out.float().square() * keep).mean().backward()
        grads = [p.grad for p in mha.parameters() if p.requires_grad]
        assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
        assert torch.isfinite(x.grad).all()
        assert (x.grad[1, 7:] == 0).all()  # padded inputs do not influence anything
        if need_weights and attention in ("full", "window"):
            assert w.shape == (3, H, L, L) and torch.isfinite(w).all()
            assert (w[1, ..., 7:] == 0).all()
        elif need_weights:
            assert w is None  # linformer / performer have no (L_q, L_k) weights
    x = x.detach()

    # float32: real tokens' outputs do not depend on what the padded positions hold
    with torch.no_grad():
        a, _ = mha(x, key_padding_mask=kpm, need_weights=False)
        b, _ = mha(x2, key_padding_mask=kpm, need_weights=False)
    torch.testing.assert_close(a[:, :7], b[:, :7], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a[0], b[0], atol=0, rtol=0)
    # and under bf16 the same holds exactly
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a, _ = mha(x, key_padding_mask=kpm, need_weights=False)
        b, _ = mha(x2, key_padding_mask=kpm, need_weights=False)
    torch.testing.assert_close(a[1, :7], b[1, :7], atol=0, rtol=0)  # blocked keys weigh exactly 0


# ------------------------------------------------------------------------------ per-layer init
# the variant tensors a layer owns, and the std its constructor draws them with (max_len 64, k 64,
# head_dim 32, 32 T5 buckets): Linformer's E, F xavier gain 1/sqrt(2) over (k, max_len): 1/sqrt(k + max_len);
# Performer's features rows ~ N(0, I); T5's table N(0, 0.02^2)
VARIANT_INIT = {
    "linformer": ("linformer", "sinusoidal", {"attention.E": 1 / 128 ** 0.5, "attention.F": 1 / 128 ** 0.5}),
    "performer": ("performer", "sinusoidal", {"attention.features": 1.0}),
    "t5": ("full", "t5", {"position_bias.emb.weight": 0.02}),
}


def variant_tensors(model) -> list[dict[str, torch.Tensor]]:
    """Per layer: the attention kernel's and position module's parameters and buffers."""
    prefixes = ("attention.", "rotary.", "position_bias.")
    return [{n: t.detach() for n, t in [*lyr.self_attn.named_parameters(), *lyr.self_attn.named_buffers()]
             if n.startswith(prefixes)} for lyr in model.encoder.layers]


@pytest.mark.parametrize("case", list(VARIANT_INIT))
def test_variant_tensors_are_redrawn_per_layer_from_layer_zeros_distribution(case):
    from mhalab.model import SequenceClassifier

    attention, pos, stds = VARIANT_INIT[case]
    torch.manual_seed(0)
    model = SequenceClassifier(100, 2, dim=128, heads=4, layers=4, ff_dim=512, max_len=64, attention=attention,
                               pos=pos, attention_options={"linformer_k": 64, "performer_features": 64})
    layers = variant_tensors(model)
    assert all(set(t) == set(stds) for t in layers)
    for i, tensors in enumerate(layers):
        for name, t in tensors.items():
            # 128 T5 entries: 25% is ~4 standard errors of a std estimate; 2048+ entries elsewhere
            rel = 0.25 if case == "t5" else 0.1
            assert abs(t.std().item() / stds[name] - 1) < rel, (i, name, t.std().item())
            assert abs(t.mean().item()) < 4 * stds[name] / t.numel() ** 0.5, (i, name)  # 4 standard errors
            for j in range(i):
                assert not torch.equal(t, layers[j][name]), (j, i, name)
        if case == "performer":  # orthogonal random features: rows within a block of head_dim are orthogonal
            W = tensors["attention.features"][:32]
            unit = W / W.norm(dim=1, keepdim=True)
            torch.testing.assert_close(unit @ unit.T, torch.eye(32), atol=1e-5, rtol=0)


def test_deterministic_positions_are_the_same_in_every_layer():
    from mhalab.model import SequenceClassifier

    model = SequenceClassifier(100, 2, dim=32, heads=4, layers=3, ff_dim=64, max_len=16, pos="alibi")
    slopes = [t["position_bias.slopes"] for t in variant_tensors(model)]
    assert all(torch.equal(s, torch.tensor(alibi_slopes(4))) for s in slopes)
    rope = SequenceClassifier(100, 2, dim=32, heads=4, layers=3, ff_dim=64, max_len=16, pos="rope")
    assert variant_tensors(rope) == [{}, {}, {}]  # RoPE's tables are a cache computed from (head_dim, base)


# ------------------------------------------------------------------------------ attention options
def test_custom_yaml_declares_every_attention_option_with_its_default():
    from conftest import CONF
    from omegaconf import OmegaConf

    declared = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "custom.yaml").attention_options)
    assert declared == ATTENTION_OPTIONS


def refusal(*args) -> str:
    with pytest.raises(ValueError) as e:
        check_attention(*args)
    return str(e.value)


def test_check_attention_refuses_unknown_keys_and_bad_values_naming_the_fix():
    assert refusal("full", "sinusoidal", {"windw": 32}, 64) == (
        "unknown option model.attention_options.windw; the options are model.attention_options.window, "
        "model.attention_options.global_tokens, model.attention_options.linformer_k, "
        "model.attention_options.performer_features.")
    assert refusal("window", "rope", {"window": -2}, 64) == (
        "model.attention_options.window=-2 must be an integer >= 0 (the default is 128).")
    assert refusal("linformer", "rope", {"linformer_k": 0}, 64) == (
        "model.attention_options.linformer_k=0 must be an integer >= 1 (the default is 64).")
    assert "performer_features=8.5 must be an integer" in refusal("performer", "rope", {"performer_features": 8.5}, 64)
    assert "window=True must be an integer" in refusal("window", "rope", {"window": True}, 64)
    assert "never forms the score matrix" in refusal("performer", "t5", {}, 64)  # check_combination runs too
    check_attention("linformer", "rope", dict(ATTENTION_OPTIONS), 64)  # every default, for any attention
    check_attention("full", "sinusoidal", None, 64)


def test_check_attention_refuses_a_window_that_covers_every_position():
    # query i sees key j iff |i - j| <= window // 2 or either is global: with global_tokens g the farthest
    # non-global pair is (g, max_len - 1), so a band of max_len - 1 - g keys per side is full attention
    assert refusal("window", "sinusoidal", {"window": 128, "global_tokens": 0}, 64) == (
        "model.attention=window with model.attention_options.window=128 (64 keys on each side) covers every "
        "position of max_len=64: it would be full attention; set model.attention_options.window below 126 "
        "(e.g. 32) or use model.attention=full.")
    assert refusal("window", "sinusoidal", {}, 64) == (  # the defaults: window 128, 1 global token
        "model.attention=window with model.attention_options.window=128 (64 keys on each side, plus 1 global "
        "token) covers every position of max_len=64: it would be full attention; set "
        "model.attention_options.window below 124 (e.g. 32) or use model.attention=full.")
    assert "window=124 (62 keys on each side, plus 1 global token)" in refusal("window", "rope", {"window": 124}, 64)
    check_attention("window", "rope", {"window": 123}, 64)  # just below: (1, 63) is out of the band
    check_attention("window", "rope", {"window": 125, "global_tokens": 0}, 64)  # (0, 63) is out of the band
    assert refusal("window", "rope", {"global_tokens": 63}, 64) == (
        "model.attention=window with model.attention_options.global_tokens=63 covers every position of "
        "max_len=64 whatever the window: it would be full attention; set "
        "model.attention_options.global_tokens below 63 or use model.attention=full.")
    check_attention("full", "rope", {"window": 1024}, 64)  # only window attention reads it


def test_the_library_refuses_a_covering_window_and_counts_the_cls_position():
    from mhalab.model import SequenceClassifier

    kw = {"embed_dim": 16, "num_heads": 4, "max_len": 20, "dropout": 0.0}
    with pytest.raises(ValueError, match=r"window=36 .* covers every position of max_len=20"):
        attention_parts("window", "rope", **kw, window=36)
    with pytest.raises(ValueError, match=r"unknown option model.attention_options.k;"):
        attention_parts("linformer", "rope", **kw, k=8)
    # mean pooling: 64 positions, limit 124; cls pooling: 65 positions (CLS at 0), limit 126
    model = {"dim": 16, "heads": 4, "layers": 1, "ff_dim": 32, "max_len": 64, "attention": "window"}
    with pytest.raises(ValueError, match=r"window=124 .* max_len=64: .* below 124"):
        SequenceClassifier(30, 2, **model, attention_options={"window": 124})
    SequenceClassifier(30, 2, **model, pooling="cls", attention_options={"window": 124})
    SequenceClassifier(30, 2, **model, attention_options={"window": 123})


def test_window_just_below_the_limit_differs_from_full_attention_at_the_farthest_pair_only():
    torch.manual_seed(0)
    E, H, L, g = 16, 4, 12, 1
    limit = 2 * (L - 1 - g)  # 20: window 20 (10 keys each side) is refused as full attention
    with pytest.raises(ValueError, match="it would be full attention"):
        attention_parts("window", "sinusoidal", embed_dim=E, num_heads=H, max_len=L, dropout=0.0,
                        window=limit, global_tokens=g)
    parts = attention_parts("window", "sinusoidal", embed_dim=E, num_heads=H, max_len=L, dropout=0.0,
                            window=limit - 1, global_tokens=g)
    win = MultiHeadAttention(E, H, 0.0, **parts).eval()
    full = MultiHeadAttention(E, H, 0.0).eval()
    full.load_state_dict(win.state_dict())  # same projections, softmax over every key
    x = torch.randn(2, L, E)
    with torch.no_grad():
        diff = (win(x)[0] - full(x)[0]).abs().amax(dim=(0, 2))  # (L,) per query position
    # 9 keys each side: only (1, 11) and (11, 1) are out of the band, so queries 1 and 11 differ
    assert (diff[[1, L - 1]] > 1e-4).all()
    torch.testing.assert_close(diff[[0, *range(2, L - 1)]], torch.zeros(L - 2), atol=1e-6, rtol=0)
    # a band shorter than the sequence differs from full attention at (almost) every query
    short = MultiHeadAttention(E, H, 0.0, **attention_parts(
        "window", "sinusoidal", embed_dim=E, num_heads=H, max_len=L, dropout=0.0, window=4, global_tokens=g))
    short.load_state_dict(win.state_dict())
    with torch.no_grad():
        assert ((short.eval()(x)[0] - full(x)[0]).abs().amax(dim=(0, 2))[g:] > 1e-4).all()
