"""Reading raw splits with HF `datasets` and checking them: files, columns, labels, texts.

Every check raises a one-line ValueError / FileNotFoundError that names the bad value and the fix.
The cheap ones (directory, files, header columns) run before any data is loaded or tokenizer trained.
"""

from __future__ import annotations

import csv
import gzip
import json
import logging
import os
from pathlib import Path

import datasets

log = logging.getLogger(__name__)

DATA_DIR_ENV = "MHALAB_DATA_DIR"
FORMATS = ("csv", "json", "parquet")


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path | None:
    """The configured data directory, else $MHALAB_DATA_DIR, else None (load from the Hub)."""
    data_dir = data_dir or os.environ.get(DATA_DIR_ENV)
    return Path(data_dir).expanduser() if data_dir else None


def check_files(name: str, data_dir: Path, files: dict[str, str]) -> dict[str, Path]:
    """Absolute path of each split's file; raise, saying where we looked, if any is missing."""
    how = (
        f"put the '{name}' files ({', '.join(files.values())}) there, or point the config at them with "
        f"data.data_dir=/path/to/data or the {DATA_DIR_ENV} environment variable"
    )
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data directory '{data_dir}' does not exist: {how}.")
    paths = {split: data_dir / rel for split, rel in files.items()}
    for split, path in paths.items():
        if not path.is_file():
            raise FileNotFoundError(f"{name} {split} file '{path}' does not exist: {how}.")
    return paths


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def read_columns(path: Path, format: str, delimiter: str = ",", quoting: int = 0) -> list[str]:
    """Column names from the header / first record / schema, without loading the file."""
    if format == "csv":
        with _open_text(path) as f:
            return next(csv.reader([f.readline().rstrip("\r\n")], delimiter=delimiter, quoting=quoting), [])
    if format == "json":
        with _open_text(path) as f:
            first = f.readline().strip()
        if not first:
            raise ValueError(f"'{path}' is empty: no rows to read; check the file.")
        if first.startswith("{"):  # JSON lines
            return list(json.loads(first))
        return load_table(path, format).column_names  # a JSON array or nested file: let `datasets` parse it
    if format == "parquet":
        import pyarrow.parquet as pq

        return pq.read_schema(path).names
    raise ValueError(f"format '{format}' is not supported; choose one of {list(FORMATS)}.")


def check_columns(where: str, present: list[str], wanted: dict[str, str]) -> None:
    """`wanted` maps a config key (text_column, label_column) to the column it names."""
    for key, column in wanted.items():
        if column not in present:
            raise ValueError(
                f"{key}='{column}' is not a column of {where}; columns present: {present}. Set data.{key} to one of them."
            )


def load_table(
    path: Path, format: str, delimiter: str = ",", quoting: int = 0, columns: list[str] | None = None,
    cache_dir: str | None = None,
) -> datasets.Dataset:
    """One file as a `datasets.Dataset`. CSV columns are all read as strings with no NA parsing:
    a label that is not an int must reach our own check (which names the row), and a text such as
    'null' or 'NA' must stay a text."""
    kwargs = {}
    if format == "csv":
        kwargs = {"delimiter": delimiter, "quoting": quoting, "na_filter": False}
        if columns:
            kwargs["features"] = datasets.Features({c: datasets.Value("string") for c in columns})
    try:
        return datasets.load_dataset(format, data_files={"data": str(path)}, split="data", cache_dir=cache_dir, **kwargs)
    except ValueError as e:
        if "corresponds to no data" not in str(e) or not columns:  # a header and no rows: our check says so
            raise
        return datasets.Dataset.from_dict({c: [] for c in columns})


def _allowed(label_names: list[str] | None, num_classes: int) -> tuple[dict, str]:
    """Lookup from every accepted label value to its index, and how to describe the accepted values."""
    index: dict = {i: i for i in range(num_classes)} | {str(i): i for i in range(num_classes)}
    if label_names:
        index |= {name: i for i, name in enumerate(label_names)}
        return index, f"{list(label_names)} (or indices 0..{num_classes - 1})"
    return index, f"the integers 0..{num_classes - 1}"


def clean_rows(
    texts: list, raw_labels: list, *, split: str, where: str, text_column: str, label_column: str,
    label_names: list[str] | None, num_classes: int, on_bad_rows: str = "error",
) -> tuple[list[str], list[int]]:
    """Texts and label indices of a split, with rows whose text is missing or blank either raised
    (on_bad_rows='error') or dropped with a WARNING (on_bad_rows='drop'). Bad labels always raise:
    dropping them would hide a label_names / num_classes misconfiguration."""
    index, allowed = _allowed(label_names, num_classes)
    out_texts, out_labels, dropped = [], [], 0
    for row, (text, label) in enumerate(zip(texts, raw_labels)):
        if text is None or not str(text).strip():
            if on_bad_rows == "drop":
                dropped += 1
                continue
            raise ValueError(
                f"{split} row {row} of {where}: text column '{text_column}' is {'missing' if text is None else 'empty'} "
                f"({text!r}); fix the file, or set data.on_bad_rows=drop to drop such rows with a warning."
            )
        key = label.strip() if isinstance(label, str) else label
        try:
            out_labels.append(index[key])
        except (KeyError, TypeError):  # TypeError: unhashable values (lists in JSON)
            raise ValueError(
                f"{split} row {row} of {where}: label {label!r} in column '{label_column}' is not one of {allowed}; "
                f"fix the file or the config's label_names / num_classes."
            ) from None
        out_texts.append(str(text))
    if dropped:
        log.warning("%s: dropped %d of %d %s rows with a missing or empty '%s' (on_bad_rows=drop)",
                    where, dropped, len(texts), split, text_column)
    if not out_texts:
        raise ValueError(f"{split} split of {where} has no usable rows ({len(texts)} read); check the file.")
    return out_texts, out_labels
