"""The package's layout is its architecture: imports point down (nn <- model <- train <- analysis <- checks, data beside
model), the building blocks need nothing but torch, and importing the library changes nothing global."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import mhalab

SRC = Path(mhalab.__file__).parent
# a module may import its own layer and the ones below; errors.py is everyone's
LAYER = {"errors": 0, "nn": 1, "model": 2, "mlm": 2, "data": 2, "train": 3, "analysis": 4, "checks": 5, "cli": 6}
TORCH_ONLY = ("nn", "model", "mlm")  # and the package root: what `import mhalab` loads
FRAMEWORKS = ("lightning", "hydra", "omegaconf", "datasets", "matplotlib", "tokenizers", "pandas", "wandb")


def _part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "mhalab" and len(parts) > 1 else None


def _imports(path: Path) -> list[str]:
    """Every module a file imports, at any depth (lazy imports inside functions count too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
            if node.module == "mhalab":  # `from mhalab import x`: x is a part of the package
                out += [f"mhalab.{a.name}" for a in node.names]
    return out


FILES = sorted(p for p in SRC.rglob("*.py") if p.relative_to(SRC).parts[0] != "__init__.py")


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(SRC)) for p in FILES])
def test_imports_point_down_the_layers(path):
    own = path.relative_to(SRC).parts[0].removesuffix(".py")
    up = [m for m in _imports(path) if _part(m) in LAYER and LAYER[_part(m)] > LAYER[own]]
    assert not up, f"{path.relative_to(SRC)} ({own}) imports from a layer above it: {up}"


@pytest.mark.parametrize("path", [p for p in FILES if p.relative_to(SRC).parts[0].removesuffix(".py") in TORCH_ONLY],
                         ids=lambda p: str(p.relative_to(SRC)))
def test_building_blocks_import_no_framework(path):
    used = [m for m in _imports(path) if m.split(".")[0] in FRAMEWORKS]
    assert not used, f"{path.relative_to(SRC)} imports {used}: nn/ and model.py are pure torch"


def test_importing_the_library_loads_torch_only_and_changes_no_global_state():
    code = f"""
import json, os, sys, warnings
import torch  # torch adds its own warning filters; the question is what mhalab adds
env, filters = dict(os.environ), list(warnings.filters)
import mhalab, mhalab.nn
from mhalab import MultiHeadAttention, ScaledDotProductAttention, SequenceClassifier, TransformerEncoder
from mhalab import TransformerEncoderLayer
loaded = sorted({{m.split(".")[0] for m in sys.modules}} & set({list(FRAMEWORKS)!r}))
print(json.dumps({{"loaded": loaded, "env": dict(os.environ) == env, "filters": list(warnings.filters) == filters}}))
"""
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert out == {"loaded": [], "env": True, "filters": True}


def test_library_names_are_the_documented_classes():
    from mhalab.model import SequenceClassifier
    from mhalab.nn.attention import MultiHeadAttention, ScaledDotProductAttention
    from mhalab.nn.encoder import TransformerEncoder, TransformerEncoderLayer
    from mhalab.nn.swap import swap_attention

    assert (mhalab.ScaledDotProductAttention, mhalab.MultiHeadAttention, mhalab.TransformerEncoderLayer,
            mhalab.TransformerEncoder, mhalab.SequenceClassifier, mhalab.swap_attention) == (
        ScaledDotProductAttention, MultiHeadAttention, TransformerEncoderLayer, TransformerEncoder, SequenceClassifier,
        swap_attention)
    assert sorted(mhalab.__all__) == sorted(["ScaledDotProductAttention", "MultiHeadAttention", "TransformerEncoderLayer",
                                             "TransformerEncoder", "SequenceClassifier", "swap_attention"])


CARD = {"conf": "dir", "src": "dir", "scripts": "dir", "tests": "dir", "pyproject.toml": "file", "Makefile": "file",
        "README.md": "file"}  # the design card's top level; docs/, results/ and the like sit beside it


def test_the_top_level_is_the_design_cards():
    from conftest import REPO

    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    top = {p.split("/")[0]: "dir" if "/" in p else "file" for p in tracked}
    assert {name: top.get(name) for name in CARD} == CARD
    # conf/ is the configs' only copy: train.yaml and its groups there, no YAML left inside the package
    assert (REPO / "conf" / "train.yaml").is_file() and (REPO / "conf" / "model" / "custom.yaml").is_file()
    assert not [p for p in tracked if p.startswith("src/") and p.endswith(".yaml")]


def test_the_package_reaches_the_top_level_conf_through_a_link_and_the_wheel_ships_it():
    """src/mhalab/conf is a link to conf/ (so a checkout, an editable install and `python train.py` read the one copy),
    and the wheel's file list holds every YAML of conf/ under mhalab/conf (tests/test_install.py installs it)."""
    from conftest import REPO

    from mhalab.train.config import CONF_DIR

    link = REPO / "src" / "mhalab" / "conf"
    assert link.is_symlink() and link.resolve() == (REPO / "conf").resolve()
    assert CONF_DIR.resolve() == (REPO / "conf").resolve()
