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
        """softmax(Q K^T / sqrt(d) + mask) V, and the weights (None where need_weights=False).

        Q (..., L_q, d), K and V (..., L_k, d): any leading dims (3-D and 4-D alike). mask: bool (True = blocked) or
        float (added to the scores), broadcastable to (..., L_q, L_k). A query whose keys are all blocked gets
        output 0 and zero gradients (PyTorch gives NaN). Returns (..., L_q, d) and the weights (..., L_q, L_k)."""
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


class MultiHeadAttention(nn.MultiheadAttention):
    """The article's MHA: project with W_Q/W_K/W_V, split heads, attend, merge, project with W_O; with the whole
    contract of nn.MultiheadAttention, so it can stand in for PyTorch's inside any model (see mhalab.nn.swap).

    Constructor: nn.MultiheadAttention's arguments in its order (embed_dim, num_heads, dropout, bias, add_bias_kv,
    add_zero_attn, kdim, vdim, batch_first, device, dtype) with their meaning; two defaults are the article's:
    batch_first=True, and `average_attn_weights=False` (the weights come per head, (B, H, L_q, L_k)), the default
    of forward's argument of that name. from_official carries PyTorch's (the module's batch_first, averaging on).
    W_K takes kdim inputs and W_V vdim inputs. Then ours only, keyword-only:
    `attention` swaps the kernel (see mhalab.model); `rotary` rotates q and k (RoPE); `position_bias` adds a
    (H, L_q, L_k) bias to the scores (ALiBi, T5); `block_min_scores`, `query_block` go to the default kernel
    (see ScaledDotProductAttention); `head_dim` (None: embed_dim / num_heads, the article's rule) sets each head's
    width apart from embed_dim: W_Q, W_K, W_V map to H x head_dim and W_O maps back (x-transformers' `dim_head`).
    `explicit=True` always attends through the (B, H, L_q, L_k) weights (the need_weights=True path), also when
    the caller passes need_weights=False, as encoder layers do; a flag of the instance, not a parameter.

    forward(query, key=None, value=None, key_padding_mask=None, need_weights=True, attn_mask=None,
            average_attn_weights=None, is_causal=False) -> (output, weights or None), as nn.MultiheadAttention:
    query (B, L_q, E), or (L_q, B, E) with batch_first=False, or unbatched (L_q, E); key and value default to
    query (self-attention). key_padding_mask (B, L_k) and attn_mask ((L_q, L_k) or (B x H, L_q, L_k); ours also
    takes (B, L_q, L_k) and (B or 1, H or 1, L_q, L_k)), bool (True = blocked) or float (added). Weights are
    always batch-first: (B, H, L_q, L_k), or their mean over heads (B, L_q, L_k). is_causal=True without an
    attn_mask applies the causal mask (PyTorch asks for the mask and takes is_causal as a hint about it).
    Where ours differs: a query whose keys are all blocked gets output 0 and zero gradients (PyTorch: NaN).
    forward(x, attn_mask=None, need_weights=..., unpad=Unpadding(key_padding_mask)) is self-attention on packed
    tokens x (N, E) -> ((N, E), weights), as TransformerEncoder runs it (see unpad.Unpadding).

    nn.MultiheadAttention's attribute names are views of ours (in_proj_weight = [W_Q; W_K; W_V], out_proj = W_O,
    q_proj_weight, ...): code that reads them, as nn.TransformerEncoderLayer's fused inference path does, gets
    these weights. The parameters are W_Q, W_K, W_V, W_O (and bias_k, bias_v), so state dicts keep the article's
    names; it is an nn.MultiheadAttention only by type and attributes (nn.MultiheadAttention.__init__ is not run).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = True,
        device=None,
        dtype=None,
        *,
        average_attn_weights: bool = False,
        attention: nn.Module | None = None,
        rotary: nn.Module | None = None,
        position_bias: nn.Module | None = None,
        block_min_scores: int | None = BLOCK_MIN_SCORES,
        query_block: int = QUERY_BLOCK,
        explicit: bool = False,
        head_dim: int | None = None,
    ):
        nn.Module.__init__(self)  # ours holds W_Q ... W_O; nn.MultiheadAttention's names are views (below)
        for name, flag in (("bias", bias), ("add_bias_kv", add_bias_kv), ("add_zero_attn", add_zero_attn),
                           ("batch_first", batch_first), ("average_attn_weights", average_attn_weights)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}={flag!r} must be True or False (nn.MultiheadAttention's order: embed_dim, "
                                 f"num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim, batch_first).")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = check_heads(embed_dim, num_heads, head_dim=head_dim)  # None: embed_dim / num_heads
        self.inner_dim = num_heads * self.head_dim  # = embed_dim unless head_dim is given
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.batch_first = batch_first
        self.average_attn_weights = average_attn_weights
        self.add_zero_attn = add_zero_attn
        f = {"device": device, "dtype": dtype}
        self.W_Q = nn.Linear(embed_dim, self.inner_dim, bias=bias, **f)
        self.W_K = nn.Linear(self.kdim, self.inner_dim, bias=bias, **f)
        self.W_V = nn.Linear(self.vdim, self.inner_dim, bias=bias, **f)
        self.W_O = nn.Linear(self.inner_dim, embed_dim, bias=bias, **f)
        # add_bias_kv: one learned key and value appended to every sequence's keys (PyTorch's bias_k, bias_v)
        self.bias_k = nn.Parameter(torch.empty(1, 1, self.inner_dim, **f)) if add_bias_kv else None
        self.bias_v = nn.Parameter(torch.empty(1, 1, self.inner_dim, **f)) if add_bias_kv else None
        self.attention = (attention if attention is not None
                          else ScaledDotProductAttention(dropout, block_min_scores, query_block))
        self.rotary = rotary
        self.position_bias = position_bias
        self.explicit = explicit
        self._check_extras()
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # nn.MultiheadAttention's init: xavier on the stacked (3E, E) in-projection (each of W_Q, W_K, W_V on its
        # own when kdim / vdim differ), zero biases, xavier-normal bias_k / bias_v; W_O keeps nn.Linear's weight
        # init, as PyTorch's out_proj. (With head_dim given, the stack is (3 x heads x head_dim, E).)
        lins = (self.W_Q, self.W_K, self.W_V)
        with torch.no_grad():
            if self.kdim == self.vdim == self.embed_dim:
                w = torch.empty(3 * self.inner_dim, self.embed_dim)
                nn.init.xavier_uniform_(w)
                for lin, chunk in zip(lins, w.chunk(3)):
                    lin.weight.copy_(chunk)
            else:
                for lin in lins:
                    nn.init.xavier_uniform_(lin.weight)
            for lin in (*lins, self.W_O):
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)
            for b in (self.bias_k, self.bias_v):
                if b is not None:
                    nn.init.xavier_normal_(b)

    __setstate__ = nn.Module.__setstate__  # not nn.MultiheadAttention's (it adds a _qkv_same_embed_dim entry)

    # ---- nn.MultiheadAttention's attributes, as views of ours ----
    @property
    def dropout(self) -> float:
        """The attention-weight dropout probability (nn.MultiheadAttention's float `dropout`): the kernel's."""
        drop = getattr(self.attention, "dropout", None)
        return drop.p if isinstance(drop, nn.Dropout) else 0.0

    @dropout.setter
    def dropout(self, p: float) -> None:
        drop = getattr(self.attention, "dropout", None)
        if isinstance(drop, nn.Dropout):
            drop.p = p
        elif p:
            raise ValueError(f"dropout={p}: the {type(self.attention).__name__} kernel has no attention dropout.")

    @property
    def _qkv_same_embed_dim(self) -> bool:
        """True when nn.MultiheadAttention's packed weights (in_proj_weight, in_proj_bias, out_proj) describe this
        module completely: kdim = vdim = embed_dim and nothing but PyTorch's attention (no bias_kv or zero_attn,
        variant or other head width). PyTorch's fused paths (nn.TransformerEncoderLayer in inference) read it
        before they compute from in_proj_weight alone; for anything else they call forward."""
        return (self.kdim == self.vdim == self.embed_dim and self.bias_k is None and not self.add_zero_attn
                and self.not_official() is None)

    @property
    def in_proj_weight(self) -> Tensor | None:
        """[W_Q; W_K; W_V], (3E, E); None when kdim / vdim differ from embed_dim, as in PyTorch (q/k/v_proj_weight
        hold them). Also with a variant, whose _qkv_same_embed_dim is False: PyTorch's encoder reads it before
        its layers decline their fused path."""
        if not self.kdim == self.vdim == self.embed_dim:
            return None
        return torch.cat([self.W_Q.weight, self.W_K.weight, self.W_V.weight])

    @property
    def in_proj_bias(self) -> Tensor | None:
        return None if self.W_Q.bias is None else torch.cat([self.W_Q.bias, self.W_K.bias, self.W_V.bias])

    @property
    def q_proj_weight(self) -> Tensor | None:
        return None if self._qkv_same_embed_dim else self.W_Q.weight

    @property
    def k_proj_weight(self) -> Tensor | None:
        return None if self._qkv_same_embed_dim else self.W_K.weight

    @property
    def v_proj_weight(self) -> Tensor | None:
        return None if self._qkv_same_embed_dim else self.W_V.weight

    @property
    def out_proj(self) -> nn.Linear:
        return self.W_O

    def _variant(self) -> str | None:
        """The part of ours that is not softmax attention on the projections (a phrase), or None."""
        if not isinstance(self.attention, ScaledDotProductAttention):
            return f"the {type(self.attention).__name__} kernel"
        if self.rotary is not None:
            return "rotary position embeddings (RoPE)"
        if self.position_bias is not None:
            return f"a position bias ({type(self.position_bias).__name__})"
        return None

    def not_official(self) -> str | None:
        """What nn.MultiheadAttention cannot express in this module (a phrase), or None: the one rule behind
        to_official's refusal and _qkv_same_embed_dim."""
        if self.inner_dim != self.embed_dim:
            return (f"num_heads={self.num_heads} x head_dim={self.head_dim} = {self.inner_dim} != "
                    f"embed_dim={self.embed_dim} (it splits embed_dim among its heads)")
        return self._variant()

    def _check_extras(self) -> None:
        """add_bias_kv / add_zero_attn append keys with no position: only the plain softmax kernel takes them."""
        variant = self._variant()
        if variant is not None and (self.bias_k is not None or self.add_zero_attn):
            what = "add_bias_kv" if self.bias_k is not None else "add_zero_attn"
            raise ValueError(f"{what}=True appends a key with no position, which {variant} cannot place; use "
                             f"{what} with the default kernel and no rotary or position bias.")

    # ---- forward ----
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
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool | None = None,
        is_causal: bool = False,
        *,
        unpad: Unpadding | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """nn.MultiheadAttention.forward's contract: (output, weights).

        query (B, L, E), key and value (B, S, kdim / vdim): batch-first by default, (L, B, E) with batch_first=False,
        or unbatched (L, E). key and value default to query (self-attention). key_padding_mask (B, S), attn_mask
        (L, S) or (B*H, L, S): bool (True = blocked) or float (added). Output has the query's layout; weights are
        per head (B, H, L, S), or averaged (B, L, S) with average_attn_weights=True (the module's default where
        none is given), None with need_weights=False. With unpad=Unpadding(...), query is packed self-attention
        input (N, E) and so is the output."""
        if isinstance(need_weights, Tensor):
            raise TypeError("need_weights got a tensor: the 5th argument is need_weights, as in "
                             "nn.MultiheadAttention (query, key, value, key_padding_mask, need_weights, attn_mask); "
                             "pass attn_mask=... by keyword.")
        average = self.average_attn_weights if average_attn_weights is None else average_attn_weights
        if unpad is not None:  # packed self-attention, query: (N, E) real tokens (see _forward_packed)
            if key is not None or value is not None or key_padding_mask is not None:
                raise ValueError(
                    "with unpad=..., query holds the packed tokens of a self-attention: pass no key, value or "
                    "key_padding_mask (the mask is the one unpad was built from)."
                )
            out, weights = self._forward_packed(query, unpad, attn_mask, need_weights, is_causal)
            return out, _average(weights, average)
        if query.is_nested:  # from nn.TransformerEncoder's inference path ("nested tensors")
            return self._forward_nested(query, key, value, attn_mask, need_weights, average, is_causal)
        key = query if key is None else key
        value = key if value is None else value
        batched = query.dim() == 3
        if not batched:  # unbatched (L, E): a batch of one
            query, key, value = self._check_unbatched(query, key, value, key_padding_mask)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (L, B, E) -> (B, L, E), views; q, k, v keep their identity for _project
            query, key, value = _batch_first(query, key, value)
        self._check_inputs(query, key, value)

        q, k, v = self._project(query, key, value)  # (B, L_q, H*d), (B, L_k, H*d) x 2
        out, weights = self._attend(q, k, v, key_padding_mask, attn_mask, need_weights, is_causal)  # (B, L_q, H*d)
        # W_O in the memory layout nn.MultiheadAttention computes in, sequence-first: (L_q, B, E) contiguous, seen
        # as (B, L_q, E) when batch_first. The numbers are the same either way; the layout makes a dropout after
        # this module (nn's layers' dropout1) draw the same mask for the same element as after PyTorch's.
        out, weights = self.W_O(out.transpose(0, 1)), _average(weights, average)  # (L_q, B, E)
        if not batched:
            return out.squeeze(1), None if weights is None else weights.squeeze(0)
        return (out.transpose(0, 1) if self.batch_first else out), weights

    def _check_unbatched(self, query: Tensor, key: Tensor, value: Tensor, kpm: Tensor | None):
        if query.dim() != 2 or key.dim() != 2 or value.dim() != 2:
            raise ValueError(
                f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}: expected all "
                f"batched (3-D, {'batch-first' if self.batch_first else 'sequence-first'}) or all unbatched "
                f"(L, features)."
            )
        if kpm is not None and kpm.dim() != 1:
            raise ValueError(f"key_padding_mask has shape {tuple(kpm.shape)}; unbatched inputs take an (L_k,) mask.")
        return query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        """query (B, L_q, embed_dim), key (B, L_k, kdim), value (B, L_k, vdim), as laid out batch-first here."""
        layout = "batch, seq_len" if self.batch_first else "seq_len, batch"
        for name, t, width in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if t.dim() != 3 or t.size(-1) != width:
                dim = {"query": "embed_dim", "key": "kdim", "value": "vdim"}[name]
                raise ValueError(f"{name} has shape {tuple(t.shape)}; expected ({layout}, {dim}={width}) "
                                 f"(batch_first={self.batch_first}) or unbatched (seq_len, {dim}).")
        if key.size(0) != query.size(0) or value.shape[:2] != key.shape[:2]:
            raise ValueError(
                f"batch/length mismatch: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                f"{tuple(value.shape)} (as batch-first); key and value need the same (batch, L_k), and batch "
                f"must equal query's."
            )

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, attn_mask: Tensor | None,
        need_weights: bool, is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Projected q (B, L_q, H*d), k and v (B, L_k, H*d) -> heads -> attention -> merged (B, L_q, H*d)
        (H*d = E unless head_dim is given), and the weights (B, H, L_q, L_k') or None (L_k' counts the keys
        add_bias_kv and add_zero_attn append)."""
        B, L_q, _ = q.shape
        if is_causal and attn_mask is None:
            attn_mask = causal_mask(L_q, k.size(1), q.device)
        if self.bias_k is not None or self.add_zero_attn:
            self._check_extras()  # a variant may have been plugged in since construction
            k, v, attn_mask, key_padding_mask = self._append_keys(k, v, attn_mask, key_padding_mask)
        L_k = k.size(1)
        # split heads: (B, L, H*d) -> (B, L, H, d) -> (B, H, L, d)
        q = q.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        k = k.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        v = v.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
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

    def _append_keys(self, k: Tensor, v: Tensor, attn_mask: Tensor | None, kpm: Tensor | None):
        """PyTorch's extras, in its order: add_bias_kv appends (bias_k, bias_v), then add_zero_attn a zero key and
        value; each extra key is visible to every query (the masks get a 0 / False column).
        k, v: (B, L_k, H*d) -> (B, L_k + extras, H*d)."""
        B = k.size(0)
        extra_k, extra_v = [], []
        if self.bias_k is not None:
            extra_k.append(self.bias_k.expand(B, 1, -1))
            extra_v.append(self.bias_v.expand(B, 1, -1))
        if self.add_zero_attn:  # a zero vector after projection: zero in every head
            extra_k.append(k.new_zeros(B, 1, k.size(-1)))
            extra_v.append(v.new_zeros(B, 1, v.size(-1)))
        n = len(extra_k)
        k, v = torch.cat([k, *extra_k], dim=1), torch.cat([v, *extra_v], dim=1)

        def visible(m: Tensor | None) -> Tensor | None:  # (..., L_k) -> (..., L_k + n)
            return None if m is None else torch.cat([m, m.new_zeros(*m.shape[:-1], n)], dim=-1)

        return k, v, visible(attn_mask), visible(kpm)

    def _forward_packed(
        self, x: Tensor, unpad: Unpadding, attn_mask: Tensor | None, need_weights: bool, is_causal: bool = False,
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
        if is_causal and attn_mask is None:
            attn_mask = causal_mask(unpad.seq_len, unpad.seq_len, x.device)
        qkv = self._in_proj(x)  # (N, 3E)
        if not need_weights and varlen_applies(self, attn_mask) and unpad.seqlens is not None:
            # attention on the real tokens too, each sequence on its own (nn.varlen): no (B, L) layout at all
            return self.W_O(varlen_attention(self, qkv, unpad.seqlens, attn_mask)), None  # (N, E)
        # back to the padded layout for attention, for q, k and v at once: (N, 3E) -> (B, L, 3E). What
        # the pads hold does not matter (masked keys, dropped queries), so skip zeroing them.
        q, k, v = unpad.unpack(qkv, zero_pads=False).chunk(3, dim=-1)  # (B, L, E) each
        out, weights = self._attend(q, k, v, unpad.key_padding_mask, attn_mask, need_weights)  # (B, L, E)
        return self.W_O(unpad.pack(out)), weights  # (N, E)

    def _forward_nested(self, query: Tensor, key, value, attn_mask, need_weights, average, is_causal):
        """Self-attention on a nested tensor (B sequences of their own lengths, batch-first), as
        nn.TransformerEncoder passes in inference when PyTorch's fused layer declines (a variant of ours):
        padded with a key-padding mask, attended, and nested again."""
        if key is not None and key is not query or value is not None and value is not query:
            raise ValueError("a nested-tensor query is taken for self-attention only (key and value the same).")
        lengths = [t.size(0) for t in query.unbind()]
        x = query.to_padded_tensor(0.0)  # (B, L, E), zeros at the pads
        pad = torch.arange(x.size(1), device=x.device) >= torch.tensor(lengths, device=x.device)[:, None]  # (B, L)
        q, k, v = self._project(x, x, x)
        out, weights = self._attend(q, k, v, pad, attn_mask, need_weights, is_causal)
        out = self.W_O(out)  # (B, L, E)
        return torch.nested.as_nested_tensor([o[:n] for o, n in zip(out, lengths)]), _average(weights, average)

    # ---- converters to and from nn.MultiheadAttention ----
    @classmethod
    def from_official(cls, mha: nn.MultiheadAttention, explicit: bool = False, **parts) -> MultiHeadAttention:
        """Ours with `mha`'s weights and behaviour: every configuration (kdim / vdim, add_bias_kv, add_zero_attn,
        bias, batch_first, dtype, device, train / eval, which parameters require grad), and PyTorch's default of
        averaging the weights over heads. `parts` (attention, rotary, position_bias) plug a variant in, which
        makes it another function (to_official then refuses)."""
        w = mha.in_proj_weight if mha._qkv_same_embed_dim else mha.q_proj_weight
        ours = cls(
            mha.embed_dim, mha.num_heads, dropout=mha.dropout, bias=mha.in_proj_bias is not None,
            add_bias_kv=mha.bias_k is not None, add_zero_attn=bool(mha.add_zero_attn), kdim=mha.kdim,
            vdim=mha.vdim, batch_first=bool(mha.batch_first), device=w.device, dtype=w.dtype,
            average_attn_weights=True, explicit=explicit, **parts,
        )
        _copy_projections(ours, mha)
        return ours.train(mha.training)

    def to_official(self) -> nn.MultiheadAttention:
        """nn.MultiheadAttention with these weights, configuration, train / eval mode and requires_grad. Refused, in
        one line, for what it cannot express (not_official). nn.MultiheadAttention has no default for
        average_attn_weights: it averages unless told not to, whatever this module's default."""
        why = self.not_official()
        if why is not None:
            raise ValueError(f"to_official: nn.MultiheadAttention cannot express {why}; keep ours, or build it "
                             f"with the default kernel, no rotary / position_bias and head_dim=None.")
        w = self.W_Q.weight
        mha = nn.MultiheadAttention(
            self.embed_dim, self.num_heads, dropout=self.dropout, bias=self.W_Q.bias is not None,
            add_bias_kv=self.bias_k is not None, add_zero_attn=self.add_zero_attn, kdim=self.kdim, vdim=self.vdim,
            batch_first=self.batch_first, device=w.device, dtype=w.dtype,
        )
        _copy_projections(mha, self)
        return mha.train(self.training)


