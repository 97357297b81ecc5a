"""Every user mistake, through the real command line: one line `error: <message>` on stderr, exit status 2,
no traceback, and (train.py) before any expensive work: no tokenizer trained.

The table below is the user-facing text of each message; `{tmp}` stands for this module's temporary dir
and `{run}` for a real run dir trained once here (tiny, ~10 s). A fresh interpreter costs ~4-5 s of
imports, so the cases run their scripts as `__main__` in one Python process per batch (tests/cli_driver.py:
argv, exit status, stdout and stderr as a shell sees them); a few also run one per process
(ONE_PER_PROCESS), which proves the same line and status come out of a real `python train.py`. The
batches run two at a time in a pool started by the `outcomes` fixture; each case waits for its own result.
"""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from conftest import REPO, write_toy_sst2


class Case(NamedTuple):
    id: str
    script: str  # train.py, scripts/eval.py, scripts/attention_map.py, or a console command (mhalab-*)
    args: list[str]  # after the base args for train.py; {tmp} and {run} are filled in
    message: str  # the expected last stderr line, after "error: "
    data: str | None = None  # train.py: paths.data_dir under {tmp} (None: the toy SST-2 dir)
    run_dir: str | None = None  # train.py: hydra.run.dir under {tmp} (None: {tmp}/<id>/run)


