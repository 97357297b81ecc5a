"""Multi-Head Attention from scratch, following the article (sections 2 and 3), made correct.

What differs from the article, and why:
  * masks follow PyTorch's convention (bool True = blocked, float = added); the article's
    `masked_fill(mask == 0, -1e9)` blocked the wrong keys. All masks go through `masks.merge_masks`.
  * `ScaledDotProductAttention` works on 3-D (B, L, d) and 4-D (B, H, L, d) inputs; the article's
    unpacked `Q.size()` into 3 names and crashed on the 4-D tensors its own MHA passes in.
  * no dropout after W_O: the encoder layer owns the residual dropout (the article applied two).
  * `need_weights=False` takes PyTorch's fused kernel (flash / memory-efficient on CUDA). On CPU,
    where SDPA has no kernel with dropout, long sequences attend in checkpointed query blocks.
  * a query whose keys are all masked gives output 0 and zero gradients instead of NaN.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from mhalab.nn.masks import dead_rows, merge_masks, to_additive
from mhalab.nn.unpad import Unpadding
from mhalab.nn.varlen import varlen_applies, varlen_attention

# CPU training with dropout and at least BLOCK_MIN_SCORES scores per (batch, head) attends in query blocks
# of QUERY_BLOCK rows (see _blocked_sdpa): memory for time, so only from L = 2048 on, where the (L, L)
# tensors dominate a training step's memory. The defaults of the constructor arguments (and of
# conf/model/custom.yaml, which a test keeps equal).
BLOCK_MIN_SCORES = 2048 * 2048
QUERY_BLOCK = 256


def check_blocking(block_min_scores: int | None, query_block: int, prefix: str = "") -> None:
    """The one rule for the query-block settings: block_min_scores None (never) or an integer >= 1,
    query_block an integer >= 1. `prefix` is the caller's name for their owner ("model." in the config)."""
    for name, value, nullable in (("block_min_scores", block_min_scores, True), ("query_block", query_block, False)):
        if value is None and nullable:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            default = {"block_min_scores": BLOCK_MIN_SCORES, "query_block": QUERY_BLOCK}[name]
            raise ValueError(f"{prefix}{name}={value!r} must be an integer >= 1{' or null (never)' * nullable} "
                             f"(the default is {default}).")


class ScaledDotProductAttention(nn.Module):
    """softmax(Q K^T / sqrt(d) + mask) V, for (..., L, d) inputs: 3-D or 4-D (B, H, L, d).

    block_min_scores, query_block: on CPU, in training with dropout, a (batch, head) with at least
    block_min_scores (L_q * L_k) scores attends query_block queries at a time, each block recomputed
    in backward (see _blocked_sdpa). None turns it off. Neither is a parameter or buffer, so
    checkpoints load whatever their values.
    """

    # nn.varlen: each sequence attended alone gives its real tokens' padded result; and this is the softmax
    # attention that PyTorch's varlen kernel (FlashAttention) computes, so CUDA may use that instead
    per_sequence = True
    softmax_varlen = True

    def __init__(self, dropout: float = 0.0, block_min_scores: int | None = BLOCK_MIN_SCORES,
                 query_block: int = QUERY_BLOCK):
        super().__init__()
        check_blocking(block_min_scores, query_block)
        self.dropout = nn.Dropout(dropout)
        self.block_min_scores, self.query_block = block_min_scores, query_block

    def forward(
        self, Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None = None, need_weights: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        # Q: (..., L_q, d)  K, V: (..., L_k, d)  mask: bool/float broadcastable to (..., L_q, L_k)
        if mask is not None and (mask.dtype == torch.bool or mask.dtype != Q.dtype):
            mask = to_additive(mask, "mask", Q.dtype)
        dead = dead_rows(mask)
        if dead is not None and dead.device.type == "cpu" and not dead.any():
            # nothing to zero: skip the two masked_fill copies below (the fused path's is a full copy
            # of the output). On a GPU this check would cost a host sync, so there we always zero.
            dead = None
        if dead is not None:
            mask = mask.masked_fill(dead, 0.0)  # keep softmax finite; the row is zeroed below

        if need_weights:
            # scale q (L_q x d numbers) rather than the scores (L_q x L_k), as PyTorch's MHA does
            scores = (Q * (1.0 / math.sqrt(Q.size(-1)))) @ K.transpose(-2, -1)  # (..., L_q, L_k)
            if mask is not None:
                scores = scores + mask
            # softmax in at least float32: bf16/fp16 scores lose too much precision in exp/sum
            # (float64 stays float64)
            weights = F.softmax(scores, dim=-1, dtype=torch.promote_types(Q.dtype, torch.float32)).to(Q.dtype)
            if dead is not None:
                weights = weights.masked_fill(dead, 0.0)
            weights = self.dropout(weights)
            out = weights @ V  # (..., L_q, d)
        else:
            p = self.dropout.p if self.training else 0.0
            L_q, L_k = Q.size(-2), K.size(-2)
            if (p > 0 and Q.device.type == "cpu" and torch.is_grad_enabled() and self.block_min_scores is not None
                    and L_q * L_k >= self.block_min_scores and L_q > self.query_block):
                out = _blocked_sdpa(Q, K, V, mask, p, self.query_block)
            else:
                out = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, dropout_p=p)
            weights = None
            if dead is not None:
                out = out.masked_fill(dead, 0.0)
        return out, weights


