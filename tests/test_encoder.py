"""encoder.py proven equal to nn.TransformerEncoderLayer / nn.TransformerEncoder (weights copied).

Outputs, input gradients and every parameter gradient are compared at 1e-5 in float32, in train
mode (dropout=0) and eval mode, post-norm and pre-norm, relu and gelu, for each mask kind.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import close
from torch import nn

from mhalab.model import SequenceClassifier
from mhalab.nn.attention import MultiHeadAttention
from mhalab.nn.encoder import OfficialEncoder, TransformerEncoder, TransformerEncoderLayer

ONE_THREAD = True  # tiny tensors: see conftest.one_thread

E, H, FF, B, L = 16, 4, 32, 2, 6
TOL = 1e-5
KINDS = ["none", "causal", "float", "padding", "causal_padding", "per_head_4d"]
pytestmark = pytest.mark.filterwarnings(
    "ignore:Support for mismatched key_padding_mask:UserWarning",
    "ignore:enable_nested_tensor is True:UserWarning",
    "ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning",
)




def perturb(mod: nn.Module, seed: int = 7) -> nn.Module:
    """Move every parameter off its init (zero biases, unit LayerNorm) so no gradient is trivially equal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p) * 0.1)
    return mod


def official_layer(activation, norm_first, dropout=0.0, dtype=torch.float32):
    return nn.TransformerEncoderLayer(
        E, H, FF, dropout=dropout, activation=activation, batch_first=True, norm_first=norm_first, dtype=dtype
    )


def layer_pair(conversion, activation, norm_first, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    if conversion == "from_official":
        off = perturb(official_layer(activation, norm_first, dropout))
        ours = TransformerEncoderLayer.from_official(off)
    else:
        ours = perturb(TransformerEncoderLayer(E, H, FF, dropout, activation, batch_first=True, norm_first=norm_first))
        off = ours.to_official()
    return ours, off


def stack_pair(conversion, activation, norm_first, final_norm, num_layers=3, seed=0):
    torch.manual_seed(seed)
    if conversion == "from_official":
        off = nn.TransformerEncoder(
            official_layer(activation, norm_first),
            num_layers,
            norm=nn.LayerNorm(E) if final_norm else None,
            enable_nested_tensor=False,
        )
        perturb(off)  # official deep-copies one layer: perturbing makes the layers differ
        ours = TransformerEncoder.from_official(off)
    else:
        ours = perturb(TransformerEncoder(num_layers=num_layers, embed_dim=E, num_heads=H, ff_dim=FF, dropout=0.0,
                                          activation=activation, norm_first=norm_first, final_norm=final_norm))
        off = ours.to_official()
    return ours, off


def make_masks(kind, seed=0):
    """(ours_mask, official_mask, key_padding_mask); official takes per-head masks as (B*H, L, L)."""
    g = torch.Generator().manual_seed(seed)
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, -2:] = True
    if kind == "none":
        return None, None, None
    if kind == "causal":
        return causal, causal, None
    if kind == "float":
        fm = torch.randn(L, L, generator=g)
        fm[0, 2] = fm[3, 5] = float("-inf")
        return fm, fm, None
    if kind == "padding":
        return None, None, kpm
    if kind == "causal_padding":
        return causal, causal, kpm
    assert kind == "per_head_4d"
    m = (torch.rand(B, H, L, L, generator=g) < 0.5) & ~torch.eye(L, dtype=torch.bool)
    return m, m.reshape(B * H, L, L), None


