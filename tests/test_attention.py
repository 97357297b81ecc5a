"""attention.py proven equal to nn.MultiheadAttention, plus the article's own checks and its bugs.

Every comparison copies the weights (from_official or to_official), runs the same inputs and masks,
and compares outputs, per-head weights, input gradients and parameter gradients at 1e-5 (float32).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import close
from torch import nn

from mhalab.nn.attention import BLOCK_MIN_SCORES, QUERY_BLOCK, MultiHeadAttention, ScaledDotProductAttention

ONE_THREAD = True  # tiny tensors: see conftest.one_thread

E, H, B = 16, 4, 2
TOL = 1e-5
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# official warns (and converts) when given a float attn_mask with a bool key_padding_mask; that mix is tested
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning")
KINDS = [
    "none",
    "causal",
    "float",
    "padding",
    "causal_padding",
    "cross",
    "per_head_4d",
    "per_head_3d",
    "batch_3d",
]




# ---------------------------------------------------------------- building blocks


def randomize_biases(*mods: nn.Module, seed: int = 123) -> None:
    """Zero biases (the default init) would hide bias bugs and give trivial bias gradients."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in mods:
            for name, p in mod.named_parameters():
                if "bias" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def make_pair(conversion: str, *, bias=True, dropout=0.0, dtype=torch.float32, device="cpu", seed=0):
    """(ours, official) holding identical weights, built in either direction."""
    torch.manual_seed(seed)
    if conversion == "from_official":
        off = nn.MultiheadAttention(E, H, dropout=dropout, bias=bias, batch_first=True)
        randomize_biases(off)
        off = off.to(device=device, dtype=dtype)
        ours = MultiHeadAttention.from_official(off)
        ours.average_attn_weights = False  # weights per head, as the tests here compare (from_official: averaged)
    else:
        ours = MultiHeadAttention(E, H, dropout=dropout, bias=bias)
        randomize_biases(ours)
        ours = ours.to(device=device, dtype=dtype)
        off = ours.to_official()
    return ours, off


def make_case(kind: str, device="cpu", dtype=torch.float32, seed=0) -> SimpleNamespace:
    """Inputs and masks for one mask kind. `ours_mask` and `off_mask` mean the same thing: official
    MHA only takes (L_q, L_k) or (B*H, L_q, L_k), ours also takes (B, L_q, L_k) and (B, H, L_q, L_k).
    No query row is fully blocked here (see the dead-row tests for that)."""
    g = torch.Generator().manual_seed(seed)
    cross = kind == "cross"
    Lq, Lk = (4, 7) if cross else (6, 6)
    q = torch.randn(B, Lq, E, generator=g)
    k = torch.randn(B, Lk, E, generator=g) if cross else q
    v = torch.randn(B, Lk, E, generator=g) if cross else q
    causal = torch.ones(Lq, Lk, dtype=torch.bool).triu(1)
    ours_mask = off_mask = kpm = None
    if kind == "causal":
        ours_mask = off_mask = causal
    elif kind == "float":
        fm = torch.randn(Lq, Lk, generator=g)
        fm[0, 3] = fm[2, 5] = fm[4, 1] = float("-inf")
        ours_mask = off_mask = fm
    elif kind == "padding":
        kpm = torch.zeros(B, Lk, dtype=torch.bool)
        kpm[1, -2:] = True
    elif kind == "causal_padding":
        ours_mask = off_mask = causal
        kpm = torch.zeros(B, Lk, dtype=torch.bool)
        kpm[0, -1] = True
        kpm[1, -3:] = True
    elif kind == "cross":
        kpm = torch.zeros(B, Lk, dtype=torch.bool)
        kpm[0, -3:] = True
        ours_mask = off_mask = torch.randn(Lq, Lk, generator=g)
    elif kind in ("per_head_4d", "per_head_3d"):
        m = torch.rand(B, H, Lq, Lk, generator=g) < 0.5
        m &= ~torch.eye(Lq, Lk, dtype=torch.bool)  # every query keeps itself
        off_mask = m.reshape(B * H, Lq, Lk)
        ours_mask = m if kind == "per_head_4d" else off_mask
    elif kind == "batch_3d":
        m = torch.rand(B, Lq, Lk, generator=g) < 0.5
        m &= ~torch.eye(Lq, Lk, dtype=torch.bool)
        ours_mask = m
        off_mask = m.repeat_interleave(H, dim=0)  # (B*H, Lq, Lk), index b*H + h
    else:
        assert kind == "none"

    def mv(t):
        if t is None:
            return None
        return t.to(device) if t.dtype == torch.bool else t.to(device=device, dtype=dtype)

    return SimpleNamespace(
        kind=kind,
        cross=cross,
        Lq=Lq,
        Lk=Lk,
        q=mv(q),
        k=mv(k),
        v=mv(v),
        ours_mask=mv(ours_mask),
        off_mask=mv(off_mask),
        kpm=mv(kpm),
        grad_out=mv(torch.randn(B, Lq, E, generator=g)),
    )


def leaves(case):
    """Fresh leaf tensors; self-attention passes the very same tensor as Q, K and V."""
    q = case.q.detach().clone().requires_grad_(True)
    if not case.cross:
        return q, q, q
    return q, case.k.detach().clone().requires_grad_(True), case.v.detach().clone().requires_grad_(True)


