"""Reading raw splits with HF `datasets` and checking them: files, columns, labels, texts.

Every check raises a one-line `DataError` (a ValueError) that names the file, the row or line where
known, and the fix; the command line prints it as `error: <message>`. The checks of the files
themselves (directory, files, header columns, delimiter, gzip stream, text encoding) run before any
data is loaded or tokenizer trained; what the readers report while loading (a row with too many
fields, a JSON line that does not parse) is raised as a DataError naming the file too.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import json
import logging
import os
import re
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from mhalab.errors import ConfigError, DataError

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

DATA_DIR_ENV = "MHALAB_DATA_DIR"
FORMATS = ("csv", "json", "parquet")
GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)  # truncated, not gzip, corrupt deflate data
DELIMITERS = {",": "comma", "\t": "tab", ";": "semicolon", "|": "pipe"}  # what a one-column header is checked for
QUOTING = {0: "csv.QUOTE_MINIMAL", 1: "csv.QUOTE_ALL", 2: "csv.QUOTE_NONNUMERIC", 3: "csv.QUOTE_NONE"}
_CHUNK = 1 << 20


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
    try:
        if not data_dir.is_dir():
            raise DataError(f"data directory '{data_dir}' does not exist: {how}.")
        paths = {split: data_dir / rel for split, rel in files.items()}
        for split, path in paths.items():
            if not path.is_file():
                raise DataError(f"{name} {split} file '{path}' does not exist: {how}.")
    except PermissionError as e:  # a folder on the way that this user may not enter
        raise DataError(f"cannot read '{e.filename}' (permission denied) on the way to the '{name}' files; "
                        f"make it readable for this user, or put the files elsewhere and point data.data_dir at "
                        f"them.") from None
    return paths


def check_encoding_name(encoding: str, where: str) -> str:
    """The codec's canonical name ('UTF8' -> 'utf-8'), or a ConfigError for an unknown one."""
    try:
        return codecs.lookup(encoding).name
    except (LookupError, TypeError):
        raise ConfigError(f"{where}: encoding={encoding!r} is not a known text encoding; use e.g. utf-8, latin-1 "
                          f"or cp1252 (the file's encoding).") from None


# ---------------------------------------------------------------------- low-level reading, errors named


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _open_text(path: Path, encoding: str = "utf-8"):
    return gzip.open(path, "rt", encoding=encoding) if path.suffix == ".gz" else open(path, encoding=encoding)


def gzip_error(path: Path, e: BaseException) -> DataError:
    return DataError(f"'{path}' is not a complete gzip file (truncated or corrupt: {e}); re-download or "
                     f"re-compress it.")


def _decodes(data: bytes, encoding: str) -> bool:
    try:
        data.decode(encoding)
        return True
    except UnicodeDecodeError:
        return False


def encoding_error(path: Path, encoding: str, offset: int | None = None) -> DataError:
    """The first line of `path` that does not decode as `encoding`, found by scanning its bytes line
    by line (only after a decode failure: this reads the file again). `offset` (a byte offset in
    the decompressed stream) is the fallback for encodings whose newline is not the byte '\\n'."""
    utf8 = codecs.lookup(encoding).name == "utf-8"
    fix = "set data.encoding={} (or the file's encoding), or re-save the file as UTF-8."
    if "\n".encode(encoding) == b"\n":  # ASCII-compatible: lines are byte lines
        try:
            with _open_binary(path) as f:
                for n, line in enumerate(f, 1):
                    try:
                        line.decode(encoding)
                    except UnicodeDecodeError as e:
                        suggest = "utf-8" if not utf8 and _decodes(line, "utf-8") else "latin-1"
                        return DataError(f"'{path}': line {n} is not valid {encoding} (byte 0x{line[e.start]:02x} "
                                         f"at column {e.start + 1}); " + fix.format(suggest))
        except GZIP_ERRORS as e:
            return gzip_error(path, e)
    where = f" (at byte {offset})" if offset is not None else ""
    return DataError(f"'{path}' is not valid {encoding}{where}; " + fix.format("latin-1" if utf8 else "utf-8"))


@contextmanager
def _named_errors(path: Path, encoding: str):
    """Turn gzip and decoding failures while reading `path` ourselves into DataErrors that name it."""
    try:
        yield
    except GZIP_ERRORS as e:
        raise gzip_error(path, e) from e
    except UnicodeDecodeError as e:
        raise encoding_error(path, encoding) from e


