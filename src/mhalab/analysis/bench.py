"""Speed and memory of our attention / encoder against PyTorch's, weights copied (`make bench`).

What is compared, for each module, sequence length L and batch B:
  * `weights`  our module on the explicit path: MultiHeadAttention(need_weights=True), which forms
               the (B, H, L, L) weight matrix. Inside encoder layers (which call need_weights=False)
               the attention kernel is wrapped so that it still takes the explicit path.
  * `fused`    our module as it ships: need_weights=False -> F.scaled_dot_product_attention.
  * `official` nn.MultiheadAttention / nn.TransformerEncoderLayer / nn.TransformerEncoder with the same
               weights (from_official), called the way a user calls them (need_weights=False for the
               bare attention, nested tensors enabled for the encoder stack: PyTorch's defaults).
Modules: `attn` (self-attention), `layer` (one post-norm encoder layer), `enc` (a stack, --layers).
Modes:   `fwd`   train mode, forward only, autograd recording (what a training forward costs);
         `train` forward + backward of a training step (loss = sum of the outputs, grads set to None
                 before each step as `optimizer.zero_grad()` does);
         `infer` eval mode under torch.inference_mode().
Padding: each batch has a key-padding mask (right padding, lengths spread evenly over
         [L - 2*pad_frac*L, L], so that pad_frac of all positions are padding: a quarter by default,
         as in a real unbucketed batch). `--pad-frac 0` / `--no-padding` passes no mask at all.

Measurements:
  * time: median wall time of `--reps` repetitions after `--warmup` ones. Variants are interleaved
    (weights, fused, official, weights, fused, ...) so that load from other processes on a shared
    machine hits them alike; ratios are to the official module of the same row.
  * peak memory: the most bytes of tensors live at once during one call, above what was live
    before it (inputs and parameters are not counted; activations saved for backward, gradients and
    temporaries are). CUDA: torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus
    memory_allocated() before. CPU: there is no allocator peak counter, so one extra call runs under
    torch.profiler(profile_memory=True), which records every CPU tensor allocation and free with
    its size; the peak of their running sum is the number reported (allocator caching and
    fragmentation are not included; it is the live-tensor peak).
  * FLOPs (CUDA, or CPU with --peak-tflops): counted analytically, matmuls only, on the useful work:
    projections 2*N*E*4E, feed-forward 2*N*E*F*2 (N = real tokens), attention 2*E*sum_b(len_b^2)*2
    (QK^T and AV over real query/key pairs); x3 for forward+backward. Every variant is credited the
    same FLOPs, so TFLOP/s ratios are time ratios; MFU = TFLOP/s / --peak-tflops.
On CUDA, the models keep float32 parameters and run under torch.autocast(bfloat16).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from mhalab.nn.attention import MultiHeadAttention, ScaledDotProductAttention
from mhalab.nn.encoder import TransformerEncoder, TransformerEncoderLayer

VARIANTS = ("weights", "fused", "official")
EXTRA_VARIANTS = ("fused_padded",)  # enc only: our stack with unpad=False (every position computed)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
MODULES = ("attn", "layer", "enc")
MODES = ("fwd", "train", "infer")

# The issue's target configuration (measured on CPU, float32).
TARGET_CFG = {"embed_dim": 256, "num_heads": 4, "ff_dim": 1024, "seq_len": 128, "batch": 32, "layers": 2,
              "pad_frac": 0.25}
TARGET_MEM_SEQ = 2048


# ------------------------------------------------------------------------------------------------
# inputs and models
# ------------------------------------------------------------------------------------------------
def padding_mask(batch: int, seq_len: int, pad_frac: float, device: torch.device, seed: int = 0) -> Tensor | None:
    """(B, L) bool, True at padded positions (right padding); pad_frac of all positions on average."""
    if pad_frac <= 0:
        return None
    # lengths evenly spread over [L - 2*pad_frac*L, L]: mean padding = pad_frac * L, as in a batch of
    # sentences of varied length padded to the longest; shuffled so padding is not sorted by row
    u = (torch.arange(batch, dtype=torch.float64) + 0.5) / batch
    lengths = (seq_len - torch.round(2 * pad_frac * seq_len * u)).clamp(min=1).long()
    lengths = lengths[torch.randperm(batch, generator=torch.Generator().manual_seed(seed))]
    return (torch.arange(seq_len)[None, :] >= lengths[:, None]).to(device)


class _ExplicitWeights(nn.Module):
    """Wraps an attention kernel so that it always takes the need_weights=True path."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, q, k, v, mask=None, need_weights=True):
        return self.inner(q, k, v, mask=mask, need_weights=True)


