"""ListOps (Nangia & Bowman 2018) as the Long Range Arena uses it (Tay et al. 2020): our own generator.

A sequence is a nested list of operations over the digits 0-9; the label (10 classes) is its value:

    [MAX 2 9 [MIN 4 7 ] 0 ]   -> 9        [SM 5 6 [MED 1 2 9 ] ]   -> 3

Operators (LRA's set): MAX, MIN, MED (median, `int(np.median)`: the mean of the two middle values,
rounded down, for an even count), SM (sum mod 10). The generator follows LRA's reference script
(`lra_benchmarks/data/listops.py`): a node at depth d < max_depth is a digit with probability 0.75,
else an operator with randint(2, max_args) arguments, each a tree of depth d + 1; at max_depth it is
a digit. A tree is kept when its length (tokens: digits + 2 per operator, the operator and `]`) lies
in [min_length, max_length] and it was not drawn before; LRA's spec is max_depth 10, max_args 10,
lengths 500-2000 (strictly between), 96k / 2k / 2k train / validation / test trees. Our token stream
has no parentheses (LRA's files wrap every argument in `( )`, which its input pipeline drops).

`generate_listops` writes `train.tsv`, `validation.tsv`, `test.tsv` (`Source<TAB>Target`) into
`<cache_dir>/listops/generated-<hash of the settings>/`, atomically, only when they are missing (once: under a
lock), so every run (and every DDP rank) with the same settings reads the same files. `ListOpsDataModule` is a
`TextClassificationDataModule` (through `SubsetDataModule`) whose files are those, with a word-level
tokenizer (each operator, bracket and digit one token; a vocabulary of 4 specials + 15 symbols).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from pathlib import Path

from mhalab.data.cache import locked
from mhalab.data.subset import SubsetDataModule
from mhalab.errors import ConfigError

log = logging.getLogger(__name__)

OPERATORS = ("[MAX", "[MIN", "[MED", "[SM")
END = "]"
VALUE_P = 0.25  # LRA's name: a node below max_depth is an operator when random() <= VALUE_P
GENERATOR_VERSION = 1  # bump when the generated files change for the same settings
SPLITS = ("train", "validation", "test")
SOURCE, TARGET = "Source", "Target"


class _TooLong(Exception):
    pass


def apply_op(op: str, values: list[int]) -> int:
    """The value of `[OP v1 ... vn ]` (LRA's `to_value`)."""
    if op == "[MAX":
        return max(values)
    if op == "[MIN":
        return min(values)
    if op == "[MED":
        s, n = sorted(values), len(values)
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) // 2  # int(np.median) for digits >= 0
    if op == "[SM":
        return sum(values) % 10
    raise ValueError(f"unknown ListOps operator {op!r}; expected one of {OPERATORS}.")


def _tree(rng: random.Random, depth: int, max_depth: int, max_args: int, budget: list[int],
          out: list[str]) -> int:
    """Append one tree's tokens to `out`, return its value; raise _TooLong once the budget is spent.

    Draws exactly as LRA's `generate_tree` does (random(), then choice / randint), so the distribution
    of accepted trees is LRA's; stopping a tree early that would be rejected as too long anyway only
    saves time.
    """
    r = rng.random() if depth < max_depth else 1.0
    if r > VALUE_P:
        budget[0] -= 1
        if budget[0] < 0:
            raise _TooLong
        value = rng.randrange(10)
        out.append(str(value))
        return value
    budget[0] -= 2
    if budget[0] < 0:
        raise _TooLong
    n_args = rng.randint(2, max_args)
    head = len(out)
    out.append("")  # the operator, drawn after its arguments as LRA does
    values = [_tree(rng, depth + 1, max_depth, max_args, budget, out) for _ in range(n_args)]
    op = rng.choice(OPERATORS)
    out[head] = op
    out.append(END)
    return apply_op(op, values)


def sample_tree(rng: random.Random, max_depth: int = 10, max_args: int = 10,
                max_length: int | None = None) -> tuple[list[str], int] | None:
    """(tokens, value) of one random tree, or None when it would exceed `max_length` tokens."""
    tokens: list[str] = []
    budget = [max_length if max_length is not None else 1 << 62]
    try:
        value = _tree(rng, 1, max_depth, max_args, budget, tokens)
    except _TooLong:
        return None
    return tokens, value


def generate_examples(n: int, seed: int = 0, min_length: int = 500, max_length: int = 2000, max_depth: int = 10,
                      max_args: int = 10, max_tries: int | None = None) -> list[tuple[str, int]]:
    """n distinct (text, value) examples with min_length <= tokens <= max_length, for a seed."""
    if not 1 <= min_length <= max_length:
        raise ConfigError(f"ListOps lengths need 1 <= min_length ({min_length}) <= max_length ({max_length}).")
    if max_depth < 1 or max_args < 2:
        raise ConfigError(f"ListOps needs max_depth >= 1 (got {max_depth}) and max_args >= 2 (got {max_args}).")
    rng = random.Random(seed)
    max_tries = max_tries if max_tries is not None else 10_000 * n + 1_000_000
    seen: set[str] = set()
    examples: list[tuple[str, int]] = []
    tries = 0
    while len(examples) < n:
        tries += 1
        if tries > max_tries:
            raise RuntimeError(
                f"ListOps: only {len(examples)} of {n} trees with {min_length}-{max_length} tokens after {max_tries} "
                f"draws (max_depth={max_depth}, max_args={max_args}); widen the length range or raise max_depth."
            )
        tree = sample_tree(rng, max_depth, max_args, max_length)
        if tree is None or len(tree[0]) < min_length:
            continue
        text = " ".join(tree[0])
        if text in seen:
            continue
        seen.add(text)
        examples.append((text, tree[1]))
    return examples


