"""Variable-length sequences back to back: the lengths of a batch, and attention on real tokens only.

A batch of B sequences of lengths n_0 .. n_{B-1}, laid end to end as N = sum(n_i) rows (N, ...), sequence
i at rows cu_seqlens[i] : cu_seqlens[i + 1] (FlashAttention's "varlen" layout). Nothing is padded, so
attention costs sum(n_i^2) instead of B * max(n)^2: on IMDB-like batches of 50-512 tokens in random order
that is about half.

    seqlens = SeqLens([5, 3, 5])              # host ints: the collate knows them, no device sync
    out = varlen_attention(mha, qkv, seqlens)  # qkv (N, 3E) -> (N, E), each sequence attending to itself

How attention runs per sequence (`varlen_attention`):

- on CUDA, plain softmax attention without dropout, bias or mask: PyTorch's varlen kernel
  (torch.nn.attention.varlen.varlen_attn, FlashAttention) in one call, where the installed torch has it;
- everywhere else: the sequences sorted by length and cut into a few calls of the layer's own kernel on
  (count, H, width, d), each call's sequences of equal or close lengths (CallPlan: a call takes a shorter
  sequence while padding it costs less than a call of its own, CALL_COST), the few pads masked as keys.
  Long, varied sequences (IMDB) get about one call per sequence, which on CPU trains 2.2x faster than
  one padded masked call; short sentences (SST-2) a few calls per batch, where tens of calls would cost
  more in overhead than their padding. Every kernel (full, window, linformer) and position (RoPE, ALiBi,
  T5) sees a sequence exactly as the padded path sees its real tokens: positions 0..n-1, the same keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from mhalab.nn.masks import merge_masks


def _flash_varlen():
    """PyTorch's varlen kernel (torch >= 2.10), or None. Imported on first use on CUDA only: importing it
    adds warning filters, and importing mhalab must change no global state (tests/test_layout.py)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # pragma: no cover - depends on the installed torch
        return None
    return varlen_attn


