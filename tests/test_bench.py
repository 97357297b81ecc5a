"""mhalab-bench: its key=value options, its variants (the `weights` one really on the explicit path, all
with the official weights), its memory counter, and the files one tiny run writes. No speed figures."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import close

from mhalab.checks.bench import main
from mhalab.checks.bench.cases import MODES, MODULES, VARIANTS, build, padding_mask
from mhalab.checks.bench.config import BenchConfig, parse_config
from mhalab.checks.bench.measure import peak_bytes
from mhalab.nn.attention import MultiHeadAttention

ONE_THREAD = True  # tiny tensors: see conftest.one_thread
pytestmark = pytest.mark.filterwarnings(
    "ignore:enable_nested_tensor is True:UserWarning",
    "ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning",
)


def test_defaults_are_the_devices_and_quick_narrows_the_sweep():
    cfg = parse_config(["device=cpu"])
    assert (cfg.embed_dim, cfg.num_heads, cfg.ff_dim, cfg.tokens) == (256, 4, 1024, 4096)
    assert cfg.seq_lens == [64, 128, 256, 512, 1024, 2048] and (cfg.reps, cfg.warmup) == (7, 2)
    assert cfg.modules == list(MODULES) and cfg.modes == list(MODES) and cfg.variants == list(VARIANTS)
    assert cfg.amp is False and cfg.peak_tflops is None and cfg.memory is True  # no autocast, no MFU on CPU
    quick = parse_config(["device=cpu", "quick=true"])
    assert quick.seq_lens == [128, 1024] and quick.modules == ["attn", "enc"] and (quick.reps, quick.warmup) == (3, 1)
    mine = parse_config(["device=cpu", "quick=true", "seq_lens=[32,64]", "reps=2", "warmup=0", "embed_dim=64",
                         "modules=[layer]", "memory=false", "out=/tmp/x"])
    assert (mine.seq_lens, mine.reps, mine.warmup, mine.embed_dim, mine.ff_dim) == ([32, 64], 2, 0, 64, 256)
    assert mine.modules == ["layer"] and mine.memory is False and mine.out == "/tmp/x"


@pytest.mark.parametrize("argv, message", [
    (["--quick"], "unknown option '--quick' (options are key=value, e.g. quick=...)"),
    (["quick"], "'quick' has no value; write quick=VALUE"),
    (["reps=x"], "reps=x is not valid (Value 'x' of type 'str' could not be converted to Integer)"),
    (["seq_lens=64"], "seq_lens=64 is not valid (a list, e.g. [128,1024] or [attn,enc])"),
    (["modules=[attn,foo]"], "modules=['attn', 'foo']: unknown ['foo']; choose from ['attn', 'layer', 'enc']"),
    (["device=cuda", "clock=cpu"], "clock=cpu measures host CPU time; on CUDA use the default clock=wall."),
    (["device=cpu", "embed_dim=30"], "num_heads=4 does not divide embed_dim=30"),
    (["device=cpu", "pad_frac=0.7"], "pad_frac=0.7 must be in [0, 0.5]"),
    (["device=cpu", "reps=0"], "reps=0 must be >= 1."),
])
def test_a_mistake_is_one_error_line_and_exit_2(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main([*argv, f"out={tmp_path}"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert not any(tmp_path.iterdir())  # refused before anything ran


def test_help_lists_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for f in dataclasses.fields(BenchConfig):
        shown = "null" if f.default is None else str(f.default).lower() if isinstance(f.default, bool) else f.default
        assert f"  {f.name}={shown} " in out, f.name


def test_padding_mask_pads_pad_frac_of_the_positions_and_keeps_a_token_per_row():
    kpm = padding_mask(32, 128, 0.25, torch.device("cpu"))  # (B, L) True at pads
    assert kpm.shape == (32, 128) and abs(kpm.float().mean().item() - 0.25) < 0.01
    assert (~kpm).sum(1).min() >= 1 and not kpm[:, 0].any()  # right padding
    assert padding_mask(32, 128, 0.0, torch.device("cpu")) is None


@pytest.mark.parametrize("module", ["layer", "enc"])
def test_weights_variant_takes_the_explicit_path_and_all_variants_share_the_official_weights(module):
    # encoder layers call their attention with need_weights=False; the `weights` variant still computes
    # through the (B, H, L, L) weights (its kernels return them), the `fused` one does not
    cfg = parse_config(["device=cpu", "embed_dim=16", "num_heads=2", "ff_dim=32", "dropout=0", "layers=2",
                        "variants=[weights,fused,official,fused_padded]"])
    models = build(module, cfg, torch.device("cpu"))
    assert set(models) == {"weights", "fused", "official"} | ({"fused_padded"} if module == "enc" else set())
    returned = {}
    for v in ("weights", "fused"):
        returned[v] = []
        for m in models[v][0].modules():
            if isinstance(m, MultiHeadAttention):
                m.attention.register_forward_hook(
                    lambda mod, a, out, v=v: returned[v].append(out[1] is not None))
    x = torch.randn(4, 10, 16, generator=torch.Generator().manual_seed(0))
    kpm = padding_mask(4, 10, 0.25, torch.device("cpu"))
    outs = {}
    for v, (m, call) in models.items():
        m.train()  # dropout 0: deterministic, and PyTorch's regular (not fast) path
        outs[v] = call(m, x, kpm)
    n_layers = 2 if module == "enc" else 1
    assert returned == {"weights": [True] * n_layers, "fused": [False] * n_layers}
    real = ~kpm
    for v in outs:
        close(outs[v][real], outs["official"][real], what=f"{v} vs official")


def test_peak_bytes_counts_the_tensors_a_step_holds_at_once():
    n = 2**20  # 4 MiB of float32

    def step():
        a = torch.ones(n)
        b = a * 2  # both live: 8 MiB
        del a, b
        torch.zeros(n)  # freed before: does not add

    peak = peak_bytes(step, torch.device("cpu"))
    assert 8 * 2**20 <= peak < 9 * 2**20


def test_smallest_run_writes_json_markdown_and_png(tmp_path, capsys):
    argv = ["device=cpu", "modules=[attn,enc]", "modes=[train,infer]", "seq_lens=[8]", "tokens=16", "embed_dim=16",
            "num_heads=2", "reps=1", "warmup=0", "threads=1", f"out={tmp_path}"]
    assert main(argv, prog="mhalab-bench") == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    rows = data["results"]
    assert len(rows) == 2 * 2 * 3  # modules x modes x variants
    assert all(r["batch"] == 2 and r["seq_len"] == 8 and r["time_ms"] > 0 and r["peak_mib"] > 0 for r in rows)
    assert all(r["ratio"] == 1.0 for r in rows if r["variant"] == "official")
    assert data["meta"]["command"] == "mhalab-bench " + " ".join(argv)
    assert data["meta"]["args"]["embed_dim"] == 16 and data["targets"] is None
    md = (tmp_path / "bench.md").read_text()
    assert md.startswith("# Benchmark: ") and md.count("| enc | train | 8 | 2 |") == 3
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_swap_bench_times_one_function_and_reports_ratios_of_its_medians(tmp_path):
    """scripts/swap_bench.py: the swapped copy computes the original's logits and gradients (checked before any
    timing, the figure in the title), and each row's ratio lies in its bootstrap interval."""
    import re

    from conftest import load_script

    swap_bench = load_script("swap_bench")
    out = tmp_path / "swap.md"
    swap_bench.main(["reps=3", "batch=3", "min_len=4", "max_len=9", f"out={out}"])
    text = out.read_text()
    same = float(re.search(r"differ by at most ([0-9.e+-]+) ", text).group(1))
    assert same <= 1e-5
    rows = [r for r in text.splitlines() if r.startswith(("| training", "| inference"))]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        ratio, (lo, hi) = float(cells[3].rstrip("x")), map(float, cells[4].split("-"))
        assert 0.2 < ratio < 5 and lo <= ratio <= hi
    # and a model that computes something else is refused before timing
    import copy

    original = swap_bench.Classifier(vocab=50, d=16, heads=2, ff=32, layers=1)
    other = swap_bench.swap_attention(copy.deepcopy(original))
    with torch.no_grad():
        other.encoder.layers[0].self_attn.W_V.weight[0, 0] += 1e-2
    ids, pad = torch.randint(1, 50, (2, 5)), torch.zeros(2, 5, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="another function"):
        swap_bench.same_function(original, other, ids, pad, torch.tensor([0, 1]))