def generator_settings(num_train: int, num_validation: int, num_test: int, min_length: int, max_length: int,
                       max_depth: int, max_args: int, seed: int) -> dict:
    return {"version": GENERATOR_VERSION, "operators": list(OPERATORS), "value_p": VALUE_P, "num_train": num_train,
                "num_validation": num_validation, "num_test": num_test, "min_length": min_length, "max_length": max_length,
                "max_depth": max_depth, "max_args": max_args, "seed": seed}


def _write_once(path: Path, text: str) -> None:
    """Atomically create `path` with `text` unless it exists (a concurrent writer of the same content
    may win: its file is kept, so the file's mtime, part of the tokenizer cache key, never changes)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    try:
        os.link(tmp, path)  # fails if path exists: never replaces a file another process wrote
    except FileExistsError:
        pass
    except OSError:  # a file system without hard links
        if not path.exists():
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def generate_listops(out_root: str | os.PathLike, num_train: int = 96_000, num_validation: int = 2_000,
                     num_test: int = 2_000, min_length: int = 500, max_length: int = 2000, max_depth: int = 10,
                     max_args: int = 10, seed: int = 0) -> Path:
    """Write the three TSV splits into out_root/generated-<hash>/ if missing; return that directory."""
    settings = generator_settings(num_train, num_validation, num_test, min_length, max_length, max_depth,
                                  max_args, seed)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    out = Path(out_root).expanduser() / f"generated-{key}"
    if (out / "settings.json").exists():
        return out
    with locked(out.with_suffix(".lock")):  # two runs that start together generate the trees once
        if (out / "settings.json").exists():  # another run generated them while this one waited
            return out
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        total = num_train + num_validation + num_test
        examples = generate_examples(total, seed, min_length, max_length, max_depth, max_args)
        bounds = {"train": (0, num_train), "validation": (num_train, num_train + num_validation),
                  "test": (num_train + num_validation, total)}
        for split, (a, b) in bounds.items():
            rows = "".join(f"{text}\t{value}\n" for text, value in examples[a:b])
            _write_once(out / f"{split}.tsv", f"{SOURCE}\t{TARGET}\n{rows}")
        _write_once(out / "settings.json", json.dumps(settings, indent=2))  # last: marks the set complete
    log.info("listops: generated %d trees (%d-%d tokens) in %.1fs -> %s", total, min_length, max_length,
             time.perf_counter() - t0, out)
    return out


_SET_BY_GENERATOR = ("files", "format", "delimiter", "quoting", "text_column", "label_column", "num_classes",
                     "label_names", "dev_split", "data_dir", "hub")


class ListOpsDataModule(SubsetDataModule):
    """ListOps from our generator: `python train.py data=listops`.

    The generator settings (sizes, lengths, depth, arity, seed) pick the generated files; everything
    else is TextClassificationDataModule's (tokenizer and id cache, length-bucketed batches), plus
    SubsetDataModule's `max_examples` (a sweep can cut every task's splits with one setting). max_len
    counts [CLS] and [SEP], so it must be >= max_length + 2: truncating a ListOps sequence would
    change its value, so a too-small max_len is an error, not a truncation.
    """

    def __init__(self, name: str = "listops", num_train: int = 96_000, num_validation: int = 2_000,
                 num_test: int = 2_000, min_length: int = 500, max_length: int = 2000, max_depth: int = 10,
                 max_args: int = 10, generator_seed: int = 0, tokenizer_kind: str = "word", vocab_size: int = 64,
                 lowercase: bool = False, min_frequency: int = 1, max_len: int = 2002, **kwargs):
        if max_len < max_length + 2:
            raise ConfigError(
                f"data config '{name}': max_len={max_len} < max_length + 2 = {max_length + 2} ([CLS] and [SEP]): "
                f"truncating a ListOps sequence changes its value; raise max_len or lower data.max_length."
            )
        for key in _SET_BY_GENERATOR:
            if kwargs.pop(key, None) is not None:
                log.warning("listops: ignoring data.%s (set by the generator)", key)
        self.generator = {"num_train": num_train, "num_validation": num_validation, "num_test": num_test,
                              "min_length": min_length, "max_length": max_length, "max_depth": max_depth, "max_args": max_args,
                              "seed": generator_seed}
        super().__init__(
            name=name, files={s: f"{s}.tsv" for s in SPLITS}, text_column=SOURCE, label_column=TARGET,
            num_classes=10, format="csv", delimiter="\t", quoting=3, tokenizer_kind=tokenizer_kind,
            vocab_size=vocab_size, lowercase=lowercase, min_frequency=min_frequency, max_len=max_len, **kwargs,
        )
        self.data_dir = None  # set by validate(), once the files exist

    def source_config(self) -> dict:
        """The generator's settings in place of the files it writes (the same settings, the same files)."""
        cfg = super().source_config()
        for key in _SET_BY_GENERATOR:
            cfg.pop(key)
        return dict(cfg, **{k: v for k, v in self.generator.items() if k != "seed"}, generator_seed=self.generator["seed"])

    def generate(self) -> Path:
        return generate_listops(self.cache_root / self.name, **self.generator)

    def check_paths(self):
        # the files are the generator's, written on first use (validate): nothing to check before
        return None if self.data_dir is None else super().check_paths()

    def validate(self) -> None:
        self.data_dir = str(self.generate())
        super().validate()
