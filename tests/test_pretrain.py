"""Self-pretraining (pretrain=mlm, init_from): BERT's masking, the masked-LM loss against a padded computation
written out here, the train split only, the cache (one pretraining per model shape), and fine-tuning from it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from conftest import compose_train

from mhalab.data.tokenizer import CLS_ID, PAD_ID, SEP_ID, SPECIALS
from mhalab.errors import CheckpointError, ConfigError
from mhalab.mlm import MaskedLanguageModel, choose_masked
from mhalab.model import SequenceClassifier
from mhalab.nn.varlen import SeqLens
from mhalab.train import pretrain
from mhalab.train.run import build, run

ONE_THREAD = True
SPECIAL = torch.tensor([PAD_ID, CLS_ID, SEP_ID])


def test_masking_chooses_15_percent_of_real_tokens_and_splits_them_80_10_10():
    g = torch.Generator().manual_seed(0)
    n = 200_000
    ids = torch.randint(len(SPECIALS), 1000, (n,), generator=g)
    ids[::10] = CLS_ID  # specials are never chosen
    ids[5::10] = SEP_ID
    chosen, to_mask, corrupted = choose_masked(ids, SPECIAL, 1000, len(SPECIALS), 0.15, generator=g)
    real = int((ids >= len(SPECIALS)).sum())
    assert not chosen[ids < len(SPECIALS)].any()
    # binomial(real, 0.15): 5 standard deviations is ~0.0021 here
    assert abs(int(chosen.sum()) / real - 0.15) < 5 * math.sqrt(0.15 * 0.85 / real)
    m = int(chosen.sum())
    masked, replaced = int(to_mask.sum()), int((chosen & ~to_mask & (corrupted != ids)).sum())
    kept = int((chosen & ~to_mask & (corrupted == ids)).sum())
    sd = math.sqrt(0.1 * 0.9 / m)
    assert abs(masked / m - 0.8) < 5 * math.sqrt(0.16 / m)
    # a random replacement may draw the token itself (1 in 996): it then counts as kept
    assert abs(replaced / m - 0.1) < 5 * sd and abs(kept / m - 0.1) < 5 * sd + 0.001
    assert (corrupted[~chosen] == ids[~chosen]).all() and (corrupted >= len(SPECIALS)).sum() == real
    assert not to_mask[~chosen].any()


def test_masking_a_batch_that_draws_no_token_predicts_its_first_real_token_and_never_a_special():
    ids = torch.tensor([CLS_ID, 7, 8, 9, SEP_ID, PAD_ID, CLS_ID, 10, SEP_ID])
    chosen, _, _ = choose_masked(ids, SPECIAL, 20, len(SPECIALS), mask_prob=1e-9)
    assert chosen.tolist() == [False, True] + [False] * 7  # the first real token, only it
    chosen, _, _ = choose_masked(ids, SPECIAL, 20, len(SPECIALS), mask_prob=0.999999)
    assert chosen.tolist() == [i >= len(SPECIALS) for i in ids.tolist()]  # every real token: none added
    specials = torch.tensor([CLS_ID, SEP_ID, PAD_ID])
    assert not choose_masked(specials, SPECIAL, 20, len(SPECIALS), mask_prob=1e-9)[0].any()


@pytest.mark.parametrize("encoder,pooling,pos,attention", [
    ("custom", "mean", "sinusoidal", "full"), ("custom", "cls", "rope", "full"), ("custom", "mean", "t5", "full"),
    ("official", "cls", "learned", "full"), ("custom", "cls", "alibi", "window"), ("custom", "mean", "rope", "linformer"),
    ("custom", "mean", "learned", "performer")])
def test_masked_lm_loss_equals_the_padded_computation_written_out(encoder, pooling, pos, attention):
    """The packed forward (CLS rows skipped, [MASK] vector, tied and scaled output) against the same loss built
    by hand from a padded batch and the encoder's plain padded forward."""
    torch.manual_seed(0)
    V, E = 50, 32
    backbone = SequenceClassifier(V, 3, encoder=encoder, dim=E, heads=4, layers=2, ff_dim=64, dropout=0.0,
                                  pos=pos, pooling=pooling, max_len=16, attention=attention,
                                  attention_options={"window": 6, "linformer_k": 8, "performer_features": 16}).eval()
    mlm = MaskedLanguageModel(backbone, (PAD_ID, CLS_ID, SEP_ID), len(SPECIALS), mask_prob=0.3).eval()
    lengths = [9, 5, 12, 3]
    rows = [torch.cat([torch.tensor([CLS_ID]), torch.randint(len(SPECIALS), V, (n - 2,)), torch.tensor([SEP_ID])])
            for n in lengths]
    packed = torch.cat(rows)
    loss, count, correct = mlm(packed, SeqLens(lengths), generator=torch.Generator().manual_seed(3))

    chosen, to_mask, ids = choose_masked(packed, mlm.special_ids, V, len(SPECIALS), 0.3,
                                         torch.Generator().manual_seed(3))  # the same draws
    B, L = len(lengths), max(lengths)
    pad = torch.arange(L)[None, :] >= torch.tensor(lengths)[:, None]  # (B, L)
    x = torch.zeros(B, L, E)
    start = 0
    for b, n in enumerate(lengths):
        e = backbone.embed(ids[start:start + n])
        x[b, :n] = torch.where(to_mask[start:start + n, None], mlm.mask_vector, e)
        start += n
    if pooling == "cls":
        x = torch.cat([backbone.cls.expand(B, 1, E), x], 1)
        pad = torch.cat([torch.zeros(B, 1, dtype=torch.bool), pad], 1)
    if backbone.pos is not None:
        x = backbone.pos(x)
    h = backbone.encoder(x, src_key_padding_mask=pad)  # (B, L', E)
    if pooling == "cls":
        h = h[:, 1:]
    h = torch.cat([h[b, :n] for b, n in enumerate(lengths)])[chosen]  # (M, E) the chosen tokens, in order
    logits = F.linear(mlm.transform(h) / math.sqrt(E), backbone.embed.weight, mlm.bias)
    want = F.cross_entropy(logits, packed[chosen])
    assert int(count) == int(chosen.sum()) > 0
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=0)
    assert int(correct) == int((logits.argmax(-1) == packed[chosen]).sum())
    # ln V at the start: the output scale is right (an unscaled tied output starts near 20 here)
    assert abs(loss.item() - math.log(V)) < 1.5


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, toy_data_dir):
    """One tiny pretraining (2 epochs) and its fine-tuning run, shared by the tests below."""
    tmp = tmp_path_factory.mktemp("pretrain")
    cache = tmp / "cache"
    overrides = ["pretrain=mlm", "pretrain.epochs=2", "max_epochs=1", "data.dev_split=0.25",
                 "data.files.validation=null"]
    cfg = compose_train(overrides, tmp / "run", toy_data_dir, cache)
    run(cfg)
    return {"cfg": cfg, "cache": cache, "tmp": tmp, "overrides": overrides, "data": toy_data_dir,
            "record": json.loads((tmp / "run" / "metrics.json").read_text())}


