"""Transformer encoder layer and stack (article section 5), and PyTorch's behind the same interface.

The article's layer applied dropout twice to each sub-layer output (inside `ffn` and again on the
residual, and after W_O inside its MHA and again on the residual). Here each sub-layer output is
dropped once, exactly where nn.TransformerEncoderLayer drops it, so the two are numerically equal.
The layer and the stack take nn.TransformerEncoderLayer's / nn.TransformerEncoder's arguments with their meaning;
the defaults that differ are the article's: activation gelu, batch_first=True.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mhalab.nn.attention import MultiHeadAttention, causal_mask, check_heads
from mhalab.nn.unpad import Unpadding

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}
_INPLACE = {nn.ReLU: torch.relu_, nn.GELU: torch.ops.aten.gelu_}  # for TransformerEncoderLayer._ff
_NAMED = {F.relu: "relu", F.gelu: "gelu"}  # the functions nn.TransformerEncoderLayer stores for the names


class Activation(nn.Module):
    """A unary callable (F.silu, torch.tanh, a lambda) as the feed-forward's activation module."""

    def __init__(self, fn: Callable[[Tensor], Tensor]):
        super().__init__()
        self.fn = fn

    def forward(self, x: Tensor) -> Tensor:
        """The activation, elementwise."""
        return self.fn(x)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))


def _activation(act: str | Callable[[Tensor], Tensor]) -> nn.Module:
    """A name (relu, gelu), an nn.Module or a unary callable, as nn.TransformerEncoderLayer takes it -> a module."""
    act = _NAMED.get(act, act) if not isinstance(act, str) else act
    if isinstance(act, str):
        if act not in ACTIVATIONS:
            raise ValueError(f"activation '{act}' is not supported; choose one of {sorted(ACTIVATIONS)}.")
        return ACTIVATIONS[act]()
    if isinstance(act, nn.Module):
        return act
    if callable(act):
        return Activation(act)
    raise ValueError(f"activation={act!r} must be 'relu', 'gelu' or a unary callable.")


def reset_parameters(module: nn.Module) -> None:
    """Redraw every parameter and random buffer of `module` as its constructors drew them.

    Descendants before ancestors, as in construction: a parent's init overwrites its children's
    defaults (MultiHeadAttention zeroes its out_proj's bias over nn.Linear's init,
    T5RelativeBias puts N(0, 0.02) over its nn.Embedding's N(0, 1)), so it must run after theirs.
    modules() is parent-first, hence reversed. MultiHeadAttention's method is `_reset_parameters`,
    named as in nn.MultiheadAttention.
    """
    for m in reversed(list(module.modules())):
        reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
        if callable(reset):
            reset()


def _check_flags(**flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r} must be True or False (nn.TransformerEncoderLayer's order: d_model, "
                             f"nhead, dim_feedforward, dropout, activation, layer_norm_eps, batch_first, norm_first, "
                             f"bias).")


