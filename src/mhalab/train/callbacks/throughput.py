"""Training throughput in real (non-pad) tokens, samples and FLOPs: Lightning's ThroughputMonitor, built from
the YAML (conf/callbacks/default.yaml: `throughput`), counting what the collate and the module already know."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from mhalab.train.log_steps import loggers_write


def batch_samples(batch: Mapping) -> int:
    """Sequences in a collated batch: a tensor's shape, never its values (no host sync)."""
    return int(batch["labels"].shape[0])


def batch_tokens(batch: Mapping) -> int:
    """Real (non-pad) tokens of a collated batch: mhalab.data.Collate's `num_tokens`, a Python int counted on
    the CPU. A batch from another collate, without it, is counted from its padding mask (a host sync on CUDA)."""
    n = batch.get("num_tokens")
    return int(n) if n is not None else int((~batch["padding_mask"]).sum())


class RealTokenThroughput(ThroughputMonitor):
    """ThroughputMonitor over training batches, items = real tokens; FLOPs from the module's `flops_per_batch`.

    Logged every `trainer.log_every_n_steps` (world size 1), under the training stage's prefix:
      train/device/samples_per_sec   sequences per second
      train/device/items_per_sec     real (non-pad) tokens per second (collate's num_tokens)
      train/device/batches_per_sec
      train/device/flops_per_sec     the module's flops_per_batch (analytic, mhalab.nn.flops) per second
      train/device/mfu               flops_per_sec / the device's peak, on CUDA only (below)
      train/time, train/batches, train/samples, train/lengths   totals since this attempt's fit started
    With DDP, also the all-device rates without "device/" (rank 0's rate x world size). The rates are
    rolling averages over the last `window_size` training batches, so they appear once that many batches
    have run; the totals restart at a resume (this callback holds no state: the window refills).

    MFU: Lightning's get_available_flops gives the peak of known CUDA chips for the trainer's precision
    (bf16-mixed -> bf16; 32-true -> tf32 when matmul precision is not "highest"). On CPU it returns None
    (a CPU's peak is unknown), so train/device/mfu is simply not logged: no warning, no error. An unlisted
    GPU gets one Lightning warning ("FLOPs not found") and no MFU.

    Training only: validation, test and predict are not measured. Lightning's version logs their rates
    per batch at the evaluation loop's own batch index as the step (rows out of step order in
    metrics.csv) and would read the training batch's flops_per_batch for them. The time a validation
    inside fit takes is still left out of the training rate, as Lightning does (on_validation_end).

    CUDA: Lightning's _update (2.6.6) calls torch.cuda.synchronize() after every training batch, so that
    perf_counter() times finished work: a host sync per step, which keeps the CPU from queueing the next
    step's kernels while the GPU works. Here, on CUDA, the counts (host ints: batch_samples, batch_tokens,
    flops_per_batch) add up every batch, but the clock is read, after one synchronize, only on the batches
    where the rates are logged (every log_every_n_steps), and the window is the last such interval (two
    points): the same rate over the same batches, one sync per interval. CPU keeps Lightning's per-batch
    window (a CPU "sync" costs nothing).
    """

    def __init__(self, window_size: int = 50, **kwargs: Any):
        super().__init__(batch_size_fn=batch_samples, length_fn=batch_tokens, window_size=window_size, **kwargs)
        self._val_t0: float | None = None
        self._sparse = False  # CUDA: clock read at logging steps only (see the class docstring)
        self._pending_flops = 0

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._sparse = trainer.strategy.root_device.type == "cuda"
        if self._sparse:  # points at logging steps only: a window of two points is the last interval
            from lightning.fabric.utilities.throughput import Throughput

            kwargs = {**self.kwargs, "window_size": 2}
            self._throughputs = {s: Throughput(available_flops=self.available_flops, world_size=trainer.world_size,
                                               **kwargs) for s in self._throughputs}

    @torch.inference_mode()
    def _update(self, trainer, pl_module, batch: Any, iter_num: int) -> None:
        if not self._sparse:
            return super()._update(trainer, pl_module, batch, iter_num)
        stage = trainer.state.stage
        self._lengths[stage] += batch_tokens(batch)
        self._samples[stage] += batch_samples(batch)
        self._batches[stage] += 1
        self._pending_flops += getattr(pl_module, "flops_per_batch", None) or 0
        if not loggers_write(trainer):
            return  # no sync on this batch
        torch.cuda.synchronize()  # once per logging interval: the clock then times finished work
        self._throughputs[stage].update(
            time=time.perf_counter() - self._t0s[stage], batches=self._batches[stage], samples=self._samples[stage],
            lengths=self._lengths[stage], flops=self._pending_flops or None)
        self._pending_flops = 0

    @rank_zero_only
    def on_validation_start(self, trainer, *_: Any) -> None:
        if not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING:
            if self._sparse:
                torch.cuda.synchronize()  # the clock stops when training's kernels are done
            self._val_t0 = time.perf_counter()

    def on_validation_batch_end(self, *_: Any, **__: Any) -> None:
        pass

    @rank_zero_only
    def on_validation_end(self, trainer, pl_module, *_: Any) -> None:
        if self._val_t0 is None or RunningStage.TRAINING not in self._t0s:
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # once per validation: its last kernels are not training time
        # stop the training clock from its last update (the last training batch) to the end of validation
        train = self._throughputs[RunningStage.TRAINING]._time
        # (sparse points: the last one may be batches before validation, so validation's own start)
        last = self._t0s[RunningStage.TRAINING] + train[-1] if train and not self._sparse else self._val_t0
        self._t0s[RunningStage.TRAINING] += time.perf_counter() - last
        self._val_t0 = None

    def on_test_start(self, *_: Any) -> None:
        pass

    def on_test_batch_end(self, *_: Any, **__: Any) -> None:
        pass

    def on_predict_start(self, *_: Any) -> None:
        pass

    def on_predict_batch_end(self, *_: Any, **__: Any) -> None:
        pass
