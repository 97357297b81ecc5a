"""metrics.json, a run's record: one writer (atomic), one reader, and the status to believe.

A record says "running" while its process lives. A process that was killed (SIGKILL, OOM, a lost
machine) never gets to say otherwise, so a reader asks the run dir's lock (mhalab.train.record.rundir): "running"
without a live holder is "dead". Each attempt of a resumed run is kept in `attempts`.

The metrics of a finished run (mhalab.train.run writes them):

* `best`: the best checkpoint (by val/acc): its val/* (evaluated again after fit), its test/* and
  `checkpoint`, its path. With test_after_fit=false, only val/acc (the checkpoint callback's score) and `checkpoint`.
* `last_epoch`: the val/* of the last validation during fit (what the run ended at, not what it kept).
* `label_names` (class i's name) and `classes`: per split, per-class precision / recall / F1, support and the
  confusion matrix (mhalab.train.record.class_report), of the best checkpoint (`classes.of` says which).
* `config` (the resolved config), `data` (the data source as the datamodule resolved it: absolute paths, the
  columns and labels data=files found), `provenance` (git commit and dirty flag, versions, device).

Records written before this split hold `final` instead: the last epoch's val/* mixed with the best
checkpoint's test/*. `best()` and `last_epoch()` read both kinds; every reader goes through them (and
through `fields()` for the flat keys), so the record's key names are spelled here only.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from mhalab.train.record import rundir

log = logging.getLogger("mhalab")

FILE = "metrics.json"

# the flat keys tables read (mhalab.analysis.report, mhalab.analysis.lra); absent ones read as None
FIELDS = ("error", "overrides", "seed", "config", "label_names", "params", "epochs", "global_step", "wall_time_s", "fit_time_s",
          "tokens_per_s", "padding_fraction", "peak_mem_mb", "device", "pretrain", "trained", "model", "data")


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


def _dict(record: dict, key: str) -> dict:
    value = record.get(key)
    return value if isinstance(value, dict) else {}


def best(record: dict) -> dict[str, Any]:
    """The best checkpoint's metrics: val/*, test/* and its `checkpoint` path (older records: test/* from `final`)."""
    out = dict(_dict(record, "best"))
    for k, v in _dict(record, "final").items():
        if k.startswith("test/"):
            out.setdefault(k, v)
    return out


def last_epoch(record: dict) -> dict[str, Any]:
    """The last validation's val/* during fit (older records: the val/* of `final`)."""
    if "last_epoch" in record:
        return dict(_dict(record, "last_epoch"))
    return {k: v for k, v in _dict(record, "final").items() if k.startswith("val/")}


def status(run_dir: str | Path, record: dict) -> str:
    """The recorded status, except that "running" without a live process is "dead"."""
    ended = record.get("last_epoch") or record.get("final")  # written at the end of fit
    s = str(record.get("status") or ("finished" if ended else "unknown"))
    if s == "running" and not rundir.is_live(run_dir):
        return "dead"
    return s


def fields(run_dir: str | Path, record: dict) -> dict[str, Any]:
    """What a results table reads from a record: FIELDS (None when absent), the status to believe, and
    the metrics of the best checkpoint (`best`) and of the last epoch (`last_epoch`)."""
    out = {k: record.get(k) for k in FIELDS}
    out.update(status=status(run_dir, record), best=best(record), last_epoch=last_epoch(record))
    return out
