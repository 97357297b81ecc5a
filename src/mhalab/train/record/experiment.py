"""The experiment record beside the metrics: the config tree printed and saved, the `extras` switches, and
what every logger (csv, wandb, tensorboard) receives as hyper-parameters.

As lightning-hydra-template's `extras` and `log_hyperparameters`: a run says, in each place a user looks,
the whole resolved config (data, model, optim, trainer, callbacks, seed...), the command-line overrides,
and its provenance (git commit and dirty flag, library versions, device: mhalab.train.record.provenance).
"""

from __future__ import annotations

import io
import warnings
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

TREE_FILE = "config_tree.log"
# the groups shown first, in this order (then the rest of the root keys: shortcuts, seed, paths, extras...)
TREE_ORDER = ("data", "model", "optim", "trainer", "callbacks", "logger")


def resolved(cfg: DictConfig) -> dict:
    """The config as plain, resolved data (what a logger and metrics.json store)."""
    return OmegaConf.to_container(cfg, resolve=True)


def config_tree(cfg: DictConfig):
    """A rich Tree of the resolved config: one branch per group (TREE_ORDER first), YAML in each."""
    from rich.syntax import Syntax
    from rich.tree import Tree

    data = resolved(cfg)
    tree = Tree("config", style="bold", guide_style="dim")
    order = [k for k in TREE_ORDER if k in data] + [k for k in data if k not in TREE_ORDER]
    scalars = {k: data[k] for k in order if not isinstance(data[k], dict)}
    for key in order:
        if isinstance(data[key], dict):
            branch = tree.add(key, style="bold")
            branch.add(Syntax(OmegaConf.to_yaml(data[key]).rstrip() or "{}", "yaml", theme="ansi_dark"))
    if scalars:
        tree.add("(root)", style="bold").add(Syntax(OmegaConf.to_yaml(scalars).rstrip(), "yaml", theme="ansi_dark"))
    return tree


def print_config(cfg: DictConfig, out: Path | None = None) -> str:
    """Print the config tree to the console and, with `out`, save it there as plain text (TREE_FILE).
    Returns the plain text."""
    from rich.console import Console

    tree = config_tree(cfg)
    Console().print(tree)
    buffer = io.StringIO()
    Console(file=buffer, width=110, color_system=None, force_terminal=False).print(tree)
    text = buffer.getvalue()
    if out is not None:
        (Path(out) / TREE_FILE).write_text(text)
    return text


@contextmanager
def extras(cfg: DictConfig, out: Path | None = None):
    """The run's `extras` (conf/train.yaml): print (and save) the config tree; silence warnings for the run.
    `extras.enforce_tags` is a config rule, checked with the others in mhalab.train.config.validate."""
    ex = cfg.get("extras") or {}
    with warnings.catch_warnings():
        if ex.get("ignore_warnings"):
            warnings.simplefilter("ignore")
        if ex.get("print_config", False):
            print_config(cfg, out)
        yield


def hyperparameters(cfg: DictConfig, provenance: dict, overrides: list[str]) -> dict:
    """What every logger receives: the resolved config, the command's overrides, and the provenance."""
    return {"config": resolved(cfg), "overrides": list(overrides), "provenance": provenance}


def log_hyperparameters(loggers, params: dict) -> None:
    """Send `params` to each logger. Lightning logs the LightningModule's own hparams (the model, vocab, the
    optimizer) at fit start as well; these add the data, trainer, seed and provenance beside them."""
    for lg in loggers:
        lg.log_hyperparams(params)
