"""swap_attention on models another library builds: PyTorch Geometric (torch-geometric, tested with 2.8.1).

PyG constructs torch.nn.MultiheadAttention itself and calls it three ways:
- SetTransformerAggregation (SetAttentionBlock / PoolingByMultiheadAttention -> MultiheadAttentionBlock):
  batch_first=True, `attn(x, y, y, ~mask, need_weights=False)`, the key_padding_mask positional; cross-attention
  from learned seed points; a graph with no nodes has every key blocked (dim_size below adds one).
- GPSConv (graph transformer layer): batch_first=True, `attn(h, h, h, key_padding_mask=~mask,
  need_weights=False)`, taken only `if isinstance(self.attn, torch.nn.MultiheadAttention)`.
- MultiAggregation(mode="attn"): batch_first=False (PyTorch's default), `attn(x, x, x)` (need_weights=True).
All three re-initialise it through `attn._reset_parameters()`.

Each model is built with a fixed seed on a tiny batch of graphs of different sizes (so padding happens), copied,
and the copy swapped; dropout is 0, so train mode is exact.
"""

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("torch_geometric")
from torch_geometric.nn import GINConv, GPSConv
from torch_geometric.nn.aggr import MultiAggregation, SetTransformerAggregation

from mhalab import MultiHeadAttention, swap_attention
from mhalab.nn import official_names

C = 8  # channels
SIZES = (3, 5, 1, 4)  # nodes per graph
TOL = 1e-5


class GPS(nn.Module):
    """Two GPS layers (GIN message passing + global attention, batch norm) on node features."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            GPSConv(C, GINConv(nn.Sequential(nn.Linear(C, C), nn.ReLU(), nn.Linear(C, C))), heads=2)
            for _ in range(2))

    def reset_parameters(self):
        for layer in self.layers:
            layer.reset_parameters()

    def forward(self, x, edge_index, batch):
        for layer in self.layers:
            x = layer(x, edge_index, batch)
        return x


# name -> (builder, call(model, x, graph), number of nn.MultiheadAttention inside, their batch_first)
MODELS = {
    "set_transformer": (
        lambda: SetTransformerAggregation(C, num_seed_points=2, num_encoder_blocks=2, heads=2, layer_norm=True),
        lambda m, x, g: m(x, g["batch"], dim_size=len(SIZES) + 1),  # + one empty graph: all its keys blocked
        4, True),
    "gps": (GPS, lambda m, x, g: m(x, g["edge_index"], g["batch"]), 2, True),
    "multi_aggregation_attn": (
        lambda: MultiAggregation(["mean", "max", "sum"], mode="attn",
                                 mode_kwargs={"in_channels": C, "out_channels": C, "num_heads": 2}),
        lambda m, x, g: m(x, g["batch"]),
        1, False),
}


@pytest.fixture(scope="module")
def graph():
    gen = torch.Generator().manual_seed(1)
    batch = torch.repeat_interleave(torch.arange(len(SIZES)), torch.tensor(SIZES))
    starts = torch.tensor((0, *SIZES)).cumsum(0)[:-1]
    chain = torch.cat([torch.stack([torch.arange(s, s + n - 1), torch.arange(s + 1, s + n)])
                       for s, n in zip(starts.tolist(), SIZES)], dim=1)  # a path inside each graph
    return {"x": torch.randn(len(batch), C, generator=gen), "batch": batch,
            "edge_index": torch.cat([chain, chain.flip(0)], dim=1)}


@pytest.fixture(params=list(MODELS))
def pair(request):
    """(name, original, swapped copy, what swap_attention returned)."""
    build, _, _, _ = MODELS[request.param]
    torch.manual_seed(0)
    original = build()
    swapped = copy.deepcopy(original)
    returned = swap_attention(swapped)
    return request.param, original, swapped, returned


def attentions(model):
    return [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]


def official_named(model, of=lambda p: p.detach()):
    """of(p) for each parameter of `model` under nn.MultiheadAttention's names (mhalab.nn.official_names:
    in_proj_weight = [W_Q; W_K; W_V].weight, out_proj.* = W_O.*, every other name unchanged)."""
    return {name: torch.cat([of(p) for p in ps]) for name, ps in official_names(model).items()}


def assert_same_tensors(got: dict, want: dict, tol=TOL):
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name].shape == value.shape, name
        diff = (got[name] - value).abs().max().item()
        assert diff <= tol, f"{name}: max |diff| {diff:.3g}"


def run(name, model, graph, train=True, no_grad=False):
    """Forward (and backward, unless no_grad) of a fresh leaf copy of the features; (output, input grad)."""
    call = MODELS[name][1]
    model.train(train)
    x = graph["x"].clone().requires_grad_(not no_grad)
    if no_grad:
        with torch.no_grad():
            return call(model, x, graph), None
    out = call(model, x, graph)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))  # a loss no norm cancels
    (out * weights).sum().backward()
    return out.detach(), x.grad


def test_swap_replaces_every_pyg_multihead_attention_in_place_with_mhalabs_weights_copied(pair):
    name, original, swapped, returned = pair
    _, _, count, batch_first = MODELS[name]
    assert returned is swapped
    assert len(attentions(original)) == count > 0
    assert all(type(m) is nn.MultiheadAttention for m in attentions(original))
    assert len(attentions(swapped)) == count
    assert all(type(m) is MultiHeadAttention for m in attentions(swapped))
    assert all(m.batch_first is batch_first and m._qkv_same_embed_dim for m in attentions(swapped))
    assert_same_tensors(official_named(swapped), official_named(original), tol=0)


def test_pyg_reset_parameters_reinitialises_mhalabs_attention_as_pytorchs(pair):
    """PyG's reset_parameters calls attn._reset_parameters(): same seed, same weights in ours."""
    _, original, swapped, _ = pair
    for model in (original, swapped):
        torch.manual_seed(3)
        model.reset_parameters()
    assert_same_tensors(official_named(swapped), official_named(original), tol=0)
    before = {k: v.clone() for k, v in official_named(swapped).items()}
    torch.manual_seed(4)
    swapped.reset_parameters()  # and it does re-initialise ours (not a temporary concatenation)
    assert any(not torch.equal(official_named(swapped)[k], before[k]) for k in before if "in_proj_weight" in k)


