"""Attention on real tokens only (nn.varlen) and packed batches (data.batching=packed).

The reference everywhere is the padded computation: TransformerEncoder(unpad=False), which runs every
position of the (B, L) layout with a key-padding mask, as nn.TransformerEncoder does in training.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import compose_train, load_script

from mhalab.data.collate import Collate, PackedCollate
from mhalab.data.sampler import PackedBatchSampler
from mhalab.model import SequenceClassifier, attention_parts
from mhalab.nn.attention import MultiHeadAttention
from mhalab.nn.encoder import TransformerEncoder, TransformerEncoderLayer, reset_parameters
from mhalab.nn.positions import RotaryEmbedding
from mhalab.nn.unpad import Unpadding
from mhalab.nn.varlen import SeqLens, varlen_attention
from mhalab.train.run import run

TOL = 1e-5  # float32, outputs and gradients (the bound); the paths sum in different orders
# the longest first, a repeated length, a single token; with E = 32 (CALL_COST / 32 = 3125 padded scores a call
# may take), CallPlan makes four calls: 150, 100, the two 60s, and 3 with 1 padded to 3
LENGTHS = [150, 3, 60, 60, 1, 100]
L, E, H = 150, 32, 4


def _encoders(attention: str, pos: str, dropout: float = 0.0):
    parts = attention_parts(attention, pos, embed_dim=E, num_heads=H, max_len=L, dropout=dropout,
                            window=8, global_tokens=1)
    layer = TransformerEncoderLayer(E, H, 64, dropout, batch_first=True,
                                    self_attn=MultiHeadAttention(E, H, dropout, **parts))
    ours = TransformerEncoder(layer, 2, unpad=True)
    reset_parameters(ours.layers[1])  # two different layers
    padded = TransformerEncoder(layer, 2, unpad=False)
    padded.load_state_dict(ours.state_dict())
    return ours, padded


def _mask(lengths, width=L):
    return torch.arange(width)[None, :] >= torch.tensor(lengths)[:, None]  # (B, width) True at pads


CAUSAL = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
CASES = [("full", "sinusoidal", None), ("full", "sinusoidal", CAUSAL), ("full", "rope", None),
         ("full", "rope", CAUSAL), ("full", "alibi", None), ("full", "t5", CAUSAL), ("window", "rope", None),
         ("window", "alibi", CAUSAL), ("linformer", "rope", None)]


@pytest.mark.parametrize("attention,pos,mask", CASES,
                         ids=[f"{a}-{p}{'-causal' if m is not None else ''}" for a, p, m in CASES])
def test_varlen_encoder_equals_the_padded_computation_outputs_and_gradients(attention, pos, mask):
    torch.manual_seed(0)
    ours, padded = _encoders(attention, pos)
    x = torch.randn(len(LENGTHS), L, E, requires_grad=True)
    kpm = _mask(LENGTHS)
    calls = []
    ours.layers[0].self_attn.attention.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    a, b = ours(x, mask=mask, src_key_padding_mask=kpm), padded(x, mask=mask, src_key_padding_mask=kpm)
    real = ~kpm
    assert (a[real] - b[real]).abs().max() < TOL
    w = torch.randn_like(a)  # a random cotangent on the real tokens: every output's gradient counts
    ga, = torch.autograd.grad((a * w)[real].sum(), x)
    gb, = torch.autograd.grad((b * w)[real].sum(), x)
    assert (ga - gb).abs().max() < TOL
    # it did attend per sequence, in CallPlan's calls, not on the padded (6, H, 150, d) layout
    d = E // H
    assert [tuple(s) for s in calls] == [(1, H, 150, d), (1, H, 100, d), (2, H, 60, d), (2, H, 3, d)]


@pytest.mark.parametrize("kind", ["performer", "explicit-weights"])
def test_performer_and_the_explicit_weights_path_keep_the_padded_layout_and_equal_it(kind):
    torch.manual_seed(0)
    ours, padded = _encoders("performer" if kind == "performer" else "full", "rope")
    mha = ours.layers[0].self_attn
    if kind == "performer":
        assert not mha.attention.per_sequence  # its redraw counter counts forward calls
    else:
        for layer in ours.layers:
            layer.self_attn.explicit = True  # attends through the (B, H, L, L) weights
    calls = []
    mha.attention.register_forward_hook(lambda m, i, o: calls.append(tuple(i[0].shape)))
    x, kpm = torch.randn(len(LENGTHS), L, E), _mask(LENGTHS)
    assert (ours(x, src_key_padding_mask=kpm) - padded(x, src_key_padding_mask=kpm))[~kpm].abs().max() < TOL
    assert calls == [(len(LENGTHS), H, L, E // H)]  # one call on the padded layout


def test_left_padding_is_not_varlen_and_still_equals_the_padded_computation():
    torch.manual_seed(0)
    ours, padded = _encoders("full", "sinusoidal")
    kpm = _mask(LENGTHS).flip(1)  # real tokens last
    assert Unpadding(kpm).seqlens is None and Unpadding(_mask(LENGTHS)).seqlens.lengths == LENGTHS
    x = torch.randn(len(LENGTHS), L, E)
    assert (ours(x, src_key_padding_mask=kpm) - padded(x, src_key_padding_mask=kpm))[~kpm].abs().max() < TOL


def test_dropout_replayed_gives_the_gradient_of_the_forward_it_drew():
    """With dropout the paths draw different masks, so they cannot be compared number for number; instead
    the RNG is replayed before every call, which makes the varlen forward a fixed function, and its autograd
    gradient must equal that function's finite differences (torch.autograd.gradcheck, float64)."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2, dropout=0.5).double().train()
    lengths = [5, 2, 2]
    seqlens = SeqLens(lengths)
    x = torch.randn(sum(lengths), 8, dtype=torch.float64, requires_grad=True)

    def f(x):
        torch.manual_seed(1)
        return varlen_attention(mha, mha._in_proj(x), seqlens)

    out = f(x)
    assert torch.equal(out, f(x))  # replayed: the same draws
    mha.eval()
    assert not torch.allclose(out, f(x))  # and dropout did act in training
    mha.train()
    assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("call_cost", [0, 40 * E, 7000 * E])
