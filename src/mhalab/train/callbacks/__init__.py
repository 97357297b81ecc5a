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

from mhalab.train.callbacks.memory import current_rss_mb, peak_memory_mb, reset_peak_memory
from mhalab.train.log_steps import loggers_write

log = logging.getLogger("mhalab")


# where Lightning's SIGTERM handler logs "Received SIGTERM: 15" (lightning.pytorch.trainer.connectors.signal_connector)
SIGNAL_LOG = "lightning.pytorch.trainer.connectors.signal_connector"


class _NoSigtermNote(logging.Filter):
    """Drops Lightning's "Received SIGTERM" line: on for the one call that hands it a Ctrl-C, which is no SIGTERM."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Received SIGTERM" not in record.getMessage()


class GracefulStop(L.Callback):
    """Ctrl-C and SIGTERM stop training between batches and save `last.ckpt` there: a resume is exact.

    While training, both signals only set a flag: a signal handler that did more could land anywhere, mid-batch
    or inside a collective. The ranks agree on the flags (one `reduce_boolean_decision`, a no-op in one process)
    at points every rank reaches together, so a signal that reached one rank stops them all at the same batch,
    and there every rank hands the stop to Lightning's own SIGTERM path (its handler, called, not signalled):
    Lightning raises SIGTERMException once that batch is finished and logged, and `on_exception` saves the
    whole state. (Lightning's handler broadcasts from rank 0, so it must run on every rank at one point; run by a
    signal that lands at any moment, it pairs with whatever collective another rank is in, and DDP hangs.)
    - A Ctrl-C stops at the end of a batch, or, when a validation follows that batch, at the validation's end:
      Lightning resumes a run stopped inside a validation without finishing it (that epoch's val metrics and best
      checkpoint would be missing).
    - A SIGTERM (a cluster's pre-emption, whose grace is short) stops at the end of the batch under way,
      validation batches included: inside a validation it saves nothing, and the run resumes, exactly, from the
      last checkpoint on disk (every epoch and every N steps).
    A second Ctrl-C stops at once, unsaved.
    """

    def __init__(self, dirpath: str | Path):
        self.dirpath = Path(dirpath)
        self.ctrl_c = False  # the stop came from the keyboard (the run's record says so)
        self.sigterm = False
        self._handed = False
        self._previous: dict[int, Any] = {}

    def _on_sigint(self, signum, frame) -> None:
        if self.ctrl_c:  # the second Ctrl-C
            self._restore()
            raise KeyboardInterrupt
        self.ctrl_c = True
        log.warning("Ctrl-C: stopping after this batch (or the validation under way) and saving last.ckpt; "
                    "press Ctrl-C again to stop at once")

    def _on_sigterm(self, signum, frame) -> None:
        self.sigterm = True

    def on_train_start(self, trainer, pl_module):
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for signum, handler in ((signal.SIGINT, self._on_sigint), (signal.SIGTERM, self._on_sigterm)):
                self._previous[signum] = signal.signal(signum, handler)

    def _stop_if_asked(self, trainer, asked: bool) -> None:
        """On every rank at once: if any rank was asked to stop, hand the stop to Lightning."""
        if self._handed or not trainer.strategy.reduce_boolean_decision(asked, all=False):
            return
        self._handed = True
        lightning_handler = self._previous.get(signal.SIGTERM)
        if not callable(lightning_handler):  # Lightning installed none (not the main thread): stop here
            raise SIGTERMException
        note = _NoSigtermNote() if self.ctrl_c and not self.sigterm else None  # a Ctrl-C is told as one (above)
        if note:
            logging.getLogger(SIGNAL_LOG).addFilter(note)
        try:
            lightning_handler(signal.SIGTERM, None)  # sets trainer.received_sigterm; Lightning raises when it may
        finally:
            if note:
                logging.getLogger(SIGNAL_LOG).removeFilter(note)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._stop_if_asked(trainer, self.sigterm or self.ctrl_c and not _validation_follows(trainer, batch_idx))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._stop_if_asked(trainer, self.sigterm)

    def on_validation_end(self, trainer, pl_module):
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._stop_if_asked(trainer, self.ctrl_c or self.sigterm)

    def on_train_end(self, trainer, pl_module):
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def on_exception(self, trainer, pl_module, exception):
        # SIGINT only: a SIGTERM that Lightning's handler forwarded to the other ranks may still be on its way, and
        # must find ours (a flag); Lightning's teardown puts back the handler from before the fit
        if signal.SIGINT in self._previous and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._previous.pop(signal.SIGINT))
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
    """Save what Lightning does not: every rank's RNG states (dropout masks depend on them).

    Each rank draws its own dropout masks, so each rank's states (torch, CUDA, numpy, python) are gathered
    into the checkpoint (rank 0 writes it) and each rank restores its own: a DDP run resumed mid-epoch draws
    what the run never stopped would have drawn. The batch sampler's position is saved by the datamodule's
    own state_dict; it is one position for all ranks (the sampler deals every rank the same number of
    batches and the ranks step together), which every save checks. With both, a run resumed from a
    mid-epoch checkpoint sees the same batches and the same dropout masks as the run that was never stopped.
    """

    def state_dict(self):  # Lightning stores a callback's state_dict in the checkpoint
        return {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        mine = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(pl_module.device) if pl_module.device.type == "cuda" else None,
            "numpy": _numpy_state_to_safe(np.random.get_state()),
            "python": random.getstate(),
            "batches": trainer.fit_loop.epoch_loop.batch_progress.current.processed,
        }
        ranks = _gather(mine)  # Lightning calls this hook on every rank, together
        if len({r["batches"] for r in ranks}) > 1:  # a bug, not a user's mistake: the sampler deals equal shares
            raise RuntimeError(f"ranks stand at different batches of the epoch ({[r['batches'] for r in ranks]}): "
                               f"the checkpoint would not resume every rank where it was")
        checkpoint["resume_state"] = {"ranks": ranks}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self._pending = checkpoint.get("resume_state")

    def on_train_start(self, trainer, pl_module):
        st = getattr(self, "_pending", None)
        if not st:
            return
        ranks = st.get("ranks", [st])  # checkpoints before 2026-12-04 hold rank 0's states only
        rank, world = trainer.global_rank, trainer.world_size
        if len(ranks) != world and rank == 0:
            log.warning("the checkpoint was saved by %d process(es), resumed with %d: rank r takes rank r mod %d's "
                        "RNG states, and the batches are dealt anew, so the run goes on, but not as it would have",
                        len(ranks), world, len(ranks))
        own = ranks[rank % len(ranks)]
        torch.set_rng_state(own["torch"])
        if own["cuda"] is not None and pl_module.device.type == "cuda":
            if isinstance(own["cuda"], list | tuple):  # older checkpoints: every device's state
                torch.cuda.set_rng_state_all(own["cuda"])
            else:
                torch.cuda.set_rng_state(own["cuda"], pl_module.device)
        np.random.set_state(_numpy_state_from_safe(own["numpy"]))
        random.setstate(own["python"])
        self._pending = None


def _gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (just [obj] in a single process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


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
    steps are left out) and records peak memory over the fit (mhalab.train.callbacks.memory: CUDA's allocator
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
    runs on, mhalab.train.allocator, is in metrics.json's provenance.)

    Read and written only on the steps the loggers write (mhalab.train.log_steps), straight to them as
    LearningRateMonitor does: a self.log on every step cost ~0.3 ms of a ~30 ms default CPU step, and a self.log on
    those steps only would leave Lightning its last value to write again, under a later step's number, at a step
    that a callback after this one stops (max_time). That step gets no memory row instead."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not loggers_write(trainer):
            return
        if pl_module.device.type == "cuda":
            values = {"perf/cuda_allocated_mb": torch.cuda.memory_allocated(pl_module.device) / 2**20,
                      "perf/cuda_reserved_mb": torch.cuda.memory_reserved(pl_module.device) / 2**20}
        else:
            values = {"perf/rss_mb": current_rss_mb()}
        for logger in trainer.loggers:  # the step the loggers give this batch's other values
            logger.log_metrics(values, step=trainer.fit_loop.epoch_loop._batches_that_stepped)


class LogEveryEpoch(L.Callback):
    """Log at least once an epoch: trainer.log_every_n_steps capped at the batches of an epoch, so a small data set
    (2 batches an epoch against an interval of 20) still gets its training curve and throughput."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        batches = trainer.num_training_batches
        if isinstance(batches, int) and 0 < batches < trainer.log_every_n_steps:
            trainer.log_every_n_steps = batches

