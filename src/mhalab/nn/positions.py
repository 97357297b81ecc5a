"""Position schemes: absolute ones added to the embeddings, relative ones that live inside attention.

Absolute (the model adds them to the token embeddings, (B, L, E) -> (B, L, E)):

- `SinusoidalPosition`   Vaswani et al. 2017 (the article's choice);
- `LearnedPosition`      one trained vector per position (BERT).

Relative (the article's "next steps"), each plugged into a hook of `mhalab.nn.attention.MultiHeadAttention`:

- `RotaryEmbedding`      -> `rotary(q, k) -> (q, k)`, applied to (B, H, L, d) after the head split;
- `ALiBi`                -> `position_bias(L_q, L_k) -> (H, L_q, L_k)`, added to the scores;
- `T5RelativeBias`       -> `position_bias(L_q, L_k) -> (H, L_q, L_k)`, added to the scores.

The bias modules go through `masks.merge_masks`, so they combine with padding and attention masks
exactly like any other additive mask. None of the relative ones adds anything to the token embeddings.

Positions are 0..L_q-1 for queries and 0..L_k-1 for keys (self-attention: the same positions).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


# ------------------------------------------------------------------------------------------------
# Absolute positions
# ------------------------------------------------------------------------------------------------
def _check_len(length: int, max_len: int) -> None:
    if length > max_len:
        raise ValueError(f"sequence length {length} exceeds max_len {max_len} of the position encoding.")


class SinusoidalPosition(nn.Module):
    """Vaswani et al. 2017: PE[p, 2i] = sin(p / 10000^(2i/E)), PE[p, 2i+1] = cos(...)."""

    def __init__(self, embed_dim: int, max_len: int):
        super().__init__()
        pos = torch.arange(max_len).unsqueeze(1)  # (L, 1)
        freq = torch.exp(torch.arange(0, embed_dim, 2) * (-math.log(10000.0) / embed_dim))  # (ceil(E/2),)
        pe = torch.zeros(max_len, embed_dim)
        pe[:, 0::2] = torch.sin(pos * freq)
        pe[:, 1::2] = torch.cos(pos * freq[: embed_dim // 2])
        self.register_buffer("pe", pe, persistent=False)
        self.max_len = max_len

    def forward(self, x: Tensor) -> Tensor:
        """x (B, L, E) -> x + the encoding of positions 0..L-1 (L <= max_len)."""
        L = x.size(1)
        _check_len(L, self.max_len)
        return x + self.pe[:L].to(x.dtype)

    def packed(self, x: Tensor, positions: Tensor, max_seqlen: int) -> Tensor:
        """Packed sequences (nn.varlen): x (N, E) + the encoding of each row's position (N,) in its sequence."""
        _check_len(max_seqlen, self.max_len)
        return x + self.pe[positions].to(x.dtype)


class LearnedPosition(nn.Module):
    """One trained vector per position (BERT, GPT-2)."""

    def __init__(self, embed_dim: int, max_len: int):
        super().__init__()
        self.emb = nn.Embedding(max_len, embed_dim)
        nn.init.normal_(self.emb.weight, std=0.02)
        self.max_len = max_len

    def forward(self, x: Tensor) -> Tensor:
        """x (B, L, E) -> x + the learned embeddings of positions 0..L-1 (L <= max_len)."""
        L = x.size(1)
        _check_len(L, self.max_len)
        return x + self.emb.weight[:L].to(x.dtype)

    def packed(self, x: Tensor, positions: Tensor, max_seqlen: int) -> Tensor:
        """Packed sequences (nn.varlen): x (N, E) + the vector of each row's position (N,) in its sequence."""
        _check_len(max_seqlen, self.max_len)
        return x + self.emb.weight[positions].to(x.dtype)


