"""compile=true: each encoder layer's position-wise half is one graph for every batch, so a run of a few hundred
steps of varying lengths, bucketed and packed, compiles a bounded number of graphs instead of one per batch (the
whole model, compiled before, recompiled every few batches and failed at step ~160: Dynamo's "Guard failed on
the same frame it was created")."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_train
from torch._dynamo.utils import counters

from mhalab.model import SequenceClassifier
from mhalab.nn.varlen import SeqLens
from mhalab.train.module import Classifier
from mhalab.train.run import run


def test_compile_true_trains_bucketed_and_packed_runs_with_a_bounded_number_of_graphs(tmp_path, toy_data_dir):
    torch._dynamo.reset()
    counters.clear()
    records = []
    for batching in ("bucketed", "packed"):  # 4 epochs of 25 batches of 16 toy sentences, lengths varying
        out = tmp_path / batching
        cfg = compose_train(["compile=true", "max_epochs=4", "batch_size=16", "test_after_fit=false",
                             f"data.batching={batching}", "trainer.log_every_n_steps=50"], out, toy_data_dir,
                            tmp_path / "cache")
        run(cfg)
        records.append(json.loads((out / "metrics.json").read_text()))
    for rec in records:
        assert rec["status"] == "finished" and rec["global_step"] >= 95, (rec["status"], rec["global_step"])
        assert rec["best"]["val/acc"] > 0.6  # it learned (the toy set's chance is 0.5)
    # one graph with autograd (training) and one without (validation), shared by every layer and both runs; a
    # graph per batch shape would be hundreds
    assert counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compiled_model_keeps_the_eager_models_parameters_and_state_dict_keys():
    kwargs = {"model": {"dim": 32, "heads": 4, "layers": 1, "ff_dim": 64, "max_len": 16}, "vocab_size": 50,
              "num_classes": 2}
    torch.manual_seed(0)
    eager = Classifier(**kwargs)
    torch.manual_seed(0)
    compiled = Classifier(**kwargs, compile=True)
    a, b = eager.state_dict(), compiled.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)  # a checkpoint loads into either


def _train_losses(compiled: bool, packed: bool, steps: int = 30) -> tuple[list[float], dict]:
    """`steps` AdamW steps with dropout 0.1 on batches of 8 random sequences of 2-24 tokens, right-padded (or
    packed with their seqlens, as the collate gives them), the same draws for both models."""
    torch.manual_seed(0)
    model = SequenceClassifier(100, 3, dim=32, heads=4, layers=2, ff_dim=128, dropout=0.1, max_len=32)
    if compiled:
        model.compile_positionwise()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    data = torch.Generator().manual_seed(1)
    torch.manual_seed(2)  # the dropout masks' draws
    losses = []
    for _ in range(steps):
        lengths = torch.randint(2, 25, (8,), generator=data).tolist()
        ids = torch.zeros(8, max(lengths), dtype=torch.long)  # (B, L), pad id 0 after each sequence
        for i, n in enumerate(lengths):
            ids[i, :n] = torch.randint(4, 100, (n,), generator=data)
        labels = torch.randint(0, 3, (8,), generator=data)
        logits = model(ids, ids == 0, seqlens=SeqLens(lengths) if packed else None)  # (B, C)
        loss = F.cross_entropy(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_compiled_training_draws_the_same_dropout_and_gives_the_eager_numbers(packed):
    # Inductor's own generator would draw other dropout masks (the losses then differ by ~0.1 within 30 steps);
    # fallback_random keeps PyTorch's, so compile=true changes the speed of a run, not its numbers
    torch._dynamo.reset()
    eager, eager_state = _train_losses(compiled=False, packed=packed)
    compiled, compiled_state = _train_losses(compiled=True, packed=packed)
    assert max(abs(a - b) for a, b in zip(eager, compiled)) < 1e-5, (eager, compiled)
    # the trained weights: Adam divides each update by the gradient's running scale, so a weight whose gradients
    # are ~0 moves by lr per step either way and float rounding picks the direction; compare what they compute
    torch.manual_seed(3)
    probe = torch.randint(4, 100, (16, 20))
    outputs = []
    for state in (eager_state, compiled_state):
        model = SequenceClassifier(100, 3, dim=32, heads=4, layers=2, ff_dim=128, dropout=0.1, max_len=32).eval()
        model.load_state_dict(state)
        outputs.append(model(probe).softmax(-1))
    assert (outputs[0] - outputs[1]).abs().max() < 1e-4
    assert len(set(eager)) > 20  # the batches (and losses) vary: the comparison is not of one repeated step