MISSING = "{tmp}/no-such.ckpt"
CASES = [
    # ---------------------------------------------------------------- the command line itself (Hydra's grammar)
    Case("unknown-key-typo", "train.py", ["heeds=16"],
         "unknown key 'heeds'; did you mean heads? (a new key needs a +: +heeds=...)"),
    Case("unknown-nested-key", "train.py", ["model.poolin=max"],
         "unknown key 'model.poolin'; did you mean model.pooling? (a new key needs a +: +model.poolin=...)"),
    Case("unknown-key-of-a-chosen-group", "train.py", ["pretrain=mlm", "pretrain.epoch=3"],
         "unknown key 'pretrain.epoch'; did you mean pretrain.epochs? (a new key needs a +: +pretrain.epoch=...)"),
    Case("unknown-key-far-from-any", "train.py", ["zzz=1"], "unknown key 'zzz' (a new key needs a +: +zzz=...)"),
    Case("two-unknown-keys", "train.py", ["trainer.limit_val_batches=2", "trainer.limit_test_batches=2"],
         "unknown key 'trainer.limit_val_batches' (a new key needs a +: +trainer.limit_val_batches=...)"),
    Case("unknown-group-option", "train.py", ["model=customm"],
         "unknown model 'customm'; choose one of custom, official."),
    Case("unknown-option-in-a-sweep", "train.py", ["-m", "seed=0,1", "callbacks=ema,emaa"],
         "unknown callbacks 'emaa'; choose one of attention_maps, default, early_stopping, ema, wandb_extras."),
    Case("unknown-key-in-an-interval-search", "train.py", ["-m", "hparams_search=optuna", "lrr=interval(1e-4,1e-2)"],
         "unknown key 'lrr'; did you mean lr? (a new key needs a +: +lrr=...)"),
    Case("unknown-option-in-the-sweepers-search-space", "train.py",
         ["-m", "hparams_search=optuna", "+hydra.sweeper.params.model='choice(custom,offical)'"],
         "unknown model 'offical'; choose one of custom, official."),
    Case("unreadable-override", "train.py", ["data.name=a=b"],
         "cannot read the override 'data.name=a=b' (mismatched input '=' expecting <EOF>); a value holding '=', "
         "',', spaces or brackets goes in quotes: key='a b'."),
    Case("eval-unknown-key", "mhalab-eval", ["ckpt_pth={run}"],
         "unknown key 'ckpt_pth'; did you mean ckpt_path? (a new key needs a +: +ckpt_pth=...)"),
    # ---------------------------------------------------------------- config values
    Case("heads-not-an-int", "train.py", ["heads=four"], "heads='four' must be an integer."),
    Case("heads-do-not-divide-dim", "train.py", ["dim=100", "heads=16"],
         "heads=16 does not divide dim=100 (dim per head would be 6.25); choose heads in "
         "[1, 2, 4, 5, 10, 20, 25, 50] or a dim that is a multiple of 16."),
    Case("max-epochs-0", "train.py", ["max_epochs=0"],
         "max_epochs=0 trains nothing; set max_epochs >= 1 (debug=fast runs one batch of each split)."),
    Case("max-epochs-negative", "train.py", ["max_epochs=-1"],
         "max_epochs=-1 would train forever and the lr schedule needs a length; set max_epochs >= 1, "
         "or trainer.max_steps=N."),
    Case("unknown-pooling", "train.py", ["model.pooling=maxx"],
         "unknown model.pooling 'maxx'; choose one of mean, cls, max."),
    Case("unknown-schedule", "train.py", ["optim.schedule=step"],
         "unknown optim.schedule 'step'; choose one of cosine, linear, constant."),
    Case("label-smoothing-1", "train.py", ["optim.label_smoothing=1"],
         "optim.label_smoothing=1.0 must be in [0, 1), e.g. 0.1."),
    Case("ema-decay-1", "train.py", ["callbacks=ema", "callbacks.ema.decay=1"],
         "callbacks.ema.decay=1.0 must be in (0, 1), e.g. 0.99 (an average over ~100 steps)."),
    Case("unknown-activation", "train.py", ["model.activation=swish"],
         "unknown model.activation 'swish'; choose one of relu, gelu."),
    Case("window-covers-max-len", "train.py", ["model.attention=window"],  # default window 128 > max_len 32
         "model.attention=window with model.attention_options.window=128 (64 keys on each side, plus 1 "
         "global token) covers every position of max_len=32: it would be full attention; set "
         "model.attention_options.window below 60 (e.g. 16) or use model.attention=full."),
    Case("unknown-attention-option", "train.py", ["+model.attention_options.foo=1"],
         "unknown option model.attention_options.foo; the options are model.attention_options.window, "
         "model.attention_options.global_tokens, model.attention_options.linformer_k, "
         "model.attention_options.performer_features."),
    Case("unknown-attention", "train.py", ["model.attention=sparse"],
         "unknown model.attention 'sparse'; choose one of full, window, linformer, performer."),
    Case("unknown-pos", "train.py", ["model.pos=relative"],
         "unknown model.pos 'relative'; choose one of sinusoidal, learned, rope, alibi, t5."),
    Case("official-with-rope", "train.py", ["model=official", "model.pos=rope"],
         "model=official supports attention=full with pos=sinusoidal|learned only (got attention=full, "
         "pos=rope); use model=custom for the variants."),
    Case("official-with-head-dim", "train.py", ["model=official", "model.head_dim=16"],
         "model=official cannot take model.head_dim=16: nn.MultiheadAttention splits dim among the heads; set "
         "model.head_dim=null (dim / heads) or use model=custom."),
    Case("head-dim-0", "train.py", ["model.head_dim=0"], "model.head_dim=0 must be >= 1 (or null: dim / heads)."),
    Case("lr-0", "train.py", ["lr=0"], "lr=0 must be > 0, e.g. 1e-3."),
    Case("dropout-1", "train.py", ["dropout=1.0"], "dropout=1.0 must be in [0, 1), e.g. 0.1."),
    Case("max-len-2", "train.py", ["max_len=2"],
         "data config 'sst2': max_len=2 is too small: it must be >= 3 ([CLS], [SEP] and one token); raise max_len."),
    Case("batch-size-0", "train.py", ["batch_size=0"], "batch_size=0 must be >= 1."),
    Case("dev-split-2", "train.py", ["data.dev_split=2"],
         "data config 'sst2': dev_split=2 must be a fraction in (0, 1), e.g. 0.1, or null (this data set has a "
         "validation file: null uses it)."),
    Case("enforce-tags-without-tags", "train.py", ["extras.enforce_tags=true"],
         "extras.enforce_tags=true but the run has no tags; pass tags=[baseline,heads] (any names that let you "
         "find the run later), or extras.enforce_tags=false."),
    # ---------------------------------------------------------------- checkpoints
    Case("ckpt-missing", "train.py", [f"ckpt_path={MISSING}"],
         f"ckpt_path={MISSING} does not exist; pass a .ckpt file or a run dir."),
    Case("ckpt-text-file", "train.py", ["ckpt_path={tmp}/notes.txt"],
         "ckpt_path={tmp}/notes.txt is not a PyTorch checkpoint (not a zip archive, or cut short); pass a "
         ".ckpt from a run's checkpoints/ dir, or the run dir."),
    Case("ckpt-truncated", "train.py", ["ckpt_path={run}/truncated.ckpt"],
         "ckpt_path={run}/truncated.ckpt is not a PyTorch checkpoint (not a zip archive, or cut short); pass "
         "a .ckpt from a run's checkpoints/ dir, or the run dir."),
    Case("ckpt-runs-code", "train.py", ["ckpt_path={tmp}/code.ckpt"],  # and the code did not run: see below
         "ckpt_path={tmp}/code.ckpt holds objects a safe load refuses (code: posix.system); it was not written "
         "by mhalab's train.py, and is not loaded: pass a checkpoint from a run's checkpoints/ dir."),
    Case("ckpt-other-classes", "train.py", ["ckpt_path={run}", "data.num_classes=3"],
         "ckpt_path={run}/checkpoints/last.ckpt holds a 2-class model (trained on sst2), but the config has 3 "
         "classes (data=sst2); resume on sst2 with data.num_classes=2."),
    Case("ckpt-other-head-dim", "train.py", ["ckpt_path={run}", "model.head_dim=16"],
         "ckpt_path={run}/checkpoints/last.ckpt holds a model with head_dim=null, but the config has head_dim=16; "
         "resume with the same model settings (e.g. head_dim=null)."),
    Case("ckpt-other-shape", "train.py", ["ckpt_path={run}", "heads=2"],
         "ckpt_path={run}/checkpoints/last.ckpt holds a model with heads=4, but the config has heads=2; "
         "resume with the same model settings (e.g. heads=4)."),
    # ---------------------------------------------------------------- data files
    Case("data-latin-1", "train.py", [], data="latin1",
         message="'{tmp}/latin1/sst2/train.tsv': line 402 is not valid utf-8 (byte 0xe8 at column 11); set "
                 "data.encoding=latin-1 (or the file's encoding), or re-save the file as UTF-8."),
    Case("data-comma-separated", "train.py", [], data="comma",
         message="'{tmp}/comma/sst2/train.tsv': the header 'sentence,label' has one column with "
                 "data.delimiter='\\t'; it looks comma-separated: set data.delimiter=',' and data.quoting=0 "
                 "(csv.QUOTE_MINIMAL)."),
    Case("data-dir-missing", "train.py", [], data="no-such-dir",
         message="data directory '{tmp}/no-such-dir' does not exist: put the 'sst2' files (sst2/train.tsv, "
                 "sst2/dev.tsv, sst2/test.tsv) there, or point the config at them with "
                 "data.data_dir=/path/to/data or the MHALAB_DATA_DIR environment variable."),
    Case("data-truncated-gzip", "train.py", ["data.format=json", "data.files.train=x.jsonl.gz",
                                             "data.files.validation=dev.jsonl", "data.files.test=test.jsonl"],
         data="gz",
         message="'{tmp}/gz/x.jsonl.gz' is not a complete gzip file (truncated or corrupt: Compressed file "
                 "ended before the end-of-stream marker was reached); re-download or re-compress it."),
    # ---------------------------------------------------------------- run dir
    Case("run-dir-in-use", "train.py", [], run_dir="held",
         message="{tmp}/held is in use by pid 1234 on h (since t); wait for it to finish, or write this run "
                 "elsewhere (hydra.run.dir=<dir>)."),
    # ---------------------------------------------------------------- scripts
    Case("eval-no-ckpt-path", "scripts/eval.py", [],
         "ckpt_path is required: pass ckpt_path=<a .ckpt file, a run dir, or last>, e.g. ckpt_path=outputs/<run> "
         "split=test."),
    Case("eval-ckpt-missing", "scripts/eval.py", [f"ckpt_path={MISSING}"],
         f"ckpt_path={MISSING} does not exist; pass a .ckpt file or a run dir."),
    Case("eval-unknown-split", "scripts/eval.py", ["ckpt_path={run}", "split=nosuch"],
         "split=nosuch is not a split of this data set; choose one of train, validation, test."),
    Case("eval-which-checkpoint", "scripts/eval.py", ["ckpt_path={run}", "checkpoint=lest"],
         "checkpoint=lest is not one of best, last; use checkpoint=best (the run's best checkpoint, the one it "
         "tested) or checkpoint=last (where it stopped)."),
    # ---------------------------------------------------------------- console commands (pyproject's scripts)
    Case("mhalab-eval-batch-size-0", "mhalab-eval", ["ckpt_path={run}", "batch_size=0"],
         "batch_size=0 must be a positive integer."),
    Case("predict-no-ckpt-path", "mhalab-predict", ["input={tmp}/notes.txt"],
         "ckpt_path is required: mhalab-predict ckpt_path=<a .ckpt file or a run dir> input=<file.txt|.csv|.tsv|"
         ".jsonl, or - for stdin> [output=preds.jsonl]."),
    Case("predict-ckpt-missing", "mhalab-predict", [f"ckpt_path={MISSING}", "input={tmp}/notes.txt"],
         f"ckpt_path={MISSING} does not exist; pass a .ckpt file or a run dir."),
    Case("predict-input-missing", "mhalab-predict", ["ckpt_path={run}", "input={tmp}/no-such.txt"],
         "input={tmp}/no-such.txt does not exist; pass a .txt file (one text per line), a .csv / .tsv / .jsonl "
         "file (a 'text' column), or input=- (stdin)."),
    Case("predict-no-text-column", "mhalab-predict", ["ckpt_path={run}", "input={tmp}/reviews.csv"],
         "input={tmp}/reviews.csv has no column 'text' (its columns: review, stars); pass text_column=<the "
         "column with the texts>."),
    Case("attention-map-ckpt-missing", "scripts/attention_map.py", [f"ckpt_path={MISSING}", "text=hi"],
         f"ckpt_path={MISSING} does not exist; pass a .ckpt file or a run dir."),
    Case("ensemble-no-runs", "mhalab-ensemble", [],
         "runs is required: mhalab-ensemble runs=<a sweep dir> or 'runs=[<run dir>,<run dir>]'."),
    Case("ensemble-not-a-run", "mhalab-ensemble", ["runs={tmp}/no-such-dir"],
         "runs: {tmp}/no-such-dir is not a .ckpt file, a run dir (with metrics.json) or a sweep dir (run dirs "
         "inside); pass runs=<sweep dir> or runs=[<run dir>,...]."),
    Case("ensemble-of-one", "mhalab-ensemble", ["runs=[{tmp}/code.ckpt]"],
         "an ensemble needs 2 or more finished runs; {tmp}/code.ckpt gave 1."),
    Case("ensemble-size-1", "mhalab-ensemble", ["runs=[{tmp}/code.ckpt,{tmp}/code.ckpt]", "size=1"],
         "size=1 must be an integer from 2 to the 2 finished members (or null: one ensemble of them all)."),
    # a sweep member's dir (named key=value,...) reaches the command intact, not as Hydra's grammar error
    Case("eval-member-dir", "mhalab-eval", ["ckpt_path={tmp}/sweep/data=trec,seed=0"],
         "ckpt_path={tmp}/sweep/data=trec,seed=0 does not exist; pass a .ckpt file or a run dir."),
    Case("init-from-member-dir", "train.py", ["init_from={tmp}/sweep/seed=0"],
         "init_from={tmp}/sweep/seed=0 does not exist; pass a pretraining dir (<cache>/pretrain/<data>/mlm-...) or "
         "its encoder.pt."),
    Case("baseline-bad-seeds", "mhalab-baseline", ["seeds=[-1]"],
         "seeds=[-1] must be a list of integers >= 0, e.g. seeds=[0,1,2]."),
    Case("accuracy-no-such-dir", "mhalab-accuracy", ["{tmp}/no-such-dir"],
         "{tmp}/no-such-dir does not exist; give the folder that holds the run dirs (or a runs CSV)"),
    # ---------------------------------------------------------------- self-pretraining
    Case("init-from-missing", "train.py", ["init_from={tmp}/no-such-dir"],
         "init_from={tmp}/no-such-dir does not exist; pass a pretraining dir (<cache>/pretrain/<data>/mlm-...) or "
         "its encoder.pt."),
    Case("pretrain-mask-prob", "train.py", ["pretrain=mlm", "pretrain.mask_prob=0"],
         "pretrain.mask_prob=0 must be in (0, 1), e.g. 0.15."),
]
# ---------------------------------------------------------------- the wrong machine (this one has no GPU): refused
# before Hydra makes the run dir (so are a single run's own config and data checks: no case leaves a run dir)
NO_GPU = "trainer.accelerator=gpu needs a CUDA GPU and this machine has none; use {}, or run where " \
         "torch.cuda.is_available()."