class TransformerEncoderLayer(nn.Module):
    """Post-norm (the article, and Vaswani et al.) or pre-norm (`norm_first=True`) encoder layer.

    post-norm: x = norm1(x + drop(attn(x)));  x = norm2(x + drop(ffn(x)))
    pre-norm:  x = x + drop(attn(norm1(x)));  x = x + drop(ffn(norm2(x)))

    Arguments in nn.TransformerEncoderLayer's order and meaning (embed_dim, num_heads, ff_dim are its d_model,
    nhead, dim_feedforward): activation a name or a unary callable, bias=False drops every Linear's and
    LayerNorm's bias, batch_first=False takes (L, B, E). `self_attn` (keyword) puts a given attention in.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        ff_dim: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = "gelu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = True,
        norm_first: bool = False,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        self_attn: MultiHeadAttention | None = None,
    ):
        super().__init__()
        _check_flags(batch_first=batch_first, norm_first=norm_first, bias=bias)
        if isinstance(layer_norm_eps, bool) or not isinstance(layer_norm_eps, (int, float)) or layer_norm_eps <= 0:
            raise ValueError(f"layer_norm_eps={layer_norm_eps!r} must be a number > 0 (the 6th argument, as in "
                             f"nn.TransformerEncoderLayer; pass norm_first=... by keyword).")
        f = {"device": device, "dtype": dtype}
        if self_attn is None:
            self_attn = MultiHeadAttention(embed_dim, num_heads, dropout, bias=bias, batch_first=batch_first, **f)
        elif self_attn.batch_first != batch_first:
            raise ValueError(f"self_attn.batch_first={self_attn.batch_first} but batch_first={batch_first}: the "
                             f"layer passes its input to self_attn as it comes; build them with the same layout.")
        self.self_attn = self_attn
        # ffn: Linear -> act -> Dropout -> Linear; its output is dropped once, by dropout2
        self.ffn = nn.Sequential(
            nn.Linear(embed_dim, ff_dim, bias=bias, **f), _activation(activation), nn.Dropout(dropout),
            nn.Linear(ff_dim, embed_dim, bias=bias, **f),
        )
        self.norm1 = nn.LayerNorm(embed_dim, eps=layer_norm_eps, bias=bias, **f)
        self.norm2 = nn.LayerNorm(embed_dim, eps=layer_norm_eps, bias=bias, **f)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.norm_first = norm_first

    @property
    def batch_first(self) -> bool:
        """The input layout, (B, L, E) or (L, B, E): self_attn's (the position-wise parts have none)."""
        return self.self_attn.batch_first

    @property
    def activation(self) -> str | Callable[[Tensor], Tensor]:
        """'relu' / 'gelu', or the callable or module given (what to_official passes to PyTorch's layer)."""
        act = self.ffn[1]
        if type(act) is nn.ReLU or (type(act) is nn.GELU and act.approximate == "none"):
            return "relu" if type(act) is nn.ReLU else "gelu"
        return act.fn if isinstance(act, Activation) else act

    def _sa(self, x: Tensor, mask: Tensor | None, kpm: Tensor | None, is_causal: bool) -> Tensor:
        out, _ = self.self_attn(x, x, x, key_padding_mask=kpm, attn_mask=mask, need_weights=False,
                                is_causal=is_causal)
        return self.dropout1(out)

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        *,
        unpad: Unpadding | None = None,
    ) -> Tensor:
        """src (B, L, E) (or (L, B, E) with batch_first=False, or unbatched (L, E)) -> the same shape: every
        position is computed, pads included (as PyTorch's layer does). is_causal=True without src_mask applies
        the causal mask.

        With unpad=Unpadding(key_padding_mask), src is packed: (N, E), the real tokens of a padded batch
        (see unpad.Unpadding), and so is the result. Norms, residuals and the feed-forward then run on
        the N real tokens only; attention goes back to the (B, L) layout inside self_attn. The result
        is the padded computation's at the real tokens. TransformerEncoder runs its layers this way.
        """
        if unpad is None:
            return self._block(src, lambda h: self._sa(h, src_mask, src_key_padding_mask, is_causal))
        if src_key_padding_mask is not None:
            raise ValueError("with unpad=..., pass no src_key_padding_mask (it is the one unpad was built from).")

        def sa(h: Tensor) -> Tensor:
            out, _ = self.self_attn(h, attn_mask=src_mask, need_weights=False, is_causal=is_causal, unpad=unpad)
            return self.dropout1(out)

        return self._block(src, sa)

    def _block(self, x: Tensor, sa) -> Tensor:
        """Residuals, norms and feed-forward around `sa` (self-attention + dropout1). All of it but `sa` is
        position-wise, so x may be padded (B, L, E) or packed (N, E)."""
        return self._after_attention(x, sa(self.norm1(x) if self.norm_first else x))

    def _after_attention(self, x: Tensor, attended: Tensor) -> Tensor:
        """Everything after self-attention, all position-wise: the residual (and norm1, post-norm), the
        feed-forward, dropout2 and its residual (and norm2). `attended` is sa's output."""
        if self.norm_first:
            x = x + attended
            return x + self.dropout2(self._ff(self.norm2(x)))
        x = self.norm1(x + attended)
        return self.norm2(x + self.dropout2(self._ff(x)))

    def compile_positionwise(self) -> None:
        """torch.compile the position-wise half (`_after_attention`): one graph for any number of tokens (dynamic
        shapes), padded or packed. Attention stays eager: its calls are planned per batch from the lengths, which
        a graph would have to guard on (whole-model compile recompiled every few batches and then failed).
        Parameters and state_dict keys are unchanged.

        Dropout draws from PyTorch's generator, as it does uncompiled (Inductor's fallback_random): the same seed
        gives the same masks, so a compiled run's numbers are the eager run's (tests/test_compile.py), and on CPU
        PyTorch's bernoulli is faster than the generator Inductor writes into its kernels (results/bench/compile.md)."""
        self._after_attention = torch.compile(self._after_attention, dynamic=True, options={"fallback_random": True})

    def _ff(self, x: Tensor) -> Tensor:
        """self.ffn(x): Linear -> activation -> Dropout -> Linear. Without autograd (eval, inference) the
        activation runs in place on the first Linear's fresh output, as PyTorch's fused inference path
        does: one (tokens, ff_dim) tensor fewer to allocate and write. Same numbers either way."""
        lin1, act, drop, lin2 = self.ffn
        inplace = None if torch.is_grad_enabled() else _INPLACE.get(type(act))
        if inplace is None or getattr(act, "approximate", "none") != "none" or x.is_nested:
            return self.ffn(x)
        return lin2(drop(inplace(lin1(x))))

    # ---- converters to and from nn.TransformerEncoderLayer ----
    @classmethod
    def from_official(cls, layer: nn.TransformerEncoderLayer, explicit: bool = False) -> TransformerEncoderLayer:
        """Ours with `layer`'s weights and configuration (any activation, bias, batch_first, norm_first, each
        dropout and eps, dtype, device, train / eval); explicit=True: its attention takes the weights path."""
        attn = layer.self_attn
        ours = cls(attn.embed_dim, attn.num_heads, layer.linear1.out_features, activation=layer.activation,
                   batch_first=attn.batch_first, norm_first=layer.norm_first,
                   self_attn=MultiHeadAttention.from_official(attn, explicit=explicit))
        ours.ffn[0], ours.ffn[2], ours.ffn[3] = (copy.deepcopy(m) for m in (layer.linear1, layer.dropout, layer.linear2))
        for name in ("norm1", "norm2", "dropout1", "dropout2"):  # copies keep eps, bias, dtype and device
            setattr(ours, name, copy.deepcopy(getattr(layer, name)))
        return ours.train(layer.training)

    def to_official(self) -> nn.TransformerEncoderLayer:
        """nn.TransformerEncoderLayer with these weights and configuration; refuses what its attention cannot
        express (MultiHeadAttention.to_official)."""
        attn = self.self_attn.to_official()  # first: it refuses what PyTorch's layer cannot express
        lin1 = self.ffn[0]
        layer = nn.TransformerEncoderLayer(
            attn.embed_dim, attn.num_heads, lin1.out_features, dropout=self.dropout1.p, activation=self.activation,
            layer_norm_eps=self.norm1.eps, batch_first=self.batch_first, norm_first=self.norm_first,
            bias=lin1.bias is not None, device=lin1.weight.device, dtype=lin1.weight.dtype,
        )
        layer.self_attn = attn
        layer.linear1, layer.dropout, layer.linear2 = (copy.deepcopy(m) for m in (lin1, self.ffn[2], self.ffn[3]))
        for name in ("norm1", "norm2", "dropout1", "dropout2"):
            setattr(layer, name, copy.deepcopy(getattr(self, name)))
        return layer.train(self.training)


