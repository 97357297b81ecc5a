"""metrics.json, a run's record: one writer (atomic), one reader, and the status to believe.

A record says "running" while its process lives. A process that was killed (SIGKILL, OOM, a lost
machine) never gets to say otherwise, so a reader asks the run dir's lock (mhalab.train.rundir): "running"
without a live holder is "dead". Each attempt of a resumed run is kept in `attempts`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from mhalab.train import rundir

log = logging.getLogger("mhalab")

FILE = "metrics.json"


def path(run_dir: str | Path) -> Path:
    return Path(run_dir) / FILE


def write(run_dir: str | Path, record: dict) -> None:
    p = path(run_dir)
    tmp = p.with_name(f".{FILE}.tmp")  # write then rename: a crash never leaves half a file
    tmp.write_text(json.dumps(record, indent=2, default=str))
    tmp.replace(p)


def read(run_dir: str | Path) -> dict | None:
    """The record, None when there is none; ValueError (naming the file) when it cannot be parsed."""
    p = path(run_dir)
    if not p.is_file():
        return None
    try:
        data = json.loads(p.read_text())
    except ValueError as e:
        raise ValueError(f"{p} is not valid JSON ({e}); it was cut short or edited") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p} holds a {type(data).__name__}, not a run record")  # noqa: TRY004 (one error type)
    return data


def read_or_set_aside(run_dir: str | Path) -> dict | None:
    """read(), but an unreadable record is renamed (kept, never overwritten) and None returned."""
    try:
        return read(run_dir)
    except ValueError as e:
        aside = path(run_dir).with_name(f"{FILE}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
        path(run_dir).rename(aside)
        log.warning("%s; kept it as %s and started a new record", e, aside.name)
        return None


def status(run_dir: str | Path, record: dict) -> str:
    """The recorded status, except that "running" without a live process is "dead"."""
    s = str(record.get("status") or ("finished" if record.get("final") else "unknown"))
    if s == "running" and not rundir.is_live(run_dir):
        return "dead"
    return s
