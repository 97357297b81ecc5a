"""MkDocs hook: every class, function and public method the API reference shows has a docstring.

mkdocstrings renders an object without one as a bare signature; here that is a warning, so the strict build
(`make docs`, tests/test_docs_site.py) fails and names it. Module constants and nn.Module's own hooks
(`extra_repr`, `reset_parameters`) are left out: their meaning is PyTorch's.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import griffe

SRC = Path(__file__).resolve().parents[2] / "src"
log = logging.getLogger("mkdocs.hooks.docstrings")
IDENT = re.compile(r"^::: (\S+)", re.MULTILINE)
TORCH_HOOKS = {"extra_repr", "reset_parameters"}


def undocumented(obj) -> list[str]:
    out = []
    for name, member in obj.members.items():
        if name.startswith("_") or member.is_alias or member.is_attribute or name in TORCH_HOOKS:
            continue
        if not member.docstring:
            out.append(member.path)
        if member.is_class:
            out += undocumented(member)
    return out


def on_page_markdown(markdown: str, page, config, files) -> str:
    for ident in IDENT.findall(markdown):
        obj = griffe.load(ident, search_paths=[str(SRC)], resolve_aliases=False)
        for path in ([] if obj.docstring else [obj.path]) + undocumented(obj):
            log.warning("%s has no docstring (shown in %s)", path, page.file.src_uri)
    return markdown