def to_device(t: Tensor, device) -> Tensor:
    """A host tensor onto `device` without a host sync: a plain .to("cuda") from pageable memory waits for the
    stream (torch's copy then synchronizes); pinned and non_blocking, it is queued like a kernel."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class SeqLens:
    """The lengths of B sequences packed as (N, ...) rows, on the host, with the index tensors built from them.

    Every shape decision (group sizes, max length, N) reads host ints, so nothing here syncs with a GPU; the
    index tensors are made once per device, on first use. Also the order in which varlen_attention visits
    the sequences: by length, longest first (stable), so similar lengths are contiguous rows and run as one
    call (plan); `perm` is None when the batch is already in that order (a length-sorted batch: bucketed or
    packed batches are sorted so by their samplers), else the rows' order.
    """

    def __init__(self, lengths: Sequence[int]):
        lens = np.asarray([int(n) for n in lengths], dtype=np.int64)
        if lens.ndim != 1 or len(lens) == 0 or (lens < 0).any():
            raise ValueError(f"SeqLens needs one or more lengths >= 0, got {lens.tolist()}.")
        self.lengths: list[int] = lens.tolist()
        self.batch, self.num_tokens, self.max_seqlen = len(lens), int(lens.sum()), int(lens.max())
        self._cu = np.concatenate([[0], np.cumsum(lens)])  # (B + 1,)
        order = np.argsort(-lens, kind="stable")  # sequences, longest first
        self._sorted = lens[order]  # (B,) their lengths in that order
        self._plans: dict[int, CallPlan] = {}
        self._perm = None
        if (order != np.arange(len(lens))).any():
            # (N,) the rows of the sorted sequences: each one's start, plus 0..n-1
            first = np.repeat(np.cumsum(self._sorted) - self._sorted, self._sorted)  # its first sorted row
            self._perm = np.repeat(self._cu[:-1][order], self._sorted) + np.arange(self.num_tokens) - first
        self._cache: dict[tuple[str, torch.device], Tensor] = {}

    @classmethod
    def from_padding_mask(cls, key_padding_mask: Tensor) -> SeqLens | None:
        """The lengths of a right-padded (B, L) bool mask (True at pads), or None if some row is not a prefix
        of real tokens followed by pads (left padding, holes). Reads the mask: on CUDA a sync."""
        real = (~key_padding_mask).sum(1)  # (B,)
        prefix = torch.arange(key_padding_mask.size(1), device=real.device)[None, :] >= real[:, None]
        if not torch.equal(prefix, key_padding_mask):
            return None
        return cls(real.tolist())

    def _tensor(self, name: str, device: torch.device) -> Tensor:
        key = (name, torch.device(device))
        if key not in self._cache:
            if name == "cu_seqlens":
                value = torch.as_tensor(self._cu, dtype=torch.int32)
            elif name == "perm":
                value = torch.as_tensor(self._perm)
            elif name == "inverse":
                value = torch.as_tensor(np.argsort(self._perm))
            elif name == "positions":  # (N,) each row's position in its sequence
                value = torch.as_tensor(np.arange(self.num_tokens) - np.repeat(self._cu[:-1], self.lengths))
            elif name == "sequence":  # (N,) each row's sequence
                value = torch.as_tensor(np.repeat(np.arange(self.batch), self.lengths))
            elif name == "starts":  # (B,) each sequence's first row
                value = torch.as_tensor(self._cu[:-1])
            elif name == "lengths":
                value = torch.as_tensor(self.lengths)
            else:
                raise KeyError(name)
            self._cache[key] = to_device(value, device)
        return self._cache[key]

    def padded_index(self, width: int, device) -> Tensor:
        """(N,) the flat positions b * width + l of the real tokens in a right-padded (B, width) batch."""
        key = (f"padded{width}", torch.device(device))
        if key not in self._cache:
            rows = np.repeat(np.arange(self.batch) * width, self.lengths) + self._tensor("positions", "cpu").numpy()
            self._cache[key] = to_device(torch.as_tensor(rows), device)
        return self._cache[key]

    def cu_seqlens(self, device) -> Tensor:
        """(B + 1,) int32: each sequence's first row, and N at the end (FlashAttention's cu_seqlens)."""
        return self._tensor("cu_seqlens", device)  # (B + 1,) int32

    def positions(self, device) -> Tensor:
        """(N,) long: each row's position within its sequence."""
        return self._tensor("positions", device)  # (N,) long

    def sequence(self, device) -> Tensor:
        """(N,) long: each row's sequence."""
        return self._tensor("sequence", device)  # (N,) long

    def starts(self, device) -> Tensor:
        """(B,) long: each sequence's first row."""
        return self._tensor("starts", device)  # (B,) long

    def lengths_tensor(self, device) -> Tensor:
        """(B,) long: the lengths, as a tensor on device."""
        return self._tensor("lengths", device)  # (B,) long

    def plan(self, pad_scores: int) -> CallPlan:
        """How varlen_attention's fallback groups these sequences into kernel calls (CallPlan), cached."""
        if pad_scores not in self._plans:
            self._plans[pad_scores] = CallPlan(self._sorted, pad_scores)
        return self._plans[pad_scores]

    def sort(self, x: Tensor) -> Tensor:
        """(N, *) rows -> the same rows in varlen_attention's order (longest sequence first)."""
        return x if self._perm is None else x.index_select(0, self._tensor("perm", x.device))

    def unsort(self, x: Tensor) -> Tensor:
        """sort's inverse."""
        return x if self._perm is None else x.index_select(0, self._tensor("inverse", x.device))

    def mean(self, x: Tensor) -> Tensor:
        """(N, E) -> (B, E): each sequence's mean row."""
        sums = x.new_zeros(self.batch, x.size(-1)).index_add_(0, self.sequence(x.device), x)
        return sums / self.lengths_tensor(x.device).clamp(min=1).unsqueeze(1).to(x.dtype)  # empty: 0

    def max(self, x: Tensor) -> Tensor:
        """(N, E) -> (B, E): each sequence's largest value per feature (an empty sequence: 0)."""
        index = self.sequence(x.device).unsqueeze(1).expand_as(x)  # (N, E): each row's sequence
        return x.new_zeros(self.batch, x.size(-1)).scatter_reduce(0, index, x, "amax", include_self=False)

    def with_prefix(self, x: Tensor, prefix: Tensor) -> tuple[Tensor, SeqLens]:
        """Put prefix (E,) before each sequence of x (N, E): (N + B, E) and the lengths + 1 (a CLS vector)."""
        longer = SeqLens([n + 1 for n in self.lengths])
        dev = x.device
        rows = torch.cat([prefix.to(x.dtype).expand(self.batch, -1), x])  # (B + N, E): prefixes, then tokens
        # row r of the result: sequence s's prefix (row s) if r is s's first row, else its token r - s - 1 (+ B)
        pos = longer.positions(dev)
        seq = longer.sequence(dev)
        source = torch.where(pos == 0, seq, self.batch + torch.arange(longer.num_tokens, device=dev) - seq - 1)
        return rows.index_select(0, source), longer

    def __repr__(self) -> str:
        return f"SeqLens(batch={self.batch}, num_tokens={self.num_tokens}, max_seqlen={self.max_seqlen})"