def check_stream(path: Path, encoding: str = "utf-8") -> None:
    """Read a text file (csv, JSON lines; .gz too) to its end, decoding it: a truncated or corrupt gzip
    stream, or a byte that is not valid in `encoding`, raises a DataError naming the file (and the line).
    Costs a pass over the data: 0.32 s for IMDB's two files (35 MB each, 13 MB gzipped) on one core."""
    decoder = codecs.getincrementaldecoder(encoding)()
    offset = 0
    with _named_errors(path, encoding), _open_binary(path) as f:
        while chunk := f.read(_CHUNK):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                raise encoding_error(path, encoding, offset + e.start) from e
            offset += len(chunk)
        decoder.decode(b"", final=True)  # a multi-byte character cut off by the end of the file


# ---------------------------------------------------------------------- header and columns


def read_columns(path: Path, format: str, delimiter: str = ",", quoting: int = 0, encoding: str = "utf-8") -> list[str]:
    """Column names from the header / first record / schema, without loading the file."""
    if format == "csv":
        with _named_errors(path, encoding), _open_text(path, encoding) as f:
            header = f.readline().rstrip("\r\n")
            columns = next(csv.reader([header], delimiter=delimiter, quoting=quoting), [])
            check_delimiter(path, header, columns, delimiter, quoting)
            try:
                first = next(csv.reader(f, delimiter=delimiter, quoting=quoting), [])
            except csv.Error:  # a malformed record: the reader names its line while loading
                first = []
        # pandas reads a first row with one field too many as (index, text, label) and another
        # with more by dropping fields, both silently; from line 3 on it raises (see _load_error).
        if len(first) > len(columns):
            raise fields_error(path, 2, len(first), len(columns), delimiter, quoting)
        return columns
    if format == "json":
        with _named_errors(path, encoding), _open_text(path, encoding) as f:
            first = f.readline().strip()
        if not first:
            raise DataError(f"'{path}' is empty: no rows to read; check the file.")
        if first.startswith("{"):  # JSON lines
            try:
                return list(json.loads(first))
            except json.JSONDecodeError as e:
                raise json_error(path, encoding, str(e)) from e
        return load_table(path, format, encoding=encoding).column_names  # a JSON array or nested file
    if format == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_schema(path).names
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"'{path}' cannot be read as parquet ({e}); check data.format, or re-write the file.") from e
    raise ConfigError(f"format '{format}' is not supported; choose one of {list(FORMATS)}.")


def check_delimiter(path: Path, header: str, columns: list[str], delimiter: str, quoting: int) -> None:
    """A header that splits into one column containing another common delimiter was written with that
    one: say so (reading on would report missing columns, or pandas a bare ParserError)."""
    if len(columns) != 1:
        return
    found = [d for d in DELIMITERS if d != delimiter and d in columns[0]]
    if not found:
        return
    guess = max(found, key=columns[0].count)
    fix = f"set data.delimiter={guess!r}"
    if guess != "\t" and quoting == csv.QUOTE_NONE:  # such files quote texts that hold the delimiter
        fix += f" and data.quoting=0 ({QUOTING[0]})"
    raise DataError(f"'{path}': the header {header!r} has one column with data.delimiter={delimiter!r}; it looks "
                    f"{DELIMITERS[guess]}-separated: {fix}.")


def fields_error(path: Path, line: int, saw: int, expected: int, delimiter: str, quoting: int) -> DataError:
    settings = f"data.delimiter={delimiter!r}, data.quoting={quoting} ({QUOTING.get(quoting, '?')})"
    if quoting == csv.QUOTE_NONE:
        hint = (f"with quoting=3 a {delimiter!r} inside a text splits it: quote such texts and set data.quoting=0 "
                f"({QUOTING[0]}), or use a data.delimiter the texts lack")
    else:
        hint = f"quote the texts that contain {delimiter!r}, or check data.delimiter / data.quoting"
    return DataError(f"'{path}': line {line} has {saw} fields but the header has {expected} ({settings}); {hint}.")


def check_columns(where: str, present: list[str], wanted: dict[str, str]) -> None:
    """`wanted` maps a config key (text_column, label_column) to the column it names."""
    for key, column in wanted.items():
        if column not in present:
            raise DataError(
                f"{key}='{column}' is not a column of {where}; columns present: {present}. Set data.{key} to one of them."
            )


