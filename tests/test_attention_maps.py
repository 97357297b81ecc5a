"""Attention maps from a checkpoint: the hooked weights equal each layer's self_attn called directly,
rows sum to 1, the PNG is written (library, CLI, callback); linformer / performer say they have none;
importing the package picks no matplotlib backend and the figures are not pyplot's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from mhalab.analysis.attention_maps import (
    AttentionMapLogger,
    NoAttentionWeights,
    attention_modules,
    attention_weights,
    encode_text,
    main,
    plot_attention_maps,
)
from mhalab.data import Collate, train_tokenizer
from mhalab.errors import CheckpointError
from mhalab.train.checkpoint import load_model
from mhalab.train.module import Classifier

REPO = Path(__file__).resolve().parents[1]
TEXTS = ["a fine and moving film", "a dull boring plot", "great acting and a lovely story", "awful weak film"] * 8
TEXT = "a moving story with great acting"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _loader(tokenizer, n=32, batch_size=8):
    from mhalab.data import encode_texts

    ids = encode_texts(tokenizer, TEXTS[:n], 32)
    items = [(torch.tensor(x), i % 2) for i, x in enumerate(ids)]
    return DataLoader(items, batch_size=batch_size, collate_fn=Collate(0))


class ToyDataModule(L.LightningDataModule):
    """Like the project's datamodules, its state (saved by Lightning under the class name) holds the tokenizer."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer

    def train_dataloader(self):
        return _loader(self.tokenizer)

    def state_dict(self):
        return {"tokenizer": self.tokenizer.to_str(), "label_names": ["neg", "pos"]}


def make_checkpoint(path: Path, callbacks=(), legacy: bool = False, **model) -> Path:
    """A real Lightning checkpoint of a tiny Classifier after one training step, laid out as train.py
    writes it: the tokenizer in the datamodule's state, checkpoint["mhalab"] says where (legacy: the
    tokenizer directly in checkpoint["mhalab"], as earlier versions wrote it)."""
    tok = train_tokenizer(TEXTS, "wordpiece", 100, True, 1)
    cfg = {"encoder": "custom", "dim": 16, "heads": 2, "layers": 2, "ff_dim": 32, "dropout": 0.1, "max_len": 32,
           "pos": "sinusoidal", "attention": "full"} | model
    torch.manual_seed(0)
    extras = ({"tokenizer": tok.to_str(), "label_names": ["neg", "pos"], "data": {"name": "toy"}} if legacy
              else {"datamodule_key": "ToyDataModule", "data": {"name": "toy"}})
    module = Classifier(model=cfg, vocab_size=tok.get_vocab_size(), num_classes=2, pad_id=0, checkpoint_extras=extras)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=list(callbacks), default_root_dir=str(path.parent))
    if legacy:
        trainer.fit(module, _loader(tok))
    else:
        trainer.fit(module, datamodule=ToyDataModule(tok))
    trainer.save_checkpoint(path)
    return path


def direct_weights(module, ids, padding_mask=None) -> list[torch.Tensor]:
    """Walk the model by hand and call each layer's self_attn directly with need_weights=True."""
    inner = module.model
    pad = ids == inner.pad_id if padding_mask is None else padding_mask
    with torch.no_grad():
        x = inner.embed(ids)
        if inner.cls is not None:
            x = torch.cat([inner.cls.expand(x.size(0), -1, -1), x], 1)
            pad = torch.cat([pad.new_zeros(x.size(0), 1), pad], 1)
        if inner.pos is not None:
            x = inner.pos(x)
        layers = inner.encoder.layers if hasattr(inner.encoder, "layers") else inner.encoder.encoder.layers
        out = []
        for layer in layers:
            h = layer.norm1(x) if layer.norm_first else x
            if isinstance(layer.self_attn, torch.nn.MultiheadAttention):
                _, w = layer.self_attn(h, h, h, key_padding_mask=pad, need_weights=True, average_attn_weights=False)
            else:
                _, w = layer.self_attn(h, key_padding_mask=pad, need_weights=True)
            out.append(w)
            x = layer(x, src_key_padding_mask=pad)
    return out


