"""Hydra callbacks of a training run. ``CheckRunDir`` refuses a run dir that cannot be written before Hydra
writes its log there. (The callbacks that write a sweep's analysis: mhalab.analysis.sweep_callbacks.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


def _check_writable(run_dir: str) -> None:
    from mhalab.errors import exit_with
    from mhalab.train.record.rundir import unwritable

    d = Path(run_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        exit_with(unwritable(d, e))


class CheckRunDir(Callback):
    """Hydra writes its own log into the run dir before our code runs: check the dir first, so a read-only
    one is one line (mhalab.errors.exit_with), not Hydra's traceback from its logging set-up."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_writable(str(config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_writable(str(config.hydra.sweep.dir))
