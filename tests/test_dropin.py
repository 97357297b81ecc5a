"""Ours as a drop-in that can be written to: every write through PyTorch's names (in_proj_weight, in_proj_bias,
q/k/v_proj_weight, out_proj.*, bias_k, bias_v) and through the article's (W_Q, W_K, W_V, W_O) reaches the weights the
forward uses; what cannot be honoured is refused in one line; checkpoints cross between a model and its swapped
copy both ways; and state dicts with the article's keys (mhalab before its attention took PyTorch's names,
tests/fixtures/article_keys) still load and compute what they computed. Each write is checked against PyTorch's own
module given the same write: equal outputs afterwards, and different from before (the write was not lost)."""

from __future__ import annotations

import copy
import re
from operator import attrgetter
from pathlib import Path

import pytest
import torch
from torch import nn

from mhalab import MultiHeadAttention, swap_attention
from mhalab.nn import official_state_dict

ONE_THREAD = True  # tiny tensors: see conftest.one_thread
E, H, B, L, S = 16, 4, 3, 5, 7
FIXTURE = Path(__file__).parent / "fixtures" / "article_keys"
CONFIGS = {  # PyTorch's module as its users build it (sequence-first); the inputs it is called with
    "packed": ({"add_bias_kv": True}, lambda g: (torch.randn(L, B, E, generator=g),) * 3),
    "kdim, vdim": ({"kdim": 6, "vdim": 10}, lambda g: (torch.randn(L, B, E, generator=g),
                                                       torch.randn(S, B, 6, generator=g),
                                                       torch.randn(S, B, 10, generator=g))),
}
PYTORCH_NAMES = {"packed": ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias", "bias_k", "bias_v"],
                 "kdim, vdim": ["q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias"]}
ARTICLE_NAMES = ["W_Q.weight", "W_K.weight", "W_V.weight", "W_Q.bias", "W_K.bias", "W_V.bias", "W_O.weight",
                 "W_O.bias"]


def pair(config: str) -> tuple[nn.MultiheadAttention, MultiHeadAttention]:
    """PyTorch's module with every parameter random (zero biases would hide a lost write), and ours from it."""
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(E, H, **CONFIGS[config][0])
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
    return theirs, MultiHeadAttention.from_official(theirs)


def named(m: nn.MultiheadAttention, name: str) -> torch.Tensor:
    """The tensor `name` names on m. On PyTorch's module the article's names resolve to the same rows of its
    parameters that ours views (W_K.weight = in_proj_weight[E:2E], or k_proj_weight; W_O = out_proj)."""
    if isinstance(m, MultiHeadAttention) or not name.startswith("W_"):
        return attrgetter(name)(m)
    lin, leaf = name.split(".")
    if lin == "W_O":
        return getattr(m.out_proj, leaf)
    i = "QKV".index(lin[-1])
    if leaf == "bias":
        return m.in_proj_bias[i * E:(i + 1) * E]
    return m.in_proj_weight[i * E:(i + 1) * E] if m.in_proj_weight is not None else getattr(m, f"{'qkv'[i]}_proj_weight")


def _random(t: torch.Tensor) -> torch.Tensor:
    return torch.randn(t.shape, generator=torch.Generator().manual_seed(7))


def _assign(m: nn.Module, name: str, value) -> None:
    owner, _, leaf = name.rpartition(".")
    owner = "out_proj" if owner == "W_O" and not isinstance(m, MultiHeadAttention) else owner
    setattr(attrgetter(owner)(m) if owner else m, leaf, value)


def _no_grad(fn):
    def write(m, name):
        with torch.no_grad():
            fn(named(m, name))
    return write


def _seeded_init(m, name):
    torch.manual_seed(3)
    nn.init.normal_(named(m, name), 0.0, 0.5)