CASES = {
    "full": {},
    "window": {"attention": "window", "attention_options": {"window": 4, "global_tokens": 1}},
    "rope_cls_prenorm": {"pos": "rope", "pooling": "cls", "norm_first": True},
    "alibi_window": {"pos": "alibi", "attention": "window", "attention_options": {"window": 2, "global_tokens": 0}},
    "official": {"encoder": "official"},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {name: make_checkpoint(root / f"{name}.ckpt", **kw) for name, kw in CASES.items()}


def load_checkpoint(path):
    loaded = load_model(path)  # the one checkpoint loader
    return loaded.module, loaded.tokenizer


@pytest.mark.parametrize("case", list(CASES))
def test_extracted_weights_equal_direct_self_attn_calls(checkpoints, case):
    module, tok = load_checkpoint(checkpoints[case])
    ids, labels = encode_text(module, tok, TEXT)
    assert labels[0 if case != "rope_cls_prenorm" else 1] == "[CLS]" and labels[-1] == "[SEP]"
    logits, weights = attention_weights(module, ids)
    direct = direct_weights(module, ids)
    L_ = ids.size(1) + (case == "rope_cls_prenorm")
    assert len(weights) == 2 and len(labels) == L_
    for w, d in zip(weights, direct):
        assert w.shape == (1, 2, L_, L_)
        torch.testing.assert_close(w, d.float(), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, L_), atol=1e-5, rtol=0)  # rows sum to 1
        assert (w >= 0).all()
    torch.testing.assert_close(logits, module(ids).detach(), atol=1e-5, rtol=1e-4)  # an ordinary forward
    if case == "window":  # outside the band (|i - j| > 2, neither is the global token 0) nothing is seen
        i, j = torch.meshgrid(torch.arange(L_), torch.arange(L_), indexing="ij")
        outside = ((i - j).abs() > 2) & (i > 0) & (j > 0)
        assert outside.any() and (weights[0][0][:, outside] == 0).all()
    # the hooks are gone and the model is unchanged: the next plain forward takes no weights
    for attn in attention_modules(module):
        assert not attn._forward_hooks and not attn._forward_pre_hooks


