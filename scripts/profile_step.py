"""Where a default training step's time goes: the step's phases as Lightning runs them, then torch.profiler's op
self-times in groups, and the counted FLOP/s beside this CPU's sgemm measured in the same process.

    python scripts/profile_step.py [data=[sst2,imdb]] [steps=100] [out=docs table to stdout] [overrides=[...]]

Each data set trains the default run's model (its config composed as `mhalab-train data=<name>` composes it, the
default callbacks and a CSV logger) through Lightning for warm-up + 2 x `steps` optimizer steps (IMDB: a quarter of
that): the first `steps` are timed by phase alone (no profiler), the next `steps` under torch.profiler for the op
groups. Phases come from the Callback hooks' clock: `data` from the end of one step to the start of the next (the
next batch, the collate, the loop), `forward` zero_grad and training_step (forward, loss, metrics, self.log),
`backward`, `optimizer` (gradient clipping, AdamW, the scheduler), `hooks` the callbacks and loggers after the step.
Op groups are self-times of ATen ops, so they add up without double counting; what is in no op (Python:
Lightning's loop, our modules' Python, the autograd engine's bookkeeping) is the wall time left over. The script
starts again with mimalloc preloaded, as `mhalab-train` does (mhalab.train.allocator; before 2026-12-08 it ran on
glibc's malloc, which made IMDB's first steps slower).
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field

import lightning as L
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.loggers import CSVLogger

from mhalab.analysis.options import doc, emit, parse
from mhalab.errors import one_line_errors
from mhalab.train.allocator import reexec_with_allocator
from mhalab.train.config import CONF_DIR, instantiate  # (and registers the configs' resolvers)
from mhalab.train.run import build

# op name fragments -> group, first match wins (ATen names; self-time of each op)
GROUPS = (
    ("optimizer", ("adamw", "_foreach", "clip_grad", "norm_except", "_fused_adam")),
    ("embedding", ("embedding",)),
    ("attention", ("scaled_dot_product", "softmax", "_flash_attention", "_efficient_attention")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmv", "aten::mv")),
    ("norm / activation / dropout", ("layer_norm", "gelu", "dropout", "bernoulli", "random_", "aten::where")),
    ("loss and metrics", ("cross_entropy", "nll_loss", "log_softmax", "argmax", "aten::eq", "bincount",
                          "aten::sum", "aten::mean")),
    ("copies, views, index (rest of ATen)", ("",)),
)
PHASES = ("data", "forward", "backward", "optimizer", "hooks")


class PhaseClock(L.Callback):
    """Wall time per phase of each training step, from the hooks' order: batch_end -> [data] -> batch_start ->
    [forward] -> before_backward -> [backward] -> after_backward -> [optimizer] -> batch_end' -> [hooks]. Callbacks
    run in the order given: first in the list for the phase starts, its hooks_end twin last for the hooks."""

    def __init__(self, warmup: int, steps: int, profile_steps: int):
        self.warmup, self.steps, self.profile_steps = warmup, steps, profile_steps
        self.t = defaultdict(float)
        self.flops = self.tokens = 0
        self.prof: torch.profiler.profile | None = None
        self._last = self._end = None

    def _timing(self, trainer) -> bool:
        return self.warmup <= trainer.global_step < self.warmup + self.steps

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        now = time.perf_counter()
        if self._end is not None and self._timing(trainer):
            self.t["data"] += now - self._end
        self._last = now

    def on_before_backward(self, trainer, pl_module, loss):
        self._lap(trainer, "forward")

    def on_after_backward(self, trainer, pl_module):
        self._lap(trainer, "backward")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # global_step already counts this step here
        step = trainer.global_step - 1
        if self.warmup <= step < self.warmup + self.steps:
            self.t["optimizer"] += time.perf_counter() - self._last
            self.flops += pl_module.flops_per_batch or 0
            self.tokens += batch["num_tokens"]
        self._last = time.perf_counter()

    def _lap(self, trainer, phase: str) -> None:
        now = time.perf_counter()
        if self._timing(trainer):
            self.t[phase] += now - self._last
        self._last = now


class HooksEnd(L.Callback):
    """Last in the callback list: closes the `hooks` phase (everything after the optimizer step) and drives the
    profiler over the steps after the timed ones."""

    def __init__(self, clock: PhaseClock):
        self.clock = clock

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        c, step = self.clock, trainer.global_step - 1
        now = time.perf_counter()
        if c.warmup <= step < c.warmup + c.steps:
            c.t["hooks"] += now - c._last
        c._end = now
        start = c.warmup + c.steps
        if step == start - 1:
            c.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            c.prof.__enter__()
            c.prof_t0 = time.perf_counter()
        elif step == start + c.profile_steps - 1 and c.prof is not None:
            c.prof_wall = time.perf_counter() - c.prof_t0
            c.prof.__exit__(None, None, None)
            trainer.should_stop = True


def op_groups(prof) -> dict[str, float]:
    """Self CPU seconds of the profiled steps' ATen ops, grouped by GROUPS."""
    out = defaultdict(float)
    for e in prof.key_averages():
        if not e.key.startswith("aten::"):
            continue
        name = e.key.lower()
        group = next(g for g, frags in GROUPS if any(f in name for f in frags))
        out[group] += e.self_cpu_time_total / 1e6
    return out


