"""Data: real text-classification sets, or the user's own files (data=files) -> checked rows -> tokenizer ->
length-bucketed batches."""

from mhalab.data.collate import Collate, EncodedSplit, padding_fraction
from mhalab.data.datamodule import TextClassificationDataModule
from mhalab.data.holdout import stratified_holdout
from mhalab.data.own_files import OwnFilesDataModule
from mhalab.data.sampler import LengthBatchSampler
from mhalab.data.tokenizer import (
    CLS_ID,
    PAD_ID,
    SPECIALS,
    byte_tokenizer,
    encode_texts,
    load_tokenizer,
    train_tokenizer,
)

__all__ = [
    "CLS_ID", "PAD_ID", "SPECIALS", "Collate", "EncodedSplit", "LengthBatchSampler", "OwnFilesDataModule",
    "TextClassificationDataModule",
    "byte_tokenizer", "encode_texts", "load_tokenizer", "padding_fraction", "stratified_holdout", "train_tokenizer",
]
