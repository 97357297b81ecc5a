"""Re-make results/default_run from this commit: the default run (`make train`), its fingerprint, and the README
figures to check.

    python scripts/default_run.py
    python scripts/default_run.py fingerprint_only=true   # add this machine's fingerprint (another CPU's kernels)

From a checkout without uncommitted changes to tracked files (the run records its commit, and the record must
say what code made it). It runs `train.py` as `make train` does, copies the run's record and pictures into
results/default_run (metrics.json, loss_curves.png, the confusion matrices, config_tree.log; not the checkpoints),
measures the fingerprint (mhalab.checks.fingerprint: the loss at step 100 at one thread) into
results/default_run/fingerprint.json with the commit, and prints the README lines that must match
(tests/test_fingerprint.py checks all three). Run it on an idle machine: its time is README's too.

The fingerprint's last digits may depend on the CPU's kernels (AVX2, AVX512). Prints measured on other CPUs stay
beside the new one where their digits equal it (mhalab.checks.fingerprint.other_prints); `fingerprint_only=true`
measures this machine's alone and adds it, so the test compares exactly here too.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mhalab.analysis.options import doc, parse
from mhalab.checks import fingerprint
from mhalab.errors import one_line_errors

REPO = Path(__file__).resolve().parents[1]
DEST = REPO / "results" / "default_run"
KEEP = ("metrics.json", "loss_curves.png", "confusion_validation.png", "confusion_test.png", "config_tree.log")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def readme_lines(rec: dict) -> list[str]:
    """The phrases README.md must hold for this record (tests/test_fingerprint.py: the one rule for both)."""
    dev, test = 100 * rec["best"]["val/acc"], 100 * rec["best"]["test/acc"]
    minutes, seconds = divmod(round(rec["wall_time_s"]), 60)
    return [f"dev acc {dev:.1f}%", f"dev **{dev:.1f}%**, test **{test:.1f}%**", f"{minutes} min {seconds:02d} s"]


@dataclass
class DefaultRunConfig:
    fingerprint_only: bool = field(default=False, metadata=doc(
        "only measure this machine's fingerprint and add it to the record (a CPU whose kernels it has no print of)"))


def add_print_here() -> int:
    """This machine's fingerprint, measured from this commit, added to the record's `also` (or replacing the one
    there for the same environment)."""
    record = fingerprint.read(DEST)
    here = fingerprint.environment()
    if fingerprint.measured_in(record, here):
        print(f"error: the default run's own print is this machine's ({here}); re-run the default run instead "
              f"(python scripts/default_run.py).", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        print_ = {"commit": git("rev-parse", "HEAD"), **fingerprint.measure(Path(d) / "fingerprint")}
    also = [p for p in record.get("also", []) if not fingerprint.measured_in(p, here)]
    record["also"] = [*also, fingerprint.entry(print_)]
    fingerprint.write(DEST, record)
    same = "the same digits as" if print_["train_loss"] == record["train_loss"] else "other digits than"
    print(f"added {here}: train/loss {print_['train_loss']} at step {print_['step']}, {same} the default run's "
          f"print ({record['cpu_capability']}: {record['train_loss']})")
    return 0


@one_line_errors
def main(argv: list[str]) -> int:
    args = parse(DefaultRunConfig, argv, "python scripts/default_run.py", __doc__)
    if git("status", "--porcelain", "--untracked-files=no"):
        print("error: uncommitted changes to tracked files; commit them first (the default run records its commit, "
              "and results/default_run must say what code made it).", file=sys.stderr)
        return 2
    if args.fingerprint_only:
        return add_print_here()
    commit = git("rev-parse", "HEAD")
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d) / "default_run"
        subprocess.run([sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}"], cwd=REPO, check=True)
        rec = json.loads((run_dir / "metrics.json").read_text())
        if rec["provenance"]["git_commit"] != commit or rec["provenance"]["git_dirty"]:
            print(f"error: the run recorded commit {rec['provenance']['git_commit']} (dirty: "
                  f"{rec['provenance']['git_dirty']}), not {commit}.", file=sys.stderr)
            return 2
        print_ = {"commit": commit, **fingerprint.measure(Path(d) / "fingerprint")}
        old = fingerprint.read(DEST) if (DEST / fingerprint.FILE).is_file() else None
        if also := fingerprint.other_prints(print_, old):
            print_["also"] = also
        shutil.rmtree(DEST, ignore_errors=True)
        DEST.mkdir(parents=True)
        for name in KEEP:
            shutil.copy2(run_dir / name, DEST / name)
    fingerprint.write(DEST, print_)
    print(f"\nwrote {DEST.relative_to(REPO)} (commit {commit[:7]}); README.md must read:")
    for line in readme_lines(rec):
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