def _explicit(model: nn.Module) -> nn.Module:
    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):
            m.attention = _ExplicitWeights(m.attention)
    return model


def build(module: str, args, device: torch.device) -> dict[str, tuple[nn.Module, Callable]]:
    """{variant: (model, call(model, x, kpm) -> output (B, L, E))}, all with the official weights."""
    torch.manual_seed(0)
    E, H, Fd, p = args.embed_dim, args.num_heads, args.ff_dim, args.dropout
    if module == "attn":
        off = nn.MultiheadAttention(E, H, dropout=p, batch_first=True)
        ours = MultiHeadAttention.from_official(off)
        calls = {
            "weights": lambda m, x, kpm: m(x, key_padding_mask=kpm, need_weights=True)[0],
            "fused": lambda m, x, kpm: m(x, key_padding_mask=kpm, need_weights=False)[0],
            "official": lambda m, x, kpm: m(x, x, x, key_padding_mask=kpm, need_weights=False)[0],
        }
        models = {"weights": ours, "fused": copy.deepcopy(ours), "official": off}
    else:
        layer = nn.TransformerEncoderLayer(E, H, Fd, p, activation=args.activation, batch_first=True)
        if module == "layer":
            off = layer
            ours = TransformerEncoderLayer.from_official(off)
        else:
            off = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=True)
            # nn.TransformerEncoder deep-copies one layer; give each layer its own weights
            for lyr in off.layers[1:]:
                for m in lyr.modules():
                    if hasattr(m, "_reset_parameters"):
                        m._reset_parameters()
                    elif isinstance(m, nn.Linear):
                        m.reset_parameters()
            ours = TransformerEncoder.from_official(off)
        call = lambda m, x, kpm: m(x, src_key_padding_mask=kpm)
        calls = dict.fromkeys(VARIANTS + EXTRA_VARIANTS, call)
        models = {"weights": _explicit(ours), "fused": ours, "official": off}
        if module == "enc":
            models["fused_padded"] = copy.deepcopy(ours)
            models["fused_padded"].unpad = False
    out = {}
    for v in args.variants:
        if v not in models:
            continue
        m = models[v].to(device)
        if args.compile and v != "official":
            m = torch.compile(m)
        out[v] = (m, calls[v])
    return out


# ------------------------------------------------------------------------------------------------
# FLOPs
# ------------------------------------------------------------------------------------------------
def flops(module: str, mode: str, x_shape, kpm: Tensor | None, args) -> float:
    B, L, E = x_shape
    if kpm is None:
        n_tok, pairs = B * L, B * L * L
    else:
        lengths = (~kpm).sum(1).double()
        n_tok, pairs = float(lengths.sum()), float((lengths**2).sum())
    per_layer = 2 * n_tok * E * 4 * E + 2 * 2 * E * pairs  # projections, QK^T + AV
    if module != "attn":
        per_layer += 2 * 2 * n_tok * E * args.ff_dim  # two feed-forward matmuls
    total = per_layer * (args.layers if module == "enc" else 1)
    return total * (3 if mode == "train" else 1)


