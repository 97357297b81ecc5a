"""Multi-Head Attention from scratch, following the article (sections 2 and 3), made correct.

What differs from the article, and why:

- masks follow PyTorch's convention (bool True = blocked, float = added); the article's
  `masked_fill(mask == 0, -1e9)` blocked the wrong keys. All masks go through `masks.merge_masks`.
- `ScaledDotProductAttention` works on 3-D (B, L, d) and 4-D (B, H, L, d) inputs; the article's
  unpacked `Q.size()` into 3 names and crashed on the 4-D tensors its own MHA passes in.
- no dropout after W_O: the encoder layer owns the residual dropout (the article applied two).
- `need_weights=False` takes PyTorch's fused kernel (flash / memory-efficient on CUDA). On CPU,
  where SDPA has no kernel with dropout, long sequences attend in checkpointed query blocks.
- a query whose keys are all masked gives output 0 and zero gradients instead of NaN.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from mhalab.nn.dropout import draws_own_mask
from mhalab.nn.masks import ShapeError, dead_rows, merge_masks, to_additive
from mhalab.nn.script import refuse
from mhalab.nn.unpad import Unpadding
from mhalab.nn.varlen import varlen_applies, varlen_attention

# CPU training with dropout and at least BLOCK_MIN_SCORES scores per (batch, head) attends in query blocks
# of QUERY_BLOCK rows (see _blocked): memory for time, so only from L = 2048 on, where the (L, L)
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
    in backward (see _blocked). None turns it off. Neither is a parameter or buffer, so
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
        if dead is not None and dead.device.type == "cpu" and not torch.compiler.is_compiling() and not dead.any():
            # no row dead (varlen's calls never have one): skip zeroing, a pass over the (..., L_q, L_k) weights
            # forward and one backward. Asked on CPU in eager only: on a GPU it is a host sync, under torch.compile
            # a data-dependent branch, and zeroing all-live rows gives the same numbers.
            dead = None
        if dead is not None:
            mask = mask.masked_fill(dead, 0.0)  # keep softmax finite; the row is zeroed below

        p = self.dropout.p if self.training else 0.0
        L_q, L_k = Q.size(-2), K.size(-2)
        blocked = (p > 0 and Q.device.type == "cpu" and torch.is_grad_enabled() and self.block_min_scores is not None
                   and L_q * L_k >= self.block_min_scores and L_q > self.query_block)
        if need_weights:
            out, weights = self._explicit(Q, K, V, mask, dead)
        elif draws_own_mask(self.dropout, Q):  # a dropout that is not SDPA's: the explicit computation (CPU SDPA
            # with dropout computes it too); in query blocks under checkpointing, as _blocked does
            out = (_blocked(lambda q, m, d: self._explicit(q, K, V, m, d)[0], Q, mask, dead, self.query_block)
                   if blocked else self._explicit(Q, K, V, mask, dead)[0])
            weights = None
        else:
            if blocked:
                out = _blocked(lambda q, m, d: F.scaled_dot_product_attention(q, K, V, attn_mask=m, dropout_p=p),
                               Q, mask, dead, self.query_block)
            else:
                out = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, dropout_p=p)
            weights = None
            if dead is not None:
                out = out.masked_fill(dead, 0.0)
        return out, weights

    def _explicit(self, Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None, dead: Tensor | None
                  ) -> tuple[Tensor, Tensor]:
        """The computation written out: (..., L_q, d) outputs and the (..., L_q, L_k) weights (after dropout).
        mask: additive, dead rows already zeroed (forward)."""
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
        return weights @ V, weights  # (..., L_q, d), (..., L_q, L_k)


def _blocked(attend, Q: Tensor, mask: Tensor | None, dead: Tensor | None, block: int) -> Tensor:
    """attend(q, mask rows, dead rows) with dropout, `block` queries at a time, each block recomputed in backward.

    On CPU, SDPA has no fused kernel with dropout: it falls back to the explicit computation, whose
    autograd keeps the (..., L_q, L_k) scores, weights and dropout mask for backward (PyTorch's
    module does the same). Under activation checkpointing each block keeps only its inputs, and
    backward recomputes it, replaying the same dropout draws (checkpoint restores the RNG state).
    Peak memory: one (..., block, L_k) block instead of the whole matrix; cost: attention's forward
    runs twice. The result is that of attending all queries at once with the dropout mask drawn block by block.
    """
    outs = []
    for s in range(0, Q.size(-2), block):
        m, d = mask, dead
        if mask is not None and mask.dim() >= 2 and mask.size(-2) > 1:  # per-query rows: slice them
            m = mask[..., s : s + block, :]
            d = None if dead is None else dead[..., s : s + block, :]
        outs.append(checkpoint(attend, Q[..., s : s + block, :], m, d, use_reentrant=False))
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


PROJECTIONS = ("W_Q", "W_K", "W_V")  # the article's names for the three input projections, in in_proj_weight's order


class Projection(nn.Linear):
    """W_Q, W_K or W_V of a MultiHeadAttention: an nn.Linear (type, forward, repr) whose weight and bias are rows of
    its owner's parameters, not parameters of its own.

    weight: rows [i*n, (i+1)*n) of in_proj_weight (n = heads x head_dim), or q/k/v_proj_weight itself when kdim /
    vdim differ from embed_dim; bias: the same rows of in_proj_bias. Both are looked up on each access, so they
    follow the owner's parameters when those are replaced (a new nn.Parameter, load_state_dict(assign=True), .to()).
    An in-place write (nn.init.*_, copy_, mul_ under no_grad, reset_parameters()) lands in the owner's parameter.
    What a view cannot be is refused in one line: rebinding `W_Q.weight = ...`; and requires_grad_ on the view
    (PyTorch's own error: freeze in_proj_weight, one flag for the three, as in nn.MultiheadAttention). The owner
    is a plain reference, not a registered module: modules(), parameters() and state_dict() see each weight once,
    under PyTorch's name.
    """

    def __init__(self, owner: MultiHeadAttention, index: int):
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would register a weight and bias of its own
        object.__setattr__(self, "_owner", owner)  # not a submodule (no cycle): deepcopy and pickle follow it
        object.__setattr__(self, "index", index)

    @property
    def in_features(self) -> int:
        o = self._owner
        return (o.embed_dim, o.kdim, o.vdim)[self.index]

    @property
    def out_features(self) -> int:
        return self._owner.inner_dim

    def source(self, name: str) -> str:
        """Where `weight` or `bias` lives on the owner, as a phrase."""
        o, i, n = self._owner, self.index, self._owner.inner_dim
        if name == "weight" and o.in_proj_weight is None:
            return ("q_proj_weight", "k_proj_weight", "v_proj_weight")[i]
        return f"in_proj_{name}[{i * n}:{(i + 1) * n}]"

    @property
    def weight(self) -> Tensor:  # (n, in_features)
        o, i, n = self._owner, self.index, self._owner.inner_dim
        if o.in_proj_weight is None:
            return (o.q_proj_weight, o.k_proj_weight, o.v_proj_weight)[i]
        return o.in_proj_weight[i * n:(i + 1) * n]

    @property
    def bias(self) -> Tensor | None:  # (n,)
        b, i, n = self._owner.in_proj_bias, self.index, self._owner.inner_dim
        return None if b is None else b[i * n:(i + 1) * n]

    def __setattr__(self, name: str, value) -> None:
        if name in ("weight", "bias"):
            raise AttributeError(
                f"{PROJECTIONS[self.index]}.{name} is a view of {self.source(name)}: write into it in place "
                f"(nn.init.*_, .copy_(...), under torch.no_grad()), or assign {self.source(name).split('[')[0]} on "
                f"the attention module.")
        super().__setattr__(name, value)


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
    always batch-first: (B, H, L_q, L_k), or their mean over heads (B, L_q, L_k). is_causal=True is a hint about
    the attn_mask given, as in PyTorch: without an attn_mask it raises PyTorch's RuntimeError.
    Where ours differs: a query whose keys are all blocked gets output 0 and zero gradients (PyTorch: NaN).
    forward(x, attn_mask=None, need_weights=..., unpad=Unpadding(key_padding_mask)) is self-attention on packed
    tokens x (N, E) -> ((N, E), weights), as TransformerEncoder runs it (see unpad.Unpadding).

    Storage: nn.MultiheadAttention's parameters, under its names and in its order. `in_proj_weight` (3 x H x d, E)
    holds W_Q, W_K, W_V stacked (`q_proj_weight`, `k_proj_weight`, `v_proj_weight` instead when kdim / vdim differ
    from embed_dim), `in_proj_bias` (3 x H x d) their biases, `out_proj` is W_O, and `bias_k`, `bias_v`. The
    article's W_Q, W_K, W_V are nn.Linear modules whose weight and bias are row views of those (see Projection), and
    W_O is out_proj. Why this way round: code written around PyTorch's module writes through PyTorch's names
    (`nn.init.xavier_uniform_(attn.in_proj_weight)`, `in_proj_weight.requires_grad_(False)`, assigning a new
    nn.Parameter, `load_state_dict` of the original model's checkpoint), and each of those needs a leaf parameter
    under that name; rows of a parameter are a true view, so an in-place write through W_Q.weight lands in
    in_proj_weight too, whereas the other way round in_proj_weight would be a concatenation, a copy that writes
    vanish into. So a state dict has PyTorch's keys (checkpoints cross between a model and its swapped copy), the
    optimizer sees each weight once, and self-attention projects with one matmul on in_proj_weight, with no copy.
    State dicts with the article's keys (`W_Q.weight` ...; mhalab's checkpoints before this storage) load through
    upgrade_state_dict, applied by load_state_dict. nn.MultiheadAttention.__init__ is not run (ours builds the same
    parameters, then the article's views).
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
        nn.Module.__init__(self)  # nn.MultiheadAttention's parameters are built below, under its names
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
        # nn.MultiheadAttention's parameters, names and registration order (so state dicts match key for key)
        n = self.inner_dim
        if self.kdim == self.vdim == embed_dim:  # packed, as PyTorch's _qkv_same_embed_dim
            self.in_proj_weight = nn.Parameter(torch.empty(3 * n, embed_dim, **f))  # [W_Q; W_K; W_V]
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(name, None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(n, embed_dim, **f))
            self.k_proj_weight = nn.Parameter(torch.empty(n, self.kdim, **f))
            self.v_proj_weight = nn.Parameter(torch.empty(n, self.vdim, **f))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * n, **f))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.modules.linear.NonDynamicallyQuantizableLinear(n, embed_dim, bias=bias, **f)  # W_O
        # the article's W_Q, W_K, W_V: views of the rows above, not registered (each weight is registered once)
        for i, name in enumerate(PROJECTIONS):
            object.__setattr__(self, name, Projection(self, i))
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
        # nn.MultiheadAttention's init, draw for draw: xavier on the stacked (3E, E) in-projection (each of q, k, v
        # on its own when kdim / vdim differ), zero biases, xavier-normal bias_k / bias_v; out_proj keeps nn.Linear's
        # weight init. (With head_dim given, the stack is (3 x heads x head_dim, E).)
        if self.in_proj_weight is not None:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)
        for b in (self.bias_k, self.bias_v):
            if b is not None:
                nn.init.xavier_normal_(b)

    def __setattr__(self, name: str, value) -> None:
        if name in PROJECTIONS and name in self.__dict__:
            raise AttributeError(
                f"{name} is a view of {self.__dict__[name].source('weight')}: write into {name}.weight in place "
                f"(nn.init.*_, .copy_(...)), or assign that parameter on the attention module.")
        super().__setattr__("out_proj" if name == "W_O" else name, value)  # W_O is out_proj

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
        """PyTorch's meaning, kdim = vdim = embed_dim (in_proj_weight holds W_Q, W_K, W_V; q/k/v_proj_weight are
        None), and nothing PyTorch's attention cannot compute (a variant, another head width): PyTorch's fused paths
        (nn.TransformerEncoderLayer in inference) read it before they compute from in_proj_weight alone, so with a
        variant they decline and call forward. F.multi_head_attention_forward reads it to pick its weights."""
        return self.kdim == self.vdim == self.embed_dim and self.not_official() is None

    def extra_repr(self) -> str:
        views = "in_proj_weight rows" if self.in_proj_weight is not None else "q/k/v_proj_weight"
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"batch_first={self.batch_first}; W_Q, W_K, W_V: views of {views}; W_O: out_proj")

    @property
    def W_O(self) -> nn.Linear:
        """The article's output projection: out_proj, nn.MultiheadAttention's name for it."""
        return self.out_proj

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
        """Self-attention's three projections as one (E -> 3E) matmul on in_proj_weight: (..., E) -> (..., 3E) =
        [q | k | v]. The same numbers as W_Q, W_K, W_V applied one by one, in one kernel call and one pass over x."""
        if self.in_proj_weight is None:
            raise ValueError(f"self-attention on one input needs kdim = vdim = embed_dim; this module has kdim="
                             f"{self.kdim}, vdim={self.vdim}, embed_dim={self.embed_dim}: pass key and value.")
        w, b = self.in_proj_weight, self.in_proj_bias
        # a bias assigned in another dtype (PyTorch's module accepts one) is cast to the weight's
        return F.linear(x, w, b if b is None or b.dtype == w.dtype else b.to(w.dtype))

    def _project(self, Q: Tensor, K: Tensor, V: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if K is Q and V is Q and self.in_proj_weight is not None:
            return self._in_proj(Q).chunk(3, dim=-1)
        return self.W_Q(Q), self.W_K(K), self.W_V(V)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        upgrade_state_dict(state_dict, prefix)  # the article's keys (W_Q.weight ...) -> PyTorch's, in place
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

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
        if is_causal and attn_mask is None:
            raise RuntimeError("is_causal=True needs attn_mask: it is a hint about the mask given, as in "
                               "nn.MultiheadAttention; pass attn_mask=nn.Transformer.generate_square_subsequent_mask(L)"
                               " too, or leave is_causal out.")
        average = self.average_attn_weights if average_attn_weights is None else average_attn_weights
        if unpad is not None:  # packed self-attention, query: (N, E) real tokens (see _forward_packed)
            if key is not None or value is not None or key_padding_mask is not None:
                raise ValueError(
                    "with unpad=..., query holds the packed tokens of a self-attention: pass no key, value or "
                    "key_padding_mask (the mask is the one unpad was built from)."
                )
            out, weights = self._forward_packed(query, unpad, attn_mask, need_weights)
            return out, _average(weights, average)
        key = query if key is None else key
        value = key if value is None else value
        batched = self._check_dims(query, key, value, key_padding_mask, attn_mask)
        if query.is_nested:  # from nn.TransformerEncoder's inference path ("nested tensors")
            return self._forward_nested(query, key, value, attn_mask, need_weights, average)
        if not batched:  # unbatched (L, E): a batch of one
            query, key, value = _same_identity(lambda t: t.unsqueeze(0), query, key, value)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (L, B, E) -> (B, L, E), views; q, k, v keep their identity for _project
            query, key, value = _same_identity(lambda t: t.transpose(0, 1), query, key, value)
        self._check_inputs(query, key, value)

        q, k, v = self._project(query, key, value)  # (B, L_q, H*d), (B, L_k, H*d) x 2
        causal = is_causal and key_padding_mask is None and not need_weights  # PyTorch trusts the hint there
        out, weights = self._attend(q, k, v, key_padding_mask, attn_mask, need_weights, causal)  # (B, L_q, H*d)
        # W_O in the memory layout nn.MultiheadAttention computes in, sequence-first: (L_q, B, E) contiguous, seen
        # as (B, L_q, E) when batch_first. The numbers are the same either way; the layout makes a dropout after
        # this module (nn's layers' dropout1) draw the same mask for the same element as after PyTorch's.
        out, weights = self.W_O(out.transpose(0, 1)), _average(weights, average)  # (L_q, B, E)
        if not batched:
            return out.squeeze(1), None if weights is None else weights.squeeze(0)
        return (out.transpose(0, 1) if self.batch_first else out), weights

    def _check_dims(self, query: Tensor, key: Tensor, value: Tensor, kpm: Tensor | None,
                    attn_mask: Tensor | None) -> bool:
        """nn.MultiheadAttention's rules for the inputs' dimensions (F._mha_shape_check), in its words (code matches on
        them), then ours. Returns whether the inputs are batched."""
        kind, want = ("batched (3-D)", 3) if query.dim() == 3 else ("unbatched (2-D)", 2)
        def layouts() -> str:  # only on failure: a strided nested tensor has no .shape
            shapes = ", ".join(f"{n} {tuple(t.shape) if not t.is_nested else 'nested'}"
                               for n, t in (("query", query), ("key", key), ("value", value)))
            return (f"{shapes}: expected all batched (3-D, {'batch-first' if self.batch_first else 'sequence-first'})"
                    f" or all unbatched (L, features).")

        if query.dim() not in (2, 3):
            raise ShapeError(f"query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D query "
                             f"tensor; {layouts()}")
        if key.dim() != want or value.dim() != want:
            raise ShapeError(f"For {kind} `query`, expected `key` and `value` to be {want}-D but found {key.dim()}-D "
                             f"and {value.dim()}-D tensors respectively; {layouts()}")
        if kpm is not None and kpm.dim() != want - 1:
            raise ShapeError(f"For {kind} `query`, expected `key_padding_mask` to be `None` or {want - 1}-D but found "
                             f"{kpm.dim()}-D tensor instead: key_padding_mask has shape {tuple(kpm.shape)}; it is "
                             f"(batch, L_k), or (L_k,) for unbatched inputs, True at padded keys.")
        if attn_mask is not None and attn_mask.dim() not in ((2, 3, 4) if want == 3 else (2, 3)):
            raise ShapeError(f"For {kind} `query`, expected `attn_mask` to be `None`, 2-D or 3-D but found "
                             f"{attn_mask.dim()}-D tensor instead: attn_mask has shape {tuple(attn_mask.shape)}; it "
                             f"is (L_q, L_k) or (batch x heads, L_q, L_k) (ours also takes (batch, heads, L_q, L_k)).")
        if want == 2 and attn_mask is not None and attn_mask.dim() == 3:
            expected = (self.num_heads, query.size(0), key.size(0))
            if tuple(attn_mask.shape) != expected:
                raise ShapeError(f"Expected `attn_mask` shape to be {expected} but got {tuple(attn_mask.shape)}: "
                                 f"an unbatched query takes a 3-D mask per head, (heads, L_q, L_k).")
        return want == 3

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        """query (B, L_q, embed_dim), key (B, L_k, kdim), value (B, L_k, vdim), as laid out batch-first here."""
        layout = "batch, seq_len" if self.batch_first else "seq_len, batch"
        for name, t, width in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if t.dim() != 3 or t.size(-1) != width:
                dim = {"query": "embed_dim", "key": "kdim", "value": "vdim"}[name]
                raise ShapeError(f"{name} has shape {tuple(t.shape)}; expected ({layout}, {dim}={width}) "
                                 f"(batch_first={self.batch_first}) or unbatched (seq_len, {dim}).")
        if key.size(0) != query.size(0) or value.shape[:2] != key.shape[:2]:
            raise ShapeError(
                f"batch/length mismatch: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                f"{tuple(value.shape)} (as batch-first); key and value need the same (batch, L_k), and batch "
                f"must equal query's."
            )

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, attn_mask: Tensor | None,
        need_weights: bool, causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Projected q (B, L_q, H*d), k and v (B, L_k, H*d) -> heads -> attention -> merged (B, L_q, H*d)
        (H*d = E unless head_dim is given), and the weights (B, H, L_q, L_k') or None (L_k' counts the keys
        add_bias_kv and add_zero_attn append). causal=True: the causal mask in place of attn_mask, as
        nn.MultiheadAttention trusts is_causal where no key_padding_mask is given and no weights asked for (it
        hands SDPA is_causal=True and drops the mask)."""
        B, L_q, _ = q.shape
        if causal:
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
        self, x: Tensor, unpad: Unpadding, attn_mask: Tensor | None, need_weights: bool,
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

    def _forward_nested(self, query: Tensor, key: Tensor, value: Tensor, attn_mask, need_weights, average):
        """Attention on nested tensors (B sequences of their own lengths, batch-first), as nn.TransformerEncoder passes
        them in inference when PyTorch's fused layer declines (a variant of ours), or as a user does: each padded,
        the keys' pads blocked by a key-padding mask, attended, and the output nested again at the query's lengths,
        in the query's layout (strided or jagged)."""
        def padded(t: Tensor) -> tuple[Tensor, list[int]]:  # nested (B, j, E) -> (B, L, E) with zeros at the pads
            return t.to_padded_tensor(0.0), [s.size(0) for s in t.unbind()]

        x, q_lengths = padded(query)
        k_in, k_lengths = (x, q_lengths) if key is query else padded(key)
        v_in, v_lengths = (k_in, k_lengths) if value is key else padded(value)
        if k_lengths != v_lengths:
            raise ShapeError(f"key and value need the same lengths; got {k_lengths} and {v_lengths}.")
        pad = torch.arange(k_in.size(1), device=x.device) >= torch.tensor(k_lengths, device=x.device)[:, None]
        q, k, v = self._project(x, k_in, v_in)  # (B, L_q, H*d), (B, L_k, H*d) x 2
        out, weights = self._attend(q, k, v, pad, attn_mask, need_weights)
        out = self.W_O(out)  # (B, L_q, E)
        nested = torch.nested.as_nested_tensor([o[:n] for o, n in zip(out, q_lengths)], layout=query.layout)
        return nested, _average(weights, average)

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

    def to_official(self, share: bool = False) -> nn.MultiheadAttention:
        """nn.MultiheadAttention with these weights, configuration, train / eval mode and requires_grad. Refused, in
        one line, for what it cannot express (not_official). nn.MultiheadAttention has no default for
        average_attn_weights: it averages unless told not to, whatever this module's default. share=True: it holds
        this module's very parameters and out_proj, not copies (what torch.jit.script compiles, see script.py)."""
        why = self.not_official()
        if why is not None:
            raise ValueError(f"to_official: nn.MultiheadAttention cannot express {why}; keep ours, or build it "
                             f"with the default kernel, no rotary / position_bias and head_dim=None.")
        w = self.out_proj.weight
        mha = nn.MultiheadAttention(
            self.embed_dim, self.num_heads, dropout=self.dropout, bias=self.in_proj_bias is not None,
            add_bias_kv=self.bias_k is not None, add_zero_attn=self.add_zero_attn, kdim=self.kdim, vdim=self.vdim,
            batch_first=self.batch_first, device="meta" if share else w.device, dtype=w.dtype,
        )  # on "meta" when shared: no memory, no init, as every parameter is replaced below
        if not share:
            _copy_projections(mha, self)
            return mha.train(self.training)
        for name in OFFICIAL_PARAMETERS[:-2]:  # all but out_proj.*, where PyTorch's configuration has them
            if getattr(self, name) is not None:
                setattr(mha, name, getattr(self, name))
        mha.out_proj = self.out_proj
        return mha.train(self.training)

    def __prepare_scriptable__(self) -> nn.MultiheadAttention:
        """torch.jit.script compiles this: nn.MultiheadAttention holding these very parameters (script.py)."""
        why = self.not_official()
        if why is None and not self.average_attn_weights:
            why = ("per-head weights by default (average_attn_weights=False, the article's default; PyTorch's forward "
                   "averages unless told)")
        if why is not None:
            raise refuse("nn.MultiheadAttention", why, "build it with PyTorch's defaults (from_official, "
                         "average_attn_weights=True)")
        return self.to_official(share=True)