MACHINE = [
    Case("machine-trainer-gpu", "train.py", ["trainer=gpu"], NO_GPU.format("trainer=cpu")),
    Case("machine-trainer-ddp", "train.py", ["trainer=ddp"], NO_GPU.format("trainer=ddp_cpu (processes on the CPU)")),
    Case("machine-experiment-article", "train.py", ["experiment=article"], NO_GPU.format("trainer=cpu")),
    Case("machine-gpu-devices-in-a-sweep", "train.py", ["-m", "seed=0,1", "trainer=gpu", "trainer.devices=4"],
         NO_GPU.format("trainer=cpu")),
]
CASES += MACHINE

SMALL = ["trainer=cpu", "trainer.enable_progress_bar=false", "callbacks.progress_bar=null", "dim=32",
         "heads=4", "layers=1", "batch_size=16", "max_len=32", "data.vocab_size=200", "data.min_frequency=1"]
CODE_RAN = "code-ran"  # the file the pickled payload in code.ckpt creates when it is unpickled unsafely


def _base(run_dir: Path, data_dir: Path, cache_dir: Path) -> list[str]:
    return [f"hydra.run.dir={run_dir}", f"paths.data_dir={data_dir}", f"paths.cache_dir={cache_dir}", *SMALL]


def _fill(s: str, tmp: Path) -> str:
    return s.replace("{run}", str(tmp / "trained")).replace("{tmp}", str(tmp))


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "MHALAB_DATA_DIR")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _run(argv: list[str], **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, check=False,
                          env=_env(**env), timeout=300)


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):  # what an unsafe torch.load would call
        return os.system, (f"touch '{self.marker}'",)


