"""The one-command GPU check: CUDA tests, encoder benchmark (TFLOP/s, MFU) and a bf16 training run, in one go.

Why: this project is lent an NVIDIA H200 now and then, for minutes, through a tool that copies the git
working tree (tracked + untracked-not-ignored files) plus up to 8 "carried" ignored paths (64 MiB in all)
to a bare machine, runs ONE bash command in the repo root and brings back what it wrote under $OUT. That
machine has Python 3.12, torch (CUDA), lightning, torchmetrics, tokenizers, pandas, pyarrow, pytest, ...
but not hydra-core / omegaconf / antlr4 / datasets, no internet and no ../shared data. So:

  1. here (CPU, PyPI reachable):   make gpu-bundle        (python scripts/gpu_bundle.py)
     writes the ignored folder .gpu/: wheels/ (what the bare machine lacks, CPython 3.12 manylinux
     x86_64, 1.2 MiB), data/sst2/{train,dev,test}.tsv (SST-2 from ../shared/data/sst2, all 67,349 train
     rows, 3.9 MiB; --train-rows N ships fewer) and MANIFEST.json (every file's size and sha256, the source data's path, the commit).
  2. the device tool's run, with carry [".gpu"] and the command
         PY=python3 make gpu-check        (or: python3 scripts/gpu_check.py)
     The bare machine has no .venv: the Makefile target calls $(PY) directly, never our venv.
     .gpu/ plus the tracked tree must stay under the tool's 64 MiB (the bundle is 5.1 MiB).
  3. what comes back (files under $OUT, at most 8): gpu_check.json, gpu_check.md, train_metrics.json,
     cuda_tests.xml, train.log, heads_report.md, heads.log. The same json/md are written to
     results/bench/<device-slug>/ on that machine (copy them from $OUT into the checkout to commit).

Dry run, here, before any GPU:  python scripts/gpu_check.py --cpu   (~15 s: tiny sizes, the toy or bundled
data, outputs in results/bench/cpu-dry-run/ or --out DIR, never over GPU figures).

The parts, each timed and recorded (a failed part keeps its error's last lines; the others still run;
the exit code is 1 if any part failed):
  bundle      the manifest verified (a corrupted file is named in one line); if hydra / omegaconf /
              datasets are not importable, `pip install --no-index --no-deps --find-links .gpu/wheels`
              into the running Python. mhalab itself is not installed: src/ goes on PYTHONPATH.
  cuda_tests  `pytest -m cuda -q` over the test files with CUDA tests, counts read from its junit xml. On a GPU, 0 run
              (all skipped) is a failure: the CUDA tests did not see the GPU.
  bench       our TransformerEncoder (fused path, as it ships) vs nn.TransformerEncoder, weights copied
              (mhalab.checks.bench.measure): d=768, 12 heads, ff 3072, 4 layers, L=512, B=16, bf16
              autocast, dropout 0.1, without padding and with a quarter of positions padded; training
              step and inference, median of 20; TFLOP/s from mhalab.nn.flops (the analytic count proven
              equal to FlopCounterMode), MFU = TFLOP/s / the device's bf16 dense peak (PEAK_TFLOPS).
              Targets beside the figures (recorded, never raised): MFU >= 40%, ours / official <= 1.0.
  train       `python train.py` (the default run: SST-2, 3 epochs) with trainer=gpu (bf16-mixed) and
              trainer.max_time=1 min, from the bundled data; its metrics.json read back, and the CUDA
              caching allocator's reserve against what tensors held over the run (MemoryMonitor's curve).
  imdb        IMDB at the article's width (experiment=article: embed_dim 512, 8 heads, ff 2048; bf16, max_len 512):
              masked-LM self-pretraining on the train texts (4 passes), then 90 s of fine-tuning; its test
              accuracy beside the TF-IDF + logistic regression bar (results/baselines/imdb.json). Skipped
              when the data dir has no imdb/.
  heads       the article's "8 or 16 heads" at its width: `train.py -m sweep=heads_gpu` (dim 512, 6 layers,
              bf16) with heads 1, 4, 16, one seed, 20 s of training each, then mhalab-report's verdicts
              (with one seed they say so: no seed noise to measure); each member's dev acc and memory.
  compile     compile=true against eager on CUDA: `scripts/throughput.py compile=true bf16=true` trains the default
              model on the SST-2 copy, bucketed and packed, compiled (compile_positionwise, as a compile=true run)
              and not, interleaved, 200 timed steps each; tokens/s, the ratio, and the compilation's seconds (the
              compiled copy's warm-up). Last, as the least of the article's questions: it gets what is left.
After every part the json and md are written (and copied to $OUT): a time-out loses nothing already measured.
Time: about 8.5 min on one H200 by estimate (never measured on one yet), 9 min at most: each part's own limit
(GPU / CPU below) is cut to what is left of the check's budget (Sizes.budget_s, --budget), and a part with less
than MIN_PART_S left is skipped, saying so, so that the check ends inside one device call of 10 min.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the checkout: src/mhalab/checks/gpu_check.py
BUNDLE = ROOT / ".gpu"
MANIFEST = "MANIFEST.json"
SST2 = ("train", "dev", "test")

# bf16 dense tensor-core peaks (TFLOP/s, no sparsity), by a substring of torch.cuda.get_device_name();
# the first match wins, so the more specific names come first.
PEAK_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.5), ("H100 NVL", 835.5), ("H100", 989.4), ("A100", 312.0))

# What the bare machine already has (the device tool's KINDS.md, 'Python packages already there', the part
# of it this project's dependencies reach): the bundle ships the rest of mhalab's core dependencies' closure.
BARE_MACHINE_HAS = frozenset(["aiohttp", "anyio", "attrs", "certifi", "charset-normalizer", "click", "contourpy", "cycler", "filelock", "fonttools", "fsspec", "h11", "hf-xet", "httpcore", "httpx", "huggingface-hub", "idna", "jinja2", "kiwisolver", "lightning", "lightning-utilities", "markdown-it-py", "markupsafe", "matplotlib", "mdurl", "mpmath", "networkx", "numpy", "packaging", "pandas", "pillow", "pip", "pyarrow", "pygments", "pyparsing", "pytest", "python-dateutil", "pytorch-lightning", "pyyaml", "requests", "rich", "setuptools", "six", "sympy", "tokenizers", "torch", "torchmetrics", "tqdm", "typing-extensions", "urllib3", "wheel", "xxhash", "yarl"])
SDIST_ONLY = {"antlr4-python3-runtime"}  # 4.9.3 is an sdist on PyPI: built into a wheel here (pip wheel)
NEEDED_IMPORTS = ("hydra", "omegaconf", "antlr4", "datasets")
WHEEL_TAGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
              "--abi", "abi3", "--abi", "none"] + [
    a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "any")
    for a in ("--platform", p)]


@dataclass(frozen=True)
class Sizes:
    """One run's sizes and time limits (seconds): GPU (the real check) or CPU (the dry run)."""

    embed_dim: int
    heads: int
    ff_dim: int
    layers: int
    seq_len: int
    batch: int
    reps: int
    warmup: int
    train_overrides: tuple[str, ...]
    install_timeout: int
    tests_timeout: int
    train_timeout: int
    heads_overrides: tuple[str, ...] = ()  # the heads claim at the article's width: sweep=heads_gpu, time-boxed
    heads_timeout: int = 0
    imdb_overrides: tuple[str, ...] = ()  # IMDB at the article's width: masked-LM self-pretraining, then fine-tuning
    imdb_timeout: int = 0
    compile_args: tuple[str, ...] = ()  # compile=true against eager: scripts/throughput.py, interleaved
    compile_timeout: int = 0
    budget_s: int = 540  # the whole check: each part's limit is cut to what is left of it


