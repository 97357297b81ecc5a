"""End-to-end training throughput: real (non-pad) tokens per second and the padding fraction of the batches,
for each data.batching: length-bucketed, plain shuffled (padded), and packed (shuffled, back to back).

    python scripts/throughput.py [steps=40] [data=[sst2,imdb]] [out=results/bench/throughput.md] [device=cpu]
    python scripts/throughput.py compile=true modes=[bucketed,packed]   # compile=true's model beside eager
    python scripts/throughput.py adamw_loop=true                        # fused AdamW beside PyTorch's CPU loop
    python scripts/throughput.py compile=true bf16=true device=cuda     # on a GPU, as trainer=gpu trains (the GPU check)

Each mode trains its own copy of the same model (the default custom encoder, same initial weights) on real
batches from the data set, called as the LightningModule calls it (with the collate's seqlens), timing
data loading, forward, backward and step. The modes are interleaved, `CHUNK` steps at a time, so that a
machine's drift spreads over all of them; 5 warm-up steps per mode are not timed. compile=true adds, for each
mode, a copy whose encoder layers are compiled as a compile=true run compiles them (compile_positionwise), in the
same interleaving; its warm-up (the compilation) is not timed.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from mhalab.analysis.options import doc, emit, parse
from mhalab.data import TextClassificationDataModule
from mhalab.errors import ConfigError, one_line_errors
from mhalab.model import SequenceClassifier
from mhalab.train.config import CONF_DIR  # (and registers the configs' resolvers)
from mhalab.train.optimizer import FUSED_ADAMW

MODES = ("bucketed", "shuffled", "packed")  # data.batching
SIZES = {"sst2": {"batch_size": 64, "max_len": 64}, "imdb": {"batch_size": 32, "max_len": 512}}
WARMUP, CHUNK = 5, 5


class _Mode:
    """One batching mode's loader, model and optimizer, stepped a few batches at a time."""

    def __init__(self, data: str, mode: str, device: str, compiled: bool = False, fused: bool = True,
                 overrides: tuple[str, ...] = (), bf16: bool = False):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=[f"data={data}", "paths.output_dir=/tmp", *overrides])
        kwargs = {k: v for k, v in dict(cfg.data).items() if k != "_target_"}
        kwargs.update(SIZES[data], batching=mode)
        dm = TextClassificationDataModule(**kwargs)
        dm.prepare_data()
        dm.setup("fit")
        torch.manual_seed(0)
        self.model = SequenceClassifier(dm.vocab_size, dm.num_classes, dim=cfg.dim, heads=cfg.heads,
                                        layers=cfg.layers, ff_dim=cfg.ff_dim, dropout=cfg.dropout,
                                        max_len=SIZES[data]["max_len"]).to(device)
        if compiled:
            self.model.compile_positionwise()
        # fused where a run fuses it (FUSED_ADAMW); fused=False: PyTorch's per-parameter loop, the CPU default
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=fused and device in FUSED_ADAMW)
        loader = dm.train_dataloader()  # epoch after epoch (a small data set runs out of batches)
        self.batches, self.device = itertools.chain.from_iterable(itertools.repeat(loader)), device
        self.data, self.mode, self.compiled, self.fused, self.bf16 = data, mode, compiled, fused, bf16
        self.seconds = self.real = self.pads = self.steps = self.warmup_s = 0

    def run(self, steps: int, timed: bool = True) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        real = pads = 0
        for _ in range(steps):
            batch = next(self.batches)
            ids = batch["input_ids"].to(self.device)
            mask = batch["padding_mask"].to(self.device) if "padding_mask" in batch else None
            with torch.autocast(self.device, torch.bfloat16, enabled=self.bf16):  # as trainer.precision=bf16-mixed
                logits = self.model(ids, mask, seqlens=batch["seqlens"])
                loss = F.cross_entropy(logits, batch["labels"].to(self.device))
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            real += batch["num_tokens"]
            pads += ids.numel() - batch["num_tokens"]
        if self.device == "cuda":
            torch.cuda.synchronize()
        if not timed:  # the warm-up: a compiled copy's compilation is in it
            self.warmup_s += time.perf_counter() - t0
        else:
            self.seconds += time.perf_counter() - t0
            self.real, self.pads, self.steps = self.real + real, self.pads + pads, self.steps + steps

    def row(self) -> dict:
        return {"data": self.data, "mode": self.mode, "compiled": self.compiled, "fused": self.fused,
                "bf16": self.bf16, "device": self.device, "warmup_s": self.warmup_s, "tokens_per_s": self.real / self.seconds,
                "padding_fraction": self.pads / (self.real + self.pads), "s_per_step": self.seconds / self.steps}