def _copy_projections(dst: nn.MultiheadAttention, src: nn.MultiheadAttention) -> None:
    """Copy every projection weight and bias, bias_k and bias_v, through nn.MultiheadAttention's names (views of
    W_Q ... W_O on ours), with their requires_grad. Works either way: ours <- PyTorch's, PyTorch's <- ours."""
    def pairs(m: nn.MultiheadAttention):
        if isinstance(m, MultiHeadAttention):  # the parameters themselves, not the concatenated views
            lins = (m.W_Q, m.W_K, m.W_V)
            yield from zip(("q", "k", "v"), (lin.weight for lin in lins), (lin.bias for lin in lins))
        else:
            ws = (m.in_proj_weight.chunk(3) if m._qkv_same_embed_dim
                  else (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight))
            bs = m.in_proj_bias.chunk(3) if m.in_proj_bias is not None else (None,) * 3
            yield from zip(("q", "k", "v"), ws, bs)
        yield "out", m.out_proj.weight, m.out_proj.bias
        yield "bias_kv", m.bias_k, m.bias_v

    with torch.no_grad():
        for (_, dw, db), (_, sw, sb) in zip(pairs(dst), pairs(src)):
            for d, s in ((dw, sw), (db, sb)):
                if d is not None:
                    d.copy_(s)
    # requires_grad: PyTorch's module has one flag per packed tensor; ours one per Linear
    for d_param, s_param in _grad_pairs(dst, src):
        d_param.requires_grad_(s_param.requires_grad)