def _blocked_sdpa(Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None, p: float, block: int) -> Tensor:
    """SDPA with dropout, `block` queries at a time, each block recomputed in backward.

    On CPU, SDPA has no fused kernel with dropout: it falls back to the explicit computation, whose
    autograd keeps the (..., L_q, L_k) scores, weights and dropout mask for backward (PyTorch's
    module does the same). Under activation checkpointing each block keeps only its inputs, and
    backward recomputes it, replaying the same dropout draws (checkpoint restores the RNG state).
    Peak memory: one (..., block, L_k) block instead of the whole matrix; cost: attention's forward
    runs twice. The result is that of SDPA with the dropout mask drawn block by block.
    """
    outs = []
    for s in range(0, Q.size(-2), block):
        m = mask
        if mask is not None and mask.dim() >= 2 and mask.size(-2) > 1:  # per-query rows: slice them
            m = mask[..., s : s + block, :]
        outs.append(checkpoint(F.scaled_dot_product_attention, Q[..., s : s + block, :], K, V, attn_mask=m,
                               dropout_p=p, use_reentrant=False))
    return torch.cat(outs, dim=-2)  # (..., L_q, d)


def check_heads(embed_dim: int, num_heads: int, names: tuple[str, str] = ("embed_dim", "num_heads"),
                head_dim: int | None = None) -> int:
    """The one rule for head counts: both positive, and, unless head_dim is given (>= 1), num_heads divides
    embed_dim (each head gets embed_dim / num_heads dims). Returns the head width. `names` are the caller's
    names for the two (the config says dim, heads)."""
    e, h = names
    if embed_dim < 1 or num_heads < 1:
        raise ValueError(f"{e}={embed_dim} and {h}={num_heads} must both be >= 1.")
    if head_dim is not None:
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim={head_dim!r} must be an integer >= 1, or null for {e} / {h}.")
        return head_dim
    if embed_dim % num_heads:
        ok = [k for k in range(1, min(embed_dim, 64) + 1) if embed_dim % k == 0]
        raise ValueError(
            f"{h}={num_heads} does not divide {e}={embed_dim} ({e.replace('embed_', '')} per head would be "
            f"{embed_dim / num_heads:.2f}); choose {h} in {ok} or a {e} that is a multiple of {num_heads}."
        )
    return embed_dim // num_heads


