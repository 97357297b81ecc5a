"""Our TransformerEncoderLayer / TransformerEncoder where code written for PyTorch's builds and calls them: PyTorch's
call forms and defaults, PyTorch's numbers at every position (padded ones included), is_causal as PyTorch treats
it, torch.jit.script and torch.export. What PyTorch's own test/test_transformers.py (class TestTransformers) checks
of these modules, in our words, each against PyTorch's module given the same weights.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import close
from torch import nn

from mhalab import MultiHeadAttention, TransformerEncoder, TransformerEncoderLayer, swap_attention
from mhalab.nn import RotaryEmbedding
from mhalab.nn.encoder import reset_parameters
from mhalab.nn.script import ScriptError

ONE_THREAD = True  # tiny tensors: see conftest.one_thread

E, H, FF, B, L = 16, 4, 32, 3, 7
TOL = 1e-5
PAD = torch.tensor([[False] * 7, [False] * 5 + [True] * 2, [False] * 2 + [True] * 5])  # (B, L) right-padded
CAUSAL = nn.Transformer.generate_square_subsequent_mask(L)  # float, -inf above the diagonal
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning",
                                        "ignore:`torch.jit.script` is deprecated:DeprecationWarning")


def pair(num_layers: int = 2, norm: bool = False, **layer_kwargs) -> tuple[TransformerEncoder, nn.TransformerEncoder]:
    """Ours and PyTorch's stack, built by PyTorch's call form from the same layer (ours converted from theirs)."""
    kw = {"dropout": 0.0, "batch_first": True, **layer_kwargs}
    theirs_layer = nn.TransformerEncoderLayer(E, H, FF, **kw)
    with torch.no_grad():  # off the init (zero biases, unit norms): no coordinate is trivially equal
        for p in theirs_layer.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ours_layer = TransformerEncoderLayer.from_official(theirs_layer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's own nested-tensor warning, checked below
        theirs = nn.TransformerEncoder(theirs_layer, num_layers, nn.LayerNorm(E) if norm else None)
        ours = TransformerEncoder(ours_layer, num_layers, nn.LayerNorm(E) if norm else None)
    return ours, theirs


# ---------------------------------------------------------------- call forms and defaults


def test_pytorchs_positional_form_copies_the_layer_into_every_layer_as_pytorch_does():
    ours, theirs = pair(num_layers=3)
    layer_state = ours.layers[0].state_dict()
    for lyr in ours.layers:
        assert all(torch.equal(v, layer_state[k]) for k, v in lyr.state_dict().items())
    assert len({id(lyr) for lyr in ours.layers}) == 3  # copies, not one module three times
    x = torch.randn(B, L, E)
    close(ours(x), theirs(x), TOL, "TransformerEncoder(layer, 3) vs nn.TransformerEncoder(layer, 3)")


def test_the_articles_keyword_call_keeps_the_articles_layer_batch_first_with_gelu():
    """The article's example, `TransformerEncoderLayer(embed_dim=512, num_heads=8, ff_dim=2048, dropout=0.1)` fed
    (batch, seq_len, embed_dim), at a smaller width: PyTorch's layer built batch-first with GELU, given our weights,
    computes the same numbers; PyTorch's positional form is sequence-first with relu, as PyTorch's is."""
    ours = TransformerEncoderLayer(embed_dim=E, num_heads=H, ff_dim=FF, dropout=0.1).eval()
    assert (ours.batch_first, ours.activation) == (True, "gelu")
    theirs = ours.to_official()
    assert (theirs.self_attn.batch_first, theirs.activation_relu_or_gelu) == (True, 2)  # 2: gelu in PyTorch's code
    x = torch.randn(B, L, E)  # (batch, seq_len, embed_dim), as the article's example
    with torch.no_grad():
        close(ours(x), theirs(x), TOL, "the article's call vs PyTorch's batch-first GELU layer")
    plain = TransformerEncoderLayer(E, H, FF)
    assert (plain.batch_first, plain.activation) == (False, "relu")
    assert TransformerEncoderLayer(embed_dim=E, num_heads=H, batch_first=False).batch_first is False  # given: wins
    with pytest.raises(TypeError, match="give PyTorch's names .* or the article's .*, not both"):
        TransformerEncoderLayer(E, H, embed_dim=E)


def test_the_sizes_form_draws_each_layer_on_its_own():
    torch.manual_seed(0)
    ours = TransformerEncoder(num_layers=3, embed_dim=E, num_heads=H, ff_dim=FF)
    w = [lyr.self_attn.in_proj_weight for lyr in ours.layers]
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[1], w[2])
    assert ours.layers[0].batch_first and ours.layers[0].activation == "gelu"  # the article's defaults


def test_the_layer_takes_pytorchs_names_and_defaults():
    torch.manual_seed(0)
    theirs = nn.TransformerEncoderLayer(d_model=E, nhead=H)
    torch.manual_seed(0)
    ours = TransformerEncoderLayer(d_model=E, nhead=H)
    assert (ours.batch_first, ours.activation, ours.ffn[0].out_features, ours.dropout1.p) == (False, "relu", 2048, 0.1)
    ours.load_state_dict(TransformerEncoderLayer.from_official(theirs).state_dict())
    x = torch.randn(L, B, E)  # sequence-first, PyTorch's default
    close(ours.eval()(x), theirs.eval()(x), TOL, "defaults")


def test_the_article_positional_stack_call_and_a_layout_mismatch_are_refused_in_one_line():
    with pytest.raises(TypeError, match=r"TransformerEncoder\(2, \.\.\.\): the first argument is the layer to copy.*"
                                        r"TransformerEncoder\(num_layers=2, embed_dim=\.\.\., num_heads=\.\.\.\)"):
        TransformerEncoder(2, E, H)
    with pytest.raises(ValueError, match=r"a layer to copy .* or embed_dim= and num_heads= .*one of the two"):
        TransformerEncoder(TransformerEncoderLayer(E, H), 2, embed_dim=E, num_heads=H)
    with pytest.raises(ValueError, match=r"self_attn.batch_first=True but the layer's batch_first=False .*"
                                         r"pass batch_first=True to the layer"):
        TransformerEncoderLayer(E, H, self_attn=MultiHeadAttention(E, H))


# ---------------------------------------------------------------- PyTorch's numbers at every position


@pytest.mark.parametrize("norm", [False, True], ids=["no_norm", "final_norm"])
@pytest.mark.parametrize("mode", ["train", "eval_grad", "eval_no_grad"])
def test_every_position_pads_included_equals_pytorch(mode, norm):
    """train and eval with grad: PyTorch computes every position; eval without grad: its nested tensors leave 0 at
    the pads before the final norm. Ours gives PyTorch's numbers at every position in each case."""
    ours, theirs = pair(norm=norm)
    for m in (ours, theirs):
        m.train(mode == "train")
    x = torch.randn(B, L, E)
    with torch.set_grad_enabled(mode != "eval_no_grad"):
        want, got = theirs(x, src_key_padding_mask=PAD), ours(x, src_key_padding_mask=PAD)
    close(got, want, TOL, f"{mode}, pads included")
    pads = got[PAD]  # (P, E)
    if mode == "eval_no_grad":  # 0 at the pads, or the final norm of 0 (its bias)
        assert torch.equal(pads, ours.norm(torch.zeros_like(pads)) if norm else torch.zeros_like(pads))
    else:
        assert pads.abs().min() > 0  # computed, as PyTorch computes them


