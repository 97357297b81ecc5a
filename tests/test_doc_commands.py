"""Every command of README.md and of the documentation pages runs, as written, with tiny limits appended, on the
real data in ../shared/data.

The commands are read from the ```bash blocks of README.md and then of the pages in mkdocs.yml's nav order (a
line that fails fails CI), in that order, each line once (its first place), inside a copy of the checkout so that nothing they
write lands in it; the measured pages under results/ are records of long runs, not run. Each runs in a process of its
own, forked from one that has imported what the commands import (tests/fork_server.py: ~4 s less per command);
`make` lines start their own. What is appended, and why:
- training runs (`python train.py`, `make train`): 2 batches of 4 examples of train / val / test, 1 epoch, no bar
  (the long-sequence sweeps and the pretrainings spend their time computing, not starting);
- sweeps (`-m`, `sweep=`, `hparams_search=`): also `seed=0` (one seed per setting) and 2 Optuna trials; a sweep
  run until decided gets 2 first seeds and a budget of 3 (one round at most);
  a sweep a later `mhalab-ensemble runs=` line reads gets `seed=0,1,2` instead (an ensemble of 3 members);
  the first sweep whose preset runs members on joblib's workers runs as written (two workers); the later ones get
  `hydra.launcher.n_jobs=1`, which joblib runs in the sweep's own process (two workers start two interpreters,
  ~10 s of imports a sweep, to train a few tiny batches);
- GPU-sized lines (`experiment=article`, `*_gpu`): the CPU, float32, batches of 4 x 32 tokens and one
  layer of the article's width (dim 512, 8 heads, ff 2048): each checkpoint of six would be 230 MB;
- `make bench`: one short sequence length, one repetition; `scripts/sequential_cost.py`: a tenth of its draws.
`<run>` and `<sweep>` stand for the run and the sweep the first such commands made. A line that needs a GPU
(`trainer=ddp`, `trainer=gpu`) runs as typed on a machine without one and must refuse in one line, exit 2,
writing nothing (on a GPU machine it is composed). Lines that need what CI does not have (a SLURM cluster,
a GPU's sweep) are composed (`--cfg job`), not run; the GPU sweep's first member trains one batch on CPU in
tests/test_config_options.py. The ```python blocks run as they are (each asserts its result), and each
`$ mhalab-...` line of a plain ``` block must print the line under it. `make test` is the command that runs this
suite: CI runs it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_driver import console_scripts
from conftest import REPO, nav_pages
from hydra import compose, initialize_config_dir

from mhalab.train import record

README = REPO / "README.md"


def documents() -> list[Path]:
    """README.md, then the site's pages in mkdocs.yml's nav order (not results/: records of long runs)."""
    return [README, *(REPO / "docs" / p for p in nav_pages() if not p.startswith("results/"))]


DOCUMENTS = documents()


def blocks(kind: str) -> list[tuple[str, list[str]]]:
    """(document, its lines) for every ```<kind> block of the documents, in order ("" for plain blocks)."""
    out = []
    for doc in DOCUMENTS:
        block, lines = None, []
        for line in doc.read_text().splitlines():
            if line.startswith("```"):
                if block == kind:
                    out.append((doc.relative_to(REPO).as_posix(), lines))
                block, lines = (line[3:].strip(), []) if block is None else (None, [])
            elif block is not None:
                lines.append(line)
    return out
VENV = Path(sys.executable).parent.parent
TINY = ["++trainer.limit_train_batches=2", "++trainer.limit_val_batches=2", "++trainer.limit_test_batches=2",
        "max_epochs=1", "batch_size=4", "trainer.enable_progress_bar=false"]
SWEEP = ["seed=0"]
# a sweep run until decided needs 2 first seeds; a budget of 3 keeps it to one round at most
UNTIL_DECIDED = ["seed=0,1", "sweep.max_seeds=3", "sweep.round_seeds=1"]
ONE_JOB = ["hydra.launcher.n_jobs=1"]  # joblib runs the members in the sweep's own process
ON_CPU = ["trainer.accelerator=cpu", "trainer.precision=32-true", "trainer.devices=1", "batch_size=4",
          "max_len=32", "layers=1"]
