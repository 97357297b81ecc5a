"""Attention kernels beyond softmax over all keys (the article's "next steps": Longformer, Linformer,
Performer). Each is a drop-in for `ScaledDotProductAttention`, the `attention` hook of MultiHeadAttention:

    kernel(q, k, v, mask=None, need_weights=True) -> (out (B, H, L_q, d), weights or None)

q, k, v: (B, H, L, d). `mask` is None or the ONE additive float mask built by `masks.merge_masks`
(-inf = blocked), broadcastable to (B, H, L_q, L_k): a key-padding mask arrives as (B, 1, 1, L_k).

  * `WindowAttention`    exact softmax over a band |i - j| <= window // 2, plus global tokens;
                         returns its (B, H, L_q, L_k) weights when asked.
  * `LinformerAttention` softmax over k learned projections of the keys/values along the sequence.
  * `PerformerAttention` FAVOR+ random-feature estimate of softmax attention, linear in L.
Linformer and Performer never form the (L_q, L_k) score matrix, so (1) they accept only masks that
are the same for every query (key masks, shape (..., 1, L_k)), and refuse attention masks and the
ALiBi / T5 position biases with a ValueError; (2) `need_weights=True` returns None for the weights:
there is no per-key weight matrix to return. A query whose keys are all blocked outputs 0 in every
kernel (as the default kernel does, see `masks.dead_rows`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mhalab.nn.attention import ScaledDotProductAttention
from mhalab.nn.masks import to_additive


def _additive(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    if mask is None:
        return None
    return to_additive(mask, "mask", dtype) if mask.dtype == torch.bool or mask.dtype != dtype else mask


def key_mask(mask: Tensor | None, kind: str) -> Tensor | None:
    """An additive mask that is the same for every query, (..., 1, L_k) -> (B|1, H|1, L_k, 1); else error."""
    if mask is None:
        return None
    if mask.dim() < 2 or mask.size(-2) != 1:
        raise ValueError(
            f"{kind} attention never forms the (L_q, L_k) score matrix, so it supports only key masks "
            f"(key_padding_mask, or an attn_mask of shape (..., 1, L_k)); got a merged mask of shape "
            f"{tuple(mask.shape)}, from an attn_mask or a position bias (alibi / t5). Use attention=full "
            f"or window for those, or pos=rope / sinusoidal / learned."
        )
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask.transpose(-1, -2)  # (B|1, H|1, L_k, 1)


# ------------------------------------------------------------------------------------------------
# Sliding window + global tokens: Beltagy et al. 2020, "Longformer" (section 3.1)
# ------------------------------------------------------------------------------------------------
class WindowAttention(nn.Module):
    """Exact softmax attention restricted to a band, with global tokens.

    Query i may attend to key j iff
        |i - j| <= window // 2          (Longformer's window w: w/2 keys on each side, plus i itself)
        or i < global_tokens            (a global query attends to every key)
        or j < global_tokens            (every query attends to the global keys, e.g. CLS at 0)
    and the incoming mask does not block (i, j). (For L_q != L_k the same rule holds on indices.)
    The band is a -inf mask merged with the incoming one, then ordinary softmax attention: exact, and
    the weights can be returned. It costs O(L^2) memory like full attention.

    `chunked` (True / False / "auto"): the blocked path, which never forms an L x L tensor: queries in
    blocks of `block` rows each attend to their block's band of block + 2*(window//2) keys plus the
    global keys, and the global queries attend to everything; O(L * (block + window + globals)).
    It needs self-attention lengths (L_q == L_k), need_weights=False, and a key-only mask (padding);
    "auto" uses it when those hold and L > 2 * (block + window), else the band mask.
    """

    # nn.varlen: per sequence, the band and the global tokens sit at the same positions 0..n-1
    per_sequence = True

    def __init__(
        self,
        window: int,
        global_tokens: int = 0,
        dropout: float = 0.0,
        chunked: bool | str = "auto",
        block: int | None = None,
    ):
        super().__init__()
        if window < 0 or global_tokens < 0:
            raise ValueError(f"window ({window}) and global_tokens ({global_tokens}) must be >= 0.")
        if chunked not in (True, False, "auto"):
            raise ValueError(f"chunked must be True, False or 'auto' (got {chunked!r}).")
        self.window, self.global_tokens, self.chunked = window, global_tokens, chunked
        self.half = window // 2
        self.block = block if block is not None else max(self.half, 64)
        if self.block < 1:
            raise ValueError(f"block must be >= 1 (got {self.block}).")
        self.dense = ScaledDotProductAttention(dropout)  # the band-mask path
        self.dropout = self.dense.dropout

    def band_mask(self, L_q: int, L_k: int, device=None) -> Tensor:
        """(L_q, L_k) bool, True where blocked (PyTorch's convention)."""
        i = torch.arange(L_q, device=device).unsqueeze(1)  # (L_q, 1)
        j = torch.arange(L_k, device=device).unsqueeze(0)  # (1, L_k)
        g = self.global_tokens
        visible = ((i - j).abs() <= self.half) | (i < g) | (j < g)
        return ~visible

    def _use_chunked(self, q: Tensor, k: Tensor, mask: Tensor | None, need_weights: bool) -> bool:
        L_q, L_k = q.size(-2), k.size(-2)
        ok = not need_weights and L_q == L_k and (mask is None or (mask.dim() >= 2 and mask.size(-2) == 1))
        if self.chunked is True:
            if not ok:
                raise ValueError(
                    "chunked window attention needs L_q == L_k, need_weights=False and a key-only mask "
                    f"(got L_q={L_q}, L_k={L_k}, need_weights={need_weights}, "
                    f"mask shape {None if mask is None else tuple(mask.shape)})."
                )
            return True
        return self.chunked == "auto" and ok and L_q > 2 * (self.block + self.window)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, need_weights: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """q (B, H, L_q, d), k and v (B, H, L_k, d) -> (B, H, L_q, d): each query attends to the keys within the
        window (and the global tokens); mask as ScaledDotProductAttention's. Weights (B, H, L_q, L_k) where asked
        and the banded path is not taken."""
        mask = _additive(mask, q.dtype)
        if self._use_chunked(q, k, mask, need_weights):
            return self._chunked(q, k, v, mask), None
        band = to_additive(self.band_mask(q.size(-2), k.size(-2), q.device), "band", q.dtype)  # (L_q, L_k)
        mask = band if mask is None else mask + band  # broadcast to (B|1, H|1, L_q, L_k)
        return self.dense(q, k, v, mask=mask, need_weights=need_weights)

    def _chunked(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        B, H, L, d = q.shape
        w, c, g = self.half, self.block, min(self.global_tokens, L)
        nb = -(-L // c)  # number of query blocks
        Lp = nb * c
        scale = 1.0 / math.sqrt(d)
        # key mask as (B|1, H|1, L) additive; the band's out-of-range keys are blocked by -inf padding
        km = key_mask(mask, "chunked window")
        km = torch.zeros(1, 1, L, dtype=q.dtype, device=q.device) if km is None else km.squeeze(-1)
        # local keys exclude the global ones (j < g), which every query sees through the global columns
        km_local = km.clone()
        km_local[..., :g] = float("-inf")

        # queries in blocks: (B, H, L, d) -> (B, H, nb, c, d)
        qb = F.pad(q, (0, 0, 0, Lp - L)).view(B, H, nb, c, d)
        # keys/values of block b: positions b*c - w .. b*c + c - 1 + w, i.e. c + 2w of them
        pad = (0, 0, w, Lp - L + w)
        kb = F.pad(k, pad).unfold(2, c + 2 * w, c)  # (B, H, nb, d, c + 2w)
        vb = F.pad(v, pad).unfold(2, c + 2 * w, c)  # (B, H, nb, d, c + 2w)
        mb = F.pad(km_local, (w, Lp - L + w), value=float("-inf")).unfold(-1, c + 2 * w, c)  # (.., nb, c+2w)
        # band inside a block: query row r (position b*c + r) sees window column t (position b*c - w + t)
        # iff |r - (t - w)| <= w, i.e. r <= t <= r + 2w
        r = torch.arange(c, device=q.device).unsqueeze(1)
        t = torch.arange(c + 2 * w, device=q.device).unsqueeze(0)
        band = to_additive(~((t >= r) & (t <= r + 2 * w)), "band", q.dtype)  # (c, c + 2w)

        s_loc = (qb @ kb) * scale + mb.unsqueeze(-2) + band  # (B, H, nb, c, c + 2w)
        s_glb = (qb @ k[:, :, :g].transpose(-1, -2).unsqueeze(2)) * scale  # (B, H, nb, c, g)
        s_glb = s_glb + km[..., :g].unsqueeze(-2).unsqueeze(-2)  # global keys keep their own mask
        scores = torch.cat([s_glb, s_loc], dim=-1)  # (B, H, nb, c, g + c + 2w)
        out = self._softmax_av(scores, torch.cat([v[:, :, :g].unsqueeze(2).expand(-1, -1, nb, -1, -1),
                                                  vb.transpose(-1, -2)], dim=-2))
        out = out.reshape(B, H, Lp, d)[:, :, :L]  # (B, H, L, d)
        if g:
            # global queries attend to every key (only the key mask applies)
            s = (q[:, :, :g] @ k.transpose(-1, -2)) * scale + km.unsqueeze(-2)  # (B, H, g, L)
            out_g = self._softmax_av(s, v)  # (B, H, g, d)
            out = torch.cat([out_g, out[:, :, g:]], dim=2)
        return out

    def _softmax_av(self, scores: Tensor, values: Tensor) -> Tensor:
        """softmax(scores) @ values with dead rows (all -inf) -> 0; scores (..., n), values (..., n, d)."""
        dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
        scores = scores.masked_fill(dead, 0.0)
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype).masked_fill(dead, 0.0)
        return self.dropout(weights) @ values

    def extra_repr(self) -> str:
        return f"window={self.window}, global_tokens={self.global_tokens}, chunked={self.chunked}"


# ------------------------------------------------------------------------------------------------
# Linformer: Wang et al. 2020, "Linformer: Self-Attention with Linear Complexity" (section 4)
# ------------------------------------------------------------------------------------------------
class LinformerAttention(nn.Module):
    """head_i = softmax(Q (E K)^T / sqrt(d)) (F V)   with E, F: (k, max_len) learned, shared by heads.

    E K and F V project the L_k keys/values along the sequence onto k rows: (k, L) @ (B, H, L, d) ->
    (B, H, k, d); a sequence of length L uses the first L columns of E and F (L <= max_len), so the
    scores are (B, H, L_q, k) and memory is linear in L.
    Padding: the projection mixes every key into every row, so a -inf key mask cannot be added to the
    scores; instead the blocked keys and values are zeroed BEFORE the projection (E K = sum over real
    keys only), which makes real tokens' outputs independent of what padded positions contain. (A
    finite additive key bias in the mask has no per-key score to be added to and is ignored; only
    -inf blocks.) A sequence with every key blocked gets E K = F V = 0 and output 0.
    Init of E, F: xavier-uniform with gain 1/sqrt(2), as fairseq's Linformer.
    Weights: need_weights=True still returns None (the (L_q, k) weights are over projections, not keys).
    """

    # nn.varlen: E[:, :n] K of a sequence of n tokens is the padded path's E K with the pads zeroed
    per_sequence = True

    def __init__(self, max_len: int, k: int = 64, dropout: float = 0.0):
        super().__init__()
        if k < 1 or max_len < 1:
            raise ValueError(f"linformer k ({k}) and max_len ({max_len}) must be >= 1.")
        self.max_len, self.k = max_len, k
        self.E = nn.Parameter(torch.empty(k, max_len))
        self.F = nn.Parameter(torch.empty(k, max_len))
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.E, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.F, gain=1 / math.sqrt(2))

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, need_weights: bool = True
    ) -> tuple[Tensor, None]:
        """q (B, H, L_q, d), k and v (B, H, L_k, d) -> (B, H, L_q, d): keys and values projected along the
        sequence to k rows by E and F (Wang et al. 2020), then softmax attention; a key-only mask zeroes the padded
        keys before the projection. No weights (None)."""
        L_k, d = k.size(-2), q.size(-1)
        if L_k > self.max_len:
            raise ValueError(f"sequence length {L_k} exceeds linformer max_len {self.max_len}.")
        km = key_mask(_additive(mask, q.dtype), "linformer")  # (B|1, H|1, L_k, 1)
        if km is not None:
            blocked = torch.isneginf(km)
            k = k.masked_fill(blocked, 0.0)  # zero padded keys/values before they are mixed
            v = v.masked_fill(blocked, 0.0)
        k_proj = self.E[:, :L_k].to(k.dtype) @ k  # (k, L_k) @ (B, H, L_k, d) -> (B, H, k, d)
        v_proj = self.F[:, :L_k].to(v.dtype) @ v  # (B, H, k, d)
        scores = q @ k_proj.transpose(-1, -2) / math.sqrt(d)  # (B, H, L_q, k)
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = self.dropout(weights) @ v_proj  # (B, H, L_q, d)
        return out, None

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, k={self.k}"