WRITES = {  # (module, name) -> the write, as user code does it
    "nn.init.normal_": _seeded_init,
    "nn.init.constant_": lambda m, name: nn.init.constant_(named(m, name), 0.7),
    "copy_ (no_grad)": _no_grad(lambda t: t.copy_(_random(t))),
    "mul_ (no_grad)": _no_grad(lambda t: t.mul_(-2.0)),
    ".data =": lambda m, name: setattr(named(m, name), "data", _random(named(m, name))),
    "new nn.Parameter": lambda m, name: _assign(m, name, nn.Parameter(_random(named(m, name)))),
}
IN_PLACE = ["nn.init.normal_", "nn.init.constant_", "copy_ (no_grad)", "mul_ (no_grad)"]
CASES = [(c, n, w) for c in CONFIGS for n in PYTORCH_NAMES[c] for w in WRITES]
CASES += [("packed", n, w) for n in ARTICLE_NAMES for w in (WRITES if n.startswith("W_O") else IN_PLACE)]
CASES += [("kdim, vdim", n, w) for n in ("W_Q.weight", "W_K.weight", "W_V.bias") for w in IN_PLACE]


def _outputs(m: nn.MultiheadAttention, config: str) -> torch.Tensor:
    torch.manual_seed(1)
    return m(*CONFIGS[config][1](torch.Generator().manual_seed(2)))[0].detach()


@pytest.mark.parametrize(("config", "name", "write"), CASES, ids=[" ".join(c) for c in CASES])
def test_a_write_through_any_name_reaches_the_forward_as_in_pytorchs_module(config, name, write):
    theirs, ours = pair(config)
    before = _outputs(ours, config)
    for m in (theirs, ours):
        WRITES[write](m, name)
    after, want = _outputs(ours, config), _outputs(theirs, config)
    assert (after - want).abs().max() < 1e-6  # what PyTorch's module computes after the same write
    assert (after - before).abs().max() > 1e-3  # and the write was not lost


@pytest.mark.parametrize("config", list(CONFIGS))
def test_reset_parameters_ours_and_pytorchs_reinitialise_ours_draw_for_draw(config):
    theirs, ours = pair(config)
    for reset in (MultiHeadAttention._reset_parameters, nn.MultiheadAttention._reset_parameters):
        for m in (theirs, ours):
            torch.manual_seed(4)
            reset(m)
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
        assert list(ours.state_dict()) == list(theirs.state_dict())


def test_the_same_seed_builds_the_weights_pytorchs_module_builds():
    for kwargs in ({}, {"add_bias_kv": True}, {"kdim": 6, "vdim": 10}, {"bias": False}):
        torch.manual_seed(0)
        theirs = nn.MultiheadAttention(E, H, **kwargs)
        torch.manual_seed(0)
        ours = MultiHeadAttention(E, H, **kwargs)
        a, b = ours.state_dict(), theirs.state_dict()
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in b), kwargs


@pytest.mark.parametrize("config", list(CONFIGS))
def test_freezing_through_pytorchs_names_leaves_those_weights_without_gradients(config):
    theirs, ours = pair(config)
    frozen = PYTORCH_NAMES[config][::2]
    for m in (theirs, ours):
        for name in frozen:
            named(m, name).requires_grad_(False)
        _outputs_with_grad = m(*CONFIGS[config][1](torch.Generator().manual_seed(2)))[0]
        _outputs_with_grad.square().sum().backward()
    grads = {n: p.grad for n, p in ours.named_parameters()}
    want = {n: p.grad for n, p in theirs.named_parameters()}
    assert all(grads[n] is None for n in frozen) and all(not named(ours, n).requires_grad for n in frozen)
    assert all((grads[n] - want[n]).abs().max() < 1e-5 for n in want if n not in frozen)


def test_what_a_view_cannot_be_is_refused_in_one_line_naming_the_attribute():
    _, ours = pair("packed")
    with pytest.raises(AttributeError, match=re.escape("W_K.weight is a view of in_proj_weight[16:32]")):
        ours.W_K.weight = nn.Parameter(torch.zeros(E, E))
    with pytest.raises(AttributeError, match=re.escape("W_V.bias is a view of in_proj_bias[32:48]")):
        ours.W_V.bias = None
    with pytest.raises(AttributeError, match=r"W_Q is a view of in_proj_weight\[0:16\]: write into W_Q.weight"):
        ours.W_Q = nn.Linear(E, E)
    with pytest.raises(RuntimeError, match="leaf"):  # PyTorch's own error for a slice: freeze in_proj_weight
        ours.W_Q.weight.requires_grad_(False)
    _, sep = pair("kdim, vdim")
    with pytest.raises(AttributeError, match=r"W_K.weight is a view of k_proj_weight"):
        sep.W_K.weight = nn.Parameter(torch.zeros(E, 6))


