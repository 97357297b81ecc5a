"""The benchmark's settings: key=value options over BenchConfig's defaults, then the device's defaults.

    mhalab-bench quick=true targets=true        mhalab-bench threads=1 clock=cpu
    mhalab-bench device=cuda                    mhalab-bench modules=[enc] seq_lens=[512,1024] out=/tmp/b
null (the default of several options) means: the device's default, filled in by `resolve`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mhalab.analysis.options import doc, parse
from mhalab.checks.bench.cases import EXTRA_VARIANTS, MODES, MODULES, VARIANTS
from mhalab.checks.bench.measure import CLOCKS
from mhalab.errors import ConfigError
from mhalab.nn.attention import check_heads


@dataclass
class BenchConfig:
    """Every option with its default; null: the device's default (see resolve)."""

    device: str = field(default="auto", metadata=doc("auto (cuda if available), cpu or cuda[:i]"))
    quick: bool = field(default=False, metadata=doc(
        "small sweep: attn and enc at L = 128 and 1024 (CPU), 3 reps; ~1.5 min on an idle 2-core CPU, "
        "~2.5 min with targets=true"))
    modules: list[str] | None = field(default=None, metadata=doc(f"of {MODULES} (default all; quick: attn, enc)"))
    modes: list[str] | None = field(default=None, metadata=doc(f"of {MODES} (default all)"))
    variants: list[str] | None = field(default=None, metadata=doc(
        f"of {VARIANTS + EXTRA_VARIANTS} (default {VARIANTS})"))
    seq_lens: list[int] | None = field(default=None, metadata=doc(
        "e.g. [128,1024]; default 64..2048 (CPU), 128..8192 (CUDA)"))
    tokens: int | None = field(default=None, metadata=doc(
        "positions per batch: batch = max(1, tokens // L) (default 4096 CPU, 32768 CUDA)"))
    batch: int | None = field(default=None, metadata=doc("fixed batch size (overrides tokens)"))
    embed_dim: int | None = field(default=None, metadata=doc("default 256 (CPU), 768 (CUDA)"))
    num_heads: int | None = field(default=None, metadata=doc("default 4 (CPU), 12 (CUDA)"))
    ff_dim: int | None = field(default=None, metadata=doc("default 4 * embed_dim"))
    layers: int = field(default=2, metadata=doc("layers in the `enc` stack"))
    dropout: float = field(default=0.1, metadata=doc("attention, residual and feed-forward dropout"))
    activation: str = field(default="gelu", metadata=doc("relu | gelu"))
    pad_frac: float = field(default=0.25, metadata=doc("fraction of positions that are padding (0: no mask)"))
    reps: int | None = field(default=None, metadata=doc("timed repetitions (default 7, quick 3)"))
    warmup: int | None = field(default=None, metadata=doc("untimed repetitions first (default 2, quick 1)"))
    memory: bool = field(default=True, metadata=doc("measure peak memory (false: skip it)"))
    amp: bool = field(default=True, metadata=doc("CUDA: bf16 autocast (false: float32); always false on CPU"))
    compile: bool = field(default=False, metadata=doc("torch.compile our variants (not the official)"))
    peak_tflops: float | None = field(default=None, metadata=doc(
        "for MFU; default 989 on CUDA (H200 bf16 dense), none on CPU"))
    threads: int | None = field(default=None, metadata=doc("torch.set_num_threads (CPU)"))
    clock: str = field(default="wall", metadata=doc(
        "wall: elapsed time; cpu: this process's CPU time, which leaves out the time other processes held "
        "the cores (with threads=1 on a shared machine; CPU only)"))
    targets: bool = field(default=False, metadata=doc("also run the issue's four target checks"))
    target_reps: int = field(default=15, metadata=doc("timed repetitions of the target checks"))
    targets_only: bool = field(default=False, metadata=doc("skip the sweep, run only the target checks"))
    out: str | None = field(default=None, metadata=doc("output dir (default results/bench/<device-name>/)"))