MIN_PART_S = 20  # a part with less left of the budget is skipped: it could not finish


GPU = Sizes(768, 12, 3072, 4, 512, 16, reps=20, warmup=3,
            train_overrides=("trainer=gpu", "trainer.precision=bf16-mixed", "++trainer.max_time=00:00:01:00"),
            install_timeout=90, tests_timeout=150, train_timeout=120,
            # dim 512, 6 layers, bf16 (gpu_scale), one seed, 20 s of training a member: a first GPU-scale row
            heads_overrides=("sweep=heads_gpu", "seed=0", "heads=1,4,16", "++trainer.max_time=00:00:00:20",
                             "test_after_fit=false"), heads_timeout=150,
            # embed_dim 512, 8 heads, ff 2048 (experiment=article), bf16, reviews of up to 512 tokens
            imdb_overrides=("data=imdb", "experiment=article", "max_len=512", "batch_size=32", "max_epochs=2",
                            "pretrain=mlm", "pretrain.epochs=4", "++trainer.max_time=00:00:01:30"),
            imdb_timeout=210,
            # the default model on SST-2, bucketed and packed, bf16 as trainer=gpu trains, compiled beside eager
            compile_args=("compile=true", "bf16=true", "modes=[bucketed,packed]", "data=[sst2]", "steps=200"),
            compile_timeout=150)
CPU = Sizes(64, 2, 256, 2, 64, 4, reps=3, warmup=1,
            train_overrides=("trainer=cpu", "++trainer.max_steps=8", "dim=64", "heads=2", "layers=1",
                             "batch_size=16", "max_len=32", "data.vocab_size=200", "data.min_frequency=1"),
            install_timeout=60, tests_timeout=60, train_timeout=90,
            heads_overrides=("sweep=heads_gpu", "seed=0", "heads=1,2", "trainer=cpu",
                             "++trainer.max_steps=4", "dim=64", "layers=1", "batch_size=16", "max_len=32",
                             "data.vocab_size=200", "data.min_frequency=1"),
            heads_timeout=120,
            imdb_overrides=("data=imdb", "trainer=cpu", "dim=64", "heads=2", "layers=1", "max_len=64",
                            "batch_size=16", "max_epochs=1", "++trainer.max_steps=4", "pretrain=mlm",
                            "pretrain.epochs=1", "data.vocab_size=200", "data.min_frequency=1"),
            imdb_timeout=120,
            compile_args=("compile=true", "modes=[packed]", "data=[sst2]", "steps=5",
                          "overrides=[dim=64,heads=2,layers=1,data.vocab_size=200,data.min_frequency=1]"),
            compile_timeout=120, budget_s=900)


def peak_tflops(device_name: str) -> float | None:
    """bf16 dense peak of a CUDA device by name (None when unknown: then MFU is null, not a guess)."""
    for key, peak in PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


# ------------------------------------------------------------------ the bundle (built here)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheels_needed(roots: list[str] | None = None) -> dict[str, str]:
    """{distribution: installed version here} for mhalab's core dependencies' closure, stopping at what the
    bare machine has (its own dependencies are there too). Markers evaluated for CPython 3.12 on Linux."""
    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "implementation_name": "cpython", "extra": ""}
    if roots is None:
        roots = [Requirement(r).name for r in md.requires("mhalab") or []
                 if not Requirement(r).marker or Requirement(r).marker.evaluate(env)]
    todo, out = list(roots), {}
    while todo:
        name = _norm(todo.pop())
        if name in out or name in BARE_MACHINE_HAS or name == "mhalab":
            continue
        dist = md.distribution(name)  # PackageNotFoundError: the venv lacks it; make install first
        out[name] = dist.version
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return dict(sorted(out.items()))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def copy_sst2(src: Path, dest: Path, train_rows: int | None) -> dict[str, int]:
    """SST-2's three TSV files from src/sst2 to dest/sst2 (train cut to its first train_rows rows): {split: rows}."""
    from mhalab.errors import DataError

    rows = {}
    (dest / "sst2").mkdir(parents=True, exist_ok=True)
    for split in SST2:
        f = src / "sst2" / f"{split}.tsv"
        if not f.is_file():
            raise DataError(f"{f} is missing: --data-src must hold sst2/{{train,dev,test}}.tsv (../shared/data).")
        lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
        keep = lines if split != "train" or train_rows is None else lines[: train_rows + 1]  # + the header
        (dest / "sst2" / f"{split}.tsv").write_text("".join(keep), encoding="utf-8")
        rows[split] = len(keep) - 1
    return rows