# nn.MultiheadAttention's parameters by name (None where a configuration has no such parameter); ours has the same
OFFICIAL_PARAMETERS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "bias_k",
                       "bias_v", "out_proj.weight", "out_proj.bias")


def _copy_projections(dst: nn.MultiheadAttention, src: nn.MultiheadAttention) -> None:
    """Copy every parameter, values and requires_grad, name for name: ours and PyTorch's have the same names and
    shapes. Works either way: ours <- PyTorch's, PyTorch's <- ours."""
    with torch.no_grad():
        for name in OFFICIAL_PARAMETERS:
            d, s = _parameter(dst, name), _parameter(src, name)
            if (d is None) != (s is None):
                raise ValueError(f"{name}: one module has it and the other does not (a bug in the conversion).")
            if d is not None:
                d.copy_(s)
                d.requires_grad_(s.requires_grad)


def _parameter(m: nn.Module, name: str) -> Tensor | None:
    """The parameter `name` (dotted) of m, or None where m's configuration has none."""
    owner, _, leaf = name.rpartition(".")
    return getattr(m.get_submodule(owner) if owner else m, leaf, None)


def upgrade_state_dict(state_dict: dict, prefix: str = "") -> dict:
    """The article's keys of one attention module (`{prefix}W_Q.weight`, ..., `{prefix}W_O.bias`: mhalab's state dicts
    before its parameters took PyTorch's names) -> nn.MultiheadAttention's (`in_proj_weight` = [W_Q; W_K; W_V], or
    q/k/v_proj_weight when their widths differ; `in_proj_bias`; `out_proj.*`), in place; returned. Anything else
    is left as it is. MultiHeadAttention.load_state_dict applies it; for PyTorch's module, use official_state_dict."""
    key = {f"W_{x}.{leaf}": f"{prefix}W_{x}.{leaf}" for x in "QKVO" for leaf in ("weight", "bias")}
    if all(key[f"W_{x}.weight"] in state_dict for x in "QKV"):
        ws = [state_dict.pop(key[f"W_{x}.weight"]) for x in "QKV"]
        if ws[0].shape == ws[1].shape == ws[2].shape:  # kdim = vdim = embed_dim: PyTorch packs them
            state_dict[f"{prefix}in_proj_weight"] = torch.cat(ws)
        else:
            for x, w in zip("qkv", ws):
                state_dict[f"{prefix}{x}_proj_weight"] = w
    if all(key[f"W_{x}.bias"] in state_dict for x in "QKV"):
        state_dict[f"{prefix}in_proj_bias"] = torch.cat([state_dict.pop(key[f"W_{x}.bias"]) for x in "QKV"])
    for leaf in ("weight", "bias"):
        if key[f"W_O.{leaf}"] in state_dict:
            state_dict[f"{prefix}out_proj.{leaf}"] = state_dict.pop(key[f"W_O.{leaf}"])
    return state_dict


