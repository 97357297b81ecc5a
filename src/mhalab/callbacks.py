"""Lightning callbacks for runs that survive interruption and resume exactly."""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger("mhalab")


class GracefulStop(L.Callback):
    """Ctrl-C and SIGTERM stop training at a batch boundary and save `last.ckpt` there: a resume is exact.

    Lightning turns SIGTERM (a cluster's pre-emption) into SIGTERMException once the batch under way
    has finished and been logged. A Ctrl-C would raise KeyboardInterrupt wherever it lands, mid-batch,
    and a checkpoint saved then sits between two states (a resumed run ended 1-2 points off). So while
    training, the first Ctrl-C is handed to that same SIGTERM path; a second one stops at once without
    saving, and a resume then starts from the last checkpoint on disk (the step or epoch checkpoint).
    """

    def __init__(self, dirpath: str | Path):
        self.dirpath = Path(dirpath)
        self.ctrl_c = False  # the stop came from the keyboard (the run's record says so)
        self._previous_handler = None

    def _on_sigint(self, signum, frame) -> None:
        if self.ctrl_c:  # the second Ctrl-C
            self._restore()
            raise KeyboardInterrupt
        self.ctrl_c = True
        log.warning("Ctrl-C: stopping after this batch and saving last.ckpt (press Ctrl-C again to stop at once)")
        os.kill(os.getpid(), signal.SIGTERM)  # Lightning's own graceful stop (its SIGTERM handler)

    def on_train_start(self, trainer, pl_module):
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._previous_handler = signal.signal(signal.SIGINT, self._on_sigint)

    def on_train_end(self, trainer, pl_module):
        self._restore()

    def _restore(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGINT, self._previous_handler)
            self._previous_handler = None

    def on_exception(self, trainer, pl_module, exception):
        self._restore()
        if isinstance(exception, SIGTERMException) and trainer.state.fn == "fit":
            path = self.dirpath / "last.ckpt"
            trainer.save_checkpoint(path, weights_only=False)  # the whole state: optimizer, loops, callbacks
            log.warning("interrupted at global step %d; saved %s", trainer.global_step, path)


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
    pre-emption, SIGINT as a Ctrl-C, SIGKILL as the OOM killer or a lost machine (no chance to save)."""

    def __init__(self, at_step: int, signal: str = "SIGTERM"):
        self.at_step, self.signum = at_step, _signal(signal)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at_step and trainer.is_global_zero:
            os.kill(os.getpid(), self.signum)


def _signal(name: str) -> int:
    if name not in ("SIGTERM", "SIGINT", "SIGKILL"):
        raise ValueError(f"signal={name!r}: choose SIGTERM, SIGINT or SIGKILL.")
    return getattr(signal, name)
