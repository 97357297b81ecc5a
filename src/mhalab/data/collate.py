"""Encoded examples, the collates that pad them into batches or pack them back to back, and the padding
fraction of batches."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from mhalab.nn.varlen import SeqLens


class EncodedSplit(Dataset):
    """Token ids of a split stored flat (one int32 tensor + offsets): IMDB at 512 tokens would be
    ~12M Python ints as lists of lists, ten times the memory."""

    def __init__(self, ids: Tensor, offsets: Tensor, labels: Tensor):
        self.ids, self.offsets, self.labels = ids, offsets, labels
        self.lengths = (offsets[1:] - offsets[:-1]).tolist()
        # host ints for __getitem__: indexing the tensors with i costs ~5 ATen ops an example (select, item),
        # ~1,100 ops a batch of 64 with the collate's, most of the data time of an SST-2 step
        self._bounds, self._labels = offsets.tolist(), labels.tolist()

    @classmethod
    def from_lists(cls, ids: Sequence[Sequence[int]], labels: Sequence[int]) -> EncodedSplit:
        return cls.from_chunks([ids], labels)

    @classmethod
    def from_chunks(cls, chunks: Iterable[Sequence[Sequence[int]]], labels: Sequence[int]) -> EncodedSplit:
        """From the ids of consecutive runs of examples, each run flattened as it comes: a split encoded chunk by
        chunk never holds all its ids as Python ints (and the tokenizer's objects) at once. Encoding IMDB whole
        peaked at ~1 GB more than chunked, which the allocator then kept (scripts/memory_curve.py parts)."""
        flats, lengths = [], []
        for ids in chunks:
            sizes = [len(x) for x in ids]
            flats.append(np.fromiter(itertools.chain.from_iterable(ids), np.int32, sum(sizes)))
            lengths += sizes
        lengths = torch.tensor(lengths, dtype=torch.long)
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
        offsets[1:] = lengths.cumsum(0)
        flat = torch.from_numpy(np.concatenate(flats) if flats else np.zeros(0, np.int32))
        return cls(flat, offsets, torch.tensor(labels, dtype=torch.long))

    def state(self) -> dict[str, Tensor]:
        return {"ids": self.ids, "offsets": self.offsets, "labels": self.labels}

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        return self.ids[self._bounds[i] : self._bounds[i + 1]], self._labels[i]


class Collate:
    """Pads a list of (ids, label) to the longest in the batch, or to `pad_to` (fixed-length
    batches, only to measure what dynamic padding saves). A class, not a closure, so DataLoader
    workers can pickle it.

    A batch: input_ids (B, L), padding_mask (B, L) True at pads, labels (B,), lengths (B,), seqlens (the
    lengths on the host, nn.varlen.SeqLens), and num_tokens, the real (non-pad) tokens as a Python int.
    The host values are counted here, on the CPU, so that the training side (the model's shapes, the
    throughput monitor, the FLOPs per batch) reads them without a host sync of a device tensor
    (Lightning's device transfer moves tensors only; an int or a SeqLens stays as it is)."""

    def __init__(self, pad_id: int = 0, pad_to: int | None = None):
        self.pad_id, self.pad_to = pad_id, pad_to

    def __call__(self, items: Sequence[tuple[Tensor, int]]) -> dict[str, Tensor | int]:
        lengths = torch.tensor([len(ids) for ids, _ in items], dtype=torch.long)
        width = self.pad_to or int(lengths.max())
        if int(lengths.max()) > width:
            raise ValueError(f"an example has {int(lengths.max())} tokens, more than pad_to={width}.")
        # (B, longest): one call, not a copy per row
        input_ids = pad_sequence([ids for ids, _ in items], batch_first=True, padding_value=self.pad_id).long()
        if input_ids.size(1) < width:  # pad_to: fixed-length batches
            input_ids = F.pad(input_ids, (0, width - input_ids.size(1)), value=self.pad_id)  # (B, width)
        return {
            "input_ids": input_ids,
            "padding_mask": torch.arange(width)[None, :] >= lengths[:, None],  # True at pads
            "labels": torch.tensor([label for _, label in items], dtype=torch.long),
            "lengths": lengths,
            "num_tokens": int(lengths.sum()),
            "seqlens": SeqLens(lengths.tolist()),  # the same lengths as host ints (SequenceClassifier.forward)
        }


class PackedCollate:
    """Lays a list of (ids, label) back to back, no padding (data.batching=packed): input_ids (N,), the B
    sequences' ids concatenated, with seqlens (nn.varlen.SeqLens: their lengths as host ints, so the model
    finds every shape without a device sync), labels (B,), lengths (B,) and num_tokens N as a Python int.
    SequenceClassifier(input_ids, seqlens=seqlens) computes the logits of the padded batch, on real tokens."""

    def __call__(self, items: Sequence[tuple[Tensor, int]]) -> dict[str, Tensor | int | SeqLens]:
        lengths = [len(ids) for ids, _ in items]
        return {
            "input_ids": torch.cat([ids for ids, _ in items]).long(),  # (N,)
            "seqlens": SeqLens(lengths),
            "labels": torch.tensor([label for _, label in items], dtype=torch.long),
            "lengths": torch.tensor(lengths, dtype=torch.long),
            "num_tokens": sum(lengths),
        }


def padding_fraction(batches: Iterable[dict[str, Tensor]]) -> float:
    """Pad positions / all positions over batches (compute spent on nothing)."""
    pad = total = 0
    for batch in batches:
        if "padding_mask" not in batch:  # packed: no pads
            total += batch["num_tokens"]
            continue
        pad += int(batch["padding_mask"].sum())
        total += batch["padding_mask"].numel()
    return pad / max(total, 1)
