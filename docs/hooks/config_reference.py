"""MkDocs hook: the configuration reference, generated from the Hydra configs themselves (conf/).

`<!-- config: groups -->` in a page becomes one table per config group (each option, the comment that opens its
file, the default marked); `<!-- config: train.yaml -->` becomes that file's keys, their defaults and comments,
section by section as the file has them. An option without its opening comment is a warning, so the strict build
fails until it says what it is for.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import yaml

CONF = Path(__file__).resolve().parents[2] / "conf"
log = logging.getLogger("mkdocs.hooks.config_reference")
MARKER = re.compile(r"<!-- config: (\S+) -->")
KEY = re.compile(r"^(?P<indent> *)(?P<key>[\w.]+):(?P<value>[^#]*?)\s*(?:#\s?(?P<comment>.*))?$")


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(lambda m: groups() if m.group(1) == "groups" else keys(m.group(1)), markdown)


def _cell(text: str) -> str:
    """Table-safe prose: a pipe would split the cell, and autorefs would read [x] as a cross-reference."""
    parts = text.split("`")  # odd parts are code spans: left as written
    return "`".join(p if i % 2 else p.replace("|", "\\|").replace("[", "\\[") for i, p in enumerate(parts)).strip()


def opening_comment(path: Path) -> str:
    """The first paragraph a config file opens with (Hydra's `# @package` directive left out), with the example
    command indented under it as code; the rest of the file's comments stay in the file."""
    prose, code = [], []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line[1:]
        if line.startswith("# @package"):
            continue
        if text.startswith("   "):  # an indented example
            command, _, note = text.strip().partition("  #")
            code.append(f"`{command.strip()}`" + (f" ({note.strip()})" if note else ""))
        elif code or not text.strip():
            break
        else:
            prose.append(text.strip())
    return " ".join(prose + code)


def groups() -> str:
    defaults = {k: v for d in yaml.safe_load((CONF / "train.yaml").read_text())["defaults"] if isinstance(d, dict)
                for k, v in d.items()}
    out = []
    for group in sorted({p.parent for p in CONF.rglob("*.yaml")} - {CONF}):
        name = group.relative_to(CONF).as_posix()
        out += [f"### `{name}`", "", f"Chosen with `{name}=<option>` (default: `{defaults.get(name)}`).", "",
                "| option | what it is |", "|---|---|"]
        for option in sorted(group.glob("*.yaml")):
            text = opening_comment(option)
            if not text:
                log.warning("config %s has no opening comment: say what the option is for", option.relative_to(CONF))
            mark = " (default)" if defaults.get(name) == option.stem else ""
            out.append(f"| `{option.stem}`{mark} | {_cell(text)} |")
        out.append("")
    return "\n".join(out)


def keys(name: str) -> str:
    """A root config's keys (`defaults` and `hydra` left out: they are the groups above and Hydra's own)."""
    lines = (CONF / name).read_text().splitlines()
    out, path, skip, prose = [], [], None, []
    table = False
    for line in lines[1:]:  # the first line is the file's title, given by the page
        if line.startswith("#"):
            prose.append(line[1:].strip())
            continue
        m = KEY.match(line)
        if not m or line.lstrip().startswith("-"):
            continue
        depth = len(m["indent"]) // 2
        path = [*path[:depth], m["key"]]
        if depth == 0:
            skip = m["key"] in ("defaults", "hydra")
        if skip:
            prose = []
            continue
        if prose:
            out += ["", " ".join(prose), ""]
            prose, table = [], False
        if not table:
            out += ["| key | default | what it is |", "|---|---|---|"]
            table = True
        value = m["value"].strip()
        if value or m["comment"]:
            out.append(f"| `{'.'.join(path)}` | `{value.replace('|', '/') or '—'}` | {_cell(m['comment'] or '')} |")
    return "\n".join(out) + "\n"
