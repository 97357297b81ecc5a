"""nn.MultiheadAttention's whole contract, and nn.TransformerEncoderLayer's / nn.TransformerEncoder's, met by ours.

Each case builds PyTorch's module as its users do and calls it as they do (PyTorch's defaults: sequence-first,
weights averaged over heads); ours is `from_official(theirs)` and gets the very same call. Outputs, weights, input
gradients and every parameter gradient (under PyTorch's names, mhalab.nn.official_names) must agree to 1e-5 in
float32, in train mode (dropout included: same seed, same draws) and in eval mode, and `to_official()` must give
back PyTorch's state dict exactly. `python tests/test_contract.py` prints each case's largest difference.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from conftest import close
from torch import nn

from mhalab import MultiHeadAttention, TransformerEncoder, TransformerEncoderLayer
from mhalab.nn import official_names

ONE_THREAD = True  # tiny tensors: see conftest.one_thread

E, H, B, L, S = 16, 4, 3, 5, 7
TOL = 1e-5
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning",
                                        "ignore:The PyTorch API of nested tensors:UserWarning",
                                        "ignore:enable_nested_tensor is True:UserWarning")


@dataclass
class Case:
    """One way of building (`build`: nn.MultiheadAttention's arguments) and calling (`call`) the module.
    `cross`: key / value of other lengths and widths than query; `unbatched`: (L, E) inputs."""

    name: str
    build: dict = field(default_factory=dict)
    call: dict = field(default_factory=dict)
    cross: bool = False
    unbatched: bool = False


def kpm(kind: str = "bool", n: int = S, batch: int = B) -> torch.Tensor:
    """A key-padding mask that pads some keys of some rows, never all of a row."""
    m = torch.zeros(batch, n, dtype=torch.bool)
    m[-1, n - 2:] = True
    m[0, 1] = True
    return m if kind == "bool" else torch.zeros(batch, n).masked_fill(m, float("-inf")) + 0.1 * (~m)


CAUSAL = torch.ones(L, L, dtype=torch.bool).triu(1)
CASES = [
    Case("default call: sequence-first, weights averaged"),
    Case("batch_first", {"batch_first": True}),
    Case("need_weights=False", call={"need_weights": False}),
    Case("average_attn_weights=False", call={"average_attn_weights": False}),
    Case("bias=False", {"bias": False}),
    Case("kdim, vdim", {"kdim": 6, "vdim": 10}, cross=True),
    Case("add_bias_kv", {"add_bias_kv": True}, {"key_padding_mask": kpm(n=L)}),
    Case("add_zero_attn", {"add_zero_attn": True}, {"attn_mask": CAUSAL}),
    Case("add_bias_kv + add_zero_attn, kdim/vdim, cross", {"add_bias_kv": True, "add_zero_attn": True, "kdim": 6,
                                                           "vdim": 10}, {"key_padding_mask": kpm()}, cross=True),
    Case("key_padding_mask bool, cross", call={"key_padding_mask": kpm()}, cross=True),
    Case("key_padding_mask float", call={"key_padding_mask": kpm("float", n=L)}),
    Case("attn_mask 2-D bool + is_causal", call={"attn_mask": CAUSAL, "is_causal": True}),
    Case("is_causal, need_weights=False (PyTorch's SDPA causal path)",
         call={"attn_mask": CAUSAL, "is_causal": True, "need_weights": False}),
    Case("attn_mask 3-D float (batch x heads)", call={"attn_mask": torch.randn(B * H, L, L)}),
    Case("attn_mask 2-D float + key_padding_mask bool",
         call={"attn_mask": torch.randn(L, L), "key_padding_mask": kpm(n=L)}),
    Case("unbatched (L, E)", call={"key_padding_mask": kpm(n=L, batch=1)[0]}, unbatched=True),
    Case("unbatched, 3-D (heads, L, S) mask, cross", call={"attn_mask": torch.randn(H, L, S)},
         cross=True, unbatched=True),
    Case("dropout 0.3 (train: the same draws)", {"dropout": 0.3}, {"key_padding_mask": kpm(n=L)}),
    Case("dropout 0.3, need_weights=False", {"dropout": 0.3}, {"need_weights": False}),
]


def perturb(mod: nn.Module, seed: int = 7) -> nn.Module:
    """Move every parameter off its init (zero biases) so no gradient is trivially equal."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p) * 0.1)
    return mod


def inputs(case: Case, mha: nn.MultiheadAttention) -> tuple[torch.Tensor, ...]:
    """query, key, value in the module's layout; key = value = query for self-attention."""
    g = torch.Generator().manual_seed(1)
    Lk = S if case.cross else L

    def shaped(n, width):
        if case.unbatched:
            return torch.randn(n, width, generator=g)
        return torch.randn(B, n, width, generator=g) if mha.batch_first else torch.randn(n, B, width, generator=g)

    q = shaped(L, E)
    if not case.cross:
        return (q,)
    return q, shaped(Lk, mha.kdim), shaped(Lk, mha.vdim)


def run(mha: nn.Module, xs: tuple[torch.Tensor, ...], call: dict, train: bool):
    """(output, weights, input grads, {PyTorch's parameter name: grad}) of one call and backward."""
    mha.train(train)
    mha.zero_grad()
    leaves = [x.clone().requires_grad_() for x in xs]
    q, k, v = leaves if len(leaves) == 3 else leaves * 3
    torch.manual_seed(3)
    out, w = mha(q, k, v, **call)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    grads = {name: torch.cat([p.grad for p in ps]) for name, ps in official_names(mha).items()}
    return out.detach(), w, [x.grad for x in leaves], grads


def largest_differences(case: Case) -> dict[str, float]:
    """Per mode, the largest |difference| between PyTorch's module and ours over output, weights and gradients;
    asserts shapes and presence on the way (a missing tensor is a failure, not a zero)."""
    torch.manual_seed(0)
    theirs = perturb(nn.MultiheadAttention(E, H, **case.build))
    ours = MultiHeadAttention.from_official(theirs)
    assert isinstance(ours, nn.MultiheadAttention) and ours.batch_first == theirs.batch_first
    xs = inputs(case, theirs)
    diffs = {}
    for train in (True, False):
        a, b = run(theirs, xs, case.call, train), run(ours, xs, case.call, train)
        assert a[0].shape == b[0].shape and (a[1] is None) == (b[1] is None)
        assert a[3].keys() == b[3].keys()
        pairs = [(a[0], b[0]), *zip(a[2], b[2]), *((a[3][n], b[3][n]) for n in a[3])]
        if a[1] is not None:
            assert a[1].shape == b[1].shape
            pairs.append((a[1], b[1]))
        for x, y in pairs:
            close(y, x, TOL, f"{case.name} ({'train' if train else 'eval'})")
        diffs["train" if train else "eval"] = max((x - y).abs().max().item() for x, y in pairs)
    return diffs


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_ours_equals_official_for_every_way_of_building_and_calling(case):
    diffs = largest_differences(case)
    assert set(diffs) == {"train", "eval"}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_to_official_gives_back_the_same_module(case):
    torch.manual_seed(0)
    theirs = perturb(nn.MultiheadAttention(E, H, **case.build)).eval()
    back = MultiHeadAttention.from_official(theirs).to_official()
    assert type(back) is nn.MultiheadAttention and not back.training
    for attr in ("embed_dim", "num_heads", "dropout", "batch_first", "kdim", "vdim", "add_zero_attn",
                 "_qkv_same_embed_dim"):
        assert getattr(back, attr) == getattr(theirs, attr), attr
    sd, sd2 = theirs.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)


