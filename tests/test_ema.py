"""callbacks=ema: the weights' exponential moving average is what a run validates, checkpoints, tests and
resumes; checked against the formula in mhalab.train.callbacks.ema, step by step."""

from __future__ import annotations

import json
from typing import ClassVar

import lightning as L
import torch
from conftest import compose_train
from test_faults import _run

from mhalab.train.commands.evaluate import evaluate
from mhalab.train.run import run

DECAY = 0.6  # the warm-up (1 + t) / (10 + t) passes 0.6 at t = 13.5: a 2-epoch toy run (26 steps) sees both


class Recorder(L.Callback):
    """The raw weights after every optimizer step (a class list: run() builds the callback from the config)."""

    steps: ClassVar[list[dict[str, torch.Tensor]]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        Recorder.steps.append({k: p.detach().clone() for k, p in pl_module.named_parameters()})


def _ema_by_hand(steps: list[dict[str, torch.Tensor]], decay: float) -> dict[str, torch.Tensor]:
    avg = dict(steps[0])  # the first update copies
    for t, w in enumerate(steps[1:], start=1):
        d = min(decay, (1 + t) / (10 + t))
        avg = {k: d * avg[k] + (1 - d) * w[k] for k in avg}
    return avg


def _ema_run(out, data, cache, *extra):
    Recorder.steps = []
    cfg = compose_train(["callbacks=ema", f"callbacks.ema.decay={DECAY}", "max_epochs=2", "seed=4",
                         "optim.schedule=constant",  # the last steps still move the weights: average != last
                         "+callbacks.rec._target_=test_ema.Recorder", *extra], out, data, cache)
    run(cfg)
    return json.loads((out / "metrics.json").read_text())


def test_ema_checkpoint_holds_the_warmed_up_average_of_every_steps_weights(tmp_path, toy_data_dir):
    rec = _ema_run(tmp_path / "out", toy_data_dir, tmp_path / "cache")
    steps = Recorder.steps
    assert len(steps) == rec["global_step"] == 26
    last = torch.load(tmp_path / "out" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    expected = _ema_by_hand(steps, DECAY)
    for k, v in expected.items():
        torch.testing.assert_close(last["state_dict"][k], v, atol=1e-6, rtol=1e-5, msg=k)
        torch.testing.assert_close(last["current_model_state"][k], steps[-1][k], atol=0, rtol=0, msg=k)
    # the average is not the last step's weights: the test above could fail
    gap = max((expected[k] - steps[-1][k]).abs().max().item() for k in expected)
    assert gap > 1e-3, gap


def test_ema_run_validates_and_tests_the_averaged_weights(tmp_path, toy_data_dir):
    rec = _ema_run(tmp_path / "out", toy_data_dir, tmp_path / "cache")
    best = rec["best"]["checkpoint"]
    averaged = {"test": evaluate(best, "test"), "val": evaluate(best, "validation")}
    ckpt = torch.load(best, map_location="cpu", weights_only=False)
    ckpt["state_dict"] = ckpt["current_model_state"]  # the same checkpoint with its raw weights
    raw_path = tmp_path / "raw.ckpt"
    torch.save(ckpt, raw_path)
    raw = {"test": evaluate(raw_path, "test"), "val": evaluate(raw_path, "validation")}
    assert abs(rec["best"]["test/loss"] - averaged["test"]["test/loss"]) < 1e-5
    assert abs(rec["best"]["val/loss"] - averaged["val"]["validation/loss"]) < 1e-5
    assert abs(rec["best"]["test/loss"] - raw["test"]["test/loss"]) > 1e-3  # Lightning's own callback tests these
    assert abs(rec["best"]["val/loss"] - raw["val"]["validation/loss"]) > 1e-3


def test_ema_run_killed_mid_epoch_resumes_to_the_same_average(tmp_path, toy_data_dir, fork_server):
    ema = ("callbacks=ema", f"callbacks.ema.decay={DECAY}")
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert _run(fork_server, straight, toy_data_dir, *ema).returncode == 0
    proc = _run(fork_server, killed, toy_data_dir, *ema, "debug=preempt", "callbacks.preempt.at_step=17",
                "callbacks.preempt.signal=SIGKILL")
    assert proc.returncode == -9
    assert _run(fork_server, killed, toy_data_dir, *ema).returncode == 0  # resumes from the step-10 checkpoint
    a, b = (torch.load(d / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
            for d in (straight, killed))
    assert a["global_step"] == b["global_step"] == 50
    for key in ("state_dict", "current_model_state"):
        for k, v in a[key].items():
            torch.testing.assert_close(b[key][k], v, atol=1e-6, rtol=0, msg=f"{key} {k}")