def official_names(ours: nn.Module, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our parameter names/tensors -> official names/tensors (W_Q, W_K, W_V stacked into in_proj)."""
    out, stacked = {}, {}
    for name, t in values.items():
        for qkv in ("W_Q", "W_K", "W_V"):
            if f"self_attn.{qkv}." in name:
                prefix, kind = name.split(f"self_attn.{qkv}.")
                stacked.setdefault((prefix, kind), {})[qkv] = t
                break
        else:
            out[
                name.replace("self_attn.W_O.", "self_attn.out_proj.")
                .replace("ffn.0.", "linear1.")
                .replace("ffn.3.", "linear2.")
            ] = t
    for (prefix, kind), d in stacked.items():
        out[f"{prefix}self_attn.in_proj_{kind}"] = torch.cat([d["W_Q"], d["W_K"], d["W_V"]])
    return out


def assert_param_grads_equal(ours, off, tol=TOL):
    """Every official parameter gradient equals ours; W_Q/W_K/W_V grads are the chunks of in_proj grads."""
    ours_g = official_names(ours, {n: p.grad for n, p in ours.named_parameters()})
    off_g = {n: p.grad for n, p in off.named_parameters()}
    assert ours_g.keys() == off_g.keys()
    for name, grad in off_g.items():
        close(ours_g[name], grad, tol, f"grad of {name}")


def run_both(ours, off, kind, mode, ours_kw="src_mask", off_kw="src_mask", real_only=False):
    """Compare outputs, input grads and parameter grads. real_only: with a key-padding mask, compare the
    real positions only and send no gradient into the padded ones (their outputs mean nothing; our stack
    may skip them, as nn.TransformerEncoder's nested tensors do). Input and parameter gradients are then
    still compared in full."""
    ours.train(mode == "train")
    off.train(mode == "train")
    m_ours, m_off, kpm = make_masks(kind)
    g = torch.Generator().manual_seed(3)
    x0, g_out = torch.randn(B, L, E, generator=g), torch.randn(B, L, E, generator=g)
    real = torch.ones(B, L, dtype=torch.bool) if kpm is None or not real_only else ~kpm
    g_out = g_out * real[..., None]
    x, xo = x0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
    out = ours(x, **{ours_kw: m_ours}, src_key_padding_mask=kpm)
    out_o = off(xo, **{off_kw: m_off}, src_key_padding_mask=kpm)
    out.backward(g_out)
    out_o.backward(g_out)
    assert torch.isfinite(out).all()
    close(out[real], out_o[real], what="output")
    close(x.grad, xo.grad, what="input grad")
    assert_param_grads_equal(ours, off)


# ---------------------------------------------------------------- equality


@pytest.mark.parametrize("conversion", ["from_official", "to_official"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("kind", KINDS)
def test_layer_equals_official(kind, activation, norm_first, mode, conversion):
    ours, off = layer_pair(conversion, activation, norm_first)
    run_both(ours, off, kind, mode)


def _record_kernel_calls(model: nn.Module) -> list[tuple[bool, bool]]:
    """(need_weights each attention kernel was called with, whether it returned weights), one per call."""
    calls = []
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):
            m.attention.register_forward_hook(
                lambda mod, args, kwargs, out: calls.append((kwargs["need_weights"], out[1] is not None)),
                with_kwargs=True)
    return calls


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("kind", KINDS)
def test_layer_with_explicit_attention_path_equals_official(kind, norm_first):
    """The layer calls its attention with need_weights=False; from_official(explicit=True) makes that
    attention compute through the weights anyway, with the same numbers as PyTorch's layer."""
    torch.manual_seed(0)
    off = perturb(official_layer("gelu", norm_first))
    ours = TransformerEncoderLayer.from_official(off, explicit=True)
    calls = _record_kernel_calls(ours)
    run_both(ours, off, kind, "train")
    assert calls == [(True, True)]  # the weights path ran (the fused one returns no weights)


@pytest.mark.parametrize("kind", ["causal_padding", "per_head_4d"])
def test_stack_with_explicit_attention_path_equals_official(kind):
    """TransformerEncoder.from_official(explicit=True): every layer's attention on the weights path."""
    torch.manual_seed(0)
    off = perturb(nn.TransformerEncoder(official_layer("relu", False), 3, enable_nested_tensor=False))
    ours = TransformerEncoder.from_official(off, explicit=True)
    calls = _record_kernel_calls(ours)
    run_both(ours, off, kind, "train", ours_kw="mask", off_kw="mask", real_only=True)
    assert calls == [(True, True)] * 3


@pytest.mark.parametrize("conversion", ["from_official", "to_official"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("config", ["post_relu", "post_gelu_final_norm", "pre_gelu_final_norm", "pre_relu"])
@pytest.mark.parametrize("kind", ["none", "causal_padding", "float", "per_head_4d"])
def test_stack_equals_official(kind, config, mode, conversion):
    norm_first = config.startswith("pre")
    activation = "relu" if "relu" in config else "gelu"
    ours, off = stack_pair(conversion, activation, norm_first, final_norm="final_norm" in config)
    assert len(ours.layers) == len(off.layers) == 3
    run_both(ours, off, kind, mode, ours_kw="mask", off_kw="mask", real_only=True)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("kind", ["none", "causal", "padding", "causal_padding"])
def test_equals_official_fast_path_in_eval_no_grad(kind, norm_first):
    """In eval + no_grad nn.TransformerEncoderLayer runs torch._transformer_encoder_layer_fwd."""
    ours, off = layer_pair("from_official", "relu", norm_first)
    ours_s, off_s = stack_pair("from_official", "gelu", norm_first, final_norm=norm_first)
    m_ours, m_off, kpm = make_masks(kind)
    real = torch.ones(B, L, dtype=torch.bool) if kpm is None else ~kpm
    x = torch.randn(B, L, E)
    for m in (ours, off, ours_s, off_s):
        m.eval()
    with torch.no_grad():
        # the layer computes every position, pads included, as official's layer does
        close(
            ours(x, src_mask=m_ours, src_key_padding_mask=kpm),
            off(x, src_mask=m_off, src_key_padding_mask=kpm),
            what="layer",
        )
        out, out_o = (
            ours_s(x, mask=m_ours, src_key_padding_mask=kpm),
            off_s(x, mask=m_off, src_key_padding_mask=kpm),
        )
    close(out[real], out_o[real], what="stack, real positions")


def test_official_encoder_wrapper_matches_ours():
    """OfficialEncoder (post-norm) uses nested tensors in eval + no_grad: its padded positions come out as
    0 then go through the final norm. Padded positions mean nothing; every real position is equal."""
    torch.manual_seed(0)
    wrap = perturb(OfficialEncoder(2, E, H, FF, dropout=0.0, activation="gelu", final_norm=True))
    ours = TransformerEncoder.from_official(wrap.encoder)
    _, _, kpm = make_masks("padding")
    x = torch.randn(B, L, E)
    wrap.eval()
    ours.eval()
    with torch.no_grad():
        a, b = ours(x, src_key_padding_mask=kpm), wrap(x, src_key_padding_mask=kpm)
    close(a[~kpm], b[~kpm], what="real positions")
    # nested tensor -> padded with 0, then the final LayerNorm: LayerNorm(0) is its bias
    close(b[kpm], wrap.encoder.norm.bias.detach().expand(int(kpm.sum()), E), 1e-6, "padded positions")
    assert torch.isfinite(a).all()
    wrap.train()
    ours.train()
    a, b = ours(x, src_key_padding_mask=kpm), wrap(x, src_key_padding_mask=kpm)
    close(a[~kpm], b[~kpm], what="train mode")
    close(ours(x), wrap(x), what="train mode, no padding")


def test_official_layer_fast_path_misreads_float_masks():
    """Documents a PyTorch bug our eval comparisons step around: in eval + no_grad,
    nn.TransformerEncoderLayer's fast path reads a float src_mask as bool (nonzero = blocked), cf.
    pytorch/pytorch#107084 (fixed there for nn.MultiheadAttention only). Ours equals its regular path."""
    ours, off = layer_pair("from_official", "relu", False)
    ours.eval()
    off.eval()
    fm = torch.randn(L, L).triu(1)  # zeros on and below the diagonal, random biases above it
    x = torch.randn(B, L, E)
    regular = off(x, src_mask=fm)  # parameters require grad and grad is on: no fast path
    with torch.no_grad():
        fast = off(x, src_mask=fm)
        as_bool = off.train()(x, src_mask=fm != 0)
        mine = ours(x, src_mask=fm)
    close(mine, regular, what="ours vs official regular path")
    close(fast, as_bool, what="official fast path == bool(mask != 0)")
    assert (fast - regular).abs().max().item() > 0.1


def test_compare_passes_and_covers_every_mask_kind():
    """mhalab-compare (make compare, the README's table) passes at its tolerance, for every mask kind."""
    import io

    from rich.console import Console

    from mhalab.checks import compare

    buf = io.StringIO()
    worst = compare.run(Console(file=buf, width=120))
    text = buf.getvalue()
    assert worst <= compare.TOL == TOL, text
    for kind in compare.MASK_KINDS:
        assert f"mask: {kind}" in text
    assert "FAIL" not in text and "PASS" in text
    assert "article's `masked_fill(mask == 0, -1e9)` 0.2000" in text


def test_compare_command_exits_1_above_its_tolerance_and_2_on_an_unknown_option(capsys, fork_server):
    """scripts/compare_with_official.py (make compare) passes argv to mhalab-compare: with a tolerance below
    float32's rounding (diffs ~1e-7) it must fail, mark the rows, and exit 1."""
    import os
    import sys
    from pathlib import Path

    from mhalab.checks import compare

    script = Path(__file__).resolve().parents[1] / "scripts" / "compare_with_official.py"
    proc = fork_server.run([sys.executable, str(script), "tol=1e-9"], env=dict(os.environ, PYTHONHASHSEED="0"),
                           timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "(tolerance 1e-09): FAIL" in proc.stdout and "tolerance 1e-09." in proc.stdout
    with pytest.raises(SystemExit) as e:
        compare.main(["--tol", "1e-9"])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("error: unknown option '--tol' (options are key=value, e.g. tol=...)")


# ---------------------------------------------------------------- converters


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_layer_round_trips(activation, norm_first):
    ours, _ = layer_pair("to_official", activation, norm_first, dropout=0.15)
    back = TransformerEncoderLayer.from_official(ours.to_official())
    assert back.activation == activation and back.norm_first == norm_first
    assert back.dropout1.p == back.dropout2.p == back.ffn[2].p == back.self_attn.attention.dropout.p == 0.15
    sd, sd2 = ours.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
    _, off = layer_pair("from_official", activation, norm_first, dropout=0.15)
    off2 = TransformerEncoderLayer.from_official(off).to_official()
    sd, sd2 = off.state_dict(), off2.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
    x = torch.randn(B, L, E)
    for m in (ours, back, off, off2):
        m.eval()
    assert torch.equal(ours(x), back(x))
    with torch.no_grad():
        assert torch.equal(off(x), off2(x))


@pytest.mark.parametrize("final_norm", [False, True])
def test_stack_round_trips(final_norm):
    ours, _ = stack_pair("to_official", "gelu", True, final_norm)
    back = TransformerEncoder.from_official(ours.to_official())
    sd, sd2 = ours.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
    _, off = stack_pair("from_official", "relu", False, final_norm)
    off2 = TransformerEncoder.from_official(off).to_official()
    sd, sd2 = off.state_dict(), off2.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert torch.equal(sd[k], sd2[k]), k
    x = torch.randn(B, L, E)
    assert torch.equal(ours.eval()(x), back.eval()(x))


def test_stack_from_official_keeps_final_norm_eps_and_dtype():
    """Regression: from_official used to copy only the final norm's weights into a fresh float32
    LayerNorm(eps=1e-5): a float64 encoder crashed and a non-default eps was silently lost."""
    layer = official_layer("gelu", True, dtype=torch.float64)
    off = nn.TransformerEncoder(
        layer, 2, norm=nn.LayerNorm(E, eps=1e-3, dtype=torch.float64), enable_nested_tensor=False
    )
    perturb(off)
    ours = TransformerEncoder.from_official(off)
    assert ours.norm.eps == 1e-3 and ours.norm.weight.dtype == torch.float64
    x = torch.randn(B, L, E, dtype=torch.float64)
    close(ours(x), off(x), 1e-12, "float64 output")
    assert ours.to_official().norm.eps == 1e-3


def test_layer_converters_keep_eps_and_dtype():
    off = nn.TransformerEncoderLayer(
        E, H, FF, 0.0, batch_first=True, layer_norm_eps=1e-3, dtype=torch.float64
    )
    perturb(off)
    ours = TransformerEncoderLayer.from_official(off)
    assert ours.norm1.eps == ours.norm2.eps == 1e-3 and ours.ffn[0].weight.dtype == torch.float64
    x = torch.randn(B, L, E, dtype=torch.float64)
    close(ours(x), off(x), 1e-12, "float64 output")
    assert ours.to_official().norm2.eps == 1e-3


def uniform_like(t: torch.Tensor, bound: float, rel: float = 0.1) -> bool:
    """t looks like U(-bound, bound): inside it, with std bound / sqrt(3) within `rel`."""
    std = t.detach().std().item()
    return t.abs().max().item() <= bound * (1 + 1e-6) and abs(std / (bound / math.sqrt(3)) - 1) < rel


def random_draws(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The layer's parameters that are not constants (LayerNorm's ones / zeros, zero biases)."""
    return {n: p for n, p in layer.named_parameters() if p.detach().unique().numel() > 1}


def test_every_layer_is_initialised_like_the_first_with_its_own_draws():
    """In each of 4 layers: W_Q/W_K/W_V are chunks of a xavier-uniform (3E, E) matrix and every attention
    bias is 0 (nn.MultiheadAttention's init); W_O and the feed-forward are nn.Linear's default (kaiming
    uniform a=sqrt(5): U(+-1/sqrt(fan_in))), feed-forward biases U(+-1/sqrt(fan_in)); no two layers share
    a draw. (Layers 1+ used to be re-initialised parent-first: kaiming W_Q/W_K/W_V, non-zero biases.)"""
    torch.manual_seed(0)
    dim = 128
    model = SequenceClassifier(100, 2, dim=dim, heads=4, layers=4, ff_dim=4 * dim, dropout=0.0, max_len=32)
    layers = model.encoder.layers
    xavier = math.sqrt(6 / (dim + 3 * dim))  # fan_in E, fan_out 3E
    for i, lyr in enumerate(layers):
        a = lyr.self_attn
        for name in ("W_Q", "W_K", "W_V", "W_O"):
            assert torch.equal(getattr(a, name).bias, torch.zeros(dim)), (i, name)
        for name in ("W_Q", "W_K", "W_V"):
            assert uniform_like(getattr(a, name).weight, xavier), (i, name)
        for name, lin in (("W_O", a.W_O), ("ffn[0]", lyr.ffn[0]), ("ffn[3]", lyr.ffn[3])):
            assert uniform_like(lin.weight, 1 / math.sqrt(lin.in_features)), (i, name)
        for name, lin in (("ffn[0]", lyr.ffn[0]), ("ffn[3]", lyr.ffn[3])):
            assert (lin.bias != 0).all() and uniform_like(lin.bias, 1 / math.sqrt(lin.in_features), 0.2), (i, name)
    draws = [random_draws(lyr) for lyr in layers]
    assert set(draws[0]) == {"self_attn.in_proj_weight", "self_attn.out_proj.weight"} | {
        "ffn.0.weight", "ffn.0.bias", "ffn.3.weight", "ffn.3.bias"}
    for i in range(len(layers)):
        assert set(draws[i]) == set(draws[0]), i
        for j in range(i):
            for name, p in draws[i].items():
                assert not torch.equal(p, draws[j][name]), (j, i, name)


# ---------------------------------------------------------------- dropout


def test_layer_train_mode_drops():
    ours, _ = layer_pair("from_official", "gelu", False, dropout=0.2)
    x = torch.randn(B, L, E)
    ref = ours.eval()(x)
    ours.train()
    torch.manual_seed(1)
    a = ours(x)
    torch.manual_seed(1)
    b = ours(x)
    assert (a - ref).abs().max().item() > 1e-2
    assert torch.equal(a, b)


def record_dropout(monkeypatch):
    """Count every F.dropout call (nn.Dropout goes through it) and every SDPA dropout_p."""
    calls, sdpa_p = [], []
    drop, sdpa = F.dropout, F.scaled_dot_product_attention

    def counting_dropout(input, p=0.5, training=True, inplace=False):
        if training and p > 0:
            calls.append((tuple(input.shape), p))
        return drop(input, p, training, inplace)

    def counting_sdpa(*args, **kw):
        sdpa_p.append(kw.get("dropout_p", args[4] if len(args) > 4 else 0.0))
        return sdpa(*args, **kw)

    monkeypatch.setattr(F, "dropout", counting_dropout)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_sdpa)
    return calls, sdpa_p


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_each_sublayer_output_is_dropped_exactly_once(norm_first, monkeypatch):
    """The article dropped the attention output twice (after W_O inside MHA, then on the residual) and
    the FFN output twice (last Dropout of `ffn`, then on the residual). Ours, like PyTorch's, once each."""
    p = 0.2
    ours, off = layer_pair("from_official", "relu", norm_first, dropout=p)
    ours.train()
    off.train()
    x = torch.randn(B, L, E)
    calls, sdpa_p = record_dropout(monkeypatch)
    ours(x)
    ours_calls, ours_sdpa = list(calls), list(sdpa_p)
    calls.clear()
    sdpa_p.clear()
    off(x)
    # attention weights: inside SDPA; then dropout1 (B, L, E), FFN hidden (B, L, FF), dropout2 (B, L, E)
    expected = [((B, L, E), p), ((B, L, FF), p), ((B, L, E), p)]
    assert ours_calls == expected and ours_sdpa == [p]
    assert calls == expected and sdpa_p == [p]  # nn.TransformerEncoderLayer does the same
    calls.clear()
    ours.eval()
    ours(x)
    assert calls == []


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_train_mode_with_dropout_equals_official(activation, norm_first, monkeypatch):
    """Same dropout masks => same numbers. F.dropout is replaced by a deterministic mask that depends only
    on the element's logical index (official's residual dropout sees a transposed memory layout, so torch's
    RNG would draw different masks for the same seed); the attention dropout inside SDPA keeps torch's RNG,
    seeded identically. Outputs and all gradients then match official in train mode with p = 0.25."""
    p = 0.25

    def fixed_dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return input
        idx = torch.arange(input.numel()).view(input.shape)
        keep = ((idx * 2654435761) % 1000) >= p * 1000  # ~75% kept, fixed pattern
        return input * keep.to(input.dtype) / (1 - p)

    monkeypatch.setattr(F, "dropout", fixed_dropout)
    ours, off = layer_pair("from_official", activation, norm_first, dropout=p)
    ours.train()
    off.train()
    causal, _, kpm = make_masks("causal_padding")
    x0 = torch.randn(B, L, E)
    g_out = torch.randn(B, L, E)
    x, xo = x0.clone().requires_grad_(True), x0.clone().requires_grad_(True)
    torch.manual_seed(11)
    out = ours(x, src_mask=causal, src_key_padding_mask=kpm)
    torch.manual_seed(11)
    out_o = off(xo, src_mask=causal, src_key_padding_mask=kpm)
    out.backward(g_out)
    out_o.backward(g_out)
    close(out, out_o, what="train-mode output")
    close(x.grad, xo.grad, what="input grad")
    assert_param_grads_equal(ours, off)
    with torch.no_grad():
        assert (out - ours.eval()(x0, src_mask=causal, src_key_padding_mask=kpm)).abs().max().item() > 1e-2


# ---------------------------------------------------------------- bad inputs


def test_bad_activation_is_refused_everywhere():
    with pytest.raises(
        ValueError, match=r"activation 'tanh' is not supported; choose one of \['gelu', 'relu'\]"
    ):
        TransformerEncoderLayer(E, H, FF, activation="tanh")
    with pytest.raises(ValueError, match=r"activation 'tanh' is not supported"):
        OfficialEncoder(1, E, H, FF, activation="tanh")


def test_embed_dim_not_divisible_is_refused_everywhere():
    with pytest.raises(ValueError, match=r"num_heads=4 does not divide embed_dim=18 \(dim per head would be 4.50\)"):
        TransformerEncoderLayer(18, 4, FF)
    with pytest.raises(ValueError, match=r"num_heads=4 does not divide embed_dim=18 \(dim per head would be 4.50\)"):
        TransformerEncoder(num_layers=2, embed_dim=18, num_heads=4, ff_dim=FF)
    with pytest.raises(ValueError, match=r"num_heads=4 does not divide embed_dim=18 \(dim per head would be 4.50\)"):
        OfficialEncoder(2, 18, 4, FF)


def test_zero_layers_is_refused_in_both_forms():
    with pytest.raises(ValueError, match=r"num_layers must be an integer >= 1, got 0"):
        TransformerEncoder(num_layers=0, embed_dim=E, num_heads=H)
    with pytest.raises(ValueError, match=r"num_layers must be an integer >= 1, got 0"):
        TransformerEncoder(TransformerEncoderLayer(E, H), 0)


def test_layer_mask_errors_reach_the_user():
    layer = TransformerEncoderLayer(E, H, FF, batch_first=True)
    x = torch.randn(B, L, E)
    with pytest.raises(
        ValueError, match=rf"attn_mask has shape \({L}, {L + 1}\).*Expected one of \({L}, {L}\)"
    ):
        layer(x, src_mask=torch.zeros(L, L + 1, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"key_padding_mask has dtype torch\.int64"):
        layer(x, src_key_padding_mask=torch.zeros(B, L, dtype=torch.int64))