def test_pytorchs_nested_tensor_rule_when_it_declines():
    """Cases where nn.TransformerEncoder runs no nested tensors in eval without grad, so it computes the pads:
    not right-padded (mask_check), a src mask given, an odd head count, enable_nested_tensor=False."""
    left = PAD.flip(1)
    cases = {"left padding": ({}, left, None), "src mask": ({}, PAD, torch.zeros(L, L, dtype=torch.bool)),
             "odd heads": ({"nhead": 1}, PAD, None), "nested disabled": ({"nested": False}, PAD, None)}
    x = torch.randn(B, L, E)
    for name, (kw, pad, mask) in cases.items():
        ours, theirs = pair()
        if "nhead" in kw:
            ours, theirs = _odd_heads_pair()
        if kw.get("nested") is False:
            ours.use_nested_tensor = theirs.use_nested_tensor = False
        ours.eval(), theirs.eval()
        with torch.no_grad():
            want, got = theirs(x, mask=mask, src_key_padding_mask=pad), ours(x, mask=mask, src_key_padding_mask=pad)
        keep = ~torch.isnan(want)  # PyTorch: NaN where a query sees no key at all (none here but the odd case)
        close(got[keep], want[keep], TOL, name)
        assert got[pad].abs().min() > 0, name  # the pads computed, not 0


