"""What a user's own file holds, read from the file itself (`data=files`): its format from the extension,
a csv file's delimiter from its first lines, which columns are the text and the label, and the train
split's label set. A guess is made only where one answer is obvious; otherwise a one-line error lists
what the file has and names the key to set. Explicit settings always win: the caller asks only for what
the config left null.
"""

from __future__ import annotations

import csv
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from mhalab.data.reading import DELIMITERS, _named_errors, _open_text, is_integer_label, label_key, load_table
from mhalab.errors import ConfigError, DataError

# extension -> kind; csv, tsv and json may be gzipped (.csv.gz). tsv is csv with a tab and no quoting.
EXTENSIONS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "json", ".json": "json", ".ndjson": "json",
              ".parquet": "parquet", ".pq": "parquet"}
TEXT_NAMES = ("text", "sentence", "review", "document", "content")
LABEL_NAMES = ("label", "labels", "class", "category", "target", "y")
SAMPLE_LINES = 50  # lines read to sniff a delimiter, rows read to judge which column holds long texts
LONG_TEXT = 20  # characters: a column whose values average at least this long reads as text, not labels


def file_kind(path: Path) -> str | None:
    """'csv', 'tsv', 'json' or 'parquet' from the file's name (.gz allowed on the text formats), else None."""
    suffixes = [s.lower() for s in path.suffixes]
    gz = suffixes[-1:] == [".gz"]
    kind = EXTENSIONS.get(suffixes[-2 if gz else -1]) if len(suffixes) > gz else None
    return None if gz and kind == "parquet" else kind


def kind_of_files(paths: dict[str, Path], typed: dict[str, str]) -> str:
    """The one kind of every split's file; a ConfigError for an unknown extension or a mix of kinds."""
    kinds = {split: file_kind(path) for split, path in paths.items()}
    for split, kind in kinds.items():
        if kind is None:
            raise ConfigError(f"data.files.{split}='{typed[split]}': the format cannot be told from its name; use "
                              f"{', '.join(EXTENSIONS)} (.gz on the text formats), or set data.format=csv|json|parquet.")
    if len(set(kinds.values())) > 1:
        raise ConfigError(f"data.files are of different formats {kinds}: use one format for every split, or set "
                          f"data.format (and data.delimiter) to read them all one way.")
    return kinds["train"]


def _fields_agree(lines: list[str], delimiter: str) -> bool:
    """The header splits in two or more fields, and every complete record of the sample into as many."""
    try:
        records = list(csv.reader(lines, delimiter=delimiter))
    except csv.Error:
        return False
    if len(lines) == SAMPLE_LINES:  # the last record may continue past the sample (a quoted newline)
        records = records[:-1]
    return len(records[0]) > 1 and all(len(r) == len(records[0]) for r in records[1:] if r)


def sniff_delimiter(path: Path, encoding: str = "utf-8") -> str:
    """The delimiter of a csv file, one of , TAB ; | : csv.Sniffer's choice on the first lines if the
    header and rows split into the same number of fields with it, else the one they agree on that
    splits the header most. ',' when none does: the header check then says what it saw."""
    with _named_errors(path, encoding), _open_text(path, encoding) as f:
        lines = list(itertools.islice(f, SAMPLE_LINES))
    if not lines:
        return ","
    try:
        sniffed = csv.Sniffer().sniff("".join(lines), delimiters="".join(DELIMITERS)).delimiter
    except csv.Error:
        sniffed = None
    if sniffed and _fields_agree(lines, sniffed):
        return sniffed
    agree = [d for d in DELIMITERS if _fields_agree(lines, d)]
    return max(agree, key=lines[0].count) if agree else ","


def sample_rows(path: Path, format: str, delimiter: str, quoting: int, encoding: str) -> list[dict]:
    """The first rows of a file as dicts (to judge its columns); fewer if a row does not parse (the
    loader names that row later)."""
    if format == "parquet":
        import pyarrow.parquet as pq

        batch = next(pq.ParquetFile(path).iter_batches(batch_size=SAMPLE_LINES), None)
        return batch.to_pylist() if batch is not None else []
    rows = []
    with _named_errors(path, encoding), _open_text(path, encoding) as f:
        if format == "csv":
            try:
                rows = list(itertools.islice(csv.DictReader(f, delimiter=delimiter, quoting=quoting), SAMPLE_LINES))
            except csv.Error:
                pass
            return rows
        for line in itertools.islice((x for x in f if x.strip()), SAMPLE_LINES):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            if not isinstance(row, dict):  # a JSON array, not JSON lines: the loader's table
                table = load_table(path, format, encoding=encoding)
                return table.select(range(min(SAMPLE_LINES, len(table)))).to_list()
            rows.append(row)
    return rows


def _long_text(rows: list[dict], column: str) -> bool:
    values = [v for v in (r.get(column) for r in rows) if v is not None]
    strings = [v for v in values if isinstance(v, str) and not is_integer_label(v.strip())]
    return bool(strings) and len(strings) == len(values) and sum(map(len, strings)) / len(strings) >= LONG_TEXT


def choose_columns(where: str, columns: list[str], rows: list[dict], text_column: str | None,
                   label_column: str | None) -> tuple[str, str]:
    """(text column, label column): the given ones; else a column of a known name (text, label, ...);
    else for the text the only long-string column, for either the only column left. Not obvious: a
    DataError listing the columns."""
    def named(names, taken):
        found = [c for c in columns if c.lower() in names and c != taken]
        return found[0] if len(found) == 1 else None

    text, label = text_column, label_column
    label = label or named(LABEL_NAMES, text)
    text = text or named(TEXT_NAMES, label)
    if text is None:
        rest = [c for c in columns if c != label]
        long = [c for c in rest if _long_text(rows, c)]
        text = rest[0] if label and len(rest) == 1 else long[0] if len(long) == 1 else None
    if label is None and text is not None:
        rest = [c for c in columns if c != text]
        label = rest[0] if len(rest) == 1 else None
    if text is None or label is None:
        unknown = " and ".join(k for k, v in (("text", text), ("label", label)) if v is None)
        raise DataError(f"{where}: cannot tell which column holds the {unknown}; its columns are {columns}: set "
                        f"data.text_column=<column> and data.label_column=<column>.")
    return text, label


@dataclass(frozen=True)
class LabelSet:
    """Class i is names[i]. how: 'indices' (integers exactly 0..K-1), 'numeric' (other integers, sorted by
    value: 1..5, -1/1), or 'strings' (sorted)."""

    names: list[str]
    how: str


def infer_labels(values: list, where: str, label_column: str) -> LabelSet:
    """The label set of a train split's label column (values as label_key matches them). Missing values
    are left to the row checks, which name the row."""
    keys = {k for k in map(label_key, values) if k is not None}
    if len(keys) < 2:
        raise DataError(f"{where}: label column '{label_column}' holds {len(keys)} distinct label(s) {sorted(keys)}; "
                        f"a classifier needs at least 2: check data.label_column.")
    if all(map(is_integer_label, keys)):
        numbers = sorted(map(int, keys))
        how = "indices" if numbers == list(range(len(numbers))) else "numeric"
        return LabelSet([str(n) for n in numbers], how)
    return LabelSet(sorted(keys), "strings")
