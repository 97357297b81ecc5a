"""init_draw=keyed (mhalab.train.common_random): each initial weight from (seed, its name), in its module's
distribution; a narrower weight the leading block of a wider one's, scaled to its own bound; dropout restarted at the
seed. Checked against the modules' own draws, and through the run's build() with the real configs."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose_train
from scipy import stats

from mhalab.errors import ConfigError
from mhalab.model import SequenceClassifier
from mhalab.train.common_random import INIT, keyed_init_, rule, uniform
from mhalab.train.config import validate
from mhalab.train.run import build

ONE_THREAD = True

# every rule of INIT is used by one of these (a test checks), at widths where each parameter has many elements
VARIANTS = ({"pos": "learned", "pooling": "cls", "attention": "linformer"}, {"pos": "t5"}, {"encoder": "official"})


def _model(seed: int = 0, **kw) -> SequenceClassifier:
    torch.manual_seed(seed)
    args = {"vocab_size": 3000, "num_classes": 5, "dim": 128, "heads": 4, "ff_dim": 512, "max_len": 256,
            "layers": 2} | kw
    return SequenceClassifier(**args)


def test_keyed_uniforms_are_uniform_and_independent_along_every_axis():
    u = uniform(12345, (512, 1024))  # (512, 1024) on (0, 1)
    assert 0 < u.min() and u.max() < 1
    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3
    se = 1 / math.sqrt(u.numel())
    for a, b in ((u[:, 1:], u[:, :-1]), (u[1:], u[:-1]), (u, uniform(12346, (512, 1024)))):  # neighbours, other key
        r = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
        assert abs(r) < 5 * se, r


def test_every_parameter_keeps_its_modules_distribution():
    """Each drawn parameter against the same parameter as the module's own init draws it (PyTorch's generator):
    two-sample Kolmogorov-Smirnov over the pooled elements of all parameters sharing a rule, and, for a uniform,
    the bound itself (no |w| above it, the largest within 1% of it)."""
    pooled: dict[tuple, tuple[list, list]] = {}
    for i, kw in enumerate(VARIANTS):  # another seed each: the pooled elements are independent draws
        ref, keyed = _model(seed=i, **kw), _model(**kw)
        keyed_init_(keyed, seed=7 + i)
        for (name, p), q in zip(ref.named_parameters(), keyed.parameters()):
            owner, how = rule(keyed, name)
            if how is None:  # a constant: left as the module set it
                assert torch.equal(p, q), name
                continue
            entry = next(k for k, v in INIT.items() if v is how)
            family, scale, _ = how
            rows = torch.ones(len(p), dtype=torch.bool)
            if getattr(owner, "padding_idx", None) is not None:  # nn.Embedding's padding row: 0 in both
                assert not p[owner.padding_idx].any() and not q[owner.padding_idx].any()
                rows[owner.padding_idx] = False
            ref_z, keyed_z = (t.detach()[rows].flatten() / scale(owner) for t in (p, q))
            if family == "uniform":  # P(max |U| < 0.99) = 0.99^n: below 1e-4 from n = 1000
                assert keyed_z.abs().max() <= 1 + 1e-6, name
            if family == "uniform" and keyed_z.numel() >= 1000:
                assert 0.99 < keyed_z.abs().max() <= 1 + 1e-6, name
            pooled.setdefault(entry, ([], []))
            pooled[entry][0].append(ref_z)
            pooled[entry][1].append(keyed_z)
    assert set(pooled) == {k for k, v in INIT.items() if v is not None}  # every rule was drawn
    for entry, (ref_z, keyed_z) in pooled.items():
        a, b = torch.cat(ref_z).numpy(), torch.cat(keyed_z).numpy()
        assert len(b) >= 100, entry
        assert stats.ks_2samp(a, b).pvalue > 1e-3, entry


def test_a_narrower_parameter_is_the_leading_block_of_the_wider_ones_draw_scaled_to_its_bound():
    wide, narrow = _model(), _model(dim=64, heads=2, ff_dim=256)
    keyed_init_(wide, seed=3)
    keyed_init_(narrow, seed=3)
    for (name, w), n in zip(wide.named_parameters(), narrow.parameters()):
        owner_w, how = rule(wide, name)
        if how is None:
            continue
        owner_n, _ = rule(narrow, name)
        view = how[2]
        w_view = w.view(view(owner_w)) if view else w  # in_proj: (q|k|v, row, column)
        n_view = n.view(view(owner_n)) if view else n
        block = w_view[tuple(slice(0, s) for s in n_view.shape)]
        torch.testing.assert_close(n_view, block * (how[1](owner_n) / how[1](owner_w)), rtol=1e-6, atol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_keyed_weights_depend_on_the_seed_and_name_not_on_the_generator_or_construction_order():
    a, b, c = _model(seed=0), _model(seed=99), _model(seed=0)
    keyed_init_(a, seed=5)
    keyed_init_(b, seed=5)  # another state of torch's generator when built
    keyed_init_(c, seed=6)
    for (name, x), y, z in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(x, y), name
        if rule(a, name)[1] is not None:
            assert not torch.equal(x, z), name
    # the same parameter in two layers: independent draws
    w0, w1 = (a.encoder.layers[i].ffn[0].weight.detach().flatten() for i in (0, 1))
    assert abs(torch.corrcoef(torch.stack([w0, w1]))[0, 1].item()) < 5 / math.sqrt(w0.numel())


def _built(tmp_path, toy_data_dir, *overrides):
    cfg = compose_train(["seed=3", "layers=2", *overrides], tmp_path / "out", data_dir=toy_data_dir,
                        cache=tmp_path / "cache")
    module = build(cfg)[1]
    return module.model, torch.get_rng_state()


def test_a_runs_keyed_members_share_weights_and_dropout_stream_where_widths_differ(tmp_path, toy_data_dir):
    """The real configs through run.build: with init_draw=keyed, dim 32 is dim 64's leading block of every keyed
    draw (here the embedding, unscaled N(0, 1)) and both start dropout at the same generator state; with PyTorch's
    draws (init_draw=torch) neither holds."""
    narrow, narrow_rng = _built(tmp_path, toy_data_dir, "init_draw=keyed", "dim=32", "ff_ratio=2")
    wide, wide_rng = _built(tmp_path, toy_data_dir, "init_draw=keyed", "dim=64", "ff_ratio=4")
    assert torch.equal(narrow.embed.weight, wide.embed.weight[:, :32])
    assert torch.equal(narrow_rng, wide_rng)
    narrow_t, narrow_t_rng = _built(tmp_path, toy_data_dir, "init_draw=torch", "dim=32", "ff_ratio=2")
    wide_t, wide_t_rng = _built(tmp_path, toy_data_dir, "init_draw=torch", "dim=64", "ff_ratio=4")
    assert not torch.equal(narrow_t.embed.weight, wide_t.embed.weight[:, :32])
    assert not torch.equal(narrow_t_rng, wide_t_rng)


def test_config_refuses_an_unknown_init_draw_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^unknown init_draw 'crn'; choose one of keyed, torch\.$"):
        validate(compose_train(["init_draw=crn"], tmp_path))