def _odd_heads_pair() -> tuple[TransformerEncoder, nn.TransformerEncoder]:
    theirs_layer = nn.TransformerEncoderLayer(E, 1, FF, dropout=0.0, batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = nn.TransformerEncoder(theirs_layer, 2)
        ours = TransformerEncoder(TransformerEncoderLayer.from_official(theirs_layer), 2)
    return ours, theirs


def test_without_mask_check_left_padding_keeps_each_token_in_place_where_pytorchs_nested_tensor_does_not():
    """mask_check=False, rows padded on the left, eval without grad: PyTorch's nested tensor takes each row's first
    tokens and writes the outputs at the front; ours skips the pads where they are (library.md says so)."""
    ours, theirs = pair()
    ours.mask_check = theirs.mask_check = False
    x, left = torch.randn(B, L, E), PAD.flip(1)
    want = theirs(x, src_key_padding_mask=left)  # training mode: every token where it is
    ours.eval(), theirs.eval()
    with torch.no_grad():
        got, nested = ours(x, src_key_padding_mask=left), theirs(x, src_key_padding_mask=left)
    close(got[~left], want[~left], TOL, "ours, real tokens")
    assert torch.equal(got[left], torch.zeros_like(got[left]))
    assert (nested[~left] - want[~left]).abs().max() > 0.1  # PyTorch's: tokens moved


def test_unpad_true_skips_the_pads_in_training_too_and_leaves_0_there():
    ours, theirs = pair(norm=True)
    ours.unpad = True
    x = torch.randn(B, L, E)
    got, want = ours(x, src_key_padding_mask=PAD), theirs(x, src_key_padding_mask=PAD)
    close(got[~PAD], want[~PAD], TOL, "real tokens")
    assert torch.equal(got[PAD], torch.zeros_like(got[PAD]))


def test_the_nested_tensor_warning_is_pytorchs():
    layer = TransformerEncoderLayer(E, H, FF, bias=False, batch_first=True)
    with pytest.warns(UserWarning, match=r"^enable_nested_tensor is True, but self.use_nested_tensor is False because "
                                         r"encoder_layer.self_attn was passed bias=False$"):
        TransformerEncoder(layer, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # unpad=True (the framework's) or enable_nested_tensor=False: no warning
        TransformerEncoder(layer, 1, unpad=True)
        TransformerEncoder(layer, 1, enable_nested_tensor=False)


def test_batch_equal_to_length_both_masks_and_fully_padded_rows_as_pytorch():
    """(B, L, E) with B == L is not read as the other layout; a src mask with a padding mask gives PyTorch's numbers
    and no warning; a row with every position padded keeps the batch's shape (PyTorch: NaN there, ours 0)."""
    ours, theirs = pair()
    x, mask = torch.randn(L, L, E), torch.rand(L, L) > 0.7
    pad = torch.zeros(L, L, dtype=torch.bool)
    pad[1, 4:], pad[2, :] = True, True  # row 2: all padding
    mask.fill_diagonal_(False)
    for train in (True, False):
        ours.train(train), theirs.train(train)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = ours(x, mask=mask, src_key_padding_mask=pad)
        want = theirs(x, mask=mask, src_key_padding_mask=pad)
        rows = torch.arange(L) != 2
        close(got[rows], want[rows], TOL, f"B == L, both masks, train={train}")
        assert got.shape == (L, L, E) and torch.isfinite(got).all()


def test_a_hook_on_self_attn_sees_every_call_in_inference_too():
    layer = TransformerEncoderLayer(E, H, FF, batch_first=True).eval()
    calls = []
    layer.self_attn.register_forward_hook(lambda m, args, out: calls.append(out[0].shape))
    with torch.inference_mode():
        layer(torch.randn(B, L, E))
    assert calls == [(B, L, E)]  # as PyTorch's (its fused inference path declines when self_attn has hooks)


# ---------------------------------------------------------------- is_causal


def test_is_causal_without_a_mask_raises_pytorchs_runtime_error_at_every_level():
    ours, theirs = pair()
    x = torch.randn(B, L, E)
    for name, module, call in (("stack", ours, lambda m: m(x, is_causal=True)),
                               ("layer", ours.layers[0], lambda m: m(x, is_causal=True)),
                               ("attention", ours.layers[0].self_attn, lambda m: m(x, x, x, is_causal=True))):
        with pytest.raises(RuntimeError, match=r"is_causal=True needs attn_mask"):
            call(module)
    with pytest.raises(RuntimeError):  # PyTorch's too
        theirs(x, is_causal=True)


def test_the_stack_detects_a_causal_mask_and_passes_is_causal_to_every_layer():
    ours, theirs = pair()
    seen = []
    for lyr in ours.layers:
        lyr.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs.get("is_causal")), with_kwargs=True)
    x = torch.randn(B, L, E)
    close(ours(x, mask=CAUSAL), theirs(x, mask=CAUSAL), TOL, "causal mask")
    close(ours(x, mask=CAUSAL.isinf()), theirs(x, mask=CAUSAL.isinf()), TOL, "the same mask as bool")
    ours(x, mask=torch.zeros(L, L))  # not causal
    ours(x, mask=CAUSAL, is_causal=False)  # the caller's hint wins, as in PyTorch
    assert seen == [True, True, True, True, False, False, False, False]
    layer = ours.layers[0]
    close(layer(x, src_mask=CAUSAL, is_causal=True), layer(x, src_mask=CAUSAL), 0.0, "the hint changes nothing")


