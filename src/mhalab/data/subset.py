"""A TextClassificationDataModule that keeps a seeded, stratified subset of each split.

For CPU-sized runs on big sets (byte-level IMDB at 25k train / 25k test): `max_examples` maps a split
to the number of examples to keep, e.g. {train: 3000, validation: 1000, test: 2000}. Subsets are drawn
after the dev hold-out, per class (the same rule as `stratified_holdout`, so class proportions are
kept: IMDB's files are sorted by label and a head would be one class), with the data seed; the
tokenizer is trained on the train subset. Lightning's `limit_{val,test}_batches` is no substitute:
evaluation batches are sorted by length, so a limit keeps the longest texts, and among equal
(truncated) lengths the file order, i.e. one class.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from mhalab.data.datamodule import SPLITS, TextClassificationDataModule
from mhalab.data.holdout import stratified_holdout
from mhalab.errors import ConfigError

log = logging.getLogger(__name__)


class SubsetDataModule(TextClassificationDataModule):
    def __init__(self, *args, max_examples: dict[str, int | None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        wanted = {str(k): (int(v) if v is not None else None) for k, v in dict(max_examples or {}).items()}
        bad = set(wanted) - set(SPLITS)
        if bad or any(v is not None and v < 1 for v in wanted.values()):
            raise ConfigError(f"data config '{self.name}': max_examples must map splits {list(SPLITS)} to counts >= 1 "
                             f"(or null for all), got {wanted}.")
        self.max_examples = {k: v for k, v in wanted.items() if v is not None}

    def read_splits(self):
        raw = super().read_splits()
        for split, n in self.max_examples.items():
            if split not in raw:
                raise ConfigError(f"{self.name}: max_examples names split '{split}', which this data set lacks "
                                 f"(splits: {sorted(raw)}).")
            texts, labels = raw[split]
            if n >= len(labels):
                continue
            _, keep = stratified_holdout(labels, n / len(labels), self.seed)
            raw[split] = ([texts[i] for i in keep], [labels[i] for i in keep])
            log.info("%s: kept a stratified subset of %d of %d %s examples (max_examples)", self.name, len(keep),
                     len(labels), split)
        return raw

    def source_config(self) -> dict:
        return dict(super().source_config(), max_examples=dict(self.max_examples) or None)

    def _cache_paths(self) -> tuple[Path, Path]:
        tok, enc = super()._cache_paths()
        if not self.max_examples:
            return tok, enc
        key = hashlib.sha256(json.dumps([self.max_examples, self.seed], sort_keys=True).encode()).hexdigest()[:8]
        return tok.with_name(f"{tok.stem}-subset{key}.json"), enc.with_name(f"{enc.name}-subset{key}")
