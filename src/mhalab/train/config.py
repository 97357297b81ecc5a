"""Config resolvers and the checks that run before any data is read (torchtune-style validation)."""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from mhalab.errors import ConfigError

__all__ = ["ConfigError", "register_resolvers", "validate"]

# the Hydra configs: the package's conf/, in a checkout a link to the top-level conf/ (their only copy)
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

def source_checkout() -> Path | None:
    """The checkout this code runs from (`python train.py`, an editable install), or None once installed."""
    root = Path(__file__).resolve().parents[3]  # <root>/src/mhalab/train/config.py
    return root if (root / "pyproject.toml").is_file() and (root / "src" / "mhalab").is_dir() else None



def default_data_dir() -> str:
    """paths.data_dir unless MHALAB_DATA_DIR is set: the shared data beside a checkout, else ./data."""
    root = source_checkout()
    return str(root.parent / "shared" / "data" if root else Path.cwd() / "data")


def default_cache_dir() -> str:
    """paths.cache_dir (tokenizers, encoded splits) unless MHALAB_CACHE_DIR is set: <checkout>/.cache, or
    the user's cache dir once installed ($XDG_CACHE_HOME/mhalab, ~/.cache/mhalab), never site-packages."""
    root = source_checkout()
    if root:
        return str(root / ".cache")
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mhalab")


def _auto_precision() -> str:
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"


def _run_id() -> str:
    # time to the second plus pid and 4 random hex digits: jobs started in the same second never collide
    return f"{time.strftime('%Y-%m-%d/%H-%M-%S')}_{os.getpid()}{secrets.token_hex(2)}"


MEMBER_DIR_MAX = 120  # characters of a member dir's name (file systems allow 255 bytes; keep it readable)


def _member_dir(override_dirname: str) -> str:
    """A sweep member's dir name from its overrides (Hydra's override_dirname: sorted, `,`-joined): one path
    component, the swept values first (`heads=4,seed=0,data=trec`). Past MEMBER_DIR_MAX characters it keeps the
    swept values whole and stands for the overrides every member shares by a hash of them (`heads=4,seed=0,~3f2a91c0`):
    two sweeps that differ in those never share a member's dir."""
    swept, shared = _split_swept()
    name = ",".join(swept + shared) if swept else override_dirname  # (the same overrides, swept ones first)
    name = name.replace(os.sep, "_") or "default"
    if len(name) <= MEMBER_DIR_MAX:
        return name
    if swept and shared:
        rest = hashlib.sha1(",".join(shared).encode()).hexdigest()[:8]
        short = ",".join(swept).replace(os.sep, "_") + f",~{rest}"
        if len(short) <= MEMBER_DIR_MAX:
            return short
    return f"{name[:100]}-{hashlib.sha1(name.encode()).hexdigest()[:10]}"