def run_ours(ours, case, need_weights):
    q, k, v = leaves(case)
    if case.cross:
        out, w = ours(q, k, v, key_padding_mask=case.kpm, attn_mask=case.ours_mask, need_weights=need_weights,
                      average_attn_weights=False)
    else:
        out, w = ours(q, key_padding_mask=case.kpm, attn_mask=case.ours_mask, need_weights=need_weights,
                      average_attn_weights=False)
    out.backward(case.grad_out)
    return out.detach(), w, (q.grad, k.grad, v.grad) if case.cross else (q.grad,)


def run_official(off, case, need_weights):
    q, k, v = leaves(case)
    out, w = off(
        q,
        k,
        v,
        key_padding_mask=case.kpm,
        attn_mask=case.off_mask,
        need_weights=need_weights,
        average_attn_weights=False,
    )
    out.backward(case.grad_out)
    return out.detach(), w, (q.grad, k.grad, v.grad) if case.cross else (q.grad,)


def param_grads_match(ours, off, tol=TOL):
    """Every parameter's gradient is PyTorch's, name for name: ours stores nn.MultiheadAttention's parameters under its
    names (in_proj_weight = [W_Q; W_K; W_V], in_proj_bias, out_proj = W_O), in its order."""
    theirs = dict(off.named_parameters())
    assert [name for name, _ in ours.named_parameters()] == list(theirs)
    for name, p in ours.named_parameters():
        close(p.grad, theirs[name].grad, tol, f"{name} grad")