def measure(data: str, steps: int, device: str, modes: list[str] = MODES, compiled: bool = False,
            adamw_loop: bool = False, overrides: tuple[str, ...] = (), bf16: bool = False) -> list[dict]:
    """Every mode on `data` (and its compiled copy, and its copy with AdamW's loop), interleaved CHUNK steps at a
    time, `steps` timed steps each."""
    variants = [(False, True), *([(True, True)] if compiled else []), *([(False, False)] if adamw_loop else [])]
    modes = [_Mode(data, m, device, c, f, tuple(overrides), bf16) for m in modes for c, f in variants]
    for m in modes:
        m.run(WARMUP, timed=False)
    for start in range(0, steps, CHUNK):
        for m in modes:
            m.run(min(CHUNK, steps - start))
    return [m.row() for m in modes]


@dataclass
class ThroughputConfig:
    steps: int = field(default=40, metadata=doc("timed optimizer steps per mode (after 5 warm-up steps)"))
    data: list[str] = field(default_factory=lambda: ["sst2", "imdb"], metadata=doc(f"of {sorted(SIZES)}"))
    device: str | None = field(default=None, metadata=doc("cpu | cuda (default: cuda if available)"))
    out: str | None = field(default=None, metadata=doc("write the markdown table here"))
    modes: list[str] = field(default_factory=lambda: list(MODES), metadata=doc(f"data.batching modes, of {MODES}"))
    compile: bool = field(default=False, metadata=doc("also time each mode compiled as compile=true compiles it"))
    adamw_loop: bool = field(default=False, metadata=doc("also time each mode with AdamW's per-parameter loop "
                                                         "(PyTorch's CPU default) instead of its fused kernel"))
    bf16: bool = field(default=False, metadata=doc("bf16 autocast around forward and loss, as trainer.precision="
                                                   "bf16-mixed trains"))
    overrides: list[str] = field(default_factory=list, metadata=doc(
        "overrides of the train config the models and data are built from, e.g. [paths.data_dir=DIR,layers=1] "
        "(batch_size and max_len stay the data set's, as in SIZES)"))
    json: str | None = field(default=None, metadata=doc("write the rows (one dict per model) as JSON here"))


@one_line_errors
def main(argv=None) -> None:
    args = parse(ThroughputConfig, sys.argv[1:] if argv is None else argv, "python scripts/throughput.py", __doc__)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    bad = [d for d in args.data if d not in SIZES] + [m for m in args.modes if m not in MODES]
    if bad or not args.data or not args.modes or args.steps < 1:
        raise ConfigError(f"data={args.data} must list some of {sorted(SIZES)}, modes={args.modes} some of "
                          f"{list(MODES)}, and steps={args.steps} be >= 1.")
    rows = [r for d in args.data for r in measure(d, args.steps, args.device, args.modes, args.compile,
                                                  args.adamw_loop, tuple(args.overrides), args.bf16)]
    lines = [(f"Training throughput, default custom encoder, {args.device}{', bf16 autocast' if args.bf16 else ''}, "
              f"{args.steps} steps per mode, "
              f"interleaved {CHUNK} at a time (`python scripts/throughput.py "
              f"{' '.join(sys.argv[1:] if argv is None else argv) or f'steps={args.steps}'}`)"), "",
             ("| data (batch, max_len) | batches | compiled | AdamW | real tokens/s | vs eager | vs bucketed "
              "| padding fraction | s/step |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:  # beside the eager, fused row of its data (and mode)
        first = next(b for b in rows if b["data"] == r["data"] and not b["compiled"] and b["fused"])
        eager = next(b for b in rows if b["data"] == r["data"] and b["mode"] == r["mode"] and not b["compiled"]
                     and b["fused"])
        size = SIZES[r["data"]]
        lines.append(f"| {r['data']} ({size['batch_size']}, {size['max_len']}) | {r['mode']} | "
                     f"{'yes' if r['compiled'] else 'no'} | {'fused' if r['fused'] else 'loop'} | "
                     f"{r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s'] / eager['tokens_per_s']:.2f}x | "
                     f"{r['tokens_per_s'] / first['tokens_per_s']:.2f}x | "
                     f"{100 * r['padding_fraction']:.1f}% | {r['s_per_step']:.3f} |")
    emit("\n".join(lines) + "\n", args.out)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
