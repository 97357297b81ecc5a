"""A run dir belongs to one live process: it holds an flock on `<run dir>/.lock` while it runs.

The kernel drops the lock when the process ends in any way (SIGKILL and power loss included), so a
lock that can be taken means the previous process is gone: its run is dead, not "running", and the
new process takes the dir over. A second process into a live run's dir is refused in one line, with
the holder's pid, host and start time (written into the lock file). Two processes started at once
cannot both win: flock is atomic.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from mhalab.errors import RunDirError

log = logging.getLogger("mhalab")

LOCK = ".lock"


def _read(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        return json.loads(raw) if raw.strip() else None
    except ValueError:
        return None


def is_live(run_dir: str | Path) -> bool:
    """Whether a live process holds this run dir. A record that says "running" without one is dead."""
    path = Path(run_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops a lock we took
    return False


def unwritable(run_dir: str | Path, e: OSError) -> RunDirError:
    """The one message for a run dir that cannot be written (also checked before Hydra logs into it)."""
    return RunDirError(f"cannot write to the run dir {run_dir} ({e.strerror}); choose a writable one with "
                       f"hydra.run.dir=<dir> (hydra.sweep.dir=<dir> for -m).")


class RunLock:
    """Context manager: hold `<run_dir>/.lock` for the life of this process's run.

    After entering, `previous` is the holder a dead process left in the file (None if the dir was
    free): pid, host and start time of the attempt that did not finish.
    """

    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.path = self.dir / LOCK
        self.previous: dict | None = None
        self._fd: int | None = None

    def __enter__(self) -> RunLock:  # noqa: PYI034
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError as e:
            raise unwritable(self.dir, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            h = _read(fd) or {}
            os.close(fd)
            raise RunDirError(
                f"{self.dir} is in use by pid {h.get('pid', '?')} on {h.get('host', '?')} (since "
                f"{h.get('started', '?')}); wait for it to finish, or write this run elsewhere "
                f"(hydra.run.dir=<dir>)."
            ) from None
        self._fd = fd
        self.previous = _read(fd)  # what a dead holder left (a clean exit empties the file)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(me).encode())
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        # empty, not unlink: a process that opened the old file meanwhile must lock the same inode
        os.ftruncate(self._fd, 0)
        os.close(self._fd)  # releases the flock
        self._fd = None


HYDRA_FILES = (".hydra", "cli.log")  # what Hydra writes into a run dir before the run starts


def only_hydra_files(run_dir: str | Path) -> bool:
    """Whether the run dir holds nothing but what Hydra wrote for this command (a run that starts here is new)."""
    d = Path(run_dir)
    return not d.exists() or all(p.name in HYDRA_FILES or p.name.endswith(".log") and "_ddp_process_" in p.name
                                 for p in d.iterdir())


def discard(run_dir: str | Path) -> None:
    """Remove a new run's dir after a refusal: a mistake caught before training leaves nothing behind. Only for a
    dir that held nothing but Hydra's files when the run started (`only_hydra_files`), so all of it is this run's."""
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