# One kernel call's fixed cost (Python, autograd, dispatch), as attention work: scores x heads x head_dim. It
# only decides speed: every plan gives the same outputs. Chosen on this project's 2-core CPU (SDPA, dropout
# 0.2, E = 128), fwd + bwd of one layer's attention on a shuffled SST-2 batch of 64 (21 distinct lengths <= 31):
# a call per length 16.6 ms, CALL_COST = 100k (2 calls) 8.1 ms, one padded call 10.4 ms.
CALL_COST = 100_000


class CallPlan:
    """The kernel calls of varlen_attention's fallback for sequences sorted longest first.

    One call per run of equal lengths would be exact with no padding, but a batch of short sentences has tens
    of distinct lengths and each call has a fixed cost; so a call also takes the next, shorter sequences
    while the scores it adds for padding, w^2 - n^2 for a sequence of n in a call of width w, stay within
    `pad_scores` (varlen_attention: CALL_COST / (heads x head_dim); 0: equal lengths only). Those calls
    pad their shorter members to w and mask the padded keys: the padded computation in miniature.

    calls: [(width, count)] in order; gather (P,) rows of the sorted tokens that lay the calls out padded,
    pads repeating a real row (masked keys; their queries are dropped), and real (N,) the padded rows that
    are real tokens: both None when no call pads. key_masks: per call, (count, width) True at pads, or None.
    """

    def __init__(self, sorted_lengths: np.ndarray, pad_scores: int):
        calls: list[list[int]] = []
        for n in (int(x) for x in sorted_lengths if x > 0):  # empty sequences have no rows
            if calls and calls[-1][0] ** 2 - n * n <= pad_scores:
                calls[-1].append(n)
            else:
                calls.append([n])
        self.calls = [(c[0], len(c)) for c in calls]
        self._masks = [None if members[-1] == members[0] else
                       np.arange(members[0])[None, :] >= np.asarray(members)[:, None] for members in calls]
        pads = any(m is not None for m in self._masks)
        self._gather = self._real = None
        if pads:  # one pass of array ops over every sequence (a Python loop over them cost ~0.3 ms a batch of 64)
            n = np.asarray([x for members in calls for x in members])  # (S,) the sequences, sorted
            width = np.repeat([w for w, _ in self.calls], [c for _, c in self.calls])  # (S,) their calls' widths
            seq = np.repeat(np.arange(len(n)), width)  # (P,) each padded row's sequence
            t = np.arange(len(seq)) - np.repeat(np.cumsum(width) - width, width)  # (P,) its place in its sequence
            # the row of sorted tokens it takes: sequence start + t, and a pad repeats the sequence's first row
            self._gather = np.repeat(np.cumsum(n) - n, width) + np.where(t < n[seq], t, 0)
            self._real = np.flatnonzero(t < n[seq])  # (N,) the padded rows that are real tokens, in order
        self._cache: dict[tuple[str, torch.device], Tensor] = {}

    def _tensor(self, name: str, value: np.ndarray, device) -> Tensor:
        key = (name, torch.device(device))
        if key not in self._cache:
            self._cache[key] = to_device(torch.as_tensor(value), device)
        return self._cache[key]

    def gather(self, x: Tensor) -> Tensor:
        """(N, *) sorted token rows -> (P, *) the calls' padded layout."""
        return x if self._gather is None else x.index_select(0, self._tensor("gather", self._gather, x.device))

    def real(self, x: Tensor) -> Tensor:
        """(P, *) -> (N, *): gather's inverse on the real tokens."""
        return x if self._real is None else x.index_select(0, self._tensor("real", self._real, x.device))

    def key_mask(self, i: int, device) -> Tensor | None:
        """Call i's key padding mask (count, width), True at pads; None when its sequences fill the width."""
        m = self._masks[i]
        return None if m is None else self._tensor(f"mask{i}", m, device)  # (count, width) True at pads


