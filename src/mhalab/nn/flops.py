"""Analytic FLOPs of one SequenceClassifier forward pass, from host-side shapes only (no tensor is touched).

Why analytic: Lightning's ThroughputMonitor reads `flops_per_batch` after every training batch, and the
batches of a length-bucketed loader all differ in shape; counting them (FlopCounterMode) would cost a
forward pass each, and reading a device tensor's shape-dependent values would cost a host sync.

What is counted, for what the model executes (see encoder.py / attention.py / kernels.py):
  * every matmul, at 2 * m * n * k FLOPs (a multiply and an add);
  * the position-wise layers (in-projection E -> 3E, W_O, the feed-forward E -> F -> E) on the N real
    tokens when the custom encoder unpads (unpad.Unpadding), on all B * L positions for PyTorch's
    encoder (it computes the pads in training);
  * attention per sequence on its real tokens (nn.varlen: the custom encoder, kernels full, window and
    linformer, given the batch's `lengths`): the sum over varlen_attention's calls (CallPlan: sequences of
    close length share a call, padded to its longest) of each call's count; else (PyTorch's encoder,
    performer, no lengths) on the padded (B, H, L, L) layout. On CUDA's flash varlen kernel, which pads
    nothing, this overstates attention by those few pads. Per kernel:
      full       scores Q K^T and A V:                     4 * B * L^2 * E
      window     the band-mask path (L <= 2 * (block + window), or a per-query mask: alibi / t5) is
                 full attention with a mask; the chunked path: 4 * B * E * (nb * c * (g + c + 2w) + g * L)
                 (c = block, nb = ceil(L / c) query blocks, w = window // 2, g = global tokens)
      linformer  E K, F V, then Q (E K)^T and A (F V):       8 * B * L * k * E
      performer  Q W^T, K W^T, phi(K)^T V, phi(Q) (phi(K)^T V), phi(Q) (phi(K)^T 1):
                                                         8 * B * L * m * E + 2 * B * H * L * m
  * the classifier head on the pooled (B, E).
Not counted (neither does torch.utils.flop_counter.FlopCounterMode, which counts matmuls and attention
kernels only): softmax, LayerNorm, the activation, dropout, masks, residual adds, positions (RoPE,
ALiBi, T5 are elementwise), the embedding lookup and pooling. They are O(N * E) against the matmuls'
O(N * E^2), a few per cent at E = 128. Nor the CPU query-block recomputation (attention.py's
attention._blocked runs attention's forward twice): these are the model's FLOPs, as MFU defines them.

Training is counted as 3 x forward: backward computes two matmuls (input and weight gradients) per
forward matmul. (Performer's random features are a buffer, so its Q W^T, K W^T have no weight gradient;
3x overstates its attention by those two products' share.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mhalab.nn.varlen import CALL_COST, SeqLens

TRAIN_FACTOR = 3  # forward + backward (two matmuls per forward matmul)
WINDOW_MIN_BLOCK = 64  # kernels.WindowAttention's default query block: max(window // 2, 64)


def attention_flops(attention: str, batch: int, seq_len: int, dim: int, heads: int, options: Mapping | None = None,
                    query_masks: bool = False) -> int:
    """Forward FLOPs of one attention layer's kernel (after the projections) on (B, H, L, d) q, k, v;
    dim = H x d (the model's dim unless model.head_dim is set).

    options: the kernel's resolved model.attention_options (window, global_tokens, linformer_k,
    performer_features), as mhalab.model.ATTENTION_OPTIONS fills them in.
    query_masks: the merged mask differs per query (a position bias: alibi / t5), which sends window
    attention down its band-mask path whatever L.
    """
    B, L, E = batch, seq_len, dim
    o = dict(options or {})
    if attention == "full":
        return 4 * B * L * L * E
    if attention == "window":
        w, g = o["window"] // 2, min(o["global_tokens"], L)
        c = max(w, WINDOW_MIN_BLOCK)
        if query_masks or L <= 2 * (c + o["window"]):  # WindowAttention._use_chunked: the dense band mask
            return 4 * B * L * L * E
        nb = -(-L // c)
        return 4 * B * E * (nb * c * (g + c + 2 * w) + g * L)
    if attention == "linformer":
        return 8 * B * L * o["linformer_k"] * E
    if attention == "performer":
        m = o["performer_features"]
        return 8 * B * L * m * E + 2 * B * heads * L * m
    raise ValueError(f"unknown attention '{attention}' for FLOPs; one of full, window, linformer, performer.")


PER_SEQUENCE = ("full", "window", "linformer")  # the kernels with per_sequence = True (nn.varlen)


def forward_flops(*, batch: int, seq_len: int, num_tokens: int, dim: int, heads: int, layers: int, ff_dim: int,
                  num_classes: int, attention: str = "full", attention_options: Mapping | None = None,
                  pooling: str = "mean", pos: str = "sinusoidal", encoder: str = "custom",
                  lengths: Sequence[int] | SeqLens | None = None, head_dim: int | None = None, **_unused) -> int:
    """Forward FLOPs of SequenceClassifier on a (batch, seq_len) batch with num_tokens real (non-pad) tokens.

    The keywords are SequenceClassifier's (pass its config with `**model_cfg`; the ones that do not
    change the FLOPs, dropout, max_len, ..., are accepted and ignored), attention_options resolved
    (every option the chosen kernel reads). seq_len and num_tokens are the collated batch's: with
    pooling=cls the encoder sees one more position per sequence, the CLS vector, counted here.
    lengths: the B sequences' real lengths (sum = num_tokens), for attention per sequence (see above); the batch's
        SeqLens itself reuses the call plan the model made from it (cached), instead of planning again.
    head_dim: model.head_dim (None: dim / heads); attention works at D = heads x head_dim.
    """
    B, L, N, E = batch, seq_len, num_tokens, dim
    D = E if head_dim is None else heads * head_dim  # the attention's inner width
    if pooling == "cls":
        L, N = L + 1, N + B
        lengths = None if lengths is None else [n + 1 for n in getattr(lengths, "lengths", lengths)]
    # custom encoder: unpadded only when something is padded (TransformerEncoder.forward); N = B * L otherwise
    positions = N if encoder == "custom" else B * L
    projections = 2 * positions * E * 3 * D + 2 * positions * D * E  # in-projection (E -> 3D) and W_O (D -> E)
    feed_forward = 2 * 2 * positions * E * ff_dim  # E -> F -> E
    query_masks = pos in ("alibi", "t5")
    if encoder == "custom" and attention in PER_SEQUENCE and lengths is not None and N < B * L:
        # the calls varlen_attention's fallback makes (CallPlan: sequences of close length share a call, padded)
        calls = (lengths if isinstance(lengths, SeqLens) else SeqLens(lengths)).plan(CALL_COST // D).calls
        attn = sum(attention_flops(attention, count, n, D, heads, attention_options, query_masks) for n, count in calls)
    else:
        attn = attention_flops(attention, B, L, D, heads, attention_options, query_masks)
    head = 2 * B * E * num_classes
    return layers * (projections + feed_forward + attn) + head


def train_flops(**kwargs) -> int:
    """FLOPs of one training step on the batch: forward_flops(**kwargs) * TRAIN_FACTOR (forward + backward)."""
    return TRAIN_FACTOR * forward_flops(**kwargs)
