"""The sequence classifier: embed -> position -> dropout -> encoder stack -> pool -> dropout -> linear head.

`encoder="custom"` stacks our TransformerEncoderLayer; `encoder="official"` wraps nn.TransformerEncoder.
With the same weights the two give the same logits (see `with_encoder` and tests/test_model.py).

It is also the one place that builds the attention parts, the article's "next steps" as small pieces that
plug into `MultiHeadAttention`'s hooks:

    # {"attention": WindowAttention, "rotary": RotaryEmbedding,
    #  "position_bias": None}
    parts = attention_parts("window", "rope", embed_dim=256, num_heads=8,
                            max_len=512, dropout=0.1)
    mha = MultiHeadAttention(256, 8, 0.1, **parts)

The names it builds:

- `model.pos`: sinusoidal | learned (absolute, added to the embeddings by the model: no part here);
  rope (rotary hook) | alibi | t5 (position_bias hook).
- `model.attention`: full (the default softmax kernel) | window | linformer | performer (attention hook).
  Any position composes with full and window. linformer and performer never form the (L_q, L_k) score
  matrix, so they cannot add the alibi / t5 bias: those pairs raise ValueError (see `check_combination`);
  rope and the absolute positions work with every kernel.
- `model.attention_options`: the names and defaults in ATTENTION_OPTIONS (conf/model/custom.yaml declares
  the same); `check_attention` refuses unknown keys, bad values, and a window that is full attention.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from mhalab.errors import CheckpointError
from mhalab.nn.attention import BLOCK_MIN_SCORES, QUERY_BLOCK, MultiHeadAttention, check_heads
from mhalab.nn.dropout import DRAWS, use_dropout16
from mhalab.nn.encoder import OfficialEncoder, TransformerEncoder, TransformerEncoderLayer, reset_parameters
from mhalab.nn.kernels import LinformerAttention, PerformerAttention, WindowAttention
from mhalab.nn.positions import ALiBi, LearnedPosition, RotaryEmbedding, SinusoidalPosition, T5RelativeBias
from mhalab.nn.unpad import Unpadding
from mhalab.nn.varlen import SeqLens

_NESTED_PROTOTYPE = "The PyTorch API of nested tensors is in prototype stage"  # torch's UserWarning (model=official)

ATTENTIONS = ("full", "window", "linformer", "performer")
POSITIONS = ("sinusoidal", "learned", "rope", "alibi", "t5")
ABSOLUTE_POSITIONS = ("sinusoidal", "learned")
BIAS_POSITIONS = ("alibi", "t5")  # need the (L_q, L_k) score matrix
LINEAR_ATTENTIONS = ("linformer", "performer")  # never form it
# model.attention_options -> default; the one list of them (conf/model/custom.yaml mirrors it, a test checks)
ATTENTION_OPTIONS = {"window": 128, "global_tokens": 1, "linformer_k": 64, "performer_features": 64}
_OPTION_MIN = {"window": 0, "global_tokens": 0, "linformer_k": 1, "performer_features": 1}

def check_combination(attention: str, pos: str) -> None:
    """Check a kernel and a position by name; cheap, builds nothing.

    Args:
        attention: one of ATTENTIONS.
        pos: one of POSITIONS.

    Raises:
        ValueError: an unknown name, or a linear kernel (linformer, performer) with a bias position (alibi, t5).
    """
    if attention not in ATTENTIONS:
        raise ValueError(f"unknown model.attention '{attention}'; choose one of {', '.join(ATTENTIONS)}.")
    if pos not in POSITIONS:
        raise ValueError(f"unknown model.pos '{pos}'; choose one of {', '.join(POSITIONS)}.")
    if attention in LINEAR_ATTENTIONS and pos in BIAS_POSITIONS:
        raise ValueError(
            f"model.attention={attention} cannot use model.pos={pos}: {pos} adds a bias to every "
            f"(query, key) score and {attention} never forms the score matrix. Use model.pos=rope, "
            f"sinusoidal or learned with {attention}, or model.attention=full / window with {pos}."
        )


def check_attention(attention: str, pos: str, options: Mapping | None, max_len: int) -> None:
    """Refuse what attention_parts cannot build or would build silently wrong, in one line naming the value and
    the fix. Cheap, builds nothing; the config validation calls it too.

    Args:
        attention: the kernel's name (ATTENTIONS).
        pos: the positions' name (POSITIONS).
        options: model.attention_options (missing keys take ATTENTION_OPTIONS' defaults).
        max_len: the number of positions attention sees: the model's max_len, + 1 with pooling=cls
            (SequenceClassifier's n_pos).

    Raises:
        ValueError: check_combination's pairs, unknown option keys, values that are not integers >= their
            minimum, and window attention whose band covers every (query, key) pair of max_len positions.
    """
    check_combination(attention, pos)
    options = dict(options or {})
    for key, value in options.items():
        if key not in ATTENTION_OPTIONS:
            valid = ", ".join(f"model.attention_options.{k}" for k in ATTENTION_OPTIONS)
            raise ValueError(f"unknown option model.attention_options.{key}; the options are {valid}.")
        low = _OPTION_MIN[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"model.attention_options.{key}={value!r} must be an integer >= {low} "
                             f"(the default is {ATTENTION_OPTIONS[key]}).")
    if attention != "window" or max_len < 2:
        return
    opts = {**ATTENTION_OPTIONS, **options}
    w, g = opts["window"], opts["global_tokens"]
    # WindowAttention: query i sees key j iff |i - j| <= w // 2 or i < g or j < g. The farthest pair of
    # non-global positions is (g, max_len - 1), so the band covers every pair iff w // 2 >= max_len - 1 - g.
    reach = max_len - 1 - g
    if reach < 1:
        raise ValueError(
            f"model.attention=window with model.attention_options.global_tokens={g} covers every position of "
            f"max_len={max_len} whatever the window: it would be full attention; set "
            f"model.attention_options.global_tokens below {max_len - 1} or use model.attention=full.")
    if w // 2 >= reach:
        glob = f", plus {g} global token{'s' * (g > 1)}" if g else ""
        eg = 1 << (reach.bit_length() - 1)  # a power of two <= reach: its eg // 2 keys fall short
        raise ValueError(
            f"model.attention=window with model.attention_options.window={w} ({w // 2} keys on each side"
            f"{glob}) covers every position of max_len={max_len}: it would be full attention; set "
            f"model.attention_options.window below {2 * reach} (e.g. {eg}) or use model.attention=full.")


def attention_parts(
    attention: str = "full",
    pos: str = "sinusoidal",
    *,
    embed_dim: int,
    num_heads: int,
    max_len: int,
    dropout: float,
    head_dim: int | None = None,
    **options: int,
) -> dict[str, nn.Module | None]:
    """The modules for MultiHeadAttention(embed_dim, num_heads, dropout, head_dim=head_dim, **parts).

    Args:
        attention: full | window | linformer | performer.
        pos: sinusoidal | learned | rope | alibi | t5 (the absolute ones, sinusoidal and learned, need no part).
        embed_dim: the model's width.
        num_heads: the number of heads.
        max_len: the positions attention sees (RoPE's table, Linformer's projected length).
        dropout: the attention weights' dropout (window, linformer).
        head_dim: each head's width; None: embed_dim / num_heads.
        **options: ATTENTION_OPTIONS, checked by check_attention (missing ones take its defaults): `window`,
            Longformer's window (each query sees window // 2 keys on each side); `global_tokens`, the first
            positions (e.g. CLS) that attend to and are attended by all; `linformer_k`, the projected length k;
            `performer_features`, the number of random features m.

    Returns:
        `{"attention": kernel or None (None: the default softmax kernel), "rotary": RotaryEmbedding or None,
        "position_bias": ALiBi / T5RelativeBias or None}`.

    Raises:
        ValueError: what check_attention refuses.
    """
    check_attention(attention, pos, options, max_len)
    o = {**ATTENTION_OPTIONS, **options}
    head_dim = check_heads(embed_dim, num_heads, head_dim=head_dim)  # None: embed_dim / num_heads

    kernel: nn.Module | None = None
    if attention == "window":
        kernel = WindowAttention(o["window"], o["global_tokens"], dropout)
    elif attention == "linformer":
        kernel = LinformerAttention(max_len, o["linformer_k"], dropout)
    elif attention == "performer":
        kernel = PerformerAttention(head_dim, o["performer_features"])

    rotary = RotaryEmbedding(head_dim, max_len) if pos == "rope" else None
    bias: nn.Module | None = None
    if pos == "alibi":
        bias = ALiBi(num_heads)
    elif pos == "t5":
        bias = T5RelativeBias(num_heads)
    return {"attention": kernel, "rotary": rotary, "position_bias": bias}


POOLINGS = ("mean", "cls", "max")  # max: each feature's largest value over real tokens (Kim 2014's max-over-time)
ENCODERS = ("custom", "official")


def check_model(encoder: str, pooling: str, attention: str, pos: str, head_dim: int | None = None,
                dropout_draw: str = "torch") -> None:
    """The classifier's own rules (the config validation runs them too).

    Raises:
        ValueError: naming the fix, for an unknown encoder or pooling, or PyTorch's encoder with anything but
            full attention, absolute positions and head_dim = dim / heads.
    """
    if encoder not in ENCODERS:
        raise ValueError(f"unknown model.encoder '{encoder}'; choose one of {', '.join(ENCODERS)}.")
    if pooling not in POOLINGS:
        raise ValueError(f"unknown model.pooling '{pooling}'; choose one of {', '.join(POOLINGS)}.")
    if encoder == "official" and (attention != "full" or pos not in ABSOLUTE_POSITIONS):
        raise ValueError(
            f"model=official supports attention=full with pos={'|'.join(ABSOLUTE_POSITIONS)} only (got "
            f"attention={attention}, pos={pos}); use model=custom for the variants."
        )
    if encoder == "official" and head_dim is not None:
        raise ValueError(
            f"model=official cannot take model.head_dim={head_dim}: nn.MultiheadAttention splits dim among the "
            f"heads; set model.head_dim=null (dim / heads) or use model=custom."
        )
    if dropout_draw not in DRAWS:
        raise ValueError(f"unknown model.dropout_draw '{dropout_draw}'; choose one of {', '.join(DRAWS)}.")
    if encoder == "official" and dropout_draw != "torch":
        raise ValueError(f"model=official cannot take model.dropout_draw={dropout_draw}: PyTorch's encoder draws its "
                         f"own masks; set model.dropout_draw=torch or use model=custom.")


class SequenceClassifier(nn.Module):
    """Token embedding + positions -> encoder stack -> pooling -> dropout -> linear head: logits (B, C).

    The model=custom config holds these arguments.

    Args:
        vocab_size: the embedding's rows (the tokenizer's vocabulary).
        num_classes: the head's outputs.
        encoder: "custom" stacks our TransformerEncoderLayer (attention built by name); "official" is PyTorch's
            nn.TransformerEncoder with the same shape.
        dim: the embedding width E.
        heads: attention heads per layer.
        layers: encoder layers.
        ff_dim: the feed-forward block's inner width.
        dropout: everywhere (attention weights, residuals, the head's input).
        activation: the feed-forward block's, gelu or relu.
        norm_first: pre-norm layers (and a final LayerNorm) instead of post-norm.
        pos: sinusoidal | learned (added to the embeddings) | rope | alibi | t5 (inside each attention layer).
        attention: full | window | linformer | performer (custom only).
        pooling: mean over the real tokens, max, or cls (a learned [CLS] vector at position 0).
        max_len: the longest input; positions are built for it (+ 1 with pooling=cls).
        pad_id: the padding token's id (its embedding row stays zero; the default padding mask).
        attention_options: ATTENTION_OPTIONS of the kernel (window, global_tokens, linformer_k,
            performer_features).
        embed_dropout: the dropout on embedding + position; None: `dropout`, as in Vaswani et al.
        block_min_scores: on CPU in training, a (batch, head) with at least this many scores attends in query
            blocks (ScaledDotProductAttention); None turns it off. Not a weight: checkpoints load either way.
        query_block: the queries of one such block.
        head_dim: each head's width; None: dim / heads (the article's rule); any other width decouples the
            heads' width from dim (custom only).
        dropout_draw: "torch": every dropout is PyTorch's (the same seed, PyTorch's masks); "16bit": each is
            nn.dropout.Dropout16, whose CPU masks cost a quarter of the draws (custom only; the model config's
            default).

    Raises:
        ValueError: what check_model and check_attention refuse.
    """

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        encoder: str = "custom",
        dim: int = 128,
        heads: int = 4,
        layers: int = 2,
        ff_dim: int = 512,
        dropout: float = 0.1,
        activation: str = "gelu",
        norm_first: bool = False,
        pos: str = "sinusoidal",
        attention: str = "full",
        pooling: str = "mean",
        max_len: int = 128,
        pad_id: int = 0,
        attention_options: dict | None = None,
        embed_dropout: float | None = None,
        block_min_scores: int | None = BLOCK_MIN_SCORES,
        query_block: int = QUERY_BLOCK,
        head_dim: int | None = None,
        dropout_draw: str = "torch",
    ):
        super().__init__()
        check_model(encoder, pooling, attention, pos, head_dim, dropout_draw)

        self.pooling, self.pad_id = pooling, pad_id
        n_pos = max_len + (pooling == "cls")  # the CLS vector takes position 0
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=pad_id)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02) if pooling == "cls" else None
        self.pos = None
        if pos == "sinusoidal":
            self.pos = SinusoidalPosition(dim, n_pos)
        elif pos == "learned":
            self.pos = LearnedPosition(dim, n_pos)
        # relative positions (rope/alibi/t5) and attention kinds live inside each attention layer
        parts = attention_parts(
            attention, pos, embed_dim=dim, num_heads=heads, max_len=n_pos, dropout=dropout, head_dim=head_dim,
            **(attention_options or {}),
        )
        if encoder == "custom":
            # CPU training at long L: query blocks (ScaledDotProductAttention); not weights, so any
            # checkpoint loads whatever the values. PyTorch's encoder has no such switch: ignored there.
            mha = MultiHeadAttention(dim, heads, dropout, **parts, block_min_scores=block_min_scores,
                                     query_block=query_block, head_dim=head_dim)
            layer = TransformerEncoderLayer(dim, heads, ff_dim, dropout, activation, batch_first=True,
                                            norm_first=norm_first, self_attn=mha)
            # PyTorch's form copies the layer; a config's stack then draws layers 1+ afresh (no two layers start
            # identical), and skips the pads in training too (unpad=True; see TransformerEncoder)
            self.encoder = TransformerEncoder(layer, layers, norm=nn.LayerNorm(dim) if norm_first else None,
                                              unpad=True)
            for lyr in self.encoder.layers[1:]:
                reset_parameters(lyr)
        else:
            self.encoder = OfficialEncoder(layers, dim, heads, ff_dim, dropout, activation, norm_first,
                                           final_norm=norm_first)
            # its eval forward packs a padded batch into a nested tensor, and torch says once per process that the
            # nested-tensor API "is in prototype stage": a cause we know and a user cannot act on; that message, from
            # that module, only
            warnings.filterwarnings("ignore", message=_NESTED_PROTOTYPE, category=UserWarning,
                                    module=r"torch\.nn\.modules\.transformer")
        # dropout on embedding + position, as in Vaswani et al. (None: the same p as everywhere else)
        self.embed_drop = nn.Dropout(dropout if embed_dropout is None else embed_dropout)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(dim, num_classes)
        if dropout_draw == "16bit":
            use_dropout16(self)

    def compile_positionwise(self) -> int:
        """torch.compile each encoder layer's position-wise half (TransformerEncoderLayer.compile_positionwise: one
        graph for any batch, attention eager); returns how many layers. PyTorch's layers (model=official) stay
        eager (0): a whole-layer graph would guard on each batch's lengths."""
        layers = [m for m in self.modules() if isinstance(m, TransformerEncoderLayer)]
        for layer in layers:
            layer.compile_positionwise()
        return len(layers)

    def load_encoder(self, state: Mapping[str, Tensor]) -> None:
        """Every weight but the classification head, from a pretrained encoder's state dict (a masked-LM
        pretraining's, mhalab.train.pretrain); the head keeps its own initialisation.

        Raises:
            CheckpointError: the state dict does not fit this classifier (other keys or shapes).
        """
        try:
            missing, unexpected = self.load_state_dict(state, strict=False)
        except RuntimeError as e:  # a shape that differs
            raise CheckpointError(f"the pretrained encoder does not fit the classifier: {e}") from None
        if unexpected or any(not k.startswith("head.") for k in missing):
            raise CheckpointError(f"the pretrained encoder does not fit the classifier (missing {missing}, "
                                  f"unexpected {unexpected}).")

    def forward(self, input_ids: Tensor, padding_mask: Tensor | None = None, seqlens: SeqLens | None = None) -> Tensor:
        """The logits of a padded or a packed batch.

        A right-padded batch may come with its seqlens too (data.collate.Collate adds them): then its real
        tokens are packed at once and take the packed path, where every shape is known on the host (no device
        sync on CUDA) and nothing is computed for the pads. Same logits either way.

        Args:
            input_ids: (B, L) padded, or (N,) packed: the B sequences back to back.
            padding_mask: (B, L), True at pads; None: the pad id's positions.
            seqlens: the lengths of the sequences (nn.varlen.SeqLens, as data.collate.PackedCollate gives
                them); required for a packed batch.

        Returns:
            Logits (B, C).
        """
        if seqlens is not None:
            if input_ids.dim() == 2:  # (B, L) right-padded -> (N,) real tokens
                input_ids = input_ids.flatten().index_select(0, seqlens.padded_index(input_ids.size(1), input_ids.device))
            return self._forward_packed(input_ids, seqlens)
        if padding_mask is None:
            padding_mask = input_ids == self.pad_id
        x = self.embed(input_ids)  # (B, L, E)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.size(0), -1, -1).to(x.dtype), x], dim=1)  # (B, 1+L, E)
            padding_mask = torch.cat([padding_mask.new_zeros(x.size(0), 1), padding_mask], dim=1)
        if self.pos is not None:
            x = self.pos(x)
        x = self.encoder(self.embed_drop(x), src_key_padding_mask=padding_mask)  # (B, L, E)
        if self.pooling == "cls":
            pooled = x[:, 0]  # (B, E)
        elif self.pooling == "max":
            pooled = x.masked_fill(padding_mask.unsqueeze(-1), float("-inf")).amax(1)  # (B, E) over real tokens
            pooled = pooled.masked_fill(padding_mask.all(1, keepdim=True), 0.0)  # an empty sequence: 0, as mean gives
        else:
            keep = (~padding_mask).unsqueeze(-1).to(x.dtype)  # (B, L, 1)
            pooled = (x * keep).sum(1) / keep.sum(1).clamp(min=1.0)  # mean over real tokens
        return self.head(self.drop(pooled))  # (B, C)

    def _forward_packed(self, input_ids: Tensor, seqlens: SeqLens) -> Tensor:
        """The padded forward's logits, computed on the N real tokens only: no pads anywhere (the custom encoder
        attends per sequence, nn.varlen); PyTorch's encoder gets them padded, as it needs."""
        x, seqlens = self.encode(input_ids, seqlens)  # (N', E)
        if self.pooling == "cls":
            pooled = x.index_select(0, seqlens.starts(x.device))  # (B, E)
        else:
            pooled = seqlens.max(x) if self.pooling == "max" else seqlens.mean(x)  # (B, E)
        return self.head(self.drop(pooled))  # (B, C)

    def encode(self, input_ids: Tensor, seqlens: SeqLens, embeddings: Tensor | None = None) -> tuple[Tensor, SeqLens]:
        """The encoder's output for every token of a packed batch.

        Args:
            input_ids: (N,), the sequences back to back.
            seqlens: their lengths.
            embeddings: (N, E) to use instead of embed(input_ids) (masked-LM pretraining puts its [MASK] vector
                there).

        Returns:
            (N', E) and the lengths of its sequences: N' = N + B with pooling=cls, whose CLS vector is each
            sequence's first row.

        Raises:
            ValueError: input_ids not (N,) for these seqlens.
        """
        if input_ids.dim() != 1 or input_ids.size(0) != seqlens.num_tokens:
            raise ValueError(f"packed input_ids must be (N,) = ({seqlens.num_tokens},), the sequences back to back; "
                             f"got {tuple(input_ids.shape)}.")
        x = self.embed(input_ids) if embeddings is None else embeddings  # (N, E)
        if self.cls is not None:
            x, seqlens = seqlens.with_prefix(x, self.cls.view(-1))  # (N + B, E): CLS first in each sequence
        if self.pos is not None:
            x = self.pos.packed(x, seqlens.positions(x.device), seqlens.max_seqlen)
        x = self.embed_drop(x)
        unpad = Unpadding.from_seqlens(seqlens, x.device)  # the padded layout, for whatever needs it
        if isinstance(self.encoder, TransformerEncoder):
            x = self.encoder.forward_packed(x, unpad)  # (N, E)
        else:  # (N, E) -> (B, L, E) -> PyTorch's encoder -> (N, E)
            x = unpad.pack(self.encoder(unpad.unpack(x), src_key_padding_mask=unpad.key_padding_mask))
        return x, seqlens

    def with_encoder(self, kind: str) -> SequenceClassifier:
        """The same model with the other encoder implementation, weights copied exactly."""
        other = copy.deepcopy(self)
        enc = self.encoder
        if kind == "official" and isinstance(enc, TransformerEncoder):
            other.encoder = OfficialEncoder.wrap(enc.to_official())
        elif kind == "custom" and isinstance(enc, OfficialEncoder):
            other.encoder = TransformerEncoder.from_official(enc.encoder, unpad=True)
        elif not isinstance(enc, TransformerEncoder if kind == "custom" else OfficialEncoder):
            raise ValueError(f"unknown encoder kind '{kind}'; choose one of {', '.join(ENCODERS)}.")
        return other
