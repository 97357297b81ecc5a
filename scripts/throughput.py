"""End-to-end training throughput: real (non-pad) tokens per second and the padding fraction, with
length-bucketed batches vs plain shuffled batches vs every batch padded to max_len.

    python scripts/throughput.py [steps=40] [data=[sst2,imdb]] [out=results/bench/throughput.md] [device=cpu]

Each mode trains the same model (the default custom encoder) for `steps` optimizer steps on real
batches from the data set (after 5 warm-up steps), timing data loading, forward, backward and step.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from mhalab.analysis.options import doc, parse
from mhalab.data import TextClassificationDataModule
from mhalab.errors import ConfigError, one_line_errors
from mhalab.model import SequenceClassifier
from mhalab.train.config import CONF_DIR  # (and registers the configs' resolvers)

MODES = {"bucketed": {"bucketing": True, "fixed_len": False}, "shuffled": {"bucketing": False, "fixed_len": False},
         "fixed max_len": {"bucketing": False, "fixed_len": True}}
SIZES = {"sst2": {"batch_size": 64, "max_len": 64}, "imdb": {"batch_size": 32, "max_len": 512}}


def measure(data: str, mode: str, steps: int, device: str) -> dict:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"data={data}", "paths.output_dir=/tmp"])
    kwargs = {k: v for k, v in dict(cfg.data).items() if k != "_target_"}
    kwargs.update(SIZES[data], **MODES[mode])
    dm = TextClassificationDataModule(**kwargs)
    dm.prepare_data()
    dm.setup("fit")
    torch.manual_seed(0)
    model = SequenceClassifier(dm.vocab_size, dm.num_classes, dim=cfg.dim, heads=cfg.heads, layers=cfg.layers,
                               ff_dim=cfg.ff_dim, dropout=cfg.dropout, max_len=SIZES[data]["max_len"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    real = pads = 0
    it = iter(dm.train_dataloader())
    for i in range(steps + 5):
        if i == 5:  # warm-up done
            real = pads = 0
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        batch = {k: v.to(device) for k, v in next(it).items()}
        loss = F.cross_entropy(model(batch["input_ids"], batch["padding_mask"]), batch["labels"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        real += int((~batch["padding_mask"]).sum())
        pads += int(batch["padding_mask"].sum())
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"data": data, "mode": mode, "tokens_per_s": real / seconds, "padding_fraction": pads / (real + pads),
            "s_per_step": seconds / steps}


@dataclass
class ThroughputConfig:
    steps: int = field(default=40, metadata=doc("timed optimizer steps per mode (after 5 warm-up steps)"))
    data: list[str] = field(default_factory=lambda: ["sst2", "imdb"], metadata=doc(f"of {sorted(SIZES)}"))
    device: str | None = field(default=None, metadata=doc("cpu | cuda (default: cuda if available)"))
    out: str | None = field(default=None, metadata=doc("write the markdown table here"))


@one_line_errors
def main(argv=None) -> None:
    args = parse(ThroughputConfig, sys.argv[1:] if argv is None else argv, "python scripts/throughput.py", __doc__)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    bad = [d for d in args.data if d not in SIZES]
    if bad or not args.data or args.steps < 1:
        raise ConfigError(f"data={args.data} must list some of {sorted(SIZES)} and steps={args.steps} be >= 1.")
    rows = [measure(d, m, args.steps, args.device) for d in args.data for m in MODES]
    lines = [(f"Training throughput, default custom encoder, {args.device}, {args.steps} steps per mode "
              f"(`python scripts/throughput.py steps={args.steps}`)"), "",
             "| data (batch, max_len) | batches | real tokens/s | vs bucketed | padding fraction | s/step |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        base = next(b for b in rows if b["data"] == r["data"] and b["mode"] == "bucketed")
        size = SIZES[r["data"]]
        lines.append(f"| {r['data']} ({size['batch_size']}, {size['max_len']}) | {r['mode']} | "
                     f"{r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
                     f"{100 * r['padding_fraction']:.1f}% | {r['s_per_step']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    sys.exit(main())