# ------------------------------------------------------------------------------------------------
# Performer (FAVOR+): Choromanski et al. 2021, "Rethinking Attention with Performers" (sections 2-3)
# ------------------------------------------------------------------------------------------------
def orthogonal_gaussian(m: int, d: int, generator: torch.Generator | None = None) -> Tensor:
    """(m, d) random features: blocks of d orthogonal rows (QR of a Gaussian), each row rescaled to
    the norm of an independent d-dim Gaussian vector, so every row is marginally N(0, I_d) while rows
    within a block are exactly orthogonal (the paper's ORF, section 2.4)."""
    blocks = []
    for _ in range(-(-m // d)):
        Q, _ = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
        blocks.append(Q.T)  # rows orthonormal
    W = torch.cat(blocks)[:m]  # (m, d)
    norms = torch.randn(m, d, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (W * norms).float()


class PerformerAttention(nn.Module):
    """FAVOR+ estimate of softmax attention, O(L m d) time and memory.

    softmax kernel: exp(q.k) = E_w[phi(q) . phi(k)] with positive random features (eq. 7, Lemma 1)
        phi(x) = exp(W x - |x|^2 / 2) / sqrt(m),   W: (m, d) orthogonal Gaussian rows
    applied to q, k scaled by d^-1/4 (so q.k becomes q.k / sqrt(d)); then
        out = D^-1 (phi(Q) (phi(K)^T V)),   D = diag(phi(Q) (phi(K)^T 1_L))
    computed right to left, never forming (L_q, L_k).
    Stabilised: exp's argument is shifted by a per-query max (over features) and by one max over all
    real keys and features per (batch, head); both constants cancel in num / den. Computed in float32
    (autocast off inside): exp of bf16 arguments loses all precision.
    Masks: only key masks; the additive mask is added to the key features' exponent, so a blocked key
    (-inf) gets phi(k) = 0 exactly and a finite key bias b_j multiplies its kernel by exp(b_j), as it
    would in softmax. Padded keys are left out of the stabiliser max, so real outputs do not depend on
    padded positions. A query with no visible key gets output 0.
    Features are a persistent buffer (saved with the model). `redraw_interval=n` draws new ones every
    n training forward passes (the paper redraws them during training); None keeps them fixed.
    Attention dropout is not applied (there is no weight matrix to drop); need_weights gives None.
    """

    # not nn.varlen: redraw_interval counts forward calls, one per length group there (and the padded
    # path is already linear in L: padding costs it little)
    per_sequence = False

    def __init__(self, head_dim: int, num_features: int = 64, redraw_interval: int | None = None):
        super().__init__()
        if num_features < 1:
            raise ValueError(f"performer num_features must be >= 1 (got {num_features}).")
        self.head_dim, self.num_features, self.redraw_interval = head_dim, num_features, redraw_interval
        self.register_buffer("features", orthogonal_gaussian(num_features, head_dim))  # (m, d)
        self._calls = 0

    @torch.no_grad()
    def redraw(self, generator: torch.Generator | None = None) -> None:
        """Draw new orthogonal random features (m, d) in place (the paper redraws them during training)."""
        W = orthogonal_gaussian(self.num_features, self.head_dim, generator)
        self.features.copy_(W.to(self.features.device))

    def reset_parameters(self) -> None:
        """New features, drawn as the constructor draws them (TransformerEncoder calls this per layer)."""
        self.redraw()

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, need_weights: bool = True
    ) -> tuple[Tensor, None]:
        """q (B, H, L_q, d), k and v (B, H, L_k, d) -> (B, H, L_q, d): softmax attention approximated in time
        linear in L by positive orthogonal random features (FAVOR+, Choromanski et al. 2021); a key-only mask drops
        the padded keys. No weights (None)."""
        if self.training and self.redraw_interval:
            if self._calls % self.redraw_interval == 0 and self._calls > 0:
                self.redraw()
            self._calls += 1
        km = key_mask(_additive(mask, torch.float32), "performer")  # (B|1, H|1, L_k, 1)
        dtype = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(device_type=q.device.type, enabled=False):
            out = self._favor(q.to(dtype), k.to(dtype), v.to(dtype), km, self.features.to(dtype))
        return out.to(q.dtype), None

    @staticmethod
    def _favor(q: Tensor, k: Tensor, v: Tensor, km: Tensor | None, W: Tensor) -> Tensor:
        d, m = q.size(-1), W.size(0)
        c = d ** -0.25
        q, k = q * c, k * c

        # exponents of the positive features, (B, H, L, m): w.x - |x|^2 / 2
        zq = q @ W.T - 0.5 * (q * q).sum(-1, keepdim=True)
        zk = k @ W.T - 0.5 * (k * k).sum(-1, keepdim=True)
        if km is not None:
            zk = zk + km.to(zk.dtype)  # -inf for blocked keys -> phi(k) = 0
        # stabilisers (constants that cancel in num / den); no gradient needed through them
        sq = zq.amax(dim=-1, keepdim=True).detach()  # (B, H, L_q, 1): per query
        sk = zk.amax(dim=(-2, -1), keepdim=True).detach()  # (B, H, 1, 1): over real keys and features
        sk = torch.where(torch.isfinite(sk), sk, torch.zeros_like(sk))  # all keys blocked: any constant
        phi_q = torch.exp(zq - sq) / math.sqrt(m)  # (B, H, L_q, m)
        phi_k = torch.exp(zk - sk) / math.sqrt(m)  # (B, H, L_k, m)

        kv = phi_k.transpose(-1, -2) @ v  # (B, H, m, d): phi(K)^T V
        num = phi_q @ kv  # (B, H, L_q, d)
        den = phi_q @ phi_k.sum(dim=-2).unsqueeze(-1)  # (B, H, L_q, 1): phi(Q) phi(K)^T 1
        # den == 0 only when every term is 0 (no visible key), and then num == 0 too: output 0
        return num / torch.where(den > 0, den, torch.ones_like(den))

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, num_features={self.num_features}, "
                f"redraw_interval={self.redraw_interval}")