def sgemm_gflops(m: int, k: int, n: int, reps: int = 50) -> float:
    """This process's float32 matmul throughput on an (m, k) @ (k, n) product, at torch's current threads."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(5):
        a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * m * k * n * reps / (time.perf_counter() - t0) / 1e9


def profile(data: str, steps: int, overrides: tuple[str, ...]) -> dict:
    warmup = 20
    with tempfile.TemporaryDirectory() as out, initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"data={data}", f"paths.output_dir={out}", *overrides])
        dm, module = build(cfg)
        clock = PhaseClock(warmup, steps, steps)
        callbacks = [instantiate(c) for c in cfg.callbacks.values() if c is not None]
        callbacks = [c for c in callbacks if not isinstance(c, L.pytorch.callbacks.ProgressBar)]
        trainer_cfg = {k: v for k, v in cfg.trainer.items() if k not in ("enable_progress_bar", "enable_model_summary")}
        trainer = L.Trainer(**trainer_cfg, enable_progress_bar=False, logger=CSVLogger(out), limit_val_batches=0,
                            callbacks=[clock, *callbacks, HooksEnd(clock)], default_root_dir=out,
                            max_steps=warmup + 2 * steps + 1, enable_model_summary=False)
        trainer.fit(module, datamodule=dm)
    wall = sum(clock.t.values())
    ops = op_groups(clock.prof)
    ops["in no ATen op (Python: Lightning, modules, autograd)"] = max(0.0, clock.prof_wall - sum(ops.values()))
    return {"data": data, "steps": steps, "phases": dict(clock.t), "wall": wall, "ops": dict(ops),
            "prof_wall": clock.prof_wall, "gflops": clock.flops / wall / 1e9, "tokens_per_s": clock.tokens / wall,
            "threads": torch.get_num_threads()}


@dataclass
class ProfileConfig:
    data: list[str] = field(default_factory=lambda: ["sst2", "imdb"], metadata=doc("data sets (train config's data=)"))
    steps: int = field(default=100, metadata=doc("timed steps, then as many profiled (IMDB: a quarter of each)"))
    out: str | None = field(default=None, metadata=doc("write the markdown here"))
    overrides: list[str] = field(default_factory=list, metadata=doc("train config overrides, e.g. [layers=4]"))


def render(rows: list[dict], sgemm: dict[str, float], argv: list[str]) -> str:
    lines = [(f"Where a training step's time goes (`python scripts/profile_step.py {' '.join(argv)}`, "
              f"{rows[0]['threads']} threads)"), "",
             "| data | steps | real tok/s | ms/step | " + " | ".join(PHASES) + " |",
             "|---|---|---|---|" + "---|" * len(PHASES)]
    for r in rows:
        ms = {p: 1e3 * r["phases"].get(p, 0) / r["steps"] for p in PHASES}
        lines.append(f"| {r['data']} | {r['steps']} | {r['tokens_per_s']:,.0f} | {1e3 * r['wall'] / r['steps']:.1f} | "
                     + " | ".join(f"{ms[p]:.1f} ({100 * ms[p] * r['steps'] / 1e3 / r['wall']:.0f}%)"
                                  for p in PHASES) + " |")
    groups = [g for g, _ in GROUPS] + ["in no ATen op (Python: Lightning, modules, autograd)"]
    lines += ["", ("Under torch.profiler (self-time of ATen ops, ms per step; the profiler's own cost inflates "
                   "small ops):"), "", "| group | " + " | ".join(r["data"] for r in rows) + " |",
              "|---|" + "---|" * len(rows)]
    for g in groups:
        cells = [f"{1e3 * r['ops'].get(g, 0) / r['steps']:.1f} ({100 * r['ops'].get(g, 0) / r['prof_wall']:.0f}%)"
                 for r in rows]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    lines.append("| wall, profiled | " + " | ".join(f"{1e3 * r['prof_wall'] / r['steps']:.1f}" for r in rows) + " |")
    lines += ["", "Counted work against this CPU's sgemm (same process, same threads):", "",
              "| | GFLOP/s |", "|---|---|"]
    lines += [f"| {r['data']} step, counted FLOPs (forward + backward) | {r['gflops']:.1f} "
              f"({100 * r['gflops'] / max(sgemm.values()):.0f}% of the best sgemm) |" for r in rows]
    lines += [f"| sgemm {k} | {v:.1f} |" for k, v in sgemm.items()]
    return "\n".join(lines) + "\n"


@one_line_errors
def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(ProfileConfig, argv, "python scripts/profile_step.py", __doc__)
    reexec_with_allocator()  # as mhalab-train does: the step is timed on the allocator runs train on (mimalloc)
    rows = [profile(d, args.steps if d != "imdb" else max(1, args.steps // 4), tuple(args.overrides))
            for d in args.data]
    sgemm = {"760 x 128 x 512 (a step's feed-forward)": sgemm_gflops(760, 128, 512),
             "1024 x 1024 x 1024": sgemm_gflops(1024, 1024, 1024, reps=10)}
    emit(render(rows, sgemm, argv), args.out)


if __name__ == "__main__":
    sys.exit(main())