def _grad_pairs(dst: nn.MultiheadAttention, src: nn.MultiheadAttention):
    """(parameter of dst, parameter of src whose requires_grad it takes)."""
    ours, theirs = (dst, src) if isinstance(dst, MultiHeadAttention) else (src, dst)
    packed = theirs._qkv_same_embed_dim
    pairs = []
    for lin, name in ((ours.W_Q, "q"), (ours.W_K, "k"), (ours.W_V, "v")):
        pairs.append((lin.weight, theirs.in_proj_weight if packed else getattr(theirs, f"{name}_proj_weight")))
        if lin.bias is not None:
            pairs.append((lin.bias, theirs.in_proj_bias))
    pairs += [(ours.W_O.weight, theirs.out_proj.weight)]
    if ours.W_O.bias is not None:
        pairs.append((ours.W_O.bias, theirs.out_proj.bias))
    if ours.bias_k is not None:
        pairs += [(ours.bias_k, theirs.bias_k), (ours.bias_v, theirs.bias_v)]
    if dst is ours:
        return pairs
    return [(t, o) for o, t in pairs]


def causal_mask(L_q: int, L_k: int, device=None) -> Tensor:
    """(L_q, L_k) bool, True above the diagonal: query i sees keys 0..i (nn.Transformer's square subsequent mask,
    top-left aligned when L_q != L_k, as F.scaled_dot_product_attention's is_causal)."""
    return torch.ones(L_q, L_k, dtype=torch.bool, device=device).triu(1)


def _batch_first(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(L, B, E) -> (B, L, E) views, keeping `key is query` / `value is key` (self-attention's one projection)."""
    q = query.transpose(0, 1)
    k = q if key is query else key.transpose(0, 1)
    v = k if value is key else (q if value is query else value.transpose(0, 1))
    return q, k, v


def _average(weights: Tensor | None, average: bool) -> Tensor | None:
    """(B, H, L_q, L_k) -> their mean over heads (B, L_q, L_k) when asked, as nn.MultiheadAttention's default."""
    return weights.mean(dim=1) if weights is not None and average else weights
