"""A batch sampler that buckets by length, shards across ranks itself, and resumes mid-epoch.

Training order for epoch e (bucketing=True), seeded by (seed, e) so every rank computes the same:
  1. shuffle all indices;
  2. cut them into chunks of `bucket_batches * batch_size` and sort each chunk by length, so each
     batch holds examples of similar length (little padding) but a batch's content stays random;
  3. cut into batches and shuffle the batches (long and short batches interleave);
  4. rank r of W takes batches r, r+W, r+2W, ... of the first W * (n // W), so every rank gets the
     same number of disjoint batches (the < W left over differ from epoch to epoch).
bucketing=False skips step 2 (plain shuffled batches). shuffle=False (evaluation) yields the
indices sorted by length, longest first (fast, deterministic, and any OOM shows up at once).
PackedBatchSampler (data.batching=packed) cuts the shuffled order by tokens instead (see there).

Because the sampler shards by itself, train with Lightning's `use_distributed_sampler=False`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class LengthBatchSampler(Sampler[list[int]]):
    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        shuffle: bool = True,
        bucketing: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        bucket_batches: int = 50,
        shard: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size, self.shuffle, self.bucketing, self.drop_last = batch_size, shuffle, bucketing, drop_last
        self.seed, self.bucket_batches, self.shard = seed, bucket_batches, shard
        # rank/world_size given explicitly (tests, custom launchers) win over torch.distributed,
        # which is read at __iter__ time because Lightning initialises it after the loaders exist.
        self._rank, self._world_size = rank, world_size
        self.epoch = 0
        self.batches_yielded = 0  # in the current (or last) pass over this rank's batches
        self._skip = 0  # batches to skip on the next pass (set by load_state_dict)

    def _shard(self) -> tuple[int, int]:
        if not self.shard:
            return 0, 1
        rank, world = _rank_and_world()
        return (rank if self._rank is None else self._rank), (world if self._world_size is None else self._world_size)

    def _num_global_batches(self) -> int:
        n, b = len(self.lengths), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def global_batches(self, epoch: int | None = None) -> list[list[int]]:
        """All ranks' batches of an epoch, before sharding."""
        epoch = self.epoch if epoch is None else epoch
        n, b = len(self.lengths), self.batch_size
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(n)
            if self.bucketing:
                chunks = np.split(order, range(b * self.bucket_batches, n, b * self.bucket_batches))
                order = np.concatenate([c[np.argsort(-self.lengths[c], kind="stable")] for c in chunks])
        else:
            order = np.argsort(-self.lengths, kind="stable") if self.bucketing else np.arange(n)
        batches = [order[i : i + b].tolist() for i in range(0, n, b)][: self._num_global_batches()]
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's batches of an epoch (all of them, ignoring any resume point)."""
        rank, world = self._shard()
        batches = self.global_batches(epoch)
        return batches[rank : len(batches) // world * world : world] if world > 1 else batches

    def __len__(self) -> int:
        return self._num_global_batches() // self._shard()[1]

    def __iter__(self) -> Iterator[list[int]]:
        batches, start = self.batches(), self._skip
        self._skip, self.batches_yielded = 0, start
        for batch in batches[start:]:
            self.batches_yielded += 1
            yield batch

    @property
    def sampler(self) -> LengthBatchSampler:
        # Lightning calls set_epoch() on `loader.sampler` and `loader.batch_sampler.sampler`, never on
        # the batch sampler itself: expose ourselves there so every epoch gets a new order.
        return self

    def set_epoch(self, epoch: int) -> None:
        # Lightning calls this at every epoch start, including the one being resumed: keep the
        # resume point for that epoch, drop it for any other.
        if epoch != self.epoch:
            self._skip = 0
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_yielded": self.batches_yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume: the next pass over epoch `state["epoch"]` skips the batches already consumed."""
        self.epoch, self.batches_yielded = int(state["epoch"]), int(state["batches_yielded"])
        self._skip = self.batches_yielded

    def padding_fraction(self, epoch: int | None = None, pad_to: int | None = None) -> float:
        """Fraction of pad positions this rank's batches will have (from lengths, no tensors built)."""
        pad = total = 0
        for batch in self.batches(epoch):
            lens = self.lengths[batch]
            width = pad_to or int(lens.max())
            pad += int((width - lens).sum())
            total += width * len(batch)
        return pad / max(total, 1)


class PackedBatchSampler(LengthBatchSampler):
    """Batches of about the same number of real tokens, sequences in plain random order (data.batching=packed).

    Epoch e: shuffle all indices (seeded by (seed, e), as the other modes), then cut that order into K batches
    of consecutive sequences at the token quantiles: batch k ends at the first sequence where the running
    token count reaches (k + 1) / K of the epoch's tokens. So every batch holds total / K tokens give or take
    one sequence, whatever its lengths, and a batch's content is a plain shuffle's (no length sorting across
    the data set, unlike bucketing). The packed collate lays them back to back with no padding.
    K is the number of batches the other modes give (ceil(n / batch_size), or n // batch_size with
    drop_last), so steps per epoch and the lr schedule are the same; tokens_per_batch=T sets K = ceil(total /
    T) instead. Within a batch the indices are sorted by length, longest first: the order varlen attention
    visits them in (nn.varlen.SeqLens), so equal lengths run as one call with no gather. Sharding and
    mid-epoch resume are the parent's (whole batches per rank, batches_yielded).
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, *, tokens_per_batch: int | None = None, **kwargs):
        super().__init__(lengths, batch_size, shuffle=True, bucketing=False, **kwargs)
        if tokens_per_batch is not None and tokens_per_batch < 1:
            raise ValueError(f"tokens_per_batch must be >= 1 or null, got {tokens_per_batch}.")
        self.tokens_per_batch = tokens_per_batch

    def _num_global_batches(self) -> int:
        if self.tokens_per_batch is None:
            return super()._num_global_batches()
        return max(1, min(len(self.lengths), -(-int(self.lengths.sum()) // self.tokens_per_batch)))

    def global_batches(self, epoch: int | None = None) -> list[list[int]]:
        epoch = self.epoch if epoch is None else epoch
        n, k = len(self.lengths), self._num_global_batches()
        if n == 0:
            return []
        order = np.random.default_rng([self.seed, epoch]).permutation(n)
        tokens = np.cumsum(self.lengths[order])  # (n,) tokens up to and including each sequence
        targets = tokens[-1] * np.arange(1, k) / k  # (k - 1,) where batches 0 .. k-2 end
        ends = np.searchsorted(tokens, targets) + 1  # exclusive end of each of those batches
        # at least one sequence per batch: ends strictly increasing, leaving one sequence for each later batch
        ends = np.maximum.accumulate(np.maximum(ends - np.arange(1, k), 0)) + np.arange(1, k)
        ends = np.minimum(ends, n - k + np.arange(1, k))
        batches = np.split(order, ends)
        return [b[np.argsort(-self.lengths[b], kind="stable")].tolist() for b in batches]

    def padding_fraction(self, epoch: int | None = None, pad_to: int | None = None) -> float:
        return 0.0  # laid back to back (PackedCollate): no pads at all
