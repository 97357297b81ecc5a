"""Transformer encoder layer and stack (article section 5), and PyTorch's behind the same interface.

The article's layer applied dropout twice to each sub-layer output (inside `ffn` and again on the
residual, and after W_O inside its MHA and again on the residual). Here each sub-layer output is
dropped once, exactly where nn.TransformerEncoderLayer drops it, so the two are numerically equal.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mhalab.nn.attention import MultiHeadAttention, check_heads
from mhalab.nn.unpad import Unpadding

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}
_INPLACE = {nn.ReLU: torch.relu_, nn.GELU: torch.ops.aten.gelu_}  # for TransformerEncoderLayer._ff


def _activation(name: str) -> nn.Module:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation '{name}' is not supported; choose one of {sorted(ACTIVATIONS)}.")
    return ACTIVATIONS[name]()


def reset_parameters(module: nn.Module) -> None:
    """Redraw every parameter and random buffer of `module` as its constructors drew them.

    Descendants before ancestors, as in construction: a parent's init overwrites its children's
    defaults (MultiHeadAttention puts xavier on W_Q/W_K/W_V and zero biases over nn.Linear's init,
    T5RelativeBias puts N(0, 0.02) over its nn.Embedding's N(0, 1)), so it must run after theirs.
    modules() is parent-first, hence reversed. MultiHeadAttention's method is `_reset_parameters`,
    named as in nn.MultiheadAttention.
    """
    for m in reversed(list(module.modules())):
        reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
        if callable(reset):
            reset()


class TransformerEncoderLayer(nn.Module):
    """Post-norm (the article, and Vaswani et al.) or pre-norm (`norm_first=True`) encoder layer.

    post-norm: x = norm1(x + drop(attn(x)));  x = norm2(x + drop(ffn(x)))
    pre-norm:  x = x + drop(attn(norm1(x)));  x = x + drop(ffn(norm2(x)))
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        ff_dim: int,
        dropout: float = 0.1,
        activation: str = "gelu",
        norm_first: bool = False,
        layer_norm_eps: float = 1e-5,
        self_attn: MultiHeadAttention | None = None,
    ):
        super().__init__()
        self.self_attn = self_attn if self_attn is not None else MultiHeadAttention(embed_dim, num_heads, dropout)
        # ffn: Linear -> act -> Dropout -> Linear; its output is dropped once, by dropout2
        self.ffn = nn.Sequential(
            nn.Linear(embed_dim, ff_dim), _activation(activation), nn.Dropout(dropout), nn.Linear(ff_dim, embed_dim)
        )
        self.norm1 = nn.LayerNorm(embed_dim, eps=layer_norm_eps)
        self.norm2 = nn.LayerNorm(embed_dim, eps=layer_norm_eps)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.activation = activation
        self.norm_first = norm_first

    def _sa(self, x: Tensor, mask: Tensor | None, kpm: Tensor | None) -> Tensor:
        out, _ = self.self_attn(x, key_padding_mask=kpm, attn_mask=mask, need_weights=False)
        return self.dropout1(out)

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        unpad: Unpadding | None = None,
    ) -> Tensor:
        """src (B, L, E) -> (B, L, E): every position is computed, pads included (as PyTorch's layer does).

        With unpad=Unpadding(key_padding_mask), src is packed: (N, E), the real tokens of a padded batch
        (see unpad.Unpadding), and so is the result. Norms, residuals and the feed-forward then run on
        the N real tokens only; attention goes back to the (B, L) layout inside self_attn. The result
        is the padded computation's at the real tokens. TransformerEncoder runs its layers this way.
        """
        if unpad is None:
            return self._block(src, lambda h: self._sa(h, src_mask, src_key_padding_mask))
        if src_key_padding_mask is not None:
            raise ValueError("with unpad=..., pass no src_key_padding_mask (it is the one unpad was built from).")

        def sa(h: Tensor) -> Tensor:
            out, _ = self.self_attn(h, attn_mask=src_mask, need_weights=False, unpad=unpad)
            return self.dropout1(out)

        return self._block(src, sa)

    def _block(self, x: Tensor, sa) -> Tensor:
        """Residuals, norms and feed-forward around `sa` (self-attention + dropout1). All of it but `sa` is
        position-wise, so x may be padded (B, L, E) or packed (N, E)."""
        if self.norm_first:
            x = x + sa(self.norm1(x))
            x = x + self.dropout2(self._ff(self.norm2(x)))
        else:
            x = self.norm1(x + sa(x))
            x = self.norm2(x + self.dropout2(self._ff(x)))
        return x

    def _ff(self, x: Tensor) -> Tensor:
        """self.ffn(x): Linear -> activation -> Dropout -> Linear. Without autograd (eval, inference) the
        activation runs in place on the first Linear's fresh output, as PyTorch's fused inference path
        does: one (tokens, ff_dim) tensor fewer to allocate and write. Same numbers either way."""
        lin1, act, drop, lin2 = self.ffn
        inplace = None if torch.is_grad_enabled() else _INPLACE.get(type(act))
        if inplace is None or getattr(act, "approximate", "none") != "none":
            return self.ffn(x)
        return lin2(drop(inplace(lin1(x))))

    # ---- converters to and from nn.TransformerEncoderLayer (batch_first) ----
    @classmethod
    def from_official(cls, layer: nn.TransformerEncoderLayer, explicit: bool = False) -> TransformerEncoderLayer:
        """Ours with `layer`'s weights; explicit=True: its attention takes the weights path (MultiHeadAttention)."""
        act = layer.activation
        name = {F.relu: "relu", F.gelu: "gelu"}.get(act) or {nn.ReLU: "relu", nn.GELU: "gelu"}.get(type(act))
        if name is None or (isinstance(act, nn.GELU) and act.approximate != "none"):
            raise ValueError(f"from_official supports relu and exact gelu activations, got {act}.")
        if not layer.self_attn.batch_first:
            raise ValueError("from_official expects batch_first=True (our layers are batch-first).")
        if layer.linear1.bias is None:
            raise ValueError("from_official supports bias=True layers only (our feed-forward has biases).")
        p = layer.dropout.p
        ours = cls(
            layer.self_attn.embed_dim, layer.self_attn.num_heads, layer.linear1.out_features, dropout=p,
            activation=name, norm_first=layer.norm_first, layer_norm_eps=layer.norm1.eps,
            self_attn=MultiHeadAttention.from_official(layer.self_attn, explicit=explicit),
        ).to(layer.linear1.weight.device, layer.linear1.weight.dtype)
        ours.ffn[0].load_state_dict(layer.linear1.state_dict())
        ours.ffn[3].load_state_dict(layer.linear2.state_dict())
        ours.norm1.load_state_dict(layer.norm1.state_dict())
        ours.norm2.load_state_dict(layer.norm2.state_dict())
        return ours

    def to_official(self) -> nn.TransformerEncoderLayer:
        attn = self.self_attn.to_official()  # first: it refuses what PyTorch's layer cannot express
        lin1 = self.ffn[0]
        layer = nn.TransformerEncoderLayer(
            self.self_attn.embed_dim, self.self_attn.num_heads, lin1.out_features, dropout=self.dropout1.p,
            activation=self.activation, layer_norm_eps=self.norm1.eps, batch_first=True,
            norm_first=self.norm_first, device=lin1.weight.device, dtype=lin1.weight.dtype,
        )
        layer.self_attn = attn
        layer.linear1.load_state_dict(lin1.state_dict())
        layer.linear2.load_state_dict(self.ffn[3].state_dict())
        layer.norm1.load_state_dict(self.norm1.state_dict())
        layer.norm2.load_state_dict(self.norm2.state_dict())
        return layer


