"""The console commands (pyproject's [project.scripts]): mhalab-train, mhalab-eval, mhalab-predict, mhalab-ensemble,
mhalab-baseline.

mhalab-report, mhalab-bench and mhalab-compare live with their code in mhalab.analysis. Every command
prints a user's mistake as one line and exits 2 (mhalab.errors.one_line_errors).
"""

from __future__ import annotations

import os
import sys

from mhalab.errors import ConfigError, UserError, exit_with, one_line_errors

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


def check_overrides(config_name: str, argv: list[str], check_run=None) -> None:
    """Compose conf/<config_name>.yaml as the command line's first job would be, before Hydra runs it: an override
    Hydra cannot parse, a key the config lacks or an option a group lacks is one line and exit 2 (Hydra's own
    message is several lines, exit 1). A sweep's first value stands for the sweep (an interval's start), a group's
    every option is composed (model=custom,offical), and so are the keys a sweeper searches (hparams_search=optuna's
    hydra.sweeper.params: a typo there would fail every trial). Flags other than -m (--help, --cfg, ...) are
    Hydra's business: then nothing is checked here. `check_run(cfg)`: a single run's own checks (mhalab-train: its
    config and data files), so that a refusal comes before Hydra makes the run dir; a sweep's members are checked
    each in its own run, where a failed member is recorded and the sweep goes on."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf import OmegaConf, open_dict

    from mhalab.train.config import CONF_DIR, check_machine, check_until_decided

    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):
        return
    parser = OverridesParser.create()
    job, other_options = [], []  # the first job's overrides; a group sweep's other options (model=custom,official)

    def add(arg: str) -> None:
        try:
            (o,) = parser.parse_overrides([arg])
        except OverrideParseException as e:
            reason = str(e).splitlines()[0]
            exit_with(ConfigError(f"cannot read the override {arg!r} ({reason}); a value holding '=', ',', spaces or "
                                  f"brackets goes in quotes: key='a b'."))
        if not o.is_sweep_override():
            job.append(arg)
            return
        first, *rest = _sweep_values(o)
        job.append(f"{o.get_key_element()}={first}")
        if "/" in o.key_or_group or (CONF_DIR / o.key_or_group).is_dir():
            other_options.extend((len(job) - 1, f"{o.get_key_element()}={v}") for v in rest)

    for arg in argv:
        if arg not in ("-m", "--multirun"):
            add(arg)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        def compose_job(overrides: list[str]):
            return compose(config_name, overrides=overrides, return_hydra_config=True)

        try:
            cfg = compose_job(job)
            # the sweeper's search space (a key typed on the command line overrides the config's entry for it)
            typed = {o.split("=", 1)[0].lstrip("+~") for o in job}
            searched = OmegaConf.select(cfg, "hydra.sweeper.params")
            untyped = {k: v for k, v in (OmegaConf.to_container(searched) if searched else {}).items()
                       if k.lstrip("+~") not in typed}
            for key, value in untyped.items():
                add(f"{key}={value}")
            if untyped:
                compose_job(job)
            for i, option in other_options:
                compose_job([*job[:i], option, *job[i + 1:]])
            if cfg.get("trainer") is not None:  # before Hydra makes a run dir: a refusal leaves nothing behind
                check_machine(OmegaConf.to_container(cfg.trainer, resolve=False))
            multirun = "-m" in argv or "--multirun" in argv or str(cfg.hydra.mode) == "RunMode.MULTIRUN"
            if multirun and OmegaConf.select(cfg, "sweep.until_decided"):  # before any member runs
                check_until_decided(str(OmegaConf.select(cfg, "hydra.sweeper._target_") or ""))
            if check_run is not None and not multirun:
                from hydra.core.hydra_config import HydraConfig

                HydraConfig.instance().set_config(cfg)  # the ${hydra:...} values, as in the run
                with open_dict(cfg):
                    del cfg["hydra"]
                check_run(cfg)
        except MissingConfigException as e:
            group, _, name = (e.missing_cfg_file or "").rpartition("/")
            if not (group and e.options):
                raise
            exit_with(ConfigError(f"unknown {group} '{name}'; choose one of {', '.join(e.options)}."))
        except ConfigCompositionException as e:
            exit_with(ConfigError(_composition_message(str(e), job, compose_job)))
        except UserError as e:
            exit_with(e)


def _sweep_values(o) -> list[str]:
    """A sweep override's values as override strings (heads=1,2,4; seed=range(3)); an interval's start stands for
    the values a sweeper draws from it (lr=interval(1e-4,1e-2), tag(log, interval(...)))."""
    from hydra.core.override_parser.types import IntervalSweep
    from hydra.errors import HydraException

    try:
        return list(o.sweep_string_iterator())
    except HydraException:
        value = o.value()
        if isinstance(value, IntervalSweep):
            return [str(value.start)]
        raise


def _composition_message(hydra_message: str, job: list[str], compose_job) -> str:
    """Hydra's message for an override of a key the config lacks, as one line with the nearest key of the config
    the other overrides compose (pretrain=mlm pretrain.epoch=3: pretrain.epochs)."""
    import difflib
    import re

    from omegaconf import OmegaConf

    missing = re.match(r"Could not override '([^']+)'", hydra_message)
    if not missing:
        return " ".join(hydra_message.split())
    key = missing.group(1)
    from hydra.errors import ConfigCompositionException

    try:
        cfg = compose_job([o for o in job if o.split("=", 1)[0].lstrip("+~") != key])
    except ConfigCompositionException:  # another override fails too: name this one, without a hint
        return f"unknown key '{key}' (a new key needs a +: +{key}=...)"
    keys = [".".join(str(k) for k in path) for path in _leaf_paths(OmegaConf.to_container(cfg, resolve=False))]
    near = difflib.get_close_matches(key, keys, n=1, cutoff=0.75)
    hint = f"; did you mean {near[0]}?" if near else ""
    return f"unknown key '{key}'{hint} (a new key needs a +: +{key}=...)"


def _leaf_paths(node, prefix=()):
    """The path of every key in a nested dict, at every depth."""
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from _leaf_paths(v, (*prefix, k))
        if prefix:
            yield prefix
    else:
        yield prefix


# ------------------------------------------------------------------------------------ console scripts
# Each imports what it needs when it runs, so `import mhalab.cli` stays cheap. Hydra's key=value style for all.


def train() -> None:
    """mhalab-train (and `python train.py` in a checkout): one run, or a sweep with -m."""
    from mhalab.train.allocator import reexec_with_allocator

    try:
        reexec_with_allocator()  # first: the process starts again with mimalloc preloaded (see allocator.py)
    except ConfigError as e:
        exit_with(e)
    import hydra

    from mhalab.train import config  # registers the resolvers the configs use

    @hydra.main(version_base="1.3", config_path=str(config.CONF_DIR), config_name="train")
    @one_line_errors
    def main(cfg):
        from mhalab.train.run import run

        return run(cfg)

    sys.argv[1:] = quote_paths(sys.argv[1:])  # hydra.main reads sys.argv
    node = int(os.environ.get("NODE_RANK") or 0)
    if node > 0 and "LOCAL_RANK" not in os.environ:  # a cluster's launcher started this command on another node:
        # it shares node 0's run dir, so it logs to a file of its own and leaves node 0's .hydra/ alone (as the
        # processes Lightning starts for a node's other devices do)
        sys.argv += [f"hydra.job.name=train_node_{node}", "hydra.output_subdir=null"]
    check_overrides("train", sys.argv[1:], check_run=config.validate)
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
    check_overrides(config_name, sys.argv[1:])
    main()


def evaluate() -> None:
    """mhalab-eval (and `python scripts/eval.py`): a checkpoint's metrics on one split (conf/eval.yaml)."""
    _hydra_command("eval", "mhalab.train.commands.evaluate")


def predict() -> None:
    """mhalab-predict: one JSON line of label and class probabilities per input text (conf/predict.yaml)."""
    _hydra_command("predict", "mhalab.train.commands.predict")


def ensemble() -> None:
    """mhalab-ensemble: the averaged probabilities of several runs (a sweep's seeds), scored on one split."""
    _hydra_command("ensemble", "mhalab.train.commands.ensemble")


def baseline() -> None:
    """mhalab-baseline: TF-IDF + logistic regression on a data set's splits (conf/baseline.yaml)."""
    _hydra_command("baseline", "mhalab.analysis.baseline")
