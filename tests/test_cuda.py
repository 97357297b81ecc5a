"""Our attention and encoder on CUDA in bf16 / fp16, against nn.MultiheadAttention / nn.TransformerEncoder.

Skipped without a GPU; `make gpu-check` runs them on the lent one (pytest -m cuda).

Reference and tolerances: both modules hold the same weights (from_official) and run the same inputs under
torch.autocast(dtype). Each is also compared with the float32 result of the official module on the same
GPU (TF32 off), the exact answer up to ~1e-6. Two checks per tensor:
  * ours vs official, max abs difference <= TOL[dtype] x the reference's largest magnitude (at least 1:
    outputs are O(1), parameter gradients sum over tokens and are O(10)); bf16 keeps 8
    significant bits (unit roundoff 2^-9 = 2e-3), fp16 11 (2^-12 = 2.4e-4), and the two modules round at
    different places (our projections are one fused (E, 3E) matmul, SDPA picks its own kernel), over
    ~4 rounding steps of a layer: bf16 5e-2, fp16 1e-2 (about 25x and 40x the roundoff, still far below
    any real bug: a wrong head split or scale moves outputs by O(1)).
  * ours is no less accurate: max |ours - fp32| <= 2 * max |official - fp32| + TOL / 10.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from mhalab.nn.attention import MultiHeadAttention
from mhalab.nn.encoder import TransformerEncoder

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"bf16": 5e-2, "fp16": 1e-2}
E, H, B, L, F = 64, 4, 3, 40, 128
DEV = "cuda"


@pytest.fixture(autouse=True)
def no_tf32():
    """The float32 reference must be float32: TF32 matmuls would round it to 10 bits."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def padding(lengths=(L, L - 13, 7)) -> torch.Tensor:
    """(B, L) bool, True at padded positions."""
    return torch.arange(L, device=DEV)[None, :] >= torch.tensor(lengths, device=DEV)[:, None]


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, E, generator=g).to(DEV), torch.randn(B, L, E, generator=g).to(DEV)


def run(module, call, x, g_out, dtype):
    """(output, input grad, {param name: grad}) of call(module, x) under autocast(dtype) (None: float32)."""
    x = x.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
        out = call(module, x)
    (out.float() * g_out).sum().backward()
    return out.float(), x.grad.float(), {n: p.grad.float() for n, p in module.named_parameters()}


def official_names(grads: dict) -> dict:
    """Our parameter names -> official ones: W_Q, W_K, W_V stacked into in_proj, W_O -> out_proj, ffn.0 / ffn.3
    -> linear1 / linear2 (for a bare attention module and for the attention inside encoder layers)."""
    out, qkv = {}, {}
    for name, g in grads.items():
        m = re.fullmatch(r"(.*?)W_([QKV])\.(weight|bias)", name)
        if m:
            qkv.setdefault((m[1], m[3]), {})[m[2]] = g
        else:
            out[name.replace("W_O.", "out_proj.").replace("ffn.0.", "linear1.").replace("ffn.3.", "linear2.")] = g
    for (prefix, kind), d in qkv.items():
        out[f"{prefix}in_proj_{kind}"] = torch.cat([d["Q"], d["K"], d["V"]])
    return out


def check(ours, off, ref, tol, what):
    """Differences relative to the reference's largest magnitude (at least 1): a parameter gradient sums
    over B * L tokens and is O(10), where one bf16 step is already 0.06."""
    tol = tol * max(1.0, ref.abs().max().item())
    diff = (ours - off).abs().max().item()
    assert diff <= tol, f"{what}: ours vs official {diff:.3g} > {tol:.3g}"
    err_ours, err_off = (ours - ref).abs().max().item(), (off - ref).abs().max().item()
    assert err_ours <= 2 * err_off + tol / 10, f"{what}: ours off fp32 by {err_ours:.3g}, official by {err_off:.3g}"


def compare(ours_m, off_m, call_ours, call_off, dtype_name, real):
    """Outputs, input and parameter gradients of ours vs official, at the real (non-pad) positions."""
    x, g_out = inputs()
    g_out = g_out * real[..., None]  # pads carry no gradient (official gives them garbage, ours 0)
    ref = run(copy.deepcopy(off_m), call_off, x, g_out, None)
    a = run(ours_m, call_ours, x, g_out, DTYPES[dtype_name])
    b = run(off_m, call_off, x, g_out, DTYPES[dtype_name])
    tol = TOL[dtype_name]
    check(a[0][real], b[0][real], ref[0][real], tol, "output")
    check(a[1][real], b[1][real], ref[1][real], tol, "input gradient")
    ours_g = official_names(a[2])
    assert ours_g.keys() == b[2].keys()
    for name, gb in b[2].items():
        check(ours_g[name], gb, ref[2][name], tol, f"gradient of {name}")