def test_default_call_averages_like_pytorch_and_the_article_way_gives_heads():
    theirs = nn.MultiheadAttention(E, H)
    x = torch.randn(L, B, E)
    _, w_theirs = theirs(x, x, x)
    _, w_ours = MultiHeadAttention.from_official(theirs)(x, x, x)
    assert w_theirs.shape == w_ours.shape == (B, L, L)
    article = MultiHeadAttention(E, H)  # the article's: batch-first, weights per head
    assert article.batch_first and not article.average_attn_weights
    assert article(x.transpose(0, 1))[1].shape == (B, H, L, L)


def test_from_official_keeps_the_sequence_first_layout():
    """The silent case of before: a sequence-first module converted to a batch-first one gave wrong numbers."""
    theirs = perturb(nn.MultiheadAttention(E, H))  # batch_first=False, PyTorch's default
    ours = MultiHeadAttention.from_official(theirs)
    x = torch.randn(L, B, E)
    close(ours(x, x, x)[0], theirs(x, x, x)[0], TOL, "sequence-first output")
    flipped = copy.deepcopy(ours)
    flipped.batch_first = True  # what from_official used to return: right shape, other numbers
    assert (flipped(x, x, x)[0] - theirs(x, x, x)[0]).abs().max().item() > 0.1