# ---------------------------------------------------------------------- loading


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


_FIELDS = re.compile(r"Expected (\d+) fields in line (\d+), saw (\d+)")


def json_error(path: Path, encoding: str, reason: str) -> DataError:
    """The first line of a JSON lines file that does not parse (pyarrow counts rows within a block of
    the file, not lines), found by reading it again: this runs only after a parse failure."""
    fix = "fix the file, or check data.format (json reads JSON lines: one object per line)."
    with _named_errors(path, encoding), _open_text(path, encoding) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                return DataError(f"'{path}': line {n} is not valid JSON ({e.msg} at column {e.colno}); {fix}")
    return DataError(f"'{path}' cannot be parsed as JSON lines ({reason}); {fix}")


def _load_error(path: Path, format: str, delimiter: str, quoting: int, encoding: str, error: BaseException):
    """The DataError for what a reader raised while loading `path`, or None if it is not a data problem."""
    import pandas as pd
    import pyarrow as pa

    settings = f"data.delimiter={delimiter!r}, data.quoting={quoting} ({QUOTING.get(quoting, '?')})"
    for e in _chain(error):
        if isinstance(e, GZIP_ERRORS) and path.suffix == ".gz":
            return gzip_error(path, e)
        if isinstance(e, UnicodeDecodeError):
            return encoding_error(path, encoding)
        if isinstance(e, pd.errors.ParserError):
            if m := _FIELDS.search(str(e)):
                expected, line, saw = map(int, m.groups())
                return fields_error(path, line, saw, expected, delimiter, quoting)
            reason = str(e).replace("Error tokenizing data. C error: ", "").strip()
            return DataError(f"'{path}' cannot be parsed as csv with {settings}: {reason}; check data.delimiter and "
                             f"data.quoting, or fix the file.")
        if isinstance(e, pa.ArrowInvalid) and format == "json":
            return json_error(path, encoding, str(e).strip())
        if isinstance(e, pa.ArrowInvalid) and format == "parquet":
            return DataError(f"'{path}' cannot be read as parquet ({e}); check data.format, or re-write the file.")
    return None


def load_table(
    path: Path, format: str, delimiter: str = ",", quoting: int = 0, columns: list[str] | None = None,
    cache_dir: str | None = None, encoding: str = "utf-8",
) -> datasets.Dataset:
    """One file as a `datasets.Dataset`. CSV columns are all read as strings with no NA parsing:
    a label that is not an int must reach our own check (which names the row), and a text such as
    'null' or 'NA' must stay a text. What the readers raise about the file (a truncated gzip stream,
    a byte not valid in `encoding`, a row with too many fields) becomes a DataError naming it.

    `datasets` is imported here, not at the top: a run whose splits are already encoded (the cache) never reads a
    file, and the import costs about half a second in every process (`python -X importtime`)."""
    import datasets

    kwargs = {}
    if format == "csv":
        kwargs = {"delimiter": delimiter, "quoting": quoting, "na_filter": False, "encoding": encoding}
        if columns:
            kwargs["features"] = datasets.Features({c: datasets.Value("string") for c in columns})
    elif format == "json":
        kwargs = {"encoding": encoding}
    try:
        return datasets.load_dataset(format, data_files={"data": str(path)}, split="data", cache_dir=cache_dir, **kwargs)
    except (ValueError, datasets.exceptions.DatasetGenerationError, EOFError, OSError, zlib.error) as e:
        if isinstance(e, ValueError) and "corresponds to no data" in str(e) and columns:
            return datasets.Dataset.from_dict({c: [] for c in columns})  # a header and no rows: our check says so
        error = _load_error(path, format, delimiter, quoting, encoding, e)
        if error is None:  # not something about the file: a bug, keep its traceback
            raise
        raise error from e


_INTEGER = re.compile(r"-?[0-9]+")


def is_integer_label(key: str) -> bool:
    """'3', '-1': an integer written the one way str(int) writes it ('01', '+1', '1.0' are names)."""
    return bool(_INTEGER.fullmatch(key)) and str(int(key)) == key


