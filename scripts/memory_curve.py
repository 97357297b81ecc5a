"""Resident memory over training steps, under the allocator mhalab-train preloads (mimalloc) and under glibc's malloc.

    python scripts/memory_curve.py loop [steps=300] [every=25] [dim=128] [layers=2] [batch=32]   # one allocator
    python scripts/memory_curve.py fit [steps=1400] [allocators=mimalloc,system] [out=results/memory.md]  # IMDB
    python scripts/memory_curve.py parts [steps=200] [data=imdb]   # the baseline, part by part, one process

`loop`: this process trains the default encoder (packed path, as a bucketed run) on random token batches whose
lengths are drawn like IMDB's (log-normal, 10-512 tokens, 32 a batch), a fresh length draw every step, with no
Lightning, data or logging around it; prints one JSON line {"step", "rss_mb", "s"} every `every` steps. Its
allocator is the one it was started with (MHALAB_ALLOCATOR / LD_PRELOAD): `fit` and tests/test_memory.py start it
both ways.
`fit`: `mhalab-train data=imdb ++trainer.max_steps=<steps>` (one thread, no test), with each allocator named (mimalloc,
the default; system, glibc's malloc), one after the other; reads each run's perf/rss_mb curve (MemoryMonitor)
and writes the table: RSS at steps 200, 400, ... and the last, the growth from step 200, and the wall time.
`parts`: where a run's resident memory goes, in one process under mimalloc (as mhalab-train runs): RSS after the
imports, after the data (tokenizer and encoded splits, from the cache), after the model, after the first training
step (gradients, AdamW's two moments, the first activations) and after `steps` steps of a Lightning fit (the
activations of the longest batches, which the allocator keeps for reuse), each beside the bytes it must hold.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mhalab.analysis.options import doc, parse
from mhalab.errors import ConfigError, one_line_errors

REPO = Path(__file__).resolve().parents[1]


@dataclass
class LoopConfig:
    steps: int = field(default=300, metadata=doc("training steps"))
    every: int = field(default=25, metadata=doc("print the RSS every this many steps"))
    dim: int = field(default=128, metadata=doc("model width (4 heads, ff 4 x dim)"))
    layers: int = field(default=2, metadata=doc("encoder layers"))
    batch: int = field(default=32, metadata=doc("sequences per batch"))
    seed: int = field(default=0, metadata=doc("seed of the weights and the length draws"))


@dataclass
class FitConfig:
    steps: int = field(default=1400, metadata=doc("trainer.max_steps of each IMDB run"))
    out: str = field(default="results/memory.md", metadata=doc("write the markdown table here"))
    data_dir: str = field(default="", metadata=doc("paths.data_dir (empty: the run's default)"))
    allocators: str = field(default="mimalloc,system", metadata=doc("MHALAB_ALLOCATOR of each run, in order"))


@dataclass
class PartsConfig:
    steps: int = field(default=200, metadata=doc("training steps of the fit (the default run's settings)"))
    data: str = field(default="imdb", metadata=doc("the data set (its cache is built first if missing)"))


def parts(argv: list[str]) -> None:
    from mhalab.train.allocator import reexec_with_allocator

    a = dataclasses.asdict(parse(PartsConfig, argv, "python scripts/memory_curve.py parts", __doc__))
    reexec_with_allocator()  # as mhalab-train: the process starts again with mimalloc preloaded
    from mhalab.train.callbacks.memory import current_rss_mb

    rows = [("python", current_rss_mb(), "")]
    import lightning as L
    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from mhalab.train.config import CONF_DIR
    from mhalab.train.run import build

    rows.append(("imports (torch, lightning, hydra, mhalab)", current_rss_mb(), ""))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"data={a['data']}", "num_threads=1", "trainer=cpu"])
    with open_dict(cfg):
        cfg.pop("hydra", None)
    dm, module = build(cfg)  # the run's own builder: the data (tokenizer, encoded splits from the cache), the model
    held = sum(t.nbytes for sp in dm.splits.values() for t in vars(sp).values() if isinstance(t, torch.Tensor))
    params = sum(p.numel() for p in module.parameters())
    rows.append(("data and model (build: tokenizer, encoded splits, weights)", current_rss_mb(),
                 f"ids, lengths, labels: {held / 2**20:.0f} MB; {params / 1e6:.2f} M weights: {params * 4 / 2**20:.0f} MB"))

    class Mark(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                rows.append(("first step (grads, AdamW moments, activations)", current_rss_mb(),
                             f"grads + 2 moments: {3 * params * 4 / 2**20:.0f} MB"))

    trainer = L.Trainer(max_steps=a["steps"], accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[Mark()])
    trainer.fit(module, dm)
    rows.append((f"after {a['steps']} steps (the longest batches' activations, kept for reuse)", current_rss_mb(), ""))
    lines = [f"| part ({a['data']}, default model, one thread, mimalloc) | RSS after (MB) | added (MB) | held |",
             "|---|---|---|---|"]
    for (name, rss, note), prev in zip(rows, [0.0, *[r[1] for r in rows]], strict=False):
        lines.append(f"| {name} | {rss:.0f} | {rss - prev:+.0f} | {note} |")
    print("\n".join(lines))


def loop(argv: list[str]) -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from mhalab.model import SequenceClassifier
    from mhalab.nn.varlen import SeqLens
    from mhalab.train.callbacks.memory import current_rss_mb

    a = dataclasses.asdict(parse(LoopConfig, argv, "python scripts/memory_curve.py loop", __doc__))
    torch.set_num_threads(1)
    torch.manual_seed(a["seed"])
    rng = np.random.default_rng(a["seed"])
    model = SequenceClassifier(8000, 2, dim=a["dim"], heads=4, layers=a["layers"], ff_dim=4 * a["dim"], dropout=0.2,
                               max_len=512, dropout_draw="16bit")  # as the framework's runs draw their masks
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    for step in range(1, a["steps"] + 1):
        lengths = np.minimum(rng.lognormal(5.3, 0.6, a["batch"]).astype(int) + 10, 512)
        lengths = sorted(lengths.tolist(), reverse=True)  # a bucketed batch's order
        ids = torch.randint(1, 8000, (sum(lengths),))  # (N,) packed
        loss = F.cross_entropy(model(ids, seqlens=SeqLens(lengths)), torch.randint(0, 2, (a["batch"],)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % a["every"] == 0:
            print(json.dumps({"step": step, "rss_mb": round(current_rss_mb(), 1),
                              "s": round(time.perf_counter() - t0, 2)}), flush=True)


def _rss_curve(run: Path) -> dict[int, float]:
    import pandas as pd

    log = pd.read_csv(next(run.glob("**/metrics.csv")))
    rows = log.dropna(subset=["perf/rss_mb"])
    return {int(s) + 1: float(v) for s, v in zip(rows["step"], rows["perf/rss_mb"])}


def fit(argv: list[str]) -> None:
    a = dataclasses.asdict(parse(FitConfig, argv, "python scripts/memory_curve.py fit", __doc__))
    rows, cmd_shown = [], None
    for allocator in a["allocators"].split(","):
        run = REPO / "outputs" / f"memory-{allocator}"
        cmd = [sys.executable, str(REPO / "train.py"), "data=imdb", "num_threads=1", f"++trainer.max_steps={a['steps']}",
               "test_after_fit=false", "trainer.enable_progress_bar=false", "callbacks.progress_bar=null",
               f"hydra.run.dir={run}", *([f"paths.data_dir={a['data_dir']}"] if a["data_dir"] else [])]
        cmd_shown = " ".join(cmd[2:-1])
        t0 = time.time()
        subprocess.run(cmd, env=dict(os.environ, MHALAB_ALLOCATOR=allocator), check=True, cwd=REPO)
        curve = _rss_curve(run)
        steps = sorted(curve)
        at = {s: curve[s] for s in steps if s % 200 == 0 or s == steps[-1]}
        rows.append((allocator, at, time.time() - t0))
    marks = sorted(set().union(*(r[1] for r in rows)))
    title = (f"Resident memory (GiB) of an IMDB fit, `python train.py {cmd_shown}` with MHALAB_ALLOCATOR=mimalloc "
             f"(the default) and =system (glibc's malloc), one after the other, nothing else running "
             f"(`python scripts/memory_curve.py fit steps={a['steps']} allocators={a['allocators']}`)")
    lines = [title, "",
             "| allocator | " + " | ".join(f"step {s}" for s in marks) + " | last / step 200 | wall (min) |",
             "|---|" + "---|" * (len(marks) + 2)]
    for allocator, at, wall in rows:
        first, last = at.get(200), at[max(at)]
        ratio = f"{last / first:.2f}x" if first else "n/a"
        lines.append(f"| {allocator} | " + " | ".join(f"{at[s] / 1024:.2f}" if s in at else "" for s in marks)
                     + f" | {ratio} | {wall / 60:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(a["out"]).write_text(text)


@one_line_errors
def main(argv: list[str]) -> None:
    mode, *rest = argv or ["loop"]
    if mode not in ("loop", "fit", "parts"):
        raise ConfigError(f"unknown mode {mode!r}: python scripts/memory_curve.py loop|fit|parts [key=value ...]")
    {"loop": loop, "fit": fit, "parts": parts}[mode](rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
