"""The console commands (pyproject's [project.scripts]): mhalab-train, mhalab-eval, mhalab-predict, mhalab-ensemble,
mhalab-baseline.

mhalab-report, mhalab-bench and mhalab-compare live with their code in mhalab.analysis. Every command
prints a user's mistake as one line and exits 2 (mhalab.errors.one_line_errors).
"""

from __future__ import annotations

import sys

from mhalab.errors import one_line_errors

# Keys whose values are paths. A sweep member's run dir is named by its overrides (`data=trec,seed=0`: conf/train.yaml,
# hydra.sweep.subdir), and Hydra's override grammar cannot read an `=` in an unquoted value, so the commands pass such
# a value on quoted: `mhalab-eval ckpt_path=multirun/x/seed=0` works as typed.
PATH_KEYS = ("ckpt_path", "init_from", "input", "output", "out", "runs", "data_dir", "paths.data_dir",
             "paths.cache_dir", "hydra.run.dir", "hydra.sweep.dir")


def quote_paths(argv: list[str]) -> list[str]:
    """argv with every `<path key>=<value holding '='>` quoted for Hydra (values already quoted, and lists, kept)."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") in PATH_KEYS and "=" in value and value[:1] not in "'\"[" and "'" not in value:
            arg = f"{key}='{value}'"
        out.append(arg)
    return out

# ------------------------------------------------------------------------------------ console scripts
# Each imports what it needs when it runs, so `import mhalab.cli` stays cheap. Hydra's key=value style for all.


def train() -> None:
    """mhalab-train (and `python train.py` in a checkout): one run, or a sweep with -m."""
    import hydra

    from mhalab.train import config  # registers the resolvers the configs use

    @hydra.main(version_base="1.3", config_path=str(config.CONF_DIR), config_name="train")
    @one_line_errors
    def main(cfg):
        from mhalab.train.run import run

        return run(cfg)

    sys.argv[1:] = quote_paths(sys.argv[1:])  # hydra.main reads sys.argv
    main()


def _hydra_command(config_name: str, module: str) -> None:
    """Compose conf/<config_name>.yaml with the command line's key=value overrides, then run
    <module>.command(cfg). Those configs write nothing of Hydra's (no run dir, no log)."""
    import importlib

    import hydra

    from mhalab.train import config

    @hydra.main(version_base="1.3", config_path=str(config.CONF_DIR), config_name=config_name)
    @one_line_errors
    def main(cfg):
        return importlib.import_module(module).command(cfg)

    sys.argv[1:] = quote_paths(sys.argv[1:])  # hydra.main reads sys.argv
    main()


def evaluate() -> None:
    """mhalab-eval (and `python scripts/eval.py`): a checkpoint's metrics on one split (conf/eval.yaml)."""
    _hydra_command("eval", "mhalab.train.evaluate")


def predict() -> None:
    """mhalab-predict: one JSON line of label and class probabilities per input text (conf/predict.yaml)."""
    _hydra_command("predict", "mhalab.train.predict")


def ensemble() -> None:
    """mhalab-ensemble: the averaged probabilities of several runs (a sweep's seeds), scored on one split."""
    _hydra_command("ensemble", "mhalab.train.ensemble")


def baseline() -> None:
    """mhalab-baseline: TF-IDF + logistic regression on a data set's splits (conf/baseline.yaml)."""
    _hydra_command("baseline", "mhalab.analysis.baseline")
