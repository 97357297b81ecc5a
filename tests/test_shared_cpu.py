"""A run beside others on one CPU (mhalab.train.callbacks.fair_threads) and a run without a terminal
(mhalab.train.callbacks.log_progress): the thread rule against the load it reads, the load read off /proc against
Python's own CPU clock, and the progress line a batch job's log gets."""

from __future__ import annotations

import os
import re
import sys
import time

import pytest
import torch
from conftest import REPO

from mhalab.train.callbacks.fair_threads import TICKS, FairThreads, machine_busy_ticks, own_busy_ticks
from mhalab.train.callbacks.log_progress import eta_text


def _rule(current: int, others: float, cores: int = 2, most: int = 2) -> int:
    f = FairThreads(cores=cores)
    f._most = most
    return f.threads_for(others, current)


@pytest.mark.parametrize("current, others, threads", [
    (2, 0.05, 2),  # alone: a shell's blip keeps both threads
    (2, 0.45, 2),
    (2, 0.9, 1),   # another training run on one core: give it that core
    (2, 1.9, 1),   # never below one
    (1, 0.85, 1),  # beside a one-thread run (~0.8-0.95 of a core): stay, do not read its core as free
    (1, 0.3, 1),   # a core a third busy is not taken back yet
    (1, 0.1, 2),   # the other run ended: both threads again
])
def test_threads_follow_the_cores_others_leave_with_hysteresis(current, others, threads):
    assert _rule(current, others) == threads


def test_threads_never_exceed_what_the_run_started_with():
    assert _rule(1, 0.0, cores=8, most=4) == 4


@pytest.mark.skipif(machine_busy_ticks() is None, reason="reads Linux's /proc")
def test_this_process_and_the_machines_busy_time_are_read_off_proc():
    """Our CPU time from /proc/self/stat equals Python's process_time; the machine's busy time includes it (whatever
    else runs beside this test: it can only add)."""
    cpu0, own0, machine0 = time.process_time(), own_busy_ticks(), machine_busy_ticks()
    while time.process_time() - cpu0 < 0.5:
        pass
    cpu1, own1, machine1 = time.process_time(), own_busy_ticks(), machine_busy_ticks()
    assert abs((own1 - own0) / TICKS - (cpu1 - cpu0)) < 0.05
    assert machine1 - machine0 >= own1 - own0 - 2  # ticks are counted per CPU: a tick of slack each


def test_others_load_is_the_machines_busy_time_less_ours_per_second():
    f = FairThreads()
    before, after = (10.0, 1000, 200), (12.0, 1000 + 3 * TICKS, 200 + TICKS)  # 2 s: 3 core-seconds, 1 of them ours
    assert f.others_busy(before, after) == pytest.approx(1.0)
    assert f.others_busy(after, after) == 0.0


def test_a_given_num_threads_is_kept():
    f = FairThreads(fixed=2)
    n = torch.get_num_threads()

    class Module:
        device = torch.device("cpu")

    f.on_train_start(None, Module())
    assert f._last is None and torch.get_num_threads() == n  # never sampled, never moved


def test_eta_reads_as_a_person_would_write_it():
    assert [eta_text(s) for s in (8.4, 102, 7500)] == ["8 s", "1 min 42 s", "2 h 05 min"]


def test_a_run_without_a_terminal_logs_step_planned_loss_tokens_and_eta(tmp_path, toy_data_dir, fork_server):
    """The command a batch job runs, its output to a pipe (no terminal): a progress line every every_s seconds
    (here 0: every step), with the steps against the run's plan."""
    cmd = [sys.executable, str(REPO / "train.py"), f"paths.data_dir={toy_data_dir}", f"paths.cache_dir={tmp_path}/c",
           f"hydra.run.dir={tmp_path}/run", "trainer=cpu", "trainer.enable_progress_bar=false", "dim=32", "heads=4",
           "layers=1", "batch_size=32", "max_len=32", "data.vocab_size=200", "data.min_frequency=1", "max_epochs=2",
           "callbacks.log_progress.every_s=0", "extras.print_config=false"]
    proc = fork_server.run(cmd, cwd=tmp_path, env=dict(os.environ, PYTHONHASHSEED="0"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"step ([\d,]+) / ([\d,]+) \((\d+)%\)  epoch (\d) / 2  loss [\d.]+  [\d,]+ tok/s  ETA \d+ s",
                       proc.stdout + proc.stderr)
    assert lines, (proc.stdout + proc.stderr)[-3000:]
    planned = {int(p.replace(",", "")) for _, p, _, _ in lines}
    assert len(planned) == 1  # the plan: max_epochs x the steps of an epoch
    steps = [int(s.replace(",", "")) for s, _, _, _ in lines]
    assert steps == sorted(steps) and steps[-1] == planned.pop()  # counted up to the plan