@pytest.mark.parametrize("script, argv, message", [
    ("speedup", ["imbd_steps=80"], "unknown option 'imbd_steps=80'; the options are base, reps, cases, imdb_steps, out"),
    ("speedup", ["reps=x"], "reps=x is not valid"),
    ("speedup", ["cases=[sst2,imbd]"], "cases=['imbd']: choose among ['sst2', 'imdb', 'make_train']"),
    ("speedup", ["reps=0"], "reps=0, imdb_steps=20: both must be at least 1"),
    ("default_run", ["fingerprint_onl=true"], "unknown option 'fingerprint_onl=true'; the options are fingerprint_only"),
])
def test_a_timing_scripts_misspelled_option_is_one_line_before_any_run(script, argv, message, capsys, monkeypatch):
    """A misspelled key would otherwise be ignored and the run measure the default (speedup.py read any key=value)."""
    from conftest import load_script

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_:
        load_script(script).main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1


def test_speedup_table_gives_each_pairs_ratio_beside_the_medians_and_shorter_is_better_for_make_train():
    """Three repetitions whose pairs disagree (1.5x, 1.0x, 2.0x): the medians' ratio is 1.50x (15 against 10), and
    each pair's own is shown, so a reader sees the machine's spread; make_train's seconds: base / new."""
    from conftest import load_script

    speedup = load_script("speedup")
    runs = {("sst2", "base"): [{"tok_s": 10.0}, {"tok_s": 20.0}, {"tok_s": 5.0}],
            ("sst2", "head"): [{"tok_s": 15.0}, {"tok_s": 20.0}, {"tok_s": 10.0}],
            ("make_train", "base"): [{"wall_s": 100.0, "dev": 0.8, "test": 0.79}] * 2,
            ("make_train", "head"): [{"wall_s": 50.0, "dev": 0.8, "test": 0.79}, {"wall_s": 80.0, "dev": 0.8,
                                                                                 "test": 0.79}]}
    lines = speedup.render(runs, ["sst2", "make_train"], "title")
    assert lines[4] == "| sst2 | real tok/s | 10, 20, 5 | 15, 20, 10 | **1.50x** | 1.50, 1.00, 2.00 |"
    assert lines[5] == "| make_train | s | 100, 100 | 50, 80 | **1.54x** | 2.00, 1.25 |"
    assert lines[-1] == "- head: 80.00 / 79.00, 80.00 / 79.00"
