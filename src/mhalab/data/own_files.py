"""OwnFilesDataModule: `data=files`, a text-classification set from the user's own files in one line.

    mhalab-train data=files data.files.train=news.csv [data.files.validation=dev.csv] [data.files.test=test.csv]

What the config leaves null is found from the files (mhalab.data.inference) and logged: paths are read
as typed, relative to the current directory (Hydra does not chdir) or absolute, `~` expanded; the name
comes from the train file, the format from the extensions, a csv file's delimiter is sniffed, the text
and label columns are chosen by name or shape, and the classes are the train split's labels. Without a
validation file a seeded, stratified 10% of train is held out. The rest is TextClassificationDataModule's
(checks, cache, batches); source_config() holds what was found, so a checkpoint rebuilds the same data
set (same cache, same dev split) from any directory.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
from pathlib import Path

from mhalab.data.cache import CACHE_VERSION, digest, write_atomic
from mhalab.data.datamodule import TextClassificationDataModule
from mhalab.data.inference import (
    LabelSet,
    choose_columns,
    file_kind,
    infer_labels,
    kind_of_files,
    sample_rows,
    sniff_delimiter,
)
from mhalab.data.reading import load_table, read_columns
from mhalab.errors import ConfigError, DataError

log = logging.getLogger(__name__)

DEFAULT_DEV_SPLIT = 0.1
SPLIT_FILE_NAMES = ("train", "training")  # a train file named so names its data set after its folder


def dataset_name(train: Path) -> str:
    """The train file's name without its extensions (news.csv.gz -> news); a file named for its split
    (data/news/train.csv) gives its folder's name (news), so logs and caches do not all say 'train'."""
    stem = Path(train.name[:-3]).stem if train.name.lower().endswith(".gz") else train.stem
    return train.parent.name if stem.lower() in SPLIT_FILE_NAMES and train.parent.name else stem


