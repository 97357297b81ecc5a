"""compile=true: each encoder layer's position-wise half is one graph for every batch, so a run of a few hundred
steps of varying lengths, bucketed and packed, compiles a bounded number of graphs instead of one per batch (the
whole model, compiled before, recompiled every few batches and failed at step ~160: Dynamo's "Guard failed on
the same frame it was created")."""

from __future__ import annotations

import json

import torch
from conftest import compose_train
from torch._dynamo.utils import counters

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
