"""mhalab.nn.flops (the analytic FLOPs that the throughput monitor divides by time) against PyTorch's own counter.

torch.utils.flop_counter.FlopCounterMode counts matmuls (mm, addmm, bmm) and the attention kernels it has
formulas for; so does the analytic count (softmax, norms, activations, dropout, masks and embeddings are in
neither, see nn/flops.py). Both count the same operations, so the tolerance is 0: equal integers.
The models run in training mode with dropout > 0: there CPU attention takes SDPA's math path, whose
matmuls the counter sees (torch 2.13 has no FLOP formula for the fused CPU flash kernel used in eval).
Batches are padded (lengths below the width), so the custom encoder unpads: its position-wise layers run
on the N real tokens only, and the count must say so.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mhalab.model import ATTENTION_OPTIONS, SequenceClassifier
from mhalab.nn.flops import TRAIN_FACTOR, forward_flops, train_flops
from mhalab.nn.varlen import CALL_COST, SeqLens
from mhalab.train.module import Classifier

ONE_THREAD = True  # conftest.one_thread
SMALL = {"dim": 32, "heads": 4, "layers": 2, "ff_dim": 64}
CLASSES = 3


def _batch(lengths: list[int], width: int, vocab: int = 50, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths_t = torch.tensor(lengths)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=g)  # (B, L)
    pad = torch.arange(width)[None, :] >= lengths_t[:, None]  # (B, L) True at pads
    return ids.masked_fill(pad, 0), pad


def _counted(model: torch.nn.Module, ids, pad, backward: bool = False) -> int:
    with FlopCounterMode(display=False) as counter:
        out = model(ids, pad)
        if backward:
            out.sum().backward()
    return counter.get_total_flops()


def _analytic(cfg: dict, lengths: list[int], width: int) -> int:
    opts = {**ATTENTION_OPTIONS, **cfg.get("attention_options", {})}
    return forward_flops(batch=len(lengths), seq_len=width, num_tokens=sum(lengths), lengths=lengths, num_classes=CLASSES,
                         **{**SMALL, **cfg, "attention_options": opts})


# (config, lengths, width): the default full attention and each kernel, on padded batches
CASES = {
    "full": ({}, [20, 13, 7, 16], 20),
    "full-unpadded-batch": ({}, [20, 20, 20, 20], 20),  # nothing padded: N = B * L
    "cls-pooling": ({"pooling": "cls"}, [20, 13, 7, 16], 20),  # one more position per row
    "official-encoder": ({"encoder": "official"}, [20, 13, 7, 16], 20),  # PyTorch's computes the pads too
    "rope": ({"pos": "rope"}, [20, 13, 7, 16], 20),
    # model.head_dim: 4 heads x 24 = 96 wide attention on dim 32 (projections 32 -> 96 -> 32)
    "head-dim": ({"head_dim": 24}, [20, 13, 7, 16], 20),
    "head-dim-performer": ({"head_dim": 6, "attention": "performer", "attention_options": {"performer_features": 16}},
                           [20, 13, 7, 16], 20),
    "window-band-mask": ({"attention": "window", "attention_options": {"window": 8}}, [20, 13, 7, 16], 20),
    # L = 300 > 2 * (block 64 + window 16): the chunked path, with 2 global tokens
    "window-chunked": ({"attention": "window", "attention_options": {"window": 16, "global_tokens": 2}},
                       [300, 200], 300),
    # a per-query bias (alibi) sends window attention back to the band mask at the same L
    "window-alibi": ({"attention": "window", "pos": "alibi", "attention_options": {"window": 16, "global_tokens": 2}},
                     [300, 200], 300),
    "linformer": ({"attention": "linformer", "attention_options": {"linformer_k": 8}}, [20, 13, 7, 16], 20),
    "performer": ({"attention": "performer", "attention_options": {"performer_features": 16}}, [20, 13, 7, 16], 20),
}


@pytest.mark.parametrize("name", list(CASES))
def test_analytic_forward_flops_equal_flop_counter_mode_on_a_padded_batch(name):
    cfg, lengths, width = CASES[name]
    torch.manual_seed(0)
    model = SequenceClassifier(vocab_size=50, num_classes=CLASSES, max_len=width, **SMALL, **cfg).train()
    ids, pad = _batch(lengths, width)
    assert _counted(model, ids, pad) == _analytic(cfg, lengths, width)


def test_padded_batch_costs_fewer_flops_than_the_same_batch_computed_at_every_position():
    """Unpadding is in the count: the real tokens' share of the position-wise FLOPs, not B * L, and attention
    per sequence (sum of n^2, not B * L^2)."""
    lengths, width = [20, 13, 7, 16], 20
    unpadded = _analytic({}, lengths, width)
    every_position = _analytic({"encoder": "official"}, lengths, width)
    B, E, F = len(lengths), SMALL["dim"], SMALL["ff_dim"]
    pads = B * width - sum(lengths)
    per_position = SMALL["layers"] * (8 * E * E + 4 * E * F)  # in-projection, W_O and the feed-forward
    calls = SeqLens(lengths).plan(CALL_COST // E).calls  # varlen attention's kernel calls (here one: all padded)
    attention_saved = SMALL["layers"] * 4 * E * (B * width**2 - sum(c * n * n for n, c in calls))  # Q K^T, A V
    assert every_position - unpadded == pads * per_position + attention_saved


def test_training_flops_are_three_forwards_and_equal_the_counted_forward_and_backward():
    lengths, width = [20, 13, 7, 16], 20
    torch.manual_seed(0)
    model = SequenceClassifier(vocab_size=50, num_classes=CLASSES, max_len=width, **SMALL).train()
    ids, pad = _batch(lengths, width)
    counted = _counted(model, ids, pad, backward=True)
    kwargs = {"batch": len(lengths), "seq_len": width, "num_tokens": sum(lengths), "lengths": lengths,
              "num_classes": CLASSES, **SMALL}
    assert counted == train_flops(**kwargs) == TRAIN_FACTOR * forward_flops(**kwargs)


def test_the_modules_flops_per_batch_equal_the_counted_training_step_of_a_collated_batch():
    """Classifier.batch_flops reads the config it was built with and the batch's shapes and num_tokens."""
    from mhalab.data import Collate

    torch.manual_seed(0)
    module = Classifier(model={**SMALL, "max_len": 24, "pooling": "cls"}, vocab_size=50, num_classes=CLASSES).train()
    g = torch.Generator().manual_seed(1)
    items = [(torch.randint(1, 50, (n,), generator=g), i % CLASSES) for i, n in enumerate([24, 5, 17, 9, 12])]
    batch = Collate(pad_id=0)(items)
    counted = _counted(module, batch["input_ids"], batch["padding_mask"], backward=True)
    assert module.batch_flops(batch) == counted
