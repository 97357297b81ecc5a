"""Where a run's numbers came from: the code (git commit, dirty flag), the library versions, the device.

Written into metrics.json and sent to every logger beside the resolved config (mhalab.train.record.experiment), so
a result found months later says which code and which stack produced it. No network, no subprocess when
git is absent: a field that cannot be known is None.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

# the libraries whose versions change results or speed (the distribution names pip knows)
PACKAGES = ("mhalab", "torch", "lightning", "torchmetrics", "hydra-core", "omegaconf", "datasets", "tokenizers",
            "numpy")


def versions() -> dict[str, str | None]:
    """python and each of PACKAGES: its installed version, None when it is not installed."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):  # no git on this machine
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def code_state(root: Path | None) -> dict:
    """{"git_commit", "git_dirty"} of the checkout `root` (None, None outside a git checkout: an installed
    package's version stands for its code). Dirty: tracked files changed; untracked files do not count."""
    commit = _git(root, "rev-parse", "HEAD") if root else None
    if commit is None:
        return {"git_commit": None, "git_dirty": None}
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": bool(status) if status is not None else None}


def device(root_device: torch.device | str | None = None) -> dict:
    """The device a run trains on: its kind, name, count and, on CUDA, the CUDA version."""
    dev = torch.device(root_device) if root_device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return {"device": str(dev), "device_name": torch.cuda.get_device_name(dev),
                "device_count": torch.cuda.device_count(), "cuda": torch.version.cuda}
    return {"device": str(dev), "device_name": _cpu_name(), "device_count": 1,
            "cpu_count": os.cpu_count(), "cpu_threads": torch.get_num_threads()}


def _cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what platform knows (often only 'x86_64')."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(root_device: torch.device | str | None = None) -> dict:
    """Code, versions, device and host of this process: what metrics.json's `provenance` holds."""
    from mhalab.train.config import source_checkout

    return {**code_state(source_checkout()), "versions": versions(), **device(root_device),
            "platform": platform.platform(), "argv": list(sys.argv),
            "allocator": os.environ.get("LD_PRELOAD") or "system",  # mimalloc's path once the launcher preloaded it
            "slurm_job_id": slurm_job_id()}


def slurm_job_id() -> str | None:
    """The SLURM job this process runs in (`<array job>_<task>` for an array task, as sacct and squeue show it)."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    return f"{array}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if array else os.environ.get("SLURM_JOB_ID")
