"""Timing and peak memory of one (module, L, B) configuration: every variant and mode, interleaved.

Time: median wall (or process CPU) time of `reps` calls after `warmup` ones, the variants taking turns
so that load from other processes hits them alike. Peak memory: the most bytes of tensors live at once
during one call, above those live before it (see the package docstring for how, on CUDA and on CPU).
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from mhalab.checks.bench.cases import MODES, build, flops, padding_mask

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step(model: nn.Module, call: Callable, mode: str, x: Tensor, kpm, device, amp: bool) -> Callable:
    params = [p for p in model.parameters() if p.requires_grad]

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp)

    if mode == "infer":
        def step():
            with torch.inference_mode(), autocast():
                call(model, x, kpm)
    elif mode == "fwd":
        def step():
            with autocast():
                call(model, x, kpm)
    else:
        def step():
            for p in params:
                p.grad = None
            with autocast():
                out = call(model, x, kpm)
            out.float().sum().backward()
    return step


def time_once(step: Callable, device: torch.device, clock: Callable = time.perf_counter) -> float:
    _sync(device)
    t0 = clock()
    step()
    _sync(device)
    return clock() - t0


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side logs start/stop lines to fd 2 on every call; silence them."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_bytes(step: Callable, device: torch.device) -> int | None:
    """Peak bytes of tensors live during step(), above those live before it (see module docstring)."""
    gc.collect()
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    try:
        from torch._C._profiler import _EventType
        from torch.profiler import ProfilerActivity, profile
    except ImportError:  # private API moved: no CPU memory figure rather than a wrong one
        return None
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    allocs = []  # (time, +bytes allocated / -bytes freed)

    def walk(node):
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            allocs.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    live = peak = 0
    for _, size in sorted(allocs):
        live += size
        peak = max(peak, live)
    return peak


@dataclass
class Row:
    module: str
    mode: str
    seq_len: int
    batch: int
    variant: str
    time_ms: float | None = None
    times_ms: list = field(default_factory=list)
    ratio: float | None = None  # time / official time
    peak_mib: float | None = None
    mem_ratio: float | None = None  # peak / official peak
    tflops: float | None = None
    mfu: float | None = None
    error: str | None = None


def measure(
    module: str, seq_len: int, batch: int, cfg, device, modes=MODES, reps=None, memory=True, warmup=None
) -> list[Row]:
    """All variants and modes of one (module, L, B) configuration, variants interleaved.
    reps=0: no timing (warmup calls, then the memory measurement only)."""
    reps = cfg.reps if reps is None else reps
    warmup = cfg.warmup if warmup is None else warmup
    models = build(module, cfg, device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq_len, cfg.embed_dim, generator=g).to(device)
    kpm = padding_mask(batch, seq_len, cfg.pad_frac, device)
    rows = []
    for mode in modes:
        steps = {v: make_step(m, c, mode, x, kpm, device, cfg.amp) for v, (m, c) in models.items()}
        for v, (m, _) in models.items():
            m.train(mode != "infer")
        res = {v: Row(module, mode, seq_len, batch, v) for v in steps}
        live = dict(steps)
        for i in range(warmup + reps):
            for v, step in list(live.items()):
                try:
                    t = time_once(step, device, CLOCKS[cfg.clock])
                except torch.cuda.OutOfMemoryError:  # CUDA at long L: record it, keep the other variants
                    res[v].error = "OOM"
                    del live[v]
                    torch.cuda.empty_cache()
                    continue
                if i >= warmup:
                    res[v].times_ms.append(t * 1e3)
        if memory:
            for v, step in live.items():
                for prm in models[v][0].parameters():
                    prm.grad = None  # the step allocates them: count them, whatever ran before
                try:
                    pb = peak_bytes(step, device)
                except torch.cuda.OutOfMemoryError:
                    res[v].error = "OOM"
                    torch.cuda.empty_cache()
                    continue
                res[v].peak_mib = None if pb is None else pb / 2**20
        fl = flops(module, mode, x.shape, kpm, cfg)
        for r in res.values():
            if r.times_ms:
                r.time_ms = statistics.median(r.times_ms)
                r.tflops = fl / (r.time_ms * 1e-3) / 1e12
                if cfg.peak_tflops:
                    r.mfu = r.tflops / cfg.peak_tflops
        off = res.get("official")
        for r in res.values():
            if off is not None and off.time_ms and r.time_ms:
                r.ratio = r.time_ms / off.time_ms
            if off is not None and off.peak_mib and r.peak_mib is not None:
                r.mem_ratio = r.peak_mib / off.peak_mib
        rows.extend(res.values())
    del models
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


