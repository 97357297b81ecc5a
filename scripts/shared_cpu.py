"""Default runs sharing this CPU: one alone, two at once as they now run (FairThreads moves their threads to the
cores left free), two at once with their threads pinned (the spinning the callback avoids), and a sweep of 2 jobs.

    python scripts/shared_cpu.py [steps=150] [reps=2] [out=results/bench/shared_cpu.md]

Each run is the default SST-2 run cut to `steps` optimizer steps (no test), its fit time read from its metrics.json;
the ratio is a run's fit time beside another against the mean of the runs alone of the same repetition. Run it on
an otherwise idle machine: anything else running is one more sharer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, str(REPO / "train.py"), "test_after_fit=false", "trainer.enable_progress_bar=false",
         "extras.print_config=false"]


def start(out: Path, steps: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([*TRAIN, f"++trainer.max_steps={steps}", f"hydra.run.dir={out}", *extra], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def fit_s(run_dir: Path) -> float:
    return float(json.loads((run_dir / "metrics.json").read_text())["fit_time_s"])


def together(tmp: Path, tag: str, steps: int, *extra: str) -> list[float]:
    procs = [(start(tmp / f"{tag}{i}", steps, *extra), tmp / f"{tag}{i}") for i in range(2)]
    for p, _ in procs:
        p.wait()
    return [fit_s(d) for _, d in procs]


def sweep(tmp: Path, tag: str, steps: int) -> list[float]:
    """A plain -m sweep of 2 settings run 2 at a time by Hydra's joblib launcher."""
    out = tmp / tag
    subprocess.run([TRAIN[0], TRAIN[1], "-m", *TRAIN[2:], "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "dropout=0.1,0.2",
                    f"++trainer.max_steps={steps}", f"hydra.sweep.dir={out}"], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [fit_s(p.parent) for p in sorted(out.glob("*/metrics.json"))]


def main(argv: list[str]) -> int:
    opts = {"steps": "150", "reps": "2", "out": "results/bench/shared_cpu.md"}
    opts.update(w.split("=", 1) for w in argv)
    steps, reps = int(opts["steps"]), int(opts["reps"])
    rows: dict[str, list[float]] = {"alone": [], "two at once": [], "two at once, threads pinned (num_threads=2)": [],
                                    "a sweep of 2 jobs (-m, joblib n_jobs=2)": []}
    ratios: dict[str, list[float]] = {k: [] for k in rows if k != "alone"}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for r in range(reps):  # interleaved: each repetition runs every case once
            alone = []
            for i in range(2):
                p = start(tmp / f"alone{r}{i}", steps)
                p.wait()
                alone.append(fit_s(tmp / f"alone{r}{i}"))
            rows["alone"] += alone
            for key, times in (("two at once", together(tmp, f"pair{r}", steps)),
                               ("two at once, threads pinned (num_threads=2)",
                                together(tmp, f"pinned{r}", steps, "num_threads=2")),
                               ("a sweep of 2 jobs (-m, joblib n_jobs=2)", sweep(tmp, f"sweep{r}", steps))):
                rows[key] += times
                ratios[key] += [t / mean(alone) for t in times]
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    L = ["# Default runs sharing the CPU", "",
         (f"Written by `python scripts/shared_cpu.py steps={steps} reps={reps}` ({stamp}, this machine, nothing else "
         f"running): the default SST-2 run cut to {steps} steps; fit time per run; ratio = a run's fit time against "
         "the runs alone of the same repetition."), "",
         "| case | fit time per run (s) | mean / mean alone | each run / its repetition's alone |",
         "|---|---|---|---|"]
    for key, times in rows.items():
        each = "–" if key == "alone" else f"{min(ratios[key]):.2f}-{max(ratios[key]):.2f}x"
        L.append(f"| {key} | {', '.join(f'{t:.1f}' for t in times)} | {mean(times) / mean(rows['alone']):.2f}x | "
                 f"{each} |")
    text = "\n".join(L) + "\n"
    print(text)
    if opts["out"]:
        (REPO / opts["out"]).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