@pytest.mark.parametrize("mode", ["train", "eval", "eval_no_grad"])
def test_swapped_pyg_model_outputs_equal_pytorchs_and_run_mhalabs_attention(pair, graph, mode):
    name, original, swapped, _ = pair
    calls = []
    for m in attentions(swapped):
        m.register_forward_hook(lambda mod, args, out: calls.append(mod))
    kw = {"train": mode == "train", "no_grad": mode == "eval_no_grad"}
    want, _ = run(name, original, graph, **kw)
    got, _ = run(name, swapped, graph, **kw)
    assert {id(m) for m in calls} == {id(m) for m in attentions(swapped)}  # every one of them ran ...
    assert {type(m) for m in calls} == {MultiHeadAttention}  # ... and is ours
    assert torch.isfinite(want).all()
    assert (got - want).abs().max().item() <= TOL


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_swapped_pyg_model_gradients_equal_pytorchs_for_every_parameter_and_the_input(pair, graph, train):
    name, original, swapped, _ = pair
    _, want_x = run(name, original, graph, train=train)
    _, got_x = run(name, swapped, graph, train=train)
    assert all(p.grad is not None for p in original.parameters())
    assert_same_tensors(official_named(swapped, of=lambda p: p.grad), official_named(original, of=lambda p: p.grad))
    assert (got_x - want_x).abs().max().item() <= TOL


def test_swap_back_to_official_restores_pytorchs_attention_and_the_exact_state_dict(pair, graph):
    name, original, swapped, _ = pair
    assert list(swapped.state_dict()) == list(original.state_dict())  # ours has PyTorch's parameter names
    back = swap_attention(swapped, to="official")
    assert back is swapped
    assert all(type(m) is nn.MultiheadAttention for m in attentions(back))
    want, got = original.state_dict(), back.state_dict()
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(run(name, back, graph, train=False, no_grad=True)[0],
                       run(name, original, graph, train=False, no_grad=True)[0])
