"""Runs survive what happens to real runs: Ctrl-C, pre-emption, the OOM killer, a second process, a read-only dir.

Every case runs `python train.py` as a user would, a process of its own that signals reach (forked from
tests/fork_server.py's, which has imported what train.py imports), on the toy data set, and compares with
one uninterrupted run of the same command: an interrupted run, re-run with the same command, must end
with the same numbers (to 1e-6), the same log (logs/metrics.csv, every row once) and the same count of
trained tokens, and its record must say what happened to each attempt. Two processes (`trainer=ddp_cpu`) and two
processes started as two nodes (`trainer.num_nodes=2`, a cluster's environment) must resume the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import pandas as pd
import pytest
import torch
from conftest import REPO

from mhalab.train import checkpoint, record
from mhalab.train.record import rundir

COMMON = ["max_epochs=2", "seed=11", "test_after_fit=false", "dropout=0.1", "trainer.log_every_n_steps=5",
          "callbacks.step_checkpoint.every_n_train_steps=10"]
ENV = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(Path(__file__).parent))


class Throttle(L.Callback):
    """Slow each training batch down, so that a signal from outside lands in the middle of training; with `gate`
    (a file's path), hold every batch until that file exists instead: the test says when the run goes on."""

    def __init__(self, seconds: float = 0.05, gate: str | None = None):
        self.seconds, self.gate = seconds, gate
        self.deadline = time.time() + 300  # a test that failed before opening the gate: the run still ends soon

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        while self.gate and not os.path.exists(self.gate) and time.time() < self.deadline:
            time.sleep(0.02)
        if not self.gate:
            time.sleep(self.seconds)


def _cmd(run_dir: Path, data: Path, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}", f"paths.data_dir={data}",
            f"paths.cache_dir={run_dir.parent / 'cache'}", "trainer=cpu", "trainer.enable_progress_bar=false",
            "callbacks.progress_bar=null", "dim=32", "heads=4", "layers=1", "batch_size=16", "max_len=32",
            "data.vocab_size=200", "data.min_frequency=1", *COMMON, *extra]


def _run(server, run_dir: Path, data: Path, *extra: str) -> subprocess.CompletedProcess:
    return server.run(_cmd(run_dir, data, *extra), env=ENV, timeout=600)


def _log(run_dir: Path) -> pd.DataFrame:
    return pd.read_csv(run_dir / "logs" / "metrics.csv")


def _logged_step(run_dir: Path) -> float:
    """The last step in a live run's CSV log, or -1 while it has none (absent, or created but not yet written)."""
    path = run_dir / "logs" / "metrics.csv"
    try:
        return _log(run_dir)["step"].max() if path.exists() else -1
    except (pd.errors.EmptyDataError, KeyError):  # the logger writes the header and rows a moment later
        return -1