def write_manifest(root: Path, extra: dict) -> dict:
    """root/MANIFEST.json: every file under root (but the manifest) with its size and sha256, plus extra."""
    files = {p.relative_to(root).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST}
    manifest = dict(extra, files=files, total_bytes=sum(f["bytes"] for f in files.values()))
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def verify_bundle(root: Path) -> list[str]:
    """One line per problem with the bundle at root (missing manifest, missing / resized / corrupted file)."""
    mf = root / MANIFEST
    if not mf.is_file():
        return [f"{mf} is missing: run `make gpu-bundle` on the CPU machine and carry .gpu"]
    try:
        files = json.loads(mf.read_text())["files"]
    except (ValueError, KeyError) as e:
        return [f"{mf} is not a bundle manifest ({e}): rerun `make gpu-bundle`"]
    problems = []
    for rel, want in files.items():
        p = root / rel
        if not p.is_file():
            problems.append(f"{p}: missing (in {MANIFEST}); rerun `make gpu-bundle` and carry .gpu")
        elif p.stat().st_size != want["bytes"]:
            problems.append(f"{p}: {p.stat().st_size} bytes, the manifest says {want['bytes']}: "
                            "truncated or changed; rerun `make gpu-bundle`")
        elif (got := _sha256(p)) != want["sha256"]:
            problems.append(f"{p}: sha256 {got[:12]}... != the manifest's {want['sha256'][:12]}...: "
                            "corrupted or changed; rerun `make gpu-bundle`")
    return problems


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def build_bundle(dest: Path = BUNDLE, data_src: Path = ROOT.parent / "shared" / "data",
                 train_rows: int | None = None) -> dict:
    """make gpu-bundle: dest/wheels (downloaded, antlr4 built), dest/data/sst2 (and imdb/, the two gzipped JSON
    lines files as they are), dest/MANIFEST.json.
    The offline install of every wheel is tried here (pip --no-index --target a tmp dir, cp312 tags)."""
    needed = wheels_needed()
    if dest.exists():
        shutil.rmtree(dest)
    wheels = dest / "wheels"
    wheels.mkdir(parents=True)
    binary = [f"{n}=={v}" for n, v in needed.items() if n not in SDIST_ONLY]
    _pip("download", "-q", "--no-deps", *WHEEL_TAGS, "-d", str(wheels), *binary)
    for n in sorted(set(needed) & SDIST_ONLY):
        _pip("wheel", "-q", "--no-deps", "--no-binary", n, "-w", str(wheels), f"{n}=={needed[n]}")
    built = sorted(wheels.glob("*.whl"))
    if any(not re.search(r"-(py3|py2\.py3|py312)-none-any\.whl$|-cp312-", w.name) for w in built):
        raise RuntimeError(f"not a CPython 3.12 / pure wheel: {[w.name for w in built]}")
    with tempfile.TemporaryDirectory() as tmp:  # the same offline install the bare machine does
        _pip("install", "-q", "--no-index", "--no-deps", "--find-links", str(wheels), *WHEEL_TAGS,
             "--target", tmp, *map(str, built))
    rows = copy_sst2(data_src, dest / "data", train_rows)
    imdb = data_src / "imdb"
    if (imdb / "train.jsonl.gz").is_file() and (imdb / "test.jsonl.gz").is_file():  # 26 MB: the imdb part's data
        shutil.copytree(imdb, dest / "data" / "imdb", ignore=shutil.ignore_patterns("README*"))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return write_manifest(dest, {
        "created": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit or None,
        "source_data": str((data_src / "sst2").resolve()), "rows": rows,
        "wheels": [{"name": n, "version": v} for n, v in needed.items()],
    })


