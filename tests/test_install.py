"""The package works installed, not only from the checkout: a wheel built from it, installed (not editable)
into a fresh directory, runs its console commands from another directory, finds its configs inside the
installed package, writes outputs under the current directory and caches under the user's cache dir,
and writes nothing into the installed package.

The wheel is installed without dependencies into its own directory (they are the test environment's),
and that directory comes first on PYTHONPATH, before the checkout's editable install.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, write_toy_sst2

TINY = ["max_epochs=1", "++trainer.limit_train_batches=3", "++trainer.limit_val_batches=2",
        "++trainer.limit_test_batches=2", "trainer=cpu", "trainer.enable_progress_bar=false", "dim=32", "heads=4",
        "layers=1", "data.vocab_size=200", "data.min_frequency=1"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("install")
    wheels, site, src = root / "wheels", root / "site", root / "src"
    # built from a copy: setuptools writes build/ and *.egg-info into the tree it builds
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".venv", ".git", ".cache", "outputs", "multirun", "build",
                                                              "*.egg-info", "__pycache__", ".*_cache", "wandb", "results"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(src)], check=True, capture_output=True, cwd=root)
    (wheel,) = wheels.glob("mhalab-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, cwd=root)
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), XDG_CACHE_HOME=str(root / "xdg"), PYTHONHASHSEED="0")
    for key in ("MHALAB_DATA_DIR", "MHALAB_CACHE_DIR"):
        env.pop(key, None)
    before = {p for p in site.rglob("*") if "__pycache__" not in p.parts}
    return {"site": site, "bin": site / "bin", "cwd": elsewhere, "env": env, "before": before,
            "data": write_toy_sst2(root / "data"), "xdg": root / "xdg"}


def _run(installed: dict, command: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(installed["bin"] / command), *args], cwd=installed["cwd"], env=installed["env"],
                          input=stdin, capture_output=True, text=True, timeout=600, check=False)


def test_installed_package_is_the_wheel_with_its_configs(installed):
    code = ("import mhalab, mhalab.train.config as c, hydra_plugins.mhalab_sweeper.until_decided_sweeper as s; "
            "print(mhalab.__file__, c.CONF_DIR, c.source_checkout(), s.__file__)")
    p = subprocess.run([sys.executable, "-c", code], cwd=installed["cwd"], env=installed["env"], capture_output=True,
                       text=True, check=True)
    module, conf, checkout, sweeper = p.stdout.split()
    assert Path(module).is_relative_to(installed["site"]) and checkout == "None"
    assert Path(sweeper).is_relative_to(installed["site"])  # the until_decided sweeper ships as Hydra's plugin
    assert sorted(q.name for q in Path(conf).glob("*.yaml")) == sorted(q.name for q in (REPO / "conf").glob("*.yaml"))
    assert len(list(Path(conf).rglob("*.yaml"))) == len(list((REPO / "conf").rglob("*.yaml")))


def test_installed_commands_train_evaluate_and_predict_from_another_directory(installed):
    p = _run(installed, "mhalab-train", f"data.data_dir={installed['data']}", "hydra.run.dir=outputs/run", *TINY)
    assert p.returncode == 0, p.stderr[-3000:]
    run = installed["cwd"] / "outputs" / "run"
    rec = json.loads((run / "metrics.json").read_text())
    assert rec["status"] == "finished" and 0.0 <= rec["best"]["test/acc"] <= 1.0
    assert list((installed["xdg"] / "mhalab" / "sst2").glob("tokenizer-*.json"))  # the user's cache dir

    p = _run(installed, "mhalab-eval", "ckpt_path=outputs/run", "split=test", "out=eval.json")
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((installed["cwd"] / "eval.json").read_text())["test/acc"] == pytest.approx(rec["best"]["test/acc"])

    p = _run(installed, "mhalab-predict", "ckpt_path=outputs/run", "input=-", stdin="good great fine\nawful dull bad\n")
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    assert [x["text"] for x in lines] == ["good great fine", "awful dull bad"]
    assert all(abs(sum(x["probs"].values()) - 1) < 1e-5 and x["label"] in x["probs"] for x in lines)

    written = {q for q in installed["site"].rglob("*") if "__pycache__" not in q.parts} - installed["before"]
    assert not written, sorted(map(str, written))[:5]


def test_installed_command_prints_a_users_mistake_as_one_line(installed):
    p = _run(installed, "mhalab-train", f"data.data_dir={installed['data']}", "dim=100", "heads=16")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error: heads=16 does not divide dim=100")
