"""Shared fixtures: a tiny SST-2-shaped data dir, and the real configs composed with Hydra."""

from __future__ import annotations

import importlib.util
import random
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

import mhalab.train.config  # noqa: F401  (registers the config resolvers)

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """scripts/<name>.py as a module, for tests that call its functions (its dataclasses look their module up in
    sys.modules while they are made)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def nav_pages(items=None) -> list[str]:
    """The documentation site's pages (paths under docs/), in mkdocs.yml's nav order."""
    out = []
    for item in yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"] if items is None else items:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out += nav_pages(value) if isinstance(value, list) else [value]
    return out


# The longest files (minutes, in one worker each: --dist loadfile), started first so that the workers finish
# together; pytest-xdist would otherwise start files by their number of tests, and a long file of few tests
# (test_faults) began last and ran alone. Only the order changes; every file's tests keep theirs.
# Ranked by the working checkout's durations (2026-12-07, the flat-memory loop slow: 274, 69, 68, 64, 39, 31 and 28 s).
LONGEST_FIRST = ("test_doc_commands.py", "test_cli_errors.py", "test_faults.py", "test_gpu_check.py",
                 "test_config_options.py", "test_verdict_statistics.py", "test_install.py")


def pytest_collection_modifyitems(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep pytest's order


CONF = REPO / "conf"
SHARED_DATA = REPO.parent / "shared" / "data"

TOL = 1e-5  # float32 equality with PyTorch's modules


@pytest.fixture(autouse=True, scope="module")
def one_thread(request):
    """Tiny tensors: one intra-op thread avoids OpenMP spin-waits on a busy 2-core machine (~7x faster).

    Applies to the modules that compare tiny tensors with PyTorch's (they set ONE_THREAD = True)."""
    if not getattr(request.module, "ONE_THREAD", False):
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def close(a, b, tol=TOL, what=""):
    """Equal within an absolute tolerance (no relative slack), naming what was compared on failure."""
    torch.testing.assert_close(a, b, atol=tol, rtol=0, msg=lambda m: f"{what}: {m}")


POS = ["good", "great", "fine", "lovely", "superb", "moving"]
NEG = ["bad", "awful", "dull", "boring", "weak", "clumsy"]
FILLER = ["the", "film", "movie", "a", "plot", "actor", "story", "was", "is", "and", "it", "of"]


def _sentence(rng: random.Random, label: int) -> str:
    words = rng.choices(FILLER, k=rng.randint(3, 12)) + rng.choices(POS if label else NEG, k=rng.randint(1, 3))
    rng.shuffle(words)
    return " ".join(words)


def write_toy_sst2(root: Path, n_train: int = 400, n_dev: int = 64, n_test: int = 64, seed: int = 0) -> Path:
    """An SST-2-shaped data dir (sst2/{train,dev,test}.tsv, `sentence<TAB>label`), learnable by word lookup."""
    rng = random.Random(seed)
    d = root / "sst2"
    d.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", n_train), ("dev", n_dev), ("test", n_test)):
        rows = ["sentence\tlabel"]
        for i in range(n):
            label = i % 2
            rows.append(f"{_sentence(rng, label)}\t{label}")
        (d / f"{name}.tsv").write_text("\n".join(rows) + "\n")
    return root


def together(*calls) -> None:
    """Run the calls in threads released at the same moment, as a sweep's first members start on a cold cache."""
    start = threading.Barrier(len(calls))
    threads = [threading.Thread(target=lambda c=c: (start.wait(), c())) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)


@pytest.fixture(scope="session")
def fork_server():
    """The project's commands as forks of one process that imported torch and Lightning once (tests/fork_server.py):
    ~4 s less per command on this machine. One per worker process."""
    from fork_server import ForkServer

    server = ForkServer()
    yield server
    server.close()


@pytest.fixture(scope="session")
def toy_data_dir(tmp_path_factory) -> Path:
    return write_toy_sst2(tmp_path_factory.mktemp("data"))


def compose_train(overrides: list[str], out: Path, data_dir: Path | None = None, cache: Path | None = None,
                  small_vocab: bool = True) -> DictConfig:
    """The real conf/train.yaml with overrides, outputs in `out`, small and CPU-only by default."""
    base = [
        f"paths.output_dir={out}", "trainer.accelerator=cpu", "trainer.precision=32-true",
        "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=5", "callbacks.progress_bar=null", "dim=32", "heads=4", "layers=1",
        "batch_size=32", "max_len=32",
    ]
    if small_vocab:  # the toy data has ~30 words
        base += ["data.vocab_size=200", "data.min_frequency=1"]
    if data_dir is not None:
        base.append(f"paths.data_dir={data_dir}")
    if cache is not None:
        base.append(f"paths.cache_dir={cache}")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=base + overrides)
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return cfg
