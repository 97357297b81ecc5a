"""The default run's figures are this code's: its fingerprint (the training loss at step 100 of `mhalab-train` at one
thread) equals the one committed beside results/default_run, digit for digit; that record comes from a clean commit;
and README shows its figures. A change that moves the default run's numbers fails here until its author runs
`python scripts/default_run.py` and updates README (mhalab.checks.fingerprint)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import REPO, SHARED_DATA

from mhalab.checks import fingerprint

RECORD = REPO / "results" / "default_run"


def _script():
    spec = importlib.util.spec_from_file_location("default_run", REPO / "scripts" / "default_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_this_codes_default_run_loss_at_step_100_equals_the_committed_fingerprint_exactly(tmp_path):
    recorded = fingerprint.read(RECORD)
    here = fingerprint.environment()
    if {k: recorded[k] for k in here} != here:  # other kernels, other last digits: nothing to compare exactly
        pytest.skip(f"the fingerprint was measured with {({k: recorded[k] for k in here})}, this machine has {here}")
    measured = fingerprint.measure(tmp_path / "run", str(SHARED_DATA), str(tmp_path / "cache"))
    assert measured["step"] == recorded["step"] == fingerprint.STEPS - 1
    assert measured["train_loss"] == recorded["train_loss"], (
        f"the default run's numbers moved: train/loss at step {measured['step']} is {measured['train_loss']}, the "
        f"committed default run's (commit {recorded['commit'][:7]}) {recorded['train_loss']}. Re-run "
        f"`python scripts/default_run.py` from a clean checkout and update README's figures.")


def test_the_committed_default_run_comes_from_a_clean_commit_the_fingerprint_names():
    rec = json.loads((RECORD / "metrics.json").read_text())
    recorded = fingerprint.read(RECORD)
    assert rec["provenance"]["git_dirty"] is False
    assert rec["provenance"]["git_commit"] == recorded["commit"]
    assert rec["status"] == "finished" and rec["overrides"] == [] and rec["seed"] == 0  # the default run, as typed
    for name in _script().KEEP:
        assert (RECORD / name).stat().st_size > 0, name


def test_readme_shows_the_committed_default_runs_accuracy_and_time():
    rec = json.loads((RECORD / "metrics.json").read_text())
    readme = (REPO / "README.md").read_text()
    missing = [line for line in _script().readme_lines(rec) if line not in readme]
    assert not missing, f"README.md lacks {missing} (results/default_run/metrics.json)"
