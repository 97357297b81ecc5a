"""What every command does with a user's mistake: one line, `error: <message>`, and exit status 2.

A `mhalab.errors.UserError` names the value and the fix; its traceback would only hide that line.
`HYDRA_FULL_ERROR=1` (Hydra's own switch) shows the traceback anyway. Every other exception is a bug
and keeps its traceback.
"""

from __future__ import annotations

import functools
import os
import sys

from mhalab.errors import UserError

USER_ERROR_EXIT = 2


def exit_with(error: UserError) -> None:
    """Print a user error as one line and exit 2 (or raise it, for the traceback, under HYDRA_FULL_ERROR=1)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    print(f"error: {error}", file=sys.stderr, flush=True)
    sys.exit(USER_ERROR_EXIT)


def one_line_errors(fn):
    """Decorate a command's entry function (under @hydra.main too) so user errors print as one line."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            exit_with(e)

    return wrapper


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

    main()


def _hydra_command(config_name: str, command: str) -> None:
    """Compose conf/<config_name>.yaml with the command line's key=value overrides, then run
    mhalab.train.<command>.command(cfg). Those configs write nothing of Hydra's (no run dir, no log)."""
    import importlib

    import hydra

    from mhalab.train import config

    @hydra.main(version_base="1.3", config_path=str(config.CONF_DIR), config_name=config_name)
    @one_line_errors
    def main(cfg):
        return importlib.import_module(f"mhalab.train.{command}").command(cfg)

    main()


def evaluate() -> None:
    """mhalab-eval (and `python scripts/eval.py`): a checkpoint's metrics on one split (conf/eval.yaml)."""
    _hydra_command("eval", "evaluate")


def predict() -> None:
    """mhalab-predict: one JSON line of label and class probabilities per input text (conf/predict.yaml)."""
    _hydra_command("predict", "predict")
