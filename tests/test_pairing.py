"""What the members of one seed share across a sweep's cells, which is what the report's paired test leans on
(scripts/pairing.py measures what it buys on the committed sweeps; docs/sweeps.md)."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_train
from torch import nn

from mhalab.train.run import build


def _model(tmp_path, toy_data_dir, *overrides: str) -> nn.Module:
    cfg = compose_train(["seed=3", "layers=2", *overrides], tmp_path / "out", data_dir=toy_data_dir,
                        cache=tmp_path / "cache")
    return build(cfg)[1].model


@pytest.mark.parametrize("draw", ["keyed", "torch"])
def test_cells_of_one_seed_draw_the_same_initial_weights_when_every_shape_agrees(draw, tmp_path, toy_data_dir):
    base = _model(tmp_path, toy_data_dir, "dropout=0.1", "heads=4", f"init_draw={draw}").state_dict()
    for other in (("dropout=0.3", "heads=4"), ("dropout=0.1", "heads=2")):
        state = _model(tmp_path, toy_data_dir, *other, f"init_draw={draw}").state_dict()
        assert state.keys() == base.keys()
        assert all(torch.equal(state[k], base[k]) for k in base), other


def test_with_pytorchs_draws_where_one_layer_changes_shape_every_later_draw_differs(tmp_path, toy_data_dir):
    """init_draw=torch, ff_ratio 2 against 4: the draws before the first feed-forward layer agree, and the second
    layer's attention weights, of the same shape in both, do not: why dim, ff_ratio and head_dim sweeps paired less
    well before init_draw=keyed (tests/test_common_random.py), the default since 2026-12-07."""
    a = _model(tmp_path, toy_data_dir, "ff_ratio=2", "init_draw=torch").state_dict()
    b = _model(tmp_path, toy_data_dir, "ff_ratio=4", "init_draw=torch").state_dict()
    same_shape = [k for k in a if a[k].shape == b[k].shape]
    first_ff = next(i for i, k in enumerate(a) if a[k].shape != b[k].shape)
    before = [k for k in list(a)[:first_ff] if a[k].numel() > 1 and a[k].std() > 0]  # drawn, not constant
    after = [k for k in list(a)[first_ff:] if k in same_shape and "in_proj_weight" in k]
    assert before and all(torch.equal(a[k], b[k]) for k in before)
    assert after and not any(torch.equal(a[k], b[k]) for k in after)


def test_dropout_masks_of_one_seed_are_nested_across_rates(tmp_path, toy_data_dir):
    """Each nn.Dropout draws one uniform per element whatever its rate, so two rates above 0 stay in step: what
    dropout 0.1 zeroes, 0.3 zeroes too, call by call, in a training forward pass of the real model."""
    masks = {}
    ids = torch.randint(5, 100, (8, 20))
    for p in (0.1, 0.3):
        model = _model(tmp_path, toy_data_dir, f"dropout={p}").train()
        seen = []
        hooks = [m.register_forward_hook(lambda m, i, o, seen=seen: seen.append((o == 0) & (i[0] != 0)))
                 for m in model.modules() if isinstance(m, nn.Dropout)]
        torch.manual_seed(11)
        model(ids)
        for h in hooks:
            h.remove()
        masks[p] = seen
    assert len(masks[0.1]) == len(masks[0.3]) >= 6
    for low, high in zip(masks[0.1], masks[0.3]):
        assert not (low & ~high).any()  # nested
        assert 0.05 < low.float().mean() < 0.15 and 0.25 < high.float().mean() < 0.35
