"""Peak memory of a run or of any code: CUDA's allocator peak, or on CPU the process's peak resident set.

On CPU the peak (VmHWM) is reset through /proc/self/clear_refs, so runs that share one process are
measured separately; where the reset is refused, getrusage's lifetime peak, marked so.
"""

from __future__ import annotations

import math
import resource
import sys

import torch


def _proc_status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_memory(device: torch.device | str | None = None) -> bool:
    """Start a new peak-memory window. Returns False where the CPU peak cannot be reset (then
    `peak_memory_mb` falls back on the process's lifetime peak)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:  # Linux >= 4.0: writing 5 resets the peak RSS (VmHWM) of this process
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory_mb(device: torch.device | str | None = None) -> tuple[float, str]:
    """(peak MB since the last reset, what was measured)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    hwm = _proc_status_kb("VmHWM")
    if hwm is not None:
        return hwm / 1024, "cpu_peak_rss"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux, bytes on macOS
    return (peak / 2**20 if sys.platform == "darwin" else peak / 1024), "cpu_lifetime_peak_rss"


def current_rss_mb() -> float:
    rss = _proc_status_kb("VmRSS")
    return rss / 1024 if rss is not None else math.nan