def test_pretraining_sees_every_train_token_per_epoch_and_no_validation_or_test_token(pretrained):
    rec = pretrained["record"]
    meta = json.loads((pretrain.resolve_init(rec["pretrain"]["dir"]).parent / "meta.json").read_text())
    cfg = pretrained["cfg"]
    dm, _ = build(cfg)  # the same data: train is the 75% left after the dev hold-out
    train_tokens = sum(dm.splits["train"].lengths)
    others = sum(sum(dm.splits[s].lengths) for s in ("validation", "test"))
    assert meta["tokens_seen"] == 2 * train_tokens and others > 0
    # the loader pretraining reads (the datamodule's train loader) yields exactly the train split's sequences
    seen = sorted(tuple(ids[:n].tolist()) for batch in dm.train_dataloader()
                  for ids, n in zip(batch["input_ids"], batch["lengths"].tolist()))
    train = sorted(tuple(dm.splits["train"][i][0].tolist()) for i in range(len(dm.splits["train"])))
    assert seen == train
    assert rec["status"] == "finished" and rec["pretrain"]["cached"] is False
    assert meta["final_loss"] < math.log(dm.vocab_size)  # it learned something in 2 epochs
    log = pd.read_csv(Path(meta["dir"]) / "logs" / "metrics.csv")  # final_*: the last epoch's logged steps, averaged
    last = log[log["epoch"] == 1]
    assert len(last) > 1 and meta["final_loss"] == pytest.approx(last["pretrain/loss"].mean())
    assert meta["final_acc"] == pytest.approx(last["pretrain/acc"].mean())