def varlen_attention(mha, qkv: Tensor, seqlens: SeqLens, attn_mask: Tensor | None = None,
                     call_cost: int = CALL_COST) -> Tensor:
    """Self-attention of each sequence on its own: qkv (N, 3E) = [q | k | v] projected -> (N, E), merged heads.

    `mha` is the MultiHeadAttention whose kernel, rotary and position_bias hooks apply (see the module
    docstring for the two ways it runs). attn_mask: None or a (L, L) mask over positions (e.g. causal), of
    which each sequence of length n takes the top-left (n, n) block, as its real tokens in a right-padded
    batch would. call_cost: the fallback's cost of one more kernel call (CALL_COST; 0: a call per distinct
    length, no padding at all). Equal to the padded computation at the real tokens (tests/test_varlen.py).
    """
    N, H, d = qkv.size(0), mha.num_heads, mha.head_dim
    E = H * d
    qkv = qkv.view(N, 3, H, d)
    if _flash_applies(mha, qkv, attn_mask):
        q, k, v = qkv.unbind(1)  # (N, H, d) each
        if mha.rotary is not None:
            q, k = mha.rotary.rotate_packed(q, k, seqlens.positions(q.device), seqlens.max_seqlen)
        cu = seqlens.cu_seqlens(q.device)
        out = _flash_varlen()(q, k, v, cu, cu, seqlens.max_seqlen, seqlens.max_seqlen)  # (N, H, d)
        return out.reshape(N, E)
    plan = seqlens.plan(call_cost // E)  # per score x heads x head_dim -> per score
    rows = plan.gather(seqlens.sort(qkv))  # (P, 3, H, d): longest first, each call's sequences padded to its width
    outs, start = [], 0
    for i, (n, count) in enumerate(plan.calls):
        block = rows[start : start + n * count].view(count, n, 3, H, d)
        start += n * count
        q, k, v = block.permute(2, 0, 3, 1, 4).unbind(0)  # (count, H, n, d) each
        if mha.rotary is not None:
            q, k = mha.rotary(q, k)
        bias = mha.position_bias(n, n) if mha.position_bias is not None else None  # (H, n, n)
        kpm = plan.key_mask(i, q.device)  # (count, n) True at pads, or None (equal lengths)
        mask = None
        if attn_mask is not None or bias is not None or kpm is not None:
            m = attn_mask[:n, :n] if attn_mask is not None else None
            mask = merge_masks(m, kpm, batch=count, num_heads=H, L_q=n, L_k=n, dtype=q.dtype, bias=bias)
        out, _ = mha.attention(q, k, v, mask=mask, need_weights=False)  # (count, H, n, d)
        outs.append(out.transpose(1, 2).reshape(count * n, E))  # (count * n, E), rows in sequence order
    return seqlens.unsort(plan.real(torch.cat(outs)))  # (P, E) -> (N, E) real tokens, sorted -> batch order


def varlen_applies(mha, attn_mask: Tensor | None) -> bool:
    """Whether `mha` can attend per sequence (varlen_attention): its kernel computes each sequence alone the
    same way (kernels say so with `per_sequence = True`), and the mask is None or one (L, L) for all."""
    if mha.explicit or not getattr(mha.attention, "per_sequence", False):
        return False
    if mha.bias_k is not None or mha.add_zero_attn:  # keys appended to every sequence: the padded path has them
        return False
    return attn_mask is None or (attn_mask.dim() == 2 and attn_mask.size(0) == attn_mask.size(1))


def _flash_applies(mha, qkv: Tensor, attn_mask: Tensor | None) -> bool:
    """PyTorch's varlen kernel covers plain softmax attention on CUDA in half precision, without dropout
    (it has none), mask or bias; its scale is 1/sqrt(d), the same as ours. Kernels that are that softmax say
    so with `softmax_varlen = True` (attention.ScaledDotProductAttention)."""
    kernel = mha.attention
    return (qkv.is_cuda and qkv.dtype in (torch.float16, torch.bfloat16) and _flash_varlen() is not None
            and getattr(kernel, "softmax_varlen", False) and not (kernel.training and kernel.dropout.p > 0)
            and attn_mask is None and mha.position_bias is None)
