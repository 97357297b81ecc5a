"""Long-sequence benchmark plumbing: stratified subsets, byte-level IMDB, the sweep presets, PerfMonitor
(time per step, peak memory), the LRA table and its Hydra callback, the interleaved re-timing."""

from __future__ import annotations

import json
import mmap
import shutil
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from conftest import SHARED_DATA, compose_train
from torch.utils.data import DataLoader

from mhalab.analysis.lra import LRA_PAPER, collect_lra, write_lra_table
from mhalab.analysis.lra import main as lra_main
from mhalab.analysis.sweep_callbacks import LRATableCallback
from mhalab.data import Collate
from mhalab.data.subset import SubsetDataModule
from mhalab.errors import RunDirError
from mhalab.train.callbacks import PerfMonitor
from mhalab.train.callbacks.memory import peak_memory_mb, reset_peak_memory
from mhalab.train.module import Classifier

IMDB = SHARED_DATA / "imdb" / "train.jsonl.gz"


def _sorted_by_label(root: Path, n=200) -> Path:
    d = root / "toy"
    d.mkdir(parents=True)
    for split in ("train", "test"):
        rows = ["text\tlabel"] + [f"{'good' if i >= n // 2 else 'bad'} film number {i}\t{int(i >= n // 2)}"
                                  for i in range(n)]  # all 0s then all 1s, like IMDB
        (d / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    return root


def _subset_dm(root, **kw):
    args = {"name": "toy", "data_dir": str(root), "files": {"train": "toy/train.tsv", "test": "toy/test.tsv"},
                "delimiter": "\t", "num_classes": 2, "dev_split": 0.2, "tokenizer_kind": "bytes", "cache_dir": str(root / "cache"),
                "max_len": 64, "batch_size": 8}
    return SubsetDataModule(**(args | kw))


def test_subsets_are_stratified_seeded_and_cached_apart(tmp_path):
    root = _sorted_by_label(tmp_path)
    dm = _subset_dm(root, max_examples={"train": 40, "validation": 10, "test": 20})
    dm.prepare_data()
    dm.setup("fit")
    sizes = {s: len(d) for s, d in dm.splits.items()}
    assert sizes == {"train": 40, "validation": 10, "test": 20}
    for split in dm.splits.values():  # both classes, equally (a head of the file would be one class)
        counts = np.bincount(split.labels.numpy(), minlength=2)
        assert counts[0] == counts[1]
    full = _subset_dm(root)
    full.prepare_data()
    full.setup("fit")
    assert {s: len(d) for s, d in full.splits.items()} == {"train": 160, "validation": 40, "test": 200}
    assert full._cache_paths()[1] != dm._cache_paths()[1]
    again = _subset_dm(root, max_examples={"train": 40, "validation": 10, "test": 20})
    again.prepare_data()
    again.setup("fit")
    assert torch.equal(again.splits["train"].ids, dm.splits["train"].ids)
    with pytest.raises(ValueError, match="max_examples"):
        _subset_dm(root, max_examples={"dev": 3})
    with pytest.raises(ValueError, match="max_examples"):
        _subset_dm(root, max_examples={"train": 0})


@pytest.mark.skipif(not IMDB.is_file(), reason="needs ../shared/data/imdb")
def test_imdb_bytes_config_reads_bytes_with_a_stratified_dev_split(tmp_path):
    from hydra.utils import instantiate

    cfg = compose_train(["data=imdb_bytes", "max_len=1024", "data.max_examples={train: 60, validation: 20, test: 20}"],
                        tmp_path / "out", data_dir=SHARED_DATA, cache=tmp_path / "cache", small_vocab=False)
    assert cfg.data.tokenizer_kind == "bytes" and cfg.data.dev_split == 0.1 and cfg.model.max_len == 1024
    dm = instantiate(cfg.data)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.vocab_size == 260
    for split in ("train", "validation", "test"):
        counts = np.bincount(dm.splits[split].labels.numpy(), minlength=2)
        assert counts[0] == counts[1] > 0, (split, counts)
    ids, _ = dm.splits["train"][0]
    assert ids[0] == 2 and len(ids) <= 1024
    text = bytes(int(i) - 4 for i in ids[1:-1]).decode("utf-8", errors="replace")
    assert len(text) > 100 and " " in text  # raw bytes of a review, spaces kept


def test_sweep_presets_compose(tmp_path):
    from hydra import compose, initialize_config_dir

    def cfg_for(*overrides):
        return compose("train", overrides=[*overrides, f"paths.output_dir={tmp_path}"], return_hydra_config=True)

    with initialize_config_dir(config_dir=str(Path(__file__).parents[1] / "conf"), version_base="1.3"):
        for data, max_len in (("listops", 512), ("imdb_bytes", 1024)):
            for kind in ("full", "performer"):
                cfg = cfg_for("sweep=lra", f"data={data}", f"model.attention={kind}")
                assert (cfg.model.dim, cfg.model.heads, cfg.model.layers) == (64, 4, 2)
                assert cfg.model.max_len == cfg.data.max_len == max_len and cfg.model.attention == kind
                assert cfg.data.max_examples.train == {"listops": 1000, "imdb_bytes": 400}[data]
                assert cfg.trainer.accelerator == "cpu" and cfg.data.batch_size == 16
                assert cfg.callbacks.perf._target_ == "mhalab.train.callbacks.PerfMonitor"
        assert cfg.hydra.mode.name == "MULTIRUN"
        assert cfg.hydra.callbacks.lra_table._target_ == "mhalab.analysis.sweep_callbacks.LRATableCallback"
        assert set(cfg.hydra.sweeper.params) == {"data", "model.attention"}
        for data, dim, steps, max_len in (("listops_lra", 512, 5000, 2048), ("imdb_bytes_lra", 256, 20000, 4096)):
            cfg = cfg_for("sweep=lra_gpu", f"data={data}")
            assert (cfg.model.dim, cfg.trainer.max_steps, cfg.model.max_len, cfg.data.max_len) == (
                dim, steps, max_len, max_len)
        assert cfg_for("data=listops_lra").data.num_train == 96000
        cfg = cfg_for("callbacks=attention_maps")
        assert {"model_checkpoint", "attention_maps"} <= set(cfg.callbacks)


def test_peak_memory_window_resets():
    reset_peak_memory()
    # 200 MB of fresh pages (an anonymous map): a malloc'd array may reuse pages earlier tests left resident
    big = mmap.mmap(-1, 200 * 2**20)
    big.write(b"\1" * len(big))
    high, kind = peak_memory_mb()
    big.close()
    if kind != "cpu_peak_rss":
        pytest.skip("no /proc/self/status peak on this system")
    assert reset_peak_memory()
    low, _ = peak_memory_mb()
    assert high - low > 150


def test_perf_monitor_writes_perf_json(tmp_path):
    module = Classifier(model={"dim": 16, "heads": 2, "layers": 1, "ff_dim": 32, "max_len": 16}, vocab_size=20, num_classes=2)
    items = [(torch.randint(4, 20, (12,)), i % 2) for i in range(48)]
    mon = PerfMonitor(warmup=2)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[mon],
                        default_root_dir=str(tmp_path))
    trainer.fit(module, DataLoader(items, batch_size=8, collate_fn=Collate(0)))
    perf = json.loads((tmp_path / "perf.json").read_text())
    assert perf["steps_timed"] == 4 and perf["step_time_s"] > 0 and perf["peak_mem_mb"] > 10
    assert perf["peak_mem_kind"] in ("cpu_peak_rss", "cpu_lifetime_peak_rss")
    assert trainer.callback_metrics["perf/step_ms"] > 0