def _split_swept() -> tuple[list[str], list[str]]:
    """This job's overrides as (swept, shared by every member): swept are the keys the sweep's command line sweeps
    (its multirun.yaml, written before any member starts) and the sweeper's params (the sweep= presets, Optuna's
    search space). ([], []) outside a multirun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        hc = HydraConfig.get()
        sweep_file = Path(hc.sweep.dir) / "multirun.yaml"
        task = OmegaConf.load(sweep_file).hydra.overrides.task if sweep_file.is_file() else []
    except ValueError:  # no Hydra config: not inside a Hydra job
        return [], []
    parsed = OverridesParser.create().parse_overrides([str(o) for o in task])
    keys = {o.key_or_group for o in parsed if o.is_sweep_override()} | set(hc.sweeper.get("params") or {})
    exclude = set(hc.job.config.override_dirname.exclude_keys)
    mine = sorted(o for o in hc.overrides.task if o.split("=", 1)[0].lstrip("+~") not in exclude)
    swept = [o for o in mine if o.split("=", 1)[0].lstrip("+~") in keys]
    return swept, [o for o in mine if o not in swept]


def register_resolvers() -> None:
    for name, fn in {
        "member_dir": _member_dir,
        "default_data_dir": default_data_dir,
        "default_cache_dir": default_cache_dir,
        "mul": lambda a, b: a * b,
        "auto_precision": _auto_precision,
        "run_id": _run_id,
    }.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=name == "run_id")


register_resolvers()


def _int(cfg: DictConfig, key: str, minimum: int | None = None, what: str = "") -> int:
    """cfg[key] as an int, or a ConfigError naming the key (a root shortcut by its short name)."""
    value = OmegaConf.select(cfg, key)
    name = _name(key)
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).lstrip("-").isdigit():
        raise ConfigError(f"{name}={value!r} must be an integer{what}.")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}{what}.")
    return value


def _float(cfg: DictConfig, key: str) -> float | None:
    value = OmegaConf.select(cfg, key)
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{_name(key)}={value!r} must be a number.") from None


def _name(key: str) -> str:
    """How a message names a key: a root shortcut by its short name (dropout, not model.dropout)."""
    leaf = key.split(".")[-1]
    return leaf if leaf in _SHORTCUTS and key.split(".")[0] in ("model", "data", "optim", "trainer") else key


def _choice(value, choices, key: str) -> None:
    if value not in choices:
        raise ConfigError(f"unknown {key} '{value}'; choose one of {', '.join(map(str, choices))}.")


# the root shortcuts (conf/train.yaml, and max_len / batch_size from conf/data): messages use their names
_SHORTCUTS = ("dim", "heads", "layers", "ff_dim", "ff_ratio", "dropout", "lr", "batch_size", "max_epochs",
              "max_len", "seed")


def validate(cfg: DictConfig) -> None:
    """Cheap checks of the composed config, before any data is read. Each message names the value and the
    fix. The rules are the modules' own (their constants and check functions), so there is one of each. The
    model's come first: their modules need torch only, so the commonest mistakes are told before Lightning loads."""
    from mhalab.model import check_attention, check_model
    from mhalab.nn.attention import QUERY_BLOCK, check_blocking, check_heads
    from mhalab.nn.encoder import ACTIVATIONS

    m = cfg.model
    dim, heads = _int(cfg, "model.dim", 1), _int(cfg, "model.heads", 1)
    head_dim = None if m.get("head_dim") is None else _int(cfg, "model.head_dim", 1, " (or null: dim / heads)")
    _ok(check_heads, dim, heads, ("dim", "heads"), head_dim)
    _int(cfg, "model.layers", 1)
    _int(cfg, "model.ff_dim", 1)
    max_len = _int(cfg, "data.max_len")  # its minimum is the datamodule's rule ([CLS], [SEP], one token)
    model_max_len = _int(cfg, "model.max_len")
    if model_max_len < max_len:
        raise ConfigError(f"model.max_len={model_max_len} is below data.max_len={max_len}: the position encoding "
                          f"would end before the longest batch; set both with max_len=N.")
    _int(cfg, "data.batch_size", 1)
    for key in ("model.dropout", "model.embed_dropout"):
        p = _float(cfg, key)
        if p is not None and not 0.0 <= p < 1.0:
            raise ConfigError(f"{_name(key)}={OmegaConf.select(cfg, key)} must be in [0, 1), e.g. 0.1.")
    _choice(m.activation, tuple(ACTIVATIONS), "model.activation")
    _ok(check_model, m.encoder, m.pooling, m.attention, m.pos, head_dim, m.get("dropout_draw", "torch"))
    options = OmegaConf.to_container(m.get("attention_options") or {}, resolve=True)
    _ok(check_attention, m.attention, m.pos, options, model_max_len + (m.pooling == "cls"))
    _ok(check_blocking, m.get("block_min_scores"), m.get("query_block", QUERY_BLOCK), "model.")  # CPU query blocks

    from mhalab.train.optimizer import check_decay, check_label_smoothing  # (torch only, as the model's)

    _check_optimizer(cfg, "optim")
    _ok(check_label_smoothing, _float(cfg, "optim.label_smoothing") or 0.0)
    if OmegaConf.select(cfg, "callbacks.ema") is not None:  # callbacks=ema
        _ok(check_decay, _float(cfg, "callbacks.ema.decay"))

    t = cfg.trainer  # (what it asks of the machine: check_machine, before Hydra runs, in mhalab.cli)
    _check_nodes(_int(cfg, "trainer.num_nodes", 1) if t.get("num_nodes") is not None else 1)
    max_steps = _int(cfg, "trainer.max_steps", -1) if t.get("max_steps") is not None else -1
    if max_steps <= 0 and not t.get("fast_dev_run"):
        epochs = _int(cfg, "trainer.max_epochs")
        if epochs == 0:
            raise ConfigError("max_epochs=0 trains nothing; set max_epochs >= 1 (debug=fast runs one batch of each split).")
        if epochs < 0:
            raise ConfigError(f"max_epochs={epochs} would train forever and the lr schedule needs a length; set "
                              f"max_epochs >= 1, or trainer.max_steps=N.")
    _int(cfg, "seed", 0)
    from mhalab.train.common_random import INIT_DRAWS

    _choice(cfg.get("init_draw", "torch"), INIT_DRAWS, "init_draw")
    if OmegaConf.select(cfg, "sweep.until_decided"):
        from hydra.core.hydra_config import HydraConfig

        check_until_decided(str(HydraConfig.get().sweeper.get("_target_", "")) if HydraConfig.initialized() else "")
    _check_pretraining(cfg)
    from mhalab.train.loggers import check_installed

    check_installed(OmegaConf.to_container(cfg.get("logger") or {}, resolve=False))
    if OmegaConf.select(cfg, "extras.enforce_tags") and not cfg.get("tags"):
        raise ConfigError("extras.enforce_tags=true but the run has no tags; pass tags=[baseline,heads] (any "
                          "names that let you find the run later), or extras.enforce_tags=false.")
    if cfg.get("ckpt_path"):
        from mhalab.train import checkpoint

        path = checkpoint.resolve(str(cfg.ckpt_path))
        checkpoint.check_fits(path, OmegaConf.to_container(m, resolve=True),
                              OmegaConf.to_container(cfg.data, resolve=True))
    instantiate(cfg.data).check_paths()  # the datamodule's arguments, then its files: nothing is read yet


