"""What a run prints: the end-of-run summary is the record's figures, and only third-party noise is dropped."""

from __future__ import annotations

import logging
import warnings

from mhalab.train.console import duration, quiet, summary


def _record(tested: bool = True) -> dict:
    best = {"val/acc": 0.795, "val/f1": 0.7947, "val/loss": 0.4496, "checkpoint": "/x/checkpoints/epoch02-acc0.7950.ckpt",
            "epoch": 2, "step": 3159}
    if tested:
        best |= {"test/acc": 0.7853, "test/f1": 0.7851, "test/loss": 0.4601}
    return {"status": "finished", "wall_time_s": 161.4, "fit_time_s": 154.0, "global_step": 3159, "epochs": 3,
            "best": best}


def test_summary_gives_the_records_figures_checkpoint_and_files(tmp_path):
    (tmp_path / "metrics.json").write_text("{}")
    lines = summary(_record(), tmp_path).splitlines()
    assert lines[0] == f"finished in 2 min 41 s (fit 2 min 34 s, 3,159 steps): {tmp_path}"
    assert lines[1] == ("  best   epoch02-acc0.7950.ckpt, after epoch 3 of 3 (step 3,159): what mhalab-eval and "
                        "mhalab-predict load")
    assert lines[2] == "  val    acc 79.50%  macro-F1 79.47%  loss 0.4496"
    assert lines[3] == "  test   acc 78.53%  macro-F1 78.51%  loss 0.4601"
    assert lines[4] == "  files  metrics.json"  # only the files that are there
    assert "  test   not run" in summary(_record(tested=False), tmp_path)


def test_duration_reads_as_a_person_would_write_it():
    assert [duration(s) for s in (4.4, 59.6, 161, 3600 + 5 * 60 + 29)] == ["4 s", "1 min 00 s", "2 min 41 s",
                                                                          "1 h 05 min"]


def test_quiet_drops_lightnings_tips_and_known_warnings_and_nothing_else(caplog):
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    with caplog.at_level(logging.INFO, logger=logger.name), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet():  # its filters go in front of "always"
            logger.info("💡 Tip: For seamless cloud logging and experiment tracking, try installing litlogger")
            logger.info("GPU available: False, used: False")
            warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use something else", FutureWarning)
            warnings.warn("a real problem", UserWarning)
    assert [r.getMessage() for r in caplog.records] == ["GPU available: False, used: False"]
    assert [str(w.message) for w in seen] == ["a real problem"]
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.info("💡 Tip: after the run")  # the filter is gone with the run
    assert caplog.records[-1].getMessage() == "💡 Tip: after the run"


def test_the_summary_says_the_head_dim_heads_set_and_when_the_dev_set_is_too_small_for_the_margin(tmp_path):
    """The audit's run: heads=16 at dim 128 (head_dim 8, set by dim / heads) on a 480-row CSV, whose automatic 10%
    dev split holds 49 examples, so accuracy moves in steps of 2 points against a 1-point margin."""
    rec = _record() | {"model": {"dim": 128, "heads": 16, "layers": 2, "head_dim": 8, "head_dim_from": "dim / heads"},
                       "trained": {"steps": 21, "planned_steps": 21, "epochs": 3, "max_epochs": 3,
                                   "evaluated": {"validation": [49, 49]}}}
    text = summary(rec, tmp_path)
    assert "  model  dim 128, 16 heads of head_dim 8 (dim / heads), 2 layers" in text.splitlines()
    assert ("  note   49 validation examples: one example moves accuracy by 2.04 points, more than half of a ±1-point "
            "margin, so differences near it are one or two examples; 200 or more resolve it") in text
    rec["trained"]["evaluated"]["validation"] = [200, 200]  # one example: 0.5 point, half the margin
    assert "  note " not in summary(rec, tmp_path)
