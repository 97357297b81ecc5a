"""Hydra callbacks. ``ReportCallback`` writes the sweep report (mhalab.analysis.report) when a multirun ends;
``CheckRunDir`` refuses a run dir that cannot be written before Hydra writes its log there.

Enable it in the root config (conf/train.yaml)::

    hydra:
      callbacks:
        report:
          _target_: mhalab.train.hydra_callbacks.ReportCallback
          metric: val/acc      # optional: the validation metric that picks the best setting

A report failure is logged, never raised: the sweep's results are already on disk, and the report can
be re-run by hand with ``python scripts/report.py <sweep dir>``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)


def _sweep_dir(config: DictConfig) -> Path:
    sweep_dir = Path(str(config.hydra.sweep.dir))
    if not sweep_dir.is_absolute() and not sweep_dir.exists():
        # Hydra resolves a relative sweep dir against the launching cwd (hydra.runtime.cwd)
        try:
            cwd = config.hydra.runtime.cwd
        except Exception:  # noqa: BLE001 -- runtime info is optional
            cwd = None
        if cwd:
            sweep_dir = Path(str(cwd)) / sweep_dir
    return sweep_dir


class ReportCallback(Callback):
    """Run ``mhalab.analysis.report.write_report`` on ``config.hydra.sweep.dir`` at the end of a multirun."""

    def __init__(self, metric: str = "val/acc", enabled: bool = True) -> None:
        self.metric = metric
        self.enabled = enabled
        self.last_result: dict | None = None  # what write_report returned (None after a failure)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self.last_result = None
        if not self.enabled:
            return
        sweep_dir = None
        try:
            sweep_dir = _sweep_dir(config)
            from mhalab.analysis.report import write_report

            result = write_report(sweep_dir, metric=self.metric)
            self.last_result = result
            verdicts = ", ".join(f"{v['claim']}: {v['verdict']}" for v in result["verdicts"] if v["covered"])
            best = result["best_setting"]
            log.info("sweep report: %s (%d members, %d finished; best %s)%s", result["report_md"],
                     result["n_members"], result["n_finished"], best["setting"] if best else "none",
                     f"; verdicts: {verdicts}" if verdicts else "")
        except Exception:  # a report failure must never fail the sweep
            log.exception("sweep report for %s failed (the sweep itself is unaffected; re-run with "
                          "`python scripts/report.py <sweep dir>`)", sweep_dir if sweep_dir else "<unknown dir>")


def _check_writable(run_dir: str) -> None:
    from mhalab.cli import exit_with
    from mhalab.train.rundir import unwritable

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
    one is one line (mhalab.cli), not Hydra's traceback from its logging set-up."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_writable(str(config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_writable(str(config.hydra.sweep.dir))
