"""FairThreads: a CPU run's torch threads follow the cores other processes leave free, so runs sharing a machine do
not spin against each other.

Why: PyTorch's OpenMP threads wait for work by spinning (OMP_WAIT_POLICY=active, libgomp's default). Alone that is
the fastest (150 default SST-2 steps: 7.0 s of fit with 2 threads). Two such runs on 2 cores spin against each
other: 36-40 s each, 5x. OMP_WAIT_POLICY=passive stops the spinning but costs a run alone ~45% (10.1-10.5 s), and
it must be set before the process starts. One thread spins at no barrier at all: two runs at one thread each take
~9-10 s. So the thread count is the lever, and torch.set_num_threads can move it while a run trains
(results/bench/shared_cpu.md; `python scripts/shared_cpu.py`).

Every `every_s` seconds of training, the callback reads how many cores the other processes kept busy since its last
look (Linux: /proc/stat's busy time for the whole machine, less this process's own from /proc/self/stat) and sets
the threads to the cores left, at least 1 and at most what the run started with. Active only when the run chose no
thread count itself (`num_threads: null`; a sweep preset's members run at 1): a given count is kept. The numbers a
run computes can depend on its thread count (a matmul's reduction order), so a run whose numbers must repeat exactly
sets `num_threads`.
"""

from __future__ import annotations

import logging
import os
import time

import lightning as L
import torch

log = logging.getLogger("mhalab")

FIRST_LOOK_S = 0.25  # the sample taken before the first step
HALF, QUARTER = 0.5, 0.25  # others' share of a core at which it becomes theirs, and below which it is free again
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100  # /proc's time unit


def machine_busy_ticks() -> int | None:
    """Busy CPU time of the whole machine since boot, in ticks (user, nice, system, irq, softirq, steal), or None
    where /proc/stat is missing (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return user + nice + system + irq + softirq + steal


def own_busy_ticks() -> int | None:
    """This process's CPU time (every thread, user and system), in ticks."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))


class FairThreads(L.Callback):
    """Set torch's intra-op threads to the cores other processes leave free, every `every_s` seconds (the module
    docstring). `fixed`: the run's num_threads (a count given: the callback does nothing). `cores`: the machine's
    (default os.cpu_count())."""

    def __init__(self, every_s: float = 0.5, fixed: int | None = None, cores: int | None = None):
        self.every_s, self.fixed = every_s, fixed
        self.cores = cores or os.cpu_count() or 1
        self._last: tuple[float, int, int] | None = None
        self._most = 0  # the threads the run started with: never more
        self.changes: list[tuple[int, int]] = []  # (global step, threads set), for the record and the tests

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._most = torch.get_num_threads()
        if self.fixed or self._most < 2 or pl_module.device.type != "cpu":  # nothing to move
            return
        self._last = self._sample()
        time.sleep(FIRST_LOOK_S)  # the first look before the first step: two runs started together never spin
        self._adjust(trainer)

    def _adjust(self, trainer: L.Trainer) -> None:
        """Read the others' load since the last sample and set the threads to what it leaves."""
        now = self._sample()
        if now is None or self._last is None:
            return
        others = self.others_busy(self._last, now)
        threads = self.threads_for(others, torch.get_num_threads())
        self._last = now
        if threads != torch.get_num_threads():
            log.info("threads %d -> %d at step %d: other processes kept %.1f of %d cores busy", torch.get_num_threads(),
                     threads, trainer.global_step, others, self.cores)
            torch.set_num_threads(threads)
            self.changes.append((trainer.global_step, threads))

    @staticmethod
    def _sample() -> tuple[float, int, int] | None:
        machine, own = machine_busy_ticks(), own_busy_ticks()
        return None if machine is None or own is None else (time.monotonic(), machine, own)

    def others_busy(self, before: tuple[float, int, int], after: tuple[float, int, int]) -> float:
        """Cores the other processes kept busy between two samples."""
        seconds = after[0] - before[0]
        others = (after[1] - before[1]) - (after[2] - before[2])
        return max(0.0, others / TICKS / seconds) if seconds > 0 else 0.0

    def threads_for(self, others: float, current: int) -> int:
        """The threads to run with, from `current`, when other processes kept `others` cores busy. A core counts
        as theirs once they keep it busy half the time, and is taken back only when they leave it busy less than a
        quarter of it: a run at one thread beside another (each ~0.8-0.95 of a core) must not read that core as
        free, and a shell's blip must not cost a run alone a thread."""
        target = self.cores - int(others + HALF)
        if target > current:
            target = max(current, self.cores - int(others + 1 - QUARTER))
        return max(1, min(self._most, target))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if self._last is not None and time.monotonic() - self._last[0] >= self.every_s:
            self._adjust(trainer)
