"""mhalab-bench: sweep the modules and lengths, optionally the targets; write bench.json, bench.md, bench.png."""

from __future__ import annotations

import json
import platform
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from mhalab.checks.bench.config import parse_config
from mhalab.checks.bench.measure import Row, measure
from mhalab.checks.bench.render import console, device_name, markdown, plot
from mhalab.checks.bench.targets import run_targets
from mhalab.errors import one_line_errors


@one_line_errors
def main(argv: Sequence[str] | None = None, prog: str = "mhalab-bench") -> int:
    """Entry point of mhalab-bench (and scripts/bench.py, which passes its own `prog` for the record)."""
    import mhalab.checks.bench as package  # its docstring is the --help text

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_config(argv, prog, package.__doc__)  # the resolved settings (BenchConfig)
    # nn.TransformerEncoder's nested tensors warn on every eval call; the warning is not news here
    warnings.filterwarnings("ignore", message=".*nested tensors is in prototype stage")
    warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # only matters with amp=false
        torch.backends.cudnn.allow_tf32 = True
    name = device_name(device)
    out = Path(args.out or Path("results/bench") / name)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    t0 = time.perf_counter()
    if not args.targets_only:
        for module in args.modules:
            for L in args.seq_lens:
                B = args.batch or max(1, args.tokens // L)
                print(f"[bench] {module} L={L} B={B} ...", file=sys.stderr, flush=True)
                rows += measure(module, L, B, args, device, modes=args.modes, memory=args.memory)
    targets = None
    if args.targets or args.targets_only:
        print("[bench] targets ...", file=sys.stderr, flush=True)
        targets = run_targets(args, device)
    meta = {
        "device_name": name, "device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "dtype": "bf16 autocast (fp32 params)" if args.amp else "float32", "python": platform.python_version(),
        "command": " ".join([prog, *argv]),
        "seconds": round(time.perf_counter() - t0, 1),
        "args": asdict(args),
        "memory_note": (
            "Peak memory: CUDA max_memory_allocated() minus memory_allocated() before the call."
            if device.type == "cuda" else
            "Peak memory (CPU): the peak of the running sum of tensor allocations and frees that "
            "torch.profiler(profile_memory=True) records during one call, i.e. the most bytes of tensors "
            "live at once above those live before it (activations, gradients, temporaries)."),
        "flops_note": "useful matmul FLOPs: 8*N*E^2 + 4*N*E*F + 4*E*sum(len^2) per layer; x3 for train",
    }
    (out / "bench.json").write_text(json.dumps(
        {"meta": meta, "results": [asdict(r) for r in rows], "targets": targets}, indent=1))
    (out / "bench.md").write_text(markdown(rows, targets, meta))
    if rows:
        plot(rows, out / "bench.png")
    console(rows, targets, meta)
    print(f"[bench] {meta['seconds']} s; wrote {out}/bench.json, bench.md" + (", bench.png" if rows else ""),
          file=sys.stderr)
    return 0