def _write_inputs(tmp: Path, toy: Path) -> None:
    """The bad files (the truncated checkpoint comes after training)."""
    (tmp / "notes.txt").write_text("these are my notes, not a checkpoint\n")
    (tmp / "reviews.csv").write_text("review,stars\na fine film,4\n")  # mhalab-predict: no `text` column
    torch.save({"state_dict": {}, "payload": _RunsCode(tmp / CODE_RAN)}, tmp / "code.ckpt")
    # the payload is real: an unsafe load runs it (and the test's own marker is removed again)
    torch.load(tmp / "code.ckpt", weights_only=False)
    assert (tmp / CODE_RAN).exists(), "the code.ckpt payload does not run; the case would prove nothing"
    (tmp / CODE_RAN).unlink()

    train = write_toy_sst2(tmp / "latin1") / "sst2" / "train.tsv"  # line 402: a latin-1 row
    train.write_bytes(train.read_bytes() + "un film tr\xe8s beau\t1\n".encode("latin-1"))
    train = write_toy_sst2(tmp / "comma") / "sst2" / "train.tsv"
    train.write_text(train.read_text().replace("\t", ","))

    gz = tmp / "gz"
    gz.mkdir()
    for split, src in (("x.jsonl.gz", "train"), ("dev.jsonl", "dev"), ("test.jsonl", "test")):
        rows = [line.split("\t") for line in (toy / "sst2" / f"{src}.tsv").read_text().splitlines()[1:]]
        text = "".join(json.dumps({"sentence": s, "label": int(y)}) + "\n" for s, y in rows)
        if split.endswith(".gz"):
            data = gzip.compress(text.encode())
            (gz / split).write_bytes(data[: len(data) // 2])
        else:
            (gz / split).write_text(text)


def _train(tmp: Path, toy: Path) -> Path:
    """One tiny real run (the checkpoint cases' run dir), and a truncated copy of its last.ckpt."""
    run = tmp / "trained"
    p = _run(["train.py", *_base(run, toy, tmp / "trained-cache"), "max_epochs=1", "num_threads=1",
             "test_after_fit=false"])
    assert p.returncode == 0, f"the tiny training run failed:\n{p.stderr[-3000:]}"
    ckpt = (run / "checkpoints" / "last.ckpt").read_bytes()
    (run / "truncated.ckpt").write_bytes(ckpt[: len(ckpt) // 2])
    return run


ONE_PER_PROCESS = ("unknown-key-typo", "heads-not-an-int", "data-latin-1", "eval-no-ckpt-path")


def _argv(case: Case, tmp: Path, toy: Path) -> list[str]:
    args = [_fill(a, tmp) for a in case.args]
    if case.script == "train.py":
        data = tmp / case.data if case.data else toy
        run_dir = tmp / case.run_dir if case.run_dir else tmp / case.id / "run"
        if "-m" in args:
            run_dir = run_dir.parent / "multirun"
        # the case's own choice of a base key wins (an experiment chooses its trainer)
        keys = {a.split("=", 1)[0] for a in args}
        keys |= {"trainer"} if "experiment" in keys else set()
        base = [b for b in _base(run_dir, data, tmp / case.id / "cache") if b.split("=", 1)[0] not in keys]
        if "-m" in args:
            base = [b.replace("hydra.run.dir=", "hydra.sweep.dir=") for b in base]
        args = base + args
    return [case.script, *args]


def _batch(cases: list[Case], tmp: Path, toy: Path, trained: Future | None) -> dict:
    """Run the cases in one process (tests/cli_driver.py); {case id: CompletedProcess}."""
    if trained is not None:
        trained.result()
    name = "with-run" if trained else "without-run"
    commands, results = tmp / f"{name}.json", tmp / f"{name}.results.json"
    commands.write_text(json.dumps([_argv(c, tmp, toy) for c in cases]))
    p = _run([str(Path(__file__).with_name("cli_driver.py")), str(commands), str(results)])
    assert p.returncode == 0, f"the driver failed:\n{p.stderr[-3000:]}"
    return {c.id: subprocess.CompletedProcess(r["args"], r["returncode"], r["stdout"], r["stderr"])
            for c, r in zip(cases, json.loads(results.read_text()))}


def _metrics_aside(tmp: Path, toy: Path, trained: Future) -> subprocess.CompletedProcess:
    trained.result()  # its cache: the tokenizer and the encoded splits are there already
    run = tmp / "broken-record"
    run.mkdir()
    (run / "metrics.json").write_bytes(b'{"status": "finished", "final": {"test/ac')
    return _run(["train.py", *_base(run, toy, tmp / "trained-cache"), "max_epochs=1", "num_threads=1",
                 "trainer.limit_train_batches=2", "test_after_fit=false"])


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cli_errors")


@pytest.fixture(scope="module")
def outcomes(tmp, toy_data_dir):
    """Start every command, two at a time: the training run first (the {run} cases wait for it)."""
    _write_inputs(tmp, toy_data_dir)
    held = tmp / "held"  # a run dir held by a live process (this one)
    held.mkdir()
    fd = os.open(held / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"pid": 1234, "host": "h", "started": "t"}).encode())

    pool = ThreadPoolExecutor(2)
    trained = pool.submit(_train, tmp, toy_data_dir)
    needs_run = [c for c in CASES if any("{run}" in a for a in c.args)]
    without = pool.submit(_batch, [c for c in CASES if c not in needs_run], tmp, toy_data_dir, None)
    with_run = pool.submit(_batch, needs_run, tmp, toy_data_dir, trained)
    futures = {c.id: pool.submit(lambda c=c: (with_run if c in needs_run else without).result()[c.id])
               for c in CASES}
    for c in CASES:  # the same cases, each in its own interpreter: what a shell really sees
        if c.id in ONE_PER_PROCESS:
            own = c._replace(id=f"{c.id}-own-process")
            futures[own.id] = pool.submit(_run, _argv(own, tmp, toy_data_dir))
    futures["hydra-full-error"] = pool.submit(
        _run, ["train.py", *_base(tmp / "full-error" / "run", toy_data_dir, tmp / "full-error" / "cache"),
               "heads=four"], HYDRA_FULL_ERROR="1")
    futures["metrics-aside"] = pool.submit(_metrics_aside, tmp, toy_data_dir, trained)
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)
    os.close(fd)


def _show(p: subprocess.CompletedProcess) -> str:
    command = " ".join(map(str, p.args[1:]))
    return f"\n$ {command}\n--- exit {p.returncode}; stderr (tail) ---\n{p.stderr[-3000:]}"


@pytest.mark.parametrize("case", [*CASES, *(c._replace(id=f"{c.id}-own-process") for c in CASES
                                             if c.id in ONE_PER_PROCESS)], ids=lambda c: c.id)
def test_user_error_is_one_line_and_exit_2(case, outcomes, tmp):
    p = outcomes[case.id].result()
    assert "Traceback" not in p.stdout + p.stderr, _show(p)
    assert p.returncode == 2, _show(p)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines and lines[-1] == "error: " + _fill(case.message, tmp), _show(p)
    assert sum(line.startswith("error:") for line in lines) == 1, _show(p)
    if case in MACHINE or case.script == "train.py" and case.run_dir is None and "-m" not in case.args:
        # a refused run leaves nothing behind: refused before Hydra made a run dir (or a sweep dir), or its new
        # run dir removed
        left = [p for p in (tmp / case.id).glob("*") if p.name != "cache"]
        assert not left, f"a refused run left {left}" + _show(p)
    if case.script == "train.py":  # it failed before the expensive work
        trained = list((tmp / case.id / "cache").glob("**/tokenizer-*.json"))
        assert not trained, f"a tokenizer was trained before the error: {trained}" + _show(p)
    assert not (tmp / CODE_RAN).exists(), "a checkpoint's pickled code ran" + _show(p)


def test_hydra_full_error_shows_the_traceback(outcomes):
    p = outcomes["hydra-full-error"].result()
    assert p.returncode != 0, _show(p)
    assert "Traceback" in p.stderr and "ConfigError: heads='four' must be an integer." in p.stderr, _show(p)


def test_unreadable_metrics_json_is_kept_aside_and_the_run_goes_on(outcomes, tmp):
    p = outcomes["metrics-aside"].result()
    assert p.returncode == 0 and "Traceback" not in p.stdout + p.stderr, _show(p)
    run = tmp / "broken-record"
    aside = list(run.glob("metrics.json.unreadable-*"))
    assert len(aside) == 1, f"{sorted(x.name for x in run.iterdir())}" + _show(p)
    assert aside[0].read_bytes() == b'{"status": "finished", "final": {"test/ac'
    assert json.loads((run / "metrics.json").read_text())["status"] == "finished"


def test_quote_paths_quotes_only_path_values_that_hold_an_equals_sign():
    from mhalab.cli import quote_paths

    argv = ["ckpt_path=multirun/x/data=trec,seed=0", "+init_from=a/b=1", "heads=4", "runs=multirun/x",
            "input='a=b'", "runs=[a,b]", "seed=0,1", "tags=[a=b]"]
    assert quote_paths(argv) == ["ckpt_path='multirun/x/data=trec,seed=0'", "+init_from='a/b=1'", "heads=4",
                                 "runs=multirun/x", "input='a=b'", "runs=[a,b]", "seed=0,1", "tags=[a=b]"]


def test_check_machine_counts_the_gpus_a_trainer_asks_for(monkeypatch):
    """The GPU-count branch of the machine check (this machine has no GPU: the cases above take the other)."""
    from mhalab.errors import ConfigError
    from mhalab.train.config import check_machine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for ok in ({"accelerator": "gpu", "devices": 2}, {"accelerator": "gpu", "devices": -1},
               {"accelerator": "gpu", "devices": [0, 1]}, {"accelerator": "cpu", "devices": 8},
               {"accelerator": "gpu", "devices": "auto"}):
        check_machine(ok)
    for devices, wanted in ((4, 4), ("3", 3), ([0, 1, 2], 3)):
        with pytest.raises(ConfigError) as e:
            check_machine({"accelerator": "gpu", "devices": devices, "strategy": "ddp"})
        assert str(e.value) == (f"trainer.devices={devices} asks for {wanted} GPUs and this machine has 2; set "
                                f"trainer.devices=2 (or -1: all of them).")


@pytest.mark.parametrize("mistake", [["heads=16", "dim=100"], ["dropout=1.5"], ["model.attention=window"],
                                     ["optim.lr=-1"], ["optim.schedule=step"], ["optim.label_smoothing=1"],
                                     ["callbacks=ema", "callbacks.ema.decay=1"]],
                         ids=["heads", "dropout", "attention-options", "lr", "schedule", "label-smoothing", "ema-decay"])
def test_a_models_or_optimizers_mistake_is_told_before_lightning_loads(mistake, tmp_path):
    # the model's and the optimizer's checks need torch only (mhalab.model, mhalab.train.optimizer): the commonest
    # mistakes come back in ~2 s, not after Lightning's ~3 s import
    probe = ("import sys\nsys.argv = ['train.py', *sys.argv[1:]]\nfrom mhalab.cli import train\n"
             "try:\n    train()\nexcept SystemExit as e:\n    print(e.code, 'lightning' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", probe, *mistake, f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO,
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.stdout.split() == ["2", "False"], p.stdout + p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1].startswith("error: ") and not (tmp_path / "run").exists()