def test_w_o_is_out_proj_and_assigning_either_replaces_both():
    _, ours = pair("packed")
    new = nn.Linear(E, E)
    ours.W_O = new
    assert ours.out_proj is new and ours.W_O is new and "W_O.weight" not in ours.state_dict()


def test_an_optimizer_sees_each_weight_once():
    _, ours = pair("packed")
    params = list(ours.parameters())
    assert len({id(p) for p in params}) == len(params) == 6  # in_proj_weight, in_proj_bias, bias_k, bias_v, out_proj.*
    assert sum(p.numel() for p in params) == sum(p.numel() for p in pair("packed")[0].parameters())


# ---------------------------------------------------------------- a whole model: init after the swap, checkpoints

def _model() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _init_and_freeze(model: nn.Module) -> None:
    """What code around an attention module does after building the model: its own init, and a freeze."""
    torch.manual_seed(5)
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention):
            nn.init.xavier_normal_(m.in_proj_weight)
            nn.init.constant_(m.in_proj_bias, 0.1)
            nn.init.normal_(m.out_proj.weight, std=0.05)
    model.layers[0].self_attn.in_proj_weight.requires_grad_(False)


def _train(model: nn.Module, steps: int = 5) -> tuple[dict[str, torch.Tensor], list[float]]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    data = torch.Generator().manual_seed(6)
    torch.manual_seed(7)  # dropout's draws
    model.train()
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 9, 32, generator=data)
        pad = torch.arange(9) >= torch.randint(3, 10, (4, 1), generator=data)
        loss = model(x, src_key_padding_mask=pad).masked_fill(pad[..., None], 0).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def test_swap_then_init_then_train_equals_init_then_swap_then_train():
    init_first, swap_first, original = _model(), _model(), _model()
    _init_and_freeze(init_first)
    swap_attention(init_first)
    swap_attention(swap_first)
    _init_and_freeze(swap_first)  # with the old storage these writes went into temporaries
    _init_and_freeze(original)
    (a, a_losses), (b, b_losses), (c, c_losses) = _train(init_first), _train(swap_first), _train(original)
    assert list(a) == list(b) == list(c)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    frozen = "layers.0.self_attn.in_proj_weight"
    assert torch.equal(b[frozen], init_first.layers[0].self_attn.in_proj_weight)  # the freeze held
    assert max(abs(x - y) for x, y in zip(a_losses, b_losses)) < 1e-6
    # and PyTorch's own module trains the same, step for step (compared by the losses: AdamW moves a weight whose
    # gradients are ~0 by ~lr either way, float rounding picking the direction)
    assert max(abs(x - y) for x, y in zip(a_losses, c_losses)) < 1e-4 and len(set(c_losses)) == 5
    assert max((b[k] - _model().state_dict()[k]).abs().max().item() for k in b if "in_proj" in k) > 1e-2


def test_checkpoints_cross_between_a_model_and_its_swapped_copy_both_ways():
    original = _model()
    with torch.no_grad():
        for p in original.parameters():
            p.add_(0.01 * torch.randn(p.shape))
    swapped = swap_attention(copy.deepcopy(original))
    x = torch.randn(2, 9, 32)
    fresh_swapped = swap_attention(_model())
    fresh_swapped.load_state_dict(original.state_dict())  # the original's checkpoint into a swapped model (strict)
    fresh_original = _model()
    fresh_original.load_state_dict(swapped.state_dict())  # a swapped model's into the original architecture
    want = original.eval()(x)
    for m in (fresh_swapped, fresh_original):
        assert (m.eval()(x) - want).abs().max() < 1e-5
    assert {k: v.shape for k, v in swapped.state_dict().items()} == {k: v.shape for k, v in original.state_dict().items()}


def _article_keys(state: dict) -> dict:
    """A state dict as mhalab wrote it before its attention took PyTorch's names."""
    out = {}
    for k, v in state.items():
        prefix, _, leaf = k.rpartition(".")
        if leaf in ("in_proj_weight", "in_proj_bias"):
            for x, chunk in zip("QKV", v.chunk(3)):
                out[f"{prefix}.W_{x}.{'weight' if leaf.endswith('weight') else 'bias'}"] = chunk
        else:
            out[k.replace("out_proj.", "W_O.")] = v
    return out


