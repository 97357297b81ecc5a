"""The documentation site builds with warnings as errors (`make docs`): a broken link or anchor, a page missing
from the nav, a public class or function of the API reference without a docstring, a config option without its
opening comment (docs/hooks/). The configuration page is generated from the configs: checked here against them."""

from __future__ import annotations

import os
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
    conf = REPO / "src" / "mhalab" / "conf"
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
