"""The cells of a results table: read a value as a number, compare, sort and print it."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np


def to_float(x: Any) -> float:
    """A number, NaN for anything else (None, a bool, text)."""
    if x is None or isinstance(x, bool):
        return math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def finite(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and math.isfinite(float(x))


def fmt_num(x: float) -> str:
    return f"{x:g}" if finite(x) else "?"


def natural_key(text: str) -> list:
    """'seed=10' after 'seed=9'."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def parse_value(text: str) -> Any:
    """'4' -> 4, '0.1' -> 0.1, 'full' -> 'full'."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def run_key(setting: str, seed: Any) -> tuple[frozenset, float]:
    """One run of a sweep, whatever the order its overrides were typed in: (the setting's words, the seed)."""
    return frozenset(str(setting).split(" ")), to_float(seed)
