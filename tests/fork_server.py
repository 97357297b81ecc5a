"""Start the project's commands as forks of one process that has already imported what they import.

A training command spends ~4-5 s of this busy 2-core machine importing torch, Lightning and Hydra before it reads
its config, and the suite starts ~60 of them (the documented commands, the interruptions). This server imports
that once (what `mhalab-train` imports when it runs: mhalab.cli, mhalab.train.run), then forks a child per
command. The child takes the command's argv, working directory, environment and stdin/stdout/stderr, and runs the
script as `__main__` (train.py, or the installed console script itself: .venv/bin/mhalab-train), as a fresh
`python` would once its imports are done; an exception, SystemExit or Ctrl-C that escapes it ends the process as
it ends a fresh interpreter (exit 1 with a traceback, the exit code, death by SIGINT). A child is a real process:
its pid is the command's, signals reach it, the processes it starts (DDP ranks, a sweep's joblib workers) are
started as a real run starts them, and its exit status (or the signal that killed it) reads as subprocess's does.

What a child does not redo is what comes before the imports: the interpreter's start and the allocator's re-exec
(mhalab/train/allocator.py). The server starts with the environment that re-exec gives (mimalloc preloaded,
PYTHONHASHSEED=0); a command whose environment would need another start (a variable of START_ONLY that differs)
is refused with ValueError: run it with subprocess. Tests of the start itself (tests/test_install.py,
tests/test_memory.py, the own-process cases of tests/test_cli_errors.py) run real interpreters.

    server = ForkServer()                # in the suite: the `fork_server` fixture, one per worker
    proc = server.run([sys.executable, "train.py", "max_epochs=1"], cwd=..., env=..., timeout=300)
    proc = server.popen([...]); proc.send_signal(signal.SIGINT); out, err = proc.communicate(timeout=300)
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# read when an interpreter starts (or by the re-exec before it), or by a module the server imported (matplotlib's
# backend and config dir), so a fork inherits the server's
START_ONLY = ("PYTHONHASHSEED", "LD_PRELOAD", "MHALAB_ALLOCATOR", "MIMALLOC_PURGE_DELAY", "OMP_NUM_THREADS",
              "MKL_NUM_THREADS", "PYTHONDONTWRITEBYTECODE", "PYTHONOPTIMIZE", "PYTHONWARNINGS", "MPLBACKEND",
              "MPLCONFIGDIR", "HOME")


def command_env(env: dict[str, str]) -> dict[str, str]:
    """The environment the command runs in after its start: the allocator's re-exec adds mimalloc's."""
    from mhalab.train.allocator import preload_env

    return preload_env(env) or dict(env)


# ------------------------------------------------------------------------------------------------ the server


def _child(request: dict, imports_printed: bytes) -> None:
    """In the forked child: become the command, then run its script. Never returns normally: the script's end,
    SystemExit or an exception ends this process through the interpreter's own exit (threads joined, atexit)."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd, path, flags in ((0, request["stdin"] or os.devnull, os.O_RDONLY),
                            (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.write(2, imports_printed)  # a fresh interpreter would have printed it
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    sys.argv = argv[1:] if Path(argv[0]).name.startswith("python") else list(argv)  # [script, args...]
    script = sys.argv[0]
    sys.orig_argv = [sys.executable, *sys.argv]
    # sys.path as a fresh `python <script>` has it: the script's dir first, then PYTHONPATH's entries
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:1] = [str(Path(script).resolve().parent), *extra]
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def _reap(out: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        os.write(out, (json.dumps({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)}) + "\n").encode())