def bundle_main(argv: list[str] | None = None) -> int:
    """scripts/gpu_bundle.py: build .gpu/ and say what is in it."""
    p = argparse.ArgumentParser(prog="python scripts/gpu_bundle.py", description=build_bundle.__doc__)
    p.add_argument("--dest", type=Path, default=BUNDLE)
    p.add_argument("--data-src", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--train-rows", type=int, default=None, help="SST-2 train rows to ship (default: all 67,349)")
    a = p.parse_args(argv)
    m = build_bundle(a.dest, a.data_src, a.train_rows)
    for rel, f in m["files"].items():
        print(f"{f['bytes'] / 2**20:8.2f} MiB  {rel}")
    print(f"{m['total_bytes'] / 2**20:8.2f} MiB  in {a.dest} (the device tool carries 64 MiB with the tree); "
          f"rows {m['rows']}")
    return 0


# ------------------------------------------------------------------ the check's parts (run there)


class PartError(Exception):
    """A part failed; `figures` are what it measured before failing."""

    def __init__(self, message: str, figures: dict | None = None):
        super().__init__(message)
        self.figures = figures or {}


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _subprocess_env() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _run(cmd: list[str], timeout: float, log: Path, ok=(0,)) -> int:
    """Run cmd in the checkout, output to log; PartError (with the log's tail) on a timeout or a bad exit."""
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, check=False, cwd=ROOT, env=_subprocess_env(), stdout=f, stderr=subprocess.STDOUT,
                                timeout=max(timeout, 1)).returncode
        except subprocess.TimeoutExpired:
            rc = None
    if rc is None:
        raise PartError(f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n{_tail(log.read_text())}")
    if rc not in ok:
        raise PartError(f"exit {rc}: {' '.join(cmd)}\n{_tail(log.read_text())}")
    return rc


def part_bundle(bundle: Path, sizes: Sizes, dry_run: bool) -> dict:
    """Verify the bundle; install its wheels offline if hydra / omegaconf / antlr4 / datasets are missing."""
    missing = [m for m in NEEDED_IMPORTS if importlib.util.find_spec(m) is None]
    if not (bundle / MANIFEST).exists() and dry_run and not missing:
        return {"status": "skipped", "reason": f"dry run, no bundle at {bundle}; every import is there"}
    problems = verify_bundle(bundle)
    if problems:
        raise PartError("\n".join(problems), {"problems": problems})
    manifest = json.loads((bundle / MANIFEST).read_text())
    figures = {"bundle_mib": round(manifest["total_bytes"] / 2**20, 2), "bundle_commit": manifest.get("commit"),
               "rows": manifest.get("rows"), "missing_before": missing, "installed": []}
    if missing:
        wheels = sorted(str(w) for w in (bundle / "wheels").glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-cache-dir",
               "--find-links", str(bundle / "wheels"), *wheels]
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=sizes.install_timeout)
        if r.returncode:
            raise PartError(f"pip install exit {r.returncode}\n{_tail(r.stdout + r.stderr)}", figures)
        importlib.invalidate_caches()
        figures["installed"] = [Path(w).name for w in wheels]
        still = [m for m in NEEDED_IMPORTS if importlib.util.find_spec(m) is None]
        if still:
            raise PartError(f"still not importable after the install: {still}", figures)
    shipped = {w["name"] for w in manifest.get("wheels", [])}
    check = subprocess.run([sys.executable, "-m", "pip", "check"], check=False, capture_output=True, text=True)
    figures["pip_check"] = [ln for ln in check.stdout.splitlines() if any(s in ln.lower() for s in shipped)]
    return figures


def cuda_test_files(tests: str) -> list[str]:
    """The test files that mark a test `cuda` (pytest.mark.cuda): collecting only these spares importing every other
    test module on the GPU machine; a directory's other files hold no CUDA test."""
    root = Path(tests)
    if root.is_file():
        return [str(root)]
    return [str(p) for p in sorted(root.glob("test_*.py")) if "mark.cuda" in p.read_text()] or [str(root)]


def part_cuda_tests(tests: str, work: Path, sizes: Sizes, dry_run: bool) -> dict:
    """pytest -m cuda over the files of `tests` that hold CUDA tests; counts from its junit xml. On a GPU, nothing
    run is a failure."""
    xml = work / "cuda_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           *cuda_test_files(tests)]
    rc = _run(cmd, sizes.tests_timeout, work / "cuda_tests.log", ok=(0, 1, 5))  # 1: failures, 5: none collected
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    if xml.exists():
        for suite in ET.parse(xml).getroot().iter("testsuite"):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
        failed = [f"{c.get('classname')}::{c.get('name')}" for c in ET.parse(xml).getroot().iter("testcase")
                  if c.find("failure") is not None or c.find("error") is not None]
    ran = counts["tests"] - counts["skipped"]
    figures = {"collected": counts["tests"], "ran": ran, "passed": ran - counts["failures"] - counts["errors"],
               "failed": counts["failures"], "errors": counts["errors"], "skipped": counts["skipped"],
               "failed_tests": failed[:20], "pytest_exit": rc}
    if rc == 1 or failed:
        raise PartError(f"{len(failed)} CUDA test(s) failed: {', '.join(failed[:5])}\n"
                        f"{_tail((work / 'cuda_tests.log').read_text())}", figures)
    if not dry_run and ran == 0:
        raise PartError("no CUDA test ran (all skipped or none collected): pytest did not see the GPU", figures)
    return figures


def part_bench(device_type: str, sizes: Sizes, peak: float | None) -> dict:
    """Our encoder stack vs nn.TransformerEncoder (weights copied): training step and inference, pad 0 and 0.25."""
    import torch

    from mhalab.checks.bench.cases import padding_mask
    from mhalab.checks.bench.config import BenchConfig, resolve
    from mhalab.checks.bench.measure import measure
    from mhalab.nn.flops import forward_flops, train_flops

    # nn.TransformerEncoder's nested tensors warn on every eval call; not news here (as in mhalab-bench)
    warnings.filterwarnings("ignore", message=".*nested tensors is in prototype stage")
    warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
    device = torch.device(device_type)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as mhalab-bench
    s = sizes
    cfg = resolve(BenchConfig(device=device_type, embed_dim=s.embed_dim, num_heads=s.heads, ff_dim=s.ff_dim,
                              layers=s.layers, variants=["fused", "official"], reps=s.reps, warmup=s.warmup,
                              memory=False))
    cases, targets = [], []
    for pad in (0.0, 0.25):
        cfg_p = dataclasses.replace(cfg, pad_frac=pad)
        rows = {(r.mode, r.variant): r for r in measure("enc", s.seq_len, s.batch, cfg_p, device,
                                                        modes=("train", "infer"), memory=False)}
        kpm = padding_mask(s.batch, s.seq_len, pad, torch.device("cpu"))
        lengths = [s.seq_len] * s.batch if kpm is None else (~kpm).sum(1).tolist()
        shape = {"batch": s.batch, "seq_len": s.seq_len, "num_tokens": sum(lengths), "dim": s.embed_dim, "heads": s.heads,
                     "layers": s.layers, "ff_dim": s.ff_dim, "num_classes": 0, "lengths": lengths}
        for mode, flops in (("train", train_flops(**shape)), ("infer", forward_flops(**shape))):
            ours, off = rows[(mode, "fused")], rows[(mode, "official")]
            if ours.time_ms is None or off.time_ms is None:
                raise PartError(f"{mode}, pad {pad}: no timing (ours {ours.error}, official {off.error})")
            tf = {v: flops / (r.time_ms * 1e-3) / 1e12 for v, r in (("ours", ours), ("official", off))}
            case = {"mode": mode, "pad_frac": pad, "tokens": sum(lengths), "flops": flops,
                    "ours_ms": ours.time_ms, "official_ms": off.time_ms, "ratio": ours.time_ms / off.time_ms,
                    "ours_tflops": tf["ours"], "official_tflops": tf["official"],
                    "ours_mfu": None if peak is None else tf["ours"] / peak,
                    "official_mfu": None if peak is None else tf["official"] / peak}
            cases.append(case)
            targets.append(_target(f"ours / official time, {mode} step, pad {pad:g}", case["ratio"], "<=", 1.0))
            if mode == "train":
                targets.append(_target(f"MFU of our training step, pad {pad:g}", case["ours_mfu"], ">=", 0.40))
    return {"config": {"embed_dim": s.embed_dim, "heads": s.heads, "ff_dim": s.ff_dim, "layers": s.layers,
                       "seq_len": s.seq_len, "batch": s.batch, "dropout": cfg.dropout, "reps": s.reps,
                       "dtype": "bf16 autocast (fp32 params)" if cfg.amp else "float32", "peak_tflops": peak},
            "cases": cases, "targets": targets}