class MultiHeadAttention(nn.Module):
    """The article's MHA: project with W_Q/W_K/W_V, split heads, attend, merge, project with W_O.

    forward(Q, K=None, V=None, key_padding_mask=None, attn_mask=None, need_weights=True)
      -> (output (B, L_q, E), weights (B, H, L_q, L_k) or None)
    Inputs are batch-first. K and V default to Q (self-attention).
    forward(x, attn_mask=None, need_weights=..., unpad=Unpadding(key_padding_mask)) is self-attention
    on packed tokens x (N, E) -> ((N, E), weights), as TransformerEncoder runs it (see unpad.Unpadding).
    `attention` swaps the kernel (see mhalab.model); `rotary` rotates q and k (RoPE);
    `position_bias` adds a (H, L_q, L_k) bias to the scores (ALiBi, T5).
    `block_min_scores`, `query_block` go to the default kernel (see ScaledDotProductAttention).
    `head_dim` (None: embed_dim / num_heads, the article's rule) sets each head's width apart from
    embed_dim: W_Q, W_K, W_V map E -> H x head_dim and W_O maps back (x-transformers' `dim_head`), so heads
    and head_dim can vary one at a time. nn.MultiheadAttention cannot express it (to_official refuses).
    `explicit=True` always attends through the (B, H, L_q, L_k) weights (the need_weights=True path), also
    when the caller passes need_weights=False, as encoder layers do; the weights are returned only when
    asked for. It is how the benchmark and the comparison with PyTorch time and test that path inside an
    encoder; a flag of the instance, not a parameter, so state dicts are the same.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        attention: nn.Module | None = None,
        rotary: nn.Module | None = None,
        position_bias: nn.Module | None = None,
        block_min_scores: int | None = BLOCK_MIN_SCORES,
        query_block: int = QUERY_BLOCK,
        explicit: bool = False,
        head_dim: int | None = None,
    ):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = check_heads(embed_dim, num_heads, head_dim=head_dim)  # None: embed_dim / num_heads
        self.inner_dim = num_heads * self.head_dim  # = embed_dim unless head_dim is given
        self.W_Q = nn.Linear(embed_dim, self.inner_dim, bias=bias)
        self.W_K = nn.Linear(embed_dim, self.inner_dim, bias=bias)
        self.W_V = nn.Linear(embed_dim, self.inner_dim, bias=bias)
        self.W_O = nn.Linear(self.inner_dim, embed_dim, bias=bias)
        self.attention = (attention if attention is not None
                          else ScaledDotProductAttention(dropout, block_min_scores, query_block))
        self.rotary = rotary
        self.position_bias = position_bias
        self.explicit = explicit
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # Same init as nn.MultiheadAttention: xavier on the stacked (3E, E) in-projection, zero biases
        # ((3 x heads x head_dim, E) when head_dim is given; W_O keeps nn.Linear's init, as PyTorch's out_proj).
        w = torch.empty(3 * self.inner_dim, self.embed_dim)
        nn.init.xavier_uniform_(w)
        for lin, chunk in zip((self.W_Q, self.W_K, self.W_V), w.chunk(3)):
            with torch.no_grad():
                lin.weight.copy_(chunk)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        if self.W_O.bias is not None:
            nn.init.zeros_(self.W_O.bias)

    def _in_proj(self, x: Tensor) -> Tensor:
        """Self-attention's three projections as one (E -> 3E) matmul: (..., E) -> (..., 3E) = [q | k | v].

        Same numbers as W_Q, W_K, W_V applied one by one, with one kernel call (and one pass over x)
        instead of three. The (3E, E) weight is concatenated on each call, which keeps W_Q/W_K/W_V
        plain nn.Linear modules (the article's names, and what the converters copy); the copy costs
        3*E^2 floats against the matmul's N*3E^2 multiply-adds.
        """
        w = torch.cat([self.W_Q.weight, self.W_K.weight, self.W_V.weight])
        b = None if self.W_Q.bias is None else torch.cat([self.W_Q.bias, self.W_K.bias, self.W_V.bias])
        return F.linear(x, w, b)

    def _project(self, Q: Tensor, K: Tensor, V: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if K is Q and V is Q:
            return self._in_proj(Q).chunk(3, dim=-1)
        return self.W_Q(Q), self.W_K(K), self.W_V(V)

    def forward(
        self,
        Q: Tensor,
        K: Tensor | None = None,
        V: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        need_weights: bool = True,
        unpad: Unpadding | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        if unpad is not None:  # packed self-attention, Q: (N, E) real tokens (see _forward_packed)
            if K is not None or V is not None or key_padding_mask is not None:
                raise ValueError(
                    "with unpad=..., Q holds the packed tokens of a self-attention: pass no K, V or "
                    "key_padding_mask (the mask is the one unpad was built from)."
                )
            return self._forward_packed(Q, unpad, attn_mask, need_weights)
        K = Q if K is None else K
        V = K if V is None else V
        for name, t in (("Q", Q), ("K", K), ("V", V)):
            if t.dim() != 3 or t.size(-1) != self.embed_dim:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}; expected (batch, seq_len, embed_dim={self.embed_dim}) "
                    f"(inputs are batch-first)."
                )
        B = Q.size(0)
        if K.size(0) != B or V.shape[:2] != K.shape[:2]:
            raise ValueError(
                f"batch/length mismatch: Q {tuple(Q.shape)}, K {tuple(K.shape)}, V {tuple(V.shape)}; "
                f"K and V need the same (batch, L_k), and batch must equal Q's."
            )

        q, k, v = self._project(Q, K, V)  # (B, L, E) each
        out, weights = self._attend(q, k, v, key_padding_mask, attn_mask, need_weights)  # (B, L_q, E)
        return self.W_O(out), weights

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, attn_mask: Tensor | None,
        need_weights: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """Projected q (B, L_q, H*d), k and v (B, L_k, H*d) -> heads -> attention -> merged (B, L_q, H*d)
        (H*d = E unless head_dim is given)."""
        B, L_q, _ = q.shape
        L_k = k.size(1)
        # split heads: (B, L, H*d) -> (B, L, H, d) -> (B, H, L, d)
        q = q.view(B, L_q, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, L_k, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, L_k, self.num_heads, self.head_dim).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q, k)

        pos_bias = self.position_bias(L_q, L_k) if self.position_bias is not None else None
        mask = merge_masks(
            attn_mask, key_padding_mask, batch=B, num_heads=self.num_heads, L_q=L_q, L_k=L_k,
            dtype=q.dtype, bias=pos_bias,
        )  # None or broadcastable to (B, H, L_q, L_k)
        out, weights = self.attention(q, k, v, mask=mask, need_weights=need_weights or self.explicit)
        weights = weights if need_weights else None  # explicit=True computed them, nobody asked
        # merge heads: (B, H, L_q, d) -> (B, L_q, H, d) -> (B, L_q, H*d)
        # (free when the kernel wrote its output as (B, L_q, H, d), as SDPA's CPU kernel does when q
        # is a view of a (B, L, ...) projection, as here)
        return out.transpose(1, 2).reshape(B, L_q, self.inner_dim), weights

    def _forward_packed(
        self, x: Tensor, unpad: Unpadding, attn_mask: Tensor | None, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Self-attention on packed tokens: x (N, E), the real tokens of a padded batch (see Unpadding).

        forward(x, unpad=unpad) lands here (through forward, so that hooks see the call). The
        projections run on the N real tokens only; attention runs on the padded (B, L) layout, where
        the pads hold copies of a real token's q, k, v, blocked as keys by the key-padding mask that
        `unpad` was built from. The real tokens' outputs are those of
        forward(x_padded, key_padding_mask=..., attn_mask=attn_mask).
        When the rows are right-padded (unpad.seqlens) and the kernel computes each sequence alone the same
        way (varlen.varlen_applies), attention also runs on the packed tokens, per sequence (varlen_attention):
        quadratic work on real tokens only. need_weights=True and explicit=True keep the padded layout.
        Returns ((N, E), weights (B, H, L, L) or None); the weights' rows for padded queries are not
        the padded computation's (they are discarded in any case).
        """
        if x.dim() != 2 or x.size(-1) != self.embed_dim or x.size(0) != unpad.num_tokens:
            raise ValueError(
                f"x has shape {tuple(x.shape)}; expected packed tokens (N={unpad.num_tokens}, "
                f"embed_dim={self.embed_dim})."
            )
        qkv = self._in_proj(x)  # (N, 3E)
        if not need_weights and varlen_applies(self, attn_mask) and unpad.seqlens is not None:
            # attention on the real tokens too, each sequence on its own (nn.varlen): no (B, L) layout at all
            return self.W_O(varlen_attention(self, qkv, unpad.seqlens, attn_mask)), None  # (N, E)
        # back to the padded layout for attention, for q, k and v at once: (N, 3E) -> (B, L, 3E). What
        # the pads hold does not matter (masked keys, dropped queries), so skip zeroing them.
        q, k, v = unpad.unpack(qkv, zero_pads=False).chunk(3, dim=-1)  # (B, L, E) each
        out, weights = self._attend(q, k, v, unpad.key_padding_mask, attn_mask, need_weights)  # (B, L, E)
        return self.W_O(unpad.pack(out)), weights  # (N, E)

    # ---- converters to and from nn.MultiheadAttention (batch_first) ----
    @classmethod
    def from_official(cls, mha: nn.MultiheadAttention, explicit: bool = False) -> MultiHeadAttention:
        if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError(
                "from_official supports nn.MultiheadAttention with kdim = vdim = embed_dim, "
                "add_bias_kv=False and add_zero_attn=False."
            )
        has_bias = mha.in_proj_bias is not None
        ours = cls(mha.embed_dim, mha.num_heads, dropout=mha.dropout, bias=has_bias, explicit=explicit)
        ours = ours.to(device=mha.in_proj_weight.device, dtype=mha.in_proj_weight.dtype)
        with torch.no_grad():
            for lin, w in zip((ours.W_Q, ours.W_K, ours.W_V), mha.in_proj_weight.chunk(3)):
                lin.weight.copy_(w)
            ours.W_O.weight.copy_(mha.out_proj.weight)
            if has_bias:
                for lin, b in zip((ours.W_Q, ours.W_K, ours.W_V), mha.in_proj_bias.chunk(3)):
                    lin.bias.copy_(b)
                ours.W_O.bias.copy_(mha.out_proj.bias)
        return ours

    def to_official(self) -> nn.MultiheadAttention:
        if not isinstance(self.attention, ScaledDotProductAttention) or self.rotary or self.position_bias:
            raise ValueError("to_official needs plain softmax attention without rotary or position bias.")
        if self.inner_dim != self.embed_dim:
            raise ValueError(
                f"to_official: nn.MultiheadAttention splits embed_dim={self.embed_dim} among its heads, so it cannot "
                f"express num_heads={self.num_heads} x head_dim={self.head_dim} = {self.inner_dim}; only "
                f"head_dim = embed_dim / num_heads (head_dim=None) converts."
            )
        has_bias = self.W_Q.bias is not None
        w = self.W_Q.weight
        mha = nn.MultiheadAttention(
            self.embed_dim, self.num_heads, dropout=self.attention.dropout.p, bias=has_bias,
            batch_first=True, device=w.device, dtype=w.dtype,
        )
        with torch.no_grad():
            mha.in_proj_weight.copy_(torch.cat([self.W_Q.weight, self.W_K.weight, self.W_V.weight]))
            mha.out_proj.weight.copy_(self.W_O.weight)
            if has_bias:
                mha.in_proj_bias.copy_(torch.cat([self.W_Q.bias, self.W_K.bias, self.W_V.bias]))
                mha.out_proj.bias.copy_(self.W_O.bias)
        return mha