def _rec(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.fixture(scope="module")
def straight(tmp_path_factory, toy_data_dir, fork_server) -> Path:
    """The uninterrupted run every interrupted one is compared with."""
    out = tmp_path_factory.mktemp("faults") / "straight"
    proc = _run(fork_server, out, toy_data_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _assert_same_run(a: Path, b: Path, steps: int = 50) -> None:
    ra, rb = _rec(a), _rec(b)
    assert rb["status"] == "finished" and ra["global_step"] == rb["global_step"] == steps
    for key in ("val/loss", "val/acc"):
        last_a, last_b = ra["last_epoch"], rb["last_epoch"]
        assert abs(last_a[key] - last_b[key]) < 1e-6, (key, last_a, last_b)
    assert ra["train_tokens"] == rb["train_tokens"]  # every token counted once over the attempts
    la, lb = _log(a), _log(b)
    assert lb["step"].is_monotonic_increasing  # one continuous log, no step twice
    for col in ("train/loss", "val/loss", "val/acc"):
        xa, xb = la[["step", col]].dropna(), lb[["step", col]].dropna()
        assert xa["step"].tolist() == xb["step"].tolist(), col
        assert (xa[col].to_numpy() - xb[col].to_numpy()).__abs__().max() < 1e-6, col


@pytest.mark.parametrize("sig, at, in_validation, exit_code, saved_step, status, how", [
    # mid-epoch SIGTERM / SIGINT: `slow` (make test-slow); the same graceful stop is proven in CI by the
    # outside Ctrl-C below, the last-batch Ctrl-C and the SIGTERM inside validation
    pytest.param("SIGTERM", 17, False, 143, 17, "interrupted", "SIGTERM", marks=pytest.mark.slow),  # pre-emption
    pytest.param("SIGINT", 17, False, 130, 17, "interrupted", "Ctrl-C", marks=pytest.mark.slow),  # Ctrl-C
    ("SIGKILL", 17, False, -9, 10, "dead", None),  # nothing saved at the kill: the step checkpoint (every 10)
    # the last batch of epoch 0: a Ctrl-C waits for the validation that follows, then stops
    ("SIGINT", 25, False, 130, 25, "interrupted", "Ctrl-C"),
    # a pre-emption inside that validation saves nothing: the run redoes steps 20-25 from the step checkpoint
    ("SIGTERM", 25, True, 143, 20, "interrupted", "SIGTERM"),
], ids=["SIGTERM", "SIGINT", "SIGKILL", "SIGINT-last-batch", "SIGTERM-in-validation"])
def test_interrupted_run_rerun_with_the_same_command_ends_equal_to_the_uninterrupted_one(
        sig, at, in_validation, exit_code, saved_step, status, how, straight, tmp_path, toy_data_dir, fork_server):
    out = tmp_path / "run"
    proc = _run(fork_server, out, toy_data_dir, "debug=preempt", f"callbacks.preempt.at_step={at}",
                f"callbacks.preempt.signal={sig}", f"callbacks.preempt.in_validation={in_validation}")
    assert proc.returncode == exit_code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert record.status(out, _rec(out)) == status  # a killed run says "running"; nothing runs it: dead
    if how:
        assert _rec(out)["error"] == (f"interrupted ({how}); to continue it in place, run the same command with "
                                      f"hydra.run.dir={out}")
    if how == "Ctrl-C":  # told as a Ctrl-C only: Lightning's handler, which we call to stop, said "Received SIGTERM"
        said = [line for line in (proc.stdout + proc.stderr).splitlines() if "SIGTERM" in line or "Ctrl-C" in line]
        assert not [line for line in said if "Received SIGTERM" in line], said
        assert "interrupted (Ctrl-C)" in proc.stdout + proc.stderr, said
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == saved_step

    proc = _run(fork_server, out, toy_data_dir)  # the same command again, as a requeued job or a user does
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"was {status}; resuming from" in proc.stdout + proc.stderr
    _assert_same_run(straight, out)
    # one last.ckpt, the newest (no last-v1.ckpt): a run dir resolves to the end of the run
    assert not [p.name for p in (out / "checkpoints").iterdir() if "-v" in p.name]
    assert checkpoint.meta(checkpoint.resolve(out))["global_step"] == 50
    attempts = _rec(out)["attempts"]
    assert [a["status"] for a in attempts] == [status, "finished"]
    assert [a["from_step"] for a in attempts] == [0, saved_step]


def test_ctrl_c_from_outside_at_any_moment_resumes_exactly(straight, tmp_path, toy_data_dir, fork_server):
    """A real Ctrl-C lands wherever the run is, usually inside a batch: it still stops at a batch boundary."""
    out = tmp_path / "run"
    proc = fork_server.popen(_cmd(out, toy_data_dir, "+callbacks.throttle._target_=test_faults.Throttle"), env=ENV)
    deadline = time.time() + 120
    # past step 9 (rows are logged every 5 steps; how many rows a step has depends on the loggers' callbacks)
    while time.time() < deadline and _logged_step(out) < 9:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    step = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    assert 10 <= step < 50 and "Ctrl-C: stopping after this batch" in stdout + err and "Traceback" not in err
    assert "Received SIGTERM" not in stdout + err
    proc2 = _run(fork_server, out, toy_data_dir)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    _assert_same_run(straight, out)


def test_second_process_into_a_live_run_dir_is_refused_and_the_first_run_is_untouched(
        straight, tmp_path, toy_data_dir, fork_server):
    out, gate = tmp_path / "run", tmp_path / "gate"
    # the first run holds its first batch until the second has been refused: it is live whatever the machine's
    # speed (a throttled run could finish first on a busy machine, and the second then found a finished run)
    first = fork_server.popen(_cmd(out, toy_data_dir, "+callbacks.throttle._target_=test_faults.Throttle",
                                   f"+callbacks.throttle.gate={gate}"), env=ENV)
    deadline = time.time() + 120  # the lock is taken first, the record written a moment later
    while time.time() < deadline and not (rundir.is_live(out) and record.path(out).exists()):
        time.sleep(0.05)
    assert record.status(out, _rec(out)) == "running"  # what a report of a live run says
    second = _run(fork_server, out, toy_data_dir)
    assert second.returncode == 2
    lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith(f"error: {out} is in use by pid {first.pid} on ") and "Traceback" not in second.stderr
    assert first.poll() is None  # still holding its first batch: the refusal was of a live run
    gate.touch()
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    _assert_same_run(straight, out)  # the live run finished as if alone: its log and record intact
    assert len(_rec(out)["attempts"]) == 1


def test_two_runs_started_at_once_into_one_dir_one_runs_the_other_is_refused(tmp_path, toy_data_dir, fork_server):
    out = tmp_path / "run"
    procs = [fork_server.popen(_cmd(out, toy_data_dir), env=ENV) for _ in range(2)]
    results = [(p.wait(timeout=300), p.communicate()[1]) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], [err[-2000:] for _, err in results]
    refused = next(err for code, err in results if code == 2)
    assert " is in use by pid " in refused.strip().splitlines()[-1]
    log = _log(out)
    assert not log.dropna(subset=["train/loss"])["step"].duplicated().any()  # no row written twice
    assert _rec(out)["status"] == "finished" and len(_rec(out)["attempts"]) == 1


@pytest.fixture(scope="module")
def ddp_straight(tmp_path_factory, toy_data_dir, fork_server) -> Path:
    """An uninterrupted run of two processes (trainer=ddp_cpu: Lightning starts rank 1, gloo)."""
    out = tmp_path_factory.mktemp("ddp") / "straight"
    proc = _run(fork_server, out, toy_data_dir, "trainer=ddp_cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow  # ~25 s: two DDP runs of two processes (make test-slow); the two-node test below resumes DDP in CI
def test_ddp_run_preempted_mid_epoch_resumes_every_rank_equal_to_the_uninterrupted_one(
        ddp_straight, tmp_path, toy_data_dir, fork_server):
    """Each rank draws its own dropout masks, so each rank's RNG states are saved and restored as its own; the
    pre-emption reaches rank 0 only, and both ranks stop at the same batch."""
    out = tmp_path / "run"
    proc = _run(fork_server, out, toy_data_dir, "trainer=ddp_cpu", "debug=preempt", "callbacks.preempt.at_step=7")
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    saved = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == 7  # mid-epoch: 12 steps an epoch on each of the 2 ranks
    ranks = saved["resume_state"]["ranks"]
    assert len(ranks) == 2 and not torch.equal(ranks[0]["torch"], ranks[1]["torch"])  # two states, not one twice
    proc = _run(fork_server, out, toy_data_dir, "trainer=ddp_cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # with rank 0's states restored on both ranks (the code before), the val loss ended 1.2e-3 off
    _assert_same_run(ddp_straight, out, steps=24)
    assert [a["from_step"] for a in _rec(out)["attempts"]] == [0, 7]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(server, out: Path, data: Path, *extra: str) -> list[subprocess.CompletedProcess]:
    """The command started twice, as a cluster's launcher starts it on two nodes of one process each."""
    port, procs = _free_port(), []
    for node in (0, 1):
        env = dict(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(node), WORLD_SIZE="2")
        procs.append(server.popen(_cmd(out, data, "trainer=ddp_cpu", "trainer.devices=1", "trainer.num_nodes=2", *extra),
                                  env=env))
    outputs = [p.communicate(timeout=600) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *o) for p, o in zip(procs, outputs, strict=True)]


def test_two_nodes_on_one_machine_train_are_preempted_and_resume_equal_to_two_local_processes(
        ddp_straight, tmp_path, toy_data_dir, fork_server):
    """num_nodes=2 with the environment a cluster sets (MASTER_ADDR/PORT, NODE_RANK, WORLD_SIZE): node 1 shares
    node 0's run dir, waits for node 0's attempt, and resumes what node 0 resumes. Two nodes of one process are
    the same ranks as two local processes, so the numbers must be those of the local run."""
    out = tmp_path / "run"
    first = _two_nodes(fork_server, out, toy_data_dir, "debug=preempt", "callbacks.preempt.at_step=7")
    assert first[0].returncode == first[1].returncode == 143, first[0].stderr[-3000:] + first[1].stderr[-3000:]
    assert "Traceback" not in first[0].stderr + first[1].stderr  # both nodes stopped, as a pre-empted job's tasks
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 7
    again = _two_nodes(fork_server, out, toy_data_dir)
    assert [p.returncode for p in again] == [0, 0], again[0].stderr[-2000:] + again[1].stderr[-2000:]
    _assert_same_run(ddp_straight, out, steps=24)
    assert [a["from_step"] for a in _rec(out)["attempts"]] == [0, 7]
    assert (out / "train_node_1.log").exists() and "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in (
        out / "train_node_1.log").read_text() + again[1].stderr  # node 1 logged beside node 0, into its own file


def test_two_nodes_need_one_run_dir_named_on_the_command_line(tmp_path, fork_server):
    proc = fork_server.run([sys.executable, str(REPO / "train.py"), "trainer=ddp_cpu", "trainer.num_nodes=2"],
                           cwd=tmp_path, env=ENV, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "error: trainer.num_nodes=2: every node runs this command and all of them write into one run dir; pass the "
        "same hydra.run.dir=<a dir every node sees> on each node.")
    assert not (tmp_path / "outputs").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the command as another user (CI runs as root)")
def test_a_run_dir_that_cannot_be_written_is_one_line(toy_data_dir):
    # as an unprivileged user (root writes anywhere) into a dir it may read but not write
    base = Path(tempfile.mkdtemp(prefix="mhalab-ro-"))
    ro, home = base / "readonly", base / "home"
    ro.mkdir(mode=0o555)
    home.mkdir(mode=0o777)
    base.chmod(0o755)
    data = shutil.copytree(toy_data_dir, base / "data")  # readable by that user, wherever pytest's tmp dir is
    for p in [data, *data.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    cmd = [*nobody, *_cmd(ro / "run", data)]
    # the checkout (its venv, train.py, src/) may sit where another user cannot read it (a clone under a 0700
    # dir): then this test cannot run its command as that user, which says nothing about the code under test
    probe = subprocess.run([*nobody, sys.executable, "-c", f"import mhalab.cli; open({str(REPO / 'train.py')!r})"],
                           env=dict(ENV, HOME=str(home)), capture_output=True, text=True, check=False, timeout=120)
    if probe.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        why = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"uid 65534 cannot run this checkout's Python and train.py ({why}): the clone is not readable "
                    f"by other users")
    try:
        proc = subprocess.run(cmd, env=dict(ENV, HOME=str(home), MPLCONFIGDIR=str(home)), capture_output=True,
                              text=True, check=False, timeout=300)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: cannot write to the run dir {ro / 'run'} (Permission denied); choose a writable one with "
        f"hydra.run.dir=<dir> (hydra.sweep.dir=<dir> for -m).")