# ---------------------------------------------------------------- equality with nn.MultiheadAttention


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fused"])
@pytest.mark.parametrize("conversion", ["from_official", "to_official"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("kind", KINDS)
def test_equals_official_mha(kind, mode, conversion, need_weights, device):
    ours, off = make_pair(conversion, device=device)  # dropout=0, so train mode is deterministic
    ours.train(mode == "train")
    off.train(mode == "train")
    case = make_case(kind, device=device)
    out, w, dx = run_ours(ours, case, need_weights)
    out_o, w_o, dx_o = run_official(off, case, need_weights)
    close(out, out_o, what="output")
    if need_weights:
        assert w.shape == (B, H, case.Lq, case.Lk)
        close(w.detach(), w_o.detach(), what="per-head weights")
    else:
        assert w is None and w_o is None
    for name, a, b in zip("QKV", dx, dx_o):
        close(a, b, what=f"d{name}")
    param_grads_match(ours, off)


@pytest.mark.parametrize("kind", KINDS)
def test_explicit_and_fused_paths_agree(kind):
    ours, _ = make_pair("from_official")
    case = make_case(kind)
    out_e, _, dx_e = run_ours(ours, case, True)
    grads_e = [p.grad.clone() for p in ours.parameters()]
    ours.zero_grad()
    out_f, _, dx_f = run_ours(ours, case, False)
    close(out_e, out_f, what="output")
    for a, b in zip(dx_e, dx_f):
        close(a, b, what="input grad")
    for a, p in zip(grads_e, ours.parameters()):
        close(a, p.grad, what="param grad")


def _record_kernel_calls(mha: MultiHeadAttention) -> list[tuple[bool, bool]]:
    """(need_weights the kernel was called with, whether it returned weights), one per call of mha's kernel."""
    calls = []
    mha.attention.register_forward_hook(
        lambda mod, args, kwargs, out: calls.append((kwargs["need_weights"], out[1] is not None)), with_kwargs=True)
    return calls


@pytest.mark.parametrize("kind", KINDS)
def test_explicit_flag_takes_the_weights_path_when_need_weights_is_false(kind):
    # MultiHeadAttention(explicit=True) called with need_weights=False (as encoder layers call it) computes
    # through the weights, bit for bit what need_weights=True gives, and still returns no weights
    off = nn.MultiheadAttention(E, H, batch_first=True)
    explicit, plain = MultiHeadAttention.from_official(off, explicit=True), MultiHeadAttention.from_official(off)
    calls, plain_calls = _record_kernel_calls(explicit), _record_kernel_calls(plain)
    case = make_case(kind)
    out, w, _ = run_ours(explicit, case, need_weights=False)
    ref, w_ref, _ = run_ours(plain, case, need_weights=True)
    fused, _, _ = run_ours(plain, case, need_weights=False)
    assert w is None and w_ref is not None
    assert torch.equal(out, ref)
    assert calls == [(True, True)] and plain_calls == [(True, True), (False, False)]
    close(out, fused, what="explicit vs fused")
    assert explicit.state_dict().keys() == plain.state_dict().keys()  # a flag, not weights


@pytest.mark.parametrize("kind", ["none", "causal", "padding", "causal_padding", "per_head_4d"])
def test_equals_official_fast_path_in_eval_no_grad(kind):
    """nn.MultiheadAttention takes its native fast path in eval + no_grad for self-attention."""
    ours, off = make_pair("from_official")
    ours.eval()
    off.eval()
    case = make_case(kind)
    with torch.no_grad():
        for nw in (True, False):
            out, _ = ours(case.q, key_padding_mask=case.kpm, attn_mask=case.ours_mask, need_weights=nw)
            out_o, _ = off(
                case.q, case.q, case.q, key_padding_mask=case.kpm, attn_mask=case.off_mask, need_weights=False
            )
            close(out, out_o, what=f"need_weights={nw}")


@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fused"])
@pytest.mark.parametrize("kind", ["none", "causal_padding", "cross", "per_head_4d"])
def test_equals_official_in_float64(kind, need_weights):
    """Regression: the explicit path used to do softmax in float32 even for float64 inputs (diff ~2e-8)."""
    ours, off = make_pair("from_official", dtype=torch.float64)
    case = make_case(kind, dtype=torch.float64)
    out, w, dx = run_ours(ours, case, need_weights)
    out_o, w_o, dx_o = run_official(off, case, need_weights)
    assert out.dtype == torch.float64
    close(out, out_o, tol=1e-12, what="output")
    if need_weights:
        close(w.detach(), w_o.detach(), tol=1e-12, what="weights")
    for a, b in zip(dx, dx_o):
        close(a, b, tol=1e-12, what="input grad")
    param_grads_match(ours, off, tol=1e-12)


def test_bias_false_equals_official():
    ours, off = make_pair("from_official", bias=False)
    assert ours.W_Q.bias is None and off.in_proj_bias is None
    case = make_case("causal_padding")
    for nw in (True, False):
        ours.zero_grad()
        off.zero_grad()
        out, _, dx = run_ours(ours, case, nw)
        out_o, _, dx_o = run_official(off, case, nw)
        close(out, out_o, what="output")
        close(dx[0], dx_o[0], what="dQ")
        param_grads_match(ours, off)


# ---------------------------------------------------------------- converters: round trips


@pytest.mark.parametrize("bias", [True, False])
def test_round_trip_ours_official_ours(bias):
    ours, _ = make_pair("to_official", bias=bias)
    back = MultiHeadAttention.from_official(ours.to_official())
    # nn.MultiheadAttention has no per-module default for averaging the weights: from_official takes PyTorch's
    assert (ours.average_attn_weights, back.average_attn_weights) == (False, True)
    back.average_attn_weights = False
    sd, sd2 = ours.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys()
    for key in sd:
        assert torch.equal(sd[key], sd2[key]), key
    case = make_case("causal_padding")
    for nw in (True, False):
        a, wa = ours(case.q, key_padding_mask=case.kpm, attn_mask=case.ours_mask, need_weights=nw)
        b, wb = back(case.q, key_padding_mask=case.kpm, attn_mask=case.ours_mask, need_weights=nw)
        assert torch.equal(a, b)
        if nw:
            assert torch.equal(wa, wb)


@pytest.mark.parametrize("bias", [True, False])
def test_round_trip_official_ours_official(bias):
    _, off = make_pair("from_official", bias=bias, dropout=0.25)
    back = MultiHeadAttention.from_official(off).to_official()
    assert back.dropout == 0.25 and back.batch_first and back.num_heads == H
    sd, sd2 = off.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys()
    for key in sd:
        assert torch.equal(sd[key], sd2[key]), key
    off.eval()
    back.eval()
    case = make_case("cross")
    a, wa = off(case.q, case.k, case.v, key_padding_mask=case.kpm, average_attn_weights=False)
    b, wb = back(case.q, case.k, case.v, key_padding_mask=case.kpm, average_attn_weights=False)
    assert torch.equal(a, b) and torch.equal(wa, wb)


def test_converters_keep_dtype_and_dropout():
    off = nn.MultiheadAttention(E, H, dropout=0.1, batch_first=True, dtype=torch.float64)
    ours = MultiHeadAttention.from_official(off)
    assert ours.W_Q.weight.dtype == torch.float64
    assert ours.attention.dropout.p == 0.1
    assert ours.to_official().in_proj_weight.dtype == torch.float64


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rotary": nn.Identity()}, r"cannot express rotary position embeddings \(RoPE\)"),
        ({"position_bias": nn.Identity()}, r"cannot express a position bias \(Identity\)"),
        ({"attention": nn.Identity()}, "cannot express the Identity kernel"),
        ({"head_dim": 8}, r"cannot express num_heads=4 x head_dim=8 = 32 != embed_dim=16"),
    ],
)
def test_to_official_refuses_variants(kwargs, match):
    with pytest.raises(ValueError, match=f"to_official: nn.MultiheadAttention {match}"):
        MultiHeadAttention(E, H, **kwargs).to_official()


# ---------------------------------------------------------------- the article's own debugging checks


class ArticleSDPA(nn.Module):
    """The article's section-2 ScaledDotProductAttention, verbatim (bugs included), for regression tests."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    def forward(self, Q, K, V, mask=None):
        batch_size, L_q, head_dim = Q.size()  # noqa: RUF059 (verbatim: unpacking 3 names is the 4-D bug)
        _, L_k, _ = K.size()  # noqa: RUF059
        attn_scores = torch.matmul(Q, K.transpose(-2, -1)) / math.sqrt(head_dim)
        if mask is not None:
            attn_scores = attn_scores.masked_fill(mask == 0, -1e9)
        attn_weights = F.softmax(attn_scores, dim=-1)
        attn_weights = self.dropout(attn_weights)
        output = torch.matmul(attn_weights, V)
        return output, attn_weights


def article_setup():
    """Section 4's sizes: embed_dim=64, num_heads=8, batch=4, seq_len=10, causal mask True = blocked."""
    torch.manual_seed(42)
    e, h, b, L = 64, 8, 4, 10
    causal = torch.triu(torch.ones(L, L), diagonal=1).bool()
    return e, h, b, L, causal


