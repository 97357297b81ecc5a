"""Predict the class of new texts with nothing but a checkpoint: mhalab-predict.

    mhalab-predict ckpt_path=outputs/<run> input=texts.txt [output=preds.jsonl] [batch_size=64] [device=cpu]

input: a .txt file (one text per line), a .csv / .tsv / .jsonl file (one text per row or record, in a `text`
column or field, or the one `text_column=` names), or `-` (stdin, one text per line). Writes one JSON line per
input line (row, record), in input order, so the output lines up with the input and with any file parallel to it:
{"text": ..., "label": <class name>, "probs": {name: p, ...}}; an empty text (a blank or whitespace-only line, an
empty field) gets {"text": ..., "label": null, "probs": null, "note": "empty text: no prediction"}, and one line on
stderr counts them. The texts are encoded with the checkpoint's own tokenizer and truncated to its max_len,
as in training; batches are formed from length-sorted texts (little padding, so little wasted compute)
and the predictions put back in input order.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from mhalab.data import Collate, encode_texts
from mhalab.errors import ConfigError, DataError
from mhalab.train import checkpoint

# (delimiter, quoting): csv quotes fields that hold commas; tsv has no quoting (a text may start with ")
TABLES = {".csv": (",", csv.QUOTE_MINIMAL), ".tsv": ("\t", csv.QUOTE_NONE)}
FORMATS = (".txt", ".csv", ".tsv", ".jsonl")
WHAT = "a .txt file (one text per line), a .csv / .tsv / .jsonl file (a 'text' column), or input=- (stdin)"


EMPTY = "empty text: no prediction"  # the note on the row of an empty text


def read_texts(source: str, text_column: str | None = None) -> list[str]:
    """The texts of `source` (a path, or - for stdin), one per line (row, record), in order: an empty one too, as
    ''. Raises DataError naming the fix (and when no text is there at all)."""
    column = text_column or "text"
    if source == "-":
        texts = sys.stdin.read().splitlines()
    else:
        path = Path(source)
        if not path.is_file():
            raise DataError(f"input={source} does not exist; pass {WHAT}.")
        suffix = path.suffix.lower()
        if suffix not in FORMATS:
            raise DataError(f"input={source}: unknown format '{suffix}'; pass {WHAT}.")
        try:
            with path.open(encoding="utf-8", newline="") as f:
                if suffix == ".txt":
                    texts = f.read().splitlines()
                elif suffix == ".jsonl":
                    texts = _jsonl_texts(f, source, column)
                else:
                    texts = _table_texts(f, source, column, *TABLES[suffix])
        except UnicodeDecodeError as e:
            raise DataError(f"input={source} is not valid UTF-8 (byte {e.object[e.start]:#04x} at offset "
                            f"{e.start}); re-save it as UTF-8.") from None
    if not any(t.strip() for t in texts):
        raise DataError(f"input={source} holds no texts; pass {WHAT}.")
    return texts


def _table_texts(f, source: str, column: str, delimiter: str, quoting: int) -> list[str]:
    reader = csv.reader(f, delimiter=delimiter, quoting=quoting)  # not DictReader: it drops blank rows
    header = next(reader, [])
    if header and column not in header:
        raise DataError(f"input={source} has no column '{column}' (its columns: {', '.join(header)}); "
                        f"pass text_column=<the column with the texts>.")
    at = header.index(column) if header else 0
    return [row[at] if at < len(row) else "" for row in reader]


def _jsonl_texts(f, source: str, field: str) -> list[str]:
    texts = []
    for n, line in enumerate(f, 1):
        if not line.strip():
            texts.append("")  # a blank line: its row says so
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"input={source}: line {n} is not JSON ({e.msg}); write one JSON object per line.") from None
        if not isinstance(record, dict) or field not in record:
            keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(f"input={source}: line {n} has no field '{field}' (it has: {keys}); "
                            f"pass text_column=<the field with the texts>.")
        texts.append("" if record[field] is None else str(record[field]))
    return texts


@torch.no_grad()
def probabilities(loaded: checkpoint.Loaded, texts: Sequence[str], batch_size: int = 64,
                  advance: Callable[[int], None] | None = None) -> torch.Tensor:
    """(len(texts), num_classes) class probabilities, in the order of `texts`. `advance(n)` is called per batch."""
    model = loaded.module.model  # the plain SequenceClassifier, in eval mode
    device = next(model.parameters()).device
    ids = encode_texts(loaded.tokenizer, texts, loaded.max_len)
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths share a batch
    collate = Collate(model.pad_id)
    probs = None
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        batch = collate([(torch.tensor(ids[i]), 0) for i in rows])
        # seqlens: the lengths as host ints (the collate's), so the model finds its shapes without reading the
        # mask back from the device, as in training and evaluation
        logits = model(batch["input_ids"].to(device), batch["padding_mask"].to(device), seqlens=batch["seqlens"])
        if probs is None:
            probs = torch.empty(len(ids), logits.shape[-1])
        probs[rows] = logits.float().softmax(-1).cpu()  # back to the input's order
        if advance is not None:
            advance(len(rows))
    return probs


def predict(loaded: checkpoint.Loaded, texts: Sequence[str], batch_size: int = 64,
            advance: Callable[[int], None] | None = None) -> list[dict]:
    """{"text", "label", "probs"} per text, in the order of `texts`; an empty (or whitespace-only) text gets no
    label and no probabilities, and a note saying why. `advance(n)` is called per batch."""
    kept = [i for i, t in enumerate(texts) if t.strip()]
    probs = probabilities(loaded, [texts[i] for i in kept], batch_size, advance).tolist() if kept else []
    names = [loaded.label(c) for c in range(len(probs[0]))] if probs else []
    rows = [{"text": t, "label": None, "probs": None, "note": EMPTY} for t in texts]
    for i, p in zip(kept, probs):
        rows[i] = {"text": texts[i], "label": names[max(range(len(p)), key=p.__getitem__)],
                   "probs": dict(zip(names, p))}
    return rows


def command(cfg: DictConfig) -> None:
    """mhalab-predict: read the input, predict in batches (a progress bar on stderr), write JSON lines."""
    for key in ("ckpt_path", "input"):
        if OmegaConf.is_missing(cfg, key):
            raise ConfigError(f"{key} is required: mhalab-predict ckpt_path=<a .ckpt file or a run dir> "
                              f"input=<file.txt|.csv|.tsv|.jsonl, or - for stdin> [output=preds.jsonl].")
    batch_size = cfg.batch_size
    if isinstance(batch_size, bool) or not str(batch_size).isdigit() or int(batch_size) < 1:
        raise ConfigError(f"batch_size={batch_size!r} must be a positive integer, e.g. 64.")
    texts = read_texts(str(cfg.input), cfg.text_column)  # before the model: a bad input costs nothing
    loaded = checkpoint.load_model(str(cfg.ckpt_path), str(cfg.device), str(cfg.checkpoint))
    print(f"checkpoint: {checkpoint.describe(loaded.path, loaded.step)}", file=sys.stderr)  # stdout may be the predictions
    show = cfg.progress if cfg.progress is not None else cfg.output is not None or sys.stderr.isatty()
    if show:
        from rich.console import Console
        from rich.progress import Progress

        with Progress(console=Console(stderr=True)) as bar:
            task = bar.add_task("predicting", total=sum(1 for t in texts if t.strip()))
            results = predict(loaded, texts, int(batch_size), lambda n: bar.advance(task, n))
    else:
        results = predict(loaded, texts, int(batch_size))
    if empty := sum(r["label"] is None for r in results):
        print(f"{empty} of {len(results)} input lines hold no text (blank, or an empty field): their rows have "
              f"label null and the note \"{EMPTY}\"", file=sys.stderr)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    if cfg.output is None:
        sys.stdout.write(lines)
        sys.stdout.flush()
    else:
        out = Path(cfg.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(lines, encoding="utf-8")
