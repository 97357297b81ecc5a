"""The default run's figures are this code's: its fingerprint (the training loss at step 100 of `mhalab-train` at one
thread) equals the one committed beside results/default_run, digit for digit; that record comes from a clean commit;
and README shows its figures. A change that moves the default run's numbers fails here until its author runs
`python scripts/default_run.py` and updates README (mhalab.checks.fingerprint)."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, SHARED_DATA, load_script

from mhalab.checks import fingerprint

RECORD = REPO / "results" / "default_run"


def _script():
    return load_script("default_run")


def test_this_codes_default_run_loss_at_step_100_equals_the_committed_fingerprint_exactly(tmp_path):
    record = fingerprint.read(RECORD)
    here = fingerprint.environment()
    recorded = fingerprint.expected(record, here)
    if recorded is None:  # other kernels, maybe other last digits: nothing to compare exactly
        machines = [{k: p[k] for k in here} for p in (record, *record.get("also", []))]
        pytest.skip(f"the fingerprint was measured with {machines}, this machine has {here}: "
                    f"`python scripts/default_run.py fingerprint_only=true` adds its print")
    measured = fingerprint.measure(tmp_path / "run", str(SHARED_DATA), str(tmp_path / "cache"))
    assert measured["step"] == record["step"] == fingerprint.STEPS - 1
    assert measured["train_loss"] == recorded["train_loss"], (
        f"the default run's numbers moved: train/loss at step {measured['step']} is {measured['train_loss']}, the "
        f"committed print's for {here} (commit {recorded['commit'][:7]}) {recorded['train_loss']}. Re-run "
        f"`python scripts/default_run.py` from a clean checkout and update README's figures.")


def test_a_print_holds_for_its_cpu_and_a_new_run_keeps_other_cpus_prints_only_with_its_digits():
    avx512 = {"commit": "a" * 40, "torch": "2.13.0+cpu", "cpu_capability": "AVX512", "train_loss": "0.67"}
    avx2 = {"commit": "b" * 40, "torch": "2.13.0+cpu", "cpu_capability": "AVX2", "train_loss": "0.67"}
    record = {**avx512, "also": [avx2]}
    assert fingerprint.expected(record, {"torch": "2.13.0+cpu", "cpu_capability": "AVX2"}) == avx2
    assert fingerprint.expected(record, {"torch": "2.13.0+cpu", "cpu_capability": "AVX512"}) is record
    assert fingerprint.expected(record, {"torch": "2.14.0+cpu", "cpu_capability": "AVX2"}) is None
    same_code = {**avx512, "commit": "c" * 40}  # re-run on the AVX512 machine, the same digits
    assert fingerprint.other_prints(same_code, record) == [avx2]
    moved = {**avx512, "commit": "c" * 40, "train_loss": "0.66"}  # the numbers moved: AVX2's print is stale
    assert fingerprint.other_prints(moved, record) == []
    on_avx2 = {**avx2, "commit": "c" * 40}  # re-run on the AVX2 machine: the AVX512 print is the one kept
    assert fingerprint.other_prints(on_avx2, record) == [{k: avx512[k] for k in avx2}]
    assert fingerprint.other_prints(on_avx2, None) == []


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