def _fake_member(root: Path, task: str, kind: str, acc: float, status: str = "finished",
                 old_record: bool = False, seed: int = 0, pretrain: dict | None = None) -> None:
    """old_record: metrics.json as written before `last_epoch` (the best checkpoint's test/* under `final`);
    pretrain: the self-pretraining facts mhalab.train.pretrain records (None: from scratch)."""
    d = root / (f"data={task},model.attention={kind}" + (f",seed={seed}" if seed else "") + (",pretrain=mlm" if pretrain else ""))
    d.mkdir(parents=True)
    scores = ({"final": {"val/acc": acc, "test/acc": acc}, "best": {"val/acc": acc + 0.01}} if old_record else
              {"last_epoch": {"val/acc": acc}, "best": {"val/acc": acc + 0.01, "test/acc": acc}})
    metrics = {"status": status, "error": None if status == "finished" else "RuntimeError: boom", "seed": seed,
               "config": {"model": {"attention": kind, "dim": 64, "heads": 4, "layers": 2, "attention_options": {}},
                          "data": {"name": task, "max_len": 512, "batch_size": 32}},
               **scores, "global_step": 10, "fit_time_s": 20.0, "tokens_per_s": 1000.0, "params": 1234,
               **({"pretrain": pretrain} if pretrain else {})}
    (d / "metrics.json").write_text(json.dumps(metrics))
    (d / "perf.json").write_text(json.dumps({"step_time_s": 0.5, "peak_mem_mb": 800.0, "peak_mem_kind": "cpu_peak_rss",
                                             "baseline_mem_mb": 500.0, "device_name": "cpu"}))


