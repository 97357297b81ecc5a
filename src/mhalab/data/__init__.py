"""Data: real text-classification sets, or the user's own files (data=files) -> checked rows -> tokenizer ->
length-bucketed batches.

The names below load on first use (PEP 562, as in `mhalab`): the tokenizer and the collate need neither Lightning
nor the data modules, so `from mhalab.data import train_tokenizer` starts in a tenth of a second, not in seconds.
"""

from __future__ import annotations

import importlib

_HOME = {
    "mhalab.data.collate": ("Collate", "EncodedSplit", "padding_fraction"),
    "mhalab.data.datamodule": ("TextClassificationDataModule",),
    "mhalab.data.holdout": ("stratified_holdout",),
    "mhalab.data.own_files": ("OwnFilesDataModule",),
    "mhalab.data.sampler": ("LengthBatchSampler",),
    "mhalab.data.tokenizer": ("CLS_ID", "PAD_ID", "SPECIALS", "byte_tokenizer", "encode_texts", "load_tokenizer",
                              "train_tokenizer"),
}
__all__ = [name for names in _HOME.values() for name in names]


def __getattr__(name: str):
    module = next((m for m, names in _HOME.items() if name in names), None)
    if module is None:
        raise AttributeError(f"module 'mhalab.data' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
