"""The documentation site builds with warnings as errors (`make docs`): a broken link or anchor, a page missing
from the nav, a public class or function of the API reference without a docstring, a config option without its
opening comment (docs/hooks/). The configuration page is generated from the configs: checked here against them."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, nav_pages

MKDOCS = Path(sys.executable).parent / "mkdocs"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"), check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_site_builds_strict_with_every_nav_page(site):
    pages = nav_pages()
    assert len(pages) >= 15, pages
    for src in pages:
        page = src.removesuffix(".md").removesuffix("README").removesuffix("index")
        assert (site / page / "index.html").exists(), src


def test_the_hooks_flag_an_undocumented_function_and_an_option_without_its_comment(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "docs" / "hooks"))
    import config_reference
    import docstrings
    import griffe

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(
        '"""A package."""\n\ndef documented():\n    """Says what it does."""\n\n\nclass Bare:\n    def run(self):\n'
        '        pass\n\n    def _private(self):\n        pass\n')
    assert docstrings.undocumented(griffe.load("pkg", search_paths=[str(tmp_path)])) == ["pkg.Bare", "pkg.Bare.run"]
    (tmp_path / "bare.yaml").write_text("# @package _global_\nkey: 1\n")
    (tmp_path / "said.yaml").write_text("# @package _global_\n# What it is for.\n#   mhalab-train x=1   # a note\n"
                                        "# More, left in the file.\nkey: 1\n")
    assert config_reference.opening_comment(tmp_path / "bare.yaml") == ""
    assert config_reference.opening_comment(tmp_path / "said.yaml") == "What it is for. `mhalab-train x=1` (a note)"


def test_configuration_page_lists_every_option_of_every_group(site):
    html = (site / "configuration" / "index.html").read_text()
    conf = REPO / "conf"
    for option in conf.rglob("*.yaml"):
        if option.parent != conf:
            assert f"<code>{option.stem}</code>" in html, option
    assert "<code>optim.label_smoothing</code>" in html and "<code>extras.print_config</code>" in html


def test_api_reference_shows_the_library_with_its_docstrings(site):
    html = (site / "api" / "index.html").read_text()
    for name in ("MultiHeadAttention", "ScaledDotProductAttention", "TransformerEncoderLayer", "swap_attention",
                 "SequenceClassifier", "RotaryEmbedding", "SeqLens"):
        assert f"mhalab.{'model' if name == 'SequenceClassifier' else 'nn'}" in html and name in html, name
    assert "nn.MultiheadAttention.forward's contract" in html  # a docstring rendered, not a bare signature


def test_api_docstrings_render_their_sections_as_tables_and_their_lists_as_lists(site):
    """docstring_style: google (mkdocs.yml): Args / Returns / Raises become tables, a Markdown list stays a list."""
    html = (site / "api" / "index.html").read_text()
    model = html.split('id="mhalab.model"')[1].split('id="mhalab.mlm"')[0]
    assert '<span class="doc-section-title">Parameters:</span>' in model
    assert "<code>vocab_size</code>" in model.split("Parameters:")[1].split("</table>")[0]
    assert '<span class="doc-section-title">Raises:</span>' in model
    assert "<li><code>model.pos</code>: sinusoidal" in model  # the module docstring's list


def _run_on_lists(docstring: str) -> list[str]:
    """List items that follow a paragraph line with no blank line between: Markdown reads them as that paragraph."""
    lines = docstring.splitlines()
    item = re.compile(r"\s*([-*+]|\d+\.)\s")
    return [b for a, b in itertools.pairwise(lines) if item.match(b) and a.strip() and not item.match(a)
            and not a.startswith((" ", "\t"))]


def test_api_docstrings_keep_a_blank_line_before_each_list():
    """Every module of the API page, mhalab.nn's included: each list in a public docstring renders as one."""
    import griffe

    modules = re.findall(r"^::: (\S+)", (REPO / "docs" / "api.md").read_text(), re.MULTILINE)
    assert {"mhalab.model", "mhalab.mlm", "mhalab.nn.attention", "mhalab.nn.masks"} <= set(modules)

    def docstrings(obj):
        if obj.docstring:
            yield obj.path, obj.docstring.value
        for name, member in obj.members.items():
            if not name.startswith("_") and not member.is_alias:
                yield from docstrings(member)

    for module in modules:
        bad = {path: _run_on_lists(text) for path, text in
               docstrings(griffe.load(module, search_paths=[str(REPO / "src")], resolve_aliases=False))}
        assert not {k: v for k, v in bad.items() if v}, bad
    assert _run_on_lists("What differs:\n* masks follow\n* no dropout") == ["* masks follow"]  # what it catches