def _target(name: str, value: float | None, op: str, limit: float) -> dict:
    ok = None if value is None else (value <= limit if op == "<=" else value >= limit)
    return {"target": name, "value": value, "op": op, "limit": limit, "passed": ok}


def _train(data_dir: Path, work: Path, run_dir: Path, overrides: tuple[str, ...], timeout: int,
           log: Path) -> tuple[list[str], dict]:
    """One `python train.py` run (the real CLI) into run_dir: its command and its metrics.json."""
    cmd = [sys.executable, str(ROOT / "train.py"), f"paths.data_dir={data_dir}", f"paths.cache_dir={work / 'cache'}",
           f"hydra.run.dir={run_dir}", "trainer.enable_progress_bar=false", "callbacks.progress_bar=null",
           "extras.print_config=false", *overrides]
    _run(cmd, timeout, log)
    return cmd, json.loads((run_dir / "metrics.json").read_text())


def part_train(data_dir: Path, work: Path, sizes: Sizes) -> dict:
    """train.py (the real CLI) on the SST-2 copy; its metrics.json read back."""
    run_dir = work / "train_run"
    cmd, record = _train(data_dir, work, run_dir, sizes.train_overrides, sizes.train_timeout, work / "train.log")
    shutil.copy(run_dir / "metrics.json", work / "train_metrics.json")
    best = record.get("best") or {}
    steps = record.get("global_step") or 0
    asked = next((int(o.split("=")[1]) for o in sizes.train_overrides if "max_steps=" in o), None)
    figures = {"overrides": cmd[2:], "status": record.get("status"), "device_name": record.get("device_name"),
               "precision": record.get("config", {}).get("trainer", {}).get("precision"),
               "global_step": steps, "max_steps": asked, "epochs": record.get("epochs"),
               "dev_acc": best.get("val/acc"), "test_acc": best.get("test/acc"),
               "tokens_per_s": record.get("tokens_per_s"), "fit_time_s": record.get("fit_time_s"),
               "step_ms": None if not steps else record["fit_time_s"] / steps * 1e3,
               "peak_mem_mb": record.get("peak_mem_mb"), "params": record.get("params"), **_memory_curve(run_dir),
               **_train_rate(run_dir)}
    if record.get("status") != "finished":
        raise PartError(f"the run's status is {record.get('status')}: {record.get('error')}", figures)
    return figures


def _memory_curve(run_dir: Path) -> dict:
    """The run's CUDA memory over its steps (MemoryMonitor's perf/cuda_allocated_mb and perf/cuda_reserved_mb):
    the caching allocator's reserve against what tensors hold, which varying batch shapes can fragment."""
    import pandas as pd

    logs = list(run_dir.glob("logs/metrics.csv"))
    if not logs:
        return {}
    log = pd.read_csv(logs[0])
    if "perf/cuda_reserved_mb" not in log:
        return {}
    rows = log.dropna(subset=["perf/cuda_reserved_mb"])
    reserved, allocated = rows["perf/cuda_reserved_mb"], rows["perf/cuda_allocated_mb"]
    return {"cuda_reserved_mb_max": float(reserved.max()), "cuda_allocated_mb_max": float(allocated.max()),
            "cuda_reserved_over_allocated_last": float(reserved.iloc[-1] / max(allocated.iloc[-1], 1e-9)),
            "cuda_reserved_mb_first_last": [float(reserved.iloc[0]), float(reserved.iloc[-1])]}


def _train_rate(run_dir: Path) -> dict:
    """The default run's training throughput as the CPU's README figure is read: real tokens per second of training
    (RealTokenThroughput's train/device/items_per_sec, validation left out), the median of its logged rates, beside
    the committed CPU default run's (results/default_run/metrics.json: tokens over its fit)."""
    import pandas as pd

    out = {}
    cpu = ROOT / "results" / "default_run" / "metrics.json"
    if cpu.is_file():
        rec = json.loads(cpu.read_text())
        out["cpu_default_run_tokens_per_s"] = rec.get("tokens_per_s")
        out["cpu_default_run_commit"] = (rec.get("provenance") or {}).get("git_commit")
    logs = list(run_dir.glob("logs/metrics.csv"))
    if logs:
        rates = pd.read_csv(logs[0]).get("train/device/items_per_sec")
        if rates is not None and rates.notna().any():
            out["train_items_per_s"] = float(rates.dropna().median())
    return out


BASELINES = ROOT / "results" / "baselines"  # mhalab-baseline data=<set>: TF-IDF + logistic regression