def test_where_pytorch_trusts_is_causal_over_the_mask_ours_does_too():
    """nn.MultiheadAttention with is_causal=True, need_weights=False and no key_padding_mask hands SDPA
    is_causal=True and drops attn_mask (here one of the wrong size, as in PyTorch's is_causal test)."""
    theirs = nn.MultiheadAttention(E, H)
    ours = MultiHeadAttention.from_official(theirs)
    x = torch.randn(2, 5, E)  # (L=2, B=5, E), sequence-first
    mask = nn.Transformer.generate_square_subsequent_mask(5)  # (5, 5): not (L, L)
    want = theirs(x, x, x, attn_mask=mask, need_weights=False, is_causal=True)[0]
    close(ours(x, x, x, attn_mask=mask, need_weights=False, is_causal=True)[0], want, TOL, "causal, mask dropped")
    with pytest.raises(ValueError, match=r"attn_mask has shape \(5, 5\)"):  # asking for weights: the mask is used
        ours(x, x, x, attn_mask=mask, is_causal=True)


# ---------------------------------------------------------------- TorchScript and torch.export


class Model(nn.Module):
    """A model written around PyTorch's modules, holding ours in their place."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(E, E)
        self.encoder = TransformerEncoder(TransformerEncoderLayer(E, H, FF, dropout=0.1, batch_first=True), 2)
        self.attn = MultiHeadAttention(E, H, batch_first=True, average_attn_weights=True)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(x), src_key_padding_mask=pad)
        return self.attn(h, h, h, key_padding_mask=pad)[0]


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("what", ["layer", "stack", "attention kdim", "model holding them",
                                  "swapped nn.TransformerEncoder"])
def test_torch_jit_script_gives_the_eager_numbers_dropout_included(what, mode):
    torch.manual_seed(0)
    x, pad = torch.randn(B, L, E), PAD
    if what == "layer":
        model, call = TransformerEncoderLayer(E, H, FF, batch_first=True), lambda m: m(x, src_key_padding_mask=pad)
    elif what == "stack":
        model = TransformerEncoder(TransformerEncoderLayer(E, H, FF, batch_first=True), 2)
        call = lambda m: m(x, mask=CAUSAL.isinf(), src_key_padding_mask=pad)
    elif what == "attention kdim":
        model = MultiHeadAttention(E, H, 0.1, kdim=6, vdim=5, average_attn_weights=True)
        k, v = torch.randn(B, L, 6), torch.randn(B, L, 5)
        call = lambda m: m(x, k, v, key_padding_mask=pad)[0]
    elif what == "model holding them":
        model, call = Model(), lambda m: m(x, pad)
    else:
        model = swap_attention(nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF, batch_first=True), 2))
        call = lambda m: m(x, src_key_padding_mask=pad)
    eager = copy.deepcopy(model).train(mode == "train")  # scripting a model puts PyTorch's modules into it
    scripted = torch.jit.script(model.train(mode == "train"))
    for no_grad in (False, True):
        with torch.set_grad_enabled(not no_grad):
            torch.manual_seed(42)
            want = call(eager)
            torch.manual_seed(42)
            got = call(scripted)
        close(got, want, TOL, f"{what}, {mode}, no_grad={no_grad}")
    if mode == "train":  # dropout was on: another seed gives other numbers (the comparison is not vacuous)
        assert (call(eager) - want).abs().max() > 1e-3


def test_the_script_module_holds_our_parameters():
    layer = TransformerEncoderLayer(E, H, FF, dropout=0.0, batch_first=True)
    scripted = torch.jit.script(layer)
    with torch.no_grad():
        layer.self_attn.in_proj_weight.mul_(2.0)  # a write to ours reaches the script module
    x = torch.randn(B, L, E)
    close(scripted(x), layer(x), TOL, "after a write to ours")
    assert {p.data_ptr() for p in scripted.parameters()} == {p.data_ptr() for p in layer.parameters()}


def test_torch_jit_script_refuses_what_pytorchs_modules_cannot_express_naming_torch_export():
    rope = MultiHeadAttention(E, H, rotary=RotaryEmbedding(E // H, 64), average_attn_weights=True)
    cases = {
        "rotary": TransformerEncoderLayer(E, H, FF, batch_first=True, self_attn=rope),
        "per-head weights": MultiHeadAttention(E, H),  # the article's default, average_attn_weights=False
        "unpad=True": TransformerEncoder(TransformerEncoderLayer(E, H, FF, batch_first=True), 2, unpad=True),
    }
    for module in cases.values():
        with pytest.raises(ScriptError, match=r"^torch.jit.script compiles PyTorch's .* or use torch.export.export"):
            torch.jit.script(module)


@pytest.mark.parametrize("what", ["our stack", "swapped nn.TransformerEncoder"])
def test_torch_export_equals_eager(what):
    torch.manual_seed(0)
    if what == "our stack":
        model = TransformerEncoder(TransformerEncoderLayer(E, H, FF, batch_first=True), 2)
        reset_parameters(model.layers[1])
    else:
        model = swap_attention(nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, FF, batch_first=True), 2))
    model.eval()
    x = torch.randn(B, L, E)
    exported = torch.export.export(model, (x,), {"src_key_padding_mask": PAD})
    close(exported.module()(x, src_key_padding_mask=PAD), model(x, src_key_padding_mask=PAD), TOL, what)