@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fused"])
def test_article_check_rows_sum_to_one_and_causal_upper_triangle_is_zero(need_weights):
    e, h, b, L, causal = article_setup()
    mha = MultiHeadAttention(e, h).eval()
    Q, K, V = (torch.randn(b, L, e) for _ in range(3))
    _, w = mha(Q, K, V)
    assert w.shape == (b, h, L, L)
    assert (w.sum(-1) - 1).abs().max().item() < 1e-6
    out_masked, w_masked = mha(Q, K, V, attn_mask=causal)
    assert (w_masked.sum(-1) - 1).abs().max().item() < 1e-6
    assert w_masked[:, :, causal].abs().max().item() < 1e-6  # the article's check: upper triangle ~0
    assert w_masked[:, :, causal].mean().item() < 1e-6
    out_path, _ = mha(Q, K, V, attn_mask=causal, need_weights=need_weights)
    close(out_path, out_masked, what="explicit vs fused")
    # causality in the output itself: changing future keys/values does not change query 0..L-2 rows
    K2, V2 = K.clone(), V.clone()
    K2[:, -1] += 5.0
    V2[:, -1] -= 5.0
    out2, _ = mha(Q, K2, V2, attn_mask=causal, need_weights=need_weights)
    close(out2[:, :-1], out_path[:, :-1], what="future keys leaked")
    assert (out2[:, -1] - out_path[:, -1]).abs().max().item() > 1e-2


def test_article_inverted_mask_regression():
    """`masked_fill(mask == 0, -1e9)` with a True = blocked causal mask blocks the VISIBLE keys.

    The article's own check (mean weight on the upper triangle, "should be ~0") then reads 2/L = 0.2
    for seq_len 10: every row i < L-1 puts all its weight on the L-1-i future keys. Ours reads 0.
    """
    e, h, b, L, causal = article_setup()
    d = e // h
    Q, K, V = (torch.randn(b, h, L, d) for _ in range(3))
    # the article's SDPA only takes 3-D inputs: run it on (B*H, L, d)
    _, w_article = ArticleSDPA()(
        Q.reshape(b * h, L, d), K.reshape(b * h, L, d), V.reshape(b * h, L, d), causal
    )
    w_article = w_article.view(b, h, L, L)
    visible = ~causal  # lower triangle, diagonal included
    # rows 0..L-2: zero weight on every visible key (exp(-1e9) underflows to exactly 0)
    assert w_article[:, :, :-1][:, :, visible[:-1]].abs().max().item() < 1e-6
    # the last row has no future key: all scores are -1e9, softmax is uniform 1/L over blocked-by-fill keys
    close(w_article[:, :, -1], torch.full((b, h, L), 1.0 / L), 1e-6, "last row")
    # the article's check, exactly as written in section 4
    upper_mean = w_article[:, :, causal].mean().item()
    assert abs(upper_mean - 2.0 / L) < 1e-6 and abs(upper_mean - 0.2) < 1e-6
    assert w_article[:, :, causal].max().item() > 0.5  # not ~0 at all: row L-2 puts weight 1 on key L-1

    _, w_ours = ScaledDotProductAttention()(Q, K, V, mask=causal)
    assert w_ours[:, :, causal].abs().max().item() < 1e-6
    assert w_ours[:, :, causal].mean().item() < 1e-6
    ref = torch.softmax((Q @ K.transpose(-2, -1) / math.sqrt(d)).masked_fill(causal, float("-inf")), -1)
    close(w_ours, ref, 1e-6, "ours vs reference")


def test_article_sdpa_crashes_on_4d_and_ours_does_not():
    Q = torch.randn(B, H, 5, 4)
    with pytest.raises(ValueError, match="too many values to unpack"):
        ArticleSDPA()(Q, Q, Q)
    out, w = ScaledDotProductAttention()(Q, Q, Q)
    assert out.shape == (B, H, 5, 4) and w.shape == (B, H, 5, 5)
    close(out, torch.softmax(Q @ Q.transpose(-2, -1) / 2.0, -1) @ Q, 1e-6, "4-D vs formula")


@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fused"])
@pytest.mark.parametrize("mask_kind", ["none", "bool_per_head", "float_per_head", "bool_shared"])
def test_sdpa_4d_equals_per_head_loop_of_3d(mask_kind, need_weights):
    torch.manual_seed(0)
    Lq, Lk, d = 5, 7, 8
    Q, K, V = torch.randn(B, H, Lq, d), torch.randn(B, H, Lk, d), torch.randn(B, H, Lk, d)
    mask = None
    if mask_kind == "bool_per_head":
        mask = torch.rand(B, H, Lq, Lk) < 0.4
        mask[..., 0] = False
    elif mask_kind == "float_per_head":
        mask = torch.randn(B, H, Lq, Lk)
    elif mask_kind == "bool_shared":
        mask = torch.ones(Lq, Lk, dtype=torch.bool).triu(1)
    sdpa = ScaledDotProductAttention().eval()
    out, w = sdpa(Q, K, V, mask=mask, need_weights=need_weights)
    for h in range(H):
        m = None if mask is None else (mask if mask.dim() == 2 else mask[:, h])
        out_h, w_h = sdpa(Q[:, h], K[:, h], V[:, h], mask=m, need_weights=True)  # 3-D (B, L, d)
        close(out[:, h], out_h, 1e-6, f"head {h} output")
        if need_weights:
            close(w[:, h], w_h, 1e-6, f"head {h} weights")
        # and the 3-D result is the formula
        s = Q[:, h] @ K[:, h].transpose(-2, -1) / math.sqrt(d)
        if m is not None:
            s = s.masked_fill(m, float("-inf")) if m.dtype == torch.bool else s + m
        close(out_h, torch.softmax(s, -1) @ V[:, h], 1e-6, f"head {h} formula")


