"""key=value options for the analysis commands (mhalab-bench, mhalab-compare, scripts/throughput.py).

The project's one command-line style, Hydra's: `key=value` words (`reps=3`, `quick=true`,
`seq_lens=[128,1024]`, `out=null`), read by OmegaConf.from_cli and merged onto a dataclass of the
defaults, so each value is typed and checked as it is read. An unknown key or a value of the wrong
type is a ConfigError naming it; the commands print it as `error: ...` and exit 2 (mhalab.errors.one_line_errors).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mhalab.errors import ConfigError

T = TypeVar("T")
HELP_WORDS = ("-h", "--help", "help")


def doc(help: str) -> dict:
    """A dataclass field's metadata with its help line: field(default=..., metadata=doc("...")), shown by
    `<command> --help`."""
    return {"help": help}


def usage(schema: type, prog: str) -> str:
    """`usage: prog key=value ...` and one line per option: key=default, help."""
    rows = [(f"{f.name}={_show(_default(f))}", f.metadata.get("help", "")) for f in dataclasses.fields(schema)]
    width = max(len(k) for k, _ in rows)
    return f"usage: {prog} [key=value ...]\n" + "\n".join(f"  {k:<{width}}  {h}" for k, h in rows)


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(_show, value)) + "]"
    return str(value)


def parse(schema: type[T], argv: Sequence[str], prog: str, doc: str = "") -> T:
    """argv's key=value words over schema's defaults -> a schema instance. `--help` prints the usage and
    exits 0; anything else that is not one of schema's keys with a value of its type: ConfigError."""
    argv = list(argv)
    if any(w in HELP_WORDS for w in argv):
        print((doc.strip() + "\n\n" if doc else "") + usage(schema, prog))
        sys.exit(0)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for word in argv:
        key, sep, _ = word.partition("=")
        if key not in fields:
            hint = f" (options are key=value, e.g. {key.lstrip('-').replace('-', '_')}=...)" if key[:1] == "-" else ""
            raise ConfigError(f"unknown option '{word}'{hint}; the options are {', '.join(fields)} "
                              f"(see {prog} --help).")
        if not sep:
            raise ConfigError(f"'{word}' has no value; write {key}=VALUE (see {prog} --help).")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.from_cli(argv)))
    except OmegaConfBaseException as e:
        key = str(e.full_key or e.key or "").split(".")[0].split("[")[0]
        given = next((w.partition("=")[2] for w in reversed(argv) if w.partition("=")[0] == key), "?")
        f = fields.get(key)
        if f is not None and "list[" in str(f.type) and not given.startswith("["):
            reason = "a list, e.g. [128,1024] or [attn,enc]"
        else:
            reason = str(getattr(e, "msg", e)).splitlines()[0]
        default = _show(_default(f)) if f is not None else "?"
        raise ConfigError(f"{key}={given} is not valid ({reason}); the default is {key}={default} "
                          f"(see {prog} --help).") from None


def split_dir(argv: Sequence[str], usage: str) -> tuple[Path, list[str]]:
    """(the one word that names a dir: no '=' in it, or an existing path; the key=value words)."""
    argv = list(argv)
    dirs = [w for w in argv if w not in HELP_WORDS and not w.startswith("-") and ("=" not in w or Path(w).exists())]
    if len(dirs) != 1 and not any(w in HELP_WORDS for w in argv):
        raise ConfigError(f"give one sweep dir, not {len(dirs)}{': ' + ' '.join(dirs) if dirs else ''} "
                          f"(usage: {usage})")
    return Path(dirs[0]) if dirs else Path(), [w for w in argv if w not in dirs]


def emit(text: str, out: str | None) -> None:
    """Print a command's report, and write it to `out` too when given (its folder made)."""
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