def test_lra_table_from_a_sweep_dir(tmp_path):
    _fake_member(tmp_path, "listops", "full", 0.2)
    _fake_member(tmp_path, "listops", "performer", 0.15)
    _fake_member(tmp_path, "imdb_bytes", "full", 0.55)
    _fake_member(tmp_path, "imdb_bytes", "window", 0.0, status="failed")
    res = write_lra_table(tmp_path, tmp_path / "out" / "README.md")
    md = Path(res["markdown"]).read_text()
    assert "| full | 20.00 | 500 | 800 | 55.00 | 500 | 800 | Transformer 36.37 / 64.27 |" in md
    assert "| window | – | – | – | failed | – | – | Local Attention 15.82 / 52.98; Longformer 35.63 / 62.85 |" in md
    assert "Performer 18.01 / 65.40" in md and "Different scale" in md and "RuntimeError: boom" in md
    assert Path(res["plot"]).read_bytes()[:4] == b"\x89PNG"
    assert set(LRA_PAPER) == {"full", "window", "linformer", "performer"}
    with pytest.raises(RunDirError, match="no metrics.json under"):
        write_lra_table(tmp_path / "empty")


def test_lra_table_ranks_kinds_over_seeds_and_pairs_pretraining_with_scipys_interval(tmp_path):
    """Several seeds per kind, with and without self-pretraining: the mean and its t-interval per cell, and the
    effects paired by seed equal to scipy's paired t-test interval."""
    from scipy import stats

    accs = {("full", None): [0.40, 0.42, 0.44], ("performer", None): [0.38, 0.41, 0.41],
            ("full", "mlm"): [0.50, 0.53, 0.55]}
    enc = tmp_path / "cache" / "mlm-1"  # the encoder's own log: its last epoch's logged steps give loss / acc
    (enc / "logs").mkdir(parents=True)
    (enc / "logs" / "metrics.csv").write_text("epoch,pretrain/acc,pretrain/loss,step\n0,0.1,3.0,9\n"
                                              "1,0.4,1.5,19\n1,0.6,1.0,29\n")
    pre = {"dir": str(enc), "wall_time_s": 300.0, "final_loss": 0.9, "final_acc": 0.7, "pretrain": {"epochs": 2}}
    for (kind, p), values in accs.items():
        for seed, acc in enumerate(values):
            _fake_member(tmp_path, "listops", kind, acc, seed=seed, pretrain=pre if p else None)
    md = Path(write_lra_table(tmp_path)["markdown"]).read_text()

    def interval(a, b=None):
        a = 100 * np.array(a) - (0 if b is None else 100 * np.array(b))
        res = stats.ttest_1samp(a, 0.0)
        lo, hi = res.confidence_interval(0.95)
        return a.mean(), lo, hi

    m, lo, hi = interval(accs[("full", None)])
    assert f"| full | {m:.1f} [{lo:.1f}, {hi:.1f}] | 500 | 800 |" in md  # main table: mean [95% CI]
    assert "| full + MLM | 52.7 [" in md
    line = {ln.split(" | ")[1]: ln for ln in md.splitlines() if ln.startswith("| ListOps | ")}  # the seeds table
    e, lo, hi = interval(accs[("full", "mlm")], accs[("full", None)])  # pretraining's effect, paired by seed
    assert line["full + MLM"].startswith("| ListOps | full + MLM | 0,1,2 | 52.7 [")
    assert line["full + MLM"].endswith(f"| {e:+.1f} [{lo:+.1f}, {hi:+.1f}] | 5.0 | 1.25 / 50.0% |")  # epoch 1's mean
    shutil.rmtree(enc)  # the cache cleared: meta's own figures
    md = Path(write_lra_table(tmp_path)["markdown"]).read_text()
    assert "| 5.0 | 0.90 / 70.0% |" in md
    e, lo, hi = interval(accs[("performer", None)], accs[("full", None)])  # performer against full, both from scratch
    assert line["performer"].endswith(f"| {e:+.1f} [{lo:+.1f}, {hi:+.1f}] |  |  |  |")