# ---------------------------------------------------------------- fully masked query rows


def dead_case(how: str, L=5):
    kpm = am = None
    dead = torch.zeros(B, L, dtype=torch.bool)  # (batch, query) rows with no visible key
    if how == "key_padding":
        kpm = torch.zeros(B, L, dtype=torch.bool)
        kpm[1] = True  # batch element 1: every key is padding
        kpm[0, -1] = True
        dead[1] = True
    else:
        am = torch.zeros(L, L, dtype=torch.bool).triu(1)
        am[2] = True  # query 2 sees nothing (causal otherwise)
        dead[:, 2] = True
    return kpm, am, dead


# dtype, tolerance of the live rows against official float32
DEAD_DTYPES = {
    "float32": (torch.float32, TOL),
    "bfloat16": (torch.bfloat16, 1e-2),
    "float16": (torch.float16, 2e-3),
    "autocast_bf16": (torch.float32, 1e-2),
}


@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fused"])
@pytest.mark.parametrize("how", ["key_padding", "attn_mask_row"])
@pytest.mark.parametrize("dtype_name", list(DEAD_DTYPES))
def test_fully_masked_rows_are_zero_and_finite(dtype_name, how, need_weights):
    dtype, tol = DEAD_DTYPES[dtype_name]
    autocast = dtype_name == "autocast_bf16"
    _, off = make_pair("from_official")
    off.eval()
    ours = MultiHeadAttention.from_official(off).to(dtype)  # float16 matmul/softmax/sdpa run on this CPU
    kpm, am, dead = dead_case(how)
    x0 = torch.randn(B, 5, E, generator=torch.Generator().manual_seed(1))
    g_out = torch.randn(B, 5, E, generator=torch.Generator().manual_seed(2))

    def forward(grad_out):
        ours.zero_grad()
        x = x0.to(dtype).clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, w = ours(x, key_padding_mask=kpm, attn_mask=am, need_weights=need_weights,
                          average_attn_weights=False)
        out.backward(grad_out.to(out.dtype))
        return x, out.detach(), w

    x, out, w = forward(g_out)
    assert out.dtype == (torch.bfloat16 if autocast else dtype)
    assert torch.isfinite(out).all()
    # attention output of a dead row is 0, so the MHA output there is exactly W_O's bias
    bias = ours.W_O.bias.detach().to(out.dtype)
    assert torch.equal(out[dead], bias.expand(int(dead.sum()), E))
    assert torch.isfinite(x.grad).all()
    for name, p in ours.named_parameters():
        assert torch.isfinite(p.grad).all(), name
    if need_weights:
        assert torch.equal(
            w[dead[:, None, :].expand(B, H, 5)], torch.zeros(int(dead.sum()) * H, 5, dtype=w.dtype)
        )
        live = w[~dead[:, None, :].expand(B, H, 5)].float()
        assert (live.sum(-1) - 1).abs().max().item() < (1e-6 if w.dtype == torch.float32 else 2e-2)
    else:
        assert w is None
    # gradients flowing in only through the dead rows are exactly zero (except out_proj's, W_O's, bias)
    x, _, _ = forward(g_out * dead[..., None])
    assert torch.equal(x.grad, torch.zeros_like(x.grad))
    for name, p in ours.named_parameters():
        if name != "out_proj.bias":
            assert torch.equal(p.grad, torch.zeros_like(p.grad)), name
    # the live rows still equal nn.MultiheadAttention (float32 reference; looser for half precision)
    with torch.no_grad():
        ref, _ = off(x0, x0, x0, key_padding_mask=kpm, attn_mask=am)
    close(out[~dead].float(), ref[~dead], tol, "live rows vs official")


@pytest.mark.parametrize("how", ["key_padding", "attn_mask_row"])
def test_fully_masked_rows_live_gradients_equal_official(how):
    """Gradients of the live rows equal official's, computed where official has no dead row to poison them."""
    ours, off = make_pair("from_official")
    kpm, am, dead = dead_case(how)
    x0 = torch.randn(B, 5, E, generator=torch.Generator().manual_seed(1))
    g_out = torch.randn(B, 5, E, generator=torch.Generator().manual_seed(2)) * (~dead)[..., None]
    for nw in (True, False):
        ours.zero_grad()
        off.zero_grad()
        x = x0.clone().requires_grad_(True)
        out, _ = ours(x, key_padding_mask=kpm, attn_mask=am, need_weights=nw)
        out.backward(g_out)
        xo = x0.clone().requires_grad_(True)
        if how == "key_padding":  # official on the live batch element only
            out_o, _ = off(xo[:1], xo[:1], xo[:1], key_padding_mask=kpm[:1])
            out_o.backward(g_out[:1])
        else:  # official with the dead row unblocked; its output gets no gradient
            am_o = am.clone()
            am_o[2] = False
            out_o, _ = off(xo, xo, xo, attn_mask=am_o)
            out_o.backward(g_out)
        close(x.grad, xo.grad, what="dX")
        param_grads_match(ours, off)


