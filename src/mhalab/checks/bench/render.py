"""The benchmark's outputs: bench.md (markdown tables), bench.png (time and memory against L), the console table.

bench.json is written by the command (the rows and targets as they are, with the settings).
"""

from __future__ import annotations

import math
import platform
import re
from pathlib import Path

import torch

from mhalab.checks.bench.cases import EXTRA_VARIANTS, MODES, MODULES, VARIANTS
from mhalab.checks.bench.measure import Row


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or "cpu"
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    name = "cpu " + line.split(":", 1)[1]
                    break
        except OSError:
            pass
    slug = re.sub(r"\(r\)|\(tm\)|cpu @.*$|@.*$", "", name.lower())
    return re.sub(r"[^a-z0-9]+", "-", slug).strip("-") or device.type


def fmt(v, spec) -> str:
    """format(v, spec), or "" for a missing value."""
    return "" if v is None else format(v, spec)


def markdown(rows: list[Row], targets, meta) -> str:
    a = meta["args"]
    setup = (f"torch {meta['torch']}, {meta['dtype']}, threads {meta['threads']}, clock {a['clock']}, "
             f"d={a['embed_dim']}, heads={a['num_heads']}, ff={a['ff_dim']}, enc layers={a['layers']}, "
             f"dropout={a['dropout']}, padding {a['pad_frac']:g} of positions. "
             "Ratios are to the official module of the same row group (lower is better).")
    header = "| module | mode | L | B | variant | median ms | x official | peak MiB | mem x official | TFLOP/s | MFU |"
    lines = [f"# Benchmark: {meta['device_name']}", "", f"`{meta['command']}`", "", setup, "",
             meta["memory_note"], "", header, "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r.module} | {r.mode} | {r.seq_len} | {r.batch} | {r.variant} | "
            f"{fmt(r.time_ms, '.2f') or (r.error or '')} | {fmt(r.ratio, '.3f')} | {fmt(r.peak_mib, '.1f')} | "
            f"{fmt(r.mem_ratio, '.3f')} | {fmt(r.tflops, '.3f')} | {fmt(r.mfu, '.1%')} |"
        )
    if targets:
        lines += ["", "## Targets", "", "| target | measured | limit | result | detail |", "|---|---:|---:|---|---|"]
        for t in targets:
            lines.append(f"| {t['target']} | {fmt(t['value'], '.3f')} | {t['limit']} | "
                         f"{'PASS' if t['passed'] else 'FAIL'} | {t['detail']} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no backend to pick, no global figure state

    modules = [m for m in MODULES if any(r.module == m for r in rows)]
    if not modules:
        return
    fig = Figure(figsize=(12, 3.8 * len(modules)))
    axes = fig.subplots(len(modules), 2, squeeze=False)
    colors = {"weights": "tab:red", "fused": "tab:blue", "official": "tab:gray", "fused_padded": "tab:cyan"}
    styles = {"fwd": ":", "train": "-", "infer": "--"}
    for i, mod in enumerate(modules):
        for mode in MODES:
            for v in VARIANTS + EXTRA_VARIANTS:
                pts = sorted((r.seq_len, r.time_ms, r.peak_mib) for r in rows
                             if r.module == mod and r.mode == mode and r.variant == v)
                if not pts:
                    continue
                Ls = [p[0] for p in pts]
                for j, k in ((0, 1), (1, 2)):
                    ys = [p[k] for p in pts]
                    if all(y is None for y in ys):
                        continue
                    axes[i][j].plot(Ls, [math.nan if y is None else y for y in ys], styles[mode],
                                    color=colors[v], marker="o", ms=3, label=f"{v} {mode}")
        for j, ylabel in enumerate(("median time (ms)", "peak memory (MiB)")):
            ax = axes[i][j]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length L (batch = tokens / L)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{mod}: {ylabel.split(' (')[0]}")
            ax.grid(True, which="both", alpha=0.3)
        axes[i][1].legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def console(rows: list[Row], targets, meta) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is a dependency, but the markdown says the same
        print(markdown(rows, targets, meta))
        return
    c = Console(width=max(Console().width, 150))
    tab = Table(title="mhalab benchmark (ratios: x official, lower is better)")
    for col in ("module", "mode", "L", "B", "variant", "ms", "x off", "MiB", "mem x off", "TFLOP/s", "MFU"):
        tab.add_column(col, justify="left" if col in ("module", "mode", "variant") else "right")
    prev = None
    for r in rows:
        key = (r.module, r.mode, r.seq_len, r.batch)
        if prev is not None and key != prev:
            tab.add_section()
        prev = key
        ratio = fmt(r.ratio, ".3f")
        if r.ratio is not None and r.variant != "official":
            ratio = f"[{'green' if r.ratio < 1 else 'red'}]{ratio}[/]"
        tab.add_row(r.module, r.mode, str(r.seq_len), str(r.batch), r.variant,
                    fmt(r.time_ms, ".2f") or (r.error or ""), ratio, fmt(r.peak_mib, ".1f"),
                    fmt(r.mem_ratio, ".3f"), fmt(r.tflops, ".3f"), fmt(r.mfu, ".1%"))
    c.print(tab)
    if targets:
        tt = Table(title="Targets")
        for col in ("target", "measured", "limit", "result", "detail"):
            tt.add_column(col)
        for t in targets:
            tt.add_row(t["target"], fmt(t["value"], ".3f"), f"<= {t['limit']}",
                       "[green]PASS[/]" if t["passed"] else "[red]FAIL[/]", t["detail"])
        c.print(tt)