def test_a_second_fine_tuning_reuses_the_cached_encoder_and_another_shape_or_hold_out_pretrains_again(pretrained):
    tmp, ov, data, cache = pretrained["tmp"], pretrained["overrides"], pretrained["data"], pretrained["cache"]
    first = pretrain.cache_dir(pretrained["cfg"], build(pretrained["cfg"])[0])
    cfg = compose_train(ov + ["lr=3e-3", "max_epochs=2", "dropout=0.2"], tmp / "run2", data, cache)
    enc, _ = pretrain.read_encoder(pretrain.resolve_init(pretrained["record"]["pretrain"]["dir"]))
    # the fine-tuning settings (lr, epochs) do not change the pretraining dir: build loads it from the cache
    dm, module = build(cfg, pretrain.stage(cfg))
    assert pretrain.cache_dir(cfg, dm) == first
    assert module.checkpoint_extras["pretrain"]["cached"] is True
    for k, v in enc.items():  # fine-tuning starts from the pretrained weights, all but the head
        torch.testing.assert_close(module.model.state_dict()[k], v, atol=0, rtol=0)
    # the model's shape does; so does the seed of a held-out dev split: its train texts are another 75%,
    # and pretraining on the old ones would show the model this seed's validation texts; and a debugging cut
    # (2 batches an epoch): its encoder must never stand in for a full pretraining
    for other in (["dim=48"], ["seed=1"], ["trainer.limit_train_batches=2"]):
        c = compose_train(ov + other, tmp / "run3", data, cache)
        assert pretrain.cache_dir(c, build(c)[0]) != first, other


def test_fine_tuning_from_the_cache_equals_fine_tuning_right_after_pretraining(pretrained):
    """The run that pretrained and a later run that found the encoder cached train the same model, to the digit."""
    again = compose_train(pretrained["overrides"], pretrained["tmp"] / "again", pretrained["data"], pretrained["cache"])
    run(again)
    rec = json.loads((pretrained["tmp"] / "again" / "metrics.json").read_text())
    assert rec["pretrain"]["cached"] is True and rec["pretrain"]["dir"] == pretrained["record"]["pretrain"]["dir"]
    assert rec["best"]["val/loss"] == pretrained["record"]["best"]["val/loss"]
    assert rec["best"]["test/loss"] == pretrained["record"]["best"]["test/loss"]


def test_an_interrupted_pretraining_resumes_mid_epoch_to_the_same_weights(tmp_path, toy_data_dir):
    """SIGTERM at step 20 of 26 (13 batches an epoch: mid-epoch 1): last.ckpt is saved, no encoder.pt; the next call
    continues from it
    and ends with the weights, token count and log of a pretraining that was never stopped."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from mhalab.train.callbacks import SimulateSignal

    ov = ["pretrain=mlm", "pretrain.epochs=2", "dropout=0.1"]
    whole = compose_train(ov, tmp_path / "a", toy_data_dir, tmp_path / "cache_a")
    ref, ref_meta = pretrain.pretrained_encoder(whole, build(compose_train([], tmp_path / "a", toy_data_dir,
                                                                           tmp_path / "cache_a"))[0])
    cfg = compose_train(ov, tmp_path / "b", toy_data_dir, tmp_path / "cache_b")
    dm = build(compose_train([], tmp_path / "b", toy_data_dir, tmp_path / "cache_b"))[0]
    d = pretrain.cache_dir(cfg, dm)
    with pytest.raises(SIGTERMException):
        pretrain.pretrained_encoder(cfg, dm, callbacks=(SimulateSignal(at_step=20),))
    assert (d / "checkpoints" / "last.ckpt").exists() and not (d / pretrain.WEIGHTS).exists()
    dm = build(compose_train([], tmp_path / "b", toy_data_dir, tmp_path / "cache_b"))[0]  # a new process's
    state, meta = pretrain.pretrained_encoder(cfg, dm)
    assert meta["cached"] is False and meta["global_step"] == ref_meta["global_step"] == 26
    for k, v in ref.items():
        torch.testing.assert_close(state[k], v, atol=1e-6, rtol=0, msg=k)
    assert meta["tokens_seen"] == ref_meta["tokens_seen"] == 2 * sum(dm.splits["train"].lengths)
    def steps(run: Path) -> list[int]:
        return [int(x.split(",")[-1]) for x in (run / "logs" / "metrics.csv").read_text().splitlines()[1:]]

    assert steps(d) == steps(Path(ref_meta["dir"]))  # the log reads as one run


def test_the_encoder_follows_pretrain_seed_and_not_the_seed_of_the_run_that_pretrained_it(tmp_path, toy_data_dir):
    """Fine-tuning seeds share one cached encoder (the toy data has a dev file: no per-seed hold-out), so the encoder
    must be the same whichever seed's run pretrains it; pretrain.seed alone changes it."""
    def encoder(seed: int, pretrain_seed: int) -> dict:
        out, cache = tmp_path / f"s{seed}p{pretrain_seed}", tmp_path / f"cache_s{seed}p{pretrain_seed}"
        cfg = compose_train(["pretrain=mlm", "pretrain.epochs=1", "dropout=0.1", f"seed={seed}",
                             f"pretrain.seed={pretrain_seed}"], out, toy_data_dir, cache)
        dm = build(compose_train([f"seed={seed}"], out, toy_data_dir, cache))[0]
        return pretrain.pretrained_encoder(cfg, dm)[0]

    by_seed0, by_seed1, other = encoder(0, 0), encoder(1, 0), encoder(0, 1)
    for k, v in by_seed0.items():
        torch.testing.assert_close(by_seed1[k], v, atol=0, rtol=0, msg=k)
    assert max((other[k] - v).abs().max().item() for k, v in by_seed0.items()) > 1e-3