def test_state_dicts_with_the_articles_keys_load_into_ours_and_through_official_state_dict_into_pytorchs():
    original = _model()
    old = _article_keys(original.state_dict())
    assert "layers.0.self_attn.W_K.weight" in old and not any("in_proj" in k for k in old)
    swapped = swap_attention(_model())
    with torch.no_grad():
        for p in swapped.parameters():
            p.zero_()
    swapped.load_state_dict(old)  # strict: the keys are mapped at load time
    plain = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2,
                                  enable_nested_tensor=False)
    plain.load_state_dict(official_state_dict(old))
    want = original.state_dict()
    for m in (swapped, plain):
        assert all(torch.equal(m.state_dict()[k], want[k]) for k in want)


def test_checkpoints_written_with_the_articles_keys_load_and_compute_what_they_computed():
    """tests/fixtures/article_keys: a run's .ckpt and a pretraining's encoder.pt written at commit 3ab1322 (its
    make.py), with the outputs they gave then; loaded as mhalab-eval / mhalab-predict and init_from load them."""
    from fixtures.article_keys.make import encode

    from mhalab.train.checkpoint import load_model

    expected = torch.load(FIXTURE / "expected.pt")
    assert any(k.endswith("self_attn.W_Q.weight") for k in torch.load(FIXTURE / "run.ckpt", weights_only=False)[
        "state_dict"])
    loaded = load_model(FIXTURE / "run.ckpt")
    ids = expected["ids"]
    with torch.no_grad():
        logits = loaded.module.model(ids, ids == 0)
        hidden = encode(loaded.module.model, FIXTURE / "encoder.pt")
    assert (logits - expected["logits"]).abs().max() < 1e-6
    assert (hidden - expected["hidden"]).abs().max() < 1e-6


def test_a_run_written_with_the_articles_keys_resumes_with_its_adamw_state_moved_to_the_packed_weights(
        tmp_path, toy_data_dir):
    """The fixture's run resumed (ckpt_path=) for a second epoch: its optimizer's moments for W_Q, W_K, W_V are
    in_proj_weight's, concatenated, and training goes on from its step."""
    import json

    from conftest import compose_train

    from mhalab.train.checkpoint import load_model
    from mhalab.train.optimizer import upgrade_article_keys
    from mhalab.train.run import run

    ckpt = torch.load(FIXTURE / "run.ckpt", weights_only=False)
    old = copy.deepcopy(ckpt["optimizer_states"][0])
    module = load_model(FIXTURE / "run.ckpt").module
    upgrade_article_keys(ckpt, module)
    new = ckpt["optimizer_states"][0]
    names = [n for n, p in module.named_parameters() if p.ndim >= 2 and "embed" not in n]
    names += [n for n, p in module.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    # the old groups: decayed [W_Q.weight, W_K.weight, W_V.weight, W_O.weight, ffn.0.weight, ffn.3.weight, head.weight],
    # not decayed [embed.weight, W_Q.bias, W_K.bias, W_V.bias, W_O.bias, ...]
    assert [len(g["params"]) for g in old["param_groups"]] == [7, 12]
    assert [len(g["params"]) for g in new["param_groups"]] == [5, 10]  # in_proj_weight, in_proj_bias, out_proj
    w = names.index("model.encoder.layers.0.self_attn.in_proj_weight")
    assert torch.equal(new["state"][w]["exp_avg"], torch.cat([old["state"][i]["exp_avg"] for i in (0, 1, 2)]))
    b = names.index("model.encoder.layers.0.self_attn.in_proj_bias")
    assert torch.equal(new["state"][b]["exp_avg_sq"], torch.cat([old["state"][i]["exp_avg_sq"] for i in (8, 9, 10)]))
    # and end to end: the fixture's run (its toy data and model) resumed for a second epoch
    out = tmp_path / "resumed"
    run(compose_train(["max_epochs=2", "dim=16", "heads=2", "ff_ratio=2", "seed=0", f"ckpt_path={FIXTURE / 'run.ckpt'}"],
                      out, toy_data_dir, tmp_path / "cache"))
    record = json.loads((out / "metrics.json").read_text())
    assert record["status"] == "finished" and record["global_step"] == 2 * ckpt["global_step"]
