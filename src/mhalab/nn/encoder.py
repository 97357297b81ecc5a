"""Transformer encoder layer and stack (article section 5), and PyTorch's behind the same interface.

The article's layer applied dropout twice to each sub-layer output (inside `ffn` and again on the
residual, and after W_O inside its MHA and again on the residual). Here each sub-layer output is
dropped once, exactly where nn.TransformerEncoderLayer drops it, so the two are numerically equal.
The layer takes nn.TransformerEncoderLayer's arguments with their names, defaults and meaning; the stack
nn.TransformerEncoder's (a layer copied num_layers times), or sizes by keyword (each layer drawn on its own).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mhalab.nn.attention import MultiHeadAttention, causal_mask, check_heads
from mhalab.nn.dropout import Dropout16, use_dropout16
from mhalab.nn.masks import to_additive
from mhalab.nn.script import refuse
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

    Two call forms, told apart by their names:

        TransformerEncoderLayer(64, 4, 128)                                  # PyTorch's: (L, B, E), relu
        TransformerEncoderLayer(embed_dim=64, num_heads=4, ff_dim=128)       # the article's: (B, L, E), GELU

    PyTorch's form takes nn.TransformerEncoderLayer's arguments, names, order and defaults (relu, sequence-first
    unless batch_first=True); the article's keywords keep the article's layer (batch-first, GELU, as its example
    feeds it (batch, seq_len, embed_dim)). batch_first= and activation= given explicitly win in either form.
    activation: a name or a unary callable; bias=False drops every Linear's and LayerNorm's bias. `self_attn`
    (keyword) puts a given attention in; the layer's batch_first must be the attention's.
    """

    def __init__(
        self,
        d_model: int | None = None,
        nhead: int | None = None,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] | None = None,  # None: relu (PyTorch's form), gelu (article's)
        layer_norm_eps: float = 1e-5,
        batch_first: bool | None = None,  # None: False (PyTorch's form), True (the article's)
        norm_first: bool = False,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        self_attn: MultiHeadAttention | None = None,
        embed_dim: int | None = None,
        num_heads: int | None = None,
        ff_dim: int | None = None,
    ):
        super().__init__()
        article = embed_dim is not None or num_heads is not None or ff_dim is not None
        if article and (d_model is not None or nhead is not None):
            raise TypeError("TransformerEncoderLayer: give PyTorch's names (d_model, nhead, dim_feedforward: "
                            "sequence-first, relu) or the article's (embed_dim=, num_heads=, ff_dim=: batch-first, "
                            "GELU), not both.")
        if article:
            d_model, nhead, dim_feedforward = embed_dim, num_heads, dim_feedforward if ff_dim is None else ff_dim
        if d_model is None or nhead is None:
            raise TypeError("TransformerEncoderLayer needs d_model and nhead (PyTorch's form), or embed_dim= and "
                            "num_heads= (the article's).")
        batch_first = article if batch_first is None else batch_first
        activation = ("gelu" if article else "relu") if activation is None else activation
        _check_flags(batch_first=batch_first, norm_first=norm_first, bias=bias)
        if isinstance(layer_norm_eps, bool) or not isinstance(layer_norm_eps, (int, float)) or layer_norm_eps <= 0:
            raise ValueError(f"layer_norm_eps={layer_norm_eps!r} must be a number > 0 (the 6th argument, as in "
                             f"nn.TransformerEncoderLayer; pass norm_first=... by keyword).")
        f = {"device": device, "dtype": dtype}
        if self_attn is None:
            self_attn = MultiHeadAttention(d_model, nhead, dropout, bias=bias, batch_first=batch_first, **f)
        elif self_attn.batch_first != batch_first:
            raise ValueError(f"self_attn.batch_first={self_attn.batch_first} but the layer's batch_first={batch_first} "
                             f"(nn.TransformerEncoderLayer's default is False): pass batch_first="
                             f"{self_attn.batch_first} to the layer, which hands its input to self_attn as it is.")
        self.self_attn = self_attn
        # ffn: Linear -> act -> Dropout -> Linear; its output is dropped once, by dropout2
        self.ffn = nn.Sequential(
            nn.Linear(d_model, dim_feedforward, bias=bias, **f), _activation(activation), nn.Dropout(dropout),
            nn.Linear(dim_feedforward, d_model, bias=bias, **f),
        )
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **f)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **f)
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
        position is computed, pads included (as PyTorch's layer does). is_causal is a hint about src_mask, as in
        PyTorch: is_causal=True without src_mask raises PyTorch's RuntimeError.

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
        PyTorch's bernoulli is faster than the generator Inductor writes into its kernels (results/bench/compile.md).
        Dynamo cannot trace Dropout16's in-place draw: the half's dropouts become PyTorch's again."""
        use_dropout16(self.ffn, back=True)
        if isinstance(self.dropout2, Dropout16):
            self.dropout2 = nn.Dropout(self.dropout2.p).train(self.dropout2.training)
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

    def to_official(self, share: bool = False) -> nn.TransformerEncoderLayer:
        """nn.TransformerEncoderLayer with these weights and configuration; refuses what its attention cannot
        express (MultiHeadAttention.to_official). share=True: it holds this layer's very submodules and
        parameters, not copies (what torch.jit.script compiles, see script.py)."""
        attn = self.self_attn.to_official(share)  # first: it refuses what PyTorch's layer cannot express
        lin1 = self.ffn[0]
        layer = nn.TransformerEncoderLayer(
            attn.embed_dim, attn.num_heads, lin1.out_features, dropout=self.dropout1.p, activation=self.activation,
            layer_norm_eps=self.norm1.eps, batch_first=self.batch_first, norm_first=self.norm_first,
            bias=lin1.bias is not None, device="meta" if share else lin1.weight.device, dtype=lin1.weight.dtype,
        )  # on "meta" when shared: every module with parameters is replaced below
        keep = (lambda m: m) if share else copy.deepcopy
        layer.self_attn = attn
        layer.linear1, layer.dropout, layer.linear2 = (keep(m) for m in (lin1, self.ffn[2], self.ffn[3]))
        for name in ("norm1", "norm2", "dropout1", "dropout2"):
            setattr(layer, name, keep(getattr(self, name)))
        return layer.train(self.training)

    def __prepare_scriptable__(self) -> nn.TransformerEncoderLayer:
        """torch.jit.script compiles this: nn.TransformerEncoderLayer holding these very modules (script.py)."""
        why = self.self_attn.not_official()
        if why is not None:
            raise refuse("nn.TransformerEncoderLayer", why, "build it without")
        return self.to_official(share=True)


class TransformerEncoder(nn.Module):
    """N encoder layers, with an optional final norm (use one with pre-norm layers). Two ways to build it:

        TransformerEncoder(layer, 6, norm=None, enable_nested_tensor=True, mask_check=True)   # PyTorch's
        TransformerEncoder(num_layers=6, embed_dim=256, num_heads=8, ff_dim=1024)             # by sizes

    PyTorch's form (nn.TransformerEncoder's arguments, order and meaning) deep-copies `layer` num_layers times, as
    PyTorch does: every layer starts with `layer`'s weights. The sizes form (keywords only; the article's defaults:
    gelu, batch-first, post-norm; final_norm=True adds a LayerNorm) draws each layer's weights on its own.

    Padding. src_key_padding_mask (B, L) bool, True at pads. Every real token's output is PyTorch's. At the pads,
    `unpad` decides:

    - None (the default): PyTorch's numbers at every position. Where nn.TransformerEncoder runs nested tensors
      (its conditions, `_as_nested`: inference without grad, bool mask, no src mask, right-padded rows, ...),
      ours skips the pads too ("unpadding", see unpad.Unpadding) and leaves 0 there before the final norm, as
      PyTorch does; everywhere else (training, ...) every position is computed, pads included.
    - True: skip the pads whenever the mask allows, in training too (a quarter less work in the position-wise
      layers when a quarter of the batch is padding, and with right-padded rows no quadratic attention work on
      them, nn.varlen); pads come out as 0, after the final norm. The framework's models run this way.
    - False: compute every position, always.

    forward's is_causal is a hint about `mask`, as in PyTorch: None compares the mask with the causal one, and the
    stack passes the hint to every layer (is_causal=True without a mask raises there, as PyTorch's does).
    """

    def __init__(
        self,
        encoder_layer: TransformerEncoderLayer | None = None,
        num_layers: int | None = None,
        norm: nn.Module | None = None,
        enable_nested_tensor: bool = True,
        mask_check: bool = True,
        *,
        embed_dim: int | None = None,
        num_heads: int | None = None,
        ff_dim: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = "gelu",
        norm_first: bool = False,
        final_norm: bool = False,
        unpad: bool | None = None,
    ):
        super().__init__()
        if isinstance(encoder_layer, int) and not isinstance(encoder_layer, bool):
            raise TypeError(f"TransformerEncoder({encoder_layer}, ...): the first argument is the layer to copy, as in "
                            f"nn.TransformerEncoder(encoder_layer, num_layers); for new layers pass sizes by keyword: "
                            f"TransformerEncoder(num_layers={encoder_layer}, embed_dim=..., num_heads=...).")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}.")
        sizes = embed_dim is not None or num_heads is not None
        if (encoder_layer is not None) == sizes or (sizes and (embed_dim is None or num_heads is None)):
            raise ValueError("TransformerEncoder needs a layer to copy (TransformerEncoder(layer, num_layers)) or "
                             "embed_dim= and num_heads= (a stack of new layers), one of the two.")
        if norm is not None and final_norm:
            raise ValueError("pass norm=<module> or final_norm=True (a LayerNorm), not both.")
        if unpad not in (None, True, False):
            raise ValueError(f"unpad={unpad!r}: None (PyTorch's numbers at the pads), True (always skip the pads) "
                             f"or False (always compute them).")
        if encoder_layer is not None:  # PyTorch's form: num_layers copies of the layer (_get_clones)
            self.layers = nn.ModuleList([copy.deepcopy(encoder_layer) for _ in range(num_layers)])
        else:  # the sizes form: copies, then fresh draws for layers 1+, so no two layers start identical
            proto = TransformerEncoderLayer(embed_dim, num_heads, ff_dim, dropout, activation, batch_first=True,
                                            norm_first=norm_first)
            self.layers = nn.ModuleList([copy.deepcopy(proto) for _ in range(num_layers)])
            for lyr in self.layers[1:]:
                reset_parameters(lyr)
        self.num_layers = num_layers
        width = self.layers[0].self_attn.embed_dim
        self.norm = norm if norm is not None else (nn.LayerNorm(width) if final_norm else None)
        self.unpad = unpad
        self.enable_nested_tensor, self.mask_check = enable_nested_tensor, mask_check
        # nn.TransformerEncoder's name and rule for whether it may run nested tensors, and its warning
        why = _why_not_nested(self.layers[0])
        self.use_nested_tensor = enable_nested_tensor and not why
        if enable_nested_tensor and why and unpad is None:
            warnings.warn(f"enable_nested_tensor is True, but self.use_nested_tensor is False because {why}",
                          stacklevel=2)

    def forward(self, src: Tensor, mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                is_causal: bool | None = None) -> Tensor:
        """src (B, L, E) -> (B, L, E) through every layer and the final norm (if any); (L, B, E) with
        sequence-first layers, unbatched (L, E) too. mask (L, L) and src_key_padding_mask (B, L) as in
        nn.TransformerEncoder; the padded positions' outputs as `unpad` says (see the class)."""
        # src: (B, L, E) -> (B, L, E); (L, B, E) with sequence-first layers; unbatched (L, E)
        seq_first = src.dim() == 3 and not self.layers[0].batch_first
        compiling = torch.compiler.is_compiling()
        if is_causal is None:  # PyTorch's: a mask equal to the causal one sets the hint (not in a graph: a sync)
            is_causal = not compiling and _is_causal_mask(mask, src.size(1 if src.dim() == 3 and not seq_first else 0))
        kpm = src_key_padding_mask
        skips = self._skips_pads(src, mask, kpm)
        if skips and not compiling:
            # Unpad once for the whole stack (see unpad.Unpadding): (B, L, E) -> (N, E) real tokens; norms,
            # residuals and feed-forwards skip the pads and only attention sees the (B, L) layout. The
            # real tokens' outputs equal the padded computation's; padded positions come out as 0.
            unpad = Unpadding(kpm)
            if 0 < unpad.num_tokens < kpm.numel():  # else nothing to skip (or nothing real)
                x = unpad.pack(src.transpose(0, 1) if seq_first else src)  # (B, L, E) -> (N, E)
                if self.unpad:  # opted in: the final norm on the real tokens too
                    x = unpad.unpack(self.forward_packed(x, unpad, mask, is_causal))
                else:  # PyTorch's nested tensors: 0 at the pads, then the final norm at every position
                    x = self._norm(unpad.unpack(self._layers(x, mask, None, is_causal, unpad)))
                return x.transpose(0, 1) if seq_first else x  # (B, L, E), or (L, B, E)
        x = self._layers(src, mask, kpm, is_causal)  # every layer on the padded layout
        if skips and compiling:
            # a compiled graph has static shapes, so no unpadding (N would be data-dependent): every position is
            # computed, then the pads are zeroed as the unpadded path leaves them (unless every position is a pad)
            pads = (kpm.t() if seq_first else kpm).unsqueeze(-1)

            def zero(t: Tensor) -> Tensor:
                return torch.where(kpm.all(), t, t.masked_fill(pads, 0.0))

            return zero(self._norm(x)) if self.unpad else self._norm(zero(x))  # pads 0 after / before the norm
        return self._norm(x)

    def _layers(self, x: Tensor, mask: Tensor | None, kpm: Tensor | None, is_causal: bool,
                unpad: Unpadding | None = None) -> Tensor:
        """Every layer in turn, called as nn.TransformerEncoder calls its layers; packed tokens with unpad."""
        for layer in self.layers:
            if unpad is None:
                x = layer(x, src_mask=mask, is_causal=is_causal, src_key_padding_mask=kpm)
            else:
                x = layer(x, src_mask=mask, is_causal=is_causal, unpad=unpad)
        return x

    def _norm(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.norm is not None else x

    def forward_packed(self, x: Tensor, unpad: Unpadding, mask: Tensor | None = None,
                       is_causal: bool = False) -> Tensor:
        """The stack on packed tokens x (N, E) -> (N, E): the real tokens of unpad's padded layout (for packed
        sequences, Unpadding.from_seqlens), final norm included. forward() lands here after unpadding a padded
        batch with unpad=True."""
        if not all(isinstance(lyr, TransformerEncoderLayer) for lyr in self.layers):
            raise ValueError("forward_packed needs TransformerEncoderLayer layers (they run on packed tokens).")
        return self._norm(self._layers(x, mask, None, is_causal, unpad))

    def _skips_pads(self, src: Tensor, mask: Tensor | None, kpm: Tensor | None) -> bool:
        """Whether this call skips the pads (see the class): a bool (B, L) mask, src (B, L, E) and layers that run on
        packed tokens; and unpad=True, or unpad=None where nn.TransformerEncoder would run nested tensors. Else the
        padded path runs (it is also the one that reports malformed inputs)."""
        if self.unpad is False or kpm is None or kpm.dtype != torch.bool or src.dim() != 3:
            return False
        batch_length = tuple(src.shape[:2]) if self.layers[0].batch_first else (src.size(1), src.size(0))
        if tuple(kpm.shape) != batch_length or not all(isinstance(lyr, TransformerEncoderLayer) for lyr in self.layers):
            return False
        return bool(self.unpad) or self._as_nested(src, mask, kpm)

    def _as_nested(self, src: Tensor, mask: Tensor | None, kpm: Tensor) -> bool:
        """Whether nn.TransformerEncoder.forward would run this call on nested tensors (its "sparsity fast path"),
        its conditions in its order; then its outputs at the pads are 0 before the final norm."""
        first = self.layers[0]
        if not (torch.backends.mha.get_fastpath_enabled() and self.use_nested_tensor and not first.training):
            return False
        if self.mask_check and (torch.compiler.is_compiling() or not _right_padded(kpm)):
            return False
        if mask is not None or torch.is_autocast_enabled():
            return False
        tensors = (src, *first.parameters())
        if torch.overrides.has_torch_function(tensors) or src.device.type not in ("cpu", "cuda", "xpu"):
            return False
        return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))

    def __prepare_scriptable__(self) -> nn.TransformerEncoder:
        """torch.jit.script compiles this: nn.TransformerEncoder holding these very layers and norm (script.py)."""
        for lyr in self.layers:
            why = lyr.self_attn.not_official() if isinstance(lyr, TransformerEncoderLayer) else "a layer not ours"
            if why is not None:
                raise refuse("nn.TransformerEncoder", why, "build it without")
        if self.unpad:
            raise refuse("nn.TransformerEncoder", "unpad=True (0 at the pads in training)", "build it with "
                         "unpad=None (PyTorch's numbers at the pads)")
        return self.to_official(share=True)

    @classmethod
    def from_official(cls, enc: nn.TransformerEncoder, explicit: bool = False,
                      unpad: bool | None = None) -> TransformerEncoder:
        """Ours with `enc`'s layers, weights, norm and settings; explicit=True: every layer's attention takes the
        weights path. unpad as in the constructor (None: PyTorch's numbers at every position)."""
        layers = [TransformerEncoderLayer.from_official(lyr, explicit) for lyr in enc.layers]
        ours = cls(layers[0], 1, norm=copy.deepcopy(enc.norm), enable_nested_tensor=False,  # copies: eps, dtype
                   mask_check=getattr(enc, "mask_check", True), unpad=unpad)
        ours.layers, ours.num_layers = nn.ModuleList(layers), len(layers)
        ours.enable_nested_tensor = getattr(enc, "enable_nested_tensor", True)
        ours.use_nested_tensor = getattr(enc, "use_nested_tensor", ours.enable_nested_tensor)
        return ours.train(enc.training)

    def to_official(self, share: bool = False) -> nn.TransformerEncoder:
        """nn.TransformerEncoder with these layers' weights, norm and settings (each layer through
        TransformerEncoderLayer.to_official, which refuses what PyTorch cannot express). share=True: it holds
        these very layers' modules and this norm, not copies. With unpad=False it runs no nested tensors, as ours
        computes every position."""
        layers = [lyr.to_official(share) for lyr in self.layers]
        norm = self.norm if share else copy.deepcopy(self.norm)
        enc = nn.TransformerEncoder(layers[0], 1, norm=norm, enable_nested_tensor=False, mask_check=self.mask_check)
        enc.layers, enc.num_layers = nn.ModuleList(layers), len(layers)
        enc.enable_nested_tensor = self.enable_nested_tensor
        enc.use_nested_tensor = self.use_nested_tensor and self.unpad is not False
        return enc.train(self.training)


