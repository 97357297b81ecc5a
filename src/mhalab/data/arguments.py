"""The datamodule's argument checks, at construction: a config that cannot work fails in one line
(a ConfigError naming the key and the fix) before any file is read or tokenizer trained."""

from __future__ import annotations

from mhalab.data.reading import FORMATS, check_encoding_name
from mhalab.data.tokenizer import KINDS, SPECIALS, min_vocab_size
from mhalab.errors import ConfigError

SPLITS = ("train", "validation", "test")  # the splits a data set may have; train is required
BATCHINGS = ("bucketed", "shuffled", "packed")  # how training batches are drawn (data/sampler.py)


def check_arguments(dm, num_classes: int | None, label_names: list | None) -> str:
    """Check a TextClassificationDataModule's settings (its attributes, and the two label arguments);
    return the canonical name of its encoding ('UTF8' -> 'utf-8': one cache key for one codec)."""
    def bad(msg):
        raise ConfigError(f"data config '{dm.name}': {msg}")

    encoding = check_encoding_name(dm.encoding, f"data config '{dm.name}'")
    if dm.format not in FORMATS:
        bad(f"format='{dm.format}' is not supported; choose one of {list(FORMATS)}.")
    if "train" not in dm.files or set(dm.files) - set(SPLITS):
        bad(f"files must map 'train' (and optionally 'validation', 'test') to files; got {sorted(dm.files)}.")
    if dm.on_bad_rows not in ("error", "drop"):
        bad(f"on_bad_rows='{dm.on_bad_rows}' is not supported; choose 'error' or 'drop'.")
    if dm.tokenizer_kind not in KINDS:
        bad(f"tokenizer_kind='{dm.tokenizer_kind}' is not supported; choose one of {list(KINDS)}.")
    if dm.target_vocab_size < min_vocab_size(dm.tokenizer_kind):
        bad(f"vocab_size={dm.target_vocab_size} is below the minimum {min_vocab_size(dm.tokenizer_kind)} for "
            f"tokenizer_kind={dm.tokenizer_kind} ({len(SPECIALS)} special tokens {SPECIALS}"
            f"{' + 256 byte symbols' if dm.tokenizer_kind == 'bpe' else ' + at least one token'}); raise vocab_size.")
    if dm.max_len < 3:
        bad(f"max_len={dm.max_len} is too small: it must be >= 3 ([CLS], [SEP] and one token); raise max_len.")
    if dm.batching not in BATCHINGS:
        bad(f"batching='{dm.batching}' is not supported; choose one of {list(BATCHINGS)} (bucketed: length-sorted "
            "chunks; shuffled: plain random batches; packed: random order, back to back, no padding).")
    if dm.batching == "packed" and dm.fixed_len:
        bad("batching=packed has no padding, so fixed_len=true (pad every batch to max_len) cannot apply; "
            "set one or the other.")
    if dm.tokens_per_batch is not None and (dm.batching != "packed" or dm.tokens_per_batch < 1):
        bad(f"tokens_per_batch={dm.tokens_per_batch} applies to batching=packed only, as an integer >= 1 (now "
            f"batching={dm.batching}); set data.batching=packed or tokens_per_batch=null.")
    if dm.batch_size < 1 or dm.eval_batch_size < 1:
        bad(f"batch_size={dm.batch_size} / eval_batch_size={dm.eval_batch_size} must be >= 1.")
    if label_names is None and num_classes is None and not dm.infers_labels:
        bad("set num_classes (integer labels 0..num_classes-1) or label_names (string labels).")
    if label_names is not None and num_classes is not None and len(label_names) != num_classes:
        bad(f"num_classes={num_classes} but label_names has {len(label_names)} names {list(label_names)}.")
    if dm.dev_split is not None and not 0.0 < dm.dev_split < 1.0:
        bad(f"dev_split={dm.dev_split} must be a fraction in (0, 1), e.g. 0.1, or null"
            + (" (this data set has a validation file: null uses it)." if "validation" in dm.files else "."))
    if dm.dev_split and "validation" in dm.files:
        bad(f"dev_split={dm.dev_split} but files already has a validation split: set one or the other.")
    if not dm.dev_split and "validation" not in dm.files:
        bad("there is no validation split: add files.validation, or set dev_split (e.g. 0.1) to hold one out "
            "of train (the test split is never used for model selection).")
    return encoding
