"""Lightning callbacks: runs that survive interruption and resume exactly; PerfMonitor, a fit's time per step
and peak memory (on in sweep=lra / sweep=lra_gpu)."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from mhalab.train.memory import current_rss_mb, peak_memory_mb, reset_peak_memory

log = logging.getLogger("mhalab")


class GracefulStop(L.Callback):
    """Ctrl-C and SIGTERM stop training between batches and save `last.ckpt` there: a resume is exact.

    Lightning turns SIGTERM (a cluster's pre-emption) into SIGTERMException once the batch under way has
    finished and been logged. A Ctrl-C would raise KeyboardInterrupt wherever it lands, mid-batch, and a
    checkpoint saved then sits between two states (a resumed run ended 1-2 points off). So while training,
    a Ctrl-C only sets a flag, and the stop is handed to that same SIGTERM path at the next batch's end,
    or, when a validation follows that batch, at the validation's end: Lightning resumes a run stopped
    inside a validation without finishing it (that epoch's val metrics and best checkpoint would be
    missing), so a SIGTERM that lands inside one saves nothing and the run resumes, exactly, from the
    last checkpoint on disk (every epoch and every N steps). A second Ctrl-C stops at once, unsaved.
    """

    def __init__(self, dirpath: str | Path):
        self.dirpath = Path(dirpath)
        self.ctrl_c = False  # the stop came from the keyboard (the run's record says so)
        self._sent = False
        self._previous_handler = None

    def _on_sigint(self, signum, frame) -> None:
        if self.ctrl_c:  # the second Ctrl-C
            self._restore()
            raise KeyboardInterrupt
        self.ctrl_c = True
        log.warning("Ctrl-C: stopping after this batch (or the validation under way) and saving last.ckpt; "
                    "press Ctrl-C again to stop at once")

    def _stop(self) -> None:
        if self.ctrl_c and not self._sent:
            self._sent = True
            os.kill(os.getpid(), signal.SIGTERM)  # Lightning's own graceful stop (its SIGTERM handler)

    def on_train_start(self, trainer, pl_module):
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._previous_handler = signal.signal(signal.SIGINT, self._on_sigint)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not _validation_follows(trainer, batch_idx):
            self._stop()

    def on_validation_end(self, trainer, pl_module):
        if trainer.state.fn == "fit":
            self._stop()

    def on_train_end(self, trainer, pl_module):
        self._restore()

    def _restore(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGINT, self._previous_handler)
            self._previous_handler = None

    def on_exception(self, trainer, pl_module, exception):
        self._restore()
        if not isinstance(exception, SIGTERMException) or trainer.state.fn != "fit":
            return
        if trainer.validating:
            log.warning("SIGTERM inside a validation: nothing saved here; the run resumes from the last "
                        "checkpoint on disk and redoes the steps since, exactly")
            return
        path = self.dirpath / "last.ckpt"
        trainer.save_checkpoint(path, weights_only=False)  # the whole state: optimizer, loops, callbacks
        log.warning("interrupted at global step %d; saved %s", trainer.global_step, path)


def _validation_follows(trainer: L.Trainer, batch_idx: int) -> bool:
    """Whether Lightning runs a validation right after this training batch (its val_check rules)."""
    if not trainer.enable_validation or trainer.limit_val_batches == 0:
        return False
    every = trainer.check_val_every_n_epoch
    if every is not None and (trainer.current_epoch + 1) % every:
        return False
    last = batch_idx + 1 >= trainer.num_training_batches
    interval = trainer.val_check_batch
    return last or (isinstance(interval, int) and interval > 0 and (batch_idx + 1) % interval == 0)


def _numpy_state_to_safe(state: tuple) -> list:
    # numpy arrays are refused by torch.load(weights_only=True), which Lightning uses: store a tensor
    name, keys, pos, has_gauss, cached = state
    return [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]


def _numpy_state_from_safe(state: list) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return name, keys.numpy().astype(np.uint32), pos, has_gauss, cached


class ResumeState(L.Callback):
    """Save what Lightning does not: the RNG states (dropout masks depend on them).

    The batch sampler's position is saved by the datamodule's own state_dict. With both, a run
    resumed from a mid-epoch checkpoint sees the same batches and the same dropout masks as the
    run that was never stopped.
    """

    def state_dict(self):  # Lightning stores a callback's state_dict in the checkpoint
        return {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["resume_state"] = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "numpy": _numpy_state_to_safe(np.random.get_state()),
            "python": random.getstate(),
        }

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self._pending = checkpoint.get("resume_state")

    def on_train_start(self, trainer, pl_module):
        st = getattr(self, "_pending", None)
        if not st:
            return
        torch.set_rng_state(st["torch"])
        if st["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(st["cuda"])
        np.random.set_state(_numpy_state_from_safe(st["numpy"]))
        random.setstate(st["python"])
        self._pending = None


class SimulateSignal(L.Callback):
    """Send this process a signal after global step `at_step` (debug=preempt): SIGTERM as a cluster's
    pre-emption, SIGINT as a Ctrl-C, SIGKILL as the OOM killer or a lost machine (no chance to save).
    `in_validation`: send it inside the validation that follows that step (after its first batch)."""

    def __init__(self, at_step: int, signal: str = "SIGTERM", in_validation: bool = False):
        self.at_step, self.signum, self.in_validation = at_step, _signal(signal), in_validation

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.in_validation and trainer.global_step == self.at_step and trainer.is_global_zero:
            os.kill(os.getpid(), self.signum)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if (self.in_validation and trainer.state.fn == "fit" and trainer.global_step == self.at_step
                and batch_idx == 0 and trainer.is_global_zero):
            os.kill(os.getpid(), self.signum)


def _signal(name: str) -> int:
    if name not in ("SIGTERM", "SIGINT", "SIGKILL"):
        raise ValueError(f"signal={name!r}: choose SIGTERM, SIGINT or SIGKILL.")
    return getattr(signal, name)


class PerfMonitor(L.Callback):
    """Median / mean training step time and peak memory of the fit, into perf.json and the loggers.

    Times every training step (forward + backward + optimizer; CUDA-synchronised; the first `warmup`
    steps are left out) and records peak memory over the fit (mhalab.train.memory: CUDA's allocator
    peak, or on CPU the process's peak resident set, reset at fit start so sweep members that share one
    process are measured separately). Logs perf/step_ms and perf/peak_mem_mb; writes `perf.json` into
    the run's output dir (read by mhalab.analysis.lra's table).
    """

    def __init__(self, warmup: int = 3, filename: str = "perf.json"):
        self.warmup, self.filename = warmup, filename
        self._all_times: list[float] = []
        self._t0: float | None = None
        self._reset_ok = False
        self.baseline_mb = math.nan
        self.result: dict[str, Any] = {}

    def _sync(self, pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_fit_start(self, trainer, pl_module):
        self._all_times = []
        self.baseline_mb = (torch.cuda.memory_allocated(pl_module.device) / 2**20 if pl_module.device.type == "cuda"
                            else current_rss_mb())
        self._reset_ok = reset_peak_memory(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._sync(pl_module)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._t0 is None:
            return
        self._sync(pl_module)
        self._all_times.append(time.perf_counter() - self._t0)
        self._t0 = None

    @property
    def step_times(self) -> list[float]:
        """Step times after the warm-up (for a run shorter than that: all but the first, or all)."""
        t = self._all_times
        return t[self.warmup:] if len(t) > self.warmup else (t[1:] or t)

    def summary(self, pl_module) -> dict[str, Any]:
        peak, kind = peak_memory_mb(pl_module.device)
        if not self._reset_ok and kind == "cpu_peak_rss":
            kind = "cpu_lifetime_peak_rss"
        times = self.step_times
        return {
            "step_time_s": statistics.median(times) if times else math.nan,
            "step_time_mean_s": statistics.fmean(times) if times else math.nan,
            "steps_timed": len(times), "warmup_steps": self.warmup,
            "peak_mem_mb": peak, "peak_mem_kind": kind, "baseline_mem_mb": self.baseline_mb,
            "device": str(pl_module.device),
            "device_name": torch.cuda.get_device_name(pl_module.device) if pl_module.device.type == "cuda" else "cpu",
            "torch_threads": torch.get_num_threads(),
        }

    def on_train_epoch_end(self, trainer, pl_module):
        s = self.summary(pl_module)
        if not math.isnan(s["step_time_s"]):
            pl_module.log("perf/step_ms", 1000 * s["step_time_s"])
        pl_module.log("perf/peak_mem_mb", s["peak_mem_mb"])

    def on_fit_end(self, trainer, pl_module):
        self.result = self.summary(pl_module)
        if trainer.is_global_zero:
            path = Path(trainer.default_root_dir) / self.filename
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.result, indent=2))
            os.replace(tmp, path)


class MemoryMonitor(L.Callback):
    """The process's memory as a training curve, logged with the loss (every trainer.log_every_n_steps): on CPU
    perf/rss_mb, the resident set; on CUDA perf/cuda_allocated_mb and perf/cuda_reserved_mb, what tensors hold and
    what the caching allocator keeps (reserved far above allocated: fragmentation by varying shapes). A run whose
    memory grows step after step shows it here before the kernel's OOM killer ends it. (Which malloc the process
    runs on, mhalab.train.allocator, is in metrics.json's provenance.)"""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.device.type == "cuda":
            pl_module.log("perf/cuda_allocated_mb", torch.cuda.memory_allocated(pl_module.device) / 2**20)
            pl_module.log("perf/cuda_reserved_mb", torch.cuda.memory_reserved(pl_module.device) / 2**20)
        else:
            pl_module.log("perf/rss_mb", current_rss_mb())
