"""The on-disk cache of a data set: its paths are hashes of everything its contents depend on.

A tokenizer JSON and a directory of encoded ids per data set, under `cache_root/<name>/`; a second
run (and every DDP rank) only loads them. Files are written through a temp file and a rename, so a
crash or a concurrent reader never sees half a file; an entry is built under a lock (`locked`), so two
runs that start together (a sweep's members on a cold cache) build it once: the second waits, then reads it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CACHE_DIR_ENV = "MHALAB_CACHE_DIR"
CACHE_VERSION = 1  # bump when the cached format or the encoding recipe changes


def digest(obj) -> str:
    """16 hex digits of the JSON of `obj` (keys sorted): the same settings give the same name in any process."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created if missing); another process (or thread) that wants it
    waits here. Build a cache entry inside, after checking again that no one built it while this one waited."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_atomic(path: Path, write) -> None:
    """Write via a temp file + rename, so a crash or a concurrent reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def cache_paths(root: Path, name: str, data: dict, kind: str, lowercase: bool, vocab_size: int,
                min_frequency: int, max_len: int) -> tuple[Path, Path]:
    """(tokenizer JSON, encoded-ids directory). `data` holds what the rows depend on (source, reading
    settings, labels, hold-out); the tokenizer adds its own settings, the ids add max_len."""
    tok = dict(data, kind=kind, lowercase=lowercase)
    if kind != "bytes":  # the byte tokenizer learns nothing: its vocabulary settings do not matter
        tok.update(vocab_size=vocab_size, min_frequency=min_frequency)
    root = root / name
    return root / f"tokenizer-{kind}-{digest(tok)}.json", root / f"encoded-{digest(dict(tok, max_len=max_len))}"