BENCH = "seq_lens=[64] reps=1 warmup=0 memory=false"
# simulations: a tenth of the draws (the committed table's figures come from the defaults)
SIMULATE = {"scripts/sequential_cost.py": ["draws=2000", "calibration=10000"]}
# a GPU line on a machine without one refuses in one line, before anything is read or written
NEEDS_GPU = ("trainer=ddp ", "trainer=gpu ")
COMPOSE_ONLY = {"trainer=ddp": "needs GPUs", "hydra/launcher=slurm": "needs a SLURM cluster",
                "sweep=heads_gpu": "a GPU's sweep (tests/test_config_options.py trains its first member on CPU)"}
NOT_RUN = {("make", "test"): "this suite itself: CI runs it"}
SCRIPTS = tuple(console_scripts())  # pyproject's [project.scripts]


def doc_commands() -> list[tuple[str, list[str]]]:
    """(document, words) of each command of the ```bash blocks (a line, or lines joined by a trailing backslash),
    each once (its first place)."""
    cmds, seen = [], set()
    for doc, lines in blocks("bash"):
        # a line ending in a backslash goes on on the next, as in a shell (a long command kept inside the page's width)
        for line in filter(str.strip, "\n".join(lines).replace("\\\n", " ").splitlines()):
            words = shlex.split(line, comments=True)
            if (words and (words[0] in ("python", "make") or words[0] in SCRIPTS) and tuple(words[:2]) not in NOT_RUN
                    and tuple(words) not in seen):
                seen.add(tuple(words))
                cmds.append((doc, words))
    return cmds


def _is_train(words: list[str]) -> bool:
    return words[0] == "mhalab-train" or words[:2] == ["python", "train.py"]


def _argv(words: list[str]) -> list[str]:
    """What runs: a console script from the venv the suite runs in (as `make` installs it), or its python."""
    return [str(VENV / "bin" / words[0]), *words[1:]] if words[0] in SCRIPTS else [sys.executable, *words[1:]]


PLACED = doc_commands()
COMMANDS = [words for _, words in PLACED]
ENSEMBLED = {w.split("=", 1)[1] for c in COMMANDS if c[0] == "mhalab-ensemble" for w in c if w.startswith("runs=")}
ENSEMBLE_SEEDS = ["seed=0,1,2"]


def doc_examples() -> list[tuple[str, str]]:
    """(command, the line it prints) for each `$ python ...` / `$ mhalab-...` line of the plain ``` blocks."""
    out = []
    for _, lines in blocks(""):
        out += [(line[2:], lines[i + 1]) for i, line in enumerate(lines) if line.startswith(("$ python ", "$ mhalab-"))]
    return list(dict.fromkeys(out))


EXAMPLES = doc_examples()