@pytest.mark.parametrize("how", ["key_padding", "attn_mask_row"])
def test_official_mha_returns_nan_on_fully_masked_rows(how):
    """Why we special-case dead rows: nn.MultiheadAttention's weights path gives NaN outputs there,
    and the NaN reaches every parameter gradient."""
    _, off = make_pair("from_official")
    kpm, am, dead = dead_case(how)
    x = torch.randn(B, 5, E, requires_grad=True)
    out, w = off(x, x, x, key_padding_mask=kpm, attn_mask=am, need_weights=True, average_attn_weights=False)
    assert torch.isnan(out[dead]).all()
    assert torch.isfinite(out[~dead]).all()
    assert torch.isnan(w[dead[:, None, :].expand(B, H, 5)]).all()
    out.sum().backward()
    assert torch.isnan(off.in_proj_weight.grad).any() and torch.isnan(x.grad).any()


# ---------------------------------------------------------------- dropout


@pytest.mark.parametrize("need_weights", [True, False], ids=["explicit", "fused"])
def test_dropout_drops_in_train_on_both_paths_and_matches_official_rng(need_weights):
    p = 0.3
    ours, off = make_pair("from_official", dropout=p)
    case = make_case("causal_padding")
    ours.eval()
    ref, w_eval = ours(case.q, key_padding_mask=case.kpm, attn_mask=case.ours_mask)
    ours.train()
    off.train()
    torch.manual_seed(7)
    out, w = ours(case.q, key_padding_mask=case.kpm, attn_mask=case.ours_mask, need_weights=need_weights)
    assert (out - ref).abs().max().item() > 1e-2  # it actually drops
    torch.manual_seed(7)
    out2, _ = ours(case.q, key_padding_mask=case.kpm, attn_mask=case.ours_mask, need_weights=need_weights)
    assert torch.equal(out, out2)  # and draws its mask from torch's RNG
    # same seed, same kernel: identical to nn.MultiheadAttention in train mode
    torch.manual_seed(7)
    out_o, w_o = off(
        case.q,
        case.q,
        case.q,
        key_padding_mask=case.kpm,
        attn_mask=case.off_mask,
        need_weights=need_weights,
        average_attn_weights=False,
    )
    close(out, out_o, what="train-mode output vs official")
    if need_weights:
        close(w, w_o, what="dropped weights vs official")
        kept = w != 0
        assert 0.5 < kept[w_eval != 0].float().mean().item() < 0.9  # ~70% kept
        close(w[kept], w_eval[kept] / (1 - p), 1e-6, "kept weights are scaled by 1/(1-p)")


def _blocked(p=0.25, block=16):
    """A ScaledDotProductAttention whose fused path attends in blocks of `block` queries."""
    return ScaledDotProductAttention(p, block_min_scores=1, query_block=block).train()


def _qkv_and_causal_padding_mask(B=2, H=3, L=40, d=8):
    g = torch.Generator().manual_seed(3)
    Q, K, V = (torch.randn(B, H, L, d, generator=g, requires_grad=True) for _ in range(3))
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, L - 9 :] = True
    return (Q, K, V), causal | pad[:, None, None, :]  # (B, 1, L, L), True = blocked


def test_blocked_dropout_path_replays_its_dropout_in_backward():
    # CPU + dropout + long enough -> blocks under checkpointing. Reference: the same blocks in a plain
    # loop, same seed, no checkpointing. Equal outputs show the blocks draw dropout as the loop does;
    # equal gradients show backward's recomputation replays the very same dropout masks.
    (Q, K, V), mask = _qkv_and_causal_padding_mask()
    p, block = 0.25, 16
    torch.manual_seed(11)
    out, _ = _blocked(p, block)(Q, K, V, mask=mask, need_weights=False)
    grads = torch.autograd.grad(out.square().sum(), (Q, K, V))

    add = torch.zeros(mask.shape).masked_fill(mask, float("-inf"))
    torch.manual_seed(11)
    ref = torch.cat([
        F.scaled_dot_product_attention(Q[..., s : s + block, :], K, V, attn_mask=add[..., s : s + block, :], dropout_p=p)
        for s in range(0, Q.size(-2), block)
    ], dim=-2)
    ref_grads = torch.autograd.grad(ref.square().sum(), (Q, K, V))
    assert torch.equal(out, ref)
    for name, g, r in zip("QKV", grads, ref_grads):
        close(g, r, 1e-6, f"d{name}, blocked+checkpointed vs plain blocks")
    torch.manual_seed(11)
    whole = F.scaled_dot_product_attention(Q, K, V, attn_mask=add, dropout_p=p)
    assert not torch.equal(out, whole)  # the blocked path really ran (one draw per block)


