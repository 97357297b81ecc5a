"""The encoder stack on variable-length sequences: ours (attention per sequence on real tokens, nn.varlen)
vs ours on the padded layout vs nn.TransformerEncoder, training step and inference, one process, interleaved.

    python scripts/varlen_stack.py [reps=7] [batch=32] [min_len=50] [max_len=512] [out=results/bench/varlen_stack.md]

The issue's case: 32 sequences of 50-512 tokens (seeded uniform draw), d=256, 4 heads, ff 1024, 2 layers,
dropout 0.1, float32. A training step is forward + backward of the real tokens' outputs (pads excluded); the
three encoders hold the same weights. PyTorch's is built with its default enable_nested_tensor=True, so its
inference skips the pads too (nested tensors); in training it computes every position. Times are medians over `reps` rounds (one warm-up round not timed),
each round timing every encoder once, so drift spreads over all three.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from mhalab.analysis.options import doc, emit, parse
from mhalab.errors import ConfigError, one_line_errors
from mhalab.nn.encoder import TransformerEncoder


@dataclass
class StackConfig:
    reps: int = field(default=7, metadata=doc("timed rounds (medians are reported)"))
    batch: int = field(default=32, metadata=doc("sequences per batch"))
    min_len: int = field(default=50, metadata=doc("shortest sequence"))
    max_len: int = field(default=512, metadata=doc("longest sequence"))
    out: str | None = field(default=None, metadata=doc("write the markdown table here"))


def _step(enc: nn.Module, x: torch.Tensor, kpm: torch.Tensor, train: bool) -> float:
    enc.train(train)
    t0 = time.perf_counter()
    if train:
        y = enc(x, src_key_padding_mask=kpm)
        y.masked_fill(kpm.unsqueeze(-1), 0.0).sum().backward()
    else:
        with torch.inference_mode():
            enc(x, src_key_padding_mask=kpm)
    return time.perf_counter() - t0


@one_line_errors
def main(argv=None) -> None:
    args = parse(StackConfig, sys.argv[1:] if argv is None else argv, "python scripts/varlen_stack.py", __doc__)
    if not 1 <= args.min_len <= args.max_len or args.reps < 1 or args.batch < 1:
        raise ConfigError(f"need 1 <= min_len ({args.min_len}) <= max_len ({args.max_len}), reps >= 1, batch >= 1.")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=g)
    L = int(lengths.max())
    kpm = torch.arange(L)[None, :] >= lengths[:, None]  # (B, L) right padding, True at pads
    sizes = {"num_layers": 2, "embed_dim": 256, "num_heads": 4, "ff_dim": 1024, "dropout": 0.1}
    ours = TransformerEncoder(**sizes, unpad=True)
    padded = TransformerEncoder(**sizes, unpad=False)
    padded.load_state_dict(ours.state_dict())
    # PyTorch's as it comes by default: nested tensors (its own unpadding) in inference
    official = nn.TransformerEncoder(ours.layers[0].to_official(), 2, enable_nested_tensor=True)
    official.layers = ours.to_official().layers
    encoders = {"ours, per sequence (varlen)": ours, "ours, padded layout": padded, "nn.TransformerEncoder": official}
    x = torch.randn(args.batch, L, 256, requires_grad=True)
    times = {(name, mode): [] for name in encoders for mode in ("train", "infer")}
    for r in range(args.reps + 1):
        for name, enc in encoders.items():
            for mode in ("train", "infer"):
                t = _step(enc, x, kpm, mode == "train")
                if r:  # round 0 warms up
                    times[(name, mode)].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    ref = "nn.TransformerEncoder"
    pad = float(kpm.float().mean())
    title = (f"Encoder stack, {args.batch} sequences of {args.min_len}-{args.max_len} tokens (padding "
             f"{100 * pad:.0f}% at L={L}), d=256, 4 heads, ff 1024, 2 layers, dropout 0.1, float32, "
             f"{torch.get_num_threads()} threads; medians of {args.reps} interleaved rounds "
             f"(`python scripts/varlen_stack.py reps={args.reps}`)")
    lines = [title, "",
             "| encoder | training step (ms) | vs official | inference (ms) | vs official |", "|---|---|---|---|---|"]
    for name in encoders:
        tr, inf = med[(name, "train")], med[(name, "infer")]
        lines.append(f"| {name} | {1e3 * tr:,.0f} | {tr / med[(ref, 'train')]:.2f}x | {1e3 * inf:,.0f} | "
                     f"{inf / med[(ref, 'infer')]:.2f}x |")
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    sys.exit(main())