def parse_config(argv: Sequence[str], prog: str = "mhalab-bench", help_text: str = "") -> BenchConfig:
    """key=value words -> the resolved settings (ConfigError, one line, for a mistake)."""
    return resolve(parse(BenchConfig, argv, prog, help_text))


def resolve(cfg: BenchConfig) -> BenchConfig:
    """Fill in the device's defaults (every null but out, batch, threads, peak_tflops on CPU) and check."""
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise ConfigError(f"device={device!r} is not a device; use auto, cpu or cuda[:i].") from None
    cuda = kind == "cuda"
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"device={device} is not supported; use auto, cpu or cuda[:i].")
    if cfg.clock not in CLOCKS:
        raise ConfigError(f"clock={cfg.clock} is not a clock; choose one of {', '.join(CLOCKS)}.")
    if cuda and cfg.clock != "wall":
        raise ConfigError("clock=cpu measures host CPU time; on CUDA use the default clock=wall.")
    if cuda and not torch.cuda.is_available():
        raise ConfigError(f"device={device}, but torch {torch.__version__} sees no CUDA device; use device=cpu.")
    quick = cfg.quick
    embed_dim = _or(cfg.embed_dim, 768 if cuda else 256)
    if quick:
        seq_lens = _or(cfg.seq_lens, [128, 1024, 8192] if cuda else [128, 1024])
    else:
        seq_lens = _or(cfg.seq_lens, [128, 256, 512, 1024, 2048, 4096, 8192] if cuda
                       else [64, 128, 256, 512, 1024, 2048])
    out = dataclasses.replace(
        cfg, device=device, amp=cuda and cfg.amp, embed_dim=embed_dim, num_heads=_or(cfg.num_heads, 12 if cuda else 4),
        ff_dim=_or(cfg.ff_dim, 4 * embed_dim), tokens=_or(cfg.tokens, 32768 if cuda else 4096),
        peak_tflops=_or(cfg.peak_tflops, 989.0 if cuda else None),
        seq_lens=list(seq_lens), modules=list(_or(cfg.modules, ["attn", "enc"] if quick else MODULES)),
        modes=list(_or(cfg.modes, MODES)), variants=list(_or(cfg.variants, VARIANTS)),
        reps=_or(cfg.reps, 3 if quick else 7), warmup=_or(cfg.warmup, 1 if quick else 2),
    )
    _check(out)
    return out


def _or(value, default):
    return default if value is None else value


def _check(cfg: BenchConfig) -> None:
    for name, values, allowed in (("modules", cfg.modules, MODULES), ("modes", cfg.modes, MODES),
                                  ("variants", cfg.variants, VARIANTS + EXTRA_VARIANTS)):
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise ConfigError(f"{name}={values}: unknown {bad}; choose from {list(allowed)}, e.g. "
                              f"{name}=[{','.join(allowed[:2])}].")
    if cfg.activation not in ("relu", "gelu"):
        raise ConfigError(f"activation={cfg.activation} is not supported; choose relu or gelu.")
    for name in ("tokens", "batch", "embed_dim", "num_heads", "ff_dim", "layers", "reps", "target_reps", "threads"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name}={value} must be >= 1.")
    if cfg.warmup < 0:
        raise ConfigError(f"warmup={cfg.warmup} must be >= 0.")
    if not cfg.seq_lens or any(L < 1 for L in cfg.seq_lens):
        raise ConfigError(f"seq_lens={cfg.seq_lens} must be a list of lengths >= 1, e.g. seq_lens=[128,1024].")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ConfigError(f"dropout={cfg.dropout} must be in [0, 1), e.g. 0.1.")
    if not 0.0 <= cfg.pad_frac <= 0.5:
        raise ConfigError(f"pad_frac={cfg.pad_frac} must be in [0, 0.5] (lengths spread over [L - 2*pad_frac*L, L]).")
    try:
        check_heads(cfg.embed_dim, cfg.num_heads)
    except ValueError as e:
        raise ConfigError(str(e)) from None
