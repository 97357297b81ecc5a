"""The memory allocator a training run uses: mimalloc, preloaded by the launcher, on Linux.

Why: a training step allocates tensors whose sizes follow the batch's lengths, so every step asks for other sizes.
glibc's malloc places those of up to 32 MB in its heap, and the heap fragments: an IMDB fit's resident memory grew
~4 MB a step, to 5.6 GB after 1,400 steps and peaks of 7-10 GB, with nothing leaking (results/memory.md).
The same loop under mimalloc (or tcmalloc) stays flat at the same speed; glibc's own settings that stop the growth
(a fixed M_MMAP_THRESHOLD, malloc_trim every step) cost 1.4-1.9x in speed, because freed memory goes back to
the kernel and each new tensor page-faults it in again.

An allocator is chosen when a process starts (LD_PRELOAD), so `mhalab-train` / `python train.py` start again,
once, with mimalloc preloaded (`reexec_with_allocator`, the first thing the command does); the processes it starts
(a sweep's joblib workers, DDP ranks) inherit it. mimalloc comes from the cmeel-mimalloc wheel (a dependency on
Linux). MHALAB_ALLOCATOR=system keeps glibc's malloc; an LD_PRELOAD the user set is left as it is.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mhalab.errors import ConfigError

ENV = "MHALAB_ALLOCATOR"  # mimalloc (default) | system


def mimalloc_path() -> Path | None:
    """The mimalloc shared library of the cmeel-mimalloc wheel, or None (not Linux, or not installed)."""
    if not sys.platform.startswith("linux"):
        return None
    for site in map(Path, sys.path):
        lib = site / "cmeel.prefix" / "lib"
        found = sorted(lib.glob("libmimalloc.so*")) if lib.is_dir() else []
        if found:
            return found[0].resolve()
    return None


def preload_env(env: dict[str, str] | None = None) -> dict[str, str] | None:
    """The environment that starts a process with mimalloc preloaded, or None when none is needed or possible:
    already preloaded, the user's own LD_PRELOAD, MHALAB_ALLOCATOR=system, or no mimalloc here."""
    env = dict(os.environ if env is None else env)
    choice = env.get(ENV, "mimalloc")
    if choice not in ("mimalloc", "system"):
        raise ConfigError(f"{ENV}={choice!r}: choose mimalloc (the default) or system (glibc's malloc).")
    if choice == "system" or env.get("LD_PRELOAD"):
        return None
    lib = mimalloc_path()
    if lib is None:
        return None
    # mimalloc keeps freed pages for reuse (never purged back to the kernel: each purge is page faults later,
    # ~10% of a CPU step at its 10 ms default); its size classes keep the set it holds from growing
    return env | {"LD_PRELOAD": str(lib), ENV: "mimalloc", "MIMALLOC_PURGE_DELAY": env.get("MIMALLOC_PURGE_DELAY", "-1")}


def reexec_with_allocator() -> None:
    """Start this command again with mimalloc preloaded, when preload_env says so (otherwise return). The same
    interpreter, flags and arguments (sys.orig_argv), the same working directory; the process is replaced.
    Only a process started as this command restarts (its command line ends with sys.argv: `mhalab-train ...`,
    `python train.py ...`); one that calls mhalab.cli.train() from inside something else (a notebook, a test
    driver, `python -m`) keeps its allocator and its process."""
    started_as_this = sys.argv and sys.orig_argv[-len(sys.argv):] == sys.argv
    env = preload_env() if started_as_this else None
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
        except OSError:  # the interpreter cannot be started again (e.g. not executable by this user): go on as is
            return
