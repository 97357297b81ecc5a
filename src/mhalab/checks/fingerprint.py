"""The default run's fingerprint: its training loss at step STEPS, trained as `mhalab-train` trains it but at one
thread (a matmul's sums, and so the last digits, can depend on the thread count; at a fixed count torch on a CPU
repeats itself exactly).

A change that moves the default run's numbers moves this loss. results/default_run/fingerprint.json holds the one
measured beside the committed default run (scripts/default_run.py writes both, from a clean checkout), and
tests/test_fingerprint.py compares this code's with it, digit for digit: such a change fails until its author
re-runs the default run, so README's figure is always this code's.

The last digits can also depend on the CPU kernels torch picks (AVX2, AVX512): a print holds for its environment
(`environment()`). The record keeps the default run's own print and, under `also`, prints measured on other CPUs
(`python scripts/default_run.py fingerprint_only=true` adds this machine's), so the test compares exactly on each.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import torch

STEPS = 100  # the logged training loss of the 100th step (log_every_n_steps 20: steps 19, 39, ..., 99)
OVERRIDES = (f"++trainer.max_steps={STEPS}", "num_threads=1", "test_after_fit=false",
             "trainer.enable_progress_bar=false", "extras.print_config=false", "trainer.accelerator=cpu",
             "trainer.precision=32-true")
FILE = "fingerprint.json"


def environment() -> dict:
    """What the digits depend on beside the code: torch's version and the CPU kernels it picks."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def measure(out: Path, data_dir: str | None = None, cache_dir: str | None = None) -> dict:
    """Train the default config for STEPS steps at one thread into `out` (a new dir); its last logged training loss
    (the exact float the CSV log holds, as text) and the environment."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from mhalab.train.config import CONF_DIR
    from mhalab.train.run import run

    paths = [f"paths.output_dir={out}"] + ([f"paths.data_dir={data_dir}"] if data_dir else []) + (
        [f"paths.cache_dir={cache_dir}"] if cache_dir else [])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[*OVERRIDES, *paths])
    with open_dict(cfg):
        cfg.pop("hydra", None)
    threads = torch.get_num_threads()
    try:
        run(cfg)
    finally:
        torch.set_num_threads(threads)
    log = pd.read_csv(out / "logs" / "metrics.csv", dtype={"train/loss": str})
    last = log.dropna(subset=["train/loss"]).iloc[-1]
    return {"steps": STEPS, "step": int(last["step"]), "train_loss": last["train/loss"], "overrides": list(OVERRIDES),
            **environment()}


def measured_in(print_: dict, env: dict) -> bool:
    """Whether `print_` was measured in environment `env` (environment()'s keys)."""
    return all(print_.get(k) == v for k, v in env.items())


def expected(record: dict, env: dict) -> dict | None:
    """The print in `record` measured in environment `env`: the default run's own or one of `also`; None if none."""
    return next((p for p in (record, *record.get("also", [])) if measured_in(p, env)), None)


def entry(print_: dict) -> dict:
    """A print as the record's `also` keeps it: its commit, its environment and its loss."""
    return {k: print_[k] for k in ("commit", *environment(), "train_loss")}


def other_prints(new: dict, old: dict | None) -> list[dict]:
    """The prints of other environments to keep beside `new`, a new print of the same code or of a later commit:
    those of `old` (its own and its `also`) measured elsewhere whose loss has new's digits. One with other digits
    may be stale, and is dropped: a machine with no print skips the exact comparison until its print is added."""
    here = {k: new[k] for k in environment()}
    prints = [] if old is None else [old, *old.get("also", [])]
    return [entry(p) for p in prints if not measured_in(p, here) and p["train_loss"] == new["train_loss"]]


def read(run_dir: Path) -> dict:
    return json.loads((run_dir / FILE).read_text())


def write(run_dir: Path, print_: dict) -> None:
    (run_dir / FILE).write_text(json.dumps(print_, indent=1) + "\n")