class TransformerEncoder(nn.Module):
    """N encoder layers, with an optional final LayerNorm (use it with pre-norm layers).

    Given a bool src_key_padding_mask, the stack runs on the real tokens only ("unpadding", see
    unpad.Unpadding): same outputs at real tokens, 0 at padded positions (nn.TransformerEncoder's
    nested-tensor path in eval zeroes them too, before its final norm), and a quarter less work in
    the position-wise layers when a quarter of the batch is padding. When the rows are right-padded (as
    the collate pads them), attention runs on the real tokens too, each sequence on its own (nn.varlen),
    so padding costs no quadratic work either.
    `unpad=False` computes every position, pads included, as nn.TransformerEncoder does in training.
    nn.TransformerEncoder's arguments, as keywords: `norm` (a final norm module; final_norm=True builds a
    LayerNorm), `enable_nested_tensor` and `mask_check` (accepted and carried by the converters: ours unpads
    in training and inference, whatever side the padding is on); forward's `is_causal`.
    With `layer` given, embed_dim, num_heads and ff_dim may be left out (they are the layer's).
    """

    def __init__(
        self,
        num_layers: int,
        embed_dim: int | None = None,
        num_heads: int | None = None,
        ff_dim: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = "gelu",
        norm_first: bool = False,
        final_norm: bool = False,
        layer: TransformerEncoderLayer | None = None,
        unpad: bool = True,
        *,
        norm: nn.Module | None = None,
        enable_nested_tensor: bool = True,
        mask_check: bool = True,
    ):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}.")
        if layer is None and (embed_dim is None or num_heads is None):
            raise ValueError("TransformerEncoder needs embed_dim and num_heads, or a layer to copy.")
        if norm is not None and final_norm:
            raise ValueError("pass norm=<module> or final_norm=True (a LayerNorm), not both.")
        proto = layer or TransformerEncoderLayer(embed_dim, num_heads, ff_dim, dropout, activation,
                                                 norm_first=norm_first)
        # deep copies, then fresh draws for layers 1+ so no two layers start identical
        self.layers = nn.ModuleList([copy.deepcopy(proto) for _ in range(num_layers)])
        for lyr in self.layers[1:]:
            reset_parameters(lyr)
        width = proto.self_attn.embed_dim
        self.norm = norm if norm is not None else (nn.LayerNorm(width) if final_norm else None)
        # skip padded positions in the position-wise layers (forward); False computes every position
        self.unpad = unpad
        self.enable_nested_tensor, self.mask_check = enable_nested_tensor, mask_check

    def forward(self, src: Tensor, mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                is_causal: bool | None = None) -> Tensor:
        """src (B, L, E) -> (B, L, E) through every layer and the final norm (if any); (L, B, E) with
        sequence-first layers, unbatched (L, E) too. mask (L, L) and src_key_padding_mask (B, L) as in
        nn.TransformerEncoder. Given a bool src_key_padding_mask, the stack runs on the real tokens only: their
        outputs equal the padded computation's, padded positions come out as 0 (unpad=False: every position)."""
        # src: (B, L, E) -> (B, L, E); (L, B, E) with sequence-first layers; unbatched (L, E)
        seq_first = src.dim() == 3 and not self.layers[0].batch_first
        if is_causal and mask is None:
            L = src.size(1) if src.dim() == 3 and not seq_first else src.size(0)
            mask = causal_mask(L, L, src.device)
        bf = src.transpose(0, 1) if seq_first else src  # (B, L, E): the layout unpadding reads
        unpads = self._unpads(bf, src_key_padding_mask)
        compiling = torch.compiler.is_compiling()
        if unpads and not compiling:
            # Unpad once for the whole stack (see unpad.Unpadding): (B, L, E) -> (N, E) real tokens; norms,
            # residuals and feed-forwards skip the pads and only attention sees the (B, L) layout. The
            # real tokens' outputs equal the padded computation's; padded positions come out as 0.
            unpad = Unpadding(src_key_padding_mask)
            if 0 < unpad.num_tokens < src_key_padding_mask.numel():  # else nothing to skip (or nothing real)
                x = unpad.unpack(self.forward_packed(unpad.pack(bf), unpad, mask))  # (N, E) -> (B, L, E)
                return x.transpose(0, 1) if seq_first else x
        x = src  # every layer on the padded layout
        for layer in self.layers:
            x = layer(x, src_mask=mask, src_key_padding_mask=src_key_padding_mask)
        x = self.norm(x) if self.norm is not None else x
        if unpads and compiling:
            # a compiled graph has static shapes, so no unpadding (N would be data-dependent): every position is
            # computed, then the pads are zeroed as the unpadded path leaves them (unless every position is a pad)
            pads = (src_key_padding_mask.t() if seq_first else src_key_padding_mask).unsqueeze(-1)
            x = torch.where(src_key_padding_mask.all(), x, x.masked_fill(pads, 0.0))
        return x

    def forward_packed(self, x: Tensor, unpad: Unpadding, mask: Tensor | None = None) -> Tensor:
        """The stack on packed tokens x (N, E) -> (N, E): the real tokens of unpad's padded layout (for packed
        sequences, Unpadding.from_seqlens). forward() lands here after unpadding a padded batch."""
        if not all(isinstance(lyr, TransformerEncoderLayer) for lyr in self.layers):
            raise ValueError("forward_packed needs TransformerEncoderLayer layers (they run on packed tokens).")
        for layer in self.layers:
            x = layer(x, src_mask=mask, unpad=unpad)
        return self.norm(x) if self.norm is not None else x

    def _unpads(self, src: Tensor, kpm: Tensor | None) -> bool:
        """Whether the stack skips padded positions: unpad=True, a bool (B, L) mask and src (B, L, E), and layers that
        run on packed tokens. Else the padded path runs (it is also the one that reports malformed inputs)."""
        return (self.unpad and kpm is not None and kpm.dtype == torch.bool and src.dim() == 3
                and tuple(kpm.shape) == tuple(src.shape[:2])
                and all(isinstance(lyr, TransformerEncoderLayer) for lyr in self.layers))

    @classmethod
    def from_official(cls, enc: nn.TransformerEncoder, explicit: bool = False) -> TransformerEncoder:
        """Ours with `enc`'s layers, weights and norm; explicit=True: every layer's attention takes the weights
        path."""
        layers = [TransformerEncoderLayer.from_official(lyr, explicit) for lyr in enc.layers]
        ours = cls(len(layers), layer=layers[0], norm=copy.deepcopy(enc.norm),  # keeps its eps, dtype, device
                   enable_nested_tensor=getattr(enc, "enable_nested_tensor", True),
                   mask_check=getattr(enc, "mask_check", True))
        ours.layers = nn.ModuleList(layers)
        return ours.train(enc.training)

    def to_official(self) -> nn.TransformerEncoder:
        """nn.TransformerEncoder with these layers' weights, norm and settings (each layer through
        TransformerEncoderLayer.to_official, which refuses what PyTorch cannot express)."""
        layers = [lyr.to_official() for lyr in self.layers]
        enc = nn.TransformerEncoder(layers[0], len(layers), norm=copy.deepcopy(self.norm),
                                    enable_nested_tensor=self.enable_nested_tensor, mask_check=self.mask_check)
        enc.layers = nn.ModuleList(layers)
        return enc.train(self.training)


