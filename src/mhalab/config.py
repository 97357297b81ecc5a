"""Config resolvers and the checks that run before any data is read (torchtune-style validation)."""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[2]


def _auto_precision() -> str:
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"


def _run_id() -> str:
    # time to the second plus pid and 4 random hex digits: jobs started in the same second never collide
    return f"{time.strftime('%Y-%m-%d/%H-%M-%S')}_{os.getpid()}{secrets.token_hex(2)}"


def _member_dir(override_dirname: str) -> str:
    """A sweep member's dir name from its overrides: one path component, at most ~120 characters."""
    name = override_dirname.replace(os.sep, "_") or "default"
    if len(name) > 120:
        name = f"{name[:100]}-{hashlib.sha1(name.encode()).hexdigest()[:10]}"
    return name


def register_resolvers() -> None:
    for name, fn in {
        "member_dir": _member_dir,
        "repo_root": lambda: str(REPO_ROOT),
        "mul": lambda a, b: a * b,
        "auto_precision": _auto_precision,
        "run_id": _run_id,
    }.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=name == "run_id")


register_resolvers()


class ConfigError(ValueError):
    """A config value that cannot work; raised before any data is read or model built."""


def validate(cfg: DictConfig) -> None:
    """Cheap checks of the composed config. Each message names the value and the fix."""
    from mhalab.variants import ATTENTIONS, POSITIONS, check_combination

    m = cfg.model
    dim, heads = int(m.dim), int(m.heads)
    if heads < 1 or dim < 1:
        raise ConfigError(f"dim={dim} and heads={heads} must both be >= 1.")
    if dim % heads:
        ok = [h for h in range(1, min(dim, 64) + 1) if dim % h == 0]
        raise ConfigError(
            f"heads={heads} does not divide dim={dim} (head_dim would be {dim / heads:.2f}); "
            f"choose heads in {ok} or a dim that is a multiple of {heads}."
        )
    if int(m.layers) < 1:
        raise ConfigError(f"layers={m.layers} must be >= 1.")
    if int(m.ff_dim) < 1:
        raise ConfigError(f"ff_dim={m.ff_dim} must be >= 1.")
    for key in ("dropout", "embed_dropout"):
        p = m.get(key)
        if p is not None and not 0.0 <= float(p) < 1.0:
            raise ConfigError(f"model.{key}={p} must be in [0, 1).")
    if m.attention not in ATTENTIONS:
        raise ConfigError(f"unknown model.attention '{m.attention}'; choose one of {', '.join(ATTENTIONS)}.")
    if m.pos not in POSITIONS:
        raise ConfigError(f"unknown model.pos '{m.pos}'; choose one of {', '.join(POSITIONS)}.")
    try:
        check_combination(m.attention, m.pos)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if m.encoder == "official" and (m.attention != "full" or m.pos not in ("sinusoidal", "learned")):
        raise ConfigError(f"model=official supports attention=full with pos=sinusoidal|learned only (got "
                          f"attention={m.attention}, pos={m.pos}); use model=custom for the variants.")
    d = cfg.data
    if int(d.max_len) < 1:
        raise ConfigError(f"max_len={d.max_len} must be >= 1 (tokens kept per text).")
    if int(d.batch_size) < 1:
        raise ConfigError(f"batch_size={d.batch_size} must be >= 1.")
    if float(cfg.optim.lr) <= 0:
        raise ConfigError(f"lr={cfg.optim.lr} must be > 0.")
    if cfg.get("ckpt_path"):
        check_checkpoint(cfg)


def resolve_ckpt_path(ckpt_path: str, outputs: Path | None = None) -> Path:
    """A .ckpt file, a run dir (its checkpoints/last.ckpt), or 'last' (newest last.ckpt under outputs/)."""
    if ckpt_path == "last":
        outputs = outputs or REPO_ROOT / "outputs"
        found = sorted(outputs.glob("**/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise ConfigError(f"ckpt_path=last but no checkpoints/last.ckpt exists under {outputs}.")
        return found[-1]
    p = Path(ckpt_path)
    if p.is_dir():
        p = p / "checkpoints" / "last.ckpt"
    if not p.is_file():
        raise ConfigError(f"ckpt_path={ckpt_path} does not exist (looked for {p}); pass a .ckpt file or a run dir.")
    return p


def checkpoint_meta(path: str) -> dict:
    """A checkpoint's small parts (hyper-parameters, mhalab's extras), read once for every pre-run check."""
    return _checkpoint_meta(path, Path(path).stat().st_mtime_ns)  # a rewritten file is read again


@functools.lru_cache(maxsize=4)
def _checkpoint_meta(path: str, mtime_ns: int) -> dict:
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    return {"hyper_parameters": ckpt.get("hyper_parameters", {}), "mhalab": ckpt.get("mhalab", {})}


def check_checkpoint(cfg: DictConfig) -> None:
    """The checkpoint must belong to a model of the configured shape, or resuming would fail late."""
    p = resolve_ckpt_path(str(cfg.ckpt_path))
    saved = checkpoint_meta(str(p))["hyper_parameters"].get("model", {})
    for key in ("encoder", "dim", "heads", "layers", "ff_dim", "pos", "attention", "pooling", "max_len"):
        if key in saved and saved[key] != cfg.model.get(key):
            raise ConfigError(
                f"ckpt_path={p} holds a model with {key}={saved[key]}, but the config has "
                f"{key}={cfg.model.get(key)}; resume with the same model settings (e.g. {key}={saved[key]})."
            )