def _why_not_nested(layer: nn.Module) -> str:
    """nn.TransformerEncoder's reason, in its words, why a stack of `layer` never runs nested tensors ('' if none)."""
    name = "encoder_layer"
    if not isinstance(layer, TransformerEncoderLayer):
        return f"{name} was not TransformerEncoderLayer"
    attn = layer.self_attn
    if layer.norm_first:
        return f"{name}.norm_first was True"
    if not attn.batch_first:
        return f"{name}.self_attn.batch_first was not True(use batch_first for better inference performance)"
    if not attn._qkv_same_embed_dim:
        return f"{name}.self_attn._qkv_same_embed_dim was not True"
    if attn.in_proj_bias is None:
        return f"{name}.self_attn was passed bias=False"
    if layer.activation not in ("relu", "gelu"):
        return f"{name}.activation_relu_or_gelu was not True"
    if layer.norm1.eps != layer.norm2.eps:
        return f"{name}.norm1.eps was not equal to {name}.norm2.eps"
    if attn.num_heads % 2 == 1:
        return f"{name}.self_attn.num_heads is odd"
    return ""


def _right_padded(kpm: Tensor) -> bool:
    """Every row's real tokens come first (nn.TransformerEncoder's mask_check: 'left aligned'). A host sync."""
    return not bool((kpm[:, :-1] & ~kpm[:, 1:]).any())


def _is_causal_mask(mask: Tensor | None, L: int) -> bool:
    """Whether `mask` is the (L, L) causal mask, bool or float (-inf above the diagonal), as PyTorch detects it."""
    if mask is None or tuple(mask.shape) != (L, L):
        return False
    causal = causal_mask(L, L, mask.device)
    causal = causal if mask.dtype == torch.bool else to_additive(causal, "mask", mask.dtype)
    return bool((mask == causal).all())


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