def test_blocked_dropout_path_equals_full_attention_when_nothing_is_dropped():
    # p > 0 takes the blocked path; a dropout of 1e-9 drops nothing in practice, so the blocks must
    # reproduce one whole SDPA call (the masks' per-query rows are sliced right), gradients included.
    (Q, K, V), mask = _qkv_and_causal_padding_mask()
    torch.manual_seed(0)  # the draws do not depend on the order the tests run in
    out, _ = _blocked(1e-9, 16)(Q, K, V, mask=mask, need_weights=False)
    grads = torch.autograd.grad(out.sum(), (Q, K, V))
    ref, _ = ScaledDotProductAttention(0.0)(Q, K, V, mask=mask, need_weights=False)
    ref_grads = torch.autograd.grad(ref.sum(), (Q, K, V))
    close(out, ref, 1e-6, "blocked vs whole")
    for name, g, r in zip("QKV", grads, ref_grads):
        close(g, r, 1e-5, f"d{name}, blocked vs whole")


def test_blocked_dropout_path_keeps_a_fraction_of_the_saved_activations():
    # what autograd keeps for backward, summed over the saved tensors: the whole-matrix fallback keeps
    # several (B, H, L, L) tensors, the blocked path only its inputs.
    B, H, L, d = 1, 2, 512, 16
    Q, K, V = (torch.randn(B, H, L, d, requires_grad=True) for _ in range(3))

    def saved_bytes(sdpa):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            sdpa(Q, K, V, need_weights=False)
        return sum(seen.values())

    whole = saved_bytes(ScaledDotProductAttention(0.1).train())
    blocked = saved_bytes(_blocked(0.1, 64))
    assert whole >= 2 * B * H * L * L * 4  # at least two float32 (L, L) matrices per head
    assert blocked <= 0.1 * whole, (blocked, whole)


def test_block_settings_are_constructor_arguments_of_each_instance():
    # MultiHeadAttention hands them to its default kernel; two instances keep their own values, and a
    # state dict saved with one setting loads into the other (they are not weights)
    (Q, K, V), _ = _qkv_and_causal_padding_mask()
    off = MultiHeadAttention(16, 2, 0.1, block_min_scores=None)
    small = MultiHeadAttention(16, 2, 0.1, block_min_scores=1, query_block=8)
    default = MultiHeadAttention(16, 2, 0.1)
    assert (off.attention.block_min_scores, off.attention.query_block) == (None, QUERY_BLOCK)
    assert (small.attention.block_min_scores, small.attention.query_block) == (1, 8)
    assert (default.attention.block_min_scores, default.attention.query_block) == (BLOCK_MIN_SCORES, QUERY_BLOCK)
    off.load_state_dict(small.state_dict())  # strict: the same keys
    # block_min_scores=None never blocks, even for a kernel whose size would
    torch.manual_seed(5)
    never, _ = ScaledDotProductAttention(0.25, block_min_scores=None, query_block=16).train()(Q, K, V, need_weights=False)
    torch.manual_seed(5)
    whole, _ = ScaledDotProductAttention(0.25).train()(Q, K, V, need_weights=False)  # L=40: below the default
    torch.manual_seed(5)
    blocked, _ = _blocked(0.25, 16)(Q, K, V, need_weights=False)
    assert torch.equal(never, whole) and not torch.equal(blocked, whole)


@pytest.mark.parametrize("kwargs, match", [
    ({"block_min_scores": 0}, r"block_min_scores=0 must be an integer >= 1 or null"),
    ({"block_min_scores": -4}, r"block_min_scores=-4 must be an integer >= 1 or null"),
    ({"block_min_scores": 1.5}, r"block_min_scores=1.5 must be an integer"),
    ({"block_min_scores": True}, r"block_min_scores=True must be an integer"),
    ({"query_block": None}, r"query_block=None must be an integer >= 1 \(the default is 256\)"),
    ({"query_block": 0}, r"query_block=0 must be an integer >= 1"),
])
def test_bad_block_settings_are_refused_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScaledDotProductAttention(0.1, **kwargs)
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(16, 2, 0.1, **kwargs)


def test_dropout_is_off_in_eval():
    ours, _ = make_pair("from_official", dropout=0.5)
    ours.eval()
    case = make_case("none")
    a, _ = ours(case.q, need_weights=True)
    b, _ = ours(case.q, need_weights=False)
    c, _ = ours(case.q, need_weights=True)
    assert torch.equal(a, c)
    close(a, b, what="explicit vs fused in eval")


# ---------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("embed_dim, num_heads", [(10, 3), (64, 7), (16, 5)])
def test_embed_dim_not_divisible_names_both_numbers(embed_dim, num_heads):
    with pytest.raises(
        ValueError, match=rf"num_heads={num_heads} does not divide embed_dim={embed_dim} "
    ):
        MultiHeadAttention(embed_dim, num_heads)


@pytest.mark.parametrize("embed_dim, num_heads", [(0, 2), (16, 0), (-4, 2)])
def test_non_positive_sizes_are_refused(embed_dim, num_heads):
    with pytest.raises(
        ValueError, match=rf"embed_dim={embed_dim} and num_heads={num_heads} must both be >= 1"
    ):
        MultiHeadAttention(embed_dim, num_heads)