def label_key(value) -> str | None:
    """A label value as the name it matches: strings stripped, numbers and booleans as str() writes them
    (a JSON or parquet 1 is the name '1'); None for a missing, blank or non-scalar value."""
    if isinstance(value, str):
        return value.strip() or None
    return str(value) if isinstance(value, (int, float, bool)) else None


def _allowed(label_names: list[str] | None, num_classes: int, names_only: bool = False) -> tuple[dict, str, str]:
    """Lookup from every accepted label value to its index, how to describe the accepted values, the fix."""
    if names_only:  # names inferred from train: a value matches its name only (label_key), never an index
        return ({name: i for i, name in enumerate(label_names)}, f"the train split's labels {list(label_names)}",
                "fix the file, or add train rows with that label (the label set is train's)")
    fix = "fix the file or the config's label_names / num_classes"
    index: dict = {i: i for i in range(num_classes)} | {str(i): i for i in range(num_classes)}
    if label_names:
        index |= {name: i for i, name in enumerate(label_names)}
        # a name that is an integer wins over reading the value as an index, as the value 1 does as '1'
        index |= {int(name): i for i, name in enumerate(label_names) if is_integer_label(name)}
        return index, f"{list(label_names)} (or indices 0..{num_classes - 1})", fix
    return index, f"the integers 0..{num_classes - 1}", fix


def file_line(path: Path, format: str, row: int, delimiter: str = ",", quoting: int = 0,
              encoding: str = "utf-8") -> int | None:
    """The line of the file where data row `row` (0-based) starts, for an error to name (a quoted csv cell may span
    lines, and JSON lines may be blank: the file is read again to count, on the error path only); None for a
    format without lines (parquet)."""
    with _named_errors(path, encoding), _open_text(path, encoding) as f:
        if format in ("csv", "tsv"):
            reader = csv.reader(f, delimiter=delimiter, quoting=quoting)
            before, i = 0, -1  # lines read before the record; records, the header being -1 (blank lines skipped)
            for record in reader:
                if record:
                    if i == row:
                        return before + 1
                    i += 1
                before = reader.line_num
            return None
        if format in ("json", "jsonl", "ndjson"):
            seen = -1
            for n, line in enumerate(f, 1):
                seen += bool(line.strip())
                if seen == row:
                    return n
    return None


def clean_rows(
    texts: list, raw_labels: list, *, split: str, where: str, text_column: str, label_column: str,
    label_names: list[str] | None, num_classes: int, on_bad_rows: str = "error", names_only: bool = False,
    line_of=None,
) -> tuple[list[str], list[int]]:
    """Texts and label indices of a split, with rows whose text is missing or blank either raised
    (on_bad_rows='error') or dropped with a WARNING (on_bad_rows='drop'). Bad labels always raise:
    dropping them would hide a label_names / num_classes misconfiguration. `names_only`: the label
    names were inferred from train, and a value matches its name (label_key) only. `line_of(row)`: the file's
    line of a data row (file_line), which an error names; without it, the row's place counted from 1."""
    index, allowed, fix = _allowed(label_names, num_classes, names_only)
    out_texts, out_labels, dropped = [], [], 0

    def at(row: int) -> str:
        line = line_of(row) if line_of else None
        return f"line {line}" if line is not None else f"data row {row + 1}"

    for row, (text, label) in enumerate(zip(texts, raw_labels)):
        if text is None or not str(text).strip():
            if on_bad_rows == "drop":
                dropped += 1
                continue
            raise DataError(
                f"{split} {at(row)} of {where}: text column '{text_column}' is {'missing' if text is None else 'empty'} "
                f"({text!r}); fix the file, or set data.on_bad_rows=drop to drop such rows with a warning."
            )
        key = label_key(label) if names_only else label.strip() if isinstance(label, str) else label
        try:
            out_labels.append(index[key])
        except (KeyError, TypeError):  # TypeError: unhashable values (lists in JSON)
            raise DataError(
                f"{split} {at(row)} of {where}: label {label!r} in column '{label_column}' is not one of {allowed}; "
                f"{fix}."
            ) from None
        out_texts.append(str(text))
    if dropped:
        log.warning("%s: dropped %d of %d %s rows with a missing or empty '%s' (on_bad_rows=drop)",
                    where, dropped, len(texts), split, text_column)
    if not out_texts:
        raise DataError(f"{split} split of {where} has no usable rows ({len(texts)} read); check the file.")
    return out_texts, out_labels