def serve() -> None:
    """Read one JSON request a line on stdin, fork a child for it, write {"started": pid} and, when it ends,
    {"exited": pid, "returncode": rc} on stdout. Ends at stdin's end (running children go on)."""
    # what the commands import, through the command's own module; what it prints goes to each child's stderr
    with tempfile.TemporaryFile() as printed:
        saved = os.dup(2)
        os.dup2(printed.fileno(), 2)
        try:
            import mhalab.cli
            import mhalab.train.run  # noqa: F401
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        printed.seek(0)
        imports_printed = printed.read()
    gc.freeze()  # the imported modules live as long as any child: its collections (and its exit's) skip them
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select() through wake_w
    out, pending = 1, b""
    os.write(out, b'{"ready": true}\n')
    while True:
        ready, _, _ = select.select([0, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(out)
        if 0 not in ready:
            continue
        data = os.read(0, 65536)
        if not data:
            return
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            pid = os.fork()
            if pid == 0:
                os.close(wake_r)
                os.close(wake_w)
                _child(json.loads(line), imports_printed)
            os.write(out, (json.dumps({"started": pid}) + "\n").encode())


# ------------------------------------------------------------------------------------------------ the client


class ForkServer:
    """The server process, and the children it started for this client (see the module's docstring). Not for
    several threads at once: one reads the server's messages at a time."""

    def __init__(self, env: dict[str, str] | None = None):
        env = dict(os.environ if env is None else env, PYTHONHASHSEED="0")
        env.pop("PYTHONPATH", None)  # a command's own PYTHONPATH goes into its child's sys.path
        self.env = command_env(env)
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=self.env)
        self._pending, self.exited = b"", {}
        self.files = Path(tempfile.mkdtemp(prefix="fork-server-"))  # each command's stdin/stdout/stderr
        first = self._event(timeout=300)
        assert first == {"ready": True}, first

    def _event(self, timeout: float | None) -> dict | None:
        """The server's next message, or None when none came within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            data = os.read(self.proc.stdout.fileno(), 65536)
            if not data:
                raise RuntimeError(f"the fork server ended (exit {self.proc.wait()})")
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        event = json.loads(line)
        if "exited" in event:
            self.exited[event["exited"]] = event["returncode"]
        return event

    def popen(self, argv: list[str], cwd: str | Path | None = None, env: dict[str, str] | None = None,
              input: str | None = None) -> Forked:
        """Start `argv` (`[python, script, args...]` or `[console script, args...]`) as subprocess.Popen would."""
        argv = [str(a) for a in argv]
        if Path(argv[0]).name.startswith("python") and argv[1].startswith("-"):
            raise ValueError(f"{argv[1]}: the server runs scripts (python <script> ...); run this with subprocess")
        env = command_env(dict(os.environ if env is None else env))
        differ = [k for k in START_ONLY if env.get(k) != self.env.get(k)]
        if differ:
            raise ValueError(f"{', '.join(differ)} differ from the fork server's: a fork cannot change them; "
                             "run this command with subprocess")
        files = Path(tempfile.mkdtemp(prefix="command-", dir=self.files))
        stdin = None
        if input is not None:
            stdin = files / "stdin"
            stdin.write_text(input)
        request = {"argv": argv, "cwd": str(Path(cwd or os.getcwd()).resolve()), "env": env,
                   "stdin": stdin and str(stdin), "stdout": str(files / "stdout"), "stderr": str(files / "stderr")}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        while True:
            event = self._event(timeout=60)
            if event is None:
                raise RuntimeError("the fork server did not start the command within 60 s")
            if "started" in event:
                return Forked(self, event["started"], request["argv"], files)

    def run(self, argv: list[str], cwd=None, env=None, input: str | None = None,
            timeout: float | None = None) -> subprocess.CompletedProcess:
        """subprocess.run(argv, capture_output=True, text=True, check=False) through a fork."""
        proc = self.popen(argv, cwd, env, input)
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        shutil.rmtree(self.files, ignore_errors=True)


class Forked:
    """One command started by the server: subprocess.Popen's pid, poll, wait, send_signal, kill, communicate."""

    def __init__(self, server: ForkServer, pid: int, args: list[str], files: Path):
        self.server, self.pid, self.args, self.files, self.returncode = server, pid, args, files, None

    def poll(self) -> int | None:
        while self.pid not in self.server.exited and self.server._event(timeout=0) is not None:
            pass
        self.returncode = self.server.exited.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.server._event(timeout=left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end (killed past `timeout`, then TimeoutExpired, as subprocess.run does); its output."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        return ((self.files / "stdout").read_text(errors="replace"), (self.files / "stderr").read_text(errors="replace"))


if __name__ == "__main__":
    serve()