def test_lra_table_command_takes_key_value_options_and_refuses_mistakes_in_one_line(tmp_path, capsys):
    _fake_member(tmp_path, "listops", "full", 0.2)
    assert lra_main([str(tmp_path), f"out={tmp_path / 'o' / 't.md'}", "title=My table", "plot=t.png"]) == 0
    assert (tmp_path / "o" / "t.md").read_text().startswith("# My table")
    assert "![accuracy, time and memory per attention kind](t.png)" in (tmp_path / "o" / "t.md").read_text()
    assert (tmp_path / "o" / "t.png").read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "o" / "lra_results.png").exists()
    for argv, line in [([str(tmp_path / "empty")], "no metrics.json under"),
                       ([str(tmp_path), "--out=x.md"], "options are key=value, e.g. out="),
                       ([str(tmp_path), "retime=maybe"], "retime=maybe is not valid"),
                       ([], "give one sweep dir, not 0")]:
        with pytest.raises(SystemExit) as e:
            lra_main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and line in err[0], (argv, err)


def test_lra_rows_read_old_and_new_records_alike(tmp_path):
    """Records from before `last_epoch` (results/lra was made with them) give the same rows."""
    for which, old in (("new", False), ("old", True)):
        _fake_member(tmp_path / which, "listops", "full", 0.2, old_record=old)
        _fake_member(tmp_path / which, "imdb_bytes", "window", 0.0, status="failed", old_record=old)
    new, old = collect_lra(tmp_path / "new"), collect_lra(tmp_path / "old")
    assert new == old
    assert [(r["attention"], r["status"], r["test_acc"], r["val_acc"]) for r in new] == [
        ("window", "failed", 0.0, 0.01), ("full", "finished", 0.2, 0.2 + 0.01)]


def test_lra_row_of_an_unreadable_record_says_so(tmp_path):
    _fake_member(tmp_path, "listops", "full", 0.2)
    (tmp_path / "data=listops,model.attention=full" / "metrics.json").write_text('{"status": "fini')
    (row,) = collect_lra(tmp_path)
    assert row["status"] == "unreadable" and "not valid JSON" in row["error"]


def test_lra_table_callback_writes_into_the_sweep_dir(tmp_path):
    from omegaconf import OmegaConf

    _fake_member(tmp_path, "listops", "full", 0.2)
    LRATableCallback().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    assert "| full | 20.00 | 500 | 800 |" in (tmp_path / "lra_table.md").read_text()
    assert (tmp_path / "lra_results.png").read_bytes()[:4] == b"\x89PNG"


def test_interleaved_retiming_covers_every_kind():
    from mhalab.analysis.lra_timing import interleaved_step_times, render_retiming

    cfg = {"dim": 16, "heads": 2, "layers": 1, "ff_dim": 32, "max_len": 16,
           "attention_options": {"window": 4, "linformer_k": 4, "performer_features": 8}}
    times = interleaved_step_times(cfg, seq_len=32, batch=2, reps=1, warmup=0)
    assert set(times) == {"full", "window", "linformer", "performer"} and all(t > 0 for t in times.values())
    md = render_retiming({32: times}, batch=2, reps=1)
    assert "| full | " in md and "(1.00x)" in md and "L = 32" in md
