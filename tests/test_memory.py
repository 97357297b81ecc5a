"""Training memory stays flat: a run's allocator (mhalab.train.allocator) and the process that chooses it.

The regression test trains a small encoder on batches whose lengths change every step (scripts/memory_curve.py
loop), in a fresh process started as mhalab-train starts its runs, and bounds the resident memory's growth after
warm-up; the same loop under glibc's malloc (MHALAB_ALLOCATOR=system, what every run used before) grows past the
bound, which is what the test would see on the old code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from mhalab.errors import ConfigError
from mhalab.train.allocator import mimalloc_path, preload_env

LOOP = [sys.executable, str(REPO / "scripts" / "memory_curve.py"), "loop", "steps=60", "every=20", "dim=64", "layers=1"]
GROWTH_BOUND_MB = 120  # steps 20 -> 60 (measured here: mimalloc +10 MB, glibc +180 MB; 20 -> 80: mimalloc -23 to +66, glibc +210 to +440)


def _curve(env: dict) -> list[dict]:
    p = subprocess.run(LOOP, env=env, capture_output=True, text=True, timeout=300, check=True)
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MHALAB_ALLOCATOR", "MIMALLOC_PURGE_DELAY")}
    return env | {"OMP_NUM_THREADS": "1"} | extra


@pytest.mark.slow  # 40-50 s: two training loops of 60 steps (make test-slow)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the preloaded allocator is Linux's")
def test_memory_of_varying_length_training_stays_flat_under_the_runs_allocator_and_grows_under_glibc():
    launched = preload_env(_env())
    assert launched is not None and launched["LD_PRELOAD"] == str(mimalloc_path())
    flat, glibc = _curve(launched), _curve(_env(MHALAB_ALLOCATOR="system"))
    assert [r["step"] for r in flat] == [r["step"] for r in glibc] == [20, 40, 60]

    def growth(curve):
        return curve[-1]["rss_mb"] - curve[0]["rss_mb"]

    assert growth(flat) < GROWTH_BOUND_MB, flat
    assert growth(glibc) > growth(flat) + 100, (glibc, flat)


def test_the_allocator_is_chosen_once_and_never_over_the_users_own():
    lib = mimalloc_path()
    assert lib is not None and lib.name.startswith("libmimalloc.so") and lib.is_file()
    env = preload_env(_env())
    assert env["LD_PRELOAD"] == str(lib) and env["MIMALLOC_PURGE_DELAY"] == "-1"
    assert preload_env(env) is None  # already preloaded: the restarted process does not restart again
    assert preload_env(_env(MHALAB_ALLOCATOR="system")) is None
    assert preload_env(_env(LD_PRELOAD="/usr/lib/libother.so")) is None  # the user's own preload stays
    assert preload_env(_env(MIMALLOC_PURGE_DELAY="10"))["MIMALLOC_PURGE_DELAY"] == "10"
    with pytest.raises(ConfigError, match="MHALAB_ALLOCATOR='jemalloc': choose mimalloc"):
        preload_env(_env(MHALAB_ALLOCATOR="jemalloc"))


def test_train_restarts_with_the_allocator_only_when_started_as_the_command(tmp_path):
    """`python train.py` re-executes itself preloaded (its run records the allocator); a process that calls
    mhalab.cli.train() from inside something else is never replaced."""
    probe = ("import os, sys; sys.argv = ['train.py', '--help']; from mhalab.train.allocator import "
             "reexec_with_allocator; reexec_with_allocator(); print('still here', os.environ.get('LD_PRELOAD'))")
    p = subprocess.run([sys.executable, "-c", probe], env=_env(), capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.stdout.strip() == "still here None"
    show = "import os; print(os.environ.get('LD_PRELOAD'), os.environ.get('MHALAB_ALLOCATOR'))"
    script = tmp_path / "cmd.py"
    script.write_text(f"from mhalab.train.allocator import reexec_with_allocator\nreexec_with_allocator()\n{show}\n")
    p = subprocess.run([sys.executable, str(script), "a=1"], env=_env(), capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.stdout.split() == [str(mimalloc_path()), "mimalloc"]
    p = subprocess.run([sys.executable, str(script)], env=_env(MHALAB_ALLOCATOR="bad"), capture_output=True,
                       text=True, timeout=60, check=False)
    assert p.returncode != 0 and "MHALAB_ALLOCATOR='bad'" in p.stderr