class TransformerEncoder(nn.Module):
    """N encoder layers, with an optional final LayerNorm (use it with pre-norm layers).

    Given a bool src_key_padding_mask, the stack runs on the real tokens only ("unpadding", see
    unpad.Unpadding): same outputs at real tokens, 0 at padded positions (nn.TransformerEncoder's
    nested-tensor path in eval zeroes them too, before its final norm), and a quarter less work in
    the position-wise layers when a quarter of the batch is padding. When the rows are right-padded (as
    the collate pads them), attention runs on the real tokens too, each sequence on its own (nn.varlen),
    so padding costs no quadratic work either.
    `unpad=False` computes every position, pads included, as nn.TransformerEncoder does in training.
    """

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
        layer: TransformerEncoderLayer | None = None,
        unpad: bool = True,
    ):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}.")
        proto = layer or TransformerEncoderLayer(embed_dim, num_heads, ff_dim, dropout, activation, norm_first)
        # deep copies, then fresh draws for layers 1+ so no two layers start identical
        self.layers = nn.ModuleList([copy.deepcopy(proto) for _ in range(num_layers)])
        for lyr in self.layers[1:]:
            reset_parameters(lyr)
        self.norm = nn.LayerNorm(embed_dim) if final_norm else None
        # skip padded positions in the position-wise layers (forward); False computes every position
        self.unpad = unpad

    def forward(self, src: Tensor, mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None) -> Tensor:
        # src: (B, L, E) -> (B, L, E)
        unpad = self._unpadding(src, src_key_padding_mask)
        if unpad is None:  # no padding (or unpad=False): every layer on the padded layout
            x = src
            for layer in self.layers:
                x = layer(x, src_mask=mask, src_key_padding_mask=src_key_padding_mask)
            return self.norm(x) if self.norm is not None else x
        # Unpad once for the whole stack (see unpad.Unpadding): (B, L, E) -> (N, E) real tokens; norms,
        # residuals and feed-forwards skip the pads and only attention sees the (B, L) layout. The
        # real tokens' outputs equal the padded computation's; padded positions come out as 0.
        x = self.forward_packed(unpad.pack(src), unpad, mask)  # (N, E)
        return unpad.unpack(x)  # (N, E) -> (B, L, E)

    def forward_packed(self, x: Tensor, unpad: Unpadding, mask: Tensor | None = None) -> Tensor:
        """The stack on packed tokens x (N, E) -> (N, E): the real tokens of unpad's padded layout (for packed
        sequences, Unpadding.from_seqlens). forward() lands here after unpadding a padded batch."""
        if not all(isinstance(lyr, TransformerEncoderLayer) for lyr in self.layers):
            raise ValueError("forward_packed needs TransformerEncoderLayer layers (they run on packed tokens).")
        for layer in self.layers:
            x = layer(x, src_mask=mask, unpad=unpad)
        return self.norm(x) if self.norm is not None else x

    def _unpadding(self, src: Tensor, kpm: Tensor | None) -> Unpadding | None:
        """An Unpadding when it applies: a bool (B, L) mask that pads something. Else None, and the
        padded path runs (it is also the one that reports malformed inputs and masks)."""
        if not self.unpad or kpm is None or kpm.dtype != torch.bool or src.dim() != 3:
            return None
        if tuple(kpm.shape) != tuple(src.shape[:2]) or not all(
            isinstance(lyr, TransformerEncoderLayer) for lyr in self.layers
        ):
            return None
        unpad = Unpadding(kpm)
        return unpad if 0 < unpad.num_tokens < kpm.numel() else None

    @classmethod
    def from_official(cls, enc: nn.TransformerEncoder, explicit: bool = False) -> TransformerEncoder:
        """Ours with `enc`'s weights; explicit=True: every layer's attention takes the weights path."""
        layers = [TransformerEncoderLayer.from_official(lyr, explicit) for lyr in enc.layers]
        first = layers[0]
        ours = cls(len(layers), first.self_attn.embed_dim, first.self_attn.num_heads,
                   first.ffn[0].out_features, final_norm=enc.norm is not None, layer=first)
        ours.layers = nn.ModuleList(layers)
        if enc.norm is not None:
            ours.norm = copy.deepcopy(enc.norm)  # keeps its eps, dtype and device, not just its weights
        return ours

    def to_official(self) -> nn.TransformerEncoder:
        layers = [lyr.to_official() for lyr in self.layers]
        enc = nn.TransformerEncoder(layers[0], len(layers), norm=copy.deepcopy(self.norm),
                                    enable_nested_tensor=False)
        enc.layers = nn.ModuleList(layers)
        return enc


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
        return self.encoder(src, mask=mask, src_key_padding_mask=src_key_padding_mask)

    @classmethod
    def wrap(cls, encoder: nn.TransformerEncoder) -> OfficialEncoder:
        """Wrap an existing (batch-first) nn.TransformerEncoder, e.g. from TransformerEncoder.to_official()."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.encoder = encoder
        return self