class OwnFilesDataModule(TextClassificationDataModule):
    """TextClassificationDataModule whose null settings are read from the files. `data_dir`, when set, is
    the folder relative paths are read from (default: the current directory), not paths.data_dir."""

    infers_labels = True

    def __init__(self, files: dict[str, str | None], name: str | None = None, data_dir: str | None = None,
                 format: str | None = None, delimiter: str | None = None, quoting: int | None = None,
                 text_column: str | None = None, label_column: str | None = None, num_classes: int | None = None,
                 label_names: list[str] | None = None, dev_split: float | None = None, hub: dict | None = None,
                 **kwargs):
        typed = {str(k): str(v) for k, v in dict(files or {}).items() if v is not None}
        if not typed.get("train"):
            raise ConfigError("data=files needs a train file: data.files.train=<path> (.csv, .tsv, .jsonl(.gz) or "
                              ".parquet; data.files.validation / data.files.test optional).")
        if hub:
            raise ConfigError(f"data=files reads local files, but data.hub={dict(hub)} is set; remove data.hub.")
        self._base = Path(data_dir).expanduser() if data_dir else Path.cwd()
        self._typed = typed
        self._own_paths = {s: Path(os.path.abspath(self._base / Path(v).expanduser())) for s, v in typed.items()}
        train = self._own_paths["train"]
        if format is None or format == "tsv":
            kind = kind_of_files(self._own_paths, typed) if format is None else "tsv"
        else:
            kind = "tsv" if format == "csv" and file_kind(train) == "tsv" else format
        format = "csv" if kind == "tsv" else kind
        if format == "csv":
            if delimiter is None and kind == "tsv":
                delimiter = "\t"  # else None: sniffed in validate(), which reads the file
            if quoting is None:  # a tsv text may start with a quote; a csv file quotes texts holding its delimiter
                quoting = csv.QUOTE_NONE if kind == "tsv" else csv.QUOTE_MINIMAL
        else:  # unused by the json and parquet readers: the base defaults, so the cache key is plain
            delimiter, quoting = delimiter or ",", quoting or 0
        if dev_split is None and "validation" not in typed:
            # files.yaml leaves dev_split null rather than 0.1, so that the base rule "dev_split and a
            # validation file: set one or the other" still refuses an explicit dev_split beside a file
            dev_split = DEFAULT_DEV_SPLIT
        super().__init__(name=name or dataset_name(train), files={s: str(p) for s, p in self._own_paths.items()},
                         text_column=text_column, label_column=label_column, num_classes=num_classes,
                         label_names=label_names, data_dir=None, format=format, delimiter=delimiter, quoting=quoting,
                         dev_split=dev_split, **kwargs)

    def check_paths(self) -> dict[str, Path]:
        for split, path in self._own_paths.items():
            try:
                found = path.is_file()
            except PermissionError:
                raise DataError(f"data.files.{split}='{self._typed[split]}' cannot be read (permission denied on "
                                f"the way to '{path}'); make it readable for this user.") from None
            if not found:
                raise DataError(f"data.files.{split}='{self._typed[split]}' does not exist (looked for '{path}'; "
                                f"relative paths are read from {self._base}); check the path.")
        return dict(self._own_paths)

    def validate(self) -> None:
        """The files exist; then, once, what the config left null is read from the train file: delimiter,
        columns, label set. Then the base checks of every file (columns, gzip stream, encoding)."""
        self._paths = self.check_paths()
        train, where = self._paths["train"], f"{self.name} train file '{self._paths['train']}'"
        if self.delimiter is None:
            self.delimiter = sniff_delimiter(train, self.encoding)
            log.info("%s: delimiter %r (sniffed from the first lines; data.delimiter overrides)", where, self.delimiter)
        if self.text_column is None or self.label_column is None:
            columns = read_columns(train, self.format, self.delimiter, self.quoting, self.encoding)
            rows = sample_rows(train, self.format, self.delimiter, self.quoting, self.encoding)
            self.text_column, self.label_column = choose_columns(where, columns, rows, self.text_column,
                                                                 self.label_column)
            log.info("%s: text column '%s', label column '%s' (of %s; data.text_column / data.label_column "
                     "override)", where, self.text_column, self.label_column, columns)
        self._check_columns()
        if self.label_names is None:
            self._infer_label_set(train, where)
        self._check_streams()

    def _infer_label_set(self, train: Path, where: str) -> None:
        """Classes from the train split's label column, read once: what was found is kept in the cache
        under a hash of the file (path, size, mtime) and its reading settings, so a second run, and
        every DDP rank, reads that instead of the file."""
        stat = train.stat()
        key = [CACHE_VERSION, str(train), stat.st_size, stat.st_mtime_ns, self.format, self.delimiter, self.quoting,
               self.encoding, self.label_column]
        memo = self.cache_root / self.name / f"labels-{digest(key)}.json"
        if memo.exists():
            found = LabelSet(**json.loads(memo.read_text()))
        else:
            columns = read_columns(train, self.format, self.delimiter, self.quoting, self.encoding)
            table = load_table(train, self.format, self.delimiter, self.quoting, columns,
                               str(self.cache_root / "hf_datasets"), self.encoding)
            found = infer_labels(table.data.column(self.label_column).to_pylist(), where, self.label_column)
            memo.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(memo, lambda p: p.write_text(json.dumps(dataclasses.asdict(found))))
        self._set_labels(len(found.names), found.names, names_only=True)
        if found.how == "numeric":
            log.info("%s: the labels are integers but not 0..%d, so they are read as names in numeric order: "
                     "class i is %s[i]", where, len(found.names) - 1, found.names)
        else:
            log.info("%s: %d classes from the train labels (%s): %s; data.label_names overrides", where,
                     len(found.names), "0..K-1" if found.how == "indices" else "sorted", found.names)

    def source_config(self) -> dict:
        return dict(super().source_config(), data_dir=None)  # the files are absolute paths there