def test_from_official_keeps_eval_mode_dtype_and_frozen_weights():
    theirs = nn.MultiheadAttention(E, H, kdim=6, vdim=6, dtype=torch.float64).eval()
    theirs.q_proj_weight.requires_grad_(False)
    ours = MultiHeadAttention.from_official(theirs)
    assert not ours.training and ours.W_Q.weight.dtype == torch.float64
    assert not ours.W_Q.weight.requires_grad and ours.W_K.weight.requires_grad
    assert not ours.to_official().q_proj_weight.requires_grad


def test_pytorch_names_are_the_parameters_and_the_articles_are_views_of_them():
    ours = perturb(MultiHeadAttention(E, H))
    theirs = nn.MultiheadAttention(E, H)
    assert list(ours.state_dict()) == list(theirs.state_dict())  # in_proj_weight, in_proj_bias, out_proj.*
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    for i, lin in enumerate((ours.W_Q, ours.W_K, ours.W_V)):  # rows of in_proj_weight, sharing its memory
        assert isinstance(lin, nn.Linear) and lin.weight._base is ours.in_proj_weight
        assert lin.weight.data_ptr() == ours.in_proj_weight[i * E].data_ptr()
        assert torch.equal(lin.bias, ours.in_proj_bias[i * E:(i + 1) * E])
    assert ours.out_proj is ours.W_O and ours.q_proj_weight is None
    assert ours._qkv_same_embed_dim and ours.dropout == 0.0
    sep = MultiHeadAttention(E, H, kdim=6, vdim=10)
    assert not sep._qkv_same_embed_dim and sep.in_proj_weight is None and sep.k_proj_weight.shape == (E, 6)
    assert sep.W_K.weight is sep.k_proj_weight and sep.W_K.in_features == 6
    assert list(sep.state_dict()) == list(nn.MultiheadAttention(E, H, kdim=6, vdim=10).state_dict())


def test_a_tensor_as_the_fifth_argument_is_refused():
    """The article's forward took attn_mask 5th; PyTorch's (ours now) takes need_weights there."""
    mha = MultiHeadAttention(E, H)
    x = torch.randn(B, L, E)
    with pytest.raises(TypeError, match=r"need_weights got a tensor: the 5th argument is need_weights.*by keyword"):
        mha(x, x, x, None, CAUSAL)


