"""A seeded, stratified dev hold-out from train, for data sets that ship no validation split (TREC,
IMDB): model selection must never look at the test split."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def stratified_holdout(labels: Sequence[int], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, dev indices), both sorted: round(fraction * n_c) random examples of each
    class c go to dev, so class proportions match train's to within one example per class. IMDB's
    file is sorted by label, which is why a plain head/tail split would not do."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"dev_split must be a fraction in (0, 1), e.g. 0.1, got {fraction}.")
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    dev = []
    for c in np.unique(labels):  # sorted: the same classes draw the same numbers for a seed
        members = np.flatnonzero(labels == c)
        dev.append(rng.permutation(members)[: int(len(members) * fraction + 0.5)])
    is_dev = np.zeros(len(labels), dtype=bool)
    is_dev[np.concatenate(dev)] = True
    return np.flatnonzero(~is_dev).tolist(), np.flatnonzero(is_dev).tolist()
