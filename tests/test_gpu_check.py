"""scripts/gpu_check.py proven on CPU before a GPU exists: the dry run end to end (one ~10 s run read by
several tests), the bundle manifest check, the peak table, the wheel list. Nothing here downloads."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mhalab.checks import gpu_check as gc
from mhalab.checks.bench.cases import flops as bench_flops
from mhalab.checks.bench.cases import padding_mask

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """python scripts/gpu_check.py --cpu on the toy data (SST-2 and IMDB shaped), no bundle, CUDA tests of
    tests/test_cuda.py only."""
    tmp = tmp_path_factory.mktemp("gpu_check")
    back = tmp / "back"
    back.mkdir()
    data = gc.write_toy_imdb(gc.write_toy_sst2(tmp / "data"))
    cmd = [sys.executable, "scripts/gpu_check.py", "--cpu", "--out", str(tmp / "out"), "--bundle", str(tmp / "none"),
           "--data", str(data), "--tests", "tests/test_cuda.py"]
    env = dict(os.environ, OUT=str(back), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp / "out" / "gpu_check.json").read_text()), tmp, back


def test_dry_run_records_every_part_and_copies_results_to_OUT(dry_run):
    result, tmp, back = dry_run
    assert result["dry_run"] is True and result["failed"] == []
    assert list(result["parts"]) == ["bundle", "cuda_tests", "bench", "train", "imdb", "heads", "compile"]
    assert result["parts"]["bundle"]["status"] == "skipped"  # no bundle, every import there
    assert all(p["wall_s"] >= 0 for p in result["parts"].values())
    assert {"gpu_check.json", "gpu_check.md", "train_metrics.json", "cuda_tests.xml"} <= {f.name for f in back.iterdir()}
    assert json.loads((back / "gpu_check.json").read_text()) == result
    assert len(list(back.iterdir())) <= 8  # what the device tool brings back from $OUT
    md = (tmp / "out" / "gpu_check.md").read_text()
    assert "| cuda_tests | passed |" in md and "CPU dry run" in md


def test_dry_run_cuda_tests_part_reports_all_skipped_on_cpu(dry_run):
    t = dry_run[0]["parts"]["cuda_tests"]["figures"]
    assert t["collected"] >= 8 and t["skipped"] == t["collected"]
    assert t["ran"] == t["passed"] == t["failed"] == t["errors"] == 0


def test_dry_run_bench_figures_are_consistent(dry_run):
    """Ratios positive and finite; MFU null on CPU; the FLOPs (mhalab.nn.flops) equal the bench's own count
    unpadded, and with padding lie between its per-sequence and padded counts; TFLOP/s = FLOPs / time."""
    b = dry_run[0]["parts"]["bench"]["figures"]
    c = b["config"]
    assert c["peak_tflops"] is None and c["embed_dim"] == gc.CPU.embed_dim
    assert [(x["mode"], x["pad_frac"]) for x in b["cases"]] == [("train", 0.0), ("infer", 0.0), ("train", 0.25),
                                                                 ("infer", 0.25)]
    cfg = type("Cfg", (), {"ff_dim": c["ff_dim"], "layers": c["layers"]})
    for x in b["cases"]:
        assert 0 < x["ratio"] < math.inf and x["ratio"] == pytest.approx(x["ours_ms"] / x["official_ms"])
        assert x["ours_mfu"] is None and x["official_mfu"] is None
        kpm = padding_mask(c["batch"], c["seq_len"], x["pad_frac"], torch.device("cpu"))
        shape = (c["batch"], c["seq_len"], c["embed_dim"])
        useful = bench_flops("enc", x["mode"], shape, kpm, cfg)  # attention per sequence exactly (sum n^2)
        if x["pad_frac"] == 0:
            assert x["flops"] == useful
        else:  # nn.flops counts varlen's kernel calls, whose few pads (CallPlan) lie between the two
            assert useful <= x["flops"] < bench_flops("enc", x["mode"], shape, None, cfg)
        assert x["ours_tflops"] == pytest.approx(x["flops"] / (x["ours_ms"] * 1e-3) / 1e12)
    assert x["tokens"] < c["batch"] * c["seq_len"]  # the padded case has padding
    mfu = [t for t in b["targets"] if t["target"].startswith("MFU")]
    assert len(mfu) == 2 and all(t["value"] is None and t["passed"] is None for t in mfu)
    assert all(t["passed"] == (t["value"] <= 1.0) for t in b["targets"] if t["op"] == "<=")


def test_dry_run_training_ran_the_steps_asked(dry_run):
    t = dry_run[0]["parts"]["train"]["figures"]
    assert t["status"] == "finished" and t["precision"] == "32-true"
    assert t["global_step"] == t["max_steps"] == 8
    assert 0 <= t["dev_acc"] <= 1 and 0 <= t["test_acc"] <= 1
    assert t["step_ms"] == pytest.approx(t["fit_time_s"] / 8 * 1e3)


def test_train_part_gives_the_default_runs_training_rate_beside_the_committed_cpu_figure(dry_run, tmp_path):
    import copy

    import pandas as pd

    (tmp_path / "logs").mkdir()
    pd.DataFrame({"step": [49, 59, 99, 149], "train/device/items_per_sec": [100.0, None, 250.0, 300.0]}).to_csv(
        tmp_path / "logs" / "metrics.csv", index=False)
    rate = gc._train_rate(tmp_path)
    cpu = json.loads((ROOT / "results" / "default_run" / "metrics.json").read_text())
    assert rate["train_items_per_s"] == 250.0  # the median of the logged rates (the empty row is not one)
    assert rate["cpu_default_run_tokens_per_s"] == cpu["tokens_per_s"]
    r = copy.deepcopy(dry_run[0])
    r["parts"]["train"]["figures"].update(rate)
    line = next(x for x in gc.markdown(r).splitlines() if x.startswith("Default run's training throughput"))
    assert "250 real tokens/s" in line and f"{cpu['tokens_per_s']:,.0f}" in line
    assert cpu["provenance"]["git_commit"][:7] in line


def test_parts_with_too_little_left_of_the_budget_are_skipped_and_say_why(tmp_path, capsys):
    # what a check that overran its budget writes: every part recorded, none started past the budget
    assert gc.main(["--cpu", "--budget", "0", "--out", str(tmp_path / "out"), "--bundle", str(tmp_path / "none")]) == 0
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert list(result["parts"]) == ["bundle", "cuda_tests", "bench", "train", "imdb", "heads", "compile"]
    assert {p["status"] for p in result["parts"].values()} == {"skipped"}
    assert result["parts"]["imdb"]["figures"]["reason"] == "0 s left of the check's 0 s budget"
    assert "heads: skipped (0 s left of the check's 0 s budget)" in capsys.readouterr().err
    assert gc.GPU.budget_s + 60 <= 600  # a device call lasts 10 min at most; a minute for the machine's start


def test_without_cuda_the_real_check_refuses_in_one_line(capsys):
    assert gc.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sees no CUDA device; use --cpu" in err[0]


def make_bundle(root: Path) -> Path:
    (root / "wheels").mkdir(parents=True)
    (root / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(b"wheel bytes")
    gc.copy_sst2(gc.write_toy_sst2(root / "src", n=40), root / "data", train_rows=10)
    gc.write_manifest(root, {"source_data": str(root / "src")})
    return root


def test_bundle_manifest_verifies_clean_and_names_a_corrupted_file_in_one_line(tmp_path):
    root = make_bundle(tmp_path / "b")
    assert gc.verify_bundle(root) == []
    f = root / "data" / "sst2" / "dev.tsv"
    data = bytearray(f.read_bytes())
    data[5] ^= 1  # same size, one bit off
    f.write_bytes(bytes(data))
    problems = gc.verify_bundle(root)
    assert len(problems) == 1 and "\n" not in problems[0]
    assert str(f) in problems[0] and "sha256" in problems[0] and "make gpu-bundle" in problems[0]


def test_bundle_manifest_names_missing_and_truncated_files(tmp_path):
    root = make_bundle(tmp_path / "b")
    (root / "wheels" / "a-1.0-py3-none-any.whl").unlink()
    (root / "data" / "sst2" / "test.tsv").write_text("sentence\tlabel\n")
    problems = gc.verify_bundle(root)
    assert len(problems) == 2
    assert any("a-1.0-py3-none-any.whl: missing" in p for p in problems)
    assert any("test.tsv: 15 bytes, the manifest says" in p for p in problems)
    assert gc.verify_bundle(tmp_path / "nothing") == [
        f"{tmp_path / 'nothing' / 'MANIFEST.json'} is missing: run `make gpu-bundle` on the CPU machine and carry .gpu"]


def test_bundle_data_copy_keeps_header_dev_test_whole_and_cuts_train(tmp_path):
    src = gc.write_toy_sst2(tmp_path / "src", n=40)
    rows = gc.copy_sst2(src, tmp_path / "dst", train_rows=10)
    assert rows == {"train": 10, "dev": 10, "test": 10}
    train = (tmp_path / "dst" / "sst2" / "train.tsv").read_text().splitlines()
    assert train[0] == "sentence\tlabel" and train[1:] == (src / "sst2" / "train.tsv").read_text().splitlines()[1:11]
    assert (tmp_path / "dst" / "sst2" / "dev.tsv").read_bytes() == (src / "sst2" / "dev.tsv").read_bytes()


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H200", 989.4), ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.5),
    ("NVIDIA A100-SXM4-80GB", 312.0), ("Tesla T4", None)])
def test_peak_table_by_device_name(name, peak):
    assert gc.peak_tflops(name) == peak


def test_wheels_are_the_dependencies_the_bare_machine_lacks():
    """mhalab's core dependencies' closure (this venv's metadata) less what the GPU machine has: hydra and its
    parser runtime, datasets and its two pinned helpers, mimalloc (cmeel-mimalloc, the allocator mhalab-train
    preloads, and cmeel, its path hook); nothing heavy (pyarrow, pandas are there)."""
    needed = gc.wheels_needed()
    assert set(needed) == {"hydra-core", "omegaconf", "antlr4-python3-runtime", "datasets", "dill", "multiprocess",
                           "cmeel-mimalloc", "cmeel"}
    assert needed["antlr4-python3-runtime"].startswith("4.9.")  # hydra-core pins 4.9.*


def test_dry_run_heads_part_trains_each_member_and_reports_its_verdicts(dry_run):
    result, tmp, back = dry_run
    heads = result["parts"]["heads"]["figures"]
    assert sorted(heads["members"]) == ["1", "2"]  # the dry run's heads=1,2 at tiny sizes
    assert all(m["status"] == "finished" and m["global_step"] == 4 for m in heads["members"].values())
    claims = {v["key"]: v for v in heads["verdicts"]["verdicts"]}
    # 4 steps on toy data, one seed: the report never decides the claim. Whether a member learned something in 4
    # steps depends on its initial draws (heads=2 reaches ~73% with PyTorch's init order, 2026-12-05); it says
    # "not decided" when the members did not learn, else "inconclusive" with one seed (as on the GPU)
    reason = claims["head_dim_min_64"]["reason"]
    verdict = claims["head_dim_min_64"]["verdict"]
    assert verdict in ("not decided", "inconclusive"), (verdict, reason)
    assert ("did not learn" in reason or "every member has the same val/acc" in reason if verdict == "not decided"
            else "fewer than 2 seeds" in reason), reason
    assert "heads_report.md" in {f.name for f in back.iterdir()}
    assert "| 2 | finished | 4 |" in (tmp / "out" / "gpu_check.md").read_text()


def test_dry_run_imdb_part_pretrains_then_fine_tunes_and_sets_the_bag_of_words_bar_beside(dry_run):
    result, tmp, _ = dry_run
    imdb = result["parts"]["imdb"]["figures"]
    assert imdb["status"] == "finished" and imdb["global_step"] == 4  # fine-tuning steps, after
    assert imdb["pretrain_steps"] > 0  # masked-LM self-pretraining on the train texts
    assert 0.0 <= imdb["test_acc"] <= 1.0 and imdb["tfidf_test_acc"] == 0.9058  # results/baselines/imdb.json
    assert "IMDB at the article's width" in (tmp / "out" / "gpu_check.md").read_text()


def test_dry_run_compile_part_times_the_compiled_model_beside_eager_and_the_compilation_apart(dry_run):
    result, tmp, _ = dry_run
    c = result["parts"]["compile"]["figures"]
    eager, compiled = c["rows"]["packed"], c["rows"]["packed compiled"]  # the dry run's modes=[packed]
    assert c["compiled_over_eager"]["packed"] == pytest.approx(compiled["tokens_per_s"] / eager["tokens_per_s"])
    assert compiled["warmup_s"] > eager["warmup_s"] + 1  # the compilation (seconds) is in the warm-up, not timed
    assert c["device"] == "cpu" and c["bf16"] is False  # on the GPU: cuda, bf16 autocast as trainer=gpu
    assert "compile=true against eager" in (tmp / "out" / "gpu_check.md").read_text()


def test_the_cuda_part_collects_only_the_files_that_hold_cuda_tests():
    files = [Path(f).name for f in gc.cuda_test_files(str(Path(__file__).parent))]
    assert files == ["test_cuda.py", "test_varlen.py"]  # the files with a test marked cuda, and no other