def mha_pair():
    torch.manual_seed(0)
    off = nn.MultiheadAttention(E, H, batch_first=True).to(DEV)
    with torch.no_grad():
        off.in_proj_bias.normal_(0, 0.1)  # zero biases would hide bias bugs
        off.out_proj.bias.normal_(0, 0.1)
    return MultiHeadAttention.from_official(off), off


def stack_pair(layers=2):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, F, dropout=0.0, activation="gelu", batch_first=True)
    off = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    for lyr in off.layers[1:]:  # deep copies of one layer: give each its own weights
        lyr.self_attn._reset_parameters()
        for m in (lyr.linear1, lyr.linear2):
            m.reset_parameters()
    off = off.to(DEV)
    return TransformerEncoder.from_official(off).to(DEV), off


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_fused_attention_outputs_and_gradients_match_official(dtype_name):
    ours, off = mha_pair()
    kpm = padding()
    compare(ours, off,
            lambda m, x: m(x, key_padding_mask=kpm, need_weights=False)[0],
            lambda m, x: m(x, x, x, key_padding_mask=kpm, need_weights=False)[0], dtype_name, ~kpm)


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_weights_path_attention_and_per_head_weights_match_official(dtype_name):
    """need_weights=True: the explicit (B, H, L, L) path, its per-head weights too."""
    ours, off = mha_pair()
    kpm = padding()
    compare(ours, off,
            lambda m, x: m(x, key_padding_mask=kpm, need_weights=True)[0],
            lambda m, x: m(x, x, x, key_padding_mask=kpm, need_weights=True)[0], dtype_name, ~kpm)
    x, _ = inputs()
    with torch.no_grad(), torch.autocast("cuda", dtype=DTYPES[dtype_name]):
        w_ours = ours(x, key_padding_mask=kpm, need_weights=True)[1].float()
        w_off = off(x, x, x, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)[1].float()
    assert w_ours.shape == (B, H, L, L)
    assert (w_ours - w_off).abs().max().item() <= TOL[dtype_name] / 5  # weights lie in [0, 1]


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_encoder_stack_training_step_matches_official(dtype_name):
    """Our stack as it ships (unpadded tokens, fused attention) vs nn.TransformerEncoder, train mode."""
    ours, off = stack_pair()
    kpm = padding()
    call = lambda m, x: m(x, src_key_padding_mask=kpm)
    compare(ours.train(), off.train(), call, call, dtype_name, ~kpm)


def test_encoder_inference_in_bf16_weights_matches_official_fast_path():
    """Eval under inference_mode with bf16 weights (no autocast, which turns PyTorch's fast path off):
    official takes its nested-tensor fast path; ours, its unpadded one. Reference: float32 official."""
    ours, off = stack_pair()
    off_nested = nn.TransformerEncoder(copy.deepcopy(off.layers[0]), 2, enable_nested_tensor=True).to(DEV)
    off_nested.layers = copy.deepcopy(off.layers)
    kpm = padding()
    x, _ = inputs()
    with torch.inference_mode():
        ref = off.eval()(x, src_key_padding_mask=kpm)
        a = ours.eval().to(torch.bfloat16)(x.bfloat16(), src_key_padding_mask=kpm).float()
        b = off_nested.eval().to(torch.bfloat16)(x.bfloat16(), src_key_padding_mask=kpm).float()
    real = ~kpm
    check(a[real], b[real], ref[real], TOL["bf16"], "inference output")
    assert torch.all(a[kpm] == 0), "ours returns 0 at padded positions"


@pytest.mark.parametrize("need_weights", [False, True], ids=["fused", "weights"])
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_fully_masked_rows_give_zero_and_finite_gradients(dtype_name, need_weights):
    """A sequence with every key padded: its attention output is 0 (so the MHA output is W_O's bias) and
    every gradient is finite, where official gives NaN."""
    ours, _ = mha_pair()
    kpm = padding((L, 0, 9))  # the second sequence has no visible key at all
    x, g_out = inputs()
    x.requires_grad_(True)
    with torch.autocast("cuda", dtype=DTYPES[dtype_name]):
        out = ours(x, key_padding_mask=kpm, need_weights=need_weights)[0]
    bias = ours.W_O.bias.detach().to(out.dtype)
    assert torch.equal(out[1], bias.expand(L, E))
    (out.float() * g_out).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters())
    assert torch.all(x.grad[1] == 0), "no gradient reaches a sequence that nothing attends to"


def test_fused_path_runs_flash_or_efficient_kernel():
    """With SDPA restricted to the flash / memory-efficient kernels (no math fallback), our fused attention
    and stack still run forward and backward: they do not need the (B, H, L, L) matrix."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mha, _ = mha_pair()
    stack, _ = stack_pair()
    x, _ = inputs()
    x.requires_grad_(True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]), \
            torch.autocast("cuda", dtype=torch.bfloat16):
        out = mha(x, need_weights=False)[0] + mha(x, key_padding_mask=padding(), need_weights=False)[0]
        out = out + stack(x, src_key_padding_mask=padding())
        out.float().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