def test_every_call_plan_gives_the_same_attention(call_cost):
    """call_cost 0: one call per distinct length, nothing padded; 40 * E: pads of at most 40 scores (the 1
    joins the 3: 9 - 1 = 8); 7000 * E: the 60s join the 100 too (10000 - 3600 = 6400). The same outputs."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(E, H, **attention_parts("full", "t5", embed_dim=E, num_heads=H, max_len=L, dropout=0.0))
    seqlens = SeqLens(LENGTHS)
    x = torch.randn(sum(LENGTHS), E, requires_grad=True)
    exact = varlen_attention(mha, mha._in_proj(x), seqlens, call_cost=0)
    planned = varlen_attention(mha, mha._in_proj(x), seqlens, call_cost=call_cost)
    assert (exact - planned).abs().max() < TOL
    calls = seqlens.plan(call_cost // E).calls
    expected = {0: [(150, 1), (100, 1), (60, 2), (3, 1), (1, 1)], 40 * E: [(150, 1), (100, 1), (60, 2), (3, 2)],
                7000 * E: [(150, 1), (100, 3), (3, 2)]}[call_cost]
    assert calls == expected


def test_call_plan_pads_within_a_call_and_lays_tokens_back():
    plan = SeqLens([5, 3, 3, 1]).plan(17)  # 5^2 - 3^2 = 16 <= 17: the 3s join the 5; 25 - 1 = 24 does not
    assert plan.calls == [(5, 3), (1, 1)]
    assert plan.key_mask(0, "cpu").tolist() == [[False] * 5, [False] * 3 + [True] * 2, [False] * 3 + [True] * 2]
    assert plan.key_mask(1, "cpu") is None
    rows = torch.arange(12)
    padded = plan.gather(rows)  # (5 + 5 + 5 + 1,): each 3 padded with a copy of its first row
    assert padded.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 5, 5, 8, 9, 10, 8, 8, 11]
    assert torch.equal(plan.real(padded), rows)


def test_seqlens_sorts_only_unsorted_batches():
    s = SeqLens([3, 5, 3, 1])
    assert s.max_seqlen == 5 and s.num_tokens == 12
    assert s.cu_seqlens("cpu").tolist() == [0, 3, 8, 11, 12]
    assert s.positions("cpu").tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 0]
    rows = torch.arange(12)
    assert s.sort(rows).tolist() == [3, 4, 5, 6, 7, 0, 1, 2, 8, 9, 10, 11] and torch.equal(s.unsort(s.sort(rows)), rows)
    assert s.padded_index(6, "cpu").tolist() == [0, 1, 2, 6, 7, 8, 9, 10, 12, 13, 14, 18]  # in a (4, 6) batch
    already = SeqLens([5, 3, 3, 1])  # longest first: no gather at all
    assert already._perm is None and already.sort(rows) is rows
    x = torch.randn(12, 4)
    assert torch.allclose(s.mean(x)[1], x[3:8].mean(0))
    with_cls, longer = s.with_prefix(x, torch.full((4,), 7.0))
    assert longer.lengths == [4, 6, 4, 2] and (with_cls[longer.starts("cpu")] == 7).all()
    assert torch.equal(with_cls[1:4], x[:3]) and torch.equal(with_cls[5:10], x[3:8])


def test_rotate_packed_equals_rope_on_each_sequence():
    rope = RotaryEmbedding(8, 16)
    s = SeqLens([5, 3])
    q, k = torch.randn(8, 2, 8), torch.randn(8, 2, 8)  # (N, H, d)
    qp, kp = rope.rotate_packed(q, k, s.positions("cpu"), s.max_seqlen)
    q0, k0 = rope(q[:5].transpose(0, 1)[None], k[:5].transpose(0, 1)[None])  # (1, H, 5, d): positions 0..4
    assert torch.allclose(qp[:5], q0[0].transpose(0, 1)) and torch.allclose(kp[:5], k0[0].transpose(0, 1))
    q1, _ = rope(q[5:].transpose(0, 1)[None], k[5:].transpose(0, 1)[None])
    assert torch.allclose(qp[5:], q1[0].transpose(0, 1))  # the second sequence starts again at position 0


MODELS = [{"encoder": "custom", "pooling": "mean", "pos": "sinusoidal"},
          {"encoder": "custom", "pooling": "cls", "pos": "learned"},
          {"encoder": "custom", "pooling": "mean", "pos": "t5"},
          {"encoder": "custom", "pooling": "max", "pos": "sinusoidal"},
          {"encoder": "official", "pooling": "cls", "pos": "sinusoidal"}]


@pytest.mark.parametrize("cfg", MODELS, ids=lambda c: "-".join(c.values()))
def test_packed_batch_gives_the_padded_batchs_logits_and_parameter_gradients(cfg):
    torch.manual_seed(0)
    model = SequenceClassifier(60, 3, dim=E, heads=H, layers=2, ff_dim=64, dropout=0.0, max_len=L, **cfg)
    g = torch.Generator().manual_seed(1)
    items = [(torch.randint(1, 60, (n,), generator=g), i % 3) for i, n in enumerate(LENGTHS)]
    padded, packed = Collate()(items), PackedCollate()(items)
    assert packed["input_ids"].shape == (sum(LENGTHS),) and packed["num_tokens"] == padded["num_tokens"]
    ref = model(padded["input_ids"], padded["padding_mask"])  # from the mask: the library's plain call
    grads = []
    for out in (ref, model(packed["input_ids"], seqlens=packed["seqlens"]),
                model(padded["input_ids"], padded["padding_mask"], seqlens=padded["seqlens"])):
        assert (out - ref).abs().max() < TOL
        grads.append(torch.autograd.grad(out.square().sum(), list(model.parameters()), allow_unused=True))
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert (a is None and b is None) or (a - b).abs().max() < TOL


def test_packed_sampler_draws_a_plain_shuffle_cut_into_equal_token_batches():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 65, 1000)
    s = PackedBatchSampler(lengths, 64, seed=3)
    batches = s.global_batches(0)
    assert len(batches) == len(s) == 16  # ceil(1000 / 64): the steps per epoch of the other modes
    # the batches are consecutive pieces of the epoch's seeded permutation (a plain shuffle)
    order = np.random.default_rng([3, 0]).permutation(1000)
    pieces = np.split(order, np.cumsum([len(b) for b in batches])[:-1])
    assert all(sorted(b) == sorted(p.tolist()) for b, p in zip(batches, pieces))
    # each batch holds the target token count within one sequence, sorted longest first
    target = lengths.sum() / 16
    assert all(abs(lengths[b].sum() - target) <= 64 for b in batches)
    assert all(list(lengths[b]) == sorted(lengths[b], reverse=True) for b in batches)
    assert s.global_batches(1) != batches  # a new order every epoch
    assert s.padding_fraction(0) == 0.0  # what the datamodule logs: packed batches have no pads
    budget = PackedBatchSampler(lengths, 64, tokens_per_batch=4000)
    assert len(budget) == -(-int(lengths.sum()) // 4000)


def test_packed_sampler_shards_and_resumes_mid_epoch():
    lengths = np.random.default_rng(1).integers(1, 30, 101)
    ranks = [PackedBatchSampler(lengths, 8, rank=r, world_size=2) for r in (0, 1)]
    seen = [i for r in ranks for b in r for i in b]
    assert len(seen) == len(set(seen)) and len(ranks[0]) == len(ranks[1]) == 6  # 13 batches: 12 used
    full = list(PackedBatchSampler(lengths, 8))
    resumed = PackedBatchSampler(lengths, 8)
    resumed.load_state_dict({"epoch": 0, "batches_yielded": 5})
    assert list(resumed) == full[5:]


def test_a_few_sequences_much_longer_than_the_rest_still_leave_no_batch_empty():
    s = PackedBatchSampler(np.array([500, 1, 1, 1, 1, 1]), 1)
    batches = s.global_batches(0)
    assert len(batches) == 6 and sorted(i for b in batches for i in b) == list(range(6))


def test_training_with_packed_batches_has_no_padding_and_learns(tmp_path, toy_data_dir):
    cfg = compose_train(["data.batching=packed", "max_epochs=3", "test_after_fit=false"], tmp_path / "out",
                        toy_data_dir, tmp_path / "cache")
    run(cfg)
    rec = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert rec["padding_fraction"] == 0.0 and rec["train_tokens"] > 0
    assert rec["data"]["batching"] == "packed"
    assert rec["best"]["val/acc"] > 0.7  # the toy task is separable; chance is 0.5


@pytest.mark.parametrize("override,fragment", [
    ("data.batching=sorted", "batching='sorted' is not supported; choose one of ['bucketed', 'shuffled', 'packed']"),
    ("data.tokens_per_batch=1000", "tokens_per_batch=1000 applies to batching=packed only"),
])
def test_bad_batching_settings_are_refused_in_one_line(override, fragment, tmp_path, toy_data_dir):
    from mhalab.errors import ConfigError
    from mhalab.train.config import instantiate

    cfg = compose_train([override], tmp_path / "out", toy_data_dir, tmp_path / "cache")
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        instantiate(cfg.data)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_varlen_kernel_equals_the_padded_computation(dtype):
    """On CUDA the flash varlen kernel (where torch has it) or the grouped fallback, against the padded path,
    in half precision: tolerance 2e-2 (bf16 keeps 8 mantissa bits: ~4e-3 per rounding, a few roundings)."""
    torch.manual_seed(0)
    ours, padded = (m.cuda().eval() for m in _encoders("full", "rope"))
    x, kpm = torch.randn(len(LENGTHS), L, E, device="cuda"), _mask(LENGTHS).cuda()
    with torch.autocast("cuda", dtype=dtype):
        a, b = ours(x, src_key_padding_mask=kpm), padded(x, src_key_padding_mask=kpm)
    assert (a.float() - b.float())[~kpm].abs().max() < 2e-2


def test_varlen_stack_script_writes_its_table_with_the_official_encoder_as_reference(tmp_path):
    """scripts/varlen_stack.py, as the README runs it, at tiny sizes: three encoders, the reference at 1.00x."""
    script = load_script("varlen_stack")
    out = tmp_path / "stack.md"
    script.main(["reps=1", "batch=2", "min_len=3", "max_len=8", f"out={out}"])
    rows = [r for r in out.read_text().splitlines() if r.startswith(("| ours", "| nn."))]
    assert [r.split(" | ")[0] for r in rows] == ["| ours, per sequence (varlen)", "| ours, padded layout",
                                                 "| nn.TransformerEncoder"]
    assert rows[-1].split(" | ")[2] == "1.00x" and rows[-1].split(" | ")[4] == "1.00x |"