def test_extras_refuse_a_variant_in_one_line():
    from mhalab.nn import RotaryEmbedding
    with pytest.raises(ValueError, match=r"add_bias_kv=True appends a key with no position, which rotary"):
        MultiHeadAttention(E, H, add_bias_kv=True, rotary=RotaryEmbedding(E // H, 16))


# ---------------------------------------------------------------- the encoder layer and stack

LAYER_CASES = {
    "defaults (relu, sequence-first)": {},
    "gelu, batch_first": {"activation": "gelu", "batch_first": True},
    "callable activation (F.silu)": {"activation": F.silu},
    "module activation (tanh GELU)": {"activation": nn.GELU(approximate="tanh"), "batch_first": True},
    "bias=False": {"bias": False},
    "norm_first, layer_norm_eps": {"norm_first": True, "layer_norm_eps": 1e-6},
    "dropout 0.2 (train: the same draws)": {"dropout": 0.2, "batch_first": True},
}


def layer_run(layer: nn.Module, x: torch.Tensor, train: bool, **call):
    layer.train(train)
    layer.zero_grad()
    x = x.clone().requires_grad_()
    torch.manual_seed(3)
    out = layer(x, **call)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    grads = {n: torch.cat([p.grad for p in ps]) for n, ps in official_names(layer).items()}
    return out.detach(), x.grad, grads


def _to_official_names(ours_grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our layer's parameter names -> nn.TransformerEncoderLayer's (ffn.0 is linear1, ffn.3 linear2)."""
    rename = {"ffn.0.": "linear1.", "ffn.3.": "linear2."}
    out = {}
    for name, g in ours_grads.items():
        for a, b in rename.items():
            if a in name:
                name = name.replace(a, b)
        out[name] = g
    return out


@pytest.mark.parametrize("kwargs", LAYER_CASES.values(), ids=LAYER_CASES.keys())
def test_layer_from_official_equals_pytorch_for_every_configuration(kwargs):
    torch.manual_seed(0)
    theirs = perturb(nn.TransformerEncoderLayer(E, H, 32, **{"dropout": 0.0, **kwargs}))
    ours = TransformerEncoderLayer.from_official(theirs)
    assert ours.batch_first == theirs.self_attn.batch_first
    x = torch.randn(B, L, E) if ours.batch_first else torch.randn(L, B, E)
    mask = {"src_key_padding_mask": kpm(n=L)}
    for train in (True, False):
        (a, ga, pa), (b, gb, pb) = layer_run(theirs, x, train, **mask), layer_run(ours, x, train, **mask)
        close(b, a, TOL, "output")
        close(gb, ga, TOL, "input grad")
        pb = _to_official_names(pb)
        assert pa.keys() == pb.keys()
        for n in pa:
            close(pb[n], pa[n], TOL, n)
    theirs.eval()
    slow = theirs(x, **mask).detach()  # grad enabled: PyTorch's layer calls its modules
    with torch.no_grad():  # PyTorch's fused inference path where it applies
        fused, inference = theirs(x, **mask), ours.eval()(x, **mask)
    close(inference, slow, TOL, "inference")
    if not isinstance(theirs.activation, nn.GELU):  # see the next test
        close(inference, fused, TOL, "inference vs PyTorch's fused path")
    back = ours.to_official()
    sd, sd2 = theirs.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)


def test_pytorchs_fused_layer_computes_exact_gelu_for_a_tanh_gelu_module():
    """Found here: nn.TransformerEncoderLayer's fused inference path takes any nn.GELU module for the exact GELU,
    so with activation=nn.GELU(approximate="tanh") its no_grad output is not its own. Ours computes the module."""
    torch.manual_seed(0)
    theirs = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, activation=nn.GELU(approximate="tanh"),
                                        batch_first=True).eval()
    ours = TransformerEncoderLayer.from_official(theirs)
    x = torch.randn(B, L, E) * 3
    slow = theirs(x).detach()
    with torch.no_grad():
        assert (theirs(x) - slow).abs().max().item() > 1e-5
        close(ours(x), slow, TOL, "ours vs PyTorch's unfused layer")


def test_layer_takes_pytorchs_positional_arguments():
    args = (E, H, 32, 0.0, "gelu", 1e-6, False, True, False)  # ..., layer_norm_eps, batch_first, norm_first, bias
    ours, theirs = TransformerEncoderLayer(*args), nn.TransformerEncoderLayer(*args)
    assert (ours.batch_first, ours.norm_first, ours.norm1.eps, ours.ffn[0].bias) == (False, True, 1e-6, None)
    assert ours.to_official().state_dict().keys() == theirs.state_dict().keys()
    with pytest.raises(ValueError, match=r"layer_norm_eps=True must be a number > 0 \(the 6th argument"):
        TransformerEncoderLayer(E, H, 32, 0.0, "gelu", True)  # the old order put norm_first 6th


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
def test_stack_from_official_with_norm_and_is_causal_equals_pytorch(norm_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, norm_first=norm_first)  # sequence-first
    theirs = perturb(nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(E, eps=1e-6), enable_nested_tensor=False,
                                           mask_check=False))
    ours = TransformerEncoder.from_official(theirs)
    assert (ours.norm.eps, ours.enable_nested_tensor, ours.mask_check) == (1e-6, False, False)
    x, pad = torch.randn(L, B, E), kpm(n=L)
    for train in (True, False):
        theirs.train(train)
        ours.train(train)
        ref = theirs(x, mask=CAUSAL, src_key_padding_mask=pad, is_causal=True)
        out = ours(x, mask=CAUSAL, src_key_padding_mask=pad, is_causal=True)
        close(out, ref, TOL, "every position, pads included (PyTorch computes them here, and so does ours)")
        with pytest.raises(RuntimeError, match=r"is_causal=True needs attn_mask"):  # as PyTorch's raises
            ours(x, src_key_padding_mask=pad, is_causal=True)
    back = ours.to_official()
    assert back.state_dict().keys() == theirs.state_dict().keys()
    assert (back.enable_nested_tensor, back.mask_check) == (False, False)


if __name__ == "__main__":  # the closing note's table: each case's largest difference, train and eval
    torch.set_num_threads(1)
    print("| case | train | eval |\n|---|---|---|")
    for c in CASES:
        d = largest_differences(c)
        print(f"| {c.name} | {d['train']:.1e} | {d['eval']:.1e} |")
