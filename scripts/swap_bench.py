"""A model written with PyTorch's modules, before and after swap_attention: training step and inference,
one process, interleaved.

    python scripts/swap_bench.py [reps=15] [batch=32] [min_len=32] [max_len=128] [out=results/bench/swap.md]

The model is what a user would have written: nn.Embedding, nn.TransformerEncoder of 4
nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.1, batch_first=True) (PyTorch's defaults otherwise:
relu, post-norm, nested tensors in inference), mean over the real tokens, a linear head; a batch of `batch`
sequences of min_len-max_len tokens (seeded uniform draw, right-padded). The swapped copy holds the same
weights (mhalab.swap_attention). A training step is forward, cross-entropy, backward and an AdamW step; inference
is eval under torch.inference_mode, where PyTorch's fused layer runs in both (on our weights after the swap).
Times are medians over `reps` rounds (one warm-up round not timed); each round times both models in turn, in
alternating order, so drift spreads over both. The ratio's interval is the 2.5-97.5% range of the per-round
ratios' median over 2,000 bootstrap resamples.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mhalab import swap_attention
from mhalab.analysis.options import doc, emit, parse
from mhalab.errors import ConfigError, one_line_errors
from mhalab.nn import official_names


@dataclass
class SwapConfig:
    reps: int = field(default=15, metadata=doc("timed rounds (medians are reported)"))
    batch: int = field(default=32, metadata=doc("sequences per batch"))
    min_len: int = field(default=32, metadata=doc("shortest sequence"))
    max_len: int = field(default=128, metadata=doc("longest sequence"))
    out: str | None = field(default=None, metadata=doc("write the markdown table here"))


class Classifier(nn.Module):
    """A text classifier on nn.TransformerEncoder, as written without mhalab."""

    def __init__(self, vocab: int = 8000, d: int = 256, heads: int = 8, ff: int = 1024, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, heads, ff, 0.1, batch_first=True), layers)
        self.head = nn.Linear(d, 2)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(ids), src_key_padding_mask=pad)  # (B, L, d)
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        return self.head((h * keep).sum(1) / keep.sum(1))  # (B, 2)


def _step(model: nn.Module, opt: torch.optim.Optimizer, ids, pad, labels, train: bool) -> float:
    model.train(train)
    t0 = time.perf_counter()
    if train:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(ids, pad), labels).backward()
        opt.step()
    else:
        with torch.inference_mode():
            model(ids, pad)
    return time.perf_counter() - t0


def same_function(original: nn.Module, swapped: nn.Module, ids, pad, labels) -> float:
    """The largest |difference| between the two models' inference logits and between their gradients of one loss
    (eval mode: no dropout, and with grad on, the unfused path), compared under PyTorch's parameter names: the
    benchmark times one function computed two ways, or it refuses."""
    for m in (original, swapped):
        m.eval()
    with torch.inference_mode():
        diffs = [(original(ids, pad) - swapped(ids, pad)).abs().max().item()]
    grads = []
    for m, names in ((original, lambda m: {n: [p] for n, p in m.named_parameters()}), (swapped, official_names)):
        m.zero_grad(set_to_none=True)
        F.cross_entropy(m(ids, pad), labels).backward()
        grads.append({n: torch.cat([p.grad for p in ps]) for n, ps in names(m).items()})
        m.zero_grad(set_to_none=True)
    if grads[0].keys() != grads[1].keys():
        raise RuntimeError(f"the swapped model has other parameters: {sorted(grads[0].keys() ^ grads[1].keys())}")
    diffs += [(grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0]]
    worst = max(diffs)
    if not worst <= 1e-4:
        raise RuntimeError(f"the swapped model computes another function (max |diff| {worst:.3g}): not timed.")
    return worst


def _ratio_interval(a: list[float], b: list[float], n: int = 2000) -> tuple[float, float]:
    r = np.array(b) / np.array(a)
    meds = np.median(np.random.default_rng(0).choice(r, (n, len(r))), axis=1)
    return float(np.quantile(meds, 0.025)), float(np.quantile(meds, 0.975))


@one_line_errors
def main(argv=None) -> None:
    args = parse(SwapConfig, sys.argv[1:] if argv is None else argv, "python scripts/swap_bench.py", __doc__)
    if not 1 <= args.min_len <= args.max_len or args.reps < 1 or args.batch < 1:
        raise ConfigError(f"need 1 <= min_len ({args.min_len}) <= max_len ({args.max_len}), reps >= 1, batch >= 1.")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=g)
    L = int(lengths.max())
    pad = torch.arange(L)[None, :] >= lengths[:, None]  # (B, L), True at pads
    ids = torch.randint(1, 8000, (args.batch, L), generator=g)
    labels = torch.randint(0, 2, (args.batch,), generator=g)
    original = Classifier()
    models = {"original (nn.MultiheadAttention)": original, "swapped (mhalab)": swap_attention(copy.deepcopy(original))}
    same = same_function(*models.values(), ids, pad, labels)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    times = {(name, mode): [] for name in models for mode in ("train", "infer")}
    for r in range(args.reps + 1):
        order = list(models) if r % 2 else list(reversed(models))
        for mode in ("train", "infer"):
            for name in order:
                t = _step(models[name], opts[name], ids, pad, labels, mode == "train")
                if r:  # round 0 warms up
                    times[(name, mode)].append(t)
    ref, new = list(models)
    title = (f"A classifier on nn.TransformerEncoder (4 layers, d=256, 8 heads, ff 1024, dropout 0.1, batch-first), "
             f"before and after swap_attention: {args.batch} sequences of {args.min_len}-{args.max_len} tokens "
             f"(padding {100 * float(pad.float().mean()):.0f}% at L={L}), float32, {torch.get_num_threads()} "
             f"threads, torch {torch.__version__}; medians of {args.reps} interleaved rounds "
             f"(`python scripts/swap_bench.py reps={args.reps}`). Before timing, the two models' logits and "
             f"gradients differ by at most {same:.1e} (eval logits; train step gradients, dropout 0).")
    lines = [title, "", "| step | original (ms) | swapped (ms) | swapped / original | 95% interval |",
             "|---|---|---|---|---|"]
    for mode, label in (("train", "training step (fwd + bwd + AdamW)"), ("infer", "inference (eval, fused layer)")):
        a, b = times[(ref, mode)], times[(new, mode)]
        lo, hi = _ratio_interval(a, b)
        ratio = statistics.median(np.array(b) / np.array(a))
        lines.append(f"| {label} | {1e3 * statistics.median(a):,.1f} | {1e3 * statistics.median(b):,.1f} | "
                     f"{ratio:.3f}x | {lo:.3f}-{hi:.3f} |")
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    sys.exit(main())