def test_a_fine_tuning_interrupted_and_resumed_keeps_its_encoders_record(pretrained):
    """SIGTERM in fine-tuning; the rerun resumes from last.ckpt (no encoder built) and still records where the
    encoder came from."""
    ov, out = pretrained["overrides"], pretrained["tmp"] / "resumed"
    cfg = compose_train(ov + ["debug=preempt", "callbacks.preempt.at_step=3"], out, pretrained["data"],
                        pretrained["cache"])
    with pytest.raises(SystemExit):
        run(cfg)
    run(compose_train(ov, out, pretrained["data"], pretrained["cache"]))
    rec = json.loads((out / "metrics.json").read_text())
    assert rec["status"] == "finished" and len(rec["attempts"]) == 2 and rec["attempts"][1]["from_step"] == 3
    assert rec["pretrain"]["dir"] == pretrained["record"]["pretrain"]["dir"]


def test_init_from_loads_the_encoder_and_refuses_another_shape_or_tokenizer(pretrained):
    tmp, d = pretrained["tmp"], pretrained["record"]["pretrain"]["dir"]
    enc, _ = pretrain.read_encoder(pretrain.resolve_init(d))
    cfg = compose_train([f"init_from={d}", "data.dev_split=0.25", "data.files.validation=null"], tmp / "i1",
                        pretrained["data"], pretrained["cache"])
    _, module = build(cfg, pretrain.stage(cfg))
    torch.testing.assert_close(module.model.embed.weight, enc["embed.weight"], atol=0, rtol=0)
    wrong = compose_train([f"init_from={d}", "dim=48", "data.dev_split=0.25", "data.files.validation=null"],
                          tmp / "i2", pretrained["data"], pretrained["cache"])
    with pytest.raises(CheckpointError, match=r"holds an encoder with model.dim=32, but the config has model.dim=48"):
        build(wrong, pretrain.stage(wrong))
    other_tok = compose_train([f"init_from={d}", "data.vocab_size=150", "data.dev_split=0.25",
                               "data.files.validation=null"], tmp / "i3", pretrained["data"], pretrained["cache"])
    with pytest.raises(CheckpointError, match=r"its embeddings belong to other token ids"):
        build(other_tok, pretrain.stage(other_tok))


@pytest.mark.parametrize("overrides,error,match", [
    (["pretrain=mlm", "pretrain.mask_prob=1.5"], ConfigError, r"pretrain.mask_prob=1.5 must be in \(0, 1\)"),
    (["pretrain=mlm", "pretrain.epochs=0"], ConfigError, r"pretrain.epochs=0 must be >= 1"),
    (["pretrain=mlm", "pretrain.objective=clm"], ConfigError, r"unknown pretrain.objective 'clm'; choose one of mlm"),
    (["pretrain=mlm", "init_from=/tmp"], ConfigError, r"pretrain=mlm and init_from=/tmp both give"),
    (["init_from=/no/such/dir"], CheckpointError, r"init_from=/no/such/dir does not exist"),
])
def test_bad_pretraining_settings_fail_before_data_is_read(overrides, error, match, tmp_path):
    cfg = compose_train(overrides, tmp_path, tmp_path / "no-data-here")
    with pytest.raises(error, match=match):
        build(cfg)