# ------------------------------------------------------------------------------------------------
# timing and memory
# ------------------------------------------------------------------------------------------------
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
    module: str, seq_len: int, batch: int, args, device, modes=MODES, reps=None, memory=True, warmup=None
) -> list[Row]:
    """All variants and modes of one (module, L, B) configuration, variants interleaved.
    reps=0: no timing (warmup calls, then the memory measurement only)."""
    reps = args.reps if reps is None else reps
    warmup = args.warmup if warmup is None else warmup
    models = build(module, args, device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq_len, args.embed_dim, generator=g).to(device)
    kpm = padding_mask(batch, seq_len, args.pad_frac, device)
    rows = []
    for mode in modes:
        steps = {v: make_step(m, c, mode, x, kpm, device, args.amp) for v, (m, c) in models.items()}
        for v, (m, _) in models.items():
            m.train(mode != "infer")
        res = {v: Row(module, mode, seq_len, batch, v) for v in steps}
        live = dict(steps)
        for i in range(warmup + reps):
            for v, step in list(live.items()):
                try:
                    t = time_once(step, device, CLOCKS[args.clock])
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
        fl = flops(module, mode, x.shape, kpm, args)
        for r in res.values():
            if r.times_ms:
                r.time_ms = statistics.median(r.times_ms)
                r.tflops = fl / (r.time_ms * 1e-3) / 1e12
                if args.peak_tflops:
                    r.mfu = r.tflops / args.peak_tflops
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


