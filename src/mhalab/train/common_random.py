"""Common random numbers for a training run: every draw depends on (seed, what is drawn), not on what was built first.

A sweep compares settings seed by seed (the paired test of mhalab.analysis.report). The comparison is sharper the
more luck two members of one seed share. With PyTorch's draws they share it only while every shape agrees: the
weights come from one stream in construction order, so the first layer whose shape differs (a dim, ff_ratio or
head_dim sweep) shifts every draw after it, dropout's included.

`init_draw=keyed` (conf/train.yaml, the framework's runs only) draws instead:

- each parameter's initial values from a counter-based generator keyed by (seed, the parameter's name): element
  (i, j) of `encoder.layers.0.linear1.weight` is the same number at any shape. A narrower or shorter parameter is
  the matching block of the wider one's draw, scaled to its own init bound. Each keeps its module's distribution
  (INIT, checked against the modules' own draws by tests/test_common_random.py);
- dropout from torch's generator restarted at a state keyed by the seed alone (`start_dropout_stream`), so the
  masks nest across rates (nn.dropout.Dropout16 compares the same draws with each rate's threshold). Across widths
  the masks do not nest: a mask keyed by coordinates costs a hash per element, against a quarter of a draw;
- the data order keyed by data.seed, as before.

The library's modules keep PyTorch's draws: SequenceClassifier(...) after torch.manual_seed(s) has PyTorch's weights.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
from torch import nn

INIT_DRAWS = ("keyed", "torch")  # conf/train.yaml's init_draw
AXIS_BITS = 21  # an element's counter: its index along each axis, 21 bits each (axes up to 2,097,152 long)
# one 64-bit constant each, from the published SplitMix64 (Steele, Lea, Flood 2014)
_GOLDEN, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def key(seed: int, name: str) -> int:
    """A 64-bit key for (seed, name): the first 8 bytes of BLAKE2b over them."""
    return int.from_bytes(hashlib.blake2b(f"{int(seed)}/{name}".encode(), digest_size=8).digest(), "little")


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer: a bijection of uint64 whose outputs pass BigCrush for consecutive inputs."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def uniform(k: int, shape: tuple[int, ...]) -> torch.Tensor:
    """float64 uniforms on (0, 1) of `shape`, element (i, j, ...) a function of (k, i, j, ...) only: a smaller shape
    gets the leading block of a larger one's."""
    if any(n >= 1 << AXIS_BITS for n in shape) or len(shape) * AXIS_BITS > 64:
        raise ValueError(f"keyed draws index at most {64 // AXIS_BITS} axes of < 2^{AXIS_BITS}; got {shape}.")
    counter = np.zeros(shape, dtype=np.uint64)
    for axis, n in enumerate(shape):  # counter = i << 42 | j << 21 | k  (for 3 axes)
        idx = np.arange(n, dtype=np.uint64) << np.uint64(AXIS_BITS * (len(shape) - 1 - axis))
        counter |= idx.reshape((n,) + (1,) * (len(shape) - 1 - axis))
    with np.errstate(over="ignore"):  # uint64 products wrap, as SplitMix64 means them to
        z = _mix(np.uint64(k) ^ _mix(counter * _GOLDEN))
    return torch.from_numpy(((z >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53))  # 53 bits, never 0 or 1


def _xavier_bound(fan_in: int, fan_out: int, gain: float = 1.0) -> float:
    return gain * math.sqrt(6.0 / (fan_in + fan_out))


# How each module draws its random parameters: (module class, parameter under it) -> (family, scale, view), where
# scale(module) is the standard deviation (normal) or bound (uniform) the module's own init gives that parameter, from
# the module's shapes, and view(module) the shape whose coordinates key the draw (None: the parameter's own). A
# parent's init overwrites its child's, so the outermost module with a rule wins. None: a constant (not drawn).
# tests/test_common_random.py draws every rule beside the module's own init and compares the two distributions.
INIT = {
    # nn.Linear: kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in)), its bias the same bound
    ("Linear", "weight"): ("uniform", lambda m: 1 / math.sqrt(m.in_features), None),
    ("Linear", "bias"): ("uniform", lambda m: 1 / math.sqrt(m.in_features), None),
    # nn.MultiheadAttention's init (and ours): xavier_uniform over the stacked (3 x heads x head_dim, E) in-projection,
    # read as (q|k|v, row, column) so that a narrower dim or head_dim keeps each of W_Q, W_K, W_V's leading block;
    # zero biases, out_proj's included (over its nn.Linear draw)
    ("MultiHeadAttention", "in_proj_weight"): (
        "uniform", lambda m: _xavier_bound(m.in_proj_weight.size(1), m.in_proj_weight.size(0)),
        lambda m: (3, m.in_proj_weight.size(0) // 3, m.in_proj_weight.size(1))),
    ("MultiHeadAttention", "in_proj_bias"): None,
    ("MultiHeadAttention", "out_proj.bias"): None,
    ("LayerNorm", "weight"): None,
    ("LayerNorm", "bias"): None,
    ("Embedding", "weight"): ("normal", lambda m: 1.0, None),  # nn.Embedding: N(0, 1), its padding row 0
    ("LearnedPosition", "emb.weight"): ("normal", lambda m: 0.02, None),
    ("T5RelativeBias", "emb.weight"): ("normal", lambda m: 0.02, None),
    ("SequenceClassifier", "cls"): ("normal", lambda m: 0.02, None),
    ("LinformerAttention", "E"): ("uniform", lambda m: _xavier_bound(m.E.size(1), m.E.size(0), 1 / math.sqrt(2)), None),
    ("LinformerAttention", "F"): ("uniform", lambda m: _xavier_bound(m.F.size(1), m.F.size(0), 1 / math.sqrt(2)), None),
}
# PyTorch's classes that draw as one above: nn.MultiheadAttention's out_proj (an nn.Linear), and nn.MultiheadAttention
# itself (model=official: ours copies its init, draw for draw)
_SAME_INIT = {"NonDynamicallyQuantizableLinear": "Linear", "MultiheadAttention": "MultiHeadAttention"}


def rule(model: nn.Module, name: str):
    """(the module that draws parameter `name`, and its INIT rule), or (owner, None) for a constant.

    Raises:
        ValueError: no module on the parameter's path has a rule for it (a bug: INIT needs it).
    """
    parts = name.split(".")
    for cut in range(len(parts)):  # outermost first
        owner = model.get_submodule(".".join(parts[:cut]))
        kind = type(owner).__name__
        entry = (_SAME_INIT.get(kind, kind), ".".join(parts[cut:]))
        if entry in INIT:
            return owner, INIT[entry]
    raise ValueError(f"init_draw=keyed does not know how parameter '{name}' is drawn; add its module's rule to "
                     f"mhalab.train.common_random.INIT.")


@torch.no_grad()
def keyed_init_(model: nn.Module, seed: int) -> int:
    """Redraw every random parameter of `model` from its (seed, name) key, in place; returns how many were drawn.

    Each keeps its module's distribution (INIT). Constants are left as the modules set them, and an nn.Embedding's
    padding row stays 0."""
    drawn = 0
    for name, p in model.named_parameters():
        owner, how = rule(model, name)
        if how is None:
            continue
        family, scale, view = how
        shape = tuple(view(owner)) if view else tuple(p.shape)
        u = uniform(key(seed, name), shape)  # (shape) float64 on (0, 1)
        z = torch.special.ndtri(u) if family == "normal" else 2 * u - 1  # N(0, 1) or U(-1, 1)
        p.copy_((scale(owner) * z).reshape(p.shape))
        drawn += 1
    for m in model.modules():
        if isinstance(m, nn.Embedding) and m.padding_idx is not None:
            m.weight[m.padding_idx].zero_()
    return drawn


def start_dropout_stream(seed: int) -> None:
    """Restart torch's generators at a state keyed by the seed alone: the dropout masks of a run then do not depend
    on how many numbers building its model took."""
    torch.manual_seed(key(seed, "dropout") >> 1)  # 63 bits
