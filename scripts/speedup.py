"""This checkout's training speed against an older commit's, interleaved on the same machine: the default SST-2 step,
IMDB's, and the whole default run (`make train`).

    python scripts/speedup.py [base=259cabe] [reps=3] [cases=[sst2,imdb,make_train]] [out=results/bench/speedup.md]
    python scripts/speedup.py base=ecbc927 cases=[imdb] imdb_steps=80   # IMDB past its first steps' allocations

The older commit is checked out beside this one (a git worktree, `../mhalab-<base>`, kept for later calls) and runs
from its own source with this checkout's virtual environment. Each repetition runs every case once at each commit,
base first then this checkout, so drift spreads over both; a first untimed run per commit and case fills its caches
(tokenizer, encoded splits). Cases:

- sst2: `train.py ++trainer.max_steps=300 test_after_fit=false`: real tokens / fit time;
- imdb: `train.py data=imdb ++trainer.max_steps=20 test_after_fit=false`: the same (`imdb_steps=` sets the 20: a
  change to what a step keeps in memory shows in its first steps, while the allocator grows to the step's peak);
- make_train: `train.py` (3 epochs and the test, what `make train` runs): the command's wall time.

Tokens and times come from each run's metrics.json (train_tokens, fit_time_s) and the clock around the command. Run
it on an otherwise idle machine: anything else running is one more sharer.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from mhalab.analysis.options import doc, parse
from mhalab.errors import ConfigError, one_line_errors

REPO = Path(__file__).resolve().parents[1]
QUIET = ["trainer.enable_progress_bar=false", "extras.print_config=false"]
CASES = {"sst2": ["++trainer.max_steps=300", "test_after_fit=false"],
         "imdb": ["data=imdb", "test_after_fit=false"],  # and ++trainer.max_steps=<imdb_steps>
         "make_train": []}


def checkout(base: str) -> Path:
    """The base commit's source tree beside this checkout (a git worktree), made once."""
    sha = subprocess.run(["git", "rev-parse", "--short", base], cwd=REPO, check=True, capture_output=True,
                         text=True).stdout.strip()
    tree = REPO.parent / f"mhalab-{sha}"
    if not (tree / "train.py").is_file():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=REPO, check=True,
                       capture_output=True)
    return tree


def run_once(tree: Path, case: str, out: Path, imdb_steps: int = 20) -> dict:
    """One run of `case` from the source in `tree`: its fit time, real tokens and the command's wall time."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))  # that tree's mhalab before the installed checkout's
    t0 = time.perf_counter()
    steps = [f"++trainer.max_steps={imdb_steps}"] if case == "imdb" else []
    subprocess.run([sys.executable, str(tree / "train.py"), *QUIET, *CASES[case], *steps, f"hydra.run.dir={out}"], cwd=tree,
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    rec = json.loads((out / "metrics.json").read_text())
    return {"wall_s": wall, "fit_s": rec["fit_time_s"], "tokens": rec["train_tokens"],
            "tok_s": rec["train_tokens"] / rec["fit_time_s"], "dev": (rec.get("best") or {}).get("val/acc"),
            "test": (rec.get("best") or {}).get("test/acc")}


def ratio(case: str, base: float, new: float) -> float:
    """How many times better the new value is: shorter for make_train's seconds, higher for tokens per second."""
    return base / new if case == "make_train" else new / base


def render(runs: dict[tuple[str, str], list[dict]], cases: list[str], title: str) -> list[str]:
    """The markdown table: each run's figure at each commit, the ratio of the medians, and each repetition's own
    ratio (its base run against its run of this checkout): their spread is this machine's, which the median hides."""
    lines = [title, "", "| case | measure | base (each run) | this checkout (each run) | ratio of medians | each pair |",
             "|---|---|---|---|---|---|"]
    for c in cases:
        key, unit = ("wall_s", "s") if c == "make_train" else ("tok_s", "real tok/s")
        base, new = ([x[key] for x in runs[(c, k)]] for k in ("base", "head"))
        fmt = (lambda v: f"{v:,.0f}") if key == "tok_s" else (lambda v: f"{v:.0f}")
        pairs = ", ".join(f"{ratio(c, b, n):.2f}" for b, n in zip(base, new))
        lines.append(f"| {c} | {unit} | {', '.join(map(fmt, base))} | {', '.join(map(fmt, new))} | "
                     f"**{ratio(c, statistics.median(base), statistics.median(new)):.2f}x** | {pairs} |")
    if "make_train" in cases:
        lines += ["", "The whole default run's accuracy, each run (dev / test):", ""]
        for k in ("base", "head"):
            lines.append(f"- {k}: " + ", ".join(f"{100 * x['dev']:.2f} / {100 * x['test']:.2f}"
                                               for x in runs[("make_train", k)]))
    return lines


@dataclass
class SpeedupConfig:
    base: str = field(default="259cabe", metadata=doc("the older commit (any git revision)"))
    reps: int = field(default=3, metadata=doc("repetitions: every case once at each commit in each"))
    cases: list[str] = field(default_factory=lambda: list(CASES), metadata=doc(f"of {list(CASES)}"))
    imdb_steps: int = field(default=20, metadata=doc("the imdb case's optimizer steps"))
    out: str = field(default="results/bench/speedup.md", metadata=doc("the markdown table (and its .json beside)"))


@one_line_errors
def main(argv: list[str]) -> int:
    args = parse(SpeedupConfig, argv, "python scripts/speedup.py", __doc__)
    bad = [c for c in args.cases if c not in CASES]
    if bad:
        raise ConfigError(f"cases={bad}: choose among {list(CASES)}")
    if args.reps < 1 or args.imdb_steps < 1:
        raise ConfigError(f"reps={args.reps}, imdb_steps={args.imdb_steps}: both must be at least 1")
    cases = args.cases
    trees = {"base": checkout(args.base), "head": REPO}
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, check=True).stdout.strip())
    runs: dict[tuple[str, str], list[dict]] = {(c, k): [] for c in cases for k in trees}
    t_start = time.time()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for c in cases:  # warm-up: caches
            for k, tree in trees.items():
                run_once(tree, c if c != "make_train" else "sst2", tmp / f"warm-{c}-{k}")
        for r in range(args.reps):
            for c in cases:
                for k, tree in trees.items():
                    runs[(c, k)].append(run_once(tree, c, tmp / f"{c}-{k}-{r}", args.imdb_steps))
                    print(c, k, r, json.dumps(runs[(c, k)][-1]), flush=True)
    title = (f"This checkout ({head.strip()}{', with uncommitted changes' if dirty else ''}) against "
             f"{args.base}, interleaved, {args.reps} repetitions "
             f"(`python scripts/speedup.py {' '.join(argv)}`, {time.strftime('%Y-%m-%d', time.gmtime(t_start))}, "
             f"{os.cpu_count()} CPUs, {(time.time() - t_start) / 60:.0f} min)")
    lines = render(runs, cases, title)
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    (Path(args.out).with_suffix(".json")).write_text(json.dumps({f"{c}/{k}": v for (c, k), v in runs.items()},
                                                                   indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
