"""Hydra callbacks that write a sweep's analysis when its multirun ends: ``ReportCallback`` (the sweep
report, mhalab.analysis.report) and ``LRATableCallback`` (the LRA table, mhalab.analysis.lra).

conf/train.yaml enables the report for every multirun; sweep=lra and sweep=lra_gpu add the table::

    hydra:
      callbacks:
        report:
          _target_: mhalab.analysis.sweep_callbacks.ReportCallback
          metric: val/acc      # optional: the validation metric that picks the best setting

A failure is logged, never raised: the sweep's results are already on disk, and the analysis can be
re-run by hand (``mhalab-report <sweep dir>``, ``python scripts/lra_table.py <sweep dir>``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)


def sweep_dir(config: DictConfig) -> Path:
    """config.hydra.sweep.dir; a relative one against the launching cwd (hydra.runtime.cwd), as Hydra does."""
    d = Path(str(config.hydra.sweep.dir))
    if not d.is_absolute() and not d.exists():
        try:
            cwd = config.hydra.runtime.cwd
        except Exception:  # noqa: BLE001 -- runtime info is optional
            cwd = None
        if cwd:
            d = Path(str(cwd)) / d
    return d


class ReportCallback(Callback):
    """Run ``mhalab.analysis.report.write_report`` on ``config.hydra.sweep.dir`` at the end of a multirun."""

    def __init__(self, metric: str | None = None, enabled: bool = True) -> None:  # None: the report's default
        self.metric = metric
        self.enabled = enabled
        self.last_result: dict | None = None  # what write_report returned (None after a failure)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self.last_result = None
        if not self.enabled:
            return
        where = None
        try:
            where = sweep_dir(config)
            from mhalab.analysis.report import (  # pandas: when a sweep ends
                DEFAULT_METRIC,
                best_line,
                write_report,
            )

            result = write_report(where, metric=self.metric or DEFAULT_METRIC)
            self.last_result = result
            verdicts = ", ".join(f"{v['claim']}: {v['verdict']}" for v in result["verdicts"] if v["covered"])
            log.info("sweep report: %s (%d members, %d finished; %s)%s", result["report_md"],
                     result["n_members"], result["n_finished"], best_line(result),
                     f"; verdicts: {verdicts}" if verdicts else "")
        except Exception:  # a report failure must never fail the sweep
            log.exception("sweep report for %s failed (the sweep itself is unaffected; re-run with "
                          "`mhalab-report <sweep dir>`)", where if where else "<unknown dir>")


class LRATableCallback(Callback):
    """Write <sweep dir>/lra_table.md (mhalab.analysis.lra.write_lra_table) at the end of a multirun."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            from mhalab.analysis.lra import write_lra_table

            res = write_lra_table(sweep_dir(config))
            log.info("LRA table: %s", res["markdown"])
        except Exception:  # a table failure must never fail the sweep
            log.exception("LRA table failed (re-run: mhalab-lra-table <sweep dir>)")