def official_state_dict(state_dict: dict) -> dict:
    """A copy of a whole model's state dict with every attention module's article keys (`...W_Q.weight`) under
    nn.MultiheadAttention's names, for loading into a model that holds PyTorch's module:
    `model.load_state_dict(official_state_dict(torch.load(path)))`. Keys already in PyTorch's names pass unchanged."""
    out = dict(state_dict)
    for prefix in {k[: -len("W_Q.weight")] for k in state_dict if k.endswith("W_Q.weight")}:
        upgrade_state_dict(out, prefix)
    return out


def causal_mask(L_q: int, L_k: int, device=None) -> Tensor:
    """(L_q, L_k) bool, True above the diagonal: query i sees keys 0..i (nn.Transformer's square subsequent mask,
    top-left aligned when L_q != L_k, as F.scaled_dot_product_attention's is_causal)."""
    return torch.ones(L_q, L_k, dtype=torch.bool, device=device).triu(1)


def _same_identity(fn, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """fn applied to query, key and value, keeping `key is query` / `value is key` (self-attention's one projection)."""
    q = fn(query)
    k = q if key is query else fn(key)
    v = k if value is key else (q if value is query else fn(value))
    return q, k, v


def _average(weights: Tensor | None, average: bool) -> Tensor | None:
    """(B, H, L_q, L_k) -> their mean over heads (B, L_q, L_k) when asked, as nn.MultiheadAttention's default."""
    return weights.mean(dim=1) if weights is not None and average else weights