def setup_process(cfg: DictConfig) -> None:
    """What a run's process needs before its parts are built: the config's checks (validate), then its CPU threads
    (num_threads; 1 when sweep members run side by side)."""
    validate(cfg)
    if cfg.get("num_threads"):
        torch.set_num_threads(int(cfg.num_threads))


def datamodule(cfg: DictConfig):
    """The data group's datamodule, set up for fitting: its tokenizer trained (or read from the cache) and its splits
    encoded."""
    dm = instantiate(cfg.data)  # the datamodule checks its arguments here, before reading anything
    dm.prepare_data()  # a tokenizer trained and the splits encoded on every core (IMDB's: 2x faster on 2 cores)
    dm.setup("fit")
    # then one thread: a DataLoader worker forked after tokenizers' threads ran would warn and turn them off. A
    # user's own setting stays.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return dm


def check_machine(trainer: DictConfig | dict) -> None:
    """What a trainer config asks of this machine, before anything is read or written: a GPU accelerator needs a
    CUDA GPU (trainer=gpu, trainer=ddp and experiment=article choose one), and its `devices` no more GPUs than
    there are. Lightning's own refusal comes after the data is read, as a long traceback."""
    accelerator = str(trainer.get("accelerator", "auto"))
    if accelerator not in ("gpu", "cuda"):
        return
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    multi = str(trainer.get("strategy", "auto")).startswith("ddp")
    instead = "trainer=ddp_cpu (processes on the CPU)" if multi else "trainer=cpu"
    if have == 0:
        raise ConfigError(f"trainer.accelerator={accelerator} needs a CUDA GPU and this machine has none; use "
                          f"{instead}, or run where torch.cuda.is_available().")
    devices = trainer.get("devices", 1)
    wanted = devices if isinstance(devices, int) else len(devices) if isinstance(devices, list | tuple) else None
    if isinstance(devices, str) and devices.lstrip("-").isdigit():
        wanted = int(devices)
    if wanted is not None and wanted > have:
        raise ConfigError(f"trainer.devices={devices} asks for {wanted} GPUs and this machine has {have}; set "
                          f"trainer.devices={have} (or -1: all of them).")