# ------------------------------------------------------------------------------------------------
# targets
# ------------------------------------------------------------------------------------------------
def run_targets(args, device) -> list[dict]:
    """The issue's checks, at the fixed target configuration (whatever the sweep's flags).

    1-3: median time ratios at L=128, B=32 (training step and inference).
    4:   peak memory of the fused path / the weights path at L=2048 (same 4096 positions, B=2), for
         the training step and for inference. On CPU, SDPA has no fused kernel with dropout (it falls
         back to the explicit computation for dropout_p > 0, for the official module too); our fused
         path then attends in checkpointed query blocks (attention._blocked_sdpa). The training
         step is also measured with dropout 0, where SDPA's own fused kernel runs.
    """
    t = argparse.Namespace(**vars(args))
    t.embed_dim, t.num_heads, t.ff_dim = TARGET_CFG["embed_dim"], TARGET_CFG["num_heads"], TARGET_CFG["ff_dim"]
    t.layers, t.pad_frac, t.variants = TARGET_CFG["layers"], TARGET_CFG["pad_frac"], list(VARIANTS)
    L, B = TARGET_CFG["seq_len"], TARGET_CFG["batch"]
    rows = measure("enc", L, B, t, device, modes=("train", "infer"), reps=args.target_reps, memory=False)
    get = {(r.mode, r.variant): r for r in rows}
    Lm = TARGET_MEM_SEQ
    Bm = max(1, (L * B) // Lm)  # the same number of positions as the timing case
    t.variants = ["weights", "fused"]
    mem = measure("enc", Lm, Bm, t, device, modes=("train", "infer"), reps=0, warmup=1)
    getm = {(r.mode, r.variant): r.peak_mib for r in mem}
    if t.dropout > 0:
        t0 = argparse.Namespace(**vars(t))
        t0.dropout = 0.0
        for r in measure("enc", Lm, Bm, t0, device, modes=("train",), reps=0, warmup=1):
            getm[("train_p0", r.variant)] = r.peak_mib

    def check(name, value, limit, detail):
        ok = value is not None and value <= limit
        return {"target": name, "value": value, "limit": limit, "passed": ok, "detail": detail}

    def ms(mode, v):
        return f"{v} {_fmt(get[(mode, v)].time_ms, '.1f')} ms"

    cfg = f"enc x{t.layers}, d={t.embed_dim}, h={t.num_heads}, ff={t.ff_dim}, L={L}, B={B}, pad {t.pad_frac:g}"
    w_train, w_inf = get[("train", "weights")].ratio, get[("infer", "weights")].ratio
    out = [
        check("fused training step / official", get[("train", "fused")].ratio, 0.85,
              f"{cfg}, dropout {t.dropout:g}; {ms('train', 'fused')} vs {ms('train', 'official')}"),
        check("fused inference / official", get[("infer", "fused")].ratio, 0.90,
              f"{cfg}; {ms('infer', 'fused')} vs {ms('infer', 'official')}"),
        check("weights path / official (worse of train, infer)",
              None if w_train is None or w_inf is None else max(w_train, w_inf), 1.30,
              f"{cfg}; train {_fmt(w_train, '.3f')}, infer {_fmt(w_inf, '.3f')}"),
    ]
    for key, what in (("train", f"training step, dropout {t.dropout:g}"), ("train_p0", "training step, dropout 0"),
                      ("infer", "inference")):
        if (key, "fused") not in getm:
            continue
        pf, pw = getm[(key, "fused")], getm[(key, "weights")]
        out.append(check(
            f"fused / weights peak memory at L={Lm}, {what}", None if not pf or not pw else pf / pw, 0.50,
            f"enc x{t.layers}, L={Lm}, B={Bm}: fused {_fmt(pf, '.1f')} MiB, weights {_fmt(pw, '.1f')} MiB"
            + ("; CPU SDPA has no fused kernel with dropout: query blocks of "
               f"{ScaledDotProductAttention.query_block}, recomputed in backward"
               if key == "train" and t.dropout > 0 and device.type == "cpu" else ""),
        ))
    return out


# ------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------
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


def _fmt(v, spec):
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
            f"{_fmt(r.time_ms, '.2f') or (r.error or '')} | {_fmt(r.ratio, '.3f')} | {_fmt(r.peak_mib, '.1f')} | "
            f"{_fmt(r.mem_ratio, '.3f')} | {_fmt(r.tflops, '.3f')} | {_fmt(r.mfu, '.1%')} |"
        )
    if targets:
        lines += ["", "## Targets", "", "| target | measured | limit | result | detail |", "|---|---:|---:|---|---|"]
        for t in targets:
            lines.append(f"| {t['target']} | {_fmt(t['value'], '.3f')} | {t['limit']} | "
                         f"{'PASS' if t['passed'] else 'FAIL'} | {t['detail']} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modules = [m for m in MODULES if any(r.module == m for r in rows)]
    if not modules:
        return
    fig, axes = plt.subplots(len(modules), 2, figsize=(12, 3.8 * len(modules)), squeeze=False)
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
    plt.close(fig)


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
        ratio = _fmt(r.ratio, ".3f")
        if r.ratio is not None and r.variant != "official":
            ratio = f"[{'green' if r.ratio < 1 else 'red'}]{ratio}[/]"
        tab.add_row(r.module, r.mode, str(r.seq_len), str(r.batch), r.variant,
                    _fmt(r.time_ms, ".2f") or (r.error or ""), ratio, _fmt(r.peak_mib, ".1f"),
                    _fmt(r.mem_ratio, ".3f"), _fmt(r.tflops, ".3f"), _fmt(r.mfu, ".1%"))
    c.print(tab)
    if targets:
        tt = Table(title="Targets")
        for col in ("target", "measured", "limit", "result", "detail"):
            tt.add_column(col)
        for t in targets:
            tt.add_row(t["target"], _fmt(t["value"], ".3f"), f"<= {t['limit']}",
                       "[green]PASS[/]" if t["passed"] else "[red]FAIL[/]", t["detail"])
        c.print(tt)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda[:i]")
    ap.add_argument("--quick", action="store_true",
                    help="small sweep: attn and enc at L = 128 and 1024 (CPU), 3 reps; ~1.5 min on an idle\n"
                         "2-core CPU, ~2.5 min with --targets")
    ap.add_argument("--modules", default=None, help=f"comma list of {MODULES}")
    ap.add_argument("--modes", default=None, help=f"comma list of {MODES}")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma list of {VARIANTS + EXTRA_VARIANTS}")
    ap.add_argument("--seq-lens", type=_ints, default=None,
                    help="comma list; default 64..2048 (CPU), 128..8192 (CUDA)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="positions per batch: batch = max(1, tokens // L) (default 4096 CPU, 32768 CUDA)")
    ap.add_argument("--batch", type=int, default=None, help="fixed batch size (overrides --tokens)")
    ap.add_argument("--embed-dim", type=int, default=None, help="default 256 (CPU), 768 (CUDA)")
    ap.add_argument("--num-heads", type=int, default=None, help="default 4 (CPU), 12 (CUDA)")
    ap.add_argument("--ff-dim", type=int, default=None, help="default 4 * embed-dim")
    ap.add_argument("--layers", type=int, default=2, help="layers in the `enc` stack")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--activation", default="gelu", choices=("relu", "gelu"))
    ap.add_argument("--pad-frac", type=float, default=0.25, help="fraction of positions that are padding")
    ap.add_argument("--no-padding", action="store_true", help="no key-padding mask (same as --pad-frac 0)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 7, quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed repetitions first (default 2, quick 1)")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    ap.add_argument("--no-amp", action="store_true", help="CUDA: float32 instead of bf16 autocast")
    ap.add_argument("--compile", action="store_true", help="torch.compile our variants (not the official)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="for MFU; default 989 on CUDA (H200 bf16 dense), none on CPU")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    ap.add_argument("--clock", default="wall", choices=tuple(CLOCKS),
                    help="wall: elapsed time; cpu: this process's CPU time, which leaves out the time other\n"
                         "processes held the cores (use with --threads 1 on a shared machine; CPU only)")
    ap.add_argument("--targets", action="store_true", help="also run the issue's four target checks")
    ap.add_argument("--target-reps", type=int, default=15)
    ap.add_argument("--targets-only", action="store_true", help="skip the sweep, run only the target checks")
    ap.add_argument("--out", default=None, help="output dir (default results/bench/<device-name>/)")
    args = ap.parse_args(argv)

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = args.device.startswith("cuda")
    if args.no_padding:
        args.pad_frac = 0.0
    args.amp = cuda and not args.no_amp
    if cuda and args.clock != "wall":
        ap.error("--clock cpu measures host CPU time; on CUDA use the default wall clock")
    args.embed_dim = args.embed_dim or (768 if cuda else 256)
    args.num_heads = args.num_heads or (12 if cuda else 4)
    args.ff_dim = args.ff_dim or 4 * args.embed_dim
    args.tokens = args.tokens or (32768 if cuda else 4096)
    if args.peak_tflops is None and cuda:
        args.peak_tflops = 989.0
    if args.quick:
        args.seq_lens = args.seq_lens or ([128, 1024, 8192] if cuda else [128, 1024])
        args.modules = args.modules or "attn,enc"
        args.reps = args.reps or 3
        args.warmup = args.warmup if args.warmup is not None else 1
    else:
        args.seq_lens = args.seq_lens or ([128, 256, 512, 1024, 2048, 4096, 8192] if cuda
                                          else [64, 128, 256, 512, 1024, 2048])
        args.reps = args.reps or 7
        args.warmup = args.warmup if args.warmup is not None else 2
    args.modules = [m for m in (args.modules or ",".join(MODULES)).split(",") if m]
    args.modes = [m for m in (args.modes or ",".join(MODES)).split(",") if m]
    args.variants = [v for v in args.variants.split(",") if v]
    for name, vals, allowed in (("modules", args.modules, MODULES), ("modes", args.modes, MODES),
                                ("variants", args.variants, VARIANTS + EXTRA_VARIANTS)):
        bad = [v for v in vals if v not in allowed]
        if bad:
            ap.error(f"--{name}: unknown {bad}; choose from {allowed}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # nn.TransformerEncoder's nested tensors warn on every eval call; the warning is not news here
    warnings.filterwarnings("ignore", message=".*nested tensors is in prototype stage")
    warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # only matters with --no-amp
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
                rows += measure(module, L, B, args, device, modes=args.modes, memory=not args.no_memory)
    targets = None
    if args.targets or args.targets_only:
        print("[bench] targets ...", file=sys.stderr, flush=True)
        targets = run_targets(args, device)
    meta = {
        "device_name": name, "device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "dtype": "bf16 autocast (fp32 params)" if args.amp else "float32", "python": platform.python_version(),
        "command": "python scripts/bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "seconds": round(time.perf_counter() - t0, 1),
        "args": dict(vars(args)),
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
