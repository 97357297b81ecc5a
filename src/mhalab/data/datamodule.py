"""TextClassificationDataModule: files (or the Hub) -> checked rows -> tokenizer -> cached ids -> batches.

Configured entirely by plain arguments, so Hydra builds it from a YAML with `_target_`. The work:
  validate()      before anything is loaded: data directory, files, header columns and delimiter,
                  and, unless the cache is complete already, one pass over each text file (gzip
                  stream intact, every byte valid in `encoding`; IMDB: 0.32 s for its two files);
  prepare_data()  read splits with HF `datasets`, check rows, hold out a dev split if asked, train
                  the tokenizer on train only, encode every split; tokenizer and ids are cached on
                  disk under a hash of the data files (size, mtime) and every setting that changes
                  them, so a second run (and every DDP rank) only loads;
  setup()         load tokenizer and ids from the cache, log counts and padding statistics.
source_config() is the data config that rebuilds the same data set from anywhere (checkpoints keep it).
Argument checks: data/arguments.py; cache paths: data/cache.py; user files with nothing configured
but their paths (data=files): data/own_files.py.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import time
from collections import Counter
from pathlib import Path

import lightning as L
import torch
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from mhalab.data.arguments import SPLITS, check_arguments
from mhalab.data.cache import CACHE_DIR_ENV, CACHE_VERSION, cache_paths, locked, write_atomic
from mhalab.data.collate import Collate, EncodedSplit, PackedCollate
from mhalab.data.holdout import stratified_holdout
from mhalab.data.reading import (
    DATA_DIR_ENV,
    check_columns,
    check_files,
    check_stream,
    clean_rows,
    file_line,
    load_table,
    read_columns,
    resolve_data_dir,
)
from mhalab.data.sampler import LengthBatchSampler, PackedBatchSampler
from mhalab.data.tokenizer import CLS_ID, PAD_ID, encode_texts, load_tokenizer, train_tokenizer
from mhalab.errors import DataError

log = logging.getLogger(__name__)
ENCODE_CHUNK = 2048  # texts encoded at a time when the cache is built (EncodedSplit.from_chunks)

__all__ = ["CACHE_DIR_ENV", "CACHE_VERSION", "SPLITS", "TextClassificationDataModule"]


class TextClassificationDataModule(L.LightningDataModule):
    """Source: `files` maps 'train' (required), 'validation', 'test' to paths relative to `data_dir`
    (else $MHALAB_DATA_DIR), read as `format` csv (with `delimiter`, `quoting`: 3 = csv.QUOTE_NONE),
    json (JSON lines, .gz too) or parquet; csv and json text is decoded as `encoding` (utf-8, or the
    file's: latin-1, cp1252, ...). With no data directory at all, `hub` = {path, name, revision,
    splits: {our split: hub split}} loads through datasets.load_dataset; then only the keys of `files`
    matter. Labels: ints 0..num_classes-1, or strings mapped to their index in `label_names`.
    No validation file (absent or null): `dev_split` holds out a seeded stratified fraction of train.

    After setup(): `.tokenizer`, `.vocab_size`, `.pad_id`, `.cls_id`, `.num_classes`, `.label_names`,
    `.splits` (EncodedSplit per split), `.tokenizer_json()`. Train under Lightning with
    `use_distributed_sampler=False`: the batch sampler shards across ranks itself.
    """

    def __init__(
        self, name: str, files: dict[str, str], text_column: str = "text", label_column: str = "label",
        num_classes: int | None = None, label_names: list[str] | None = None, data_dir: str | None = None,
        format: str = "csv", delimiter: str = ",", quoting: int = 0, encoding: str = "utf-8",
        hub: dict | None = None, dev_split: float | None = None, seed: int = 42,
        tokenizer_kind: str = "wordpiece", vocab_size: int = 8000, lowercase: bool = True, min_frequency: int = 2,
        cache_dir: str | None = None, max_len: int = 128, batch_size: int = 32, eval_batch_size: int | None = None,
        batching: str = "bucketed", bucket_batches: int = 50, tokens_per_batch: int | None = None,
        fixed_len: bool = False, drop_last: bool = False,
        num_workers: int = 0, pin_memory: bool | None = None, on_bad_rows: str = "error",
    ):
        super().__init__()
        # Hydra hands over DictConfig / ListConfig: make them plain so they hash and pickle simply.
        # A split set to null is absent (a config that extends another drops the parent's split so).
        self.name, self.files = name, {str(k): str(v) for k, v in dict(files).items() if v is not None}
        self.text_column, self.label_column = text_column, label_column
        self.data_dir, self.format, self.delimiter, self.quoting = data_dir, format, delimiter, quoting
        self.encoding = encoding
        self.hub = {k: (dict(v) if hasattr(v, "items") else v) for k, v in dict(hub).items()} if hub else None
        self.dev_split, self.seed = dev_split, seed
        self.tokenizer_kind, self.target_vocab_size = tokenizer_kind, vocab_size
        self.lowercase, self.min_frequency = lowercase, min_frequency
        self.max_len, self.batch_size = max_len, batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.batching, self.bucket_batches, self.tokens_per_batch = batching, bucket_batches, tokens_per_batch
        self.fixed_len, self.drop_last = fixed_len, drop_last
        self.num_workers, self._pin_memory_setting = num_workers, pin_memory
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.on_bad_rows = on_bad_rows
        self.encoding = check_arguments(self, num_classes, label_names)  # before anything is read
        self._set_labels(num_classes, label_names)
        cache_root = cache_dir or os.environ.get(CACHE_DIR_ENV) or "~/.cache/mhalab"
        self.cache_root = Path(cache_root).expanduser()

        self.tokenizer: Tokenizer | None = None
        self.splits: dict[str, EncodedSplit] = {}
        self.train_sampler: LengthBatchSampler | None = None
        self._pending_sampler_state: dict | None = None
        self._paths: dict[str, Path] | None = None

    # ------------------------------------------------------------------ checks

    infers_labels = False  # OwnFilesDataModule: null num_classes and label_names mean "the train split's labels"

    def _set_labels(self, num_classes: int | None, label_names: list | None, names_only: bool = False) -> None:
        """Classes from the config: integer labels 0..num_classes-1, or names (a row may give the index too,
        unless `names_only`: labels inferred from train match their names only). Both None: not known yet."""
        if num_classes is None and not label_names:
            self.num_classes = self.label_names = None
        else:
            self.num_classes = num_classes if num_classes is not None else len(label_names)
            self.label_names = [str(n) for n in label_names] if label_names else [str(i) for i in range(self.num_classes)]
        self._labels_are_names, self._names_only = bool(label_names), names_only

    def check_paths(self) -> dict[str, Path] | None:
        """Each split's file, checked to exist (nothing is read): validate()'s first check, and the one a run makes
        before its run dir exists (mhalab.train.config.validate). None: the data set comes from the Hub."""
        data_dir = resolve_data_dir(self.data_dir)
        if data_dir is None:
            if not self.hub:
                raise DataError(
                    f"no data directory for '{self.name}': set data.data_dir=/path/to/data or the {DATA_DIR_ENV} "
                    f"environment variable (or data.hub to load from the Hugging Face Hub)."
                )
            return None
        return check_files(self.name, data_dir, self.files)

    def validate(self) -> None:
        """Checks of the source (data directory, files, header columns, delimiter), before any loading;
        then, if the cache is not complete, one pass over each csv / json file (gzip stream, encoding)."""
        self._paths = self.check_paths()
        if self._paths is None:
            return
        self._check_columns()
        self._check_streams()

    def _check_columns(self) -> None:
        for split, path in self._paths.items():
            columns = read_columns(path, self.format, self.delimiter, self.quoting, self.encoding)
            check_columns(f"{self.name} {split} file '{path}'", columns,
                          {"text_column": self.text_column, "label_column": self.label_column})

    def _check_streams(self) -> None:
        if self.format != "parquet" and not (self._cache_paths()[1] / "meta.json").exists():
            # A cached file (same size and mtime) was read in full before. JSON lines must be checked
            # here: pyarrow's reader keeps bytes that are not UTF-8, and they fail only when used.
            for path in self._paths.values():
                check_stream(path, self.encoding)

    # ------------------------------------------------------------------ cache

    def _cache_paths(self) -> tuple[Path, Path]:
        """(tokenizer JSON, encoded-ids directory), named by hashes of everything they depend on."""
        if self._paths is not None:
            source = {s: [self.files[s], p.stat().st_size, p.stat().st_mtime_ns] for s, p in self._paths.items()}
        else:
            source = {"hub": self.hub, "files": self.files}
        data = {
            "version": CACHE_VERSION, "name": self.name, "source": source, "format": self.format, "delimiter": self.delimiter,
            "quoting": self.quoting, "text": self.text_column, "label": self.label_column, "label_names": self.label_names,
            "names": self._labels_are_names, "dev_split": self.dev_split, "seed": self.seed if self.dev_split else None,
            "on_bad_rows": self.on_bad_rows,
        }
        if self.encoding != "utf-8":  # (absent for utf-8: the caches built before this key existed stay valid)
            data["encoding"] = self.encoding
        return cache_paths(self.cache_root, self.name, data, self.tokenizer_kind, self.lowercase,
                           self.target_vocab_size, self.min_frequency, self.max_len)

    @property
    def tokenizer_path(self) -> Path:
        self.validate()  # the cache key needs the files' size and mtime
        return self._cache_paths()[0]

    @property
    def encoded_dir(self) -> Path:
        """Where the encoded splits are cached: its name is a digest of the data, the tokenizer and max_len."""
        self.validate()
        return self._cache_paths()[1]

    def read_splits(self) -> dict[str, tuple[list[str], list[int]]]:
        """Checked (texts, labels) of every split, with the dev hold-out applied."""
        hf_cache = str(self.cache_root / "hf_datasets")
        wanted = {"text_column": self.text_column, "label_column": self.label_column}
        raw = {}
        for split in self.files:
            if self._paths is not None:
                path = self._paths[split]
                where = f"{self.name} file '{path}'"
                columns = read_columns(path, self.format, self.delimiter, self.quoting, self.encoding)
                table = load_table(path, self.format, self.delimiter, self.quoting, columns, hf_cache, self.encoding)
            else:  # the online path: datasets.load_dataset(path, name) and its split names
                import datasets

                hub_split = self.hub.get("splits", {}).get(split, split)
                where = f"hub data set {self.hub['path']}/{self.hub.get('name')} split '{hub_split}'"
                table = datasets.load_dataset(self.hub["path"], self.hub.get("name"), split=hub_split,
                                              revision=self.hub.get("revision"), cache_dir=hf_cache)
                check_columns(where, table.column_names, wanted)
            raw[split] = clean_rows(
                table.data.column(self.text_column).to_pylist(), table.data.column(self.label_column).to_pylist(),
                split=split, where=where, text_column=self.text_column, label_column=self.label_column,
                label_names=self.label_names if self._labels_are_names else None, num_classes=self.num_classes,
                on_bad_rows=self.on_bad_rows, names_only=self._names_only,
                line_of=(lambda row, path=path: file_line(path, self.format, row, self.delimiter, self.quoting,
                                                          self.encoding)) if self._paths is not None else None,
            )
        if self.dev_split:
            texts, labels = raw["train"]
            train_idx, dev_idx = stratified_holdout(labels, self.dev_split, self.seed)
            if not dev_idx or not train_idx:
                raise DataError(f"dev_split={self.dev_split} of {len(labels)} train rows leaves an empty "
                                f"{'validation' if not dev_idx else 'train'} split; change dev_split.")
            raw["validation"] = ([texts[i] for i in dev_idx], [labels[i] for i in dev_idx])
            raw["train"] = ([texts[i] for i in train_idx], [labels[i] for i in train_idx])
        return {split: raw[split] for split in SPLITS if split in raw}

    def _build_cache(self) -> None:
        """Create the cached tokenizer and encoded splits if they are not there yet (once: a run that wants the
        same entry meanwhile waits for it)."""
        self.validate()
        tok_path, enc_dir = self._cache_paths()
        if (enc_dir / "meta.json").exists():
            return
        with locked(enc_dir.with_suffix(".lock")):
            if not (enc_dir / "meta.json").exists():  # another run may have built it while this one waited
                self._build_entry(tok_path, enc_dir)

    def _build_entry(self, tok_path: Path, enc_dir: Path) -> None:
        t0 = time.perf_counter()
        raw = self.read_splits()
        log.info("%s: read and checked %s rows in %.1fs", self.name,
                 {s: len(t) for s, (t, _) in raw.items()}, time.perf_counter() - t0)
        tok_path.parent.mkdir(parents=True, exist_ok=True)
        if tok_path.exists():
            tokenizer = Tokenizer.from_file(str(tok_path))
        else:
            t0 = time.perf_counter()
            tokenizer = train_tokenizer(raw["train"][0], self.tokenizer_kind, self.target_vocab_size,
                                        self.lowercase, self.min_frequency)
            write_atomic(tok_path, lambda p: p.write_text(tokenizer.to_str()))
            log.info("%s: trained %s tokenizer (vocab %d) on %d train texts in %.1fs -> %s", self.name,
                     self.tokenizer_kind, tokenizer.get_vocab_size(), len(raw["train"][0]), time.perf_counter() - t0,
                     tok_path)
        enc_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        for split, (texts, labels) in raw.items():
            chunks = (encode_texts(tokenizer, texts[i:i + ENCODE_CHUNK], self.max_len)
                      for i in range(0, len(texts), ENCODE_CHUNK))
            encoded = EncodedSplit.from_chunks(chunks, labels)
            write_atomic(enc_dir / f"{split}.pt", functools.partial(torch.save, encoded.state()))
        seconds = time.perf_counter() - t0
        log.info("%s: encoded %d texts (max_len %d) in %.1fs -> %s", self.name,
                 sum(len(t) for t, _ in raw.values()), self.max_len, seconds, enc_dir)
        meta = {"splits": list(raw), "tokenizer": tok_path.name, "encode_seconds": seconds}
        write_atomic(enc_dir / "meta.json", lambda p: p.write_text(json.dumps(meta)))  # last: marks it complete

    # ------------------------------------------------------------------ Lightning hooks

    def prepare_data(self) -> None:
        # Lightning runs this on one process per node, then setup() on every rank reads the cache.
        self._build_cache()

    def setup(self, stage: str | None = None) -> None:
        if self.splits:  # fit then test: already loaded
            return
        self._build_cache()  # a no-op when prepare_data() already built it
        tok_path, enc_dir = self._cache_paths()
        self.tokenizer = Tokenizer.from_file(str(tok_path))
        meta = json.loads((enc_dir / "meta.json").read_text())
        self.splits = {s: EncodedSplit(**torch.load(enc_dir / f"{s}.pt", weights_only=True)) for s in meta["splits"]}
        self._log_statistics()

    def _log_statistics(self) -> None:
        for split, data in self.splits.items():
            lengths = torch.tensor(data.lengths, dtype=torch.float)
            counts = Counter(data.labels.tolist())
            # a text of exactly max_len tokens counts too: the cache keeps ids, not the texts' full lengths
            log.info("%s %s: %d examples, classes %s, tokens mean %.1f max %d, "
                     "%.1f%% reach max_len=%d (truncated or exactly full)",
                     self.name, split, len(data), {self.label_names[c]: counts[c] for c in sorted(counts)},
                     lengths.mean(), lengths.max(), 100 * (lengths >= self.max_len).float().mean(), self.max_len)
        pad_to = self.max_len if self.fixed_len else None
        train = self._sampler("train", train=True).padding_fraction(0, pad_to)
        val = self._sampler("validation", train=False).padding_fraction(0, pad_to)
        log.info("%s padding fraction (batch %d, %s): train %.1f%% (epoch 0), validation %.1f%%", self.name,
                 self.batch_size, "fixed max_len" if self.fixed_len else self.batching,
                 100 * train, 100 * val)

    def _split(self, split: str) -> EncodedSplit:
        if not self.splits:
            raise RuntimeError(f"{self.name}: call prepare_data() and setup() before asking for data.")
        if split not in self.splits:
            raise ValueError(f"{self.name} has no '{split}' split; configured splits: {sorted(self.splits)}.")
        return self.splits[split]

    def _sampler(self, split: str, train: bool) -> LengthBatchSampler:
        if train:
            common = {"drop_last": self.drop_last, "seed": self.seed}
            if self.batching == "packed":
                return PackedBatchSampler(self._split(split).lengths, self.batch_size,
                                          tokens_per_batch=self.tokens_per_batch, **common)
            return LengthBatchSampler(self._split(split).lengths, self.batch_size, shuffle=True,
                                      bucketing=self.batching == "bucketed", bucket_batches=self.bucket_batches,
                                      **common)
        # Evaluation: sorted by length, not shuffled, and not sharded: every rank sees every example
        # once, so metrics need no de-duplication and uneven ranks cannot hang a collective.
        return LengthBatchSampler(self._split(split).lengths, self.eval_batch_size, shuffle=False, shard=False)

    def _loader(self, split: str, sampler: LengthBatchSampler) -> DataLoader:
        # Each new iterator draws its workers' base seed from `generator`; without one it would take a draw
        # from torch's global RNG, which dropout uses too. A run resumed at an epoch's end restores that RNG
        # after its first iterator exists, so the uninterrupted run's draw for epoch 1's iterator would be
        # missing, and every later dropout mask shifted (val/loss off by ~2e-5; tests/test_faults.py).
        if isinstance(sampler, PackedBatchSampler):  # training with batching=packed: back to back, no pads
            collate = PackedCollate()
        else:
            collate = Collate(PAD_ID, self.max_len if self.fixed_len else None)
        return DataLoader(
            self._split(split), batch_sampler=sampler, collate_fn=collate,
            num_workers=self.num_workers, pin_memory=self.pin_memory, persistent_workers=self.num_workers > 0,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def shuffled_by(self, seed: int) -> TextClassificationDataModule:
        """This data module, set up, with its training batches shuffled by `seed` instead of data.seed: the same
        splits (the dev hold-out stays data.seed's) in another order. Pretraining orders its batches by
        pretrain.seed, so a cached encoder does not depend on which fine-tuning seed happened to pretrain it."""
        self.setup()
        view = copy.copy(self)  # shares the loaded splits and tokenizer; its own sampler and trainer
        view.seed, view.train_sampler, view._pending_sampler_state = seed, None, None
        return view

    def train_dataloader(self) -> DataLoader:
        self.train_sampler = self._sampler("train", train=True)
        if self._pending_sampler_state is not None:  # resuming from a checkpoint
            self.train_sampler.load_state_dict(self._pending_sampler_state)
            self._pending_sampler_state = None
        return self._loader("train", self.train_sampler)

    def val_dataloader(self) -> DataLoader:
        return self._loader("validation", self._sampler("validation", train=False))

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self._sampler("test", train=False))

    # ------------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict:
        """Saved by Lightning in every checkpoint: the tokenizer (so evaluation needs nothing else)
        and where the training sampler stands (for exact mid-epoch resume)."""
        state = {"label_names": self.label_names, "max_len": self.max_len}
        if self.tokenizer is not None:
            state["tokenizer"] = self.tokenizer_json()
        if self.train_sampler is not None:
            state["train_sampler"] = self.train_sampler.state_dict()
            # The sampler has handed out batches the trainer has not consumed yet (Lightning and
            # DataLoader workers prefetch): count the ones the training loop actually processed.
            try:
                state["train_sampler"]["batches_yielded"] = int(
                    self.trainer.fit_loop.epoch_loop.batch_progress.current.processed)
            except (AttributeError, RuntimeError):  # no trainer attached
                pass
        return state

    def load_state_dict(self, state: dict) -> None:
        if "tokenizer" in state and self.tokenizer is not None and state["tokenizer"] != self.tokenizer_json():
            log.warning("%s: the checkpoint's tokenizer differs from the one built from the data config; token ids "
                        "may not match the trained embeddings (was the cache rebuilt or the config changed?)", self.name)
        if "train_sampler" in state:
            self._pending_sampler_state = state["train_sampler"]
            if self.train_sampler is not None:
                self.train_sampler.load_state_dict(state["train_sampler"])
                self._pending_sampler_state = None

    # ------------------------------------------------------------------ the data set, reproducible

    def source_config(self) -> dict:
        """The data config as a plain dict that rebuilds this data set from any directory (mhalab-eval reads
        it from a checkpoint): every setting in force, what was inferred filled in, the data and cache
        directories absolute. Instantiated, it has the same cache paths and the same splits (dev hold-out)."""
        self.validate()  # paths, and what a data=files source infers
        data_dir = resolve_data_dir(self.data_dir) if self._paths is not None else None
        return {
            "_target_": f"{type(self).__module__}.{type(self).__qualname__}", "name": self.name,
            "files": dict(self.files), "data_dir": str(data_dir.absolute()) if data_dir else None,
            "format": self.format, "delimiter": self.delimiter, "quoting": self.quoting, "encoding": self.encoding,
            "hub": copy.deepcopy(self.hub), "text_column": self.text_column, "label_column": self.label_column,
            "num_classes": self.num_classes, "label_names": list(self.label_names) if self._labels_are_names else None,
            "dev_split": self.dev_split, "seed": self.seed, "on_bad_rows": self.on_bad_rows,
            "tokenizer_kind": self.tokenizer_kind, "vocab_size": self.target_vocab_size, "lowercase": self.lowercase,
            "min_frequency": self.min_frequency, "cache_dir": str(self.cache_root.absolute()), "max_len": self.max_len,
            "batch_size": self.batch_size, "eval_batch_size": self.eval_batch_size, "batching": self.batching,
            "bucket_batches": self.bucket_batches, "tokens_per_batch": self.tokens_per_batch,
            "fixed_len": self.fixed_len, "drop_last": self.drop_last,
            "num_workers": self.num_workers, "pin_memory": self._pin_memory_setting,
        }

    # ------------------------------------------------------------------ what the model needs

    def _tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RuntimeError(f"{self.name}: the tokenizer exists after prepare_data() and setup(); call them first.")
        return self.tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tok().get_vocab_size()

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def cls_id(self) -> int:
        return CLS_ID

    def tokenizer_json(self) -> str:
        return self._tok().to_str()

    tokenizer_from_json = staticmethod(load_tokenizer)