def _check_nodes(nodes: int) -> None:
    """Several nodes run one command each (a cluster's launcher starts them), and every node must write into the
    same run dir: a run of its own needs hydra.run.dir given (the default names a new dir per process)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if nodes <= 1 or not HydraConfig.initialized() or HydraConfig.get().mode == RunMode.MULTIRUN:
        return  # a sweep's member dir is named by the launcher, the same for every task of a job
    if not any(o.split("=", 1)[0].lstrip("+") == "hydra.run.dir" for o in HydraConfig.get().overrides.hydra):
        raise ConfigError(f"trainer.num_nodes={nodes}: every node runs this command and all of them write into one "
                          f"run dir; pass the same hydra.run.dir=<a dir every node sees> on each node.")


def check_until_decided(sweeper: str) -> None:
    """sweep.until_decided is read by the until_decided sweeper only (`sweeper`: hydra.sweeper._target_): elsewhere
    it would be silently ignored."""
    if not sweeper.endswith(".UntilDecidedSweeper"):
        raise ConfigError("sweep.until_decided=true is read by the until_decided sweeper, which this run does not "
                          "use: run a sweep preset with -m (sweep=dropout ...), or add -m hydra/sweeper=until_decided.")


def _check_pretraining(cfg: DictConfig) -> None:
    """pretrain=mlm's settings, and init_from's path (the encoder's shape and tokenizer are checked once the data
    is ready: mhalab.train.pretrain.check_encoder_fits)."""
    from mhalab.train.pretrain import OBJECTIVES

    p = cfg.get("pretrain")
    if p and cfg.get("init_from"):
        raise ConfigError(f"pretrain={p.get('objective')} and init_from={cfg.init_from} both give the encoder's "
                          f"weights; pass one (init_from=null to pretrain, or drop pretrain=...).")
    if cfg.get("init_from"):
        from mhalab.train.pretrain import resolve_init

        resolve_init(cfg.init_from)
    if not p:
        return
    _choice(p.get("objective"), OBJECTIVES, "pretrain.objective")
    _int(cfg, "pretrain.epochs", 1)
    _int(cfg, "pretrain.seed", 0)
    mask = _float(cfg, "pretrain.mask_prob")
    if mask is None or not 0.0 < mask < 1.0:
        raise ConfigError(f"pretrain.mask_prob={p.get('mask_prob')} must be in (0, 1), e.g. 0.15.")
    _check_optimizer(cfg, "pretrain")


def _check_optimizer(cfg: DictConfig, group: str) -> None:
    """<group>.lr, .schedule and .warmup_ratio: what mhalab.train.optimizer.adamw_with_schedule reads (optim, pretrain)."""
    from mhalab.train.optimizer import SCHEDULES

    lr = _float(cfg, f"{group}.lr")
    if lr is None or lr <= 0:
        raise ConfigError(f"{_name(f'{group}.lr')}={OmegaConf.select(cfg, f'{group}.lr')} must be > 0, e.g. 1e-3.")
    _choice(OmegaConf.select(cfg, f"{group}.schedule"), SCHEDULES, f"{group}.schedule")
    warmup = _float(cfg, f"{group}.warmup_ratio")
    if warmup is None or not 0.0 <= warmup < 1.0:
        raise ConfigError(f"{group}.warmup_ratio={warmup} must be in [0, 1).")


def instantiate(cfg, **kwargs):
    """hydra.utils.instantiate, except that a user error raised by the constructor (the datamodule checks its
    arguments there) comes out as itself, not wrapped in Hydra's InstantiationException."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate as hydra_instantiate

    from mhalab.errors import UserError

    try:
        return hydra_instantiate(cfg, **kwargs)
    except InstantiationException as e:
        if isinstance(e.__cause__, UserError):
            raise e.__cause__ from None
        raise


def _ok(check, *args) -> None:
    """Run a module's own check (it raises ValueError, for library users) as a config check."""
    try:
        check(*args)
    except ValueError as e:
        raise ConfigError(str(e)) from None