def test_padded_keys_get_zero_weight(checkpoints):
    module, tok = load_checkpoint(checkpoints["full"])
    from mhalab.data import encode_texts

    a, b = encode_texts(tok, [TEXT, "dull"], 32)
    ids = torch.zeros(2, len(a), dtype=torch.long)
    ids[0, : len(a)], ids[1, : len(b)] = torch.tensor(a), torch.tensor(b)
    _, weights = attention_weights(module, ids)
    _, alone = attention_weights(module, ids[:1])  # the unpadded example by itself
    _, short = attention_weights(module, ids[1:, : len(b)])
    for w, w_a, w_b in zip(weights, alone, short):
        assert (w[1, :, :, len(b):] == 0).all()  # no query looks at a pad
        torch.testing.assert_close(w[1, :, : len(b)].sum(-1), torch.ones(2, len(b)))
        torch.testing.assert_close(w[0], w_a[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(w[1, :, : len(b), : len(b)], w_b[0], atol=1e-5, rtol=1e-4)  # pads change nothing


def test_both_checkpoint_layouts_carry_the_tokenizer(checkpoints, tmp_path):
    saved = torch.load(checkpoints["full"], map_location="cpu", weights_only=False)
    assert "tokenizer" not in saved["mhalab"] and "tokenizer" in saved["ToyDataModule"]
    legacy = make_checkpoint(tmp_path / "legacy.ckpt", legacy=True)
    for path in (checkpoints["full"], legacy, checkpoints["full"].parent):  # a dir without metrics.json: error
        if path.is_dir():
            with pytest.raises(CheckpointError, match="not a run dir"):
                load_checkpoint(path)
            continue
        loaded = load_model(path)
        assert loaded.label_names == ["neg", "pos"] and not loaded.module.training
        assert loaded.tokenizer.encode(TEXT).ids == encode_text(loaded.module, loaded.tokenizer, TEXT)[0][0].tolist()


def test_main_writes_the_png(checkpoints, tmp_path, capsys):
    out = tmp_path / "maps" / "window.png"
    assert main([f"ckpt_path={checkpoints['window']}", f"text={TEXT}", f"out={out}"]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "2 layers x 2 heads" in printed
    assert re.search(r"prediction (neg|pos);", printed), printed  # the checkpoint's label names
    assert main([f"ckpt_path={checkpoints['window']}"]) == 2  # text missing
    assert main(["ckpt_path=/nonexistent.ckpt", "text=x"]) == 2
    assert main([f"ckpt_path={checkpoints['full']}", "text=x", "colour=red"]) == 2


@pytest.mark.parametrize("kind", ["linformer", "performer"])
def test_linear_attentions_say_they_have_no_weights(tmp_path, kind, capsys):
    ckpt = make_checkpoint(tmp_path / f"{kind}.ckpt", attention=kind,
                           attention_options={"linformer_k": 4, "performer_features": 8})
    assert main([f"ckpt_path={ckpt}", "text=a fine film", f"out={tmp_path / 'x.png'}"]) == 3
    err = capsys.readouterr().err
    assert f"model.attention={kind} has no explicit attention weights" in err
    assert not (tmp_path / "x.png").exists()
    module, _ = load_checkpoint(ckpt)
    with pytest.raises(NoAttentionWeights):
        attention_weights(module, torch.tensor([[2, 5, 3]]))


def test_script_command_line(checkpoints, tmp_path, fork_server):
    out = tmp_path / "cli.png"
    res = fork_server.run([sys.executable, str(REPO / "scripts" / "attention_map.py"), f"ckpt_path={checkpoints['full']}",
                           f"text={TEXT}", f"out={out}"], env=dict(os.environ, PYTHONHASHSEED="0"), timeout=120)
    assert res.returncode == 0, res.stderr
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_the_map_goes_into_the_run_dir_it_reads_and_its_full_path_is_printed(checkpoints, tmp_path, fork_server):
    """Without out=: <run>/attention_map.png, not the working directory (an untracked file at a checkout's root)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    ckpt = run / "checkpoints" / "epoch00-acc0.5000.ckpt"
    ckpt.write_bytes(checkpoints["full"].read_bytes())
    (run / "metrics.json").write_text(json.dumps({"status": "finished", "best": {"checkpoint": str(ckpt)}}))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    command = [str(Path(sys.executable).parent / "mhalab-attention-map"), f"ckpt_path={run}", f"text={TEXT}"]
    res = fork_server.run(command, cwd=elsewhere, env=dict(os.environ, PYTHONHASHSEED="0"), timeout=120)
    assert res.returncode == 0, res.stderr
    assert (run / "attention_map.png").read_bytes()[:8] == PNG_MAGIC and not list(elsewhere.iterdir())
    assert res.stdout.rstrip().endswith(f"; wrote {run / 'attention_map.png'}"), res.stdout
    # out= a relative name: from the working directory, printed in full
    res = fork_server.run([*command, "out=maps/a.png"], cwd=elsewhere, env=dict(os.environ, PYTHONHASHSEED="0"),
                          timeout=120)
    assert res.returncode == 0 and res.stdout.rstrip().endswith(f"; wrote {elsewhere / 'maps' / 'a.png'}"), res.stdout
    res = fork_server.run([command[0], "--help"], cwd=elsewhere, env=dict(os.environ, PYTHONHASHSEED="0"), timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("mhalab-attention-map: ") and "Most useful: " in res.stdout


def test_callback_saves_and_logs_maps(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger

    tok = train_tokenizer(TEXTS, "wordpiece", 100, True, 1)
    module = Classifier(model={"dim": 16, "heads": 2, "layers": 1, "ff_dim": 32, "max_len": 32}, vocab_size=tok.get_vocab_size(),
                        num_classes=2)
    cb = AttentionMapLogger(num_examples=2, max_tokens=6)
    tb = TensorBoardLogger(str(tmp_path), name="tb", version="")
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, accelerator="cpu", logger=tb, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[cb], default_root_dir=str(tmp_path))
    trainer.fit(module, _loader(tok), _loader(tok, n=8))
    assert [p.name for p in cb.saved] == ["epoch000_ex0.png", "epoch000_ex1.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in cb.saved)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    # linformer: one warning, no maps, training unaffected
    lin = Classifier(model={"dim": 16, "heads": 2, "layers": 1, "ff_dim": 32, "max_len": 32, "attention": "linformer",
                                "attention_options": {"linformer_k": 4}}, vocab_size=tok.get_vocab_size(), num_classes=2)
    cb2 = AttentionMapLogger()
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[cb2], default_root_dir=str(tmp_path / "lin"))
    trainer.fit(lin, _loader(tok), _loader(tok, n=8))
    assert cb2.saved == [] and cb2._disabled


def test_figures_are_not_pyplots(checkpoints):
    module, tok = load_checkpoint(checkpoints["full"])
    ids, labels = encode_text(module, tok, TEXT)
    fig = plot_attention_maps([w[0] for w in attention_weights(module, ids)[1]], labels)
    # pyplot's figures get a manager (a window, a place in pyplot's figure list): these have none, so
    # nothing has to close them and no backend was chosen for them
    assert fig.canvas.manager is None and len(fig.axes) == 2 * 2


def test_drawing_leaves_the_users_matplotlib_backend_alone(tmp_path):
    # a user (or a notebook) picked the svg backend; importing and drawing must not switch it (the maps
    # used to call matplotlib.use("Agg")), and the figure is drawn without pyplot
    code = ("import matplotlib, torch, mhalab.analysis.attention_maps as m; "
            f"fig = m.plot_attention_maps([torch.rand(1, 3, 3)], list('abc'), {str(tmp_path / 'x.png')!r}); "
            "print(matplotlib.get_backend(), fig.canvas.manager)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False,
                         env={**os.environ, "MPLBACKEND": "svg"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["svg", "None"]
    assert (tmp_path / "x.png").read_bytes()[:8] == PNG_MAGIC