class OfficialEncoder(nn.Module):
    """nn.TransformerEncoder behind TransformerEncoder's constructor and forward, so configs swap them."""

    def __init__(
        self,
        num_layers: int,
        embed_dim: int,
        num_heads: int,
        ff_dim: int,
        dropout: float = 0.1,
        activation: str = "gelu",
        norm_first: bool = False,
        final_norm: bool = False,
    ):
        super().__init__()
        check_heads(embed_dim, num_heads)
        _activation(activation)  # same check and message as ours
        layer = nn.TransformerEncoderLayer(
            embed_dim, num_heads, ff_dim, dropout, activation=activation, batch_first=True, norm_first=norm_first
        )
        # nested tensors ("unpadding") only apply to post-norm in eval; keep PyTorch's default there
        self.encoder = nn.TransformerEncoder(
            layer, num_layers, norm=nn.LayerNorm(embed_dim) if final_norm else None,
            enable_nested_tensor=not norm_first,
        )

    def forward(self, src: Tensor, mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None) -> Tensor:
        """nn.TransformerEncoder's forward, as PyTorch computes it: (B, L, E) -> (B, L, E)."""
        return self.encoder(src, mask=mask, src_key_padding_mask=src_key_padding_mask)

    @classmethod
    def wrap(cls, encoder: nn.TransformerEncoder) -> OfficialEncoder:
        """Wrap an existing (batch-first) nn.TransformerEncoder, e.g. from TransformerEncoder.to_official()."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.encoder = encoder
        return self