def part_imdb(data_dir: Path, work: Path, sizes: Sizes) -> dict:
    """IMDB at the article's width: masked-LM self-pretraining on the train texts, then fine-tuning (time-boxed), its
    test accuracy beside the bag-of-words bar (recorded, never raised)."""
    if not (data_dir / "imdb").is_dir():
        return {"status": "skipped", "reason": f"no imdb/ in {data_dir} (make gpu-bundle copies it)"}
    run_dir = work / "imdb_run"
    cmd, record = _train(data_dir, work, run_dir, sizes.imdb_overrides, sizes.imdb_timeout, work / "imdb.log")
    best, pre = record.get("best") or {}, record.get("pretrain") or {}
    figures = {"overrides": cmd[2:], "status": record.get("status"), "global_step": record.get("global_step"),
               "epochs": record.get("epochs"), "fit_time_s": record.get("fit_time_s"),
               "pretrain_steps": pre.get("global_step"), "pretrain_final_loss": pre.get("final_loss"),
               "dev_acc": best.get("val/acc"), "test_acc": best.get("test/acc"),
               "tfidf_test_acc": json.loads((BASELINES / "imdb.json").read_text())["mean"]["test/acc"],
               **_memory_curve(run_dir)}
    if record.get("status") != "finished":
        raise PartError(f"the run's status is {record.get('status')}: {record.get('error')}", figures)
    return figures


def part_heads(data_dir: Path, work: Path, sizes: Sizes) -> dict:
    """The article's "8 or 16 heads" at its width: `train.py -m sweep=heads_gpu` (heads 1..16 at dim 512), one
    seed, each member time-boxed, then mhalab-report's verdicts on the sweep dir."""
    sweep = work / "heads_sweep"
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", f"paths.data_dir={data_dir}",
           f"paths.cache_dir={work / 'cache'}", f"hydra.sweep.dir={sweep}", "extras.print_config=false",
           *sizes.heads_overrides]
    _run(cmd, sizes.heads_timeout, work / "heads.log")
    members = {}
    for rec_path in sorted(sweep.glob("*/metrics.json")):
        rec = json.loads(rec_path.read_text())
        heads = rec.get("config", {}).get("model", {}).get("heads")
        members[str(heads)] = {"status": rec.get("status"), "val_acc": (rec.get("best") or {}).get("val/acc"),
                               "global_step": rec.get("global_step"), "fit_time_s": rec.get("fit_time_s"),
                               **_memory_curve(rec_path.parent)}
    verdicts = json.loads((sweep / "verdicts.json").read_text()) if (sweep / "verdicts.json").exists() else None
    for name in ("report.md", "verdicts.json"):
        if (sweep / name).exists():
            shutil.copy(sweep / name, work / f"heads_{name}")
    figures = {"overrides": cmd[3:], "members": members, "verdicts": verdicts}
    if not members or any(m["status"] != "finished" for m in members.values()):
        raise PartError(f"members not all finished: { {k: m['status'] for k, m in members.items()} }", figures)
    return figures


def part_compile(data_dir: Path, work: Path, sizes: Sizes, device_type: str) -> dict:
    """compile=true against eager: scripts/throughput.py trains the default model compiled as a compile=true run
    compiles it (compile_positionwise) and uncompiled, interleaved, on the SST-2 copy; tokens/s of each, the ratio,
    and the compilation's time (the compiled copy's warm-up)."""
    rows_json = work / "compile.json"
    args = list(sizes.compile_args)
    given = next((i for i, a in enumerate(args) if a.startswith("overrides=[")), None)
    paths = f"paths.data_dir={data_dir},paths.cache_dir={work / 'cache'}"
    if given is None:
        args.append(f"overrides=[{paths}]")
    else:
        args[given] = f"overrides=[{paths},{args[given][len('overrides=['):]}"
    cmd = [sys.executable, str(ROOT / "scripts" / "throughput.py"), *args, f"device={device_type}",
           f"json={rows_json}", f"out={work / 'compile.md'}"]
    _run(cmd, sizes.compile_timeout, work / "compile.log")
    rows = json.loads(rows_json.read_text())
    out = {}
    for r in rows:
        key = r["mode"] + (" compiled" if r["compiled"] else "")
        out[key] = {k: r[k] for k in ("tokens_per_s", "s_per_step", "warmup_s", "padding_fraction")}
    ratios = {r["mode"]: out[r["mode"] + " compiled"]["tokens_per_s"] / out[r["mode"]]["tokens_per_s"]
              for r in rows if r["compiled"]}
    return {"command": cmd[1:], "rows": out, "compiled_over_eager": ratios,
            "bf16": any(r["bf16"] for r in rows), "device": rows[0]["device"]}


# ------------------------------------------------------------------ the command


def run_part(name: str, fn, *args) -> dict:
    """One part: its figures, status (passed / failed / skipped), wall seconds, the error's last lines."""
    t0 = time.perf_counter()
    out = {"status": "passed", "figures": {}, "error": None}
    try:
        figures = fn(*args)
        if figures.get("status") == "skipped":
            out["status"] = "skipped"
        out["figures"] = figures
    except PartError as e:
        out.update(status="failed", figures=e.figures, error=_tail(str(e), 20))
    except Exception:  # noqa: BLE001 -- a bug or a CUDA error: recorded, and the next part still runs
        out.update(status="failed", error=_tail(traceback.format_exc(), 20))
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"[gpu-check] {name}: {out['status']} ({out['wall_s']} s)", file=sys.stderr, flush=True)
    return out


def environment(device_type: str) -> dict:
    import torch

    versions = {}
    for d in ("torch", "lightning", "torchmetrics", "tokenizers", "hydra-core", "omegaconf", "datasets", "pyarrow",
              "numpy", "pandas", "fsspec", "huggingface-hub"):
        try:
            versions[d] = md.version(d)
        except md.PackageNotFoundError:
            versions[d] = None
    cuda = device_type == "cuda"
    return {"device": device_type, "device_name": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "capability": list(torch.cuda.get_device_capability()) if cuda else None,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
            "python": platform.python_version(), "versions": versions, "host": platform.node()}