@pytest.mark.parametrize("command, printed", EXAMPLES, ids=[_c for _c, _ in EXAMPLES])
def test_doc_example_prints_what_the_doc_shows(command, printed, tmp_path, fork_server):
    # as typed, with the repo's defaults: a user error comes before any data is read (nothing to append)
    proc = fork_server.run([*_argv(shlex.split(command)), f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO,
                           env=dict(os.environ, PYTHONHASHSEED="0"), timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == printed


PYTHON_BLOCKS = list(dict.fromkeys("\n".join(lines) for _, lines in blocks("python")))


@pytest.mark.parametrize("code", PYTHON_BLOCKS, ids=[f"python-{i}" for i in range(len(PYTHON_BLOCKS))])
def test_doc_python_example_holds(code, tmp_path):
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0 and "assert" in code, proc.stderr[-3000:]


def _id(words: list[str]) -> str:
    return re.sub(r"[^\w=.,/<>+-]+", "_", " ".join(words))[:80]


def test_docs_have_the_commands_this_test_expects():
    # the placeholders below are filled from earlier lines: the documents must keep that order
    text = [" ".join(w) for w in COMMANDS]
    first_run = next(i for i, w in enumerate(COMMANDS) if _is_train(w) and "-m" not in w)
    assert all(i > first_run for i, t in enumerate(text) if "<run>" in t)
    first_sweep = next(i for i, t in enumerate(text) if " -m " in t or "sweep=" in t)
    assert all(i > first_sweep for i, t in enumerate(text) if "<sweep>" in t)
    assert len(COMMANDS) >= 25, text
    assert len(EXAMPLES) >= 2, EXAMPLES
    assert PYTHON_BLOCKS, "the library example"


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> dict:
    """A copy of the checkout's files (outputs go there), and what earlier commands made."""
    root = tmp_path_factory.mktemp("docs") / "mhalab"
    shutil.copytree(REPO, root, ignore=shutil.ignore_patterns(".venv", ".git", ".cache", "outputs", "multirun",
                                                               "*.egg-info", "__pycache__", ".*_cache", "wandb"))
    return {"root": root, "run": None, "sweep": None}


def _launcher(words: list[str]) -> str:
    """The launcher a sweep command composes: its preset's, or the one it names."""
    choices = [w for w in words if w.startswith(("sweep=", "hydra/launcher="))]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=choices, return_hydra_config=True).hydra.launcher._target_


def _expand(words: list[str], state: dict) -> tuple[list[str], str]:
    """The command to run, and what to check afterwards ("run", "sweep", "compose", "plain")."""
    line, original = " ".join(words), words
    words = [w.replace("outputs/<run>", str(state["run"])).replace("multirun/<sweep>", str(state["sweep"]))
             for w in words]
    if words[0] == "make":
        make = ["make", "-o", str(VENV / ".installed"), f"VENV={VENV}", *words[1:]]
        if words[1] == "train":
            return [*make, f"ARGS={' '.join(TINY)}"], "plain"
        if words[1] == "bench":
            args = next((w.split("=", 1)[1] for w in words if w.startswith("ARGS=")), "")
            return [*[w for w in make if not w.startswith("ARGS=")], f"ARGS={args} {BENCH}"], "plain"
        return make, "plain"
    cmd = _argv(words)
    if not _is_train(words):
        return cmd + SIMULATE.get(words[1] if len(words) > 1 else "", []), "plain"
    if any(key in f"{line} " for key in NEEDS_GPU) and not torch.cuda.is_available():
        return [*cmd, *TINY, "hydra.run.dir=outputs/refused"], "refused"
    if any(key in line for key in COMPOSE_ONLY):
        return [*cmd, "--cfg", "job"], "compose"
    sweep = " -m" in f" {line} " or "sweep=" in line or "hparams_search=" in line
    seeds = (ENSEMBLE_SEEDS if any(f"hydra.sweep.dir={d}" in words for d in ENSEMBLED) else
             UNTIL_DECIDED if "sweep.until_decided=true" in words else SWEEP)
    extra = TINY + (seeds if sweep else []) + (["hydra.sweeper.n_trials=2"] if "hparams_search=" in line else [])
    if "experiment=article" in line or "_gpu" in line:
        extra += ON_CPU
    if sweep and "joblib" in _launcher(words):
        extra += ONE_JOB if state.setdefault("two_jobs_shown", False) else []
        state["two_jobs_shown"] = True
    if sweep and "hydra.sweep.dir=" not in line:
        extra.append(f"hydra.sweep.dir=multirun/doc-{len(state.get('sweeps', []))}")
    if not sweep and "hydra.run.dir=" not in line:
        extra.append(f"hydra.run.dir=outputs/doc-{COMMANDS.index(original)}")
    return cmd + extra, "sweep" if sweep else "run"


def _write_questions(root: Path) -> None:
    topics = {"HUM": "Who wrote {}, the novel ?", "LOC": "Where is {} , exactly ?", "NUM": "How many {} are there ?"}
    things = ["moby dick", "paris", "the moon", "rivers", "cats", "bridges", "stars", "kings"]
    for name, n in (("questions.csv", 96), ("questions_test.csv", 24)):
        rows = ["question,topic"] + [f'"{topics[t].format(things[i % 8])}",{t}'
                                     for i in range(n) for t in [sorted(topics)[i % 3]]]
        (root / name).write_text("\n".join(rows) + "\n")


@pytest.mark.parametrize("words", COMMANDS, ids=[f"{doc}:{_id(w)}" for doc, w in PLACED])
def test_doc_command_runs_as_written(words, checkout, fork_server):
    cmd, kind = _expand(words, checkout)
    if words[0] == "mhalab-predict":  # the documented input file, one text per line
        (checkout["root"] / "texts.txt").write_text("a gripping , funny film\nflat , dull and far too long\n")
    if "data=files" in words:  # the documented own files: CSVs of questions with string labels, commas quoted
        _write_questions(checkout["root"])
    env = dict(os.environ, MHALAB_CACHE_DIR=str(REPO / ".cache"), WANDB_MODE="offline", PYTHONHASHSEED="0")
    if cmd[0] == "make":  # make starts its own python
        proc = subprocess.run(cmd, cwd=checkout["root"], env=env, capture_output=True, text=True, timeout=900,
                              check=False)
    else:  # the console script or script, forked from a process that has imported what it imports
        proc = fork_server.run(cmd, cwd=checkout["root"], env=env, timeout=900)
    out = proc.stdout + proc.stderr
    if kind == "refused":
        assert proc.returncode == 2 and "Traceback" not in out, out[-4000:]
        assert proc.stderr.strip().splitlines()[-1].startswith("error: trainer.accelerator=gpu needs a CUDA GPU and "
                                                               "this machine has none; use trainer=ddp_cpu")
        assert not (checkout["root"] / "outputs" / "refused").exists()  # nothing written
        return
    assert proc.returncode == 0, f"{' '.join(words)}\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]
    root = checkout["root"]
    if kind == "run":
        run_dir = root / next(w.split("=", 1)[1] for w in cmd if w.startswith("hydra.run.dir="))
        rec = record.read(run_dir)
        assert rec and rec["status"] == "finished", rec
        # it ends with the summary of its record, and shows no third-party tips or meaningless FLOPs
        assert f"  val    acc {record.best(rec)['val/acc']:.2%}" in proc.stdout, proc.stdout[-2000:]
        assert "💡" not in out and "LeafSpec" not in out
        if "model=official" not in words:  # PyTorch's nested tensors: Lightning's summary cannot count them
            assert not re.search(r"Total FLOPs: 0\s*$", out, re.MULTILINE), out[-3000:]
        if checkout["run"] is None:
            checkout["run"] = run_dir
    elif kind == "sweep":
        sweep_dir = root / next(w.split("=", 1)[1] for w in cmd if w.startswith("hydra.sweep.dir="))
        checkout.setdefault("sweeps", []).append(sweep_dir)
        members = [record.read(p.parent) for p in sweep_dir.rglob(record.FILE)]
        assert members and all(m["status"] == "finished" for m in members), [m["error"] for m in members]
        if (sweep_dir / "report.md").exists():
            assert f"{len(members)} members, {len(members)} finished" in (sweep_dir / "report.md").read_text()
        if checkout["sweep"] is None:
            checkout["sweep"] = sweep_dir
    elif kind == "compose":
        assert "model:" in proc.stdout and "trainer:" in proc.stdout
    if words[0] == "mhalab-eval" or words[1:2] == ["scripts/eval.py"]:
        assert "test/acc" in proc.stdout
        assert "(the best by val/acc, step" in re.sub(r"\s+", " ", proc.stdout)  # of a run dir: the tested one
    if words[0] == "mhalab-predict":
        assert "(the best by val/acc, step" in proc.stderr, proc.stderr
        out_file = next((w.split("=", 1)[1] for w in words if w.startswith("output=")), None)
        lines = ((checkout["root"] / out_file).read_text() if out_file else proc.stdout).splitlines()
        assert len(lines) == 2 and all('"label"' in x and '"probs"' in x for x in lines), lines
    if words[0] == "mhalab-ensemble":  # the documented sweep of 3 seeds: one ensemble, scored beside its members
        assert "ensembles of 3" in proc.stdout and "3 members on test" in proc.stdout, proc.stdout[-3000:]
    if words[1:2] == ["compare"]:
        assert "PASS" in proc.stdout
    if words[0] == "mhalab-report" or words[1:2] == ["scripts/report.py"]:
        assert "members" in (checkout["sweep"] / "report.md").read_text()
