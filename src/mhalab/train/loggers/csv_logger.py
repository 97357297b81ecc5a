"""Lightning's CSVLogger, continued across the attempts of one run instead of started over.

Lightning's writer deletes an existing logs/metrics.csv when it starts, so a resumed run's file (and
its loss_curves.png) would show only the last attempt. This one keeps the file and, at the first new
row, drops only the rows from `resume_step` on (the checkpoint's global step): the steps the resumed
attempt redoes (after a SIGKILL, those logged after the last checkpoint). The file then reads as one
uninterrupted run, and equals it when the resume is exact (tests/test_faults.py).
"""

from __future__ import annotations

import csv
import os
from typing import Any

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


class _ContinuedWriter(ExperimentWriter):
    def __init__(self, log_dir: str, resume_step: int):
        self.resume_step = resume_step
        super().__init__(log_dir=log_dir)

    def _check_log_dir_exists(self) -> None:  # Lightning's removes metrics.csv here: keep it for now
        self._continuing = os.path.isfile(self.metrics_file_path)

    def log_metrics(self, metrics_dict: dict[str, Any], step: int | None = None) -> None:
        if self._continuing:  # at the first new row, so that a run that logs nothing changes nothing
            self._continuing = False
            self._keep_rows_before(self.resume_step)
        super().log_metrics(metrics_dict, step)

    def _keep_rows_before(self, step: int) -> None:
        with open(self.metrics_file_path, newline="") as f:
            reader = csv.DictReader(f)
            keys = sorted(reader.fieldnames or [])  # Lightning writes its columns sorted
            rows = [r for r in reader if r.get("step") not in (None, "") and int(float(r["step"])) < step]
        tmp = f"{self.metrics_file_path}.tmp"
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.metrics_file_path)
        self.metrics_keys = keys  # new keys make Lightning's save() rewrite the header


class ContinuedCSVLogger(CSVLogger):
    """CSVLogger(save_dir, name, version, ...) whose metrics.csv survives a resume from `resume_step`
    (0: a fresh start, every old row goes)."""

    def __init__(self, *args, resume_step: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.resume_step = resume_step

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuedWriter(log_dir=self.log_dir, resume_step=self.resume_step)
        return self._experiment