@pytest.mark.parametrize("bad", ["Q", "K", "V"])
def test_wrong_last_dimension_names_the_tensor(bad):
    mha = MultiHeadAttention(E, H)
    t = {n: torch.randn(B, 5, E) for n in "QKV"}
    t[bad] = torch.randn(B, 5, E + 1)
    name, width = {"Q": ("query", "embed_dim"), "K": ("key", "kdim"), "V": ("value", "vdim")}[bad]
    with pytest.raises(
        ValueError,
        match=rf"{name} has shape \({B}, 5, {E + 1}\); expected \(batch, seq_len, {width}={E}\) "
        rf"\(batch_first=True\) or unbatched",
    ):
        mha(t["Q"], t["K"], t["V"])


def test_inputs_neither_batched_nor_unbatched_are_refused():
    mha = MultiHeadAttention(E, H)
    with pytest.raises(ValueError, match=rf"query \(5, {E}\), key \(2, 5, {E}\).*expected all batched"):
        mha(torch.randn(5, E), torch.randn(2, 5, E), torch.randn(2, 5, E))
    with pytest.raises(ValueError, match=rf"query \(1, 2, 5, {E}\).*expected all batched \(3-D, batch-first\)"):
        mha(torch.randn(1, 2, 5, E))


def test_batch_or_length_mismatch_is_refused():
    mha = MultiHeadAttention(E, H)
    with pytest.raises(ValueError, match=r"batch/length mismatch: query \(2, 5, 16\), key \(3, 6, 16\)"):
        mha(torch.randn(2, 5, E), torch.randn(3, 6, E), torch.randn(3, 6, E))
    with pytest.raises(ValueError, match=r"key and value need the same \(batch, L_k\)"):
        mha(torch.randn(2, 5, E), torch.randn(2, 6, E), torch.randn(2, 7, E))


@pytest.mark.parametrize("need_weights", [True, False])
def test_mask_of_wrong_shape_names_expected_shapes(need_weights):
    mha = MultiHeadAttention(E, H)
    q, k = torch.randn(B, 3, E), torch.randn(B, 5, E)
    with pytest.raises(
        ValueError,
        match=r"attn_mask has shape \(5, 3\).*Expected one of \(3, 5\), \(2, 3, 5\), "
        r"\(8, 3, 5\) or \(2, 4, 3, 5\)",
    ):
        mha(q, k, k, attn_mask=torch.zeros(5, 3, dtype=torch.bool), need_weights=need_weights)
    with pytest.raises(
        ValueError, match=r"key_padding_mask has shape \(2, 3\); expected \(batch, L_k\) = \(2, 5\)"
    ):
        mha(q, k, k, key_padding_mask=torch.zeros(B, 3, dtype=torch.bool), need_weights=need_weights)


@pytest.mark.parametrize("which", ["attn_mask", "key_padding_mask"])
def test_integer_mask_is_refused(which):
    mha = MultiHeadAttention(E, H)
    x = torch.randn(B, 5, E)
    mask = (
        torch.ones(5, 5, dtype=torch.int64).tril()
        if which == "attn_mask"
        else torch.ones(B, 5, dtype=torch.int64)
    )
    with pytest.raises(TypeError, match=rf"{which} has dtype torch\.int64; use a bool mask \(True = blocked"):
        mha(x, **{which: mask})


def test_sdpa_integer_mask_is_refused():
    Q = torch.randn(B, 5, 4)
    with pytest.raises(TypeError, match=r"mask has dtype torch\.int64"):
        ScaledDotProductAttention()(Q, Q, Q, mask=torch.ones(5, 5, dtype=torch.int64))


def _weight_sized_masked_fills(attention, Q, K, V, mask) -> int:
    """How many masked_fill calls over a (..., L_q, L_k) tensor one forward and backward of the explicit computation
    (need_weights=True) makes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    scores = Q.shape[:-1].numel() * K.size(-2)
    count = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket == torch.ops.aten.masked_fill and out.numel() == scores:
                count.append(func)
            return out

    with Count():
        out, _ = attention(Q, K, V, mask=mask, need_weights=True)
        out.sum().backward()
    return len(count)


def test_a_mask_without_dead_rows_skips_zeroing_them_on_cpu_and_gives_pytorchs_numbers():
    # key padding leaves every query a key: no row to zero, so no pass over the weights for it, forward or backward
    # (a dead row still gets one each way). The numbers are PyTorch's either way.
    g = torch.Generator().manual_seed(5)
    Q, K, V = (torch.randn(3, 2, 7, 4, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3))
    live = torch.zeros(3, 1, 1, 7, dtype=torch.float64)
    live[1, ..., 4:] = float("-inf")
    attention = ScaledDotProductAttention(0.0).eval()
    assert _weight_sized_masked_fills(attention, Q, K, V, live) == 0
    dead = live.clone()
    dead[2] = float("-inf")  # every key of batch 2 blocked
    assert _weight_sized_masked_fills(attention, Q, K, V, dead) == 2

    for mask in (live, dead):
        Q.grad = None
        out, _ = attention(Q, K, V, mask=mask, need_weights=True)
        out.sum().backward()
        ref = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask).nan_to_num(0.0)  # PyTorch: NaN at dead rows
        close(out, ref, 1e-12, "explicit against SDPA")
        assert torch.isfinite(Q.grad).all() and (mask is live or Q.grad[2].abs().sum() == 0)