def write_toy_sst2(root: Path, n: int = 256, seed: int = 0) -> Path:
    """A learnable SST-2-shaped set (sst2/{train,dev,test}.tsv) for the dry run when no bundle is there."""
    rng = random.Random(seed)
    words = (["dull", "bad", "boring", "awful"], ["great", "fine", "lovely", "fun"])
    (root / "sst2").mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", n), ("dev", n // 4), ("test", n // 4)):
        lines = ["sentence\tlabel"] + [
            " ".join(rng.choice(words[i % 2] + ["the", "film", "was"]) for _ in range(rng.randint(3, 12)))
            + f" {words[i % 2][i % 4]} \t{i % 2}" for i in range(rows)]
        (root / "sst2" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return root


def write_toy_imdb(root: Path, n: int = 128, seed: int = 0) -> Path:
    """A learnable IMDB-shaped set (imdb/{train,test}.jsonl.gz, text and label) beside the toy SST-2."""
    rng = random.Random(seed)
    words = (["dull", "bad", "boring", "awful"], ["great", "fine", "lovely", "fun"])
    (root / "imdb").mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", n), ("test", n // 4)):
        lines = [json.dumps({"text": " ".join(rng.choice(words[i % 2] + ["the", "film", "was"])
                                              for _ in range(rng.randint(20, 60))), "label": i % 2})
                 for i in range(rows)]
        with gzip.open(root / "imdb" / f"{split}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return root


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/gpu_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="dry run on CPU, tiny sizes (no GPU needed)")
    p.add_argument("--out", type=Path, help="results dir (default results/bench/<device-slug>, cpu-dry-run)")
    p.add_argument("--bundle", type=Path, default=BUNDLE)
    p.add_argument("--data", type=Path, help="data dir holding sst2/ (default: the bundle's; --cpu: a toy set "
                   "when no bundle is there)")
    p.add_argument("--tests", default="tests/", help="what pytest -m cuda collects (default tests/)")
    p.add_argument("--budget", type=int, help=f"seconds for the whole check (default {GPU.budget_s}; --cpu: "
                   f"{CPU.budget_s}): each part's limit is cut to what is left, and a part with under "
                   f"{MIN_PART_S} s left is skipped")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    sizes = CPU if a.cpu else GPU
    if a.budget is not None:
        sizes = dataclasses.replace(sizes, budget_s=a.budget)
    import torch

    if not a.cpu and not torch.cuda.is_available():
        print(f"error: torch {torch.__version__} sees no CUDA device; use --cpu for the dry run.", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    if a.out:
        out = a.out
    elif a.cpu:
        out = ROOT / "results" / "bench" / "cpu-dry-run"
    else:
        from mhalab.checks.bench.render import device_name

        out = ROOT / "results" / "bench" / device_name(torch.device("cuda"))
    out.mkdir(parents=True, exist_ok=True)
    parts: dict[str, dict] = {}
    device_type = "cpu" if a.cpu else "cuda"
    result = {"dry_run": a.cpu, "environment": None, "data": None, "parts": parts, "failed": [], "wall_s": None,
              "command": " ".join(["gpu_check.py", *(argv or [])])}

    def save() -> None:
        """After every part: a time-out or a crash later loses nothing already measured."""
        result.update(failed=[k for k, v in parts.items() if v["status"] == "failed"],
                      wall_s=round(time.perf_counter() - t0, 1))
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "gpu_check.md").write_text(markdown(result))
        back = os.environ.get("OUT")
        if back:  # the device tool brings back what is here (8 files at most)
            for f in [out / "gpu_check.json", out / "gpu_check.md"] + [
                    work / n for n in ("train_metrics.json", "cuda_tests.xml", "train.log", "imdb.log",
                                       "heads_report.md", "heads.log")]:
                if f.exists():
                    shutil.copy(f, Path(back) / f.name)

    def part(name: str, fn, *args, limit: str | None) -> None:
        """Run one part within what is left of the budget (Sizes' `limit` field cut to it), then save."""
        left = int(t0 + sizes.budget_s - time.perf_counter())
        if left < MIN_PART_S:
            reason = f"{max(left, 0)} s left of the check's {sizes.budget_s} s budget"
            parts[name] = {"status": "skipped", "figures": {"status": "skipped", "reason": reason}, "error": None,
                           "wall_s": 0.0}
            print(f"[gpu-check] {name}: skipped ({reason})", file=sys.stderr, flush=True)
        else:
            cut = dataclasses.replace(sizes, **{limit: min(getattr(sizes, limit), left)}) if limit else sizes
            parts[name] = run_part(name, fn, *(cut if x is sizes else x for x in args))
        save()

    part("bundle", part_bundle, a.bundle, sizes, a.cpu, limit="install_timeout")
    result["environment"] = environment(device_type)
    data = a.data or (a.bundle / "data" if (a.bundle / "data" / "sst2").is_dir() or not a.cpu
                      else write_toy_imdb(write_toy_sst2(work / "toy")))
    result["data"] = str(data)
    save()
    part("cuda_tests", part_cuda_tests, a.tests, work, sizes, a.cpu, limit="tests_timeout")
    part("bench", part_bench, device_type, sizes,  # (in this process: its reps, not a clock, bound it)
         peak_tflops(result["environment"]["device_name"]) if not a.cpu else None, limit=None)
    part("train", part_train, data.resolve(), work, sizes, limit="train_timeout")
    part("imdb", part_imdb, data.resolve(), work, sizes, limit="imdb_timeout")
    part("heads", part_heads, data.resolve(), work, sizes, limit="heads_timeout")
    part("compile", part_compile, data.resolve(), work, sizes, device_type, limit="compile_timeout")
    print(f"[gpu-check] {result['wall_s']} s; failed: {result['failed'] or 'none'}; wrote {out}/gpu_check.json, "
          "gpu_check.md", file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)
    return 1 if result["failed"] else 0


def _f(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def markdown(r: dict) -> str:
    """gpu_check.md: the parts, the benchmark table, the targets, the training run."""
    e = r["environment"] or {"device_name": "?", "versions": {"torch": "?"}, "cuda": None, "cudnn": None,
                              "python": "?"}
    lines = [f"# GPU check{' (CPU dry run)' if r['dry_run'] else ''}: {e['device_name']}", "",
             (f"torch {e['versions']['torch']}, CUDA {e['cuda']}, cuDNN {e['cudnn']}, Python {e['python']}; "
             f"total {r['wall_s']} s; failed parts: {', '.join(r['failed']) or 'none'}"), "",
             "| part | status | wall s |", "|---|---|---|"]
    lines += [f"| {k} | {v['status']} | {v['wall_s']} |" for k, v in r["parts"].items()]
    for k, v in r["parts"].items():
        if v["error"]:
            lines += ["", f"{k} error:", "```", v["error"], "```"]
    for k, v in r["parts"].items():
        if v["status"] == "skipped" and v["figures"].get("reason"):
            lines += ["", f"{k} skipped: {v['figures']['reason']}"]

    def fig(part: str) -> dict:  # a part not run yet, or skipped: no figures
        p = r["parts"].get(part, {})
        return {} if p.get("status") == "skipped" else p.get("figures") or {}

    t = fig("cuda_tests")
    if t:
        lines += ["", (f"CUDA tests: {t['ran']} run, {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, "
                      f"{t['skipped']} skipped")]
    b = fig("bench")
    if b.get("cases"):
        c = b["config"]
        lines += ["", (f"Encoder stack x{c['layers']}, d={c['embed_dim']}, {c['heads']} heads, ff {c['ff_dim']}, "
                      f"L={c['seq_len']}, B={c['batch']}, {c['dtype']}, dropout {c['dropout']}, median of {c['reps']}; "
                      f"peak {c['peak_tflops']} TFLOP/s"), "",
                  "| mode | pad | ours ms | official ms | ours/official | ours TFLOP/s | official TFLOP/s | ours MFU |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {x['mode']} | {x['pad_frac']:g} | {x['ours_ms']:.2f} | {x['official_ms']:.2f} | {x['ratio']:.3f} | "
                  f"{x['ours_tflops']:.3g} | {x['official_tflops']:.3g} | {_f(x['ours_mfu'], '.1%')} |"
                  for x in b["cases"]]
        lines += ["", "| target | value | limit | passed |", "|---|---|---|---|"]
        lines += [f"| {x['target']} | {_f(x['value'], '.3f')} | {x['op']} {x['limit']} | {_f(x['passed'], '')} |"
                  for x in b["targets"]]
    tr = fig("train")
    if tr:
        lines += ["", (f"Training run ({tr.get('precision')}, {tr.get('device_name')}): {tr.get('global_step')} steps, "
                      f"{tr.get('epochs')} epochs in {_f(tr.get('fit_time_s'), '.1f')} s ({_f(tr.get('step_ms'), '.1f')} ms "
                      f"a step, validation included), {_f(tr.get('tokens_per_s'), '.0f')} tokens/s; dev acc "
                      f"{_f(tr.get('dev_acc'), '.4f')}, test acc {_f(tr.get('test_acc'), '.4f')}; CUDA memory reserved "
                      f"/ allocated at the end {_f(tr.get('cuda_reserved_over_allocated_last'), '.2f')}x")]
        if tr.get("train_items_per_s") is not None:  # the line the README's CPU figure is compared with
            lines += ["", (f"Default run's training throughput: {tr['train_items_per_s']:,.0f} real tokens/s on "
                          f"{tr.get('device_name')} (median of the logged rolling rates, validation left out); this "
                          f"project's CPU default run: {_f(tr.get('cpu_default_run_tokens_per_s'), ',.0f')} "
                          f"(results/default_run, commit {str(tr.get('cpu_default_run_commit'))[:7]})")]
    im = fig("imdb")
    if im.get("test_acc") is not None:
        lines += ["", (f"IMDB at the article's width, masked-LM self-pretraining ({im.get('pretrain_steps')} steps, final "
                      f"loss {_f(im.get('pretrain_final_loss'), '.3f')}) then {im.get('global_step')} fine-tuning steps: "
                      f"dev acc {_f(im.get('dev_acc'), '.4f')}, test acc {_f(im.get('test_acc'), '.4f')} (TF-IDF + "
                      f"logistic regression: {im['tfidf_test_acc']:.3f})")]
    h = fig("heads")
    if h.get("members"):
        lines += ["", "Heads at the article's width (`" + " ".join(h["overrides"]) + "`):", "",
                  "| heads | status | steps | dev acc | reserved / allocated (MB, max) |", "|---|---|---|---|---|"]
        lines += [f"| {k} | {m['status']} | {m['global_step']} | {_f(m['val_acc'], '.4f')} | "
                  f"{_f(m.get('cuda_reserved_mb_max'), '.0f')} / {_f(m.get('cuda_allocated_mb_max'), '.0f')} |"
                  for k, m in sorted(h["members"].items(), key=lambda kv: int(kv[0]))]
    c = fig("compile")
    if c.get("rows"):
        lines += ["", (f"compile=true against eager (`throughput.py {' '.join(c['command'][1:])}`; "
                      f"{'bf16 autocast' if c['bf16'] else 'float32'}):"), "",
                  "| batches | compiled | tokens/s | s/step | warm-up s | compiled / eager |", "|---|---|---|---|---|---|"]
        lines += [f"| {k.split()[0]} | {'yes' if k.endswith('compiled') else 'no'} | {v['tokens_per_s']:,.0f} | "
                  f"{v['s_per_step']:.4f} | {v['warmup_s']:.1f} | "
                  f"{_f(c['compiled_over_eager'][k.split()[0]], '.2f') + 'x' if k.endswith('compiled') else ''} |"
                  for k, v in c["rows"].items()]
    return "\n".join(lines) + "\n"