# ------------------------------------------------------------------------------------------------
# RoPE: Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding"
# ------------------------------------------------------------------------------------------------
class RotaryEmbedding(nn.Module):
    """Rotate each pair (x_{2i}, x_{2i+1}) of q and k by the angle p * theta_i (RoFormer eq. 34):

        theta_i = base^(-2i/d),  i = 0 .. d/2 - 1
        [x'_{2i}  ]   [cos p*theta_i  -sin p*theta_i] [x_{2i}  ]
        [x'_{2i+1}] = [sin p*theta_i   cos p*theta_i] [x_{2i+1}]

    i.e. in complex form z_i' = z_i * e^{i p theta_i} with z_i = x_{2i} + i x_{2i+1}. Then
    <R_m q, R_n k> = Re sum_i q_i conj(k_i) e^{i (m - n) theta_i} depends on m - n only, and every
    rotation preserves the norm. We use the paper's interleaved pairs (not the "half split" layout of
    GPT-NeoX / HF Llama, which pairs x_i with x_{i + d/2}; the two are a fixed permutation apart).
    The rotation is computed in float32 (bf16 angles at position ~1000 are off by whole radians).
    """

    def __init__(self, head_dim: int, max_len: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE rotates pairs of dims, so head_dim must be even (got {head_dim}).")
        self.head_dim, self.max_len, self.base = head_dim, max_len, base
        # cos/sin tables are a per-device cache, not buffers: `model.to(torch.bfloat16)` would round
        # buffers to bf16, and they hold no state worth saving
        self._tables: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """cos(p theta_i), sin(p theta_i) as float32 (max_len, d/2), computed in float64 once per device."""
        if device not in self._tables:
            theta = self.base ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
            angles = torch.arange(self.max_len, dtype=torch.float64).unsqueeze(1) * theta  # (max_len, d/2)
            self._tables[device] = (angles.cos().float().to(device), angles.sin().float().to(device))
        return self._tables[device]

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: (..., L, d); positions: (L,) integer positions (< max_len). Returns R_p x, same shape/dtype."""
        if positions.numel() and int(positions.max()) >= self.max_len:
            raise ValueError(
                f"position {int(positions.max())} exceeds max_len {self.max_len} of the rotary embedding."
            )
        cos, sin = self.tables(x.device)
        idx = positions.to(x.device)
        return self._rotate_pairs(x, cos[idx], sin[idx])

    @staticmethod
    def _rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        # (not `_apply`: that name is nn.Module._apply, which .to() / .cuda() / .float() call)
        # x: (..., L, d); cos, sin: (L, d/2). Rotation in (at least) float32, result in x's dtype.
        dt = torch.promote_types(x.dtype, torch.float32)
        xf, cos, sin = x.to(dt), cos.to(dt), sin.to(dt)
        x1, x2 = xf[..., 0::2], xf[..., 1::2]  # (..., L, d/2) each
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (..., L, d/2, 2)
        return out.flatten(-2).to(x.dtype)  # (..., L, d)

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """q (B, H, L_q, d) and k (B, H, L_k, d), rotated by their positions 0..L-1 (Su et al. 2021): their dot
        products then depend on the offset between positions only."""
        # q: (B, H, L_q, d)  k: (B, H, L_k, d); positions 0..L-1 (no device sync: slices, not indexing)
        L_q, L_k = q.size(-2), k.size(-2)
        if max(L_q, L_k) > self.max_len:
            raise ValueError(f"sequence length {max(L_q, L_k)} exceeds max_len {self.max_len} of RoPE.")
        cos, sin = self.tables(q.device)
        return self._rotate_pairs(q, cos[:L_q], sin[:L_q]), self._rotate_pairs(k, cos[:L_k], sin[:L_k])

    def rotate_packed(self, q: Tensor, k: Tensor, positions: Tensor, max_seqlen: int) -> tuple[Tensor, Tensor]:
        """Packed sequences (nn.varlen): q, k (N, H, d) rotated by each row's position (N,) in its sequence.
        max_seqlen (a host int) is checked against max_len instead of the positions (no device sync)."""
        if max_seqlen > self.max_len:
            raise ValueError(f"sequence length {max_seqlen} exceeds max_len {self.max_len} of RoPE.")
        cos, sin = self.tables(q.device)
        cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # (N, 1, d/2): broadcast over heads
        return self._rotate_pairs(q, cos, sin), self._rotate_pairs(k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_len={self.max_len}, base={self.base}"


# ------------------------------------------------------------------------------------------------
# ALiBi: Press et al. 2022, "Train Short, Test Long: Attention with Linear Biases"
# ------------------------------------------------------------------------------------------------
def alibi_slopes(num_heads: int) -> list[float]:
    """The paper's head slopes m_h (its reference `get_slopes`).

    n a power of 2: the geometric sequence starting at 2^(-8/n) with ratio 2^(-8/n), m_h = 2^(-8h/n).
    Otherwise: the slopes of the closest smaller power of 2, c, followed by every other slope
    (indices 0, 2, 4, ...) of the 2c-head sequence, until there are n.
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1 (got {num_heads}).")

    def power_of_2(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]  # 2^(-8h/n), h = 1..n

    if math.log2(num_heads).is_integer():
        return power_of_2(num_heads)
    c = 2 ** math.floor(math.log2(num_heads))
    return power_of_2(c) + alibi_slopes(2 * c)[0::2][: num_heads - c]


class ALiBi(nn.Module):
    """Linear distance penalty, no parameters: bias[h, i, j] = -m_h * |i - j|.

    The paper is about causal language models, where bias[h, i, j] = -m_h * (i - j) for j <= i (and
    the causal mask blocks j > i). For this bidirectional encoder we use the symmetric |i - j|, the
    common encoder variant (e.g. the one used by MosaicBERT): a key is penalised by its distance,
    whichever side it is on. Pass `causal=True` to get the paper's form (-m_h * (i - j) for j <= i,
    -inf above the diagonal).
    """

    def __init__(self, num_heads: int, causal: bool = False):
        super().__init__()
        self.num_heads, self.causal = num_heads, causal
        self.register_buffer("slopes", torch.tensor(alibi_slopes(num_heads)), persistent=False)  # (H,)

    def forward(self, L_q: int, L_k: int) -> Tensor:
        """The additive bias (H, L_q, L_k): -slope_h x |i - j| (Press et al. 2022), -inf above the diagonal when
        causal."""
        i = torch.arange(L_q, device=self.slopes.device).unsqueeze(1)  # (L_q, 1)
        j = torch.arange(L_k, device=self.slopes.device).unsqueeze(0)  # (1, L_k)
        dist = (i - j).float()  # (L_q, L_k), i - j
        if self.causal:
            dist = dist.masked_fill(j > i, float("inf"))  # -m * inf = -inf: future keys blocked
        else:
            dist = dist.abs()
        return -self.slopes.view(-1, 1, 1) * dist  # (H, L_q, L_k)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, causal={self.causal}"


# ------------------------------------------------------------------------------------------------
# T5 relative position bias: Raffel et al. 2020, "Exploring the Limits of Transfer Learning ..." (3.1.2)
# ------------------------------------------------------------------------------------------------
def relative_position_bucket(
    relative_position: Tensor, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """T5's bucketing of relative_position = j - i (key minus query), as in HF `_relative_position_bucket`.

    bidirectional: half of the buckets for j > i (offset by num_buckets/2), half for j <= i.
    Within a direction (n = |j - i|, N = buckets per direction, max_exact = N/2):
        n <  max_exact: bucket n                                              (one bucket per offset)
        n >= max_exact: max_exact + floor(log(n / max_exact) / log(max_distance / max_exact)
                                          * (N - max_exact)), capped at N - 1   (log-spaced)
    so every offset >= max_distance shares the last bucket.
    Unidirectional (causal): only j <= i gets distinct buckets; n = max(i - j, 0).
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        n = relative_position.abs()
    else:
        n = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    # clamp(min=1) only keeps log() finite on the rows that `is_small` selects anyway
    large = max_exact + (
        torch.log(n.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, n, large)


class T5RelativeBias(nn.Module):
    """A learned scalar per (bucket, head): bias[h, i, j] = emb[bucket(j - i), h].

    T5 computes the bias once and shares it across layers; here each attention layer owns its
    (num_buckets, H) table (a layer-shared table is simply the same module passed to every layer).
    Init: N(0, 0.02^2) (T5 uses N(0, d_model^-1) with its unscaled dot product; we keep 1/sqrt(d)).
    """

    def __init__(
        self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True
    ):
        super().__init__()
        self.num_heads, self.num_buckets = num_heads, num_buckets
        self.max_distance, self.bidirectional = max_distance, bidirectional
        self.emb = nn.Embedding(num_buckets, num_heads)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.emb.weight, std=0.02)  # over nn.Embedding's N(0, 1)

    def forward(self, L_q: int, L_k: int) -> Tensor:
        """The additive bias (H, L_q, L_k): a learned scalar per head and bucket of the offset j - i (Raffel et al.
        2020: exact for short offsets, log-spaced up to max_distance)."""
        dev = self.emb.weight.device
        rel = torch.arange(L_k, device=dev).unsqueeze(0) - torch.arange(L_q, device=dev).unsqueeze(1)  # j - i
        buckets = relative_position_bucket(rel, self.bidirectional, self.num_buckets, self.max_distance)
        return self.emb(buckets).permute(2, 0, 1)  # (L_q, L_k, H) -> (H, L_q, L_k)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, "
                f"max_distance={self.max_distance}, bidirectional={self.bidirectional}")
